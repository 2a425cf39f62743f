"""Experiment: which rewrites of the generated forward kernel pay on Hopper?

    python benchmarks/experiments/forward_variants.py OUT_DIR

Takes the committed generated modules for d=128 bf16 (generated/fwd_causal_d128.py and
generated/fwd_d128.py), applies textual variants (each a candidate pass), checks each against SDPA
and times it at N=4096 (batch 4, 16 heads) with a few tile configs:
  rev   causal only: heavy query blocks (most key blocks) first, for a better tail
  fma   fold the scale into the exp2 argument (one multiply-add per score instead of two ops)
  tma   K and V through TMA tensor descriptors (no pointer tensors; OOB rows zero-filled)
  ws    warp specialisation of the unmasked key loop (tl.range(..., warp_specialize=True))
Results decide which become passes (benchmarks/NOTES.md). Writes variants.json; prints a table.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

from common import error_text  # noqa: E402 (this script's folder is on sys.path)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def patch(text: str, old: str, new: str, count: int = 1) -> str:
    assert old in text, f"variant does not apply: {old!r}"
    return text.replace(old, new, count)


def rev(t):
    return patch(t, "start_m = tl.program_id(0) * BLOCK_M", "start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M")


def fma(t):
    if "tl.max(s, 1) * qk_scale" in t:  # the generator folds the scale already (fold-scale pass)
        return t
    t = patch(t, "        s = tl.dot(q, tl.trans(k)) * qk_scale\n        m_new = tl.maximum(m_i, tl.max(s, 1))\n",
              "        s = tl.dot(q, tl.trans(k))\n        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)\n")
    return patch(t, "p = tl.math.exp2(s - m_new[:, None])", "p = tl.math.exp2(s * qk_scale - m_new[:, None])")


def tma(t):
    t = patch(t, "    qk_scale = sm_scale * 1.4426950408889634\n",
              "    qk_scale = sm_scale * 1.4426950408889634\n"
              "    k_desc = tl.make_tensor_descriptor(k_base, shape=[N_K, HEAD_DIM], strides=[stride_k_n, 1], block_shape=[BLOCK_N, HEAD_DIM_PADDED])\n"
              "    v_desc = tl.make_tensor_descriptor(v_base, shape=[N_K, HEAD_DIM], strides=[stride_v_n, 1], block_shape=[BLOCK_N, HEAD_DIM_PADDED])\n")
    lines = []
    for line in t.split("\n"):
        stripped = line.strip()
        indent = line[: len(line) - len(line.lstrip())]
        if stripped.startswith("k = tl.load(k_base"):
            line = f"{indent}k = k_desc.load([start_n, 0])"
        elif stripped.startswith("v = tl.load(v_base"):
            line = f"{indent}v = v_desc.load([start_n, 0])"
        lines.append(line)
    return "\n".join(lines)


def ws(t):
    marker = "  # full blocks: no mask"
    i = t.index(marker)
    j = t.rindex("for start_n in range(", 0, i)
    head = t[j:i]
    new = head.replace("for start_n in range(", "for start_n in tl.range(")[:-2] + ", warp_specialize=True):"
    return t[:j] + new + t[i:]


def rot(t):
    """Rotate the unmasked key loop: issue the next block's Q K^T before this block's softmax, so
    the tensor cores work while the exponentials run (FA3's intra-warpgroup overlap, by hand)."""
    start = t.index("    for start_n in range(0, ")
    end = t.index("        m_i = m_new\n", start) + len("        m_i = m_new\n")
    loop = t[start:end]
    hi = loop[len("    for start_n in range(0, "):loop.index(", BLOCK_N):")]
    body = f"""    hi_full = {hi}
    offs_n = tl.arange(0, BLOCK_N)
    k = tl.load(k_base + offs_n[:, None] * stride_k_n + offs_d[None, :] * stride_k_d, mask=offs_n[:, None] < hi_full, other=0.0)
    s = tl.dot(q, tl.trans(k))
    for start_n in range(0, hi_full, BLOCK_N):  # full blocks, rotated
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_next = offs_n + BLOCK_N
        k_next = tl.load(k_base + offs_next[:, None] * stride_k_n + offs_d[None, :] * stride_k_d, mask=offs_next[:, None] < hi_full, other=0.0)
        s_next = tl.dot(q, tl.trans(k_next))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * stride_v_n + offs_d[None, :] * stride_v_d)
        acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None])
        m_i = m_new
        s = s_next
"""
    return t[:start] + body + t[end:]


# v1 measured fma (now the fold-scale pass), tma, ws and rev; what is left open is the rotation.
VARIANTS = {"base": [fma], "rot": [fma, rot], "rev_rot": [rev, fma, rot]}
CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 2)]


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    rows = []
    for causal, fname in ((True, "fwd_causal_d128.py"), (False, "fwd_d128.py")):
        source = open(os.path.join(ROOT, "generated", fname)).read()
        b, h, n, d = 4, 16, 4096, 128
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal).float()
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        for vname, steps in VARIANTS.items():
            if "rev" in vname and not causal:
                continue
            text = source
            try:
                for step in steps:
                    text = step(text)
            except AssertionError as e:
                rows.append(dict(causal=causal, variant=vname, error=str(e)))
                continue
            os.makedirs("/tmp/variants", exist_ok=True)
            path = os.path.join("/tmp/variants", f"v_{'c' if causal else 'n'}_{vname}.py")
            with open(path, "w") as f:
                f.write(text)
            module = load(path, f"v_{'c' if causal else 'n'}_{vname}")
            for cfg in CONFIGS:
                config = dict(BLOCK_M=cfg[0], BLOCK_N=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
                row = dict(causal=causal, variant=vname, config=cfg)
                try:
                    out, _ = module.forward(q, k, v, config=config)
                    row["rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
                    ms = triton.testing.do_bench(lambda: module.forward(q, k, v, config=config), warmup=25, rep=100,
                                                 return_mode="median")
                    row.update(ms=ms, tflops=flops / ms / 1e9)
                except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
                    row["error"] = error_text(e)
                rows.append(row)
            print(f"causal={causal} {vname} done", flush=True)
    with open(os.path.join(out_dir, "variants.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}: forward variants, d=128 bf16 N=4096 B=4 H=16 (TFLOP/s by config)")
    print(f"{'causal':>6} {'variant':>12} " + " ".join(f"{str(c):>16}" for c in CONFIGS) + "   max_rel_err")
    for causal in (True, False):
        for vname in VARIANTS:
            sel = [r for r in rows if r["causal"] == causal and r["variant"] == vname]
            if not sel:
                continue
            cells = []
            for cfg in CONFIGS:
                r = next((r for r in sel if r.get("config") == cfg), None)
                cells.append(f"{r['tflops']:16.1f}" if r and "tflops" in r else f"{'err':>16}")
            errs = [r["rel_err"] for r in sel if "rel_err" in r]
            print(f"{causal!s:>6} {vname:>12} " + " ".join(cells) + f"   {max(errs) if errs else float('nan'):.1e}")
    errors = {r["variant"]: r["error"] for r in rows if "error" in r}
    for name, err in errors.items():
        print(f"  {name}: {err}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
