"""Parsing and checking `.attn` specs.

`parse(text, filename)` turns spec text into a `Spec`: the grammar (attn.lark) fixes the shape, a
Lark Transformer (values.py) turns the tree into located `Entry` values, and `_build` checks every key
and value (the mask, score, sinks and tensor entries through exprs.py, into the variant tree of
variants.py), raising `SpecError` at the offending line and column. A `Spec` is frozen; its canonical text (every
key, defaults filled in, comments and layout dropped) is its identity, and the hash of that text is
the kernel's cache key.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import keyword
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import lark

from ..errors import SpecError, UnsupportedError
from . import exprs
from .values import Entry, Header, TensorEntry, ToEntries, Value, joined_names
from .values import did_you_mean as _did_you_mean
from .values import err as _err
from .values import short as _short
from .values import shown as _shown
from .variants import Causal, Variant
from .variants import alignment as variant_alignment

MAX_SPEC_BYTES = 1 << 20
MAX_NAME_LENGTH = 64
# A spec setting every key is about 60 tokens and nests one call deep (an expression a few more). These bounds keep the parser's
# work (and the recursion of Lark's tree transformer) small whatever the input: a 1 MiB file of
# entries would otherwise take the LALR parser ten seconds, and deep nesting overflows the stack.
MAX_TOKENS = 2000
MAX_NESTING = 8
# The largest head dim of V (`head_dim_v`): MLA's latent values are 512 wide.
MAX_HEAD_DIM_V = 512
# The largest head dim of Q and K: 256, or MLA's 576 (512 latent + 64 rotary) where V is K's prefix (`v = k[:N]`).
MAX_HEAD_DIM = 256
MAX_HEAD_DIM_LATENT = 576
# The smallest softmax scale (spec or run time): the kernels need scale * log2(e) to be a normal,
# non-zero fp32 number (see checks.check_scale).
MIN_SCALE = 1e-30


class Direction(enum.Enum):
    FORWARD = "forward"
    FORWARD_BACKWARD = "forward+backward"


class Mask(enum.Enum):
    NONE = "none"
    CAUSAL_TOP_LEFT = "causal(top_left)"
    CAUSAL_BOTTOM_RIGHT = "causal(bottom_right)"
    CUSTOM = "custom"  # any other mask: the tree is the spec's `variant.mask`

    @property
    def is_causal(self) -> bool:
        """Whether the mask drops scores (every mask but none: the kernels skip and mask blocks)."""
        return self is not Mask.NONE


class DType(enum.Enum):
    FP16 = "fp16"
    BF16 = "bf16"
    FP32 = "fp32"
    # torch.float8_e4m3fn: 4 exponent bits, 3 mantissa bits, finite (+-448). As `dtype`, q, k and v are e4m3 with
    # float32 descale factors and the output is bf16; as `kv_dtype`, only the KV cache is.
    FP8_E4M3 = "fp8_e4m3"

    @property
    def bytes(self) -> int:
        return {DType.FP32: 4, DType.FP8_E4M3: 1}.get(self, 2)

    @property
    def fp8(self) -> bool:
        return self is DType.FP8_E4M3

    @property
    def output(self) -> "DType":
        """The dtype of the output: the inputs' own, but bf16 for FP8 inputs (e4m3 would lose the
        output's precision for nothing: it is written once)."""
        return DType.BF16 if self.fp8 else self

    @property
    def torch(self):
        found = _TORCH_DTYPES.get(self)
        if found is None:  # torch is imported on first use, not with the spec module
            import torch

            _TORCH_DTYPES.update({DType.FP16: torch.float16, DType.BF16: torch.bfloat16, DType.FP32: torch.float32,
                                  DType.FP8_E4M3: torch.float8_e4m3fn})
            found = _TORCH_DTYPES[self]
        return found


_TORCH_DTYPES: dict = {}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Where keys and values live: one contiguous run per sequence, or pages via a block table."""

    paged: bool = False
    page_size: int | None = None

    def __str__(self) -> str:
        return f"paged(page_size={self.page_size})" if self.paged else "contiguous"


class Layout(enum.Enum):
    """How a batch's queries and keys are laid out: rectangular (batch, heads, seq, head_dim), or packed
    variable-length sequences end to end (total_tokens, heads, head_dim) with cu_seqlens offsets."""

    DENSE = "dense"
    VARLEN = "varlen"


AUTO = None  # a tile value left to the autotuner / heuristics

# The run-time descale factors of an FP8 spec, FA3's names and convention: float32, (1,) for the whole tensor
# or (batch, kv_heads) per head, and a stored value x stands for x * descale.
DESCALES = ("q_descale", "k_descale", "v_descale")
# An FP8 cache's (`kv_dtype = fp8_e4m3`): k's and v's alone, one per (sequence, K/V head), per K/V head or per tensor;
# the true key is the cache's value times k_descale, the true value v's times v_descale.
FP8_DESCALES = DESCALES[1:]
# The least an FP8 tensor-core product reduces over (Triton's tl.dot on float8 operands: K >= 32), so an FP8 spec's
# padded head dim (Q K^T) and its key blocks (P V) are at least this.
FP8_MIN_REDUCTION = 32


@dataclass(frozen=True, slots=True)
class Spec:
    """One attention kernel, as a user described it. Fields left `None` mean `auto` or `any`."""

    name: str
    head_dim: int
    dtype: DType
    direction: Direction = Direction.FORWARD
    mask: Mask = Mask.NONE
    heads: int | None = None
    kv_heads: int | None = None
    group: int | None = None
    scale: float | None = None
    block_m: int | None = AUTO
    block_n: int | None = AUTO
    num_warps: int | None = AUTO
    num_stages: int | None = AUTO
    split_kv: int | None = 1
    kv_layout: KVLayout = KVLayout()
    pack_gqa: bool | None = AUTO
    layout: Layout = Layout.DENSE
    # Masks beyond none/causal, score modifiers, sinks and run-time tensors (lang/variants.py); empty for
    # a plain spec. `mask` is Mask.CUSTOM exactly when `variant.mask` holds the mask's tree.
    variant: Variant = Variant()
    # The head dim of V and O (`head_dim_v`); None in the constructor means head_dim, and __post_init__ fills it in.
    head_dim_v: int | None = None
    # What the KV cache holds (`kv_dtype`): None means `dtype`; fp8_e4m3 (decoding specs) reads K and V as e4m3
    # with run-time per-(sequence, K/V head) descale factors, q and the output staying in `dtype`.
    kv_dtype: DType | None = None
    # V is K's first head_dim_v columns (`v = k[:N]`, MLA's absorbed latent cache): one cache, read once for both.
    v_from_k: bool = False
    # Where each key was written, for error messages; not part of the kernel's identity.
    filename: str = field(default="<spec>", compare=False, repr=False)
    where: tuple[tuple[str, int, int], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)

    # -- derived facts ---------------------------------------------------------------------------
    @property
    def head_dim_padded(self) -> int:
        """Head dim rounded up to a power of two: `tl.arange` needs one; the rest is masked off."""
        return 1 << (self.head_dim - 1).bit_length()

    @property
    def head_dim_v_padded(self) -> int:
        """V's head dim rounded up to a power of two, like `head_dim_padded`."""
        return 1 << (self.head_dim_v - 1).bit_length()

    @property
    def splits_head_dims(self) -> bool:
        """Whether V and O have another head dim than Q and K (`head_dim_v` set to something else)."""
        return self.head_dim_v != self.head_dim

    @property
    def fp8_cache(self) -> bool:
        """Whether K and V are an e4m3 cache read with descale factors (`kv_dtype = fp8_e4m3`)."""
        return self.kv_dtype is DType.FP8_E4M3

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def backward(self) -> bool:
        return self.direction is Direction.FORWARD_BACKWARD

    @property
    def is_split(self) -> bool:
        return self.split_kv != 1

    @property
    def fixes_tiles(self) -> bool:
        """Whether the spec writes any tile key (block_m, block_n, num_warps, num_stages) by hand."""
        return any(getattr(self, key) is not None for key in ("block_m", "block_n", "num_warps", "num_stages"))

    @property
    def decoding(self) -> bool:
        """Whether the kernel reads a KV cache (split-KV or paged): `forward_kvcache`, per-sequence lengths."""
        return self.split_kv != 1 or self.kv_layout.paged

    @property
    def varlen(self) -> bool:
        """Whether q, k and v are packed variable-length sequences (`layout = varlen`)."""
        return self.layout is Layout.VARLEN

    @property
    def bottom_right(self) -> bool:
        """Whether query positions align bottom-right (the last query at the last key): a KV-cache kernel's,
        or what `causal(bottom_right)` asks for; top-left otherwise. Every mask node and score modifier
        reads q in this alignment."""
        if self.mask is Mask.CAUSAL_BOTTOM_RIGHT:
            return True
        if self.mask is Mask.CAUSAL_TOP_LEFT:
            return False
        named = variant_alignment(self.variant.mask)
        # Packed sequences align per sequence bottom-right, as flash-attn's varlen functions do.
        return named == "bottom_right" if named else (self.decoding or self.varlen)

    @property
    def packs_gqa(self) -> bool:
        """Whether query heads sharing a K/V head are processed by one program (decode kernels)."""
        if self.pack_gqa is not None:
            return self.pack_gqa
        # NOTE: packed rows address (head, position) of a (batch, heads, seq) tensor; a varlen tensor is
        # (tokens, heads): no packing there yet.
        return (self.is_split or self.kv_layout.paged) and not self.varlen

    def runtime_tensors(self) -> tuple[str, ...]:
        """The keyword tensors a kernel of this spec takes, in order: the variant's, then the descales of its FP8
        inputs (q's, k's and v's for `dtype = fp8_e4m3`, k's and v's for an FP8 cache)."""
        return self.variant.runtime_tensors() + self.descales

    @property
    def descales(self) -> tuple[str, ...]:
        """The run-time descale factors of its FP8 inputs: q's, k's and v's for `dtype = fp8_e4m3`, k's and v's for
        an FP8 cache, none otherwise."""
        return DESCALES if self.dtype.fp8 else FP8_DESCALES if self.fp8_cache else ()

    @property
    def tunables(self) -> tuple[str, ...]:
        """The tile keys written as `auto`: the autotuner's search space."""
        keys = ["block_m", "block_n", "num_warps", "num_stages"]
        if self.split_kv is None:
            keys.append("split_kv")
        return tuple(k for k in keys if getattr(self, k) is None)

    def position(self, key: str) -> tuple[int, int]:
        """Line and column where `key` was written (the kernel header if it was not)."""
        for k, line, col in self.where:
            if k == key:
                return line, col
        for k, line, col in self.where:
            if k == "kernel":
                return line, col
        return 1, 1

    def error(self, key: str, message: str, cls: type[SpecError] = SpecError) -> SpecError:
        line, col = self.position(key)
        return cls(message, self.filename, line, col)

    # -- identity --------------------------------------------------------------------------------
    def canonical(self) -> str:
        """The spec with every key written out in a fixed order: equal kernels, equal text."""

        def show(v: Any) -> str:
            if v is None:
                return "auto"
            if isinstance(v, enum.Enum):
                return v.value
            if isinstance(v, bool):
                return "true" if v else "false"
            if isinstance(v, float):
                return repr(v)
            return str(v)

        lines = [f"kernel {self.name} {{"]
        for key in _KEY_ORDER:
            value = getattr(self, key)
            if key == "mask" and self.variant.mask is not None:
                text = self.variant.mask.text()
            elif key in ("heads", "kv_heads", "group") and value is None:
                text = "any"
            elif key == "scale" and value is None:
                text = "default"
            else:
                text = show(value)
            lines.append(f"    {key} = {text}")
            if key == "head_dim" and self.splits_head_dims:  # only when set: a plain spec's hash stays
                lines.append(f"    head_dim_v = {self.head_dim_v}")
            if key == "head_dim" and self.v_from_k:
                lines.append(f"    v = k[:{self.head_dim_v}]")
            if key == "dtype" and self.kv_dtype is not None:  # likewise
                lines.append(f"    kv_dtype = {self.kv_dtype.value}")
        # Written only when set, so that a plain spec's text (and hash) is what it always was.
        if self.varlen:
            lines.append(f"    layout = {self.layout.value}")
        if self.variant.score is not None:
            lines.append(f"    score = {self.variant.score.text()}")
        if self.variant.sinks:
            lines.append("    sinks = true")
        lines += [f"    {t.text()}" for t in self.variant.tensors]
        lines.append("}")
        return "\n".join(lines) + "\n"

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()[:16]

    def replace(self, **changes: Any) -> "Spec":
        return dataclasses.replace(self, **changes)


_KEY_ORDER = (
    "direction", "mask", "head_dim", "dtype", "heads", "kv_heads", "group", "scale",
    "block_m", "block_n", "num_warps", "num_stages", "split_kv", "kv_layout", "pack_gqa",
)

# -- parsing -----------------------------------------------------------------------------------


_PARSER: lark.Lark | None = None


def _parser() -> lark.Lark:
    global _PARSER
    if _PARSER is None:
        grammar = resources.files("attngen.lang").joinpath("attn.lark").read_text()
        _PARSER = lark.Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True)
    return _PARSER


_TOKEN_NAMES = {
    "NAME": "a name", "NUMBER": "a number", "LBRACE": "'{'", "RBRACE": "'}'", "EQUAL": "'='",
    "LPAR": "'('", "RPAR": "')'", "COMMA": "','", "PLUS": "'+'", "SEMICOLON": "';'",
    "KERNEL": "'kernel'", "$END": "end of file", "LSQB": "'['", "RSQB": "']'", "COLON": "':'",
    "MINUS": "'-'", "STAR": "'*'", "SLASH": "'/'", "FLOORDIV": "'//'", "PERCENT": "'%'",
    "AMPERSAND": "'&'", "VBAR": "'|'", "AND": "'and'", "OR": "'or'", "NOT": "'not'",
    "TENSOR": "'tensor'", "COMPARE": "a comparison",
}


def _expected(names) -> str:
    shown = sorted({_TOKEN_NAMES.get(n, n.lower()) for n in names})
    return ", ".join(shown) if shown else "nothing"


def _describe(token) -> str:
    if token is None or token.type == "$END":
        return "end of file"
    text = str(token)
    return f"'{text[:40]}'" + ("..." if len(text) > 40 else "")


def parse(text: str | bytes, filename: str = "<spec>") -> Spec:
    """Parse and check one spec. Raises `SpecError` pointing at the first problem."""
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(f"spec is {len(text):,} {'bytes' if isinstance(text, bytes) else 'characters'} long; "
                        f"the limit is {MAX_SPEC_BYTES:,}", filename)
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            line = text[: e.start].count(b"\n") + 1
            raise SpecError("spec is not valid UTF-8 text", filename, line, 1) from None
    if not text.strip():
        raise SpecError("empty spec: expected 'kernel NAME { ... }'", filename)
    _check_extent(text, filename)
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedCharacters as e:
        ch = text[e.pos_in_stream] if e.pos_in_stream < len(text) else ""
        raise SpecError(
            f"unexpected character {ch!r}; expected {_expected(e.allowed)}", filename, e.line, e.column
        ) from None
    except lark.exceptions.UnexpectedEOF as e:
        line, col = _end(text)
        raise SpecError(f"unexpected end of file; expected {_expected(e.expected)}", filename, line, col) from None
    except lark.exceptions.UnexpectedToken as e:
        line, col = (e.line, e.column) if e.line not in (None, -1) else (1, 1)
        # `accepts` is what the parser could really shift here; `expected` is LALR's looser set.
        expected = getattr(e, "accepts", None) or e.expected
        if e.token.type == "$END":
            line, col = _end(text)
            if text.count("{") > text.count("}"):
                raise SpecError("unexpected end of file; expected '}' to close the kernel", filename, line, col) from None
        raise SpecError(
            f"unexpected {_describe(e.token)}; expected {_expected(expected)}", filename, line, col
        ) from None
    try:
        header = ToEntries(text).transform(tree)
    except lark.exceptions.VisitError as e:
        if isinstance(e.orig_exc, SpecError):
            raise SpecError(e.orig_exc.message, filename, e.orig_exc.line, e.orig_exc.column) from None
        raise
    return _build(header, filename)


# Comments, then runs of name/number characters, then any other single character: at least as many
# tokens as Lark's lexer finds, so the bound below holds for the parser too.
_ROUGH_TOKEN = re.compile(r"#[^\n]*|[A-Za-z0-9_.]+|\S")


def _check_extent(text: str, filename: str) -> None:
    """Refuse, before parsing, a spec with too many tokens or brackets nested too deeply."""
    count = depth = 0
    for m in _ROUGH_TOKEN.finditer(text):
        token = m.group()
        if token[0] == "#":
            continue
        count += 1
        depth += (token in "([") - (token in ")]")
        if count > MAX_TOKENS:
            raise SpecError(f"spec has more than {MAX_TOKENS} tokens; a spec is a few dozen",
                            filename, *_line_col(text, m.start()))
        if depth > MAX_NESTING:
            raise SpecError(f"values are nested more than {MAX_NESTING} brackets deep",
                            filename, *_line_col(text, m.start()))


def _line_col(text: str, pos: int) -> tuple[int, int]:
    """1-based line and column of offset `pos`, counting lines by '\\n' as Lark does."""
    return text.count("\n", 0, pos) + 1, pos - (text.rfind("\n", 0, pos) + 1) + 1


def _end(text: str) -> tuple[int, int]:
    """Where to report an unexpected end of file: just after the last character that is not a
    line break (`str.splitlines` would also break at form feeds and U+2028, which Lark does not)."""
    return _line_col(text, len(text.rstrip("\r\n")))


# -- checking ----------------------------------------------------------------------------------

_DTYPES = {"fp16": DType.FP16, "bf16": DType.BF16, "fp32": DType.FP32, "fp8_e4m3": DType.FP8_E4M3}
_DTYPE_ALIASES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32",
                  "float8_e4m3fn": "fp8_e4m3", "fp8e4m3": "fp8_e4m3", "e4m3": "fp8_e4m3"}
_BOOLS = {"true": True, "false": False, "auto": None}


def _word(v: Value, key: str, choices) -> str:
    if v.kind != "word":
        raise _err(v, f"{key} takes one of {', '.join(choices)}; got '{_shown(v)}'")
    if v.text not in choices:
        hint = _did_you_mean(v.text, choices)
        raise _err(v, f"unknown {key} '{_short(v.text)}'; expected one of {', '.join(choices)}{hint}")
    return v.text


def _int(v: Value, key: str, lo: int, hi: int, *, auto: bool = False, any_: bool = False) -> int | None:
    if v.kind == "word" and ((auto and v.text == "auto") or (any_ and v.text == "any")):
        return None
    allowed = " or ".join(w for w, ok in (("auto", auto), ("any", any_)) if ok)
    if v.kind != "number":
        extra = f" or {allowed}" if allowed else ""
        raise _err(v, f"{key} takes a whole number{extra}; got '{_shown(v)}'")
    if not re.fullmatch(r"[+-]?[0-9]+", v.text):
        raise _err(v, f"{key} takes a whole number; got '{_short(v.text)}'")
    # A long digit string is out of range anyway; int() of it would cost time or hit Python's limit.
    number = int(v.text) if len(v.text) <= 24 else None
    if number is None or not lo <= number <= hi:
        raise _err(v, f"{key} = {_short(v.text)} is out of range; expected {lo} to {hi}")
    return number


def _power_of_two(v: Value, key: str, lo: int, hi: int, *, auto: bool = True) -> int | None:
    number = _int(v, key, lo, hi, auto=auto)
    if number is not None and number & (number - 1):
        below, above = 1 << (number.bit_length() - 1), 1 << number.bit_length()
        raise _err(v, f"{key} = {number} is not a power of two; use {below} or {above}")
    return number


def _mask(v: Value, tensors) -> tuple[Mask, Any, set[str]]:
    """The plain mask enum, the mask's tree when it is not a plain one (else None), the tensors it reads."""
    tree, read = exprs.mask(v, tensors)
    if tree is None:
        return Mask.NONE, None, read
    if isinstance(tree, Causal):
        return (Mask.CAUSAL_BOTTOM_RIGHT if tree.align == "bottom_right" else Mask.CAUSAL_TOP_LEFT), None, read
    return Mask.CUSTOM, tree, read


def _kv_layout(v: Value) -> KVLayout:
    if v.kind == "word" and v.text == "contiguous":
        return KVLayout()
    if v.kind in ("word", "call") and v.text == "paged":
        if v.kind == "word" or len(v.args) != 1:
            raise _err(v, "paged needs a page size: paged(page_size = 16)")
        key, arg = v.args[0]
        if key not in (None, "page_size"):
            raise _err(arg, f"paged takes page_size, not '{key}'")
        size = _power_of_two(arg, "page_size", 1, 256, auto=False)
        return KVLayout(paged=True, page_size=size)
    raise _err(v, f"unknown kv_layout '{_shown(v)}'; expected contiguous or paged(page_size = N)")


def _scale(v: Value) -> float | None:
    if v.kind == "word" and v.text == "default":
        return None
    if v.kind != "number":
        raise _err(v, f"scale takes a positive number or default; got '{_shown(v)}'")
    value = float(v.text)
    if not (math.isfinite(value) and MIN_SCALE <= value <= 1e4):
        raise _err(v, f"scale = {_short(v.text)} is out of range; expected a number from {MIN_SCALE:g} to 10000")
    return value


def _direction(v: Value) -> Direction:
    choices = {"forward": Direction.FORWARD, "forward+backward": Direction.FORWARD_BACKWARD}
    if joined_names(v) in choices:
        return choices[joined_names(v)]
    if v.text == "backward":
        raise _err(v, "a backward kernel is generated from its forward: write direction = forward+backward")
    raise _err(v, f"unknown direction '{_shown(v)}'; expected forward or forward+backward")


def _dtype(v: Value, key: str = "dtype") -> DType:
    if v.kind == "word" and v.text in _DTYPE_ALIASES:
        raise _err(v, f"{key} '{v.text}' is spelled '{_DTYPE_ALIASES[v.text]}' here")
    return _DTYPES[_word(v, key, tuple(_DTYPES))]


def _bool(v: Value, key: str) -> bool | None:
    return _BOOLS[_word(v, key, tuple(_BOOLS))]


def _layout(v: Value) -> Layout:
    return Layout(_word(v, "layout", tuple(x.value for x in Layout)))


def _v_prefix(v: Value) -> int:
    """`v = k[:N]`: V is the first N columns of K (MLA's latent cache). Returns N."""
    usage = "v = k[:N] (V is the first N columns of K, as MLA's latent cache holds it)"
    if v.kind != "index" or v.text != "k" or len(v.args) != 1 or v.args[0][1].kind != "slice":
        raise _err(v, f"v takes a prefix of k: {usage}; got '{_shown(v)}'")
    bounds = dict(v.args[0][1].args)
    start = bounds.get("start")
    if start is not None and not (start.kind == "number" and re.fullmatch(r"\+?0+", start.text)):
        raise _err(start, f"v must be a prefix of k (its columns from 0): {usage}; got '{_shown(v)}'")
    if "stop" not in bounds:
        raise _err(v, f"v = k[:] is all of k; write the prefix's width: {usage}")
    width = _int(bounds["stop"], "v's width", 16, MAX_HEAD_DIM_V)
    if width % 16:
        below = width // 16 * 16
        raise _err(bounds["stop"], f"v's width {width} is not a multiple of 16; use {max(below, 16)} or {below + 16}")
    return width


_KEYS = {
    "direction": _direction,
    "head_dim": lambda v: _int(v, "head_dim", 16, MAX_HEAD_DIM_LATENT),
    "head_dim_v": lambda v: _int(v, "head_dim_v", 16, MAX_HEAD_DIM_V),
    "dtype": _dtype,
    "kv_dtype": lambda v: _dtype(v, "kv_dtype"),
    "heads": lambda v: _int(v, "heads", 1, 1024, any_=True),
    "kv_heads": lambda v: _int(v, "kv_heads", 1, 1024, any_=True),
    "group": lambda v: _int(v, "group", 1, 1024, any_=True),
    "scale": _scale,
    "block_m": lambda v: _power_of_two(v, "block_m", 16, 256),
    "block_n": lambda v: _power_of_two(v, "block_n", 16, 256),
    "num_warps": lambda v: _power_of_two(v, "num_warps", 1, 16),
    "num_stages": lambda v: _int(v, "num_stages", 1, 8, auto=True),
    "split_kv": lambda v: _int(v, "split_kv", 1, 128, auto=True),
    "kv_layout": _kv_layout,
    "pack_gqa": lambda v: _bool(v, "pack_gqa"),
    "layout": _layout,
    "v": _v_prefix,
}
# Read after the tensor declarations, which a mask or score may use wherever they stand in the spec.
_VARIANT_KEYS = ("mask", "score", "sinks")
_ALL_KEYS = ("direction", "mask") + tuple(k for k in _KEYS if k != "direction") + ("score", "sinks", "tensor")
REQUIRED = ("head_dim", "dtype")


def _build(header: Header, filename: str) -> Spec:
    try:
        return _check(header, filename)
    except SpecError as e:
        if e.filename != "<spec>":
            raise
        raise type(e)(e.message, filename, e.line, e.column) from None


def _check(header: Header, filename: str) -> Spec:
    name = header.name
    if len(name) > MAX_NAME_LENGTH:
        raise _err(header, f"kernel name is {len(name)} characters long; the limit is {MAX_NAME_LENGTH}")
    if keyword.iskeyword(name) or name.startswith("__"):
        raise _err(header, f"'{name}' cannot name a kernel: it is a Python keyword or reserved name")
    values: dict[str, Any] = {}
    seen: dict[str, Entry] = {}
    declared: dict[str, TensorEntry] = {}
    for entry in header.entries:
        if isinstance(entry, TensorEntry):
            if entry.name in declared:
                raise _err(entry, f"tensor '{entry.name}' is declared twice (first at line {declared[entry.name].line})")
            declared[entry.name] = entry
            continue
        if entry.key not in _KEYS and entry.key not in _VARIANT_KEYS:
            hint = _did_you_mean(entry.key, _ALL_KEYS)
            raise _err(entry, f"unknown key '{_short(entry.key)}'{hint}; known keys: {', '.join(_ALL_KEYS)}")
        if entry.key in seen:
            first = seen[entry.key]
            raise _err(entry, f"duplicate key '{entry.key}' (first set at line {first.line})")
        seen[entry.key] = entry
        if entry.key in _KEYS:
            values[entry.key] = _KEYS[entry.key](entry.value)
    values.update(_variant(seen, declared))
    if "v" in values:
        width = values.pop("v")
        if values.get("head_dim_v", width) != width:
            raise _err(seen["v"].value, f"v = k[:{width}] is {width} wide but head_dim_v = {values['head_dim_v']} "
                       f"(line {seen['head_dim_v'].line}); they must agree")
        values.update(head_dim_v=width, v_from_k=True)
    if values.get("layout") is Layout.VARLEN and "mask" in seen:
        v = seen["mask"].value
        if v.kind == "word" and v.text == "causal":  # unaligned: per sequence, bottom-right
            values["mask"] = Mask.CAUSAL_BOTTOM_RIGHT
    for key in REQUIRED:
        if key not in values:
            raise _err(header, f"kernel '{name}' does not set {key}")
    where = (("kernel", header.line, header.column),) + tuple(
        (e.key, e.value.line, e.value.column) for e in header.entries if isinstance(e, Entry)
    ) + tuple((f"tensor {t.name}", t.line, t.column) for t in declared.values())
    spec = Spec(name=name, filename=filename, where=where, **values)
    return _check_kv_dtype(_check_fp8(_check_layout(_check_heads(_check_head_dim(spec)))))


def _variant(seen: dict[str, Entry], declared: dict[str, TensorEntry]) -> dict[str, Any]:
    """The `mask` and `variant` fields from the mask, score, sinks and tensor entries."""
    tensors = {name: exprs.tensor(t, MAX_NAME_LENGTH) for name, t in declared.items()}
    found: dict[str, Any] = {}
    tree, score, read = None, None, set()
    if "mask" in seen:
        found["mask"], tree, read = _mask(seen["mask"].value, tensors)
    if "score" in seen:
        score, score_read = exprs.score(seen["score"].value, tensors)
        read |= score_read
    for name, t in declared.items():
        if name not in read:
            raise _err(t, f"tensor '{name}' is declared but never read; read it in the mask or score, or remove it")
    sinks = exprs.sinks(seen["sinks"].value) if "sinks" in seen else False
    variant = Variant(mask=tree, score=score, sinks=sinks, tensors=tuple(tensors.values()))
    if variant:
        found["variant"] = variant
    return found


def _check_head_dim(spec: Spec) -> Spec:
    for key in ("head_dim", "head_dim_v"):
        value = getattr(spec, key)
        if value % 16:
            below = value // 16 * 16
            raise spec.error(key, f"{key} = {value} is not a multiple of 16; use {max(below, 16)} or {below + 16}")
    if spec.head_dim > MAX_HEAD_DIM and not spec.v_from_k:
        raise spec.error("head_dim", f"head_dim = {spec.head_dim} is out of range; expected 16 to {MAX_HEAD_DIM} (up to "
                         f"{MAX_HEAD_DIM_LATENT} where v = k[:N], MLA's latent cache)")
    return _check_v_from_k(spec) if spec.v_from_k else spec


def _check_v_from_k(spec: Spec) -> Spec:
    """What a V read from K's prefix (`v = k[:N]`, MLA decode) needs."""
    if spec.head_dim_v >= spec.head_dim:
        raise spec.error("v", f"v = k[:{spec.head_dim_v}] needs head_dim > {spec.head_dim_v}: q.k runs over the prefix "
                         f"and the columns after it (MLA: 512 latent + 64 rotary); head_dim is {spec.head_dim}")
    if spec.backward:
        raise spec.error("v", "v = k[:N] is for decoding a latent cache; it has no backward", UnsupportedError)
    if spec.varlen or not spec.decoding:
        raise spec.error("v", "v = k[:N] is for decoding a KV cache: set split_kv or kv_layout = paged (layout = "
                         "varlen is not supported)", UnsupportedError)
    return spec


def _check_heads(spec: Spec) -> Spec:
    """Reconcile heads / kv_heads / group into one consistent triple (any may be unknown)."""
    heads, kv_heads, group = spec.heads, spec.kv_heads, spec.group
    if kv_heads is not None and heads is None:
        raise spec.error("kv_heads", "kv_heads needs heads (the number of query heads) as well")
    if heads is not None and kv_heads is not None:
        if heads % kv_heads:
            raise spec.error("kv_heads", f"heads = {heads} is not a multiple of kv_heads = {kv_heads}")
        implied = heads // kv_heads
        if group is not None and group != implied:
            raise spec.error("group", f"group = {group} contradicts heads / kv_heads = {heads} / {kv_heads} = {implied}")
        group = implied
    if heads is not None and group is not None:
        if heads % group:
            raise spec.error("group", f"heads = {heads} is not a multiple of group = {group}")
        kv_heads = heads // group
    if spec.kv_layout.paged and spec.backward:
        raise spec.error("kv_layout", "a paged KV cache is for inference; it has no backward", UnsupportedError)
    if spec.is_split and spec.backward:
        raise spec.error("split_kv", "split_kv is for decoding; a forward+backward kernel must use split_kv = 1", UnsupportedError)
    return spec.replace(heads=heads, kv_heads=kv_heads, group=group)


def _check_layout(spec: Spec) -> Spec:
    """What packed variable-length sequences do not combine with (yet)."""
    if not spec.varlen:
        return spec
    if spec.is_split:
        raise spec.error("split_kv", "layout = varlen runs one program per query tile: split_kv must be 1",
                         UnsupportedError)
    if spec.pack_gqa:
        raise spec.error("pack_gqa", "layout = varlen does not pack GQA rows: leave pack_gqa auto or false",
                         UnsupportedError)
    if spec.mask is Mask.CAUSAL_TOP_LEFT or variant_alignment(spec.variant.mask) == "top_left":
        raise spec.error("mask", "layout = varlen aligns positions bottom-right per sequence (flash-attn's varlen "
                         "convention): write causal or causal(bottom_right)", UnsupportedError)
    for t in spec.variant.tensors:
        if any(isinstance(d, str) and d not in ("B", "H") for d in t.dims):
            raise spec.error(f"tensor {t.name}", f"tensor '{t.name}' has a dimension other than B, H or a number; "
                             "a varlen kernel's sequences have no common length", UnsupportedError)
    return spec


def _check_fp8(spec: Spec) -> Spec:
    """What FP8 inputs are for: the prefill forward, dense (batch, heads, seq, head_dim) tensors."""
    if not spec.dtype.fp8:
        return spec
    if spec.backward:
        raise spec.error("direction", "dtype = fp8_e4m3 is forward-only: the backward stays 16-bit (train in bf16 "
                         "or fp16, and quantise for inference); write direction = forward")
    if spec.decoding:
        key = "kv_layout" if spec.kv_layout.paged else "split_kv"
        raise spec.error(key, "dtype = fp8_e4m3 is the prefill forward (q, k and v in FP8); it reads no KV cache",
                         UnsupportedError)
    if spec.varlen:
        raise spec.error("layout", "dtype = fp8_e4m3 takes (batch, heads, seq, head_dim) tensors; layout = varlen "
                         "is 16-bit", UnsupportedError)
    if spec.head_dim_padded < FP8_MIN_REDUCTION:
        raise spec.error("head_dim", f"dtype = fp8_e4m3 needs head_dim >= {FP8_MIN_REDUCTION}: FP8 tensor-core "
                         f"products reduce over at least {FP8_MIN_REDUCTION}", UnsupportedError)
    return spec


def _check_kv_dtype(spec: Spec) -> Spec:
    """An FP8 cache is for decoding kernels with 16-bit queries; `kv_dtype` equal to `dtype` is the default."""
    if spec.kv_dtype is None or spec.kv_dtype is spec.dtype:
        return spec.replace(kv_dtype=None)
    if spec.kv_dtype is not DType.FP8_E4M3:
        raise spec.error("kv_dtype", f"kv_dtype = {spec.kv_dtype.value} differs from dtype = {spec.dtype.value}; "
                         "a cache of another dtype than the queries' is fp8_e4m3", UnsupportedError)
    if spec.dtype not in (DType.BF16, DType.FP16):
        raise spec.error("kv_dtype", f"kv_dtype = fp8_e4m3 takes 16-bit queries (dtype = bf16 or fp16), not "
                         f"{spec.dtype.value}", UnsupportedError)
    if not spec.decoding or spec.varlen:
        raise spec.error("kv_dtype", "kv_dtype = fp8_e4m3 is for decoding over a KV cache: set split_kv "
                         "(auto or a count) or kv_layout = paged(...), and layout = dense", UnsupportedError)
    if spec.v_from_k:
        # NOTE: pass latent-kv shares one load of K for both products; an FP8 cache widens K and V separately.
        raise spec.error("kv_dtype", "kv_dtype = fp8_e4m3 with v = k[:N] (an FP8 latent cache) is not supported; "
                         "read the latent cache in dtype", UnsupportedError)
    return spec


def load_file(path: str) -> Spec:
    """Read and parse a spec file; an unreadable file is a `SpecError` too."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise SpecError(f"cannot read spec: {e.strerror}", path) from None
    return parse(data, path)
