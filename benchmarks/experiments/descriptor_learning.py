"""Experiment: what it cost that FastJIT learnt where a kernel takes TMA descriptors from its first call only.

    python benchmarks/experiments/descriptor_learning.py OUT_DIR      (GPU)

The Triton dK/dV kernel takes q and do through Triton host descriptors where TMA can read them, and None in
their place where it cannot (an expanded do: a loss of `out.sum()`). Before v37 FastJIT fixed the places of
descriptors at a kernel's first call, so a process whose first backward had an expanded do (a common first
step: a smoke test, a warm-up on `out.sum()`) launched the kernel through Triton's own path on every later
call with descriptors (an unhashable descriptor in the key), re-encoding both tensor maps each time; since
v37 a descriptor where earlier calls passed None is learnt on its first call.
Two ways on fresh FastJIT wrappers of the same kernel, each warmed with one expanded do first:
  learnt     the shipped rule;
  first      the rule before v37 (descriptors only where the first call had them);
then `Kernel.backward` (d=128 without a mask, B=2 H=16 N=256 bf16: the Triton backward) with a contiguous do,
host us per call (host_overhead.py's `host_us`: back-to-back calls, fastest of interleaved rounds), and
whether both give the same gradients bit for bit.
Prediction: first +15-30 us per backward (Triton's launch path: binding, two tensor-map encodings).
Writes OUT_DIR/descriptor_learning.json and prints a table.
"""

from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    import attngen
    from attngen.api import sdpa_spec
    from attngen.launch import FastJIT
    from host_overhead import host_us

    class FirstCallOnly(FastJIT):
        """FastJIT with the rule before v37: descriptor places learnt at the first call only."""

        def _learn_descriptors(self, args):
            if self._cache:
                return False
            return super()._learn_descriptors(args)

    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    kernel = attngen.load(sdpa_spec("bf16", 128, False))
    module = kernel.module
    shipped = module.attn_bwd_dkdv
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(2, 16, 256, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    out, lse = kernel.forward(q, k, v, 128 ** -0.5)
    expanded = torch.ones((), device="cuda", dtype=torch.bfloat16).expand(q.shape)
    ways = {"learnt": FastJIT(shipped.fn), "first": FirstCallOnly(shipped.fn)}
    for fast in ways.values():  # each wrapper's first call: an expanded do
        module.attn_bwd_dkdv = fast
        kernel.backward(q, k, v, out, lse, expanded)

    def way(fast):
        def run():
            module.attn_bwd_dkdv = fast
            return kernel.backward(q, k, v, out, lse, do)
        return run

    calls = {name: way(fast) for name, fast in ways.items()}
    try:
        grads = {name: fn() for name, fn in calls.items()}
        same = all(torch.equal(a, b) for a, b in zip(grads["learnt"], grads["first"]))
        us = host_us(calls, n=50)
    finally:
        module.attn_bwd_dkdv = shipped
    kept = {name: sum(entry[2] is not None for entry in fast._cache.values()) for name, fast in ways.items()}
    row = dict(case="bwd d128 full B2 H16 N256 bf16", same=same, binaries_with_kept_maps=kept,
               **{f"{name} us": t for name, t in us.items()})
    with open(os.path.join(out_dir, "descriptor_learning.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": [row]}, f, indent=1)
    print(json.dumps(row))
    print(f"\nKernel.backward host us after an expanded first call: learnt {us['learnt']:.1f}, first-call rule "
          f"{us['first']:.1f} ({us['first'] - us['learnt']:+.1f}); same gradients: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
