"""The exponential noise of the sampling race (`argmax(p / E)`, E ~ Exp(1)), `vocab` numbers
per sampled row and step.

Unseeded rows draw in one call from the device's default generator. A seeded sequence owns
a CPU generator, seeded `seed + index` (its index among a request's n samples), that draws
its rows one after another: the same numbers whatever else is in the batch, and the same on
every device, so a seeded request gives the same text on a GPU as on the CPU. The rows go to
the device in one copy.

Off the CPU, `start` (called before the step's forward pass) draws each seeded sequence's
next row ahead, on worker threads (torch releases the GIL while it draws), so the draws
overlap the forward pass instead of following it. A row drawn ahead waits, in order, until
its sequence next samples: each sampled step still takes the next `vocab` numbers of its
generator, whether or not the step it was drawn for ran.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from backends.llm.sampler.transfer import pinned, upload
from backends.llm.sequence import Sequence

# Worker threads drawing rows ahead: a few, leaving cores to the engine's own threads.
AHEAD_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))


class SeededNoise:
    """A CPU generator per seeded sequence, created on its first sampled step, until `forget`."""

    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}
        # A row drawn ahead per sequence, not yet used.
        self._ready: dict[int, torch.Tensor] = {}
        self._pending: list[Future[list[tuple[int, torch.Tensor]]]] = []
        self._pool: ThreadPoolExecutor | None = None
        # Draw ahead in `start`: None decides by the device of the last step (ahead off the
        # CPU, where the forward pass leaves the host free; on a CPU it would compete).
        self.ahead: bool | None = None
        # The device and vocabulary of the last step (what `start` draws for).
        self._device = torch.device("cpu")
        self._vocab = 0

    def start(self, seqs: list[Sequence]) -> None:
        """Begin drawing the next row of each seeded, sampling sequence of `seqs`."""
        ahead = self._device.type != "cpu" if self.ahead is None else self.ahead
        if not ahead or not self._vocab:
            return
        self._wait()
        device, vocab = self._device, self._vocab
        todo = [
            (s.seq_id, self._generator(s))
            for s in seqs
            if s.params.seed is not None and not s.params.greedy and s.seq_id not in self._ready
        ]
        if not todo:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(AHEAD_THREADS, thread_name_prefix="seeded-noise")
        for chunk in range(AHEAD_THREADS):
            part = todo[chunk::AHEAD_THREADS]
            if part:
                self._pending.append(self._pool.submit(_draw_rows, part, vocab, pinned(device)))

    def draw(
        self,
        seqs: list[Sequence],
        seeded: list[int],
        unseeded: list[int],
        vocab: int,
        device: torch.device,
        index: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """(len(seqs), vocab) float32 noise on `device`: row r of `seqs` from its own generator
        where r is in `seeded`, from the device's default generator where in `unseeded`;
        `index` holds both lists on the device."""
        self._device, self._vocab = device, vocab
        rows = len(seqs)
        if not seeded:
            return torch.empty(rows, vocab, device=device).exponential_()
        self._wait()
        host = torch.empty(len(seeded), vocab, pin_memory=pinned(device))
        for out, r in enumerate(seeded):
            ready = self._ready.pop(seqs[r].seq_id, None)
            if ready is None:
                host[out].exponential_(generator=self._generator(seqs[r]))
            else:
                host[out] = ready
        if not unseeded:
            return upload(host, device)
        noise = torch.empty(rows, vocab, device=device)
        noise.index_copy_(0, index["seeded"], upload(host, device))
        free = torch.empty(len(unseeded), vocab, device=device).exponential_()
        noise.index_copy_(0, index["unseeded"], free)
        return noise

    def forget(self, seq_id: int) -> None:
        self._wait()
        self._generators.pop(seq_id, None)
        self._ready.pop(seq_id, None)

    def _wait(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            self._ready.update(future.result())

    def _generator(self, seq: Sequence) -> torch.Generator:
        generator = self._generators.get(seq.seq_id)
        if generator is None:
            assert seq.params.seed is not None
            generator = torch.Generator()
            generator.manual_seed(seq.params.seed + seq.index)
            self._generators[seq.seq_id] = generator
        return generator


def _draw_rows(
    todo: list[tuple[int, torch.Generator]], vocab: int, pin: bool
) -> list[tuple[int, torch.Tensor]]:
    """The next `vocab` draws of each generator (a worker thread's share of `start`)."""
    return [
        (seq_id, torch.empty(vocab, pin_memory=pin).exponential_(generator=generator))
        for seq_id, generator in todo
    ]
