"""The wide Gluon backward at one and two Q/dO stages (policy hopper.WIDE_BACKWARD_STAGES) and, for DeepSeek's
192/128, with its Q and K tiles in 128 + 64 column pieces (hopper.SPLIT_TILES_192), beside SDPA's cuDNN backend, in
one process: the shapes suite's d=256 and DeepSeek 192/128 rows, causal as the suite runs them and without a mask.

    python benchmarks/wide_backward.py [--split-stages N]

Each row times the forward (under no_grad) and `torch.autograd.grad` on a retained graph (the shapes suite's
backward timing: the row passes around the Gluon kernel included) for cuDNN, then for attngen.attention at each
setting (SETTINGS; "split" only on rows whose head dim has pieces); a setting's switches are set on the policy object
before its forward (an experiment's way: CONVENTIONS.md), and kernel caches key on them, so each setting runs its own
module (a fresh ATTNGEN_CACHE_DIR keeps earlier runs' modules out; the call plans, keyed by the call alone, are
cleared between settings). --split-stages sets hopper.BWD_WIDE_SPLIT's stages for the whole process (a table, not a
switch: caches do not key on it, so the other value needs a run of its own). Prints TFLOP/s forward / backward (the
suite's FLOP counts) and the ratios to cuDNN of each setting, the largest difference of a setting's gradients from
the first's relative to cuDNN's largest (the kernels add dQ in any order: small, not zero), and the forms of the wide
modules generated so far.
"""

import argparse
import dataclasses
import os
import tempfile

os.environ["ATTNGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="attngen-widebwd-")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import attngen  # noqa: E402
from attngen.bench.prefill import _median_ms  # noqa: E402
from attngen.bench.shapes import SHAPES, Shape, _tensors  # noqa: E402
from attngen.policy import hopper  # noqa: E402
from attngen.runtime.plans import PLANS  # noqa: E402

ROWS = [s for s in SHAPES if s.name in ("d256", "d192_128")]
ROWS += [Shape(s.name + "_nomask", s.batch, s.heads, s.heads_kv, s.seqlen, s.head_dim, s.head_dim_v, False)
         for s in list(ROWS)]


SETTINGS = {"1 stage": {"WIDE_BACKWARD_STAGES": False, "SPLIT_TILES_192": False},
            "2 stages": {"WIDE_BACKWARD_STAGES": True, "SPLIT_TILES_192": False},
            "split": {"WIDE_BACKWARD_STAGES": False, "SPLIT_TILES_192": True}}
"""The policy switches of each setting timed (d=256 takes two stages only where WIDE_BACKWARD_STAGES is on: its pair is
in BWD_WIDE_STAGED_PAIRS, 192/128's is not; "split" is BWD_WIDE_SPLIT)."""


def _forms_generated() -> set:
    """The forms of the wide Gluon backward modules generated so far in this run's cache: their stages, "split" where
    the tiles are pieces."""
    found = set()
    for root, _, files in os.walk(os.environ["ATTNGEN_CACHE_DIR"]):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(root, name)) as f:
                    text = f.read()
                if "'wide': True" in text or '"wide": True' in text:
                    found.add("split" if "q1_desc" in text else "2" if "_ws_bwd_stage(" in text else "1")
    return found


def _backward(fn, q, k, v):
    """fn's forward time (ms, without autograd), its backward time on a retained graph, and its gradients for one fixed
    dO."""
    with torch.no_grad():
        forward_ms = _median_ms(lambda: fn(q, k, v))
    out = fn(q, k, v)
    do = torch.randn(out.shape, generator=torch.Generator(out.device).manual_seed(1), device=out.device,
                     dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    return forward_ms, _median_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)), grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split-stages", type=int, default=hopper.BWD_WIDE_SPLIT.stages,
                        help="hopper.BWD_WIDE_SPLIT's Q/dO stages (default: the policy's)")
    hopper.BWD_WIDE_SPLIT = dataclasses.replace(hopper.BWD_WIDE_SPLIT, stages=parser.parse_args().split_stages)
    hopper.WIDE_BACKWARD = True
    gen = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; TFLOP/s forward / backward (torch.autograd.grad); split: "
          f"{hopper.BWD_WIDE_SPLIT.stages} stage(s)")
    print(f"{'row':<18} {'cuDNN':>9}" + "".join(f" {name:>9} {'x cuDNN':>11}" for name in SETTINGS)
          + f" {'grad diff':>10} forms generated")
    for shape in ROWS:
        q, k, v = _tensors(shape, "cuda", gen)
        flops = {"fwd": shape.flops(backward=False), "bwd": shape.flops(backward=True)}

        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)

        def ours(q, k, v):
            return attngen.attention(q, k, v, is_causal=shape.causal)

        fwd_ref, bwd_ref, ref = _backward(cudnn, q, k, v)
        tflops, grads = {}, {}
        for name, switches in SETTINGS.items():
            if switches["SPLIT_TILES_192"] and shape.head_dim not in hopper.TILE_PIECES:
                continue
            for switch, value in switches.items():
                setattr(hopper, switch, value)
            PLANS.clear()  # (call plans are keyed by the call, not the switches: they would run the other module)
            fwd_ms, bwd_ms, grads[name] = _backward(ours, q, k, v)
            tflops[name] = (flops["fwd"] / fwd_ms * 1e-9, flops["bwd"] / bwd_ms * 1e-9)
        for switch, value in SETTINGS["1 stage"].items():
            setattr(hopper, switch, value)
        first = grads["1 stage"]
        diff = max(((a.float() - b.float()).abs().max() / r.float().abs().max()).item()
                   for g in grads.values() for a, b, r in zip(first, g, ref))
        ref_tf = (flops["fwd"] / fwd_ref * 1e-9, flops["bwd"] / bwd_ref * 1e-9)
        cells = "".join(f" {tflops[n][0]:4.0f}/{tflops[n][1]:4.0f} "
                        f"{tflops[n][0] / ref_tf[0]:5.2f}/{tflops[n][1] / ref_tf[1]:5.2f}"
                        if n in tflops else f" {'-':>9} {'-':>11}" for n in SETTINGS)
        print(f"{shape.name:<18} {ref_tf[0]:4.0f}/{ref_tf[1]:4.0f}{cells} {diff:10.2e} {sorted(_forms_generated())}")


if __name__ == "__main__":
    main()
