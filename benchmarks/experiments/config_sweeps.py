"""Experiment: launch configs for the decode and backward kernels, to set their heuristics.

    python benchmarks/experiments/config_sweeps.py OUT_DIR

Decode (bf16, 32/8 heads, d=128, one query token; K/V GB/s): contiguous and paged (16 and 64
tokens per page) at batch 1/16/64 x 8k/32k, over BLOCK_N and num_stages. A paged kernel spends
pipeline stages on the block-table load (the sm_90 compile shows one K/V buffer pair at
num_stages 3-4, two at 5-6, three at 7), so it is swept deeper.
Backward (bf16, N=4096, batch 4, hidden 2048): the dQ and dK/dV kernels timed separately per config.
Writes sweeps.json; prints the best per case.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton

import attngen
from attngen.decode import kvcache_spec
from attngen.runtime import load


def ms(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=20, rep=60, return_mode="median")


def decode(rows):
    H, H_KV, D = 32, 8, 128
    gen = torch.Generator("cuda").manual_seed(0)
    for page in (None, 16, 64):
        module = load(kvcache_spec("bf16", D, True, page)).module
        stages = (3, 4) if page is None else (5, 7)
        for batch, ctx in ((1, 8192), (1, 32768), (16, 8192), (16, 32768), (64, 8192)):
            q = torch.randn(batch, H, 1, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            seqlens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
            if page is None:
                k = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
                v = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
                table = None
            else:
                n = batch * ctx // page
                k = torch.randn(n, page, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                v = torch.randn(n, page, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                table = torch.randperm(n, device="cuda", generator=gen).view(batch, -1).to(torch.int32)
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
            for bn in (64, 128):
                for st in stages:
                    cfg = dict(BLOCK_M=16, BLOCK_N=bn, num_warps=4, num_stages=st)
                    try:
                        t = ms(lambda: module.forward_kvcache(q, k, v, seqlens, table, None, out, lse, 0, cfg))
                        rows.append(dict(kind="decode", page=page, batch=batch, ctx=ctx, config=cfg, ms=t,
                                         gbps=2 * batch * ctx * H_KV * D * 2 / (t * 1e-3) / 1e9))
                    except Exception as e:  # noqa: BLE001
                        rows.append(dict(kind="decode", page=page, batch=batch, ctx=ctx, config=cfg, error=str(e)[:150]))
            del q, k, v
        print(f"decode page={page} done", flush=True)


def backward(rows):
    for d in (64, 128):
        for causal in (False, True):
            spec = f"kernel sweep_b{d}{int(causal)} {{ direction = forward+backward head_dim = {d} dtype = bf16 mask = {'causal' if causal else 'none'} }}"
            kernel = attngen.load(spec)
            b, h, n = 4, 2048 // d, 4096
            q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            out, lse = kernel.forward(q, k, v, d ** -0.5)
            delta = torch.empty_like(lse)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            m = kernel.module
            for name, cfgs in (("attn_bwd_dq", [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 3)]),
                               ("attn_bwd_dkdv", [(64, 128, 8, 3), (64, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 2), (128, 128, 8, 2), (32, 64, 4, 3), (64, 128, 4, 3)])):
                for bm, bn, w, st in cfgs:
                    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
                    if name == "attn_bwd_dq":
                        fn = lambda: m.launch_attn_bwd_dq(q=q, k=k, v=v, o=out, do=do, lse=lse, delta=delta, dq=dq, sm_scale=d ** -0.5, **cfg)
                    else:
                        m.launch_attn_bwd_dq(q=q, k=k, v=v, o=out, do=do, lse=lse, delta=delta, dq=dq, sm_scale=d ** -0.5,
                                             BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
                        fn = lambda: m.launch_attn_bwd_dkdv(q=q, k=k, v=v, do=do, lse=lse, delta=delta, dk=dk, dv=dv, sm_scale=d ** -0.5, **cfg)
                    try:
                        t = ms(fn)
                        # dQ does 3 of the backward's 7 matmul-equivalents here, dK/dV 4 (FA counts 5 in all).
                        rows.append(dict(kind=name, d=d, causal=causal, config=cfg, ms=t))
                    except Exception as e:  # noqa: BLE001
                        rows.append(dict(kind=name, d=d, causal=causal, config=cfg, error=str(e)[:150]))
            print(f"backward d={d} causal={causal} done", flush=True)


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    decode(rows)
    backward(rows)
    with open(os.path.join(out_dir, "sweeps.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}: best decode configs (GB/s)")
    for page in (None, 16, 64):
        for batch, ctx in sorted({(r["batch"], r["ctx"]) for r in rows if r["kind"] == "decode"}):
            sel = [r for r in rows if r["kind"] == "decode" and r["page"] == page and (r["batch"], r["ctx"]) == (batch, ctx) and "gbps" in r]
            cells = " ".join(f"{r['config']['BLOCK_N']}/{r['config']['num_stages']}:{r['gbps']:.0f}" for r in sel)
            print(f"  page={page!s:>4} B={batch:>2} ctx={ctx:>5}  {cells}")
    print("best backward configs (ms)")
    for kind in ("attn_bwd_dq", "attn_bwd_dkdv"):
        for d in (64, 128):
            for causal in (False, True):
                sel = sorted((r for r in rows if r["kind"] == kind and r["d"] == d and r["causal"] == causal and "ms" in r), key=lambda r: r["ms"])
                print(f"  {kind:>14} d={d} causal={causal!s:>5}: " + "  ".join(
                    f"{tuple(r['config'].values())}={r['ms']:.3f}" for r in sel[:4]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
