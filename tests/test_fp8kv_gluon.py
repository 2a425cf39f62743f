"""The Hopper Gluon decode kernel over an FP8 (e4m3) KV cache (templates/gluon_decode.py.j2 with `kv_gl_dtype`,
passes/warp_specialize_decode.py behind policy hopper.FP8_DECODE_GLUON).

On the CPU: which FP8-cache specs get the Gluon kernel with the switch on and off; that its generated source takes
the descales from the IR (K's factor in the scale, V's on the output) and widens the e4m3 tiles in registers; that
it compiles for sm_90 (Triton's compiler and ptxas, in a subprocess) without spilling, beside the 16-bit kernel. On a
Hopper GPU (`gpu`): the kernel against float64 of the dequantised cache at real sizes, with test_fp8kv.py's
tolerance (the widening is exact, so the 16-bit rule holds unloosened).

Each spec here has a name of its own: a module compiled with the switch on must not be one the API (switch off)
shares through the disk cache.
"""

import pytest
import torch

import attngen
from attngen.codegen import render
from attngen.lang.spec import parse
from attngen.passes import compile_program, warp_specialize_decode
from attngen.policy import hopper
from conftest import HAS_GPU
from probe import probe

HOPPER = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)
FP8 = torch.float8_e4m3fn
LAYOUTS = {"contiguous": "contiguous", "paged16": "paged(page_size = 16)"}


def _text(name, mask="causal(bottom_right)", layout="contiguous", kv_dtype="fp8_e4m3", head_dim=128, dtype="bf16"):
    return (f"kernel {name} {{\n    mask = {mask}\n    head_dim = {head_dim}\n    dtype = {dtype}\n"
            f"    kv_dtype = {kv_dtype}\n    split_kv = auto\n    kv_layout = {layout}\n}}\n")


@pytest.fixture
def fp8_gluon(monkeypatch):
    """The switch on, as the lead turns it on once the GPU test passes."""
    monkeypatch.setattr(hopper, "FP8_DECODE_GLUON", True)


def test_by_default_an_fp8_cache_keeps_the_triton_kernel(monkeypatch):
    monkeypatch.setattr(hopper, "FP8_DECODE_GLUON", False)
    spec = parse(_text("gfp8_off"))
    program = compile_program(spec)
    assert program.warp_specialized.decode is None and "attn_fwd_wsd" not in render(spec, program)
    assert "hopper.FP8_DECODE_GLUON" in warp_specialize_decode.fp8_refusal(program)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mask", ["causal(bottom_right)", "none"])
def test_switched_on_an_fp8_cache_gets_the_gluon_decode(fp8_gluon, mask, layout):
    spec = parse(_text(f"gfp8_on_{mask[:4]}_{layout}", mask, LAYOUTS[layout]))
    program = compile_program(spec)
    assert warp_specialize_decode.fp8_refusal(program) is None
    assert program.warp_specialized.decode == hopper.DECODE_FP8 == hopper.decode("fp8_e4m3")
    source = render(spec, program)
    compile(source, "gfp8.py", "exec")
    # the ring holds the cache's e4m3 bytes; the consumer widens both tiles to bf16 as wgmma's register A operand
    assert "k_smem = gl.allocate_shared_memory(gl.float8e4nv," in source
    assert "_WSD_LAYOUT = gl.NVMMASharedLayout.get_default_for(_WSD_BOX, gl.float8e4nv)" in source
    assert "k_tile = _gl_e4m3_to_bf16(k_smem.index(s).load(a_op))" in source
    assert "v_tile = _gl_e4m3_to_bf16(v_smem.index(s).permute((1, 0)).load(a_op))" in source
    # pass descale's math, from the IR: K's factor of (b, hkv) in the scale, V's on the output
    assert ("qk_scale = sm_scale * 1.4426950408889634 * gl.load(K_DESCALE + b.to(gl.int64) * stride_k_descale_0 "
            "+ hkv * stride_k_descale_1)") in source
    assert "gl.convert_layout(acc * v_descale / l_safe[None, :], out_t)" in source
    assert "k_descale, *k_descale.stride(), v_descale, *v_descale.stride()" in source  # the launcher passes them


def test_the_16bit_kernel_keeps_its_shape_and_an_fp8_variant_keeps_the_triton_kernel(fp8_gluon):
    spec = parse(_text("gfp8_bf16", kv_dtype="bf16").replace("    kv_dtype = bf16\n", ""))
    program = compile_program(spec)
    assert program.warp_specialized.decode == hopper.DECODE
    source = render(spec, program)
    assert "gl.float8e4nv" not in source and "gl.convert_layout(acc / l_safe[None, :], out_t)" in source
    window = compile_program(parse(_text("gfp8_window", mask="window(300)")))
    assert window.warp_specialized.decode is None
    assert "with a variant" in warp_specialize_decode.fp8_refusal(window)


def test_the_fp8_gluon_decode_compiles_for_sm90(fp8_gluon, tmp_path):
    """Compiled for sm_90 beside the 16-bit kernel (generated/decode_paged16_d128.py): the consumer warpgroup and
    the loader, wgmma for both products, the ring's copies, and no spills up to the most rows it takes."""
    assert hopper.DECODE_FP8.rows == 32
    jobs = []
    for name, mask, layout, rows in (("c_causal", "causal(bottom_right)", "contiguous", 8),
                                     ("p_causal", "causal(bottom_right)", "paged16", 8),
                                     ("p_none", "none", "paged16", 16), ("c_d64", "none", "contiguous", 32),
                                     ("c_fp16", "causal(bottom_right)", "contiguous", 8)):
        spec = parse(_text(f"gfp8_sm90_{name}", mask, LAYOUTS[layout], head_dim=64 if "d64" in name else 128,
                           dtype="fp16" if "fp16" in name else "bf16"))
        path = tmp_path / f"gfp8_sm90_{name}.py"
        path.write_text(render(spec, compile_program(spec)))
        jobs.append({"path": str(path), "gluon_ws": "decode", "rows": rows, "ptxas": True})
    bf16 = {"path": "generated/decode_paged16_d128.py", "gluon_ws": "decode", "rows": 8, "ptxas": True}
    results = probe(jobs + [bf16])
    for job, result in zip(jobs + [bf16], results):
        assert "error" not in result, (job, result)
        assert result["warps"] == 8 and result["wgmma"] > 0 and result["tma_loads"] >= 2, (job, result)
        assert result["spill_stores"] == 0 and result["spill_loads"] == 0, (job, result)
    # a block of 128 e4m3 keys is the 16-bit kernel's 64 keys' bytes: the same ring, twice the wgmma a block
    assert abs(results[1]["shared"] - results[-1]["shared"]) < 4096, results
    assert results[1]["wgmma"] == 2 * results[-1]["wgmma"], results


# -- on a Hopper GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon decode kernel is sm_90's")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gpu_fp8_gluon_decode_at_real_sizes(fp8_gluon, monkeypatch, layout, causal):
    """B = 16, 32/8 heads, d = 128, up to 8k keys (odd lengths), shuffled 16-token pages, per-(sequence, head)
    descales; the Gluon kernel runs (the Triton one would raise), at the rule's split count and at one split."""
    from test_fp8kv import _check, _dequantized, _descale

    mask = "causal(bottom_right)" if causal else "none"
    module = attngen.load(_text(f"gfp8_gpu_{layout}_{mask[:4]}", mask, LAYOUTS[layout])).module
    assert hasattr(module, "attn_fwd_wsd")

    def no_triton(*args, **kwargs):
        raise AssertionError("the Triton partial kernel ran: the Gluon kernel should have")

    monkeypatch.setattr(module, "launch_attn_fwd", no_triton)
    gen = torch.Generator().manual_seed(52)
    batch, heads, kv_heads, d, n, page = 16, 32, 8, 128, 8192, 16
    lens = torch.randint(n // 2, n + 1, (batch,), generator=gen, dtype=torch.int32)
    lens[0], lens[1] = n, 1  # a full cache and a single key
    lens = lens.cuda()
    q = torch.randn(batch, 1, heads, d, generator=gen).to(torch.bfloat16).cuda()
    k_descale, v_descale = _descale((batch, kv_heads), gen).cuda(), _descale((batch, kv_heads), gen).cuda()
    k = (torch.randn(batch, n, kv_heads, d, generator=gen) * 4).to(FP8).cuda()
    v = (torch.randn(batch, n, kv_heads, d, generator=gen) * 4).to(FP8).cuda()
    k64, v64 = _dequantized(k, k_descale, False), _dequantized(v, v_descale, False)
    if layout == "paged16":  # the same keys in shuffled pages, spare pages of NaN bytes in the pool
        pages = n // page
        order = torch.randperm(batch * pages + 7, generator=gen)[: batch * pages].cuda()
        pool_k = torch.full((batch * pages + 7, page, kv_heads, d), float("nan"), device="cuda").to(FP8)
        pool_v = pool_k.clone()
        pool_k[order] = k.view(batch * pages, page, kv_heads, d)
        pool_v[order] = v.view(batch * pages, page, kv_heads, d)
        table = order.view(batch, pages).to(torch.int32)
        caches = (pool_k, pool_v, lens, table)
    else:  # flash-attn's (B, N, H_KV, D) storage as the module's (B, H_KV, N, D)
        caches = (k.transpose(1, 2), v.transpose(1, 2), lens, None)
    for num_splits in (0, 1):
        out = torch.full((batch, heads, 1, d), float("nan"), dtype=torch.bfloat16, device="cuda")
        module.forward_kvcache(q.transpose(1, 2), *caches, out=out, num_splits=num_splits,
                               k_descale=k_descale, v_descale=v_descale)
        # (the reference on the contiguous dequantised cache: the same values the pages hold)
        _check(out.transpose(1, 2), q, k64, v64, lens, None, causal=causal)
