"""Spec fuzzing and code injection: whatever text a spec holds, attngen either generates a kernel
that is valid Python, carries nothing from the spec but validated identifiers and numbers, and
computes attention correctly, or stops with a `SpecError` located inside the text (exit status 2
and `FILE:LINE:COL: error:` from the command line). Never another exception, a traceback or a hang.

Spec texts are generated from the grammar's shape (`kernel NAME { key = value ... }` with keys and
values drawn from valid and hostile pools) and made by mutating the shipped specs (tokens deleted,
duplicated, swapped and replaced, random bytes, truncation, huge and empty files). The example
counts keep this file near a minute in CI; set ATTNGEN_FUZZ_SCALE=10 for a longer local run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import io
import keyword
import os
import re
import tempfile
import time
import tokenize

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import attngen
from attngen import SpecError
from attngen.testing.accuracy import Case, validate
from attngen.cli import main
from attngen.codegen import render
from attngen.passes import compile_program
from attngen.analysis.resources import check_spec_tiles
from attngen.lang import variants
from attngen.lang.spec import MAX_SPEC_BYTES, KVLayout, Spec, load_file, parse
from conftest import ROOT, shipped_specs

SCALE = float(os.environ.get("ATTNGEN_FUZZ_SCALE", "1"))
GENERATED = os.path.join(ROOT, "generated")


def fuzz_settings(examples: int):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])


# A parse that takes longer than this is a hang as far as a user is concerned (a real spec parses in
# about a millisecond; the worst input the size limits allow in well under a second).
PARSE_SECONDS = 3.0

# -- the property ---------------------------------------------------------------------------------


def assert_located(e: SpecError, data: str | bytes, filename: str) -> None:
    """A SpecError names the file and a line and column inside the text, on one short line."""
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    lines = text.split("\n")  # Lark counts lines by '\n' only; so must we
    assert e.filename == filename, str(e)
    assert 1 <= e.line <= len(lines), (e.line, len(lines), str(e))
    assert 1 <= e.column <= len(lines[e.line - 1]) + 1, (e.column, str(e))
    assert str(e).startswith(f"{filename}:{e.line}:{e.column}: error: ")
    assert "\n" not in str(e) and len(str(e)) < 400, str(e)[:500]


def _program(spec: Spec):
    """The final IR of a spec. Tile values and the scale are launch-time values (constexprs and a float
    argument), not part of the IR, and the name only labels it: specs differing only in those share
    one compilation, which keeps the fuzzers in their time budget (a backward takes seconds). Whether
    the spec fixes any tile is part of it (a hand-tiled spec keeps the Triton forward: warp-specialize)."""
    return _compiled(spec.replace(name=NEUTRAL, scale=None, block_m=None, block_n=None,
                                  num_warps=4 if spec.fixes_tiles else None,
                                  num_stages=None))


@functools.lru_cache(maxsize=None)
def _compiled(spec: Spec):
    return compile_program(spec)


def generate(data: str | bytes, filename: str = "f.attn"):
    """What `attngen compile` does with a spec text: the Spec and its module source, or the
    located SpecError. Any other exception escapes, and fails the test that called this."""
    start = time.perf_counter()
    try:
        spec = parse(data, filename)
    except SpecError as e:
        assert time.perf_counter() - start < PARSE_SECONDS, "parsing took too long"
        assert_located(e, data, filename)
        return e
    assert time.perf_counter() - start < PARSE_SECONDS, "parsing took too long"
    try:
        check_spec_tiles(spec)
    except SpecError as e:
        assert_located(e, data, filename)
        return e
    source = render(spec, _program(spec))
    compile(source, f"{spec.name}.py", "exec")  # valid Python
    assert_only_expected_tokens(source, spec)
    return spec, source


def validate_small(spec: Spec) -> None:
    """Run the kernel in the interpreter at a tiny odd shape against float64 (skipped for specs
    with many heads: too slow there, and heads do not change the code)."""
    heads = spec.heads or 2 * (spec.group or 1)
    kv_heads = spec.kv_heads or heads // (spec.group or 1)
    if heads > 8:
        return
    kernel = attngen.load(spec)
    for result in validate(kernel, [Case(1, heads, kv_heads, 13, 29)], seed=0):
        assert result.ok, (spec.canonical(), result)


def generate_and_sample(data: str | bytes, run: bool) -> None:
    """The fuzzers' property; `run`: also validate the kernel if the spec is accepted (a sample:
    the interpreter is too slow to run every one)."""
    result = generate(data)
    event("accepted" if isinstance(result, tuple) else type(result).__name__)
    if isinstance(result, tuple) and run:
        validate_small(result[0])


# -- nothing from the spec reaches the source but identifiers and numbers ---------------------------

NEUTRAL = "zz_neutral_kernel"
_CANONICAL_LINE = re.compile(r"#     (%s) = [A-Za-z0-9_.+\-()=]+" % "|".join(
    f for f in Spec.__dataclass_fields__ if f not in ("name", "filename", "where")))
# A variant's entries in the canonical text (lang/variants.py): its expressions' operators, brackets and
# spaces, the sinks flag, tensor declarations.
_VARIANT_LINE = re.compile(r"#     ((mask|score) = [A-Za-z0-9_.+\-*/%%()<>=!&|\[\], ]+|sinks = true"
                           r"|tensor [A-Za-z_][A-Za-z0-9_]*\[[A-Z0-9, ]+\]: (%s))" % "|".join(variants.TENSOR_DTYPES))
# `v = k[:N]` (MLA: V is K's first N columns): a number is all it carries.
_V_PREFIX_LINE = re.compile(r"#     v = k\[:[0-9]+\]")


def _tokens(source: str) -> list[tuple[int, str]]:
    return [(t.type, t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)]


def _normal(text: str, spec: Spec) -> str:
    return text.replace(spec.name, "<name>").replace(spec.hash, "<hash>")


def _numbered(name: str) -> str:
    """A temporary's name with its number left out (`pw_6` -> `pw_#`): the generator numbers pointwise values and
    reads by how many others the kernel holds, which no list of sample modules covers."""
    return re.sub(r"_[0-9]+$", "_#", name)


@functools.lru_cache(maxsize=1)
def _vocabulary() -> tuple[set, set]:
    """The identifiers and the short (non-doc) string constants the generator writes, spec name and
    hash normalised: from the committed golden modules (forward, backward, decoding), forward
    modules for every mask and dtype, padded and unpadded head dims, and variants' backward and decoding modules."""
    sources = []
    for path in shipped_specs():
        spec = load_file(path)
        with open(os.path.join(GENERATED, f"{spec.name}.py")) as f:
            sources.append((spec, f.read()))
    for mask in ("none", "causal(top_left)", "causal(bottom_right)"):
        for dtype, head_dim in (("fp16", 64), ("bf16", 80), ("fp32", 32)):
            spec = parse(f"kernel {NEUTRAL} {{ mask = {mask} dtype = {dtype} head_dim = {head_dim} }}")
            sources.append((spec, render(spec, _program(spec))))
    # the variants' backward and decoding modules (the shipped variant specs are forward ones and one decode)
    # (each variant alone and together: the generator numbers its temporaries by what else the kernel holds)
    for lines in ("score = softcap(30)", "score = alibi", "sinks = true", "mask = causal & window(300)",
                  "mask = causal & window(300)\n score = alibi\n sinks = true",
                  "mask = (q >= k & q - k < 4) | k < 6\n tensor bias[H, 64]: fp32\n score = s + bias[h, q - k]"):
        for extra in ("direction = forward+backward", "split_kv = auto", "split_kv = auto\n kv_layout = paged(16)"):
            spec = parse(f"kernel {NEUTRAL} {{ dtype = fp16\n head_dim = 64\n {lines}\n {extra} }}")
            sources.append((spec, render(spec, _program(spec))))
    names, strings = set(), set()
    for spec, source in sources:
        for kind, text in _tokens(source):
            if kind == tokenize.NAME:
                names.update((text, _numbered(text)))
            elif kind == tokenize.STRING and not text.startswith('"""'):
                strings.add(_normal(text, spec))
    return names, strings


_PLAIN = re.compile(r"[ -~\n]*")  # printable ASCII


def assert_typed_variant(node) -> None:
    """A variant's tree holds numbers, booleans, and strings only from the language's fixed sets or
    checked identifiers (tensor names): no other text of the spec's."""
    fixed = set(variants.POSITION_VARS + (variants.SCORE_VAR,) + tuple(variants.FUNCTIONS) + variants.COMPARISONS
                + variants.ARITH + variants.TENSOR_DTYPES + ("top_left", "bottom_right", "B", "H"))
    for field in dataclasses.fields(node):
        if field.name == "pos":
            continue
        value = getattr(node, field.name)
        for item in value if isinstance(value, tuple) else (value,):
            if dataclasses.is_dataclass(item):
                assert_typed_variant(item)
            elif isinstance(item, str):
                assert item in fixed or (item.isascii() and item.isidentifier() and not keyword.iskeyword(item)
                                         and field.name in ("name", "tensor")), (field.name, item)
            else:
                assert item is None or isinstance(item, (bool, int, float)), (field.name, item)


def assert_only_expected_tokens(source: str, spec: Spec) -> None:
    """Nothing from the spec reaches the module but validated identifiers and numbers:

    * the spec's values are typed (numbers, booleans, enums): no text of the spec's but its name;
    * the module is token for token the module of the same spec under a neutral name, except for
      strings and comments that differ by exactly the name and hash: the name is never code;
    * the neutral module's identifiers and short strings are ones the generator writes for ordinary
      specs; its docstrings and comments are printable ASCII, and the comments quoting the canonical
      spec have a plain `key = value` shape."""
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        if field.name == "name":
            assert value.isascii() and value.isidentifier() and not keyword.iskeyword(value), value
        elif field.name == "variant":
            assert_typed_variant(value)
        elif field.name not in ("filename", "where"):
            assert value is None or isinstance(value, (bool, int, float, enum.Enum, KVLayout)), (field.name, value)
    neutral_spec = spec.replace(name=NEUTRAL)
    neutral = _tokens(render(neutral_spec, _program(spec)))
    ours = _tokens(source)
    assert len(ours) == len(neutral)
    for (kind, text), (n_kind, n_text) in zip(ours, neutral):
        assert kind == n_kind, (text, n_text)
        if text != n_text:
            assert kind in (tokenize.STRING, tokenize.COMMENT), (tokenize.tok_name[kind], text)
            assert n_text.replace(NEUTRAL, spec.name).replace(neutral_spec.hash, spec.hash) == text
    names, strings = _vocabulary()
    for kind, text in neutral:
        if kind == tokenize.NAME:
            assert _numbered(text) in names, f"unexpected identifier {text!r} in the generated module"
        elif kind == tokenize.STRING and not text.startswith('"""'):
            assert _normal(text, neutral_spec) in strings, f"unexpected string {text!r} in the generated module"
        elif kind in (tokenize.STRING, tokenize.COMMENT):
            assert _PLAIN.fullmatch(text), f"unexpected characters in {text!r}"
            if kind == tokenize.COMMENT and text.startswith("#     "):
                assert (_CANONICAL_LINE.fullmatch(text) or _VARIANT_LINE.fullmatch(text)
                        or _V_PREFIX_LINE.fullmatch(text)), f"unexpected comment {text!r}"


# Attempts to break out of an identifier, a number, a string or the template.
HOSTILE = [
    "'", '"', "\\", "\\n", "\n", "'''", '"""', "'); import os; ('", '"+__import__("os").system("id")+"',
    "__import__('os')", "__import__", "__builtins__", "exec", "eval(1)", "{{ 7*7 }}", "{% if 1 %}x{% endif %}",
    "{# c #}", "#", "# }", "}", "{", "k\n}\nkernel j {", "\x00", "\r", "\u2028", "\u202e", "\ufeff",
    "ｋernel", "kеrnel", "héad_dim", "١٦", "６４", "𝟔𝟒", "1e309", "-1e309", "nan", "inf", "0x40", "1_000",
    "9" * 400, "x" * 65, "a" * 5000, "None", "True", "class", "lambda", "import", "__init__", "_" * 3,
]

# Valid identifiers that mean something in Python or in the module: accepted, as plain names.
ACCEPTED_NAMES = ["os", "sys", "torch", "triton", "tl", "eval", "exec", "print", "forward", "attn_fwd",
                  "SPEC_NAME", "DEFAULT_CONFIG", "match", "case", "type", "_", "_x", "x" * 64, "kernel"]


def _hostile_texts():
    base = "kernel {name} {{\n    head_dim = {head_dim}\n    dtype = {dtype}\n    mask = {mask}\n}}\n"
    plain = dict(name="k", head_dim="64", dtype="fp16", mask="causal")
    for word in HOSTILE:
        for slot in plain:
            yield base.format(**dict(plain, **{slot: word}))
        yield base.format(**plain).replace("mask", word, 1)  # as a key
        yield base.format(**dict(plain, mask=f"causal({word})"))
        yield base.format(**dict(plain, mask=f"causal(align = {word})"))
        yield f"kernel k {{ head_dim = 64 dtype = fp16 kv_layout = paged(page_size = {word}) }}"
        yield f"kernel k {{ head_dim = 64 dtype = fp16 scale = {word} }}"


@pytest.mark.parametrize("word", HOSTILE, ids=lambda w: ascii(w)[:24])
def test_hostile_names_and_values_are_rejected_or_inert(word):
    """`generate` checks each accepted module token by token; a name must be a plain identifier."""
    texts = [t for t in _hostile_texts() if word in t]
    assert texts
    for text in texts:
        result = generate(text)
        if isinstance(result, tuple):
            spec, _ = result
            assert spec.name.isascii() and spec.name.isidentifier(), spec.name


@pytest.mark.parametrize("name", ACCEPTED_NAMES)
def test_identifiers_that_mean_something_in_python_stay_inert(name):
    spec, source = generate(f"kernel {name} {{ head_dim = 32 dtype = fp16 }}")
    assert spec.name == name and f'SPEC_NAME = "{name}"' in source


@pytest.mark.parametrize("name", ["torch", "triton", "forward"])
def test_kernels_named_like_modules_load_and_run(name):
    """The generated file is `<name>.py`; it must still import the real torch and triton."""
    kernel = attngen.load(f"kernel {name} {{ head_dim = 32 dtype = fp32 mask = causal }}")
    assert kernel.path.name == f"{name}.py"
    (result,) = validate(kernel, [Case(1, 2, 2, 9, 17)], seed=1)
    assert result.ok, result


# -- specs generated from the grammar's shape --------------------------------------------------------

VALID = {
    "direction": ["forward", "forward", "forward", "forward+backward"],
    "mask": ["none", "causal", "causal(top_left)", "causal(bottom_right)", "causal(align = bottom_right)",
             # issue 48's variants: each named mask, a bottom-right one, a general form bounded as bands and one
             # with a gap (evaluated per block)
             "window(8)", "causal & window(300)", "window(5, 3)", "causal | prefix(9)", "causal & chunked(64)",
             "causal(bottom_right) & window(7)", "q - k < 1024 and (k < 64 or q >= k)", "(q >= k & q - k < 4) | k < 6"],
    "score": ["softcap(30)", "softcap(2)", "alibi", "s + bias[h, q - k]"],  # bias: declared, or not (an error)
    "sinks": ["true", "false"],
    "head_dim": [str(d) for d in range(16, 257, 16)],
    "dtype": ["fp16", "bf16", "fp32"],
    "heads": ["any", "1", "2", "4", "8", "32", "1024"],
    "kv_heads": ["any", "1", "2", "8"],
    "group": ["any", "1", "2", "4"],
    "scale": ["default", "0.125", "1e-3", "2", "1e4", ".5", "+0.25"],
    "block_m": ["auto", "16", "32", "64", "128", "256"],
    "block_n": ["auto", "16", "32", "64", "128", "256"],
    "num_warps": ["auto", "1", "2", "4", "8", "16"],
    "num_stages": ["auto", "1", "2", "3", "8"],
    "split_kv": ["1", "1", "1", "auto", "2", "128"],
    "kv_layout": ["contiguous", "contiguous", "contiguous", "paged(page_size = 16)", "paged(1)", "paged(page_size=256)"],
    "pack_gqa": ["true", "false", "auto"],
}
INVALID_VALUES = [
    "100", "0", "-16", "272", "48", "24", "3", "1e400", "1e-400", "-1", "nan", "99999999999999999999999",
    "fp8", "float16", "backward", "forward+forward", "causal()", "causal(top_left, bottom_right)", "causal(x = top_left)",
    "paged", "paged(page_size = 24)", "paged(size = 16)", "sliding", "a(b(c(d)))", "f(" * 12 + ")" * 12, "true",
    "16.0", "1.5", "auto", "any", "default", "forward+backward+forward",
] + HOSTILE
INVALID_KEYS = ["blok_m", "Head_dim", "kernel", "headdim", "x" * 70, "__import__", "_"]
SPACE = [" ", "\n", "\t", "\r\n", "\f", "  # a comment with { } ( ) = ;\n", "\n\n\n", "#\n"]
BAD_SPACE = ["", "{", "}", "=", "(", "#", ";"]


def _mostly(draw, good: list, bad: list, one_in: int = 10):
    """A draw from `good`, or one time in `one_in` from `bad`: most generated specs stay close to
    valid, so the generator's later stages are exercised as well as the parser's errors."""
    return draw(st.sampled_from(bad if draw(st.integers(1, one_in)) == 1 else good))


@st.composite
def grammar_specs(draw) -> str:
    keys = [k for k in ("head_dim", "dtype") if draw(st.integers(0, 19)) > 0]
    keys += draw(st.lists(st.sampled_from(sorted(set(VALID) - {"head_dim", "dtype"})), max_size=5, unique=True))
    keys += draw(st.lists(st.sampled_from(INVALID_KEYS + sorted(VALID)), max_size=1)) if draw(st.integers(0, 9)) == 0 else []
    space = lambda: _mostly(draw, SPACE, BAD_SPACE, one_in=100)  # noqa: E731
    entries = []
    for key in draw(st.permutations(keys)):
        value = _mostly(draw, VALID.get(key, ["16"]), INVALID_VALUES + [v for vs in VALID.values() for v in vs], 15)
        eq = _mostly(draw, [" = ", "=", "\t=\n"], ["==", "", "= ="], one_in=100)
        end = draw(st.sampled_from(["", "", ";", " ;"]))
        entries.append(f"{space()}{key}{eq}{value}{end}")
    if any("bias[" in e for e in entries) and draw(st.booleans()):
        entries.append(f"{space()}tensor bias[H, 64]: fp32")
    head = _mostly(draw, ["kernel"], ["Kernel", "kernal", "", "kernel kernel"], one_in=100)
    name = draw(st.one_of(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,70}", fullmatch=True),
                          st.sampled_from(["k", "fuzz", "fwd_d64", "_x", "K9"] + ACCEPTED_NAMES),
                          st.sampled_from(HOSTILE))) if draw(st.integers(0, 9)) == 0 else "fuzz"
    close = _mostly(draw, ["}"], ["", "}}", "} trailing", "{"], one_in=100)
    return f"{space()}{head} {name} {{{''.join(entries)}{space()}{close}{space()}"


@fuzz_settings(400)
@given(grammar_specs(), st.integers(0, 24))
# found by this test in CI: Triton TMA descriptors without any Gluon kernel (fixed 16-row tiles) once
# rendered `return Truedef tma_readable(...)` (a template's whitespace control)
@example("kernel fuzz {dtype = fp16 group = 100head_dim = 64heads = 100block_m = 16direction = forward+backward}", 0)
def test_generated_specs_compile_or_fail_cleanly(text, lucky):
    generate_and_sample(text, lucky == 0)


# -- mutations of the shipped specs ------------------------------------------------------------------

SHIPPED = [open(p, "rb").read() for p in shipped_specs()]
_TOKEN = re.compile(rb"\s+|#[^\n]*|[A-Za-z0-9_.+-]+|.", re.S)
_POOL = [w.encode() for w in HOSTILE + INVALID_VALUES + ["kernel", "{", "}", "=", "(", ")", ",", "+", ";", "#"]]


@st.composite
def mutated_specs(draw) -> bytes:
    data = draw(st.sampled_from(SHIPPED))
    for _ in range(draw(st.integers(1, 3))):
        tokens = _TOKEN.findall(data) or [b""]
        op = draw(st.sampled_from(["delete", "duplicate", "swap", "replace", "bytes", "truncate", "repeat",
                                   "long_comment", "long_word", "empty"]))
        i, j = draw(st.integers(0, len(tokens) - 1)), draw(st.integers(0, len(tokens) - 1))
        if op == "delete":
            del tokens[i]
        elif op == "duplicate":
            tokens.insert(i, tokens[i])
        elif op == "swap":
            tokens[i], tokens[j] = tokens[j], tokens[i]
        elif op == "replace":
            tokens[i] = draw(st.sampled_from(_POOL))
        elif op == "bytes":
            tokens.insert(i, draw(st.binary(min_size=1, max_size=6)))
        elif op == "truncate":
            tokens = tokens[:i]
        elif op == "repeat":  # past the token limit, or past the size limit
            tokens = tokens * min(draw(st.sampled_from([2, 40, 5000])), 1 + 2 * MAX_SPEC_BYTES // max(len(data), 1))
        elif op == "long_comment":
            tokens.insert(i, b"\n#" + b"x" * draw(st.sampled_from([1000, MAX_SPEC_BYTES - 2000])) + b"\n")
        elif op == "long_word":
            tokens.insert(i, b" " + b"w" * draw(st.sampled_from([100, 100_000])) + b" ")
        else:
            tokens = [draw(st.sampled_from([b"", b" \n\t", b"\n" * 1000]))]
        data = b"".join(tokens)[: 2 * MAX_SPEC_BYTES]  # past the limit is past it; repeats must not grow forever
    return data


@fuzz_settings(400)
@given(mutated_specs(), st.integers(0, 24))
def test_mutated_shipped_specs_compile_or_fail_cleanly(data, lucky):
    generate_and_sample(data, lucky == 0)


@pytest.mark.parametrize("path", shipped_specs(), ids=os.path.basename)
def test_shipped_specs_pass_the_property(path):
    """The fuzzers' starting points themselves: they compile and carry only expected tokens."""
    assert isinstance(generate(open(path, "rb").read()), tuple)


# -- valid specs validate --------------------------------------------------------------------------------


@st.composite
def supported_specs(draw) -> str:
    """Specs attngen generates today, with few heads, so that each one can run in the interpreter."""
    kv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2]))
    entries = {
        "head_dim": draw(st.sampled_from(VALID["head_dim"])),
        "dtype": draw(st.sampled_from(VALID["dtype"])),
        "mask": draw(st.sampled_from(VALID["mask"])),
        "heads": draw(st.sampled_from(["any", str(kv * group)])),
        "kv_heads": str(kv),
        "scale": draw(st.sampled_from(VALID["scale"])),
        "block_m": draw(st.sampled_from(["auto", "16", "32", "64"])),
        "block_n": draw(st.sampled_from(["auto", "16", "32", "64"])),
        "num_stages": draw(st.sampled_from(["auto", "1", "2"])),  # deeper pipelines may not fit d=256 fp32
        "score": draw(st.sampled_from(["softcap(30)", "softcap(2)", "alibi"])),  # (validate passes their tensors)
        "sinks": "true",
    }
    if entries["heads"] == "any":
        del entries["kv_heads"]
    keys = set(draw(st.lists(st.sampled_from(sorted(entries)), unique=True))) | {"head_dim", "dtype"}
    if "kv_heads" in keys:
        keys.add("heads")
    body = "\n".join(f"    {k} = {entries[k]}" for k in draw(st.permutations(sorted(keys))))
    return f"kernel valid_{draw(st.integers(0, 10**6))} {{\n{body}\n}}\n"


@fuzz_settings(6)
@given(supported_specs())
def test_supported_specs_validate_against_float64(text):
    result = generate(text)
    assert isinstance(result, tuple), str(result)
    validate_small(result[0])


# -- the command line ---------------------------------------------------------------------------------


@fuzz_settings(25)
@given(st.one_of(mutated_specs(), grammar_specs().map(lambda t: t.encode())))
def test_command_line_exits_2_with_a_location_and_no_traceback(data):
    expected = generate(data, "spec.attn")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "spec.attn")
        with open(path, "wb") as f:
            f.write(data)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(["compile", path, "-o", os.path.join(tmp, "out")])
        stderr = err.getvalue()
        assert "Traceback" not in stderr
        if isinstance(expected, SpecError):
            assert status == 2, stderr
            assert re.match(rf"{re.escape(path)}:{expected.line}:{expected.column}: error: ", stderr), stderr
            assert stderr.count("\n") == 1
        else:
            assert status == 0, stderr
            spec, source = expected
            with open(os.path.join(tmp, "out", f"{spec.name}.py")) as f:
                assert f.read() == source


# -- size limits ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("make,where", [
    (lambda base: base + b"#" + b"x" * (MAX_SPEC_BYTES - len(base) - 1), None),   # at the limit: fine
    (lambda base: base + b"#" + b"x" * (MAX_SPEC_BYTES - len(base)), "limit"),     # one byte over
    (lambda base: base + b"\n#" + "é".encode() * MAX_SPEC_BYTES, "limit"),        # over, multi-byte
    (lambda base: base.replace(b"}", b" mask = none" * 50_000 + b"}"), "tokens"),
    (lambda base: base.replace(b"}", b" mask = " + b"f(" * 50_000 + b")" * 50_000 + b"}"), "nested"),
    (lambda base: base.replace(b"}", b" mask = " + b"w" * 500_000 + b"}"), "unknown mask"),
    (lambda base: base.replace(b"64", b"9" * 500_000), "out of range"),
])
def test_huge_inputs_fail_fast_or_parse_fast(make, where):
    base = b"kernel k {\n    head_dim = 64\n    dtype = fp16\n}\n"
    data = make(base)
    start = time.perf_counter()
    result = generate(data, "big.attn")
    assert time.perf_counter() - start < PARSE_SECONDS
    if where is None:
        assert isinstance(result, tuple)
    else:
        assert isinstance(result, SpecError) and where in result.message, str(result)[:300]
