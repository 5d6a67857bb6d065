"""multiprocessing's fork server, for the encoders' forward workers
(backends/encoders/forward_process.py).

The server imports torch and sentence-transformers once per hub (seconds, at the first load
that wants workers); a worker forked from it starts in milliseconds. Unlike multiprocessing's own
fork-server processes, a worker does not import the parent's `__main__` (`WorkerProcess`).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import threading
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from multiprocessing.context import ForkServerProcess, set_spawning_popen
from typing import Any

# Imported once by the fork server, so a worker forked from it starts at once.
_PRELOAD = [
    "torch",
    "sentence_transformers",
    "backends.encoders.embedder",
    "backends.encoders.reranker",
]
_context_guard = threading.Lock()
_context: Any = None


def fork_server() -> Any:
    """multiprocessing's fork-server context, with torch's tensor sharing registered and the
    heavy imports preloaded in the server."""
    global _context
    with _context_guard:
        if _context is None:
            import torch.multiprocessing  # noqa: F401  # registers shared-memory tensor pickling

            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(_PRELOAD)
            _context = context
        return _context


class _Popen(popen_forkserver.Popen):
    """A fork-server child that does not import the parent's `__main__`: multiprocessing
    runs the main script again in every child so that its functions can be targets, which
    costs a worker the script's imports and fails outright for a script without a
    `__name__ == "__main__"` guard. A worker's target lives in a module of its own. (The launch of
    `multiprocessing.popen_forkserver` with the preparation data built here, so that other
    threads starting processes meanwhile see multiprocessing unchanged.)"""

    def _launch(self, process_obj: Any) -> None:
        data = spawn.get_preparation_data(process_obj._name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        payload = io.BytesIO()
        set_spawning_popen(self)  # file descriptors in the pickles go with the request
        try:
            reduction.dump(data, payload)
            reduction.dump(process_obj, payload)
        finally:
            set_spawning_popen(None)
        fds: list[int] = self._fds  # type: ignore[attr-defined]
        self.sentinel, data_w = forkserver.connect_to_new_process(fds)
        # The child watches a duplicate of the data pipe's write end for its parent's death.
        kept = os.dup(data_w)
        self.finalizer = util.Finalize(self, util.close_fds, (kept, self.sentinel))  # type: ignore[attr-defined]
        with open(data_w, "wb", closefd=True) as pipe:
            pipe.write(payload.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class WorkerProcess(ForkServerProcess):
    """A process forked from the fork server that does not import the parent's `__main__`."""

    @staticmethod
    def _Popen(process_obj: Any) -> _Popen:  # multiprocessing's name
        return _Popen(process_obj)
