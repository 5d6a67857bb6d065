"""A decode step over static buffers, replayed as a CUDA graph per batch-size bucket.

On a GPU a decode step of the transformers modules is launch-bound: each of its ~1,000
kernels is issued from Python. A step whose scheduled items are all single-token decodes can
instead run one recorded graph: its shapes depend only on how many rows it has, so the rows
are padded to the next size of a ladder (`bucket_sizes`) and every bucket's forward is
captured once, over buffers that stay where they are, and replayed by copying the step's
values into those buffers.

Buffers, sized for the largest bucket `B` and allocated once per KV cache:

- `inputs` `(5, B)` int64: token ids, positions, cache slots, context lengths, and for an
  asynchronous step the row of the previous step whose sampled token is a row's input (-1:
  the host knows it); rows of one tensor, so one host-to-device copy fills them all;
- `tables` `(B, W)` int64: block tables, `W = ceil(max_model_len / block_size)`; a row's
  columns past its own blocks hold ids that are valid but never attended;
- `logits` `(B, V)`: each captured forward copies its rows here.

A padding row is token 0 at position 0 writing its K/V into the scratch block (a block of
the cache past those the block pool hands out, so no sequence owns it) and attending to that
one slot; its logits are never read. Attention is the batched decode call of
`backends.llm.attention` over `tables` and `lens`: the Triton kernel (`triton_decode`) where it
runs, else the padded gather and mask in torch.

On CUDA (`capture=True`) each bucket is warmed up once on a side stream (allocator, cuBLAS,
Triton compilation), then captured, largest first, into one shared memory pool
(`capture_error_mode="thread_local"`: other models' threads may use the device meanwhile).
`GraphStats` counts captures, their seconds and the pool's bytes, so that a load's time and
footprint can include them. On a CPU (`capture=False`) the same function runs eagerly: what
CI tests (padding, bucket choice, the scratch slot, equality with the packed step) is the
code a GPU replays.

Why hand capture rather than `torch.compile(mode="reduce-overhead")`: no compile time at
load (a restore or a first request never waits for Inductor), the engine owns the buffers
and the memory pool (so it can count and drop them), and the paged attention function needs
no tracing. Whether Inductor's fusions win back more than they cost has to be measured on a
GPU: `mode="compile"` wraps the same static forward in `torch.compile` instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from backends.llm import triton_fused
from backends.llm.attention import PagedAttentionMetadata
from backends.llm.scheduler import ScheduledSequence

log = logging.getLogger(__name__)

# Larger batches than this run eagerly: few engines run more rows, and each graph costs
# capture time and pool memory.
MAX_BUCKET = 512

GraphMode = Literal["capture", "compile"]


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes a decode step is padded to: 1, 2, 4, 8, then steps of 8 up to 64,
    then of 16, ending at `max_num_seqs` (or `MAX_BUCKET`), which is always a bucket."""
    top = min(max_num_seqs, MAX_BUCKET)
    ladder = [1, 2, 4, *range(8, 65, 8), *range(80, top + 1, 16)]
    return [size for size in ladder if size < top] + [top]


def bucket_for(buckets: Sequence[int], rows: int) -> int | None:
    """The smallest bucket that holds `rows`, or None past the largest."""
    for size in buckets:
        if size >= rows:
            return size
    return None


@dataclass
class GraphStats:
    """What capturing cost, kept by the runner across recaptures."""

    # Graphs captured (or, in compile mode, buckets compiled) since the runner was built.
    captures: int = 0
    # Seconds spent on them, warm-up runs included.
    capture_seconds: float = 0.0
    # Device bytes the graphs held now keep reserved (the memory pool); 0 when none is held.
    pool_bytes: int = 0
    # Steps run on the static buffers: replayed graphs, and eager runs (CPU, compile mode).
    replays: int = 0
    eager_steps: int = 0
    # Static steps per bucket size: how often each padded size ran.
    steps_by_bucket: dict[int, int] = field(default_factory=dict)


class StaticDecode:
    """The static-buffer decode step over one KV cache; dropped (with its graphs) whenever
    the cache or the weights move. `run(items)` returns the step's logits, row i for
    `items[i]`."""

    def __init__(
        self,
        model: Any,
        kv_caches: list[torch.Tensor],
        *,
        buckets: list[int],
        max_model_len: int,
        scratch_block: int,
        device: torch.device,
        capture: bool,
        stats: GraphStats,
        decode_kernel: Callable[..., None] | None = None,
        mode: GraphMode = "capture",
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = buckets
        self.block_size = kv_caches[0].shape[2]
        self.width = -(-max_model_len // self.block_size)
        self.scratch_block = scratch_block
        self.device = device
        self.capture = capture and device.type == "cuda"
        self.mode = mode
        self.stats = stats
        self.decode_kernel = decode_kernel
        largest = buckets[-1]
        self.inputs = torch.zeros(5, largest, dtype=torch.long, device=device)
        self.tables = torch.empty(largest, self.width, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None  # allocated by the first forward (its dtype)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool: Any = None
        self._compiled: Callable[[int], torch.Tensor] | None = None
        self._compiled_sizes: set[int] = set()
        self._reset()

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the static buffers (the graphs' pool is `stats.pool_bytes`)."""
        logits = 0 if self.logits is None else self.logits.nbytes
        return self.inputs.nbytes + self.tables.nbytes + logits

    def bucket_for(self, rows: int) -> int | None:
        return bucket_for(self.buckets, rows)

    def run(
        self,
        items: Sequence[ScheduledSequence],
        before: Callable[[], None] | None = None,
        previous: tuple[torch.Tensor, Mapping[int, int]] | None = None,
    ) -> torch.Tensor:
        """Logits `(len(items), V)` of one decode step; every item is one token (the caller
        checks, with `bucket_for`, that they fit). `before` is called just before the
        forward starts. An item whose input token is still in flight (past its sequence's
        `token_ids`) takes it from `previous`: the previous step's sampled tokens on the
        device and the row of each of its sequences. The rows are views of the static
        buffer: valid until the next run."""
        n = len(items)
        size = self.bucket_for(n)
        if size is None:
            raise ValueError(f"{n} decodes exceed the largest bucket ({self.buckets[-1]})")
        if self.capture and self.mode == "capture" and size not in self.graphs:
            self.capture_bucket(size)
        self._fill(items, size, previous)
        self.stats.steps_by_bucket[size] = self.stats.steps_by_bucket.get(size, 0) + 1
        if before is not None:
            before()
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
            self.stats.replays += 1
        else:
            self._run_eager(size)
            self.stats.eager_steps += 1
        assert self.logits is not None
        return self.logits[:n]

    def capture_all(self) -> None:
        """Capture every bucket not captured yet, largest first (smaller graphs then reuse
        the pool memory of the larger). Nothing on a CPU."""
        if not self.capture or self.mode != "capture":
            return
        for size in reversed(self.buckets):
            if size not in self.graphs:
                self.capture_bucket(size)

    def capture_bucket(self, size: int) -> None:
        """Warm up and capture bucket `size`'s forward (CUDA only); timed into `stats`.
        The pool's bytes are the growth of the device memory torch reserves across the
        capture, taken after emptying its cache (as `torch.cuda.graph` does on entry)."""
        device = self.device
        self._reset()  # the warm-up and the capture write K/V into the scratch slot only
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._forward(size)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(device)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._forward(size)
        torch.cuda.synchronize(device)
        self.graphs[size] = graph
        self.stats.captures += 1
        self.stats.capture_seconds += time.perf_counter() - began
        self.stats.pool_bytes += max(0, torch.cuda.memory_reserved(device) - reserved)

    def drop(self) -> None:
        """Forget the graphs and their pool (their memory returns to the caching allocator)."""
        self.graphs.clear()
        self._pool = None
        self._compiled = None
        self._compiled_sizes.clear()
        self.stats.pool_bytes = 0

    # ---- inside ----------------------------------------------------------------------
    def _reset(self) -> None:
        """Every row a padding row: token 0 at position 0, the scratch slot, length 1."""
        self.inputs.zero_()
        self.inputs[2].fill_(self.scratch_block * self.block_size)
        self.inputs[3].fill_(1)
        self.tables.fill_(self.scratch_block)

    def _fill(
        self,
        items: Sequence[ScheduledSequence],
        size: int,
        previous: tuple[torch.Tensor, Mapping[int, int]] | None = None,
    ) -> None:
        bs, scratch = self.block_size, self.scratch_block
        pad = size - len(items)
        ids, positions, slots, lens, sources = [], [], [], [], []
        widths = []
        for item in items:
            seq, pos = item.seq, item.start
            if pos < len(seq.token_ids):
                ids.append(seq.token_ids[pos])
                sources.append(-1)
            else:  # sampled by the previous step, not landed yet
                if previous is None:
                    raise ValueError(f"{seq!r}: its input token is in flight")
                ids.append(0)
                sources.append(previous[1][seq.seq_id])
            positions.append(pos)
            slots.append(seq.block_ids[pos // bs] * bs + pos % bs)
            lens.append(pos + 1)
            widths.append(pos // bs + 1)
        width = max(widths)
        rows: list[int] = []
        for item, w in zip(items, widths, strict=True):
            rows.extend(item.seq.block_ids[:w])
            rows.extend([scratch] * (width - w))
        rows.extend([scratch] * (width * pad))
        # From pinned memory without a wait: a copy from pageable memory synchronizes the
        # stream, which would hold this step's launch until the step before it is done.
        pinned = self.device.type == "cuda"
        host = torch.tensor(
            [
                ids + [0] * pad,
                positions + [0] * pad,
                slots + [scratch * bs] * pad,
                lens + [1] * pad,
                sources + [-1] * pad,
            ],
            dtype=torch.long,
            pin_memory=pinned,
        )
        self.inputs[:, :size].copy_(host, non_blocking=pinned)
        if previous is not None and any(s >= 0 for s in sources):
            ids_now, source = self.inputs[0, :size], self.inputs[4, :size]
            fed = previous[0].index_select(0, source.clamp(min=0))
            ids_now.copy_(torch.where(source >= 0, fed, ids_now))
        table = torch.tensor(rows, dtype=torch.long, pin_memory=pinned).view(size, width)
        self.tables[:size, :width].copy_(table, non_blocking=pinned)

    def _run_eager(self, size: int) -> None:
        if self.mode != "compile" or self.device.type != "cuda":
            self._forward(size)
            return
        if self.logits is None:  # the buffer exists before anything is compiled
            self._forward(size)
            return
        if self._compiled is None:
            # The buffers and the cache keep their addresses: Inductor's graphs may then
            # write into them (the K/V) and read them without copies.
            for tensor in (self.inputs, self.tables, *self.kv_caches):
                torch._dynamo.mark_static_address(tensor)
            # One compiled graph per bucket (`size` is a constant of each): let Dynamo keep
            # them all rather than fall back to eager past its default limit.
            config = torch._dynamo.config
            config.recompile_limit = max(config.recompile_limit, len(self.buckets) + 1)
            self._compiled = torch.compile(
                self._model_logits, mode="reduce-overhead", dynamic=False
            )
        began = time.perf_counter()
        logits = self._compiled(size)
        self.logits[:size].copy_(logits)
        if size not in self._compiled_sizes:
            self._compiled_sizes.add(size)
            self.stats.captures += 1
            self.stats.capture_seconds += time.perf_counter() - began

    def _forward(self, size: int) -> None:
        """The model over the first `size` rows of the buffers, logits into `self.logits`,
        with the fused Triton kernels on (`triton_fused`; where the runner installed them)."""
        with triton_fused.active():
            logits = self._model_logits(size)
        if self.logits is None:
            self.logits = torch.empty(
                self.buckets[-1], logits.shape[-1], dtype=logits.dtype, device=self.device
            )
        self.logits[:size].copy_(logits)

    def _model_logits(self, size: int) -> torch.Tensor:
        metadata = PagedAttentionMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=self.inputs[2, :size],
            decode_batch=(self.tables[:size], self.inputs[3, :size]),
            decode_kernel=self.decode_kernel,
        )
        logits: torch.Tensor = self.model(
            input_ids=self.inputs[0:1, :size],
            position_ids=self.inputs[1:2, :size],
            logits_to_keep=0,  # every row
            use_cache=False,
            paged_metadata=metadata,
        ).logits[0]
        return logits
