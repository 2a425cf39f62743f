"""Experiment: dQ inside the Gluon dK/dV kernel (DQ_ATOMIC in templates/gluon_backward.py.j2).

    python benchmarks/experiments/gluon_dq_atomic.py OUT_DIR [HEAD_DIM [N,N,...]]

The d=128 backward ran two kernels (NOTES.md v10): the Gluon dK/dV kernel (S^T, dP^T, dV, dK: four
products, 558-570 TFLOP/s) and the Triton dQ kernel, which recomputes S and dP for dQ = dS K (three
products, ~630 TFLOP/s): seven products where the FA convention counts five; whole backward 1.03-1.07x
FlexAttention. DQ_ATOMIC has each consumer warpgroup write its dS^T to shared memory; after an mbarrier
both warpgroups have the program's 128 keys of dS, and each computes its 64 columns of dQ = dS K for
the step's 64 queries and adds them into a float32 accumulator by a TMA reduction
(cp.reduce.async.bulk.tensor), FA3's scheme. A row pass before (delta, zeroed accumulator) and after
(dQ = sm_scale * acc in bf16) costs ~3 bytes x 12 per element of dQ, so short rows lose.
Prediction: the kernel at ~540 TFLOP/s on five products; whole backward at N=16384 ~+20% (1.2x Flex),
at N=4096 about even with the split form, at N <= 2048 a loss.
Cases: bf16, batch 16384/N, hidden 2048 (HEAD_DIM 128: 16 heads, 64: 32), N 1024-16384, full and
causal. Variants of the whole `module.backward`: triton (the Triton dK/dV and dQ kernels), split (Gluon
dK/dV, Triton dQ), fused (DQ_ATOMIC; lse and delta reach shared memory by TMA with Q and dO, ROWS_SMEM),
fused_ptr (DQ_ATOMIC, lse and delta through pointers, PREFETCH as the pass sets it), fused_s3 (3 stages);
FlexAttention's backward; the fused kernel alone. Gradients of each against the Triton kernels'; on
small odd GQA cases (N_Q != N_K, both causal alignments) dQ, dK, dV of the fused path (poisoned first)
against a float64 reference.
Run 1 (d=128, before ROWS_SMEM): fused 1.06-1.14x Flex, causal below the split form at N=1024 -- and
dQ wrong in the last query block: a consumer stored dK into its K buffer while the other consumer's
last dQ product still read it (now an mbarrier, `done_bar`). With ROWS_SMEM (lse/delta latency off
the consumers' path; PREFETCH had cost registers): 1.24-1.33x Flex.
Writes gluon_dq_atomic_d<HEAD_DIM>.json; prints a table (TFLOP/s, FA convention).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import error_text, reference_grads, rel_err  # noqa: E402

CASES = [(c, n) for c in (False, True) for n in (1024, 2048, 4096, 8192, 16384)]
VARIANTS = {  # name: WS_BWD_SHAPE changes, None for the Triton dK/dV and dQ kernels
    "triton": None, "split": dict(DQ_ATOMIC=False), "fused": dict(DQ_ATOMIC=True),
    "fused_ptr": dict(DQ_ATOMIC=True, ROWS_SMEM=False), "fused_s3": dict(DQ_ATOMIC=True, STAGES=3)}


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def forced(m, **changes):
    """WS_BWD_SHAPE with `changes`, at every size (min_scores, min_keys and dq_atomic_keys lifted)."""
    return dict(m.WS_BWD_SHAPE, dq_atomic_keys=0, min_scores=0, min_keys=0, **changes)


def reference_check(m, mask: str, gen) -> dict:
    """dQ, dK, dV of the fused path against float64 on an odd GQA case with N_Q != N_K."""
    b, h, hkv, n_q, n_k, d = 2, 4, 2, 333, 1111 if mask != "none" else 777, m.HEAD_DIM
    q = torch.randn(b, h, n_q, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, hkv, n_k, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    do = torch.randn_like(q)
    out, lse = m.forward(q, k, v, d ** -0.5)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    m.WS_BWD_SHAPE.update(forced(m, DQ_ATOMIC=True))
    ran = m.ws_bwd_ready(q, k, v, do, dk, dv) and m.ws_bwd_fused()
    m.backward(q, k, v, out, lse, do, d ** -0.5, dq=dq, dk=dk, dv=dv)
    gq, gk, gv = reference_grads(q, k, v, do, mask, d ** -0.5)
    return dict(mask=mask, ran_fused=ran, dq_err=rel_err(dq, gq), dk_err=rel_err(dk, gk), dv_err=rel_err(dv, gv),
                nan=bool(dq.isnan().any() or dk.isnan().any() or dv.isnan().any()))


def main() -> None:
    import attngen
    from attngen.api import sdpa_spec
    from attngen.bench import fa_flops, prefill_providers
    from attngen.spec import parse

    out_dir, d = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 128
    cases = [(c, int(n)) for c in (False, True) for n in sys.argv[3].split(",")] if len(sys.argv) > 3 else CASES
    tag = f"d{d}" + (f"_n{sys.argv[3].replace(',', '_')}" if len(sys.argv) > 3 else "")
    os.makedirs(out_dir, exist_ok=True)
    rows, checks = [], []
    kernels = {c: attngen.load(sdpa_spec("bf16", d, c)) for c in (False, True)}
    shipped = {c: dict(kernels[c].module.WS_BWD_SHAPE) for c in (False, True)}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for mask in ("none", "top_left", "bottom_right"):
        text = (f"kernel dq_atomic_{mask} {{\n    direction = forward+backward\n    mask = "
                f"{'none' if mask == 'none' else f'causal({mask})'}\n    head_dim = {d}\n    dtype = bf16\n}}\n")
        try:
            checks.append(reference_check(attngen.load(parse(text, f"<{mask}>")).module, mask, gen))
        except Exception as e:  # noqa: BLE001
            checks.append(dict(mask=mask, error=error_text(e)))
        print("check", checks[-1], flush=True)
    flex = {c: prefill_providers(c)["flex"] for c in (False, True)}
    for causal, n in cases:
        m = kernels[causal].module
        b, h, scale = 16384 // n, 2048 // d, d ** -0.5
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        out, lse = m.forward(q, k, v, scale)
        total = fa_flops(b, h, n, n, d, causal, backward=True)
        base = dict(head_dim=d, causal=causal, n=n)
        grads = {}
        for name, changes in VARIANTS.items():
            config = None
            if changes is None:
                cfg = kernels[causal].backward_config(q, k)
                config = dict(cfg, attn_bwd_dkdv=dict(cfg["attn_bwd_dkdv"], warp_specialized=False))
            else:
                m.WS_BWD_SHAPE.update(forced(m, **changes))
            row = dict(base, variant=name)
            try:
                grads[name] = m.backward(q, k, v, out, lse, do, scale, config=config)
                torch.cuda.synchronize()
                ms = timed(lambda: m.backward(q, k, v, out, lse, do, scale, config=config))
                row.update(bwd_ms=ms, bwd_tflops=total / ms / 1e9)
                if name == "fused":  # the kernel alone, on the arguments launch_attn_bwd_ws gave it
                    seen, launch = [], m.launch_attn_bwd_dkdv_ws
                    m.launch_attn_bwd_dkdv_ws = lambda *a, **kw: (seen.append((a, kw)), launch(*a, **kw))
                    m.backward(q, k, v, out, lse, do, scale)
                    m.launch_attn_bwd_dkdv_ws = launch
                    ms = timed(lambda: launch(*seen[0][0], **seen[0][1]))
                    row.update(kernel_ms=ms, kernel_tflops=total / ms / 1e9)
                if name != "triton":
                    row.update(err_vs_triton=max(rel_err(a, t) for a, t in zip(grads[name], grads["triton"])),
                               nan=any(bool(t.isnan().any()) for t in grads[name]))
            except Exception as e:  # noqa: BLE001 - a variant that fails is a result too
                row["error"] = error_text(e)
            finally:
                m.WS_BWD_SHAPE.clear()
                m.WS_BWD_SHAPE.update(shipped[causal])
            rows.append(row)
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        fo = flex[causal](qg, kg, vg)
        ms = timed(lambda: torch.autograd.grad(fo, (qg, kg, vg), do, retain_graph=True))
        rows.append(dict(base, variant="flex", bwd_ms=ms, bwd_tflops=total / ms / 1e9))
        print(f"causal={causal} N={n}: " + " ".join(f"{r['variant']}={r.get('bwd_tflops', float('nan')):.0f}"
                                                     for r in rows if (r["causal"], r["n"]) == (causal, n)), flush=True)
        with open(os.path.join(out_dir, f"gluon_dq_atomic_{tag}.json"), "w") as f:
            json.dump(dict(rows=rows, checks=checks), f, indent=1)
        del q, k, v, do, out, lse, grads, qg, kg, vg, fo
    names = list(VARIANTS) + ["flex"]
    print(f"\nDQ_ATOMIC, d={d} bf16, whole backward TFLOP/s (FA convention); kernel = the fused kernel alone (no row "
          "passes); ! = differs from the Triton kernels' gradients by > 2e-2 or NaN; last column fused / flex")
    print(f"{'mask':>6} {'N':>6} " + " ".join(f"{x:>9}" for x in names + ["kernel", "fused/flex"]))
    for causal, n in cases:
        sel = {r["variant"]: r for r in rows if (r["causal"], r["n"]) == (causal, n)}

        def cell(r, key="bwd_tflops"):
            bad = "!" if r.get("nan") or r.get("err_vs_triton", 0) > 2e-2 else " "
            return f"{r[key]:>8.1f}{bad}" if key in r else f"{'err':>9}"

        ratio = sel["fused"].get("bwd_tflops", float("nan")) / sel["flex"]["bwd_tflops"]
        print(f"{'causal' if causal else 'full':>6} {n:>6} " + " ".join(cell(sel[x]) for x in names)
              + f" {cell(sel['fused'], 'kernel_tflops')} {ratio:>9.3f}")
    for r in rows:
        if "error" in r:
            print(f"  causal={r['causal']} N={r['n']} {r['variant']}: {r['error']}")
    for c in checks:
        print("float64 check:", c)


if __name__ == "__main__":
    main()
