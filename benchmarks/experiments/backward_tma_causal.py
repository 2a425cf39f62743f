"""Experiment: TMA descriptors for every query loop of the dK/dV kernel (causal, and the non-causal tail).

    python benchmarks/experiments/backward_tma_causal.py OUT_DIR

The causal d=128 dK/dV kernel runs at 444 TFLOP/s (64x128, 8 warps, 3 stages) where the non-causal
one runs at 554 (64x64, 4 warps, 2 stages, Q and dO through TMA descriptors); at 64x64 / 4 warps the
causal kernel manages 310 (experiments/dkdv_sweep.py). sm_90 compiles (experiments/regs.py): the
causal kernel spills 944 bytes at 64x64 / 4 warps / 2 stages, 688 at 64x128 / 8 / 3, against 344
for the non-causal one with descriptors: its three query loops (diagonal, full, diagonal) each
hold [BLOCK_M, D] pointer tensors for Q and dO. NOTES v5 put descriptors in the full loop only
(tma4 here), which lost 4-8% for causal at 64x128. A descriptor load zero-fills rows past the end
of the tensor, so the masked loops can read through it too (tma_all): no pointer tensor is left
for Q and dO. Prediction: the spills fall to the non-causal kernel's, and 64x64 / 4 warps runs
near the non-causal 554 (x the diagonal blocks' masking).
The non-causal d=128 kernel's tail loop (the last, partial query block) still holds pointer
tensors too: with it through descriptors the sm_90 compile spills 112 bytes instead of 344.
Variants of the sdpa specs' `attn_bwd_dkdv` (d=128 and d=64, causal and not), each checked against the
generated kernel's dK and dV and timed alone (bf16, B=16384/N, hidden 2048, N=4096 and 16384).
Writes backward_tma_causal.json; prints a table.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from backward_variants import _desc_args, _dkdv_bounds  # noqa: E402
from common import build_variants, error_text, rel_err  # noqa: E402

import attngen  # noqa: E402
from attngen.api import sdpa_spec  # noqa: E402

DESCS = ("    q_desc = TensorDescriptor.from_tensor(q, [1, 1, BLOCK_M, HEAD_DIM])\n"
         "    do_desc = TensorDescriptor.from_tensor(do, [1, 1, BLOCK_M, HEAD_DIM])\n")
Q_NEW = "q = Q_DESC.load([b, g + hkv*GROUP, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)"
DO_NEW = "do = DO_DESC.load([b, g + hkv*GROUP, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)"


def _loads(masked_too: bool):
    def rewrite(t):
        if "Q_DESC" not in t:  # the tma pass left this spec alone: add the descriptor arguments
            t = _desc_args(t, DESCS)
        s, e = _dkdv_bounds(t)
        lines, changed = [], 0
        for line in t[s:e].split("\n"):
            stripped = line.strip()
            indent = line[: len(line) - len(line.lstrip())]
            masked = "mask=" in stripped
            if (masked_too or not masked) and stripped.startswith("q = tl.load("):
                line, changed = indent + Q_NEW, changed + 1
            elif (masked_too or not masked) and stripped.startswith("do = tl.load("):
                line, changed = indent + DO_NEW, changed + 1
            lines.append(line)
        assert changed >= 2, "variant does not apply"  # (a USE_TMA ... else tl.load line is kept)
        return t[:s] + "\n".join(lines) + t[e:]
    return rewrite


VARIANTS = {"base": [], "tma4": [_loads(False)], "tma_all": [_loads(True)]}
CONFIGS = {(128, True): [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 3), (32, 128, 8, 3)],
           (64, True): [(32, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 8, 3), (32, 128, 8, 3)],
           (128, False): [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 8, 2)],
           (64, False): [(32, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 8, 2)]}


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for d, causal in CONFIGS:
        kern = attngen.load(sdpa_spec("bf16", d, causal))
        # non-causal: the full loop reads through descriptors already (d=128) or tma4 is v5's variant
        variants = VARIANTS if causal else {"base": VARIANTS["base"], "tma_all": VARIANTS["tma_all"]}
        modules = build_variants(kern.source, variants, f"btc{d}{int(causal)}")
        for n in (4096, 16384):
            b, h = 16384 // n, 2048 // d
            gen = torch.Generator(device="cuda").manual_seed(n + d)
            q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
            scale = d ** -0.5
            out, lse = kern.forward(q, k, v, scale)
            tuned = kern.backward_config(q, k)
            dq, dk0, dv0 = kern.backward(q, k, v, out, lse, do, scale)
            delta = torch.empty_like(lse)
            kern.module.launch_attn_bwd_dq(q=q, k=k, v=v, o=out, do=do, lse=lse, delta=delta, dq=dq, sm_scale=scale,
                                           **tuned["attn_bwd_dq"])
            flops = 4 * 2 * b * h * n * n * d / (2 if causal else 1)
            configs = CONFIGS[d, causal] if n == 4096 else None
            for vname, module in modules.items():
                if configs is None:  # at 16384: each variant's two best configs at 4096
                    done = sorted((r for r in rows if r["head_dim"] == d and r["causal"] == causal and r["seqlen"] == 4096
                                   and r["variant"] == vname and "tflops" in r), key=lambda r: -r["tflops"])
                    use = [tuple(r["config"]) for r in done[:2]]
                else:
                    use = configs
                for cfg in use:
                    config = dict(BLOCK_M=cfg[0], BLOCK_N=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
                    row = dict(head_dim=d, causal=causal, seqlen=n, variant=vname, config=cfg,
                               tuned=config == tuned["attn_bwd_dkdv"])
                    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
                    run = lambda: module.launch_attn_bwd_dkdv(q=q, k=k, v=v, do=do, lse=lse, delta=delta, dk=dk,  # noqa: E731
                                                              dv=dv, sm_scale=scale, **config)
                    try:
                        run()
                        torch.cuda.synchronize()
                        row["err"] = max(rel_err(dk, dk0), rel_err(dv, dv0))
                        ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
                        row.update(ms=ms, tflops=flops / ms / 1e9)
                    except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result
                        row["error"] = error_text(e)
                    rows.append(row)
            print(f"d={d} causal={causal} N={n} done", flush=True)
            del q, k, v, do, out, lse, dq, dk0, dv0
            torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "backward_tma_causal.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}: dK/dV kernel alone, bf16, TFLOP/s of its 4 products (* tuned)")
    for r in rows:
        tf = f"{r['tflops']:7.1f}" if "tflops" in r else "    err"
        print(f"d={r['head_dim']:>3} {'causal' if r['causal'] else 'full':>6} N={r['seqlen']:>5} {r['variant']:>8} {str(tuple(r['config'])):>17}"
              f"{'*' if r['tuned'] else ' '} {tf}  {r.get('err', float('nan')):.1e} {r.get('error', '')}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
