"""mixed: a serving step's decodes as narrow, split-KV work items beside the prefills' wide tiles.

A paged varlen batch mixes chunked prefills (many queries) with decodes (one query, or a few under speculative
decoding) over caches of up to ~32k keys. In the wide kernel a decode takes a BLOCK_M = 128 tile of which one row is
real and walks its whole cache in one program: compute-bound and unsplit. This pass adds, beside `attn_fwd`:

  * `attn_fwd_short`: one program per (sequence, split, K/V head) whose tile is BLOCK_M rows (16: the narrowest
    `tl.dot`) of (query, head of the GQA group) pairs, as pack-gqa packs a decode's, for the sequences whose
    queries times GROUP fit in it; the program reduces its split's slice of the keys (split-kv's slices, so a
    window's splits share the keys it keeps) into O_PART / LSE_PART (B, NUM_SPLITS, H_KV, BLOCK_M, ...) in
    float32. A longer sequence's programs see n_q = n_k = 0 and store nothing;
  * `attn_combine_short`: one program per (sequence, K/V head) that merges the splits by log-sum-exp, one split at
    a time, into the packed O and LSE rows of the short sequences;
  * in `attn_fwd`, a constexpr SHORT_Q (BLOCK_M // GROUP at a mixed launch): a tile of a sequence of at most SHORT_Q
    queries returns at once (the narrow kernels have it). SHORT_Q = 0 is the wide kernel alone, as before.

The host decides the narrow BLOCK_M and NUM_SPLITS from shapes and lengths it holds (the policy,
attngen/policy/mixed.py), so nothing is read back from the GPU. Applies to paged varlen specs; a no-op otherwise.
"""

from __future__ import annotations

from dataclasses import replace

import sympy

from .. import ir
from ..errors import InternalError
from ..ir import sym
from ..ir import Assign, Buffer, Call, DT, Load, Loop, LoopKind, Op, Packed, Ragged, Ref, Role, SequenceTile, Space
from ..ir import Span, Store, Sym
from .grid import grid_path, map_indices
from .pack_gqa import _sink_rows
from .split_kv import _sink_once, _split_range, merge_splits
from .tiling import value_span

NAME = "mixed"


def applies(program: ir.Program) -> bool:
    return bool(program.attr("varlen")) and program.attr("page_size") is not None \
        and not program.attr("backward", False)


def _scalar(symbol) -> Buffer:
    return Buffer(str(symbol), (), DT.I32, Space.REG)


def _short(value, n_q_all) -> sympy.Expr:
    """`value` for a short sequence (1 query or more, its GROUP heads' rows within BLOCK_M), 0 for any other."""
    return sympy.Piecewise((value, sympy.And(n_q_all * sym.GROUP <= sym.BLOCK_M, n_q_all > 0)), (0, True))


# A narrow tile's rows: (query, head of the GQA group) pairs, row r query r // GROUP of head h_kv * GROUP + r % GROUP.
_ROWS = Span("offs_m", sym.ZERO, sym.BLOCK_M, sym.n_q * sym.GROUP)


def _packed_rows(first) -> Packed:
    """The (position, head) dimensions of a packed varlen tensor (TOTAL_Q, H, ...) at a narrow tile's rows."""
    return Packed(sym.h_kv * sym.GROUP, _ROWS, sym.GROUP, first=first, rows_first=True)


def run(program: ir.Program) -> ir.Program:
    if not applies(program):
        return program
    wide = program.kernel("attn_fwd")
    h_grid, tiles = grid_path(wide, NAME)
    locate, *body = tiles.body
    if not isinstance(locate, SequenceTile) or locate.start != sym.start_m:
        raise InternalError(f"{NAME}: attn_fwd's tiles do not start by finding their sequence (run varlen first)")
    params = {p.name: p for p in wide.params}
    o, lse = params["O"], params["LSE"]
    o_part = Buffer("O_PART", (sym.B, sym.NUM_SPLITS, sym.H_KV, sym.BLOCK_M, o.shape[-1]), DT.F32, Space.HBM,
                    Role.OUTPUT, o.stat)
    lse_part = Buffer("LSE_PART", (sym.B, sym.NUM_SPLITS, sym.H_KV, sym.BLOCK_M), DT.F32, Space.HBM, Role.OUTPUT,
                      lse.stat)
    skip = replace(locate, count=sympy.Piecewise((0, sym.n_q <= sym.SHORT_Q), (locate.count, True)))
    short_q = ir.SymbolDecl(sym.SHORT_Q, ir.SymKind.CONSTEXPR, "queries of the longest narrow work item (0: none)")
    wide = replace(wide, body=(replace(h_grid, body=(replace(tiles, body=(skip, *body)),)),),
                   symbols=wide.symbols + (short_q,))
    narrow = _narrow_kernel(wide, locate, tuple(body), o_part, lse_part)
    combine = _combine_kernel(program, locate, o, lse, o_part, lse_part)
    kernels = tuple(k for kernel in program.kernels
                    for k in ((wide, narrow, combine) if kernel.name == "attn_fwd" else (kernel,)))
    return replace(program, kernels=kernels).with_attrs(mixed=True)


def _short_facts(locate: SequenceTile) -> tuple:
    """The sequence's facts with n_q and n_k those of a short sequence (0 for a long one)."""
    renamed = {"n_q": sym.n_q_all, "n_k": sym.n_k_all}
    facts = tuple(replace(f, target=_scalar(renamed[f.target.name])) if f.target.name in renamed else f
                  for f in locate.facts)
    if {f.target.name for f in facts} & {"n_q", "n_k"}:
        raise InternalError(f"{NAME}: a fact of the sequence is not renamed")
    return facts + (Assign(_scalar(sym.n_q), Sym(_short(sym.n_q_all, sym.n_q_all))),
                    Assign(_scalar(sym.n_k), Sym(_short(sym.n_k_all, sym.n_q_all))))


def _narrow_kernel(wide: ir.KernelIR, locate: SequenceTile, body: tuple, o_part: Buffer, lse_part: Buffer):
    """attn_fwd_short: the wide tile's body for one BLOCK_M tile at row 0 whose rows are the queries of a GQA group's
    heads (as pack-gqa packs a decode's), over one split of the keys."""
    body = _sink_once(_split_range(ir.subs_stmts(body, {sym.start_m: sym.ZERO})))
    body = _sink_rows(body, _ROWS, sym.GROUP)

    def packed(buffer: Buffer, index):
        if buffer.name == "Q":
            rows, head, dims = index
            _query_rows(rows, head, buffer)
            return buffer, (_packed_rows(rows.first), dims)
        if buffer.name == "O":
            rows, head, dims = index
            _query_rows(rows, head, buffer)
            return o_part, (sym.b, sym.split, sym.h_kv, _ROWS, dims)
        if buffer.name == "LSE":
            head, rows = index
            _query_rows(rows, head, buffer)
            return lse_part, (sym.b, sym.split, sym.h_kv, _ROWS)
        return buffer, tuple(_kv_head(i, buffer) for i in index)

    def rows_of_the_group(e):
        if isinstance(e, (ir.Masked, ir.Pointwise)) and e.query.name == "offs_m":
            return replace(e, query=_ROWS, query_group=sym.GROUP)
        return e

    body = ir.map_exprs_in(map_indices(body, packed), rows_of_the_group)
    nest = Loop(sym.split, sym.ZERO, sym.NUM_SPLITS, sym.ONE, (
        Loop(sym.b, sym.ZERO, sym.B, sym.ONE, (
            Loop(sym.h_kv, sym.ZERO, sym.H_KV, sym.ONE, _short_facts(locate) + body, LoopKind.GRID, "K/V heads"),
        ), LoopKind.GRID, "sequences"),
    ), LoopKind.GRID, "key/value splits")
    params = tuple({"O": o_part, "LSE": lse_part}.get(p.name, p) for p in wide.params)
    symbols = tuple(d for d in wide.symbols if d.symbol != sym.SHORT_Q) + (
        ir.SymbolDecl(sym.NUM_SPLITS, ir.SymKind.SIZE, "key/value splits", specialize=False),)
    return ir.KernelIR("attn_fwd_short", params, symbols, (nest,),
                       doc="one program per (short sequence, split, K/V head): a narrow tile of BLOCK_M (query, group "
                           "head) rows over one slice of the sequence's keys, partial outputs")


def _query_rows(rows, head, buffer: Buffer) -> None:
    if not isinstance(rows, Ragged) or head != sym.h:
        raise InternalError(f"{NAME}: {buffer.name} is indexed by {rows} and {head}, not a sequence's rows and h")


def _kv_head(item, buffer: Buffer):
    """A key-side index's head: h // GROUP is the program's K/V head."""
    if isinstance(item, (Span, ir.Paged, Ragged)):
        return item
    if sympy.sympify(item) == sym.FloorDiv(sym.h, sym.GROUP):
        return sym.h_kv
    if sym.h in sympy.sympify(item).free_symbols:
        raise InternalError(f"{NAME}: {buffer.name} is indexed by the query head as {item}")
    return item


def _combine_kernel(program: ir.Program, locate: SequenceTile, o: Buffer, lse: Buffer, o_part: Buffer,
                    lse_part: Buffer) -> ir.KernelIR:
    """attn_combine_short: a short sequence's rows of O and LSE from its splits, merged one split at a time
    (running max, rescaled sum and accumulator, as key blocks merge in the forward); a row no split saw a key of
    gives 0 and -inf."""
    dims = value_span(program)
    rows = _ROWS
    vector = lambda name: Buffer(name, (sym.BLOCK_M,), DT.F32, Space.REG)  # noqa: E731
    m_run, m_new, m_use, alpha, l_run, l_safe, lse_s, weight = (
        vector(n) for n in ("m_run", "m_new", "m_use", "alpha", "l_run", "l_safe", "lse_s", "weight"))
    acc = Buffer("acc", (sym.BLOCK_M, dims.size), DT.F32, Space.REG)
    lse_load = Load(replace(lse_part, role=Role.INPUT), (sym.b, sym.split, sym.h_kv, rows), fill=float("-inf"))
    o_load = Load(replace(o_part, role=Role.INPUT), (sym.b, sym.split, sym.h_kv, rows, dims))

    cu_q = locate.offsets
    facts = (Assign(_scalar(sym.q_start), Load(cu_q, (sym.b,))),
             Assign(_scalar(sym.n_q_all), Call(Op.SUB, (Load(cu_q, (sym.b + 1,)), Ref(_scalar(sym.q_start))))),
             Assign(_scalar(sym.n_q), Sym(_short(sym.n_q_all, sym.n_q_all))))
    merge, out, log_sum_exp = merge_splits(lse_load, o_load, (lse_s, weight), (m_run, m_new, m_use, alpha, l_run, acc),
                                           l_safe, step=sym.ONE, chunk=False)
    lse_rows = Packed(sym.h_kv * sym.GROUP, rows, sym.GROUP, first=sym.q_start)  # LSE is (H, TOTAL_Q)
    body = facts + merge + (Store(o, (_packed_rows(sym.q_start), dims), out), Store(lse, (lse_rows,), log_sum_exp))
    nest = Loop(sym.h_kv, sym.ZERO, sym.H_KV, sym.ONE, (
        Loop(sym.b, sym.ZERO, sym.B, sym.ONE, body, LoopKind.GRID, "sequences"),
    ), LoopKind.GRID)
    value_dims = tuple(d for d in program.kernel("attn_fwd").symbols
                       if d.symbol in (sym.HEAD_DIM, sym.HEAD_DIM_PADDED, sym.HEAD_DIM_V, sym.HEAD_DIM_V_PADDED))
    group = next(d for d in program.kernel("attn_fwd").symbols if d.symbol == sym.GROUP)
    symbols = (
        ir.SymbolDecl(sym.B, ir.SymKind.SIZE, "sequences", specialize=False),
        ir.SymbolDecl(sym.H, ir.SymKind.SIZE, "query heads"),
        ir.SymbolDecl(sym.H_KV, ir.SymKind.SIZE, "key/value heads"),
        group,
        ir.SymbolDecl(sym.NUM_SPLITS, ir.SymKind.SIZE, "key/value splits", specialize=False),
        ir.SymbolDecl(sym.TOTAL_Q, ir.SymKind.SIZE, "query rows of all sequences", specialize=False),
    ) + value_dims + (ir.SymbolDecl(sym.BLOCK_M, ir.SymKind.CONSTEXPR, "rows of a narrow work item"),)
    params = (replace(o_part, role=Role.INPUT), replace(lse_part, role=Role.INPUT), o, lse, cu_q)
    return ir.KernelIR("attn_combine_short", params, symbols, (nest,),
                       doc="merge a short sequence's splits by log-sum-exp, one program per (sequence, K/V head)")
