"""exp2: keep the softmax statistics in base 2 and fold log2(e) into the scale.

The GPU's fast exponential is exp2; exp(x) costs a multiply more. Since exp(x) = exp2(x * log2 e)
and every score (a `dot_t(...) * sm_scale`) is already multiplied by the softmax scale, the pass
multiplies the scale by log2 e once per program (`qk_scale`), turns exp/log into exp2/log2, and
converts the log-sum-exp at the HBM boundary: stored values are multiplied by ln 2 (HBM keeps the
natural log that users and other libraries expect) and loaded ones by log2 e. Other uses of the
scale (the backward's dQ = dS K * scale) are left alone: they are not in the exponent.
"""

from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..ir import sym
from ..ir import Assign, Buffer, Call, DT, Load, Num, Op, Ref, Space, Stat, Store, Sym
from .grid import grid_path, rebuild

NAME = "exp2"

_BASE2 = {Op.EXP: Op.EXP2, Op.LOG: Op.LOG2}


def _is_lse(buffer: Buffer) -> bool:
    return buffer.space is Space.HBM and buffer.stat is Stat.LSE


def _is_base2_lse(e) -> bool:
    return (isinstance(e, Call) and e.op is Op.MUL and isinstance(e.args[0], Load) and _is_lse(e.args[0].buffer)
            and e.args[1] == Num(sym.LOG2E))


def _rewrite_kernel(kernel: ir.KernelIR) -> ir.KernelIR:
    qk_scale = Buffer("qk_scale", (), DT.F32, Space.REG)

    def expr(e):
        if (isinstance(e, Call) and e.op is Op.MUL and e.args[1] == Sym(sym.sm_scale)
                and isinstance(e.args[0], Call) and e.args[0].op is Op.DOT_T):
            return replace(e, args=(e.args[0], Ref(qk_scale)))
        if isinstance(e, Call) and e.op in _BASE2:
            return replace(e, op=_BASE2[e.op])
        if isinstance(e, Load) and (_is_lse(e.buffer) or e.buffer.stat is Stat.SINK):
            return Call(Op.MUL, (e, Num(sym.LOG2E)))
        if isinstance(e, ir.Pointwise):
            # Its argument is now a base-2 score (s * log2 e): fn reads it back in base e, and a score it
            # returns goes to base 2 as well.
            fn = e.fn.subs(sym.S, sym.S * sym.LN2)
            return replace(e, fn=fn * sym.LOG2E if e.score else fn)
        if isinstance(e, Call) and e.op is Op.INF_IF_EMPTY and _is_base2_lse(e.args[0]):
            # +-inf survive the change of base: convert after the guard, once.
            return Call(Op.MUL, (replace(e, args=(e.args[0].args[0],)), Num(sym.LOG2E)))
        return e

    def stmt(st):
        if isinstance(st, Store) and _is_lse(st.target):
            return replace(st, value=Call(Op.MUL, (st.value, Num(sym.LN2))))
        return st

    body = ir.map_stmts(ir.map_exprs_in(kernel.body, expr), stmt)
    uses_scale = any(
        isinstance(e, Ref) and e.buffer == qk_scale
        for st in ir.walk_stmts(body) for x in ir.stmt_exprs(st) for e in ir.walk_expr(x)
    )
    kernel = replace(kernel, body=body)
    if not uses_scale:
        return kernel
    # Define qk_scale once, at the top of the innermost grid level.
    path = grid_path(kernel, "exp2")
    inner = (Assign(qk_scale, Call(Op.MUL, (Sym(sym.sm_scale), Num(sym.LOG2E)))),) + path[-1].body
    return replace(kernel, body=rebuild(path, inner))


def run(program: ir.Program) -> ir.Program:
    return replace(program, kernels=tuple(_rewrite_kernel(k) for k in program.kernels))
