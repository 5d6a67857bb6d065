"""The token-budget batcher with a stand-in model (upper-cases each text; a text's length is
its token count): order, budgets, length grouping, capacity, refusal, cancellation, failure."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from backends.encoders.batch_limits import BatchLimits
from backends.encoders.batching import DynamicBatcher
from backends.errors import BackendClosedError, CapacityError, InputError
from backends.runtime_config import EmbedderConfig, RuntimeConfigError


@dataclass(frozen=True)
class Item:
    text: str

    @property
    def length(self) -> int:
        return len(self.text)


class UpperModel:
    """Tokenizes a text into one item per input; refuses a payload holding "bad"; fails a
    batch holding "boom". `hold()` parks the next forward pass until `release()`."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self._gate = threading.Event()
        self._gate.set()
        self.entered = threading.Event()
        self.tokenized: list[list[list[str]]] = []  # payloads of each tokenize call
        self.tokenizer_gate = threading.Event()
        self.tokenizer_parked = threading.Event()

    def tokenize(self, payloads: Sequence[list[str]]) -> list[list[Item] | BaseException]:
        self.tokenized.append([list(p) for p in payloads])
        if any("crash" in texts for texts in payloads):
            raise RuntimeError("the tokenizer broke")
        if any("slow" in texts for texts in payloads):
            self.tokenizer_parked.set()
            self.tokenizer_gate.wait(30)
        out: list[list[Item] | BaseException] = []
        for texts in payloads:
            if "bad" in texts:
                out.append(InputError(f"input[{texts.index('bad')}] is bad", param="input"))
            else:
                out.append([Item(t) for t in texts])
        return out

    def forward(self, items: Sequence[Item]) -> list[str]:
        self.entered.set()
        self._gate.wait()
        texts = [i.text for i in items]
        self.batches.append(texts)
        if "boom" in texts:
            raise RuntimeError("the model broke")
        return [t.upper() for t in texts]

    def hold(self) -> None:
        self._gate.clear()
        self.entered.clear()

    def release(self) -> None:
        self._gate.set()


@pytest.fixture
def model() -> UpperModel:
    return UpperModel()


def batcher(model: UpperModel, **limits: object) -> DynamicBatcher[list[str], Item, str]:
    settings = {"batch_wait_s": 0.0, **limits}
    return DynamicBatcher(model, BatchLimits(**settings), name="upper")  # type: ignore[arg-type]


async def submit(b: DynamicBatcher[list[str], Item, str], texts: list[str]) -> list[str]:
    return await b.submit(texts, len(texts))


async def wait_entered(model: UpperModel) -> None:
    await asyncio.to_thread(model.entered.wait, 30)


async def queued(b: DynamicBatcher[list[str], Item, str], n: int) -> None:
    """Until `n` inputs wait in the batcher (tokenized or not)."""

    def poll() -> None:
        while b.queued < n:
            time.sleep(0.005)

    await asyncio.wait_for(asyncio.to_thread(poll), 30)


async def test_inputs_split_across_batches_come_back_in_order(model: UpperModel) -> None:
    b = batcher(model, max_batch_size=2, max_batch_tokens=1000)
    texts = ["ccc", "a", "eeeee", "bb", "dddd"]
    assert await submit(b, texts) == [t.upper() for t in texts]
    assert sorted(t for batch in model.batches for t in batch) == sorted(texts)
    assert all(len(batch) <= 2 for batch in model.batches) and len(model.batches) == 3
    b.close()


async def test_concurrent_requests_share_batches_under_the_token_budget(
    model: UpperModel,
) -> None:
    b = batcher(model, max_batch_size=64, max_batch_tokens=12, batch_overhead_tokens=32)
    model.hold()
    first = asyncio.create_task(submit(b, ["x"]))
    await wait_entered(model)
    # While the model is busy, four requests arrive; lengths 1..6.
    others = [["aaaaaa", "b"], ["cc"], ["ddddd", "eee"], ["ffff"]]
    tasks = [asyncio.create_task(submit(b, texts)) for texts in others]
    await queued(b, 6)
    model.release()
    assert await first == ["X"]
    assert [await t for t in tasks] == [[x.upper() for x in texts] for texts in others]
    later = model.batches[1:]
    # Every batch fits the budget: size x longest <= 12 tokens.
    assert all(len(batch) * max(map(len, batch)) <= 12 for batch in later)
    # The oldest input (length 6) goes first; inputs of different requests share batches,
    # grouped by length (each grows while its cost per token, 32 per pass plus padded
    # tokens, falls).
    assert [sorted(map(len, batch)) for batch in later] == [[5, 6], [1, 2, 3], [4]]
    b.close()


@pytest.mark.parametrize(
    ("overhead", "batches"),
    [(2, [["s"] * 5, ["L" * 20] * 5]), (10**6, [["s"] * 5 + ["L" * 20] * 5])],
)
async def test_a_batch_grows_while_an_input_costs_less_in_it_than_alone(
    model: UpperModel, overhead: int, batches: list[list[str]]
) -> None:
    # Five short and five long inputs, interleaved. With a small per-pass overhead, mixing
    # them would pad each short input to 20 tokens: two batches. With a large one, one batch.
    b = batcher(model, batch_overhead_tokens=overhead, max_batch_size=64)
    texts = ["L" * 20, "s"] * 5
    assert await submit(b, texts) == [t.upper() for t in texts]
    assert sorted(sorted(batch) for batch in model.batches) == sorted(sorted(x) for x in batches)
    b.close()


async def test_a_dear_pass_takes_a_request_of_mixed_lengths_whole(model: UpperModel) -> None:
    # A GPU's pass costs about the same for any small batch (its default overhead, 4096
    # tokens): a request of 32 inputs of 8 to 60 tokens is one pass, not its bulk and then
    # its longest few on their own.
    b = batcher(model, batch_overhead_tokens=4096, max_batch_size=32)
    rng = random.Random(1)
    texts = ["x" * rng.randint(8, 60) for _ in range(32)]
    assert await submit(b, texts) == [t.upper() for t in texts]
    assert [len(batch) for batch in model.batches] == [32]
    b.close()


async def test_an_unpadded_model_batches_unlike_lengths_under_a_real_token_budget(
    model: UpperModel,
) -> None:
    # The same interleaved inputs as above with a small overhead: padded they split by length,
    # unpadded (padding costs nothing) they share batches up to the budget of real tokens.
    b = batcher(model, batch_overhead_tokens=2, max_batch_size=64, max_batch_tokens=60,
                unpadded=True)  # fmt: skip
    texts = ["L" * 20, "s"] * 5
    assert await submit(b, texts) == [t.upper() for t in texts]
    assert all(sum(map(len, batch)) <= 60 for batch in model.batches)
    assert any({"s", "L" * 20} <= set(batch) for batch in model.batches)
    assert len(model.batches) == 2  # 105 real tokens: 5 x 20 + 5 x 1, two passes of <= 60
    b.close()


async def test_idle_model_waits_for_a_batch_as_large_as_the_last(model: UpperModel) -> None:
    b = batcher(model, batch_wait_s=60.0, max_batch_size=8)
    # Nothing ran before: a lone request does not wait.
    assert await submit(b, ["a", "b", "c", "d"]) == ["A", "B", "C", "D"]
    # The last batch held 4: one new input waits for company rather than running alone.
    lone = asyncio.create_task(submit(b, ["e"]))
    await asyncio.sleep(0.2)
    rest = [asyncio.create_task(submit(b, [t])) for t in "fgh"]
    assert await lone == ["E"]
    assert [await t for t in rest] == [["F"], ["G"], ["H"]]
    assert sorted(model.batches[-1]) == ["e", "f", "g", "h"]
    b.close()


async def test_full_queue_is_a_capacity_error_and_oversized_requests_are_refused(
    model: UpperModel,
) -> None:
    b = batcher(model, max_queue=4, max_batch_size=1)
    model.hold()
    running = asyncio.create_task(submit(b, ["x"]))
    await wait_entered(model)
    waiting = asyncio.create_task(submit(b, ["a", "b", "c"]))
    await queued(b, 3)
    with pytest.raises(CapacityError, match="3 inputs already wait") as e:
        await submit(b, ["d", "e"])
    assert e.value.retry_after > 0
    with pytest.raises(InputError, match="5 inputs in one request"):
        await submit(b, ["1", "2", "3", "4", "5"])
    model.release()
    assert await running == ["X"] and await waiting == ["A", "B", "C"]
    assert await submit(b, ["d", "e"]) == ["D", "E"]  # room again
    b.close()


async def test_a_refused_request_never_reaches_the_model(model: UpperModel) -> None:
    b = batcher(model)
    with pytest.raises(InputError, match=r"input\[1\] is bad"):
        await submit(b, ["fine", "bad", "also fine"])
    assert await submit(b, ["ok"]) == ["OK"]
    assert model.batches == [["ok"]]
    assert b.queued == 0
    b.close()


async def test_a_request_that_breaks_the_tokenizer_fails_alone(model: UpperModel) -> None:
    b = batcher(model)
    # Park the tokenizer on a first request, so the next two are tokenized together.
    slow = asyncio.create_task(submit(b, ["slow"]))
    await asyncio.to_thread(model.tokenizer_parked.wait, 30)
    broken = asyncio.create_task(submit(b, ["crash"]))
    fine = asyncio.create_task(submit(b, ["fine"]))
    await queued(b, 3)
    model.tokenizer_gate.set()
    assert await slow == ["SLOW"] and await fine == ["FINE"]
    with pytest.raises(RuntimeError, match="the tokenizer broke"):
        await broken
    assert model.tokenized[1:] == [[["crash"], ["fine"]], [["crash"]], [["fine"]]]
    assert await submit(b, ["after"]) == ["AFTER"]
    b.close()


async def test_cancelled_request_drops_its_inputs_not_yet_run(model: UpperModel) -> None:
    b = batcher(model, max_batch_size=1)
    model.hold()
    running = asyncio.create_task(submit(b, ["x"]))
    await wait_entered(model)
    gone = asyncio.create_task(submit(b, ["never", "run", "these"]))
    await queued(b, 3)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert b.queued == 0
    model.release()
    assert await running == ["X"]
    assert await submit(b, ["after"]) == ["AFTER"]
    assert model.batches == [["x"], ["after"]]
    b.close()


async def test_a_failed_batch_fails_its_requests_only(model: UpperModel) -> None:
    b = batcher(model, max_batch_size=1)
    with pytest.raises(RuntimeError, match="the model broke"):
        await submit(b, ["boom", "later"])
    assert await submit(b, ["fine"]) == ["FINE"]
    assert ["later"] not in model.batches  # the failed request's other input was dropped
    b.close()


async def test_close_fails_waiting_requests_and_refuses_new_ones(model: UpperModel) -> None:
    b = batcher(model, max_batch_size=1)
    model.hold()
    running = asyncio.create_task(submit(b, ["x"]))
    await wait_entered(model)
    waiting = asyncio.create_task(submit(b, ["y"]))
    await queued(b, 1)
    closing = asyncio.create_task(asyncio.to_thread(b.close))
    await asyncio.sleep(0.05)
    model.release()
    await closing
    assert await running == ["X"]
    with pytest.raises(BackendClosedError):
        await waiting
    with pytest.raises(BackendClosedError):
        await submit(b, ["z"])


def test_limits_come_from_runtime_config_and_bad_values_name_the_key() -> None:
    limits = BatchLimits.from_config(EmbedderConfig.parse(
        {"max_batch_tokens": 4096, "max_batch_size": 16, "batch_wait_ms": 5, "max_queue": 100,
         "forward_workers": 3, "batch_overhead_tokens": 0}
    ))  # fmt: skip
    assert (limits.max_batch_tokens, limits.max_batch_size) == (4096, 16)
    assert (limits.batch_wait_s, limits.max_queue) == (0.005, 100)
    assert (limits.forward_workers, limits.batch_overhead_tokens) == (3, 0)
    assert BatchLimits.from_config(EmbedderConfig.parse({"normalize": True})) == BatchLimits()
    bad = [("max_batch_tokens", 0), ("max_batch_size", "8"), ("batch_wait_ms", -1),
           ("forward_workers", 0), ("batch_overhead_tokens", True)]  # fmt: skip
    for key, value in bad:
        with pytest.raises(RuntimeConfigError, match=key) as e:
            EmbedderConfig.parse({key: value})
        assert e.value.key == key
