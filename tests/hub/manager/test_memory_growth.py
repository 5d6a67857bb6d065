"""Unload frees memory for real: 100 load/unload cycles of a tiny model through the manager
(real registry, real embedder backend) leave the process no bigger than noise, and a weak
reference to an unloaded model dies."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import weakref
from pathlib import Path

from backends.encoders.embedder import EmbedderBackend
from hub.manager import ModelKey
from hub.settings import HubSettings
from hub.state import Hub
from tests.support.hubs import running_app

CYCLES = 100
MiB = 2**20


def rss_bytes() -> int:
    """Resident set size of this process (Linux), after returning freed heap to the OS."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: noisier, still bounded
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def weights_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


async def test_load_unload_cycles_do_not_grow_the_process(
    settings: HubSettings, tiny_embedder_dir: Path
) -> None:
    weights = weights_bytes(tiny_embedder_dir)
    async with running_app(settings) as (app, client):
        hub: Hub = app.state.hub
        r = await client.post(
            "/admin/registry/models",
            json={"name": "emb", "kind": "embedder", "source": str(tiny_embedder_dir)},
        )
        assert r.status_code == 201, r.text
        await hub.catalog.refresh()

        async def cycle() -> weakref.ref[object]:
            await hub.manager.load("emb", 1)
            async with hub.manager.acquire("emb", 1) as backend:
                assert isinstance(backend, EmbedderBackend)
                await backend.embed(["warm the caches"])
                model = weakref.ref(backend.model)
            status = await hub.manager.unload("emb", 1)
            assert status.state == "unloaded"
            return model

        # Warm-up: lazy imports, tokenizer and SQL caches and allocator pools grow during the
        # first few dozen cycles (about 4 MiB), then stay flat (0.1-0.3 MiB per 50 cycles).
        for _ in range(20):
            await cycle()
        model_bytes = hub.manager.status()[0].predicted_bytes
        before = rss_bytes()
        refs = [await cycle() for _ in range(CYCLES)]
        after = rss_bytes()

        gc.collect()
        assert all(ref() is None for ref in refs), "an unloaded model is still referenced"
        entry = hub.manager.entry(ModelKey("emb", 1))
        assert entry is not None and entry.backend is None
        assert hub.manager.ledger.used("cpu") == 0 and hub.manager.host_tier.used_bytes == 0
        growth = after - before
        # Leaking one model copy per cycle would grow by CYCLES x weights; allow 8 MiB of
        # allocator and logging noise, far below that and below one predicted footprint.
        assert growth < min(8 * MiB, CYCLES * weights // 2, model_bytes), (
            f"process grew by {growth / MiB:.1f} MiB over {CYCLES} cycles "
            f"(weights {weights / MiB:.2f} MiB)"
        )
