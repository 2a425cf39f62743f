"""Experiment: tile shapes outside the tuner's space for the prefill forward (bf16, N=4096).

    python benchmarks/experiments/forward_configs.py OUT_DIR

The tuner searches BLOCK_M and BLOCK_N up to 128 with 4 or 8 warps. sm_90 compiles show the d=64
kernel at 128 registers and 80 KB of shared memory at its tuned 128x64 / 8 warps / 4 stages, so
two programs share a multiprocessor; 256-row programs of 16 warps (four warpgroups sharing each
K/V tile) fit in the same budget. This times them against the tuned configs with the kernel
`attngen.attention()` runs (the sdpa spec of each dtype/head dim/mask), on the bench's shapes
(batch 16384/N, hidden 2048), checked against SDPA. Writes forward_configs.json; prints a table.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

import attngen
from attngen.api import sdpa_spec

from common import error_text  # noqa: E402 (this script's folder is on sys.path)

CONFIGS = {
    64: [(128, 64, 8, 4), (128, 128, 8, 3), (256, 64, 16, 3), (256, 64, 16, 4), (256, 128, 16, 2),
         (256, 128, 16, 3), (256, 64, 8, 3)],
    128: [(128, 128, 8, 3), (128, 64, 8, 3), (256, 64, 16, 2), (256, 64, 16, 3), (256, 128, 16, 2)],
}


def main(out_dir, n=4096):
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for d, configs in CONFIGS.items():
        for causal in (False, True):
            kernel = attngen.load(sdpa_spec("bf16", d, causal))
            b, h = 16384 // n, 2048 // d
            gen = torch.Generator(device="cuda").manual_seed(d + causal)
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            for cfg in configs:
                config = dict(BLOCK_M=cfg[0], BLOCK_N=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
                row = dict(head_dim=d, causal=causal, n=n, config=cfg)
                try:
                    out = torch.full_like(q, float("nan"))
                    kernel.forward(q, k, v, d ** -0.5, out=out, config=config)
                    row["rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
                    ms = triton.testing.do_bench(lambda: kernel.forward(q, k, v, d ** -0.5, out=out, config=config),
                                                 warmup=25, rep=100, return_mode="median")
                    row.update(ms=ms, tflops=flops / ms / 1e9)
                except Exception as e:  # noqa: BLE001 - a config that does not compile is a result too
                    row["error"] = error_text(e)
                rows.append(row)
                print(row, flush=True)
    with open(os.path.join(out_dir, "forward_configs.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}: forward TFLOP/s by config, bf16 N={n} (first config = tuned)")
    for d, configs in CONFIGS.items():
        print(f"d={d}: " + " ".join(f"{str(c):>18}" for c in configs))
        for causal in (False, True):
            cells = []
            for cfg in configs:
                r = next(r for r in rows if r["head_dim"] == d and r["causal"] == causal and r["config"] == cfg)
                ok = "tflops" in r and r["rel_err"] < 2e-2
                cells.append(f"{r['tflops']:18.1f}" if ok else f"{'err':>18}")
            print(f"{'causal' if causal else 'full':>6}: " + " ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
