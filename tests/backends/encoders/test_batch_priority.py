"""Priority classes in the encoders' batcher: an interactive request goes into the next batch
ahead of queued batch-class inputs, and aging lets batch-class inputs seed a batch in turn."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from backends.encoders.batch_items import PooledInput
from backends.encoders.batch_queue import SeedQueue
from backends.encoders.batching import DynamicBatcher
from backends.priority import PriorityClass
from tests.backends.encoders.test_batching import (
    Item,
    UpperModel,
    batcher,
    queued,
    wait_entered,
)

INTERACTIVE = PriorityClass.INTERACTIVE.level
BATCH = PriorityClass.BATCH.level


async def pooled(b: DynamicBatcher[list[str], Item, str], n: int) -> None:
    """Until `n` inputs wait tokenized: the next batch is chosen among them. (`queued` counts
    inputs the tokenizer thread has not reached, which a busy machine can leave there while
    the forward thread takes batches from what is pooled.)"""

    def poll() -> None:
        while len(b._pool) < n:
            time.sleep(0.005)

    await asyncio.wait_for(asyncio.to_thread(poll), 30)


async def passes_until_served(model: UpperModel, load: int, *, classes: bool) -> int:
    """Forward passes from an interactive request's arrival to its result while `load`
    batch-class requests of 4 inputs wait, one pass in flight (counted) when `load` is not 0;
    `classes` False submits every request at the standard level, as with priorities off."""
    b = batcher(model, max_batch_size=4, max_batch_tokens=1000)
    in_flight = None
    if load:
        model.hold()
        in_flight = asyncio.create_task(b.submit(["x"], 1))
        await wait_entered(model)
    batch_level = BATCH if classes else 0
    texts = [[f"batch{i}-{j}" for j in range(4)] for i in range(load)]
    waiting = [asyncio.create_task(b.submit(t, 4, priority=batch_level)) for t in texts]
    await queued(b, 4 * load)
    chat = asyncio.create_task(b.submit(["chat"], 1, priority=INTERACTIVE if classes else 0))
    if load:  # the forward thread is parked: everything waits, tokenized
        await pooled(b, 4 * load + 1)
    passes_before = len(model.batches)
    model.release()
    assert await chat == ["CHAT"]
    served = next(i for i, batch in enumerate(model.batches) if "chat" in batch)
    await asyncio.gather(*waiting, *([in_flight] if in_flight else []))
    b.close()
    return served + 1 - passes_before


async def test_an_interactive_request_joins_the_next_batch_ahead_of_queued_batch_work() -> None:
    idle = await passes_until_served(UpperModel(), 0, classes=True)
    loaded = await passes_until_served(UpperModel(), 32, classes=True)
    without_classes = await passes_until_served(UpperModel(), 32, classes=False)
    assert loaded / idle <= 2.0, (idle, loaded)
    assert without_classes / idle > 2.0, (idle, without_classes)


@dataclass(frozen=True)
class Text:
    length: int = 1


@pytest.mark.parametrize("aging", [1, 4, 16])
def test_a_batch_class_input_seeds_a_batch_despite_a_stream_of_interactive_ones(
    aging: int,
) -> None:
    queue: SeedQueue[Text] = SeedQueue(aging)
    arrivals = iter(range(10**6))
    patient = PooledInput(None, 0, Text(), next(arrivals))
    queue.append(patient, BATCH)
    batches = 0
    while batches < 10 * aging:
        batches += 1
        queue.append(PooledInput(None, 0, Text(), next(arrivals)), INTERACTIVE)
        seed = queue.seed()
        assert seed is not None
        seed.taken = True
        queue.batch_taken()
        if seed is patient:
            break
    assert seed is patient
    # Two levels behind, it ties newcomers after waiting 2 x aging batches and, older, wins.
    assert batches == 2 * aging + 1
