"""The wide Gluon backward at one and two Q/dO stages (policy hopper.WIDE_BACKWARD_STAGES) beside SDPA's cuDNN
backend, in one process: the shapes suite's d=256 and DeepSeek 192/128 rows, causal as the suite runs them and
without a mask.

    python benchmarks/wide_backward.py

Each row times `torch.autograd.grad` on a retained graph (the shapes suite's backward timing: the row passes
around the Gluon kernel included) for cuDNN, then for attngen.attention with the switch off and on; the switch is
set on the policy object before that setting's forward (an experiment's way: CONVENTIONS.md), and kernel caches
key on it, so each setting runs its own module (a fresh ATTNGEN_CACHE_DIR keeps earlier runs' modules out; the call
plans, keyed by the call alone, are cleared between settings). Prints
TFLOP/s (the suite's FLOP count), the ratios to cuDNN and of two stages to one, the largest difference of the two
settings' gradients relative to cuDNN's largest (the kernels add dQ in any order: small, not zero), and the stages of
the wide modules generated so far (1 and 2 from the first row on: both settings ran their own module).
"""

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


def _stages_generated() -> set:
    """The STAGES of the wide Gluon backward modules generated so far in this run's cache."""
    found = set()
    for root, _, files in os.walk(os.environ["ATTNGEN_CACHE_DIR"]):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(root, name)) as f:
                    text = f.read()
                if "'wide': True" in text or '"wide": True' in text:
                    found.add(2 if "_ws_bwd_stage(" in text else 1)
    return found


def _backward(fn, q, k, v):
    """fn's backward time (ms) on a retained graph, and its gradients for one fixed dO."""
    out = fn(q, k, v)
    do = torch.randn(out.shape, generator=torch.Generator(out.device).manual_seed(1), device=out.device,
                     dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    return _median_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)), grads


def main() -> None:
    hopper.WIDE_BACKWARD = True
    gen = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; TFLOP/s of the backward (torch.autograd.grad)")
    print(f"{'row':<18} {'cuDNN':>7} {'1 stage':>8} {'x cuDNN':>8} {'2 stages':>9} {'x cuDNN':>8} {'x 1 stage':>10} "
          f"{'grad diff':>10} stages generated")
    for shape in ROWS:
        q, k, v = _tensors(shape, "cuda", gen)
        flops = shape.flops(backward=True)

        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)

        def ours(q, k, v):
            return attngen.attention(q, k, v, is_causal=shape.causal)

        ms_ref, ref = _backward(cudnn, q, k, v)
        times, grads = {}, {}
        for staged in (False, True):
            hopper.WIDE_BACKWARD_STAGES = staged
            PLANS.clear()  # (call plans are keyed by the call, not the switches: they would run the other module)
            times[staged], grads[staged] = _backward(ours, q, k, v)
        hopper.WIDE_BACKWARD_STAGES = False
        diff = max(((a.float() - b.float()).abs().max() / r.float().abs().max()).item()
                   for a, b, r in zip(grads[False], grads[True], ref))
        tf = {key: flops / ms * 1e-9 for key, ms in (("ref", ms_ref), (False, times[False]), (True, times[True]))}
        print(f"{shape.name:<18} {tf['ref']:7.0f} {tf[False]:8.0f} {tf[False] / tf['ref']:8.2f} {tf[True]:9.0f} "
              f"{tf[True] / tf['ref']:8.2f} {tf[True] / tf[False]:10.3f} {diff:10.2e} {sorted(_stages_generated())}")


if __name__ == "__main__":
    main()
