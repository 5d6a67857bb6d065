"""Repetition, presence and frequency penalties from token counts kept on the device.

Each penalised sequence owns a slot: a row of output-token counts and a row of "in the
prompt" flags, both vocabulary-wide, on the logits' device. A slot is filled from the
sequence's tokens once; after that each step adds the token it sampled, on the device, so a
step sends nothing per token to the device. Before a step the host checks that a slot covers
exactly its sequence's tokens (their number and the last one, which the host has by then);
anything else (a token the engine did not append) rebuilds the slot from the tokens.

vLLM's semantics: repetition over prompt and output, presence and frequency over the output
only.
"""

from __future__ import annotations

import torch

from backends.llm.sampler.transfer import pinned, upload
from backends.llm.sequence import Sequence

# Slots added at once when the table is full (it doubles past this).
MIN_SLOTS = 8


class PenaltyCounts:
    """Per-sequence token counts for the penalties; a slot per sequence until `forget`."""

    def __init__(self) -> None:
        self._counts: torch.Tensor | None = None  # (slots, V) float32, output tokens
        self._in_prompt: torch.Tensor | None = None  # (slots, V) bool
        self._slots: dict[int, int] = {}
        self._free: list[int] = []
        # seq_id -> (num_tokens, last token) that its slot's counts cover.
        self._covered: dict[int, tuple[int, int]] = {}

    def slots_for(self, seqs: list[Sequence], vocab: int, device: torch.device) -> list[int]:
        """The slot of each sequence, first brought up to date with its tokens."""
        slots, stale = [], []
        for seq in seqs:
            slot = self._slots.get(seq.seq_id)
            if slot is None:
                slot = self._allocate(seq.seq_id, vocab, device)
                stale.append((slot, seq))
            elif self._covered.get(seq.seq_id) != _tip(seq):
                stale.append((slot, seq))
            slots.append(slot)
        if stale:
            self._rebuild(stale, device)
        return slots

    def apply(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        repetition: torch.Tensor,
        frequency: torch.Tensor,
        presence: torch.Tensor,
    ) -> torch.Tensor:
        """`logits` (P, V) of the rows owning `slots` (P,), penalised (a new tensor)."""
        assert self._counts is not None and self._in_prompt is not None
        counts = self._counts.index_select(0, slots)  # (P, V)
        seen = self._in_prompt.index_select(0, slots) | (counts > 0)
        repetition = repetition[:, None]
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits)
        return (
            logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)
        )

    def count(
        self, seqs: list[Sequence], slots: torch.Tensor, tokens: torch.Tensor, sampled: list[int]
    ) -> None:
        """Add each sequence's sampled token (`tokens` (P,) on the device; `sampled` the same
        on the host) to its slot, as the engine will append it."""
        assert self._counts is not None
        self._counts.index_put_(
            (slots, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True
        )
        for seq, token in zip(seqs, sampled, strict=True):
            self._covered[seq.seq_id] = (seq.num_tokens + 1, token)

    def forget(self, seq_id: int) -> None:
        slot = self._slots.pop(seq_id, None)
        self._covered.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def _allocate(self, seq_id: int, vocab: int, device: torch.device) -> int:
        if not self._free:
            self._grow(vocab, device)
        slot = self._free.pop()
        self._slots[seq_id] = slot
        return slot

    def _grow(self, vocab: int, device: torch.device) -> None:
        old = 0 if self._counts is None else self._counts.shape[0]
        size = max(MIN_SLOTS, 2 * old)
        counts = torch.zeros(size, vocab, device=device)
        in_prompt = torch.zeros(size, vocab, dtype=torch.bool, device=device)
        if self._counts is not None and self._in_prompt is not None:
            counts[:old] = self._counts
            in_prompt[:old] = self._in_prompt
        self._counts, self._in_prompt = counts, in_prompt
        self._free.extend(range(size - 1, old - 1, -1))

    def _rebuild(self, stale: list[tuple[int, Sequence]], device: torch.device) -> None:
        """Refill the slots of `stale` from their sequences' tokens (one upload)."""
        assert self._counts is not None and self._in_prompt is not None
        slots: list[int] = []
        out_slots: list[int] = []
        out_tokens: list[int] = []
        prompt_slots: list[int] = []
        prompt_tokens: list[int] = []
        for slot, seq in stale:
            slots.append(slot)
            output = seq.output_token_ids
            out_slots += [slot] * len(output)
            out_tokens += output
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            prompt_slots += [slot] * len(prompt)
            prompt_tokens += prompt
            self._covered[seq.seq_id] = _tip(seq)
        flat = [*slots, *out_slots, *out_tokens, *prompt_slots, *prompt_tokens]
        host = torch.tensor(flat, dtype=torch.int64, pin_memory=pinned(device))
        index = upload(host, device).split(
            [len(slots), len(out_slots), len(out_tokens), len(prompt_slots), len(prompt_tokens)]
        )
        self._counts.index_fill_(0, index[0], 0.0)
        self._in_prompt.index_fill_(0, index[0], False)
        ones = torch.ones(len(out_tokens), device=device)
        self._counts.index_put_((index[1], index[2]), ones, accumulate=True)
        self._in_prompt[index[3], index[4]] = True


def _tip(seq: Sequence) -> tuple[int, int]:
    """A sequence's token count and last token: what a slot must cover."""
    return seq.num_tokens, seq.token_ids[-1] if seq.token_ids else -1
