"""exp2 on the FMA pipe: the exponential the Gluon FP8 forward takes for part of each key block's scores.

Hopper's exp2 unit (MUFU.EX2) makes 16 results a clock per multiprocessor, its FP32 pipe 128 FMAs: in the FP8
forward the exponentials take as long as the e4m3 products (policy/hopper.py FP8_EXP2_EMULATION). FlashAttention 4
moves part of them to the FMA pipe by Cody-Waite range reduction: 2^x = 2^j * 2^f with j = round(x) and
f = x - j in [-0.5, 0.5], 2^f by a polynomial in FMAs, and j added into the result's exponent bits. The rounding
adds and subtracts 1.5 * 2^23 (the sum's low mantissa bits are round(x), and the add is an FADD where floor would be
an FRND), and the integer j lands in the exponent by one shift and add of the sum's own bits (the constant's bits
vanish in the shift). COEFFS is the degree-3 minimax polynomial for the relative error of 2^f on [-0.5, 0.5]
(Remez, rounded to float32): at most 7.5e-5 (2^-13.7), where P is rounded next to e4m3's 3 mantissa bits (2^-4).

The softmax's arguments are at most 0 (a score less its row's running max) or -inf (a masked key): x is clamped
at -127 first (so -inf makes no NaN), and the result is 0 below x = -125.5, where 2^round(x) * 2^f would leave the
normal floats (MUFU's flush-to-zero exp2 gives 0 below -126; the half step between is 0 here, < 2^-125.5 off).
`helper(lib)` is the function's source in Gluon ("gl") or Triton ("tl"); the Gluon kernel takes the former, the
tests run the latter in Triton's interpreter against a float64 exp2.
"""

from __future__ import annotations

COEFFS = (0.9999280571937561, 0.6932609677314758, 0.2426111251115799, 0.0551716685295105)
"""2^f ~ c0 + c1 f + c2 f^2 + c3 f^3 on [-0.5, 0.5] (float32 values)."""

ROUNDER = 12582912.0
"""1.5 * 2^23: x + ROUNDER holds round(x) in its low mantissa bits for |x| < 2^22 (round to nearest even)."""

LOWEST = -127.0
"""Where x is clamped: a finite round(x) whatever x is (the select below makes the result 0)."""

SMALLEST = -125.5
"""Below this x the result is 0: from here down, round(x) = -126 with 2^f < 1 would give the exponent field 0."""


def helper(lib: str, name: str = "_exp2_fma") -> str:
    """The source of a jit function `name`(x) computing 2^x of a float32 tensor x <= 0 by FMAs, in `lib` ("gl":
    Gluon, "tl": Triton), without its decorator."""
    c0, c1, c2, c3 = COEFFS
    return f'''def {name}(x):
    """2^x of x <= 0 on the FMA pipe (codegen/exp2_fma.py): 2^round(x) * 2^f, 2^f by a degree-3 polynomial."""
    x = {lib}.maximum(x, {LOWEST})  # -inf (a masked key) too: a finite round(x), then 0
    t = x + {ROUNDER}  # 1.5 * 2^23: round(x) in the low mantissa bits
    f = x - (t - {ROUNDER})  # in [-0.5, 0.5]
    p = {lib}.fma({lib}.fma({lib}.fma(f, {c3}, {c2}), f, {c1}), f, {c0})
    # round(x) << 23 into the exponent (1.5 * 2^23's own bits shift out)
    bits = p.to({lib}.int32, bitcast=True) + (t.to({lib}.int32, bitcast=True) << 23)
    return {lib}.where(x < {SMALLEST}, 0.0, bits.to({lib}.float32, bitcast=True))'''
