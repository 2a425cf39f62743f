"""recompute: derive the backward kernels from the fused forward, recomputing P instead of storing it.

The forward keeps only O and the log-sum-exp (LSE) of each query row. From them and the inputs,
the gradients are, with S = Q K^T * scale and P = exp(S - LSE):

    dV = P^T dO        dP = dO V^T        dS = P * (dP - delta) * fn'(S),  delta = rowsum(dO * O)
    dQ = dS K * scale  dK = dS^T Q * scale

where P = exp(fn(S) - LSE) for a spec's score modifier fn (softcap, ALiBi, an expression; the identity
without one), and fn' = d fn / d S comes from sympy (`sympy.diff`), applied to the unmodified scaled
score as a factor (a Pointwise with score=False): no variant is special-cased. Attention sinks need
nothing here: the stored LSE already counts the sink's term, and the sink carries no value, so delta
is unchanged (the sinks' own gradient is a reduction of LSE and delta: the template's `backward`).

`lower` wrote the textbook backward (`attn_bwd`: P stored by the forward and read back, dP and dS
through HBM). This pass replaces it: it reads the forward kernel after online-softmax (its masked
score expression, scale, GQA indexing, dtypes and precision) and derives two kernels that recompute
S and P tile by tile:

  * `attn_bwd_dq`, one program per (batch, head, block of queries), like the forward. It first
    computes delta for its rows (the preprocessing step, fused here: the rows are loaded anyway)
    and saves it for the next kernel, then loops over key blocks accumulating dQ.
  * `attn_bwd_dkdv`, one program per (batch, K/V head, block of keys). It loops over the query
    heads sharing that K/V head and over query blocks, accumulating dK and dV in registers: the
    sum over a GQA group happens inside one program, so no atomics and deterministic results.

Its score tiles are transposed (keys x queries), which the mask records (`query_axis=1`); a
`query < N_Q` bound keeps the padding rows of the last query block out of the sums. Rows with no
visible key have LSE = -inf; `inf_if_empty` turns that into +inf so their P is 0, not NaN. The
causal-skip pass runs after this one and splits the backward's loops too.
"""

from __future__ import annotations

from dataclasses import replace

import sympy

from .. import ir
from ..ir import sym
from ..errors import InternalError
from ..ir import (Assign, Buffer, Call, DT, Load, Loop, LoopKind, Masked, Num, Op, Pointwise, Pred, PredKind, Ref,
                  Role, Space, Stat, Store, Sym)

NAME = "recompute"

hkv = sym.index("hkv")
g = sym.index("g")


def _forward_parts(kernel: ir.KernelIR):
    """The forward's query/key/value loads and masked score expression."""
    scores = None
    loads = {}
    for st in ir.walk_stmts(kernel.body):
        for x in ir.stmt_exprs(st):
            for e in ir.walk_expr(x):
                if isinstance(e, Load) and e.buffer.name in ("Q", "K", "V"):
                    loads.setdefault(e.buffer.name, e)
        if isinstance(st, Assign) and st.target.name == "s":
            scores = st.value
    if scores is None or set(loads) != {"Q", "K", "V"}:
        raise InternalError("recompute expects the fused forward from online-softmax (scores s, loads of Q, K, V)")
    if not isinstance(scores, Masked):
        raise InternalError("recompute expects the forward's scores to carry the key-bound mask")
    pointwise = scores.value if isinstance(scores.value, Pointwise) else None
    product = pointwise.value if pointwise is not None else scores.value
    if not (isinstance(product, Call) and product.op is Op.MUL and isinstance(product.args[0], Call)
            and product.args[0].op is Op.DOT_T and product.args[1] == Sym(sym.sm_scale)):
        raise InternalError("recompute expects scores = mask(dot_t(q, k) * sm_scale)")
    return loads, scores, pointwise, product.args[0].dtype


def _score_parts(raw: Buffer, scores: Masked, pointwise: Pointwise | None, **where):
    """(the masked score tile recomputed from the unmodified scores in `raw`, the factor fn'(raw) of dS or
    None where it is 1). `where` re-seats the forward's tile for this kernel (query_axis, query/key spans)
    and `head` the forward's query head (its q_head) where the grid differs."""
    head = where.pop("head", None)
    at = (lambda e: sympy.sympify(e).subs(sym.q_head, head)) if head is not None else sympy.sympify
    preds = tuple(replace(p, bound=at(p.bound)) if p.kind is PredKind.EXPR else p for p in scores.preds)
    if pointwise is None:
        return replace(scores, value=Ref(raw), preds=preds, **where), None
    fn = at(pointwise.fn)
    modified = replace(pointwise, value=Ref(raw), fn=fn, **where)
    slope = sympy.diff(fn, sym.S)
    factor = None if slope == 1 else replace(modified, fn=slope, score=False)
    return replace(scores, value=modified, preds=preds, **where), factor


def _times(e, factor):
    return e if factor is None else Call(Op.MUL, (e, factor))


def _like(buffer: Buffer, name: str, role: Role, dtype: DT | None = None, stat: Stat | None = None) -> Buffer:
    return Buffer(name, buffer.shape, dtype or buffer.dtype, Space.HBM, role, stat)


def _grid(loops, body):
    for var, stop, step, note in reversed(loops):
        body = (Loop(var, sym.ZERO, stop, step, body, LoopKind.GRID, note, aligned=step != 1),)
    return body


def _dq_kernel(fwd: ir.KernelIR, loads, scores, pointwise, precision, bufs) -> ir.KernelIR:
    q_buf, k_buf, v_buf, o_buf, lse_buf, do_buf, delta_buf, dq_buf = bufs
    q_load, k_load, v_load = loads["Q"], loads["K"], loads["V"]
    rows, dims = q_load.index[2], q_load.index[3]
    io = q_buf.dtype
    d = dims.size
    t = lambda name, shape, dtype=DT.F32: Buffer(name, shape, dtype, Space.REG)
    q, do = t("q", (sym.BLOCK_M, d), io), t("do", (sym.BLOCK_M, v_load.index[-1].size), io)
    lse, delta = t("lse", (sym.BLOCK_M,)), t("delta", (sym.BLOCK_M,))
    s, p, dp, ds = (t(n, (sym.BLOCK_M, sym.BLOCK_N)) for n in ("s", "p", "dp", "ds"))
    raw = t("raw", (sym.BLOCK_M, sym.BLOCK_N))
    dq = t("dq", (sym.BLOCK_M, d))
    row_index = (sym.b, sym.h, rows)
    tile_index = q_load.index
    out_index = tile_index[:-1] + v_load.index[-1:]  # O and dO: V's head dim
    f32 = lambda e: Call(Op.CAST, (e,), DT.F32)
    cast = (lambda e: e) if io is DT.F32 else (lambda e: Call(Op.CAST, (e,), io))
    qk = ir.map_expr(scores, lambda e: Ref(q) if e == q_load else e)
    if pointwise is not None:
        # The score modifier's derivative reads the unmodified score: keep it in a tile of its own.
        product = qk.value.value
        qk, factor = _score_parts(raw, qk, replace(pointwise, value=product))
        scores_first = (Assign(raw, product),)
    else:
        factor, scores_first = None, ()
    body = (
        ir.Comment("preprocessing: delta = rowsum(dO * O), saved for the dK/dV kernel"),
        Assign(do, Load(do_buf, out_index)),
        Assign(delta, Call(Op.ROWSUM, (Call(Op.MUL, (f32(Load(o_buf, out_index)), f32(Ref(do)))),))),
        Store(delta_buf, row_index, Ref(delta)),
        Assign(q, q_load),
        Assign(lse, Call(Op.INF_IF_EMPTY, (Load(lse_buf, row_index),))),
        Assign(dq, Num(0.0)),
        ir.Comment("recompute P block by block and accumulate dQ = dS K"),
        Loop(sym.start_n, sym.ZERO, sym.N_K, sym.BLOCK_N, scores_first + (
            Assign(s, qk),
            Assign(p, Call(Op.EXP, (Call(Op.SUB, (Ref(s), Ref(lse))),))),
            Assign(dp, Call(Op.DOT_T, (Ref(do), v_load), precision)),
            Assign(ds, _times(Call(Op.MUL, (Ref(p), Call(Op.SUB, (Ref(dp), Ref(delta))))), factor)),
            Assign(dq, Call(Op.DOT_ACC, (cast(Ref(ds)), k_load, Ref(dq)), precision)),
        ), LoopKind.SERIAL, "every key block", aligned=True),
        Store(dq_buf, tile_index, Call(Op.MUL, (Ref(dq), Sym(sym.sm_scale)))),
    )
    grid = _grid([(sym.b, sym.B, sym.ONE, ""), (sym.h, sym.H, sym.ONE, ""),
                  (sym.start_m, sym.N_Q, sym.BLOCK_M, "query blocks")], body)
    extra = pointwise.tensors if pointwise is not None else ()
    return ir.KernelIR("attn_bwd_dq", (q_buf, k_buf, v_buf, o_buf, do_buf, lse_buf, delta_buf, dq_buf) + extra,
                     fwd.symbols, grid, doc="dQ (and delta) for one (batch, head, block of BLOCK_M queries)")


def _dkdv_kernel(fwd: ir.KernelIR, loads, scores, pointwise, precision, bufs) -> ir.KernelIR:
    q_buf, k_buf, v_buf, do_buf, lse_buf, delta_buf, dk_buf, dv_buf = bufs
    q_load, k_load = loads["Q"], loads["K"]
    rows, cols, dims, dims_v = q_load.index[2], k_load.index[2], q_load.index[3], loads["V"].index[3]
    io = q_buf.dtype
    d, d_v = dims.size, dims_v.size
    t = lambda name, shape, dtype=DT.F32: Buffer(name, shape, dtype, Space.REG)
    k, v = t("k", (sym.BLOCK_N, d), io), t("v", (sym.BLOCK_N, d_v), io)
    q, do = t("q", (sym.BLOCK_M, d), io), t("do", (sym.BLOCK_M, d_v), io)
    lse, delta = t("lse", (sym.BLOCK_M,)), t("delta", (sym.BLOCK_M,))
    s_t, p_t, dp_t, ds_t, raw_t = (t(n, (sym.BLOCK_N, sym.BLOCK_M)) for n in ("s_t", "p_t", "dp_t", "ds_t", "raw_t"))
    dk, dv = t("dk", (sym.BLOCK_N, d)), t("dv", (sym.BLOCK_N, d_v))
    head = hkv * sym.GROUP + g
    q_index = (sym.b, head, rows, dims)
    do_index = (sym.b, head, rows, dims_v)
    row_index = (sym.b, head, rows)
    kv_index = (sym.b, hkv, cols, dims)
    v_index = (sym.b, hkv, cols, dims_v)
    cast = (lambda e: e) if io is DT.F32 else (lambda e: Call(Op.CAST, (e,), io))
    # The forward's mask, seen from the key tile: keys are rows now, queries columns; padding
    # query rows of the last block must not add to dK/dV (padding key rows are never stored).
    preds = tuple(p for p in scores.preds if p.kind is not PredKind.KEY_BOUND) + (Pred(PredKind.QUERY_BOUND, sym.N_Q),)
    # (the forward's element head q_head is this program's hkv * GROUP + g)
    product = Call(Op.MUL, (Call(Op.DOT_T, (Ref(k), Ref(q)), precision), Sym(sym.sm_scale)))
    s_value, factor = _score_parts(raw_t, replace(scores, preds=preds), pointwise, query=rows, key=cols,
                                   query_axis=1, head=head)
    if pointwise is None:
        s_value, scores_first = replace(s_value, value=product), ()
    else:
        scores_first = (Assign(raw_t, product),)
    # With a score modifier, fn'(S^T) joins P^T (pf_t) as soon as dV's product has taken P^T: the raw scores it
    # reads die there instead of living beside P^T until dP^T is in (the Gluon backward at d=128 with softcap
    # spilled 484 bytes a thread with both live, 16 without a modifier).
    if factor is None:
        ds_steps = (Assign(dp_t, Call(Op.DOT_T, (Ref(v), Ref(do)), precision)),
                    Assign(ds_t, Call(Op.MUL, (Ref(p_t), Call(Op.SUB, (Ref(dp_t), Ref(delta)))))))
    else:
        pf_t = t("pf_t", (sym.BLOCK_N, sym.BLOCK_M))
        ds_steps = (Assign(pf_t, Call(Op.MUL, (Ref(p_t), factor))),
                    Assign(dp_t, Call(Op.DOT_T, (Ref(v), Ref(do)), precision)),
                    Assign(ds_t, Call(Op.MUL, (Ref(pf_t), Call(Op.SUB, (Ref(dp_t), Ref(delta)))))))
    inner = Loop(sym.start_m, sym.ZERO, sym.N_Q, sym.BLOCK_M, (
        Assign(q, Load(q_buf, q_index)),
        Assign(do, Load(do_buf, do_index)),
        Assign(lse, Call(Op.INF_IF_EMPTY, (Load(lse_buf, row_index),))),
        Assign(delta, Load(delta_buf, row_index)),
    ) + scores_first + (
        Assign(s_t, s_value),
        Assign(p_t, Call(Op.EXP, (Call(Op.SUB, (Ref(s_t), Ref(lse))),))),
        Assign(dv, Call(Op.DOT_ACC, (cast(Ref(p_t)), Ref(do), Ref(dv)), precision)),
    ) + ds_steps + (
        Assign(dk, Call(Op.DOT_ACC, (cast(Ref(ds_t)), Ref(q), Ref(dk)), precision)),
    ), LoopKind.SERIAL, "every query block", aligned=True)
    body = (
        Assign(k, Load(k_buf, kv_index)),
        Assign(v, Load(v_buf, v_index)),
        Assign(dk, Num(0.0)),
        Assign(dv, Num(0.0)),
        ir.Comment("recompute P^T for every query head of the group and block of queries"),
        Loop(g, sym.ZERO, sym.GROUP, sym.ONE, (inner,), LoopKind.SERIAL, "query heads sharing this K/V head"),
        Store(dk_buf, kv_index, Call(Op.MUL, (Ref(dk), Sym(sym.sm_scale)))),
        Store(dv_buf, v_index, Ref(dv)),
    )
    grid = _grid([(sym.b, sym.B, sym.ONE, ""), (hkv, sym.H_KV, sym.ONE, ""),
                  (sym.start_n, sym.N_K, sym.BLOCK_N, "key blocks")], body)
    extra = pointwise.tensors if pointwise is not None else ()
    return ir.KernelIR("attn_bwd_dkdv", (q_buf, k_buf, v_buf, do_buf, lse_buf, delta_buf, dk_buf, dv_buf) + extra,
                     fwd.symbols, grid, doc="dK and dV for one (batch, K/V head, block of BLOCK_N keys)")


def applies(program: ir.Program) -> bool:
    return bool(program.attr("backward", False))


def run(program: ir.Program) -> ir.Program:
    if not applies(program):
        return program
    fwd = program.kernel("attn_fwd")
    loads, scores, pointwise, precision = _forward_parts(fwd)
    params = {p.name: p for p in fwd.params}
    q_buf, k_buf, v_buf, o_buf, lse_buf = (params[n] for n in ("Q", "K", "V", "O", "LSE"))
    do_buf = _like(o_buf, "DO", Role.INPUT)
    dq_buf = _like(q_buf, "DQ", Role.OUTPUT)
    dk_buf, dv_buf = _like(k_buf, "DK", Role.OUTPUT), _like(v_buf, "DV", Role.OUTPUT)
    delta_out = _like(lse_buf, "DELTA", Role.OUTPUT, stat=Stat.DELTA)
    delta_in = replace(delta_out, role=Role.INPUT)
    lse_in = replace(lse_buf, role=Role.INPUT)
    dq = _dq_kernel(fwd, loads, scores, pointwise, precision, (q_buf, k_buf, v_buf, replace(o_buf, role=Role.INPUT),
                                                    lse_in, do_buf, delta_out, dq_buf))
    dkdv = _dkdv_kernel(fwd, loads, scores, pointwise, precision, (q_buf, k_buf, v_buf, do_buf, lse_in, delta_in, dk_buf, dv_buf))
    kept = tuple(k for k in program.kernels if k.name != "attn_bwd")  # the naive backward goes
    return replace(program, kernels=kept + (dq, dkdv))
