"""`head_dim_v`: V (and O, dO, dV) with another head dim than Q and K, from the spec key through the IR, the
resource and cost models, every Triton kernel (forward, backward, split-KV decoding and its merge, paged,
varlen) and the drop-in API, checked against float64 with outputs poisoned first."""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
import torch

import attngen
from attngen import ir
from attngen.analysis import cost, masks
from attngen.analysis.resources import Target, infeasible, registers, shared_bytes, shared_bytes_backward
from attngen.cli import main
from attngen.errors import InternalError, SpecError
from attngen.ir import sym
from attngen.ir.verify import verify
from attngen.lang.spec import parse
from attngen.passes import applied_passes, compile_program
from attngen.testing import reference
from attngen.testing.accuracy import Case, PackedCase, run_case

from conftest import DEVICE, SPECS, spec_text

H100 = Target((9, 0), 232448, "H100")


def _spec(**keys):
    return parse(spec_text(**keys))


# -- the spec key -------------------------------------------------------------------------------------------


def test_head_dim_v_defaults_to_head_dim_and_is_written_only_when_it_differs():
    plain = _spec(head_dim=64)
    assert plain.head_dim_v == 64 and not plain.splits_head_dims
    assert "head_dim_v" not in plain.canonical()
    assert _spec(head_dim=64, head_dim_v=64) == plain and _spec(head_dim=64, head_dim_v=64).hash == plain.hash
    split = _spec(head_dim=192, head_dim_v=128)
    assert (split.head_dim_v, split.head_dim_v_padded, split.head_dim_padded) == (128, 128, 256)
    lines = split.canonical().splitlines()
    assert lines[lines.index("    head_dim = 192") + 1] == "    head_dim_v = 128"
    assert parse(split.canonical()) == split and split.hash != _spec(head_dim=192).hash
    assert split.softmax_scale == 1 / math.sqrt(192)  # q.k's width, as SDPA scales


BAD = [
    ("kernel k { head_dim = 64 head_dim_v = 528 dtype = fp16 }", 1, 39, ["head_dim_v = 528", "out of range", "16 to 512"]),
    ("kernel k { head_dim = 64 head_dim_v = 200 dtype = fp16 }", 1, 39, ["head_dim_v = 200", "multiple of 16", "192 or 208"]),
    ("kernel k { head_dim = 64 head_dim_v = 8 dtype = fp16 }", 1, 39, ["out of range", "16 to 512"]),
    ("kernel k { head_dim = 64 head_dim_v = auto dtype = fp16 }", 1, 39, ["head_dim_v takes a whole number"]),
    ("kernel k { head_dim = 64 head_dim_v = 64.0 dtype = fp16 }", 1, 39, ["whole number"]),
    ("kernel k {\n head_dim = 64\n head_dim_v = 32\n dtype = fp16\n head_dim_v = 48 }", 5, 2,
     ["duplicate key 'head_dim_v'", "line 3"]),
    ("kernel k { head_dim = 64 head_dimv = 32 dtype = fp16 }", 1, 26, ["unknown key 'head_dimv'", "head_dim_v"]),
]


@pytest.mark.parametrize("text,line,col,words", BAD)
def test_bad_head_dim_v_is_a_spec_error_at_the_key(text, line, col, words):
    with pytest.raises(SpecError) as info:
        parse(text, "bad.attn")
    e = info.value
    assert (e.filename, e.line, e.column) == ("bad.attn", line, col), str(e)
    for w in words:
        assert w in e.message, e.message


def test_compile_exits_2_at_a_bad_head_dim_v(tmp_path, capsys):
    bad = tmp_path / "bad.attn"
    bad.write_text("kernel k {\n    head_dim = 192\n    head_dim_v = 1024\n    dtype = bf16\n}\n")
    assert main(["compile", str(bad), "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{bad}:3:18: error: head_dim_v = 1024 is out of range; expected 16 to 512"), err
    assert "Traceback" not in err and not (tmp_path / "k.py").exists()


# -- the IR -------------------------------------------------------------------------------------------------


def _last_dims(program: ir.Program) -> dict:
    return {p.name: p.shape[-1] for k in program.kernels for p in k.params if p.name in ("Q", "K", "V", "O", "DO", "DQ",
                                                                                        "DK", "DV", "O_PART")}


def test_v_o_do_dv_take_head_dim_v_and_q_k_dq_dk_head_dim():
    program = compile_program(_spec(head_dim=48, head_dim_v=32, direction="forward+backward", mask="causal"))
    assert _last_dims(program) == {"Q": sym.HEAD_DIM, "K": sym.HEAD_DIM, "DQ": sym.HEAD_DIM, "DK": sym.HEAD_DIM,
                                   "V": sym.HEAD_DIM_V, "O": sym.HEAD_DIM_V, "DO": sym.HEAD_DIM_V, "DV": sym.HEAD_DIM_V}
    accumulators = {st.target.name: st.target.shape for k in program.kernels for st in ir.walk_stmts(k.body)
                    if isinstance(st, ir.Assign) and st.target.name in ("acc", "dq", "dk", "dv")}
    assert accumulators == {"acc": (sym.BLOCK_M, sym.HEAD_DIM_V), "dq": (sym.BLOCK_M, sym.HEAD_DIM_PADDED),
                            "dk": (sym.BLOCK_N, sym.HEAD_DIM_PADDED), "dv": (sym.BLOCK_N, sym.HEAD_DIM_V)}
    decode = compile_program(_spec(head_dim=80, head_dim_v=256, split_kv=4, kv_layout="paged(page_size = 16)",
                                   mask="causal(bottom_right)"))
    assert _last_dims(decode)["O_PART"] == sym.HEAD_DIM_V and _last_dims(decode)["O"] == sym.HEAD_DIM_V
    assert decode.attr("combine_block_s") == 4096 // 256  # chunks of [BLOCK_S, D_V] partial outputs (32 at D = 128)


def test_verify_holds_each_buffer_to_its_head_dim():
    split = compile_program(_spec(head_dim=128, head_dim_v=64, dtype="bf16", direction="forward+backward"))
    plain = compile_program(_spec(head_dim=128, dtype="bf16", direction="forward+backward"))
    verify(split, "test")
    with pytest.raises(InternalError, match="after pass 'test': attn_fwd: V is HEAD_DIM_V wide; its head dim is "
                                            "HEAD_DIM"):
        verify(split.with_attrs(head_dim_v=None), "test")
    with pytest.raises(InternalError, match="attn_fwd: V is HEAD_DIM wide; its head dim is HEAD_DIM_V"):
        verify(plain.with_attrs(head_dim_v=128), "test")
    with pytest.raises(InternalError, match=r"kernels for head dim 128 \(padded 128, head_dim_v 64\); the templates"):
        verify(replace(split, warp_specialized=plain.warp_specialized), "test")
    # DeepSeek's pair has the Gluon forward, not its backward (that template takes one head dim)
    deepseek = compile_program(_spec(head_dim=192, head_dim_v=128, dtype="bf16", mask="causal",
                                     direction="forward+backward"))
    verify(deepseek, "test")
    with_backward = replace(deepseek.warp_specialized, backward=plain.warp_specialized.backward)
    with pytest.raises(InternalError, match="backward or decode kernels for head_dim_v 128 beside head_dim 192"):
        verify(replace(deepseek, warp_specialized=with_backward), "test")


def test_a_plain_spec_has_no_second_head_dim_anywhere():
    text = ir.format_program(compile_program(_spec(head_dim=64, head_dim_v=64, direction="forward+backward")))
    assert "HEAD_DIM_V" not in text and "offs_dv" not in text and "head_dim_v" not in text


@pytest.mark.parametrize("keys,part", [
    (dict(dtype="bf16", direction="forward+backward"), "forward"),
    (dict(dtype="bf16", mask="causal(bottom_right)", split_kv="auto", kv_layout="paged(page_size = 16)"), "decode"),
])
def test_gluon_kernels_stay_for_one_head_dim(keys, part):
    same = compile_program(_spec(head_dim=128, **keys))
    other = compile_program(_spec(head_dim=128, head_dim_v=64, **keys))
    assert getattr(same.warp_specialized, part) is not None
    assert getattr(other.warp_specialized, part) is None and other.warp_specialized.backward is None


def test_tma_reads_q_and_do_at_their_own_widths():
    program = compile_program(_spec(head_dim=128, head_dim_v=64, dtype="bf16", direction="forward+backward"))
    loads = {e.buffer.name: e.index[-1].size for k in program.kernels if k.name == "attn_bwd_dkdv"
             for st in ir.walk_stmts(k.body) for x in ir.stmt_exprs(st) for e in ir.walk_expr(x)
             if isinstance(e, ir.Load) and e.descriptor}
    assert loads == {"Q": sym.HEAD_DIM, "DO": sym.HEAD_DIM_V}
    padded_v = compile_program(_spec(head_dim=128, head_dim_v=80, dtype="bf16", direction="forward+backward"))
    assert "tma" not in applied_passes(padded_v)  # dO's loads are masked along its padded head dim


def test_explain_says_which_gluon_kernels_run(capsys, tmp_path):
    assert main(["explain", os.path.join(SPECS, "deepseek_192_128.attn")]) == 0
    out = capsys.readouterr().out
    assert ("the forward runs the Gluon kernel, Q and K tiles in column pieces 128 + 64 (policy/hopper.py "
            "SPLIT_TILES_192: S a product per piece) (head_dim = 192), V and the output 128 (head_dim_v); the backward "
            "runs the Gluon kernel's wide path with its Q and K tiles in column pieces 128 + 64") in out
    assert "head_dim 192, head_dim_v 128, bf16" in out and "2*(d + d_v) per kept score, /2 causal" in out
    other = tmp_path / "other.attn"
    other.write_text(spec_text("other", head_dim=128, head_dim_v=64, dtype="bf16"))
    assert main(["explain", str(other)]) == 0
    assert "no Hopper Gluon kernels (head_dim_v = 64 differs from head_dim = 128" in capsys.readouterr().out


# -- resources and cost ---------------------------------------------------------------------------------------


def test_resources_count_each_head_dim_where_it_is_used():
    for stages in (1, 2, 3):
        assert shared_bytes(128, 2, 128, 64, stages, H100, head_dim_v_padded=128) == shared_bytes(128, 2, 128, 64,
                                                                                                  stages, H100)
    # Q tile 256 wide, each stage one 256-wide K and one 128-wide V tile (wgmma: 3 stages buffered)
    assert shared_bytes(256, 2, 64, 32, 3, H100, head_dim_v_padded=128) == 2 * (256 * 64 + 32 * 3 * (256 + 128))
    for name in ("attn_bwd_dq", "attn_bwd_dkdv"):
        both = shared_bytes_backward(name, 256, 2, 64, 32, 2, H100, head_dim_v_padded=128)
        assert shared_bytes_backward(name, 256, 2, 64, 32, 2, H100) > both > shared_bytes_backward(name, 128, 2, 64,
                                                                                                     32, 2, H100)
    assert registers(128, 128, 64, 8) == (128 * 128 + 128 * 64) / 256  # the accumulator is D_V wide
    wide = _spec(head_dim=64, head_dim_v=512, dtype="bf16")
    problem = infeasible(wide, {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}, H100)
    assert "head_dim_v 512" in problem and "registers" in problem


def test_flops_count_q_k_and_p_v_at_their_widths():
    sizes = dict(B=2, H=3, N_Q=300, N_K=500, HEAD_DIM=192)
    for causal in (False, True):
        for backward in (False, True):
            split = _spec(head_dim=192, head_dim_v=128, mask="causal" if causal else "none")
            per_score = 2 * (3 * 192 + 2 * 128) if backward else 2 * (192 + 128)
            assert masks.fa_flops(split, sizes, backward) == 2 * 3 * 300 * 500 * per_score / (2 if causal else 1)
            same = cost.evaluate(cost.fa_flops(causal, backward, head_dim_v=True), dict(sizes, HEAD_DIM_V=192))
            assert same == cost.evaluate(cost.fa_flops(causal, backward), sizes)  # FlashAttention's 4d and 2.5x
    window = _spec(head_dim=192, head_dim_v=128, mask="window(64)")
    kept = masks.kept_scores(window, 300, 500, 2, 3)
    assert masks.fa_flops(window, sizes) == 2 * (192 + 128) * kept


# -- the kernels against float64 ------------------------------------------------------------------------------

KERNELS = [  # (spec keys, cases): odd sizes, seq_q != seq_k both ways, GQA
    (dict(head_dim=48, head_dim_v=32, dtype="fp32", mask="causal", direction="forward+backward", heads=4,
          kv_heads=2), [Case(2, 4, 2, 13, 29), Case(1, 4, 2, 37, 11)]),
    (dict(head_dim=32, head_dim_v=64, dtype="bf16", direction="forward+backward"), [Case(1, 6, 2, 21, 45)]),
    # dK/dV reads Q (128 wide) and dO (64 wide) through TMA descriptors (the interpreter emulates them)
    (dict(head_dim=128, head_dim_v=64, dtype="bf16", direction="forward+backward"), [Case(1, 2, 1, 37, 45)]),
    (dict(head_dim=64, head_dim_v=80, dtype="fp16", mask="causal(bottom_right) & window(9)", score="softcap(20)",
          direction="forward+backward", heads=3, kv_heads=1), [Case(1, 3, 1, 19, 33)]),
    (dict(head_dim=80, head_dim_v=48, dtype="fp32", mask="causal(bottom_right)", split_kv=3,
          kv_layout="paged(page_size = 16)"), [Case(2, 4, 2, 3, 37), Case(1, 6, 2, 1, 70)]),
    (dict(head_dim=48, head_dim_v=96, dtype="bf16", split_kv="auto"), [Case(2, 4, 1, 5, 41)]),
    (dict(head_dim=48, head_dim_v=32, dtype="fp32", mask="causal", layout="varlen", direction="forward+backward",
          heads=4, kv_heads=2), [PackedCase(4, 2, (5, 0, 13, 1), (9, 4, 13, 0))]),
    (dict(head_dim=64, head_dim_v=32, dtype="fp16", mask="causal", layout="varlen",
          kv_layout="paged(page_size = 8)"), [PackedCase(2, 2, (3, 11), (20, 11))]),
]


@pytest.mark.parametrize("keys,cases", KERNELS, ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items())
                         if isinstance(x, dict) else "")
def test_kernels_match_float64_with_outputs_poisoned(keys, cases, device):
    kernel = attngen.load(spec_text(**keys))
    gen = torch.Generator(device).manual_seed(0)
    for case in cases:
        result = run_case(kernel, case, device, gen)  # out (and dq, dk, dv) poisoned with NaN before the launch
        assert result.ok, result
        assert not kernel.spec.backward or len(result.grads) == 3


# -- the API --------------------------------------------------------------------------------------------------


def _randn(*shape, gen, dtype=torch.float32):
    return torch.randn(shape, generator=gen, device=DEVICE).to(dtype)


def _close(got, ref, tol):
    assert got.shape == ref.shape and (got.double() - ref.double()).abs().max().item() < tol


@pytest.mark.parametrize("causal", [False, True])
def test_attention_takes_v_of_another_head_dim_as_sdpa_does(causal):
    gen = torch.Generator(DEVICE).manual_seed(1)
    q, k, v = _randn(2, 4, 13, 48, gen=gen), _randn(2, 2, 29, 48, gen=gen), _randn(2, 2, 29, 32, gen=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    for _ in range(3):  # checked, recorded, replayed
        out = attngen.attention(*leaves, is_causal=causal, enable_gqa=True)
        assert out.shape == (2, 4, 13, 32)
        ref = torch.nn.functional.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), is_causal=causal,
                                                               enable_gqa=True)
        _close(out, ref, 1e-5)
        do = _randn(*out.shape, gen=gen)
        doubles = [t.double().requires_grad_() for t in (q, k, v)]
        torch.nn.functional.scaled_dot_product_attention(*doubles, is_causal=causal, enable_gqa=True).backward(
            do.double())
        for got, want in zip(torch.autograd.grad(out, leaves, do), doubles):
            _close(got, want.grad, 1e-5)
    out3 = attngen.attention(q[0], k[0], v[0], is_causal=causal, enable_gqa=True)  # (heads, seq, head_dim) too
    _close(out3, ref[0], 1e-5)


def test_torch_compile_traces_v_of_another_head_dim_with_gradients():
    """The custom ops' fake outputs take v's head dim: one graph, the eager result, gradients through it."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(lambda q, k, v: attngen.attention(q, k, v, is_causal=True, enable_gqa=True) * 2,
                             backend=counter, fullgraph=True)
    gen = torch.Generator(DEVICE).manual_seed(4)
    q, k, v = (t.requires_grad_() for t in (_randn(1, 4, 11, 32, gen=gen), _randn(1, 2, 19, 32, gen=gen),
                                            _randn(1, 2, 19, 48, gen=gen)))
    out = compiled(q, k, v)
    assert counter.frame_count == 1 and out.shape == (1, 4, 11, 48)
    eager = attngen.attention(q, k, v, is_causal=True, enable_gqa=True) * 2
    _close(out, eager, 1e-6)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    for g, want in zip(got, torch.autograd.grad(eager.sum(), (q, k, v))):
        _close(g, want, 1e-6)


def test_attention_with_kvcache_takes_a_v_cache_of_another_head_dim():
    gen = torch.Generator(DEVICE).manual_seed(2)
    q = _randn(2, 3, 4, 48, gen=gen, dtype=torch.bfloat16)
    lens = torch.tensor([37, 11], dtype=torch.int32, device=DEVICE)
    k_cache, v_cache = _randn(2, 40, 2, 48, gen=gen, dtype=torch.bfloat16), _randn(2, 40, 2, 32, gen=gen,
                                                                                    dtype=torch.bfloat16)
    pool_k, pool_v = _randn(9, 16, 2, 48, gen=gen, dtype=torch.bfloat16), _randn(9, 16, 2, 32, gen=gen,
                                                                                  dtype=torch.bfloat16)
    table = torch.tensor([[4, 0, 7], [2, 8, 1]], dtype=torch.int32, device=DEVICE)
    for kc, vc, bt in ((k_cache, v_cache, None), (pool_k, pool_v, table)):
        ref = reference.kvcache_attention(q, kc, vc, lens, bt, causal=True)
        for _ in range(3):
            out = torch.full((2, 3, 4, 32), float("nan"), dtype=torch.bfloat16, device=DEVICE)
            attngen.attention_with_kvcache(q, kc, vc, lens, bt, causal=True, out=out, num_splits=2)
            _close(out, ref[0] if isinstance(ref, tuple) else ref, 2e-2)
            fresh = attngen.attention_with_kvcache(q, kc, vc, lens, bt, causal=True)  # (its own split count)
            assert fresh.shape == (2, 3, 4, 32)
            _close(fresh, ref[0] if isinstance(ref, tuple) else ref, 2e-2)


def test_flash_attn_varlen_func_takes_v_of_another_head_dim():
    gen = torch.Generator(DEVICE).manual_seed(3)
    cu_q = torch.tensor([0, 5, 22, 23], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 9, 26, 30], dtype=torch.int32, device=DEVICE)
    q, k, v = _randn(23, 4, 48, gen=gen), _randn(30, 2, 48, gen=gen), _randn(30, 2, 32, gen=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attngen.flash_attn_varlen_func(*leaves, cu_q, cu_k, 17, 17, causal=True)
    doubles = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference.varlen_attention(*doubles, cu_q, cu_k, causal=True)
    ref = ref[0] if isinstance(ref, tuple) else ref
    _close(out, ref, 1e-5)
    do = _randn(*out.shape, gen=gen)
    ref.backward(do.double())
    for got, want in zip(torch.autograd.grad(out, leaves, do), doubles):
        _close(got, want.grad, 1e-5)


def test_loaded_kernels_name_v_and_out_when_the_last_dim_is_wrong():
    kernel = attngen.load(spec_text(head_dim=48, head_dim_v=32, dtype="fp32", direction="forward+backward"))
    q, k = torch.randn(1, 2, 5, 48, device=DEVICE), torch.randn(1, 2, 7, 48, device=DEVICE)
    with pytest.raises(ValueError, match=r"^v has head_dim 48; kernel 't' takes head_dim_v 32"):
        kernel(q, k, torch.randn(1, 2, 7, 48, device=DEVICE))
    v = torch.randn(1, 2, 7, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"^out must be \(1, 2, 5, 32\)"):
        kernel(q, k, v, out=torch.empty(1, 2, 5, 48, device=DEVICE))
    with pytest.raises(ValueError, match=r"^k and v must have the same shape but for the head dim"):
        kernel(q, k, torch.randn(1, 2, 8, 32, device=DEVICE))
    out, lse = kernel(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"^do must be \(1, 2, 5, 32\)"):
        kernel.backward(q, k, v, out, lse, torch.randn(1, 2, 5, 48, device=DEVICE))
    with pytest.raises(ValueError, match=r"^value has head dim 40, which is not supported"):
        attngen.attention(q, k, torch.randn(1, 2, 7, 40, device=DEVICE))
    with pytest.raises(ValueError, match=r"^v_cache has head dim 520"):
        attngen.attention_with_kvcache(q.transpose(1, 2), k.transpose(1, 2), torch.randn(1, 7, 2, 520, device=DEVICE), 7)
    with pytest.raises(ValueError, match=r"^k_cache and v_cache must have the same shape but for the head dim"):
        attngen.attention_with_kvcache(q.transpose(1, 2), k.transpose(1, 2), torch.randn(1, 6, 2, 32, device=DEVICE), 6)


# -- DeepSeek-V3's shipped spec -------------------------------------------------------------------------------


def test_deepseek_spec_is_shipped_with_its_golden():
    spec = attngen.load(os.path.join(SPECS, "deepseek_192_128.attn")).spec
    assert (spec.head_dim, spec.head_dim_v, spec.dtype.value, spec.mask.value, spec.backward) == (
        192, 128, "bf16", "causal(top_left)", True)
    source = open(os.path.join(SPECS, "..", "generated", "deepseek_192_128.py")).read()
    assert "HEAD_DIM_V = 128" in source and "HEAD_DIM = 192" in source


@pytest.mark.gpu
def test_gpu_deepseek_192_128_at_real_sizes():
    kernel = attngen.load(os.path.join(SPECS, "deepseek_192_128.attn"))
    gen = torch.Generator(DEVICE).manual_seed(0)
    for case in (Case(1, 16, 16, 4096, 4096), Case(2, 8, 8, 1000, 3000), Case(1, 16, 4, 2049, 2049)):
        result = run_case(kernel, case, DEVICE, gen)
        assert result.ok, result
    # the drop-in at DeepSeek-V3's prefill shape (128 heads of 192 / 128 at 4k), against SDPA in float32
    q, k = _randn(1, 128, 4096, 192, gen=gen, dtype=torch.bfloat16), _randn(1, 128, 4096, 192, gen=gen,
                                                                           dtype=torch.bfloat16)
    v = _randn(1, 128, 4096, 128, gen=gen, dtype=torch.bfloat16)
    out = attngen.attention(q, k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert out.shape == (1, 128, 4096, 128) and (out.float() - ref).abs().max().item() < 2e-2
