"""The math the Gluon templates take from the IR: code emitted from an IR kernel into their hook points.

The Triton kernel's body is emitted from the IR statement by statement (emit.py). The Gluon kernels keep
their own pipeline (TMA, warpgroups, mbarriers, which blocks need masking at all), but the math inside it
comes from here, rendered from the same IR kernel over names the template provides, as Inductor's flex
templates take `{{modification}}`:

    scale             the value exp2 scales the raw scores by (the IR's `qk_scale`: sm_scale * log2(e))
    scaled(s)         the scores as exp2 takes them, `s` the template's raw score tile (the IR's exp2 argument;
                      a score modifier's Pointwise over the raw scores, with `query` / `key` the positions it reads)
    scaled_max(s, a)  their maximum along axis `a` (the IR's new running max, before its max with the old)
    lse(m, l)         the log-sum-exp stored from the running max `m` and sum `l` (base 2 back to e)
    lse_log2(x, lib)  a loaded log-sum-exp `x` in base 2, +inf for a row that saw no key (P = 0 there)
    value(name, names, lib)
                      the IR's value of the register or output `name` (its first definition), the IR's
                      buffers renamed to the template's by `names` (the backward's dS^T, dK, dQ); with `score`,
                      over the template's raw score tile (a score modifier's derivative on dS^T)
    causal_offset     b in the IR's causal predicate `key <= query + b`, over the kernel's sizes ("0" top-left)
    diagonal(rows)    query + b for the packed row positions `rows` (query = row // group)
    keep(...)         the masked blocks' predicate over the template's key positions and diagonal positions
                      (and, with `query`, the row positions a variant's BAND/EXPR predicates read as q_idx)
    key_blocks(lib)   a query tile's key blocks (variant programs): the first visited, the unmasked
                      [full_lo, full_hi) and how many, from the IR's key loops after causal-skip
    sink(load)        the sink's logit in base 2 (the IR's `sink`), `load` the template's read of SINKS[h]
    split_keys(rows)  a decoding split's slice (split-kv's definitions) and its key loops' range, for a program
                      over every packed row of a K/V head (the Gluon decode kernel)
    query_blocks(lib) a key tile's query blocks (the dK/dV kernel of variant programs), as key_blocks gives a
                      query tile's key blocks, from the IR's query loops after causal-skip
    reads()           a score modifier's tensor reads over the batch and query head (ALiBi's slope; the backward's
                      GROUP * hkv + g is the query head `h`), loaded once where the template holds b and h
                      (`per_head`: those that hold h, or those that do not, loaded before a loop over heads)
    scalar_loads()    the kernel's loads of one value a program (an FP8 spec's descales), as code over b, h and GROUP

A mask or score modifier added to the IR reaches these strings, so every Gluon kernel takes it with the
Triton one, without editing the templates' math; an IR the hooks cannot spell raises InternalError here
instead of generating a kernel that silently drops it. To extend: a new predicate kind gets its term in
`keep` (over `key`, `diagonal`, or the IR's sizes), a new score op its spelling in `_expr`; an expression
over the head or batch index uses the IR's names (h, b), which a template lists in `in_scope` where it
holds them. Every identifier in a hook's code is a name the
template gave (in the call, or `in_scope`: the IR values it keeps under the IR's name, such as qk_scale), a
size or scalar the IR kernel declares, or `gl` / `tl`: nothing else from a spec gets in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import sympy

from .. import ir
from ..errors import InternalError
from ..analysis.distance import DistanceBias, distance_bias
from ..ir import Call, Num, Op, Pred, PredKind, Ref, sym
from . import exprs

_PREC = {Op.ADD: 1, Op.SUB: 1, Op.MUL: 2, Op.DIV: 2}
_IDENTIFIER = re.compile(r"(?<![.\w])[A-Za-z_]\w*")  # attributes (gl.max) are not names
_BROADCAST = {0: "[:, None]", 1: "[None, :]"}  # a vector along axis a of a 2-D tile
# the attention kernels' own inputs, which the templates read themselves (the rest: a variant's tensors)
_OPERANDS = ("Q", "K", "V", "DO", "LSE", "DELTA", "SEQLENS", "BLOCK_TABLE")


@dataclass(frozen=True)
class ScoreHooks:
    """What one IR kernel says about its scores: their scale into exp2's base 2, the running max and
    the masked blocks' predicates (in the IR's order), for the Gluon template that implements it."""

    kernel: ir.KernelIR    # the IR kernel the hooks are read from
    scale_value: ir.Expr   # qk_scale's value
    scaled_expr: ir.Expr   # exp2's argument before the running max is subtracted
    max_expr: ir.Expr | None  # the block's scaled row max (None: a kernel without a running max)
    score: ir.Buffer       # the raw score tile those two read
    lse_value: ir.Expr | None  # what the kernel stores as the log-sum-exp (None: it stores none)
    lse_read: ir.Expr | None   # a loaded log-sum-exp as exp2 takes it (None: it loads none)
    preds: tuple[Pred, ...]
    query_group: sympy.Expr
    in_scope: tuple[str, ...]  # IR values the template holds under the IR's names (qk_scale, decoding's n_k)

    # -- the scale and the softmax's exponent ------------------------------------------------------
    @property
    def scale(self) -> str:
        return self._code(_render(self.scale_value, {}))

    def scaled(self, s: str, query: str | None = None, key: str | None = None, key_axis: int = 1) -> str:
        """The scores `s` as exp2 takes them; `query` / `key` the tile's row and key positions (vectors along
        the axes other than / of `key_axis`), needed where a score modifier reads q_idx / k_idx."""
        elements = _elements(query, key, key_axis, _float_positions(self.scaled_expr))
        reads = _reads(self.scaled_expr).values()  # the template loads them first (reads())
        return self._code(_render(self.scaled_expr, {self.score.name: s, **elements}), s, *elements.values(), *reads)

    @property
    def modded(self) -> bool:
        """Whether a score modifier (a Pointwise of the IR) sits between the raw scores and exp2."""
        return any(isinstance(n, ir.Pointwise) for n in ir.walk_expr(self.scaled_expr))

    @property
    def distance(self) -> DistanceBias | None:
        """The score modifier as alpha * S + coef * |q - k + shift| + rest where that is linear on every block the mask
        keeps (analysis/distance.py: causal ALiBi, the context-parallel blocks' ALiBi), exp2's argument that modifier
        alone; None otherwise."""
        bias = self.any_distance
        return bias if bias is not None and bias.linear_everywhere(self.preds) else None

    @property
    def any_distance(self) -> DistanceBias | None:
        """The score modifier as a distance bias, linear on every block or not (`distance`); None otherwise."""
        if not isinstance(self.scaled_expr, ir.Pointwise):
            return None
        return distance_bias(self.scaled_expr.fn)

    def distance_code(self, s: str, by_block: bool = False) -> dict | None:
        """`distance`'s pieces as code, the template's raw score tile `s`: `scaled` (alpha times the scaled scores, no
        positions), `coef`, `shift` and `rest` (scalars over the tile's reads and the sizes; `rest` None where it is
        0), `everywhere` (whether one sign holds on every block). None where there is no such modifier (`by_block`:
        a distance bias of either kind, for a kernel that tests each block's sign)."""
        bias = self.any_distance if by_block else self.distance
        if bias is None:
            return None
        reads = {read: sympy.Symbol(name) for read, name in _reads(self.scaled_expr).items()}
        given = [s, *(str(n) for n in reads.values())]
        value = exprs.parenthesized(_render(self.scaled_expr.value, {self.score.name: s}))
        alpha = "" if float(bias.alpha) == 1.0 else f"{exprs.parenthesized(_elementwise(bias.alpha, {}))} * "

        def scalar(e):
            code = _elementwise(sympy.sympify(e).xreplace(reads), {})
            return self._code(exprs.parenthesized(code), *given)

        return {"scaled": self._code(alpha + value, *given), "coef": scalar(bias.coef), "shift": scalar(bias.shift),
                "rest": None if bias.rest == 0 else scalar(bias.rest), "everywhere": bias.linear_everywhere(self.preds)}

    def scaled_max(self, s: str, axis: int) -> str:
        if self.max_expr is None:
            raise InternalError(f"kernel {self.kernel.name} keeps no running max")
        if self.modded:  # the IR's max is over the modified tile: the template takes it over scaled(s)
            raise InternalError(f"kernel {self.kernel.name}: a modified score's max is the max of scaled(s)")
        return self._code(_render(self.max_expr, {self.score.name: s}, axis), s)

    def lse(self, m: str, l: str) -> str:
        if self.lse_value is None:
            raise InternalError(f"kernel {self.kernel.name} stores no log-sum-exp")
        refs = list(dict.fromkeys(n.buffer.name for n in ir.walk_expr(self.lse_value) if isinstance(n, Ref)))
        if len(refs) != 2:
            raise InternalError(f"kernel {self.kernel.name}: a log-sum-exp of {refs}, not of a max and a sum")
        return self._code(_render(self.lse_value, dict(zip(refs, (m, l)))), m, l)

    def lse_log2(self, x: str, lib: str = "gl") -> str:
        if self.lse_read is None:
            raise InternalError(f"kernel {self.kernel.name} loads no log-sum-exp")
        loads = {n.buffer.name: x for n in ir.walk_expr(self.lse_read) if isinstance(n, ir.Load)}
        return self._code(_render(self.lse_read, loads, lib=lib), x)

    def value(self, target: str, names: dict, lib: str = "gl", default: str | None = None, score: str | None = None,
              query: str | None = None, key: str | None = None, key_axis: int = 1) -> str:
        """`default` (if given) where the kernel defines no `target`. With `score` (the template's raw score tile, as
        scaled() takes it), the tiles the kernel computes from the raw product (the backward's raw_t, which a score
        modifier's derivative reads) are spelled over it, and `query` / `key` are the positions it reads."""
        for st in ir.walk_stmts(self.kernel.body):
            if isinstance(st, (ir.Assign, ir.Store)) and st.target.name == target:
                if score is None:
                    return self._code(_render(st.value, names, lib=lib), *names.values())
                value = _over_raw(st.value, self.score, [a for a in ir.walk_stmts(self.kernel.body)
                                                        if isinstance(a, ir.Assign)], keep=set(names))
                elements = _elements(query, key, key_axis, _float_positions(value))
                code = _render(value, {**names, self.score.name: score, **elements}, lib=lib)
                return self._code(code, *names.values(), score, *elements.values(), *_reads(value).values())
        if default is not None:
            return self._code(default, *names.values())
        raise InternalError(f"kernel {self.kernel.name} defines no {target}")

    def scalar_loads(self, b: str = "b", h: str = "h") -> dict:
        """The kernel's loads of one value a program (an FP8 spec's descales, Q_DESCALE[b, h // GROUP]: pass
        descale), by buffer name, as code over the template's batch `b` and query head `h` (and GROUP): the names
        `value` takes to spell the registers computed from them (qk_scale, v_descale) where the template holds a
        tile's b and h."""
        out = {}
        for st in ir.walk_stmts(self.kernel.body):
            for e in ir.stmt_exprs(st):
                for n in ir.walk_expr(e):
                    if (not isinstance(n, ir.Load) or n.buffer.name in _OPERANDS or n.buffer.name in out
                            or not all(isinstance(i, sympy.Expr) for i in n.index)):
                        continue
                    index = [_elementwise(i, {str(sym.b): b, str(sym.q_head): h}) for i in n.index]
                    ptr = " + ".join([n.buffer.name] + [f"{i if i.isidentifier() else exprs.parenthesized(i)} * {st}"
                                                         for i, st in zip(index, _strides(n.buffer))])
                    out[n.buffer.name] = self._code(f"gl.load({ptr})", b, h, ptr)
        return out

    def defines(self, target: str) -> bool:
        """Whether the kernel assigns the register `target` (a step the template takes only where the IR has it)."""
        return any(isinstance(st, ir.Assign) and st.target.name == target for st in ir.walk_stmts(self.kernel.body))

    @property
    def sinks(self) -> bool:
        return any(st.target.name == "sink" for st in ir.walk_stmts(self.kernel.body) if isinstance(st, ir.Assign))

    def sink(self, load: str) -> str:
        """The sink's logit as the online softmax's extra step takes it (base 2), `load` the template's read
        of the head's SINKS entry (a Load of the IR, or a packed row's read of SINKS at its own query head)."""
        loads = {}
        for st in ir.walk_stmts(self.kernel.body):
            if isinstance(st, ir.Assign) and st.target.name == "sink":
                loads.update({n.buffer.name: load for n in ir.walk_expr(st.value) if isinstance(n, ir.Load)})
                loads.update({name: load for read, name in _reads(st.value).items() if read.func.__name__ == "SINKS"})
        return self.value("sink", loads)

    @property
    def tensors(self) -> tuple:
        """The run-time tensors the kernel reads beside Q, K and V (a variant's: declared tensors, ALiBi's slopes,
        the sinks; a varlen kernel's CU_SEQLENS_Q, CU_SEQLENS_K and SEQLENS_K), in the order of the kernel's
        parameters."""
        return tuple(p for p in self.kernel.params if p.role is ir.Role.INPUT and p.name not in _OPERANDS)

    @property
    def tensor_params(self) -> str:
        """The Gluon kernel's parameters for `tensors`: each one's pointer and strides (", SINKS, stride_sinks_0")."""
        return "".join(f", {t.name}" + "".join(f", {n}" for n in _strides(t)) for t in self.tensors)

    def reads(self, b: str = "b", h: str = "h", per_head: bool | None = None) -> list[tuple[str, str]]:
        """(name, code) for each tensor read of the score modifier: one value per tile (its indices are over the
        batch and query head alone: `b`, `h` as the template holds them; `h` a vector of the packed rows' heads
        where a tile's rows span a group), loaded under the name `scaled` gives it; a read outside the tensor
        reads 0 (the spec language's rule). `per_head`: only the reads whose indices hold the query head (True) or
        do not (False: a loop over a group's heads loads them once, before it); None: all."""
        out = []
        for read, name in _reads(self.scaled_expr).items():
            if per_head is not None and any(i.has(sym.q_head) for i in _head_args(read)) != per_head:
                continue
            buf = next(t for t in self.tensors if t.name == read.func.__name__)
            index = [_elementwise(i, {str(sym.b): b, str(sym.q_head): h}) for i in _head_args(read)]
            ptr = " + ".join([buf.name] + [f"({i}) * {st}" for i, st in zip(index, _strides(buf))])
            # b < B and h < H hold in every tile (and the template holds neither B nor H where it loads)
            inside = " & ".join(f"({i} >= 0) & ({i} < {_size(d)})" for i, d, e in zip(index, buf.shape, _head_args(read))
                                if (e, d) not in ((sym.b, sym.B), (sym.q_head, sym.H)))
            load = f"gl.load({ptr}, mask={inside}, other=0.0)" if inside else f"gl.load({ptr})"
            out.append((name, self._code(f"{load}.to(gl.float32)", b, h, "mask other", self.tensor_params)))
        return out

    def split_keys(self, rows: str) -> dict:
        """One split's keys for a program over every packed row of a K/V head (the Gluon decode kernel), as
        code over split, n_k, N_Q, GROUP, NUM_SPLITS, BLOCK_N and `rows` (the padded row count): the IR's
        slice definitions after split-kv (`keys_per_split`, `split_start`, `split_stop`, in that order, each
        reading the ones before) and its key loops' range after causal-skip: `lo`, `hi` (the first key visited
        and one past the last) and `full_lo`, `full_hi` (the unmasked loop's). The IR's loops are a tile's of
        BLOCK_M rows from start_m: here the tile of rows [0, rows)."""
        tile = {sym.start_m: sympy.Integer(0), sym.BLOCK_M: sympy.Symbol(rows, integer=True, positive=True)}
        names = ("keys_per_split", "split_start", "split_stop")
        defs = {st.target.name: st.value for st in ir.walk_stmts(self.kernel.body)
                if isinstance(st, ir.Assign) and st.target.name in names}
        if set(defs) != set(names) or not all(isinstance(v, ir.Sym) for v in defs.values()):
            raise InternalError(f"kernel {self.kernel.name}: no split-kv slice {names} to read the split's keys from")
        loops = _loops(self.kernel, sym.start_n)
        full = [lp for lp in loops if not _masks(lp)]
        if len(full) != 1:
            raise InternalError(f"kernel {self.kernel.name}: key loops {[lp.note for lp in loops]}, not one unmasked "
                                "range between masked ones")
        values = {name: defs[name].expr for name in names}
        values.update(lo=loops[0].start, full_lo=full[0].start, full_hi=full[0].stop, hi=loops[-1].stop)
        given = f"split n_k {rows} " + " ".join(names)
        return {name: self._code(_size(sympy.sympify(e).xreplace(tile)), given) for name, e in values.items()}

    def key_blocks(self, lib: str = "gl") -> dict:
        """A query tile's key blocks as code over start_m, N_Q, N_K, BLOCK_M, BLOCK_N: `lo` (the first block
        visited), `full_lo` and `full_hi` (the unmasked blocks [full_lo, full_hi); the others visited are
        masked) and `hi` (one past the last visited). Read from the IR's key loops after causal-skip (masked,
        unmasked, masked, each stepping BLOCK_N from a multiple of it): the tile visits the blocks of their union.
        `lib` gl: Gluon code; "" : Python (the tests evaluate it)."""
        return self._blocks(_loops(self.kernel, sym.start_n), "BLOCK_N", "start_m", lib)

    def query_blocks(self, lib: str = "gl") -> dict:
        """A key tile's query blocks (the dK/dV kernel of a variant program) as code over start_n, N_Q, N_K,
        BLOCK_M, BLOCK_N: `lo`, `full_lo`, `full_hi`, `hi` as key_blocks() gives them for a query tile, read
        from the IR's query loops after causal-skip (masked, unmasked, masked, each stepping BLOCK_M)."""
        return self._blocks(_loops(self.kernel, sym.start_m), "BLOCK_M", "start_n", lib)

    def _blocks(self, loops, block_name: str, given: str, lib: str) -> dict:
        full = [lp for lp in loops if not _masks(lp)]
        if len(full) != 1:
            raise InternalError(f"kernel {self.kernel.name}: loops {[lp.note for lp in loops]}, not one unmasked "
                                "range between masked ones")
        block = next(d.symbol for d in self.kernel.symbols if str(d.symbol) == block_name)
        index = {"lo": loops[0].start, "full_lo": full[0].start, "full_hi": full[0].stop}
        code = {name: _size(_in_blocks(start, block), lib) for name, start in index.items()}
        code["hi"] = _size(sym.CeilDiv(loops[-1].stop, block), lib)
        given = given if lib else f"{given} cdiv max min"  # Python's builtins
        return {name: self._code(text, given) for name, text in code.items()}

    # -- the mask ------------------------------------------------------------------------------------
    @property
    def causal(self) -> bool:
        return any(p.kind is PredKind.CAUSAL for p in self.preds)

    @property
    def causal_offset(self) -> str:
        return self._code(_size(self._offset()))

    def diagonal(self, rows: str) -> str:
        """query + causal_offset for the tile rows `rows` (packed: query = row // group)."""
        query = rows if self.query_group == 1 else f"{rows} // {_size(self.query_group)}"
        return self._code(query if self._offset() == 0 else f"{self.causal_offset} + {query}", rows)

    def _offset(self) -> sympy.Expr:
        bounds = {p.bound for p in self.preds if p.kind is PredKind.CAUSAL}
        if len(bounds) != 1:
            raise InternalError(f"kernel {self.kernel.name}: the Gluon templates take one causal diagonal, not {bounds}")
        return sympy.sympify(bounds.pop())

    def keep(self, key: str, diagonal: str | None, key_axis: int, structural: tuple[str, ...] = (),
             query: str | None = None) -> str:
        """The masked blocks' predicate: `key` the tile's key positions (a vector along `key_axis`), `diagonal`
        its query positions plus causal_offset (a vector along the other axis), or `query` its query positions
        (the IR's q_idx, as a variant's BAND and EXPR predicates read them; the diagonal is then query plus the
        CAUSAL predicate's own offset). The predicate kinds named in `structural` (PredKind values) are the
        template's own (say, rows past N_Q given an lse of +inf); every other predicate is rendered."""
        kb, db = _BROADCAST[key_axis], _BROADCAST[1 - key_axis]
        elements = _elements(query, key, key_axis)
        terms = []
        for p in self.preds:
            if p.kind.value in structural:
                continue
            if p.kind is PredKind.CAUSAL and query is not None:
                offset = "" if sympy.sympify(p.bound) == 0 else f" + ({_size(p.bound)})"
                terms.append(f"({key}{kb} <= {query}{db}{offset})")
            elif p.kind is PredKind.CAUSAL:
                self._offset()  # the one diagonal the template built `diagonal` from
                terms.append(f"({key}{kb} <= {diagonal}{db})")
            elif p.kind is PredKind.KEY_BOUND:
                terms.append(f"({key} < {_size(p.bound)}){kb}")
            elif p.kind is PredKind.QUERY_BOUND and query is not None:
                terms.append(f"({query} < {_size(p.bound)}){db}")
            elif p.kind in (PredKind.BAND, PredKind.EXPR) and query is not None:
                cond = sympy.Le(p.bound, 0, evaluate=False) if p.kind is PredKind.BAND else p.bound
                terms.append(_elementwise(cond, elements))
            else:
                raise InternalError(f"kernel {self.kernel.name}: no Gluon spelling for the predicate {ir.format_pred(p)}")
        if not terms:
            raise InternalError(f"kernel {self.kernel.name}: a masked block with nothing to mask")
        return self._code(" & ".join(terms), key, *(x for x in (diagonal, query) if x is not None))

    def _code(self, code: str, *given: str) -> str:
        """`code`, once every identifier in it is a given name's, a symbol's of the kernel, or gl's."""
        allowed = {"gl", "tl", "None", "float", "_gl_tanh"} | {str(d.symbol) for d in self.kernel.symbols} | set(self.in_scope)
        for text in given:
            allowed |= set(_IDENTIFIER.findall(text))
        unknown = set(_IDENTIFIER.findall(re.sub(r'"[^"]*"', "", code))) - allowed  # float("-inf") holds no name
        if unknown:
            raise InternalError(f"kernel {self.kernel.name}: hook code {code!r} names {sorted(unknown)}")
        return code


def score_hooks(kernel, in_scope: tuple[str, ...] = ("qk_scale",)) -> ScoreHooks:
    """The hooks of an IR kernel with an online softmax in exp2 (the forward, the decode kernel) or the
    backward's recomputed P (exp2 of the scaled scores less the log-sum-exp); `in_scope`: the IR values
    the template holds under the IR's own names."""
    assigns = [st for st in ir.walk_stmts(kernel.body) if isinstance(st, ir.Assign)]
    exp = next((st.value.args[0] for st in assigns if isinstance(st.value, Call) and st.value.op is Op.EXP2
                and len(st.target.shape) == 2), None)
    if exp is None or not (isinstance(exp, Call) and exp.op is Op.SUB):
        raise InternalError(f"kernel {kernel.name}: no exp2 of scaled scores for the Gluon hooks")
    scaled = _modifier(exp.args[0], assigns)
    score = next(n.buffer for n in ir.walk_expr(scaled) if isinstance(n, Ref) and len(n.buffer.shape) == 2)
    scale_buffers = [n.buffer for n in ir.walk_expr(scaled) if isinstance(n, Ref) and n.buffer.shape == ()]
    values = {st.target.name: st.value for st in assigns}
    if len(scale_buffers) != 1 or scale_buffers[0].name not in values:
        raise InternalError(f"kernel {kernel.name}: the scores' scale is not one scalar the kernel computes")
    max_expr = next((st.value.args[1] for st in assigns if isinstance(st.value, Call) and st.value.op is Op.MAX
                     and any(isinstance(n, Call) and n.op is Op.ROWMAX for n in ir.walk_expr(st.value.args[1]))), None)
    lse_value = next((st.value for st in ir.walk_stmts(kernel.body) if isinstance(st, ir.Store)
                      and any(isinstance(n, Call) and n.op is Op.LOG2 for n in ir.walk_expr(st.value))), None)
    lse_read = next((st.value for st in assigns
                     if any(isinstance(n, Call) and n.op is Op.INF_IF_EMPTY for n in ir.walk_expr(st.value))), None)
    preds: list[Pred] = []
    groups = set()
    for st in ir.walk_stmts(kernel.body):
        for e in ir.stmt_exprs(st):
            for node in ir.walk_expr(e):
                if isinstance(node, ir.Masked):
                    preds += [p for p in node.preds if p not in preds]
                    groups.add(node.query_group)
    if len(groups) > 1:
        raise InternalError(f"kernel {kernel.name}: masks with different row groupings {groups}")
    return ScoreHooks(kernel=kernel, scale_value=values[scale_buffers[0].name], scaled_expr=scaled,
                      max_expr=max_expr, score=score, lse_value=lse_value, lse_read=lse_read,
                      preds=tuple(preds), query_group=groups.pop() if groups else sympy.Integer(1),
                      in_scope=tuple(in_scope))


def _size(expr, lib: str = "gl") -> str:
    """An integer expression over the kernel's sizes, positive terms first (`n_k - N_Q`, as a person writes it);
    `lib` "gl": as Gluon code, "tl": as Triton code, "": as Python."""
    expr = sympy.sympify(expr)
    if isinstance(expr, sympy.Add):
        terms = sorted(expr.args, key=lambda t: (t.could_extract_minus_sign(), sympy.default_sort_key(t)))
        text = _size(terms[0], lib)
        for t in terms[1:]:
            text += f" - {_size(-t, lib)}" if t.could_extract_minus_sign() else f" + {_size(t, lib)}"
        return text
    if not lib:
        return exprs.host(expr)
    return exprs.gluon(expr) if lib == "gl" else exprs.device(expr)


def _modifier(scaled: ir.Expr, assigns) -> ir.Expr:
    """exp2's argument with a score modifier in view: where the scores exp2 reads are a tile the kernel
    assigned a Pointwise of the raw product (a score modifier, under its mask), that Pointwise over the
    raw product, which the template holds under the assigned tile's name."""
    if not isinstance(scaled, Ref) or len(scaled.buffer.shape) != 2:
        return scaled
    value = next((st.value for st in assigns if st.target.name == scaled.buffer.name), None)
    if isinstance(value, ir.Masked):
        value = value.value
    if not isinstance(value, ir.Pointwise):
        raise InternalError(f"exp2 reads the tile {scaled.buffer.name}, not a score modifier's value")
    for read in _reads(value):
        if {str(x) for a in _head_args(read) for x in a.free_symbols} - {str(sym.b), str(sym.q_head)}:
            raise InternalError(f"no Gluon hook spelling for the read {read}: it varies within a tile")
    return _over_raw(value, scaled.buffer, assigns)


def _over_raw(e: ir.Expr, raw: ir.Buffer, assigns, keep=frozenset()) -> ir.Expr:
    """`e` over the raw score tile `raw`: the product (DOT_T) becomes `raw`, and a tile the kernel assigns from the
    product (the backward's raw_t = dot_t(k, q) * qk_scale) its value over `raw`; the tiles named in `keep` (the
    template's own) stay."""
    products = {st.target.name: st.value for st in assigns if len(st.target.shape) == 2
                and any(isinstance(n, Call) and n.op is Op.DOT_T for n in ir.walk_expr(st.value))}

    def to_raw(node):
        if isinstance(node, Call) and node.op is Op.DOT_T:
            return Ref(raw)
        if isinstance(node, Ref) and node.buffer.name in products and node.buffer.name not in keep:
            return ir.map_expr(products[node.buffer.name], to_raw)
        return node

    return ir.map_expr(e, to_raw)


def _reads(e) -> dict:
    """The tensor reads of the Pointwise in `e` (applied sympy functions named after their buffers), each with the
    name the hooks load it under (the buffer's in lower case, numbered past the first)."""
    pointwise = [n for n in ir.walk_expr(e) if isinstance(n, ir.Pointwise)]
    atoms = sorted({a for p in pointwise for a in sympy.sympify(p.fn).atoms(sympy.core.function.AppliedUndef)},
                   key=sympy.default_sort_key)
    names = {}
    for read in atoms:
        base = read.func.__name__.lower()
        names[read] = base if base not in names.values() else f"{base}_{len(names)}"
    return names


def _head_args(read) -> list[sympy.Expr]:
    """A tensor read's indices with the backward's query head (GROUP * hkv + g, its loop over the group's heads)
    as the IR's q_head, which the templates hold as `h`."""
    g = {str(s): s for a in read.args for s in sympy.sympify(a).free_symbols}
    args = [sympy.sympify(a) for a in read.args]
    if "g" in g and "hkv" in g:
        args = [sympy.expand(a.subs(g["g"], sym.q_head - sym.GROUP * g["hkv"])) for a in args]
    return args


def _strides(buffer) -> list[str]:
    return [f"stride_{buffer.name.lower()}_{i}" for i in range(len(buffer.shape))]


def _in_blocks(start, block):
    """A multiple of `block` (as causal-skip writes its loops' starts: block * k, their max and min, 0) over it."""
    start = sympy.sympify(start)
    if start == 0:
        return start
    if isinstance(start, (sympy.Max, sympy.Min)):
        return type(start)(*(_in_blocks(a, block) for a in start.args))
    if isinstance(start, sympy.Mul) and block in start.args:
        factors = list(start.args)
        factors.remove(block)
        return sympy.Mul(*factors)
    raise InternalError(f"a key loop starting at {start}, not a multiple of {block}")


def _masks(loop) -> bool:
    """Whether a loop's body masks its scores."""
    return any(isinstance(n, ir.Masked) for st in ir.walk_stmts(loop.body) for e in ir.stmt_exprs(st)
               for n in ir.walk_expr(e))


def _loops(kernel, var) -> list:
    """The serial loops over `var` of an IR kernel, in order: a forward query tile's key loops (start_n), a dK/dV
    key tile's query loops (start_m)."""
    return [st for st in ir.walk_stmts(kernel.body) if isinstance(st, ir.Loop) and st.kind is ir.LoopKind.SERIAL
            and st.var == var]


def _elements(query: str | None, key: str | None, key_axis: int, as_float: bool = False) -> dict:
    """The IR's element symbols as the template's position vectors, broadcast over a 2-D tile (`as_float`:
    converted to float32 before the broadcast, see `_float_positions`)."""
    kb, qb = _BROADCAST[key_axis], _BROADCAST[1 - key_axis]
    cast = ".to(gl.float32)" if as_float else ""
    out = {}
    if query is not None:
        out[str(sym.q_idx)] = f"{query}{cast}{qb}"
    if key is not None:
        out[str(sym.k_idx)] = f"{key}{cast}{kb}"
    return out


# The operations through which a score modifier may read positions as floats: their result is a float either way.
_FLOAT_READS = (sympy.Symbol, sympy.Add, sympy.Mul, sympy.Abs, sympy.Min, sympy.Max, sympy.Pow, sympy.tanh, sympy.exp)


def _float_positions(e: ir.Expr) -> bool:
    """Whether the score modifiers in `e` read the positions (q_idx, k_idx) only through sums, products, abs,
    min, max and float functions (ALiBi's slope * |q - k|; no division, modulo, comparison or tensor index):
    then the template's position vectors are converted to float32 once each and broadcast, instead of one
    integer-to-float conversion per score (a quarter-rate instruction on Hopper, beside the softmax's exp2).
    Exact below 2**24 positions, and within one part in 2**24 beyond."""
    positions = {sym.q_idx, sym.k_idx}
    fns = [sympy.sympify(n.fn) for n in ir.walk_expr(e) if isinstance(n, ir.Pointwise)]
    return any(fn.free_symbols & positions for fn in fns) and all(
        isinstance(node, _FLOAT_READS) for fn in fns for node in sympy.preorder_traversal(fn)
        if isinstance(node, sympy.Basic) and node.free_symbols & positions)


def _elementwise(expr, elements: dict) -> str:
    """A sympy expression over element symbols (q_idx, k_idx) and sizes as Gluon code over the template's tiles."""
    expr = sympy.sympify(expr)
    free = {str(s) for s in expr.free_symbols}
    missing = free & {str(sym.q_idx), str(sym.k_idx), str(sym.q_head), str(sym.b)} - set(elements)
    if missing:
        raise InternalError(f"no Gluon spelling for {expr}: the template gives no {sorted(missing)}")
    placeholders = {s: sympy.Symbol(f"__{s.name}__") for s in expr.free_symbols if str(s) in elements}
    code = exprs.gluon(expr.xreplace(placeholders))
    for s, ph in placeholders.items():
        code = code.replace(ph.name, elements[str(s)])
    return code


def _render(e: ir.Expr, names: dict, axis: int | None = None, lib: str = "gl") -> str:
    """An IR tile expression as Gluon code (`lib` tl: Triton's), buffers and loads renamed by `names`;
    reductions along `axis`."""
    code, _ = _expr(e, names, axis, lib)
    return code


def _expr(e: ir.Expr, names: dict, axis, lib: str) -> tuple[str, int]:
    if isinstance(e, Ref):
        return names.get(e.buffer.name, e.buffer.name), 3
    if isinstance(e, ir.Load) and e.buffer.name in names:
        return names[e.buffer.name], 3
    if isinstance(e, Num):
        return repr(e.value), 3
    if isinstance(e, ir.Sym) and str(e.expr) in names:  # a scalar argument the template holds under another name
        return names[str(e.expr)], 3
    if isinstance(e, ir.Sym):
        return exprs.gluon(e.expr), 2
    if isinstance(e, Call) and e.op in _PREC:
        (a, pa), (b, pb) = (_expr(x, names, axis, lib) for x in e.args)
        prec = _PREC[e.op]
        a = f"({a})" if pa < prec else a
        b = f"({b})" if pb < prec or (pb == prec and e.op in (Op.SUB, Op.DIV)) else b
        return f"{a} {e.op.value} {b}", prec
    if isinstance(e, Call) and e.op in (Op.EXP2, Op.LOG2):
        return f"{lib}.{e.op.value}({_expr(e.args[0], names, axis, lib)[0]})", 3
    if isinstance(e, Call) and e.op is Op.ROWMAX and axis is not None:
        return f"{lib}.max({_expr(e.args[0], names, axis, lib)[0]}, {axis})", 3
    if isinstance(e, ir.Pointwise):
        value = exprs.parenthesized(_expr(e.value, names, axis, lib)[0])
        fn = sympy.sympify(e.fn)
        placeholder = sympy.Symbol("__S__")
        reads = {read: sympy.Symbol(name) for read, name in _reads(e).items()}  # loaded per tile (ScoreHooks.reads)
        code = _elementwise(fn.xreplace({sym.S: placeholder, **reads}), names)
        return exprs.parenthesized(code.replace(placeholder.name, value)), 3
    if isinstance(e, Call) and e.op is Op.FINITE_OR_ZERO:
        x = _expr(e.args[0], names, axis, lib)[0]
        return f'{lib}.where({x} == float("-inf"), 0.0, {x})', 3
    if isinstance(e, Call) and e.op is Op.ONE_IF_ZERO:
        x = _expr(e.args[0], names, axis, lib)[0]
        return f"{lib}.where({x} == 0.0, 1.0, {x})", 3
    if isinstance(e, Call) and e.op is Op.INF_IF_EMPTY:
        x = _expr(e.args[0], names, axis, lib)[0]
        return f'{lib}.where({x} == float("-inf"), float("inf"), {x})', 3
    raise InternalError(f"no Gluon hook spelling for {ir.format_expr(e)}")
