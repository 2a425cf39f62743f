"""`attngen bench --suite fp8`: the FP8 (e4m3) prefill forward against attngen's bf16 forward, in one process.

d=128, 16 heads, batch 16384 / N, N = 4096, 8192, 16384, causal and not; inputs standard normal (`outliers`: also
with three channels of q and k 20x larger, at N=4096). Providers (forward only):
- `attngen_fp8`: `attngen.attention` on q, k, v quantised per head (`attngen.quantize_fp8`, outside the timing),
  V in the usual (batch, heads, seq, head_dim) layout, so the timing includes the module's copy of V into the
  layout its kernel's P V reads (`fp8_vt` in the generated module);
- `attngen_fp8_vt`: the same with V already keys-contiguous (the Triton kernel then takes it as it is; the Hopper
  kernel still copies it, in its own key order);
- `attngen_fp8_rot`: `attngen_fp8_vt` with q and k rotated by a Hadamard matrix before quantising
  (`attngen.quantize_fp8_qkv(..., rotate=True)`, outside the timing): the same kernel on other e4m3 inputs;
- `attngen_bf16`: `attngen.attention` on the bf16 inputs;
- `sdpa_cudnn`: SDPA's cuDNN backend on the bf16 inputs;
- `torch_fp8`: torch's experimental FP8 SDPA (`torch.nn.attention.experimental._scaled_dot_product_attention_quantized`,
  per-head descales), which runs FA3's FP8 kernel when FA3 is activated (`activate_flash_attention_impl("FA3")`);
  where torch lacks it or FA3 is not installed, the row carries the error. SDPA's cuDNN backend takes no FP8
  inputs in torch 2.13 (the quantized entry point has only FA3's per-head descaling).

Each row also has `extra["err"]`: the max |out - ref| over (batch 0, heads 0-1) against float64 attention of the
unquantised inputs (so an FP8 row's error includes its inputs' quantisation), and `extra["rel"]`, the relative norm
error there. TFLOP/s by the FlashAttention convention (`analysis.cost.fa_flops`). `--check` runs the attngen
providers at a tiny size (in Triton's interpreter without a GPU) and holds each to its dtype's relative error
against float64 instead of timing: 2^-4 + 2^-8 for FP8 (testing/accuracy.py's REL_TOL, here on the dequantised
inputs, rotated for `attngen_fp8_rot`), CHECK_REL for bf16; its rows carry `extra` too.
"""

from __future__ import annotations

import contextlib

import torch

from ..analysis.cost import evaluate, fa_flops
from ..api.fp8 import quantize_fp8_qkv
from ..api.sdpa import attention
from ..lang.spec import DType, Mask
from ..testing import reference
from ..testing.accuracy import REL_TOL
from .common import Row, error_text
from .prefill import run_suite
from .varlen import CHECK_REL, _timed

PROVIDERS = ("attngen_fp8", "attngen_fp8_vt", "attngen_fp8_rot", "attngen_bf16", "sdpa_cudnn", "torch_fp8")
LENGTHS = (4096, 8192, 16384)
HEAD_DIM, HEADS, TOKENS = 128, 16, 16384
FP8_PROVIDERS = ("attngen_fp8", "attngen_fp8_vt", "attngen_fp8_rot", "torch_fp8")


def _inputs(batch, heads, n, d, outliers, device, generator):
    # (drawn by the host's generator, then moved: one generator serves every tensor of a run on any device)
    q, k, v = (torch.randn(batch, heads, n, d, generator=generator).to(device, torch.bfloat16) for _ in range(3))
    if outliers:  # a few channels 20x the rest, as LLM activations have
        q[..., :3] *= 20
        k[..., :3] *= 20
    return q, k, v


def _runs(causal: bool, q, k, v) -> tuple[dict, dict]:
    """(name -> f() -> out, and name -> what an FP8 provider is given: its e4m3 (q8, k8, v8) and their per-head
    descales), the quantisation done here, outside the timing."""
    q8, k8, v8, fp8 = quantize_fp8_qkv(q, k, v, per="head")
    r8, rk8, rv8, rotated = quantize_fp8_qkv(q, k, v, per="head", rotate=True)
    v8t, rv8t = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (v8, rv8))
    runs = {
        "attngen_fp8": lambda: attention(q8, k8, v8, is_causal=causal, **fp8),
        "attngen_fp8_vt": lambda: attention(q8, k8, v8t, is_causal=causal, **fp8),
        "attngen_fp8_rot": lambda: attention(r8, rk8, rv8t, is_causal=causal, **rotated),
        "attngen_bf16": lambda: attention(q, k, v, is_causal=causal),
    }
    if q.is_cuda:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def torch_fp8():
            from torch.nn.attention.experimental._scaled_dot_product_attention_quantized import (
                _scaled_dot_product_attention_quantized)

            return _scaled_dot_product_attention_quantized(q8, k8, v8, is_causal=causal, **fp8)

        runs.update(sdpa_cudnn=cudnn, torch_fp8=torch_fp8)
    plain, turned = ((q8, k8, v8), fp8), ((r8, rk8, rv8), rotated)
    return runs, {name: turned if name == "attngen_fp8_rot" else plain for name in FP8_PROVIDERS}


@contextlib.contextmanager
def _fa3():
    """FA3 as torch's flash-attention implementation (it runs torch's FP8 SDPA) inside the block, the one active
    before (attngen's, or none) back after it; outside the timed calls: activating registers torch's ops."""
    from torch.nn.attention import activate_flash_attention_impl, current_flash_attention_impl, restore_flash_attention_impl

    def back(before):
        if before is None:
            restore_flash_attention_impl(_raise_warn=False)
        else:
            activate_flash_attention_impl(before)

    before = current_flash_attention_impl()
    try:
        activate_flash_attention_impl("FA3")  # (it drops the active impl first, also when FA3 is not installed)
    except Exception:
        back(before)
        raise
    try:
        yield
    finally:
        back(before)


def _errors(out, q, k, v, causal) -> tuple[float, float]:
    """(max |out - ref|, ||out - ref|| / ||ref||) over batch 0, heads 0-1, against float64 of q, k, v."""
    mask = Mask.CAUSAL_TOP_LEFT if causal else Mask.NONE
    ref, _ = reference.attention(q[:1, :2], k[:1, :2], v[:1, :2], mask)
    diff = out[:1, :2].double() - ref
    return diff.abs().max().item(), (diff.norm() / ref.norm()).item()


def _check(name, out, q, k, v, given, causal) -> str | None:
    """A check's verdict: FP8 against float64 of its dequantised inputs (`given[name]`, from `_runs`), bf16 against
    float64 of its own."""
    if name in FP8_PROVIDERS:
        tensors, descales = given[name]
        q, k, v = (x.double() * descales[d][:, :, None, None]
                   for x, d in zip(tensors, ("q_descale", "k_descale", "v_descale")))
        limit = REL_TOL[DType.FP8_E4M3]
    else:
        limit = CHECK_REL
    _, rel = _errors(out, q, k, v, causal)
    return None if rel < limit else f"relative error {rel:.3g} against float64 (limit {limit:.3g})"


def bench_fp8(names=PROVIDERS, lengths=LENGTHS, check=False, progress=print) -> list[Row]:
    """One Row per (case, provider), forward: timed on a GPU with its error against float64, or with `check` the
    attngen providers' accuracy at a tiny size (`error` says why a check failed)."""
    device = "cpu" if check and not torch.cuda.is_available() else "cuda"
    generator = torch.Generator()
    generator.seed()  # fresh random data each run
    lengths = lengths[:1] if check else lengths  # (a check runs one tiny size)
    cases = [(n, causal, False) for n in lengths for causal in (False, True)]
    cases += [(lengths[0], causal, True) for causal in (False, True)]
    rows = []
    for n, causal, outliers in cases:
        batch, heads, d = (1, 2, HEAD_DIM) if check else (max(1, TOKENS // n), HEADS, HEAD_DIM)
        size = 37 if check else n
        params = dict(batch=batch, heads=heads, seqlen=size, head_dim=d, causal=causal,
                      inputs="outliers" if outliers else "normal")
        q, k, v = _inputs(batch, heads, size, d, outliers, device, generator)
        runs, given = _runs(causal, q, k, v)
        for name in (n_ for n_ in names if n_ in runs and (not check or n_.startswith("attngen"))):
            fn = runs[name]
            row = Row("fp8", "forward", name, dict(params, dtype="fp8_e4m3" if name in FP8_PROVIDERS else "bf16"))
            try:
                with torch.no_grad(), _fa3() if name == "torch_fp8" else contextlib.nullcontext():
                    out = fn()
                err, rel = _errors(out, q, k, v, causal)
                row.extra.update(err=err, rel=rel)
                if check:
                    row.error = _check(name, out, q, k, v, given, causal)
                else:
                    out = None
                    with _fa3() if name == "torch_fp8" else contextlib.nullcontext():
                        row.ms = _timed(fn, (), "forward")
                    flops = evaluate(fa_flops(causal, False), dict(B=batch, H=heads, N_Q=size, N_K=size, HEAD_DIM=d))
                    row.tflops = flops / row.ms / 1e9
            except Exception as e:  # noqa: BLE001 - a provider that cannot run a case is a result
                row.error = error_text(e)
                if device == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
        progress(f"fp8 N={n} causal={causal}{' outliers' if outliers else ''} done")
        q = k = v = runs = given = None  # (freed before the next case)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def table(rows: list[Row]) -> str:
    """TFLOP/s (or the check's verdict) and the relative error against float64 of the unquantised inputs per
    provider, one line per case, and attngen FP8's speed-up over attngen bf16."""
    names = [p for p in PROVIDERS if any(r.provider == p for r in rows)]
    lines = ["fp8 forward TFLOP/s (relative error against float64), d=128",
             f"{'N':>6} {'causal':>6} {'inputs':>8} " + " ".join(f"{p:>22}" for p in names) + f" {'fp8/bf16':>8}"]
    for case in dict.fromkeys((r.params["seqlen"], r.params["causal"], r.params["inputs"]) for r in rows):
        found = {r.provider: r for r in rows if (r.params["seqlen"], r.params["causal"], r.params["inputs"]) == case}
        cells = []
        for p in names:
            r = found.get(p)
            if r is None:
                cell = "-"
            elif r.error:
                cell = "err"
            elif r.tflops:
                cell = f"{r.tflops:.1f} ({r.extra['rel']:.1e})"
            else:  # a check's
                cell = f"ok ({r.extra['rel']:.1e})"
            cells.append(f"{cell:>22}")
        fp8, bf16 = found.get("attngen_fp8"), found.get("attngen_bf16")
        ratio = f"{fp8.tflops / bf16.tflops:8.2f}" if fp8 and bf16 and fp8.tflops and bf16.tflops else f"{'':>8}"
        lines.append(f"{case[0]:>6} {case[1]!s:>6} {case[2]:>8} " + " ".join(cells) + f" {ratio}")
    errors = [f"  N={r.params['seqlen']} causal={r.params['causal']} {r.provider}: {r.error}" for r in rows if r.error]
    return "\n".join(lines + (["errors:"] + errors if errors else []))


def main(out_dir="benchmarks/results", names=None, lengths=None, check=False) -> int:
    """Run the suite (or its check) and print the table; writes `<out_dir>/fp8_<gpu>.json` when timed."""
    return run_suite("fp8_", lambda: bench_fp8(names or PROVIDERS, lengths or LENGTHS, check), table, out_dir, check)
