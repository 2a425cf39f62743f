"""Experiment: every GPU kernel of one attngen call beside every kernel of SDPA cuDNN's, per prefill case.

    python benchmarks/experiments/kernel_breakdown.py OUT_DIR [CASE ...]
    CASE: DIRECTION:D:MASK:N[:BATCH:HEADS], e.g. backward:64:full:2048 or forward:64:causal:512:32:33
    (default: CASES below; GPU; bf16, batch 16384/N and hidden 2048 as the prefill bench unless given)

The bench's d=64 backward without a mask trails cuDNN most at N = 1024-2048 (0.95 / 0.91x in the committed
H200 run) and least at 16384 (0.98x), and cuDNN's TFLOP/s is flat from 2048 to 4096 where ours climbs.
NOTES v24 measured our Gluon kernel alone at 831 us at N=1024 against ~1000 us for the whole call: the
row passes (the prep pass: delta = rowsum(dO * O) and a zeroed float32 dQ accumulator; the dQ pass:
that accumulator scaled to bf16) move 14 bytes per element of Q whatever N is, ~117 us at ~4 TB/s, so
their share halves each time N doubles. Prediction: the row passes are most of the gap at N <= 2048, and
cuDNN's own kernel list (its main kernel against its passes) says whether its passes are cheaper or its
main kernel slower. The short causal forward rows (0.88-0.90x at N = 512-1024) are profiled alongside.

Each provider's call (attngen.attention / SDPA with the cuDNN backend, through autograd for the backward,
as the bench calls them) is profiled by torch.profiler over 10 back-to-back calls (best of 3 rounds,
alternating providers), kernel by kernel, and timed whole by do_bench (median, with its cache flush, as the
bench). Writes kernel_breakdown.json; prints a table per case.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import profiled_us  # noqa: E402 - GPU us per call of each kernel, by torch.profiler

CASES = ["backward:64:full:1024", "backward:64:full:2048", "backward:64:full:4096", "backward:128:full:2048",
         "forward:64:causal:512", "forward:64:causal:1024", "forward:128:causal:512"]


def run_case(case: str) -> dict:
    import torch
    import triton

    from attngen.bench import fa_flops, prefill_providers

    direction, d, mask, n, *bh = case.split(":")
    d, n, causal = int(d), int(n), mask == "causal"
    b, h = map(int, bh) if bh else (16384 // n, 2048 // d)
    gen = torch.Generator(device="cuda").manual_seed(n + d + causal)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    impls = prefill_providers(causal)
    fns = {}
    for name in ("attngen", "sdpa_cudnn"):
        if direction == "forward":
            fns[name] = (lambda f=impls[name]: f(q.detach(), k.detach(), v.detach()))
        else:
            out = impls[name](q, k, v)
            fns[name] = (lambda o=out: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
    got = {name: fn() for name, fn in fns.items()}
    torch.cuda.synchronize()
    a, c = (got[x] if direction == "backward" else (got[x],) for x in ("attngen", "sdpa_cudnn"))
    err = max(float(((x.float() - y.float()).abs().max() / y.float().abs().max())) for x, y in zip(a, c))
    flops = fa_flops(b, h, n, n, d, causal, backward=direction == "backward")
    row = dict(case=case, rel_err_vs_cudnn=err)
    for rnd in range(3):
        for name in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
            ks = {k: us for k, us in profiled_us(fns[name], "").items() if us > 0}  # every GPU kernel
            total = sum(ks.values())
            if total < row.get(f"{name} gpu us", float("inf")):
                row[f"{name} gpu us"], row[f"{name} kernels"] = total, ks
    for rnd in range(3):
        for name in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
            ms = triton.testing.do_bench(fns[name], warmup=25, rep=100, return_mode="median")
            row.setdefault(f"{name} tflops rounds", []).append(flops / ms / 1e9)
    for name in fns:
        row[f"{name} tflops"] = max(row[f"{name} tflops rounds"])
        row[f"{name} tflops by gpu us"] = flops / row[f"{name} gpu us"] / 1e6
    return row


def main() -> int:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    cases = sys.argv[2:] or CASES
    rows = []
    for case in cases:
        try:
            rows.append(run_case(case))
        except Exception as e:  # noqa: BLE001 - a case that fails is a result too
            rows.append(dict(case=case, error=f"{type(e).__name__}: {e}"[:300]))
        with open(os.path.join(out_dir, "kernel_breakdown.json"), "w") as f:
            json.dump(rows, f, indent=1)
    for row in rows:
        print(f"\n== {row['case']}" + (f"  ERROR {row['error']}" if "error" in row else
              f"  (rel err vs cuDNN {row['rel_err_vs_cudnn']:.2e})"))
        for name in ("attngen", "sdpa_cudnn"):
            if f"{name} gpu us" not in row:
                continue
            print(f"  {name}: do_bench {row[f'{name} tflops']:.0f} TFLOP/s, profiled GPU {row[f'{name} gpu us']:.1f} us"
                  f" ({row[f'{name} tflops by gpu us']:.0f} TFLOP/s)")
            for kname, us in sorted(row[f"{name} kernels"].items(), key=lambda x: -x[1]):
                print(f"    {us:9.1f}  {kname[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
