"""The tuned config against the untuned default and FlexAttention, in one run on this GPU.

    python benchmarks/tuned_vs_default.py [-o benchmarks/results/tuned_vs_default_<gpu>.json]

Forward, bf16, d=128, B=4, H=16, N=4096 (the FlashAttention benchmarks' 16k tokens, 2048 hidden),
causal and not: attngen with the config the shipped table (or the user's cache) gives for this
bucket, attngen with the default config of attngen/policy/configs.py (what runs when nothing is tuned),
and compiled FlexAttention. do_bench medians on fresh random inputs; TFLOP/s by the FlashAttention
convention (4 B H N^2 d, halved for causal). GPU only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

import attngen
from attngen.policy import configs
from attngen import tuning
from attngen.runtime import tables
from attngen.lang.builtin import sdpa_spec
from attngen.analysis.cost import evaluate, fa_flops
from attngen.bench.prefill import gpu_slug, prefill_providers

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default=None)
    parser.add_argument("--n", type=int, default=4096)
    args = parser.parse_args()
    b, h, n, d = 16384 // args.n, 16, args.n, 128
    rows = []
    for causal in (False, True):
        kernel = attngen.load(sdpa_spec("bf16", d, causal))
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        tuned, source = tables.describe_config(kernel, tuning.Shape.of(q, k))
        default = configs.default_config(kernel.spec)
        flex = prefill_providers(causal)["flex"]
        runs = {"attngen tuned": lambda: kernel(q, k, v, config=tuned),
                "attngen default": lambda: kernel(q, k, v, config=default),
                "flex": lambda: flex(q, k, v)}
        flops = evaluate(fa_flops(causal), dict(B=b, H=h, N_Q=n, N_K=n, HEAD_DIM=d))
        for name, fn in runs.items():
            fn()
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            config = tuned if name == "attngen tuned" else default if name == "attngen default" else None
            rows.append({"causal": causal, "provider": name, "ms": ms, "tflops": flops / ms / 1e9,
                         "config": config, "source": source if name == "attngen tuned" else None})
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}: forward bf16 d={d} B={b} H={h} N={n}")
    print(f"{'mask':7s} {'provider':16s} {'ms':>8s} {'TFLOP/s':>8s}  config")
    for r in rows:
        print(f"{'causal' if r['causal'] else 'full':7s} {r['provider']:16s} {r['ms']:8.3f} {r['tflops']:8.1f}  "
              f"{r['config'] or ''}{' (' + r['source'] + ')' if r['source'] else ''}")
    output = args.output or ROOT / "benchmarks" / "results" / f"tuned_vs_default_{gpu_slug(gpu)}.json"
    Path(output).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
