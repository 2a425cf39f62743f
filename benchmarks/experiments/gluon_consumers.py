"""Experiment: three consumer warpgroups in the Gluon forward (passes/warp_specialize.py).

    python benchmarks/experiments/gluon_consumers.py OUT_DIR

At d=64 the Gluon forward led FlexAttention by 1.09-1.12x without a mask (NOTES.md v9): per key block a
consumer warpgroup does half the products of d=128 for the same softmax work, so more of its time is
its own dependency chain (wgmma wait -> softmax -> next wgmma). A third consumer warpgroup (192 query
rows a program, 16 warps at 128 registers: consumers 160-168, the loader 24) gives the warp
schedulers a third chain to switch to. Variants are rendered from templates/gluon_forward.py.j2 with
another launch shape (the `consumers` key of the pass's attribute), not edited by hand. Prediction:
+3-8% at d=64; at d=128 a 160-register consumer spills and loses.
Cases: bf16, batch 16384/N, hidden 2048; each variant's output checked against the adopted shape's
(poisoned with NaN first); the Triton kernel and SDPA's cuDNN backend in the same process.
Writes gluon_consumers.json; prints a table (TFLOP/s).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import error_text, load, rel_err, variant_cells  # noqa: E402

THREE = {"consumers": 3, "BLOCK_M": 192, "maxnreg": 128, "consumer_regs": 160}
VARIANTS = {"base": {}, "c3": THREE, "c3n64": dict(THREE, BLOCK_N=64, STAGES=3)}
CASES = [(64, False, 2048), (64, False, 4096), (64, False, 16384), (64, True, 4096), (64, True, 16384),
         (128, False, 4096), (128, True, 16384)]


def variant_module(spec, name: str, shape: dict):
    from attngen.codegen import render
    from attngen.passes import compile_program

    program = compile_program(spec)
    ws = dict(program.attr("warp_specialized"), **shape)
    path = f"/tmp/gluon_consumers/{spec.name}_{name}.py"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(render(spec, program.with_attrs(warp_specialized=tuple(ws.items()))))
    return load(path, f"{spec.name}_{name}")


def main() -> None:
    import attngen
    from attngen.api import sdpa_spec
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for d, causal, n in CASES:
        spec = sdpa_spec("bf16", d, causal)
        kernel = attngen.load(spec)
        b, h, scale = 16384 // n, 2048 // d, d ** -0.5
        gen = torch.Generator(device="cuda").manual_seed(n + d + causal)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
        ref = None
        for name, shape in VARIANTS.items():
            row = dict(head_dim=d, causal=causal, n=n, variant=name, shape=shape)
            try:
                module = variant_module(kernel.spec, name, shape)
                out.fill_(float("nan"))
                lse.fill_(float("nan"))
                module.launch_attn_fwd_ws(q, k, v, out, lse, scale)
                torch.cuda.synchronize()
                ref = out.clone() if ref is None else ref
                row["err_vs_base"] = rel_err(out, ref)
                row["nan"] = bool(out.isnan().any().item() or lse.isnan().any().item())
                ms = triton.testing.do_bench(lambda: module.launch_attn_fwd_ws(q, k, v, out, lse, scale),
                                             warmup=25, rep=200, return_mode="median")
                row.update(ms=ms, tflops=flops / ms / 1e9)
            except Exception as e:  # noqa: BLE001 - a shape that does not compile is a result too
                row["error"] = error_text(e)
            rows.append(row)
        cfg = dict(kernel.config(q, k), warp_specialized=False)
        ms = triton.testing.do_bench(lambda: kernel.module.forward(q, k, v, scale, out=out, lse=lse, config=cfg),
                                     warmup=25, rep=200, return_mode="median")
        rows.append(dict(head_dim=d, causal=causal, n=n, variant="triton", ms=ms, tflops=flops / ms / 1e9))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=scale), warmup=25, rep=200, return_mode="median")
        rows.append(dict(head_dim=d, causal=causal, n=n, variant="cudnn", ms=ms, tflops=flops / ms / 1e9))
        print(f"d={d} causal={causal} N={n}: " + " ".join(
            f"{r['variant']}={r.get('tflops', float('nan')):.0f}" for r in rows[-len(VARIANTS) - 2:]), flush=True)
        with open(os.path.join(out_dir, "gluon_consumers.json"), "w") as f:
            json.dump(rows, f, indent=1)
    names = list(VARIANTS) + ["triton", "cudnn"]
    print("\nGluon forward, consumer warpgroups, TFLOP/s (! = differs from base by > 1e-2 or NaN)")
    print(f"{'d':>4} {'mask':>6} {'N':>6} " + " ".join(f"{x:>8}" for x in names))
    for d, causal, n in CASES:
        sel = [r for r in rows if (r["head_dim"], r["causal"], r["n"]) == (d, causal, n)]
        print(f"{d:>4} {'causal' if causal else 'full':>6} {n:>6} " + variant_cells(sel, names))
    for r in rows:
        if "error" in r:
            print(f"  d={r['head_dim']} causal={r['causal']} N={r['n']} {r['variant']}: {r['error']}")


if __name__ == "__main__":
    main()
