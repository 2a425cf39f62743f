"""Experiment: why the dK/dV kernel runs at ~450 TFLOP/s while dQ runs at ~660, and what helps.

    python benchmarks/experiments/backward_variants.py OUT_DIR

sm_90 compiles (benchmarks/experiments/regs.py) show the generated dK/dV kernel at 255 registers
with spills at every BLOCK_N=128 config (164 bytes at 64x128 / 8 warps / 2 stages, 348 at 3
stages): two [128, D] fp32 accumulators take 128 registers per thread, and the pointer tensors of
the Q and dO loads, two [BLOCK_N, BLOCK_M] fp32 score tiles and their bf16 copies take the rest.
Variants of generated/train_d128.py's `attn_bwd_dkdv` (textual rewrites, each a candidate pass):
  tma    Q and dO of the unmasked query loop through host-side TMA descriptors of the
         (B*H*N, D) view (no pointer tensors; bulk async copies)
  tma4   the same through 4-D descriptors of (B, H, N, D) blocks [1, 1, BLOCK_M, D] (any strides)
  pbf16  dS^T from the bf16 copy of P^T that the dV product already needs (the fp32 P^T dies
         before dP^T is computed: one [BLOCK_N, BLOCK_M] fp32 tile fewer alive)
Each variant's dK and dV are checked against the base kernel's and timed alone (dQ and delta
computed once). Writes backward_variants.json; prints a table.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_variants, error_text, rel_err  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMPORT = "from triton.tools.tensor_descriptor import TensorDescriptor\n"


def patch(text: str, old: str, new: str, count: int = 1) -> str:
    assert old in text, f"variant does not apply: {old!r}"
    return text.replace(old, new, count)


def _dkdv_bounds(t):
    start = t.index("def attn_bwd_dkdv(")
    return start, t.index("\ndef launch_attn_bwd_dkdv", start)


def _desc_args(t, launch_args):
    """Add Q_DESC, DO_DESC parameters after DV and the launcher's descriptor arguments."""
    s, e = _dkdv_bounds(t)
    kernel = patch(t[s:e], "    DV,\n", "    DV,\n    Q_DESC,\n    DO_DESC,\n")
    t = t[:s] + kernel + t[e:]
    ls = t.index("def launch_attn_bwd_dkdv(")
    le = t.index("\n\n\n", ls)
    launch = patch(t[ls:le], "    grid = (triton.cdiv(N_K, BLOCK_N), H_KV, B)\n",
                   "    grid = (triton.cdiv(N_K, BLOCK_N), H_KV, B)\n" + launch_args)
    launch = patch(launch, "q, k, v, do, lse, delta, dk, dv,\n", "q, k, v, do, lse, delta, dk, dv, q_desc, do_desc,\n")
    return IMPORT + t[:ls] + launch + t[le:]


def _replace_full_loads(t, q_new, do_new):
    s, e = _dkdv_bounds(t)
    kernel = t[s:e]
    lines = []
    for line in kernel.split("\n"):
        stripped = line.strip()
        indent = line[: len(line) - len(line.lstrip())]
        if stripped.startswith("q = tl.load(") and "mask=" not in stripped:
            line = indent + q_new
        elif stripped.startswith("do = tl.load(") and "mask=" not in stripped:
            line = indent + do_new
        lines.append(line)
    return t[:s] + "\n".join(lines) + t[e:]


def tma(t):
    t = _desc_args(t, "    q_desc = TensorDescriptor.from_tensor(q.reshape(-1, q.shape[-1]), [BLOCK_M, HEAD_DIM])\n"
                      "    do_desc = TensorDescriptor.from_tensor(do.reshape(-1, do.shape[-1]), [BLOCK_M, HEAD_DIM])\n")
    row = "((b * H + g + hkv*GROUP) * N_Q + start_m)"
    return _replace_full_loads(t, f"q = Q_DESC.load([{row}, 0])", f"do = DO_DESC.load([{row}, 0])")


def tma4(t):
    t = _desc_args(t, "    q_desc = TensorDescriptor.from_tensor(q, [1, 1, BLOCK_M, HEAD_DIM])\n"
                      "    do_desc = TensorDescriptor.from_tensor(do, [1, 1, BLOCK_M, HEAD_DIM])\n")
    return _replace_full_loads(t, "q = Q_DESC.load([b, g + hkv*GROUP, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)",
                               "do = DO_DESC.load([b, g + hkv*GROUP, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)")


def pbf16(t):
    s, e = _dkdv_bounds(t)
    kernel = t[s:e]
    dtype = "tl.bfloat16" if "p_t.to(tl.bfloat16)" in kernel else "tl.float16"
    kernel = kernel.replace(f"dv = tl.dot(p_t.to({dtype}), do, dv)",
                            f"p_lo = p_t.to({dtype})\n            dv = tl.dot(p_lo, do, dv)")
    kernel = kernel.replace("ds_t = p_t * (dp_t - delta[None, :])", "ds_t = p_lo.to(tl.float32) * (dp_t - delta[None, :])")
    assert kernel.count("p_lo") >= 3 and kernel.count("p_lo") % 3 == 0, "pbf16 does not apply"
    return t[:s] + kernel + t[e:]


def accinit(t):
    """Start the S^T and dP^T products from -lse/scale and -delta columns (the MMA accumulator's
    input) instead of subtracting the column vectors from the results: the vectors die before
    the products are issued, and two subtractions per score are gone."""
    s, e = _dkdv_bounds(t)
    out, pending = [], False
    for line in t[s:e].split("\n"):
        stripped = line.strip()
        indent = line[: len(line) - len(line.lstrip())]
        if stripped == "s_t = tl.dot(k, tl.trans(q))":
            line = indent + "s_t = tl.dot(k, tl.trans(q), tl.broadcast_to((-lse / qk_scale)[None, :], (BLOCK_N, BLOCK_M)))"
            pending = True
        elif pending and stripped == "p_t = tl.math.exp2(s_t * qk_scale - lse[None, :])":
            line, pending = indent + "p_t = tl.math.exp2(s_t * qk_scale)", False
        elif stripped == "dp_t = tl.dot(v, tl.trans(do))":
            line = indent + "dp_t = tl.dot(v, tl.trans(do), tl.broadcast_to(-delta[None, :], (BLOCK_N, BLOCK_M)))"
        elif stripped == "ds_t = p_t * (dp_t - delta[None, :])":
            line = indent + "ds_t = p_t * dp_t"
        out.append(line)
    kernel = "\n".join(out)
    assert "lse / qk_scale" in kernel and "ds_t = p_t * dp_t" in kernel, "accinit does not apply"
    return t[:s] + kernel + t[e:]


# pbf16 left the sm_90 compile unchanged (ptxas already shares the tile): not timed.
VARIANTS = {"base": [], "tma": [tma], "tma4": [tma4], "accinit": [accinit]}
CONFIGS = {128: [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 2), (128, 64, 8, 2)],
           64: [(32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (128, 128, 8, 2)]}
SPECS = {128: "train_d128.py", 64: "train_causal_d64.py"}


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for d, fname in SPECS.items():
        source = open(os.path.join(ROOT, "generated", fname)).read()
        causal = "causal" in fname
        modules = build_variants(source, VARIANTS, f"bwdv{d}")
        base = modules["base"]
        n = 4096
        b, h = 16384 // n, 2048 // d
        dtype = base.DTYPE
        gen = torch.Generator(device="cuda").manual_seed(7)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
        scale = d ** -0.5
        out, lse = base.forward(q, k, v, scale)
        dq, dk0, dv0 = base.backward(q, k, v, out, lse, do, scale)
        delta = torch.empty_like(lse)
        base.launch_attn_bwd_dq(q=q, k=k, v=v, o=out, do=do, lse=lse, delta=delta, dq=dq, sm_scale=scale,
                                **base.DEFAULT_BACKWARD_CONFIG["attn_bwd_dq"])
        flops = 4 * 2 * b * h * n * n * d / (2 if causal else 1)  # four products in the dK/dV kernel
        for vname, module in modules.items():
            for cfg in CONFIGS[d]:
                config = dict(BLOCK_M=cfg[0], BLOCK_N=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
                row = dict(head_dim=d, causal=causal, variant=vname, config=cfg)
                dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
                run = lambda: module.launch_attn_bwd_dkdv(q=q, k=k, v=v, do=do, lse=lse, delta=delta, dk=dk, dv=dv,
                                                          sm_scale=scale, **config)
                try:
                    run()
                    torch.cuda.synchronize()
                    row["err_dk"] = rel_err(dk, dk0)
                    row["err_dv"] = rel_err(dv, dv0)
                    ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
                    row.update(ms=ms, tflops=flops / ms / 1e9)
                except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
                    row["error"] = error_text(e)
                rows.append(row)
            print(f"d={d} {vname} done", flush=True)
    with open(os.path.join(out_dir, "backward_variants.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}: dK/dV kernel variants, bf16 N=4096 (TFLOP/s of its 4 products)")
    for d in SPECS:
        print(f"{'d':>4} {'variant':>10} " + " ".join(f"{str(c):>17}" for c in CONFIGS[d]) + "  max_err")
        for vname in VARIANTS:
            sel = [r for r in rows if r["head_dim"] == d and r["variant"] == vname]
            cells = []
            for cfg in CONFIGS[d]:
                r = next((r for r in sel if r["config"] == cfg), None)
                cells.append(f"{r['tflops']:17.1f}" if r and "tflops" in r else f"{'err':>17}")
            errs = [max(r["err_dk"], r["err_dv"]) for r in sel if "err_dk" in r]
            print(f"{d:>4} {vname:>10} " + " ".join(cells) + f"  {max(errs) if errs else float('nan'):.1e}")
    for r in rows:
        if "error" in r:
            print(f"  d={r['head_dim']} {r['variant']} {r['config']}: {r['error']}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
