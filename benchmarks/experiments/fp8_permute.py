"""The FP8 Gluon forward with P's operand relabelled (policy hopper.FP8_PERMUTE_P), made early (FP8_EARLY_P) and
beside its product ("permuted", the policy's), against it without, the Triton FP8 kernel and the bf16 Gluon forward, in one process (issue 52: FP8 at 1.5x the bf16 forward at d=128, N >= 4096).
B x 16 heads x N = 32k tokens, d=128, no mask and causal, TFLOP/s by triton.testing.do_bench (median) of each
module's `forward` (V given with its head dim contiguous: the permuted module copies it in the call, the others take
it keys-contiguous, copied beforehand); also the permuted copy of V alone, and each FP8 row's largest difference from
the Triton FP8 kernel's output.

    python benchmarks/experiments/fp8_permute.py [--lengths 4096,16384] [--head-dim 64] [--alternatives]

Each setting sets the policy objects before its module is generated, under a spec name of its own, in a fresh
ATTNGEN_CACHE_DIR (an experiment's way: CONVENTIONS.md).
"""

import argparse
import os
import tempfile

os.environ["ATTNGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="attngen-fp8perm-")

import torch  # noqa: E402
import triton  # noqa: E402

import attngen  # noqa: E402
from attngen.policy import hopper  # noqa: E402

D, H, TOKENS = 128, 16, 32768
SETTINGS = {"bf16": ("bf16", {}), "triton": ("fp8_e4m3", {"FP8_GLUON": False}),
            "gluon": ("fp8_e4m3", {"FP8_GLUON": True, "FP8_HEAD_DIMS": (64, 128), "FP8_PERMUTE_P": False,
                                  "FP8_EARLY_P": True}),
            "perm_early": ("fp8_e4m3", {"FP8_GLUON": True, "FP8_HEAD_DIMS": (64, 128), "FP8_PERMUTE_P": True,
                                       "FP8_EARLY_P": True}),
            "permuted": ("fp8_e4m3", {"FP8_GLUON": True, "FP8_HEAD_DIMS": (64, 128), "FP8_PERMUTE_P": True,
                                     "FP8_EARLY_P": False})}
# the alternatives on top of "permuted" (--alternatives): FP8_FORWARD_ALTERNATIVES' shapes at d=128, and the forward's
# flags: one program a tile instead of the persistent grid, and with it the consumers taking turns (pingpong: TRIM off,
# its turns assume every warpgroup takes every block; the persistent grid's turns count one tile's blocks)
from dataclasses import replace as _replace  # noqa: E402

ALTERNATIVES = {f"perm_{name}": {"FP8_FORWARD": {**hopper.FP8_FORWARD, 128: shape}}
                for name, shape in hopper.FP8_FORWARD_ALTERNATIVES.items()}
ALTERNATIVES.update({
    "perm_launch": {"FORWARD_FLAGS": _replace(hopper.FORWARD_FLAGS, persistent=False)},
    "perm_pingpong": {"FORWARD_FLAGS": _replace(hopper.FORWARD_FLAGS, persistent=False, pingpong=True, trim=False)},
    "perm_pingpong_s2": {"FORWARD_FLAGS": _replace(hopper.FORWARD_FLAGS, persistent=False, pingpong=True, trim=False),
                         "FP8_FORWARD": {**hopper.FP8_FORWARD, 128: hopper.FP8_FORWARD_ALTERNATIVES["stages2"]}}})


def module_for(setting: str, causal: bool):
    dtype, values = SETTINGS[setting]
    saved = {name: getattr(hopper, name) for name in values}
    try:
        for name, value in values.items():
            setattr(hopper, name, value)
        mask = "causal" if causal else "none"
        return attngen.load(f"kernel fp8perm_{setting}_{mask}_{D} {{\n    direction = forward\n    mask = {mask}\n"
                            f"    head_dim = {D}\n    dtype = {dtype}\n}}\n").module
    finally:
        for name, value in saved.items():
            setattr(hopper, name, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--alternatives", action="store_true", help="also the policy's alternatives (d=128)")
    args = parser.parse_args()
    if args.alternatives:
        for name, values in ALTERNATIVES.items():
            SETTINGS[name] = ("fp8_e4m3", {**SETTINGS["permuted"][1], **values})
    global D
    D = args.head_dim
    gen = torch.Generator("cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; d={D}, {H} heads, B x N = {TOKENS} tokens; TFLOP/s (x bf16; max |out - "
          "triton fp8|)")
    for causal in (False, True):
        for n in (int(x) for x in args.lengths.split(",")):
            b = max(1, TOKENS // n)
            q, k, v = (torch.randn(b, H, n, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
            (q8, qd), (k8, kd), (v8, vd) = (attngen.quantize_fp8(t, "head") for t in (q, k, v))
            v8t = v8.transpose(-1, -2).contiguous().transpose(-1, -2)
            fp8 = dict(q_descale=qd, k_descale=kd, v_descale=vd)
            flops = 4 * b * H * n * n * D / (2 if causal else 1)
            reference, _ = module_for("triton", causal).forward(q8, k8, v8t, **fp8)
            cells, base = [], None
            for setting in SETTINGS:
                module = module_for(setting, causal)
                if setting == "bf16":
                    call = lambda: module.forward(q, k, v)  # noqa: E731
                elif setting.startswith("perm"):
                    assert module.ws_ready(q8, k8, v8, torch.empty_like(q))
                    call = lambda: module.forward(q8, k8, v8, **fp8)  # noqa: E731
                else:
                    call = lambda: module.forward(q8, k8, v8t, **fp8)  # noqa: E731
                out, _ = call()
                ms = triton.testing.do_bench(call, warmup=50, rep=300)
                tflops = flops / ms / 1e9
                base = tflops if setting == "bf16" else base
                err = "" if setting == "bf16" else f" {(out.float() - reference.float()).abs().max().item():.1e}"
                cells.append(f"{setting} {tflops:.0f}" + ("" if setting == "bf16" else f" x{tflops / base:.2f}") + err)
                if setting == "permuted":
                    copy_ms = triton.testing.do_bench(lambda: module.fp8_vt(v8, permute=True), warmup=50, rep=300)
                    cells.append(f"V copy {copy_ms * 1e3:.0f} us ({100 * copy_ms / ms:.1f}%)")
            print(f"N={n:>5} B={b:>2} {'causal' if causal else 'none  '}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
