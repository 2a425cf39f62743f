"""Experiment: the Gluon forward's consumers issue the next tile's first product before storing a tile's output (XTILE).

    python benchmarks/experiments/gluon_xtile.py --base BASE_DIR   (before the patch: writes the shipped modules)
    git apply benchmarks/experiments/gluon_xtile.patch              (the change measured; not adopted, NOTES v23)
    python benchmarks/experiments/gluon_xtile.py OUT_DIR [BASE_DIR]   (GPU)

(BASE_DIR: the shipped modules <spec name>_committed.py, timed as a third variant "committed"; x0 is the
patched template with XTILE off, x1 with it on.)

On the persistent grid (NOTES v22) a consumer warpgroup still ends each tile in series: its last P V
product, waited for; the output normalised, written to shared memory and stored; then the next tile's
first Q K^T, waited for, and its softmax. The tensor cores of that warpgroup idle through the store
and the first softmax. The bench's d=128 rows without a mask lose ~3% from N=16384 (128 key blocks a
tile) to 4096 (32) and ~19% to 512 (4), about one key block's time per tile. With XTILE, once the last
P V is issued the consumer waits for the next tile's Q and first K block (the loader has them by
then), issues its Q K^T, and only then waits for P V and stores the output: the store runs beside the
next product. Prediction: d=128 N=4096 +1-2%, 512-1024 +4-10%, 16384 within 1%; d=64 alike if its
extra registers do not spill more.
Cases: bf16, batch 16384/N, hidden 2048; variants timed in alternating order (3 rounds, do_bench
medians, best round kept), outputs poisoned with NaN and checked against the base's; cuDNN in the
same rounds.
Result (results/h200_gluon_xtile_v23.json, h100_gluon_xtile_v23.json): x1 gives wrong outputs (relative
error 0.25-0.53) wherever a program takes more than one tile, also with the store moved before the next
product (no overlap at all), so the fault is in the hand-over of the scores, not in the overlap; every
tile of an odd round is wrong, tiles of even rounds are right. Not found. And x0, the same algorithm as
shipped with the hand-over's control flow in place but never taken, already runs 5-9% below the shipped
kernel at N=512-1024 (H200 d=128 full 512: 484 against 521) and within 2% from 4096: the restructured
consumer costs more at short N than the overlap could win. Not adopted; the template is unchanged.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import error_text, gluon_variant_module, load, prefill_case, rel_err  # noqa: E402

CASES = [(d, causal, n) for d in (128, 64) for causal in (False, True) for n in (512, 1024, 2048, 4096, 16384)]


def write_base(base_dir: str) -> int:
    """The shipped modules of the four sdpa specs as <name>_committed.py (no GPU needed)."""
    from attngen.api import sdpa_spec
    from attngen.codegen import render
    from attngen.passes import compile_program

    os.makedirs(base_dir, exist_ok=True)
    for d in (128, 64):
        for causal in (False, True):
            spec = sdpa_spec("bf16", d, causal)
            with open(os.path.join(base_dir, f"{spec.name}_committed.py"), "w") as f:
                f.write(render(spec, compile_program(spec)))
    return 0


def main() -> int:
    if sys.argv[1] == "--base":
        return write_base(sys.argv[2])
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen
    from attngen.api import sdpa_spec

    out_dir = sys.argv[1]
    base_dir = sys.argv[2] if len(sys.argv) > 2 else None
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for d, causal, n in CASES:
        if d == 64 and n < (1024 if not causal else 4096):
            continue  # the Triton kernel runs these (MIN_KEYS)
        spec = attngen.load(sdpa_spec("bf16", d, causal)).spec
        mods = {"x0": gluon_variant_module(spec, "x0", {"XTILE": False}, "xtile"),
                "x1": gluon_variant_module(spec, "x1", {"XTILE": True}, "xtile")}
        if base_dir:
            mods = {"committed": load(os.path.join(base_dir, f"{spec.name}_committed.py"), f"{spec.name}_committed"), **mods}
        q, k, v, out, lse, scale, flops = prefill_case(d, causal, n)
        ref = None
        fns = {}
        row = dict(head_dim=d, causal=causal, n=n)
        for name, m in mods.items():
            try:
                out.fill_(float("nan"))
                lse.fill_(float("nan"))
                m.launch_attn_fwd_ws(q, k, v, out, lse, scale)
                torch.cuda.synchronize()
                ref = out.clone() if ref is None else ref
                row[f"{name} err"] = rel_err(out, ref)
                row[f"{name} nan"] = bool(out.isnan().any().item() or lse.isnan().any().item())
                fns[name] = lambda m=m: m.launch_attn_fwd_ws(q, k, v, out, lse, scale)
            except Exception as e:  # noqa: BLE001
                row[f"{name} error"] = error_text(e)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

        fns["cudnn"] = cudnn
        times = {name: [] for name in fns}
        for rnd in range(3):
            order = list(fns) if rnd % 2 == 0 else list(fns)[::-1]
            for name in order:
                times[name].append(triton.testing.do_bench(fns[name], warmup=25, rep=150, return_mode="median"))
        for name, ts in times.items():
            row[name] = flops / min(ts) / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(out_dir, "gluon_xtile.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)

    names = [x for x in ("committed", "x0", "x1", "cudnn") if any(x in r for r in rows)]
    print(f"\n{torch.cuda.get_device_name()}: Gluon forward, XTILE off / on, TFLOP/s (best of 3 alternating rounds)")
    print(f"{'d':>4} {'mask':>6} {'N':>6} " + " ".join(f"{x:>9}" for x in names) + "   x1/base  x1/cudnn  errs")
    for r in rows:
        base = r.get("committed", r.get("x0", float("nan")))
        errs = " ".join(f"{k}" for k in r if (k.endswith("err") and r[k] > 1e-2) or (k.endswith("nan") and r[k]) or k.endswith("error"))
        print(f"{r['head_dim']:>4} {'causal' if r['causal'] else 'full':>6} {r['n']:>6} "
              + " ".join(f"{r.get(x, float('nan')):9.0f}" for x in names)
              + f"   {r.get('x1', float('nan')) / base:7.3f}  {r.get('x1', float('nan')) / r['cudnn']:7.3f}  {errs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
