"""Experiment: the backward's dK/dV kernel as a warp-specialised Gluon kernel (templates/gluon_backward.py.j2).

    python benchmarks/experiments/gluon_backward.py OUT_DIR

The d=128 backward sat at 0.99-1.01x FlexAttention (NOTES.md v6-v9): its Triton dK/dV kernel runs the
four products at 530-554 TFLOP/s with 255 registers, `barrier` its top stall, the picture the forward
had before it moved to Gluon. The Gluon kernel keeps K and V of 64 keys per consumer warpgroup in
shared memory and has a TMA loader warp stream Q and dO. Variants are rendered from the template with
the pass's `warp_specialized_bwd` attribute changed: `sync` (each block's four products waited for
before the next block's), PREFETCH (the next block's lse and delta loaded during this block), 3 stages.
(An earlier run, results/h200_gluon_backward_stages_v10.json, had the next block's products issued
ahead; ptxas serialised it.) Prediction: dK/dV alone +20-30% at d=128, the whole backward +10-15% (dQ
unchanged): >= 1.1x Flex.
Cases: bf16, batch 16384/N, hidden 2048; each variant's dK, dV (poisoned with NaN first) against the
Triton kernel's and, on a small odd-sized GQA case per mask, against a float64 reference. Times (do_bench
medians): dK/dV alone, and the whole `module.backward` with each; FlexAttention's backward in the same
process. Writes gluon_backward.json; prints a table (TFLOP/s).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import error_text, gluon_variant_module, rel_err  # noqa: E402

VARIANTS = {"sync": {}, "pf": {"PREFETCH": True}, "s3": {"STAGES": 3}, "pf_s3": {"PREFETCH": True, "STAGES": 3}}
CASES = [(128, False, 4096), (128, False, 8192), (128, False, 16384), (128, True, 4096), (128, True, 8192),
         (128, True, 16384)]


def reference_check(kernel, causal: bool, gen) -> dict:
    """dK, dV of the Gluon path against float64 on an odd, GQA, N_Q != N_K case (min_scores lifted)."""

    m = kernel.module
    b, h, hkv, n_q, n_k, d = 2, 4, 2, 333, 1111 if causal else 777, m.HEAD_DIM
    q = torch.randn(b, h, n_q, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, hkv, n_k, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    do = torch.randn_like(q)
    out, lse = m.forward(q, k, v, d ** -0.5)
    saved = m.WS_BWD_SHAPE["min_scores"]
    m.WS_BWD_SHAPE["min_scores"] = 0
    try:
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        ran = m.ws_bwd_ready(q, k, v, do, dk, dv)
        _, dk, dv = m.backward(q, k, v, out, lse, do, d ** -0.5, dk=dk, dv=dv)
    finally:
        m.WS_BWD_SHAPE["min_scores"] = saved
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    kr_e, vr_e = kr.repeat_interleave(h // hkv, 1), vr.repeat_interleave(h // hkv, 1)
    s = qr @ kr_e.transpose(-1, -2) * d ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool, device="cuda").tril().logical_not(), float("-inf"))
    ref = torch.softmax(s, -1) @ vr_e
    gk, gv = torch.autograd.grad(ref, (kr, vr), do.double())
    return dict(ran_gluon=ran, dk_err=rel_err(dk, gk), dv_err=rel_err(dv, gv), nan=bool(dk.isnan().any() or dv.isnan().any()))


def main() -> None:
    import attngen
    from attngen.api import sdpa_spec
    from attngen.bench import fa_flops, prefill_providers

    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    rows, checks = [], []
    flex = {c: prefill_providers(c)["flex"] for c in (False, True)}
    for d, causal, n in CASES:
        kernel = attngen.load(sdpa_spec("bf16", d, causal))
        m = kernel.module
        gen = torch.Generator(device="cuda").manual_seed(n + d + causal)
        if not any(c["head_dim"] == d and c["causal"] == causal for c in checks):
            try:
                checks.append(dict(head_dim=d, causal=causal, **reference_check(kernel, causal, gen)))
            except Exception as e:  # noqa: BLE001
                checks.append(dict(head_dim=d, causal=causal, error=error_text(e)))
            print("check", checks[-1], flush=True)
        b, h, scale = 16384 // n, 2048 // d, d ** -0.5
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        out, lse = m.forward(q, k, v, scale)
        cfg = kernel.backward_config(q, k)
        tri = dict(cfg, attn_bwd_dkdv=dict(cfg["attn_bwd_dkdv"], warp_specialized=False))
        dq_t, dk_t, dv_t = m.backward(q, k, v, out, lse, do, scale, config=tri)
        delta = torch.empty_like(lse)
        m.launch_attn_bwd_dq(q=q, k=k, v=v, o=out, do=do, lse=lse, delta=delta, dq=torch.empty_like(q), sm_scale=scale,
                             **cfg["attn_bwd_dq"])
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        flops_dkdv = 4 * b * h * n * n * d * 2 / (2 if causal else 1)  # four products of 2*N*N*d
        total = fa_flops(b, h, n, n, d, causal, backward=True)

        def timed(fn) -> float:
            return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

        base = dict(head_dim=d, causal=causal, n=n)
        tcfg = dict(cfg["attn_bwd_dkdv"])
        ms = timed(lambda: m.launch_attn_bwd_dkdv(q=q, k=k, v=v, do=do, lse=lse, delta=delta, dk=dk, dv=dv, sm_scale=scale,
                                                  **tcfg))
        ms_bwd = timed(lambda: m.backward(q, k, v, out, lse, do, scale, config=tri))
        rows.append(dict(base, variant="triton", config=tcfg, dkdv_ms=ms, dkdv_tflops=flops_dkdv / ms / 1e9,
                         bwd_ms=ms_bwd, bwd_tflops=total / ms_bwd / 1e9))
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        fo = flex[causal](qg, kg, vg)
        ms = timed(lambda: torch.autograd.grad(fo, (qg, kg, vg), do, retain_graph=True))
        rows.append(dict(base, variant="flex", bwd_ms=ms, bwd_tflops=total / ms / 1e9))
        for name, shape in VARIANTS.items():
            row = dict(base, variant=name, shape=shape)
            try:
                vm = gluon_variant_module(kernel.spec, name, shape, "gluon_backward", "warp_specialized_bwd")
                dk.fill_(float("nan"))
                dv.fill_(float("nan"))
                vm.launch_attn_bwd_dkdv_ws(q, k, v, do, lse, delta, dk, dv, scale)
                torch.cuda.synchronize()
                row.update(err_vs_triton=max(rel_err(dk, dk_t), rel_err(dv, dv_t)),
                           nan=bool(dk.isnan().any() or dv.isnan().any()))
                ms = timed(lambda: vm.launch_attn_bwd_dkdv_ws(q, k, v, do, lse, delta, dk, dv, scale))
                ms_bwd = timed(lambda: vm.backward(q, k, v, out, lse, do, scale, config=cfg))
                row.update(dkdv_ms=ms, dkdv_tflops=flops_dkdv / ms / 1e9, bwd_ms=ms_bwd, bwd_tflops=total / ms_bwd / 1e9)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
                row["error"] = error_text(e)
            rows.append(row)
        print(f"d={d} causal={causal} N={n}: " + " ".join(
            f"{r['variant']}={r.get('dkdv_tflops', float('nan')):.0f}/{r.get('bwd_tflops', float('nan')):.0f}"
            for r in rows if (r["head_dim"], r["causal"], r["n"]) == (d, causal, n)), flush=True)
        with open(os.path.join(out_dir, "gluon_backward.json"), "w") as f:
            json.dump(dict(rows=rows, checks=checks), f, indent=1)
        del q, k, v, do, out, lse, dq_t, dk_t, dv_t, dk, dv, qg, kg, vg, fo
    names = ["triton"] + list(VARIANTS)
    print("\nGluon dK/dV, bf16, TFLOP/s: dK/dV alone (its four products) | whole backward (FA convention); "
          "! = differs from Triton's by > 1e-2 or NaN")
    print(f"{'d':>4} {'mask':>6} {'N':>6} " + " ".join(f"{x:>8}" for x in names) + " | " +
          " ".join(f"{x:>8}" for x in names + ["flex"]))
    for d, causal, n in CASES:
        sel = {r["variant"]: r for r in rows if (r["head_dim"], r["causal"], r["n"]) == (d, causal, n)}

        def cell(r, key):
            bad = r.get("nan") or r.get("err_vs_triton", 0) > 1e-2
            return f"{r[key]:.1f}{'!' if bad else ''}" if key in r else "err"

        print(f"{d:>4} {'causal' if causal else 'full':>6} {n:>6} " + " ".join(f"{cell(sel[x], 'dkdv_tflops'):>8}" for x in names)
              + " | " + " ".join(f"{cell(sel[x], 'bwd_tflops'):>8}" for x in names + ["flex"]))
    for r in rows:
        if "error" in r:
            print(f"  d={r['head_dim']} causal={r['causal']} N={r['n']} {r['variant']}: {r['error']}")
    for c in checks:
        print("float64 check:", c)


if __name__ == "__main__":
    main()
