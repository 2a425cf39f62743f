"""Experiment: the prefill forward's K/V tiles through host-side TMA tensor descriptors.

    python benchmarks/experiments/forward_tma_host.py OUT_DIR [--head-dims 64,128] [--lengths 4096,16384]

v1 (NOTES.md) read K and V through *device-side* descriptors (`tl.make_tensor_descriptor` in every
program: a descriptor built and fenced per program) and lost 2-8% at the tuned configs. Nsight
Compute (v8) puts the non-causal forward's top stall at `barrier` (1.93 cycles per issued
instruction): the cp.async pipeline needs a CTA-wide bar.sync per iteration so that both warpgroups
see each other's copies. A host-side descriptor (`triton.tools.tensor_descriptor.TensorDescriptor`,
a kernel argument, what the backward's tma pass uses) costs nothing per program, and TMA copies
complete on an mbarrier. Variants of the generated kernel (`attngen.attention`'s bf16 spec):
  kv     K and V through 4-D host descriptors [1, 1, BLOCK_N, D] of (B, H_KV, N_K, D), every key loop
         (rows past N_K read as zeros, which is what the masked loads read)
  qkvo   kv, and Q read / O written through descriptors too (no pointer tensor left but LSE's)
(`tl.range(..., warp_specialize=True)` on the kv loop compiles to the same PTX as kv for sm_90 in
Triton 3.6: checked with an sm_90 compile on the CPU box, so not timed.)
Prediction: +5-10% non-causal at d=128 if the barrier stall is the cp.async visibility barrier.
Writes forward_tma_host.json; prints a table (TFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_forward_variants, print_forward_variants  # noqa: E402


def patch(text: str, old: str, new: str, count: int = 1) -> str:
    assert old in text, f"variant does not apply: {old!r}"
    return text.replace(old, new, count)


def _loads(text: str, name: str, desc: str, index: str, rows: str) -> str:
    """Every `name = tl.load(<name>_base ...)` line of the forward kernel (not the backward's, which
    the same module holds) becomes a descriptor load."""
    start = text.index("\ndef attn_fwd(")
    end = text.index("\ndef ", start + 1)
    out = []
    for line in text[start:end].split("\n"):
        stripped = line.strip()
        if stripped.startswith(f"{name} = tl.load({name}_base"):
            indent = line[: len(line) - len(line.lstrip())]
            line = f"{indent}{name} = {desc}.load([{index}]).reshape({rows}, HEAD_DIM)"
        out.append(line)
    return text[:start] + "\n".join(out) + text[end:]


def kv(t: str) -> str:
    t = patch(t, "    sm_scale,\n    HEAD_DIM: tl.constexpr,", "    sm_scale,\n    K_DESC,\n    V_DESC,\n    HEAD_DIM: tl.constexpr,")
    t = _loads(t, "k", "K_DESC", "b, h // GROUP, start_n, 0", "BLOCK_N")
    t = _loads(t, "v", "V_DESC", "b, h // GROUP, start_n, 0", "BLOCK_N")
    t = patch(t, "        sm_scale,\n        HEAD_DIM=HEAD_DIM,",
              "        sm_scale,\n"
              "        TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, BLOCK_N, HEAD_DIM]),\n"
              "        TensorDescriptor(v, list(v.shape), list(v.stride()), [1, 1, BLOCK_N, HEAD_DIM]),\n"
              "        HEAD_DIM=HEAD_DIM,")
    if "from triton.tools.tensor_descriptor import TensorDescriptor" not in t:
        t = patch(t, "import triton.language as tl\n",
                  "import triton.language as tl\nfrom triton.tools.tensor_descriptor import TensorDescriptor\n")
    return t


def qkvo(t: str) -> str:
    t = kv(t)
    t = patch(t, "    K_DESC,\n    V_DESC,\n", "    K_DESC,\n    V_DESC,\n    Q_DESC,\n    O_DESC,\n")
    t = _loads(t, "q", "Q_DESC", "b, h, start_m, 0", "BLOCK_M")
    store = "    tl.store(o_base + offs_m[:, None] * stride_o_n + offs_d[None, :] * stride_o_d, (acc / l_safe[:, None]).to("
    i = t.index(store)
    j = t.index("\n", i)
    dtype = t[i + len(store):t.index(")", i + len(store))]
    t = t[:i] + (f"    O_DESC.store([b, h, start_m, 0], (acc / l_safe[:, None]).to({dtype}).reshape(1, 1, BLOCK_M, HEAD_DIM))"
                 ) + t[j:]
    return patch(t, "        TensorDescriptor(v, list(v.shape), list(v.stride()), [1, 1, BLOCK_N, HEAD_DIM]),\n",
                 "        TensorDescriptor(v, list(v.shape), list(v.stride()), [1, 1, BLOCK_N, HEAD_DIM]),\n"
                 "        TensorDescriptor(q, list(q.shape), list(q.stride()), [1, 1, BLOCK_M, HEAD_DIM]),\n"
                 "        TensorDescriptor(o, list(o.shape), list(o.stride()), [1, 1, BLOCK_M, HEAD_DIM]),\n")


VARIANTS = {"base": [], "kv": [kv], "qkvo": [qkvo]}
NEIGHBOURS = {128: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (128, 64, 4, 3)],
              64: [(128, 64, 8, 4), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--lengths", default="4096,16384")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    rows, cases = [], []
    for d in (int(x) for x in args.head_dims.split(",")):
        r, c = bench_forward_variants(VARIANTS, "ftma", [int(x) for x in args.lengths.split(",")], [d], NEIGHBOURS[d])
        rows += r
        cases += c
        with open(os.path.join(args.out_dir, "forward_tma_host.json"), "w") as f:
            json.dump(dict(rows=rows, cases=cases), f, indent=1)
    print_forward_variants("forward, K/V through host TMA descriptors (TFLOP/s)", list(VARIANTS), rows, cases)


if __name__ == "__main__":
    main()
