"""The block analysis (analysis/masks.py) against brute force: the reference's own mask evaluated on every
element of every tile, and every kept score counted."""

import pytest
import torch

from attngen.analysis import cost, masks
from attngen.lang import variants as v
from attngen.lang.spec import Mask, parse
from attngen.testing.reference import _holds

BASE = parse("kernel t { mask = none\n head_dim = 64\n dtype = bf16 }")


def spec_of(mask, score=None, sinks=False):
    return BASE.replace(mask=Mask.CUSTOM if mask is not None else Mask.NONE, variant=v.Variant(mask, score, sinks))


# The named variants at sizes small enough to enumerate, with the same shapes of bound.
q, k = v.Var("q"), v.Var("k")
NAMED = {
    "sliding_window": spec_of(v.And(v.Causal(), v.Window(39, 0, 40))),
    "window_left_right": spec_of(v.Window(21, 13)),
    "prefix_lm": spec_of(v.Or(v.Causal(), v.Prefix(37))),
    "chunked": spec_of(v.And(v.Causal(), v.Chunked(45))),
    "alibi": spec_of(v.Causal(), v.Alibi()),
    "sinks_window": spec_of(v.And(v.Causal(), v.Window(27, 0, 28)), None, True),
    "bottom_right_window": spec_of(v.And(v.Causal("bottom_right"), v.Window(50, 0, 51))),
    "general_bands": spec_of(v.And(v.Compare("<", v.BinOp("-", q, k), v.Const(60)),
                                   v.Or(v.Compare("<", k, v.Const(9)), v.Compare(">=", q, k)))),
}
# Conditions the analysis cannot bound: evaluated per block, so only soundness holds on tiles.
GENERAL = {
    "modular": spec_of(v.And(v.Causal(), v.Compare("!=", v.BinOp("%", k, v.Const(7)), v.Const(3)))),
    "not_window": spec_of(v.Not(v.Window(10, 10))),
    "per_head": spec_of(v.And(v.Causal(), v.Compare("<", k, v.BinOp("*", v.BinOp("+", v.Var("h"), v.Const(1)),
                                                                           v.Const(30))))),
}
PLAIN = {
    "none": BASE,
    "causal": BASE.replace(mask=Mask.CAUSAL_TOP_LEFT),
    "causal_bottom_right": BASE.replace(mask=Mask.CAUSAL_BOTTOM_RIGHT),
}
SIZES = [(131, 131, 16, 16), (77, 200, 16, 32), (200, 77, 32, 16), (1, 93, 16, 16), (250, 250, 64, 32)]


def brute_keep(spec, n_q, n_k, heads=1, batch=1):
    """(batch, heads, n_q, n_k) of what the reference keeps."""
    offset = n_k - n_q if spec.bottom_right else 0
    env = {"b": torch.arange(batch)[:, None, None, None], "h": torch.arange(heads)[None, :, None, None],
           "q": torch.arange(n_q)[None, None, :, None] + offset, "k": torch.arange(n_k)[None, None, None, :]}
    mask = spec.variant.mask
    if mask is None:
        if spec.mask is Mask.NONE:
            return torch.ones(batch, heads, n_q, n_k, dtype=torch.bool)
        mask = v.Causal()
    return _holds(mask, env).expand(batch, heads, n_q, n_k)


def brute_blocks(keep, n_q, n_k, bm, bn):
    """The tile classes by enumeration: keys past N_K count as masked, rows past N_Q do not count."""
    rows, cols = -(-n_q // bm), -(-n_k // bn)
    padded = torch.zeros(n_q, cols * bn, dtype=torch.bool)
    padded[:, :n_k] = keep
    out = []
    for i in range(rows):
        row = ""
        for j in range(cols):
            tile = padded[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            row += "#" if tile.all() else "." if not tile.any() else "~"
        out.append(row)
    return tuple(out)


@pytest.mark.parametrize("name", list(NAMED) + list(PLAIN))
@pytest.mark.parametrize("n_q,n_k,bm,bn", SIZES)
def test_bands_classify_every_tile_exactly(name, n_q, n_k, bm, bn):
    spec = {**NAMED, **PLAIN}[name]
    found = masks.classify(spec, n_q, n_k, bm, bn)
    assert not found.evaluated
    expected = brute_blocks(brute_keep(spec, n_q, n_k)[0, 0], n_q, n_k, bm, bn)
    assert found.cells == expected, "\n" + "\n".join(found.cells) + "\n!=\n" + "\n".join(expected)


@pytest.mark.parametrize("name", GENERAL)
@pytest.mark.parametrize("n_q,n_k,bm,bn", SIZES)
def test_conditions_the_analysis_cannot_bound_are_evaluated_on_every_live_tile(name, n_q, n_k, bm, bn):
    spec = GENERAL[name]
    found = masks.classify(spec, n_q, n_k, bm, bn)
    assert found.evaluated and found.count(masks.Block.FULL) == 0
    keep = brute_keep(spec, n_q, n_k, heads=4).any(dim=1)[0]  # a tile is live if any head keeps a score there
    expected = brute_blocks(keep, n_q, n_k, bm, bn)
    # Sound: an empty tile keeps nothing; every tile with a kept score is visited (partial).
    pairs = [(a, b) for got, want in zip(found.cells, expected) for a, b in zip(got, want)]
    assert all(a == "~" if b != "." else a in ".~" for a, b in pairs)


def test_the_bands_of_a_general_mask_still_skip_tiles():
    spec = spec_of(v.And(v.And(v.Causal(), v.Window(31, 0, 32)),
                         v.Compare("!=", v.BinOp("%", k, v.Const(7)), v.Const(3))))
    found = masks.classify(spec, 256, 256, 16, 16)
    assert found.evaluated and found.count(masks.Block.EMPTY) > 200


@pytest.mark.parametrize("name", list(NAMED) + list(GENERAL) + list(PLAIN))
@pytest.mark.parametrize("n_q,n_k", [(131, 131), (77, 200), (200, 77), (1, 93), (93, 1)])
def test_kept_scores_match_brute_force(name, n_q, n_k):
    spec = {**NAMED, **GENERAL, **PLAIN}[name]
    expected = int(brute_keep(spec, n_q, n_k, heads=3, batch=2).sum())
    assert masks.kept_scores(spec, n_q, n_k, batch=2, heads=3) == expected
    # A small chunk takes the numeric path a few rows at a time.
    assert masks.kept_scores(spec, n_q, n_k, batch=2, heads=3, chunk=50) == expected


def test_kept_scores_at_training_length_in_closed_form():
    n, w = 16384, 4096
    window = spec_of(v.And(v.Causal(), v.Window(w - 1, 0, w)))
    assert masks.kept_scores(window, n, n) == w * (w + 1) // 2 + (n - w) * w
    chunked = spec_of(v.And(v.Causal(), v.Chunked(8192)))
    assert masks.kept_scores(chunked, n, n) == 2 * 8192 * 8193 // 2
    prefix = spec_of(v.Or(v.Causal(), v.Prefix(2048)))
    assert masks.kept_scores(prefix, n, n) == 2048 * 2048 + n * (n + 1) // 2 - 2048 * 2049 // 2


def test_fa_flops_count_kept_scores_and_leave_plain_masks_as_they_were():
    sizes = dict(B=2, H=3, N_Q=300, N_K=300, HEAD_DIM=64)
    for plain in PLAIN.values():
        for backward in (False, True):
            assert masks.fa_flops(plain, sizes, backward) == cost.evaluate(
                cost.fa_flops(plain.mask.is_causal, backward), sizes)
    window = NAMED["sliding_window"]
    kept = masks.kept_scores(window, 300, 300, 2, 3)
    assert masks.fa_flops(window, sizes) == 4 * 64 * kept
    assert masks.fa_flops(window, sizes, backward=True) == 2.5 * 4 * 64 * kept


def test_predicates_say_which_are_bounded():
    window = [masks.describe(p) for p in masks.predicates(NAMED["sliding_window"])]
    assert window == ["k_idx <= q_idx", "k_idx >= q_idx - 39"]
    preds = masks.predicates(GENERAL["modular"])
    assert [masks.bounded(p) for p in preds] == [True, False]


def test_block_map_text_is_capped_and_merges_tiles():
    found = masks.classify(NAMED["sliding_window"], 4096, 4096, 16, 16)
    lines = found.text(cap=32)
    assert len(lines) == 32 and {len(line) for line in lines} == {32}
    assert lines[0] == "~" + "." * 31 and lines[-1][-1] == "~" and lines[-1][0] == "."
