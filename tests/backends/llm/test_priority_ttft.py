"""An interactive request's time to first token, counted in engine steps, while 32 batch-class
requests saturate the same tiny model: within 2x of its time on an idle engine, where without
priority classes it waits behind the whole batch queue."""

from __future__ import annotations

from pathlib import Path

from backends.llm.engine import LLMEngine
from backends.llm.sampling_params import SamplingParams
from backends.priority import PriorityClass
from tests.backends.llm.support import make_engine, random_prompts

BATCH_PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
CHAT_PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def steps_to_first_token(engine: LLMEngine, request_id: str) -> int:
    steps = 0
    while True:
        steps += 1
        if any(out.request_id == request_id for out in engine.step()):
            return steps
        assert steps < 10_000


def chat_ttft_steps(folder: Path, *, batch_requests: int, classes: bool) -> int:
    """Steps from an interactive request's arrival to its first token, after
    `batch_requests` batch-class requests filled the engine (`classes` False: every request
    at the standard level, as with priorities off)."""
    engine = make_engine(folder, max_num_seqs=8, max_num_batched_tokens=64)
    batch_level = PriorityClass.BATCH.level if classes else 0
    chat_level = PriorityClass.INTERACTIVE.level if classes else 0
    for i, prompt in enumerate(random_prompts(batch_requests, seed=1, lengths=(8, 16))):
        engine.add_request(f"batch-{i}", prompt, BATCH_PARAMS, priority=batch_level)
    for _ in range(3):  # every seat taken and decoding
        engine.step()
    chat = random_prompts(1, seed=2, lengths=(40, 40))[0]
    engine.add_request("chat", chat, CHAT_PARAMS, priority=chat_level)
    return steps_to_first_token(engine, "chat")


def test_interactive_ttft_under_a_saturating_batch_load_is_within_2x_of_idle(
    tiny_llm_dir: Path,
) -> None:
    idle = chat_ttft_steps(tiny_llm_dir, batch_requests=0, classes=True)
    loaded = chat_ttft_steps(tiny_llm_dir, batch_requests=32, classes=True)
    without_classes = chat_ttft_steps(tiny_llm_dir, batch_requests=32, classes=False)
    assert loaded / idle <= 2.0, (idle, loaded)
    # The same load without classes: the chat turn queues behind every batch request.
    assert without_classes / idle > 2.0, (idle, without_classes)
