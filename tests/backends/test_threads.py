"""Per-thread torch thread counts: one thread's setting never leaks into another's."""

from __future__ import annotations

import threading

import torch

from backends.threads import cores, set_this_thread, single_threaded, start_up_count


def test_set_this_thread_leaves_other_threads_alone() -> None:
    start = torch.get_num_threads()
    seen: list[int] = []

    def worker() -> None:
        set_this_thread(start + 1)
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [start + 1]
    assert torch.get_num_threads() == start
    assert start_up_count() == start


def test_single_threaded_restores_the_count() -> None:
    start = torch.get_num_threads()
    set_this_thread(2)
    try:
        with single_threaded():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        set_this_thread(start)
    assert start_up_count() == start


def test_cores_is_the_process_affinity_not_torchs_count() -> None:
    import os

    start = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert cores() == len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(start)
