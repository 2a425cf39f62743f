"""MLA decode (`v = k[:N]`: V is the first N columns of K, DeepSeek's absorbed latent cache): the spec key and its
errors at FILE:LINE:COL, the latent-kv pass (one read of each key tile for both products, no V tensor), the
kernels against float64 with outputs poisoned (small test-only widths through the same code path, and one
576/512 case), `attention_with_kvcache` with `v_cache=None, head_dim_v=` or a view of the cache, and
`PagedKVCache` with one latent pool."""

from __future__ import annotations

import os

import pytest
import torch

import attngen
from attngen import ir
from attngen.cli import main
from attngen.errors import KernelInputError, SpecError, UnsupportedError
from attngen.lang.spec import load_file, parse
from attngen.passes import applied_passes, compile_program
from attngen.testing import reference
from attngen.testing.accuracy import Case, run_case

from conftest import DEVICE, SPECS, spec_text

MLA_SPEC = os.path.join(SPECS, "mla_decode.attn")


def _mla(head_dim=80, head_dim_v=64, page_size=16, split_kv="auto", **extra):
    """A latent decode spec's text: paged by `page_size` (None: contiguous)."""
    layout = {"kv_layout": f"paged(page_size = {page_size})"} if page_size else {}
    return spec_text(head_dim=head_dim, dtype="bf16", mask="causal(bottom_right)", head_dim_v=head_dim_v,
                     v=f"k[:{head_dim_v}]", split_kv=split_kv, **layout, **extra)


# -- the spec key ---------------------------------------------------------------------------------------------


def test_shipped_spec_reads_v_as_the_first_512_columns_of_a_576_wide_cache():
    spec = load_file(MLA_SPEC)
    assert (spec.head_dim, spec.head_dim_v, spec.v_from_k, spec.kv_layout.page_size) == (576, 512, True, 64)
    assert spec.is_split and spec.packs_gqa and spec.softmax_scale == 576 ** -0.5
    lines = spec.canonical().splitlines()
    assert lines[lines.index("    head_dim_v = 512") + 1] == "    v = k[:512]"
    assert parse(spec.canonical()) == spec
    # the key is written only where set: the same spec without it is another kernel (if it were allowed)
    assert "v = k" not in parse(spec_text(head_dim=80, head_dim_v=64)).canonical()
    # head_dim_v may be left out: the slice gives it
    assert parse(spec_text(head_dim=80, dtype="bf16", v="k[:64]", split_kv=2)).head_dim_v == 64


BAD = [  # (keys, line, column, words in the message): the spec_text lines are kernel, head_dim, dtype, mask, ...
    (dict(head_dim=576, head_dim_v=512, v="k[64:]", split_kv=2), 6, 11, ["prefix of k", "k[64:]"]),
    (dict(head_dim=576, head_dim_v=512, v="k[64:576]", split_kv=2), 6, 11, ["prefix of k"]),
    (dict(head_dim=576, head_dim_v=512, v="q[:512]", split_kv=2), 6, 9, ["prefix of k", "q[:512]"]),
    (dict(head_dim=576, head_dim_v=512, v="k", split_kv=2), 6, 9, ["prefix of k"]),
    (dict(head_dim=576, head_dim_v=512, v="k[:]", split_kv=2), 6, 9, ["write the prefix's width"]),
    (dict(head_dim=576, v="k[:520]", split_kv=2), 5, 12, ["520", "out of range", "16 to 512"]),
    (dict(head_dim=576, v="k[:200]", split_kv=2), 5, 12, ["200", "multiple of 16", "192 or 208"]),
    (dict(head_dim=576, head_dim_v=520, v="k[:512]", split_kv=2), 5, 18, ["head_dim_v = 520", "16 to 512"]),
    (dict(head_dim=576, head_dim_v=504, split_kv=2), 5, 18, ["head_dim_v = 504", "multiple of 16"]),
    (dict(head_dim=576, head_dim_v=256, v="k[:512]", split_kv=2), 6, 9, ["512 wide but head_dim_v = 256"]),
    (dict(head_dim=576, head_dim_v=512, split_kv=2), 2, 16, ["head_dim = 576", "out of range", "v = k[:N]"]),
    (dict(head_dim=512, v="k[:512]", split_kv=2), 5, 9, ["needs head_dim > 512"]),
    (dict(head_dim=80, v="k[:64]"), 5, 9, ["decoding", "split_kv or kv_layout = paged"]),
    (dict(head_dim=80, v="k[:64]", direction="forward+backward"), 5, 9, ["no backward"]),
]


@pytest.mark.parametrize("keys,line,col,words", BAD, ids=lambda x: str(x) if isinstance(x, dict) else "")
def test_bad_v_is_a_spec_error_at_the_key(keys, line, col, words):
    with pytest.raises(SpecError) as info:
        parse(spec_text(dtype="bf16", **keys), "mla.attn")
    e = info.value
    assert (e.filename, e.line, e.column) == ("mla.attn", line, col), str(e)
    assert str(e).startswith(f"mla.attn:{line}:{col}:")
    for word in words:
        assert word in str(e), str(e)
    if "no backward" in words or "decoding" in words:
        assert isinstance(e, UnsupportedError)


def test_a_slice_elsewhere_is_a_spec_error():
    with pytest.raises(SpecError, match="is a slice") as info:
        parse("kernel t {\n head_dim = 64\n dtype = bf16\n tensor bias[H]: fp32\n score = s + bias[1:3]\n}")
    assert (info.value.line, info.value.column) == (5, 19)


# -- the pass -------------------------------------------------------------------------------------------------


def _stages(text):
    out = {}
    compile_program(parse(text), trace=lambda name, p: out.__setitem__(name, p))
    return out


def _key_loops(kernel):
    return [st for st in ir.walk_stmts(kernel.body) if isinstance(st, ir.Loop) and st.kind is ir.LoopKind.SERIAL]


def _loads(stmts, name):
    return [e for st in stmts for x in ir.stmt_exprs(st) for e in ir.walk_expr(x)
            if isinstance(e, ir.Load) and e.buffer.name == name]


def test_latent_kv_reads_each_key_tile_once_for_both_products():
    stages = _stages(open(MLA_SPEC).read())
    before, after = stages["paged"].kernel("attn_fwd"), stages["latent-kv"].kernel("attn_fwd")
    assert "V" not in {p.name for p in before.params}  # no V tensor from `lower` on: the values are K's columns
    assert "latent-kv" in applied_passes(stages["latent-kv"])
    for old, new in zip(_key_loops(before), _key_loops(after)):
        # before: K read full width for the scores and again, its first 512 columns, for P V (overlapping)
        assert sorted(ir.format_span(e.index[-1]) for e in _loads(old.body, "K")) == [
            ":HEAD_DIM_PADDED (<HEAD_DIM)", ":HEAD_DIM_V"]
        # after: two disjoint tiles, each read once at the loop's top, and no other read of K
        kv, k_rope = new.body[:2]
        assert (kv.target.name, k_rope.target.name) == ("kv", "k_rope")
        assert [ir.format_span(e.index[-1]) for e in _loads(new.body, "K")] == [
            ":HEAD_DIM_V", "HEAD_DIM_V:+HEAD_DIM_ROPE_PADDED"]
        text = "\n".join(ir.format_expr(x) for st in new.body[2:] for x in ir.stmt_exprs(st))
        assert "dot_t(q_nope, kv) + dot_t(q_rope, k_rope)" in text and "dot_acc(cast<bf16>(p), kv" in text
    assert [p.name for p in after.params][:2] == ["Q", "K"]
    assert not any(d.symbol.name == "HEAD_DIM_PADDED" for d in after.symbols)  # nothing is 1024 wide


def test_the_golden_source_loads_each_tile_once_and_has_no_v():
    source = open(os.path.join(SPECS, "..", "generated", "mla_decode.py")).read()
    assert "HEAD_DIM = 576" in source and "HEAD_DIM_V = 512" in source and "HEAD_DIM_ROPE_PADDED = 64" in source
    assert "v_base" not in source and "def launch_attn_fwd(q, k, o_part" in source
    loops = source.split("for start_n in range(")[1:]
    assert len(loops) == 2
    for loop in loops:
        body = loop.split("m_i = m_new")[0]
        assert body.count("tl.load(k_base") == 2
        assert "kv = tl.load(k_base" in body and "offs_dv[None, :] * stride_k_d" in body
        assert "k_rope = tl.load(k_base" in body and "offs_dr[None, :] * stride_k_d" in body
        assert "tl.dot(p.to(tl.bfloat16), kv, acc" in body


MLA_PROBES = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages): 16 heads' rows on mma, 128 heads' 64 on wgmma
    (16, 32, 4, 2), (16, 32, 4, 7), (16, 64, 4, 5), (64, 32, 8, 2), (64, 64, 8, 2)]


def test_the_resource_model_counts_one_576_wide_tile_a_stage_as_the_sm90_compiler_does():
    """The shipped kernel compiled for sm_90: its shared memory is the model's within 2 KB (one K tile a stage, no V
    tile), so the tuner does not prune configs that fit (64 rows x 64 keys on 2 stages: 221,184 bytes)."""
    from probe import probe

    from attngen.analysis.resources import Target, infeasible, shared_bytes, tile_widths

    spec = load_file(MLA_SPEC)
    path = os.path.join(SPECS, "..", "generated", "mla_decode.py")
    jobs = [dict(path=path, kernel="attn_fwd", num_warps=w, num_stages=s, unit_strides=("stride_lse_part_n",),
                 constexprs=dict(HEAD_DIM=576, HEAD_DIM_V=512, HEAD_DIM_V_PADDED=512, HEAD_DIM_ROPE_PADDED=64,
                                 BLOCK_M=bm, BLOCK_N=bn),
                 ptr_dtypes={"O_PART": "*fp32", "LSE_PART": "*fp32", "SEQLENS": "*i32", "BLOCK_TABLE": "*i32"})
            for bm, bn, w, s in MLA_PROBES]
    widths, target = tile_widths(spec), Target.default()
    for (bm, bn, warps, stages), result in zip(MLA_PROBES, probe(jobs)):
        assert "error" not in result, result
        model = shared_bytes(widths[0], 2, bm, bn, stages, target, paged=True, head_dim_v_padded=widths[1])
        assert result["shared"] <= model <= result["shared"] + 2048, (bm, bn, stages, result, model)
        assert result["wgmma"] == (bm >= 64)
        assert infeasible(spec, dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages), target) is None


def test_explain_shows_the_shared_read_and_the_packing(capsys):
    assert main(["explain", MLA_SPEC]) == 0
    text = capsys.readouterr().out
    assert "latent-kv: V is K's first 512 columns: each key tile is read once" in text
    assert "pack-gqa: the GROUP query heads of a K/V head fill one program's rows" in text
    assert "kv: reg bf16[BLOCK_N, HEAD_DIM_V] = load K[page(BLOCK_TABLE[b], start_n:+BLOCK_N, size=64" in text
    assert "does not fit" not in text


# -- the kernels against float64 -------------------------------------------------------------------------------

KERNELS = [  # (spec text, cases): one latent head shared by odd numbers of query heads, odd lengths, N_Q > 1
    (_mla(page_size=16, split_kv=3), [Case(2, 5, 1, 1, 37), Case(1, 7, 1, 3, 70), Case(1, 4, 2, 2, 19)]),
    (_mla(page_size=64), [Case(2, 16, 1, 1, 131), Case(1, 6, 1, 4, 65)]),  # per-tile page lookups
    (_mla(head_dim=96, head_dim_v=48, page_size=None), [Case(2, 3, 1, 1, 45)]),  # contiguous; both parts padded
    (_mla(head_dim=576, head_dim_v=512, page_size=64), [Case(1, 16, 1, 1, 70)]),  # the real widths, kept short
]


@pytest.mark.parametrize("text,cases", KERNELS, ids=["paged16-split3", "paged64", "contiguous-48-48", "576-512"])
def test_kernels_match_float64_with_outputs_poisoned(text, cases, device):
    kernel = attngen.load(text)
    gen = torch.Generator(device).manual_seed(0)
    for case in cases:
        result = run_case(kernel, case, device, gen)  # v = k[..., :head_dim_v]; out poisoned with NaN first
        assert result.ok, result


def test_kernel_refuses_a_v_that_is_not_a_view_of_k():
    kernel = attngen.load(_mla())
    q, k = torch.randn(1, 4, 1, 80).bfloat16(), torch.randn(1, 1, 20, 80).bfloat16()
    with pytest.raises(KernelInputError, match="v must be a view of k's first columns"):
        kernel(q, k, k[..., :64].clone())


# -- the API ---------------------------------------------------------------------------------------------------


def _within(out, q, cache, lens, table, width):
    """out against float64, within 4x the error of the same computation in bfloat16 (plus a floor)."""
    ref = reference.kvcache_attention(q, cache, cache[..., :width], lens, table, causal=True)[0]
    low = reference.kvcache_attention(q, cache, cache[..., :width], lens, table, causal=True, dtype=torch.bfloat16)[0]
    err, base = (out.double() - ref).abs().max().item(), (low.double() - ref).abs().max().item()
    assert out.shape == ref.shape and err <= 4 * base + 1e-3, (err, base)


@pytest.mark.parametrize("d,d_v,heads", [(80, 64, 6), (576, 512, 16)])
def test_attention_with_kvcache_reads_v_from_the_latent_cache(d, d_v, heads):
    gen = torch.Generator(DEVICE).manual_seed(1)
    randn = lambda *shape: torch.randn(shape, generator=gen, device=DEVICE).to(torch.bfloat16)
    q, pool = randn(3, 1, heads, d), randn(11, 64, 1, d)
    lens = torch.tensor([129, 1, 70], dtype=torch.int32, device=DEVICE)
    # shuffled pages, entries past a sequence's pages pointing anywhere
    table = torch.tensor([[7, 2, 9], [4, 0, 0], [10, 1, 5]], dtype=torch.int32, device=DEVICE)
    first = None
    # the plan's checks, its recording and replays (the 576-wide case stops at its recording: the interpreter is
    # slow at that width), and a split count of its own
    for splits in (0, 3, 0, 0) if d < 256 else (0, 3):
        out = torch.full((3, 1, heads, d_v), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        attngen.attention_with_kvcache(q, pool, None, lens, table, head_dim_v=d_v, num_splits=splits, out=out)
        _within(out, q, pool, lens, table, d_v)
        view = attngen.attention_with_kvcache(q, pool, pool[..., :d_v], lens, table, num_splits=splits)
        assert torch.equal(view, out)
        first = out if first is None else first
        if splits == 0:
            assert torch.equal(out, first)
    contiguous = randn(3, 130, 1, d)  # (batch, seqlen_max, 1, d)
    out, lse = attngen.attention_with_kvcache(q, contiguous, None, lens, head_dim_v=d_v, return_softmax_lse=True)
    _within(out, q, contiguous, lens, None, d_v)
    assert out.shape == (3, 1, heads, d_v) and lse.shape == (3, heads, 1)


def test_a_v_cache_of_the_same_layout_from_other_memory_is_not_taken_for_the_latent_one():
    """The plans' signature holds whether v_cache is k_cache's prefix: layouts alone cannot tell."""
    gen = torch.Generator(DEVICE).manual_seed(2)
    q = torch.randn(1, 1, 4, 80, generator=gen, device=DEVICE).bfloat16()
    pool, other = (torch.randn(4, 16, 1, 80, generator=gen, device=DEVICE).bfloat16() for _ in range(2))
    lens, table = torch.tensor([40], dtype=torch.int32, device=DEVICE), torch.tensor([[2, 0, 3]], dtype=torch.int32,
                                                                                     device=DEVICE)
    for _ in range(3):
        attngen.attention_with_kvcache(q, pool, pool[..., :64], lens, table)
    out = attngen.attention_with_kvcache(q, pool, other[..., :64], lens, table)
    ref = reference.kvcache_attention(q, pool, other[..., :64], lens, table, causal=True)[0]
    assert (out.double() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("v_cache,keys,error,words", [
    (None, {}, KernelInputError, ["v_cache is None: pass head_dim_v"]),
    (None, dict(head_dim_v="512"), TypeError, ["head_dim_v must be an int"]),
    (None, dict(head_dim_v=600), KernelInputError, ["head_dim_v = 600", "less than k_cache's head dim (576)"]),
    (None, dict(head_dim_v=500), KernelInputError, ["head_dim_v = 500", "multiple of 16"]),
    ("other", dict(head_dim_v=256), KernelInputError, ["v_cache has head dim 512 but head_dim_v is 256"]),
    ("other", {}, KernelInputError, ["head dim 576 is not supported", "k_cache[..., :D_V]"]),
])
def test_bad_latent_arguments_are_refused_before_any_launch(v_cache, keys, error, words, monkeypatch):
    from attngen.runtime import parts

    monkeypatch.setattr(parts.KVCachePart, "launch", lambda *a, **k: pytest.fail("launched"))
    q, pool = torch.randn(1, 1, 16, 576).bfloat16(), torch.randn(2, 64, 1, 576).bfloat16()
    v = torch.randn(2, 64, 1, 512).bfloat16() if v_cache == "other" else None
    with pytest.raises(error) as info:
        attngen.attention_with_kvcache(q, pool, v, 10, torch.zeros(1, 2, dtype=torch.int32), **keys)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_paged_kv_cache_holds_one_latent_pool():
    gen = torch.Generator(DEVICE).manual_seed(3)
    randn = lambda *shape: torch.randn(shape, generator=gen, device=DEVICE).to(torch.bfloat16)
    cache = attngen.PagedKVCache(num_pages=12, page_size=64, kv_heads=1, head_dim=80, dtype=torch.bfloat16,
                                 device=DEVICE, head_dim_v=64)
    assert cache.v_pages.data_ptr() == cache.k_pages.data_ptr() and cache.v_pages.shape[-1] == 64
    a, b = cache.new_sequence(), cache.new_sequence()
    ka, kb, kc = randn(70, 1, 80), randn(130, 1, 80), randn(5, 1, 80)
    cache.append(a, ka)
    cache.append(b, kb)
    c = cache.fork(a)
    cache.append(c, kc)  # copy on write of a's last page
    ids = [a, b, c]
    q = randn(3, 1, 8, 80)
    out = attngen.attention_with_kvcache(q, cache.k_pages, None, cache.seqlens(ids), cache.block_table(ids),
                                         head_dim_v=64)
    assert torch.equal(out, attngen.attention_with_kvcache(q, cache.k_pages, cache.v_pages, cache.seqlens(ids),
                                                           cache.block_table(ids)))
    for i, keys in enumerate((ka, kb, torch.cat([ka, kc]))):
        lens = torch.tensor([keys.shape[0]], dtype=torch.int32, device=DEVICE)
        _within(out[i:i + 1], q[i:i + 1], keys[None], lens, None, 64)
    with pytest.raises(KernelInputError, match="append k alone"):
        cache.append(a, ka, ka)
    with pytest.raises(KernelInputError, match="head_dim_v must be an int from 1 to head_dim - 1"):
        attngen.PagedKVCache(4, 64, 1, 80, head_dim_v=80, device=DEVICE)
    plain = attngen.PagedKVCache(4, 16, 1, 64, device=DEVICE)
    with pytest.raises(KernelInputError, match="append k and v"):
        plain.append(plain.new_sequence(), torch.zeros(3, 1, 64, device=DEVICE, dtype=torch.float16))


# -- a GPU at real sizes ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_mla_decode_at_real_sizes(heads):
    """DeepSeek-V3's decode: 576/512, one latent head, 64-token pages shuffled over the pool, lengths up to 4k, a
    replay captured in a CUDA graph."""
    gen = torch.Generator(DEVICE).manual_seed(4)
    batch, pages_per_seq = 8, 64
    q = torch.randn(batch, 1, heads, 576, generator=gen, device=DEVICE).bfloat16() * 0.3
    pool = torch.randn(batch * pages_per_seq + 3, 64, 1, 576, generator=gen, device=DEVICE).bfloat16()
    table = torch.randperm(batch * pages_per_seq, generator=gen, device=DEVICE).view(batch, pages_per_seq).int()
    lens = torch.randint(1, pages_per_seq * 64 + 1, (batch,), generator=gen, device=DEVICE, dtype=torch.int32)
    out = attngen.attention_with_kvcache(q, pool, None, lens, table, head_dim_v=512)
    _within(out, q, pool, lens, table, 512)
    for _ in range(2):  # the plan, its recording
        attngen.attention_with_kvcache(q, pool, None, lens, table, head_dim_v=512)
    graph, captured = torch.cuda.CUDAGraph(), torch.empty_like(out)
    with torch.cuda.graph(graph):
        captured.copy_(attngen.attention_with_kvcache(q, pool, None, lens, table, head_dim_v=512))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)


# -- the bench rows --------------------------------------------------------------------------------------------


def test_bench_rows_are_issue_51_s_mla_decode_and_count_the_cache_once():
    from attngen.bench import mla

    assert {(r.batch, r.heads, r.seqlen) for r in mla.ROWS} == {(64, 16, 8192), (64, 128, 8192)}
    row = mla.ROWS[1]
    assert row.bytes() == 64 * 8192 * 576 * 2  # K and V are one read of the latent cache
    assert row.flops() == 64 * 128 * 8192 * 2 * (576 + 512)


def test_bench_check_runs_attngen_on_the_mla_rows_in_the_interpreter(monkeypatch):
    from attngen.bench import mla, shapes

    rows = mla.bench_mla(check=True, progress=lambda _: None)
    assert [(r.provider, r.direction, r.error) for r in rows] == [("attngen", "decode", None)]
    text = mla.table(rows)
    assert "MLA decode" in text and "not FlashMLA" in text and "mla_tiny" in text
    assert "sdpa" in shapes.PROVIDERS  # the MLA rows' peer can be asked for by name
    # the check fails a wrong result: scores at twice the scale
    original = mla.attention_with_kvcache
    monkeypatch.setattr(mla, "attention_with_kvcache", lambda q, *a, **k: original(q * 2, *a, **k))
    (bad,) = mla.bench_mla(check=True, progress=lambda _: None)
    assert bad.error is not None and "relative error" in bad.error


def test_the_sweep_script_checks_and_times_each_config_at_its_head_count():
    """benchmarks/mla_sweep.py (the GPU sweep that picks MLA's policy) in the interpreter at a tiny size: each
    candidate runs through the tuner's launch, passes its float64 check, and the default is marked."""
    import importlib.util

    path = os.path.join(SPECS, "..", "benchmarks", "mla_sweep.py")
    loaded = importlib.util.spec_from_file_location("mla_sweep", path)
    sweep = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(sweep)
    space = {16: dict(BLOCK_N=(32,), num_warps=(4,), num_stages=(1,), num_splits=(0, 2))}
    rows = sweep.sweep(attngen.load(MLA_SPEC), 16, 1, 2 * 64 + 3, space, device=DEVICE, timer=lambda fn: (fn(), 1.0)[1])
    assert [r["config"]["num_splits"] for r in rows] == [0, 2] and all(r["config"]["BLOCK_M"] == 16 for r in rows)
    assert all("error" not in r and r["rel"] < 2e-2 for r in rows), rows
    assert rows[0]["default"] and rows[0]["gbps"] == 1 * 131 * 576 * 2 / 1e6
    assert "<- default" in sweep.table(rows)
