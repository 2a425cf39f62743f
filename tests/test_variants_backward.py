"""The backward of every variant through `attngen.load(spec)` kernels: gradients of q, k, v (and the sinks)
against float64 autograd through reference.variant_attention, the run-time tensors' checks, and the
generated dK/dV loops skipping dead query blocks."""

import functools

import pytest
import sympy
import torch

import attngen
from attngen import KernelInputError
from attngen.ir import sym
from attngen.lang.spec import parse
from attngen.passes import compile_program
from attngen.runtime import kernel as kernel_module
from attngen.testing import reference
from attngen.testing.accuracy import ATOL, FUDGE, GRAD_REL_TOL, REL_TOL, spec_variant
from conftest import DEVICE, spec_text


def variant_spec(name, body, dtype="fp32"):
    """A forward+backward spec of head dim 32 with 16 x 16 tiles and the variant lines `body`."""
    return parse(spec_text(name, 32, dtype, "none", direction="forward+backward", block_m=16, block_n=16)
                 .replace("    mask = none\n", "").replace("\n}", "\n    " + body.replace("\n", "\n    ") + "\n}"))



# name: (the spec's variant lines, run-time tensors (heads, batch) -> dict, (B, H, H_KV, N_Q, N_K))
CASES = {
    "window": ("mask = window(8)", None, (2, 2, 2, 37, 45)),
    "causal_window": ("mask = causal & window(12)", None, (1, 4, 2, 45, 37)),
    "window_left_right": ("mask = window(5, 3)", None, (1, 2, 1, 33, 50)),
    "causal_or_prefix": ("mask = causal | prefix(9)", None, (1, 2, 2, 41, 41)),
    "causal_chunked": ("mask = causal & chunked(12)", None, (2, 2, 2, 39, 39)),
    "softcap": ("mask = none\nscore = softcap(2)", None, (1, 4, 2, 29, 43)),
    "alibi_heads": ("mask = causal\nscore = alibi", lambda b, h: {"alibi_slopes": torch.rand(h)}, (2, 2, 2, 35, 35)),
    "alibi_batch_heads": ("mask = causal\nscore = alibi", lambda b, h: {"alibi_slopes": torch.rand(b, h)},
                          (2, 2, 2, 35, 40)),
    "sinks_window": ("mask = window(8)\nsinks = true", lambda b, h: {"sinks": torch.randn(h)}, (2, 2, 2, 37, 37)),
    # a union with a gap between its pieces: no band bounds it, an EXPR predicate evaluated per element
    "general_mask": ("mask = (q >= k & q - k < 4) | k < 6", None, (1, 2, 2, 45, 45)),
    "general_score": ("mask = none\ntensor bias[H, 64]: fp32\nscore = s + bias[h, q - k]",
                      lambda b, h: {"bias": torch.randn(h, 64)}, (1, 2, 2, 30, 34)),
}


def inputs(case, dtype, seed=0):
    body, make, (b, h, h_kv, n_q, n_k) = CASES[case]
    variant = spec_variant(variant_spec("vb_reference", body))
    gen = torch.Generator().manual_seed(seed)
    q, k, val, do = (torch.randn(shape, generator=gen).to(DEVICE, dtype)
                     for shape in ((b, h, n_q, 32), (b, h_kv, n_k, 32), (b, h_kv, n_k, 32), (b, h, n_q, 32)))
    torch.manual_seed(seed)
    tensors = {name: t.to(DEVICE) for name, t in (make(b, h) if make else {}).items()}
    return variant, q, k, val, do, tensors


def reference_grads(variant, q, k, val, do, tensors, dtype):
    """(out, dq, dk, dv[, dsinks]) of reference.variant_attention computed in `dtype`."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, val)]
    consts = {n: (t.detach().to(dtype).requires_grad_() if n == "sinks" else t) for n, t in tensors.items()}
    out, _ = reference.variant_attention(*leaves, variant, False, tensors=consts, dtype=dtype)
    out.backward(do.to(dtype))
    sinks = [consts["sinks"].grad] if "sinks" in consts else []
    return [out.detach()] + [t.grad for t in leaves] + sinks


SPEC_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def assert_close(name, got, ref, low, spec_dtype, rel_tol):
    """The kernel's error against float64 within FUDGE times a same-precision computation's, plus a floor
    (attngen/testing/accuracy.py's rule), and its relative error under `rel_tol`."""
    assert not torch.isnan(got).any(), f"{name}: NaN (unwritten or poisoned)"
    err = (got.double() - ref).abs().max().item()
    low_err = (low.double() - ref).abs().max().item()
    atol = ATOL[spec_dtype]
    assert err <= FUDGE * low_err + atol, f"{name}: max|err| {err:.3e} > {FUDGE} * {low_err:.3e} + {atol}"
    rel = (got.double() - ref).norm().item() / (ref.norm().item() or 1.0)
    assert rel <= rel_tol, f"{name}: relative error {rel:.3e} > {rel_tol}"


def poisoned(q, k, v):
    return tuple(torch.full_like(t, float("nan")) for t in (q, k, v))


def check_gradients(monkeypatch, case, dtype, seed=0):
    variant, q, k, val, do, tensors = inputs(case, dtype, seed)
    spec = variant_spec(f"vb_{case}_{SPEC_DTYPES[dtype]}", CASES[case][0], SPEC_DTYPES[dtype])
    kernel = attngen.load(spec)
    # The backward writes into gradient buffers poisoned with NaN: an element it leaves shows.
    monkeypatch.setattr(kernel_module, "gradient_tensors", poisoned)
    leaves = [t.clone().requires_grad_() for t in (q, k, val)]
    args = {n: (t.clone().requires_grad_() if n == "sinks" else t) for n, t in tensors.items()}
    out = kernel(*leaves, **args)
    out.backward(do)
    got = [out.detach()] + [t.grad for t in leaves] + ([args["sinks"].grad] if "sinks" in args else [])
    refs = reference_grads(variant, q, k, val, do, tensors, torch.float64)
    lows = reference_grads(variant, q, k, val, do, tensors, dtype)
    assert len(got) == len(refs)
    for i, (name, g, r, low) in enumerate(zip(("out", "dq", "dk", "dv", "dsinks"), got, refs, lows)):
        assert g.shape == r.shape and g.dtype == (tensors["sinks"].dtype if name == "dsinks" else dtype), name
        tol = (REL_TOL if i == 0 else GRAD_REL_TOL)[spec.dtype]
        assert_close(f"{case} {name}", g, r, low, spec.dtype, tol)


@pytest.mark.parametrize("case", sorted(CASES))
def test_variant_gradients_match_float64(monkeypatch, case):
    check_gradients(monkeypatch, case, torch.float32)


@pytest.mark.parametrize("case,dtype", [("causal_window", torch.float16), ("softcap", torch.bfloat16)])
def test_variant_gradients_in_16_bit(monkeypatch, case, dtype):
    check_gradients(monkeypatch, case, dtype)


def test_sinks_gradient_through_torch_compile_in_one_graph():
    """The custom ops carry the run-time tensors (a Tensor[] argument): a compiled training step through
    `autograd.attention_forward` (what the SDPA drop-in calls) with sinks stays one graph and gives the eager
    gradients, the sinks' included."""
    from torch._dynamo.testing import CompileCounter

    from attngen.runtime.autograd import attention_forward

    variant, q, k, val, do, tensors = inputs("sinks_window", torch.float32)
    key = attngen.load(variant_spec("vb_compile_sinks", CASES["sinks_window"][0])).key

    def loss(q, k, v, sinks):
        out, _ = attention_forward(key, q, k, v, 32 ** -0.5, (sinks,))
        return (out * do).sum()

    counter = CompileCounter()
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    runs = []
    for fn in (loss, compiled):
        leaves = [t.clone().requires_grad_() for t in (q, k, val, tensors["sinks"])]
        fn(*leaves).backward()
        runs.append([t.grad for t in leaves])
    assert counter.frame_count == 1
    for eager, traced in zip(*runs):
        assert torch.allclose(eager, traced, atol=1e-6, rtol=0)


def test_sinks_in_the_kernels_dtype_get_a_gradient_in_theirs():
    variant, q, k, val, do, tensors = inputs("sinks_window", torch.float16)
    kernel = attngen.load(variant_spec("vb_sinks_fp16", CASES["sinks_window"][0], "fp16"))
    sinks = tensors["sinks"].half().requires_grad_()
    kernel(q, k, val, sinks=sinks).backward(do)
    ref = reference_grads(variant, q, k, val, do, {"sinks": sinks.detach()}, torch.float64)[-1]
    assert sinks.grad.dtype == torch.float16 and torch.allclose(sinks.grad.double(), ref, atol=2e-2, rtol=1e-2)


def test_kernel_backward_returns_the_sinks_gradient_last():
    """`Kernel.backward` (no autograd) takes the forward's keyword tensors and returns (dq, dk, dv, dsinks)."""
    variant, q, k, val, do, tensors = inputs("sinks_window", torch.float32)
    kernel = attngen.load(variant_spec("vb_sinks", CASES["sinks_window"][0]))
    out, lse = kernel(q, k, val, return_lse=True, **tensors)
    grads = kernel.backward(q, k, val, out, lse, do, grads=poisoned(q, k, val), **tensors)
    refs = reference_grads(variant, q, k, val, do, tensors, torch.float64)[1:]
    assert len(grads) == 4
    for g, r in zip(grads, refs):
        assert torch.allclose(g.double(), r, atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match="sinks="):
        kernel.backward(q, k, val, out, lse, do)


def test_run_time_tensors_are_checked_before_any_launch():
    variant, q, k, val, do, tensors = inputs("general_score", torch.float32)
    kernel = attngen.load(variant_spec("vb_general_score", CASES["general_score"][0]))
    with pytest.raises(TypeError, match="needs the tensor bias="):
        kernel(q, k, val)
    with pytest.raises(TypeError, match="unexpected keyword sinks="):
        kernel(q, k, val, bias=tensors["bias"], sinks=torch.zeros(2))
    with pytest.raises(KernelInputError, match=r"bias has shape \(2, 63\)"):
        kernel(q, k, val, bias=torch.zeros(2, 63))
    with pytest.raises(KernelInputError, match="bias has dtype torch.float16"):
        kernel(q, k, val, bias=tensors["bias"].half())
    with pytest.raises(KernelInputError, match="bias requires grad"):
        kernel(q, k, val, bias=tensors["bias"].clone().requires_grad_())
    with torch.no_grad():  # a constant there: no gradient is asked for
        kernel(q, k, val, bias=tensors["bias"].clone().requires_grad_())
    assert issubclass(KernelInputError, ValueError)

    plain = attngen.load(variant_spec("vb_plain_window", CASES["window"][0]))
    with pytest.raises(TypeError, match="unexpected keyword alibi_slopes="):
        plain(q, k, val, alibi_slopes=torch.rand(2))

    variant, q, k, val, do, tensors = inputs("alibi_heads", torch.float32)
    alibi = attngen.load(variant_spec("vb_alibi_heads", CASES["alibi_heads"][0]))
    for bad in (torch.rand(3), torch.rand(1, 2, 1), torch.rand(2, 2, dtype=torch.float64)):
        with pytest.raises(KernelInputError, match="alibi_slopes has"):
            alibi(q, k, val, alibi_slopes=bad)

    variant, q, k, val, do, tensors = inputs("sinks_window", torch.float32)
    sinks = attngen.load(variant_spec("vb_sinks", CASES["sinks_window"][0]))
    for bad in (torch.zeros(3), torch.zeros(2, dtype=torch.float16), torch.zeros(1, 2)):
        with pytest.raises(KernelInputError, match="sinks has"):
            sinks(q, k, val, sinks=bad)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        sinks(q, k, val, sinks=[0.0, 0.0])


def _walk(body):
    for st in body:
        yield st
        yield from _walk(getattr(st, "body", ()))


RANGE_MASKS = {name: CASES[name][0] for name in ("window", "causal_window", "window_left_right", "causal_chunked",
                                                "causal_or_prefix", "general_mask")}
RANGE_MASKS["banded_expression"] = "mask = q - k < 20 & (k < 5 | q >= k)"  # an expression solved as bands


@functools.lru_cache(maxsize=None)
def dkdv_query_loops(name):
    spec = variant_spec("vb_ranges", RANGE_MASKS[name])
    kernel = compile_program(spec).kernel("attn_bwd_dkdv")
    return spec.variant.mask, [st for st in _walk(kernel.body) if getattr(st, "var", None) == sym.start_m]


@pytest.mark.parametrize("name", sorted(RANGE_MASKS))
@pytest.mark.parametrize("sizes", [(37, 45), (64, 33), (100, 100)])
def test_dkdv_query_block_ranges_are_exact(name, sizes):
    """The dK/dV kernel's loops over query blocks after causal-skip (narrowed by the band predicates' query
    forms): for every key block, no live query block is skipped, no dead one visited where the mask is bands,
    and every block of an unmasked loop is kept whole (brute force over the tree's condition). A mask no band
    bounds visits every query block."""
    n_q, n_k = sizes
    mask, loops = dkdv_query_loops(name)
    assert loops
    env = {"q": torch.arange(n_q)[:, None], "k": torch.arange(n_k)[None, :], "b": 0, "h": 0}
    tree = reference._holds(mask, env).expand(n_q, n_k)
    banded = name != "general_mask"
    bm = bn = 16
    for start_n in range(0, n_k, bn):
        values = {sym.start_n: start_n, sym.N_Q: n_q, sym.N_K: n_k, sym.BLOCK_M: bm, sym.BLOCK_N: bn}
        visited = {}
        for loop in loops:
            for start_m in range(sym.evaluate(loop.start, values), sym.evaluate(loop.stop, values), bm):
                assert start_m not in visited, "a query block visited twice"
                visited[start_m] = "no mask" not in loop.note
        for start_m in range(0, n_q, bm):
            kept = tree[start_m:start_m + bm, start_n:start_n + bn]
            if start_m not in visited:
                assert not kept.any(), (name, start_n, start_m, "a live block skipped")
            elif not banded:
                continue  # (its condition stays in every loop: the test of the source below)
            elif not visited[start_m]:
                assert kept.all() and kept.shape[0] == bm, (name, start_n, start_m, "a partial block unmasked")
            else:
                assert kept.any(), (name, start_n, start_m, "a dead block visited")
        if not banded:
            assert sorted(visited) == list(range(0, n_q, bm))


def test_score_derivative_comes_from_sympy():
    """dS's factor is d fn / d s of the score modifier: softcap's 1 - tanh^2 in both backward kernels; ALiBi's
    and an additive bias's derivative is 1, so their dS has no factor."""
    from attngen import ir

    def factors(body):
        program = compile_program(variant_spec("vb_ir", body))
        found = []
        for name in ("attn_bwd_dq", "attn_bwd_dkdv"):
            for st in ir.walk_stmts(program.kernel(name).body):
                if isinstance(st, ir.Assign) and st.target.name in ("ds", "ds_t"):
                    found += [e for e in ir.walk_expr(st.value) if isinstance(e, ir.Pointwise)]
        return found

    softcap = factors(CASES["softcap"][0])
    assert softcap and all(not f.score and f.fn.has(sympy.tanh) for f in softcap)
    assert factors(CASES["alibi_heads"][0]) == [] and factors(CASES["general_score"][0]) == []
