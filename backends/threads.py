"""Per-thread torch intra-op thread counts.

`torch.set_num_threads` sets the calling thread's OpenMP/MKL thread count, and also the count
every thread that starts later begins with. Work made of many small ops (a batcher's forward
worker, per-sequence decode attention) runs faster on one thread per caller than on an OpenMP
team that meets at a barrier after every tiny op; the helpers here set a thread's own count
without changing the count other threads start with.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

_guard = threading.Lock()


def set_this_thread(n: int) -> None:
    """Run the calling thread's torch ops on `n` threads; other threads keep their count, and
    threads started later begin with the count they would have had."""
    with _guard:
        default = torch.get_num_threads()
        torch.set_num_threads(n)
        if n != default:
            # A fresh thread setting the default back restores the start-up count.
            helper = threading.Thread(target=torch.set_num_threads, args=(default,))
            helper.start()
            helper.join()


def intraop_threads(n: int) -> Callable[[], None]:
    """A thread's start hook: run this thread's torch ops on `n` threads."""
    return lambda: set_this_thread(n)


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run the calling thread's torch ops on one thread inside the block. Cheap (a few
    hundred nanoseconds each way) so it can wrap work inside a model's forward pass; a thread
    started by another thread while inside the block begins with one thread."""
    previous = torch.get_num_threads()
    if previous == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
