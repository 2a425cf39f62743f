"""The Hopper Gluon split-KV decode kernel with issue 48's variants (passes/warp_specialize_decode.py,
codegen/hooks.py, templates/gluon_decode.py.j2): windows, chunks, softcap, ALiBi and sinks over a contiguous or
paged cache.

On the CPU: which decoding variants get the Gluon kernel and which keep the Triton one; the hooks' code for the
packed rows (the query of column n is n // GROUP, its head hkv * GROUP + n % GROUP); that each split's key blocks in
the generated kernel (its `_wsd_key_blocks`, run as Python) are exactly those the Triton partial kernel's loops
visit, and its unmasked ones exactly the Triton kernel's unmasked ones, for many sizes, groups and split counts;
that the variant kernels compile for sm_90 (Triton's compiler and ptxas, in a subprocess). On a Hopper GPU (`gpu`):
forward_kvcache and attention_with_kvcache against reference.kvcache_attention in float64, outputs poisoned first.
"""

import pytest
import torch

import attngen
from attngen import ir
from attngen.codegen import render
from attngen.codegen.hooks import score_hooks
from attngen.ir import sym
from attngen.lang.builtin import kvcache_spec
from attngen.lang.spec import parse
from attngen.passes import compile_program
from attngen.policy import hopper
from attngen.testing import reference
from attngen.testing.accuracy import ATOL, FUDGE, spec_variant
from attngen.lang.spec import DType
from conftest import HAS_GPU, empty_plans, spec_text
from probe import probe
from test_gluon_variants import generated_function, triton_blocks



HOPPER = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)

# name: the spec's variant lines; each gets the Gluon decode kernel
VARIANTS = {
    "window": "mask = window(300)",
    "window_lr": "mask = window(200, 70)",
    "chunked": "mask = causal & chunked(192)",
    "softcap": "mask = causal(bottom_right)\n    score = softcap(30)",
    "alibi": "mask = causal(bottom_right)\n    score = alibi",
    "sinks": "mask = none\n    sinks = true",
    "sinks_window": "mask = window(300)\n    sinks = true",
    "alibi_window_sinks": "mask = window(300)\n    score = alibi\n    sinks = true",
}


def _text(name, variant, layout="contiguous", head_dim=128, dtype="bf16", split_kv="auto"):
    return (f"kernel {name} {{\n    {VARIANTS[variant]}\n    head_dim = {head_dim}\n    dtype = {dtype}\n"
            f"    split_kv = {split_kv}\n    kv_layout = {layout}\n}}\n")


def _program(text):
    spec = parse(text)
    return spec, compile_program(spec)


def _hooks(program):
    return score_hooks(program.kernel("attn_fwd"), ("qk_scale", "n_k", "split"))


@pytest.mark.parametrize("layout", ["contiguous", "paged(page_size = 64)"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_decoding_variants_get_the_gluon_decode(variant, layout):
    spec, program = _program(_text(f"gd_{variant}", variant, layout))
    assert program.warp_specialized.decode == hopper.decode()
    source = render(spec, program)
    compile(source, f"gd_{variant}.py", "exec")
    assert "def _wsd_key_blocks(" in source and "def attn_fwd_wsd(" in source
    assert ("sink = (gl.where((split == 0)" in source) is ("sinks" in variant)  # split 0's partial only
    # ALiBi's slope per column: the packed row's own query head
    assert ("alibi_slopes = (gl.load(ALIBI_SLOPES + (b) * stride_alibi_slopes_0 + (heads) * stride_alibi_slopes_1)"
            in source) is ("alibi" in variant)


@pytest.mark.parametrize("mask, extra", [
    ("window(4) | prefix(6)", {}),  # a gap between the two: an EXPR predicate
    ("none", {"score": "s + bias[h, q - k]"}),  # a declared tensor's read that varies within a tile
    ("causal(top_left) & window(8)", {"split_kv": "auto", "kv_layout": "paged(page_size = 8)"}),  # pages too small
])
def test_decoding_variants_the_gluon_decode_cannot_take_keep_the_triton_kernel(mask, extra):
    text = spec_text("gd_refused", 128, "bf16", mask, **{"split_kv": "auto", **extra})
    if "bias" in extra.get("score", ""):
        text = text.replace("}", "    tensor bias[H, 64]: fp32\n}")
    spec, program = _program(text)
    assert spec.variant and program.attr("kvcache") and program.warp_specialized.decode is None
    assert "attn_fwd_wsd" not in render(spec, program)


def test_plain_decoding_keeps_its_gluon_decode():
    spec, program = _program(spec_text("gd_plain", 128, "bf16", "causal(bottom_right)", split_kv="auto"))
    source = render(spec, program)
    assert program.warp_specialized.decode == hopper.decode()
    assert "_wsd_key_blocks" not in source and "first_limit = n_k - N_Q + 1" in source


def test_the_hooks_spell_the_packed_rows_math():
    hooks = _hooks(_program(_text("gd_hooks", "alibi_window_sinks"))[1])
    keep = hooks.keep("keys", None, 0, query="q_cols")
    # the window's lower bound and the diagonal, bottom-right (n_k - N_Q), over keys down and columns across
    assert "-299 + q_cols[None, :] + n_k - keys[:, None] - N_Q <= 0" in keep
    assert "(keys[:, None] <= q_cols[None, :] + (n_k - N_Q))" in keep and "(keys < n_k)[:, None]" in keep
    scaled = hooks.scaled("sc", "q_cols", "keys", 0)
    # (positions as float32 vectors, one conversion per vector; the mask above keeps them integers)
    assert "(sc * qk_scale)" in scaled and ("alibi_slopes*gl.abs(keys.to(gl.float32)[:, None] + N_Q - "
                                            "q_cols.to(gl.float32)[None, :] - n_k)") in scaled
    (name, code), = hooks.reads(h="heads")
    assert name == "alibi_slopes" and "(heads) * stride_alibi_slopes_1" in code
    assert hooks.sink("LOAD") == '(gl.where((split == 0), ((LOAD) * 1.4426950408889634), float("-inf")))'
    assert hooks.tensor_params == ", ALIBI_SLOPES, stride_alibi_slopes_0, stride_alibi_slopes_1, SINKS, stride_sinks_0"
    keys = hooks.split_keys("NQ")
    assert list(keys) == ["keys_per_split", "split_start", "split_stop", "lo", "full_lo", "full_hi", "hi"]
    assert "start_m" not in " ".join(keys.values()) and "BLOCK_M" not in " ".join(keys.values())
    assert keys["split_stop"] == "gl.minimum(n_k, keys_per_split + split_start)"
    softcap = _hooks(_program(_text("gd_softcap", "softcap"))[1])
    assert softcap.modded and "_gl_tanh(" in softcap.scaled("sc", "q_cols", "keys", 0) and not softcap.sinks


def _slice_values(kernel, values):
    """`values` with the split's slice (keys_per_split, split_start, split_stop) the kernel defines, evaluated."""
    values = dict(values)
    for st in ir.walk_stmts(kernel.body):
        if isinstance(st, ir.Assign) and st.target.name in ("keys_per_split", "split_start", "split_stop"):
            values[getattr(sym, st.target.name)] = sym.evaluate(st.value.expr, values)
    return values


@pytest.mark.parametrize("variant", ["window", "window_lr", "chunked", "softcap"])
def test_each_split_visits_exactly_the_triton_kernels_key_blocks(variant):
    spec, program = _program(_text(f"gd_kb_{variant}", variant))
    key_blocks = generated_function(render(spec, program), "_wsd_key_blocks")
    kernel = program.kernel("attn_fwd")
    block_n = hopper.decode().block_n
    seen = set()
    for group, n_q in ((1, 1), (4, 1), (8, 1), (4, 3), (8, 2), (2, 16)):
        nq = max(8, 1 << (group * n_q - 1).bit_length())  # the launcher's _wsd_columns
        for n_k in (0, 1, 63, 64, 299, 301, 1000, 4097):
            for splits in (1, 3, 16):
                for split in range(splits):
                    j0, jf0, jf1, j1 = key_blocks(split, n_k, n_q, group, splits, nq, block_n)
                    values = _slice_values(kernel, {sym.start_m: 0, sym.BLOCK_M: nq, sym.BLOCK_N: block_n,
                                                    sym.n_k: n_k, sym.N_Q: n_q, sym.GROUP: group,
                                                    sym.NUM_SPLITS: splits, sym.split: split})
                    masked, full = triton_blocks(kernel, values, block_n)
                    where = (variant, group, n_q, n_k, splits, split)
                    assert j0 <= jf0 <= jf1 <= j1, where
                    assert set(range(jf0, jf1)) == full, where
                    assert set(range(j0, j1)) - full == masked, where
                    seen.add((bool(masked), bool(full)))
    assert (True, True) in seen and (False, False) in seen  # masked and full blocks, and splits with no key


def test_the_variant_decode_kernels_compile_for_sm90():
    cases = [("window", "contiguous", 128, "bf16", 8), ("softcap", "paged(page_size = 64)", 128, "bf16", 16),
             ("alibi", "contiguous", 128, "fp16", 32), ("sinks_window", "paged(page_size = 64)", 64, "fp16", 8),
             ("alibi_window_sinks", "paged(page_size = 16)", 128, "bf16", 8)]
    jobs = []
    for variant, layout, d, dtype, rows in cases:
        kernel = attngen.load(_text(f"gd_sm90_{variant}_{d}_{layout[:5]}", variant, layout, d, dtype))
        jobs.append({"path": str(kernel.path), "gluon_ws": "decode", "rows": rows})
    for job, result in zip(jobs, probe(jobs)):
        assert "error" not in result, (job, result)
        # a consumer warpgroup and the loader, padded to a warpgroup; the ring's K and V copies
        assert result["warps"] == 8 and result["wgmma"] > 0 and result["tma_loads"] >= 2, (job, result)


# -- on a Hopper GPU -------------------------------------------------------------------------------------------

def _check(out, lse, ref, ref_lse, atol):
    """Same finite / infinite log-sum-exps, both within atol; no poisoned element left."""
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten (poisoned) elements"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    assert (out.double().cpu() - ref).abs().max().item() <= atol
    if fin.any():
        assert (lse.double().cpu() - ref_lse)[fin].abs().max().item() <= atol


# flash-attn's arguments for each variant (attention_with_kvcache), and the spec kvcache_spec writes for them
API_CASES = {
    "window": dict(window_size=(300, 0)),
    "softcap": dict(softcap=30.0),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "sinks_window": dict(sinks=True, window_size=(300, 0)),
}


def _api_args(case, heads, gen):
    args = dict(API_CASES[case])
    if args.pop("alibi", False):
        args["alibi_slopes"] = torch.rand(heads, generator=gen, device=gen.device) * 0.1
    if args.pop("sinks", False):
        args["sinks"] = torch.randn(heads, generator=gen, device=gen.device) + 1.5
    return args


def test_the_api_cases_get_the_gluon_decode():
    for case, args in API_CASES.items():
        for page in (None, 64):
            spec = kvcache_spec("bf16", 128, True, page, args.get("window_size", (-1, -1)), args.get("softcap", 0.0),
                                args.get("alibi", False), args.get("sinks", False))
            assert compile_program(spec).warp_specialized.decode == hopper.decode(), (case, page)


def _cache(batch, capacity, kv_heads, d, dtype, page, lengths, gen):
    """k, v in flash-attn's layout (contiguous (B, N, H_KV, D), or pools of `page`-token pages and a shuffled
    block table), every slot past a sequence's length NaN."""
    k, v = (torch.randn(batch, capacity, kv_heads, d, generator=gen, device="cuda").to(dtype) for _ in range(2))
    for b, n in enumerate(lengths):
        k[b, n:] = float("nan")
        v[b, n:] = float("nan")
    if page is None:
        return k, v, None
    per = capacity // page
    order = torch.randperm(batch * per, generator=gen, device="cuda")
    pools = [torch.empty(batch * per, page, kv_heads, d, dtype=dtype, device="cuda") for _ in range(2)]
    for pool, x in zip(pools, (k, v)):
        pool[order] = x.reshape(batch * per, page, kv_heads, d)
    return pools[0], pools[1], order.view(batch, per).to(torch.int32)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon decode runs on sm_90 only")
@pytest.mark.parametrize("page", [None, 64])
@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (32, 4)])  # GQA 4:1 and 8:1
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("case", sorted(API_CASES))
def test_attention_with_kvcache_variants_on_the_gluon_decode(case, num_splits, heads, kv_heads, page, monkeypatch):
    empty_plans(monkeypatch)  # every call launches (no replay of an earlier call's launches)
    gen = torch.Generator("cuda").manual_seed(48 + num_splits + heads // kv_heads)
    lengths = [1, 299, 300, 1000, 2049, 64]
    batch, capacity, d, dtype = len(lengths), 2112, 128, torch.bfloat16
    k, v, table = _cache(batch, capacity, kv_heads, d, dtype, page, lengths, gen)
    q = torch.randn(batch, 1, heads, d, generator=gen, device="cuda").to(dtype)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    args = _api_args(case, heads, gen)
    spec = kvcache_spec("bf16", d, True, page, args.get("window_size", (-1, -1)), args.get("softcap", 0.0),
                        "alibi_slopes" in args, "sinks" in args)
    module = attngen.load(spec).module
    called = []
    launch = module.launch_attn_fwd_wsd
    monkeypatch.setattr(module, "launch_attn_fwd_wsd", lambda *a: (called.append(1), launch(*a)))
    out = torch.full_like(q, float("nan"))
    out, lse = attngen.attention_with_kvcache(q, k, v, seqlens, table, causal=True, return_softmax_lse=True,
                                              out=out, num_splits=num_splits, **args)
    assert called, "the Gluon decode kernel did not run"
    cpu = {name: t.cpu() if isinstance(t, torch.Tensor) else t for name, t in args.items()}
    table_cpu = None if table is None else table.cpu()
    ref, ref_lse = reference.kvcache_attention(q.cpu(), k.cpu(), v.cpu(), seqlens.cpu(), table_cpu, True, **cpu)
    low, _ = reference.kvcache_attention(q.cpu(), k.cpu(), v.cpu(), seqlens.cpu(), table_cpu, True,
                                         dtype=torch.float32, **cpu)
    _check(out, lse, ref, ref_lse, FUDGE * (low - ref).abs().max().item() + ATOL[DType.BF16])


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon decode runs on sm_90 only")
@pytest.mark.parametrize("layout", ["contiguous", "paged(page_size = 64)"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_forward_kvcache_variants_on_the_gluon_decode(variant, num_splits, layout):
    """The module's forward_kvcache over (B, H_KV, N, D) views of flash-attn's layout, 8:1 GQA, two new tokens."""
    spec = parse(_text(f"gd_gpu_{variant}", variant, layout, 128, "fp16"))
    module = attngen.load(spec).module
    gen = torch.Generator("cuda").manual_seed(7 + num_splits)
    lengths = [2, 333, 1024, 1500]
    batch, capacity, heads, kv_heads, n_q, d = len(lengths), 1536, 16, 2, 2, 128
    page = 64 if layout.startswith("paged") else None
    k, v, table = _cache(batch, capacity, kv_heads, d, torch.float16, page, lengths, gen)
    q = torch.randn(batch, heads, n_q, d, generator=gen, device="cuda").to(torch.float16)
    tensors = {}
    if "alibi" in variant:
        tensors["alibi_slopes"] = (torch.rand(batch, heads, generator=gen, device="cuda") * 0.1)
    if "sinks" in variant:
        tensors["sinks"] = torch.randn(heads, generator=gen, device="cuda") + 1.5
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, heads, n_q), float("nan"), device="cuda")
    called = []
    launch = module.launch_attn_fwd_wsd
    module.launch_attn_fwd_wsd = lambda *a: (called.append(1), launch(*a))
    try:
        if page:
            module.forward_kvcache(q, k, v, seqlens, table, None, out, lse, num_splits=num_splits, **tensors)
        else:
            module.forward_kvcache(q, k.transpose(1, 2), v.transpose(1, 2), seqlens, None, None, out, lse,
                                   num_splits=num_splits, **tensors)
    finally:
        module.launch_attn_fwd_wsd = launch
    assert called, "the Gluon decode kernel did not run"
    refs = {torch.float64: [], torch.float16: []}
    for b, n in enumerate(lengths):
        if page:
            keys = [reference.gather_cache(x, n, table[b]).transpose(0, 1)[None].cpu() for x in (k, v)]
        else:
            keys = [x[b : b + 1, :n].transpose(1, 2).cpu() for x in (k, v)]
        per_seq = {name: (t[b : b + 1] if name == "alibi_slopes" else t).cpu() for name, t in tensors.items()}
        for dtype, found in refs.items():  # float64, and the same precision's error for the tolerance
            found.append(reference.variant_attention(q[b : b + 1].cpu(), *keys, spec_variant(spec),
                                                     bottom_right=True, tensors=per_seq, dtype=dtype))
    (ref, ref_lse), (low, _) = ((torch.cat(x) for x in zip(*found)) for found in refs.values())
    _check(out, lse, ref, ref_lse, FUDGE * (low.double() - ref).abs().max().item() + ATOL[DType.FP16])
