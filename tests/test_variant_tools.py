"""attngen explain and attngen check on variant specs (masks and score modifiers): the block map, the
predicates the analysis bounds or evaluates per block, the kept-score FLOPs, and validation against the
full-matrix float64 reference."""

import os

import pytest

import attngen.cli as cli
from attngen.analysis import masks
from attngen.lang import variants as v
from attngen.lang.spec import Mask, load_file, parse
from attngen.runtime.kernel import load
from attngen.testing.accuracy import Case, format_result, validate
from conftest import shipped_specs

SMALL = parse("kernel small { mask = none\n head_dim = 32\n dtype = bf16\n block_m = 16\n block_n = 16 }")
BIG = parse("kernel big { mask = none\n head_dim = 128\n dtype = bf16 }")
k = v.Var("k")


def variant(base, mask=None, score=None, sinks=False, causal=False):
    plain = Mask.CAUSAL_TOP_LEFT if causal else Mask.NONE
    return base.replace(mask=Mask.CUSTOM if mask is not None else plain, variant=v.Variant(mask, score, sinks))


def explain(monkeypatch, capsys, spec, *args):
    monkeypatch.setattr(cli, "_spec", lambda path: spec)
    assert cli.main(["explain", "spec.attn", "--pass", "lower", *args]) == 0
    return capsys.readouterr().out


def test_explain_prints_a_window_s_block_map_and_kept_flops(monkeypatch, capsys):
    spec = variant(BIG, v.And(v.Causal(), v.Window(1023, 0, 1024)), v.Softcap(30.0))
    out = explain(monkeypatch, capsys, spec, "--shape", "N=4096")
    assert "mask = causal & window(1024) (top-left aligned)" in out
    assert out.count("bounded in closed form") == 2 and "cannot bound" not in out
    grid = out.split("rows are query blocks")[1].splitlines()[1:33]
    assert [len(line.strip()) for line in grid] == [32] * 32
    assert grid[0].strip() == "~" + "." * 31 and grid[31].strip() == "." * 23 + "~" + "#" * 7 + "~"
    kept = masks.kept_scores(spec, 4096, 4096, 1, 16)
    assert f"FlashAttention convention (4*d per kept score): {4 * 128 * kept / 1e9:.2f} GFLOP" in out
    assert "score = softcap(30)" in out


def test_explain_says_which_predicate_is_evaluated_per_block(monkeypatch, capsys):
    spec = variant(BIG, v.And(v.Causal(), v.Compare("!=", v.BinOp("%", k, v.Const(64)), v.Const(7))))
    out = explain(monkeypatch, capsys, spec, "--shape", "N=1024")
    assert "the analysis cannot bound: evaluated on every live block" in out
    assert "bounded in closed form" in out  # the causal diagonal still skips tiles
    assert "28 empty (skipped), 0 full (no mask), 36 partial (masked)" in out


def test_explain_of_a_plain_mask_with_a_score_modifier_keeps_the_plain_flops(monkeypatch, capsys):
    spec = variant(BIG, None, v.Alibi(), sinks=True, causal=True)
    out = explain(monkeypatch, capsys, spec)
    assert "(4*B*H*N_Q*N_K*d, /2 causal): 68.72 GFLOP" in out
    assert "block map" not in out and "score = alibi" in out
    assert "run-time tensors (keywords): alibi_slopes, sinks" in out


CHECKED = {
    "softcap_causal": variant(SMALL, None, v.Softcap(5.0), causal=True),
    "alibi_window": variant(SMALL, v.And(v.Causal(), v.Window(7, 0, 8)), v.Alibi()),
    "sinks_window": variant(SMALL, v.Window(7, 0, 8), None, True),
    "chunked": variant(SMALL, v.And(v.Causal(), v.Chunked(12))),
    "general": variant(SMALL, v.And(v.Causal(), v.Compare("!=", v.BinOp("%", k, v.Const(5)), v.Const(2)))),
    "declared_bias": SMALL.replace(mask=Mask.CAUSAL_TOP_LEFT, variant=v.Variant(
        None, v.ScoreExpr(v.BinOp("+", v.Var("s"), v.Index("bias", (v.Var("h"), v.BinOp("-", v.Var("q"), k))))),
        False, (v.TensorDecl("bias", ("H", 64), "fp32"),))),
}
CASES = [Case(1, 2, 2, 37, 45), Case(2, 2, 2, 20, 20), Case(1, 2, 2, 40, 9)]


@pytest.mark.parametrize("name", CHECKED)
def test_check_validates_variants_against_the_full_matrix_reference(name):
    results = validate(load(CHECKED[name]), cases=CASES, seed=2)
    assert all(r.ok for r in results), "\n".join(map(format_result, results))


class _Mislabelled:
    """A kernel compiled from one spec, presented as another's: validation must catch the difference."""

    def __init__(self, kernel, spec):
        self.spec, self.module, self.config, self._kernel = spec, kernel.module, kernel.config, kernel

    def __call__(self, *args, **kwargs):
        return self._kernel(*args, **kwargs)


@pytest.mark.parametrize("compiled,claimed", [
    (CHECKED["alibi_window"], variant(SMALL, v.Window(7, 2), v.Alibi())),
    (CHECKED["sinks_window"], variant(SMALL, v.Window(6, 0, 7), None, True)),
    (CHECKED["softcap_causal"], variant(SMALL, None, v.Softcap(4.0), causal=True)),
    (CHECKED["declared_bias"], CHECKED["declared_bias"].replace(mask=Mask.NONE)),
])
def test_check_fails_a_kernel_of_another_variant(compiled, claimed):
    results = validate(_Mislabelled(load(compiled), claimed), cases=CASES[:1], seed=2)
    assert not all(r.ok for r in results)


def test_cli_check_runs_a_variant_spec(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_spec", lambda path: CHECKED["sinks_window"])
    assert cli.main(["check", "spec.attn", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "mask window(8), sinks)" in out and "6/6 cases within tolerance" in out


VARIANT_SPECS = [p for p in shipped_specs() if load_file(p).variant]


def test_every_named_variant_has_a_shipped_spec():
    masks_seen = {load_file(p).variant.mask.text() for p in VARIANT_SPECS if load_file(p).variant.mask is not None}
    scores_seen = {load_file(p).variant.score.text() for p in VARIANT_SPECS if load_file(p).variant.score is not None}
    assert {"causal & window(4096)", "causal | prefix(2048)", "causal & chunked(8192)", "causal & window(128)",
            "window(4096)"} <= masks_seen, seen
    assert {"softcap(50)", "alibi"} <= scores_seen
    assert any(load_file(p).variant.sinks for p in VARIANT_SPECS)
    assert any(load_file(p).variant.tensors for p in VARIANT_SPECS)


@pytest.mark.parametrize("path", VARIANT_SPECS, ids=os.path.basename)
def test_explain_runs_on_each_shipped_variant_spec(path, capsys):
    assert cli.main(["explain", path, "--pass", "lower", "--shape", "N=2048"]) == 0
    out = capsys.readouterr().out
    assert "=== variant ===" in out
    spec = load_file(path)
    if spec.variant.mask is not None:
        assert "block map at" in out and "bounded in closed form" in out and "kept scores per head" in out
