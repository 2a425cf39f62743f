"""Masks and score modifiers (issue 48): their IR predicates, the closed-form block ranges causal-skip derives from
them, and the Triton forward against a float64 reference that builds the full matrices from the spec's tree."""

from __future__ import annotations

import importlib.util
import itertools
import math

import pytest
import sympy
import torch

from conftest import DEVICE

import attngen
from attngen import KernelInputError
from attngen.codegen import render
from attngen.ir import PredKind, sym
from attngen.ir import variants as irv
from attngen.lang import variants as v
from attngen.lang.spec import Mask, parse
from attngen.passes import compile_program
from attngen.passes.causal_skip import regions
from attngen.testing import reference

BASE = parse("kernel t {\n mask = none\n head_dim = 32\n dtype = fp32\n block_m = 16\n block_n = 16\n}\n")
GENERAL = v.And(v.Compare("<", v.BinOp("-", v.Var("q"), v.Var("k")), v.Const(20)),
                v.Or(v.Compare("<", v.Var("k"), v.Const(5)), v.Compare(">=", v.Var("q"), v.Var("k"))))
MASKS = {
    "window": v.Window(7, 0, 8),
    "causal_window": v.And(v.Causal(), v.Window(7, 0, 8)),
    "window_lr": v.Window(5, 3),
    "prefix_lm": v.Or(v.Causal(), v.Prefix(9)),
    "chunked": v.And(v.Causal(), v.Chunked(12)),
    "chunked_only": v.Chunked(10),
    "general": GENERAL,
    "window_or_prefix": v.Or(v.Window(3, 0, 4), v.Prefix(6)),  # a gap: one EXPR predicate
    "odd_keys": v.Not(v.Compare("==", v.BinOp("%", v.Var("k"), v.Const(2)), v.Const(1))),
}


def variant_spec(mask=None, score=None, sinks=False, tensors=(), **changes):
    return BASE.replace(mask=Mask.CUSTOM if mask is not None else Mask.NONE,
                        variant=v.Variant(mask, score, sinks, tensors), **changes)


# -- predicates ---------------------------------------------------------------------------------------


def _holds(cond, q, k):
    return bool(sympy.sympify(cond).subs({sym.q_idx: q, sym.k_idx: k}))


@pytest.mark.parametrize("name", ["window", "causal_window", "window_lr", "prefix_lm", "chunked", "chunked_only",
                                  "general"])
def test_band_predicates_and_their_query_forms_agree_with_the_tree(name):
    """Every BAND predicate's key form and query form (its solution for q) say the same thing, and the
    conjunction of the predicates is the tree's own condition, at every (q, k) of a grid."""
    preds = irv.mask_preds(MASKS[name], sym.ZERO)
    assert preds and all(p.kind in (PredKind.CAUSAL, PredKind.BAND) for p in preds)
    tree = irv.mask_condition(MASKS[name], sym.ZERO)
    for q, k in itertools.product(range(0, 40), range(0, 40)):
        kept = []
        for p in preds:
            if p.kind is PredKind.CAUSAL:
                kept.append(k <= q + int(p.bound))
                continue
            key_form = sym.evaluate(p.bound, {sym.q_idx: q, sym.k_idx: k}) <= 0
            assert p.alt is not None, f"{name}: no query form for {p.bound}"
            query_form = sym.evaluate(p.alt, {sym.q_idx: q, sym.k_idx: k}) <= 0
            assert key_form == query_form, (name, p, q, k)
            kept.append(key_form)
        assert all(kept) == _holds(tree, q, k), (name, q, k)


def test_masks_the_analysis_cannot_bound_are_evaluated_per_element():
    assert [p.kind for p in irv.mask_preds(MASKS["window_or_prefix"], sym.ZERO)] == [PredKind.EXPR]
    assert [p.kind for p in irv.mask_preds(MASKS["odd_keys"], sym.ZERO)] == [PredKind.EXPR]
    # a plain diagonal stays the kernels' CAUSAL predicate, bottom-right too
    preds = irv.mask_preds(v.And(v.Causal(), v.Window(15, 0, 16)), sym.N_K - sym.N_Q)
    assert preds[0].kind is PredKind.CAUSAL and preds[0].bound == sym.N_K - sym.N_Q


@pytest.mark.parametrize("name", ["window", "window_lr", "prefix_lm", "chunked", "general", "window_or_prefix"])
@pytest.mark.parametrize("sizes", [(37, 45), (64, 33), (100, 100)])
def test_key_block_ranges_are_exact(name, sizes):
    """The forward's key loops after causal-skip: every block before the first loop or after the last is
    entirely masked for the query block, every block of an unmasked loop entirely kept (brute force)."""
    n_q, n_k = sizes
    program = compile_program(variant_spec(MASKS[name]))
    kernel = program.kernel("attn_fwd")
    loops = [st for st in _walk(kernel.body) if getattr(st, "var", None) == sym.start_n]
    assert loops
    tree = irv.mask_condition(MASKS[name], sym.ZERO)
    bm = bn = 16
    for start_m in range(0, n_q, bm):
        values = {sym.start_m: start_m, sym.N_Q: n_q, sym.N_K: n_k, sym.BLOCK_M: bm, sym.BLOCK_N: bn}
        visited = {}
        for loop in loops:
            lo, hi = sym.evaluate(loop.start, values), sym.evaluate(loop.stop, values)
            for start_n in range(lo, hi, bn):
                assert start_n not in visited, "a key block visited twice"
                visited[start_n] = "no mask" not in loop.note
        rows = range(start_m, min(start_m + bm, n_q))
        for start_n in range(0, n_k, bn):
            cols = range(start_n, min(start_n + bn, n_k))
            kept = [_holds(tree, q, k) for q in rows for k in cols]
            if start_n not in visited:
                assert not any(kept), (name, start_m, start_n, "a live block skipped")
            elif not visited[start_n]:
                assert all(kept) and len(cols) == bn, (name, start_m, start_n, "a partial block unmasked")


def test_dead_blocks_are_skipped_by_a_window():
    """A window of 8 over 100 keys: a query block reads at most the blocks its window spans."""
    program = compile_program(variant_spec(MASKS["window"]))
    loops = [st for st in _walk(program.kernel("attn_fwd").body) if getattr(st, "var", None) == sym.start_n]
    values = {sym.start_m: 80, sym.N_Q: 100, sym.N_K: 100, sym.BLOCK_M: 16, sym.BLOCK_N: 16}
    blocks = sum(len(range(sym.evaluate(lp.start, values), sym.evaluate(lp.stop, values), 16)) for lp in loops)
    assert blocks == 2  # keys 73..95 lie in the blocks at 64 and 80


def _walk(body):
    for st in body:
        yield st
        yield from _walk(getattr(st, "body", ()))


# -- the Triton forward in the interpreter -----------------------------------------------------------


def _module(spec, tmp_path):
    path = tmp_path / f"{spec.name}_{spec.hash}.py"
    path.write_text(render(spec, compile_program(spec)))
    found = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


def _run(spec, tmp_path, shape=(2, 2, 2, 37, 45), dtype=torch.float32, tensors=None, seed=0):
    torch.manual_seed(seed)
    b, h, h_kv, n_q, n_k = shape
    d = spec.head_dim
    q = torch.randn(b, h, n_q, d).to(DEVICE, dtype)
    k = torch.randn(b, h_kv, n_k, d).to(DEVICE, dtype)
    v_ = torch.randn(b, h_kv, n_k, d).to(DEVICE, dtype)
    tensors = {name: t.to(DEVICE) for name, t in (tensors or {}).items()}
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, n_q), float("nan"), device=DEVICE)
    got, got_lse = _module(spec, tmp_path).forward(q, k, v_, out=out, lse=lse, **tensors)
    ref, ref_lse = reference.variant_attention(q, k, v_, spec.variant, spec.bottom_right, tensors=tensors)
    tol = 2e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)
    assert torch.equal(torch.isinf(got_lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(got_lse.double()[finite], ref_lse[finite], atol=tol, rtol=tol)
    return ref_lse


@pytest.mark.parametrize("name", sorted(MASKS))
def test_forward_masks(name, tmp_path):
    _run(variant_spec(MASKS[name]), tmp_path)


def test_forward_rows_a_mask_leaves_empty_give_zero_and_minus_inf(tmp_path):
    # chunked(10) with N_Q > N_K: queries in chunks past the last key see nothing
    lse = _run(variant_spec(v.Chunked(10)), tmp_path, shape=(1, 2, 2, 45, 21))
    assert torch.isinf(lse).any() and torch.isfinite(lse).any()


def test_forward_bottom_right_window_gqa_fp16(tmp_path):
    spec = variant_spec(v.And(v.Causal("bottom_right"), v.Window(6, 0, 7)), dtype=parse(
        "kernel t {\n head_dim = 32\n dtype = fp16\n}\n").dtype)
    assert spec.bottom_right
    _run(spec, tmp_path, shape=(1, 4, 2, 19, 50), dtype=torch.float16)


@pytest.mark.parametrize("score", ["softcap", "alibi_h", "alibi_bh", "bias"])
def test_forward_score_modifiers(score, tmp_path):
    tensors, decls = {}, ()
    if score == "softcap":
        modifier = v.Softcap(2.5)
    elif score == "bias":
        decls = (v.TensorDecl("bias", ("H", 64), "fp32"),)
        rel = v.BinOp("+", v.BinOp("-", v.Var("q"), v.Var("k")), v.Const(40))
        modifier = v.ScoreExpr(v.BinOp("+", v.Var("s"), v.Index("bias", (v.Var("h"), rel))))
        tensors["bias"] = torch.randn(2, 64)  # reads past its 64 entries (q - k + 40 >= 64) read 0
    else:
        modifier = v.Alibi()
        tensors["alibi_slopes"] = torch.rand(2) if score == "alibi_h" else torch.rand(2, 2)
    _run(variant_spec(v.Causal() if score != "softcap" else None, modifier, tensors=decls), tmp_path,
         tensors=tensors)


def test_forward_sinks_join_the_denominator(tmp_path):
    sinks = torch.randn(2) * 3
    lse = _run(variant_spec(v.Window(7, 0, 8), sinks=True), tmp_path, tensors={"sinks": sinks})
    assert torch.isfinite(lse).all()  # every row has its sink, even one the mask leaves empty


def test_forward_softcap_with_window_and_sinks(tmp_path):
    spec = variant_spec(v.And(v.Causal(), v.Window(9, 0, 10)), v.Softcap(3.0), sinks=True)
    _run(spec, tmp_path, tensors={"sinks": torch.randn(2)})


def test_softcap_is_a_pointwise_function_in_base_2():
    """After exp2 the modifier reads its base-2 argument back in base e and returns base 2: at a score s
    (base e), fn(s * log2 e) = softcap(s) * log2 e."""
    program = compile_program(variant_spec(None, v.Softcap(5.0)))
    from attngen import ir

    fns = [e.fn for st in ir.walk_stmts(program.kernel("attn_fwd").body) for x in ir.stmt_exprs(st)
           for e in ir.walk_expr(x) if isinstance(e, ir.Pointwise)]
    assert fns
    for s in (-30.0, -1.0, 0.3, 12.0):
        got = float(fns[0].subs(sym.S, s * sym.LOG2E))
        assert math.isclose(got, 5.0 * math.tanh(s / 5.0) * sym.LOG2E, rel_tol=1e-9, abs_tol=1e-12)


def test_kernel_calls_with_run_time_tensors_are_planned_with_their_own(monkeypatch):
    """A user's spec with a declared tensor and sinks, called repeatedly without autograd at one layout: the
    run-time tensors' checks run at the signature's first call only, every call computes with its own tensors
    (against float64), a tensor of another layout is a new signature (checked, and refused where it is wrong), and a
    call recorded for autograd (sinks that require grad) is checked every time."""
    from attngen.runtime import kernel as kernel_module
    from conftest import empty_plans

    spec = parse("kernel planned_bias {\n    mask = q - k < 9\n    score = s + bias[h, q - k + 32]\n"
                 "    tensor bias[H, 64]: fp32\n    sinks = true\n    head_dim = 16\n    dtype = fp32\n"
                 "    direction = forward+backward\n}\n")
    kernel = attngen.load(spec)
    plans = empty_plans(monkeypatch)
    checked = []
    real = kernel_module.check_runtime_tensors
    monkeypatch.setattr(kernel_module, "check_runtime_tensors", lambda *a, **kw: checked.append(1) or real(*a, **kw))
    for i in range(3):
        q, k, v_ = (torch.randn(1, 2, 21, 16, device=DEVICE) for _ in range(3))
        tensors = {"bias": torch.randn(2, 64, device=DEVICE), "sinks": torch.randn(2, device=DEVICE)}
        out = kernel(q, k, v_, **tensors)
        ref, _ = reference.variant_attention(q, k, v_, spec.variant, spec.bottom_right, tensors=tensors)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    assert len(checked) == 1 and len(plans.plans(kernel)) == 1
    with pytest.raises(KernelInputError, match="bias has shape"):
        kernel(q, k, v_, bias=torch.randn(2, 63, device=DEVICE), sinks=tensors["sinks"])
    sinks = tensors["sinks"].requires_grad_()
    for _ in range(2):
        kernel(q, k, v_, bias=tensors["bias"], sinks=sinks).sum().backward()
    assert len(checked) == 1 + 1 + 2 and len(plans.plans(kernel)) == 1
