"""Experiment: each consumer of the one-kernel Gluon backward makes dQ over its own keys (DQ_LOCAL).

    python benchmarks/experiments/gluon_dq_local.py OUT_DIR [HEAD_DIM [N ...]] [--key=NAME]
    (GPU; N: lengths other than CASES'; --key: A/B another boolean key of the backward's shape, off (l0) / on
    (l1), instead of DQ_LOCAL: `--key=P16` with gluon_bwd_p16.patch applied, NOTES v25)

(DQ_LOCAL: a constexpr of the kernel since v25, which the launch sets from `dq_local_rows` query rows on,
BWD_DQ_LOCAL_ROWS in passes/warp_specialize.py; both variants here are rendered from the template with that
threshold at 1 (l1) and 0 (l0).)

In the shipped kernel (NOTES v11) each consumer warpgroup writes its dS^T to shared memory and arrives on
an mbarrier; each then waits for the other's, and computes its HEAD_DIM / 2 columns of the step's
dQ = dS K over all 128 keys of the program. That wait ties the two warpgroups together at every step:
their softmax phases (exp2, dS, stores) fall at the same time and the tensor cores idle through them.
With DQ_LOCAL a warpgroup computes every column of dQ over its own 64 keys (dS^T from its own buffer, its
own K) and adds that partial sum into the float32 accumulator by its own TMA reduction: no wait on the
other warpgroup, the same products, twice the reduction traffic (each warpgroup reduces [64, HEAD_DIM]
float32 a step instead of [64, HEAD_DIM / 2]) and, at d=128, a [64, 128] float32 dQ accumulator in
registers instead of [64, 64] (ptxas on the CPU: spills 184 -> 240 bytes without a mask, 232 -> 260
causal; shared memory 198 -> 214 KB; d=64: no spills either way).
Prediction: d=64 +2-5% (its steps are short, so the wait is a larger share), d=128 within +-2%.
Cases: bf16, batch 16384/N, hidden 2048; l0 = shipped algorithm, l1 = DQ_LOCAL, whole `module.backward`
(row passes included); kernel times by torch.profiler (10 back-to-back calls, 4 alternating rounds) and
do_bench of the whole call beside SDPA cuDNN's backward (torch.autograd.grad) in alternating rounds;
gradients of l1 against l0's, and on small odd GQA cases (both causal alignments, N_Q != N_K) against float64.
Writes gluon_<key>.json (gluon_dq_local_rows.json for DQ_LOCAL); prints a table.
Result (H200; results/h200_gluon_dq_local_v24.json, all cases, and h200_gluon_dq_local_d64_v24.json, d=64 again
on the same machine): float64 checks pass (dQ, dK, dV 0.0023-0.0025 for every mask). d=64 without a mask:
the kernel 5-10% faster (1024 878 -> 830 us, 4096 3224 -> 2913, 16384 12591 -> 11936), the whole call
343 -> 343-349, 407-411 -> 418-423, 426-433 -> 437-445 TFLOP/s (cuDNN 358-373, 422-432, 444-454). d=64
causal: the kernel 0.5-3% faster but the whole call 0-3% slower in both runs (the profiler's calls run
back to back; do_bench flushes the cache before each). d=128: 23-30% slower (kernel and call). Adopted
for d=64 without a mask only (BWD_DQ_LOCAL).
v25 (`gluon_dq_local.py OUT 64 512 1024`): at N=512 without a mask the kernel 5.4% slower on the H100 (491 ->
518 us; call 262 -> 250 TFLOP/s, Flex 235) and level on the H200 (496 -> 497); at 1024 2% / 5.3% faster. So it
runs from 1024 query rows on (BWD_DQ_LOCAL_ROWS).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
KEY = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--key=")), "dq_local_rows")
ON, OFF = (1, 0) if KEY == "dq_local_rows" else (True, False)

from common import alternating_ms, error_text, gluon_variant_module, profiled_us, reference_grads, rel_err  # noqa: E402

CASES = [(64, c, n) for c in (False, True) for n in (1024, 4096, 16384)] + \
        [(128, c, n) for c in (False, True) for n in (4096, 16384)]


def float64_checks() -> list:
    import torch

    import attngen
    from attngen.spec import parse

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for d in [x for x in (64, 128) if len(ARGS) < 2 or x == int(ARGS[1])]:
        for mask in ("none", "top_left", "bottom_right"):
            text = (f"kernel dq_local_{mask}_{d} {{\n    direction = forward+backward\n    mask = "
                    f"{'none' if mask == 'none' else f'causal({mask})'}\n    head_dim = {d}\n    dtype = bf16\n}}\n")
            spec = attngen.load(parse(text, f"<{mask}>")).spec
            m = gluon_variant_module(spec, "l1", {KEY: ON, "min_scores": 0, "min_keys": 0},
                                     "dq_local", attr="warp_specialized_bwd")
            b, h, hkv, n_q = 2, 4, 2, 333
            n_k = 1111 if mask != "none" else 777
            q = torch.randn(b, h, n_q, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            k, v = (torch.randn(b, hkv, n_k, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
            do = torch.randn_like(q)
            out, lse = m.forward(q, k, v, d ** -0.5)
            dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
            ran = m.ws_bwd_ready(q, k, v, do, dk, dv) and m.ws_bwd_fused()
            m.backward(q, k, v, out, lse, do, d ** -0.5, dq=dq, dk=dk, dv=dv)
            gq, gk, gv = reference_grads(q, k, v, do, mask, d ** -0.5)
            rows.append(dict(head_dim=d, mask=mask, ran_gluon=ran, dq_err=rel_err(dq, gq), dk_err=rel_err(dk, gk),
                             dv_err=rel_err(dv, gv), nan=bool(dq.isnan().any() or dk.isnan().any() or dv.isnan().any())))
            print("check", rows[-1], flush=True)
    return rows


def main() -> int:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen
    from attngen.api import sdpa_spec
    from attngen.bench import fa_flops

    out_dir = ARGS[0]
    os.makedirs(out_dir, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "key": KEY, "checks": float64_checks(), "rows": []}
    lengths = [int(a) for a in ARGS[2:]]
    cases = [(int(ARGS[1]), c, n) for c in (False, True) for n in lengths] if lengths else CASES
    for d, causal, n in [c for c in cases if len(ARGS) < 2 or c[0] == int(ARGS[1])]:
        spec = attngen.load(sdpa_spec("bf16", d, causal)).spec
        mods = {x: gluon_variant_module(spec, x, {KEY: ON if x == "l1" else OFF}, "dq_local", attr="warp_specialized_bwd")
                for x in ("l0", "l1")}
        b, h, scale = 16384 // n, 2048 // d, d ** -0.5
        gen = torch.Generator(device="cuda").manual_seed(n + d + causal)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        out, lse = mods["l0"].forward(q, k, v, scale)
        flops = fa_flops(b, h, n, n, d, causal, backward=True)
        row = dict(head_dim=d, causal=causal, n=n)
        grads, fns = {}, {}
        for x, m in mods.items():
            try:
                grads[x] = m.backward(q, k, v, out, lse, do, scale)
                torch.cuda.synchronize()
                row[f"{x} err"] = max(rel_err(a, r) for a, r in zip(grads[x], grads["l0"]))
                fns[x] = lambda m=m: m.backward(q, k, v, out, lse, do, scale)
            except Exception as e:  # noqa: BLE001 - a variant that fails is a result too
                row[f"{x} error"] = error_text(e)
        kus = {x: [] for x in fns}
        for rnd in range(4):
            for x in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
                kus[x].append(sum(profiled_us(fns[x], "attn_bwd_dkdv_ws").values()))
        for x, ts in kus.items():
            row[f"{x} kernel us"] = ts
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale)
        fns["cudnn"] = lambda: torch.autograd.grad(ref, (qg, kg, vg), do, retain_graph=True)
        for x, ts in alternating_ms(fns, rep=100).items():
            row[x] = flops / min(ts) / 1e9
            row[f"{x} rounds"] = [flops / t / 1e9 for t in ts]
        result["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if "rounds" not in k}), flush=True)
        with open(os.path.join(out_dir, f"gluon_{KEY.lower()}.json"), "w") as f:
            json.dump(result, f, indent=1)
        del q, k, v, do, out, lse, grads, qg, kg, vg, ref, fns

    print(f"\n{result['device']}: one-kernel Gluon backward, {KEY} off (l0) / on (l1). Kernel: the Gluon kernel "
          "alone, best of 4 profiler rounds (us); whole call TFLOP/s, best of 3 do_bench rounds")
    print(f"{'d':>4} {'mask':>6} {'N':>6} {'l0 us':>9} {'l1 us':>9} {'l1/l0':>6}   {'l0':>5} {'l1':>5} {'cudnn':>5}  errs")
    for r in result["rows"]:
        k0, k1 = (min(r.get(f"{x} kernel us", [float("nan")])) for x in ("l0", "l1"))
        errs = " ".join(k for k in r if (k.endswith("err") and r[k] > 2e-2) or k.endswith("error"))
        print(f"{r['head_dim']:>4} {'causal' if r['causal'] else 'full':>6} {r['n']:>6} {k0:9.1f} {k1:9.1f} {k1 / k0:6.3f}   "
              + " ".join(f"{r.get(x, float('nan')):5.0f}" for x in ("l0", "l1", "cudnn")) + f"  {errs}")
    bad = [c for c in result["checks"] if c["nan"] or max(c["dq_err"], c["dk_err"], c["dv_err"]) > 2e-2 or not c["ran_gluon"]]
    print(f"float64 checks: {len(result['checks']) - len(bad)} of {len(result['checks'])} passed"
          + "".join(f"\n  {c}" for c in bad))
    return 0


if __name__ == "__main__":
    sys.exit(main())
