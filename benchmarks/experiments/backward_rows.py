"""Experiment: the launch shape of the one-kernel backward's two row passes.

    python benchmarks/experiments/backward_rows.py OUT_DIR   (GPU, sm_90)

NOTES v16: the row passes around the Gluon backward (`attn_bwd_prep_ws`: lse and delta rows plus the
zeroed float32 dQ accumulator; `attn_bwd_dq_ws`: dQ from it) take 83 + 50 us on an H200 at every bench
N (B x H x N = 262144 at d=128), 32% of the GPU time at N=512. The prep pass moves 268 MB in 83 us
(3.2 TB/s, two thirds of the read bandwidth), the dQ pass 201 MB in 50 us (4.0 TB/s). Both run blocks
of BLOCK_M = 64 rows with 4 warps. This times each pass (a CUDA-graph replay, do_bench median) at other
row blocks and warp counts, and torch's zero_ of the accumulator alone (what the prep pass's zeroing
would cost as a pass of its own), at N=512 for d=128 and 64, and checks that every variant writes what
the layout before (BLOCK_M rows, 4 warps) writes (outputs poisoned with NaN first).
Prediction: the prep pass reaches ~4 TB/s (-15 us) with more rows or warps per program; the dQ pass is
already near the copy bandwidth.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main() -> int:
    import attngen
    from attngen.api import sdpa_spec
    from attngen.tuning.search import graphed

    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    rows_out = []
    for d in (128, 64):
        n = 512
        b, h = 16384 // n, 2048 // d
        gen = torch.Generator(device="cuda").manual_seed(d)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        kernel = attngen.load(sdpa_spec("bf16", d, True))
        m = kernel.module
        o, lse = kernel.forward(q, k, v, d ** -0.5)
        shape = m.WS_BWD_SHAPE
        n_pad = m.cdiv(n, shape["BLOCK_M"]) * shape["BLOCK_M"]
        dq_acc = torch.randn((b, h, n, d), device="cuda", dtype=torch.float32, generator=gen)
        dq = torch.empty_like(q)

        def prep(block, warps, rows, acc):
            return lambda: m.attn_bwd_prep_ws.fn[(n_pad // block, h, b)](
                o, do, lse, rows, acc, *o.stride(), *do.stride(), *lse.stride(), h, n, n_pad, BLOCK=block,
                HEAD_DIM=d, num_warps=warps)

        def dq_pass(block, warps, out):
            return lambda: m.attn_bwd_dq_ws.fn[(n_pad // block, h, b)](
                dq_acc, out, *out.stride(), h, n, 0.5, BLOCK=block, HEAD_DIM=d, num_warps=warps)

        # the reference: the layout before v17 (BLOCK_M rows a program; ROW_BLOCK since)
        ref_rows = torch.full((b, h, 2, n_pad), float("nan"), device="cuda")
        ref_acc = torch.full_like(dq_acc, float("nan"))
        prep(shape["BLOCK_M"], 4, ref_rows, ref_acc)()
        ref_dq = torch.full_like(dq, float("nan"))
        dq_pass(shape["BLOCK_M"], 4, ref_dq)()
        prep_bytes = 2 * o.numel() * 2 + dq_acc.numel() * 4 + ref_rows.numel() * 4
        dq_bytes = dq_acc.numel() * 4 + dq.numel() * 2
        for name, make, nbytes in (("prep", prep, prep_bytes), ("dq", dq_pass, dq_bytes)):
            for block in (16, 32, 64, 128):
                if n_pad % block:
                    continue
                for warps in (1, 2, 4, 8):
                    if block * d // (32 * warps) < 8:  # fewer than 8 elements a thread
                        continue
                    if name == "prep":
                        got_rows = torch.full_like(ref_rows, float("nan"))
                        got_acc = torch.full_like(ref_acc, float("nan"))
                        fn = make(block, warps, got_rows, got_acc)
                        fn()
                        same = bool(torch.equal(got_rows, ref_rows) and torch.equal(got_acc, ref_acc))
                    else:
                        got = torch.full_like(ref_dq, float("nan"))
                        fn = make(block, warps, got)
                        fn()
                        same = bool(torch.equal(got, ref_dq))
                    us = triton.testing.do_bench(graphed(fn), warmup=50, rep=300) * 1e3
                    row = {"d": d, "pass": name, "BLOCK": block, "warps": warps, "us": us,
                           "TB/s": nbytes / us / 1e6, "same": same, "before": block == shape["BLOCK_M"] and warps == 4}
                    rows_out.append(row)
                    print(json.dumps(row), flush=True)
        zero = graphed(lambda: dq_acc.zero_())
        us = triton.testing.do_bench(zero, warmup=50, rep=300) * 1e3
        rows_out.append({"d": d, "pass": "zero_ of the accumulator", "us": us, "TB/s": dq_acc.numel() * 4 / us / 1e6})
        print(json.dumps(rows_out[-1]), flush=True)
    with open(os.path.join(out_dir, "backward_rows.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}: row passes at N=512 (us, TB/s; before: BLOCK_M rows, 4 warps)")
    for d in (128, 64):
        for name in ("prep", "dq"):
            rs = sorted((r for r in rows_out if r["d"] == d and r["pass"] == name), key=lambda r: r["us"])
            best, before = rs[0], next(r for r in rs if r["before"])
            print(f"  d={d} {name:4s} before {before['us']:6.1f} ({before['TB/s']:.2f}); best BLOCK {best['BLOCK']} "
                  f"warps {best['warps']} {best['us']:6.1f} ({best['TB/s']:.2f}); all equal: {all(r['same'] for r in rs)}")
        z = next(r for r in rows_out if r["d"] == d and r["pass"].startswith("zero"))
        print(f"  d={d} zero_ of the accumulator {z['us']:6.1f} ({z['TB/s']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
