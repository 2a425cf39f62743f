"""split-kv: Flash-Decoding. Split each sequence's keys across programs, merge by log-sum-exp.

In decoding a (batch, head) pair has one query row, so one program per query block leaves most of
the GPU idle while it streams the whole cache. This pass adds a grid axis over NUM_SPLITS splits
(a run-time value: the launcher picks it from the batch, the heads and the number of
multiprocessors, or the spec fixes it). Split `split` of a sequence with n_k keys reduces the keys
[split_start, split_stop): slices of `keys_per_split` keys, a multiple of BLOCK_N, so every split
starts on a block boundary and causal-skip can still split its range into full and masked blocks.
Each split writes its own normalised output and log-sum-exp (O_PART, LSE_PART, float32); a second
kernel, `attn_combine`, merges them: with lse_max the largest split LSE,

    O = sum_s exp(lse_s - lse_max) O_s / sum_s exp(lse_s - lse_max),  LSE = lse_max + log(sum ...)

A split that saw no key has LSE -inf and weight 0; a row no split saw gives 0 and -inf.
One split needs no merge: the launcher then points O_PART and LSE_PART at the final outputs.

Applies when the spec's split_kv is not 1; a no-op otherwise (split_kv = 1 is the plain kernel).
"""

from __future__ import annotations

from dataclasses import replace

import sympy

from .. import ir, sym
from ..errors import InternalError
from ..ir import Assign, Buffer, Call, DT, Load, Loop, LoopKind, Num, Op, Ref, Role, Space, Span, Store, Sym
from .grid import grid_path, rebuild
from .tiling import tile_spans

NAME = "split-kv"


def _scalar(symbol: sympy.Symbol) -> Buffer:
    return Buffer(str(symbol), (), DT.I32, Space.REG)


def _partial(buffer: Buffer) -> Buffer:
    """O (B, H, N_Q, D) -> O_PART (B, NUM_SPLITS, H, N_Q, D) in float32; LSE likewise."""
    shape = (buffer.shape[0], sym.NUM_SPLITS) + buffer.shape[1:]
    return Buffer(f"{buffer.name}_PART", shape, DT.F32, Space.HBM, Role.OUTPUT)


def _split_range(body):
    """The body with its key loop restricted to this split's slice, and the slice's definitions."""
    loops = [st for st in body if isinstance(st, Loop) and st.var == sym.start_n]
    if len(loops) != 1 or loops[0].start != 0 or loops[0].stop != sym.n_k:
        raise InternalError(f"{NAME} expects one key loop over [0, n_k) (after kv-lengths)")
    (loop,) = loops
    slice_defs = (
        ir.Comment("this split's slice of the keys: whole blocks, so every split starts on a block boundary"),
        Assign(_scalar(sym.keys_per_split),
               Sym(sym.BLOCK_N * sym.CeilDiv(sym.CeilDiv(sym.n_k, sym.NUM_SPLITS), sym.BLOCK_N))),
        Assign(_scalar(sym.split_start), Sym(sym.split * sym.keys_per_split)),
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


def _to_partial(body, partials: dict):
    def stmt(st):
        if isinstance(st, Store) and st.target.name in partials:
            return replace(st, target=partials[st.target.name], index=st.index[:1] + (sym.split,) + st.index[1:])
        return st

    return ir.map_stmts(body, stmt)


def combine_kernel(program: ir.Program, o: Buffer, lse: Buffer, o_part: Buffer, lse_part: Buffer) -> ir.Kernel:
    """attn_combine: O and LSE from the splits' partial outputs, one program per query block."""
    rows = Span("offs_m", sym.start_m, sym.BLOCK_M, sym.N_Q)
    dims = tile_spans(program)["offs_d"]
    vec = lambda name: Buffer(name, (sym.BLOCK_M,), DT.F32, Space.REG)  # noqa: E731
    lse_max, lse_use, weight, l_sum, l_safe = (vec(n) for n in ("lse_max", "lse_use", "weight", "l_sum", "l_safe"))
    acc = Buffer("acc", (sym.BLOCK_M, dims.size), DT.F32, Space.REG)
    lse_s = Load(replace(lse_part, role=Role.INPUT), (sym.b, sym.split, sym.h, rows))
    o_s = Load(replace(o_part, role=Role.INPUT), (sym.b, sym.split, sym.h, rows, dims))

    def every_split(body):
        return Loop(sym.split, sym.ZERO, sym.NUM_SPLITS, sym.ONE, body, LoopKind.SERIAL, "every split")

    body = (
        ir.Comment("the largest log-sum-exp over the splits (-inf: no split saw a key of this row)"),
        Assign(lse_max, Num(float("-inf"))),
        every_split((Assign(lse_max, Call(Op.MAX, (Ref(lse_max), lse_s))),)),
        Assign(lse_use, Call(Op.FINITE_OR_ZERO, (Ref(lse_max),))),
        ir.Comment("each split's output weighted by its share exp(lse_s - lse_max) of the softmax mass"),
        Assign(l_sum, Num(0.0)),
        Assign(acc, Num(0.0)),
        every_split((
            Assign(weight, Call(Op.EXP, (Call(Op.SUB, (lse_s, Ref(lse_use))),))),
            Assign(l_sum, Call(Op.ADD, (Ref(l_sum), Ref(weight)))),
            Assign(acc, Call(Op.ADD, (Ref(acc), Call(Op.MUL, (Ref(weight), o_s))))),
        )),
        Assign(l_safe, Call(Op.ONE_IF_ZERO, (Ref(l_sum),))),
        Store(o, (sym.b, sym.h, rows, dims), Call(Op.DIV, (Ref(acc), Ref(l_safe)))),
        Store(lse, (sym.b, sym.h, rows), Call(Op.ADD, (Ref(lse_max), Call(Op.LOG, (Ref(l_safe),))))),
    )
    grid = Loop(sym.b, sym.ZERO, sym.B, sym.ONE, (
        Loop(sym.h, sym.ZERO, sym.H, sym.ONE, (
            Loop(sym.start_m, sym.ZERO, sym.N_Q, sym.BLOCK_M, body, LoopKind.GRID, "query blocks", aligned=True),
        ), LoopKind.GRID),
    ), LoopKind.GRID)
    symbols = (
        ir.SymbolDecl(sym.B, ir.SymKind.SIZE, "batch", specialize=False),
        ir.SymbolDecl(sym.H, ir.SymKind.SIZE, "query heads"),
        ir.SymbolDecl(sym.NUM_SPLITS, ir.SymKind.SIZE, "key/value splits", specialize=False),
        ir.SymbolDecl(sym.N_Q, ir.SymKind.SIZE, "query length", specialize=False),
        ir.SymbolDecl(sym.HEAD_DIM, ir.SymKind.CONSTEXPR, "head dim"),
        ir.SymbolDecl(sym.HEAD_DIM_PADDED, ir.SymKind.CONSTEXPR, "head dim rounded up to a power of two"),
        ir.SymbolDecl(sym.BLOCK_M, ir.SymKind.CONSTEXPR, "query rows per program"),
    )
    params = (replace(o_part, role=Role.INPUT), replace(lse_part, role=Role.INPUT), o, lse)
    return ir.Kernel("attn_combine", params, symbols, (grid,),
                     doc="merge the splits' outputs by log-sum-exp, one program per (batch, head, block of BLOCK_M queries)")


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
    body = _to_partial(_split_range(path[-1].body), partials)
    grid_split = Loop(sym.split, sym.ZERO, sym.NUM_SPLITS, sym.ONE, (), LoopKind.GRID)
    kernel = replace(
        kernel,
        params=tuple(partials.get(p.name, p) for p in kernel.params),
        symbols=kernel.symbols + (ir.SymbolDecl(sym.NUM_SPLITS, ir.SymKind.SIZE, "key/value splits", specialize=False),),
        body=rebuild([grid_b, grid_split, *inner], body),
        doc=kernel.doc.replace("one program per (batch, ", "one program per (batch, split, ", 1),
    )
    combine = combine_kernel(program, o, lse, partials["O"], partials["LSE"])
    return replace(program, kernels=(kernel, combine))
