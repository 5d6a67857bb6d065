"""Engine tests run tiny models whose matrices are far too small to gain from intra-op
threads; one thread avoids waking (and, on a busy machine, waiting for) the others."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
