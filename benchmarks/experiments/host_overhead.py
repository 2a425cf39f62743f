"""Experiment: what an eager call costs on the host (Python, checks, Triton's launcher), per call.

    python benchmarks/experiments/host_overhead.py OUT_DIR

At batch 1 a decode step's kernels take 10-50 us on the GPU, but the bench's eager (non-graph)
attngen rows read 65-100 us: the host, not the GPU, sets the pace of a model that decodes without
CUDA graphs. For small calls (GPU work far below the host's), back-to-back calls and one
synchronise measure the host's time per call (rounds interleaved across providers, the fastest
kept); the same call captured in a CUDA graph gives the GPU's.

Providers: attngen.attention_with_kvcache (auto splits; num_splits=1, one launch; and "triton
path", the same with Triton's JITFunction.run launching instead of attngen/launch.py's FastJIT,
swapped in and out around each call), torch SDPA (flash, cuDNN) on the same cache; the prefill
forward attngen.attention vs SDPA at N=128 (d=64 causal; d=128, whose module also holds the Gluon forward
of pass warp-specialize: its launch alone, forced, against the Triton kernel's path; a call this
small takes the Triton kernel since the min_scores rule); one launch of the split kernel alone both ways, and two
torch floors (a small allocation, a small op). Then cProfile of the attngen decode and prefill calls
(top functions by own and by cumulative time, OUT_DIR/host_profile.txt). Writes host_overhead.json,
prints a table last. Prediction (NOTES v8): Triton's launcher is about half of each launch's host
time; attngen's own checks and lookups another 50-100 us per call before this work.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import attngen  # noqa: E402
from attngen.api import sdpa_spec  # noqa: E402
from attngen.bench_decode import bench_graph  # noqa: E402
from attngen.decode import kvcache_spec  # noqa: E402

H, H_KV, D = 32, 8, 128


def host_us(calls: dict, n: int = 100, rounds: int = 15) -> dict:
    """Host time per call of each of `calls` (name -> fn): rounds of `n` back-to-back calls and one
    synchronise, the providers interleaved round by round (so a slow spell of the machine hits them
    all), the fastest round kept (noise on a shared host only ever adds time)."""
    for fn in calls.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    best = {name: float("inf") for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            best[name] = min(best[name], (time.perf_counter() - t0) / n * 1e6)
    return best


def measure(case: str, calls: dict) -> list:
    """A row per call: host us per call (host_us) and GPU us (one CUDA-graph replay)."""
    host = host_us(calls)
    rows = []
    for name, fn in calls.items():
        rows.append({"case": case, "provider": name, "host_us": host[name], "gpu_us": bench_graph(fn) * 1e3})
        print(rows[-1], flush=True)
    return rows


def triton_path(kernel, fn):
    """`fn` with the kernel's launches going through Triton's JITFunction.run (no FastJIT)."""
    from attngen.launch import FastJIT

    saved = {name: f for name, f in vars(kernel.module).items() if isinstance(f, FastJIT)}

    def call():
        for name, f in saved.items():
            setattr(kernel.module, name, f.fn)
        try:
            return fn()
        finally:
            for name, f in saved.items():
                setattr(kernel.module, name, f)
    return call


def launch_rows(kernel, q4, k4, v4, seqlens) -> list:
    """The split kernel's launch alone (module.launch_attn_fwd, 16 splits) through FastJIT and through
    Triton's JITFunction.run, and two torch floors: allocating a small tensor, and one small op."""
    module = kernel.module
    config = dict(module.DEFAULT_CONFIG, BLOCK_M=16, BLOCK_N=64, num_stages=4)
    o_part = torch.empty((1, 16, H, 1, D), device="cuda", dtype=torch.float32)
    lse_part = torch.empty((1, 16, H, 1), device="cuda", dtype=torch.float32)

    def fast_launch():
        module.launch_attn_fwd(q4, k4, v4, o_part, lse_part, seqlens, 0.088, **config)

    small = torch.zeros(64, device="cuda")
    calls = {"launch_attn_fwd (FastJIT)": fast_launch,
             "launch_attn_fwd (JITFunction.run)": triton_path(kernel, fast_launch),
             "torch.empty(64)": lambda: torch.empty(64, device="cuda"), "small.add_(1)": lambda: small.add_(1)}
    host = host_us(calls)
    rows = [{"case": "one launch, B=1 ctx=1024", "provider": name, "host_us": host[name], "gpu_us": None}
            for name in calls]
    for row in rows:
        print(row, flush=True)
    return rows


def main() -> int:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    decode_kernel = attngen.load(kvcache_spec("bf16", D, True, None))
    prefill_kernel = attngen.load(sdpa_spec("bf16", 64, True))
    with torch.inference_mode():
        for batch, ctx in ((1, 1024), (1, 8192), (16, 1024)):
            q = torch.randn(batch, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            k = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            v = torch.randn_like(k)
            seqlens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
            q4, k4, v4 = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

            def sdpa(kind):
                def fn():
                    with sdpa_kernel(kind):
                        return F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)
                return fn

            calls = {
                "attngen": lambda: attngen.attention_with_kvcache(q, k, v, seqlens),
                "attngen triton path": triton_path(decode_kernel, lambda: attngen.attention_with_kvcache(q, k, v, seqlens)),
                "attngen 1 split": lambda: attngen.attention_with_kvcache(q, k, v, seqlens, num_splits=1),
                "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION),
                "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
            }
            ok = {}
            for name, fn in calls.items():
                try:
                    fn()
                    ok[name] = fn
                except Exception as e:  # noqa: BLE001 - a backend may refuse the shape
                    rows.append({"case": f"decode B={batch} ctx={ctx}", "provider": name, "error": str(e)[:200]})
            host = host_us(ok)
            for name, fn in ok.items():
                row = {"case": f"decode B={batch} ctx={ctx}", "provider": name, "host_us": host[name],
                       "gpu_us": bench_graph(fn) * 1e3}
                rows.append(row)
                print(row, flush=True)
            if batch == 1 and ctx == 1024:
                rows += launch_rows(decode_kernel, q4, k4, v4, seqlens)
        qp, kp, vp = (torch.randn(1, 16, 128, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        calls = {"attngen": lambda: attngen.attention(qp, kp, vp, is_causal=True),
                 "attngen triton path": triton_path(prefill_kernel, lambda: attngen.attention(qp, kp, vp, is_causal=True)),
                 "sdpa": lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)}
        rows += measure("prefill fwd B=1 H=16 N=128 d=64 causal", calls)

        # d=128 prefill: the Gluon forward (pass warp-specialize: Triton's own launcher, four TMA descriptors
        # built per call) against the Triton kernel of the same module (FastJIT)
        kernel128 = attngen.load(sdpa_spec("bf16", 128, False))
        qg, kg, vg = (torch.randn(1, 16, 128, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        og, lseg = torch.empty_like(qg), torch.empty(qg.shape[:3], device="cuda")
        calls = {"attngen": lambda: attngen.attention(qg, kg, vg),
                 "Kernel.forward": lambda: kernel128.forward(qg, kg, vg, 128 ** -0.5),
                 "Kernel.forward, warp_specialized=False": lambda: kernel128.forward(
                     qg, kg, vg, 128 ** -0.5, config={"warp_specialized": False}),
                 "launch_attn_fwd_ws (gluon, forced)": lambda: kernel128.module.launch_attn_fwd_ws(
                     qg, kg, vg, og, lseg, 128 ** -0.5),
                 "sdpa": lambda: F.scaled_dot_product_attention(qg, kg, vg)}
        rows += measure("prefill fwd B=1 H=16 N=128 d=128", calls)

        q = torch.randn(1, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(1, 1024, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        seqlens = torch.full((1,), 1024, device="cuda", dtype=torch.int32)
        text = io.StringIO()
        for name, fn in (("decode B=1 ctx=1024", lambda: attngen.attention_with_kvcache(q, k, v, seqlens)),
                         ("prefill fwd N=128", lambda: attngen.attention(qp, kp, vp, is_causal=True)),
                         ("prefill fwd N=128 d=128 (gluon, forced)",
                          lambda: kernel128.module.launch_attn_fwd_ws(qg, kg, vg, og, lseg, 128 ** -0.5))):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(500):
                fn()
            torch.cuda.synchronize()
            prof.disable()
            text.write(f"==== {name}: 500 calls\n")
            for key in ("tottime", "cumulative"):
                pstats.Stats(prof, stream=text).sort_stats(key).print_stats(30)
        with open(os.path.join(out_dir, "host_profile.txt"), "w") as f:
            f.write(text.getvalue())
    with open(os.path.join(out_dir, "host_overhead.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\n{'case':<40} {'provider':<34} {'host us/call':>12} {'gpu us':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<40} {r['provider']:<34} error: {r['error'][:60]}")
        else:
            gpu = "" if r["gpu_us"] is None else f"{r['gpu_us']:.1f}"
            print(f"{r['case']:<40} {r['provider']:<34} {r['host_us']:>12.1f} {gpu:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
