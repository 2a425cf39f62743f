"""Experiment: the host time of one eager backward call, piece by piece.

    [D=128] python benchmarks/experiments/backward_host.py OUT_DIR   (GPU, sm_90: the Gluon backward)

backward_short.py (NOTES v16) found the d=128 backward at N=512 (batch 32, 16 heads) host-bound on
both lent GPUs: its GPU work takes 418 us on an H200 (494 on the H100: a CUDA-graph replay), while
`torch.autograd.grad` over an attngen call costs 345-530 us of host time per call on the H200's host
and 680-1050 on the H100's, so the bench's eager rows there read 115-202 TFLOP/s from round to round
(H200) where the GPU alone gives 205. v8 trimmed the forward's and decode's host paths (51-83 us a
call); the backward's was never measured. This times, warm, calls back to back without
synchronising (50 a round, 7 rounds, min and median of the per-call means), each piece of the path
inside the one before:
  autograd.grad        torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
  Kernel.backward      the runtime's checks, the tuned-config lookup and the module's backward
  module.backward      the generated module's entry (config given)
  launch_attn_bwd_ws   two allocations, three launches, eight TMA descriptors
  prep / dkdv / dq     each launch alone (dkdv with its descriptors built inside)
  8 checked / 8 unchecked descriptors   eight TMA descriptors through Triton's constructor (as the
                       backward built them) / filled in without it (`_gluon_desc`, adopted after this)
  2 torch.empty        the rows and the float32 dQ accumulator
then a cProfile of 100 autograd.grad calls (top entries by own time).
Prediction: the descriptors (Triton's checked constructor, ~5-15 us each) and FastJIT's per-launch
Python (~15-25 us) account for ~150 us; what is left is autograd's engine and the runtime's checks.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def host_us(fn, calls: int = 50, rounds: int = 7) -> list[float]:
    """Per-call host time of `fn`, `calls` back to back without synchronising, for each round."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return out


def main() -> int:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    import attngen
    from attngen.api import sdpa_spec

    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    n, d, causal = 512, int(os.environ.get("D", "128")), True
    b, h = 16384 // n, 2048 // d
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    kernel = attngen.load(sdpa_spec("bf16", d, causal))
    m = kernel.module
    out = attngen.attention(q, k, v, is_causal=causal)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    o, lse = kernel.forward(qd, kd, vd, d ** -0.5)
    dq, dk, dv = (torch.empty_like(t) for t in (qd, kd, vd))
    scale = d ** -0.5
    config = kernel.backward_config(qd, kd)
    shape = m.WS_BWD_SHAPE
    n_pad = m.cdiv(n, shape["BLOCK_M"]) * shape["BLOCK_M"]
    rows = torch.empty((b, h, 2, n_pad), device="cuda", dtype=torch.float32)
    dq_acc = torch.empty((b, h, n, d), device="cuda", dtype=torch.float32)
    grid = (n_pad // shape["BLOCK_M"], h, b)
    kv_block = [1, 1, shape["BLOCK_N"] // shape["consumers"], d]
    pieces = {
        "autograd.grad": lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
        "Kernel.backward": lambda: kernel.backward(qd, kd, vd, o, lse, do, scale),
        "module.backward": lambda: m.backward(qd, kd, vd, o, lse, do, scale, dq=dq, dk=dk, dv=dv,
                                              config={name: dict(c) for name, c in config.items()}),
        "launch_attn_bwd_ws": lambda: m.launch_attn_bwd_ws(qd, kd, vd, o, do, lse, dq, dk, dv, scale),
        "prep launch": lambda: m.attn_bwd_prep_ws[grid](o, do, lse, rows, dq_acc, *o.stride(), *do.stride(),
                                                        *lse.stride(), h, n, n_pad, BLOCK=shape["BLOCK_M"],
                                                        HEAD_DIM=d, num_warps=4),
        "dkdv launch": lambda: m.launch_attn_bwd_dkdv_ws(qd, kd, vd, do, lse, rows[:, :, 1, :n], dk, dv, scale,
                                                         dq_acc=dq_acc, rows=rows),
        "dq launch": lambda: m.attn_bwd_dq_ws[grid](dq_acc, dq, *dq.stride(), h, n, scale, BLOCK=shape["BLOCK_M"],
                                                    HEAD_DIM=d, num_warps=4),
        "8 checked descriptors": lambda: [GluonTensorDescriptor(t, list(t.shape), list(t.stride()), kv_block,
                                                                m._WS_BWD_KV_LAYOUT) for t in (kd, vd, dk, dv) * 2],
        "8 unchecked descriptors": lambda: [m._gluon_desc(t, kv_block, m._WS_BWD_KV_LAYOUT) for t in (kd, vd, dk, dv) * 2],
        "2 torch.empty": lambda: (torch.empty((b, h, 2, n_pad), device="cuda", dtype=torch.float32),
                                  torch.empty((b, h, n, d), device="cuda", dtype=torch.float32)),
    }
    results = {}
    for name, fn in pieces.items():
        results[name] = host_us(fn)
        r = results[name]
        print(f"{name:24s} host us per call: min {min(r):7.1f}  median {statistics.median(r):7.1f}", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    with open(os.path.join(out_dir, f"backward_host_d{d}.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "us per call": results, "cprofile": text.getvalue()}, f,
                  indent=1)
    print(text.getvalue()[:7000])
    print(f"\n{torch.cuda.get_device_name()}: host us per backward call piece, d={d} causal N=512 (min / median of 7)")
    for name, r in results.items():
        print(f"  {name:24s} {min(r):7.1f} / {statistics.median(r):7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
