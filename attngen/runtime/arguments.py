"""Checking tensors against a kernel's spec before any launch.

Every check raises `KernelInputError` (a ValueError) or TypeError naming the argument and what was
expected, so a bad call never reaches the GPU and never computes garbage. What is checked here, and
what is left to the caller, is listed in the README's "Errors and guarantees".
"""

from __future__ import annotations

import math
import numbers

import torch

from ..errors import KernelInputError
from ..lang.spec import DESCALES, MAX_HEAD_DIM_V, MIN_SCALE, Spec
from ..env import interpreting

INT32_MAX = 2**31 - 1
# CUDA's limit on the second and third grid dimensions, which carry heads and batch.
GRID_YZ_MAX = 65535
# Longer sequences would overflow the 32-bit block offsets (start + arange) inside the kernel.
MAX_SEQ = 2**30
# The kernel folds log2(e) into the scale in fp32; a larger scale is inf there.
MAX_SCALE = torch.finfo(torch.float32).max / math.log2(math.e)


def _runtime_device_ok(name: str, t: torch.Tensor) -> None:
    """A CUDA tensor on any GPU (the launch paths switch to its device: `on_other_gpu`), or a CPU
    tensor under Triton's interpreter."""
    if t.is_cuda:
        return
    if t.device.type == "cpu" and interpreting():
        return
    if t.device.type == "cpu":
        raise KernelInputError(
            f"{name} is on the CPU; attngen kernels run on a CUDA GPU "
            "(set TRITON_INTERPRET=1 to run them, slowly, in Triton's CPU interpreter)"
        )
    raise KernelInputError(f"{name} is on {t.device}; attngen kernels run on CUDA GPUs")


def tensor_signature(t: torch.Tensor) -> tuple:
    """What the checks read of a tensor but its address: shape, strides, dtype, device, layout and whether it
    requires grad (a part of the API's keys of checked calls, `attngen.api.kvcache._signature`,
    `attngen.api.sdpa._signature`)."""
    return (t.shape, t.stride(), t.dtype, t.device, t.layout, t.requires_grad)


def on_other_gpu(t: torch.Tensor) -> bool:
    """Whether `t` is on a CUDA device other than the current one. Triton launches on the current
    device, so the launch paths then run under `torch.cuda.device(t.device)`; on the usual path
    (one GPU, or the tensor's GPU current) this costs one comparison."""
    return t.is_cuda and t.device.index != torch.cuda.current_device()


def check_tensor(name: str, t, dims: int, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if t.layout is not torch.strided:
        raise KernelInputError(f"{name} is a {t.layout} tensor; attngen kernels take dense (strided) tensors")
    if t.dim() != dims:
        raise KernelInputError(f"{name} must have {dims} dimensions {what}; got shape {tuple(t.shape)}")
    return t


def check_span(name: str, shown: torch.Tensor, sizes, strides, where: str, remedy: str) -> None:
    """The kernel addresses the elements of `sizes` x `strides` (a part of `shown`, named in the
    message) with 32-bit offsets: their span must stay below 2**31 elements, or offsets wrap around
    and read or write the wrong memory."""
    span = 0
    for n, s in zip(sizes, strides):
        if n > 0:
            span += (n - 1) * s
    if span > INT32_MAX:
        raise KernelInputError(
            f"{name} spans {span + 1:,} elements within {where} (shape {tuple(shown.shape)}, "
            f"strides {shown.stride()}); the kernel indexes it with 32-bit offsets, so it must span fewer "
            f"than 2**31: {remedy}"
        )


def check_indexing(name: str, t: torch.Tensor) -> None:
    """The kernels address one (batch, head) slice of a (batch, heads, seq, head_dim) tensor with
    32-bit integers and the leading dimensions with 64-bit: a slice must span fewer than 2**31
    elements, or offsets would wrap around and read or write the wrong memory."""
    *_, n, d = t.shape
    if n > MAX_SEQ:
        raise KernelInputError(f"{name} has sequence length {n:,}; the limit is {MAX_SEQ:,}")
    *_, s_n, s_d = t.stride()
    # NOTE: runs three times per call: the arithmetic inline, check_span only for its message
    if (n - 1) * s_n * (n > 0) + (d - 1) * s_d * (d > 0) > INT32_MAX:
        check_span(name, t, t.shape[-2:], t.stride()[-2:], "one (batch, head) slice",
                   f"make the sequence dimension denser (e.g. {name}.contiguous()) or split it")


def check_packed_indexing(name: str, t: torch.Tensor, group: int, shown: torch.Tensor | None = None,
                          remedy: str = "pass fewer queries per call") -> None:
    """Packed-GQA kernels (decoding specs, `pack_gqa = true`) give one program the `group` query heads
    of a K/V head: its rows, (query, head) pairs, are numbered in 32 bits, and the heads, queries and
    head dim of one group of `t` (batch, heads, seq, head_dim) are addressed with 32-bit offsets.
    `shown` is the tensor the caller passed, when `t` is a view of it."""
    shown = t if shown is None else shown
    rows = group * t.shape[2]
    if rows > MAX_SEQ:
        raise KernelInputError(
            f"{name} has {t.shape[2]:,} queries x {group} query heads per K/V head = {rows:,} rows for one "
            f"program's tiles; the limit is {MAX_SEQ:,} (32-bit row numbers): {remedy}")
    check_span(name, shown, (group, t.shape[2], t.shape[3]), (t.stride(1), t.stride(2), t.stride(3)),
               f"one group of {group} query heads sharing a K/V head", remedy)


def check_split_launch(batch: int, heads: int, kv_heads: int, seqlen_q: int, head_dim: int, splits: int,
                       q_name: str = "q", k_name: str = "k", splits_name: str = "num_splits") -> None:
    """The launches of a packed-GQA (decoding) kernel with `splits` key/value splits: the partial
    kernel's grid is (row blocks, kv_heads, batch x splits); with more than one split, the merge
    kernel's is (query blocks, heads, batch), and it addresses one sequence's partial outputs
    (splits x heads x seqlen_q x head_dim float32, the split index 32-bit) with 32-bit offsets."""
    if kv_heads > GRID_YZ_MAX:
        raise KernelInputError(f"{k_name} has {kv_heads} heads; at most {GRID_YZ_MAX} (a CUDA grid dimension)")
    if batch * splits > GRID_YZ_MAX:
        if splits == 1:
            raise KernelInputError(f"{q_name} has batch {batch}; at most {GRID_YZ_MAX} (a CUDA grid dimension): "
                                   "split the batch")
        raise KernelInputError(
            f"{q_name} has batch {batch} and {splits_name} = {splits}: the kernel's grid runs batch x splits = "
            f"{batch * splits:,} programs along one axis, at most {GRID_YZ_MAX} (a CUDA grid dimension): pass a "
            f"smaller {splits_name} or split the batch")
    if splits > 1:
        if heads > GRID_YZ_MAX:
            raise KernelInputError(
                f"{q_name} has {heads} heads; with {splits_name} = {splits} the merge kernel runs one program per "
                f"head along a grid axis of at most {GRID_YZ_MAX}: pass {splits_name}=1 or split the heads")
        span = (splits - 1) * heads * seqlen_q * head_dim + seqlen_q * head_dim - 1
        if span > INT32_MAX:
            raise KernelInputError(
                f"{q_name} with {splits_name} = {splits}: the merge kernel reads {splits} x {heads} heads x "
                f"{seqlen_q:,} queries x {head_dim} partial results per sequence with 32-bit offsets, "
                f"{span + 1:,} elements, over 2**31: pass a smaller {splits_name} (1 needs no merge) or fewer "
                "queries per call")


def check_head_dim(spec: Spec, name: str, t, value: bool = False) -> None:
    """`t`'s last dimension is the spec's head dim: head_dim_v for a value or output tensor (`value`)."""
    key, want = ("head_dim_v", spec.head_dim_v) if value and spec.splits_head_dims else ("head_dim", spec.head_dim)
    if t.shape[-1] != want:
        raise KernelInputError(f"{name} has head_dim {t.shape[-1]}; kernel '{spec.name}' takes {key} {want}")


def value_head_dim(v, head_dim: int, name: str = "value") -> int | None:
    """V's head dim for a drop-in call whose q and k have `head_dim`: None where it is that too, else the spec's
    `head_dim_v` (a multiple of 16 up to MAX_HEAD_DIM_V, as the spec key takes it)."""
    head_dim_v = v.shape[-1]
    if head_dim_v == head_dim:
        return None
    if head_dim_v % 16 or not 16 <= head_dim_v <= MAX_HEAD_DIM_V:
        raise KernelInputError(f"{name} has head dim {head_dim_v}, which is not supported: it must be a multiple of 16 "
                               f"from 16 to {MAX_HEAD_DIM_V}")
    return head_dim_v


def check_attention_inputs(spec: Spec, q, k, v, names: tuple[str, str, str] = ("q", "k", "v")) -> None:
    """q (B, H, N_Q, D), k (B, H_KV, N_K, D) and v (B, H_KV, N_K, D_V), matching the spec's dtype (k and v its
    kv_dtype where it sets one), head dims (D_V its head_dim_v) and heads."""
    layout = "(batch, heads, seq, head_dim)"
    qn, kn, vn = names
    for i, (name, t) in enumerate(zip(names, (q, k, v))):
        check_tensor(name, t, 4, layout)
        want = (spec.kv_dtype or spec.dtype).torch if i else spec.dtype.torch
        if t.dtype != want:
            raise KernelInputError(f"{name} has dtype {t.dtype}; kernel '{spec.name}' takes {want}")
        check_head_dim(spec, name, t, value=i == 2)
        check_indexing(name, t)
        _runtime_device_ok(name, t)
    if not (q.device == k.device == v.device):
        raise KernelInputError(f"{qn}, {kn} and {vn} must be on one device; got {q.device}, {k.device}, {v.device}")
    if k.shape[:-1] != v.shape[:-1]:
        raise KernelInputError(f"{kn} and {vn} must have the same shape but for the head dim; got {tuple(k.shape)} "
                               f"and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise KernelInputError(f"{qn} has batch {q.shape[0]} but {kn} and {vn} have batch {k.shape[0]}")
    if spec.v_from_k:
        check_prefix_view(vn, v, kn, k)
    check_heads(spec, q.shape[1], k.shape[1], qn, kn, vn)
    check_grid(q.shape[0], q.shape[1], qn)
    if spec.packs_gqa:
        check_packed_indexing(qn, q, q.shape[1] // k.shape[1])
        if spec.is_split and spec.split_kv is not None:
            # NOTE: `split_kv = auto` splits only launches that leave the GPU mostly idle (a small
            # batch x heads x queries: attngen/policy/splits.py), far from these limits.
            check_split_launch(q.shape[0], q.shape[1], k.shape[1], q.shape[2], v.shape[3], spec.split_kv, qn, kn,
                               "split_kv")


def is_prefix_view(v, k) -> bool:
    """Whether `v` is `k[..., :D_V]`: the same memory, shape and strides but for a shorter last dim (MLA's values
    as a view of its latent cache)."""
    return (v.data_ptr() == k.data_ptr() and v.dtype == k.dtype and v.device == k.device and v.dim() == k.dim()
            and v.shape[:-1] == k.shape[:-1] and v.shape[-1] <= k.shape[-1] and v.stride() == k.stride())


def check_prefix_view(v_name: str, v, k_name: str, k) -> None:
    """For a `v = k[:N]` kernel, which reads V from K's memory: v must be that view, not another tensor."""
    if not is_prefix_view(v, k):
        raise KernelInputError(f"{v_name} must be a view of {k_name}'s first columns ({k_name}[..., :{v.shape[-1]}]): "
                               f"the kernel reads the values from {k_name} (its spec says v = k[:N]); got a tensor "
                               "of its own memory or strides")


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


def check_recording(spec: Spec, grad: bool, traced: bool, out, config) -> None:
    """A call that needs gradients (`grad`) or that torch.compile traces (`traced`) is recorded through
    attngen's autograd: its spec must have a backward, and it takes no out= or config=."""
    if grad and not spec.backward:
        raise KernelInputError(
            f"q, k, v or sinks requires grad, but kernel '{spec.name}' is forward-only: "
            "write direction = forward+backward in its spec (or call it under torch.no_grad())")
    if (grad or traced) and (out is not None or config is not None):
        raise KernelInputError("out= and config= are not supported when recording for autograd")


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


def output_shape(q: torch.Tensor, v: torch.Tensor) -> torch.Size:
    """The shape of the output (and its gradient) of q over v: q's, with v's head dim last (SDPA's rule)."""
    return q.shape[:-1] + v.shape[-1:]


def new_output(q: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised output for q over v, in `dtype` (if None q's, but bfloat16 for float8_e4m3fn q: the FP8
    kernels' output, lang.spec's `DType.output`): laid out like q where v's head dim and the dtype are q's, else
    contiguous."""
    if dtype is None and q.dtype == torch.float8_e4m3fn:
        dtype = torch.bfloat16
    if (dtype is None or dtype == q.dtype) and v.shape[-1] == q.shape[-1]:
        return torch.empty_like(q)
    return q.new_empty(output_shape(q, v), dtype=dtype)


def check_like(t, like: torch.Tensor, name: str, shape: torch.Size | None = None,
               dtype: torch.dtype | None = None) -> None:
    """A tensor the kernel reads (e.g. the output gradient) must match `like` (with `shape` and `dtype` instead of
    its own, where given); any strides work."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    shape = like.shape if shape is None else shape
    dtype = like.dtype if dtype is None else dtype
    if t.layout is not torch.strided or t.shape != shape or t.dtype != dtype or t.device != like.device:
        raise KernelInputError(
            f"{name} must be {tuple(shape)} {dtype} on {like.device}; "
            f"got {tuple(t.shape)} {t.dtype} on {t.device}"
        )
    check_indexing(name, t)


def check_out(out, like: torch.Tensor, name: str = "out", inputs: dict | None = None,
              shape: torch.Size | None = None, dtype: torch.dtype | None = None) -> None:
    """A tensor the kernel writes must match `like` (`shape`, `dtype`: as check_like) and own its memory: no element
    twice, nothing shared with `inputs` (name -> tensor), since some programs read inputs while others write."""
    check_like(out, like, name, shape, dtype)
    if has_internal_overlap(out):
        raise KernelInputError(
            f"{name} has strides {out.stride()} for shape {tuple(out.shape)}, so some of its elements share "
            f"memory (an expanded or overlapping view); the kernel needs a distinct place for every output"
        )
    check_disjoint(out, name, inputs or {})


def check_disjoint(out, name: str, inputs: dict) -> None:
    """check_out's part that reads addresses: `out` shares no memory with `inputs` (name -> tensor)."""
    for other, t in inputs.items():
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


def gradient_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """Uninitialised (dq, dk, dv), laid out as `empty_like` lays out q, k and v; one laid out afresh (its input is
    expanded) is checked for the kernels' 32-bit indexing, as the inputs were."""
    grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for name, g, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        if g.stride() != like.stride():
            check_indexing(name, g)
    return grads


_UNIT_DESCALES: dict = {}


def unit_descale(device: torch.device) -> torch.Tensor:
    """A (1,) float32 one on `device`: the descale of a tensor given without one (one per device, never written)."""
    found = _UNIT_DESCALES.get(device)
    if found is None:
        found = _UNIT_DESCALES[device] = torch.ones(1, device=device, dtype=torch.float32)
    return found


_TENSOR_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int32": torch.int32}


def check_runtime_tensors(spec: Spec, q: torch.Tensor, given: dict, batch: int | None = None,
                          kv_heads: int | None = None) -> tuple:
    """The run-time tensors of a variant spec (declared tensors, ALiBi's slopes, the sinks) from a call's
    keywords, in `Variant.runtime_tensors` order, each checked against q (B, H, N_Q, D): a missing or unknown
    keyword is a TypeError naming it, a wrong shape, dtype or device a KernelInputError.

    ALiBi's slopes are (H,) or (B, H) float32; the sinks (H,) float32 or the kernel's dtype (their
    gradient comes back in theirs); a declared tensor is exactly its declared shape (B and H read from q)
    and dtype. attngen computes gradients for the sinks only: a slope or declared tensor that requires
    grad while grad mode is on is refused, not treated as a constant (its gradient would silently be
    missing). `batch`: the number of sequences where q's first dimension is not it (packed varlen q).

    FP8 descales (an FP8 spec's q_descale, k_descale and v_descale, an FP8 cache's k_descale and v_descale) are
    float32, (1,), (kv_heads,) or (batch, kv_heads) (`kv_heads`: k's or the cache's heads); one not given is 1."""
    variant = spec.variant
    names = spec.runtime_tensors()
    unknown = sorted(set(given) - set(names))
    if unknown:
        takes = ", ".join(f"{n}=" for n in names) or "no tensor keywords"
        raise TypeError(f"kernel '{spec.name}' got the unexpected keyword {unknown[0]}= (its spec takes {takes})")
    batch, heads = q.shape[0] if batch is None else batch, q.shape[1]
    out = []
    for name in names:
        t = given.get(name)
        if t is None and name in DESCALES:
            t = unit_descale(q.device)
        if t is None:
            raise TypeError(f"kernel '{spec.name}' needs the tensor {name}= (its spec declares it)")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
        decl = variant.tensor(name)
        if decl is not None:
            shapes = [tuple(batch if d == "B" else heads if d == "H" else d for d in decl.dims)]
            dtypes = [_TENSOR_DTYPES[decl.dtype]]
        elif name == "sinks":
            shapes, dtypes = [(heads,)], [torch.float32, spec.dtype.torch]
        elif name in DESCALES:
            kv = heads if kv_heads is None else kv_heads
            shapes, dtypes = [(1,), (kv,), (batch, kv)], [torch.float32]
        else:  # ALiBi's slopes
            shapes, dtypes = [(heads,), (batch, heads)], [torch.float32]
        if tuple(t.shape) not in shapes:
            against = "(batch, kv_heads)" if name in DESCALES else "q of shape " + str(tuple(q.shape))
            raise KernelInputError(f"{name} has shape {tuple(t.shape)}; kernel '{spec.name}' takes "
                                   + " or ".join(str(s) for s in shapes) + " for " + against)
        if t.dtype not in dtypes:
            raise KernelInputError(f"{name} has dtype {t.dtype}; kernel '{spec.name}' takes "
                                   + " or ".join(str(d) for d in dict.fromkeys(dtypes)))
        if t.layout is not torch.strided or t.device != q.device:
            raise KernelInputError(f"{name} must be a dense tensor on {q.device}; got a {t.layout} tensor on {t.device}")
        if name != "sinks" and t.requires_grad and torch.is_grad_enabled():
            raise KernelInputError(f"{name} requires grad, but attngen computes gradients for q, k, v and sinks only: "
                                   f"pass {name}.detach() to use it as a constant")
        out.append(t)
    return tuple(out)
