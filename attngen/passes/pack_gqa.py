"""pack-gqa: the query heads that share a key/value head fill one tile together.

With grouped-query attention, GROUP query heads read the same K and V. One program per query head
reads every K/V byte GROUP times; in decoding, where a head has a single query row, that also
leaves the tile nearly empty. This pass makes the grid run over key/value heads (`h_kv`) and packs
the tile's rows as (query position, group member) pairs: row r is query head
`h_kv * GROUP + r % GROUP` at position `r // GROUP` (an `ir.Packed` index on Q, O and LSE), so a
program reads its K/V head once for all GROUP heads and a decode tile holds GROUP real rows. The
row count becomes N_Q * GROUP; masks and score modifiers compare keys with the row's position
(`query_group`) and read the row's head as `q_head`, and a sink logit, one per query head, becomes a
vector of the rows' own sinks.

Applies when the spec packs GQA (`pack_gqa = true`, or `auto` in a decoding spec); a no-op
otherwise.
"""

from __future__ import annotations

from dataclasses import replace

import sympy

from .. import ir
from ..ir import sym
from ..errors import InternalError
from ..ir import Assign, Load, Loop, Masked, Packed, Ref, Span, Stat
from .grid import grid_path, map_indices, rebuild

NAME = "pack-gqa"


def _pack_index(index, rows: Span):
    out, i = [], 0
    while i < len(index):
        item = index[i]
        nxt = index[i + 1] if i + 1 < len(index) else None
        if item == sym.h and isinstance(nxt, Span) and nxt.name == "offs_m":
            out.append(Packed(sym.h_kv * sym.GROUP, rows, sym.GROUP))
            i += 2
            continue
        if isinstance(item, Span) and item.name == "offs_m":
            raise InternalError(f"{NAME}: query rows indexed without their head")
        if not isinstance(item, (Span, ir.Paged)) and sympy.sympify(item) == sym.FloorDiv(sym.h, sym.GROUP):
            item = sym.h_kv
        elif not isinstance(item, (Span, ir.Paged)) and sym.h in sympy.sympify(item).free_symbols:
            raise InternalError(f"{NAME}: cannot pack an index that uses the query head as {item}")
        out.append(item)
        i += 1
    return tuple(out)


def _sink_rows(body, rows: Span, group):
    """The sink step with one logit per packed row: SINKS[h] becomes SINKS[q_head] of each row (a rank-1
    Pointwise, whose emitter defines q_head per row), and the scalar that holds it a vector of rows."""
    def is_sink(e):
        return isinstance(e, Load) and e.buffer.stat is Stat.SINK

    found = [st for st in ir.walk_stmts(body) if isinstance(st, Assign)
             and any(is_sink(e) for e in ir.walk_expr(st.value))]
    if not found:
        return body
    (st,) = found
    per_row = replace(st.target, shape=(rows.size,))

    def sink(e):
        if is_sink(e):
            # fn reads no score: the value it is applied to is a placeholder
            return ir.Pointwise(ir.Num(0.0), sympy.Function(e.buffer.name)(sym.q_head), rows, None,
                                query_group=group, tensors=(e.buffer,), score=False)
        return e

    def stmt(s):
        return Assign(per_row, ir.map_expr(s.value, sink)) if s == st else s

    return ir.map_exprs_in(ir.map_stmts(body, stmt), lambda e: Ref(per_row) if e == Ref(st.target) else e)


def applies(program: ir.Program) -> bool:
    return bool(program.attr("pack_gqa"))


def run(program: ir.Program) -> ir.Program:
    if not applies(program):
        return program
    kernel = program.kernel("attn_fwd")
    path = grid_path(kernel, NAME)
    try:
        grid_b, grid_h, grid_m = path
        assert (grid_b.var, grid_h.var, grid_m.var) == (sym.b, sym.h, sym.start_m)
    except (ValueError, AssertionError):
        raise InternalError(f"{NAME} expects a grid over (b, h, start_m)") from None
    rows = Span("offs_m", sym.start_m, sym.BLOCK_M, sym.N_Q * sym.GROUP)

    def mask(e):
        if isinstance(e, (Masked, ir.Pointwise)) and e.query.name == "offs_m":
            return replace(e, query=rows, query_group=sym.GROUP)
        return e

    body = map_indices(_sink_rows(grid_m.body, rows, sym.GROUP), lambda buffer, index: (buffer, _pack_index(index, rows)))
    body = ir.map_exprs_in(body, mask)
    grid_h = Loop(sym.h_kv, sym.ZERO, sym.H_KV, sym.ONE, (), ir.LoopKind.GRID)
    grid_m = replace(grid_m, stop=sym.N_Q * sym.GROUP, note="blocks of (query, head of the group) rows")
    kernel = replace(kernel, body=rebuild([grid_b, grid_h, grid_m], body),
                     doc="one program per (batch, key/value head, block of BLOCK_M (query, group head) rows)")
    return program.replace_kernel(kernel)
