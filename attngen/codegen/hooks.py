"""The math the Gluon templates take from the IR: code emitted from an IR kernel into their hook points.

The Triton kernel's body is emitted from the IR statement by statement (emit.py). The Gluon kernels keep
their own pipeline (TMA, warpgroups, mbarriers, which blocks need masking at all), but the math inside it
comes from here, rendered from the same IR kernel over names the template provides, as Inductor's flex
templates take `{{modification}}`:

    scale             the value exp2 scales the raw scores by (the IR's `qk_scale`: sm_scale * log2(e))
    scaled(s)         the scores as exp2 takes them, `s` the template's raw score tile (the IR's exp2 argument)
    scaled_max(s, a)  their maximum along axis `a` (the IR's new running max, before its max with the old)
    lse(m, l)         the log-sum-exp stored from the running max `m` and sum `l` (base 2 back to e)
    lse_log2(x, lib)  a loaded log-sum-exp `x` in base 2, +inf for a row that saw no key (P = 0 there)
    value(name, names, lib)
                      the IR's value of the register or output `name` (its first definition), the IR's
                      buffers renamed to the template's by `names` (the backward's dS^T, dK, dQ)
    causal_offset     b in the IR's causal predicate `key <= query + b`, over the kernel's sizes ("0" top-left)
    diagonal(rows)    query + b for the packed row positions `rows` (query = row // group)
    keep(...)         the masked blocks' predicate over the template's key positions and diagonal positions

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
from ..ir import Call, Num, Op, Pred, PredKind, Ref
from . import exprs

_PREC = {Op.ADD: 1, Op.SUB: 1, Op.MUL: 2, Op.DIV: 2}
_IDENTIFIER = re.compile(r"(?<![.\w])[A-Za-z_]\w*")  # attributes (gl.max) are not names
_BROADCAST = {0: "[:, None]", 1: "[None, :]"}  # a vector along axis a of a 2-D tile


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

    def scaled(self, s: str) -> str:
        return self._code(_render(self.scaled_expr, {self.score.name: s}), s)

    def scaled_max(self, s: str, axis: int) -> str:
        if self.max_expr is None:
            raise InternalError(f"kernel {self.kernel.name} keeps no running max")
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

    def value(self, target: str, names: dict, lib: str = "gl") -> str:
        for st in ir.walk_stmts(self.kernel.body):
            if isinstance(st, (ir.Assign, ir.Store)) and st.target.name == target:
                return self._code(_render(st.value, names, lib=lib), *names.values())
        raise InternalError(f"kernel {self.kernel.name} defines no {target}")

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

    def keep(self, key: str, diagonal: str, key_axis: int, structural: tuple[str, ...] = ()) -> str:
        """The masked blocks' predicate: `key` the tile's key positions (a vector along `key_axis`), `diagonal`
        its query positions plus causal_offset (a vector along the other axis). The predicate kinds named in
        `structural` (PredKind values) are the template's own (say, rows past N_Q given an lse of +inf); every
        other predicate is rendered."""
        kb, db = _BROADCAST[key_axis], _BROADCAST[1 - key_axis]
        terms = []
        for p in self.preds:
            if p.kind.value in structural:
                continue
            if p.kind is PredKind.CAUSAL:
                self._offset()  # the one diagonal the template built `diagonal` from
                terms.append(f"({key}{kb} <= {diagonal}{db})")
            elif p.kind is PredKind.KEY_BOUND:
                terms.append(f"({key} < {_size(p.bound)}){kb}")
            else:
                raise InternalError(f"kernel {self.kernel.name}: no Gluon spelling for the predicate {ir.format_pred(p)}")
        if not terms:
            raise InternalError(f"kernel {self.kernel.name}: a masked block with nothing to mask")
        return self._code(" & ".join(terms), key, diagonal)

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
    scaled = exp.args[0]
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


def _size(expr) -> str:
    """An integer expression over the kernel's sizes, positive terms first (`n_k - N_Q`, as a person writes it)."""
    expr = sympy.sympify(expr)
    if isinstance(expr, sympy.Add):
        terms = sorted(expr.args, key=lambda t: (t.could_extract_minus_sign(), sympy.default_sort_key(t)))
        text = _size(terms[0])
        for t in terms[1:]:
            text += f" - {_size(-t)}" if t.could_extract_minus_sign() else f" + {_size(t)}"
        return text
    return exprs.gluon(expr)


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
    if isinstance(e, Call) and e.op is Op.INF_IF_EMPTY:
        x = _expr(e.args[0], names, axis, lib)[0]
        return f'{lib}.where({x} == float("-inf"), float("inf"), {x})', 3
    raise InternalError(f"no Gluon hook spelling for {ir.format_expr(e)}")
