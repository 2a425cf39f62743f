"""The wide Gluon backward's causal programs in pairs of key tiles (policy hopper.WIDE_BWD_PAIRED) against the per-tile
grid, beside SDPA's cuDNN backend, in one process: DeepSeek's 192/128 (split tiles, SPLIT_TILES_192) causal as the
shapes suite runs it and without a mask (which the switch leaves as it is: a control), and the d=256 causal row (not
paired either: its staged kernel's stages are its dQ tiles).

    python benchmarks/wide_backward.py             # on a Hopper GPU
    python benchmarks/wide_backward.py --tail-waves 0   # every head paired (WIDE_BWD_PAIR_TAIL_WAVES: a table, not
                                                        # a switch: caches do not key on it, so a run of its own)
    python benchmarks/wide_backward.py --simulate  # on any machine: the list-scheduling simulation of the grids

Each row times the forward (under no_grad) and `torch.autograd.grad` on a retained graph (the shapes suite's
backward timing: the row passes around the Gluon kernel included) for cuDNN, then for attngen.attention at each
setting (SETTINGS); a setting's switches are set on the policy object before its forward (an experiment's way:
CONVENTIONS.md), and kernel caches key on them, so each setting runs its own module (a fresh ATTNGEN_CACHE_DIR keeps
earlier runs' modules out; the call plans, keyed by the call alone, are cleared between settings). Prints TFLOP/s
forward / backward (the suite's FLOP counts) and the ratios to cuDNN of each setting, the largest difference of a
setting's gradients from the first's relative to cuDNN's largest (the kernels add dQ in any order: small, not zero),
and whether the paired module was generated.

--simulate: the backward's programs of 192/128 (B=1 H=128 N=4096, 64 key tiles a head of 64 - i query-block steps
causal, 64 without a mask) list-scheduled on 132 multiprocessors in launch order (each program, when one ends, to the
next in order: one program a multiprocessor, as the wide kernel's shared memory allows), a program's time its steps
plus a fixed cost c (launch, K and V load, ring fill, dK and dV stores); paired: programs of tiles p and 63 - p, whose
fixed cost is c plus the second tile's exposed part `second` (its K and V load); tail: the paired grid with its last
heads single (the launcher's WIDE_BWD_PAIR_TAIL_WAVES). Prints the makespan against the work's own (total / 132) and
the causal rate against the no-mask one under each model.
"""

import argparse
import heapq
import os
import tempfile

os.environ["ATTNGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="attngen-widebwd-")

SETTINGS = {"per tile": {"WIDE_BWD_PAIRED": False}, "paired": {"WIDE_BWD_PAIRED": True}}
"""The policy switches of each setting timed (the others at the policy's values: WIDE_BACKWARD, SPLIT_TILES_192 on)."""


def _makespan(jobs, programs=132):
    """When the last of `jobs` (their times, in launch order) ends, each started on the first multiprocessor free."""
    free = [0.0] * programs
    end = 0.0
    for work in jobs:
        start = heapq.heappop(free)
        end = max(end, start + work)
        heapq.heappush(free, start + work)
    return end


def simulate(heads=128, tiles=64, waves=2, programs=132):
    """Print the list-scheduling simulation described in the module docstring."""
    single = -(-waves * programs // tiles)  # (the launcher's ws_bwd_paired_heads)
    print(f"192/128 B=1 H={heads} N={tiles * 64}: makespan in steps (work's own), causal rate / no-mask rate; "
          f"tail: the last {single} heads single ({waves} waves)")
    for c, second in ((0, 0), (1, 0.5), (2, 1), (4, 1), (5, 2)):
        none = [tiles + c] * (heads * tiles)
        causal = [tiles - i + c for _ in range(heads) for i in range(tiles)]
        paired = [tiles + 1 + c + second for _ in range(heads) for _ in range(tiles // 2)]
        tail = paired[:(heads - single) * (tiles // 2)] + causal[(heads - single) * tiles:]
        cells = []
        for name, jobs, useful in (("none", none, tiles * tiles), ("causal", causal, tiles * tiles / 2),
                                   ("paired", paired, tiles * tiles / 2), ("tail", tail, tiles * tiles / 2)):
            span = _makespan(jobs)
            cells.append((name, span, sum(jobs) / 132, heads * useful / span))
        rate_none = cells[0][3]
        print(f"c={c} second={second}: " + "; ".join(
            f"{name} {span:.0f} ({own:.0f}) {rate / rate_none:.3f}" for name, span, own, rate in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--simulate", action="store_true", help="the grids' list-scheduling simulation (no GPU)")
    parser.add_argument("--tail-waves", type=int, default=None,
                        help="hopper.WIDE_BWD_PAIR_TAIL_WAVES for the whole process (default: the policy's)")
    args = parser.parse_args()
    if args.simulate:
        for waves in (2, 1) if args.tail_waves is None else (args.tail_waves,):
            simulate(waves=waves)
        return

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen
    from attngen.bench.prefill import _median_ms
    from attngen.bench.shapes import SHAPES, Shape, _tensors
    from attngen.policy import hopper
    from attngen.runtime.plans import PLANS

    rows = [s for s in SHAPES if s.name == "d192_128"]
    rows += [Shape(s.name + "_nomask", s.batch, s.heads, s.heads_kv, s.seqlen, s.head_dim, s.head_dim_v, False)
             for s in list(rows)]
    rows += [s for s in SHAPES if s.name == "d256"]

    def backward(fn, q, k, v):
        """fn's forward time (ms, without autograd), its backward time on a retained graph, and its gradients for one
        fixed dO."""
        with torch.no_grad():
            forward_ms = _median_ms(lambda: fn(q, k, v))
        out = fn(q, k, v)
        do = torch.randn(out.shape, generator=torch.Generator(out.device).manual_seed(1), device=out.device,
                         dtype=out.dtype)
        grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        return forward_ms, _median_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)), grads

    def paired_generated():
        for root, _, files in os.walk(os.environ["ATTNGEN_CACHE_DIR"]):
            for name in files:
                if name.endswith(".py") and "_ws_bwd_pair_loader" in open(os.path.join(root, name)).read():
                    return True
        return False

    hopper.WIDE_BACKWARD = True
    if args.tail_waves is not None:
        hopper.WIDE_BWD_PAIR_TAIL_WAVES = args.tail_waves
    gen = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; TFLOP/s forward / backward (torch.autograd.grad); paired launches end in "
          f"{hopper.WIDE_BWD_PAIR_TAIL_WAVES} waves of single tiles")
    print(f"{'row':<18} {'cuDNN':>9}" + "".join(f" {name:>9} {'x cuDNN':>11}" for name in SETTINGS)
          + f" {'grad diff':>10} paired module")
    for shape in rows:
        q, k, v = _tensors(shape, "cuda", gen)
        flops = {"fwd": shape.flops(backward=False), "bwd": shape.flops(backward=True)}

        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)

        def ours(q, k, v):
            return attngen.attention(q, k, v, is_causal=shape.causal)

        fwd_ref, bwd_ref, ref = backward(cudnn, q, k, v)
        tflops, grads = {}, {}
        for name, switches in SETTINGS.items():
            for switch, value in switches.items():
                setattr(hopper, switch, value)
            PLANS.clear()  # (call plans are keyed by the call, not the switches: they would run the other module)
            fwd_ms, bwd_ms, grads[name] = backward(ours, q, k, v)
            tflops[name] = (flops["fwd"] / fwd_ms * 1e-9, flops["bwd"] / bwd_ms * 1e-9)
        hopper.WIDE_BWD_PAIRED = False
        first = grads["per tile"]
        diff = max(((a.float() - b.float()).abs().max() / r.float().abs().max()).item()
                   for g in grads.values() for a, b, r in zip(first, g, ref))
        ref_tf = (flops["fwd"] / fwd_ref * 1e-9, flops["bwd"] / bwd_ref * 1e-9)
        cells = "".join(f" {tflops[n][0]:4.0f}/{tflops[n][1]:4.0f} "
                        f"{tflops[n][0] / ref_tf[0]:5.2f}/{tflops[n][1] / ref_tf[1]:5.2f}" for n in SETTINGS)
        print(f"{shape.name:<18} {ref_tf[0]:4.0f}/{ref_tf[1]:4.0f}{cells} {diff:10.2e} {paired_generated()}")


if __name__ == "__main__":
    main()
