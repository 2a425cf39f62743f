"""The spec language: parsing, canonical identity, and every user error located at its text."""

import pytest

from attngen import SpecError, UnsupportedError
from attngen.lang.spec import Direction, DType, Mask, load_file, parse
from conftest import shipped_specs, spec_text


def test_minimal_spec_fills_defaults():
    spec = parse("kernel k { head_dim = 64 dtype = fp16 }")
    assert spec.direction is Direction.FORWARD and spec.mask is Mask.NONE
    assert spec.block_m is None and spec.split_kv == 1 and not spec.kv_layout.paged
    assert spec.softmax_scale == pytest.approx(64 ** -0.5)


def test_all_keys_parse():
    spec = parse("""
        # every key
        kernel full_spec {
            direction = forward+backward
            mask = causal(bottom_right)
            head_dim = 96; dtype = bf16
            heads = 32  kv_heads = 8
            scale = 0.125
            block_m = 128 block_n = 64 num_warps = 8 num_stages = 3
            split_kv = 1
            kv_layout = contiguous
            pack_gqa = false
        }""")
    assert spec.backward and spec.mask is Mask.CAUSAL_BOTTOM_RIGHT and spec.dtype is DType.BF16
    assert (spec.heads, spec.kv_heads, spec.group) == (32, 8, 4)
    assert spec.head_dim_padded == 128 and spec.scale == 0.125
    assert (spec.block_m, spec.block_n, spec.num_warps, spec.num_stages) == (128, 64, 8, 3)


def test_group_implies_kv_heads():
    spec = parse(spec_text(heads=16, group=4))
    assert spec.kv_heads == 4


def test_identity_ignores_comments_layout_and_order():
    a = parse("kernel k { head_dim = 64 dtype = fp16 mask = causal }")
    b = parse("# same kernel\nkernel k {\n  mask = causal(top_left)   # spelled out\n  dtype = fp16\n  head_dim = 64\n}\n")
    assert a == b and a.hash == b.hash and a.canonical() == b.canonical()
    assert parse(spec_text(head_dim=128)).hash != a.hash


def test_canonical_text_parses_back_to_the_same_spec():
    spec = parse(spec_text(mask="causal(bottom_right)", heads=8, kv_heads=2, block_m=64, scale=0.5))
    assert parse(spec.canonical()) == spec


@pytest.mark.parametrize("path", shipped_specs())
def test_shipped_specs_parse(path):
    spec = load_file(path)
    assert spec.filename == path and spec.name


# (spec text, line, column, words the message must contain)
BAD = [
    ("kernel k { head_dim = 100 dtype = fp16 }", 1, 23, ["head_dim = 100", "multiple of 16", "96", "112"]),
    ("kernel k { head_dim = 272 dtype = fp16 }", 1, 23, ["out of range", "16 to 256"]),
    ("kernel k { head_dim = 64 dtype = fp16 block_m = 48 }", 1, 49, ["block_m = 48", "power of two", "32 or 64"]),
    ("kernel k { head_dim = 64 dtype = fp16 blok_m = 64 }", 1, 39, ["unknown key 'blok_m'", "block_m"]),
    ("kernel k {\n head_dim = 64\n dtype = fp16\n head_dim = 32 }", 4, 2, ["duplicate key 'head_dim'", "line 2"]),
    ("kernel k { head_dim = 64 dtype = fp8 }", 1, 34, ["unknown dtype 'fp8'", "fp16"]),
    ("kernel k { head_dim = 64 dtype = float16 }", 1, 34, ["spelled 'fp16'"]),
    ("kernel k { head_dim = 64 dtype = fp16 mask = sliding }", 1, 46, ["unknown mask 'sliding'"]),
    ("kernel k { head_dim = 64 }", 1, 8, ["does not set dtype"]),
    ("kernel k { head_dim 64 dtype = fp16 }", 1, 21, ["unexpected '64'", "'='"]),
    ("kernel k { head_dim = 64 dtype = fp16 ", 1, 39, ["end of file", "'}'"]),
    ("kernel k { head_dim = @ }", 1, 23, ["unexpected character '@'"]),
    ("kernel class { head_dim = 64 dtype = fp16 }", 1, 8, ["Python keyword"]),
    ("kernel k { head_dim = 64 dtype = fp16 heads = 6 kv_heads = 4 }", 1, 60, ["not a multiple of kv_heads"]),
    ("kernel k { head_dim = 64 dtype = fp16 heads = 8 kv_heads = 2 group = 3 }", 1, 70, ["contradicts"]),
    ("kernel k { head_dim = 64 dtype = fp16 kv_layout = paged(page_size = 24) }", 1, 69, ["power of two"]),
    ("kernel k { head_dim = 64 dtype = fp16 scale = -1 }", 1, 47, ["scale = -1", "out of range"]),
    ("kernel k { head_dim = 64 dtype = fp16 direction = backward }", 1, 51, ["forward+backward"]),
    ("kernel k { head_dim = 99999999999999999999999 dtype = fp16 }", 1, 23, ["out of range"]),
    ("", 1, 1, ["empty spec"]),
]


@pytest.mark.parametrize("text,line,col,words", BAD)
def test_errors_name_their_line_and_column(text, line, col, words):
    with pytest.raises(SpecError) as info:
        parse(text, "bad.attn")
    e = info.value
    assert (e.filename, e.line, e.column) == ("bad.attn", line, col), str(e)
    assert str(e).startswith(f"bad.attn:{line}:{col}: error: ")
    for w in words:
        assert w in e.message, e.message


def test_infeasible_tiles_are_a_spec_error_with_numbers():
    from attngen.analysis.resources import check_spec_tiles

    spec = parse("kernel k {\n head_dim = 256\n dtype = fp32\n block_m = 128\n block_n = 128\n num_stages = 4\n}", "t.attn")
    with pytest.raises(SpecError) as info:
        check_spec_tiles(spec)
    assert (info.value.line, info.value.column) == (4, 12)
    assert "shared memory" in info.value.message and "232,448" in info.value.message


def test_paged_backward_is_unsupported():
    with pytest.raises(UnsupportedError):
        parse(spec_text(direction="forward+backward", kv_layout="paged(16)"))


def test_non_utf8_is_a_spec_error():
    with pytest.raises(SpecError) as info:
        parse(b"kernel k {\n head_dim = 64 \xff }", "b.attn")
    assert info.value.line == 2
