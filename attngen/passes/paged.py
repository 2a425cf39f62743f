"""paged: keys and values live in fixed-size pages, found through a per-sequence block table.

A paged cache (PagedAttention) keeps one pool of pages, K and V each (NUM_PAGES, PAGE_SIZE, H_KV,
D), and a block table (B, MAX_PAGES) of int32 page numbers: key n of sequence b is at page
BLOCK_TABLE[b, n // PAGE_SIZE], slot n % PAGE_SIZE. This pass turns every K and V load's
(sequence, position) dimensions into that lookup (an `ir.Paged` index item). Pages may sit anywhere
in the pool, in any order, and be shared between sequences.

Two ways to look pages up, chosen from the page size:
  * pages of at least PER_TILE_MIN_PAGE tokens: a tile of BLOCK_N keys (BLOCK_N <= PAGE_SIZE, both
    powers of two, tiles start at multiples of BLOCK_N) never crosses a page, so one table entry
    serves the whole tile: the rows are contiguous in memory, as in a contiguous cache. The program
    records `max_block_n` so the launcher keeps BLOCK_N within a page.
  * smaller pages (down to 1 token): each key row looks its page up (a gather), so BLOCK_N is free.

Applies to specs with kv_layout = paged(page_size = N); a no-op otherwise.
"""

from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..ir import sym
from ..errors import InternalError
from ..ir import Buffer, DT, Paged, Role, Space, Span
from .grid import map_indices

NAME = "paged"

PER_TILE_MIN_PAGE = 64
"""Pages at least this long are looked up once per tile (and BLOCK_N is kept to the page size)."""


def applies(program: ir.Program) -> bool:
    return program.attr("page_size") is not None


def run(program: ir.Program) -> ir.Program:
    if not applies(program):
        return program
    page_size = program.attr("page_size")
    per_tile = page_size >= PER_TILE_MIN_PAGE
    for kernel in program.kernels:
        # attn_fwd, and a mixed step's narrow attn_fwd_short: the kernels that read K and V (or, under `v = k[:N]`,
        # MLA's, K alone: the values are K's columns, so K is the one pool)
        names = {p.name for p in kernel.params}
        if "K" in names and ("V" in names or program.attr("v_from_k")):
            program = program.replace_kernel(_paged(kernel, page_size, per_tile))
    return program.with_attrs(max_block_n=page_size) if per_tile else program


def _paged(kernel: ir.KernelIR, page_size: int, per_tile: bool) -> ir.KernelIR:
    table = Buffer("BLOCK_TABLE", (sym.B, sym.MAX_PAGES), DT.I32, Space.HBM, Role.INPUT)
    pools = {}
    for p in kernel.params:
        if p.name in ("K", "V"):
            pools[p.name] = replace(p, shape=(sym.NUM_PAGES, sym.PAGE_SIZE, sym.H_KV, p.shape[-1]))

    def page(buffer: Buffer, index):
        if buffer.name not in pools:
            return buffer, index
        try:
            batch, head, keys, dims = index
            assert batch == sym.b and isinstance(keys, Span) and keys.name == "offs_n"
        except (ValueError, AssertionError):
            raise InternalError(f"{NAME} expects {buffer.name}[b, head, offs_n, offs_d], got {ir.format_index(index)}") from None
        return pools[buffer.name], (Paged(table, batch, keys, page_size, per_tile), head, dims)

    return replace(
        kernel,
        params=tuple(pools.get(p.name, p) for p in kernel.params) + (table,),
        body=map_indices(kernel.body, page),
    )
