"""The math the Gluon templates take from the IR (attngen/codegen/hooks.py): the emitted hook code, evaluated
with torch on index grids and score tiles, is what the IR's mask and scale say, for every mask kind the Gluon
kernels run (none, causal top-left, causal bottom-right, decoding's per-sequence lengths), and it reaches the
generated Gluon kernels."""

import math
import types
from dataclasses import replace

import pytest
import sympy
import torch

from attngen import ir
from attngen.ir import sym
from attngen.codegen import render
from attngen.codegen.hooks import score_hooks
from attngen.errors import InternalError
from attngen.passes import compile_program
from attngen.testing.reference import causal_keep
from attngen.lang.spec import Mask, parse
from conftest import spec_text

# Gluon's functions the hooks call, as torch on the CPU
GL = types.SimpleNamespace(max=lambda x, axis: x.amax(axis), exp2=torch.exp2, minimum=torch.minimum,
                           maximum=torch.maximum)
SIZES = [(5, 5), (5, 13), (13, 5), (1, 9), (64, 64)]  # (N_Q, N_K); BLOCK_N 16 in the grids below: keys past N_K too


def _hooks(text, kernel="attn_fwd", in_scope=("qk_scale",)):
    program = compile_program(parse(text))
    return program, score_hooks(program.kernel(kernel), in_scope)


def _run(code, **names):
    return eval(code, {"gl": GL}, names)


@pytest.mark.parametrize("mask", ["none", "causal(top_left)", "causal(bottom_right)"])
@pytest.mark.parametrize("n_q, n_k", SIZES)
def test_the_forward_keeps_what_the_mask_keeps(mask, n_q, n_k):
    """keep("cols", "rows", 1) over a tile of every query row and 16-key blocks covering N_K and past it."""
    _, hooks = _hooks(spec_text("hk_fwd", 128, "bf16", mask))
    assert hooks.causal is (mask != "none")
    keys = -(-n_k // 16) * 16
    cols = torch.arange(keys)
    query = torch.arange(n_q)
    offset = _run(hooks.causal_offset, N_Q=n_q, N_K=n_k) if hooks.causal else 0
    keep = _run(hooks.keep("cols", "rows", 1), cols=cols, rows=query + offset, N_K=n_k, N_Q=n_q)
    reference = torch.zeros(n_q, keys, dtype=torch.bool)
    reference[:, :n_k] = True
    kept = causal_keep(n_q, n_k, Mask(mask))
    if kept is not None:
        reference[:, :n_k] &= kept
    assert torch.equal(keep.expand(n_q, keys), reference)


@pytest.mark.parametrize("mask", ["causal(top_left)", "causal(bottom_right)"])
@pytest.mark.parametrize("n_q, n_k", SIZES)
def test_the_backward_keeps_what_the_mask_keeps(mask, n_q, n_k):
    """The transposed tile (keys down, queries across); rows past N_Q and keys past N_K are the template's."""
    _, hooks = _hooks(spec_text("hk_bwd", 64, "fp16", mask, direction="forward+backward"), "attn_bwd_dkdv")
    offset = _run(hooks.causal_offset, N_Q=n_q, N_K=n_k)
    code = hooks.keep("rows", "(cols + offset)", 0, structural=("query_bound",))
    keep = _run(code, rows=torch.arange(n_k), cols=torch.arange(n_q), offset=offset, N_Q=n_q, N_K=n_k)
    assert torch.equal(keep, causal_keep(n_q, n_k, Mask(mask)).T)
    with pytest.raises(InternalError, match="query < N_Q"):  # the query bound is not the keep's unless said so
        hooks.keep("rows", "(cols + offset)", 0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q, group, n_k", [(1, 4, 37), (3, 4, 37), (2, 8, 5), (1, 1, 64), (4, 2, 3)])
def test_the_decode_kernel_keeps_each_sequences_keys(causal, n_q, group, n_k):
    """Decoding: columns are packed (query head, query) rows, query = column // GROUP; the keys a sequence
    has are n_k (its cache length), and causal is aligned bottom-right to it."""
    mask = "causal(bottom_right)" if causal else "none"
    _, hooks = _hooks(spec_text("hk_dec", 128, "bf16", mask, split_kv="auto", kv_layout="paged(page_size = 16)"),
                      in_scope=("qk_scale", "n_k"))  # the sequence's length, as the template names it
    assert hooks.causal is causal
    columns = 16 * -(-(group * n_q) // 16)
    s_cols = torch.arange(columns)
    keys = torch.arange(-(-n_k // 16) * 16 + 16)
    names = dict(keys=keys, s_cols=s_cols, n_k=n_k, N_Q=n_q, GROUP=group)
    if causal:
        names["diag"] = _run(hooks.diagonal("s_cols"), **names)
        assert _run(hooks.causal_offset, **names) + 1 == n_k - n_q + 1  # the template's first_limit
    keep = _run(hooks.keep("keys", "diag", 0), **names).expand(len(keys), columns)
    query = (s_cols // group)[None, :]
    reference = (keys[:, None] < n_k) & ((keys[:, None] <= query + n_k - n_q) if causal else True)
    assert torch.equal(keep, reference.expand(len(keys), columns))


@pytest.mark.parametrize("text, kernel", [
    (spec_text("hk_s1", 128, "bf16", "causal"), "attn_fwd"),
    (spec_text("hk_s2", 64, "fp16", "none", direction="forward+backward"), "attn_bwd_dkdv"),
])
def test_the_scale_and_exponent_are_the_irs(text, kernel):
    """exp2(scaled(s) - scaled_max(s)) is softmax's numerator of s * sm_scale (log2(e) folded into the scale);
    the stored log-sum-exp is in base e, and read back in base 2 (+inf where a row saw no key)."""
    _, hooks = _hooks(text, kernel)
    sm_scale = 0.0883883
    qk_scale = _run(hooks.scale, sm_scale=sm_scale)
    assert qk_scale == pytest.approx(sm_scale / math.log(2), rel=1e-12)
    sc = torch.randn(8, 16, dtype=torch.float64)
    scaled = _run(hooks.scaled("sc"), sc=sc, qk_scale=qk_scale)
    assert torch.allclose(scaled, sc * sm_scale / math.log(2))
    if kernel == "attn_fwd":
        row_max = _run(hooks.scaled_max("sc", 1), sc=sc, qk_scale=qk_scale)
        p = torch.exp2(scaled - row_max[:, None])
        assert torch.allclose(p / p.sum(1, keepdim=True), torch.softmax(sc * sm_scale, 1))
        assert torch.equal(_run(hooks.scaled_max("sc", 0), sc=sc, qk_scale=qk_scale), (sc * qk_scale).amax(0))
        lse = _run(hooks.lse("m", "l"), m=row_max, l=p.sum(1), gl=types.SimpleNamespace(log2=torch.log2))
        assert torch.allclose(lse, torch.logsumexp(sc * sm_scale, 1))
    else:
        lse = torch.tensor([0.5, float("-inf"), -2.0], dtype=torch.float64)
        for lib in ("gl", "tl"):
            code = hooks.lse_log2("lse", lib)
            assert code.startswith(f"{lib}.where(")
            log2 = eval(code, {lib: types.SimpleNamespace(where=torch.where)}, {"lse": lse})
            assert torch.allclose(log2, torch.tensor([0.5 / math.log(2), float("inf"), -2.0 / math.log(2)],
                                                  dtype=torch.float64))


def _with_kernel(program, name, fn):
    kernel = program.kernel(name)
    return program.replace_kernel(replace(kernel, body=fn(kernel.body)))


def test_a_changed_ir_reaches_the_gluon_kernels():
    """The Gluon source follows the IR, not the template: a scale and a causal diagonal changed in the IR
    appear in the generated Gluon forward and backward."""
    spec = parse(spec_text("hk_ir", 128, "bf16", "causal", direction="forward+backward"))
    program = compile_program(spec)
    plain = render(spec, program)
    assert "qk_scale = sm_scale * 1.4426950408889634" in plain and "offset = 0  # query row r" in plain

    def scale_by_two(body):
        def visit(st):
            if isinstance(st, ir.Assign) and st.target.name == "qk_scale":
                return replace(st, value=ir.Call(ir.Op.MUL, (ir.Sym(sympy.Symbol("sm_scale")), ir.Num(2.0))))
            return st
        return ir.map_stmts(body, visit)

    def shift_diagonal(expr):
        if isinstance(expr, ir.Masked):
            return replace(expr, preds=tuple(replace(p, bound=p.bound + 3) if p.kind is ir.PredKind.CAUSAL else p
                                             for p in expr.preds))
        return expr

    for name in ("attn_fwd", "attn_bwd_dkdv"):
        program = _with_kernel(program, name, scale_by_two)
        program = _with_kernel(program, name, lambda body: ir.map_exprs_in(body, shift_diagonal))
    changed = render(spec, program)
    gluon = changed[changed.index("# -- the warp-specialised Hopper forward"):]
    assert gluon.count("qk_scale = sm_scale * 2.0") == 2 and "sm_scale * 1.4426950408889634" not in gluon
    assert "offset = 3  # query row r" in gluon and "offset = 3  # query i" in gluon


def test_the_hooks_refuse_what_they_cannot_spell():
    _, hooks = _hooks(spec_text("hk_bad", 128, "bf16", "causal"))
    two_diagonals = replace(hooks, preds=hooks.preds + (ir.Pred(ir.PredKind.CAUSAL, sympy.Integer(5)),))
    with pytest.raises(InternalError, match="one causal diagonal"):
        two_diagonals.causal_offset
    foreign = replace(hooks, scale_value=ir.Call(ir.Op.MUL, (ir.Sym(sympy.Symbol("__import__")), ir.Num(1.0))))
    with pytest.raises(InternalError, match="__import__"):  # only the kernel's own names reach the code
        foreign.scale
    tanh = replace(hooks, scaled_expr=ir.Call(ir.Op.LOG, (hooks.scaled_expr,)))
    with pytest.raises(InternalError, match="no Gluon hook spelling"):
        tanh.scaled("sc")


def test_the_backwards_gradients_are_the_irs():
    """dS^T = P^T (dP^T - delta), dK = sm_scale dS^T Q and dQ = sm_scale dS K, as the Gluon backward takes them."""
    program, hooks = _hooks(spec_text("hk_grads", 128, "bf16", "none", direction="forward+backward"), "attn_bwd_dkdv")
    dq_hooks = score_hooks(program.kernel("attn_bwd_dq"))
    pt, dpt, delta = torch.rand(8, 4), torch.randn(8, 4), torch.randn(4)
    code = hooks.value("ds_t", {"p_t": "pt", "dp_t": "dpt", "delta": "delta[None, :]"})
    assert torch.allclose(_run(code, pt=pt, dpt=dpt, delta=delta), pt * (dpt - delta[None, :]))
    dk = torch.randn(8, 16)
    assert torch.equal(_run(hooks.value("DK", {"dk": "dk"}), dk=dk, sm_scale=0.25), dk * 0.25)
    assert torch.equal(_run(dq_hooks.value("DQ", {"dq": "acc"}, "tl"), acc=dk, sm_scale=0.5), dk * 0.5)
    with pytest.raises(InternalError, match="names"):  # an IR value over a name the template did not give
        hooks.value("ds_t", {"p_t": "pt"})
    with pytest.raises(InternalError, match="defines no"):
        hooks.value("softcap", {})


def test_a_modifier_reads_positions_as_floats_only_where_that_is_exact():
    """slope * |q - k| takes float32 position vectors (converted once each, not once per score); a modifier that
    divides, takes a modulo or indexes a tensor by position keeps the integers."""
    from attngen.codegen.hooks import _float_positions

    raw = ir.Ref(ir.Buffer("raw", (sym.BLOCK_M, sym.BLOCK_N), ir.DT.F32, ir.Space.REG))
    rows, keys = ir.Span("offs_m", sym.start_m, sym.BLOCK_M), ir.Span("offs_n", sym.start_n, sym.BLOCK_N)
    pointwise = lambda fn: ir.Pointwise(raw, fn, rows, keys)

    slope = sympy.Function("alibi_slopes")(sym.b, sym.q_head)
    assert _float_positions(pointwise(sym.S - slope * sympy.Abs(sym.k_idx - sym.q_idx)))
    assert _float_positions(pointwise(sym.S + sympy.Min(sym.q_idx, 3 * sym.k_idx) ** 2))
    assert not _float_positions(pointwise(sym.S + sympy.floor((sym.q_idx - sym.k_idx) / 7)))
    assert not _float_positions(pointwise(sym.S + sympy.Mod(sym.q_idx, 4)))
    assert not _float_positions(pointwise(sym.S + sympy.Function("bias")(sym.q_head, sym.q_idx - sym.k_idx)))
    assert not _float_positions(pointwise(30 * sympy.tanh(sym.S / 30)))  # no position read: nothing to convert
