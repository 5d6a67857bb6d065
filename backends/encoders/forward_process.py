"""An encoder's forward passes in worker processes, off the hub's interpreter lock.

A sentence-transformers forward pass is hundreds of small torch ops, and the Python between
them needs the interpreter lock. In the hub's process that lock is also what the event loop
runs on, so under a burst of HTTP requests every op of a pass waits for the loop and a
pass takes many times its own length; in another process it does not. So on a CPU the
forward passes run in worker processes (runtime config `forward_process`):

- The weights are shared, not copied: the stages are packed once per pool
  (`backends.encoders.stage_packing`: the weights in one block of shared memory, the rest pickled
  against it) and each worker maps the same pages, so the model is counted and held once,
  and the hub keeps the module for accounting, parking and unload.
- Workers fork from the fork server (`backends.encoders.fork_server`); one worker per forward thread
  of the batcher, each on `threads` torch threads at niceness `nice`. A pass takes an idle
  worker, sends it the batch's token ids through a pipe, and blocks without the lock until
  the rows come back.
- A worker found dead (its process gone, or its pipe at end of file) is replaced before its
  next pass; a pass it was running fails with a `TransientError` (503 with `Retry-After`), as
  does one that has not come back within `PASS_TIMEOUT_S` (the worker is killed). A pass's own
  exception comes back as itself. Workers ignore SIGINT and SIGTERM and exit when the pool
  closes (offload, unload) or the hub's process goes away (their pipe reaches end of file).

Where shared memory cannot be had (a container whose /dev/shm is too small for the weights),
`start` raises `ForwardProcessError` and the backend decides: an explicit `forward_process:
true` fails the load, the default runs the passes in-process with a warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from backends.encoders.fork_server import WorkerProcess, fork_server
from backends.encoders.stage_packing import PackedStages, pack_stages
from backends.errors import BackendClosedError, TransientError

log = logging.getLogger(__name__)

I = TypeVar("I")  # noqa: E741  # one input
R = TypeVar("R")  # the result for one input

# Seconds to wait for a new worker to take the model.
_START_TIMEOUT_S = 120.0
# A pass that has not come back after this long is taken for a hung worker: it is killed,
# the pass fails with TransientError and the worker is replaced (the longest batch a CPU
# encoder runs takes seconds).
PASS_TIMEOUT_S = 600.0
# Whether a CPU encoder whose runtime config leaves `forward_process` unset uses workers.
_by_default = False


def use_by_default(on: bool = True) -> None:
    """Make worker processes the default for CPU encoders in this process: for a process's
    entry point (`hub serve`). Elsewhere (tests, an app embedded in another process) a model
    uses them only when its runtime config says `forward_process: true`, so that a process
    that did not choose does not pay for the fork server."""
    global _by_default
    _by_default = on


def by_default() -> bool:
    """Whether `use_by_default` was called (and not undone)."""
    return _by_default


class ForwardProcessError(RuntimeError):
    """The workers could not start."""


@dataclass(frozen=True)
class WorkerShape:
    """How many workers, the torch threads of each, and their niceness (0-19)."""

    workers: int
    threads: int
    nice: int = 0


def _serve(conn: Connection, shape: WorkerShape, packed: PackedStages) -> None:
    """A worker's body: unpack the stages, say it is up, then answer ("ok", rows) or
    ("error", exception) for every batch until the pipe closes or says stop (None)."""
    if shape.nice:
        os.nice(shape.nice)  # first: every thread started later (torch's) inherits it
    # The hub stops its workers through the pipe; a Ctrl-C or a SIGTERM sent to the whole
    # process group must not end them under passes the hub is still draining.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(shape.threads)
    stages = packed.unpack()
    from backends.encoders import unpadded

    unpadded.register()  # the packed path's attention, named in the model's config
    conn.send(("ok", None))
    while True:
        try:
            items = conn.recv()
        except EOFError:
            return  # the hub went away
        if items is None:
            return
        try:
            reply: tuple[str, Any] = ("ok", stages.forward(items))
        except Exception as e:  # the pass's error goes back to its caller
            reply = ("error", _sendable(e))
        conn.send(reply)


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: whether it exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in ("Z", "X")


def _sendable(error: Exception) -> Exception:
    """`error` with the worker's traceback as a note, or a RuntimeError saying what it was
    when it would not come back through pickle (an exception class whose constructor takes
    other arguments than it keeps)."""
    trace = "".join(traceback.format_exception(error))[-4000:]
    try:
        error.add_note(f"in the forward worker:\n{trace}")
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}\nin the forward worker:\n{trace}")


class _Worker:
    """One worker process and the parent's end of its pipe; one thread uses it at a time."""

    def __init__(self, stages: PackedStages, shape: WorkerShape, name: str) -> None:
        """Start the process; `ready` waits for it to have unpacked the stages."""
        context = fork_server()
        self._conn, child = context.Pipe()
        self.name = name
        # The stages go with the start: the block's shared-memory handle travels in the fork
        # server's message, not over a connection back to this process.
        args = (child, shape, stages)
        self.process = WorkerProcess(target=_serve, args=args, name=name, daemon=True)
        try:
            self.process.start()
        except Exception as e:  # the stages do not pickle
            self._conn.close()
            raise ForwardProcessError(f"{name} could not start: {e}") from e
        finally:
            child.close()  # the worker's death then reads as end of file here

    def ready(self) -> _Worker:
        """Wait until the worker has its model (ForwardProcessError if it never does)."""
        try:
            if not self._conn.poll(_START_TIMEOUT_S):
                raise ForwardProcessError(f"took no model within {_START_TIMEOUT_S:.0f}s")
            self._conn.recv()
        except Exception as e:  # the pipe broke, it died
            self.stop()
            raise ForwardProcessError(f"{self.name} could not start: {e}") from e
        return self

    def call(self, items: Sequence[Any]) -> list[Any]:
        try:
            self._conn.send(items)
            if not self._conn.poll(PASS_TIMEOUT_S):
                self.kill()
                raise TransientError(
                    f"the forward worker {self.name} took longer than {PASS_TIMEOUT_S:g}s "
                    "over this pass and was stopped; it is being replaced, send the request "
                    "again"
                )
            status, value = self._conn.recv()
        except (OSError, EOFError) as e:
            raise TransientError(
                f"the forward worker {self.name} ended during this pass; it is being "
                "replaced, send the request again"
            ) from e
        if status == "error":
            raise value
        return list(value)

    @property
    def alive(self) -> bool:
        """Whether an idle worker can take a pass: its process runs (read from /proc, not
        from the fork server, which may itself be gone) and its pipe is not at end of file
        (an idle worker sends nothing)."""
        pid = self.process.pid
        if pid is None or not _running(pid):
            return False
        try:
            return not self._conn.poll(0)
        except (OSError, ValueError):
            return False

    def kill(self) -> None:
        """End the process at once, without touching the pipe (another thread may be in a
        pass on it: that pass then fails)."""
        if self.process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGKILL)

    def stop(self) -> None:
        """Ask it to exit, wait a little, kill it if it has not; close the pipe."""
        with contextlib.suppress(OSError, ValueError):
            self._conn.send(None)
        self.process.join(timeout=5)
        if self.alive:
            self.kill()
            self.process.join(timeout=5)
        self._conn.close()


class ForwardPool(Generic[I, R]):
    """`shape.workers` worker processes running `stages.forward` on shared weights; `forward` is
    called from the batcher's forward threads, at most that many at a time. A worker found
    dead is replaced; when a replacement cannot start, `forward` raises ForwardProcessError
    from then on (`PooledStages` then runs the passes in the hub's process)."""

    def __init__(self, stages: Any, shape: WorkerShape, name: str) -> None:
        self._shape = shape
        self._name = name
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._all: list[_Worker] = []
        self._closed = False
        self._broken: str | None = None
        try:
            self._packed = pack_stages(stages)
        except (RuntimeError, ValueError) as e:  # /dev/shm too small or absent, not the CPU
            raise ForwardProcessError(f"cannot share {name}'s weights with workers: {e}") from e
        except Exception as e:  # something in the stages does not pickle
            raise ForwardProcessError(f"cannot send {name}'s stages to workers: {e}") from e
        try:
            # Started together, so that they unpack the stages side by side.
            for i in range(shape.workers):
                self._all.append(_Worker(self._packed, shape, f"{name} worker {i}"))
            self._idle = [worker.ready() for worker in self._all]
        except ForwardProcessError:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (for tests and the admin view)."""
        with self._cond:
            return [w.process.pid for w in self._all if w.process.pid is not None]

    def forward(self, items: Sequence[I]) -> list[R]:
        worker = self._take()
        if not worker.alive:  # died while idle: replaced, and no pass need fail
            self._give_back(worker)
            worker = self._take()
        try:
            return worker.call(items)
        finally:
            self._give_back(worker)

    def _take(self) -> _Worker:
        with self._cond:
            while not self._idle and not self._closed and self._broken is None:
                self._cond.wait()
            if self._broken is not None:
                raise ForwardProcessError(self._broken)
            if self._closed:
                raise BackendClosedError(f"{self._name}'s forward workers were stopped")
            worker = self._idle.pop()
            self._busy.add(worker)
            return worker

    def _give_back(self, worker: _Worker) -> None:
        """Back to the idle ones; a dead worker is replaced by a new one first; after
        `close`, stopped."""
        with self._cond:
            self._busy.discard(worker)
            if not self._closed and worker.alive:
                self._idle.append(worker)
                self._cond.notify()
                return
            closed = self._closed
        worker.stop()
        if closed:
            return
        log.warning("%s exited; starting another", worker.name)
        try:
            replacement = _Worker(self._packed, self._shape, worker.name).ready()
        except ForwardProcessError as e:
            with self._cond:
                self._broken = f"{worker.name} exited and another could not start: {e}"
                self._cond.notify_all()
            return
        with self._cond:
            if not self._closed:
                self._all[self._all.index(worker)] = replacement
                self._idle.append(replacement)
                self._cond.notify()
                return
        replacement.stop()

    def close(self) -> None:
        """Stop every worker; idempotent. Idle ones are asked to exit; one still in a pass
        (abandoned: the manager unloads only idle models) is killed, its pass fails, and it
        is stopped when that thread gives it back."""
        with self._cond:
            self._closed = True
            idle, self._idle, self._all = self._idle, [], []
            busy = list(self._busy)
            self._cond.notify_all()
        for worker in idle:
            worker.stop()
        for worker in busy:
            worker.kill()


class PooledStages(Generic[I, R]):
    """An encoder's stages (`tokenize`, `forward`) whose `forward` runs in a `ForwardPool`
    while one is started, and in the calling thread otherwise."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.pool: ForwardPool[I, R] | None = None

    def tokenize(self, payloads: Sequence[Any]) -> list[list[I] | BaseException]:
        return self.inner.tokenize(payloads)

    def forward(self, items: Sequence[I]) -> list[R]:
        pool = self.pool
        if pool is not None:
            try:
                return pool.forward(items)
            except ForwardProcessError as e:
                log.error("%s; the passes run in the hub's process from now on", e)
                self.stop()
        return list(self.inner.forward(items))

    def start(self, shape: WorkerShape, name: str) -> None:
        """Run passes in new worker processes."""
        self.stop()
        self.pool = ForwardPool(self.inner, shape, name)

    def stop(self) -> None:
        """Run passes in the calling thread again; the workers exit. Idempotent."""
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()
