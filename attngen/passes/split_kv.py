"""split-kv: Flash-Decoding. Split each sequence's keys across programs, merge by log-sum-exp.

In decoding a (batch, head) pair has one query row, so one program per query block leaves most of
the GPU idle while it streams the whole cache. This pass adds a grid axis over NUM_SPLITS splits
(a run-time value: the launcher picks it from the batch, the heads and the number of
multiprocessors, or the spec fixes it). Split `split` of a sequence with n_k keys reduces the keys
[split_start, split_stop): slices of `keys_per_split` keys, a multiple of BLOCK_N, so every split
starts on a block boundary and causal-skip can still split its range into full and masked blocks.
Each split writes its own normalised output and log-sum-exp (O_PART, LSE_PART, float32); a second
kernel, `attn_combine`, merges them, BLOCK_S splits per load: with lse_max the largest split LSE,

    O = sum_s exp(lse_s - lse_max) O_s / sum_s exp(lse_s - lse_max),  LSE = lse_max + log(sum ...)

A split that saw no key has LSE -inf and weight 0; a row no split saw gives 0 and -inf.
A sink logit (`sinks = true`) joins split 0's partial only (`_sink_once`): its LSE then counts it, so
the merge above gives exactly the softmax whose denominator has it once, and one split needs nothing more.
One split needs no merge: the launcher then points O_PART and LSE_PART at the final outputs.

Applies when the spec's split_kv is not 1; a no-op otherwise (split_kv = 1 is the plain kernel).
"""

from __future__ import annotations

from dataclasses import replace

import sympy

from .. import ir
from ..ir import sym
from ..errors import InternalError
from ..ir import Assign, Buffer, Call, DT, Load, Loop, LoopKind, Num, Op, Ref, Role, Space, Span, Stat, Store, Sym
from . import causal_skip
from .grid import grid_path, rebuild
from .tiling import value_span

NAME = "split-kv"


def _scalar(symbol: sympy.Symbol) -> Buffer:
    return Buffer(str(symbol), (), DT.I32, Space.REG)


def _partial(buffer: Buffer) -> Buffer:
    """O (B, H, N_Q, D) -> O_PART (B, NUM_SPLITS, H, N_Q, D) in float32; LSE likewise."""
    shape = (buffer.shape[0], sym.NUM_SPLITS) + buffer.shape[1:]
    return Buffer(f"{buffer.name}_PART", shape, DT.F32, Space.HBM, Role.OUTPUT, buffer.stat)


def _live_keys(loop: Loop):
    """The keys [lo, hi) a program's mask can keep, where the mask bounds them from below (a window, a chunk);
    None where every program may need the keys from 0 (no mask, causal, a prefix): those keep today's slices."""
    masks = {e for st in ir.walk_stmts(loop.body) for x in ir.stmt_exprs(st) for e in ir.walk_expr(x)
             if isinstance(e, ir.Masked)}
    if len(masks) != 1:
        return None
    found = causal_skip.regions(loop, masks.pop())
    if found is None:
        return None
    (lo, _, _), _, (_, hi, _) = found[0]
    if sympy.sympify(lo) == loop.start:
        return None
    return lo, hi


def _split_range(body):
    """The body with its key loop restricted to this split's slice, and the slice's definitions."""
    loops = [st for st in body if isinstance(st, Loop) and st.var == sym.start_n]
    if len(loops) != 1 or loops[0].start != 0 or loops[0].stop != sym.n_k:
        raise InternalError(f"{NAME} expects one key loop over [0, n_k) (after kv-lengths)")
    (loop,) = loops
    live = _live_keys(loop)
    if live is None:
        first, count = sym.ZERO, sym.n_k
        what = "this split's slice of the keys: whole blocks, so every split starts on a block boundary"
    else:
        # A window of 4096 keys over a cache of 128k: the splits share the keys the program's rows can see
        # (from a block boundary), not the whole cache, so each reads ~4096 / NUM_SPLITS keys.
        first, count = live[0], sympy.Max(0, live[1] - live[0])
        what = "this split's slice of the keys the mask keeps: whole blocks from a block boundary"
    slice_defs = (
        ir.Comment(what),
        Assign(_scalar(sym.keys_per_split),
               Sym(sym.BLOCK_N * sym.CeilDiv(sym.CeilDiv(count, sym.NUM_SPLITS), sym.BLOCK_N))),
        Assign(_scalar(sym.split_start), Sym(first + sym.split * sym.keys_per_split)),
        Assign(_scalar(sym.split_stop), Sym(sympy.Min(sym.n_k, sym.split_start + sym.keys_per_split))),
    )
    new_loop = replace(loop, start=sym.split_start, stop=sym.split_stop, note="this split's key blocks")
    out = []
    for st in body:
        if st is loop:
            out.extend(slice_defs)
            out.append(new_loop)
        else:
            out.append(st)
    return tuple(out)


def _sink_once(body):
    """The sink's logit in split 0, -inf (no weight: the recurrence step leaves the row unchanged) in the
    others. NOTE: split 0 rather than the combine kernel, so that one split (no combine launched) and a
    split 0 that sees no key (a window far from the start) still count it once."""
    def reads_sink(e):
        return ((isinstance(e, Load) and e.buffer.stat is Stat.SINK)
                or (isinstance(e, ir.Pointwise) and any(b.stat is Stat.SINK for b in e.tensors)))

    rows = next(i.span if isinstance(i, ir.Packed) else i for st in ir.walk_stmts(body) for x in ir.stmt_exprs(st)
                for e in ir.walk_expr(x) if isinstance(e, Load) and e.buffer.name == "Q"
                for i in e.index if isinstance(i, (Span, ir.Packed)))
    once = sympy.Piecewise((sym.S, sympy.Eq(sym.split, 0)), (-sympy.oo, True))

    def stmt(st):
        if isinstance(st, Assign) and any(reads_sink(e) for e in ir.walk_expr(st.value)):
            return replace(st, value=ir.Pointwise(st.value, once, rows, None, score=False))
        return st

    return ir.map_stmts(body, stmt)


def _to_partial(body, partials: dict):
    def stmt(st):
        if isinstance(st, Store) and st.target.name in partials:
            return replace(st, target=partials[st.target.name], index=st.index[:1] + (sym.split,) + st.index[1:])
        return st

    return ir.map_stmts(body, stmt)


def combine_kernel(program: ir.Program, o: Buffer, lse: Buffer, o_part: Buffer, lse_part: Buffer) -> ir.KernelIR:
    """attn_combine: O and LSE from the splits' partial outputs, one program per query row.

    The splits are merged BLOCK_S at a time: one load brings a chunk's BLOCK_S log-sum-exps
    (splits past NUM_SPLITS read -inf: weight 0) and one its [BLOCK_S, D] outputs, and chunks merge
    online like key blocks in the forward (running max, rescaled sum and accumulator). Loading one
    split at a time instead costs a memory round trip per split: measured 7% of a batch-1 decoding
    step at 16 splits (benchmarks/NOTES.md, v4). The launcher passes the split count rounded up to a
    power of two, at most the program's `combine_block_s`: a 32-wide step at 2 splits cost 1.6 us
    more of a batch-16 step (v20)."""
    dims = value_span(program)
    splits = Span("offs_s", sym.split, sym.BLOCK_S, sym.NUM_SPLITS)
    scalar = lambda name: Buffer(name, (), DT.F32, Space.REG)  # noqa: E731
    chunk = lambda name: Buffer(name, (sym.BLOCK_S,), DT.F32, Space.REG)  # noqa: E731
    m_run, m_new, m_use, alpha, l_run, l_safe = (scalar(n) for n in ("m_run", "m_new", "m_use", "alpha", "l_run", "l_safe"))
    lse_s, weight = chunk("lse_s"), chunk("weight")
    acc = Buffer("acc", (dims.size,), DT.F32, Space.REG)
    lse_load = Load(replace(lse_part, role=Role.INPUT), (sym.b, splits, sym.h, sym.m), fill=float("-inf"))
    o_load = Load(replace(o_part, role=Role.INPUT), (sym.b, splits, sym.h, sym.m, dims))

    merge, out, log_sum_exp = merge_splits(lse_load, o_load, (lse_s, weight), (m_run, m_new, m_use, alpha, l_run, acc),
                                           l_safe, step=sym.BLOCK_S, chunk=True)
    body = merge + (Store(o, (sym.b, sym.h, sym.m, dims), out), Store(lse, (sym.b, sym.h, sym.m), log_sum_exp))
    grid = Loop(sym.b, sym.ZERO, sym.B, sym.ONE, (
        Loop(sym.h, sym.ZERO, sym.H, sym.ONE, (
            Loop(sym.m, sym.ZERO, sym.N_Q, sym.ONE, body, LoopKind.GRID, "query rows"),
        ), LoopKind.GRID),
    ), LoopKind.GRID)
    symbols = (
        ir.SymbolDecl(sym.B, ir.SymKind.SIZE, "batch", specialize=False),
        ir.SymbolDecl(sym.H, ir.SymKind.SIZE, "query heads"),
        ir.SymbolDecl(sym.NUM_SPLITS, ir.SymKind.SIZE, "key/value splits", specialize=False),
        ir.SymbolDecl(sym.N_Q, ir.SymKind.SIZE, "query length", specialize=False),
    ) + _value_dims(program) + (
        ir.SymbolDecl(sym.BLOCK_S, ir.SymKind.CONSTEXPR, "splits merged per step"),
    )
    params = (replace(o_part, role=Role.INPUT), replace(lse_part, role=Role.INPUT), o, lse)
    return ir.KernelIR("attn_combine", params, symbols, (grid,),
                     doc="merge the splits' outputs by log-sum-exp, one program per (batch, head, query row)")


def merge_splits(lse_load: ir.Expr, o_load: ir.Expr, loaded: tuple, running: tuple, l_safe: Buffer, step,
                 chunk: bool) -> tuple[tuple, ir.Expr, ir.Expr]:
    """The merge of splits by log-sum-exp: (statements, the output, the log-sum-exp) of one program. A loop over
    the splits, `step` at a time, loads their `lse_s` and `weight` (`loaded`) and updates the running max, its
    finite stand-in, the rescale factor, the running sum and the accumulator (`running`: m_run, m_new, m_use,
    alpha, l_run, acc), as key blocks merge in the forward. `chunk`: a step loads several splits of one row
    (reduced over the first axis); else one split of several rows. A row no split saw a key of gives 0 and -inf."""
    (lse_s, weight), (m_run, m_new, m_use, alpha, l_run, acc) = loaded, running
    over = (lambda op, x: Call(op, (x,))) if chunk else (lambda op, x: x)

    def rescaled(old: Buffer, new: ir.Expr) -> ir.Expr:
        return Call(Op.ADD, (Call(Op.MUL, (Ref(old), Ref(alpha))), new))

    steps = (
        Assign(lse_s, lse_load),
        Assign(m_new, Call(Op.MAX, (Ref(m_run), over(Op.COLMAX, Ref(lse_s))))),
        Assign(m_use, Call(Op.FINITE_OR_ZERO, (Ref(m_new),))),
        Assign(alpha, Call(Op.EXP, (Call(Op.SUB, (Ref(m_run), Ref(m_use))),))),
        Assign(weight, Call(Op.EXP, (Call(Op.SUB, (Ref(lse_s), Ref(m_use))),))),
        Assign(l_run, rescaled(l_run, over(Op.COLSUM, Ref(weight)))),
        Assign(acc, rescaled(acc, over(Op.COLSUM, Call(Op.MUL, (Ref(weight), o_load))))),
        Assign(m_run, Ref(m_new)),
    )
    what = "BLOCK_S splits at a time" if chunk else "the splits one at a time"
    merge = (
        ir.Comment(f"merge {what}: running max, rescaled sum and accumulator"),
        Assign(m_run, Num(float("-inf"))),
        Assign(l_run, Num(0.0)),
        Assign(acc, Num(0.0)),
        Loop(sym.split, sym.ZERO, sym.NUM_SPLITS, step, steps, LoopKind.SERIAL,
             "chunks of BLOCK_S splits" if chunk else "key/value splits", aligned=chunk),
        ir.Comment("a row no split saw a key of gives 0 and a log-sum-exp of -inf"),
        Assign(l_safe, Call(Op.ONE_IF_ZERO, (Ref(l_run),))),
    )
    return merge, Call(Op.DIV, (Ref(acc), Ref(l_safe))), Call(Op.ADD, (Ref(m_run), Call(Op.LOG, (Ref(l_safe),))))


def _value_dims(program: ir.Program) -> tuple[ir.SymbolDecl, ...]:
    """The head dim symbols of the outputs the combine kernel merges: V's, which is Q's unless the spec sets another."""
    if program.attr("head_dim_v") is not None:
        return (ir.SymbolDecl(sym.HEAD_DIM_V, ir.SymKind.CONSTEXPR, "head dim of V and O"),
                ir.SymbolDecl(sym.HEAD_DIM_V_PADDED, ir.SymKind.CONSTEXPR, "head dim of V and O rounded up to a power of two"))
    return (ir.SymbolDecl(sym.HEAD_DIM, ir.SymKind.CONSTEXPR, "head dim"),
            ir.SymbolDecl(sym.HEAD_DIM_PADDED, ir.SymKind.CONSTEXPR, "head dim rounded up to a power of two"))


def applies(program: ir.Program) -> bool:
    return program.attr("split_kv") is not None


def run(program: ir.Program) -> ir.Program:
    if not applies(program):
        return program
    kernel = program.kernel("attn_fwd")
    params = {p.name: p for p in kernel.params}
    o, lse = params["O"], params["LSE"]
    partials = {"O": _partial(o), "LSE": _partial(lse)}
    path = grid_path(kernel, NAME)
    grid_b, *inner = path
    body = _to_partial(_sink_once(_split_range(path[-1].body)), partials)
    grid_split = Loop(sym.split, sym.ZERO, sym.NUM_SPLITS, sym.ONE, (), LoopKind.GRID)
    kernel = replace(
        kernel,
        params=tuple(partials.get(p.name, p) for p in kernel.params),
        symbols=kernel.symbols + (ir.SymbolDecl(sym.NUM_SPLITS, ir.SymKind.SIZE, "key/value splits", specialize=False),),
        body=rebuild([grid_b, grid_split, *inner], body),
        doc=kernel.doc.replace("one program per (batch, ", "one program per (batch, split, ", 1),
    )
    combine = combine_kernel(program, o, lse, partials["O"], partials["LSE"])
    # A chunk of [BLOCK_S, D] float32 outputs: 32 values a thread at 4 warps, at most 32 splits
    # (BLOCK_S's upper bound: a launch with fewer splits passes fewer).
    block_s = max(1, min(32, 4096 // program.attr("head_dim_v_padded", program.attr("head_dim_padded"))))
    return replace(program, kernels=(kernel, combine)).with_attrs(combine_block_s=block_s)
