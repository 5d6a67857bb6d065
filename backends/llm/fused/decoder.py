"""Which models run fused, and the decoder that points the kernel at one model's tensors."""

from __future__ import annotations

import ctypes
import time
from array import array
from collections.abc import Callable, Mapping
from typing import Any

import torch

from backends.llm.attention import AttentionParams
from backends.llm.cpu_kernels import PagedDecodeKernel
from backends.llm.fused.caches import last_level_cache_bytes, streams_weights
from backends.llm.fused.kernel import CLayer, CModel, CStep, CWeight, FusedKernel, bptr, fptr
from backends.llm.fused.step import FusedStep
from backends.llm.fused.threads import ThreadChoice
from backends.llm.lora.layers import LoRALinear
from backends.llm.quantization import Int8Linear

# Rope types whose frequencies change with the sequence's length (transformers'
# `dynamic_rope_update`): their tables are computed for each step's positions; every other
# type's depend on the position alone and are computed once per position, then looked up.
DYNAMIC_ROPE = ("dynamic", "longrope")

# Model types whose decoder layer is the Llama one: pre-norm RMS norms, q/k/v/o projections
# (biases optional, Qwen2's on q/k/v; Phi-3's q, k and v rows of one weight, and its gate and
# up rows too), per-head q/k norms (Qwen3), full rotary embedding, SwiGLU MLP. Others keep
# the transformers path.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
# Linear layers the kernel reads: float32, and int8 with a scale per output row.
LINEAR_TYPES = (torch.nn.Linear, Int8Linear)
# The kernel's tiles its scratch is sized by: rows of a packed panel (csrc/tiles.h `PANEL`),
# weight rows of a widened int8 block (csrc/project.h `BLOCK_COLUMNS`), tokens whose attention
# logits are held at once (csrc/attend.h `ATTEND_CHUNK`).
_PANEL, _BLOCK_COLUMNS, _ATTEND_CHUNK = 16, 16, 512
# Sample rows whose logits a decoder keeps a buffer for (a decode batch of up to this many
# sequences takes its greedy tokens without allocating anything).
LOGITS_ROWS = 32


def scratch_floats(
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    inter: int,
    max_context: int,
    rows: int,
    threads: int,
) -> int:
    """Floats of the kernel's scratch for steps of up to `rows` rows, as its
    `hub_fused_work_floats` counts them (a test holds the two equal): the step's activations
    and its input packed into panels, and per thread the attention scores (over the longest
    context, or a chunk of it) and two widened int8 blocks."""
    widest = max(hidden, inter, heads * head_dim)
    panels = -(-rows // _PANEL) * _PANEL * widest
    scores = heads * (_ATTEND_CHUNK + 2) if max_context > _ATTEND_CHUNK else heads * max_context
    per_thread = scores + 2 * _BLOCK_COLUMNS * (widest + rows)
    activations = rows * (2 * hidden + 2 * heads * head_dim + 2 * kv_heads * head_dim + inter)
    return activations + panels + threads * per_thread


def predicted_scratch_bytes(
    config: Mapping[str, Any], *, max_context: int, max_rows: int, threads: int
) -> int:
    """What a model of this `config.json` holds for the fused step (`FusedDecoder
    .scratch_bytes`) if its steps run fused: 0 for a family the kernel does not run."""
    if config.get("model_type") not in FAMILIES or config.get("hidden_act") != "silu":
        return 0
    rope = config.get("rope_parameters") or {}
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        return 0
    try:
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        floats = scratch_floats(
            hidden=int(config["hidden_size"]),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            inter=int(config["intermediate_size"]),
            max_context=max_context,
            rows=max_rows,
            threads=threads,
        )
        logits = min(LOGITS_ROWS, max_rows) * int(config["vocab_size"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0  # not a config the decoder could read either
    return 4 * (floats + logits) + 2 * 4 * max_context * head_dim


def unsupported_reason(model: Any) -> str | None:
    """Why `model` cannot run fused, or None when its structure is the one the kernel runs."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type!r} is not one of {', '.join(FAMILIES)}"
    if model.dtype != torch.float32 or model.device.type != "cpu":
        return "the fused step runs float32 models on the CPU"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r} is not silu"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(inner, "rotary_emb"):
        return "no model.layers / model.rotary_emb"
    lm_head = getattr(model, "lm_head", None)
    if type(lm_head) not in LINEAR_TYPES:
        return "the LM head is not a float32 or int8 linear layer (int4 weights?)"
    rope = getattr(config, "rope_parameters", None) or {}
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        return "partial rotary embedding"
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        try:
            parts = projections(layer, config)
        except (AttributeError, ValueError) as e:
            return f"projections the kernel does not read: {e}"
        if any(type(linear) not in LINEAR_TYPES for linear, _ in parts.values()):
            return "a projection is not a float32 or int8 linear layer (int4 weights?)"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [n for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if n]
        if any(norm_eps(n) is None for n in norms):
            return "a norm is not an RMS norm with a weight"
        act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
        if type(act).__name__ != "SiLUActivation" and not isinstance(act, torch.nn.SiLU):
            return "the MLP activation is not SiLU"
    return None


def projections(layer: Any, config: Any) -> dict[str, tuple[Any, slice]]:
    """Each projection the kernel reads (q, k, v, o, gate, up, down) as the linear layer
    holding it and its rows there: a layer of its own, or rows of a fused one (Phi-3's
    `qkv_proj`, q then k then v, and `gate_up_proj`, gate then up). ValueError for a fused
    layer of other rows."""
    attn, mlp = layer.self_attn, layer.mlp
    everything = slice(None)
    parts: dict[str, tuple[Any, slice]]
    if hasattr(attn, "qkv_proj"):
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        qd, kvd = heads * attn.head_dim, kv_heads * attn.head_dim
        qkv = base_linear(attn.qkv_proj)
        if qkv.out_features != qd + 2 * kvd:
            raise ValueError(f"qkv_proj has {qkv.out_features} rows, not {qd} + 2 x {kvd}")
        bounds = {"q": (0, qd), "k": (qd, qd + kvd), "v": (qd + kvd, qd + 2 * kvd)}
        parts = {name: (qkv, slice(*rows)) for name, rows in bounds.items()}
    else:
        parts = {name: (base_linear(getattr(attn, f"{name}_proj")), everything) for name in "qkv"}
    parts["o"] = (base_linear(attn.o_proj), everything)
    if hasattr(mlp, "gate_up_proj"):
        gate_up = base_linear(mlp.gate_up_proj)
        inter = gate_up.out_features // 2
        if gate_up.out_features != 2 * inter:
            raise ValueError(f"gate_up_proj has an odd number of rows ({gate_up.out_features})")
        parts["gate"], parts["up"] = (gate_up, slice(0, inter)), (gate_up, slice(inter, None))
    else:
        parts["gate"] = (base_linear(mlp.gate_proj), everything)
        parts["up"] = (base_linear(mlp.up_proj), everything)
    parts["down"] = (base_linear(mlp.down_proj), everything)
    return parts


def base_linear(module: Any) -> Any:
    """The layer whose weights a projection computes with: a LoRA wrapper's base (adapter
    tokens never run fused; base tokens use exactly the base's weights)."""
    return module.base_layer if isinstance(module, LoRALinear) else module


def norm_eps(norm: Any) -> float | None:
    """The epsilon of a transformers RMS norm (`weight * x / rms(x)`), or None for others."""
    if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "weight"):
        return None
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if eps is not None else None


class FusedDecoder:
    """A model's fused step: `decoder(step)` returns the sample rows' logits (S, V).

    Points the kernel at the model's own weight tensors and at `kv_caches` (holding them, so
    they stay alive while it does). Built anew whenever those tensors are replaced (an
    offload and restore, a new KV cache): the runner does that."""

    def __init__(
        self,
        kernel: FusedKernel,
        model: Any,
        kv_caches: list[torch.Tensor],
        attention: list[AttentionParams],
        *,
        max_context: int,
        max_rows: int,
        threads: int,
    ) -> None:
        config, inner = model.config, model.model
        layers = list(inner.layers)
        if len(attention) != len(layers) or len(kv_caches) != len(layers):
            raise ValueError("fused step: one attention record and KV cache per layer")
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        _, num_blocks, block_size, _, _ = kv_caches[0].shape
        self._kernel = kernel
        self._keep: list[torch.Tensor] = []  # every tensor the structs point into
        # The bytes a one-row step reads: every linear layer's weights (int8 ones with their
        # scales), the LM head's included; `_weight` adds each layer's.
        self.weight_bytes = 0
        self.kv_caches = kv_caches
        self.max_rows = max_rows
        self.threads = threads
        # Picks each step's thread count up to `threads` (None: always all of them).
        self.choice: ThreadChoice | None = None
        self._layers = (CLayer * len(layers))()
        qk_eps = 0.0
        for c, layer, params, kv in zip(self._layers, layers, attention, kv_caches, strict=True):
            attn = layer.self_attn
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            if q_norm is not None:
                qk_eps = norm_eps(q_norm) or 0.0
            c.input_norm = self._ptr(layer.input_layernorm.weight)
            c.post_norm = self._ptr(layer.post_attention_layernorm.weight)
            for name, (linear, rows) in projections(layer, config).items():
                setattr(c, name, self._weight(linear, rows))
            c.q_norm = self._ptr(None if q_norm is None else q_norm.weight)
            c.k_norm = self._ptr(None if k_norm is None else k_norm.weight)
            c.cache = self._ptr(kv)
            c.window = params.sliding_window or 0
            c.scaling = params.scaling
        m = self._model = CModel()
        m.hidden, m.heads, m.kv_heads = config.hidden_size, heads, kv_heads
        m.head_dim = layers[0].self_attn.head_dim
        gate, gate_rows = projections(layers[0], config)["gate"]
        m.inter = gate.out_features if gate_rows.stop is None else gate_rows.stop
        m.vocab, m.layers = model.lm_head.out_features, len(layers)
        m.num_blocks, m.block_size = num_blocks, block_size
        m.max_context, m.threads = max_context, threads
        m.eps, m.qk_eps = norm_eps(layers[0].input_layernorm) or 0.0, qk_eps
        m.embed = self._ptr(inner.embed_tokens.weight)
        m.final_norm = self._ptr(inner.norm.weight)
        m.lm_head = self._weight(model.lm_head, slice(None))
        m.layer = self._layers
        m.stream_weights = int(streams_weights(self.weight_bytes, last_level_cache_bytes()))
        self._work = torch.empty(kernel.work_floats(m, max_rows), dtype=torch.float32)
        self._work_address = self._work.data_ptr()
        self._rotary = inner.rotary_emb
        self._static_rope = getattr(self._rotary, "rope_type", "default") not in DYNAMIC_ROPE
        with torch.no_grad():
            cos, _ = self._rotary(self._work, torch.zeros(1, 1, dtype=torch.long))
        if cos.shape[-1] != m.head_dim:  # the kernel rotates whole heads
            raise ValueError(f"fused step: rotary tables of {cos.shape[-1]} of {m.head_dim} dims")
        self._rope = (torch.empty(0, m.head_dim), torch.empty(0, m.head_dim))  # cos, sin
        self.vocab = int(m.vocab)
        # The logits of up to LOGITS_ROWS sample rows (`greedy`), and a numpy view of them.
        self._logits = torch.empty(min(LOGITS_ROWS, max_rows), self.vocab, dtype=torch.float32)
        self._logits_array = self._logits.numpy()
        self._logits_address = self._logits.data_ptr()
        # The step's struct, reused: only its per-step fields are set each step.
        self._step = CStep()
        self._step.work, self._step.work_floats = self._work_address, self._work.numel()
        # What the decoder holds at most: its scratch, the logits buffer, and rotary tables
        # of every position.
        self.scratch_bytes = (
            self._work.nbytes + self._logits.nbytes + 2 * 4 * max_context * int(m.head_dim)
        )
        self.slots = int(m.num_blocks * m.block_size)

    def check(self, step: FusedStep) -> None:
        """ValueError naming the problem unless `step` fits this decoder: the kernel follows
        every index it is given (tables into the cache, slots, tokens, rows), so a bad one
        must be refused before it runs."""
        rows = len(step.tokens)
        if not 0 < rows <= self.max_rows:
            raise ValueError(f"fused step: {rows} rows, at most {self.max_rows}")
        per_row = (step.positions, step.slots, step.table_starts, step.lens)
        if any(len(values) != rows for values in per_row):
            raise ValueError("fused step: one position, slot, table start and length per row")
        if min(step.tokens) < 0 or max(step.tokens) >= self.vocab:
            raise ValueError(f"fused step: token ids must be in [0, {self.vocab})")
        if min(step.slots) < 0 or max(step.slots) >= self.slots:
            raise ValueError(f"fused step: cache slots must be in [0, {self.slots})")
        if max(step.lens) > self._model.max_context or min(step.lens) < 1:
            raise ValueError(f"fused step: contexts must be 1-{self._model.max_context} tokens")
        if any(p != n - 1 for p, n in zip(step.positions, step.lens, strict=True)):
            raise ValueError("fused step: a row's position must be its context length - 1")
        samples = step.sample_rows
        if len(samples) > rows or len(set(samples)) != len(samples):
            raise ValueError("fused step: each sample row at most once")
        if samples and not 0 <= min(samples) <= max(samples) < rows:
            raise ValueError("fused step: a sample row is not a row of the step")
        # Each row's blocks in its table, each block id in the cache.
        PagedDecodeKernel.check_index_lists(
            step.tables,
            step.table_starts,
            step.lens,
            int(self._model.num_blocks),
            int(self._model.block_size),
        )

    def __call__(
        self,
        step: FusedStep,
        *,
        checked: bool = False,
        before: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """The logits (S, V) of `step.sample_rows`; `checked`: skip `check` (the caller ran
        it, or built `step` with `fused_rows`, whose lists agree by construction; the kernel
        itself still refuses any index out of range); `before` is called last thing before
        the native call (which releases the GIL)."""
        if not checked:
            self.check(step)
        logits = torch.empty(len(step.sample_rows), self.vocab, dtype=torch.float32)
        self._run(step, logits.data_ptr(), before)
        return logits

    def greedy(self, step: FusedStep, *, before: Callable[[], None] | None = None) -> list[int]:
        """The argmax token of each of `step.sample_rows` (the first of equal maxima, a NaN
        counting as the maximum), for a step built by `fused_rows` (not `check`ed: the kernel
        refuses any index out of range, ValueError). Up to LOGITS_ROWS rows, the logits go
        to the decoder's own buffer and numpy picks: no tensor is made."""
        samples = len(step.sample_rows)
        if samples > len(self._logits_array):
            return list(self(step, checked=True, before=before).numpy().argmax(axis=1).tolist())
        self._run(step, self._logits_address, before)
        tokens: list[int] = self._logits_array[:samples].argmax(axis=1).tolist()
        return tokens

    def _run(self, step: FusedStep, logits: int, before: Callable[[], None] | None) -> None:
        """Run `step`, its sample rows' logits written at address `logits`."""
        rows, samples = len(step.tokens), len(step.sample_rows)
        rope_rows = self._rope_tables(step.positions)
        # Every index list in one int64 array (its parts at these offsets), pointed at by
        # address (this frame holds it until the kernel returned): a few list copies in C,
        # where a tensor per list cost ~50 us a step.
        indices = array("q", step.tokens)
        for part in (step.slots, step.table_starts, step.lens, rope_rows, step.sample_rows):
            indices.extend(part)
        indices.extend(step.tables)
        base = indices.buffer_info()[0]
        s = self._step
        s.rows, s.samples = rows, samples
        s.tokens, s.slots, s.table_starts, s.lens, s.rope_rows, s.sample_rows = (
            base + 8 * rows * i for i in range(6)
        )
        s.tables = base + 8 * (5 * rows + samples)
        s.logits, s.table_len = logits, len(step.tables)
        # The calling thread's torch threads, within what the scratch was sized for, or
        # fewer where `choice` has seen fewer run faster (threads.py). Only a step that
        # samples every row (decodes, no prompt chunk) may be spent measuring the side
        # believed slower: a prompt's step is its request's time to first token.
        most = max(1, min(self.threads, torch.get_num_threads()))
        if self.choice is None:
            threads = most
        else:
            threads = self.choice.threads(rows, most, may_probe=samples == rows)
        self._model.threads = threads
        if before is not None:
            before()
        start = time.perf_counter()
        try:
            self._kernel.step(self._model, s)  # ValueError for what check() refuses
        finally:
            self._model.threads = self.threads
        if self.choice is not None:
            self.choice.observe(rows, most, threads, time.perf_counter() - start)

    def _rope_tables(self, positions: list[int]) -> list[int]:
        """Point the step at cos and sin tables (n, head_dim) from the model's own rotary
        module, held until the next step at least, and return each row's index into them: a
        table of every position so far for a static rope type (grown by doubling), this
        step's positions for one whose frequencies depend on the length."""
        if self._static_rope:
            if max(positions) < self._step.rope_len:
                return positions
            size = min(
                max(max(positions) + 1, 2 * self._step.rope_len, 256), self._model.max_context
            )
            positions_now = torch.arange(size, dtype=torch.long)[None]
        else:
            positions_now = torch.tensor([positions], dtype=torch.long)
        cos, sin = self._rotary(self._work, positions_now)
        self._rope = (cos[0].contiguous(), sin[0].contiguous())
        self._step.cos, self._step.sin = self._rope[0].data_ptr(), self._rope[1].data_ptr()
        self._step.rope_len = len(self._rope[0])
        return positions if self._static_rope else list(range(len(positions)))

    def _weight(self, linear: Any, rows: slice) -> CWeight:
        """Rows `rows` of a float32 `nn.Linear` or an `Int8Linear` (its bfloat16 scales
        widened once); a slice of a contiguous weight's rows is contiguous too."""
        w = CWeight()
        if isinstance(linear, Int8Linear):
            if linear.weight.device.type != "cpu" or not linear.weight.is_contiguous():
                raise ValueError("fused step: int8 weights must be contiguous on the CPU")
            weight = linear.weight.detach()[rows]
            self._keep.append(weight)
            w.i8 = bptr(weight)
            scale = linear.scale[rows].float().contiguous()
            w.scale = self._ptr(scale)
            self.weight_bytes += weight.nbytes + scale.nbytes
        else:
            weight = linear.weight[rows]
            w.f32 = self._ptr(weight)
            self.weight_bytes += weight.nbytes
        w.bias = self._ptr(None if linear.bias is None else linear.bias[rows])
        return w

    def _ptr(self, tensor: torch.Tensor | None) -> Any:
        if tensor is None:
            return ctypes.POINTER(ctypes.c_float)()  # NULL
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
            raise ValueError("fused step: every weight must be a float32 CPU tensor")
        if not tensor.is_contiguous():
            raise ValueError("fused step: every weight must be contiguous")
        # A detached view holds the storage itself: a parameter whose data is later replaced
        # must not free what the kernel points at.
        self._keep.append(tensor.detach())
        return fptr(tensor)
