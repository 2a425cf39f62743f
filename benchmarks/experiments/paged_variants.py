"""Experiment: does the 16-token paged decode kernel lose to the contiguous one on its addressing?

    python benchmarks/experiments/paged_variants.py OUT_DIR

Nsight Compute (NOTES v8, results/h200_ncu_v8.txt) shows the paged split kernel executing 63-74%
more instructions than the contiguous one on the same tokens (batch 1 and 16, 8k), with 226 against
128 registers at batch 1, and 1.4 us (10%) slower there. Its block-table load reads one entry per
key row (BLOCK_N addresses, 16 equal in a row), and K and V each rebuild 64-bit row addresses from
it. Candidates, textual rewrites of the module attention_with_kvcache generates for 16-token pages:
  dedup  load BLOCK_N // 16 table entries per tile and broadcast each to its 16 rows
  rows   dedup, and one [BLOCK_N] int64 row offset (page x page stride + slot x slot stride) that K
         and V share (valid where the K and V pools have the same strides, as here)
Prediction: fewer instructions and registers; +3-8% at batch 1 if issue-bound, nothing at batch 16
where DRAM bounds it. Shapes: 32 query / 8 kv heads, d = 128, bf16, one query token, full caches,
pages in random order; each variant at the config and split count the call would use, CUDA-graph
replays (do_bench median), outputs compared with the base's. Writes paged_variants.json; a table last.
"""

from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import attngen  # noqa: E402
from attngen.bench_decode import H, H_KV, D, DTYPE, gbps, paged_copy  # noqa: E402
from attngen.decode import _auto_splits, kvcache_spec  # noqa: E402
from attngen.tuning.key import Shape  # noqa: E402
from common import build_variants, error_text, quick_graph, rel_err  # noqa: E402

SHAPES = ((1, 8192), (1, 32768), (16, 1024), (16, 8192))
FULL = "page_n = tl.load(block_table_base + (offs_n // 16) * stride_block_table_page).to(tl.int64)"
MASKED = ("page_n = tl.load(block_table_base + (offs_n // 16) * stride_block_table_page, mask=offs_n < n_k, "
          "other=0).to(tl.int64)")
DEDUP = ("offs_pg = start_n // 16 + tl.arange(0, BLOCK_N // 16)\n"
         "        pages = tl.load(block_table_base + offs_pg * stride_block_table_page{mask}).to(tl.int64)\n"
         "        page_n = tl.reshape(tl.broadcast_to(pages[:, None], (BLOCK_N // 16, 16)), (BLOCK_N,))")
K_ADDR = "k_base + page_n[:, None] * stride_k_page + (offs_n % 16)[:, None] * stride_k_slot"
V_ADDR = "v_base + page_n[:, None] * stride_v_page + (offs_n % 16)[:, None] * stride_v_slot"


def dedup(src: str) -> str:
    assert FULL in src and MASKED in src, "the generated paged kernel changed: update this experiment"
    src = src.replace(FULL, DEDUP.format(mask=""))
    return src.replace(MASKED, DEDUP.format(mask=", mask=offs_pg * 16 < n_k, other=0"))


def rows(src: str) -> str:
    src = dedup(src)
    assert src.count(K_ADDR) == 2 and src.count(V_ADDR) == 2
    src = src.replace("page_n = tl.reshape(tl.broadcast_to(pages[:, None], (BLOCK_N // 16, 16)), (BLOCK_N,))",
                      "page_n = tl.reshape(tl.broadcast_to(pages[:, None], (BLOCK_N // 16, 16)), (BLOCK_N,))\n"
                      "        row = page_n * stride_k_page + (offs_n % 16) * stride_k_slot")
    return src.replace(K_ADDR, "k_base + row[:, None]").replace(V_ADDR, "v_base + row[:, None]")


def main() -> int:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    kernel = attngen.load(kvcache_spec("bf16", D, True, 16))
    modules = {"base": kernel.module}
    modules.update(build_variants(kernel.source, {"dedup": [dedup], "rows": [rows]}, "pagedvar"))
    gen = torch.Generator("cuda").manual_seed(0)
    results = []
    for batch, ctx in SHAPES:
        q = torch.randn(batch, 1, H, D, device="cuda", dtype=DTYPE, generator=gen)
        k = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen)
        v = torch.randn_like(k)
        seqlens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        perm = torch.randperm(batch * ctx // 16, device="cuda", generator=gen)
        kp, vp = paged_copy(k, 16, perm), paged_copy(v, 16, perm)
        table = perm.view(batch, ctx // 16).to(torch.int32)
        shape = Shape(batch, H, H_KV, 1, ctx)
        config = kernel.tuner("kvcache").config(shape)
        splits = config.pop("num_splits", 0) or _auto_splits(kernel.module, config, batch, H, H_KV, 1, ctx, q.device)
        q4, out = q.transpose(1, 2), torch.empty_like(q)
        lse = torch.empty((batch, H, 1), device="cuda", dtype=torch.float32)
        row = {"batch": batch, "context": ctx, "config": config, "splits": splits, "GB/s": {}, "err_vs_base": {}}
        row["GB/s"]["contiguous (call)"] = gbps(batch, ctx, quick_graph(
            lambda: attngen.attention_with_kvcache(q, k, v, seqlens)))
        base = None
        for name, module in modules.items():
            def call(module=module):
                module.forward_kvcache(q4, kp, vp, seqlens, table, D ** -0.5, out.transpose(1, 2), lse, splits, config)
            try:
                out.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                if base is None:
                    base = out.clone()
                else:
                    row["err_vs_base"][name] = rel_err(out, base)
                row["GB/s"][name] = gbps(batch, ctx, quick_graph(call))
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
                row["GB/s"][name] = None
                row["err_vs_base"][name] = error_text(e)
        results.append(row)
        print(row, flush=True)
        del k, v, kp, vp
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "paged_variants.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": results}, f, indent=1)
    names = ["contiguous (call)"] + list(modules)
    print("\npaged 16 decode variants, GB/s of K/V (CUDA-graph replays)")
    print(f"{'B':>3} {'ctx':>6} " + " ".join(f"{n:>18}" for n in names) + "  err (dedup, rows)")
    for r in results:
        cells = " ".join(f"{r['GB/s'][n]:>18.0f}" if isinstance(r["GB/s"].get(n), float) else f"{'err':>18}"
                         for n in names)
        print(f"{r['batch']:>3} {r['context']:>6} {cells}  {r['err_vs_base']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
