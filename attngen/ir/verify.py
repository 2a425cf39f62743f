"""The IR's invariants, checked after every pass (always in tests; `compile_program(verify=...)`).

A failure is an `InternalError` naming the pass after which it appeared: passes are pure functions,
so the culprit is the pass named.
"""

from __future__ import annotations

from dataclasses import replace

import sympy

from . import nodes as ir, sym
from ..errors import InternalError
from .nodes import (DT, Assign, Buffer, Call, Load, Loop, LoopKind, Masked, Packed, Paged, Ragged, Ref, Role,
                    SequenceTile, Softmax, Space, Span, Store, SymKind)

# The element a predicate or pointwise function is evaluated at (sym.py): defined wherever a tile is.
_ELEMENT = {"q_idx", "k_idx", "q_head"}

# Passes after which the forward kernel is fused (no N x N scratch, no naive softmax), and after
# which every kernel is (the naive backward lives until `recompute` replaces it).
_FUSED_STAGES = {"online-softmax", "exp2", "fold-scale", "causal-skip", "pack-gqa", "split-kv", "paged", "recompute"}
_ALL_FUSED_STAGES = _FUSED_STAGES - {"online-softmax"}


class _Checker:
    def __init__(self, kernel: ir.KernelIR, stage: str):
        self.kernel = kernel
        self.stage = stage
        self.buffers: dict[str, Buffer] = {p.name: p for p in kernel.params}
        self.sizes = {d.symbol for d in kernel.symbols}
        self.size_symbols = {d.symbol for d in kernel.symbols if d.kind is SymKind.SIZE}
        self.per_tile_pages: set[int] = set()  # page sizes looked up once per tile

    def fail(self, message: str) -> None:
        raise InternalError(f"after pass '{self.stage}', kernel {self.kernel.name}: {message}")

    # -- symbols -------------------------------------------------------------------------------
    def symbols_ok(self, expr, scope: set, what: str) -> None:
        if expr is None:
            return
        free = sympy.sympify(expr).free_symbols
        unknown = {s for s in free if s not in self.sizes and str(s) not in scope}
        if unknown:
            self.fail(f"{what} uses undefined {', '.join(sorted(map(str, unknown)))}")

    def span_ok(self, sp: Span, scope: set) -> None:
        for part in (sp.start, sp.size, sp.limit):
            self.symbols_ok(part, scope, f"span {sp.name}")

    def index_ok(self, buffer: Buffer, index, scope: set) -> None:
        dims = ir.index_dims(index)
        if dims != buffer.rank:
            self.fail(f"{buffer.name} has rank {buffer.rank} but is indexed with {dims} dimensions")
        for i in index:
            if isinstance(i, Span):
                self.span_ok(i, scope)
            elif isinstance(i, Paged):
                self.span_ok(i.span, scope)
                self.symbols_ok(i.batch, scope, f"page table row of {buffer.name}")
                self.declared(i.table)
                self.paged_ok(buffer, i)
            elif isinstance(i, Ragged):
                self.span_ok(i.span, scope)
                self.symbols_ok(i.first, scope, f"first row of {buffer.name}")
            elif isinstance(i, Packed):
                self.span_ok(i.span, scope)
                self.symbols_ok(i.head, scope, f"packed head of {buffer.name}")
                self.symbols_ok(i.group, scope, f"packed group of {buffer.name}")
                self.symbols_ok(i.first, scope, f"first row of {buffer.name}")
            else:
                self.symbols_ok(i, scope, f"index of {buffer.name}")

    def paged_ok(self, buffer: Buffer, item: Paged) -> None:
        t = item.table
        if t.role is not Role.INPUT or t.dtype is not ir.DT.I32 or t.rank != 2 or t.space is not Space.HBM:
            self.fail(f"block table {t.name} of {buffer.name} must be an int32 (batch, pages) input in HBM")
        size = item.page_size
        if not (isinstance(size, int) and 1 <= size <= 256 and size & (size - 1) == 0):
            self.fail(f"page size {size} of {buffer.name} is not a power of two from 1 to 256")
        if item.per_tile:
            self.per_tile_pages.add(size)

    def declared(self, buffer: Buffer) -> None:
        if buffer.stat is not None and (buffer.space is not Space.HBM or buffer.dtype is not DT.F32):
            self.fail(f"{buffer.name} holds a per-row statistic ({buffer.stat.value}) but is "
                      f"{ir.describe_buffer(buffer)}: statistics are float32 tensors in HBM")
        known = self.buffers.get(buffer.name)
        if known is not None and known != buffer:
            self.fail(f"{buffer.name} is used as {ir.describe_buffer(buffer)} and {ir.describe_buffer(known)}")
        self.buffers.setdefault(buffer.name, buffer)

    # -- expressions ---------------------------------------------------------------------------
    def expr_ok(self, e: ir.Expr, scope: set, defined: set) -> None:
        for node in ir.walk_expr(e):
            if isinstance(node, Ref):
                self.declared(node.buffer)
                if node.buffer.space is Space.REG and node.buffer.name not in defined:
                    self.fail(f"{node.buffer.name} is read before it is assigned")
            elif isinstance(node, Load):
                self.declared(node.buffer)
                if node.buffer.space is not Space.HBM:
                    self.fail(f"load from {node.buffer.name}, which is not in HBM")
                self.index_ok(node.buffer, node.index, scope)
            elif isinstance(node, Masked):
                self.span_ok(node.query, scope)
                self.span_ok(node.key, scope)
                element = scope | _ELEMENT
                for p in node.preds:
                    self.symbols_ok(p.bound, element, "mask predicate")
                    self.symbols_ok(p.alt, element, "mask predicate")
                self.symbols_ok(node.query_group, scope, "rows per query position")
            elif isinstance(node, ir.Pointwise):
                self.span_ok(node.query, scope)
                if node.key is not None:
                    self.span_ok(node.key, scope)
                for t in node.tensors:
                    self.declared(t)
                reads = {f.func.__name__ for f in sympy.sympify(node.fn).atoms(sympy.core.function.AppliedUndef)}
                if reads - {t.name for t in node.tensors}:
                    self.fail(f"pointwise function reads {sorted(reads - {t.name for t in node.tensors})}, "
                              "which it does not list")
                self.symbols_ok(node.fn, scope | _ELEMENT | {str(ir.sym.S)}, "pointwise function")
            elif isinstance(node, ir.Sym):
                self.symbols_ok(node.expr, scope, "scalar")
            elif isinstance(node, Call) and node.op is ir.Op.CAST and node.dtype is None:
                self.fail("cast without a dtype")

    # -- statements ----------------------------------------------------------------------------
    def body_ok(self, body, scope: set, defined: set, in_serial: bool) -> None:
        for st in body:
            if isinstance(st, Loop):
                if in_serial and st.kind is LoopKind.GRID:
                    self.fail(f"grid loop over {st.var} inside a serial loop")
                for part in (st.start, st.stop, st.step):
                    self.symbols_ok(part, scope, f"bounds of loop over {st.var}")
                inner_defined = set(defined)
                self.body_ok(st.body, scope | {str(st.var)}, inner_defined, in_serial or st.kind is LoopKind.SERIAL)
                # Values a loop assigns stay visible after it (Triton carries them out).
                defined |= inner_defined
            elif isinstance(st, SequenceTile):
                t = st.offsets
                if t.role is not Role.INPUT or t.dtype is not DT.I32 or t.rank != 1 or t.space is not Space.HBM:
                    self.fail(f"sequence offsets {t.name} must be an int32 vector input in HBM")
                self.declared(t)
                self.symbols_ok(st.tile, scope, "sequence search")
                self.symbols_ok(st.block, scope, "sequence search")
                scope.add(str(st.seq))
                self.body_ok(st.facts, scope, defined, in_serial)
                self.symbols_ok(st.start_value, scope, f"first row of {st.start}")
                scope.add(str(st.start))
                self.symbols_ok(st.count, scope, "sequence length")
            elif isinstance(st, Assign):
                self.expr_ok(st.value, scope, defined)
                self.declared(st.target)
                self.shape_ok(st.target, st.value)
                defined.add(st.target.name)
                if st.target.shape == ():
                    scope.add(st.target.name)  # a scalar may appear in later bounds and indices
            elif isinstance(st, Store):
                self.expr_ok(st.value, scope, defined)
                self.declared(st.target)
                if st.target.role not in (Role.OUTPUT, Role.SCRATCH):
                    self.fail(f"store into {st.target.name}, which is not an output")
                self.index_ok(st.target, st.index, scope)
            elif isinstance(st, Softmax):
                if self.fused:
                    self.fail("a naive softmax survives the online-softmax rewrite")
                self.expr_ok(st.scores, scope, defined)
                for b in (st.probs, st.rowmax, st.rowsum):
                    self.declared(b)
                    defined.add(b.name)

    def shape_ok(self, target: Buffer, value: ir.Expr) -> None:
        if isinstance(value, (ir.Num, ir.Sym)):
            return
        shape = ir.shape_of(value)
        if shape != target.shape and len(shape) == len(target.shape):
            if any(sympy.simplify(a - b) != 0 for a, b in zip(shape, target.shape)):
                self.fail(f"{target.name} has shape {target.shape} but is assigned {shape}")
        elif shape != target.shape and len(shape) > len(target.shape):
            self.fail(f"{target.name} has rank {len(target.shape)} but is assigned rank {len(shape)}")

    @property
    def fused(self) -> bool:
        return self.stage in _ALL_FUSED_STAGES or (self.stage in _FUSED_STAGES and self.kernel.name == "attn_fwd")

    def run(self) -> None:
        self.body_ok(self.kernel.body, set(), set(), False)
        if self.fused:
            for b in self.buffers.values():
                if b.role is Role.SCRATCH:
                    self.fail(f"HBM scratch {b.name} survives the online-softmax rewrite")
                if b.space is Space.REG and b.shape and any(s in self.size_symbols for d in b.shape for s in sympy.sympify(d).free_symbols):
                    self.fail(f"register value {b.name} has a run-time size {b.shape}: tiles must be bounded")


def verify(program: ir.Program, stage: str) -> ir.Program:
    names = [k.name for k in program.kernels]
    if len(set(names)) != len(names):
        raise InternalError(f"after pass '{stage}': duplicate kernel names {names}")
    checkers = []
    for kernel in program.kernels:
        checker = _Checker(kernel, stage)
        checker.run()
        checkers.append(checker)
    _program_ok(program, stage, checkers)
    _warp_specialized_ok(program, stage)
    _triton_backward_ok(program, stage)
    return program


def _triton_backward_ok(program: ir.Program, stage: str) -> None:
    """The Triton backward's group split: attn_bwd_dkdv_split exists exactly where it may be launched, and its
    float32 parts are what the summing pass reads (one slice a part, one head dim)."""
    split = program.triton_backward.max_group_split
    kernel = next((k for k in program.kernels if k.name == "attn_bwd_dkdv_split"), None)

    def fail(message: str) -> None:
        raise InternalError(f"after pass '{stage}': triton backward {message}")

    if split < 1:
        fail(f"max_group_split {split} (1: groups never split)")
    if (split > 1) != (kernel is not None):
        fail(f"max_group_split {split} with{'' if kernel else 'out'} attn_bwd_dkdv_split")
    if kernel is None:
        return
    block = program.triton_backward.sum_block
    if block < 1 or block & (block - 1):
        fail(f"sum_block {block}: the summing pass's rows are a power of two (tl.arange)")
    if program.attr("varlen") or program.attr("head_dim_v") is not None:
        fail("split for a varlen program or two head dims: the summing pass takes dense parts of one width")
    parts = {p.name: p for p in kernel.params if p.name in ("DK_PART", "DV_PART")}
    if set(parts) != {"DK_PART", "DV_PART"} or any(p.name in ("DK", "DV") for p in kernel.params):
        fail(f"attn_bwd_dkdv_split writes {sorted(p.name for p in kernel.params if p.role is Role.OUTPUT)}; "
             "it writes DK_PART and DV_PART only")
    for p in parts.values():
        if p.dtype is not ir.DT.F32 or len(p.shape) != 5 or p.shape[-1] != sym.HEAD_DIM:
            fail(f"{p.name} is {ir.format_buffer_type(p)}; the parts are float32 (B, H_KV, GROUP_SPLIT, N_K, "
                 "HEAD_DIM)")


def _program_ok(program: ir.Program, stage: str, checkers: list[_Checker]) -> None:
    """Invariants across kernels: what one kernel writes for another, and launch constraints."""

    def fail(message: str) -> None:
        raise InternalError(f"after pass '{stage}': {message}")

    written: dict[str, Buffer] = {}
    for kernel in program.kernels:
        for p in kernel.params:
            if p.role is Role.INPUT and p.name in written and replace(written[p.name], role=Role.INPUT) != p:
                fail(f"{kernel.name} reads {p.name} as {ir.format_buffer_type(p)}, "
                     f"but it was written as {ir.format_buffer_type(written[p.name])}")
        written.update({p.name: p for p in kernel.params if p.role is Role.OUTPUT})
    # Split-KV: partial results are merged by a later kernel, never left for the caller.
    for i, kernel in enumerate(program.kernels):
        for p in kernel.params:
            if p.role is Role.OUTPUT and sym.NUM_SPLITS in p.shape:
                read = replace(p, role=Role.INPUT)
                later = [k for k in program.kernels[i + 1:] if read in k.params]
                if not later:
                    fail(f"{kernel.name} writes per-split {p.name}, which no later kernel merges")
    # Two head dims: Q, K and their gradients are head_dim wide; V, O, dO, dV and the partial outputs head_dim_v wide
    # (the same symbol unless the spec sets another).
    d_v = sym.HEAD_DIM_V if program.attr("head_dim_v") is not None else sym.HEAD_DIM
    widths = {**dict.fromkeys(_QK_BUFFERS, sym.HEAD_DIM), **dict.fromkeys(_VO_BUFFERS, d_v)}
    for kernel in program.kernels:
        for p in kernel.params:
            if p.name in widths and p.shape[-1] != widths[p.name]:
                fail(f"{kernel.name}: {p.name} is {p.shape[-1]} wide; its head dim is {widths[p.name]}")
    # Pages looked up once per tile: the launcher must keep BLOCK_N within a page.
    for checker in checkers:
        for size in checker.per_tile_pages:
            if program.attr("max_block_n") is None or program.attr("max_block_n") > size:
                fail(f"{checker.kernel.name} looks pages of {size} up once per tile, "
                     f"but the program does not bound BLOCK_N by {size} (attr max_block_n)")


_QK_BUFFERS = ("Q", "K", "DQ", "DK")
_VO_BUFFERS = ("V", "O", "DO", "DV", "O_PART")

# the head dims the Gluon templates' layouts and register budgets are written for, and their tiles' width (register
# tiles have power-of-two shapes: d=96 runs 128 columns wide, not in the varlen kernels' row-masked stores)
_GLUON_HEAD_DIMS = {64: 64, 96: 128, 128: 128, 256: 256}
_GLUON_SPLIT_HEAD_DIMS = {(192, 128): 256}  # (head dim, head_dim_v): the forward's Q and K tiles' width


_GLUON_MLA_HEAD_DIMS = ((576, 512),)  # (head dim, head_dim_v): the MLA template's Q and latent tiles (512 + 64)


def _mla_ok(program: ir.Program, fail, regs_ok) -> None:
    """The Gluon MLA decode kernel's shape: a latent paged cache whose pages hold whole blocks, wgmma's M rows a
    program, each consumer's value columns one wgmma N (at most 256)."""
    ws, m = program.warp_specialized, program.warp_specialized.mla
    if ws.forward is not None or ws.backward is not None or ws.decode is not None:
        fail("MLA decode beside another Gluon kernel: a latent program has only the decode kernel")
    page = program.attr("page_size")
    if not (program.attr("v_from_k") and program.attr("kvcache", False) and program.attr("split_kv") is not None
            and page is not None):
        fail("MLA decode on a program without a paged split-KV latent cache (v = k[:N])")
    if (program.attr("head_dim"), program.attr("head_dim_v")) not in _GLUON_MLA_HEAD_DIMS:
        fail(f"MLA decode for (head_dim, head_dim_v) ({program.attr('head_dim')}, {program.attr('head_dim_v')}); the "
             f"template takes {_GLUON_MLA_HEAD_DIMS}")
    if m.rows != 64 or m.consumers != 2 or m.block_n % 32 or page % m.block_n or m.stages < 1:
        fail(f"MLA decode: {m.rows} rows, {m.consumers} consumers, {m.block_n}-key blocks in pages of {page}, "
             f"{m.stages} stages (64 rows: wgmma's M; 2 consumers, each half a block's keys' scores and half the "
             "value columns; blocks a multiple of 32 within a page)")
    if m.min_rows < 1:
        fail(f"MLA decode from {m.min_rows} packed rows (at least 1)")
    if m.overlap and m.stages < 2:
        fail(f"MLA decode overlapped on {m.stages} stage: the next block's S reads a second tile of the ring")
    if m.defer_pv and (m.overlap or m.seesaw):
        fail("MLA decode: the deferred P V wait is the serial schedule's")
    if m.seesaw and (m.overlap or m.stages % 2):
        fail(f"MLA decode seesaw on {m.stages} stages{', overlapped' if m.overlap else ''}: its pairs of blocks take "
             "an even number of stages (a pair's two in consecutive ones), and it is not overlapped")
    regs_ok("MLA decode consumers", m.consumer_regs)
    regs_ok("MLA decode loader", m.loader_regs)
    if not 0 < m.maxnreg <= 255:
        fail(f"MLA decode: maxnreg {m.maxnreg}")


def _warp_specialized_ok(program: ir.Program, stage: str) -> None:
    """The Hopper kernels' shapes: what wgmma, setmaxnreg and the templates' descriptors need of them."""
    ws = program.warp_specialized

    def fail(message: str) -> None:
        raise InternalError(f"after pass '{stage}': warp-specialized {message}")

    def shape_ok(what: str, s: ir.GluonShape) -> None:
        if s.consumers < 1 or s.stages < 1:
            fail(f"{what}: {s.consumers} consumers, {s.stages} stages")
        if s.block_n % 16:  # the P V product's K dimension
            fail(f"{what}: BLOCK_N {s.block_n} is not a multiple of 16")
        regs_ok(what, s.consumer_regs)
        if not 0 < s.maxnreg <= 255:
            fail(f"{what}: maxnreg {s.maxnreg}")

    def regs_ok(what: str, regs: int) -> None:
        if not (24 <= regs <= 256 and regs % 8 == 0):  # setmaxnreg's range and step
            fail(f"{what}: {regs} registers a thread (setmaxnreg takes multiples of 8 in [24, 256])")

    def counts_ok(what: str, k) -> None:
        for name in ("min_keys", "short_keys", "min_scores"):
            if getattr(k, name) < 0:
                fail(f"{what}: {name} {getattr(k, name)} is negative")

    if ws.mla is not None:
        _mla_ok(program, fail, regs_ok)
        return
    d, padded, dv = program.attr("head_dim"), program.attr("head_dim_padded"), program.attr("head_dim_v")
    width = _GLUON_HEAD_DIMS.get(d) if dv is None else _GLUON_SPLIT_HEAD_DIMS.get((d, dv))
    if ws and width != padded:
        fail(f"kernels for head dim {d} (padded {padded}, head_dim_v {dv}); the templates take {_GLUON_HEAD_DIMS} "
             f"and (head dim, head_dim_v) {_GLUON_SPLIT_HEAD_DIMS} (: Q's and K's tiles' width)")
    if ws and program.attr("varlen") and (d != padded or dv is not None):
        fail(f"varlen kernels for head dim {d} at {padded} columns, head_dim_v {dv}: their row-masked stores are one "
             "head dim wide")
    if ws and dv is not None and ((ws.backward is not None and not ws.backward.wide) or ws.decode is not None):
        fail(f"backward or decode kernels for head_dim_v {dv} beside head_dim {d}: those templates take one head dim "
             "for Q, K and V (the backward's wide path excepted)")
    fp8 = program.attr("dtype") == "fp8_e4m3"
    if ws and program.attr("dtype") not in ("fp16", "bf16") and not fp8:
        fail(f"kernels for {program.attr('dtype')} inputs: wgmma takes 16-bit and e4m3 ones")
    if fp8 and (ws.backward is not None or ws.decode is not None):
        fail("backward or decode kernels for e4m3 inputs: only the forward template takes them")
    if fp8 and ws.forward is not None and any(s.block_n % 32 for s in (ws.forward.main, ws.forward.short)):
        fail("forward for e4m3 inputs: BLOCK_N is not a multiple of 32 (P V's K step on e4m3 wgmma)")
    if ws.forward is not None:
        f = ws.forward
        if program.attr("kvcache", False):
            fail("forward on a KV-cache program")
        for what, s in (("forward", f.main), ("forward short shape", f.short)):
            shape_ok(what, s)
            if s.block_m % s.consumers or (s.block_m // s.consumers) % 64:  # a consumer warpgroup's wgmma rows
                fail(f"{what}: {s.block_m // s.consumers} rows a consumer, not a multiple of 64")
        if f.short.block_m // f.short.consumers != f.main.block_m // f.main.consumers:  # one Q descriptor
            fail("forward: the short shape changes the rows a consumer takes")
        regs_ok("forward loader", f.loader_regs)
        counts_ok("forward", f)
        if f.exp2_fma and not fp8:
            fail("forward: exp2 on the FMA pipe for 16-bit inputs (only the FP8 kernel is bound by the exponentials)")
        if f.permute_p and not fp8:
            fail("forward: permute_p for 16-bit inputs (their P operand is already the scores' registers)")
        if f.exp2_fma and (f.exp2_fma != 2.0 ** -f.exp2_fma_halvings or f.exp2_fma_halvings < 1
                           or any(s.block_n * f.exp2_fma < 8 for s in (f.main, f.short))):
            # a halving splits the tile by its columns' top bit, a thread's registers only down to 8 columns
            fail(f"forward: exp2_fma {f.exp2_fma} is not 1/2^k of the key blocks in parts of at least 8 columns")
    if ws.forward is not None and ws.forward.pieces and (
            dv is None or fp8 or len(ws.forward.pieces) != 2 or sum(ws.forward.pieces) != d
            or any(w < 16 or w & (w - 1) for w in ws.forward.pieces) or ws.forward.pieces[0] < dv):
        # a piece is a TMA box and an S product's K; the output leaves through the first piece's Q buffer
        fail(f"forward: tile pieces {ws.forward.pieces}: two powers of two of at least 16 columns that add up to head "
             f"dim {d}, the first at least head_dim_v {dv} wide, for a head_dim_v spec in 16 bits")
    if ws.backward is not None:
        b = ws.backward
        if ws.forward is None or not any(k.name == "attn_bwd_dkdv" for k in program.kernels):
            fail("backward without the Gluon forward and a dK/dV kernel")
        for what, s in (("backward", b.main), ("backward short shape", b.short)):
            shape_ok(what, s)
            if s.consumers & (s.consumers - 1):  # the K/V buffers' count is a shared allocation's dimension
                fail(f"{what}: {s.consumers} consumers, not a power of two")
            # keys a consumer: its own block_n / consumers, or (wide) all of the program's, its rows split instead
            keys = s.block_n if b.wide else s.block_n // s.consumers
            if b.wide and (s.consumers != 2 or (s.block_m // s.consumers) % 8 or padded != 256
                           or b.short != b.main or b.max_group_split != 1 or b.dq_local_rows or b.dq_claim_keys
                           or not (b.dq_atomic and b.rows_smem) or b.ahead or b.split):
                fail(f"backward: the wide path takes 2 consumers of {s.block_m // 2} query rows (wgmma's N, a "
                     "multiple of 8), 256 columns, one shape, DQ_ATOMIC and ROWS_SMEM and nothing else")
            if s.block_m % 64 or s.block_n % s.consumers or keys % 64 \
                    or keys != (b.main.block_n if b.wide else b.main.block_n // b.main.consumers):
                fail(f"{what}: {s.block_m} query rows a step, {keys} keys a consumer "
                     f"(a multiple of 64, and the main shape's: one K/V descriptor)")
        if b.pieces and (not b.wide or len(b.pieces) != b.main.consumers or sum(b.pieces) != d
                         or any(w < 16 or w & (w - 1) for w in b.pieces)):
            # a piece is a TMA box and a register tile's columns, consumer i's columns of dK and dQ
            fail(f"backward: tile pieces {b.pieces}: the wide path's, one a consumer, powers of two of at least 16 "
                 f"columns that add up to head dim {d}")
        if b.short.block_m != b.main.block_m:
            fail("backward: the short shape changes the query block")
        if b.row_block < 1 or b.main.block_m % b.row_block:
            fail(f"backward: row passes of {b.row_block} rows do not divide BLOCK_M {b.main.block_m}")
        if b.max_group_split < 1:
            fail(f"backward: max_group_split {b.max_group_split} (1: groups never split)")
        if b.late_rows not in (0, 1, 2) or b.dq_local_rows < 0 or b.dq_claim_keys < 0:
            fail(f"backward: late_rows {b.late_rows}, dq_local_rows {b.dq_local_rows}, dq_claim_keys {b.dq_claim_keys}")
        if b.order_heads < 0 or (b.order_heads and not program.attr("varlen")) or (b.order_tiles < 1) != (not b.order_heads) \
                or b.order_tiles > 1 << 15:  # (attn_bwd_order_ws packs a tile's number in 15 bits)
            fail(f"backward: order_heads {b.order_heads} over {b.order_tiles} tiles (a varlen grid's key tiles ordered "
                 "k > 0 K/V heads at a time, up to 0 < order_tiles <= 2^15 a head)")
        if b.zero_whole and not program.attr("varlen"):
            fail("backward: zero_whole zeroes K and V rows past a packed sequence (varlen only)")
        if b.mask_scores and not program.attr("varlen"):
            fail("backward: mask_scores bounds the rows past a packed sequence (varlen only)")
        if b.persistent and not (program.attr("varlen") and b.order_heads and b.dq_atomic):
            fail("backward: a persistent grid takes the ordered varlen grid's work items (varlen, order_heads, dq_atomic)")
        if b.paired and (not b.wide or (b.main.stages > 1 and not b.pieces) or program.attr("varlen")):
            fail("backward: paired key tiles are the wide path's, one-stage or in pieces (not staged, not varlen)")
        if b.pair_tail_waves < 0 or (b.pair_tail_waves and not b.paired):
            fail(f"backward: pair_tail_waves {b.pair_tail_waves} (waves of single tiles ending a paired launch)")
        regs_ok("backward loader", b.loader_regs)
        counts_ok("backward", b)
    if ws.decode is not None:
        d = ws.decode
        if not program.attr("kvcache", False) or program.attr("split_kv") is None:
            fail("decode on a program without a split-KV KV cache")
        if d.block_n % 16 or d.stages < 1 or d.rows & (d.rows - 1) or not 8 <= d.rows <= 256:
            fail(f"decode: {d.block_n}-key blocks, {d.stages} stages, {d.rows} rows (wgmma's N: a power of two, 8-256)")
        # each consumer warpgroup's wgmma takes M = 64 of a block's keys (S^T) and of the head dim's rows (O^T; with
        # halves every warpgroup holds all of O^T's rows)
        rows_split = 1 if d.halves else d.consumers
        if d.consumers not in (1, 2) or d.block_n % (64 * d.consumers) or program.attr("head_dim") % (64 * rows_split):
            fail(f"decode: {d.consumers} consumer warpgroups over {d.block_n}-key blocks at head dim "
                 f"{program.attr('head_dim')} (each takes 64 keys and 64 rows of O^T a block, or a multiple)")
        q8_bad = d.q_e4m3 and (d.stage_k or d.permute_k or program.attr("kv_dtype") != "fp8_e4m3")
        if d.q_e4m3 not in (0, 1, 2) or q8_bad:
            fail("decode: q_e4m3 (0, 1 or 2 e4m3 terms) reads K's e4m3 block from shared memory as S^T's operand (an "
                 "FP8 cache, K neither staged nor permuted)")
        if d.permute_k and (d.stage_k or (d.consumers, d.block_n, program.attr("head_dim")) != (2, 128, 128)):
            fail("decode: permute_k's layout is two warpgroups' over 128 keys and 128 columns of K in registers")
        if d.halves and (d.consumers != 2 or d.stage_k or d.stage_v or program.attr("score") is not None
                         or program.attr("sinks", False) or not 0 < d.maxnreg <= 255):
            fail("decode: halves takes two consumer warpgroups with K and V^T as register operands and no score "
                 "modifier or sink (a variant's hooks take the shared state)")
        if d.p_e4m3 and (not d.q_e4m3 or d.stage_v):
            fail("decode: p_e4m3 makes both products e4m3 (with q_e4m3) and reads V^T's bytes from the ring (not "
                 "staged)")
        if d.halves:
            regs_ok("decode consumers", d.consumer_regs)
        fp8_only = d.consumers > 1 or d.widen_by_sign or d.stage_k or d.stage_v or d.permute_k or d.q_e4m3
        if fp8_only and program.attr("kv_dtype") is None:
            fail("decode: consumer warpgroups and the widening by sign or in shared memory are the FP8 cache's (a "
                 "16-bit ring keeps one consumer and reads V^T from the ring)")
        regs_ok("decode loader", d.loader_regs)
