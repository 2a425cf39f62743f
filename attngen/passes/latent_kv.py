"""latent-kv: where V is K's prefix (`v = k[:N]`, MLA's latent cache), each K tile is read once for both products.

Before this pass a key block is read twice from the one cache: all HEAD_DIM columns of K for Q K^T, then its
first HEAD_DIM_V columns again as V for P V. Here the block becomes two disjoint tiles, `kv` (columns
[0, HEAD_DIM_V): the values, and the scores' first part) and `k_rope` (columns [HEAD_DIM_V, HEAD_DIM): MLA's
rotary part), and Q likewise `q_nope` and `q_rope`:

    s = q_nope kv^T + q_rope k_rope^T        acc += p kv

so every element of the cache is loaded once per tile, and no tile is padded past its width (576 columns would
otherwise be a 1024-wide power-of-two tile). FlashMLA splits the product the same way (512 + 64).

Applies to specs with `v = k[:N]` (which spec.py keeps to decoding, forward only); a no-op otherwise.
"""

from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..errors import InternalError
from ..ir import Assign, Buffer, Call, Load, Loop, LoopKind, Op, Ref, Space, Span, sym
from .tiling import value_span

NAME = "latent-kv"


def applies(program: ir.Program) -> bool:
    return bool(program.attr("v_from_k"))


def rope_span(program: ir.Program) -> Span:
    """K's and Q's columns after V's prefix, [HEAD_DIM_V, HEAD_DIM), as a power-of-two tile (masked past HEAD_DIM)."""
    width = program.attr("head_dim") - program.attr("head_dim_v")
    padded = width != 1 << (width - 1).bit_length()
    return Span("offs_dr", sym.HEAD_DIM_V, sym.HEAD_DIM_ROPE_PADDED, sym.HEAD_DIM if padded else None)


def run(program: ir.Program) -> ir.Program:
    if not applies(program):
        return program
    kernel = program.kernel("attn_fwd")
    dims_v, dims_r = value_span(program), rope_span(program)
    q_old = next((st.target for st in ir.walk_stmts(kernel.body)
                  if isinstance(st, Assign) and st.target.name == "q" and isinstance(st.value, Load)), None)
    if q_old is None:
        raise InternalError(f"{NAME}: kernel {kernel.name} has no query tile `q`")
    tile = lambda name, rows, span: Buffer(name, (rows, span.size), q_old.dtype, Space.REG)
    q_nope, q_rope = tile("q_nope", sym.BLOCK_M, dims_v), tile("q_rope", sym.BLOCK_M, dims_r)
    kv, k_rope = tile("kv", sym.BLOCK_N, dims_v), tile("k_rope", sym.BLOCK_N, dims_r)
    columns = lambda load, span: replace(load, index=load.index[:-1] + (span,))

    def key_loop(loop: Loop) -> Loop:
        loads = {e for st in loop.body for x in ir.stmt_exprs(st) for e in ir.walk_expr(x)
                 if isinstance(e, Load) and e.buffer.name == "K"}
        values = [e for e in loads if e.index[-1].name == dims_v.name]
        scores = [e for e in loads if e.index[-1].name != dims_v.name]
        if len(values) != 1 or len(scores) != 1 or values[0].index[:-1] != scores[0].index[:-1]:
            raise InternalError(f"{NAME}: a key loop of {kernel.name} reads K as {len(scores)} score and "
                                f"{len(values)} value tiles of the same keys; expected one of each")
        value, score = values[0], scores[0]

        def split(e):
            if isinstance(e, Call) and e.op is Op.DOT_T and e.args == (Ref(q_old), score):
                return Call(Op.ADD, (Call(Op.DOT_T, (Ref(q_nope), Ref(kv)), e.dtype),
                                     Call(Op.DOT_T, (Ref(q_rope), Ref(k_rope)), e.dtype)))
            return Ref(kv) if e == value else e

        body = ir.map_exprs_in(loop.body, split)
        if any(e == score for st in body for x in ir.stmt_exprs(st) for e in ir.walk_expr(x)):
            raise InternalError(f"{NAME}: K's score tile in {kernel.name} is read other than as q K^T")
        # The one read of the block: V's columns, then the rest of K's.
        return replace(loop, body=(Assign(kv, value), Assign(k_rope, columns(score, dims_r))) + body)

    def stmt(st):
        if isinstance(st, Assign) and st.target == q_old:
            return Assign(q_nope, columns(st.value, dims_v)), Assign(q_rope, columns(st.value, dims_r))
        if isinstance(st, Loop) and st.kind is LoopKind.SERIAL and any(
                isinstance(e, Load) and e.buffer.name == "K"
                for s in st.body for x in ir.stmt_exprs(s) for e in ir.walk_expr(x)):
            return key_loop(st)
        return st

    rope = ir.SymbolDecl(sym.HEAD_DIM_ROPE_PADDED, ir.SymKind.CONSTEXPR,
                         "K's columns after V's, rounded up to a power of two")
    # Q and K are no longer read HEAD_DIM_PADDED wide.
    symbols = tuple(d for d in kernel.symbols if d.symbol != sym.HEAD_DIM_PADDED) + (rope,)
    kernel = replace(kernel, body=ir.map_stmts(kernel.body, stmt), symbols=symbols)
    return program.replace_kernel(kernel)
