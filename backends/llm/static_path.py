"""When the runner takes the static decode step (`backends.llm.decode_graphs`), and its life.

Contract: `StaticPath.for_step(output)` is the `StaticDecode` to run a step with, or None
when the step must take the packed path: it is not all single-token decodes, some sequence
has a LoRA adapter (graphs are captured for the base model alone), it has more rows than the
largest bucket, the static step is off on this device, or capturing the bucket it needs just
failed (then graphs stay off for this model and it decodes eagerly, logged once).

On when: `cuda_graphs` (the engine setting: True, False or "auto", which is on) on a CUDA
device where Triton is installed; `static_decode=True` also runs the static step, eagerly,
on a CPU (what CI tests), `static_decode=False` never. The KV cache then has one more block
than the pool hands out, the scratch block the padding rows write into (`scratch_blocks`).

Lifetime: the step and its graphs point at the KV cache and the weights, so `forget` drops
them whenever either moves (the runner calls it on allocate, release and `to`); they are
built again when a step needs them, one bucket at a time, or all at once by `capture_all`
(at load, so that the load's time includes it). `stats` lasts as long as the runner.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal

import torch

from backends.llm import triton_decode
from backends.llm.config import EngineConfig
from backends.llm.decode_graphs import GraphStats, StaticDecode, bucket_sizes
from backends.llm.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from backends.llm.model_runner import ModelRunner

log = logging.getLogger(__name__)


class StaticPath:
    """The runner's static decode step: whether it runs, and the one built now."""

    def __init__(
        self, runner: ModelRunner, config: EngineConfig, static_decode: bool | None
    ) -> None:
        self.runner = runner
        # None: where graphs are on; True: also eagerly elsewhere (a CPU); False: never.
        self.static_decode = static_decode
        self.cuda_graphs: bool | Literal["auto"] = config.cuda_graphs
        self.mode = config.cuda_graph_mode
        self.buckets = bucket_sizes(config.max_num_seqs)
        self.stats = GraphStats()
        self.failed: str | None = None  # why capturing failed, if it did
        self.step: StaticDecode | None = None

    @property
    def graphs_enabled(self) -> bool:
        """Whether decode steps replay CUDA graphs on the runner's device now. They need the
        Triton decode kernel: without it a graph's attention would gather every row padded
        to `max_model_len`, in memory and time."""
        return (
            self.runner.device.type == "cuda"
            and self.cuda_graphs is not False
            and self.static_decode is not False
            and self.failed is None
            and triton_decode.kernel_for(self.runner.device) is not None
        )

    @property
    def wanted(self) -> bool:
        """Whether decode steps take the static step on the runner's device."""
        return self.static_decode is True or self.graphs_enabled

    def scratch_blocks(self) -> int:
        """Blocks a new KV cache needs past the pool's: the scratch block, where wanted."""
        return 1 if self.wanted else 0

    def bytes(self) -> int:
        """Device bytes of the step now built: its buffers and its graphs' memory pool."""
        if self.step is None:
            return 0
        return self.step.buffer_bytes + self.stats.pool_bytes

    def capture_all(self) -> None:
        """Capture every bucket's graph now; nothing where graphs are off."""
        if not self.graphs_enabled or not self.runner.kv_caches:
            return
        try:
            with torch.inference_mode():
                self._built().capture_all()
        except Exception as e:  # a model the graph cannot hold: decode eagerly instead
            self._graphs_off(e)

    def for_step(self, output: SchedulerOutput) -> StaticDecode | None:
        """The step to run `output` with (see the module docstring), or None."""
        items, kv_caches = output.scheduled, self.runner.kv_caches
        if not self.wanted or not kv_caches or len(items) > self.buckets[-1]:
            return None
        if kv_caches[0].shape[1] <= self.runner.num_blocks:  # allocated without the scratch
            return None
        if any(item.num_tokens != 1 or item.seq.adapter is not None for item in items):
            return None
        step = self._built()
        size = step.bucket_for(len(items))
        capture = step.capture and self.mode == "capture"
        if capture and size is not None and size not in step.graphs:
            try:
                step.capture_bucket(size)
            except Exception as e:
                self._graphs_off(e)
                return None
        return step

    def forget(self) -> None:
        """Drop the step and its graphs (the KV cache or the weights are about to move)."""
        if self.step is not None:
            self.step.drop()
            self.step = None

    def _built(self) -> StaticDecode:
        if self.step is None:
            runner = self.runner
            self.step = StaticDecode(
                runner.model,
                runner.kv_caches,
                buckets=self.buckets,
                max_model_len=runner.max_model_len,
                scratch_block=runner.num_blocks,
                device=runner.device,
                capture=self.graphs_enabled,
                stats=self.stats,
                decode_kernel=triton_decode.kernel_for(runner.device),
                mode=self.mode,
            )
        return self.step

    def _graphs_off(self, error: Exception) -> None:
        log.warning("decode graphs off for this model: capturing failed (%s)", error)
        self.failed = f"{type(error).__name__}: {error}"
        self.forget()
