"""Engine tests run tiny models whose matrices are far too small to gain from intra-op
threads; one thread avoids waking (and, on a busy machine, waiting for) the others.

torch is imported inside the fixture: the scheduler and block-pool tests in this folder are
pure (they run where torch is not installed)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    torch = sys.modules.get("torch")
    if torch is None:  # a pure module: nothing of torch's to tune
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
