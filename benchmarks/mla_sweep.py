"""MLA decode configs on one GPU: which tiles, warps, stages and split counts read the latent cache fastest.

    python benchmarks/mla_sweep.py [--heads 16 128] [--batch 64] [--seqlen 8192] [--wide]
                                   [--gluon [--splits 0 2 4 8] [--overlap] [--seesaw] [--defer-pv] [--shapes 64x2 32x4]]
                                   [-o sweep.json]

specs/mla_decode.attn (576/512, `v = k[:512]`, pages of 64) at issue 51's bench shapes (batch 64, every sequence
8,192 tokens, one new token, 16 and 128 query heads over one latent head), through the tuner's own view of the
kernel (`KVCacheTunable`: its inputs, launch and float64 check), so a config here runs exactly as a tuned one
would. Each candidate is checked against float64 on two sequences, then timed as CUDA-graph replays. Printed per
head count: the config, ms, GB/s of the latent cache read once (issue 51's bandwidth target: 80% of HBM at 16
heads) and TFLOP/s at 2 x (576 + 512) a score (target: 500 at 128 heads), fastest first, the default marked.
Candidates the resource model rejects (`infeasible`) are skipped before compiling. `num_splits` 0 is the
run-time heuristic (attngen/policy/splits.py). About 3 minutes on an H200 (`--wide`: more candidates, longer).
`--gluon`: instead, the Gluon MLA kernel (policy hopper.MLA_GLUON, turned on in this process for its own module) at
0, 2, 4 and 8 splits beside the Triton kernel's default config, the same inputs and checks; `--gluon --overlap`:
also the overlapped schedule (policy hopper.MLA_OVERLAP, a module of its own) at the same split counts; `--seesaw`:
also the seesaw schedule (hopper.MLA_SEESAW) likewise, `--defer-pv` the serial one with its P V wait deferred
(hopper.MLA_DEFER_PV); `--shapes`:
also both schedules at each block size x stages given (modules of their own, through the policy objects). GPU only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import replace

import torch

import attngen
from attngen.analysis.resources import infeasible
from attngen.bench.decode import bench_graph
from attngen.policy import hopper
from attngen.runtime.keys import Shape
from attngen.tuning.adapt import tunable

SPEC = "specs/mla_decode.attn"

# Per query-rows tile (BLOCK_M: 16 at 16 heads, 64 at 128): BLOCK_N, num_warps, num_stages, num_splits.
# 16 rows are memory bound: the question is how many bytes each SM keeps in flight (stages x CTAs a SM, and
# the split count sets the CTAs); 64 rows are bound by the two products, whose 64 x 512 float32 accumulator
# leaves 8 warps little room (4 warps spill: benchmarks/NOTES.md "MLA decode"). A paged kernel's stages buffer
# one 576-wide tile at 2-4, two at 5-6, three at 7 (its sm_90 compile), so those are the stages tried.
CANDIDATES = {
    16: dict(BLOCK_N=(32, 64), num_warps=(4, 8), num_stages=(2, 5, 7), num_splits=(0, 4, 8)),
    64: dict(BLOCK_N=(16, 32, 64), num_warps=(8,), num_stages=(1, 2, 5), num_splits=(0, 2, 4)),
}
WIDE = {
    16: dict(BLOCK_N=(16, 32, 64), num_warps=(2, 4, 8), num_stages=(1, 2, 5, 7), num_splits=(0, 2, 4, 8, 16)),
    64: dict(BLOCK_N=(16, 32, 64), num_warps=(4, 8), num_stages=(1, 2, 3, 5), num_splits=(0, 1, 2, 4, 8)),
}


def candidates(spec, space: dict) -> list[dict]:
    """The configs of `space` (key -> values, BLOCK_M's included) that the resource model lets through."""
    found = [dict(zip(space, values)) for values in itertools.product(*space.values())]
    return [c for c in found if infeasible(spec, {k: v for k, v in c.items() if k != "num_splits"}) is None]


def _setup(kernel, heads: int, batch: int, seqlen: int, device):
    """The tuner's view of the kernel, its inputs at one head count (every sequence full) and the default config."""
    tuner = tunable(kernel.part("kvcache"))
    shape = Shape(batch, heads, 1, 1, seqlen)
    generator = torch.Generator(device=device).manual_seed(0)
    _, inputs = tuner.tuning_variants(tuner.tuning_inputs(shape, device, generator))[0]  # every sequence full
    default = dict(tuner.part.config(shape, uniform=True), num_splits=0)
    default.pop("warp_specialized", None)  # (the Triton kernel: a tuned entry says 0, an untuned one nothing)
    return tuner, inputs, default, tuner.part.block_m(shape)


def sweep(kernel, heads: int, batch: int, seqlen: int, spaces: dict, device="cuda", timer=bench_graph) -> list[dict]:
    """Every candidate of `spaces[BLOCK_M]` (BLOCK_M: the part's for `heads`; else the nearest key's) and the
    default config at one head count: its config, and ms, GB/s, TFLOP/s and float64 error, or why it failed.
    `timer(fn)`: ms a call."""
    tuner, inputs, default, block_m = _setup(kernel, heads, batch, seqlen, device)
    nearest = min(spaces, key=lambda rows: abs(rows - block_m))  # other head counts: the nearer space's values
    configs = candidates(tuner.spec, dict(spaces[nearest], BLOCK_M=(block_m,)))
    if not any(all(c[k] == default[k] for k in c) for c in configs):
        configs.insert(0, default)
    return measure(tuner, inputs, configs, heads, default, timer)


def load_gluon(overlap: bool = False, shape: tuple[int, int] | None = None, seesaw: bool = False,
               defer_pv: bool = False, min_rows: int | None = None):
    """The spec's kernel with the Gluon MLA kernel (policy hopper.MLA_GLUON on; hopper.MLA_OVERLAP, MLA_SEESAW and
    MLA_DEFER_PV as given) for the load and the switches back after: all are part of the kernel cache's key, so each
    setting is a module of its own and all can run in one process. `shape`: (block_n, stages) in place of the
    policy's for that schedule (hopper.mla_decode()), `min_rows` in place of its fewest packed rows (16 heads' 16 rows
    take the Triton kernel otherwise), experiments through the policy objects; kernel caches key on the switches, not
    on the shapes, so such a module is generated under a spec name of its own. Returns the kernel and its schedule's
    name ("serial 64x2", "overlapped 32x4", "seesaw 64x2", "serial, P V deferred 64x2")."""
    previous = (hopper.MLA_GLUON, hopper.MLA_OVERLAP, hopper.MLA_SEESAW, hopper.MLA_DEFER_PV, hopper.MLA_DECODE,
                hopper.MLA_DECODE_OVERLAP, hopper.MLA_DECODE_SEESAW)
    hopper.MLA_GLUON, hopper.MLA_OVERLAP, hopper.MLA_SEESAW, hopper.MLA_DEFER_PV = True, overlap, seesaw, defer_pv
    fields, suffix = {}, ""
    if shape is not None:
        fields.update(block_n=shape[0], stages=shape[1])
        suffix += f"_{shape[0]}x{shape[1]}"
    if min_rows is not None:
        fields.update(min_rows=min_rows)
        suffix += f"_rows{min_rows}"
    spec = SPEC
    if fields:
        hopper.MLA_DECODE, hopper.MLA_DECODE_OVERLAP, hopper.MLA_DECODE_SEESAW = (
            replace(m, **fields) for m in (hopper.MLA_DECODE, hopper.MLA_DECODE_OVERLAP, hopper.MLA_DECODE_SEESAW))
        with open(SPEC) as f:
            spec = f.read().replace("kernel mla_decode ", f"kernel mla_decode{suffix} ")
    try:
        kernel, m = attngen.load(spec), hopper.mla_decode()
    finally:
        (hopper.MLA_GLUON, hopper.MLA_OVERLAP, hopper.MLA_SEESAW, hopper.MLA_DEFER_PV, hopper.MLA_DECODE,
         hopper.MLA_DECODE_OVERLAP, hopper.MLA_DECODE_SEESAW) = previous
    if not kernel.part("kvcache").has_gluon():
        raise RuntimeError(f"{SPEC} has no Gluon MLA kernel with hopper.MLA_GLUON on: explain says why")
    name = "seesaw" if m.seesaw else "overlapped" if m.overlap else "serial, P V deferred" if m.defer_pv else "serial"
    return kernel, f"{name} {m.block_n}x{m.stages}"


def gluon_against_triton(heads: int, batch: int, seqlen: int, splits=(0, 2, 4, 8), device="cuda",
                         timer=bench_graph, overlap: bool = False, shapes=(), seesaw: bool = False,
                         defer_pv: bool = False) -> list[dict]:
    """The Gluon MLA kernel (templates/gluon_mla_decode.py.j2) at each split count of `splits` (0: the run-time
    rule) beside the Triton kernel at its default config, in one module (`load_gluon`); a config's warp_specialized
    picks the kernel. `overlap`: also the overlapped schedule's module (hopper.MLA_OVERLAP) at the same split
    counts; `shapes`: also both schedules at each (block_n, stages); `seesaw`: also the seesaw schedule's module
    (hopper.MLA_SEESAW), and at each of `shapes` (even stages); `defer_pv`: also the serial schedule with its P V
    wait deferred (hopper.MLA_DEFER_PV). Rows as `sweep`'s, each Gluon row with its module's `schedule`."""
    # calls of fewer packed rows than the policy's min_rows keep the Triton kernel: here every module takes them
    fewest = None if heads >= hopper.mla_decode().min_rows else 1
    kernel, name = load_gluon(min_rows=fewest)
    tuner, inputs, default, _ = _setup(kernel, heads, batch, seqlen, device)
    if not kernel.module.wsm_ready(inputs["q"].transpose(1, 2), inputs["k"], inputs["out"].transpose(1, 2)):
        raise RuntimeError("the Gluon MLA kernel cannot run these inputs here (wsm_ready): it needs an sm_90 GPU")
    triton = dict(default, warp_specialized=0)
    gluon = [dict(default, num_splits=s, warp_specialized=1) for s in splits]
    rows = measure(tuner, inputs, [triton], heads, triton, timer)
    others = [load_gluon(overlap=True, min_rows=fewest)] if overlap else []
    others += [load_gluon(seesaw=True, min_rows=fewest)] if seesaw else []
    others += [load_gluon(defer_pv=True, min_rows=fewest)] if defer_pv else []
    others += [load_gluon(o, shape, min_rows=fewest) for shape in shapes for o in (False, True)]
    others += [load_gluon(seesaw=True, shape=shape, min_rows=fewest) for shape in shapes] if seesaw else []
    for other, other_name in [(kernel, name)] + others:  # the same inputs through each module's launcher
        rows += measure(tunable(other.part("kvcache")), inputs, gluon, heads, triton, timer, other_name)
    return rows


def measure(tuner, inputs: dict, configs: list[dict], heads: int, default: dict, timer, schedule="") -> list[dict]:
    """Each config checked against float64 (outputs poisoned first) and timed: ms, GB/s, TFLOP/s and the error, or
    why it failed; `default` marked, and `schedule`: the Gluon MLA kernel's in the module that ran them."""
    spec, shape = tuner.spec, inputs["shape"]
    batch, seqlen = shape.batch, shape.n_k
    cache_bytes = batch * seqlen * spec.head_dim * spec.dtype.bytes  # the latent cache, read once
    flops = 2.0 * batch * heads * seqlen * (spec.head_dim + spec.head_dim_v)
    rows = []
    for config in configs:
        row = {"heads": heads, "config": config, "schedule": schedule,
               "default": all(config[k] == default.get(k) for k in config)
               and all(default[k] == config.get(k) for k in default)}
        try:
            outputs = tuner.tuning_run(inputs, config, poison=True)
            result = tuner.tuning_check(inputs, outputs)
            if not result.ok:
                raise RuntimeError(f"wrong result (rel {result.rel:.1e})")
            ms = timer(lambda: tuner.tuning_run(inputs, config))
        except Exception as e:  # noqa: BLE001 - a candidate that fails is a row, not the end of the sweep
            rows.append(dict(row, error=f"{type(e).__name__}: {str(e).strip()[:120]}"))
            continue
        rows.append(dict(row, ms=ms, gbps=cache_bytes / ms / 1e6, tflops=flops / ms / 1e9, rel=result.rel))
        print(f"  {describe(config, schedule)}: {ms:.4f} ms {rows[-1]['gbps']:.0f} GB/s", flush=True)
    return rows


def describe(config: dict, schedule: str = "") -> str:
    if config.get("warp_specialized"):  # the Gluon kernel's tiles are its own (hopper.mla_decode())
        return f"gluon MLA kernel{' ' + schedule if schedule else ''} num_splits={config['num_splits']}"
    return " ".join(f"{k}={config[k]}" for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "num_splits"))


def table(rows: list[dict]) -> str:
    ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    lines = [f"{'config':58s} {'ms':>8s} {'GB/s':>6s} {'TFLOP/s':>8s} {'rel err':>8s}"]
    lines += [f"{describe(r['config'], r['schedule']):58s} {r['ms']:8.4f} {r['gbps']:6.0f} "
              f"{r['tflops']:8.1f} {r['rel']:8.1e}" + ("  <- default" if r["default"] else "") for r in ok]
    lines += [f"{describe(r['config'], r['schedule']):58s} {r['error']}" for r in rows if "error" in r]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--wide", action="store_true", help="a larger space (several times longer)")
    parser.add_argument("--gluon", action="store_true",
                        help="the Gluon MLA kernel (hopper.MLA_GLUON) at 0, 2, 4, 8 splits against the Triton default")
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 2, 4, 8],
                        help="with --gluon: the Gluon kernel's split counts (0: the run-time rule)")
    parser.add_argument("--overlap", action="store_true",
                        help="with --gluon: also the overlapped schedule (hopper.MLA_OVERLAP) at the same split counts")
    parser.add_argument("--seesaw", action="store_true",
                        help="with --gluon: also the seesaw schedule (hopper.MLA_SEESAW) at the same split counts")
    parser.add_argument("--defer-pv", action="store_true",
                        help="with --gluon: also the serial schedule with its P V wait deferred (hopper.MLA_DEFER_PV)")
    parser.add_argument("--shapes", nargs="+", default=[], metavar="BLOCK_NxSTAGES",
                        help="with --gluon: also both schedules at these shapes (e.g. 64x2 32x4), through the policy")
    parser.add_argument("-o", "--output", default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("mla_sweep.py times kernels: it needs a CUDA GPU")
    kernel = attngen.load(SPEC)
    start, everything = time.perf_counter(), []
    print(f"{SPEC} on {torch.cuda.get_device_name()}, batch {args.batch} x {args.seqlen} tokens", flush=True)
    for heads in args.heads:
        print(f"-- {heads} heads", flush=True)
        if args.gluon:
            shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes]
            rows = gluon_against_triton(heads, args.batch, args.seqlen, tuple(args.splits), overlap=args.overlap,
                                        shapes=shapes, seesaw=args.seesaw, defer_pv=args.defer_pv)
        else:
            rows = sweep(kernel, heads, args.batch, args.seqlen, WIDE if args.wide else CANDIDATES)
        print(table(rows), flush=True)
        everything += rows
    print(f"{time.perf_counter() - start:.0f} s in all")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(everything, f, indent=1)


if __name__ == "__main__":
    main()
