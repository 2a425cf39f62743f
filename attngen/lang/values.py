"""The located values a spec's parse tree becomes before any meaning is attached.

`ToEntries` (a Lark transformer over attn.lark's tree) turns the tree into a `Header` of `Entry` and
`TensorEntry` values; spec.py checks the plain keys' values and exprs.py turns `mask`, `score` and tensor
declarations into the typed tree of lang/variants.py. Both report problems with `err`, at a value's line
and column.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace

import lark

from ..errors import SpecError

# How deeply an expression's operators may nest (`a + b + c` is two deep): the checks walk the tree
# recursively, and a spec's expressions are a few operators (`q - k < 1024 and (k < 64 or q >= k)` is 4).
MAX_DEPTH = 32


@dataclass(frozen=True, slots=True)
class Value:
    """A parsed value with its position.

    kind: 'word' (text: the name), 'number' (text: as written, a sign included), 'call' (text: the name; args: (keyword or None, Value) pairs), 'index' (text:
    the tensor's name; args: (None, Value) pairs), 'binop' (text: the operator as written; args: the two
    operands), 'unary' (text: '-', '+' or 'not'; args: the operand) or 'slice' (a subscript `lo:hi`, text ':';
    args: ('start', Value) and ('stop', Value), each only where written). `source` is the text as written.
    """

    kind: str
    text: str
    line: int
    column: int
    args: tuple[tuple[str | None, "Value"], ...] = ()
    source: str = ""
    depth: int = 0


@dataclass(frozen=True, slots=True)
class Entry:
    key: str
    value: Value
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """`tensor NAME[dims]: DTYPE` as written: dims are 'word' or 'number' values."""

    name: str
    dims: tuple[Value, ...]
    dtype: Value
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class Header:
    name: str
    line: int
    column: int
    entries: tuple[Entry | TensorEntry, ...]


@lark.v_args(meta=True)
class ToEntries(lark.visitors.Transformer_NonRecursive):
    """Parse tree -> `Header` of located entries (no meaning attached yet). Not recursive: an expression
    as long as the token limit allows stays off Python's stack; `MAX_DEPTH` bounds it for the checks."""

    def __init__(self, text: str):
        super().__init__()
        self._text = text

    def _value(self, meta, kind: str, text: str, args=()) -> Value:
        depth = 1 + max((a.depth for _, a in args), default=0)
        value = Value(kind, text, meta.line, meta.column, tuple(args),
                      self._text[meta.start_pos:meta.end_pos], depth)
        if depth > MAX_DEPTH:
            raise err(value, f"expression nests more than {MAX_DEPTH} operators deep")
        return value

    def start(self, meta, items):
        return items[0]

    def kernel(self, meta, items):
        name, *entries = items
        return Header(str(name), name.line, name.column, tuple(entries))

    def entry(self, meta, items):
        key, value = items[0], items[1]
        return Entry(str(key), value, key.line, key.column)

    def tensor_decl(self, meta, items):
        keyword, name, *dims, dtype = items
        dtype_value = Value("word", str(dtype), dtype.line, dtype.column, source=str(dtype))
        return TensorEntry(str(name), tuple(dims), dtype_value, keyword.line, keyword.column)

    def word(self, meta, items):
        (tok,) = items
        return Value("word", str(tok), tok.line, tok.column, source=str(tok))

    def number(self, meta, items):
        (tok,) = items
        return Value("number", str(tok), tok.line, tok.column, source=str(tok))

    def group(self, meta, items):
        return items[0]

    def binop(self, meta, items):
        a, op, b = items
        return self._value(meta, "binop", str(op), ((None, a), (None, b)))

    def unary(self, meta, items):
        op, arg = items
        if str(op) in "+-" and arg.kind == "number" and arg.text[0] not in "+-":
            # A signed literal is one number (`scale = -1` is out of range, not an expression).
            return Value("number", str(op) + arg.text, op.line, op.column, source=str(op) + arg.text)
        return self._value(meta, "unary", str(op), ((None, arg),))

    def call(self, meta, items):
        name, *args = items
        located = tuple(a if isinstance(a, tuple) else (None, a) for a in args if a is not None)
        return self._value(meta, "call", str(name), located)

    def index(self, meta, items):
        name, *args = items
        return self._value(meta, "index", str(name), tuple((None, a) for a in args))

    def slice(self, meta, items):
        start, colon, stop = items
        args = tuple((name, v) for name, v in (("start", start), ("stop", stop)) if v is not None)
        line, column = (start.line, start.column) if start is not None else (colon.line, colon.column)
        return replace(self._value(meta, "slice", ":", args), line=line, column=column)

    def keyword(self, meta, items):
        key, value = items
        return (str(key), value)


def joined_names(v: Value) -> str | None:
    """'a+b+c' for names joined by '+' (`forward+backward`), else None."""
    if v.kind == "word":
        return v.text
    if v.kind == "binop" and v.text == "+":
        a, b = joined_names(v.args[0][1]), joined_names(v.args[1][1])
        return f"{a}+{b}" if a and b else None
    return None


def err(v, message: str) -> SpecError:
    """A SpecError at a value's (or entry's) position; `_build` in spec.py fills in the filename."""
    return SpecError(message, "<spec>", v.line, v.column)


def err_at(pos: tuple[int, int], message: str) -> SpecError:
    return SpecError(message, "<spec>", *pos)


def short(text: str) -> str:
    return text if len(text) <= 24 else text[:20] + "..."


def shown(v: Value) -> str:
    """A value as written, cut short: messages stay one readable line whatever the input."""
    if v.kind == "call":
        inner = ", ".join((f"{k}={shown(a)}" if k else shown(a)) for k, a in v.args[:4])
        return short(f"{v.text}({inner}{', ...' if len(v.args) > 4 else ''})")
    if v.kind in ("binop", "unary", "index", "slice"):
        return short(" ".join(v.source.split()))
    return short(v.text)


def did_you_mean(text: str, choices) -> str:
    close = difflib.get_close_matches(text, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""
