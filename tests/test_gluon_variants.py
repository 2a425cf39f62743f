"""The Hopper Gluon forward with issue 48's variants (passes/warp_specialize.py, codegen/hooks.py,
templates/gluon_forward.py.j2): windows, prefixes, chunks, softcap and sinks.

On the CPU: which variant programs get the Gluon forward; the hooks' code for each variant; that each query
tile's key blocks in the generated kernel (its `_ws_key_blocks`, run as Python) are exactly the blocks the
Triton kernel's loops visit and its unmasked ones exactly the Triton kernel's unmasked ones, for many sizes;
that the variant kernels compile for sm_90 (Triton's compiler and ptxas, in a subprocess). On a Hopper GPU
(`gpu`): the Gluon forward against reference.variant_attention in float64, outputs poisoned first.
"""

import ast
import math

import pytest
import torch

import attngen
from attngen import ir
from attngen.analysis.distance import any_distance, linear_distance
from attngen.codegen import render
from attngen.codegen.hooks import score_hooks
from attngen.ir import sym
from attngen.lang.spec import parse
from attngen.passes import compile_program
from attngen.policy import hopper
from attngen.testing import reference
from attngen.testing.accuracy import ATOL, FUDGE, REL_TOL, spec_variant
from conftest import HAS_GPU, spec_text
from probe import probe



HOPPER = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)

# name: (mask, score, sinks) as a spec writes them; each gets the Gluon forward
VARIANTS = {
    "window": ("window(300)", None, False),
    "causal_window": ("causal & window(300)", None, False),
    "window_lr": ("window(200, 70)", None, False),
    "prefix": ("causal | prefix(100)", None, False),
    "chunked": ("causal & chunked(192)", None, False),
    "softcap": ("none", "softcap(30)", False),
    "softcap_window": ("causal & window(300)", "softcap(30)", False),
    "sinks_window": ("causal & window(300)", None, True),
    "bottom_right_window": ("causal(bottom_right) & window(300)", "softcap(20)", True),
    "general": ("q - k < 1024 and (k < 64 or q >= k)", None, False),  # two BAND predicates
    "alibi": ("causal", "alibi", False),  # its slope: one tensor read per tile
    "alibi_window": ("window(300)", "alibi", True),
}


def _text(name, head_dim=128, dtype="bf16", variant="window", **extra):
    mask, score, sinks = VARIANTS[variant]
    if score:
        extra["score"] = score
    if sinks:
        extra["sinks"] = "true"
    return spec_text(name, head_dim, dtype, mask, **extra)


def _program(text):
    spec = parse(text)
    return spec, compile_program(spec)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_get_the_gluon_forward(variant):
    spec, program = _program(_text(f"gv_{variant}", variant=variant))
    masked = VARIANTS[variant][0] != "none"
    # tiles in pairs where a tile's key blocks start at the same key for every row block and end with it
    pair = variant in ("prefix", "alibi")
    kernel = program.kernel("attn_fwd")  # (an ALiBi spec's distance bias: analysis/distance.py)
    assert program.warp_specialized.forward == hopper.forward_variant(
        128, masked, pair, distance=linear_distance(kernel) is not None, any_distance=any_distance(kernel) is not None)
    assert not program.warp_specialized.forward.balance


@pytest.mark.parametrize("mask, extra", [
    ("window(4) | prefix(6)", {}),  # a gap between the two: an EXPR predicate, no bound on its blocks
    ("none", {"score": "s + bias[h, q - k]"}),  # a declared tensor's read that varies within a tile
])
def test_variants_the_gluon_forward_cannot_take_keep_the_triton_kernel(mask, extra):
    text = spec_text("gv_refused", 128, "bf16", mask, **extra)
    if "bias" in extra.get("score", ""):
        text = text.replace("}", "    tensor bias[H, 64]: fp32\n}")
    spec, program = _program(text)
    assert spec.variant and program.warp_specialized.forward is None
    assert "attn_fwd_ws" not in render(spec, program)


def test_the_hooks_spell_each_variants_math():
    spec, program = _program(_text("gv_hooks", variant="softcap_window"))
    hooks = score_hooks(program.kernel("attn_fwd"))
    assert hooks.modded and not score_hooks(_program(_text("gv_w", variant="window"))[1].kernel("attn_fwd")).modded
    scaled = hooks.scaled("sc", "rows", "cols")
    assert scaled.startswith("(43.28") and "_gl_tanh(" in scaled and "(sc * qk_scale)" in scaled
    keep = hooks.keep("cols", None, 1, query="rows")
    # the window's lower bound over both position vectors, the diagonal, the sequence end
    assert "(cols[None, :] <= rows[:, None])" in keep and "-299 + rows[:, None] - cols[None, :] <= 0" in keep
    assert "(cols < N_K)[None, :]" in keep
    assert hooks.value("m_use", {"m_new": "m_new"}) == 'gl.where(m_new == float("-inf"), 0.0, m_new)'
    assert hooks.value("l_safe", {"l_i": "l_i"}) == "gl.where(l_i == 0.0, 1.0, l_i)"
    sinks = score_hooks(_program(_text("gv_s", variant="sinks_window"))[1].kernel("attn_fwd"))
    assert sinks.sinks and not hooks.sinks
    assert sinks.sink("gl.load(SINKS + h)") == f"gl.load(SINKS + h) * {1 / math.log(2)!r}"
    chunked = score_hooks(_program(_text("gv_c", variant="chunked"))[1].kernel("attn_fwd"))
    assert "192*(rows[:, None] // 192)" in chunked.keep("cols", None, 1, query="rows")
    bottom = score_hooks(_program(_text("gv_b", variant="bottom_right_window"))[1].kernel("attn_fwd"))
    assert "(cols[None, :] <= rows[:, None] + (N_K - N_Q))" in bottom.keep("cols", None, 1, query="rows")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_variant_module_compiles_as_python(variant):
    spec, program = _program(_text(f"gv_py_{variant}", variant=variant))
    source = render(spec, program)
    compile(source, f"gv_py_{variant}.py", "exec")
    assert "def _ws_variant_softmax(" in source and "def _ws_key_blocks(" in source
    assert ("sinks, sm_scale)" in source) is VARIANTS[variant][2]  # forward() hands the sinks to the Gluon launch
    assert ("alibi_slopes = gl.load(ALIBI_SLOPES + (b) * stride_alibi_slopes_0 + (h) * stride_alibi_slopes_1)"
            in source) is (VARIANTS[variant][1] == "alibi")


def test_plain_specs_keep_their_gluon_forward():
    spec, program = _program(spec_text("gv_plain", 128, "bf16", "causal"))
    source = render(spec, program)
    assert "_ws_variant_softmax" not in source and "_ws_key_blocks" not in source
    assert program.warp_specialized.forward == hopper.forward(128, True)


class _Gl:
    """What `_ws_key_blocks` (and the backward's `_ws_bwd_query_blocks`) take from gl, on Python integers."""

    maximum, minimum = staticmethod(max), staticmethod(min)

    @staticmethod
    def cdiv(a, b):
        return -(-a // b)


def generated_function(source, name="_ws_key_blocks"):
    """The generated gluon.jit function `name` of integer arithmetic as a Python function (its gl calls on integers)."""
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    fn.decorator_list = []
    for a in fn.args.args:
        a.annotation = None  # gl.constexpr
    scope = {"gl": _Gl}
    exec(compile(ast.Module([fn], []), name, "exec"), scope)
    return scope[name]


def triton_blocks(kernel, values, block_n, var=sym.start_n):
    """(masked, unmasked) blocks the Triton kernel's serial loops over `var` visit for these sizes (the forward's
    key blocks; start_m: the dK/dV kernel's query blocks, `block_n` then BLOCK_M)."""
    masked, full = set(), set()
    for loop in ir.walk_stmts(kernel.body):
        if not (isinstance(loop, ir.Loop) and loop.kind is ir.LoopKind.SERIAL and loop.var == var):
            continue
        start, stop = sym.evaluate(loop.start, values), sym.evaluate(loop.stop, values)
        assert start % block_n == 0
        has_mask = any(isinstance(n, ir.Masked) for st in ir.walk_stmts(loop.body) for e in ir.stmt_exprs(st)
                       for n in ir.walk_expr(e))
        (masked if has_mask else full).update(s // block_n for s in range(start, stop, block_n))
    return masked, full


def same_key_blocks(key_blocks, kernel, values: dict, where) -> bool:
    """Assert that the generated `_ws_key_blocks` (as Python) gives the query tile at `values` (start_m, the sizes,
    BLOCK_M and BLOCK_N by their IR symbols) exactly the key blocks the Triton kernel's loops visit, unmasked where
    they are; returns whether the tile's rows see no key (it then visits one masked block, so its rows are written)."""
    n_q = values.get(sym.N_Q, values.get(sym.n_q))
    n_k = values.get(sym.N_K, values.get(sym.n_k))
    block_n = values[sym.BLOCK_N]
    lo, full_lo, full_hi, n = key_blocks(values[sym.start_m], n_q, n_k, values[sym.BLOCK_M], block_n)
    masked, full = triton_blocks(kernel, values, block_n)
    visited = set(range(lo, lo + n))
    unmasked = visited & set(range(full_lo, full_hi))
    assert unmasked == full, where
    if masked | full:
        assert visited - unmasked == masked, where
        return False
    assert n == 1 and not unmasked, where
    return True


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_tile_visits_exactly_the_triton_kernels_key_blocks(variant):
    spec, program = _program(_text(f"gv_kb_{variant}", variant=variant))
    key_blocks = generated_function(render(spec, program))
    kernel = program.kernel("attn_fwd")
    shapes = {(s.block_m, s.block_n) for f in (hopper.forward_variant(64, True, False),
                                               hopper.forward_variant(128, True, False))
              for s in (f.main, f.short)}
    empty = 0
    for block_m, block_n in sorted(shapes):
        for n_q in (1, 63, 257, 1000, 1500):
            for n_k in (1, 100, 257, 1000, 4096):
                for start_m in range(0, n_q, block_m):
                    values = {sym.start_m: start_m, sym.N_Q: n_q, sym.N_K: n_k, sym.BLOCK_M: block_m,
                              sym.BLOCK_N: block_n}
                    empty += same_key_blocks(key_blocks, kernel, values, (variant, block_m, block_n, n_q, n_k, start_m))
    # a window's tiles past N_K + its width see no key at these sizes: the empty case is checked
    assert empty > 0 or variant not in ("window", "window_lr", "causal_window")


def test_the_variant_kernels_compile_for_sm90():
    cases = [("softcap_window", 128, False), ("softcap_window", 128, True), ("sinks_window", 64, False),
             ("prefix", 64, True), ("window_lr", 128, False), ("bottom_right_window", 128, False),
             ("alibi_window", 64, False), ("alibi", 128, True)]
    jobs = []
    for variant, d, short in cases:
        kernel = attngen.load(_text(f"gv_sm90_{variant}_{d}", d, "bf16" if d == 128 else "fp16", variant))
        shape = kernel.module.WS_SHAPE
        jobs.append((shape, {"path": str(kernel.path), "gluon_ws": True, "short": short}))
    for (shape, job), result in zip(jobs, probe([job for _, job in jobs])):
        assert "error" not in result, (job, result)
        consumers = shape["SHORT_consumers" if job["short"] else "consumers"]
        assert result["warps"] == 4 * (1 + consumers) and result["wgmma"] > 0 and result["tma_loads"] >= 3, result
        assert result["shared"] <= 232448, result


# -- on a Hopper GPU -------------------------------------------------------------------------------------


def _tensors(variant, batch, heads):
    """The run-time tensors of a variant: sinks (heads,), ALiBi's slopes (batch, heads)."""
    tensors = {}
    if VARIANTS[variant][1] == "alibi":
        tensors["alibi_slopes"] = torch.rand(batch, heads, device="cuda") * 0.1
    if VARIANTS[variant][2]:
        tensors["sinks"] = torch.randn(heads, device="cuda") * 2
    return tensors


def _accuracy(out, lse, ref, ref_lse, low, low_lse, dtype):
    """The project's rule (testing/accuracy.py) for a variant: the kernel's max abs error (output and lse) within
    FUDGE times the same-precision computation's plus ATOL, its relative error under REL_TOL, and rows with no
    key (lse -inf) exactly 0."""
    assert not out.isnan().any() and not lse.isnan().any(), "unwritten (poisoned) or NaN outputs"
    finite = torch.isfinite(ref)
    err = (out.double() - ref)[finite].abs().max().item()
    low_err = (low.double() - ref)[finite].abs().max().item()
    assert err <= FUDGE * low_err + ATOL[dtype], (err, low_err)
    rel = (out.double() - ref).norm().item() / max(ref.norm().item(), 1e-30)
    assert rel <= REL_TOL[dtype], rel
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and (out[empty] == 0).all()
    if (~empty).any():
        lse_err = (lse.double() - ref_lse)[~empty].abs().max().item()
        low_lse_err = (low_lse.double() - ref_lse)[~empty].abs().max().item()
        assert lse_err <= FUDGE * low_lse_err + ATOL[dtype], (lse_err, low_lse_err)


def _against_reference(kernel, q, k, v, out, lse, tensors):
    """The kernel's out and lse against reference.variant_attention (on the CPU, where it builds its index tiles)."""
    spec = kernel.spec
    q, k, v, out, lse = (t.cpu() for t in (q, k, v, out, lse))
    tensors = {name: t.cpu() for name, t in tensors.items()}
    variant = spec_variant(spec)  # `mask = causal` beside `score = alibi` is the spec's mask, not the tree's
    ref, ref_lse = reference.variant_attention(q, k, v, variant, spec.bottom_right, tensors=tensors)
    low, low_lse = reference.variant_attention(q, k, v, variant, spec.bottom_right, tensors=tensors,
                                               dtype=spec.dtype.torch)
    _accuracy(out, lse, ref, ref_lse, low, low_lse, spec.dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon forward runs on sm_90 only")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("n", [257, 1000, 4096])
def test_gluon_variant_forward_against_float64(variant, head_dim, n, monkeypatch):
    kernel = attngen.load(_text(f"gv_gpu_{variant}_{head_dim}", head_dim, "bf16", variant))
    module = kernel.module
    monkeypatch.setitem(module.WS_SHAPE, "min_scores", 0)  # run the Gluon kernel at every size here
    monkeypatch.setitem(module.WS_SHAPE, "min_keys", 1)
    B, H = 2, 4
    q, k, v = (torch.randn(B, H, n, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    tensors = _tensors(variant, B, H)
    assert module.ws_ready(q, k, v, q)
    called = []
    launch = module.launch_attn_fwd_ws
    monkeypatch.setattr(module, "launch_attn_fwd_ws", lambda *a: (called.append(1), launch(*a)))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, n), float("nan"), device="cuda")
    module.forward(q, k, v, out=out, lse=lse, **tensors)
    assert called
    _against_reference(kernel, q, k, v, out, lse, tensors)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon forward runs on sm_90 only")
@pytest.mark.parametrize("variant", ["causal_window", "chunked", "sinks_window", "softcap", "bottom_right_window",
                                     "alibi_window"])
@pytest.mark.parametrize("programs", [None, 3])
def test_gluon_variant_forward_short_shape_and_persistent_grid(variant, programs, monkeypatch):
    """The shape for short sequences at a length past short_keys, and a persistent grid of 3 programs, each taking
    tiles of several heads and batches with different key-block ranges; GQA and N_Q != N_K."""
    kernel = attngen.load(_text(f"gv_gpu_short_{variant}", 128, "bf16", variant, heads=8, kv_heads=2))
    module = kernel.module
    monkeypatch.setitem(module.WS_SHAPE, "min_scores", 0)
    monkeypatch.setitem(module.WS_SHAPE, "short_keys", 1 << 30)
    if programs:
        monkeypatch.setitem(module.WS_SHAPE, "PERSISTENT", True)
        monkeypatch.setattr(module, "_ws_programs", lambda device: programs)
    q = torch.randn(2, 8, 700, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 1300, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    tensors = _tensors(variant, 2, 8)
    assert module.ws_ready(q, k, v, q)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    module.forward(q, k, v, out=out, lse=lse, **tensors)
    _against_reference(kernel, q, k, v, out, lse, tensors)


def test_forward_hands_the_sinks_to_the_gluon_launch(monkeypatch):
    """Where ws_ready says the Gluon kernel runs, forward() launches it with the spec's run-time tensors."""
    module = attngen.load(_text("gv_launch", 64, "fp16", "sinks_window")).module
    q, k, v = (torch.randn(1, 2, 5, 64).half() for _ in range(3))
    sinks = torch.randn(2)
    calls = []
    monkeypatch.setattr(module, "ws_ready", lambda *a: True)
    monkeypatch.setattr(module, "launch_attn_fwd_ws", lambda *a: calls.append(a))
    out, lse = module.forward(q, k, v, sinks=sinks)
    (args,) = calls
    assert args[:5] == (q, k, v, out, lse) and args[5] is sinks and args[6] == 64 ** -0.5
    with pytest.raises(TypeError, match="sinks="):
        module.forward(q, k, v)
