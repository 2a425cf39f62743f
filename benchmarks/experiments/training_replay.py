"""Experiment: the host time an eager training call saves by replaying its forward's and backward's launches.

    python benchmarks/experiments/training_replay.py OUT_DIR      (GPU)

v35 replays `attngen.attention`'s inference calls; since v36 a training call (q, k or v requiring grad) whose
signature repeats takes `autograd._Planned`: from the signature's third call on, its forward replays the
launches recorded at the second (out and the log-sum-exp written into tensors the call allocates) and its
backward those recorded for the output gradient's layout (prep pass, Gluon or Triton kernels, dQ pass),
without `Kernel.forward` / `Kernel._backward`'s Python (config lookups, allocations, descriptors, FastJIT
keys); and it returns only `out`, so autograd makes no zero gradient for the log-sum-exp. The call timed is
a training step's attention part: `out = attention(q, k, v)`, then `torch.autograd.grad(out, (q, k, v), do)`.
Three ways, in one process, rounds interleaved (host_overhead.py's `host_us`: back-to-back calls, one
synchronise, fastest round):
  replay    the shipped path;
  module    plans kept, replays off (`record` patched to keep none: v35's training path, but _Planned);
  checked   every call checked afresh through `_Eager` (v35's path exactly: a `_PLANS` that keeps nothing);
beside SDPA's cuDNN and flash backends on the same inputs, and checks that the three ways agree (out, dK and
dV bit for bit; dQ, which the Gluon backward adds in any order, within 1e-2 relative). Also each call's
host time alone (GPU idle before it; medians of 200, paired).
Cases (small enough that the host, not the GPU, bounds back-to-back calls): B=1 H=16 N=128 d=64 causal,
B=2 H=16 N=256 d=128 without a mask, and B=1 8 query / 2 K/V heads N=512 d=128 causal (GQA).
Prediction: checked ~250-300 us per call (v17: 216-291 on the H200 at N=512), module -10 to -20 us (no zero
lse gradient, fewer checks of do), replay a further -60 to -90 us (the forward's ~25 us of Python, the
backward's ~60: five allocations, three launches, eight descriptors), near SDPA cuDNN's ~110-120.
Writes OUT_DIR/training_replay.json and prints a table (us per call).
"""

from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CASES = [  # (name, batch, heads, kv heads, N, d, causal)
    ("B1 H16 N128 d64 causal", 1, 16, 16, 128, 64, True),
    ("B2 H16 N256 d128 full", 2, 16, 16, 256, 128, False),
    ("B1 H8/2 N512 d128 causal", 1, 8, 2, 512, 128, True),
]


def main() -> int:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen
    from attngen import api, replay
    from decode_replay import paired, variants
    from host_overhead import host_us

    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, b, h, hkv, n, d, causal in CASES:
        q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        k, v = (torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                for _ in range(2))
        do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        gqa = h != hkv

        def step():
            out = attngen.attention(q, k, v, is_causal=causal, enable_gqa=gqa)
            return (out, *torch.autograd.grad(out, (q, k, v), do))

        def sdpa(backend):
            def run():
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
                return (out, *torch.autograd.grad(out, (q, k, v), do))
            return run

        calls, tables = variants(step, api, recorder=replay)  # replay / module / checked
        results = {w: [tuple(t.clone() for t in fn()) for _ in range(3)][-1] for w, fn in calls.items()}
        base = results["replay"]
        same = all(torch.equal(base[i], r[i]) for r in results.values() for i in (0, 2, 3))
        dq_err = max(float((r[1].float() - base[1].float()).norm() / base[1].float().norm()) for r in results.values())
        built = [(type(p.training.forward).__name__, [type(x).__name__ for x in p.training.backward.values()])
                 for p in tables["replay"].values()]
        peers = {"cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "flash": sdpa(SDPBackend.FLASH_ATTENTION)}
        us = host_us(dict(calls, **peers), n=50)
        row = dict(case=name, same_out_dk_dv=same, dq_rel_diff=dq_err, replays=built,
                   **{f"{w} us": t for w, t in us.items()},
                   **paired(dict(calls, cudnn=peers["cudnn"]), n=200))
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(out_dir, "training_replay.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\n{'case':>26} {'checked':>8} {'module':>8} {'replay':>8} {'cudnn':>7} {'flash':>7}   alone c/m/r/cudnn"
          "          same")
    for r in rows:
        print(f"{r['case']:>26} {r['checked us']:8.1f} {r['module us']:8.1f} {r['replay us']:8.1f} {r['cudnn us']:7.1f} "
              f"{r['flash us']:7.1f}   {r['checked alone us']:5.1f}/{r['module alone us']:5.1f}/{r['replay alone us']:5.1f}"
              f"/{r['cudnn alone us']:5.1f}  {r['same_out_dk_dv']} {r['dq_rel_diff']:.1e}")
    print("(host us per eager training call, forward + autograd.grad: back-to-back calls, fastest of interleaved rounds;"
          " 'alone': medians of single calls with the GPU idle)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
