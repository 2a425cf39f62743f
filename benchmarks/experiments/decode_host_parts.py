"""Experiment: where an eager, planned `attention_with_kvcache` call spends its host time, part by part.

    python benchmarks/experiments/decode_host_parts.py OUT_DIR      (GPU)

Since NOTES v33 a repeated call skips its checks (`_PLANS`), and still costs ~2x SDPA cuDNN's host time
(92 against 45 us at batch 1, 1k keys, on an H200 host). This times, on one host and in one process:
  * the whole call (contiguous with int lengths, paged 16, batch 16) and SDPA cuDNN beside it
    (`host_overhead.host_us`: back-to-back calls, rounds interleaved, fastest round);
  * its parts, each in a loop of its own (us per call, no GPU work waited on): the signature, the
    allocations, the views, `wsd_ready`, two descriptors, the partial kernel's and the merge's
    launches on prepared arguments, and the floor of a launch (an empty Triton kernel through
    FastJIT, and `torch.empty` alone);
  * cProfile of 3000 calls per case, the 25 largest items by own time.
Writes OUT_DIR/decode_host_parts.json and .txt (the profiles) and prints a table of the parts.
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
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@triton.jit
def _empty_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pass


def loop_us(fn, n: int = 5000, rounds: int = 5) -> float:
    """us per call of fn over n back-to-back calls, fastest of `rounds` (a synchronise after each round)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def main() -> int:
    import attngen
    from attngen import decode, launch
    from attngen.bench_decode import H, H_KV, D, DTYPE, PEERS
    from host_overhead import host_us

    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ctx = 1024
    cases, rows, profiles = {}, [], []
    for batch, layout in ((1, "contiguous"), (1, "paged 16"), (16, "contiguous")):
        q = torch.randn(batch, 1, H, D, device="cuda", dtype=DTYPE, generator=gen)
        k = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen)
        v = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen)
        if layout == "paged 16":
            table = torch.arange(batch * ctx // 16, device="cuda", dtype=torch.int32).view(batch, -1)
            kc, vc = k.reshape(-1, 16, H_KV, D), v.reshape(-1, 16, H_KV, D)
        else:
            table, kc, vc = None, k, v
        call = lambda q=q, kc=kc, vc=vc, table=table: attngen.attention_with_kvcache(q, kc, vc, ctx, table)  # noqa: E731
        cudnn = PEERS["sdpa cudnn"](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), False)
        cases[(batch, layout)] = (q, kc, vc, table, call)
        us = host_us({"attngen": call, "cudnn": cudnn})
        rows.append(dict(batch=batch, layout=layout, **{f"{name} us": t for name, t in us.items()}))
        print(json.dumps(rows[-1]), flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3000):
            call()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        profiles.append(f"--- cProfile, batch {batch} {layout}, 3000 calls\n{text.getvalue()}")
        print(profiles[-1], flush=True)

    # The parts, at batch 1 contiguous: each in its own loop.
    q, kc, vc, table, call = cases[(1, "contiguous")]
    plan = next(p for p in decode._PLANS.values() if p.batch == 1 and p.page_size is None)
    module = plan.tuner.kernel.module
    k4, v4 = kc.transpose(1, 2), vc.transpose(1, 2)
    q4 = q.transpose(1, 2)
    out = torch.empty_like(q)
    lse = torch.empty((1, H, 1), device="cuda", dtype=torch.float32)
    lens = decode._equal_lengths(1, ctx, q.device)
    splits = plan.num_splits
    o_part = torch.empty((1, splits, H, 1, D), device="cuda", dtype=torch.float32)
    lse_part = torch.empty((1, splits, H, 1), device="cuda", dtype=torch.float32)
    x = torch.empty(16, device="cuda")
    parts = {
        "whole call": call,
        "_signature": lambda: decode._signature(q, kc, vc, ctx, None, True, None, 0, None),
        "_PLANS lookup (signature + get)": lambda: decode._PLANS.get(
            decode._signature(q, kc, vc, ctx, None, True, None, 0, None)),
        "tensor_signature(q)": lambda: attngen.checks.tensor_signature(q),
        "_equal_lengths": lambda: decode._equal_lengths(1, ctx, q.device),
        "torch.empty_like(q)": lambda: torch.empty_like(q),
        "torch.empty lse": lambda: torch.empty((1, H, 1), device=q.device, dtype=torch.float32),
        "two transposes": lambda: (kc.transpose(1, 2), vc.transpose(1, 2)),
        "tuner.launch": lambda: plan.tuner.launch(q4, k4, v4, lens, None, plan.softmax_scale, out.transpose(1, 2),
                                                  lse, plan.config, splits),
        "module.forward_kvcache": lambda: module.forward_kvcache(q4, k4, v4, lens, None, plan.softmax_scale,
                                                                 out.transpose(1, 2), lse, splits, dict(plan.config)),
        "wsd_ready": lambda: module.wsd_ready(q4, k4, v4, q4),
        "two descriptors": lambda: (module._wsd_descriptor(k4), module._wsd_descriptor(v4)),
        "launch_attn_fwd_wsd": lambda: module.launch_attn_fwd_wsd(q4, k4, v4, o_part, lse_part, lens, None,
                                                                   plan.softmax_scale),
        "launch_attn_combine": lambda: module.launch_attn_combine(o_part, lse_part, q4, lse, BLOCK_S=16,
                                                                  num_warps=4, num_stages=1),
        "empty Triton kernel, FastJIT": lambda: fast_empty[(1,)](x, 16, BLOCK=16),
        "empty Triton kernel, Triton's path": lambda: _empty_kernel[(1,)](x, 16, BLOCK=16),
        "torch.empty (16 floats)": lambda: torch.empty(16, device="cuda"),
        "sdpa cudnn": PEERS["sdpa cudnn"](q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), False),
    }
    fast_empty = launch.FastJIT(_empty_kernel)
    measured = {name: loop_us(fn) for name, fn in parts.items()}
    for name, t in measured.items():
        print(f"{name:>40} {t:8.2f} us", flush=True)
    with open(os.path.join(out_dir, "decode_host_parts.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "parts": measured,
                   "splits": splits, "gluon": bool(module.wsd_ready(q4, k4, v4, q4))}, f, indent=1)
    with open(os.path.join(out_dir, "decode_host_parts.txt"), "w") as f:
        f.write("\n".join(profiles))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
