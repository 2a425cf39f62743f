"""Experiment: the host time a user's own spec saves when `Kernel.__call__` plans and replays its calls.

    python benchmarks/experiments/kernel_call_replay.py OUT_DIR      (GPU)

Until v37 only `attngen.attention` (v33-v36) and `attention_with_kvcache` kept the outcome of a call's checks
per signature and replayed its launches; `kernel(q, k, v)` on a loaded spec checked every call and ran
`Kernel.forward` (inference) or `autograd._Eager` (forward and backward in full, a zero gradient for the
log-sum-exp) each time. Since v37 `Kernel.__call__` keeps plans too (`Kernel._plans`) and takes
`autograd.replayed_forward` / `autograd._Planned`, the paths `attngen.attention` takes.
The spec here is a user's: the mask written `causal(bottom_right)` (the same as SDPA's top-left causal mask
at N_Q = N_K) and the heads fixed, so that SDPA's backends compute the same thing on the same inputs.
Three ways, in one process, rounds interleaved (host_overhead.py's `host_us`: back-to-back calls, one
synchronise, fastest round), as training_replay.py:
  replay    the shipped path;
  module    plans kept, replays off (`record` patched to keep none);
  checked   every call checked afresh (a `_plans` that keeps nothing: the path before v37 exactly);
beside SDPA's cuDNN and flash backends, and checks that the three ways agree (out, and dK, dV bit for bit;
dQ, which the Gluon backward adds in any order, within 1e-2 relative). Also each call's host time alone (GPU
idle before it; medians of 200, paired).
Cases: inference B=1 H=16 N=128 d=64 causal, into a new tensor and into one buffer passed as `out=` (planned
too since v37's second commit: the signature holds out's layout, and whether it shares memory with an input
is checked every call); training (out = kernel(q, k, v), then
`torch.autograd.grad(out, (q, k, v), do)`) at that size, B=2 H=16 N=256 d=128 without a mask and B=1 8 query
/ 2 K/V heads N=512 d=128 causal (GQA).
Prediction: the same as `attngen.attention`'s (v35: inference ~113 -> ~36 us on a slow host; v36: training
-29 to -45%), checked a little cheaper than attention's checked path (no SDPA argument checks).
Writes OUT_DIR/kernel_call_replay.json and prints a table (us per call).
"""

from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CASES = [  # (name, training, batch, heads, kv heads, N, d, causal)
    ("inference B1 H16 N128 d64 causal", False, 1, 16, 16, 128, 64, True),
    ("inference out= B1 H16 N128 d64 causal", False, 1, 16, 16, 128, 64, True),
    ("training B1 H16 N128 d64 causal", True, 1, 16, 16, 128, 64, True),
    ("training B2 H16 N256 d128 full", True, 2, 16, 16, 256, 128, False),
    ("training B1 H8/2 N512 d128 causal", True, 1, 8, 2, 512, 128, True),
]


class KernelPlans:
    """Stands in for a module in decode_replay.variants: its `_PLANS` is a kernel's `_plans`."""

    def __init__(self, kernel):
        self.kernel = kernel

    @property
    def _PLANS(self):
        return self.kernel._plans

    @_PLANS.setter
    def _PLANS(self, table):
        self.kernel._plans = table


def user_spec(name: str, d: int, causal: bool, heads: int, kv_heads: int) -> str:
    mask = "causal(bottom_right)" if causal else "none"
    return (f"kernel {name} {{\n    direction = forward+backward\n    mask = {mask}\n    head_dim = {d}\n"
            f"    dtype = bf16\n    heads = {heads}\n    kv_heads = {kv_heads}\n}}\n")


def main() -> int:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen
    from attngen import replay
    from decode_replay import paired, variants
    from host_overhead import host_us

    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, training, b, h, hkv, n, d, causal in CASES:
        kernel = attngen.load(user_spec(f"user_{'causal' if causal else 'full'}_d{d}_h{h}_{hkv}", d, causal, h, hkv))
        q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(training)
        k, v = (torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(training)
                for _ in range(2))
        do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        gqa = h != hkv

        buffer = torch.empty_like(q) if "out=" in name else None

        def step():
            out = kernel(q, k, v, out=buffer)
            return (out, *torch.autograd.grad(out, (q, k, v), do)) if training else (out,)

        def sdpa(backend):
            def run():
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
                return (out, *torch.autograd.grad(out, (q, k, v), do)) if training else (out,)
            return run

        calls, tables = variants(step, KernelPlans(kernel), recorder=replay)  # replay / module / checked
        results = {w: [tuple(t.clone() for t in fn()) for _ in range(3)][-1] for w, fn in calls.items()}
        base = results["replay"]
        exact = (0, 2, 3) if training else (0,)
        same = all(torch.equal(base[i], r[i]) for r in results.values() for i in exact)
        dq_err = (max(float((r[1].float() - base[1].float()).norm() / base[1].float().norm())
                      for r in results.values()) if training else 0.0)
        ref = sdpa(SDPBackend.MATH)()
        out_err = float((base[0].detach().float() - ref[0].detach().float()).norm() / ref[0].detach().float().norm())
        built = [(type(p.inference.forward).__name__, type(p.training.forward).__name__,
                  [type(x).__name__ for x in p.training.backward.values()]) for p in tables["replay"].values()]
        peers = {"cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "flash": sdpa(SDPBackend.FLASH_ATTENTION)}
        us = host_us(dict(calls, **peers), n=50)
        row = dict(case=name, same=same, dq_rel_diff=dq_err, out_rel_err_vs_sdpa_math=out_err, replays=built,
                   **{f"{w} us": t for w, t in us.items()},
                   **paired(dict(calls, cudnn=peers["cudnn"]), n=200))
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(out_dir, "kernel_call_replay.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\n{'case':>39} {'checked':>8} {'module':>8} {'replay':>8} {'cudnn':>7} {'flash':>7}   alone c/m/r/cudnn"
          "          same")
    for r in rows:
        print(f"{r['case']:>39} {r['checked us']:8.1f} {r['module us']:8.1f} {r['replay us']:8.1f} "
              f"{r['cudnn us']:7.1f} {r['flash us']:7.1f}   {r['checked alone us']:5.1f}/{r['module alone us']:5.1f}/"
              f"{r['replay alone us']:5.1f}/{r['cudnn alone us']:5.1f}  {r['same']} {r['dq_rel_diff']:.1e}")
    print("(host us per eager call of a user's spec, `Kernel.__call__` (training: forward + autograd.grad):"
          " back-to-back calls, fastest of interleaved rounds; 'alone': medians of single calls with the GPU idle)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
