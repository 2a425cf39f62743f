"""Experiment: dQ written by the one-kernel backward's last program per (batch, K/V head) (FINISH).

    git apply benchmarks/experiments/backward_finish.patch   (the change measured; not adopted, NOTES v18)
    python benchmarks/experiments/backward_finish.py OUT_DIR      (GPU; env LENGTHS, HEAD_DIMS, ROUNDS)

The one-kernel Gluon backward (DQ_ATOMIC) adds dS K into a float32 accumulator by TMA reductions; a
row pass after it converts the accumulator to dQ: 50 us on the H200 and 68 on the H100 at every bench
shape (B x H x N = 262144 rows), 12-14% of the d=128 call at N=512, plus one launch of host time
(NOTES v16-v17). With FINISH the program that arrives last for its (batch, K/V head) (an int32 counter
per pair, zeroed by the prep pass; each consumer fences its completed reductions before the program
arrives) converts that pair's rows itself, while the other SMs still compute. Its cost grows with the
rows (one program converts GROUP x N_Q rows): a serial tail at long sequences, hence a row limit.
Prediction: N=512 d=128 -40 us GPU (-8-10%), host -10-15 us; N=4096 a loss (the tail), so the limit
lands at 1024-2048 rows.

Times, alternating rounds, with WS_BWD_SHAPE["FINISH_ROWS"] set to 0 (off: the dQ pass) or 2^30 (on):
  graph   the module's backward (prep, kernel, [dQ pass]) captured in a CUDA graph: GPU time alone
  eager   torch.autograd.grad through attngen.attention, as `attngen bench` times the backward
  flex    compiled FlexAttention's backward, as in the bench
Gradients with FINISH on are checked against off (relative Frobenius: the reductions' order differs).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton

HEAD_DIMS = tuple(int(x) for x in os.environ.get("HEAD_DIMS", "128,64").split(","))
LENGTHS = tuple(int(x) for x in os.environ.get("LENGTHS", "512,1024,2048,4096").split(","))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main() -> int:
    import attngen
    from attngen.api import sdpa_spec
    from attngen.bench import fa_flops, prefill_providers
    from attngen.tuning.search import graphed

    out_dir = next((a for a in sys.argv[1:] if not a.startswith("--")), ".")
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for d in HEAD_DIMS:
        for causal in (True, False):
            module = attngen.load(sdpa_spec("bf16", d, causal)).module
            shape = module.WS_BWD_SHAPE
            shipped = shape["FINISH_ROWS"]
            flex = prefill_providers(causal)["flex"]
            for n in LENGTHS:
                b, h = 16384 // n, 2048 // d
                gen = torch.Generator(device="cuda").manual_seed(11 * n + d + causal)
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                           for _ in range(3))
                do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                flops = fa_flops(b, h, n, n, d, causal, True)
                o = torch.empty_like(q)
                lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
                module.forward(q.detach(), k.detach(), v.detach(), out=o, lse=lse)
                grads = {}
                out_a = attngen.attention(q, k, v, is_causal=causal)
                out_f = flex(q, k, v)
                modes = {"off": 0, "on": 1 << 30}
                for mode, limit in modes.items():
                    shape["FINISH_ROWS"] = limit
                    g = [torch.full_like(t, float("nan")) for t in (q, k, v)]
                    module.backward(q.detach(), k.detach(), v.detach(), o, lse, do, dq=g[0], dk=g[1], dv=g[2])
                    grads[mode] = g
                torch.cuda.synchronize()
                row = {"head_dim": d, "causal": causal, "seqlen": n, "batch": b, "heads": h,
                       "rel diff on vs off": [((x.float() - y.float()).norm() / y.float().norm()).item()
                                              for x, y in zip(grads["on"], grads["off"])],
                       "nan on": any(bool(t.isnan().any()) for t in grads["on"])}
                for rep in range(ROUNDS):
                    for mode in modes if rep % 2 == 0 else reversed(list(modes)):
                        shape["FINISH_ROWS"] = modes[mode]
                        g = grads[mode]

                        def call(g=g):
                            module.backward(q.detach(), k.detach(), v.detach(), o, lse, do, dq=g[0], dk=g[1], dv=g[2])

                        us = triton.testing.do_bench(graphed(call), warmup=25, rep=100, return_mode="median") * 1e3
                        row.setdefault(f"graph us {mode}", []).append(us)
                        ms = triton.testing.do_bench(lambda: torch.autograd.grad(out_a, (q, k, v), do, retain_graph=True),
                                                     warmup=25, rep=100, return_mode="median")
                        row.setdefault(f"eager TFLOP/s {mode}", []).append(flops / ms / 1e9)
                    ms = triton.testing.do_bench(lambda: torch.autograd.grad(out_f, (q, k, v), do, retain_graph=True),
                                                 warmup=25, rep=100, return_mode="median")
                    row.setdefault("flex TFLOP/s", []).append(flops / ms / 1e9)
                shape["FINISH_ROWS"] = shipped
                rows.append(row)
                print(json.dumps(row), flush=True)
                del q, k, v, do, grads, out_a, out_f
                torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "backward_finish.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"\n{torch.cuda.get_device_name()}: backward with dQ finished in the kernel (on) or by the pass (off), "
          f"medians of {ROUNDS} rounds")
    print(f"  {'d':>3} {'mask':6} {'N':>5}  graph us off / on   eager TFLOP/s off / on / flex   on/flex  rel diff")
    for r in rows:
        off, on = med(r["graph us off"]), med(r["graph us on"])
        eo, en, fl = med(r["eager TFLOP/s off"]), med(r["eager TFLOP/s on"]), med(r["flex TFLOP/s"])
        print(f"  {r['head_dim']:3d} {'causal' if r['causal'] else 'full':6} {r['seqlen']:5d}  {off:7.0f} / {on:7.0f}"
              f"   {eo:6.0f} / {en:6.0f} / {fl:6.0f}   {en / fl:5.2f}x  {max(r['rel diff on vs off']):.1e}"
              f"{'  NaN' if r['nan on'] else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
