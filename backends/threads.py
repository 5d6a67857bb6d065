"""Per-thread torch intra-op thread counts.

`torch.set_num_threads` sets the calling thread's OpenMP/MKL thread count, and also the count
every thread that starts later begins with. Work made of many small ops (a batcher's forward
worker, per-sequence decode attention) runs faster on one thread per caller than on an OpenMP
team that meets at a barrier after every tiny op; the helpers here set a thread's own count
without changing the count other threads start with.

Only compute threads should own OpenMP teams. Every thread that runs a torch op on more than
one thread gets a team of worker threads of its own, kept for as long as the thread lives
(the main thread's forever), and once a process holds more OpenMP threads than it has cores,
GNU OpenMP stops spinning between parallel regions and puts its workers to sleep at once: each
region then pays a futex wake-up: a native few-row linear layer costs two to three times as
much once the main thread has a team too (the LLM engine's
thread, next to an event loop that had run torch ops while loading). So `hub serve` starts
every thread at one torch thread (`only_compute_threads`), and the compute threads run on
`compute_threads()`: an LLM engine's step thread starts with that count
(`start_thread_with`); an encoder's forward workers set theirs first thing
(`set_this_thread`, before any op, which has not shown the run-to-run differences that a
step thread raising its own count mid-life gave). Elsewhere (tests, an app embedded in
another process) nothing changes: compute threads start with the count every thread starts
with.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator

import torch

_guard = threading.Lock()
# Threads a compute thread runs torch on, once a process's entry point chose
# (`only_compute_threads`); None: the count threads start with.
_compute: int | None = None


def set_this_thread(n: int) -> None:
    """Run the calling thread's torch ops on `n` threads; other threads keep their count, and
    threads started later begin with the count they would have had."""
    with _guard:
        # torch sets a thread's count from the start-up one at the thread's first query: make
        # that happen now, or it would undo the count set below.
        if torch.get_num_threads() == n:
            return  # setting it anyway would also change MKL's threading mode
        default = start_up_count()
        torch.set_num_threads(n)  # this thread's count, and the start-up count too
        if n != default:
            _set_start_up_count(default)


def start_thread_with(n: int | None, thread: threading.Thread, counted: threading.Event) -> None:
    """Start `thread` so that its torch ops run on `n` threads from its first op on (None:
    the count threads start with), without it ever setting a count itself. torch gives a
    thread the start-up count at its first query or op, so the start-up count is `n` (set
    from helper threads) until `thread` has made one and set `counted` (meanwhile a thread
    that makes its first torch query elsewhere starts with `n` too). (Setting the count
    from inside a thread that began with another one gave run-to-run differences in int8
    greedy output.)"""
    if n is None:
        thread.start()
        return
    with _guard:
        default = start_up_count()
        if n == default:
            thread.start()
            return
        _set_start_up_count(n)
        try:
            thread.start()
            # Until it has counted, or died trying (then nothing waits on it forever).
            while not counted.wait(0.1) and thread.is_alive():
                pass
        finally:
            _set_start_up_count(default)


def _set_start_up_count(n: int) -> None:
    """Make `n` the count threads start with, leaving the calling thread's (a fresh thread
    sets it)."""
    helper = threading.Thread(target=torch.set_num_threads, args=(n,))
    helper.start()
    helper.join()


def start_up_count() -> int:
    """The torch thread count a thread started now begins with."""
    seen: list[int] = []
    probe = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    probe.start()
    probe.join()
    return seen[0]


def cores() -> int:
    """The cores this process may run on (its CPU affinity), whatever torch's thread count
    is in the calling thread."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API on this platform
        return max(1, os.cpu_count() or 1)


def only_compute_threads(threads: int | None = None) -> None:
    """Make one torch thread the count every thread starts with, from the calling thread on,
    and `threads` (default: torch's own count, within the process's CPUs) what compute
    threads run on: threads that do not ask for more (an event loop, loaders, executor
    threads) never start OpenMP teams. For a process's entry point (`hub serve`), before it
    loads anything."""
    global _compute
    # torch's own default (physical cores, OMP_NUM_THREADS), within the process's CPUs.
    _compute = threads or min(torch.get_num_threads(), cores())
    torch.set_num_threads(1)


def compute_threads() -> int | None:
    """What a compute thread runs torch on (`only_compute_threads`), or None where the
    process did not choose: then compute threads keep the count they start with."""
    return _compute


def intraop_threads(n: int) -> Callable[[], None]:
    """A thread's start hook: run this thread's torch ops on `n` threads."""
    return lambda: set_this_thread(n)


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run the calling thread's torch ops on one thread inside the block. Cheap (a few
    hundred nanoseconds each way) so it can wrap work inside a model's forward pass; a thread
    started by another thread while inside the block begins with one thread. Where the
    process chose compute threads (`only_compute_threads`), the count threads start with is
    one again afterwards (set from a helper thread, some 0.1 ms: restoring this thread's
    count also sets the start-up count)."""
    previous = torch.get_num_threads()
    if previous == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
        if _compute is not None:
            _set_start_up_count(1)
