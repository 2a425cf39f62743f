"""varlen: packed variable-length sequences; programs spread over all sequences' tiles, found by a search.

A packed batch lays its sequences end to end: q (TOTAL_Q, H, D), k and v (TOTAL_K, H_KV, D), sequence b's
queries rows CU_SEQLENS_Q[b] .. CU_SEQLENS_Q[b+1] - 1 (keys likewise through CU_SEQLENS_K, or, paged,
positions 0 .. n_k - 1 through the block table), and it uses its first SEQLENS_K[b] keys (flash-attn's
seqused_k, else its length). This pass rewrites every kernel:

  * the grid over (batch, blocks of one length) becomes one axis over the tiles of all sequences together,
    cdiv(TOTAL, BLOCK) + B programs (an `ir.SequenceTile` finds a program's sequence and tile, and returns
    from one past its sequence's last tile): work follows the tokens, not the longest sequence;
  * N_Q and N_K become the sequence's n_q and n_k, read once per program, so every bound, mask offset
    (bottom-right: n_k - n_q) and causal-skip range holds per sequence;
  * the tensors' (batch, ..., position) indices become rows of the packed tensors (`ir.Ragged`: the
    sequence's first row plus the position); the log-sum-exp (and delta) are (H, TOTAL_Q), flash-attn's
    varlen layout. Paged K/V keep their (sequence, position) index for the paged pass.

The forward and dQ kernels tile queries (CU_SEQLENS_Q, BLOCK_M), the dK/dV kernel keys (CU_SEQLENS_K,
BLOCK_N). Applies to specs with layout = varlen; a no-op otherwise.
"""

from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..errors import InternalError
from ..ir import sym
from ..ir import Assign, Buffer, Call, DT, Load, Loop, LoopKind, Op, Ragged, Ref, Role, SequenceTile, Space, Span
from .grid import grid_path, map_indices, rebuild

NAME = "varlen"

_QUERY_ROWS = ("Q", "O", "DO", "DQ")   # (B, H, N_Q, D) -> (TOTAL_Q, H, D)
_KEY_ROWS = ("K", "V", "DK", "DV")     # (B, H_KV, N_K, D) -> (TOTAL_K, H_KV, D), unless paged
_ROW_STATS = ("LSE", "DELTA")          # (B, H, N_Q) -> (H, TOTAL_Q)


def applies(program: ir.Program) -> bool:
    return bool(program.attr("varlen"))


def _scalar(symbol) -> Buffer:
    return Buffer(str(symbol), (), DT.I32, Space.REG)


def run(program: ir.Program) -> ir.Program:
    if not applies(program):
        return program
    paged = program.attr("page_size") is not None
    return replace(program, kernels=tuple(_kernel(k, paged) for k in program.kernels))


def _kernel(kernel: ir.KernelIR, paged: bool) -> ir.KernelIR:
    cu_q = Buffer("CU_SEQLENS_Q", (sym.B + 1,), DT.I32, Space.HBM, Role.INPUT)
    cu_k = Buffer("CU_SEQLENS_K", (sym.B + 1,), DT.I32, Space.HBM, Role.INPUT)
    seqlens_k = Buffer("SEQLENS_K", (sym.B,), DT.I32, Space.HBM, Role.INPUT)
    path = grid_path(kernel, NAME)
    batch, *middle, blocks = path
    if batch.var != sym.b or blocks.var not in (sym.start_m, sym.start_n):
        raise InternalError(f"{NAME}: kernel {kernel.name}'s grid is not (b, ..., blocks)")

    # What a program reads of its sequence, once it knows which one it is.
    q_start, n_q, k_start, n_k = (_scalar(s) for s in (sym.q_start, sym.n_q, sym.k_start, sym.n_k))
    facts = (Assign(q_start, Load(cu_q, (sym.b,))),
             Assign(n_q, Call(Op.SUB, (Load(cu_q, (sym.b + 1,)), Ref(q_start)))))
    if not paged:
        facts += (Assign(k_start, Load(cu_k, (sym.b,))),)
    facts += (Assign(n_k, Load(seqlens_k, (sym.b,))),)

    by_queries = blocks.var == sym.start_m
    offsets, total, first, count = (cu_q, sym.TOTAL_Q, sym.q_start, sym.n_q) if by_queries else \
        (cu_k, sym.TOTAL_K, sym.k_start, sym.n_k)
    block = blocks.step
    locate = SequenceTile(sym.tile, offsets, block, sym.b, facts, blocks.var,
                          (sym.tile - (sym.FloorDiv(first, block) + sym.b)) * block, count)

    body = ir.subs_stmts(blocks.body, {sym.N_Q: sym.n_q, sym.N_K: sym.n_k})
    params = {p.name: p for p in kernel.params}
    shapes = {}
    for name, p in params.items():
        if name in _QUERY_ROWS:
            shapes[name] = replace(p, shape=(sym.TOTAL_Q, p.shape[1], p.shape[3]))
        elif name in _KEY_ROWS and not paged:
            shapes[name] = replace(p, shape=(sym.TOTAL_K, p.shape[1], p.shape[3]))
        elif name in _ROW_STATS:
            shapes[name] = replace(p, shape=(p.shape[1], sym.TOTAL_Q))

    def pack(buffer: Buffer, index):
        if buffer.name not in shapes:
            return buffer, index
        if buffer.name in _ROW_STATS:
            _, head, rows = index
            return shapes[buffer.name], (head, Ragged(sym.q_start, _span(rows, buffer)))
        _, head, rows, dims = index
        start = sym.q_start if buffer.name in _QUERY_ROWS else sym.k_start
        return shapes[buffer.name], (Ragged(start, _span(rows, buffer)), head, dims)

    body = map_indices(body, pack)
    tiles = Loop(sym.tile, sym.ZERO, sym.CeilDiv(total, block) + sym.B, sym.ONE, (locate,) + body, LoopKind.GRID,
                 "tiles of all sequences")
    grid = rebuild(middle, (tiles,))
    extra = (cu_q,) + (() if paged else (cu_k,)) + (seqlens_k,)
    totals = {sym.N_Q: ir.SymbolDecl(sym.TOTAL_Q, ir.SymKind.SIZE, "query rows of all sequences", specialize=False),
              sym.N_K: ir.SymbolDecl(sym.TOTAL_K, ir.SymKind.SIZE, "key rows of all sequences", specialize=False)}
    if paged:  # the page pool's size is no sequence's
        del totals[sym.N_K]
    sizes = tuple(totals.get(d.symbol, d) for d in kernel.symbols
                  if d.symbol in totals or d.symbol not in (sym.N_Q, sym.N_K))
    doc = kernel.doc.replace("batch", "sequence") + "; programs over the tiles of all sequences"
    return replace(kernel, params=tuple(shapes.get(p.name, p) for p in kernel.params) + extra,
                   symbols=sizes, body=grid, doc=doc)


def _span(rows, buffer: Buffer) -> Span:
    if not isinstance(rows, Span):
        raise InternalError(f"{NAME}: {buffer.name}'s position index is {rows}, not a span")
    return rows
