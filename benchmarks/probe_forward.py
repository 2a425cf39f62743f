"""A first look at forward speed on the GPU: attngen (a few configs) against the peers, one process.

    python benchmarks/probe_forward.py [OUT_DIR]

Prefill shapes of the FlashAttention benchmarks (batch = 16384 / N, hidden 2048), bf16, timed with
triton.testing.do_bench (median) on fresh random data; TFLOP/s by the FlashAttention convention
(4*B*H*N^2*d, halved for causal). Writes forward_probe.json to OUT_DIR and prints a table.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

import attngen
from attngen.lang.spec import parse

torch._dynamo.config.recompile_limit = 64
torch._dynamo.config.cache_size_limit = 64


def flops(b, h, n, d, causal):
    return 4 * b * h * n * n * d / (2 if causal else 1)


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def peers(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    out = {}
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        try:
            out[name] = bench(run)
        except Exception as e:  # noqa: BLE001
            out[name] = f"error: {type(e).__name__}: {str(e)[:120]}"
    n = q.shape[2]
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, n, n) if causal else None
    flex = torch.compile(flex_attention, dynamic=False)
    try:
        out["flex"] = bench(lambda: flex(q, k, v, block_mask=mask))
    except Exception as e:  # noqa: BLE001
        out["flex"] = f"error: {type(e).__name__}: {str(e)[:120]}"
    return out


CONFIGS = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 2),
           (128, 128, 4, 2), (64, 128, 4, 3)]


def main(out_dir: str) -> None:
    rows = []
    dev = torch.cuda.get_device_name()
    for d in (64, 128):
        for causal in (False, True):
            for n in (1024, 4096, 16384):
                b, h = 16384 // n, 2048 // d
                gen = torch.Generator(device="cuda").manual_seed(n + d)
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
                spec = parse(f"kernel probe_d{d}_{'c' if causal else 'n'} {{ head_dim = {d} dtype = bf16 "
                             f"mask = {'causal' if causal else 'none'} }}")
                kernel = attngen.load(spec)
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                fl = flops(b, h, n, d, causal)
                best = None
                configs = CONFIGS if n == 4096 else [None]
                for cfg in configs:
                    config = None if cfg is None else dict(BLOCK_M=cfg[0], BLOCK_N=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
                    t0 = time.time()
                    try:
                        out = kernel(q, k, v, config=config)
                        err = (out.float() - ref.float()).norm().item() / ref.float().norm().item()
                        ms = bench(lambda: kernel(q, k, v, config=config))
                    except Exception as e:  # noqa: BLE001
                        rows.append(dict(d=d, causal=causal, n=n, provider="attngen", config=cfg, error=str(e)[:200]))
                        continue
                    rows.append(dict(d=d, causal=causal, n=n, provider="attngen", config=cfg or kernel.config(q, k),
                                     ms=ms, tflops=fl / ms / 1e9, rel_err=err, first_call_s=time.time() - t0))
                    if best is None or ms < best:
                        best = ms
                for name, ms in peers(q, k, v, causal).items():
                    row = dict(d=d, causal=causal, n=n, provider=name)
                    row.update(dict(ms=ms, tflops=fl / ms / 1e9) if isinstance(ms, float) else dict(error=ms))
                    rows.append(row)
                print(f"d={d} causal={causal} n={n} done", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "forward_probe.json"), "w") as f:
        json.dump(dict(device=dev, torch=torch.__version__, triton=triton.__version__, rows=rows), f, indent=1)
    print(f"\n{dev}  (TFLOP/s, bf16 forward)")
    print(f"{'d':>4} {'causal':>6} {'N':>6} {'attngen':>8} {'best cfg':>18} {'flex':>7} {'flash':>7} {'cudnn':>7}")
    for d in (64, 128):
        for causal in (False, True):
            for n in (1024, 4096, 16384):
                sel = [r for r in rows if r["d"] == d and r["causal"] == causal and r["n"] == n and "tflops" in r]
                ours = max((r for r in sel if r["provider"] == "attngen"), key=lambda r: r["tflops"], default=None)
                get = lambda p: next((f"{r['tflops']:7.1f}" for r in sel if r["provider"] == p), "    err")
                print(f"{d:>4} {causal!s:>6} {n:>6} {ours['tflops'] if ours else 0:8.1f} {str(ours['config'] if ours else ''):>18} "
                      f"{get('flex')} {get('sdpa_flash')} {get('sdpa_cudnn')}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
