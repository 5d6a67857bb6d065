"""Safe, measurable loading helpers shared by every backend.

Weights are read from safetensors only; a folder holding only pickle checkpoints (`*.bin`,
`*.pt`, `*.pth`, `*.ckpt`) is refused unless the deployment explicitly allows pickle.
`load_pretrained` / `load_causal_lm` bring a transformers model up at close to the cost of
`safetensors.torch.load_file` plus building the module tree (no random initialisation of
weights that are overwritten right after); `benchmarks/swap.py` measures the gap.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode

from backends.errors import LoadError
from backends.load_cancel import check_cancelled

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl"})

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

# Bytes per element of the safetensors dtype names found in file headers.
SAFETENSORS_DTYPE_BYTES: dict[str, int] = {
    "F64": 8, "I64": 8, "U64": 8,
    "F32": 4, "I32": 4, "U32": 4,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip


class WeightTransform(Protocol):
    """Changes a model's weights as its checkpoint is read (quantization while loading):
    `prepare` adapts the just-built model and names the checkpoint tensors to convert,
    `convert` turns one of them into the model's tensors (name -> tensor), and `apply` does
    the same to a model that was loaded whole (the reference path)."""

    def prepare(self, model: torch.nn.Module) -> set[str]: ...

    def convert(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def apply(self, model: torch.nn.Module) -> int: ...


def parse_dtype(name: str | None) -> torch.dtype | None:
    """`"bfloat16"` -> torch.bfloat16; None or "auto" -> None (keep the checkpoint's dtype)."""
    if name is None or name == "auto":
        return None
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        known = sorted(set(_DTYPES))
        raise LoadError(f"unknown dtype {name!r}; use one of {known} or 'auto'") from None


def safetensors_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.safetensors") if p.is_file())


def require_safe_weights(folder: Path, *, allow_pickle: bool = False) -> list[Path]:
    """The folder's safetensors files; raise LoadError when only pickle weights are present."""
    weights = safetensors_files(folder)
    if weights:
        return weights
    pickles = sorted(p.name for p in folder.rglob("*") if p.suffix in PICKLE_SUFFIXES)
    if pickles and not allow_pickle:
        raise LoadError(
            f"{folder} holds only pickle checkpoints ({', '.join(pickles[:5])}); pickle can run "
            "arbitrary code on load, so only safetensors weights are accepted "
            "(set allow_pickle to override)"
        )
    if not pickles:
        raise LoadError(f"{folder} holds no weights (no *.safetensors file)")
    return []


@dataclass(frozen=True)
class HeaderTensor:
    """A tensor as a safetensors header describes it: name, dtype ("F32", "BF16", "I8", ...)
    and shape."""

    name: str
    dtype: str
    shape: list[int]

    @property
    def floating(self) -> bool:
        return self.dtype.startswith(("F", "BF"))


def header_tensors(files: Iterable[Path]) -> list[HeaderTensor]:
    """Every tensor of these safetensors files, read from their headers only."""
    tensors = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                sl = f.get_slice(name)
                tensors.append(HeaderTensor(name, sl.get_dtype(), list(sl.get_shape())))
    return tensors


# The CUDA caching allocator hands out blocks in multiples of 512 bytes; a request past
# 1 MiB comes from the large pool, whose segments are cut from the driver in 2 MiB steps,
# and the tail of a segment too small to split off stays with the tensor.
CUDA_BLOCK_BYTES = 512
CUDA_SMALL_BYTES = 2**20
CUDA_SEGMENT_BYTES = 2 * 2**20


def cuda_allocation_bytes(nbytes: int) -> int:
    """Bytes the CUDA caching allocator holds for one tensor of `nbytes`: rounded up to a
    512-byte block, and past 1 MiB to a whole 2 MiB segment step (an upper bound: a large
    segment's tail of more than 1 MiB can serve another tensor)."""
    if nbytes <= 0:
        return 0
    if nbytes <= CUDA_SMALL_BYTES:
        return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return -(-nbytes // CUDA_SEGMENT_BYTES) * CUDA_SEGMENT_BYTES


def tensor_bytes_from_headers(
    files: Iterable[Path],
    dtype: torch.dtype | None = None,
    *,
    size_of: Callable[[str, list[int], int], int] | None = None,
    device: str | None = None,
) -> int:
    """Bytes the tensors of these safetensors files take once loaded, read from the headers
    only (`tensor_bytes`)."""
    return tensor_bytes(header_tensors(files), dtype, size_of=size_of, device=device)


def tensor_bytes(
    tensors: Iterable[HeaderTensor],
    dtype: torch.dtype | None = None,
    *,
    size_of: Callable[[str, list[int], int], int] | None = None,
    device: str | None = None,
) -> int:
    """Bytes these tensors take once loaded; with `dtype`, floating-point tensors are counted
    as cast to it. `size_of(name, shape, element_size)`, when given, says what a
    floating-point tensor takes instead (a quantized weight). On a CUDA `device` each tensor
    is counted as the caching allocator holds it (`cuda_allocation_bytes`); elsewhere, its
    bytes."""
    total = 0
    target = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
    on_cuda = device is not None and device.startswith("cuda")
    for t in tensors:
        size = SAFETENSORS_DTYPE_BYTES.get(t.dtype, 4)
        if target is not None and t.floating:
            size = target
        if size_of is not None and t.floating:
            nbytes = size_of(t.name, t.shape, size)
        else:
            numel = 1
            for dim in t.shape:
                numel *= dim
            nbytes = numel * size
        total += cuda_allocation_bytes(nbytes) if on_cuda else nbytes
    return total


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage counted once (tied weights)."""
    seen: set[int] = set()
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in seen or tensor.device.type == "meta":
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


# In-place writes that modules make to their parameters while being built: initialisation.
_INIT_WRITES = frozenset(
    {
        "uniform_", "normal_", "trunc_normal_", "fill_", "zero_", "copy_", "random_",
        "exponential_", "log_normal_", "cauchy_", "geometric_", "bernoulli_", "erfinv_",
        "mul_", "div_", "add_", "sub_", "clamp_", "constant_", "ones_", "zeros_", "eye_",
        "dirac_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
        "orthogonal_", "sparse_",
    }
)  # fmt: skip


class _SkipParameterInit(TorchFunctionMode):
    """Skips initialisation writes to parameters; everything else runs as usual."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        check_cancelled()  # building a module tree of a huge config takes a while too
        kwargs = kwargs or {}
        # torch.nn.init functions pass their tensor by keyword when dispatching here.
        target = args[0] if args else kwargs.get("tensor")
        if isinstance(target, torch.nn.Parameter) and getattr(func, "__name__", "") in _INIT_WRITES:
            return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def skip_parameter_init() -> Iterator[None]:
    """Build modules without initialising their parameters.

    Parameters are allocated but never written (untouched pages cost nothing on the CPU), and
    are replaced right after by the checkpoint's tensors; buffers (a rotary embedding's
    `inv_freq`, absent from checkpoints) are computed as usual. It is a torch function mode,
    so it is local to the calling thread: models built concurrently in other threads (a load
    running beside this one) are unaffected, unlike the global patches of `torch.nn.init` that
    meta-device loaders use.
    """
    with _SkipParameterInit():
        yield


def load_pretrained(
    auto_class: Any,
    artifact_dir: Path,
    device: str,
    dtype: torch.dtype | None = None,
    *,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    transform: WeightTransform | None = None,
) -> Any:
    """A transformers model of `auto_class` (`AutoModelForCausalLM`, ...) from a verified
    folder, on `device`, in `dtype` (None: the checkpoint's), with `attn_implementation`
    when given (a registered attention function, as for `from_pretrained`).

    The fast path builds the architecture with `skip_parameter_init`, reads the safetensors
    files straight onto `device` and assigns their tensors (no copy into preallocated
    parameters), so a load costs about `load_file` plus building the module tree.
    Checkpoints it cannot map one to one (renamed keys, quantisation) go through
    `from_pretrained`, the reference path, with the reason logged; a checkpoint that lacks
    weights the config needs (they would be random) fails with LoadError on either path.
    `transform` (quantization) converts each tensor as it is read on the fast path, so the
    load never holds more than one unconverted tensor; on the reference path it converts the
    loaded model.
    """
    from transformers import AutoConfig

    files = require_safe_weights(artifact_dir)
    options: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        options["attn_implementation"] = attn_implementation
    try:
        config = AutoConfig.from_pretrained(
            str(artifact_dir), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as e:
        raise LoadError(f"cannot read the model config in {artifact_dir}: {e}") from e
    try:
        if getattr(config, "quantization_config", None) is not None:
            raise _NeedsReferenceLoader("the checkpoint is quantised")
        model = _load_assigned(auto_class, config, files, device, dtype, options, transform)
    except _NeedsReferenceLoader as why:
        log.info("loading %s with from_pretrained: %s", artifact_dir, why)
        model = _load_reference(auto_class, artifact_dir, device, dtype, options)
        if transform is not None:
            transform.apply(model)
    generation_config = artifact_dir / "generation_config.json"
    if generation_config.is_file() and hasattr(model, "generation_config"):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(artifact_dir))
    model.eval()
    model.requires_grad_(False)
    return model


def load_causal_lm(
    artifact_dir: Path,
    device: str,
    dtype: torch.dtype | None = None,
    *,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    transform: WeightTransform | None = None,
) -> Any:
    """A causal LM (`AutoModelForCausalLM`) loaded by `load_pretrained`."""
    from transformers import AutoModelForCausalLM

    return load_pretrained(
        AutoModelForCausalLM,
        artifact_dir,
        device,
        dtype,
        trust_remote_code=trust_remote_code,
        attn_implementation=attn_implementation,
        transform=transform,
    )


class _NeedsReferenceLoader(Exception):
    """The fast path cannot load this checkpoint faithfully; use from_pretrained."""


def _load_assigned(
    auto_class: Any,
    config: Any,
    files: list[Path],
    device: str,
    dtype: torch.dtype | None,
    options: dict[str, Any],
    transform: WeightTransform | None = None,
) -> Any:
    # Built on the CPU whatever the target: its uninitialised parameters are never touched,
    # so they cost no memory there, and the checkpoint's tensors land on `device` directly.
    with skip_parameter_init():
        model = auto_class.from_config(config, **options)
    converted = transform.prepare(model) if transform is not None else set()
    expected = set(model.state_dict().keys())
    prefix = getattr(model, "base_model_prefix", "")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        for key, tensor in _read_tensors(path, device):
            name = _model_key(key, expected, prefix)
            if name is None:
                continue  # not part of this architecture (e.g. a stale rotary buffer)
            if name in converted and transform is not None:
                # Converted from the checkpoint's tensor (memory-mapped, no copy); cast only
                # to a narrower dtype, whose rounding the model would have seen.
                if dtype is not None and torch.finfo(dtype).bits < torch.finfo(tensor.dtype).bits:
                    tensor = tensor.to(dtype)
                state.update(transform.convert(name, tensor))
                continue
            if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            state[name] = tensor
    loaded = {t.data_ptr() for t in state.values()}
    result = model.load_state_dict(state, strict=False, assign=True)
    del state
    model.tie_weights()
    # A weight the checkpoint lacks is fine only when tying made it share a loaded tensor.
    untied = [k for k in result.missing_keys if _tensor(model, k).data_ptr() not in loaded]
    if untied:
        raise _NeedsReferenceLoader(f"{len(untied)} weights not in the checkpoint ({untied[:3]})")
    # Buffers computed at build time (rotary tables) sit on the CPU; bring them along.
    if torch.device(device).type != "cpu":
        model.to(device)
    return model


def _read_tensors(path: Path, device: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one safetensors file, read onto `device` one at a time (as
    `load_file` does), the load's cancellation checked before each."""
    with safe_open(str(path), framework="pt", device=device) as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            check_cancelled()
            yield key, f.get_tensor(key)


def _tensor(model: torch.nn.Module, name: str) -> torch.Tensor:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return model.get_buffer(name)


def _model_key(key: str, expected: set[str], prefix: str) -> str | None:
    """The model's name for checkpoint key `key`: as is, with or without the base prefix."""
    if key in expected:
        return key
    if prefix and f"{prefix}.{key}" in expected:
        return f"{prefix}.{key}"
    if prefix and key.startswith(prefix + ".") and key[len(prefix) + 1 :] in expected:
        return key[len(prefix) + 1 :]
    return None


def _load_reference(
    auto_class: Any,
    artifact_dir: Path,
    device: str,
    dtype: torch.dtype | None,
    options: dict[str, Any],
) -> Any:
    try:
        model, info = auto_class.from_pretrained(
            str(artifact_dir),
            dtype=dtype if dtype is not None else "auto",
            local_files_only=True,
            use_safetensors=True,
            output_loading_info=True,
            **options,
        )
    except Exception as e:
        raise LoadError(f"cannot load {artifact_dir}: {e}") from e
    # transformers fills weights the checkpoint lacks with random values (tied ones are not
    # reported missing); a model answering from those is worse than no model.
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise LoadError(
            f"{artifact_dir} lacks {len(missing)} weights its config needs ({missing[:3]}); "
            "loading it would initialise them at random. Register a config that matches "
            "the checkpoint"
        )
    return model.to(device)
