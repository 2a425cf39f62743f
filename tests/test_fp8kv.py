"""An FP8 (e4m3) KV cache with 16-bit queries: attention_with_kvcache's k_descale / v_descale, the
`kv_dtype = fp8_e4m3` spec key, and PagedKVCache(dtype=torch.float8_e4m3fn)'s quantising append.

Tolerances. The kernels widen e4m3 tiles to q's dtype in registers: e4m3's 3 mantissa bits and exponents
(-9 to 8) fit bf16's 7 bits and fp16's 10 bits and -24 to 15, so the widening is exact and the kernel's
arithmetic is the 16-bit kernel's. Its error is therefore measured against float64 on the DEQUANTISED cache
(fp8 value x descale) with the 16-bit rule, `err <= FUDGE * err(same-precision PyTorch) + ATOL`, not
loosened for FP8: an error from the FP8 path (a descale applied twice, a wrong head's factor) is far
larger. The quantisation is tested on its own: rounding to nearest gives |x/s - fp8| <= 2^-4 |x/s| for
normal values (3 mantissa bits: half a unit in the last place is 2^-4 of the leading bit), at most half
the subnormal step 2^-9 below 2^-6, and values past 448 saturate to +-448.
"""

import pytest
import torch

import attngen
from attngen import KernelInputError, PagedKVCache
from attngen.errors import SpecError
from attngen.lang.spec import DType, parse
from attngen.testing import reference
from attngen.testing.accuracy import ATOL, FUDGE
from conftest import DEVICE, spec_text

FP8 = torch.float8_e4m3fn
_DT = {torch.float16: DType.FP16, torch.bfloat16: DType.BF16}
E4M3_MAX = 448.0
HALF_ULP = 2.0 ** -4      # relative, normal e4m3 values
SUBNORMAL_HALF_STEP = 2.0 ** -10  # absolute, below e4m3's smallest normal 2^-6


def _fp8(shape, gen, spread=4.0):
    """A random e4m3 tensor (values from normal(0, spread), so that many exponents occur)."""
    return (torch.randn(*shape, generator=gen) * spread).to(FP8).to(DEVICE)


def _descale(shape, gen):
    return (torch.rand(*shape, generator=gen) * 0.9 + 0.1).to(DEVICE)


def _dequantized(cache, descale, paged: bool):
    """The cache's true values in float64: e4m3 x its (sequence, K/V head) descale; a page pool (pages, slots,
    kv_heads, d) takes a per-head (H_KV,) or per-tensor (1,) descale."""
    d = descale.double()
    if paged:
        return cache.double() * d.expand(cache.shape[2])[:, None]
    return cache.double() * d.expand(cache.shape[0], cache.shape[2])[:, None, :, None]


def _check(out, q, k64, v64, lens, table, q_e4m3=0, **variant):
    """The kernel's error against float64 on the dequantised cache within the 16-bit kernel's rule (`q_e4m3`: for a
    kernel that takes q's rows as that many e4m3 terms, the 16-bit computation takes them so too)."""
    ref, _ = reference.kvcache_attention(q.cpu(), k64.cpu(), v64.cpu(), lens.cpu(),
                                         None if table is None else table.cpu(), **variant)
    q_low = reference.e4m3_rows(q.cpu(), q_e4m3).to(q.dtype) if q_e4m3 else q.cpu()
    low, _ = reference.kvcache_attention(q_low, k64.cpu().to(q.dtype), v64.cpu().to(q.dtype), lens.cpu(),
                                         None if table is None else table.cpu(), dtype=q.dtype, **variant)
    assert out.dtype == q.dtype
    assert not torch.isnan(out).any(), "unwritten (poisoned) output elements"
    err = (out.cpu().double() - ref).abs().max().item()
    low_err = (low.double() - ref).abs().max().item()
    assert err <= FUDGE * low_err + ATOL[_DT[q.dtype]], (err, low_err)
    return err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_contiguous_fp8_cache_against_float64(dtype, num_splits):
    gen = torch.Generator().manual_seed(1)
    batch, heads, kv_heads, d, seq_max = 3, 4, 2, 64, 83
    lens = torch.tensor([83, 0, 37], dtype=torch.int32, device=DEVICE)  # a full, an empty, an odd length
    q = torch.randn(batch, 1, heads, d, generator=gen).to(dtype).to(DEVICE)
    k, v = _fp8((batch, seq_max, kv_heads, d), gen), _fp8((batch, seq_max, kv_heads, d), gen)
    k_descale, v_descale = _descale((batch, kv_heads), gen), _descale((batch, kv_heads), gen)
    out = torch.full_like(q, float("nan"))
    attngen.attention_with_kvcache(q, k, v, lens, out=out, num_splits=num_splits, k_descale=k_descale,
                                   v_descale=v_descale)
    assert (out[1] == 0).all(), "a sequence with no keys gives zeros"
    _check(out, q, _dequantized(k, k_descale, False), _dequantized(v, v_descale, False), lens, None)


def test_paged_fp8_cache_shuffled_pages_and_chunk():
    """Pages in random order with spare pages in the pool, a chunk of 3 new queries (causal, bottom-right),
    GQA 6/2, per-head descales."""
    gen = torch.Generator().manual_seed(2)
    batch, heads, kv_heads, d, page = 2, 6, 2, 32, 16
    lens = torch.tensor([45, 70], dtype=torch.int32, device=DEVICE)
    per_seq = 5
    num_pages = batch * per_seq + 3
    k, v = _fp8((num_pages, page, kv_heads, d), gen), _fp8((num_pages, page, kv_heads, d), gen)
    table = torch.randperm(num_pages, generator=gen)[: batch * per_seq].view(batch, per_seq).to(torch.int32).to(DEVICE)
    q = torch.randn(batch, 3, heads, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    k_descale, v_descale = _descale((kv_heads,), gen), _descale((kv_heads,), gen)
    out = torch.full_like(q, float("nan"))
    attngen.attention_with_kvcache(q, k, v, lens, table, out=out, num_splits=2, k_descale=k_descale,
                                   v_descale=v_descale)
    _check(out, q, _dequantized(k, k_descale, True), _dequantized(v, v_descale, True), lens, table)


@pytest.mark.parametrize("variant", [dict(window_size=(20, 0)), dict(softcap=5.0), dict(alibi=True),
                                     dict(sinks=True)], ids=["window", "softcap", "alibi", "sinks"])
def test_fp8_cache_with_the_decode_variants(variant):
    gen = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, d, seq_max = 2, 4, 2, 32, 50
    lens = torch.tensor([50, 29], dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, 1, heads, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    k, v = _fp8((batch, seq_max, kv_heads, d), gen), _fp8((batch, seq_max, kv_heads, d), gen)
    k_descale, v_descale = _descale((1,), gen), _descale((1,), gen)
    extra = dict(variant)
    if extra.pop("alibi", False):
        extra["alibi_slopes"] = torch.rand(heads, generator=gen).to(DEVICE)
    if extra.pop("sinks", False):
        extra["sinks"] = torch.randn(heads, generator=gen).to(DEVICE)
    out = attngen.attention_with_kvcache(q, k, v, lens, num_splits=2, k_descale=k_descale, v_descale=v_descale,
                                         **extra)
    _check(out, q, _dequantized(k, k_descale, False), _dequantized(v, v_descale, False), lens, None, **extra)


def test_descale_shapes_and_the_default_of_one():
    """(B, H_KV), (H_KV,) and (1,) descales of the same values give the same output; None means 1.0."""
    gen = torch.Generator().manual_seed(4)
    batch, heads, kv_heads, d = 2, 4, 2, 32
    q = torch.randn(batch, 1, heads, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    k, v = _fp8((batch, 40, kv_heads, d), gen), _fp8((batch, 40, kv_heads, d), gen)
    per_head = _descale((kv_heads,), gen)
    full = attngen.attention_with_kvcache(q, k, v, 40, k_descale=per_head.expand(batch, -1).contiguous(),
                                          v_descale=per_head.expand(batch, -1).contiguous())
    assert torch.equal(full, attngen.attention_with_kvcache(q, k, v, 40, k_descale=per_head, v_descale=per_head))
    one = torch.ones(1, device=DEVICE)
    assert torch.equal(attngen.attention_with_kvcache(q, k, v, 40),
                       attngen.attention_with_kvcache(q, k, v, 40, k_descale=one, v_descale=one))
    # and a factor really is applied: doubling v_descale doubles the output
    twice = attngen.attention_with_kvcache(q, k, v, 40, k_descale=per_head, v_descale=2 * per_head)
    torch.testing.assert_close(twice.float(), 2 * full.float(), rtol=2 ** -7, atol=0)


def test_fp8_arguments_are_refused_before_any_launch():
    batch, heads, kv_heads, d = 2, 4, 2, 32
    q = torch.randn(batch, 1, heads, d, device=DEVICE).to(torch.bfloat16)
    k = torch.zeros(batch, 16, kv_heads, d, device=DEVICE).to(FP8)
    v = k.clone()
    good = torch.ones(kv_heads, device=DEVICE)
    cases = [
        (dict(q=q.to(FP8)), KernelInputError, "FP8 queries"),
        (dict(q=q.float()), KernelInputError, "bfloat16 or float16 q"),
        (dict(v_cache=v.to(torch.bfloat16)), KernelInputError, "v_cache has dtype"),
        (dict(k_descale=torch.ones(3, device=DEVICE)), KernelInputError, "k_descale must have shape"),
        (dict(v_descale=torch.ones(batch, heads, device=DEVICE)), KernelInputError, "v_descale must have shape"),
        (dict(k_descale=good.double()), KernelInputError, "k_descale must be float32"),
        (dict(k_descale=0.5), TypeError, "k_descale must be a torch.Tensor"),
        (dict(k_cache=k.to(torch.bfloat16), v_cache=v.to(torch.bfloat16), k_descale=good), KernelInputError,
         "k_descale is for an FP8 cache"),
        (dict(v_cache=k[..., :16]), KernelInputError, "an FP8 latent cache is not supported"),
    ]
    for change, error, words in cases:
        args = dict(q=q, k_cache=k, v_cache=v, k_descale=good, v_descale=good)
        args.update(change)
        out = torch.full((batch, 1, heads, d), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        with pytest.raises(error, match=words):
            attngen.attention_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), 16,
                                           out=out if args.get("k_cache", k).dtype == FP8 else None, **args)
        assert torch.isnan(out).all(), "nothing was launched"


def test_debug_mode_checks_descale_values(monkeypatch):
    """ATTNGEN_CHECK_KVCACHE=1 reads the descales back: a negative one would break the running max (it multiplies
    the softmax scale, which the kernels take as positive)."""
    monkeypatch.setenv("ATTNGEN_CHECK_KVCACHE", "1")
    q = torch.randn(1, 1, 2, 32, device=DEVICE).to(torch.bfloat16)
    k = torch.zeros(1, 16, 2, 32, device=DEVICE).to(FP8)
    with pytest.raises(KernelInputError, match="k_descale must be positive and finite"):
        attngen.attention_with_kvcache(q, k, k, 16, k_descale=torch.tensor([1.0, -1.0], device=DEVICE))
    attngen.attention_with_kvcache(q, k, k, 16, k_descale=torch.tensor([1.0, 2.0], device=DEVICE))


# -- the paged pool ----------------------------------------------------------------------------------------


def _pool(scale_k, scale_v, pages=24, page=8, kv_heads=2, d=32):
    return PagedKVCache(pages, page, kv_heads, d, dtype=FP8, device=DEVICE, k_scale=scale_k, v_scale=scale_v)


def _slots(cache, seqs):
    """The pool's rows of each sequence, in order: (len(seqs), tokens, kv_heads, d)."""
    table = cache.block_table(seqs).long().cpu()
    n = cache.length(seqs[0])
    return lambda pages: pages.cpu()[table].flatten(1, 2)[:, :n]


def test_paged_append_quantises_to_nearest_and_saturates():
    gen = torch.Generator().manual_seed(5)
    k_scale = torch.tensor([0.5, 0.03])
    cache = _pool(k_scale, 0.25)
    seqs = [cache.new_sequence(), cache.new_sequence()]
    k = (torch.randn(2, 13, 2, 32, generator=gen) * 20).to(torch.bfloat16)
    k[0, 0, 1, :4] = torch.tensor([1e4, -1e4, 500.0 * 0.03, 0.0])  # past 448 x scale, and zero
    v = torch.randn(2, 13, 2, 32, generator=gen).to(torch.bfloat16)
    cache.append(seqs, k.to(DEVICE), v.to(DEVICE))
    rows = _slots(cache, seqs)
    for pages, src, scale in ((cache.k_pages, k, k_scale), (cache.v_pages, v, torch.full((2,), 0.25))):
        x = (src.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX)
        got = rows(pages).float()
        nearest = x.to(FP8).float()  # torch rounds to nearest even, as the GPU's cvt.rn does
        assert ((got - x).abs() <= (nearest - x).abs()).all(), "not rounded to nearest"
        assert (got.abs() <= E4M3_MAX).all()
    assert rows(cache.k_pages)[0, 0, 1, :4].float().tolist() == [448.0, -448.0, 448.0, 0.0]


def test_paged_quantisation_error_against_the_bf16_originals():
    """|dequantised - original| within half an e4m3 step: 2^-4 relative (normal), 2^-10 x scale (subnormal)."""
    gen = torch.Generator().manual_seed(6)
    scale = torch.tensor([0.02, 0.2])
    cache = _pool(scale, scale)
    seq = cache.new_sequence()
    k = (torch.randn(1, 40, 2, 32, generator=gen) * torch.tensor([1.0, 10.0])[:, None]).to(torch.bfloat16)
    k[0, :5] *= 1e-3  # some subnormal e4m3 values
    cache.append([seq], k.to(DEVICE), k.to(DEVICE))
    x = k.float()[0] / scale[:, None]
    got = _slots(cache, [seq])(cache.k_pages)[0].float()
    bound = torch.where(x.abs() >= 2.0 ** -6, HALF_ULP * x.abs(), torch.full_like(x, SUBNORMAL_HALF_STEP))
    assert ((got - x).abs() <= bound).all()
    dequantised = got * scale[:, None]
    assert ((dequantised - k.float()[0]).abs() <= bound * scale[:, None]).all()


def test_attention_through_an_fp8_pool_with_a_fork():
    gen = torch.Generator().manual_seed(7)
    cache = _pool(torch.tensor([0.05, 0.1]), 0.02, pages=20, page=8)
    a = cache.new_sequence()
    cache.append([a], (torch.randn(1, 19, 2, 32, generator=gen) * 3).to(torch.bfloat16).to(DEVICE),
                 (torch.randn(1, 19, 2, 32, generator=gen)).to(torch.bfloat16).to(DEVICE))
    b = cache.fork(a)  # shares a's pages; its last, partly filled one is copied on append
    cache.append([a, b], (torch.randn(2, 6, 2, 32, generator=gen)).to(torch.bfloat16).to(DEVICE),
                 (torch.randn(2, 6, 2, 32, generator=gen)).to(torch.bfloat16).to(DEVICE))
    seqs = [a, b]
    table, lens = cache.block_table(seqs), cache.seqlens(seqs)
    q = torch.randn(2, 1, 4, 32, generator=gen).to(torch.bfloat16).to(DEVICE)
    out = attngen.attention_with_kvcache(q, cache.k_pages, cache.v_pages, lens, table, k_descale=cache.k_scale,
                                         v_descale=cache.v_scale)
    _check(out, q, _dequantized(cache.k_pages, cache.k_scale, True), _dequantized(cache.v_pages, cache.v_scale, True),
           lens, table)


def test_paged_fp8_scales_are_checked():
    with pytest.raises(KernelInputError, match="k_scale must be a float32 tensor"):
        _pool(torch.ones(3), 1.0)
    with pytest.raises(KernelInputError, match="v_scale must be a positive finite number"):
        _pool(1.0, 0.0)
    with pytest.raises(KernelInputError, match="for an FP8 pool"):
        PagedKVCache(4, 8, 2, 32, dtype=torch.bfloat16, device=DEVICE, k_scale=1.0)
    with pytest.raises(KernelInputError, match="an FP8 latent pool"):
        PagedKVCache(4, 8, 1, 32, dtype=FP8, device=DEVICE, head_dim_v=16)
    cache = _pool(None, None)
    assert cache.k_scale.tolist() == [1.0, 1.0]  # vLLM's default
    seq = cache.new_sequence()
    with pytest.raises(KernelInputError, match="k and v must have one dtype"):
        cache.append([seq], torch.zeros(1, 2, 2, 32, device=DEVICE), torch.zeros(1, 2, 2, 32, device=DEVICE).half())


# -- the spec key ------------------------------------------------------------------------------------------


def test_kv_dtype_spec_key():
    spec = parse(spec_text(dtype="bf16", mask="causal(bottom_right)", head_dim=128, kv_dtype="fp8_e4m3",
                           split_kv="auto"))
    assert spec.fp8_cache and "kv_dtype = fp8_e4m3" in spec.canonical()
    same = parse(spec_text(dtype="bf16", head_dim=128, kv_dtype="bf16", split_kv="auto"))
    assert same.kv_dtype is None and "kv_dtype" not in same.canonical()  # the default: the plain spec's hash
    for extra, words in ((dict(kv_dtype="fp8_e4m3"), "is for decoding"),
                         (dict(kv_dtype="fp16", split_kv="auto"), "differs from dtype"),
                         (dict(kv_dtype="float8_e4m3fn", split_kv="auto"), "spelled 'fp8_e4m3'")):
        with pytest.raises(SpecError, match=words):
            parse(spec_text(dtype="bf16", head_dim=64, **extra))
    with pytest.raises(SpecError, match="kv_dtype = fp8_e4m3 takes 16-bit queries"):
        parse(spec_text(dtype="fp32", head_dim=64, kv_dtype="fp8_e4m3", split_kv="auto"))
    # FP8 queries are the FP8 prefill's (dtype = fp8_e4m3), which reads no KV cache; kv_dtype then adds nothing
    with pytest.raises(SpecError, match="it reads no KV cache"):
        parse(spec_text(dtype="fp8_e4m3", head_dim=64, kv_dtype="fp8_e4m3", split_kv="auto"))
    prefill = parse(spec_text(dtype="fp8_e4m3", head_dim=64, kv_dtype="fp8_e4m3"))
    assert prefill.kv_dtype is None and prefill.runtime_tensors() == ("q_descale", "k_descale", "v_descale")
    assert spec.runtime_tensors() == ("k_descale", "v_descale")
    with pytest.raises(SpecError, match="an FP8 latent cache"):
        parse(spec_text(dtype="bf16", head_dim=576, v="k[:512]", kv_dtype="fp8_e4m3", split_kv="auto"))


def test_explain_says_the_fp8_cache_takes_the_gluon_decode(capsys, monkeypatch):
    from attngen.cli import main
    from attngen.policy import hopper

    assert main(["explain", "specs/decode_fp8kv_d128.attn"]) == 0
    printed = capsys.readouterr().out
    shape = hopper.decode("fp8_e4m3", 128)  # (the policy's shape: two warpgroups at d=128)
    assert f"gluon decode: {shape.block_n}-key blocks, {shape.stages} stages" in printed
    assert "no Hopper Gluon kernel" not in printed
    monkeypatch.setattr(hopper, "FP8_DECODE_GLUON", False)
    assert main(["explain", "specs/decode_fp8kv_d128.attn"]) == 0
    assert "warp-specialize-decode: no Hopper Gluon kernel (kv_dtype = fp8_e4m3" in capsys.readouterr().out
    # pass descale applies the cache's factors, as it does an FP8 spec's; q and P stay 16-bit
    summary = printed.split("=== fp8: where values are quantised and descaled (pass descale) ===")[1]
    assert "e4m3 inputs: K (fp8_e4m3), V (fp8_e4m3)" in summary and "load K_DESCALE[b, h_kv]" in summary
    assert "(acc * v_descale) / l_safe" in summary and "widened to bf16" in summary and "Q_DESCALE" not in summary


def _kernel_rounding(x, terms):
    """The Gluon kernel's q_e4m3 as it is written there (templates/gluon_decode.py.j2), emulated on the CPU: the
    factor's exponent from the bits of the row's maximum, the scaling by its reciprocal's bits."""
    xf = x.float()
    bits = xf.abs().amax(-1).view(torch.int32)
    f_exp = torch.clamp((bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).int(), min=1)
    factor, inverse = (f_exp << 23).view(torch.float32), ((254 - f_exp) << 23).view(torch.float32)
    scaled = xf * inverse[..., None]
    hi = scaled.to(FP8).float()
    total = hi.double() + ((scaled - hi).to(FP8).double() if terms == 2 else 0.0)
    return total * factor[..., None].double()


@pytest.mark.parametrize("terms", [1, 2])
def test_e4m3_rows_is_the_kernels_rounding_of_q(terms):
    """reference.e4m3_rows (what the checks hold the q_e4m3 kernel to) equals the kernel's bit arithmetic on rows of
    every scale (zero, tiny, 448 exactly, a significand just past 1.75); each row's factor is a power of two that puts
    its maximum within e4m3's 448; one term moves an element by up to 2^-4 of the row's largest, two by far less."""
    gen = torch.Generator().manual_seed(54)
    x = torch.randn(300, 128, generator=gen) * torch.exp(4 * torch.randn(300, 1, generator=gen))
    x[0], x[1, 5], x[2], x[3, 0], x[4, 0], x[5, 0] = 0.0, 448.0, 1e-30, 1.75, 1.7578125, -3.5
    x = x.to(torch.bfloat16)
    got = reference.e4m3_rows(x, terms)
    assert torch.equal(got, _kernel_rounding(x, terms))
    assert (got[0] == 0).all() and got[1, 5] == 448.0
    xd = x.double()
    moved = ((got - xd).abs() / xd.abs().amax(-1, keepdim=True).clamp(min=1e-300))[6:]
    if terms == 1:
        assert 2.0 ** -7 < moved.max() <= 2.0 ** -4
    else:  # (a bf16 value's 8 significant bits are two e4m3 terms' 4 + 4, but for what falls below e4m3's range)
        assert moved.max() <= 2.0 ** -12


@pytest.mark.parametrize("terms", [1, 2])
def test_the_q_e4m3_bound_is_the_same_precision_computation_rounding_q(terms):
    """accuracy.compare's q_e4m3: an output computed from q as e4m3 terms (in float64, then bf16) passes with that
    q_e4m3; one term's output fails the exact-q bound (a few percent off: the rounding of q is shared by every key's
    score and does not average out), two terms' passes it too; an output further off fails either."""
    from attngen.testing.accuracy import Case, compare

    spec = parse(spec_text("q8cmp", 64, "bf16", "none", direction="forward"))
    gen = torch.Generator().manual_seed(55)
    q, k, v = (torch.randn(1, 4, n, 64, generator=gen).to(torch.bfloat16) for n in (9, 300, 300))
    case = Case(1, 4, 4, 9, 300)
    out, lse = reference.attention(reference.e4m3_rows(q, terms), k.double(), v.double(), spec.mask, 0.125)
    out = out.to(torch.bfloat16)
    assert compare(spec, case, out, lse, q, k, v, q_e4m3=terms).ok
    assert compare(spec, case, out, lse, q, k, v).ok == (terms == 2)
    assert not compare(spec, case, out * (1.2 if terms == 1 else 1.05), lse, q, k, v, q_e4m3=terms).ok


# -- real sizes on a GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_fp8_decode_at_real_sizes(paged):
    gen = torch.Generator().manual_seed(8)
    batch, heads, kv_heads, d, n, page = 16, 32, 8, 128, 8192, 16
    lens = torch.randint(n // 2, n + 1, (batch,), generator=gen, dtype=torch.int32).cuda()
    q = torch.randn(batch, 1, heads, d, generator=gen).to(torch.bfloat16).cuda()
    k_descale, v_descale = _descale((batch, kv_heads), gen).cuda(), _descale((batch, kv_heads), gen).cuda()
    k = (torch.randn(batch, n, kv_heads, d, generator=gen) * 4).to(FP8).cuda()
    v = (torch.randn(batch, n, kv_heads, d, generator=gen) * 4).to(FP8).cuda()
    k64, v64 = _dequantized(k, k_descale, False), _dequantized(v, v_descale, False)
    table = None
    if paged:  # the same keys in shuffled pages
        pages = n // page
        order = torch.randperm(batch * pages, generator=gen).cuda()
        table = order.view(batch, pages).to(torch.int32)
        pool_k = torch.empty(batch * pages, page, kv_heads, d, dtype=FP8, device="cuda")
        pool_v = torch.empty_like(pool_k)
        pool_k[order] = k.view(batch * pages, page, kv_heads, d)
        pool_v[order] = v.view(batch * pages, page, kv_heads, d)
        k, v = pool_k, pool_v
    out = torch.full_like(q, float("nan"))
    attngen.attention_with_kvcache(q, k, v, lens, table, out=out, k_descale=k_descale, v_descale=v_descale)
    # (the reference on the contiguous dequantised cache: the same values the pages hold; on Hopper the Gluon kernel
    # runs these, and takes q's rows as the policy's e4m3 terms)
    from attngen.policy import hopper

    hopper_gluon = torch.cuda.get_device_capability() == (9, 0) and hopper.FP8_DECODE_GLUON
    _check(out, q, k64, v64, lens, None, q_e4m3=hopper.FP8_DECODE_Q8 if hopper_gluon else 0)


def test_paged_fp8_kernel_compiles_for_sm90():
    """The interpreter accepts code the real compiler rejects: compile the paged FP8 decode kernel for Hopper (the
    contiguous one is a shipped spec's, compiled by test_golden)."""
    from probe import probe

    from attngen.lang.builtin import kvcache_spec

    module = attngen.load(kvcache_spec("bf16", 128, True, 16, kv_dtype="fp8_e4m3")).module
    config = dict(module.DEFAULT_CONFIG)
    warps, stages = config.pop("num_warps"), config.pop("num_stages")
    (result,) = probe([dict(path=module.__file__, kernel="attn_fwd", num_warps=warps, num_stages=stages,
                            constexprs=dict(HEAD_DIM=128, HEAD_DIM_PADDED=128, **config),
                            ptr_dtypes={"K": "*fp8e4nv", "V": "*fp8e4nv", "K_DESCALE": "*fp32", "V_DESCALE": "*fp32",
                                        "O_PART": "*fp32", "LSE_PART": "*fp32", "SEQLENS": "*i32",
                                        "BLOCK_TABLE": "*i32"})])
    assert "error" not in result, result


@pytest.mark.gpu
def test_gpu_replayed_fp8_calls_read_their_own_descales(monkeypatch):
    """From a signature's third call on its launches are replayed (attngen/runtime/replay.py): each call's descales
    (new tensors, new values) must reach the kernel as its caches do; the unplanned path gives the same bits."""
    from conftest import empty_plans

    gen = torch.Generator().manual_seed(9)
    batch, heads, kv_heads, d, n = 4, 32, 8, 128, 1024
    q = torch.randn(batch, 1, heads, d, generator=gen).to(torch.bfloat16).cuda()
    k, v = _fp8((batch, n, kv_heads, d), gen).cuda(), _fp8((batch, n, kv_heads, d), gen).cuda()
    scales = [(_descale((batch, kv_heads), gen).cuda(), _descale((batch, kv_heads), gen).cuda()) for _ in range(4)]
    got = [attngen.attention_with_kvcache(q, k, v, n, k_descale=kd, v_descale=vd) for kd, vd in scales]
    with monkeypatch.context() as m:
        empty_plans(m)
        want = [attngen.attention_with_kvcache(q, k, v, n, k_descale=kd, v_descale=vd) for kd, vd in scales]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(got[2], got[3])
