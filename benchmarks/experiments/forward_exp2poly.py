"""Experiment: part of the forward's softmax exponentials on the FMA pipe (FlashAttention-4's trick).

    python benchmarks/experiments/forward_exp2poly.py OUT_DIR
    TRITON_INTERPRET=1 python benchmarks/experiments/forward_exp2poly.py --interpret-check   # CPU, no GPU

The prefill forward computes one exp2 per score on the MUFU unit, 16 results/clk/SM on Hopper: at
head_dim 64 that is the tensor cores' score rate (QK^T and PV: 256 flops per score at 4096
flops/clk/SM), so the exponentials sit on the critical path. FA4 computes some of them with a
polynomial on the FMA pipe (128 lanes/clk/SM) instead. Variants of `attn_fwd` in the module
`attngen.attention()` runs (the sdpa spec of bf16 / head dim / mask), as text rewrites (each a
candidate pass):
  base          unchanged
  poly_half     unmasked key loop: the score tile's adjacent column pairs split
                (reshape [BM, BN/2, 2] + tl.split), MUFU exp2 on the even columns, the polynomial
                on the odd ones, tl.join back
  poly_quarter  unmasked key loop: the odd columns split again into halves (reshape [BM, 2, BN/4]
                + permute + split): the polynomial on a quarter of the scores, MUFU on the rest
  poly_all      the polynomial for every score of every key loop (masked ones too): the FMA-pipe
                cost alone (and the -inf -> 0 path of masked scores)
The row rescale alpha = exp2(m_old - m_new) stays on MUFU everywhere (one per row).

The polynomial (`_exp2_poly`): x clamped to >= -127; t = x + 1.5*2^23 rounds it to the nearest
integer n, kept in t's low mantissa bits; f = x - (t - 1.5*2^23) in [-0.5, 0.5]; 2^f by a
degree-3 Horner polynomial with constant term exactly 1 (a relative-minimax fit on [-0.5, 0.5]:
3 FFMA); the result is the bits of 2^f plus (t's bits << 23), i.e. n added to the exponent (one
LEA). -inf (and anything <= -127) clamps to n = -127, f = 0, 2^f = 1.0 exactly, whose bits plus
(-127 << 23) are 0: exactly +0.0, no select needed. Accuracy (`--interpret-check`, the helper
itself run by Triton's interpreter on 1.4M points of [-130, 0] plus -inf): max relative error
1.01e-4 (2^-13.3) for x in [-125, 0] (bf16 needs well under 2^-8, fp16 2^-11); below that the
results are denormal-sized (absolute error <= 2^-127, where MUFU's ex2.approx.ftz gives 0);
-inf -> exactly 0; no negative or non-finite output.
Per polynomial score: FMNMX, 3 FADD, 3 FFMA, 1 LEA (SASS) instead of one MUFU.EX2.

Interpreter check (`--interpret-check`: d 64/128, causal or not, N_Q=200 with N_K 200 or 136,
tiles 32x32 / 64x64 / 64x32, bf16 on CPU): every variant within 1.1e-3 of the base kernel's output
(relative Frobenius), and as close to a float64 reference as the base (all ~5e-3, bf16 I/O).

sm_90a compiles (benchmarks/experiments/regs.py, triton 3.6; registers, spill-store bytes, shared
memory) of the sdpa kernels, base / poly_half / poly_quarter / poly_all:
  d=64  full   128x64 /8w/4s: 128 / 113 / 127 / 128 regs, 0 spills, 80 KB smem for all
  d=64  causal 128x64 /8w/4s: 128 / 121 / 116 / 127 regs, 0 spills, 80 KB
  d=64  full  128x128 /8w/3s: 222 / 226 / 222 / 255 regs, 0 spills, 112 KB
  d=128 full  128x128 /8w/3s: 255 / 236 / 255 / 255 regs, 0 spills, 224 KB
  d=128 causal 128x128/8w/3s: 255 (8 B spill) / 255 (0) / 255 (8 B) / 255 (0), 224 KB
  d=128 full   128x64 /8w/4s: 182 / 183 / 186 / 177 regs, 0 spills, 160 KB
No variant adds shared memory, shuffles or layout round trips: the reshape/split/join/permute
become register renamings (TTGIR keeps only register-only linear-layout conversions; the PTX's
st.shared / ld.shared / shfl counts equal base's). MUFU.EX2 per thread per unmasked block at d=64
128x64: 34 -> 18 (half), 26 (quarter), 2 (all; the row rescale's).

Cases: bf16, batch 16384/N, hidden 2048 (heads 2048/d), N = 4096 and 16384, d = 64 and 128,
causal and not; each variant with the tuned config (`kernel.config(q, k)`) and the neighbours
(128, 128, 8, 3) and (128, 64, 8, 4); do_bench median. Each variant's output is checked against
the base kernel's at the same config (relative Frobenius error, flagged "!" above 1e-2); base
against torch SDPA once per case. A variant/config that fails to compile is recorded with "error".
Writes forward_exp2poly.json; prints a table last.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_forward_variants, build_variants, load, print_forward_variants, rel_err  # noqa: E402

import attngen  # noqa: E402
from attngen.api import sdpa_spec  # noqa: E402

# Degree-3 relative-minimax fit of 2**f on [-0.5, 0.5] with the constant term fixed at 1.0.
COEFFS = (0.6932829022407532, 0.2422110140323639, 0.05500895157456398)

HELPERS = f'''

@triton.jit
def _exp2_poly(x):
    """2**x for x <= 0 on the FMA pipe (forward_exp2poly.py): -inf gives exactly 0."""
    x = tl.maximum(x, -127.0)
    t = x + 12582912.0  # 1.5 * 2**23: t's low mantissa bits hold round(x)
    f = x - (t - 12582912.0)  # in [-0.5, 0.5]
    p = (({COEFFS[2]!r} * f + {COEFFS[1]!r}) * f + {COEFFS[0]!r}) * f + 1.0
    return (p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _exp2_half(x, BM: tl.constexpr, BN: tl.constexpr):
    """exp2 of a [BM, BN] tile: MUFU on even columns, the polynomial on odd ones."""
    a, b = tl.split(tl.reshape(x, (BM, BN // 2, 2)))
    return tl.reshape(tl.join(tl.math.exp2(a), _exp2_poly(b)), (BM, BN))


@triton.jit
def _exp2_quarter(x, BM: tl.constexpr, BN: tl.constexpr):
    """exp2 of a [BM, BN] tile: the polynomial on the odd columns of the right half, MUFU elsewhere."""
    a, b = tl.split(tl.reshape(x, (BM, BN // 2, 2)))
    b0, b1 = tl.split(tl.permute(tl.reshape(b, (BM, 2, BN // 4)), (0, 2, 1)))
    b = tl.reshape(tl.permute(tl.join(tl.math.exp2(b0), _exp2_poly(b1)), (0, 2, 1)), (BM, BN // 2))
    return tl.reshape(tl.join(tl.math.exp2(a), b), (BM, BN))

'''

FULL = "p = tl.math.exp2(s * qk_scale - m_new[:, None])"
MASKED = "p = tl.math.exp2(s * qk_scale - m_use[:, None])"


def _fwd_bounds(t):
    start = t.index("def attn_fwd(")
    return start, t.index("\ndef launch_attn_fwd", start)


def _with_helpers(t):
    i = t.index("\n@triton.jit")
    return t[:i] + HELPERS + t[i:]


def _rewrite(t, full, masked=None):
    """The unmasked loop's p line of attn_fwd through `full` (and the masked loops' through `masked`)."""
    s, e = _fwd_bounds(t)
    kernel = t[s:e]
    marker = kernel.index("# full blocks: no mask")
    i = kernel.index(FULL, marker)
    kernel = kernel[:i] + full + kernel[i + len(FULL):]
    if masked is not None:
        assert MASKED in kernel, "variant does not apply: no masked loop"
        kernel = kernel.replace(MASKED, masked)
    return _with_helpers(t[:s] + kernel + t[e:])


def poly_half(t):
    return _rewrite(t, "p = _exp2_half(s * qk_scale - m_new[:, None], BLOCK_M, BLOCK_N)")


def poly_quarter(t):
    return _rewrite(t, "p = _exp2_quarter(s * qk_scale - m_new[:, None], BLOCK_M, BLOCK_N)")


def poly_all(t):
    return _rewrite(t, "p = _exp2_poly(s * qk_scale - m_new[:, None])", "p = _exp2_poly(s * qk_scale - m_use[:, None])")


VARIANTS = {"base": [], "poly_half": [poly_half], "poly_quarter": [poly_quarter], "poly_all": [poly_all]}
NEIGHBOURS = [(128, 128, 8, 3), (128, 64, 8, 4)]
TOKENS, HIDDEN, SEQ_LENS, HEAD_DIMS = 16384, 2048, (4096, 16384), (64, 128)

ACCURACY_KERNEL = '''

@triton.jit
def exp2_poly_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, _exp2_poly(tl.load(X + offs, mask=offs < N, other=0.0)), mask=offs < N)
'''


def poly_accuracy(device: str) -> dict:
    """The helper itself on [-130, 0] plus -inf: max relative error where 2**x >= 2**-125, max
    absolute error below, and what -inf gives."""
    path = "/tmp/exp2poly/exp2poly_check.py"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("import triton\nimport triton.language as tl\n" + HELPERS + ACCURACY_KERNEL)
    module = load(path, "exp2poly_check")
    x = torch.cat([torch.linspace(-130.0, 0.0, 1_300_001, dtype=torch.float64),
                   torch.linspace(-1.0, 0.0, 100_001, dtype=torch.float64),
                   torch.tensor([float("-inf"), -1e30, -127.0, -126.5, -126.0, -0.5, -1e-30, -0.0])]).float()
    xd = x.to(device)
    y = torch.empty_like(xd)
    block = 1024
    module.exp2_poly_kernel[(triton.cdiv(x.numel(), block),)](xd, y, x.numel(), BLOCK=block)
    y = y.cpu().double()
    ref = torch.exp2(x.double())
    normal = x >= -125.0
    rel = ((y - ref).abs() / ref)[normal]
    return dict(max_rel_err=rel.max().item(), max_rel_err_at=x[normal][rel.argmax()].item(),
                max_abs_err_below_m125=(y - ref).abs()[~normal].max().item(),
                neg_inf_gives=y[x == float("-inf")].tolist(), negative_outputs=int((y < 0).sum()),
                nonfinite_outputs=int((~torch.isfinite(y)).sum()))


def interpret_check():
    """Every variant against the base kernel in Triton's interpreter on CPU, at sizes that are not
    multiples of the blocks; asserts errors < 1e-2 and the polynomial's accuracy."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 in the environment"
    acc = poly_accuracy("cpu")
    print("polynomial:", acc, flush=True)
    assert acc["max_rel_err"] < 2 ** -12 and acc["neg_inf_gives"] == [0.0] and acc["negative_outputs"] == 0
    assert acc["nonfinite_outputs"] == 0 and acc["max_abs_err_below_m125"] < 2 ** -124
    worst = 0.0
    for d in (64, 128):
        for causal in (False, True):
            kernel = attngen.load(sdpa_spec("bf16", d, causal))  # also applies attngen's interpreter fixes
            modules = build_variants(kernel.source, VARIANTS, f"exp2poly_i{d}{'c' if causal else 'f'}")
            for n_q, n_k in ((200, 200), (200, 136)):
                gen = torch.Generator().manual_seed(d + causal + n_k)
                q = torch.randn(1, 2, n_q, d, generator=gen).to(torch.bfloat16)
                k, v = (torch.randn(1, 2, n_k, d, generator=gen).to(torch.bfloat16) for _ in range(2))
                scale = d ** -0.5
                s = (q.double() @ k.double().transpose(-1, -2)) * scale
                if causal:
                    s = s.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool).triu(1), float("-inf"))
                ref = torch.softmax(s, -1) @ v.double()
                for bm, bn in ((32, 32), (64, 64), (64, 32)):
                    config = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=4, num_stages=1)
                    outs = {}
                    for name, module in modules.items():
                        out = torch.full_like(q, float("nan"))
                        lse = torch.empty(q.shape[:3], dtype=torch.float32)
                        module.launch_attn_fwd(q=q, k=k, v=v, o=out, lse=lse, sm_scale=scale, **config)
                        outs[name] = out
                    errs = {name: rel_err(o, outs["base"]) for name, o in outs.items() if name != "base"}
                    exact = {name: rel_err(o, ref) for name, o in outs.items()}
                    worst = max(worst, *errs.values())
                    print(f"d={d} causal={causal} N_Q={n_q} N_K={n_k} {bm}x{bn}: vs float64 "
                          + " ".join(f"{k}={e:.2e}" for k, e in exact.items()) + "; vs base "
                          + " ".join(f"{k}={e:.2e}" for k, e in errs.items()), flush=True)
                    assert all(e < 1e-2 for e in errs.values()), errs
                    assert all(e < 1.5 * exact["base"] for e in exact.values()), exact
    print(f"interpret check passed: worst variant-vs-base error {worst:.2e}")


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    device = torch.cuda.get_device_name()
    accuracy = poly_accuracy("cuda")
    print("polynomial on cuda:", accuracy, flush=True)
    rows, cases = bench_forward_variants(VARIANTS, "exp2poly", SEQ_LENS, HEAD_DIMS, NEIGHBOURS, TOKENS, HIDDEN)
    with open(os.path.join(out_dir, "forward_exp2poly.json"), "w") as f:
        json.dump(dict(device=device, triton=triton.__version__, torch=torch.__version__, coeffs=COEFFS,
                       poly_accuracy=accuracy, cases=cases, rows=rows), f, indent=1)
    print_forward_variants(f"{device}: forward TFLOP/s, bf16, batch {TOKENS}/N, hidden {HIDDEN}", list(VARIANTS),
                           rows, cases, width=13)
    print(f"polynomial max rel err {accuracy['max_rel_err']:.2e} (x >= -125), -inf -> {accuracy['neg_inf_gives']}")


if __name__ == "__main__":
    if "--interpret-check" in sys.argv[1:]:
        interpret_check()
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
