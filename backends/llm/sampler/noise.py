"""The exponential noise of the sampling race (`argmax(p / E)`, E ~ Exp(1)), `vocab` numbers
per sampled row and step.

Unseeded rows draw in one call from the device's default generator. A seeded sequence owns
a CPU generator, seeded `seed + index` (its index among a request's n samples), that draws
its rows one after another: the same numbers whatever else is in the batch, and the same on
every device, so a seeded request gives the same text on a GPU as on the CPU. The rows are
drawn on the host while the device still runs the step's forward pass, and go to the device
in one copy.
"""

from __future__ import annotations

import torch

from backends.llm.sampler.transfer import pinned, upload
from backends.llm.sequence import Sequence


class SeededNoise:
    """A CPU generator per seeded sequence, created on its first sampled step, until `forget`."""

    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}

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
        rows = len(seqs)
        if not seeded:
            return torch.empty(rows, vocab, device=device).exponential_()
        host = torch.empty(len(seeded), vocab, pin_memory=pinned(device))
        for out, r in enumerate(seeded):
            host[out].exponential_(generator=self._generator(seqs[r]))
        if not unseeded:
            return upload(host, device)
        noise = torch.empty(rows, vocab, device=device)
        noise.index_copy_(0, index["seeded"], upload(host, device))
        free = torch.empty(len(unseeded), vocab, device=device).exponential_()
        noise.index_copy_(0, index["unseeded"], free)
        return noise

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def _generator(self, seq: Sequence) -> torch.Generator:
        generator = self._generators.get(seq.seq_id)
        if generator is None:
            assert seq.params.seed is not None
            generator = torch.Generator()
            generator.manual_seed(seq.params.seed + seq.index)
            self._generators[seq.seq_id] = generator
        return generator
