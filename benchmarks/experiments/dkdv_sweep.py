"""Experiment: the d=128 dK/dV kernel over a wide launch-config grid (the tuner searches near its
default only).

    python benchmarks/experiments/dkdv_sweep.py OUT_DIR

At d=128 the dQ kernel runs its three products at ~615-660 TFLOP/s and the dK/dV kernel its four at
~525-554 (experiments/bench_overhead.py, NOTES v5): dK/dV is 60% of the backward. Its tuned config
(64x64, 4 warps, 2 stages) spills 344 bytes (two [64, 128] fp32 accumulators in one warpgroup).
This times `attn_bwd_dkdv` of the kernel `attngen.attention()` runs (bf16, B=4, H=16, N=4096,
causal and not) at every BLOCK_M x BLOCK_N x warps x stages the resource model admits, including
8-warp programs on 64-key tiles (two warpgroups split each product's columns: half the
accumulator registers per thread). Writes dkdv_sweep.json; prints the ten best per case.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch
import triton

import attngen
from attngen.api import sdpa_spec

from common import error_text, rel_err  # noqa: E402 (this script's folder is on sys.path)


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    d, n = 128, 4096
    b, h = 16384 // n, 2048 // d
    for causal in (False, True):
        kern = attngen.load(sdpa_spec("bf16", d, causal))
        module = kern.module
        gen = torch.Generator(device="cuda").manual_seed(11)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        scale = d ** -0.5
        out, lse = kern.forward(q, k, v, scale)
        tuned = kern.backward_config(q, k)
        dq, dk0, dv0 = kern.backward(q, k, v, out, lse, do, scale)
        delta = torch.empty_like(lse)
        module.launch_attn_bwd_dq(q=q, k=k, v=v, o=out, do=do, lse=lse, delta=delta, dq=dq, sm_scale=scale,
                                  **tuned["attn_bwd_dq"])
        flops = 4 * 2 * b * h * n * n * d / (2 if causal else 1)
        tuner = kern.tuner("attn_bwd_dkdv")
        grid = itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (1, 2, 3))
        for bm, bn, w, s in grid:
            config = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
            row = dict(causal=causal, config=(bm, bn, w, s), tuned=(config == tuned["attn_bwd_dkdv"]))
            reason = tuner.tuning_infeasible(config, None)
            if reason:
                row["skipped"] = str(reason)[:120]
                rows.append(row)
                continue
            dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
            run = lambda: module.launch_attn_bwd_dkdv(q=q, k=k, v=v, do=do, lse=lse, delta=delta, dk=dk, dv=dv,  # noqa: E731
                                                      sm_scale=scale, **config)
            try:
                run()
                torch.cuda.synchronize()
                row["err"] = max(rel_err(dk, dk0), rel_err(dv, dv0))
                ms = triton.testing.do_bench(run, warmup=10, rep=40, return_mode="median")
                row.update(ms=ms, tflops=flops / ms / 1e9)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a result too
                row["error"] = error_text(e, 120)
                torch.cuda.empty_cache()
            rows.append(row)
        print(f"causal={causal} done: tuned {tuned['attn_bwd_dkdv']}", flush=True)
    with open(os.path.join(out_dir, "dkdv_sweep.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}: attn_bwd_dkdv d=128 bf16 N=4096, TFLOP/s of its 4 products")
    for causal in (False, True):
        sel = sorted((r for r in rows if r["causal"] == causal and "tflops" in r), key=lambda r: -r["tflops"])
        print(f"causal={causal}: " + "; ".join(f"{r['config']}{'*' if r['tuned'] else ''} {r['tflops']:.0f}"
                                               for r in sel[:10]))
        tuned = [r for r in sel if r["tuned"]]
        if tuned:
            print(f"  tuned {tuned[0]['config']} {tuned[0]['tflops']:.0f}; max err {max(r['err'] for r in sel):.1e}; "
                  f"errors {sum('error' in r for r in rows if r['causal'] == causal)}, "
                  f"skipped {sum('skipped' in r for r in rows if r['causal'] == causal)}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
