"""Experiment: does the cache's memory layout decide batch-16 decode bandwidth?

    python benchmarks/experiments/decode_layout.py OUT_DIR        (GPU)

The bench's caches are (B, S, H_KV, D): one program's K/V head is 256-byte pieces 2 KB apart, and the
8 programs of one sequence together cover each 2 KB row. If those programs drift apart in time, each
DRAM row is opened up to 8 times; with one program per SM (batch 16) nothing hides that. A
(B, H_KV, S, D) cache gives every program one sequential stream. Prediction: if the row locality
matters, the shipped kernel at one split gains >= 3% on the (B, H_KV, S, D) layout at batch 16 8k;
if it does not (within 1%), the gap to cuDNN is per-program latency, not the access pattern.

Times (CUDA-graph replays, full caches): the shipped call (tuned splits, 1, 2), the warp-split kernel
of decode_warpsplit.py at its best H100 configs, and cuDNN, each on both layouts (same values).
"""

from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import decode_case, write_rows  # noqa: E402


def main() -> int:
    import attngen
    from attngen.bench_decode import H, D, bench_graph, sdpa
    from decode_warpsplit import run as ws_run
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    module = attngen.load(os.path.join(ROOT, "specs/decode_d128.attn")).module
    rows = []
    for batch, ctx in ((16, 8192), (16, 32768), (16, 1024), (64, 1024)):
        q, k, v, lens, nbytes = decode_case(batch, ctx)
        want = attngen.attention_with_kvcache(q, k, v, lens)
        layouts = {"bshd": (k, v),
                   "bhsd": (k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2))}
        out = torch.empty(batch, H, 1, D, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(batch, H, 1, device="cuda", dtype=torch.float32)
        for name, (kl, vl) in layouts.items():
            calls = {f"shipped {s or 'tuned'}": (lambda kl=kl, vl=vl, s=s: attngen.attention_with_kvcache(q, kl, vl, lens, num_splits=s))
                     for s in (0, 1, 2)}
            for cfg in ((1, 8, 16, 4, 2), (1, 4, 32, 4, 2), (1, 4, 16, 4, 3), (2, 8, 16, 4, 2)):
                splits, W, BN_W, warps, stages = cfg
                calls[f"warp-split {cfg}"] = (lambda kl=kl, vl=vl, c=cfg: ws_run(
                    module, q.transpose(1, 2), kl.transpose(1, 2), vl.transpose(1, 2), lens, out, lse, *c).transpose(1, 2))
            for label, fn in calls.items():
                got = fn()
                torch.cuda.synchronize()
                err = (got.float() - want.float()).abs().max().item()
                row = {"batch": batch, "context": ctx, "layout": name, "call": label, "max diff": err}
                if err < 2e-2:
                    row["GB/s"] = nbytes / (bench_graph(fn) * 1e-3) / 1e9
                else:
                    row["error"] = "wrong result"
                rows.append(row)
                print(json.dumps(row), flush=True)
            ms, how = sdpa("CUDNN_ATTENTION", q, kl, vl)
            rows.append({"batch": batch, "context": ctx, "layout": name, "call": "cuDNN", "GB/s": nbytes / (ms * 1e-3) / 1e9})
            print(json.dumps(rows[-1]), flush=True)
        del q, k, v, layouts
        torch.cuda.empty_cache()
    write_rows(out_dir, "decode_layout.json", rows)
    print(f"\n{torch.cuda.get_device_name()}: decode GB/s by cache layout (bshd = the bench's, bhsd = head-major)")
    shapes = sorted({(r["batch"], r["context"]) for r in rows})
    for batch, ctx in shapes:
        print(f"  B={batch} ctx={ctx}")
        labels = list(dict.fromkeys(r["call"] for r in rows if (r["batch"], r["context"]) == (batch, ctx)))
        for label in labels:
            vals = {r["layout"]: r.get("GB/s") for r in rows if (r["batch"], r["context"], r["call"]) == (batch, ctx, label)}
            print(f"    {label:34s} " + "  ".join(f"{lay} {vals.get(lay) or 0:6.0f}" for lay in ("bshd", "bhsd")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
