"""IR kernel -> the body of a `@triton.jit` function, statement by statement.

The emitter decides nothing about the algorithm: every loop, mask, load and arithmetic step is in
the IR it is given. It only spells them in Triton: grid loops become `tl.program_id` axes, spans
become `offs_* = start + tl.arange(0, size)`, loads and stores become pointer arithmetic over the
strides the launcher passes, rank-1 operands are broadcast against tiles by matching sizes, and
loop-invariant base pointers are computed once, after the grid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from .. import ir
from ..ir import sym
from ..errors import InternalError
from ..ir import (Assign, Buffer, Call, Load, Loop, LoopKind, Masked, Num, Op, Packed, Paged, PredKind, Ragged, Ref,
                  SequenceTile, Span, Store, SymKind)
from . import exprs
from ..passes.grid import grid_path

_DIM_LABELS = {"B": "b", "H": "h", "H_KV": "h", "N_Q": "n", "N_K": "n", "HEAD_DIM": "d", "HEAD_DIM_V": "d",
               "NUM_PAGES": "page", "PAGE_SIZE": "slot", "MAX_PAGES": "page", "SPLITS": "split",
               "NUM_SPLITS": "split", "GROUP_SPLIT": "part", "TOTAL_Q": "n", "TOTAL_K": "n", "B + 1": "b"}

_UNARY = {Op.EXP: "tl.exp", Op.EXP2: "tl.math.exp2", Op.LOG: "tl.log", Op.LOG2: "tl.math.log2"}
_PREC = {Op.ADD: 1, Op.SUB: 1, Op.MUL: 2, Op.DIV: 2}


def stride_names(buffer: Buffer) -> list[str]:
    labels = []
    for i, d in enumerate(buffer.shape):
        label = _DIM_LABELS.get(str(d), f"dim{i}")
        labels.append(label if label not in labels else f"{label}{i}")
    return [f"stride_{buffer.name.lower()}_{label}" for label in labels]


@dataclass
class GridAxis:
    var: sympy.Symbol
    axis: int
    count: str          # host expression: number of programs along this axis
    code: str           # device statement defining var


@dataclass
class KernelCode:
    name: str
    doc: str
    params: list[Buffer]
    strides: list[tuple[Buffer, list[str]]]
    sizes: list[ir.SymbolDecl]
    floats: list[ir.SymbolDecl]
    constexprs: list[ir.SymbolDecl]
    grid: list[GridAxis]
    body: str
    derived: list[tuple[str, str]] = field(default_factory=list)
    descriptors: list[tuple[Buffer, list[str]]] = field(default_factory=list)
    """Buffers some loads read through TMA descriptors, each with its block shape (host code)."""

    @property
    def signature(self) -> list[str]:
        out = [p.name for p in self.params]
        out.extend(f"{p.name}_DESC" for p, _ in self.descriptors)
        for _, names in self.strides:
            out.extend(names)
        out.extend(str(d.symbol) for d in self.sizes)
        out.extend(str(d.symbol) for d in self.floats)
        out.extend(f"{d.symbol}: tl.constexpr" for d in self.constexprs)
        if self.descriptors:
            out.append("USE_TMA: tl.constexpr")
        return out

    @property
    def unspecialized(self) -> list[str]:
        """Arguments Triton must not specialise on (value 1, divisibility by 16): the sizes that
        vary per call, and the batch and head strides of per-row statistics (log-sum-exp, delta),
        which are multiples of the query length: specialised, a length that is not a multiple of
        16 would compile a second binary. The tiles' own strides stay specialised (they are
        multiples of the head dim, and their divisibility lets loads vectorise)."""
        sizes = [str(d.symbol) for d in self.sizes if not d.specialize]
        return sizes + [n for p, names in self.strides if p.stat is not None for n in names[:-1]]

    def size_source(self, decl: ir.SymbolDecl) -> str:
        """Host code computing a size symbol from the launcher's tensors."""
        for p in self.params:
            for i, d in enumerate(p.shape):
                if d == decl.symbol:
                    return f"{p.name.lower()}.shape[{i}]"
        if decl.derive is not None:
            return exprs.host(decl.derive)
        raise InternalError(f"no tensor dimension carries {decl.symbol}, and it has no derivation")


class _Scope:
    def __init__(self, parent: "_Scope | None" = None):
        self.parent = parent
        self.spans: dict[str, Span] = {}
        self.pages: dict[tuple, str] = {}  # page numbers already looked up in this scope

    def _find(self, table: str, key):
        scope = self
        while scope is not None:
            found = getattr(scope, table)
            if key in found:
                return found[key]
            scope = scope.parent
        return None

    def page(self, key: tuple) -> str | None:
        return self._find("pages", key)

    def span(self, name: str) -> Span | None:
        return self._find("spans", name)


class KernelEmitter:
    def __init__(self, kernel: ir.KernelIR):
        self.kernel = kernel
        self.lines: list[str] = []
        self.depth = 1
        self.scope = _Scope()
        self.params = {p.name: p for p in kernel.params}
        self.strides = {p.name: stride_names(p) for p in kernel.params}
        self.reg_names = {st.target.name for st in ir.walk_stmts(kernel.body) if isinstance(st, Assign)}
        self.bases: dict[tuple, str] = {}
        self.grid_vars: set = set()
        self.fixed: set[str] = set()  # scalars a program reads before its base pointers (its sequence's)
        self.sizes = {d.symbol for d in kernel.symbols}

    # -- output ----------------------------------------------------------------------------------
    def line(self, text: str) -> None:
        self.lines.append("    " * self.depth + text)

    # -- the kernel ------------------------------------------------------------------------------
    def emit(self) -> KernelCode:
        grid_loops = grid_path(self.kernel, "codegen")
        body = grid_loops[-1].body
        if any(isinstance(st, Loop) and st.kind is LoopKind.GRID for st in body):
            raise InternalError(f"{self.kernel.name}: statements beside a grid loop")
        # A launch grid has 3 axes: more grid loops fold, outermost first, into the last axis.
        axes = [[loop] for loop in grid_loops]
        if len(axes) > 3:
            axes = [grid_loops[:-2]] + axes[-2:]
        grid = []
        self.line("# -- which tile this program computes --")
        for axis, loops in enumerate(reversed(axes)):
            grid.append(self._grid_axis(axis, loops))
            self.grid_vars.update(loop.var for loop in loops)
        for g in sorted(grid, key=lambda g: -g.axis):
            for code in g.code.split("\n"):
                self.line(code)
        if body and isinstance(body[0], SequenceTile):
            self.sequence_tile(body[0])
            body = body[1:]
        self._hoist_bases(body)
        self.block(body)
        decls = self.kernel.symbols
        code = KernelCode(
            name=self.kernel.name,
            doc=self.kernel.doc,
            params=list(self.kernel.params),
            strides=[(p, self.strides[p.name]) for p in self.kernel.params],
            sizes=[d for d in decls if d.kind is SymKind.SIZE],
            floats=[d for d in decls if d.kind is SymKind.FLOAT],
            constexprs=[d for d in decls if d.kind is SymKind.CONSTEXPR],
            grid=sorted(grid, key=lambda g: g.axis),
            body="\n".join(self.lines),
            descriptors=self._descriptors(),
        )
        return code

    def _descriptors(self) -> list[tuple[Buffer, list[str]]]:
        """The buffers read through descriptors, with the block shape their loads read."""
        found = {}
        for st in ir.walk_stmts(self.kernel.body):
            if isinstance(st, Assign):
                for e in ir.walk_expr(st.value):
                    if isinstance(e, Load) and e.descriptor:
                        block = [exprs.host(it.size) if isinstance(it, Span) else "1" for it in e.index]
                        if found.setdefault(e.buffer.name, (e.buffer, block))[1] != block:
                            raise InternalError(f"{self.kernel.name}: {e.buffer.name} read through descriptors "
                                                "with two block shapes")
        return [found[p.name] for p in self.kernel.params if p.name in found]

    def _grid_axis(self, axis: int, loops: list[Loop]) -> GridAxis:
        """One launch-grid axis for one grid loop, or for several folded (mixed radix, inner fastest)."""
        counts = [sym.CeilDiv(loop.stop - loop.start, loop.step) for loop in loops]
        pid = f"tl.program_id({axis})"
        lines = []
        if len(loops) > 1:
            lines.append(f"pid_{axis} = {pid}")
            pid = f"pid_{axis}"
        for j, (loop, count) in enumerate(zip(reversed(loops), reversed(counts))):
            outermost = j == len(loops) - 1
            index = pid if outermost else f"{pid} % {exprs.device(count)}"
            if not outermost:
                pid = f"{pid} // {exprs.device(count)}" if j == 0 else f"({pid}) // {exprs.device(count)}"
            value = index if loop.step == 1 else f"{exprs.parenthesized(index) if len(loops) > 1 else index} * {exprs.device(loop.step)}"
            if not exprs.is_zero(loop.start):
                value = f"{exprs.device(loop.start)} + {value}"
            lines.append(f"{loop.var} = {value}")
        count = " * ".join(exprs.host(c) for c in counts)
        return GridAxis(loops[0].var, axis, count, "\n".join(lines))

    def sequence_tile(self, st: SequenceTile) -> None:
        """Find the program's sequence (a binary search over the sequences' first tiles), read its facts,
        and return from a program past the sequence's last tile."""
        first = f"tl.load({st.offsets.name} + mid.to(tl.int64) * {self.strides[st.offsets.name][0]})"
        block = exprs.device(st.block)
        self.line(f"# -- which sequence: the last b whose first tile {st.offsets.name}[b] // {block} + b is at or "
                  f"before this program's --")
        self.line("lo = tl.full([], 0, dtype=tl.int32)")
        self.line(f"hi = tl.full([], {exprs.device(sym.B)}, dtype=tl.int32)")
        self.line("while lo < hi:")
        self.line("    mid = (lo + hi) // 2")
        self.line(f"    if {first} // {block} + mid <= {st.tile}:")
        self.line("        lo = mid + 1")
        self.line("    else:")
        self.line("        hi = mid")
        self.line(f"{st.seq} = lo - 1")
        self.grid_vars.add(st.seq)
        for fact in st.facts:
            self.assign(fact)
            self.fixed.add(fact.target.name)
        self.line(f"{st.start} = {exprs.device(st.start_value)}")
        self.fixed.add(str(st.start))
        self.line(f"if {st.start} >= {exprs.device(st.count)}:  # past the sequence's last tile")
        self.line("    return")

    # -- base pointers -----------------------------------------------------------------------------
    def _scalar_part(self, buffer: Buffer, index) -> tuple:
        """(buffer dimension, index) of every scalar index item: the tile's fixed coordinates."""
        part, dim = [], 0
        for item in index:
            if isinstance(item, Paged):
                dim += 2
                continue
            if isinstance(item, Packed):
                head, rows = (dim + 1, dim) if item.rows_first else (dim, dim + 1)
                part.append((head, item.head))  # the group's first head; rows add their member
                if not exprs.is_zero(item.first):
                    part.append((rows, item.first))  # the sequence's first row; rows add their position
                dim += 2
                continue
            if isinstance(item, Ragged):
                part.append((dim, item.first))  # the sequence's first row; the span adds the position
                dim += 1
                continue
            if not isinstance(item, Span):
                part.append((dim, item))
            dim += 1
        return tuple(part)

    def _hoistable(self, part) -> bool:
        for _, item in part:
            for s in sympy.sympify(item).free_symbols:
                if s not in self.grid_vars and s not in self.sizes and str(s) not in self.fixed:
                    return False
        return True

    def _base_code(self, buffer: Buffer, part) -> str:
        strides = self.strides[buffer.name]
        terms = [buffer.name]
        for dim, item in part:
            if exprs.is_zero(item):
                continue
            text = exprs.device(item)
            text = f"{text if isinstance(item, sympy.Symbol) else exprs.parenthesized(text)}.to(tl.int64)"
            terms.append(f"{text} * {strides[dim]}")
        return " + ".join(terms)

    def _hoist_bases(self, body) -> None:
        accesses = []
        for st in ir.walk_stmts(body):
            if isinstance(st, Store):
                accesses.append((st.target, st.index))
            for x in ir.stmt_exprs(st):
                accesses.extend((e.buffer, e.index) for e in ir.walk_expr(x) if isinstance(e, Load))
        accesses += [(item.table, (item.batch, item.span)) for _, index in list(accesses)
                     for item in index if isinstance(item, Paged)]
        emitted = False
        for buffer, index in accesses:
            part = self._grid_part(self._scalar_part(buffer, index))
            key = (buffer.name, part)
            if key in self.bases:
                continue
            taken = set(self.bases.values())
            name = f"{buffer.name.lower()}_base"
            n = 1
            while name in taken or name in self.reg_names:
                n += 1
                name = f"{buffer.name.lower()}_base{n}"
            if not emitted:
                self.line("# -- base pointers of this program's rows --")
                emitted = True
            self.line(f"{name} = {self._base_code(buffer, part)}")
            self.bases[key] = name

    def _grid_part(self, part) -> tuple:
        """The coordinates fixed for the whole program (grid variables and sizes): hoistable."""
        return tuple(p for p in part if self._hoistable((p,)))

    def base(self, buffer: Buffer, index) -> str:
        part = self._scalar_part(buffer, index)
        fixed = self._grid_part(part)
        name = self.bases.get((buffer.name, fixed))
        base = name if name is not None else f"({self._base_code(buffer, fixed)})"
        # Coordinates that vary inside the program (a serial loop's variable, e.g. the query head of
        # a GQA group) are added at the use, in 64 bits like the base: head x head stride can pass 2**31.
        strides = self.strides[buffer.name]
        for dim, item in part:
            if (dim, item) not in fixed:
                # NOTE: tl.cast, not .to(): in the interpreter a loop variable is a Python int.
                base += f" + tl.cast({exprs.device(item)}, tl.int64) * {strides[dim]}"
        return base

    # -- spans -------------------------------------------------------------------------------------
    def use_span(self, sp: Span) -> str:
        known = self.scope.span(sp.name)
        if known is None or (known.start, known.size) != (sp.start, sp.size):
            start = "" if exprs.is_zero(sp.start) else f"{exprs.device(sp.start)} + "
            self.line(f"{sp.name} = {start}tl.arange(0, {exprs.device(sp.size)})")
            self.scope.spans[sp.name] = sp
        return sp.name

    # -- memory ------------------------------------------------------------------------------------
    def address(self, buffer: Buffer, index) -> tuple[str, str | None]:
        """Pointer expression and mask (or None) for a tile of `buffer`."""
        tile = [it for it in index if isinstance(it, (Span, Paged, Packed, Ragged))]
        rank = len(tile)
        strides = self.strides[buffer.name]
        terms, conds = [self.base(buffer, index)], []
        tile_axis = 0
        dim = 0
        for item in index:
            if isinstance(item, (Span, Ragged)):
                item = item.span if isinstance(item, Ragged) else item
                name = self.use_span(item)
                b = _broadcast(tile_axis, rank)
                terms.append(f"{name}{b} * {strides[dim]}")
                if item.limit is not None:
                    conds.append(f"({name}{b} < {exprs.device(item.limit)})")
                tile_axis += 1
                dim += 1
            elif isinstance(item, Paged):
                name = self.use_span(item.span)
                b = _broadcast(tile_axis, rank)
                page = self.page_lookup(item)
                terms.append(f"{page} * {strides[dim]}" if item.per_tile else f"{page}{b} * {strides[dim]}")
                terms.append(f"({name} % {item.page_size}){b} * {strides[dim + 1]}")
                if item.span.limit is not None:
                    conds.append(f"({name}{b} < {exprs.device(item.span.limit)})")
                tile_axis += 1
                dim += 2
            elif isinstance(item, Packed):
                name = self.use_span(item.span)
                b = _broadcast(tile_axis, rank)
                group = exprs.device(item.group)
                head, rows = (dim + 1, dim) if item.rows_first else (dim, dim + 1)
                terms.append(f"({name} % {group}){b} * {strides[head]}")
                terms.append(f"({name} // {group}){b} * {strides[rows]}")
                if item.span.limit is not None:
                    conds.append(f"({name}{b} < {exprs.device(item.span.limit)})")
                tile_axis += 1
                dim += 2
            else:
                dim += 1
        return " + ".join(terms), (" & ".join(conds) if conds else None)

    def page_lookup(self, item: Paged) -> str:
        """The page number(s) of a paged tile, looked up once per scope: K and V share them."""
        table = item.table
        span = item.span
        key = (table.name, item.batch, span, item.per_tile)
        known = self.scope.page(key)
        if known is not None:
            return known
        name = f"page_{span.name.removeprefix('offs_')}"
        t_strides = self.strides[table.name]
        row = self.base(table, (item.batch, span))
        if item.per_tile:
            # The tile lies inside one page (BLOCK_N <= page size): one entry for all its rows.
            start = exprs.device(span.start)
            start = start if isinstance(span.start, sympy.Symbol) else exprs.parenthesized(start)
            self.line(f"{name} = tl.load({row} + ({start} // {item.page_size}) * {t_strides[1]}).to(tl.int64)")
        else:
            mask = f", mask={span.name} < {exprs.device(span.limit)}, other=0" if span.limit is not None else ""
            self.line(f"{name} = tl.load({row} + ({span.name} // {item.page_size}) * {t_strides[1]}{mask}).to(tl.int64)")
        self.scope.pages[key] = name
        return name

    def load(self, e: Load) -> str:
        ptr, mask = self.address(e.buffer, e.index)
        if mask is None:
            pointers = f"tl.load({ptr})"
        else:
            pointers = f"tl.load({ptr}, mask={mask}, other={_literal(e.fill)})"
        if not e.descriptor:
            return pointers
        # The block's corner, and the tile without the descriptor's unit dimensions; rows past the
        # tensor's end read as 0 either way (passes/tma.py). The launcher picks the form (USE_TMA).
        corner = ", ".join(exprs.device(it.start) if isinstance(it, Span) else exprs.device(it) for it in e.index)
        tile = ", ".join(exprs.device(it.size) for it in e.index if isinstance(it, Span))
        return f"{e.buffer.name}_DESC.load([{corner}]).reshape({tile}) if USE_TMA else {pointers}"

    # -- expressions -------------------------------------------------------------------------------
    def hoist_loads(self, e: ir.Expr) -> dict:
        """Give every load inside an expression its own line and name; return the renaming."""
        names = {}
        for node in ir.walk_expr(e):
            if isinstance(node, Load) and node not in names:
                base = node.buffer.name.lower()
                name = base if base not in self.reg_names else f"{base}_tile"
                self.line(f"{name} = {self.load(node)}")
                names[node] = name
        return names

    def expr(self, e: ir.Expr, loads: dict) -> tuple[str, int]:
        """Code and precedence (3 = atom) of a tile expression."""
        if isinstance(e, Ref):
            return e.buffer.name, 3
        if isinstance(e, Num):
            return _literal(e.value), 3
        if isinstance(e, ir.Sym):
            return exprs.device(e.expr), 2
        if isinstance(e, Load):
            return loads[e], 3
        if isinstance(e, Masked):
            keep = self.mask(e)
            value, _ = self.expr(e.value, loads)
            return f"tl.where({keep}, {value}, {_literal(e.fill)})", 3
        if isinstance(e, ir.Pointwise):
            return self.pointwise(e, loads), 1
        op, args = e.op, e.args
        if op in _PREC:
            return self.binary(e, loads)
        if op is Op.MAX:
            (a, _), (b, _) = self.broadcast_args(e, loads)
            return f"tl.maximum({a}, {b})", 3
        if op in _UNARY:
            return f"{_UNARY[op]}({self.expr(args[0], loads)[0]})", 3
        if op is Op.ROWMAX:
            return f"tl.max({self.expr(args[0], loads)[0]}, 1)", 3
        if op is Op.ROWSUM:
            return f"tl.sum({self.expr(args[0], loads)[0]}, 1)", 3
        if op is Op.COLMAX:
            return f"tl.max({self.expr(args[0], loads)[0]}, 0)", 3
        if op is Op.COLSUM:
            return f"tl.sum({self.expr(args[0], loads)[0]}, 0)", 3
        if op is Op.TRANS:
            return f"tl.trans({self.expr(args[0], loads)[0]})", 3
        if op is Op.CAST:
            return f"{self.atom(args[0], loads)}.to({e.dtype.triton})", 3
        if op in (Op.DOT, Op.DOT_T, Op.DOT_ACC):
            a = self.expr(args[0], loads)[0]
            b = self.expr(args[1], loads)[0]
            if op is Op.DOT_T:
                b = f"tl.trans({b})"
            extra = f", {self.expr(args[2], loads)[0]}" if op is Op.DOT_ACC else ""
            prec = ', input_precision="ieee"' if e.dtype is ir.DT.F32 else ""
            return f"tl.dot({a}, {b}{extra}{prec})", 3
        if op is Op.FINITE_OR_ZERO:
            x = self.atom(args[0], loads)
            return f"tl.where({x} == float(\"-inf\"), 0.0, {x})", 3
        if op is Op.ONE_IF_ZERO:
            x = self.atom(args[0], loads)
            return f"tl.where({x} == 0.0, 1.0, {x})", 3
        if op is Op.INF_IF_EMPTY:
            x = self.atom(args[0], loads)
            return f"tl.where({x} == float(\"-inf\"), float(\"inf\"), {x})", 3
        raise InternalError(f"no Triton spelling for {op}")

    def atom(self, e: ir.Expr, loads: dict) -> str:
        code, prec = self.expr(e, loads)
        return code if prec == 3 else f"({code})"

    def broadcast_args(self, e: Call, loads: dict) -> list[tuple[str, int]]:
        shape = ir.shape_of(e)
        out = []
        for a in e.args:
            code, prec = self.expr(a, loads)
            own = ir.shape_of(a)
            if len(own) == 1 and len(shape) == 2:
                code = (code if prec == 3 else f"({code})") + _vector_broadcast(own[0], shape)
                prec = 3
            out.append((code, prec))
        return out

    def binary(self, e: Call, loads: dict) -> tuple[str, int]:
        (a, pa), (b, pb) = self.broadcast_args(e, loads)
        prec = _PREC[e.op]
        if pa < prec:
            a = f"({a})"
        if pb < prec or (pb == prec and e.op in (Op.SUB, Op.DIV)):
            b = f"({b})"
        return f"{a} {e.op.value} {b}", prec

    def mask(self, m: Masked) -> str:
        q = self.use_span(m.query)
        if m.query_group != 1:  # packed GQA rows: the query position is row // group
            q = f"({q} // {exprs.device(m.query_group)})"
        k = self.use_span(m.key)
        qb, kb = ("[:, None]", "[None, :]") if m.query_axis == 0 else ("[None, :]", "[:, None]")
        conds = []
        for p in m.preds:
            if p.kind is PredKind.CAUSAL:
                offset = "" if exprs.is_zero(p.bound) else f" + ({exprs.device(p.bound)})"
                conds.append(f"({k}{kb} <= {q}{qb}{offset})")
            elif p.kind is PredKind.KEY_BOUND:
                conds.append(f"({k}{kb} < {exprs.device(p.bound)})")
            elif p.kind is PredKind.QUERY_BOUND:
                conds.append(f"({q}{qb} < {exprs.device(p.bound)})")
            else:
                cond = sympy.sympify(p.bound)
                conds.append(sympy.Le(cond, 0, evaluate=False) if p.kind is PredKind.BAND else cond)
        self.elements(sympy.And(*(c for c in conds if not isinstance(c, str))), q, k, qb, kb, m.query_group)
        self.line("keep = " + " & ".join(c if isinstance(c, str) else exprs.device(c) for c in conds))
        return "keep"

    def elements(self, expr, q: str, k: str | None, qb: str, kb: str, group) -> None:
        """Define the element symbols `expr` uses (sym.py: q_idx, k_idx, q_head) as tiles of this scope."""
        free = sympy.sympify(expr).free_symbols
        if sym.q_idx in free:
            self.line(f"q_idx = {q}{qb}")
        if sym.k_idx in free:
            self.line(f"k_idx = {k}{kb}")
        if sym.q_head in free:
            if group == 1:
                self.line("q_head = h")
            else:  # packed rows: row r is head h_kv * GROUP + r % GROUP of the group
                rows = q.removeprefix("(").split(" // ")[0]
                self.line(f"q_head = (h_kv * {exprs.device(group)} + {rows} % {exprs.device(group)}){qb}")

    def pointwise(self, e: ir.Pointwise, loads: dict) -> str:
        """A pointwise function of a tile: its element symbols and tensor reads defined, then fn."""
        value, _ = self.expr(e.value, loads)
        name = self.fresh("pw")
        self.line(f"{name} = {value}")
        q = self.use_span(e.query)
        if e.query_group != 1:
            q = f"({q} // {exprs.device(e.query_group)})"
        k = self.use_span(e.key) if e.key is not None else None
        qb, kb = ("[:, None]", "[None, :]") if e.query_axis == 0 else ("[None, :]", "[:, None]")
        if e.key is None:
            qb = ""
        fn = sympy.sympify(e.fn)
        self.elements(fn, q, k, qb, kb, e.query_group)
        buffers = {b.name: b for b in e.tensors}
        for read in sorted(fn.atoms(sympy.core.function.AppliedUndef), key=sympy.default_sort_key):
            buf = buffers[read.func.__name__]
            strides = self.strides[buf.name]
            ptr = " + ".join([buf.name] + [f"({exprs.device(i)}) * {s}" for i, s in zip(read.args, strides)])
            inside = " & ".join(f"({exprs.device(i)} >= 0) & ({exprs.device(i)} < {exprs.device(d)})"
                                for i, d in zip(read.args, buf.shape))
            got = self.fresh(buf.name.lower())
            # Reads outside the tensor's extent read 0 (the spec language's rule).
            self.line(f"{got} = tl.load({ptr}, mask={inside}, other=0).to(tl.float32)")
            fn = fn.subs(read, sympy.Symbol(got))
        return exprs.device(fn.subs(sym.S, sympy.Symbol(name)))

    def fresh(self, base: str) -> str:
        """A new local name `base_N` for generated temporaries."""
        self.counter = getattr(self, "counter", 0) + 1
        return f"{base}_{self.counter}"

    # -- statements --------------------------------------------------------------------------------
    def block(self, body) -> None:
        for st in body:
            self.stmt(st)

    def stmt(self, st: ir.Stmt) -> None:
        if isinstance(st, ir.Comment):
            self.line(f"# -- {st.text} --")
        elif isinstance(st, Loop):
            self.loop(st)
        elif isinstance(st, Assign):
            self.assign(st)
        elif isinstance(st, Store):
            if st.accumulate:
                raise InternalError("an accumulating store reached code generation; recompute should have removed it")
            loads = self.hoist_loads(st.value)
            value, prec = self.expr(st.value, loads)
            if ir.dtype_of(st.value) is not st.target.dtype:
                value = f"{value if prec == 3 else f'({value})'}.to({st.target.dtype.triton})"
            ptr, mask = self.address(st.target, st.index)
            tail = f", mask={mask}" if mask else ""
            self.line(f"tl.store({ptr}, {value}{tail})")
        else:
            raise InternalError(f"no code for {type(st).__name__}; a pass should have removed it")

    def assign(self, st: Assign) -> None:
        target, value = st.target, st.value
        if isinstance(value, Num):
            if target.shape:
                dims = ", ".join(exprs.device(d) for d in target.shape)
                if value.value == 0.0:
                    self.line(f"{target.name} = tl.zeros([{dims}], dtype={target.dtype.triton})")
                else:
                    self.line(f"{target.name} = tl.full([{dims}], {_literal(value.value)}, dtype={target.dtype.triton})")
            else:  # a typed scalar: a plain literal would change type when a loop reassigns it
                self.line(f"{target.name} = tl.full([], {_literal(value.value)}, dtype={target.dtype.triton})")
            return
        if isinstance(value, Load):
            self.line(f"{target.name} = {self.load(value)}")
            return
        loads = self.hoist_loads(value)
        code, _ = self.expr(value, loads)
        self.line(f"{target.name} = {code}")

    def loop(self, loop: Loop) -> None:
        if loop.kind is LoopKind.GRID:
            raise InternalError(f"{self.kernel.name}: grid loop over {loop.var} below the top")
        note = f"  # {loop.note}" if loop.note else ""
        step = exprs.device(loop.step)
        self.line(f"for {loop.var} in range({exprs.device(loop.start)}, {exprs.device(loop.stop)}, {step}):{note}")
        self.depth += 1
        self.scope = _Scope(self.scope)
        if loop.aligned and loop.step != 1:
            self.line(f"{loop.var} = tl.multiple_of({loop.var}, {step})")
        self.block(loop.body)
        self.scope = self.scope.parent
        self.depth -= 1


def _broadcast(axis: int, rank: int) -> str:
    if rank == 1:
        return ""
    return "[:, None]" if axis == 0 else "[None, :]"


def _vector_broadcast(size, shape) -> str:
    if size == shape[0]:
        return "[:, None]"
    if size == shape[1]:
        return "[None, :]"
    raise InternalError(f"cannot broadcast a vector of {size} against a tile of {shape}")


def _literal(value: float) -> str:
    if value == float("inf"):
        return 'float("inf")'
    if value == float("-inf"):
        return 'float("-inf")'
    return repr(float(value))
