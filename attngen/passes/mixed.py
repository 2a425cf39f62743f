"""mixed: a serving step's decodes as narrow, split-KV work items beside the prefills' wide tiles.

A paged varlen batch mixes chunked prefills (many queries) with decodes (one query, or a few under speculative
decoding) over caches of up to ~32k keys. In the wide kernel a decode takes a BLOCK_M = 128 tile of which one row is
real and walks its whole cache in one program: compute-bound and unsplit. This pass adds, beside `attn_fwd`:

  * `attn_fwd_short`: one program per (sequence, split, head) whose tile is BLOCK_M rows (16: the narrowest
    `tl.dot`), for the sequences of at most BLOCK_M queries; the program reduces its split's slice of the keys
    (split-kv's slices, so a window's splits share the keys it keeps) into O_PART / LSE_PART (B, NUM_SPLITS, H,
    BLOCK_M, ...) in float32. A longer sequence's programs see n_q = n_k = 0 and store nothing;
  * `attn_combine_short`: one program per (sequence, head) that merges the splits by log-sum-exp, one split at a
    time, into the packed O and LSE rows of the short sequences;
  * in `attn_fwd`, a constexpr SHORT_Q: a tile of a sequence of at most SHORT_Q queries returns at once (the
    narrow kernels have it). SHORT_Q = 0 is the wide kernel alone, as before.

The host decides SHORT_Q (= the narrow BLOCK_M) and NUM_SPLITS from shapes and lengths it holds (the policy,
attngen/policy/mixed.py), so nothing is read back from the GPU. Applies to paged varlen specs; a no-op otherwise.
"""

from __future__ import annotations

from dataclasses import replace

import sympy

from .. import ir
from ..errors import InternalError
from ..ir import sym
from ..ir import Assign, Buffer, Call, DT, Load, Loop, LoopKind, Op, Ragged, Ref, Role, SequenceTile, Space, Span
from ..ir import Store, Sym
from .grid import grid_path, map_indices
from .split_kv import _sink_once, _split_range, merge_splits
from .tiling import value_span

NAME = "mixed"


def applies(program: ir.Program) -> bool:
    return bool(program.attr("varlen")) and program.attr("page_size") is not None \
        and not program.attr("backward", False)


def _scalar(symbol) -> Buffer:
    return Buffer(str(symbol), (), DT.I32, Space.REG)


def _short(value, n_q_all) -> sympy.Expr:
    """`value` for a short sequence (1 to BLOCK_M queries), 0 for any other."""
    return sympy.Piecewise((value, sympy.And(n_q_all <= sym.BLOCK_M, n_q_all > 0)), (0, True))


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
    o_part = Buffer("O_PART", (sym.B, sym.NUM_SPLITS, sym.H, sym.BLOCK_M, o.shape[-1]), DT.F32, Space.HBM, Role.OUTPUT,
                    o.stat)
    lse_part = Buffer("LSE_PART", (sym.B, sym.NUM_SPLITS, sym.H, sym.BLOCK_M), DT.F32, Space.HBM, Role.OUTPUT,
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
    """attn_fwd_short: the wide tile's body for one BLOCK_M tile at row 0, over one split of the keys."""
    body = _sink_once(_split_range(ir.subs_stmts(body, {sym.start_m: sym.ZERO})))

    def partial(buffer: Buffer, index):
        if buffer.name == "O":
            (rows, head, dims) = index
            return o_part, (sym.b, sym.split, head, _rows(rows), dims)
        if buffer.name == "LSE":
            (head, rows) = index
            return lse_part, (sym.b, sym.split, head, _rows(rows))
        return buffer, index

    body = map_indices(body, partial)
    # NOTE: heads innermost (the launch's first axis, the fastest-moving): the query heads of a GQA group run side
    # by side and read the same K/V tiles, from L2 after the first
    nest = Loop(sym.split, sym.ZERO, sym.NUM_SPLITS, sym.ONE, (
        Loop(sym.b, sym.ZERO, sym.B, sym.ONE, (
            Loop(sym.h, sym.ZERO, sym.H, sym.ONE, _short_facts(locate) + body, LoopKind.GRID, "query heads"),
        ), LoopKind.GRID, "sequences"),
    ), LoopKind.GRID, "key/value splits")
    params = tuple({"O": o_part, "LSE": lse_part}.get(p.name, p) for p in wide.params)
    symbols = tuple(d for d in wide.symbols if d.symbol != sym.SHORT_Q) + (
        ir.SymbolDecl(sym.NUM_SPLITS, ir.SymKind.SIZE, "key/value splits", specialize=False),)
    return ir.KernelIR("attn_fwd_short", params, symbols, (nest,),
                       doc="one program per (short sequence, split, head): a narrow tile of BLOCK_M queries over one "
                           "slice of the sequence's keys, partial outputs")


def _rows(rows) -> Span:
    if not isinstance(rows, Ragged):
        raise InternalError(f"{NAME}: an output row index is {rows}, not a sequence's rows")
    return rows.span


def _combine_kernel(program: ir.Program, locate: SequenceTile, o: Buffer, lse: Buffer, o_part: Buffer,
                    lse_part: Buffer) -> ir.KernelIR:
    """attn_combine_short: a short sequence's rows of O and LSE from its splits, merged one split at a time
    (running max, rescaled sum and accumulator, as key blocks merge in the forward); a row no split saw a key of
    gives 0 and -inf."""
    dims = value_span(program)
    rows = Span("offs_m", sym.ZERO, sym.BLOCK_M, sym.n_q)
    vector = lambda name: Buffer(name, (sym.BLOCK_M,), DT.F32, Space.REG)  # noqa: E731
    m_run, m_new, m_use, alpha, l_run, l_safe, lse_s, weight = (
        vector(n) for n in ("m_run", "m_new", "m_use", "alpha", "l_run", "l_safe", "lse_s", "weight"))
    acc = Buffer("acc", (sym.BLOCK_M, dims.size), DT.F32, Space.REG)
    lse_load = Load(replace(lse_part, role=Role.INPUT), (sym.b, sym.split, sym.h, rows), fill=float("-inf"))
    o_load = Load(replace(o_part, role=Role.INPUT), (sym.b, sym.split, sym.h, rows, dims))

    cu_q = locate.offsets
    facts = (Assign(_scalar(sym.q_start), Load(cu_q, (sym.b,))),
             Assign(_scalar(sym.n_q_all), Call(Op.SUB, (Load(cu_q, (sym.b + 1,)), Ref(_scalar(sym.q_start))))),
             Assign(_scalar(sym.n_q), Sym(_short(sym.n_q_all, sym.n_q_all))))
    merge, out, log_sum_exp = merge_splits(lse_load, o_load, (lse_s, weight), (m_run, m_new, m_use, alpha, l_run, acc),
                                           l_safe, step=sym.ONE, chunk=False)
    body = facts + merge + (Store(o, (Ragged(sym.q_start, rows), sym.h, dims), out),
                            Store(lse, (sym.h, Ragged(sym.q_start, rows)), log_sum_exp))
    nest = Loop(sym.h, sym.ZERO, sym.H, sym.ONE, (
        Loop(sym.b, sym.ZERO, sym.B, sym.ONE, body, LoopKind.GRID, "sequences"),
    ), LoopKind.GRID)
    value_dims = tuple(d for d in program.kernel("attn_fwd").symbols
                       if d.symbol in (sym.HEAD_DIM, sym.HEAD_DIM_PADDED, sym.HEAD_DIM_V, sym.HEAD_DIM_V_PADDED))
    symbols = (
        ir.SymbolDecl(sym.B, ir.SymKind.SIZE, "sequences", specialize=False),
        ir.SymbolDecl(sym.H, ir.SymKind.SIZE, "query heads"),
        ir.SymbolDecl(sym.NUM_SPLITS, ir.SymKind.SIZE, "key/value splits", specialize=False),
        ir.SymbolDecl(sym.TOTAL_Q, ir.SymKind.SIZE, "query rows of all sequences", specialize=False),
    ) + value_dims + (ir.SymbolDecl(sym.BLOCK_M, ir.SymKind.CONSTEXPR, "rows of a narrow work item"),)
    params = (replace(o_part, role=Role.INPUT), replace(lse_part, role=Role.INPUT), o, lse, cu_q)
    return ir.KernelIR("attn_combine_short", params, symbols, (nest,),
                       doc="merge a short sequence's splits by log-sum-exp, one program per (sequence, head)")
