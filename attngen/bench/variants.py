"""`attngen bench --suite variants`: the attention variants of issue 48 against FlexAttention, in one process.

B=1 H=16 N=16384 d=128 bf16 by default. Rows: causal (the reference), sliding window 4096, softcap 30
causal, ALiBi causal, prefix-LM 2048, chunked 8192, sinks with a window of 128; each forward and backward.
Providers: attngen (a kernel of the row's variant spec), FlexAttention (compiled as the prefill suite
measures it; create_block_mask for the mask, score_mod for softcap and ALiBi, and for sinks its log-sum-exp:
out * sigmoid(lse - sink) is the softmax with the sink in the denominator), and cuDNN's causal (SDPA) as the
dense reference on the causal row.

Every timing is a `do_bench` median on fresh random data; TFLOP/s count the kept scores (analysis/masks.py:
4 * d per kept score forward, x2.5 backward; a plain causal mask counted as half, as the prefill suite
does). Rows go to `<out>/variants_<gpu>.json`. `--check` runs each row at a tiny size (in Triton's
interpreter without a GPU) and compares attngen and the peer with the float64 reference instead of timing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..analysis import masks
from ..lang import variants as v
from ..lang.spec import parse
from ..runtime.kernel import load
from ..testing.accuracy import spec_reference
from .common import Row, compiled_flex_attention, error_text
from .prefill import _median_ms, run_suite

PROVIDERS = ("attngen", "flex", "sdpa_cudnn")
SHAPE = dict(batch=1, heads=16, seqlen=16384, head_dim=128)
TINY = dict(batch=1, heads=2, seqlen=96, head_dim=32)
# A check compares with the float64 reference: ||out - ref|| / ||ref|| under this (bf16 inputs and output).
CHECK_REL = 2e-2


@dataclass(frozen=True)
class Case:
    """One row: the variant as a spec writes it, and as FlexAttention takes it."""

    name: str
    entries: str                   # the spec's variant entries, e.g. "mask = causal & window(4096)"
    mask_mod: object = None        # (b, h, q, k) -> bool, for create_block_mask
    params: dict = field(default_factory=dict)

    def spec(self, head_dim: int, backward: bool):
        return parse(f"kernel bench_{self.name} {{\n direction = {'forward+backward' if backward else 'forward'}\n"
                     f" {self.entries}\n head_dim = {head_dim}\n dtype = bf16\n}}")


def cases(n: int) -> list[Case]:
    """The suite's rows; at a short length (a check) the window, prefix and chunk shrink with it."""
    def size(full):
        return full if n >= 16384 else max(4, full * n // 16384)

    window, prefix, chunk, sink_window = size(4096), size(2048), size(8192), size(128)
    causal = lambda b, h, q, k: q >= k  # noqa: E731
    return [
        Case("causal", "mask = causal", causal),
        Case(f"window_{window}", f"mask = causal & window({window})",
             lambda b, h, q, k: (q >= k) & (q - k < window), dict(window=window)),
        Case("softcap_30", "mask = causal\n score = softcap(30)", causal, dict(softcap=30)),
        Case("alibi", "mask = causal\n score = alibi", causal),
        Case(f"prefix_{prefix}", f"mask = causal | prefix({prefix})",
             lambda b, h, q, k: (q >= k) | (k < prefix), dict(prefix=prefix)),
        Case(f"chunked_{chunk}", f"mask = causal & chunked({chunk})",
             lambda b, h, q, k: (q >= k) & (q // chunk == k // chunk), dict(chunk=chunk)),
        Case(f"sinks_window_{sink_window}", f"mask = causal & window({sink_window})\n sinks = true",
             lambda b, h, q, k: (q >= k) & (q - k < sink_window), dict(window=sink_window)),
    ]


def _tensors(variant: v.Variant, heads: int, device, generator) -> dict:
    """The row's run-time tensors: ALiBi's geometric slopes (BLOOM's, for `heads` heads), sinks ~ N(0, 1)."""
    import torch

    tensors = {}
    if isinstance(variant.score, v.Alibi):
        tensors[v.ALIBI_TENSOR] = torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)],
                                               device=device, dtype=torch.float32)
    if variant.sinks:
        tensors[v.SINKS_TENSOR] = torch.randn(heads, device=device, generator=generator).requires_grad_()
    return tensors


def providers(case: Case, n: int, device, tensors: dict, compiled: bool, kernel) -> dict:
    """name -> f(q, k, v) -> out, each differentiable (the peers a row has)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = compiled_flex_attention() if compiled else flex_attention
    try:  # (torch 2.9 on: return_lse is deprecated for return_aux)
        from torch.nn.attention.flex_attention import AuxRequest

        lse_request = dict(return_aux=AuxRequest(lse=True))
    except ImportError:
        lse_request = dict(return_lse=True)
    block_mask = create_block_mask(case.mask_mod, None, None, n, n, device=device)
    score_mod = None
    variant = kernel.spec.variant
    if isinstance(variant.score, v.Softcap):
        cap = variant.score.cap
        score_mod = lambda s, b, h, q, k: cap * torch.tanh(s / cap)  # noqa: E731
    elif isinstance(variant.score, v.Alibi):
        slopes = tensors[v.ALIBI_TENSOR]
        score_mod = lambda s, b, h, q, k: s - slopes[h] * (q - k).abs()  # noqa: E731

    def run_flex(q, k, v_):
        if not variant.sinks:
            return flex(q, k, v_, score_mod=score_mod, block_mask=block_mask)
        out, lse = flex(q, k, v_, score_mod=score_mod, block_mask=block_mask, **lse_request)
        lse = lse.lse if hasattr(lse, "lse") else lse
        sink = tensors[v.SINKS_TENSOR][None, :, None]
        return out * torch.sigmoid(lse - sink).to(out.dtype)[..., None]

    def run_cudnn(q, k, v_):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v_, is_causal=True)

    found = {"attngen": lambda q, k, v_: kernel(q, k, v_, **tensors), "flex": run_flex}
    if case.name == "causal" and device != "cpu":
        found["sdpa_cudnn"] = run_cudnn
    return found


def _check(case: Case, spec, fn, q, k, v_, tensors) -> str | None:
    """None when the provider's output is within CHECK_REL of the float64 reference, else why not."""
    import torch

    with torch.no_grad():
        out = fn(q, k, v_)
    ref, _ = spec_reference(spec, q, k, v_, spec.softmax_scale, {name: t.detach() for name, t in tensors.items()})
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    return None if rel <= CHECK_REL else f"relative error {rel:.2e} against float64 (tolerance {CHECK_REL:.0e})"


def bench_variants(shape=None, directions=("forward", "backward"), names=PROVIDERS, check=False,
                   progress=print, only=None) -> list[Row]:
    """One Row per (case, direction, provider): timed on a GPU, or with `check` compared with the float64
    reference (`error` says why a check failed). `only`: the names of the cases to run (default all)."""
    import torch

    shape = dict(TINY if check else SHAPE, **(shape or {}))
    b, h, n, d = shape["batch"], shape["heads"], shape["seqlen"], shape["head_dim"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backward = "backward" in directions and not check
    rows = []
    for case in cases(n):
        if only is not None and case.name not in only:
            continue
        spec = case.spec(d, backward)
        sizes = dict(B=b, H=h, N_Q=n, N_K=n, HEAD_DIM=d)
        params = dict(shape, variant=case.name, dtype="bf16", **case.params)
        gen = torch.Generator(device=device)
        gen.seed()  # fresh random data each run
        try:
            kernel = load(spec)
            q, k, v_ = (torch.randn(b, h, n, d, device=device, dtype=torch.bfloat16, generator=gen)
                        .requires_grad_(backward) for _ in range(3))
            tensors = _tensors(spec.variant, h, device, gen)
            impls = providers(case, n, device, tensors, compiled=not check, kernel=kernel)
        except Exception as e:  # noqa: BLE001 - a row that cannot be set up is a result
            rows += [Row("variants", dr, p, params, error=error_text(e)) for dr in directions for p in names]
            continue
        for name in names:
            if name not in impls:
                continue
            fn = impls[name]
            for direction in (("forward",) if check else directions):
                row = Row("variants", direction, name, params)
                try:
                    if check:
                        row.error = _check(case, spec, fn, q.detach(), k.detach(), v_.detach(), tensors)
                        row.extra["checked"] = row.error is None
                    else:
                        row.ms = _time(fn, q, k, v_, tensors, direction)
                        row.tflops = masks.fa_flops(spec, sizes, direction == "backward") / row.ms / 1e9
                except Exception as e:  # noqa: BLE001 - a provider that cannot run a case is a result
                    row.error = error_text(e)
                    if device == "cuda":
                        torch.cuda.empty_cache()
                rows.append(row)
        progress(f"variants {case.name} done")
        q = k = v_ = None  # (freed before the next row; rebound, not deleted: the timed lambdas name them)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _time(fn, q, k, v_, tensors, direction) -> float:
    import torch

    if direction == "forward":
        with torch.no_grad():
            fn(q, k, v_)
            return _median_ms(lambda: fn(q, k, v_))
    out = fn(q, k, v_)
    do = torch.randn_like(out)
    inputs = (q, k, v_, *(t for t in tensors.values() if t.requires_grad))
    torch.autograd.grad(out, inputs, do, retain_graph=True)
    return _median_ms(lambda: torch.autograd.grad(out, inputs, do, retain_graph=True))


def table(rows: list[Row]) -> str:
    """The rows as text: TFLOP/s (or the check's verdict) per provider, one line per variant."""
    lines = []
    names = [p for p in PROVIDERS if any(r.provider == p for r in rows)]
    for direction in ("forward", "backward"):
        sel = [r for r in rows if r.direction == direction]
        if not sel:
            continue
        first = sel[0].params
        lines.append(f"variants {direction} TFLOP/s on kept scores (B={first['batch']} H={first['heads']} "
                     f"N={first['seqlen']} d={first['head_dim']} bf16)")
        lines.append(f"{'variant':>20} " + " ".join(f"{p:>12}" for p in names))
        for variant in dict.fromkeys(r.params["variant"] for r in sel):
            cells = []
            for p in names:
                r = next((r for r in sel if r.provider == p and r.params["variant"] == variant), None)
                if r is None:
                    cells.append(f"{'-':>12}")
                elif r.error:
                    cells.append(f"{'err':>12}")
                elif r.tflops:
                    cells.append(f"{r.tflops:12.1f}")
                else:
                    cells.append(f"{'ok':>12}")
            lines.append(f"{variant:>20} " + " ".join(cells))
    errors = [f"  {r.params['variant']} {r.direction} {r.provider}: {r.error}" for r in rows if r.error]
    return "\n".join(lines + (["errors:"] + errors if errors else []))


def main(out_dir="benchmarks/results", shape=None, directions=("forward", "backward"), names=None,
         check=False) -> int:
    """Run the suite (or its check) and print the table; writes `<out_dir>/variants_<gpu>.json` when timed."""
    return run_suite("variants_", lambda: bench_variants(shape, directions, names or PROVIDERS, check), table, out_dir,
                     check)
