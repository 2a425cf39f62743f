"""Backward speed and training memory on the GPU, attngen against the peers in one process.

    python benchmarks/bench_backward.py OUT_DIR

1. Backward TFLOP/s (FlashAttention convention: 2.5 x 4*B*H*N^2*d, halved for causal) for bf16,
   batch = 16384/N, hidden 2048, N = 4096, d = 64 and 128, causal and not; every provider
   timed as `torch.autograd.grad` on a retained graph (backward only), triton.testing.do_bench median.
2. Peak extra memory of forward + backward at N = 4k, 8k, 16k (B=1, H=16, d=128, bf16, causal),
   attngen against naive PyTorch attention (matmul, softmax, matmul): attngen grows linearly in N.
Writes backward.json to OUT_DIR; prints tables last.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
import triton

import attngen

torch._dynamo.config.recompile_limit = 64
torch._dynamo.config.cache_size_limit = 64


def providers(causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    import torch.nn.functional as F

    flex = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def flex_run(q, k, v):
        n = q.shape[2]
        if causal and n not in masks:
            masks[n] = create_block_mask(lambda b, h, i, j: i >= j, None, None, n, n)
        return flex(q, k, v, block_mask=masks.get(n))

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    return {
        "attngen": lambda q, k, v: attngen.attention(q, k, v, is_causal=causal),
        "flex": flex_run,
        "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
    }


def time_backward(fn, q, k, v):
    out = fn(q, k, v)
    do = torch.randn_like(out)
    torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    return triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                   warmup=25, rep=100, return_mode="median")


def speed(lengths=(4096,)):
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for n in lengths:
                b, h = 16384 // n, 2048 // d
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
                flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
                for name, fn in providers(causal).items():
                    try:
                        ms = time_backward(fn, q, k, v)
                        rows.append(dict(d=d, causal=causal, n=n, provider=name, direction="backward", ms=ms,
                                         tflops=flops / ms / 1e9))
                    except Exception as e:  # noqa: BLE001 - a peer that cannot run this case
                        rows.append(dict(d=d, causal=causal, n=n, provider=name, direction="backward",
                                         error=f"{type(e).__name__}: {str(e)[:150]}"))
                print(f"backward d={d} causal={causal} n={n} done", flush=True)
    return rows


def naive(q, k, v):
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    n = q.shape[2]
    keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


def memory():
    rows = []
    for n in (4096, 8192, 16384):
        for name, fn in (("attngen", lambda q, k, v: attngen.attention(q, k, v, is_causal=True)), ("naive", naive)):
            torch.cuda.empty_cache()
            q, k, v = (torch.randn(1, 16, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            do = torch.randn_like(q)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                out = fn(q, k, v)
                out.backward(do)
                torch.cuda.synchronize()
                extra = torch.cuda.max_memory_allocated() - base
                rows.append(dict(n=n, provider=name, peak_extra_bytes=extra))
            except torch.OutOfMemoryError:
                rows.append(dict(n=n, provider=name, error="out of memory"))
            del q, k, v, do
            out = None
        print(f"memory n={n} done", flush=True)
    return rows


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    result["memory"] = memory()
    result["speed"] = speed()
    with open(os.path.join(out_dir, "backward.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['device']}: peak extra memory of forward+backward (B=1, H=16, d=128, bf16, causal)")
    for r in result["memory"]:
        print(f"  N={r['n']:>6} {r['provider']:>8}: " + (f"{r['peak_extra_bytes'] / 2**30:8.3f} GiB" if "error" not in r else r["error"]))
    print("backward TFLOP/s (bf16, FA convention)")
    print(f"{'d':>4} {'causal':>6} {'N':>6} " + " ".join(f"{p:>10}" for p in ("attngen", "flex", "sdpa_flash", "sdpa_cudnn")))
    for d in (64, 128):
        for causal in (False, True):
            for n in sorted({r["n"] for r in result["speed"]}):
                sel = {r["provider"]: r for r in result["speed"] if (r["d"], r["causal"], r["n"]) == (d, causal, n)}
                cells = [f"{sel[p]['tflops']:10.1f}" if "tflops" in sel.get(p, {}) else f"{'err':>10}"
                         for p in ("attngen", "flex", "sdpa_flash", "sdpa_cudnn")]
                print(f"{d:>4} {causal!s:>6} {n:>6} " + " ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
