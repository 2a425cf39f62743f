"""Validating a kernel against the float64 reference on fresh random inputs.

For each case the output is poisoned with NaN first, so an element the kernel fails to write shows
up as an error. The kernel's error against float64 is compared with the error a same-precision
PyTorch computation makes on the same inputs: it passes when
`err_kernel <= FUDGE * err_pytorch + ATOL[dtype]` (the scheme of PyTorch's FlexAttention tests),
and the log-sum-exp is held to the same rule. Rows with no visible key must come out as exactly 0
with a log-sum-exp of -inf.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import reference
from .packed import packed_inputs
from ..lang import variants as v
from ..lang.spec import DType, Mask, Spec
from ..env import interpreting

FUDGE = 3.0
# FP8 (e4m3 inputs, a bf16 output): the floor is bf16's, the output's rounding.
ATOL = {DType.FP16: 2e-3, DType.BF16: 1.5e-2, DType.FP32: 2e-5, DType.FP8_E4M3: 1.5e-2}
# ||out - ref|| / ||ref|| must also stay under this: a max-abs rule alone is lenient for bf16, whose
# same-precision reference is poor, and a dropped key block moves the relative error past 5e-2.
# FP8: against float64 of the dequantised inputs, the kernel's only rounding beyond fp32 and the bf16 store
# is P's to e4m3 (3 mantissa bits: a relative 2^-4 at most per weight in the normal range; weights
# below 2^-6 are off by 2^-10 at most, against a row sum >= 1). Each output is a weighted mean of V,
# so its error is at most 2^-4 of the mean of |v| by those weights, and the norm of the errors 2^-4
# of the outputs' norm where the weights' errors do not all lean one way; plus 2^-8, bf16's rounding.
REL_TOL = {DType.FP16: 3e-3, DType.BF16: 1e-2, DType.FP32: 1e-5, DType.FP8_E4M3: 2.0 ** -4 + 2.0 ** -8}
# Gradients go through two more roundings to the input dtype (P and dS before their products).
GRAD_REL_TOL = {DType.FP16: 5e-3, DType.BF16: 2e-2, DType.FP32: 2e-5}


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    kv_heads: int
    n_q: int
    n_k: int

    def __str__(self) -> str:
        return f"B={self.batch} H={self.heads}/{self.kv_heads} N_Q={self.n_q} N_K={self.n_k}"


@dataclass(frozen=True)
class PackedCase:
    """A varlen kernel's case: sequences of these query and key lengths (zero allowed) packed end to end."""

    heads: int
    kv_heads: int
    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]

    @property
    def batch(self) -> int:
        return len(self.lengths_q)

    def __str__(self) -> str:
        return (f"B={self.batch} H={self.heads}/{self.kv_heads} N_Q={'+'.join(map(str, self.lengths_q))} "
                f"N_K={'+'.join(map(str, self.lengths_k))}")


@dataclass(frozen=True)
class Result:
    case: "Case | PackedCase"
    err: float          # max |out - ref64|
    rel: float          # ||out - ref64|| / ||ref64||
    tol: float          # the bound err must stay under
    rel_tol: float      # the bound rel must stay under
    lse_err: float
    lse_tol: float
    problem: str = ""   # why it failed, beyond the numbers
    grads: tuple = ()   # GradResult per gradient, for forward+backward specs

    @property
    def ok(self) -> bool:
        return (not self.problem and self.err <= self.tol and self.rel <= self.rel_tol
                and self.lse_err <= self.lse_tol and all(g.ok for g in self.grads))


@dataclass(frozen=True)
class GradResult:
    name: str
    err: float
    tol: float
    rel: float
    rel_tol: float
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem and self.err <= self.tol and self.rel <= self.rel_tol


def default_cases(spec: Spec, small: bool = False) -> list:
    """Odd sizes, seq 1, seq_q != seq_k (both ways), and a long one (shorter when `small`); for a varlen spec,
    packed batches of such sequences (`PackedCase`)."""
    heads = spec.heads or 2 * (spec.group or 1)
    kv = spec.kv_heads or heads // (spec.group or 1)
    if spec.v_from_k and spec.heads is None:  # MLA: DeepSeek's fewest query heads over one latent head
        heads, kv = 16, 1
    long = 200 if small else 1000
    if spec.varlen:
        return [
            PackedCase(heads, kv, (1,), (1,)),
            PackedCase(heads, kv, (77, 13, 40), (77, 13, 40)),  # documents of unequal lengths
            # seq_q != seq_k both ways, an empty sequence of queries and one of keys (its queries see nothing)
            PackedCase(heads, kv, (5, 0, 37, 3, 17), (9, 4, 37, 0, 40)),
            PackedCase(heads, kv, (1, 1, 77), (long, 77, 90)),  # decodes beside a chunked prefill
            PackedCase(heads, kv, (long, 77), (long, 100)),
        ]
    return [
        Case(1, heads, kv, 1, 1),
        Case(2, heads, kv, 77, 77),
        Case(1, heads, kv, 1, long),
        Case(1, heads, kv, 77, long),
        Case(1, heads, kv, long, 77),
        Case(1, heads, kv, long, long),
    ]


def random_inputs(spec: Spec, case: Case, device, generator=None):
    """Standard normal q, k, v of the case's shapes in the spec's dtype, k and v in its kv_dtype where it sets one
    (FP8 values are the stored e4m3 ones: `runtime_tensors` gives their descales)."""
    dt, kv_dt = spec.dtype.torch, (spec.kv_dtype or spec.dtype).torch
    shape_q = (case.batch, case.heads, case.n_q, spec.head_dim)
    shape_k = (case.batch, case.kv_heads, case.n_k, spec.head_dim)
    shape_v = shape_k[:-1] + (spec.head_dim_v,)
    q = torch.randn(shape_q, generator=generator, device=device, dtype=torch.float32).to(dt)
    k = torch.randn(shape_k, generator=generator, device=device, dtype=torch.float32).to(kv_dt)
    if spec.v_from_k:  # `v = k[:N]` (MLA): the values are a view of the keys' first columns
        return q, k, k[..., :spec.head_dim_v]
    v = torch.randn(shape_v, generator=generator, device=device, dtype=torch.float32).to(kv_dt)
    return q, k, v


def runtime_tensors(spec: Spec, case: Case, device, generator=None) -> dict:
    """Random run-time tensors of a variant spec, by keyword: ALiBi slopes (H,) in (0, 0.1] (a bias of a
    few units across the cases' lengths), sinks (H,) standard normal, declared tensors of their shape and
    dtype (standard normal; int32 in [0, 4)); an FP8 spec's descales per (batch, K/V head) in [0.5, 1.5)."""
    variant = spec.variant
    tensors = {}

    def normal(shape):
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32)

    for decl in variant.tensors:
        shape = tuple(case.batch if d == "B" else case.heads if d == "H" else d for d in decl.dims)
        if decl.dtype == "int32":
            tensors[decl.name] = torch.randint(0, 4, shape, generator=generator, device=device, dtype=torch.int32)
        else:
            tensors[decl.name] = normal(shape).to(DType(decl.dtype).torch)
    if isinstance(variant.score, v.Alibi):
        tensors[v.ALIBI_TENSOR] = 0.1 * (1 - torch.rand(case.heads, generator=generator, device=device))
    if variant.sinks:
        tensors[v.SINKS_TENSOR] = normal(case.heads)
    for name in spec.descales:  # in [0.5, 1.5): every (sequence, K/V head) its own
        tensors[name] = 0.5 + torch.rand(case.batch, case.kv_heads, generator=generator, device=device)
    return tensors


def dequantized(spec: Spec, q, k, v_, tensors: dict):
    """(q, k, v, tensors) as the kernel reads them: the FP8 inputs' stored values times their descales in float64
    (q's per K/V head, shared by its group; a descale not given is 1), the descales taken out of the tensors; a
    16-bit input, and every input of another spec, as it is."""
    if not spec.descales:
        return q, k, v_, tensors
    tensors = dict(tensors)
    factors = {name: tensors.pop(name, None) for name in spec.descales}
    group = q.shape[1] // k.shape[1]

    def descaled(x, name, heads_per_descale=1):
        d = factors.get(name)
        if d is None:
            return x if x.dtype.itemsize > 1 else x.double()
        d = d.double().expand(q.shape[0], k.shape[1]) if d.dim() == 1 else d.double()
        return x.double() * d.repeat_interleave(heads_per_descale, dim=1)[:, :, None, None]

    return descaled(q, "q_descale", group), descaled(k, "k_descale"), descaled(v_, "v_descale"), tensors


def spec_variant(spec: Spec) -> v.Variant:
    """The spec's whole variant as reference.variant_attention reads it: a plain causal mask beside a score
    modifier or sinks (`mask = causal` with `score = alibi`) lives in `spec.mask`, not in the tree; here it is
    the tree's `Causal()` (aligned as `spec.bottom_right` says)."""
    if spec.variant.mask is None and spec.mask is not Mask.NONE:
        return replace(spec.variant, mask=v.Causal())
    return spec.variant


def spec_reference(spec: Spec, q, k, v_, scale, tensors: dict, dtype=torch.float64, fp8_probs: bool = False):
    """(out, lse) of the spec's attention in `dtype`: the plain reference, or a variant's full matrices (`fp8_probs`:
    the weights rounded to e4m3, reference.weights)."""
    if not spec.variant:
        return reference.attention(q, k, v_, spec.mask, scale, dtype=dtype, fp8_probs=fp8_probs)
    return reference.variant_attention(q, k, v_, spec_variant(spec), spec.bottom_right, scale, tensors, dtype=dtype,
                                       fp8_probs=fp8_probs)


def low_precision_reference(spec: Spec, q, k, v_, scale, tensors: dict, q_e4m3: int = 0):
    """(out, lse) of a same-precision PyTorch computation: in the spec's dtype; for an FP8 spec (whose inputs here
    are dequantised), in float32 with the weights rounded to e4m3 and the output to bf16, as the kernel rounds.
    `q_e4m3`: q's rows as that many e4m3 terms first, as the FP8-cache decode kernel's `q_e4m3` takes them."""
    if q_e4m3:
        q = reference.e4m3_rows(q, q_e4m3).to(q.dtype)
    if spec.dtype.fp8:
        out, lse = spec_reference(spec, q, k, v_, scale, tensors, dtype=torch.float32, fp8_probs=True)
        return out.to(spec.dtype.output.torch), lse
    return spec_reference(spec, q, k, v_, scale, tensors, dtype=spec.dtype.torch)


def _errors(got: torch.Tensor, ref: torch.Tensor, low: torch.Tensor):
    """Max abs error of got and of the same-precision computation, on finite reference entries."""
    finite = torch.isfinite(ref)
    diff = (got.double() - ref).abs()
    err = diff[finite].max().item() if finite.any() else 0.0
    low_err = (low.double() - ref).abs()[finite].max().item() if finite.any() else 0.0
    return err, low_err


def compare(spec: Spec, case: Case, out, lse, q, k, v, scale=None, tensors: dict | None = None,
            q_e4m3: int = 0) -> Result:
    """The kernel's out and lse against float64 of the (dequantised) inputs, within FUDGE x the same-precision
    computation's error + ATOL and REL_TOL; `q_e4m3` (a decode kernel that takes q's rows as that many e4m3 terms):
    the same-precision computation takes them so too, and the relative bound grows by FUDGE x how far the rounding
    of q alone moves the float64 output."""
    scale = spec.softmax_scale if scale is None else scale
    q, k, v, tensors = dequantized(spec, q, k, v, tensors or {})
    ref, ref_lse = spec_reference(spec, q, k, v, scale, tensors)
    low, low_lse = low_precision_reference(spec, q, k, v, scale, tensors, q_e4m3)
    if not ((torch.isfinite(low) | ~torch.isfinite(ref)).all() and (torch.isfinite(low_lse) | ~torch.isfinite(ref_lse)).all()):
        # NOTE: scores past fp16's range (a large scale) overflow the same-precision computation, which
        # would make the tolerance inf or NaN; the kernels keep scores in fp32, so measure against fp32.
        low, low_lse = spec_reference(spec, q, k, v, scale, tensors, dtype=torch.float32)
    problem = ""
    if torch.isnan(out).any() and not torch.isnan(ref).any():
        problem = f"{int(torch.isnan(out).sum())} output elements are NaN (unwritten or poisoned)"
    empty = torch.isinf(ref_lse) & (ref_lse < 0)
    if empty.any():
        if not (torch.isinf(lse[empty]).all() and (lse[empty] < 0).all()):
            problem = problem or "rows with no visible key must have log-sum-exp -inf"
        if out[empty].abs().max().item() != 0.0:
            problem = problem or "rows with no visible key must be exactly 0"
    err, low_err = _errors(out, ref, low)
    lse_err, low_lse_err = _errors(lse, ref_lse, low_lse)
    norm = ref[torch.isfinite(ref)].norm().item()
    rel = (out.double() - ref)[torch.isfinite(ref)].norm().item() / norm if norm else 0.0
    rel_tol = REL_TOL[spec.dtype]
    if q_e4m3 and norm:  # plus what q's rounding alone moves the output by (float64 otherwise)
        moved, _ = spec_reference(spec, reference.e4m3_rows(q, q_e4m3), k, v, scale, tensors)
        rel_tol += FUDGE * (moved - ref)[torch.isfinite(ref)].norm().item() / norm
    atol = ATOL[spec.dtype]
    return Result(case, err, rel, FUDGE * low_err + atol, rel_tol, lse_err,
                  FUDGE * low_lse_err + atol, problem)


def _variant_grads(spec: Spec, q, k, v_, do, scale, tensors: dict, dtype):
    """(dq, dk, dv[, dsinks]) by autograd through a variant's full-matrix reference in `dtype`."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v_)]
    tensors = dict(tensors)
    if spec.variant.sinks:
        tensors[v.SINKS_TENSOR] = tensors[v.SINKS_TENSOR].detach().to(dtype).requires_grad_()
        leaves.append(tensors[v.SINKS_TENSOR])
    out, _ = spec_reference(spec, *leaves[:3], scale, tensors, dtype)
    grads = torch.autograd.grad(out, leaves, do.to(dtype), allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))


def _delta_floor(spec: Spec, q, k, v_, do, scale, tensors: dict) -> tuple[torch.Tensor, ...]:
    """How far FlashAttention's backward formula moves a variant's gradients by itself, in float64: it takes each
    row's delta = dO . O from the output as stored (in the spec's output dtype), and dS = P (dP - delta) is a
    difference of near-equal terms where a row's weights sit on few keys (a sink beside a single key: 17% of
    random such rows lose more than 2% of dQ to the output's bf16 rounding alone, in any kernel of that design).
    Computed as the gradients of -sum_i e_i lse_i, e_i = dO_i . (stored O_i - O_i) held constant: d lse_i / d s_ij
    = P_ij, so they are exactly the change -P_ij e_i in dS, through the score modifier's chain rule."""
    leaves = [t.detach().to(torch.float64).requires_grad_() for t in (q, k, v_)]
    tensors = dict(tensors)
    if spec.variant.sinks:
        tensors[v.SINKS_TENSOR] = tensors[v.SINKS_TENSOR].detach().to(torch.float64).requires_grad_()
        leaves.append(tensors[v.SINKS_TENSOR])
    out, lse = spec_reference(spec, *leaves[:3], scale, tensors)
    out = out.detach()
    stored = out.to(spec.dtype.output.torch).double()
    e = (do.double() * (stored - out)).sum(-1)
    finite = torch.isfinite(lse)  # (rows with no visible key have no delta)
    grads = torch.autograd.grad(-(e[finite] * lse[finite]).sum(), leaves, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))


def compare_grads(spec: Spec, q, k, v, do, grads, scale=None, tensors: dict | None = None) -> tuple[GradResult, ...]:
    """Gradients against float64 autograd of the reference, by the same rule as the outputs; a spec with
    sinks has a fourth gradient, dsinks. The relative tolerance of a 16-bit variant's gradient is also at least
    FUDGE times what the backward formula's own use of the stored output costs on these inputs (`_delta_floor`):
    that is the rows' conditioning, not the kernel's error."""
    scale = spec.softmax_scale if scale is None else scale

    def reference_grads(dtype):
        if spec.variant:
            return _variant_grads(spec, q, k, v, do, scale, tensors or {}, dtype)
        return reference.attention_grads(q, k, v, do, spec.mask, scale, dtype=dtype)

    refs, lows = reference_grads(torch.float64), reference_grads(spec.dtype.torch)
    if not all((torch.isfinite(low) | ~torch.isfinite(ref)).all() for ref, low in zip(refs, lows)):
        lows = reference_grads(torch.float32)  # overflowed in fp16: see compare()
    floors = (_delta_floor(spec, q, k, v, do, scale, tensors or {}) if spec.variant and spec.dtype != DType.FP32
              else (None,) * len(refs))
    results = []
    names = ("dq", "dk", "dv") + (("dsinks",) if spec.variant.sinks else ())
    for name, got, ref, low, floor in zip(names, grads, refs, lows, floors, strict=True):
        problem = ""
        if torch.isnan(got).any() and not torch.isnan(ref).any():
            problem = f"{int(torch.isnan(got).sum())} elements are NaN (unwritten or poisoned)"
        err, low_err = _errors(got, ref, low)
        norm = ref.norm().item()
        rel = (got.double() - ref).norm().item() / norm if norm else (got.double() - ref).norm().item()
        rel_tol = GRAD_REL_TOL[spec.dtype]
        if floor is not None and norm:
            rel_tol = max(rel_tol, FUDGE * floor.norm().item() / norm)
        results.append(GradResult(name, err, FUDGE * low_err + ATOL[spec.dtype], rel, rel_tol, problem))
    return tuple(results)


def _rounds_q(kernel) -> int:
    """The e4m3 terms the kernel's Gluon decode kernel (a split-KV spec over an FP8 cache: `q_e4m3`) takes q's rows
    as where it runs (KVCachePart.rounds_q); 0: q as given, and for every other spec."""
    if kernel.spec.kv_dtype is None or not kernel.spec.is_split:
        return 0
    return kernel.part("kvcache").rounds_q()


def run_case(kernel, case: Case, device, generator=None) -> Result:
    spec = kernel.spec
    if spec.varlen:
        return _run_varlen_case(kernel, case, device, generator)
    q, k, v = random_inputs(spec, case, device, generator)
    tensors = runtime_tensors(spec, case, device, generator)
    out = q.new_full(q.shape[:-1] + v.shape[-1:], float("nan"), dtype=spec.dtype.output.torch)
    out, lse = kernel(q, k, v, out=out, return_lse=True, **tensors)
    result = compare(spec, case, out, lse, q, k, v, tensors=tensors, q_e4m3=_rounds_q(kernel))
    if spec.backward:
        do = torch.randn(out.shape, generator=generator, device=device, dtype=torch.float32).to(q.dtype)
        poisoned = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        grads = kernel.backward(q, k, v, out, lse, do, grads=poisoned, **tensors)
        result = replace(result, grads=compare_grads(spec, q, k, v, do, grads, tensors=tensors))
    return result


def varlen_lengths(case: "Case | PackedCase") -> tuple[list[int], list[int]]:
    """The sequences a varlen kernel runs for `case`: a `PackedCase`'s own; for a `Case`, `case.batch` of them, of
    n_q and n_k, then a few shorter each (odd, unequal lengths; seq_q != seq_k where the case's differ), at least
    one query and key each."""
    if isinstance(case, PackedCase):
        return list(case.lengths_q), list(case.lengths_k)
    batch = range(case.batch)
    return [max(1, case.n_q - 5 * b) for b in batch], [max(1, case.n_k - 3 * b) for b in batch]


def _run_varlen_case(kernel, case: "Case | PackedCase", device, generator=None) -> Result:
    """`run_case` for a varlen kernel: the case's sequences (`varlen_lengths`) packed end to end (K/V copied into
    shuffled pages for a paged spec), the output poisoned, gradients through autograd; each sequence compared with
    the reference of it alone. Returns the first failing sequence's result, else the one with the largest error."""
    spec = kernel.spec
    lens_q, lens_k = varlen_lengths(case)
    x = packed_inputs(spec, lens_q, lens_k, case.heads, case.kv_heads, device, generator)
    tensors = runtime_tensors(spec, case, device, generator)
    if spec.backward:  # (not paged: keys and values are k and v)
        for t in (x.q, x.k, x.v):
            t.requires_grad_()
    out, lse = kernel(x.q, x.keys, x.values, cu_seqlens_q=x.cu_seqlens_q, cu_seqlens_k=x.cu_seqlens_k,
                      max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), block_table=x.block_table, return_lse=True,
                      out=None if spec.backward else x.q.new_full(x.q.shape[:-1] + x.v.shape[-1:], float("nan")),
                      **tensors)
    do = torch.randn(out.shape, generator=generator, device=device, dtype=torch.float32).to(x.q.dtype)
    if spec.backward:
        out.backward(do)
    results = []
    for b in range(len(lens_q)):
        seq = {name: t[b:b + 1] if name == v.ALIBI_TENSOR and t.dim() == 2 else t for name, t in tensors.items()}
        qs, ks, vs = x.rows(x.q.detach(), b), x.rows(x.k.detach(), b, keys=True), x.rows(x.v.detach(), b, keys=True)
        lse_b = lse[:, int(x.cu_seqlens_q[b]):int(x.cu_seqlens_q[b + 1])][None]
        result = compare(spec, Case(1, case.heads, case.kv_heads, lens_q[b], lens_k[b]), x.rows(out.detach(), b),
                         lse_b, qs, ks, vs, tensors=seq)
        if spec.backward:
            grads = (x.rows(x.q.grad, b), x.rows(x.k.grad, b, keys=True), x.rows(x.v.grad, b, keys=True))
            # (the sinks' gradient sums over the sequences: not one sequence's; its check is the tests')
            grads += (torch.zeros_like(seq[v.SINKS_TENSOR]),) if spec.variant.sinks else ()
            checked = compare_grads(spec, qs, ks, vs, x.rows(do, b), grads, tensors=seq)[:3]
            result = replace(result, grads=checked)
        results.append(result)
    failed = [r for r in results if not r.ok]
    return replace(failed[0] if failed else max(results, key=lambda r: r.err), case=case)


def validate(kernel, cases=None, seed: int | None = None, device=None, progress=None) -> list[Result]:
    """Run the kernel on each case with fresh random inputs; return one Result per case."""
    if device is None:
        device = "cpu" if interpreting() or not torch.cuda.is_available() else "cuda"
    if cases is None:
        cases = default_cases(kernel.spec, small=device == "cpu")
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else torch.seed() % (1 << 62))
    results = []
    for case in cases:
        results.append(run_case(kernel, case, device, generator))
        if progress:
            progress(results[-1])
    return results


def format_result(r: Result) -> str:
    status = "ok  " if r.ok else "FAIL"
    line = (f"{status} {str(r.case):34s} max|err| {r.err:9.3e} (tol {r.tol:8.2e})  rel {r.rel:8.2e} (tol {r.rel_tol:.0e})"
            f"  lse {r.lse_err:8.2e} (tol {r.lse_tol:8.2e})")
    line += f"  {r.problem}" if r.problem else ""
    for g in r.grads:
        status = "ok  " if g.ok else "FAIL"
        line += (f"\n  {status} {g.name:>32s}  max|err| {g.err:9.3e} (tol {g.tol:8.2e})  rel {g.rel:8.2e}"
                 f" (tol {g.rel_tol:.0e})" + (f"  {g.problem}" if g.problem else ""))
    return line

