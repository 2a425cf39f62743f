"""kv-lengths: every sequence of the batch has its own number of keys, read from SEQLENS.

A KV cache holds sequences of different lengths in one tensor (or one page pool): the key count is
no longer one run-time size N_K shared by the batch but `n_k = SEQLENS[b]`, loaded once per
program. Every bound, limit and mask offset that said N_K now says n_k, so a bottom-right causal
mask aligns each sequence's last query with its own last key (offset n_k - N_Q), keys past n_k are
never read, and a sequence with no keys gives zeros and a log-sum-exp of -inf. The tensor's own
length (the cache's capacity) is no longer needed inside the kernel.

Applies to decoding specs (split_kv other than 1, or a paged kv_layout) but packed variable-length ones,
whose lengths the varlen pass reads; a no-op otherwise.
"""

from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..ir import sym
from ..ir import Assign, Buffer, DT, Load, Role, Space
from .grid import grid_path, rebuild

NAME = "kv-lengths"


def applies(program: ir.Program) -> bool:
    return (program.attr("split_kv") is not None or program.attr("page_size") is not None) and not program.attr("varlen")


def run(program: ir.Program) -> ir.Program:
    if not applies(program):
        return program
    kernel = program.kernel("attn_fwd")
    seqlens = Buffer("SEQLENS", (sym.B,), DT.I32, Space.HBM, Role.INPUT)
    n_k = Buffer(str(sym.n_k), (), DT.I32, Space.REG)
    path = grid_path(kernel, NAME)
    inner = ir.subs_stmts(path[-1].body, {sym.N_K: sym.n_k})
    body = (ir.Comment("this sequence's keys"), Assign(n_k, Load(seqlens, (sym.b,)))) + inner
    # N_K (the cache's capacity) now only sizes the K and V tensors: no longer a kernel argument.
    symbols = tuple(d for d in kernel.symbols if d.symbol != sym.N_K)
    kernel = replace(kernel, params=kernel.params + (seqlens,), symbols=symbols, body=rebuild(path, body))
    return program.replace_kernel(kernel).with_attrs(kvcache=True)
