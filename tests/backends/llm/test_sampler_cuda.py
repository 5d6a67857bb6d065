"""The sampler on a CUDA device (skipped without one) gives what it gives on the CPU: the
same tokens for greedy and seeded rows over many steps of mixed batches (penalties, bias,
cuts, logprobs), log-probabilities equal to float tolerance, and no host wait but the one
copy of its result."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from backends.llm.sampler import Sampler
from backends.llm.sampling_params import SamplingParams
from backends.llm.sequence import Sequence
from tests.backends.llm.test_sampler_equivalence import EOS, VOCAB, new_seq

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def comparable(seq: Sequence) -> bool:
    """Rows whose token does not hang on the global generator (greedy or seeded)."""
    return seq.params.greedy or seq.params.seed is not None


@pytest.mark.parametrize("trial", range(3))
def test_seeded_and_greedy_rows_sample_the_same_on_cuda_as_on_the_cpu(trial: int) -> None:
    rng = random.Random(100 + trial)
    gen = torch.Generator().manual_seed(trial)
    gpu, cpu = Sampler([EOS]), Sampler([EOS])
    live: dict[int, tuple[Sequence, Sequence]] = {}
    next_id, compared = 0, 0
    for _step in range(12):
        while len(live) < rng.randrange(1, 24):
            # Half the rows seeded, so most rows are comparable.
            pair = tuple(new_seq(next_id, random.Random(next_id * 31 + trial)) for _ in range(2))
            live[next_id] = (pair[0], pair[1])
            next_id += 1
        ids = rng.sample(sorted(live), len(live))
        logits = torch.randn(len(ids), VOCAB, generator=gen) * 4
        gpu.prepare([live[i][0] for i in ids])  # seeded rows' noise is drawn ahead
        got = gpu(logits.to("cuda"), [live[i][0] for i in ids])
        want = cpu(logits.clone(), [live[i][1] for i in ids])
        for r, i in enumerate(ids):
            a, b = live[i]
            token = want.token_ids[r]
            if comparable(a):
                assert got.token_ids[r] == token
                compared += 1
                lp_a, lp_b = got.logprobs[r], want.logprobs[r]
                if lp_a is not None and lp_b is not None:
                    assert lp_a.logprob == pytest.approx(lp_b.logprob, abs=1e-4)
                    assert [v for _, v in lp_a.top] == pytest.approx(
                        [v for _, v in lp_b.top], abs=1e-4
                    )
            # Both go on with the CPU's token, so later steps compare like for like.
            a.append_token(token)
            b.append_token(token)
        gone = [i for i in ids if rng.random() < 0.2]
        gpu.forget(gone)
        cpu.forget(gone)
        for i in gone:
            del live[i]
    assert compared > 50


def test_a_step_waits_for_the_device_once() -> None:
    """A step with every knob calls nothing that synchronises but its one result copy."""
    knobs: dict[str, Any] = {
        "temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "logprobs": 3,
        "repetition_penalty": 1.2, "presence_penalty": 0.5, "logit_bias": {7: 2.0},
        "min_tokens": 5, "stop_token_ids": (9,),
    }  # fmt: skip
    params = [SamplingParams(**knobs, seed=i if i % 2 else None) for i in range(8)]
    seqs = [Sequence(i, "r", [2, 3], p, max_tokens=99, block_size=4) for i, p in enumerate(params)]
    sampler = Sampler([EOS])
    logits = torch.randn(8, VOCAB, device="cuda")
    out = sampler(logits.clone(), seqs)  # warm: allocations, pinned buffers
    for s, token in zip(seqs, out.token_ids, strict=True):
        s.append_token(token)
    torch.cuda.synchronize()
    # Any synchronising call but the event's wait raises (that wait is not reported).
    torch.cuda.set_sync_debug_mode("error")
    try:
        sampler.prepare(seqs)
        sampler(logits.clone(), seqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
