"""Experiment: what autograd's engine adds to the host time of one eager backward call.

    [N=512] [D=128] python benchmarks/experiments/backward_engine.py OUT_DIR
    (GPU; causal, batch 16384/N, 2048/D heads)

backward_host.py (NOTES v16) found, on an H200's host, torch.autograd.grad over an attngen call at
N=512, d=128 (batch 32, 16 heads, causal) costing 369-607 us of host time per call, of which the
runtime's `Kernel.backward` (called directly from the main thread) is 165-283 us: 200-400 us went to
the engine and the `_Eager` Function around the call, more than attngen's own path, and enough to make
the bench's eager rows there host-bound. This times the same call with each layer swapped out (calls
back to back without synchronising, 50 a round, 7 rounds, min and median of the per-call means):
  trivial Function      a torch.autograd.Function with the same five saved tensors whose backward
                        returns three preallocated gradients: the engine alone
  _Eager, stub kernel   attngen's Function with a registered kernel whose forward/backward return
                        preallocated tensors: the engine + _Eager
  _Eager stub, no materialize   the same with ctx.set_materialize_grads(False) (no zero tensor made
                        for the log-sum-exp's absent gradient)
  attngen               the real call, as the bench times it
  Kernel.backward       the runtime's entry, from the main thread
  Kernel.backward on the engine's thread   the same entry timed from inside the attngen call above
                        (perf_counter around it), per call
  flex / sdpa_cudnn / sdpa_flash   the peers' autograd.grad host time at the same shape
and lists the process's threads. Prediction: the engine itself costs 20-40 us (a CPU-only run of the
trivial Function: 41 us a call, _Eager with a stub 50 us); if the trivial Function already costs
200+ us on the GPU host, the gap is the engine's device-thread handoff and every peer pays it too;
if only attngen pays it, it is something attngen's path does on the engine's thread.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from backward_host import host_us  # noqa: E402 - calls back to back, per-call host time per round


def main() -> int:
    import attngen
    from attngen import autograd as ag
    from attngen.api import sdpa_spec

    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    n, d, causal = int(os.environ.get("N", "512")), int(os.environ.get("D", "128")), True
    b, h = 16384 // n, 2048 // d
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    kernel = attngen.load(sdpa_spec("bf16", d, causal))
    scale = d ** -0.5
    o0, lse0 = kernel.forward(qd, kd, vd, scale)
    grads = tuple(torch.randn_like(t) for t in (qd, kd, vd))

    class Stub:
        def forward(self, q, k, v, scale):
            return o0, lse0

        def backward_saved(self, q, k, v, out, lse, do, scale):
            return grads

    ag._KERNELS["stub"] = Stub()

    class Trivial(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v, o0, lse0)
            return o0.view_as(o0), lse0.view_as(lse0)

        @staticmethod
        def backward(ctx, d_out, d_lse):
            ctx.saved_tensors
            return grads

    class NoMaterialize(ag._Eager):
        @staticmethod
        def forward(ctx, key, q, k, v, scale):
            ctx.set_materialize_grads(False)
            return ag._Eager.forward(ctx, key, q, k, v, scale)

    timed = {"calls": 0, "s": 0.0}
    real = kernel.backward_saved

    def timed_backward(*args, **kwargs):
        t0 = time.perf_counter()
        r = real(*args, **kwargs)
        timed["s"] += time.perf_counter() - t0
        timed["calls"] += 1
        return r

    out_trivial = Trivial.apply(q, k, v)[0]
    out_stub = ag._Eager.apply("stub", q, k, v, scale)[0]
    out_nomat = NoMaterialize.apply("stub", q, k, v, scale)[0]
    out = attngen.attention(q, k, v, is_causal=causal)

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.config.cache_size_limit = 64
    flex = torch.compile(flex_attention, dynamic=False)
    mask = create_block_mask(lambda b_, h_, i, j: i >= j, None, None, n, n) if causal else None
    out_flex = flex(q, k, v, block_mask=mask)
    peers = {}
    for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                peers[name] = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        except RuntimeError as e:
            print(f"{name}: {e}")

    def grad(o):
        return lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

    pieces = {
        "trivial Function": grad(out_trivial),
        "_Eager, stub kernel": grad(out_stub),
        "_Eager stub, no materialize": grad(out_nomat),
        "attngen": grad(out),
        "Kernel.backward": lambda: kernel.backward(qd, kd, vd, o0, lse0, do, scale),
        "Kernel.backward_saved": lambda: kernel.backward_saved(qd, kd, vd, o0, lse0, do, scale),
        "flex": grad(out_flex),
        **{name: grad(o) for name, o in peers.items()},
    }
    results = {}
    for _ in range(2):  # two passes, alternating, so a slow stretch of the host shows
        for name, fn in pieces.items():
            results.setdefault(name, []).extend(host_us(fn))
    kernel.backward_saved = timed_backward
    try:
        host_us(grad(out))
        inside = timed["s"] / timed["calls"] * 1e6
    finally:
        del kernel.backward_saved
    results["Kernel.backward_saved on the engine's thread (mean)"] = [inside]
    threads = [t.name for t in threading.enumerate()]
    info = {"device": torch.cuda.get_device_name(), "N": n, "d": d, "causal": causal, "us per call": results,
            "threads": threads, "switch interval s": sys.getswitchinterval()}
    with open(os.path.join(out_dir, f"backward_engine_n{n}_d{d}.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(f"threads: {threads}; switch interval {sys.getswitchinterval()}")
    print(f"\n{torch.cuda.get_device_name()}: host us per autograd.grad call, d={d} causal N={n} (min / median)")
    for name, r in results.items():
        print(f"  {name:44s} {min(r):7.1f} / {statistics.median(r):7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
