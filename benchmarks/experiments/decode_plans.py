"""Experiment: the host time an eager call saves by repeating the checks' outcome (`_PLANS`).

    python benchmarks/experiments/decode_plans.py OUT_DIR      (GPU)

`attention_with_kvcache` checks every argument before it launches (layouts, dtypes, devices, what the
kernels' 32-bit offsets take) and looks up the kernel, its tuned config and split count: ~25 us of
Python per call on the lent machines' hosts, where a batch-1 decode's GPU work is 8-20 us. Since NOTES
v33 a call whose signature (every tensor's shape, strides, dtype, device; the other arguments' values)
matches an earlier call's takes that call's outcome (attngen/decode.py `_PLANS`). This times the
host side of eager calls (back-to-back calls, one synchronise, rounds interleaved, fastest round:
host_overhead.py's `host_us`) with plans kept ("plans") and with every call checked afresh ("checked":
the same code with a `_PLANS` that keeps nothing), SDPA's cuDNN backend on the same cache beside them,
and checks that both give the same output bit for bit.
Cases: 32 query / 8 K/V heads, d=128, bf16, 1k keys; batch 1 contiguous with an int and with a
tensor of lengths, with `out=`, paged (16-token pages); batch 16 contiguous. And `attngen.attention`
(its own `_PLANS`, attngen/api.py) at batch 1, 16 heads, N=128, d=64, causal, bf16, beside SDPA.
Prediction: -15 to -20 us per call in every case (the checks' share), ~95 -> ~78 us at batch 1.
Writes OUT_DIR/decode_plans.json and prints a table (us per call; "cudnn" is SDPA's cuDNN backend).
"""

from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class NoPlans(dict):
    """A `_PLANS` that keeps nothing: every call is checked afresh."""

    def __setitem__(self, key, value):
        pass


def measure(row: dict, call, cudnn) -> dict:
    """row with host us per call of `call` with plans kept ("plans") and with a `_PLANS` that keeps nothing
    ("checked"), and of `cudnn`; whether both ways give the same output."""
    from attngen import api, decode
    from host_overhead import host_us

    kept = (api._PLANS, decode._PLANS)

    def checked():
        api._PLANS, decode._PLANS = NoPlans(), NoPlans()
        try:
            return call()
        finally:
            api._PLANS, decode._PLANS = kept

    same = torch.equal(call().clone(), checked())
    us = host_us({"plans": call, "checked": checked, "cudnn": cudnn})
    row = dict(row, same_output=same, **{f"{name} us": t for name, t in us.items()})
    print(json.dumps(row), flush=True)
    return row


def case_call(batch: int, layout: str, d: int, ctx: int, gen):
    """(q, k, v, an eager attngen call on them) for one case: 32 query / 8 K/V heads, bf16, ctx keys in a
    cache of ctx; layout "contiguous" (an int length), "growing int" (another int every call, 512 to 1023
    keys, as a decoding loop's), "lengths tensor", "out=" or "paged 16" (k and v as 16-token pages)."""
    import attngen
    from attngen.bench_decode import H, H_KV, DTYPE

    q = torch.randn(batch, 1, H, d, device="cuda", dtype=DTYPE, generator=gen)
    k = torch.randn(batch, ctx, H_KV, d, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn(batch, ctx, H_KV, d, device="cuda", dtype=DTYPE, generator=gen)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    if layout == "paged 16":
        table = torch.arange(batch * ctx // 16, device="cuda", dtype=torch.int32).view(batch, -1)
        kp, vp = k.reshape(-1, 16, H_KV, d), v.reshape(-1, 16, H_KV, d)
        call = lambda: attngen.attention_with_kvcache(q, kp, vp, ctx, table)  # noqa: E731
    elif layout == "growing int":
        step = iter(range(10 ** 9))
        call = lambda: attngen.attention_with_kvcache(q, k, v, 512 + next(step) % 512)  # noqa: E731
    elif layout == "lengths tensor":
        call = lambda: attngen.attention_with_kvcache(q, k, v, lens)  # noqa: E731
    elif layout == "out=":
        call = lambda: attngen.attention_with_kvcache(q, k, v, ctx, out=out)  # noqa: E731
    else:
        call = lambda: attngen.attention_with_kvcache(q, k, v, ctx)  # noqa: E731
    return q, k, v, call


def main() -> int:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen
    from attngen.bench_decode import D, DTYPE, PEERS

    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ctx = 1024
    rows = []
    for batch, layout in ((1, "contiguous"), (1, "lengths tensor"), (1, "out="), (1, "paged 16"), (16, "contiguous")):
        q, k, v, call = case_call(batch, layout, D, ctx, gen)
        cudnn = PEERS["sdpa cudnn"](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), False)
        rows.append(measure(dict(batch=batch, layout=layout), call, cudnn))
    q, k, v = (torch.randn(1, 16, 128, 64, device="cuda", dtype=DTYPE, generator=gen) for _ in range(3))

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with torch.no_grad():
        rows.append(measure(dict(batch=1, layout="prefill N=128"), lambda: attngen.attention(q, k, v, is_causal=True),
                            sdpa))
    with open(os.path.join(out_dir, "decode_plans.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\n{'B':>3} {'case':>15} {'checked':>8} {'plans':>8} {'saved':>8} {'cudnn':>8} same")
    for r in rows:
        print(f"{r['batch']:>3} {r['layout']:>15} {r['checked us']:8.1f} {r['plans us']:8.1f} "
              f"{r['checked us'] - r['plans us']:8.1f} {r['cudnn us']:8.1f} {r['same_output']}")
    print("(host us per eager call: back-to-back calls, fastest of interleaved rounds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
