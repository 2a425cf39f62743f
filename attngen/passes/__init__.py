"""The lowering pipeline, in order. `compile_program` runs it; `attngen explain` prints each stage.

    lower           spec -> the textbook three-pass algorithm (N x N scores in HBM)
    tiling          query-block grid x key-block loops; S and P still go through HBM
    online-softmax  one pass with running max / sum / rescaled accumulator; no N x N scratch
    recompute       (forward+backward specs) dQ and dK/dV kernels that recompute P from the LSE
    exp2            softmax statistics in base 2, log2(e) folded into the scale
    fold-scale      scores kept unscaled; the scale applied where they are consumed (one FMA)
    causal-skip     split key loops into masked and mask-free ranges; skip dead blocks

Every pass but `lower` is a pure function Program -> Program in its own module, with a NAME.
"""

from __future__ import annotations

from typing import Callable

from .. import ir
from ..spec import Spec
from . import causal_skip, exp2, fold_scale, lower, online_softmax, recompute, tiling

PIPELINE = (tiling, online_softmax, recompute, exp2, fold_scale, causal_skip)
"""The passes after `lower`, in order."""

PASS_NAMES = (lower.NAME,) + tuple(p.NAME for p in PIPELINE)


def compile_program(spec: Spec, trace: Callable[[str, ir.Program], None] | None = None,
                    verify: bool = True) -> ir.Program:
    """Lower a spec through every pass; `trace(name, program)` sees the program after each one."""
    from ..verify import verify as check

    program = lower.run(spec)
    if verify:
        check(program, lower.NAME)
    if trace:
        trace(lower.NAME, program)
    for p in PIPELINE:
        program = p.run(program)
        if verify:
            check(program, p.NAME)
        if trace:
            trace(p.NAME, program)
    return program
