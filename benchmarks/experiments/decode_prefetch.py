"""Experiment: L2 prefetches ahead of the decode kernel's loads (more DRAM bytes in flight per SM).

    python benchmarks/experiments/decode_prefetch.py OUT_DIR        (GPU)

With one program per SM (batch 16, one split) the decode kernel reads 86-90% of DRAM peak and cuDNN
92.5% (NOTES v17); deeper cp.async pipelines did not help (5+ stages lose: shared memory and
registers). A `prefetch.global.L2` per 128-byte line of the K and V rows PF blocks ahead puts more
bytes in flight without shared memory: the loop's own loads then hit L2. The cache layout does not
matter (decode_layout.py: head-major caches within 1-2%), so this tests the in-flight depth.
Prediction: batch 16 one split +2-4% (to ~1.0x cuDNN) with PF 4-8; batch 1 and 64 unchanged.

Variants of the generated decode module (specs/decode_d128.attn), the prefetch inserted in the loop
over full blocks (targets clamped to the sequence's last key: never past the cache); each at the
tuned config and at one split, CUDA-graph replays, full caches; outputs checked against the base.
"""

from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import build_variants, decode_case, error_text, write_rows  # noqa: E402

ANCHOR = ("        offs_n = start_n + tl.arange(0, BLOCK_N)\n"
          "        k = tl.load(k_base + offs_n[:, None] * stride_k_n + offs_d[None, :] * stride_k_d)\n")


def prefetch(distance: int, lines: int = 2, only_k: bool = False):
    """A rewrite: prefetch `lines` 128-byte lines of each K (and V) row `distance` blocks ahead."""
    def step(text: str) -> str:
        assert text.count(ANCHOR) == 1, "anchor not found once"
        bases = ("k",) if only_k else ("k", "v")
        add = f"        pf_n = tl.minimum(offs_n + {distance} * BLOCK_N, n_k - 1)\n"
        for base in bases:
            add += (f"        pf_{base} = {base}_base + pf_n[:, None] * stride_{base}_n + (tl.arange(0, {lines}) * 64)[None, :] * stride_{base}_d\n"
                    f"        tl.inline_asm_elementwise(\"prefetch.global.L2 [$1]; mov.u32 $0, 0;\", \"=r,l\", [pf_{base}], "
                    f"dtype=tl.int32, is_pure=False, pack=1)\n")
        return text.replace(ANCHOR, ANCHOR + add)
    return step


def main() -> int:
    import attngen
    from attngen.bench_decode import H, H_KV, D, bench_graph, sdpa
    from attngen.tuning import Shape
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    kernel = attngen.load(os.path.join(ROOT, "specs/decode_d128.attn"))
    part = kernel.tuner("kvcache")
    variants = {"base": [], "pf2": [prefetch(2)], "pf4": [prefetch(4)], "pf8": [prefetch(8)], "pf16": [prefetch(16)],
                "pf4 k only": [prefetch(4, only_k=True)], "pf8 1 line": [prefetch(8, lines=1)]}
    modules = build_variants(kernel.source, variants, "dpf")
    rows = []
    shapes = ((16, 8192), (16, 32768), (16, 1024), (64, 1024), (1, 8192), (1, 32768))
    for batch, ctx in shapes:
        q, k, v, lens, nbytes = decode_case(batch, ctx)
        want = attngen.attention_with_kvcache(q, k, v, lens)
        ms, _ = sdpa("CUDNN_ATTENTION", q, k, v)
        cudnn = nbytes / (ms * 1e-3) / 1e9
        tuned = dict(part.config(Shape(batch, H, H_KV, 1, ctx), 0))
        tuned.pop("warp_specialized", None)
        q4, k4, v4 = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = torch.empty(batch, 1, H, D, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(batch, H, 1, device="cuda", dtype=torch.float32)
        print(f"B={batch} ctx={ctx}: cuDNN {cudnn:.0f} GB/s, tuned {tuned}", flush=True)
        for splits in dict.fromkeys((tuned.get("num_splits", 0), 1)):
            config = {key: val for key, val in tuned.items() if key != "num_splits"}
            for name, mod in modules.items():
                def fn(mod=mod, splits=splits, config=config):
                    return mod.forward_kvcache(q4, k4, v4, lens, None, D ** -0.5, out.transpose(1, 2), lse, splits, config)
                row = {"batch": batch, "context": ctx, "variant": name, "splits": splits, "config": config, "cudnn": cudnn}
                try:
                    out.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    err = (out.float() - want.float()).abs().max().item()
                    row["max diff"] = err
                    if err < 2e-2:
                        row["GB/s"] = nbytes / (bench_graph(fn) * 1e-3) / 1e9
                        row["vs cudnn"] = row["GB/s"] / cudnn
                    else:
                        row["error"] = "wrong result"
                except Exception as e:  # noqa: BLE001 - a variant that fails to compile: recorded
                    row["error"] = error_text(e)
                rows.append(row)
                print(json.dumps(row), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    write_rows(out_dir, "decode_prefetch.json", rows)
    print(f"\n{torch.cuda.get_device_name()}: decode with L2 prefetches, full caches, GB/s (vs cuDNN)")
    names = list(variants)
    print(f"  {'B':>3} {'ctx':>6} {'splits':>6} " + " ".join(f"{n:>13}" for n in names))
    for batch, ctx in shapes:
        for splits in dict.fromkeys(r["splits"] for r in rows if (r["batch"], r["context"]) == (batch, ctx)):
            cells = []
            for n in names:
                r = next(r for r in rows if (r["batch"], r["context"], r["splits"], r["variant"]) == (batch, ctx, splits, n))
                cells.append(f"{r['GB/s']:6.0f} ({r['vs cudnn']:.3f})" if "GB/s" in r else f"{'error':>13}")
            print(f"  {batch:>3} {ctx:>6} {splits:>6} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
