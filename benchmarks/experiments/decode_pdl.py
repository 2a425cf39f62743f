"""Experiment: the combine kernel as a programmatic dependent launch of the split kernel.

    python benchmarks/experiments/decode_pdl.py OUT_DIR

NOTES v4 measured what the combine launch costs at batch 1, 8k: 2.9 us of 16.8 us per layer, though
the combine reads only 16 splits x 32 heads x 128 floats. Most of it is the gap between the two
grids: the combine's programs start only after the last split program has finished and the second
launch has gone through. Hopper's programmatic dependent launch (PDL; Triton: `launch_pdl=True`,
`tl.extra.cuda.gdc_launch_dependents` / `gdc_wait`) lets the second grid be scheduled while the
first runs; its programs wait in `griddepcontrol.wait` until the first grid's writes are visible.
Prediction: most of the 2.9 us gap goes (the combine grid is resident on the SMs the 128 split
programs leave free), +10-15% at batch 1, nothing at batch 16 (one or two splits).
Variants of the committed generated/decode_d128.py:
  base     as generated
  pdl      split kernel: gdc_launch_dependents() first; combine: gdc_wait() first, launched with PDL
  pdl_late the same, with launch_dependents after the split kernel's key loop (later scheduling of
           the combine grid, for comparison)
Timed as one call per CUDA-graph replay and as 8-16 layers per graph ([layers], attngen bench's
decode measurement), at 16 and 32 splits at batch 1, cuDNN in the same run; every variant checked
against base on uneven lengths and on repeated graph replays with new queries.
"""

from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from attngen.bench_decode import H, H_KV, D, DTYPE, bench_graph, bench_layers, gbps, layer_count, sdpa  # noqa: E402
from common import build_variants  # noqa: E402

SHAPES = ((1, 1024), (1, 8192), (1, 32768), (16, 8192), (64, 8192))


def _patch(t, old, new):
    assert old in t, f"variant does not apply: {old!r}"
    return t.replace(old, new, 1)


def _pdl(early: bool):
    def rewrite(t):
        if early:
            t = _patch(t, "    # -- this sequence's keys --\n",
                       "    tl.extra.cuda.gdc_launch_dependents()\n    # -- this sequence's keys --\n")
        else:
            t = _patch(t, "    # -- epilogue: normalise;", "    tl.extra.cuda.gdc_launch_dependents()\n    # -- epilogue: normalise;")
        t = _patch(t, "    # -- merge BLOCK_S splits at a time", "    tl.extra.cuda.gdc_wait()\n    # -- merge BLOCK_S splits at a time")
        s = t.index("def launch_attn_combine(")
        return t[:s] + _patch(t[s:], "        num_stages=num_stages,\n", "        num_stages=num_stages,\n        launch_pdl=True,\n")
    return rewrite


VARIANTS = {"base": [], "pdl": [_pdl(True)], "pdl_late": [_pdl(False)]}


def main() -> int:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    source = open(os.path.join(ROOT, "generated", "decode_d128.py")).read()
    modules = build_variants(source, VARIANTS, "dpdl")
    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    config = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
    for batch, ctx in SHAPES:
        layers = max(2, layer_count(batch, ctx))
        caches = [(torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen).transpose(1, 2),
                   torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen).transpose(1, 2))
                  for _ in range(layers)]
        q = torch.randn(batch, H, 1, D, device="cuda", dtype=DTYPE, generator=gen)
        k, v = caches[0]
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        odd = torch.randint(1, ctx, (batch,), device="cuda", dtype=torch.int32, generator=gen)
        for splits in ((16, 32) if batch == 1 else (1, 2)):
            row = {"batch": batch, "context": ctx, "layers": layers, "splits": splits}
            for name, module in modules.items():
                call = lambda kl, vl, out=None, m=module: m.forward_kvcache(  # noqa: E731
                    q, kl, vl, lens, out=out, num_splits=splits, config=config)
                errs = []
                for s in (splits, 3, 37):
                    want, want_lse = modules["base"].forward_kvcache(q, k, v, odd, num_splits=s, config=config)
                    got = torch.full_like(q, float("nan"))
                    got_lse = torch.full((batch, H, 1), float("nan"), device="cuda")
                    module.forward_kvcache(q, k, v, odd, out=got, lse=got_lse, num_splits=s, config=config)
                    errs.append(max((got.float() - want.float()).abs().max().item(),
                                    (got_lse - want_lse).abs().max().item()))
                out = torch.empty_like(q)
                graph = torch.cuda.CUDAGraph()
                call(k, v, out)
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    call(k, v, out)
                for _ in range(20):
                    q.copy_(torch.randn(q.shape, device="cuda", dtype=DTYPE, generator=gen))
                    graph.replay()
                    want, _ = modules["base"].forward_kvcache(q, k, v, lens, num_splits=splits, config=config)
                    errs.append((out.float() - want.float()).abs().max().item())
                row[f"{name} max err"] = max(errs)
                row[name] = gbps(batch, ctx, bench_graph(lambda: call(k, v)))
                row[f"{name} [layers]"] = gbps(batch, ctx, bench_layers([lambda kl=kl, vl=vl: call(kl, vl)
                                                                         for kl, vl in caches]))
            ms, _ = sdpa("CUDNN_ATTENTION", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            row["cudnn"] = gbps(batch, ctx, ms)
            ms, _ = sdpa("CUDNN_ATTENTION", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                         [(kl.transpose(1, 2), vl.transpose(1, 2)) for kl, vl in caches])
            row["cudnn [layers]"] = gbps(batch, ctx, ms)
            rows.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        del caches, q, k, v
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "decode_pdl.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    cols = ["base", "pdl", "pdl_late", "cudnn", "base [layers]", "pdl [layers]", "pdl_late [layers]", "cudnn [layers]"]
    print(f"\nGB/s ({torch.cuda.get_device_name()}), BLOCK_N=64, 4 stages")
    print(f"{'B':>3} {'ctx':>6} {'spl':>4} " + " ".join(f"{c:>17}" for c in cols) + "  max err")
    for r in rows:
        err = max(r[f"{n} max err"] for n in VARIANTS)
        print(f"{r['batch']:>3} {r['context']:>6} {r['splits']:>4} " + " ".join(f"{r[c]:17.0f}" for c in cols)
              + f"  {err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
