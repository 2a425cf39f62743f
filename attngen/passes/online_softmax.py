"""online-softmax: fuse the three passes over key blocks into one, with no N x N scratch.

The tiled program writes score tiles to HBM, softmaxes whole rows, then reads P back to accumulate
P V. This pass replaces that with the recurrence of FlashAttention: per query row it keeps a running
max `m_i`, a running sum `l_i` of exp(s - m_i), and an accumulator `acc` of exp(s - m_i) V; when a
new key block raises the max, the old sum and accumulator are rescaled by alpha = exp(m_old - m_new).
One loop, everything in registers, and the log-sum-exp m_i + log(l_i) falls out for free.

Rows whose keys are all masked (so far, or entirely) keep m_i = -inf; `finite_or_zero` keeps
exp(-inf - -inf) out of the arithmetic, and `one_if_zero` makes such rows come out as 0 with a
log-sum-exp of -inf rather than NaN.
"""

from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..ir import sym
from ..errors import InternalError
from ..ir import Assign, Buffer, Call, DT, Loop, Masked, Num, Op, Ref, Softmax, Space, Store
from .grid import grid_path, rebuild

NAME = "online-softmax"


def _match(body):
    """The tiled program's shape inside its query-block program."""
    try:
        q_assign, s_loop, softmax, acc_init, pv_loop, o_store, lse_store = [
            s for s in body if not isinstance(s, ir.Comment)
        ]
        assert isinstance(q_assign, Assign) and isinstance(s_loop, Loop) and isinstance(softmax, Softmax)
        (s_store,) = s_loop.body
        assert isinstance(s_store, Store) and s_store.target.space is ir.Space.HBM
        (acc_update,) = pv_loop.body
        assert isinstance(acc_update, Assign) and acc_update.value.op is Op.DOT_ACC
        assert isinstance(o_store, Store) and isinstance(lse_store, Store)
    except (AssertionError, ValueError, AttributeError) as e:
        raise InternalError(f"online-softmax expects the tiled program from `tiling`: {e!r}") from None
    return q_assign, s_loop, s_store, softmax, acc_init, acc_update, o_store, lse_store


def run(program: ir.Program) -> ir.Program:
    kernel = program.kernel("attn_fwd")
    path = grid_path(kernel, "online-softmax")
    q_assign, s_loop, s_store, softmax, acc_init, acc_update, o_store, lse_store = _match(path[-1].body)

    rows = sym.BLOCK_M
    m_i = Buffer("m_i", (rows,), DT.F32, Space.REG)
    l_i = Buffer("l_i", (rows,), DT.F32, Space.REG)
    m_new = Buffer("m_new", (rows,), DT.F32, Space.REG)
    m_use = Buffer("m_use", (rows,), DT.F32, Space.REG)
    alpha = Buffer("alpha", (rows,), DT.F32, Space.REG)
    l_safe = Buffer("l_safe", (rows,), DT.F32, Space.REG)
    acc = acc_update.target
    block = (rows, sym.BLOCK_N)
    s = Buffer("s", block, DT.F32, Space.REG)
    p = Buffer("p", block, DT.F32, Space.REG)

    scores = s_store.value
    _, v_load, _ = acc_update.value.args
    io = q_assign.target.dtype
    masked = isinstance(scores, Masked)
    # exp(-inf - m) must not meet m = -inf: only rows that can be fully masked need the guard,
    # and only masked tiles can produce them (the causal-skip pass drops it from unmasked ones).
    shift = Ref(m_use) if masked else Ref(m_new)
    p_operand = Ref(p) if io is DT.F32 else Call(Op.CAST, (Ref(p),), io)
    step = [
        Assign(s, scores),
        Assign(m_new, Call(Op.MAX, (Ref(m_i), Call(Op.ROWMAX, (Ref(s),))))),
    ]
    if masked:
        step.append(Assign(m_use, Call(Op.FINITE_OR_ZERO, (Ref(m_new),))))
    step += [
        Assign(alpha, Call(Op.EXP, (Call(Op.SUB, (Ref(m_i), shift)),))),
        Assign(p, Call(Op.EXP, (Call(Op.SUB, (Ref(s), shift)),))),
        Assign(l_i, Call(Op.ADD, (Call(Op.MUL, (Ref(l_i), Ref(alpha))), Call(Op.ROWSUM, (Ref(p),))))),
        Assign(acc, Call(Op.DOT_ACC, (p_operand, v_load, Call(Op.MUL, (Ref(acc), Ref(alpha)))),
                         acc_update.value.dtype)),
        Assign(m_i, Ref(m_new)),
    ]
    loop = replace(s_loop, body=tuple(step), note="every key block")

    def stats(e):
        if e == Ref(softmax.rowmax):
            return Ref(m_i)
        if e == Ref(softmax.rowsum):
            return Ref(l_safe)
        return e

    sink = ()
    if softmax.sink is not None:
        # One more step of the recurrence, for a logit with no value: the denominator takes it, the
        # accumulator is only rescaled. A row that saw no key comes out 0, its log-sum-exp the sink's.
        sink_logit = Buffer("sink", (), DT.F32, Space.REG)
        sink = (
            ir.Comment("the sink: one logit per row that joins the denominator and carries no value"),
            Assign(sink_logit, softmax.sink),
            Assign(m_new, Call(Op.MAX, (Ref(m_i), Ref(sink_logit)))),
            Assign(m_use, Call(Op.FINITE_OR_ZERO, (Ref(m_new),))),
            Assign(alpha, Call(Op.EXP, (Call(Op.SUB, (Ref(m_i), Ref(m_use))),))),
            Assign(l_i, Call(Op.ADD, (Call(Op.MUL, (Ref(l_i), Ref(alpha))),
                                      Call(Op.EXP, (Call(Op.SUB, (Ref(sink_logit), Ref(m_use))),))))),
            Assign(acc, Call(Op.MUL, (Ref(acc), Ref(alpha)))),
            Assign(m_i, Ref(m_new)),
        )
    body = (
        q_assign,
        Assign(m_i, Num(float("-inf"))),
        Assign(l_i, Num(0.0)),
        acc_init,
        ir.Comment("one pass over key/value blocks: running max, running sum, rescaled accumulator"),
        loop,
        *sink,
        ir.Comment("epilogue: normalise; rows that saw no key give 0 and a log-sum-exp of -inf"),
        Assign(l_safe, Call(Op.ONE_IF_ZERO, (Ref(l_i),))),
        replace(o_store, value=Call(Op.DIV, (Ref(acc), Ref(l_safe)))),
        replace(lse_store, value=ir.map_expr(lse_store.value, stats)),
    )
    kernel = replace(kernel, body=rebuild(path, body))
    return program.replace_kernel(kernel)
