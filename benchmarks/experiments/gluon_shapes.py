"""Experiment: launch shapes of the Gluon forward (passes/warp_specialize.py) beyond the adopted one.

    python benchmarks/experiments/gluon_shapes.py OUT_DIR

The generated module reads its Gluon kernel's shape (WS_SHAPE) at each launch, so variants are the
same kernel source at other constexprs: 256 query rows per program (128 per consumer warpgroup: the
[128, D] accumulator and [128, BLOCK_N] scores fit a consumer's 240 registers at d=64 only), 256-key
blocks, 3 stages. Also the Triton kernel (config warp_specialized=False, tuned config) and SDPA's
cuDNN backend. bf16 non-causal, batch 16384/N, hidden 2048. Each variant's output is checked against
the adopted shape's (poisoned with NaN first). Prediction: d=64 gains from 256-row programs (each K/V
tile serves twice the rows; half the programs) by 3-8%, nothing from more stages.
Writes gluon_shapes.json; prints a table (TFLOP/s).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import error_text, rel_err, variant_cells  # noqa: E402

VARIANTS = {64: {"base": {}, "m256": {"BLOCK_M": 256}, "n256": {"BLOCK_N": 256}, "s3": {"STAGES": 3},
                 "m256s3": {"BLOCK_M": 256, "STAGES": 3}, "m256n64": {"BLOCK_M": 256, "BLOCK_N": 64, "STAGES": 4}},
            128: {"base": {}, "s3": {"STAGES": 3}, "n64s4": {"BLOCK_N": 64, "STAGES": 4}}}
LENGTHS = (1024, 4096, 16384)


def set_shape(module, base: dict, shape: dict) -> None:
    from triton.experimental.gluon import language as gl

    module.WS_SHAPE = dict(base, **shape)
    dt = gl.bfloat16 if module.DTYPE == torch.bfloat16 else gl.float16
    module._WS_Q_LAYOUT = gl.NVMMASharedLayout.get_default_for([1, 1, module.WS_SHAPE["BLOCK_M"] // 2, module.HEAD_DIM], dt)
    module._WS_KV_LAYOUT = gl.NVMMASharedLayout.get_default_for([1, 1, module.WS_SHAPE["BLOCK_N"], module.HEAD_DIM], dt)


def main() -> None:
    import attngen
    from attngen.api import sdpa_spec
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for d, variants in VARIANTS.items():
        kernel = attngen.load(sdpa_spec("bf16", d, False))
        module = kernel.module
        base_shape = dict(module.WS_SHAPE)
        h, scale = 2048 // d, d ** -0.5
        for n in LENGTHS:
            b = 16384 // n
            gen = torch.Generator(device="cuda").manual_seed(n + d)
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
            flops = 4 * b * h * n * n * d
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], device="cuda")
            cfg = kernel.config(q, k)
            timed = {"triton": lambda: module.forward(q, k, v, scale, out=out, lse=lse, config=dict(cfg, warp_specialized=False))}
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cudnn_ms = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale),
                                                   warmup=25, rep=200, return_mode="median")
            ref = None
            for name, shape in variants.items():
                row = dict(head_dim=d, n=n, batch=b, heads=h, variant=name, shape=dict(base_shape, **shape))
                try:
                    set_shape(module, base_shape, shape)
                    out.fill_(float("nan"))
                    lse.fill_(float("nan"))
                    module.launch_attn_fwd_ws(q, k, v, out, lse, scale)
                    torch.cuda.synchronize()
                    if ref is None:
                        ref = out.clone()
                    row["err_vs_base"] = rel_err(out, ref)
                    row["nan"] = bool(out.isnan().any().item() or lse.isnan().any().item())
                    ms = triton.testing.do_bench(lambda: module.launch_attn_fwd_ws(q, k, v, out, lse, scale),
                                                 warmup=25, rep=200, return_mode="median")
                    row.update(ms=ms, tflops=flops / ms / 1e9)
                except Exception as e:  # noqa: BLE001 - a shape that does not compile is a result too
                    row["error"] = error_text(e)
                rows.append(row)
            set_shape(module, base_shape, {})
            ms = triton.testing.do_bench(timed["triton"], warmup=25, rep=200, return_mode="median")
            rows.append(dict(head_dim=d, n=n, variant="triton", config=cfg, ms=ms, tflops=flops / ms / 1e9))
            rows.append(dict(head_dim=d, n=n, variant="cudnn", ms=cudnn_ms, tflops=flops / cudnn_ms / 1e9))
            print(f"d={d} N={n}: " + " ".join(f"{r['variant']}={r.get('tflops', float('nan')):.0f}"
                                              for r in rows if r["head_dim"] == d and r["n"] == n), flush=True)
            with open(os.path.join(out_dir, "gluon_shapes.json"), "w") as f:
                json.dump(rows, f, indent=1)
    print("\nGluon forward launch shapes, bf16 non-causal, TFLOP/s (! = differs from base by > 1e-2 or NaN)")
    for d, variants in VARIANTS.items():
        names = list(variants) + ["triton", "cudnn"]
        print(f"{'d':>4} {'N':>6} " + " ".join(f"{x:>8}" for x in names))
        for n in LENGTHS:
            sel = [r for r in rows if r["head_dim"] == d and r["n"] == n]
            print(f"{d:>4} {n:>6} " + variant_cells(sel, names))
    for r in rows:
        if "error" in r:
            print(f"  d={r['head_dim']} N={r['n']} {r['variant']}: {r['error']}")


if __name__ == "__main__":
    main()
