"""The lifecycle shared by the batched encoder backends (embedder, reranker).

An encoder backend is a sentence-transformers model (its module pipeline), an
`EncoderTokenizer` and a `DynamicBatcher` whose threads run the two. Subclasses load the model
and build their stages; this base class starts the batcher and implements the rest of the
`Backend` lifecycle: measured memory, offload (the weights parked in one host buffer,
`backends.parking`) and restore (one copy back; the batcher's threads stay up, idle, and the
next batch runs on the restored device), `aclose` and `unload` (the threads stop, work still
queued fails with BackendClosedError, the weights are freed at once).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch

from backends.admission import device_work
from backends.base import Backend, BackendContext, checked_config
from backends.encoders.batch_limits import BatchLimits
from backends.encoders.batch_metrics import BatchMetrics
from backends.encoders.batching import DynamicBatcher
from backends.encoders.forward_process import (
    ForwardProcessError,
    PooledStages,
    WorkerShape,
    by_default,
)
from backends.encoders.tokenization import Encoded, EncoderTokenizer
from backends.errors import BackendClosedError, LoadError
from backends.loading import (
    header_tensors,
    module_bytes,
    parse_dtype,
    require_safe_weights,
    tensor_bytes_from_headers,
)
from backends.parking import ParkedWeights, park, release
from backends.runtime_config import EncoderConfig, RuntimeConfig
from backends.threads import compute_threads, intraop_threads
from backends.workers import on_own_thread

log = logging.getLogger(__name__)

# Activations and the tokenizer on top of the weights on a CPU: a small fixed allowance (on
# a GPU the tokenizer stays in host memory and a batch's activations are transient).
_RUNTIME_OVERHEAD_BYTES = 32 * 1024 * 1024
# Forward workers on a CPU unless the runtime config says `forward_workers`.
DEFAULT_CPU_WORKERS = 2
# `batch_overhead_tokens` on an accelerator unless the runtime config says otherwise.
ACCELERATOR_OVERHEAD_TOKENS = 4096

P = TypeVar("P")  # the payload of one request
R = TypeVar("R")  # the result for one input
P_contra = TypeVar("P_contra", contravariant=True)
R_co = TypeVar("R_co", covariant=True)
C = TypeVar("C", bound=EncoderConfig)  # the kind's runtime config


class EncoderStages(Protocol[P_contra, R_co]):
    """What the batcher runs for one loaded encoder; `device` follows offload and restore."""

    model: torch.nn.Module
    tokenizer: EncoderTokenizer
    device: str
    # Whether `forward` runs a batch unpadded (packed into one row), so padding costs nothing.
    unpadded: bool

    def tokenize(self, payloads: Sequence[P_contra]) -> list[list[Encoded] | BaseException]: ...

    def forward(self, items: Sequence[Encoded]) -> Sequence[R_co]: ...


class BatchedEncoderBackend(Backend, Generic[P, R, C]):
    """A loaded encoder behind a dynamic batcher; subclasses implement `load` and call
    `_start` at its end, and submit work through `_submit`. `config` is the version's runtime
    config as `config_type` (LoadError naming the key when it does not check)."""

    def __init__(self, context: BackendContext, config_type: type[C]) -> None:
        super().__init__(context)
        where = f"{context.model} v{context.version}"
        self.config: C = checked_config(config_type, context.runtime_config, where)
        self.limits = BatchLimits.from_config(self.config)
        self._stages: EncoderStages[P, R] | None = None
        self._batcher: DynamicBatcher[P, Encoded, R] | None = None
        # What the batcher runs: the stages, their passes in worker processes on a CPU.
        self._pooled: PooledStages[Encoded, R] | None = None
        # The forward workers of a pool on a CPU.
        self._pool_shape: WorkerShape | None = None
        # The weights while offloaded: one host buffer, restored by one copy.
        self._parked: ParkedWeights | None = None

    @classmethod
    def predict_memory(
        cls,
        artifact_dir: Path,
        runtime_config: RuntimeConfig | Mapping[str, Any],
        *,
        device: str | None = None,
    ) -> int:
        """The weights in the dtype they load in (`weights_dtype`) plus a fixed allowance; on
        a CUDA `device`, what loading allocates there: each weight as the caching allocator
        rounds it."""
        files = require_safe_weights(artifact_dir)
        configured = (
            runtime_config.get("dtype")
            if isinstance(runtime_config, Mapping)
            else getattr(runtime_config, "dtype", None)
        )
        dtype = weights_dtype(files, device or "cpu", parse_dtype(configured))
        if device is not None and device.startswith("cuda"):
            return tensor_bytes_from_headers(files, dtype, device=device)
        return tensor_bytes_from_headers(files, dtype) + _RUNTIME_OVERHEAD_BYTES

    @property
    def model(self) -> torch.nn.Module:
        """The loaded sentence-transformers model (its module pipeline)."""
        return self._require().model

    @property
    def max_tokens(self) -> int:
        """Tokens one input may have, special tokens included, before it is truncated."""
        return self._require().tokenizer.max_length

    def memory_bytes(self) -> int:
        if self._stages is None or self._parked is not None:
            return 0
        return module_bytes(self._stages.model)

    def offload_bytes(self) -> int:
        return module_bytes(self._require().model)

    def offload(self) -> None:
        stages = self._require()
        if self._parked is None:
            if self._pooled is not None:
                self._pooled.stop()  # the workers map the weights about to be parked
            self._parked = park(stages.model)
            self._device = stages.device = "cpu"

    def restore(self, device: str) -> None:
        stages = self._require()
        if self._parked is not None:
            self._parked.restore(device)
            self._parked = None
        else:
            if self._pooled is not None:
                self._pooled.stop()  # the workers map the weights `to` may replace
            stages.model.to(device)
        self._device = stages.device = device
        if self._batcher is not None:
            self._batcher.set_device_work(device_work(device))
        try:
            self._start_pool(device)
        except LoadError:
            log.exception("%s: its forward passes run in the hub's process", self._name)

    async def aclose(self) -> None:
        """Stop the batcher's threads; requests still queued fail with BackendClosedError."""
        # A thread of its own (backends/workers.py): an eviction never waits behind a pool.
        if self._batcher is not None:
            await on_own_thread(self._batcher.close, name="encoder-close")
        if self._pooled is not None:
            await on_own_thread(self._pooled.stop, name="encoder-close")

    def unload(self) -> None:
        if self._batcher is not None:
            self._batcher.close()
        if self._pooled is not None:
            self._pooled.stop()  # before the weights go: the workers map them
        if self._parked is not None:
            self._parked.discard()
        elif self._stages is not None:
            release(self._stages.model)  # frees the weights now, cycles in the model or not
        self._parked = None
        self._batcher = None
        self._pooled = None
        self._stages = None
        self._device = None

    def _start(self, stages: EncoderStages[P, R], device: str) -> None:
        """Make the loaded model servable: its forward workers (processes on a CPU), then its
        batcher. LoadError when `forward_process: true` and the workers cannot start."""
        registry = self.context.metrics_registry
        metrics = None
        if registry is not None:
            metrics = BatchMetrics(registry, self.context.model, self.context.version)
        limits, threads = self._execution(device)
        limits = replace(limits, unpadded=stages.unpadded)
        self._stages = stages
        self._pooled = PooledStages(stages)
        if threads is not None:
            nice = self.config.forward_process_nice
            self._pool_shape = WorkerShape(limits.forward_workers, threads, nice)
        self._start_pool(device)
        self._batcher = DynamicBatcher(
            self._pooled,
            limits,
            name=self._name,
            metrics=metrics,
            on_worker_start=None if threads is None else intraop_threads(threads),
            device_work=device_work(device),
        )
        self._device = device

    @property
    def _name(self) -> str:
        return f"{self.kind.value} {self.context.model} v{self.context.version}"

    def _start_pool(self, device: str) -> None:
        """Run the passes in worker processes when on a CPU and the runtime config says
        `forward_process: true`, or leaves it unset in a process that made them the default
        (`hub serve`; backends/encoders/forward_process.py). LoadError when it says true and they
        cannot start; by default that is a warning, and passes run here."""
        pooled, shape, setting = self._pooled, self._pool_shape, self.config.forward_process
        wanted = by_default() if setting is None else setting
        if pooled is None or shape is None or not device.startswith("cpu") or not wanted:
            return
        try:
            pooled.start(shape, name=self._name)
        except ForwardProcessError as e:
            if setting:
                raise LoadError(f"forward_process is true but {e}") from e
            log.warning("%s; its forward passes run in the hub's process", e)

    def worker_pids(self) -> list[int]:
        """The worker processes running this model's passes; empty when they run here."""
        pool = None if self._pooled is None else self._pooled.pool
        return [] if pool is None else pool.pids

    def _execution(self, device: str) -> tuple[BatchLimits, int | None]:
        """Forward workers, their intra-op threads and the per-pass overhead, by device unless
        the runtime config sets them. On a CPU, several single-threaded workers (each running
        its own batch) lose less than one multi-threaded worker when the cores are shared with
        HTTP, tokenizing and clients: an OpenMP team stalls at every barrier whenever one of its
        threads is descheduled. A GPU pass costs about the same for any small batch, so there
        batches are split for padding only when they are large. Threads None: the device's
        own (an accelerator)."""
        config = self.config
        limits = self.limits
        if not device.startswith("cpu"):
            if config.batch_overhead_tokens is None:
                limits = replace(limits, batch_overhead_tokens=ACCELERATOR_OVERHEAD_TOKENS)
            return limits, None
        available = compute_threads() or torch.get_num_threads()
        if config.forward_workers is None:
            limits = replace(limits, forward_workers=max(1, min(DEFAULT_CPU_WORKERS, available)))
        threads = config.worker_threads or max(1, available // limits.forward_workers)
        return limits, threads

    async def _submit(self, payload: P, size: int, priority: int = 0) -> list[R]:
        batcher = self._batcher
        if batcher is None:
            raise BackendClosedError(f"{self.kind.value} {self.context.model} is not loaded")
        return await batcher.submit(payload, size, priority=priority)

    def _require(self) -> EncoderStages[P, R]:
        if self._stages is None:
            raise BackendClosedError(f"{self.kind.value} {self.context.model} is not loaded")
        return self._stages


def unpadded_setting(config: EncoderConfig, device: str) -> bool:
    """The runtime config's `unpadded` (true / false), by default true on a CPU, where a packed
    batch saves the padding's compute, and false on an accelerator, where one padded SDPA call
    beats an attention call per input."""
    if config.unpadded is None:
        return device.startswith("cpu")
    return config.unpadded


def model_max_length(model: Any, configured: int | None) -> int:
    """The model's maximum input tokens (sentence-transformers' `max_seq_length`), lowered to
    the runtime config's `max_seq_length` when that is smaller."""
    length = model.max_seq_length
    if not length:
        raise LoadError("the model reports no maximum sequence length")
    if configured is not None:
        return min(int(length), configured)
    return int(length)


_HALF = {"F16": torch.float16, "BF16": torch.bfloat16}


def weights_dtype(
    files: Sequence[Path], device: str, configured: torch.dtype | None
) -> torch.dtype | None:
    """The dtype an encoder's weights load in: the runtime config's `dtype` when it names one;
    on a CUDA device otherwise half precision, the checkpoint's own 16-bit dtype or else
    float16 (an encoder's batch is matmuls and attention, which run at twice the rate and half
    the memory there; scores and vectors are returned in float32 whatever the dtype, and
    `dtype: float32` keeps full precision); elsewhere None, the checkpoint's dtype."""
    if configured is not None or not device.startswith("cuda"):
        return configured
    bytes_by_dtype: dict[str, int] = {}
    for t in header_tensors(files):
        if t.floating:
            count = 1
            for n in t.shape:
                count *= n
            bytes_by_dtype[t.dtype] = bytes_by_dtype.get(t.dtype, 0) + count
    dominant = max(bytes_by_dtype, key=bytes_by_dtype.__getitem__, default="F32")
    return _HALF.get(dominant, torch.float16)


def sentence_transformers_kwargs(backend: Backend, dtype: torch.dtype | None) -> dict[str, Any]:
    """Loading arguments shared by SentenceTransformer and CrossEncoder: offline, safe."""
    model_kwargs: dict[str, Any] = {"use_safetensors": not backend.context.allow_pickle}
    if dtype is not None:
        model_kwargs["dtype"] = dtype
    return {
        "local_files_only": True,
        "trust_remote_code": backend.context.trust_remote_code,
        "model_kwargs": model_kwargs,
    }
