"""One Triton kernel each for the small operations of a transformers decoder layer on CUDA:
RMSNorm, the rotary position embedding, and the MLP's SiLU-and-multiply.

Why: in eager transformers code each of these is several kernels: an RMSNorm is eight
(two casts, a power, a mean, an add, an rsqrt, two products), the rotary embedding of the
queries and keys ten (products, negations, concatenations, sums), the activation two. A
decode step works on a few rows, so each of those kernels runs for a few microseconds and
the step's time is their count: they were 28 of the ~42 kernels a layer of a captured decode
step replayed. Fused, a layer runs 5 of them (a 1.1B Llama's step: 933 kernels -> 420).

Contract: `install(model)` changes this model's modules only: the forward of each RMSNorm
whose code is Llama's and of each MLP whose code is Llama's with a SiLU activation, and the
rotary function of each transformers modeling module whose code is Llama's (`rotate_half`
included), which is a module global. The kernels run only inside `active()` (a thread-local
flag), which the static decode step sets around its forward, so they are captured into its
CUDA graphs and any other code in the process, another transformers model included, keeps
its own. Eager steps (prefills, mixed steps) keep the torch code: there every launch is paid
on the host, and Triton's Python launcher costs more per call than the several torch kernels
a fused one replaces (a 512-token prefill step took 28.7 ms with them, 16.0 ms without, on an
H200). Each kernel computes what the code it replaces computes, in the same dtypes
with the same roundings (each torch op's result rounded to its tensor's dtype, as torch
does); only the order of a sum and the last bit of a transcendental may differ. The torch
code runs instead wherever a tensor is not on CUDA, its layout or dtypes are not the usual
ones, autograd records, or the kernels disagreed with torch on a first small call on the
device (`works_on`, logged once). So a model moved between the CPU and a GPU keeps working.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from backends.llm.triton_decode import next_pow2

log = logging.getLogger(__name__)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Set while a model with fused operations runs its forward on this thread.
_ACTIVE = threading.local()


def install(model: nn.Module) -> int:
    """Fuse what this model's code allows (see the module docstring); how many modules and
    modeling functions were changed (0 without Triton)."""
    if _build() is None:
        return 0
    norms, mlps, modeling = plan(model)
    for module in norms:
        module.forward = types.MethodType(_rms_norm_forward(type(module).forward), module)
    for module in mlps:
        module.forward = types.MethodType(_mlp_forward(type(module).forward), module)
    for m in modeling:
        _wrap_rotary(m)
    return len(norms) + len(mlps) + len(modeling)


def plan(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module], list[types.ModuleType]]:
    """What `install` fuses in `model`: its RMSNorms with Llama's code, its MLPs with Llama's
    code and a SiLU activation, and the modeling modules of its classes whose rotary function
    (and `rotate_half`) is Llama's."""
    from transformers.models.llama import modeling_llama as llama

    norms: list[nn.Module] = []
    mlps: list[nn.Module] = []
    names: set[str] = set()
    for module in model.modules():
        cls = type(module)
        names.add(cls.__module__)
        if _same_code(cls.forward, llama.LlamaRMSNorm.forward) and hasattr(
            module, "variance_epsilon"
        ):
            norms.append(module)
        elif (
            _same_code(cls.forward, llama.LlamaMLP.forward)
            and _is_silu(getattr(module, "act_fn", None))
            and all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj"))
        ):
            mlps.append(module)
    modeling: list[types.ModuleType] = []
    for name in sorted(names):
        source = sys.modules.get(name)
        fn = getattr(source, "apply_rotary_pos_emb", None)
        if (
            source is not None
            and fn is not None
            and (
                getattr(fn, "_hub_fused", False)
                or (
                    _same_code(fn, llama.apply_rotary_pos_emb)
                    and _same_code(getattr(source, "rotate_half", None), llama.rotate_half)
                )
            )
        ):
            modeling.append(source)
    return norms, mlps, modeling


@contextmanager
def active() -> Iterator[None]:
    """The fused kernels on for the code run inside this block, on this thread: the static
    decode step runs its forward (and captures its graphs) in one."""
    before = getattr(_ACTIVE, "on", False)
    _ACTIVE.on = True
    try:
        yield
    finally:
        _ACTIVE.on = before


# ---- the kernels' callers ------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x.float() * rsqrt(mean(x.float() ** 2, -1) + eps)).to(x.dtype)` over the
    last dimension (Llama's RMSNorm), in the dtype torch would give that product."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        block = next_pow2(n)
        _build().rms_norm[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), out.stride(0), n, float(eps),
            BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` for `x` (B, H, T, D) and `cos`, `sin` (B or 1, T, D)
    (Llama's rotary embedding with its default `unsqueeze_dim=1`), each op rounded to x's
    dtype."""
    b, h, t, d = x.shape
    out = torch.empty_like(x)
    if out.numel():
        half = d // 2
        cos_b = cos.stride(0) if cos.shape[0] > 1 else 0
        _build().rotary[(b * t, h)](
            x, cos, sin, out, t,
            x.stride(0), x.stride(1), x.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            cos_b, cos.stride(1),
            HALF=half, HALF_P=max(2, next_pow2(half)), num_warps=1,
        )  # fmt: skip
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`, the activation's result rounded to gate's dtype first (as the two
    torch ops round it)."""
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        block = 1024
        _build().silu_mul[(triton_cdiv(n, block),)](gate, up, out, n, BLOCK=block, num_warps=4)
    return out


def triton_cdiv(n: int, d: int) -> int:
    return -(-n // d)


# ---- when they run -------------------------------------------------------------------------
def works_on(device: torch.device) -> bool:
    """Whether the kernels run on `device` and agree with the torch code there."""
    return device.type == "cuda" and _works_on(str(device))


@functools.cache
def _works_on(device: str) -> bool:
    """Each kernel once on small inputs against the torch code it replaces, in bfloat16 and
    float32: a Triton that cannot compile here (or computes something else) is not used."""
    from transformers.models.llama import modeling_llama as ml

    try:
        gen = torch.Generator().manual_seed(0)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):

            def rand(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
                return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

            x, w = rand(3, 40), rand(40)
            norm = ml.LlamaRMSNorm(40, eps=1e-6).to(device=device, dtype=dtype)
            norm.weight.data.copy_(w)
            with torch.inference_mode():
                _close(rms_norm(x, norm.weight, 1e-6), norm(x), tol, "RMSNorm")
                q = rand(1, 5, 4, 6).transpose(1, 2)  # (1, H, T, D) as the attention has it
                k = rand(1, 5, 2, 6).transpose(1, 2)
                cos, sin = rand(1, 5, 6), rand(1, 5, 6)
                want_q, want_k = ml.apply_rotary_pos_emb(q, k, cos, sin)
                _close(rotary(q, cos, sin), want_q, tol, "rotary (queries)")
                _close(rotary(k, cos, sin), want_k, tol, "rotary (keys)")
                g, u = rand(3, 33), rand(3, 33)
                _close(silu_mul(g, u), nn.functional.silu(g) * u, tol, "SiLU-and-multiply")
        return True
    except Exception as e:
        log.warning("fused Triton kernels not used on %s: %s", device, e)
        return False


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape:
        raise ValueError(f"{what}: {got.dtype} {tuple(got.shape)}, torch gives "
                         f"{want.dtype} {tuple(want.shape)}")  # fmt: skip
    if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
        error = (got.float() - want.float()).abs().max().item()
        raise ValueError(f"{what} disagrees with torch (largest difference {error:.3g})")


def _usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels may take these tensors: inside `active()`, on a CUDA device where
    they work, in a float dtype, the last dimension contiguous, nothing for autograd to
    record."""
    first = tensors[0]
    if not first.is_cuda or not getattr(_ACTIVE, "on", False):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t.device != first.device or t.dtype not in _DTYPES or t.stride(-1) != 1:
            return False
        if grad and t.requires_grad:
            return False
    return works_on(first.device)


def _rms_norm_forward(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        if not _usable(hidden_states, self.weight) or self.weight.shape[-1:] != (
            hidden_states.shape[-1],
        ):
            return original(self, hidden_states)
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    return forward


def _mlp_forward(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        if not _usable(x):
            return original(self, x)
        gate, up = self.gate_proj(x), self.up_proj(x)
        if (
            gate.shape != up.shape
            or gate.dtype != up.dtype
            or not (gate.is_contiguous() and up.is_contiguous())
            or not _usable(gate, up)
        ):
            return self.down_proj(self.act_fn(gate) * up)
        return self.down_proj(silu_mul(gate, up))

    return forward


def _wrap_rotary(module: types.ModuleType) -> None:
    """Wrap `module.apply_rotary_pos_emb` (Llama's, see `plan`), once per process."""
    original = module.apply_rotary_pos_emb
    if getattr(original, "_hub_fused", False):
        return

    @functools.wraps(original)
    def apply_rotary_pos_emb(
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        unsqueeze_dim = kwargs.get("unsqueeze_dim", args[0] if args else 1)
        if (
            unsqueeze_dim == 1
            and len(args) + len(kwargs) <= 1
            and _rotary_shapes(q, k, cos, sin)
            and _usable(q, k, cos, sin)
        ):
            return rotary(q, cos, sin), rotary(k, cos, sin)
        result: tuple[torch.Tensor, torch.Tensor] = original(q, k, cos, sin, *args, **kwargs)
        return result

    apply_rotary_pos_emb._hub_fused = True  # type: ignore[attr-defined]
    module.apply_rotary_pos_emb = apply_rotary_pos_emb  # type: ignore[attr-defined]


def _rotary_shapes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The shapes and dtypes the rotary kernel takes: q, k (B, heads, T, D), D even, cos and
    sin (B or 1, T, D) with the same strides, all of one dtype."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    b, _, t, d = q.shape
    return (
        d % 2 == 0
        and k.shape[0] == b
        and k.shape[2:] == (t, d)
        and cos.shape[1:] == (t, d)
        and cos.shape[0] in (1, b)
        and cos.stride() == sin.stride()
        and q.dtype == k.dtype == cos.dtype == sin.dtype
    )


def _same_code(fn: Any, reference: Any) -> bool:
    """Whether two functions run the same code (their bytecode and the names it uses)."""
    fn = getattr(fn, "__wrapped__", fn)
    reference = getattr(reference, "__wrapped__", reference)
    a, b = getattr(fn, "__code__", None), getattr(reference, "__code__", None)
    return a is not None and b is not None and (a.co_code, a.co_names) == (b.co_code, b.co_names)


def _is_silu(act: Any) -> bool:
    if isinstance(act, nn.SiLU):
        return True
    forward = getattr(type(act), "forward", None)
    return type(act).__name__ == "SiLUActivation" and forward is not None


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


@functools.cache
def _build() -> Any:
    """The jitted kernels as a namespace, or None without Triton (defined here: their
    decorator needs it)."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # not installed, or an install that cannot load here
        return None

    @triton.jit  # type: ignore[misc,unused-ignore]
    def rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n, eps, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        variance = tl.sum(x * x, axis=0) / n
        normed = (x * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    # One variant for any number of tokens (Triton would specialize on 1 and multiples of 16).
    @triton.jit(do_not_specialize=["tokens"])  # type: ignore[misc,unused-ignore]
    def rotary_kernel(  # type: ignore[no-untyped-def]
        x_ptr, cos_ptr, sin_ptr, out_ptr, tokens,
        stride_xb, stride_xh, stride_xt, stride_ob, stride_oh, stride_ot, stride_cb, stride_ct,
        HALF: tl.constexpr, HALF_P: tl.constexpr,
    ):  # fmt: skip
        bt = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        b = (bt // tokens).to(tl.int64)
        t = (bt % tokens).to(tl.int64)
        d = tl.arange(0, HALF_P)
        m = d < HALF
        x_row = x_ptr + b * stride_xb + head * stride_xh + t * stride_xt
        c_row = b * stride_cb + t * stride_ct
        x1 = tl.load(x_row + d, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + HALF + d, mask=m, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + c_row + d, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + c_row + HALF + d, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + c_row + d, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + c_row + HALF + d, mask=m, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        # x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype.
        o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
        o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        o_row = out_ptr + b * stride_ob + head * stride_oh + t * stride_ot
        tl.store(o_row + d, o1.to(dt), mask=m)
        tl.store(o_row + HALF + d, o2.to(dt), mask=m)

    @triton.jit(do_not_specialize=["n"])  # type: ignore[misc,unused-ignore]
    def silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + offsets, (act * u).to(dt), mask=mask)

    return types.SimpleNamespace(
        rms_norm=rms_norm_kernel, rotary=rotary_kernel, silu_mul=silu_mul_kernel
    )
