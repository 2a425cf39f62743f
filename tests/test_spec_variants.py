"""The spec language's variants (issue 48): masks, score modifiers, sinks and tensor declarations parse to
lang/variants.py's tree, print back to the same tree, and every mistake is a SpecError at its text."""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attngen import SpecError
from attngen.cli import main
from attngen.lang import variants as v
from attngen.lang.spec import Direction, Mask, parse

HEAD = "kernel k { head_dim = 64 dtype = fp16 "


def spec(body: str):
    return parse(HEAD + body + " }", "v.attn")


q, k, h, b, s = (v.Var(n) for n in "qkhbs")
CAUSAL = v.Causal()

# (entries, the variant they say)
EXAMPLES = [
    ("mask = causal & window(4096)", v.Variant(mask=v.And(CAUSAL, v.Window(4095, 0, 4096)))),
    ("mask = window(4096)", v.Variant(mask=v.Window(4095, 0, 4096))),
    ("mask = window(128, 0)", v.Variant(mask=v.Window(128, 0))),
    ("mask = window(0, 0)", v.Variant(mask=v.Window(0, 0))),
    ("mask = causal | prefix(2048)", v.Variant(mask=v.Or(CAUSAL, v.Prefix(2048)))),
    ("mask = causal & chunked(8192)", v.Variant(mask=v.And(CAUSAL, v.Chunked(8192)))),
    ("mask = (causal | prefix(64)) & window(512)",
     v.Variant(mask=v.And(v.Or(CAUSAL, v.Prefix(64)), v.Window(511, 0, 512)))),
    ("mask = q - k < 1024 and (k < 64 or q >= k)",
     v.Variant(mask=v.And(v.Compare("<", v.BinOp("-", q, k), v.Const(1024)),
                          v.Or(v.Compare("<", k, v.Const(64)), v.Compare(">=", q, k))))),
    ("mask = not (k % 2 == 1)", v.Variant(mask=v.Not(v.Compare("==", v.BinOp("%", k, v.Const(2)), v.Const(1))))),
    ("mask = causal(bottom_right) & window(8)", v.Variant(mask=v.And(v.Causal("bottom_right"), v.Window(7, 0, 8)))),
    ("mask = q-1 < k", v.Variant(mask=v.Compare("<", v.BinOp("-", q, v.Const(1)), k))),
    ("mask = abs(q - k) <= 3 & h == 0 | not b != 1",
     v.Variant(mask=v.Or(v.And(v.Compare("<=", v.Func("abs", (v.BinOp("-", q, k),)), v.Const(3)),
                               v.Compare("==", h, v.Const(0))),
                         v.Not(v.Compare("!=", b, v.Const(1)))))),
    ("mask = m[q] > 0 tensor m[4096]: int32",
     v.Variant(mask=v.Compare(">", v.Index("m", (q,)), v.Const(0)), tensors=(v.TensorDecl("m", (4096,), "int32"),))),
    ("score = softcap(30)", v.Variant(score=v.Softcap(30.0))),
    ("score = softcap(50.0)", v.Variant(score=v.Softcap(50.0))),
    ("score = softcap(0.5)", v.Variant(score=v.Softcap(0.5))),
    ("score = alibi", v.Variant(score=v.Alibi())),
    ("score = s + bias[h, q - k + 4095]\n tensor bias[H, 8192]: fp32",
     v.Variant(score=v.ScoreExpr(v.BinOp("+", s, v.Index("bias", (h, v.BinOp("+", v.BinOp("-", q, k), v.Const(4095)))))),
               tensors=(v.TensorDecl("bias", ("H", 8192), "fp32"),))),
    ("score = 30 * tanh(s / 30)",
     v.Variant(score=v.ScoreExpr(v.BinOp("*", v.Const(30), v.Func("tanh", (v.BinOp("/", s, v.Const(30)),)))))),
    ("score = -s * 0.5 - -1", v.Variant(score=v.ScoreExpr(v.BinOp("-", v.BinOp("*", v.Neg(s), v.Const(0.5)), v.Const(-1))))),
    ("score = s + (q + (k + 1))",
     v.Variant(score=v.ScoreExpr(v.BinOp("+", s, v.BinOp("+", q, v.BinOp("+", k, v.Const(1))))))),
    ("sinks = true", v.Variant(sinks=True)),
    ("mask = causal & window(128) score = softcap(30) sinks = true",
     v.Variant(mask=v.And(CAUSAL, v.Window(127, 0, 128)), score=v.Softcap(30.0), sinks=True)),
    ("mask = (causal & window(8)) & (prefix(4) | chunked(16)) score = alibi kv_layout = paged(page_size = 16)",
     v.Variant(mask=v.And(v.And(CAUSAL, v.Window(7, 0, 8)), v.Or(v.Prefix(4), v.Chunked(16))), score=v.Alibi())),
]


@pytest.mark.parametrize("body,variant", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_variants_parse_to_their_tree_and_print_back(body, variant):
    got = spec(body)
    assert got.variant == variant
    assert got.mask is (Mask.CUSTOM if variant.mask is not None else Mask.NONE)
    again = parse(got.canonical())
    assert again == got and again.variant == variant and again.canonical() == got.canonical()


def test_plain_masks_keep_the_enum_and_no_tree():
    for text, mask in [("none", Mask.NONE), ("causal", Mask.CAUSAL_TOP_LEFT), ("(causal)", Mask.CAUSAL_TOP_LEFT),
                       ("causal(top_left)", Mask.CAUSAL_TOP_LEFT), ("causal(align = bottom_right)", Mask.CAUSAL_BOTTOM_RIGHT),
                       ("causal(bottom_right)", Mask.CAUSAL_BOTTOM_RIGHT)]:
        got = spec(f"mask = {text}")
        assert got.mask is mask and got.variant == v.Variant() and not got.variant, text
        assert "score" not in got.canonical() and "tensor" not in got.canonical()


def test_old_spellings_parse_as_before():
    spaced = spec("direction = forward + backward scale = +0.125 block_m = +64")
    assert spaced == spec("direction = forward+backward scale = 0.125 block_m = 64")
    assert spaced.direction is Direction.FORWARD_BACKWARD and spaced.scale == 0.125 and spaced.block_m == 64
    assert spec("kv_layout = paged(page_size = 16)").kv_layout.page_size == 16
    assert parse("kernel tensor { head_dim = 64 dtype = fp16 }").name == "tensor"


def test_window_keeps_what_was_written():
    assert spec("mask = window(4096)").canonical() != spec("mask = window(4095, 0)").canonical()
    assert "mask = window(4096)" in spec("mask = window(4096)").canonical()


def test_nodes_know_where_they_were_written():
    got = parse("kernel k {\n  head_dim = 64 dtype = fp16\n  mask = causal & (q - k < 9)\n"
                "  score = s + t[h]\n  tensor t[H]: fp32\n}", "p.attn")
    m = got.variant.mask
    assert (m.pos, m.a.pos, m.b.pos, m.b.a.pos, m.b.a.b.pos) == ((3, 10), (3, 10), (3, 20), (3, 20), (3, 24))
    e = got.variant.score.expr
    assert (e.pos, e.b.pos, e.b.args[0].pos) == ((4, 11), (4, 15), (4, 17))
    assert got.variant.tensors[0].pos == (5, 3)


# (entries, line, column, words the message must contain); the entries start at column 39 of line 1
BAD = [
    ("mask = window(0)", 1, 53, ["window = 0", "at least 1"]),
    ("mask = window(-4)", 1, 53, ["window = -4", "at least 1"]),
    ("mask = window(-1, 0)", 1, 53, ["window left = -1", "at least 0"]),
    ("mask = window(4, -2)", 1, 56, ["window right = -2"]),
    ("mask = window(4.5)", 1, 53, ["whole number", "4.5"]),
    ("mask = window(1, 2, 3)", 1, 46, ["one or two sizes"]),
    ("mask = causal & chunked(0)", 1, 63, ["chunked = 0"]),
    ("mask = causal | prefix(-3)", 1, 62, ["prefix = -3"]),
    ("mask = window(4) & prefix(0)", 1, 65, ["prefix = 0"]),
    ("mask = window(99999999999)", 1, 53, ["out of range"]),
    ("score = softcap(0)", 1, 55, ["softcap = 0", "positive"]),
    ("score = softcap(-30)", 1, 55, ["softcap = -30"]),
    ("score = softcap(1e999)", 1, 55, ["finite"]),
    ("score = softcap(s)", 1, 55, ["positive number"]),
    ("mask = q - x < 4", 1, 50, ["unknown name 'x'", "q, k, h, b"]),
    ("mask = q < kk", 1, 50, ["unknown name 'kk'"]),
    ("score = s + qq", 1, 51, ["unknown name 'qq'", "did you mean 'q'"]),
    ("mask = s < 1", 1, 46, ["'s'", "score"]),
    ("mask = slide(4)", 1, 46, ["unknown mask 'slide(4)'"]),
    ("mask = sliding", 1, 46, ["unknown mask 'sliding'"]),
    ("mask = windw(4) & causal", 1, 46, ["did you mean 'window'"]),
    ("score = s * tanhh(s)", 1, 51, ["unknown function 'tanhh'", "did you mean 'tanh'"]),
    ("score = max(s)", 1, 47, ["max takes 2 arguments"]),
    ("score = tanh(s, 1)", 1, 47, ["tanh takes 1 argument"]),
    ("score = s + bias[h]", 1, 51, ["tensor 'bias' is not declared"]),
    ("score = s + bias[h] tensor bias[H, 8]: fp32", 1, 51, ["2 dimension", "1 index"]),
    ("score = s + bias tensor bias[H]: fp32", 1, 51, ["read with 1 index"]),
    ("score = s + bias[x] tensor bias[H]: fp32", 1, 56, ["unknown name 'x'"]),
    ("score = s + bias[s] tensor bias[H]: fp32", 1, 56, ["index is a whole number"]),
    ("score = s tensor bias[H]: fp32", 1, 49, ["'bias' is declared but never read"]),
    ("score = s + t[q] tensor t[4]: fp32\n tensor t[8]: fp32", 2, 2, ["declared twice", "line 1"]),
    ("score = s + q[q] tensor q[4]: fp32", 1, 56, ["'q' cannot name a tensor"]),
    ("score = alibi tensor alibi_slopes[H]: fp32", 1, 53, ["'alibi_slopes' cannot name a tensor"]),
    ("sinks = true tensor sinks[H]: fp32", 1, 52, ["'sinks' cannot name a tensor"]),
    ("score = s + tanh[q] tensor tanh[4]: fp32", 1, 59, ["'tanh' cannot name a tensor"]),
    ("score = s + t[q] tensor t[Q]: fp32", 1, 65, ["unknown dimension 'Q'"]),
    ("score = s + t[q] tensor t[0]: fp32", 1, 65, ["tensor dimension = 0"]),
    ("score = s + t[q] tensor t[4]: fp64", 1, 69, ["unknown tensor dtype 'fp64'"]),
    ("mask = m[q] > 0 tensor m[8]: fp32", 1, 46, ["whole numbers", "int32"]),
    ("mask = causal & not causal", 1, 46, ["keeps no key"]),
    ("mask = window(8) & not window(16)", 1, 46, ["keeps no key"]),
    ("mask = q - k > 4000 & q < 4000", 1, 46, ["keeps no key"]),
    ("mask = 2 < 1", 1, 46, ["keeps no key"]),
    ("score = q * 2", 1, 47, ["score must depend on s"]),
    ("score = 1", 1, 47, ["score must depend on s"]),
    ("mask = causal(top_left) & causal(bottom_right)", 1, 65, ["causal(top_left) and causal(bottom_right)"]),
    ("mask = q - k", 1, 46, ["a mask is a condition", "'q - k' is a number"]),
    ("mask = causal & q", 1, 55, ["a mask is a condition"]),
    ("mask = causal & none", 1, 55, ["none is a whole mask"]),
    ("mask = q < (k < 1)", 1, 51, ["condition; a number is expected"]),
    ("mask = q + window(4) < k", 1, 50, ["is a mask"]),
    ("score = s < 1", 1, 47, ["a score is a number", "condition"]),
    ("score = s + (q < k)", 1, 52, ["condition; a number is expected"]),
    ("score = s + softcap(30)", 1, 51, ["softcap is a whole score"]),
    ("mask = q // 2 < 2147483648", 1, 55, ["does not fit 31 bits"]),
    ("mask = q < k * 2.5", 1, 54, ["whole numbers", "2.5"]),
    ("mask = q / 2 < k", 1, 46, ["use //"]),
    ("mask = q % 0 == 1", 1, 50, ["division by zero"]),
    ("score = s * 1e999", 1, 51, ["not a finite number"]),
    ("score = s + abs(x = s)", 1, 59, ["positional"]),
    ("sinks = yes", 1, 47, ["sinks takes true or false"]),
    ("scale = -1", 1, 47, ["scale = -1", "out of range"]),
    ("mask = q < k < 1", 1, 52, ["unexpected '<'"]),
    ("score = s" + " + 1" * 40, 1, 47, ["nests more than"]),
    ("mask = causal & window(4) score = s + t[q] tensor t[4]: fp32 tensor u[4]: fp32", 1, 100, ["'u' is declared but never read"]),
]


@pytest.mark.parametrize("body,line,col,words", BAD, ids=[b[0][:50] for b in BAD])
def test_variant_errors_name_their_line_and_column(body, line, col, words):
    with pytest.raises(SpecError) as info:
        spec(body)
    e = info.value
    assert (e.filename, e.line, e.column) == ("v.attn", line, col), str(e)
    assert str(e).startswith(f"v.attn:{line}:{col}: error: ")
    for w in words:
        assert w in e.message, e.message


def test_compile_of_a_bad_variant_exits_2_at_its_text(tmp_path, capsys):
    bad = tmp_path / "swa.attn"
    bad.write_text("kernel swa {\n    head_dim = 64\n    dtype = fp16\n    mask = causal & window(0)\n}\n")
    assert main(["compile", str(bad), "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{bad}:4:28: error: window = 0 must be at least 1"), err
    assert "Traceback" not in err
    assert os.listdir(tmp_path) == ["swa.attn"]  # nothing generated


# -- fuzzing: whatever expression a spec holds, a Spec or a located SpecError -----------------------------

ATOMS = ["q", "k", "h", "b", "s", "x", "0", "1", "7", "64", "4096", "2.5", "1e999", "2147483648", "causal",
         "none", "alibi", "window(4)", "window(0)", "window(3, 1)", "prefix(2)", "chunked(8)", "causal(top_left)",
         "causal(bottom_right)", "softcap(30)", "abs(q - k)", "max(q, k)", "tanh(s)", "t[q]", "t[h, q]", "u[k]",
         "m[q]", "(", ")", "[", "]", ",", "="]
OPS = ["+", "-", "*", "/", "//", "%", "<", "<=", ">", ">=", "==", "!=", "&", "|", "and", "or", "not", "-"]
TENSORS = ["", "tensor t[H, 64]: fp32", "tensor m[64]: int32", "tensor t[4]: bf16 tensor u[B]: int32"]


@st.composite
def expression(draw):
    parts = draw(st.lists(st.one_of(st.sampled_from(ATOMS), st.sampled_from(OPS)), min_size=1, max_size=12))
    return " ".join(parts)


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(["mask", "score", "mask", "score"]), expr=expression(), tensors=st.sampled_from(TENSORS))
def test_random_expressions_give_a_spec_or_a_located_spec_error(key, expr, tensors):
    text = f"{HEAD}\n{key} = {expr}\n{tensors}\n}}"
    try:
        got = parse(text, "f.attn")
    except SpecError as e:
        lines = text.split("\n")
        assert e.filename == "f.attn" and 1 <= e.line <= len(lines), str(e)
        assert 1 <= e.column <= len(lines[e.line - 1]) + 1, str(e)
        assert "\n" not in str(e) and len(str(e)) < 400
        return
    again = parse(got.canonical())
    assert again == got and again.variant == got.variant and again.canonical() == got.canonical()
