"""The Hopper Gluon backward with issue 48's variants (passes/warp_specialize.py, codegen/hooks.py,
templates/gluon_backward.py.j2): windows, prefixes, chunks, softcap, ALiBi and sinks.

On the CPU: which variant programs get the Gluon backward; the hooks' code for the backward's P^T, mask and dS^T;
that each key tile's query blocks in the generated kernel (its `_ws_bwd_query_blocks`, run as Python) are exactly
the blocks the Triton dK/dV kernel's loops visit and its unmasked ones exactly the Triton kernel's unmasked ones,
for many sizes; that the modules compile as Python and the kernels for sm_90 (Triton's compiler and ptxas, in a
subprocess). On a Hopper GPU (`gpu`): dq, dk, dv (and dsinks) of the Gluon backward against autograd through
reference.variant_attention in float64, outputs poisoned first.
"""

import pytest
import torch

import attngen
from attngen import ir
from attngen.analysis.distance import linear_distance
from attngen.codegen import render
from attngen.codegen.hooks import score_hooks
from attngen.ir import sym
from attngen.policy import hopper
from attngen.testing import reference
from attngen.testing.accuracy import ATOL, FUDGE, REL_TOL, spec_variant
from conftest import HAS_GPU, spec_text
from probe import probe
from test_gluon_variants import VARIANTS, _program, generated_function, triton_blocks  # each gets the Gluon backward too



HOPPER = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)


def _text(name, head_dim=128, dtype="bf16", variant="window", **extra):
    mask, score, sinks = VARIANTS[variant]
    if score:
        extra["score"] = score
    if sinks:
        extra["sinks"] = "true"
    return spec_text(name, head_dim, dtype, mask, direction="forward+backward", **extra)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_get_the_gluon_backward(variant):
    spec, program = _program(_text(f"gvb_{variant}", variant=variant))
    masked = VARIANTS[variant][0] != "none"
    distance = linear_distance(program.kernel("attn_fwd")) is not None  # (ALiBi: analysis/distance.py)
    assert program.warp_specialized.backward == hopper.backward_variant(128, masked, distance)
    assert program.warp_specialized.backward.dq_claim_keys == 0


@pytest.mark.parametrize("mask, extra", [
    ("window(4) | prefix(6)", {}),  # a gap between the two: an EXPR predicate, no bound on its blocks
    ("none", {"score": "s + bias[h, q - k]"}),  # a declared tensor's read that varies within a tile
])
def test_variants_the_gluon_backward_cannot_take_keep_the_triton_kernels(mask, extra):
    text = spec_text("gvb_refused", 128, "bf16", mask, direction="forward+backward", **extra)
    if "bias" in extra.get("score", ""):
        text = text.replace("}", "    tensor bias[H, 64]: fp32\n}")
    spec, program = _program(text)
    assert spec.variant and program.warp_specialized.backward is None
    assert "attn_bwd_dkdv_ws" not in render(spec, program)


def test_the_hooks_spell_the_backwards_math():
    spec, program = _program(_text("gvb_hooks", variant="softcap_window"))
    hooks = score_hooks(program.kernel("attn_bwd_dkdv"))
    # the modifier over the raw scores times qk_scale (the IR's raw_t), at the template's positions
    scaled = hooks.scaled("st", "cols", "rows", 0)
    assert scaled.startswith("(43.28") and "_gl_tanh(" in scaled and "(st * qk_scale)" in scaled
    keep = hooks.keep("rows", None, 0, structural=("query_bound",), query="cols")
    assert keep == "(rows[:, None] <= cols[None, :]) & (-299 + cols[None, :] - rows[:, None] <= 0)"
    # P^T times the softcap's derivative 1 - tanh^2 at the raw score (pf_t), then dS^T = that (dP^T - delta)
    assert hooks.defines("pf_t")
    pf = hooks.value("pf_t", {"p_t": "pt"}, score="st", query="cols", key="rows", key_axis=0)
    assert pf.startswith("pt * (1.0 - 1.0*(_gl_tanh(") and pf.count("(st * qk_scale)") == 2
    ds = hooks.value("ds_t", {"pf_t": "pt", "dp_t": "dpt", "delta": "delta[None, :]"})
    assert ds == "pt * (dpt - delta[None, :])"
    plain = score_hooks(_program(_text("gvb_w", variant="causal_window"))[1].kernel("attn_bwd_dkdv"))
    assert not plain.defines("pf_t")  # no modifier: no derivative to fold in
    assert plain.value("ds_t", {"p_t": "pt", "dp_t": "dpt", "delta": "d"}, score="st") == "pt * (dpt - d)"
    assert plain.scaled("st", "cols", "rows", 0) == "st * qk_scale"
    alibi = score_hooks(_program(_text("gvb_a", variant="alibi"))[1].kernel("attn_bwd_dkdv"))
    # the slope of the step's query head (GROUP * hkv + g in the IR: `h` in the template), once per step
    assert alibi.reads() == [("alibi_slopes", "gl.load(ALIBI_SLOPES + (b) * stride_alibi_slopes_0 + (h) * "
                                              "stride_alibi_slopes_1).to(gl.float32)")]
    assert alibi.tensor_params == ", ALIBI_SLOPES, stride_alibi_slopes_0, stride_alibi_slopes_1"
    # (positions as float32 vectors: one conversion per vector, not per score)
    assert ("alibi_slopes*gl.abs(rows.to(gl.float32)[:, None] - cols.to(gl.float32)[None, :])"
            in alibi.scaled("st", "cols", "rows", 0))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_variant_module_compiles_as_python(variant):
    spec, program = _program(_text(f"gvb_py_{variant}", variant=variant))
    source = render(spec, program)
    compile(source, f"gvb_py_{variant}.py", "exec")
    assert "def _ws_bwd_query_blocks(" in source
    assert ("pt = gl.where(" in source) is (VARIANTS[variant][0] != "none")  # an unmasked one masks only past N_Q
    alibi = VARIANTS[variant][1] == "alibi"
    assert ("alibi_slopes = gl.load(ALIBI_SLOPES" in source.split("def _ws_bwd_consume(")[1]) is alibi
    assert ("dq, dk, dv, _dsinks(sinks, lse, delta)" in source) is VARIANTS[variant][2]


def test_plain_specs_keep_their_gluon_backward():
    spec, program = _program(spec_text("gvb_plain", 128, "bf16", "causal", direction="forward+backward"))
    source = render(spec, program)
    assert "_ws_bwd_query_blocks" not in source
    assert program.warp_specialized.backward == hopper.backward(128, True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_key_tile_visits_exactly_the_triton_kernels_query_blocks(variant):
    spec, program = _program(_text(f"gvb_qb_{variant}", variant=variant))
    query_blocks = generated_function(render(spec, program), "_ws_bwd_query_blocks")
    kernel = program.kernel("attn_bwd_dkdv")
    shapes = {(s.block_m, s.block_n) for d in hopper.BWD_HEAD_DIMS for masked in (False, True)
              for b in (hopper.backward_variant(d, masked),) for s in (b.main, b.short)}
    empty = 0
    for block_m, block_n in sorted(shapes):
        for n_q in (1, 63, 257, 1000, 1500):
            for n_k in (1, 100, 257, 1000, 4096):
                for start_n in range(0, n_k, block_n):
                    lo, full_lo, full_hi, n = query_blocks(start_n, n_q, n_k, block_m, block_n)
                    values = {sym.start_n: start_n, sym.N_Q: n_q, sym.N_K: n_k, sym.BLOCK_M: block_m,
                              sym.BLOCK_N: block_n}
                    masked, full = triton_blocks(kernel, values, block_m, sym.start_m)
                    visited = set(range(lo, lo + n))
                    unmasked = visited & set(range(full_lo, full_hi))
                    where = (variant, block_m, block_n, n_q, n_k, start_n)
                    assert unmasked == full and visited - unmasked == masked, where
                    empty += not visited
    # a window's key tiles past N_Q + its width are seen by no query at these sizes: the empty case is checked
    assert empty > 0 or variant not in ("window", "window_lr", "causal_window")


def test_the_variant_backward_kernels_compile_for_sm90():
    cases = [("softcap_window", 128, False, {}), ("softcap_window", 128, True, {}), ("sinks_window", 64, False, {}),
             ("prefix", 64, True, {}), ("window_lr", 128, False, {"dq_atomic": False}), ("alibi", 128, False, {}),
             ("alibi_window", 64, False, {"dq_local": True}), ("chunked", 128, False, {})]
    jobs = []
    for variant, d, short, extra in cases:
        kernel = attngen.load(_text(f"gvb_sm90_{variant}_{d}", d, "bf16" if d == 128 else "fp16", variant))
        shape = kernel.module.WS_BWD_SHAPE
        jobs.append((shape, {"path": str(kernel.path), "gluon_ws": "backward", "short": short, **extra}))
    for (shape, job), result in zip(jobs, probe([job for _, job in jobs])):
        assert "error" not in result, (job, result)
        consumers = shape["SHORT_consumers" if job["short"] else "consumers"]
        assert result["warps"] == 4 * (1 + consumers) and result["wgmma"] > 0 and result["tma_loads"] >= 2, result
        assert result["shared"] <= 232448, result


def test_a_read_that_holds_no_head_is_loaded_once_before_the_loop():
    """A score's tensor read indexed by the batch alone (context parallelism's ALiBi: `shift[b]`) is loaded once
    before the dK/dV kernel's loop over a group's query heads and blocks, the per-head slope in it: loaded in the
    loop, it had cost ptxas 244 more bytes of spills a thread (352 against the built-in ALiBi's 108; 7.1 against
    5.1 ms on the H200). The kernel compiles for sm_90 with no more spills than the built-in ALiBi's."""
    text = spec_text("gvb_shifted_alibi", 128, "bf16", "causal", direction="forward+backward",
                     score="s - slopes[b, h] * abs(q - k + shift[b])").replace(
        "}", "    tensor slopes[B, H]: fp32\n    tensor shift[B]: int32\n}")
    shifted = attngen.load(text)
    source = shifted.path.read_text()
    consume = source[source.index("def _ws_bwd_consume"):]
    consume = consume[:consume.index("\ndef ")]
    loop = consume.index("    for t in range(n_iters):")
    assert 0 < consume.index("arg_shift = gl.load(ARG_shift") < loop
    assert consume.index("arg_slopes = gl.load(ARG_slopes") > loop
    builtin = attngen.load(_text("gvb_builtin_alibi", variant="alibi"))
    got, want = probe([{"path": str(shifted.path), "gluon_ws": "backward", "ptxas": True,
                        "arg_ptrs": {"ARG_shift": "*i32"}},
                       {"path": str(builtin.path), "gluon_ws": "backward", "ptxas": True}])
    assert "error" not in got and "error" not in want, (got, want)
    assert got["spill_stores"] <= want["spill_stores"] and got["spill_loads"] <= want["spill_loads"], (got, want)


def test_backward_hands_the_tensors_to_the_gluon_launch_and_returns_dsinks(monkeypatch):
    """Where ws_bwd_ready says the Gluon kernel runs, backward() launches it with the modifier's tensors and
    returns the sinks' gradient from the delta it gives back."""
    module = attngen.load(_text("gvb_launch", 64, "fp16", "alibi_window")).module
    q, k, v, o, do = (torch.randn(1, 2, 5, 64).half() for _ in range(5))
    lse, delta = torch.randn(1, 2, 5), torch.randn(1, 2, 5)
    slopes, sinks = torch.rand(2), torch.randn(2)
    calls = []
    monkeypatch.setattr(module, "ws_bwd_ready", lambda *a: True)
    monkeypatch.setattr(module, "ws_bwd_fused", lambda: True)
    monkeypatch.setattr(module, "launch_attn_bwd_ws", lambda *a: (calls.append(a), delta)[1])
    dq, dk, dv, dsinks = module.backward(q, k, v, o, lse, do, alibi_slopes=slopes, sinks=sinks)
    (args,) = calls
    assert args[9].shape == (1, 2) and torch.equal(args[9][0], slopes) and args[10] == 64 ** -0.5
    expected = -(torch.exp(sinks[None, :, None] - lse) * delta).sum(dim=(0, 2))
    assert torch.allclose(dsinks, expected)


# -- on a Hopper GPU -------------------------------------------------------------------------------------

def _tensors(variant, batch, heads):
    """The run-time tensors of a variant: sinks (heads,) (learned: their gradient is checked), ALiBi's slopes
    (batch, heads)."""
    tensors = {}
    if VARIANTS[variant][1] == "alibi":
        tensors["alibi_slopes"] = torch.rand(batch, heads, device="cuda") * 0.1
    if VARIANTS[variant][2]:
        tensors["sinks"] = torch.randn(heads, device="cuda") * 2
    return tensors


def _close(name, got, ref, low, dtype, size=None):
    """The project's rule (testing/accuracy.py): the kernel's max abs error within FUDGE times the same-precision
    computation's plus ATOL, its relative error under REL_TOL; no poisoned (NaN) element left. `size`: the norm the
    relative error is taken against where it is not the result's own (a sum whose terms cancel: `_dsinks_size`)."""
    assert not got.isnan().any(), f"{name}: unwritten (poisoned) or NaN elements"
    err = (got.double().cpu() - ref).abs().max().item()
    low_err = (low.double().cpu() - ref).abs().max().item()
    assert err <= FUDGE * low_err + ATOL[dtype], (name, err, low_err)
    rel = (got.double().cpu() - ref).norm().item() / max(ref.norm().item() if size is None else size, 1e-30)
    assert rel <= REL_TOL[dtype], (name, rel)


def _dsinks_size(spec, q, k, v, do, tensors):
    """The norm over heads of sum |p_sink * D| over each head's rows (float64; D = rowsum(dO * O)): dsinks is
    -sum p_sink * D, whose terms cancel, so that its rounding error (D from the 16-bit O, each term's) scales with
    this size, not with the sum's own (a draw of n=1000 at d=128 once left the sum 1.15% off by its own norm)."""
    consts = {name: t.detach().cpu().double() for name, t in tensors.items()}
    out, lse = reference.variant_attention(*(t.detach().cpu() for t in (q, k, v)), spec_variant(spec),
                                           spec.bottom_right, tensors=consts, dtype=torch.float64)
    p_sink = torch.exp(consts["sinks"][None, :, None] - lse)
    terms = p_sink * (do.detach().cpu().double() * out).sum(-1)
    return terms.abs().sum((0, 2)).norm().item()


def _reference_grads(spec, q, k, v, do, tensors, dtype):
    """dq, dk, dv (and dsinks) by autograd through reference.variant_attention at `dtype`, on the CPU."""
    leaves = [t.detach().cpu().to(dtype).requires_grad_() for t in (q, k, v)]
    consts = {name: t.detach().cpu() for name, t in tensors.items()}
    if "sinks" in consts:
        consts["sinks"] = consts["sinks"].to(dtype).requires_grad_()
    out, _ = reference.variant_attention(*leaves, spec_variant(spec), spec.bottom_right, tensors=consts, dtype=dtype)
    out.backward(do.detach().cpu().to(dtype))
    grads = [t.grad for t in leaves]
    return grads + ([consts["sinks"].grad] if "sinks" in consts else [])


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("n", [257, 1000])
@pytest.mark.parametrize("fused", [True, False])
def test_gluon_variant_backward_against_float64(variant, head_dim, n, fused, monkeypatch):
    kernel = attngen.load(_text(f"gvb_gpu_{variant}_{head_dim}", head_dim, "bf16", variant))
    module, spec = kernel.module, kernel.spec
    for key in ("min_scores", "min_keys"):  # the Gluon kernels at every size here
        monkeypatch.setitem(module.WS_BWD_SHAPE, key, 0)
        monkeypatch.setitem(module.WS_SHAPE, key, 0)
    if not fused:  # dK, dV from the Gluon kernel, dQ from the Triton one (deterministic algorithms' split)
        monkeypatch.setattr(module, "ws_bwd_fused", lambda: False)
        monkeypatch.setitem(module.WS_BWD_SHAPE, "split", True)
    B, H = 2, 4
    q, k, v, do = (torch.randn(B, H, n, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    tensors = _tensors(variant, B, H)
    out, lse = module.forward(q, k, v, **tensors)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    assert module.ws_bwd_ready(q, k, v, do, dk, dv)
    called = []
    for name in ("launch_attn_bwd_ws", "launch_attn_bwd_dkdv_ws"):
        launch = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _l=launch, **kw: (called.append(1), _l(*a, **kw))[1])
    got = module.backward(q, k, v, out, lse, do, dq=dq, dk=dk, dv=dv, **tensors)
    assert called
    ref = _reference_grads(spec, q, k, v, do, tensors, torch.float64)
    low = _reference_grads(spec, q, k, v, do, tensors, torch.bfloat16)
    size = _dsinks_size(spec, q, k, v, do, tensors) if "sinks" in tensors else None
    for name, g, r, lo in zip(("dq", "dk", "dv", "dsinks"), got, ref, low):
        _close(name, g, r, lo, spec.dtype, size if name == "dsinks" else None)
