"""Experiment: the host time an eager decoding call saves by replaying its signature's launches.

    python benchmarks/experiments/decode_replay.py OUT_DIR      (GPU)

Since NOTES v34, from a signature's third call on, `attention_with_kvcache` replays the launches recorded
at its second (attngen/replay.py) instead of running the generated module's `forward_kvcache`. This
times the host side of eager calls three ways, in one process, rounds interleaved (host_overhead.py's
`host_us`: back-to-back calls, one synchronise, fastest round):
  replay    the shipped path (plans and replays);
  module    plans kept, replays off (v33's path: `record` patched to keep none);
  checked   every call checked afresh and no replay (v32's path);
with SDPA's cuDNN backend on the same cache beside them, and checks that all three give the same output
bit for bit (but for "growing int"). Cases: 32 query / 8 K/V heads, d=128, bf16, 1k keys; batch 1
contiguous with an int, with an int that changes every call as a decoding loop's does (v33 planned each
value afresh: its "checked" column), with a tensor of lengths, with `out=`, paged (16-token pages);
batch 16 contiguous; batch 1 at d=96 (the Triton decode kernel, not the Gluon one); and
`attngen.attention` (since v35 it replays too, from attngen/api.py's plans) at B=1 H=16 N=128 d=64
causal beside SDPA cuDNN. Also each case's per-call host time (the call alone, the GPU idle before it:
medians of 300) for replay and module, paired within each sample.
Prediction: -35 to -45 us per call against "module" (forward_kvcache's Python: views, readiness,
descriptors, two FastJIT keys), batch 1 ~92 -> ~50 us, near SDPA cuDNN's ~45. Prefill (v35): -15 to -20
us (Kernel.forward's allocation, config lookup and one FastJIT key), ~45 -> ~28 us against SDPA's ~41.
Writes OUT_DIR/decode_replay.json and prints a table (us per call).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def variants(call, module, recorder=None):
    """(name -> fn, name -> plan table): the call with replays, with plans but no replays, and checked every
    time (each with its own plan table, swapped in around the call); `module`: attngen.decode or attngen.api,
    whose `_PLANS` the call uses, and whose `record` it calls unless `recorder` is the module it takes
    `record` from (attngen.replay, for attngen.autograd's training calls)."""
    from decode_plans import NoPlans

    recorder = recorder or module
    real_record = recorder.record
    tables = {"replay": {}, "module": {}, "checked": NoPlans()}

    def keep_none(fn, inputs, generated):
        return fn(), None

    def way(name):
        def run():
            kept = module._PLANS
            module._PLANS = tables[name]
            recorder.record = real_record if name == "replay" else keep_none
            try:
                return call()
            finally:
                module._PLANS, recorder.record = kept, real_record
        return run

    return {name: way(name) for name in tables}, tables


def paired(calls: dict, n: int = 300) -> dict:
    """Medians of each call's host time alone (GPU idle before it), the calls taken in turn per sample."""
    times = {name: [] for name in calls}
    for _ in range(n):
        for name, fn in calls.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    out = {f"{name} alone us": statistics.median(t) for name, t in times.items()}
    out["module - replay alone us"] = statistics.median([a - b for a, b in zip(times["module"], times["replay"])])
    return out


def main() -> int:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen
    from attngen import api, decode, replay
    from attngen.bench_decode import D, DTYPE, PEERS
    from decode_plans import case_call
    from host_overhead import host_us

    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ctx = 1024
    rows = []
    for batch, layout, d in ((1, "contiguous", D), (1, "growing int", D), (1, "lengths tensor", D), (1, "out=", D),
                             (1, "paged 16", D), (16, "contiguous", D), (1, "contiguous", 96), (1, "prefill N=128", 64)):
        if layout == "prefill N=128":  # attngen.attention, B=1 H=16 d=64 causal (its own plans, attngen/api.py)
            q, k, v = (torch.randn(1, 16, 128, d, device="cuda", dtype=DTYPE, generator=gen) for _ in range(3))
            ways, tables = variants(lambda: attngen.attention(q, k, v, is_causal=True), api, recorder=replay)

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            q, k, v, call = case_call(batch, layout, d, ctx, gen)
            ways, tables = variants(call, decode)
            cudnn = PEERS["sdpa cudnn"](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), False)
        results = {name: [fn().clone() for _ in range(3)][-1] for name, fn in ways.items()}
        built = [bool(p.replay if hasattr(p, "replay") else p.inference.forward) for p in tables["replay"].values()]
        same = all(torch.equal(results["replay"], r) for r in results.values()) if layout != "growing int" else None
        us = host_us(dict(ways, cudnn=cudnn))
        row = dict(batch=batch, layout=layout, head_dim=d, same_output=same, replay_built=built,
                   **{f"{name} us": t for name, t in us.items()}, **paired({n: ways[n] for n in ("replay", "module")}))
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(out_dir, "decode_replay.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\n{'B':>3} {'case':>15} {'d':>4} {'checked':>8} {'module':>8} {'replay':>8} {'saved':>7} {'cudnn':>7} "
          f"{'alone m/r':>12} same")
    for r in rows:
        print(f"{r['batch']:>3} {r['layout']:>15} {r['head_dim']:>4} {r['checked us']:8.1f} {r['module us']:8.1f} "
              f"{r['replay us']:8.1f} {r['module us'] - r['replay us']:7.1f} {r['cudnn us']:7.1f} "
              f"{r['module alone us']:5.1f}/{r['replay alone us']:5.1f} {r['same_output']}")
    print("(host us per eager call: back-to-back calls, fastest of interleaved rounds; 'alone': medians of single "
          "calls with the GPU idle)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
