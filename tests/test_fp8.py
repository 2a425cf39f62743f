"""FP8 (e4m3) prefill: the spec, where the IR quantises and descales, quantize_fp8, attention()'s FP8 arguments,
and the kernel against float64 (Triton's interpreter computes in float8 here, rounding as the GPU does:
runtime/interpreter_fixes.py; the same checks run at real sizes on a GPU).

Tolerances. e4m3 keeps 3 mantissa bits: rounding to nearest moves a value in the normal range (>= 2^-6) by at
most half a unit in the last place, a relative 2^-4; below 2^-6 (subnormals, steps of 2^-9) by at most 2^-10.
Against float64 of the dequantised inputs (the stored e4m3 values times their descales) the kernel rounds only
P to e4m3 (Q K^T and P V accumulate in fp32) and the output to bf16 (2^-9 relative). Each output row is a mean
of V's rows weighted by P / l, so with every weight off by at most 2^-4 relatively (the subnormals' absolute
2^-10 weighs at most 2^-10 * n_k / l, and l >= 1) a row is off by at most 2^-4 * sum(w |v|) + 2^-10 * n_k / l *
max|v| + 2^-9 |o| (`row_bound`). That bound holds element by element whatever the inputs; the tests also hold
the kernel to 3x the error of a float32 PyTorch computation that rounds P the same way (testing/accuracy.py).
"""

import math
from dataclasses import replace

import pytest
import torch

import attngen
from attngen import ir
from attngen.cli import main
from attngen.errors import KernelInputError, SpecError, UnsupportedError
from attngen.lang.builtin import sdpa_variant
from attngen.lang.spec import DType, Mask, parse
from attngen.lang.variants import Causal
from attngen.passes import compile_program
from attngen.testing import reference
from attngen.testing.accuracy import Case, compare, validate
from conftest import DEVICE, SPECS, spec_text

FP8 = torch.float8_e4m3fn
E4M3_REL = 2.0 ** -4     # half an ulp of 3 mantissa bits, relative, in the normal range
E4M3_SUB = 2.0 ** -10    # half the subnormal step 2^-9, absolute
BF16_REL = 2.0 ** -9


def fp8_spec(name="f8", mask="causal", **extra):
    return spec_text(name, 64, "fp8_e4m3", mask, direction="forward", **extra)


# -- the spec ------------------------------------------------------------------------------------


def test_fp8_spec_is_a_forward_with_a_bf16_output():
    spec = parse(fp8_spec())
    assert spec.dtype is DType.FP8_E4M3 and spec.dtype.bytes == 1 and spec.dtype.output is DType.BF16
    assert spec.runtime_tensors() == ("q_descale", "k_descale", "v_descale")
    assert parse(spec_text("b", 64, "bf16")).runtime_tensors() == ()


def test_fp8_backward_is_a_spec_error_at_the_direction():
    text = "kernel k {\n    head_dim = 128\n    dtype = fp8_e4m3\n    direction = forward+backward\n}\n"
    with pytest.raises(SpecError) as e:
        parse(text, "k.attn")
    assert (e.value.line, e.value.column) == (4, 17)
    assert "backward stays 16-bit" in e.value.message


def test_fp8_backward_exits_2_from_the_cli(tmp_path, capsys):
    bad = tmp_path / "bad.attn"
    bad.write_text("kernel k {\n    head_dim = 128\n    dtype = fp8_e4m3\n    direction = forward+backward\n}\n")
    assert main(["compile", str(bad), "-o", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"{bad}:4:17: error: dtype = fp8_e4m3 is forward-only")


@pytest.mark.parametrize("extra, key", [(dict(split_kv=2), "split_kv"),
                                        (dict(kv_layout="paged(page_size = 16)"), "kv_layout"),
                                        (dict(layout="varlen"), "layout")])
def test_fp8_is_the_prefill_forward(extra, key):
    text = fp8_spec(**extra)
    with pytest.raises(UnsupportedError) as e:
        parse(text)
    assert "fp8_e4m3" in e.value.message and text.splitlines()[e.value.line - 1].strip().startswith(key)


def test_fp8_products_reduce_over_at_least_32():
    with pytest.raises(UnsupportedError, match="head_dim >= 32"):
        parse(spec_text("k", 16, "fp8_e4m3", direction="forward"))
    with pytest.raises(SpecError, match="FP8 tensor-core products reduce over at least 32"):
        attngen.load(fp8_spec(block_n=16))
    from attngen.analysis.resources import infeasible

    spec = parse(fp8_spec())
    assert infeasible(spec, dict(BLOCK_M=64, BLOCK_N=16, num_warps=4, num_stages=2)) is not None
    assert infeasible(spec, dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)) is None
    q = torch.zeros(1, 1, 8, 16, dtype=FP8)
    with pytest.raises(KernelInputError, match="head dim >= 32"):
        attngen.attention(q, q, q)


def test_fp8_dtype_spelling():
    with pytest.raises(SpecError, match="spelled 'fp8_e4m3'"):
        parse(spec_text("k", 64, "float8_e4m3fn"))


# -- the IR ---------------------------------------------------------------------------------------


def stages(text):
    out = {}
    compile_program(parse(text), trace=lambda name, p: out.__setitem__(name, p))
    return out


def test_descale_pass_folds_q_and_k_into_the_scale_and_v_into_the_output():
    s = stages(fp8_spec(mask="none"))
    before, after = ir.format_program(s["fold-scale"]), ir.format_program(s["descale"])
    # before: the scale alone; the factors are parameters, read nowhere yet
    assert "qk_scale: reg fp32[] = sm_scale * 1.4426950408889634\n" in before
    assert "in Q_DESCALE: hbm fp32[B, H_KV]" in before and "load Q_DESCALE" not in before
    assert ("qk_scale: reg fp32[] = ((sm_scale * 1.4426950408889634) * load Q_DESCALE[b, (h // GROUP)]) "
            "* load K_DESCALE[b, (h // GROUP)]") in after
    assert "v_descale: reg fp32[] = load V_DESCALE[b, (h // GROUP)]" in after
    assert "store O[b, h, start_m:+BLOCK_M (<N_Q), :HEAD_DIM] = (acc * v_descale) / l_safe" in after
    # scores keep one FMA each: no descale inside the key loop
    assert after.count("load Q_DESCALE") == 1 and after.count("load V_DESCALE") == 1
    # where values are quantised: e4m3 inputs and P cast to e4m3 for P V, the output bf16
    assert "q: reg fp8_e4m3[BLOCK_M, HEAD_DIM]" in after and "dot_acc(cast<fp8_e4m3>(p), load V" in after
    assert "out O: hbm bf16[B, H, N_Q, HEAD_DIM]" in after


def test_descale_pass_is_a_no_op_for_16_bit_specs():
    s = stages(spec_text("b", 64, "bf16", "causal"))
    assert s["descale"] == s["fold-scale"]


def test_explain_shows_the_descales(capsys):
    assert main(["explain", "--pass", "descale", f"{SPECS}/fp8_causal_d128.attn"]) == 0
    out = capsys.readouterr().out
    assert "load K_DESCALE" in out and "cast<fp8_e4m3>(p)" in out and "(acc * v_descale) / l_safe" in out
    assert main(["explain", f"{SPECS}/fp8_causal_d128.attn"]) == 0
    summary = capsys.readouterr().out.split("=== fp8: where values are quantised and descaled (pass descale) ===")[1]
    assert "e4m3 inputs: Q (fp8_e4m3), K (fp8_e4m3), V (fp8_e4m3)" in summary
    assert "out (bf16) = (acc * v_descale) / l_safe" in summary and "cast<fp8_e4m3>(p)" in summary
    assert main(["explain", f"{SPECS}/fwd_causal_d128.attn"]) == 0
    assert "=== fp8" not in capsys.readouterr().out


# -- quantize_fp8 ---------------------------------------------------------------------------------


def within_e4m3(x, x8, descale_per_element):
    """Whether x8 * descale is x rounded to e4m3: within half an ulp (2^-4 relative) or half a subnormal step."""
    back = x8.float() * descale_per_element
    return bool(((back - x).abs() <= E4M3_REL * x.abs() + E4M3_SUB * descale_per_element + 1e-12).all())


def test_quantize_per_tensor_maps_the_largest_magnitude_to_448():
    x = torch.randn(2, 3, 17, 32) * 5
    x[1, 2, 3, 4] = -40.0
    x8, descale = attngen.quantize_fp8(x)
    assert x8.dtype == FP8 and descale.shape == (1,) and descale.dtype == torch.float32
    assert descale.item() == pytest.approx(40.0 / 448)
    assert x8.float().abs().max().item() == 448.0
    assert within_e4m3(x, x8, descale)


def test_quantize_per_head_and_per_group():
    x = torch.randn(2, 4, 9, 16)
    x[:, 1] *= 100  # an outlier head takes no precision from the others
    x8, descale = attngen.quantize_fp8(x, per="head")
    assert descale.shape == (2, 4)
    assert torch.allclose(descale, x.abs().amax(dim=(2, 3)) / 448)
    assert within_e4m3(x, x8, descale[:, :, None, None])
    g8, gdescale = attngen.quantize_fp8(x, per="head", kv_heads=2)  # q's descale under GQA: per K/V head
    assert gdescale.shape == (2, 2)
    assert torch.allclose(gdescale, x.reshape(2, 2, -1).abs().amax(dim=2) / 448)
    assert within_e4m3(x, g8, gdescale.repeat_interleave(2, dim=1)[:, :, None, None])


def test_quantize_rejects_what_it_cannot_quantise():
    with pytest.raises(KernelInputError, match="per must be"):
        attngen.quantize_fp8(torch.randn(1, 2, 3, 16), per="row")
    with pytest.raises(KernelInputError, match="kv_heads = 3"):
        attngen.quantize_fp8(torch.randn(1, 4, 3, 16), per="head", kv_heads=3)
    with pytest.raises(KernelInputError, match="float16, bfloat16 or float32"):
        attngen.quantize_fp8(torch.randn(1, 2, 3, 16).to(FP8))
    zeros8, descale = attngen.quantize_fp8(torch.zeros(1, 1, 2, 16))
    assert descale.item() > 0 and zeros8.float().abs().max().item() == 0.0


# -- attention()'s FP8 arguments -----------------------------------------------------------------


def quantized(batch=1, heads=4, kv_heads=2, n_q=40, n_k=56, d=64, outliers=False, generator=None):
    q, k, v = (torch.randn(batch, h, n, d, generator=generator, device=DEVICE)
               for h, n in ((heads, n_q), (kv_heads, n_k), (kv_heads, n_k)))
    if outliers:  # a few channels 20x larger than the rest, as activations of LLMs have
        for t in (q, k):
            t[..., :3] *= 20
    return (q, k, v), attngen.quantize_fp8(q, "head", kv_heads), attngen.quantize_fp8(k, "head"), \
        attngen.quantize_fp8(v, "head")


def dequant(x8, descale, heads):
    d = descale.expand(x8.shape[0], -1) if descale.dim() == 1 else descale
    return x8.double() * d.double().repeat_interleave(heads // d.shape[1], dim=1)[:, :, None, None]


def row_bound(qd, kd, vd, causal, scale):
    """The element-wise bound of the module docstring, from float64 weights of the dequantised inputs."""
    heads = qd.shape[1]
    kd, vd = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (kd, vd))
    s = qd @ kd.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~reference.causal_keep(s.shape[2], s.shape[3], Mask.CAUSAL_TOP_LEFT, s.device), -math.inf)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    l = p.sum(-1, keepdim=True)
    w = p / l
    o = w @ vd
    # (the last term: fp32's accumulation, far below the others)
    return E4M3_REL * (w @ vd.abs()) + E4M3_SUB * s.shape[-1] / l * vd.abs().amax(-2, keepdim=True) \
        + BF16_REL * o.abs() + 2.0 ** -20 * (w @ vd.abs()), o


@pytest.mark.parametrize("causal", [False, True])
def test_attention_on_fp8_inputs_within_e4m3s_bound(causal):
    (q, k, v), (q8, qd), (k8, kd), (v8, vd) = quantized()
    out = attngen.attention(q8, k8, v8, is_causal=causal, enable_gqa=True, q_descale=qd, k_descale=kd, v_descale=vd)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    qf, kf, vf = dequant(q8, qd, 4), dequant(k8, kd, 2), dequant(v8, vd, 2)
    bound, ref = row_bound(qf, kf, vf, causal, 64 ** -0.5)
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), (err - bound).max()
    # within 3x of PyTorch rounding P the same way, and an output 10% off (a descale lost) is not
    mask = Mask.CAUSAL_TOP_LEFT if causal else Mask.NONE
    low, _ = reference.attention(qf, kf, vf, mask, dtype=torch.float32, fp8_probs=True)
    low_err = (low.bfloat16().double() - ref).abs().max().item()
    assert err.max().item() <= 3 * low_err + 1.5e-2
    rel = lambda o: ((o.double() - ref).norm() / ref.norm()).item()
    assert rel(out) <= E4M3_REL + 2 * BF16_REL < rel(out * 1.1)


def test_per_tensor_descales_and_window_softcap_sinks_alibi():
    (q, k, v), *_ = quantized(heads=2, kv_heads=2)
    (q8, qd), (k8, kd), (v8, vd) = (attngen.quantize_fp8(t) for t in (q, k, v))
    qf, kf, vf = (dequant(x, d, 2) for x, d in ((q8, qd), (k8, kd), (v8, vd)))
    sinks = torch.randn(2, device=DEVICE)
    slopes = torch.tensor([0.05, 0.1], device=DEVICE)
    for options, variant in (
        (dict(window_size=(8, 0), softcap=15.0, sinks=sinks), sdpa_variant(True, (8, 0), 15.0, sinks=True)),
        (dict(alibi_slopes=slopes), replace(sdpa_variant(True, alibi=True), mask=Causal())),
    ):
        out = attngen.attention(q8, k8, v8, is_causal=True, q_descale=qd, k_descale=kd, v_descale=vd, **options)
        tensors = {"sinks": sinks, "alibi_slopes": slopes}
        ref, _ = reference.variant_attention(qf, kf, vf, variant, False, None, tensors)
        low, _ = reference.variant_attention(qf, kf, vf, variant, False, None, tensors, torch.float32, fp8_probs=True)
        err, low_err = (out.double() - ref).abs().max().item(), (low.bfloat16().double() - ref).abs().max().item()
        assert err <= 3 * low_err + 1.5e-2, (options.keys(), err, low_err)
        assert (out.double() - ref).norm() <= (E4M3_REL + 2 * BF16_REL) * ref.norm()


def test_fp8_arguments_are_checked_before_the_launch():
    _, (q8, qd), (k8, kd), (v8, vd) = quantized()
    call = lambda **kw: attngen.attention(q8, kw.pop("k", k8), v8, enable_gqa=True, **kw)
    with pytest.raises(KernelInputError, match="q_descale must be float32"):
        call(q_descale=qd.double())
    with pytest.raises(KernelInputError, match=r"k_descale must have shape \(1,\) or \(batch, kv_heads\) = \(1, 2\)"):
        call(k_descale=torch.ones(4, device=DEVICE))
    with pytest.raises(TypeError, match="v_descale must be a torch.Tensor"):
        call(v_descale=[1.0])
    with pytest.raises(KernelInputError, match="all be float8_e4m3fn"):
        call(k=k8.bfloat16())
    with pytest.raises(KernelInputError, match="q_descale is for float8_e4m3fn inputs"):
        attngen.attention(q8.bfloat16(), k8.bfloat16(), v8.bfloat16(), enable_gqa=True, q_descale=qd)


def test_fp8_has_no_backward():
    _, (q8, qd), (k8, kd), (v8, vd) = quantized()
    q8.requires_grad_()
    with pytest.raises(KernelInputError, match="forward-only: its backward stays 16-bit"):
        attngen.attention(q8, k8, v8, enable_gqa=True)
    kernel = attngen.load(f"{SPECS}/fp8_causal_d128.attn")
    with pytest.raises(KernelInputError, match="forward-only"):
        kernel.backward(*(torch.zeros(1, 1, 4, 128, dtype=FP8) for _ in range(3)), None, None, None)


def test_value_layout_gives_the_same_output():
    """attention() copies V to a keys-contiguous layout; a V already so laid out is read as it is."""
    _, (q8, qd), (k8, kd), (v8, vd) = quantized()
    a = attngen.attention(q8, k8, v8, enable_gqa=True, q_descale=qd, k_descale=kd, v_descale=vd)
    v_t = v8.transpose(-1, -2).contiguous().transpose(-1, -2)
    b = attngen.attention(q8, k8, v_t, enable_gqa=True, q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(a, b)


# -- the shipped spec, validated as `attngen check` does ----------------------------------------


def test_shipped_fp8_spec_validates_and_its_check_can_fail():
    kernel = attngen.load(f"{SPECS}/fp8_causal_d128.attn")
    for result in validate(kernel, [Case(1, 4, 2, 65, 130), Case(1, 2, 2, 70, 33)], device=DEVICE):
        assert result.ok, result
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q8, k8, v8 = (torch.randn(1, 2, 40, 128, generator=gen, device=DEVICE).to(FP8) for _ in range(3))
    tensors = {n: 0.5 + torch.rand(1, 2, generator=gen, device=DEVICE) for n in ("q_descale", "k_descale", "v_descale")}
    out, lse = kernel(q8, k8, v8, return_lse=True, **tensors)
    case = Case(1, 2, 2, 40, 40)
    assert compare(kernel.spec, case, out, lse, q8, k8, v8, tensors=tensors).ok
    wrong = dict(tensors, v_descale=tensors["v_descale"] * 1.1)
    assert not compare(kernel.spec, case, out, lse, q8, k8, v8, tensors=wrong).ok


@pytest.mark.parametrize("text", [
    "mask = causal & window(24)\n score = softcap(20)\n sinks = true\n head_dim = 64\n heads = 4\n kv_heads = 2",
    "mask = causal(bottom_right)\n score = alibi\n head_dim = 80",
])
def test_fp8_variant_specs_validate(text):
    kernel = attngen.load(f"kernel v {{\n direction = forward\n dtype = fp8_e4m3\n {text}\n}}\n")
    for result in validate(kernel, [Case(1, kernel.spec.heads or 2, kernel.spec.kv_heads or 2, 77, 130)], device=DEVICE):
        assert result.ok, result


# -- real sizes (GPU) -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("outliers", [False, True])
def test_gpu_fp8_real_sizes_against_float64_beside_bf16(causal, outliers):
    """d=128, N=4096, GQA 16/4: the FP8 kernel within e4m3's element-wise bound of float64 on its dequantised
    inputs, and within 3x a same-precision PyTorch computation of float64 on the unquantised ones (the bf16
    kernel's error printed beside it)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    (q, k, v), (q8, qd), (k8, kd), (v8, vd) = quantized(2, 16, 4, 4096, 4096, 128, outliers, gen)
    out = attngen.attention(q8, k8, v8, is_causal=causal, enable_gqa=True, q_descale=qd, k_descale=kd, v_descale=vd)
    qf, kf, vf = dequant(q8, qd, 16), dequant(k8, kd, 4), dequant(v8, vd, 4)
    for b in range(2):  # a batch at a time: float64 scores of 16 x 4096 x 4096 are 2 GiB
        bound, ref = row_bound(qf[b:b + 1], kf[b:b + 1], vf[b:b + 1], causal, 128 ** -0.5)
        assert ((out[b:b + 1].double() - ref).abs() <= bound).all()
    exact, _ = reference.attention(q[:1], k[:1].repeat_interleave(4, 1), v[:1].repeat_interleave(4, 1),
                                   Mask.CAUSAL_TOP_LEFT if causal else Mask.NONE)
    low, _ = reference.attention(qf[:1], kf[:1].repeat_interleave(4, 1), vf[:1].repeat_interleave(4, 1),
                                 Mask.CAUSAL_TOP_LEFT if causal else Mask.NONE, dtype=torch.float32,
                                 fp8_probs=True)
    err = (out[:1].double() - exact).abs().max().item()
    low_err = (low.bfloat16().double() - exact).abs().max().item()
    bf16 = attngen.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=causal, enable_gqa=True)
    bf16_err = (bf16[:1].double() - exact).abs().max().item()
    print(f"causal={causal} outliers={outliers}: fp8 {err:.3e}, PyTorch fp8-emulated {low_err:.3e}, bf16 {bf16_err:.3e}")
    assert err <= 3 * low_err + 1.5e-2


def test_the_tuner_times_v_keys_contiguous_and_validates_against_the_dequantised_inputs():
    from attngen.runtime.keys import Shape
    from attngen.tuning.tunables import ForwardTunable

    tunable = ForwardTunable(attngen.load(f"{SPECS}/fp8_causal_d128.attn"))
    inputs = tunable.tuning_inputs(Shape(1, 2, 2, 40, 40), DEVICE, torch.Generator(device=DEVICE).manual_seed(0))
    assert inputs["v"].stride(-2) == 1 and set(inputs["tensors"]) == {"q_descale", "k_descale", "v_descale"}
    out, lse = tunable.tuning_run(inputs, dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1), poison=True)
    assert out.dtype == torch.bfloat16 and tunable.tuning_check(inputs, (out, lse)).ok
    assert not tunable.tuning_check(inputs, (out * 1.1, lse)).ok


def test_fp8_attention_under_torch_compile_matches_eager():
    """The custom op's fake gives the bf16 output the kernel writes, so the graph compiles whole."""
    _, (q8, qd), (k8, kd), (v8, vd) = quantized(heads=2, kv_heads=2)
    fn = lambda *a: attngen.attention(a[0], a[1], a[2], is_causal=True, q_descale=a[3], k_descale=a[4], v_descale=a[5])
    eager = fn(q8, k8, v8, qd, kd, vd)
    compiled = torch.compile(fn, fullgraph=True)(q8, k8, v8, qd, kd, vd)
    assert compiled.dtype == torch.bfloat16 and torch.equal(compiled, eager)
    from attngen.runtime.ops import _forward_fake

    out, lse = _forward_fake("sdpa:fp8_e4m3:64:causal", q8.to("meta"), k8.to("meta"), v8.to("meta"), 0.125, [])
    assert out.dtype == torch.bfloat16 and out.shape == q8.shape and lse.dtype == torch.float32
