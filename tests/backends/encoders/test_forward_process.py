"""Encoder forward passes in worker processes (backends/encoders/forward_process.py): the same
answers as in-process passes, weights shared rather than copied, a killed worker replaced, and
the workers gone after offload and unload."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from prometheus_client import CollectorRegistry

from backends.base import BackendContext
from backends.encoders import forward_process, stage_packing
from backends.encoders.embedder import EmbedderBackend
from backends.encoders.reranker import RerankerBackend
from backends.errors import LoadError, TransientError
from tests.backends.encoders.test_embedder import sentences


def embedder(folder: Path, **config: object) -> EmbedderBackend:
    registry = CollectorRegistry()
    backend = EmbedderBackend(BackendContext("emb", "1", config, metrics_registry=registry))
    backend.load(folder, "cpu")
    return backend


def gone(pids: list[int], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
            return True
        time.sleep(0.05)
    return False


async def test_passes_run_in_workers_and_equal_in_process_ones(tiny_embedder_dir: Path) -> None:
    texts = sentences(24, seed=5, longest=50)
    here = embedder(tiny_embedder_dir, forward_process=False, max_batch_size=8)
    pooled = embedder(tiny_embedder_dir, forward_process=True, forward_workers=2, max_batch_size=8)
    try:
        assert here.worker_pids() == []
        pids = pooled.worker_pids()
        assert len(pids) == 2 and os.getpid() not in pids
        # They yield the cores to the hub's own threads (forward_process_nice, default 10).
        assert {psutil.Process(p).nice() for p in pids} == {min(19, os.nice(0) + 10)}
        want = await asyncio.gather(*(here.embed([t]) for t in texts))
        got = await asyncio.gather(*(pooled.embed([t]) for t in texts))
        # The same module and the same single-threaded kernels: the same bits.
        for a, b in zip(want, got, strict=True):
            np.testing.assert_array_equal(a.vectors, b.vectors)
            assert a.token_counts == b.token_counts
        # The weights are shared with the workers, not copied: one block of shared memory,
        # counted once here (plus each tensor's alignment to 256 bytes in the block).
        tensors = [*pooled.model.parameters(), *pooled.model.buffers()]
        assert all(t.is_shared() for t in tensors)
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
        extra = pooled.memory_bytes() - here.memory_bytes()
        assert 0 <= extra < 256 * len(tensors)
    finally:
        here.unload()
        pooled.unload()
    assert gone(pids), "the workers outlived the unload"


async def test_a_killed_worker_is_replaced_and_no_request_is_lost(tiny_embedder_dir: Path) -> None:
    backend = embedder(tiny_embedder_dir, forward_process=True, forward_workers=1)
    try:
        (pid,) = backend.worker_pids()
        before = (await backend.embed(["the harbour at dawn"])).vectors
        os.kill(pid, signal.SIGKILL)
        assert gone([pid])
        # Killed while idle: the next pass finds it dead, starts another, and runs there.
        after = (await backend.embed(["the harbour at dawn"])).vectors
        np.testing.assert_array_equal(before, after)
        (replacement,) = backend.worker_pids()
        assert replacement != pid
    finally:
        backend.unload()


async def test_a_worker_dying_mid_pass_fails_that_pass_with_a_retryable_error(
    tiny_embedder_dir: Path,
) -> None:
    backend = embedder(tiny_embedder_dir, forward_process=True, forward_workers=1)
    try:
        (pid,) = backend.worker_pids()
        os.kill(pid, signal.SIGSTOP)  # alive, and takes the next batch without answering it
        pool = backend._pooled.pool  # type: ignore[union-attr]
        (worker,) = pool._all  # type: ignore[union-attr]
        sent = threading.Event()
        send = worker._conn.send

        def send_and_tell(obj: object) -> None:  # the batch is in the worker's pipe
            send(obj)
            sent.set()

        worker._conn.send = send_and_tell
        pending = asyncio.ensure_future(backend.embed(["lost with its worker"]))
        assert await asyncio.to_thread(sent.wait, 30)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(TransientError, match="ended during this pass"):
            await pending
        # The next pass runs on a new worker.
        assert (await backend.embed(["sent again"])).vectors.shape == (1, 32)
        assert backend.worker_pids() != [pid]
    finally:
        backend.unload()


async def test_offload_stops_the_workers_and_restore_starts_new_ones(
    tiny_reranker_dir: Path,
) -> None:
    backend = RerankerBackend(BackendContext("rr", "1", {"forward_process": True}))
    backend.load(tiny_reranker_dir, "cpu")
    docs = ["fog over the harbour", "gulls on the pier", "a ferry timetable"]
    try:
        first = backend.worker_pids()
        want = (await backend.rerank("when does the ferry leave", docs)).scores
        backend.offload()
        assert backend.worker_pids() == [] and gone(first)
        backend.restore("cpu")
        assert backend.worker_pids() and not set(backend.worker_pids()) & set(first)
        got = (await backend.rerank("when does the ferry leave", docs)).scores
        assert got == want
    finally:
        backend.unload()


def test_workers_are_the_default_only_where_the_process_chose_them(
    tiny_embedder_dir: Path,
) -> None:
    plain = embedder(tiny_embedder_dir)
    try:
        assert plain.worker_pids() == []  # a test, an embedded app: passes run here
    finally:
        plain.unload()
    forward_process.use_by_default()  # what `hub serve` does
    try:
        chosen = embedder(tiny_embedder_dir, forward_process_nice=0, forward_workers=2)
        declined = embedder(tiny_embedder_dir, forward_process=False)
        try:
            assert len(chosen.worker_pids()) == 2 and declined.worker_pids() == []
            assert {psutil.Process(p).nice() for p in chosen.worker_pids()} == {os.nice(0)}
        finally:
            chosen.unload()
            declined.unload()
    finally:
        forward_process.use_by_default(False)


async def test_a_model_of_more_tensors_than_a_fork_message_carries_still_gets_workers(
    tmp_path: Path,
) -> None:
    from backends.tiny import build_tiny_embedder

    # 24 layers: some 400 tensors, past the 252 file handles multiprocessing sends with a
    # new process; the block is one.
    folder = build_tiny_embedder(tmp_path / "deep", num_layers=24)
    here = embedder(folder, forward_process=False)
    pooled = embedder(folder, forward_process=True, forward_workers=1)
    try:
        assert len([*pooled.model.parameters()]) > 252
        assert len(pooled.worker_pids()) == 1
        texts = sentences(6, seed=2)
        want = (await here.embed(texts)).vectors
        np.testing.assert_array_equal((await pooled.embed(texts)).vectors, want)
    finally:
        here.unload()
        pooled.unload()


def test_where_weights_cannot_be_shared_the_passes_stay_here_or_the_load_fails(
    tiny_embedder_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_room(module: object) -> None:  # what a full /dev/shm raises
        raise RuntimeError("unable to write to file </torch_1_2>: No space left on device (28)")

    monkeypatch.setattr(stage_packing, "share", no_room)
    forward_process.use_by_default()
    try:
        with caplog.at_level(logging.WARNING, logger="backends.encoders.encoder"):
            backend = embedder(tiny_embedder_dir)  # the default: a warning, passes here
        try:
            assert backend.worker_pids() == []
            assert "No space left on device" in caplog.text
            assert "run in the hub's process" in caplog.text
        finally:
            backend.unload()
        with pytest.raises(LoadError, match="forward_process is true but cannot share"):
            embedder(tiny_embedder_dir, forward_process=True)
    finally:
        forward_process.use_by_default(False)


async def test_a_worker_ignores_a_ctrl_c_meant_for_the_hub(tiny_embedder_dir: Path) -> None:
    backend = embedder(tiny_embedder_dir, forward_process=True, forward_workers=1)
    try:
        (pid,) = backend.worker_pids()
        want = (await backend.embed(["the pier at night"])).vectors
        os.kill(pid, signal.SIGINT)  # what a terminal's Ctrl-C sends the process group
        os.kill(pid, signal.SIGTERM)
        await asyncio.sleep(0.2)
        np.testing.assert_array_equal((await backend.embed(["the pier at night"])).vectors, want)
        assert backend.worker_pids() == [pid]  # the same worker answered
    finally:
        backend.unload()


def test_an_error_in_a_worker_comes_back_as_itself_or_says_what_it_was() -> None:
    from backends.encoders.forward_process import _sendable

    class Strict(Exception):
        def __init__(self, code: int, why: str) -> None:  # pickle cannot rebuild it
            super().__init__(f"{code}: {why}")

    error = ValueError("a bad shape")
    try:
        raise error
    except ValueError as e:
        kept = _sendable(e)
    assert kept is error and "in the forward worker" in "".join(error.__notes__)
    try:
        raise Strict(7, "odd")
    except Strict as e:
        said = _sendable(e)
    assert isinstance(said, RuntimeError) and str(said).startswith("Strict: 7: odd")


async def test_a_hung_worker_is_killed_after_the_pass_limit_and_replaced(
    tiny_embedder_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = forward_process.PASS_TIMEOUT_S
    backend = embedder(tiny_embedder_dir, forward_process=True, forward_workers=1)
    try:
        (pid,) = backend.worker_pids()
        os.kill(pid, signal.SIGSTOP)  # hung: alive, never answers
        monkeypatch.setattr(forward_process, "PASS_TIMEOUT_S", 0.5)
        with pytest.raises(TransientError, match=r"took longer than 0\.5s"):
            await asyncio.wait_for(backend.embed(["a pass that never ends"]), 30)
        assert gone([pid])
        # The short limit was for the hung pass; the replacement's first pass (a fork and a
        # warm-up) may take longer than that on a loaded machine, as in production.
        monkeypatch.setattr(forward_process, "PASS_TIMEOUT_S", limit)
        assert (await backend.embed(["the next one"])).vectors.shape == (1, 32)
        assert backend.worker_pids() != [pid]
    finally:
        backend.unload()
