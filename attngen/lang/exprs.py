"""The `mask`, `score`, `sinks` and `tensor` entries of a spec: located values -> the typed, checked tree
of lang/variants.py.

Masks are conditions: named masks (causal, window, prefix, chunked) and comparisons of whole-number
expressions over q, k, h, b, combined with & (and), | (or), not. Scores are numbers: softcap(C), alibi,
or an expression over s, q, k, h, b, numbers and declared tensors that depends on s. Every problem is a
SpecError at the text that has it.
"""

from __future__ import annotations

import keyword
import math
import re

from . import variants as v
from .values import TensorEntry, Value, did_you_mean, err, err_at, short, shown

INT_LIMIT = 2**31  # integer constants must fit 31 bits (int32 arithmetic in the kernels)
MAX_TENSOR_DIMS = 4
NAMED_MASKS = ("causal", "window", "prefix", "chunked")
# A declared tensor becomes a keyword argument of the kernel and a name in generated code: it may not
# shadow a variable, a function, a named mask or modifier, the kernel's other arguments, or a keyword.
RESERVED = frozenset(
    v.POSITION_VARS + (v.SCORE_VAR,) + tuple(v.FUNCTIONS) + NAMED_MASKS
    + ("none", "softcap", "alibi", "true", "false", v.ALIBI_TENSOR, v.SINKS_TENSOR)
    + ("v", "scale", "return_lse", "out", "config", "tensor", "and", "or", "not")
)
_AND, _OR = ("&", "and"), ("|", "or")
_INT = re.compile(r"[+-]?[0-9]+")


# -- numbers --------------------------------------------------------------------------------------


def _whole(val: Value, what: str, lo: int) -> int:
    """A whole-number literal >= lo (and below 2**31), as a named mask's size."""
    if val.kind != "number" or not _INT.fullmatch(val.text):
        raise err(val, f"{what} takes a whole number; got '{shown(val)}'")
    n = int(val.text) if len(val.text) <= 24 else INT_LIMIT
    if n < lo:
        raise err(val, f"{what} = {n} must be at least {lo}")
    if n >= INT_LIMIT:
        raise err(val, f"{what} = {shown(val)} is out of range; expected {lo} to {INT_LIMIT - 1}")
    return n


def _const(val: Value, in_mask: bool) -> v.Const:
    pos = (val.line, val.column)
    if _INT.fullmatch(val.text):
        n = int(val.text) if len(val.text) <= 24 else INT_LIMIT
        if abs(n) >= INT_LIMIT:
            raise err(val, f"{shown(val)} does not fit 31 bits; integer constants lie within ±{INT_LIMIT - 1}")
        return v.Const(n, pos)
    if in_mask:
        raise err(val, f"a mask compares whole numbers; got '{shown(val)}'")
    x = float(val.text)
    if not math.isfinite(x):
        raise err(val, f"{shown(val)} is not a finite number")
    return v.Const(x, pos)


# -- expressions ------------------------------------------------------------------------------------


class _Exprs:
    """Converts expression values for one entry: `in_mask` allows whole numbers only and no `s`."""

    def __init__(self, in_mask: bool, tensors: dict[str, v.TensorDecl]):
        self.in_mask = in_mask
        self.tensors = tensors
        self.read: set[str] = set()

    def names(self) -> tuple[str, ...]:
        return v.POSITION_VARS + (() if self.in_mask else (v.SCORE_VAR,))

    def expr(self, val: Value) -> tuple[v.Expr, bool]:
        """The expression and whether it is a float (else a whole number)."""
        pos = (val.line, val.column)
        if val.kind == "number":
            c = _const(val, self.in_mask)
            return c, isinstance(c.value, float)
        if val.kind == "word":
            return self.word(val)
        if val.kind == "index":
            return self.index(val)
        if val.kind == "call":
            return self.call(val)
        if val.kind == "unary" and val.text in "+-":
            arg, is_float = self.expr(val.args[0][1])
            return (v.Neg(arg, pos) if val.text == "-" else arg), is_float
        if val.kind == "binop" and val.text in v.ARITH:
            return self.binop(val)
        raise err(val, f"'{shown(val)}' is a condition; a number is expected here")

    def word(self, val: Value) -> tuple[v.Expr, bool]:
        pos = (val.line, val.column)
        if val.text in v.POSITION_VARS:
            return v.Var(val.text, pos), False
        if val.text == v.SCORE_VAR and not self.in_mask:
            return v.Var(val.text, pos), True
        if val.text == v.SCORE_VAR:
            raise err(val, "'s' (the score) is only for score expressions; a mask is over q, k, h and b")
        if val.text in self.tensors:
            dims = len(self.tensors[val.text].dims)
            raise err(val, f"tensor '{val.text}' is read with {dims} ind{'ex' if dims == 1 else 'ices'}: "
                           f"{val.text}[...]")
        where = "mask" if self.in_mask else "score"
        hint = did_you_mean(val.text, self.names())
        raise err(val, f"unknown name '{shown(val)}' in the {where}{hint}; "
                       f"expressions use {', '.join(self.names())}")

    def index(self, val: Value) -> tuple[v.Expr, bool]:
        decl = self.tensors.get(val.text)
        if decl is None:
            hint = did_you_mean(val.text, self.tensors)
            declared = f"; declared: {', '.join(self.tensors)}" if self.tensors else ""
            raise err(val, f"tensor '{short(val.text)}' is not declared{hint}{declared} "
                           f"(declare it with `tensor {val.text}[...]: fp32`)")
        if len(val.args) != len(decl.dims):
            raise err(val, f"tensor '{decl.name}' has {len(decl.dims)} dimension(s); "
                           f"'{shown(val)}' reads it with {len(val.args)} ind{'ex' if len(val.args) == 1 else 'ices'}")
        args = []
        for _, a in val.args:
            if a.kind == "slice":
                raise err(a, f"a tensor index is one position; '{shown(a)}' is a slice")
            e, is_float = self.expr(a)
            if is_float:
                raise err(a, f"a tensor index is a whole number; '{shown(a)}' is not")
            args.append(e)
        is_float = decl.dtype != "int32"
        if is_float and self.in_mask:
            raise err(val, f"a mask compares whole numbers; '{decl.name}' is {decl.dtype} (declare it int32)")
        self.read.add(decl.name)
        return v.Index(decl.name, tuple(args), (val.line, val.column)), is_float

    def call(self, val: Value) -> tuple[v.Expr, bool]:
        name = val.text
        if name in NAMED_MASKS:
            raise err(val, f"'{shown(val)}' is a mask (a condition); a number is expected here")
        if name in ("softcap", "alibi"):
            raise err(val, f"{name} is a whole score: write `score = {'softcap(C)' if name == 'softcap' else 'alibi'}`"
                           + (", or C * tanh(s / C) inside an expression" if name == "softcap" else ""))
        if name not in v.FUNCTIONS:
            hint = did_you_mean(name, v.FUNCTIONS)
            raise err(val, f"unknown function '{short(name)}'{hint}; "
                           f"known: {', '.join(v.FUNCTIONS)}")
        arity = v.FUNCTIONS[name]
        if len(val.args) != arity:
            raise err(val, f"{name} takes {arity} argument{'s' if arity > 1 else ''}; got {len(val.args)}")
        args, floats = [], []
        for key, a in val.args:
            if key is not None:
                raise err(a, f"{name} takes positional arguments, not '{key} = ...'")
            e, is_float = self.expr(a)
            args.append(e)
            floats.append(is_float)
        is_float = name in ("tanh", "exp") or any(floats)
        if is_float and self.in_mask:
            raise err(val, f"a mask compares whole numbers; '{shown(val)}' is not one")
        return v.Func(name, tuple(args), (val.line, val.column)), is_float

    def binop(self, val: Value) -> tuple[v.Expr, bool]:
        (_, av), (_, bv) = val.args
        a, fa = self.expr(av)
        b, fb = self.expr(bv)
        if val.text == "/" and self.in_mask:
            raise err(val, "a mask compares whole numbers: use // for division")
        if val.text in ("/", "//", "%") and isinstance(b, v.Const) and b.value == 0:
            raise err(bv, f"division by zero in '{shown(val)}'")
        return v.BinOp(val.text, a, b, (val.line, val.column)), fa or fb or val.text == "/"


# -- masks --------------------------------------------------------------------------------------------


def _not_condition(val: Value) -> str:
    return (f"a mask is a condition (a comparison such as q - k < 64, or a named mask: "
            f"{', '.join(NAMED_MASKS)}); '{shown(val)}' is a number")


def _mask(val: Value, exprs: _Exprs) -> v.MaskExpr:
    pos = (val.line, val.column)
    if val.kind == "binop" and val.text in _AND + _OR:
        (_, a), (_, b) = val.args
        node = v.And if val.text in _AND else v.Or
        return node(_mask(a, exprs), _mask(b, exprs), pos)
    if val.kind == "unary" and val.text == "not":
        return v.Not(_mask(val.args[0][1], exprs), pos)
    if val.kind == "binop" and val.text in v.COMPARISONS:
        (_, a), (_, b) = val.args
        return v.Compare(val.text, exprs.expr(a)[0], exprs.expr(b)[0], pos)
    if val.kind == "word" and val.text == "causal":
        return v.Causal(None, pos)
    if val.kind == "call" and val.text in NAMED_MASKS:
        return _named_mask(val)
    if val.kind == "word" and val.text in NAMED_MASKS:
        raise err(val, f"{val.text} takes a size: {_USAGE[val.text]}")
    if val.kind == "word" and val.text == "none":
        raise err(val, "none is a whole mask (mask = none); it does not combine")
    if val.kind == "word" and val.text not in exprs.names() + (v.SCORE_VAR,):
        hint = did_you_mean(val.text, NAMED_MASKS + ("none",))
        raise err(val, f"unknown mask '{shown(val)}'{hint}; expected none, causal, causal(top_left), "
                       f"causal(bottom_right), window(W), window(L, R), prefix(P), chunked(C) or a condition")
    if val.kind == "call" and val.text not in v.FUNCTIONS:
        hint = did_you_mean(val.text, NAMED_MASKS)
        raise err(val, f"unknown mask '{shown(val)}'{hint}; expected causal, window(W), window(L, R), "
                       f"prefix(P), chunked(C) or a condition")
    exprs.expr(val)  # a name or expression problem is reported as such first
    raise err(val, _not_condition(val))


_USAGE = {"causal": "causal, causal(top_left) or causal(bottom_right)", "window": "window(W) or window(L, R)",
          "prefix": "prefix(P)", "chunked": "chunked(C)"}


def _named_mask(val: Value) -> v.MaskExpr:
    name, pos = val.text, (val.line, val.column)
    for key, a in val.args:
        if key is not None and not (name == "causal" and key == "align"):
            raise err(a, f"{name} takes positional arguments, not '{key} = ...': {_USAGE[name]}")
    args = [a for _, a in val.args]
    if name == "causal":
        if len(args) != 1 or args[0].kind != "word":
            raise err(val, "causal takes one alignment: causal(top_left) or causal(bottom_right)")
        if args[0].text not in ("top_left", "bottom_right"):
            hint = did_you_mean(args[0].text, ("top_left", "bottom_right"))
            raise err(args[0], f"unknown causal alignment '{shown(args[0])}'; expected one of top_left, "
                               f"bottom_right{hint}")
        return v.Causal(args[0].text, pos)
    if name == "window" and len(args) == 1:
        size = _whole(args[0], "window", 1)
        return v.Window(size - 1, 0, size, pos)
    if name == "window" and len(args) == 2:
        return v.Window(_whole(args[0], "window left", 0), _whole(args[1], "window right", 0), None, pos)
    if len(args) != 1 or name == "window":
        raise err(val, f"{name} takes {'one or two sizes' if name == 'window' else 'one size'}: "
                       f"{_USAGE[name]}; got {len(args)}")
    if name == "prefix":
        return v.Prefix(_whole(args[0], "prefix", 1), pos)
    return v.Chunked(_whole(args[0], "chunked", 1), pos)


def mask(val: Value, tensors: dict[str, v.TensorDecl]) -> tuple[v.MaskExpr | None, set[str]]:
    """The mask a `mask = ...` value says (None for `none`) and the tensors it reads."""
    if val.kind == "word" and val.text == "none":
        return None, set()
    exprs = _Exprs(True, tensors)
    tree = _mask(val, exprs)
    aligns = {}
    for node in v.mask_nodes(tree):
        if isinstance(node, v.Causal) and node.align:
            aligns.setdefault(node.align, node)
            if len(aligns) > 1:
                raise err_at(node.pos, "causal(top_left) and causal(bottom_right) in one mask: positions "
                                         "align one way per kernel")
    if not exprs.read and not v.keeps_any(tree):
        raise err(val, f"mask '{shown(val)}' keeps no key for any query")
    return tree, exprs.read


# -- scores, sinks, tensors -------------------------------------------------------------------------------


def score(val: Value, tensors: dict[str, v.TensorDecl]) -> tuple[v.ScoreMod, set[str]]:
    """The score modifier a `score = ...` value says and the tensors it reads."""
    pos = (val.line, val.column)
    if val.kind == "word" and val.text == "alibi":
        return v.Alibi(pos), set()
    if val.kind == "call" and val.text == "softcap":
        if len(val.args) != 1 or val.args[0][0] is not None:
            raise err(val, "softcap takes one positive number: softcap(C)")
        arg = val.args[0][1]
        if arg.kind != "number":
            raise err(arg, f"softcap takes a positive number; got '{shown(arg)}'")
        cap = float(arg.text)
        if not (math.isfinite(cap) and cap > 0):
            raise err(arg, f"softcap = {shown(arg)} must be a positive, finite number")
        return v.Softcap(cap, pos), set()
    exprs = _Exprs(False, tensors)
    if val.kind in ("binop", "unary") and (val.text in v.COMPARISONS + _AND + _OR or val.text == "not"):
        raise err(val, f"a score is a number; '{shown(val)}' is a condition (conditions go in the mask)")
    expr, _ = exprs.expr(val)
    if not any(isinstance(n, v.Var) and n.name == v.SCORE_VAR for n in v.expr_nodes(expr)):
        raise err(val, "score must depend on s (the scaled score q·k * scale)")
    return v.ScoreExpr(expr, pos), exprs.read


def sinks(val: Value) -> bool:
    if val.kind != "word" or val.text not in ("true", "false"):
        raise err(val, f"sinks takes true or false; got '{shown(val)}'")
    return val.text == "true"


def tensor(entry: TensorEntry, name_limit: int) -> v.TensorDecl:
    """A checked tensor declaration (its name free, its dims B, H or positive sizes, a known dtype)."""
    name = entry.name
    if name in RESERVED or keyword.iskeyword(name) or name.startswith("__"):
        raise err(entry, f"'{name}' cannot name a tensor: it is a variable, function, mask, modifier, "
                         f"argument name or Python keyword")
    if len(name) > name_limit:
        raise err(entry, f"tensor name is {len(name)} characters long; the limit is {name_limit}")
    if len(entry.dims) > MAX_TENSOR_DIMS:
        raise err(entry.dims[MAX_TENSOR_DIMS], f"tensor '{name}' has {len(entry.dims)} dimensions; "
                                               f"the limit is {MAX_TENSOR_DIMS}")
    dims = []
    for d in entry.dims:
        if d.kind == "word" and d.text not in ("B", "H"):
            raise err(d, f"unknown dimension '{shown(d)}'; a dimension is a size or B (batch) or H (query heads)")
        dims.append(d.text if d.kind == "word" else _whole(d, "tensor dimension", 1))
    if entry.dtype.text not in v.TENSOR_DTYPES:
        hint = did_you_mean(entry.dtype.text, v.TENSOR_DTYPES)
        raise err(entry.dtype, f"unknown tensor dtype '{shown(entry.dtype)}'; expected one of "
                               f"{', '.join(v.TENSOR_DTYPES)}{hint}")
    return v.TensorDecl(name, tuple(dims), entry.dtype.text, (entry.line, entry.column))
