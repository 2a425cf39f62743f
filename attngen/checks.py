"""Checking tensors against a kernel's spec before any launch.

Every check raises `KernelInputError` (a ValueError) or TypeError naming the argument and what was
expected, so a bad call never reaches the GPU and never computes garbage. What is checked here, and
what is left to the caller, is listed in the README's "Errors and guarantees".
"""

from __future__ import annotations

import math
import numbers

import torch

from .errors import KernelInputError
from .spec import MIN_SCALE, Spec

INT32_MAX = 2**31 - 1
# CUDA's limit on the second and third grid dimensions, which carry heads and batch.
GRID_YZ_MAX = 65535
# Longer sequences would overflow the 32-bit block offsets (start + arange) inside the kernel.
MAX_SEQ = 2**30
# The kernel folds log2(e) into the scale in fp32; a larger scale is inf there.
MAX_SCALE = torch.finfo(torch.float32).max / math.log2(math.e)


def _runtime_device_ok(name: str, t: torch.Tensor) -> None:
    from .runtime import interpreting

    if t.device.type == "cuda":
        current = torch.cuda.current_device()
        if t.device.index is not None and t.device.index != current:
            raise KernelInputError(
                f"{name} is on {t.device} but the current CUDA device is cuda:{current}; Triton launches "
                f"on the current device: call the kernel under torch.cuda.device({name}.device)"
            )
        return
    if t.device.type == "cpu" and interpreting():
        return
    if t.device.type == "cpu":
        raise KernelInputError(
            f"{name} is on the CPU; attngen kernels run on a CUDA GPU "
            "(set TRITON_INTERPRET=1 to run them, slowly, in Triton's CPU interpreter)"
        )
    raise KernelInputError(f"{name} is on {t.device}; attngen kernels run on CUDA GPUs")


def check_tensor(name: str, t, dims: int, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if t.layout is not torch.strided:
        raise KernelInputError(f"{name} is a {t.layout} tensor; attngen kernels take dense (strided) tensors")
    if t.dim() != dims:
        raise KernelInputError(f"{name} must have {dims} dimensions {what}; got shape {tuple(t.shape)}")
    return t


def check_indexing(name: str, t: torch.Tensor, inner_dims: int = 2) -> None:
    """The kernels address the last `inner_dims` dimensions of a tensor (one (batch, head) slice)
    with 32-bit integers and the leading ones with 64-bit: a slice must span fewer than 2**31
    elements, or offsets would wrap around and read or write the wrong memory."""
    sizes, strides = t.shape[-inner_dims:], t.stride()[-inner_dims:]
    if sizes[0] > MAX_SEQ:
        raise KernelInputError(f"{name} has sequence length {sizes[0]:,}; the limit is {MAX_SEQ:,}")
    span = sum((n - 1) * s for n, s in zip(sizes, strides) if n > 0)
    if span > INT32_MAX:
        raise KernelInputError(
            f"{name} spans {span + 1:,} elements within one (batch, head) slice (shape {tuple(t.shape)}, "
            f"strides {t.stride()}); the kernel indexes a slice with 32-bit offsets, so it must span fewer "
            f"than 2**31: make the sequence dimension denser (e.g. {name}.contiguous()) or split it"
        )


def check_attention_inputs(spec: Spec, q, k, v, names: tuple[str, str, str] = ("q", "k", "v")) -> None:
    """q (B, H, N_Q, D), k and v (B, H_KV, N_K, D), matching the spec's dtype, head dim and heads."""
    layout = "(batch, heads, seq, head_dim)"
    qn, kn, vn = names
    for name, t in zip(names, (q, k, v)):
        check_tensor(name, t, 4, layout)
        if t.dtype != spec.dtype.torch:
            raise KernelInputError(f"{name} has dtype {t.dtype}; kernel '{spec.name}' takes {spec.dtype.torch}")
        if t.shape[-1] != spec.head_dim:
            raise KernelInputError(
                f"{name} has head_dim {t.shape[-1]}; kernel '{spec.name}' takes head_dim {spec.head_dim}"
            )
        check_indexing(name, t)
        _runtime_device_ok(name, t)
    if not (q.device == k.device == v.device):
        raise KernelInputError(f"{qn}, {kn} and {vn} must be on one device; got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise KernelInputError(f"{kn} and {vn} must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise KernelInputError(f"{qn} has batch {q.shape[0]} but {kn} and {vn} have batch {k.shape[0]}")
    check_heads(spec, q.shape[1], k.shape[1], qn, kn, vn)
    check_grid(q.shape[0], q.shape[1], qn)


def check_heads(spec: Spec, heads: int, kv_heads: int, q_name: str, k_name: str, v_name: str = "v") -> None:
    if kv_heads == 0 or heads % kv_heads:
        raise KernelInputError(
            f"{q_name} has {heads} heads, which is not a multiple of the {kv_heads} heads of {k_name} and {v_name}"
        )
    if spec.heads is not None and heads != spec.heads:
        raise KernelInputError(f"{q_name} has {heads} heads; kernel '{spec.name}' takes heads = {spec.heads}")
    if spec.kv_heads is not None and kv_heads != spec.kv_heads:
        raise KernelInputError(f"{k_name} has {kv_heads} heads; kernel '{spec.name}' takes kv_heads = {spec.kv_heads}")
    if spec.group is not None and heads // kv_heads != spec.group:
        raise KernelInputError(
            f"{q_name} and {k_name} have {heads} and {kv_heads} heads (group {heads // kv_heads}); "
            f"kernel '{spec.name}' takes group = {spec.group}"
        )


def check_grid(batch: int, heads: int, name: str) -> None:
    if batch > GRID_YZ_MAX or heads > GRID_YZ_MAX:
        raise KernelInputError(
            f"{name} has batch {batch} and {heads} heads; each must be at most {GRID_YZ_MAX} "
            "(a CUDA grid dimension): split the call"
        )


def check_scale(scale, spec: Spec | None = None, name: str = "scale") -> float:
    """A finite positive Python or numpy real number (not a bool or a tensor) in the range the
    kernels compute correctly; None means the spec's scale."""
    if scale is None and spec is not None:
        return spec.softmax_scale
    if isinstance(scale, (bool, torch.Tensor)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{name} must be a Python number, not {type(scale).__name__}")
    value = float(scale)
    if not math.isfinite(value):
        raise KernelInputError(f"{name} must be finite; got {value}")
    if value > MAX_SCALE:
        raise KernelInputError(f"{name} = {value:g} overflows float32 inside the kernel; it must be below {MAX_SCALE:.3g}")
    if value < MIN_SCALE:
        # NOTE: the kernels scale scores after masking them to -inf and after taking their row
        # maximum (fold-scale pass): a zero scale gives -inf * 0 = NaN, and a negative one makes that
        # maximum the minimum. A scale too small for fp32 is zero there.
        raise KernelInputError(f"{name} = {value:g} is not supported; attngen kernels take a scale of at least {MIN_SCALE:g}")
    return value


def check_like(t, like: torch.Tensor, name: str) -> None:
    """A tensor the kernel reads (e.g. the output gradient) must match `like`; any strides work."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if t.layout is not torch.strided or t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
        raise KernelInputError(
            f"{name} must be {tuple(like.shape)} {like.dtype} on {like.device}; "
            f"got {tuple(t.shape)} {t.dtype} on {t.device}"
        )
    check_indexing(name, t)


def check_out(out, like: torch.Tensor, name: str = "out", inputs: dict | None = None) -> None:
    """A tensor the kernel writes must match `like` and own its memory: no element twice, nothing
    shared with `inputs` (name -> tensor), since some programs read inputs while others write."""
    check_like(out, like, name)
    if has_internal_overlap(out):
        raise KernelInputError(
            f"{name} has strides {out.stride()} for shape {tuple(out.shape)}, so some of its elements share "
            f"memory (an expanded or overlapping view); the kernel needs a distinct place for every output"
        )
    for other, t in (inputs or {}).items():
        if shares_memory(out, t):
            raise KernelInputError(f"{name} shares memory with {other}; pass an output that does not overlap the inputs")


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether two indices of `t` may address the same element. Conservative: a layout that fails
    the usual test (sorted by stride, each stride clears the extent of the smaller ones) counts as
    overlapping even in the rare case that it does not."""
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1)
    extent = 0
    for stride, size in dims:
        if stride <= extent:
            return True
        extent += stride * (size - 1)
    return False


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges `a` and `b` span in one storage intersect (interleaved views that
    never touch the same element count too: cheap, and on the safe side)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def byte_range(t: torch.Tensor) -> tuple[int, int]:
        start = t.storage_offset() * t.element_size()
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) * t.element_size()
        return start, start + last + t.element_size()

    (a0, a1), (b0, b1) = byte_range(a), byte_range(b)
    return a0 < b1 and b0 < a1
