"""tiling: the loop nest over query blocks x key/value blocks.

Each (batch, head) program of the naive algorithm is split into one program per block of BLOCK_M
query rows (a new grid axis). Its query tile is loaded once into registers; the scores are produced
BLOCK_N keys at a time; the P V product accumulates over key/value blocks into a register
accumulator. The row softmax still needs a whole row of scores, so S and P stay in HBM, now written
tile by tile: the online-softmax pass is what removes them. Tiles overhang the sequence ends, so the
mask gains `key < N_K` and the spans their limits.
"""

from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..ir import sym
from ..errors import InternalError
from ..ir import Assign, Buffer, Call, DT, Load, Loop, LoopKind, Masked, Num, Op, Pred, PredKind, Ref, Softmax, Space, Span, Store

NAME = "tiling"


def tile_spans(program: ir.Program) -> dict[str, Span]:
    """The spans of the tiled program, by the name the naive program gave them (`offs_dv`, V's and O's head dim,
    only where the spec sets another head_dim_v)."""
    padded = program.attr("head_dim") != program.attr("head_dim_padded")
    spans = {
        "offs_m": Span("offs_m", sym.start_m, sym.BLOCK_M, sym.N_Q),
        "offs_n": Span("offs_n", sym.start_n, sym.BLOCK_N, sym.N_K),
        "offs_d": Span("offs_d", sym.ZERO, sym.HEAD_DIM_PADDED, sym.HEAD_DIM) if padded
        else Span("offs_d", sym.ZERO, sym.HEAD_DIM),
    }
    if program.attr("head_dim_v") is not None:
        padded_v = program.attr("head_dim_v") != program.attr("head_dim_v_padded")
        spans["offs_dv"] = (Span("offs_dv", sym.ZERO, sym.HEAD_DIM_V_PADDED, sym.HEAD_DIM_V) if padded_v
                            else Span("offs_dv", sym.ZERO, sym.HEAD_DIM_V))
    return spans


def value_span(program: ir.Program) -> Span:
    """The tiled span over V's and O's head dim (Q's and K's unless the spec sets another head_dim_v)."""
    spans = tile_spans(program)
    return spans.get("offs_dv", spans["offs_d"])


def _retile_index(index, spans):
    return tuple(spans[i.name] if isinstance(i, Span) else i for i in index)


def _retile(expr: ir.Expr, spans) -> ir.Expr:
    def visit(e):
        if isinstance(e, Load):
            return replace(e, index=_retile_index(e.index, spans))
        if isinstance(e, Masked):
            return replace(e, query=spans[e.query.name], key=spans[e.key.name])
        if isinstance(e, ir.Pointwise):
            return replace(e, query=spans[e.query.name], key=None if e.key is None else spans[e.key.name])
        return e

    return ir.map_expr(expr, visit)


def _match(kernel: ir.KernelIR):
    """The naive kernel's shape: grid b { grid h { S = ...; P,m,l = softmax(S); O = ...; LSE = ... } }."""
    try:
        (grid_b,) = kernel.body
        (grid_h,) = grid_b.body
        s_assign, softmax, o_store, lse_store = [s for s in grid_h.body if not isinstance(s, ir.Comment)]
        assert isinstance(s_assign, Assign) and s_assign.target.space is Space.HBM
        assert isinstance(softmax, Softmax) and softmax.scores == Ref(s_assign.target)
        assert isinstance(o_store, Store) and isinstance(lse_store, Store)
        o_value = o_store.value
        assert o_value.op is Op.DIV and o_value.args[0].op is Op.DOT
        assert o_value.args[0].args[0] == Ref(softmax.probs)
    except (AssertionError, ValueError, AttributeError, TypeError) as e:
        raise InternalError(f"tiling expects the naive forward program from `lower`: {e!r}") from None
    return grid_b, grid_h, s_assign, softmax, o_store, lse_store


def run(program: ir.Program) -> ir.Program:
    kernel = program.kernel("attn_fwd")
    grid_b, grid_h, s_assign, softmax, o_store, lse_store = _match(kernel)
    spans = tile_spans(program)
    rows, cols, dims = spans["offs_m"], spans["offs_n"], spans["offs_d"]
    # The query tile: loaded once per program, reused for every key block.
    scores = _retile(s_assign.value, spans)
    q_loads = [e for e in ir.walk_expr(scores) if isinstance(e, Load) and e.buffer.name == "Q"]
    if len(q_loads) != 1:
        raise InternalError("tiling expects exactly one load of Q in the scores")
    q_tile = Buffer("q", (sym.BLOCK_M, dims.size), q_loads[0].buffer.dtype, Space.REG)
    scores = ir.map_expr(scores, lambda e: Ref(q_tile) if e == q_loads[0] else e)
    key_bound = Pred(PredKind.KEY_BOUND, sym.N_K)
    if isinstance(scores, Masked):
        scores = replace(scores, preds=scores.preds + (key_bound,))
    else:
        scores = Masked(scores, (key_bound,), query=rows, key=cols)

    s_full = s_assign.target
    block_m_rows = Span("offs_n", sym.ZERO, sym.N_K)
    m = Buffer(softmax.rowmax.name, (sym.BLOCK_M,), DT.F32, Space.REG)
    l = Buffer(softmax.rowsum.name, (sym.BLOCK_M,), DT.F32, Space.REG)
    acc = Buffer("acc", (sym.BLOCK_M, value_span(program).size), DT.F32, Space.REG)
    dot = o_store.value.args[0]
    v_load = _retile(dot.args[1], spans)

    def key_loop(body, note):
        return Loop(sym.start_n, sym.ZERO, sym.N_K, sym.BLOCK_N, body, LoopKind.SERIAL, note, aligned=True)

    body = (
        Assign(q_tile, q_loads[0]),
        ir.Comment("pass 1: score tiles to HBM"),
        key_loop((Store(s_full, (rows, cols), scores),), "every key block"),
        ir.Comment("pass 2: row softmax of this query block, HBM to HBM"),
        Softmax(softmax.probs, m, l, Load(s_full, (rows, block_m_rows)), softmax.sink),
        ir.Comment("pass 3: accumulate P V over key blocks"),
        Assign(acc, Num(0.0)),
        key_loop((Assign(acc, Call(Op.DOT_ACC, (Load(softmax.probs, (rows, cols)), v_load, Ref(acc)), dot.dtype)),),
                 "every key block"),
        Store(o_store.target, _retile_index(o_store.index, spans), Call(Op.DIV, (Ref(acc), Ref(l)))),
        Store(lse_store.target, _retile_index(lse_store.index, spans),
              ir.map_expr(lse_store.value, lambda e: Ref(m) if e == Ref(softmax.rowmax) else
                          Ref(l) if e == Ref(softmax.rowsum) else e)),
    )
    grid_m = Loop(sym.start_m, sym.ZERO, sym.N_Q, sym.BLOCK_M, body, LoopKind.GRID, "query blocks", aligned=True)
    grid_b = replace(grid_b, body=(replace(grid_h, body=(grid_m,)),))
    padded_v = ((sym.HEAD_DIM_V_PADDED, "head dim of V and O rounded up to a power of two"),) \
        if program.attr("head_dim_v") is not None else ()
    symbols = kernel.symbols + tuple(
        ir.SymbolDecl(s, ir.SymKind.CONSTEXPR, note)
        for s, note in ((sym.HEAD_DIM_PADDED, "head dim rounded up to a power of two"),) + padded_v +
        ((sym.BLOCK_M, "query rows per program"), (sym.BLOCK_N, "keys per loop step"))
    )
    kernel = replace(kernel, body=(grid_b,), symbols=symbols,
                     doc="one program per (batch, head, block of BLOCK_M queries)")
    return program.replace_kernel(kernel)
