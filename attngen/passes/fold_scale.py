"""fold-scale: multiply scores by the scale where they are consumed, so it fuses into an FMA.

After exp2, a score tile is `s = dot_t(q, k) * qk_scale` and is used as `rowmax(s)` and as
`exp2(s - m)`. Keeping `s` unscaled and writing the uses as `rowmax(s) * qk_scale` (a row vector,
not a tile) and `exp2(s * qk_scale - m)` turns a tile multiply plus a tile subtract into one
fused multiply-add per score, the scaling trick of the Triton tutorial kernel. It holds because
qk_scale > 0: max(c*x) = c*max(x), and -inf * c = -inf for masked scores.

Measured on an H200 (benchmarks/NOTES.md, v1): +2 to 4% forward TFLOP/s at d=128.
"""

from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..errors import InternalError
from ..ir import Assign, Buffer, Call, Loop, Masked, Op, Ref

NAME = "fold-scale"


def _scale_of(value):
    """(unscaled value, scale) if `value` is `x * qk_scale`, possibly under a mask; else None."""
    inner = value.value if isinstance(value, Masked) else value
    if (isinstance(inner, Call) and inner.op is Op.MUL and isinstance(inner.args[1], Ref)
            and inner.args[1].buffer.name == "qk_scale" and isinstance(inner.args[0], Call)
            and inner.args[0].op is Op.DOT_T):
        unscaled = inner.args[0]
        return (replace(value, value=unscaled) if isinstance(value, Masked) else unscaled), inner.args[1]
    return None


def _pointwise_reads(body: tuple) -> set[Buffer]:
    """The tiles a pointwise function reads: it takes them as scaled scores, so they keep their scale."""
    return {e.value.buffer for st in ir.walk_stmts(body) for x in ir.stmt_exprs(st) for e in ir.walk_expr(x)
            if isinstance(e, ir.Pointwise) and isinstance(e.value, Ref)}


def _fold_body(body: tuple) -> tuple:
    out = []
    scaled: dict[Buffer, Ref] = {}
    kept = _pointwise_reads(body)
    for st in body:
        if isinstance(st, Loop):
            out.append(replace(st, body=_fold_body(st.body)))
            continue
        if scaled and isinstance(st, (Assign, ir.Store)):
            st = replace(st, value=_rewrite_uses(st.value, scaled))
        if isinstance(st, Assign):
            found = None if st.target in kept else _scale_of(st.value)
            if found is not None:
                st = replace(st, value=found[0])
                scaled[st.target] = found[1]
            else:
                scaled.pop(st.target, None)
        out.append(st)
    return tuple(out)


def _rewrite_uses(expr, scaled: dict):
    def visit(e):
        if isinstance(e, Call) and e.op is Op.ROWMAX and isinstance(e.args[0], Ref) and e.args[0].buffer in scaled:
            return Call(Op.MUL, (e, scaled[e.args[0].buffer]))
        if isinstance(e, Call) and e.op is Op.SUB and isinstance(e.args[0], Ref) and e.args[0].buffer in scaled:
            return replace(e, args=(Call(Op.MUL, (e.args[0], scaled[e.args[0].buffer])), e.args[1]))
        return e

    # Uses other than rowmax(s) and s - m would see the unscaled tile: refuse rather than miscompute.
    rewritten = ir.map_expr(expr, visit)
    for node in ir.walk_expr(rewritten):
        if isinstance(node, Call) and node.op not in (Op.ROWMAX, Op.SUB, Op.MUL):
            for arg in node.args:
                if isinstance(arg, Ref) and arg.buffer in scaled:
                    raise InternalError(f"fold-scale: {arg.buffer.name} is used by {node.op.value}")
    return rewritten


def run(program: ir.Program) -> ir.Program:
    return replace(program, kernels=tuple(replace(k, body=_fold_body(k.body)) for k in program.kernels))
