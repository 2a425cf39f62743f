"""A mixed serving step (paged varlen): short sequences as narrow split-KV work items beside the wide tiles.

The policy is forced (tiny thresholds) so that the interpreter runs the narrow kernels, the split and the merge at
small sizes; every output is checked against float64 per sequence, with the outputs poisoned first."""

from __future__ import annotations

import pytest
import torch

from attngen.policy import mixed
from attngen.policy.mixed import MixedPolicy, MixedSchedule

from conftest import DEVICE
from test_varlen import _check_forward, _kernel, _packed, _pages

# Every short sequence narrow, its keys cut into slices of 16 (one BLOCK_N = 16 block): up to 5 splits here.
FORCED = MixedPolicy(narrow_m=16, min_keys=0, split_keys=16, min_waves=0, max_splits=8)
CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16}
# decodes (1), a speculative step (2), a chunked prefill just past the threshold (17), an empty sequence, odd keys
LENS_Q = [1, 17, 2, 0, 1, 5]
LENS_K = [37, 41, 9, 6, 1, 77]


def _launches(kernel, monkeypatch, skip=()) -> dict:
    """Counts of each launcher's calls from now on; the launchers named in `skip` do nothing."""
    counts = {}
    for name in ("launch_attn_fwd", "launch_attn_fwd_short", "launch_attn_combine_short"):
        launch = getattr(kernel.module, name)

        def counted(*args, _name=name, _launch=launch, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return None if _name in skip else _launch(*args, **kwargs)

        monkeypatch.setattr(kernel.module, name, counted)
    return counts


def _step(kernel, heads, kv_heads, seed, lens_q=LENS_Q, lens_k=LENS_K, used=None, **call):
    """Run one step of packed sequences over shuffled pages (outputs poisoned); returns out, lse, the inputs."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v, cu_q, cu_k = _packed(kernel, lens_q, lens_k, heads, kv_heads, g)
    k_pool, v_pool, table = _pages(k, v, cu_k, kernel.spec.kv_layout.page_size, g)
    out, lse = kernel(q, k_pool, v_pool, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                      max_seqlen_k=max(lens_k), block_table=table, seqused_k=used, out=torch.full_like(q, float("nan")),
                      return_lse=True, config=CONFIG, **call)
    return out, lse, (q, k, v, cu_q, cu_k)


@pytest.mark.parametrize("mask, heads, kv_heads", [
    ("causal", 4, 2),                 # GQA, causal bottom-right per sequence
    ("causal & window(6)", 2, 2),     # a window: most splits of a long cache see no key
    ("none", 2, 1),
])
def test_narrow_split_items_match_float64_per_sequence(monkeypatch, mask, heads, kv_heads):
    monkeypatch.setattr(mixed, "DEFAULT", FORCED)
    kernel = _kernel(f"mask = {mask}\n heads = {heads}\n kv_heads = {kv_heads}\n kv_layout = paged(page_size = 16)",
                     "vl_mixed_" + "".join(c for c in mask if c.isalnum()))
    counts = _launches(kernel, monkeypatch)
    out, lse, (q, k, v, cu_q, cu_k) = _step(kernel, heads, kv_heads, seed=heads + kv_heads)
    assert counts == {"launch_attn_fwd": 1, "launch_attn_fwd_short": 1, "launch_attn_combine_short": 1}
    _check_forward(kernel, out, lse, q, k, v, cu_q, cu_k)
    # seqused_k: the decodes use fewer keys than their pages hold (one uses none)
    used = torch.tensor([20, 41, 0, 6, 1, 33], dtype=torch.int32, device=DEVICE)
    out, lse, _ = _step(kernel, heads, kv_heads, seed=heads + kv_heads, used=used)
    _check_forward(kernel, out, lse, q, k, v, cu_q, cu_k, used=used)


def test_wide_tiles_skip_the_short_sequences_and_the_narrow_items_write_only_them(monkeypatch):
    monkeypatch.setattr(mixed, "DEFAULT", FORCED)
    kernel = _kernel("mask = causal\n kv_layout = paged(page_size = 16)", "vl_mixed_split")
    short = [b for b, n in enumerate(LENS_Q) if 0 < n <= FORCED.narrow_m]  # (no GQA: one head a row)
    for skip in ("launch_attn_fwd", "launch_attn_fwd_short"):
        with monkeypatch.context() as m:
            _launches(kernel, m, skip=(skip, "launch_attn_combine_short") if skip != "launch_attn_fwd" else (skip,))
            out, lse, (q, k, v, cu_q, cu_k) = _step(kernel, 2, 2, seed=5)
        for b, n in enumerate(LENS_Q):
            rows = out[int(cu_q[b]):int(cu_q[b + 1])]
            # the kernel that ran wrote its own sequences' rows and left the others poisoned
            wrote = (b in short) == (skip == "launch_attn_fwd")
            assert bool(torch.isfinite(rows).all()) == wrote or n == 0, (skip, b)


def test_a_step_of_decodes_only_skips_the_wide_launch(monkeypatch):
    monkeypatch.setattr(mixed, "DEFAULT", FORCED)
    kernel = _kernel("mask = causal\n heads = 4\n kv_heads = 1\n kv_layout = paged(page_size = 16)", "vl_mixed_dec")
    counts = _launches(kernel, monkeypatch)
    lens_q, lens_k = [1, 3, 1], [50, 19, 64]
    out, lse, (q, k, v, cu_q, cu_k) = _step(kernel, 4, 1, seed=9, lens_q=lens_q, lens_k=lens_k)
    assert counts == {"launch_attn_fwd_short": 1, "launch_attn_combine_short": 1}
    _check_forward(kernel, out, lse, q, k, v, cu_q, cu_k)


def test_the_default_policy_leaves_short_caches_to_the_wide_kernel(monkeypatch):
    kernel = _kernel("mask = causal\n kv_layout = paged(page_size = 16)", "vl_mixed_off")
    counts = _launches(kernel, monkeypatch)
    out, lse, (q, k, v, cu_q, cu_k) = _step(kernel, 2, 2, seed=3)
    assert counts == {"launch_attn_fwd": 1}
    _check_forward(kernel, out, lse, q, k, v, cu_q, cu_k)


def test_policy_decides_from_host_values():
    # issue 49's step on an H200: 64 sequences, 16 heads, caches up to 32k keys, 132 SMs
    assert mixed.schedule(64, 16, 16, 2048, 32768, 132, 64) == MixedSchedule(16, 16)
    # a lone decode over 32k keys: split further to fill two waves of the SMs
    assert mixed.schedule(1, 16, 16, 1, 32768, 132, 64) == MixedSchedule(16, 17)
    # GQA: a tile holds the group's rows; a group of 32 heads needs 32 rows
    assert mixed.schedule(64, 32, 8, 2048, 32768, 132, 64) == MixedSchedule(16, 16)
    assert mixed.schedule(64, 64, 2, 1, 32768, 132, 64).narrow_m == 32
    # short caches: the wide kernel alone; no split past the key blocks
    assert mixed.schedule(64, 16, 16, 1, 200, 132, 64) == mixed.OFF
    assert mixed.schedule(1, 1, 1, 1, 300, 132, 64).num_splits == 5
    assert mixed.schedule(0, 16, 16, 0, 0, 132, 64) == mixed.OFF


def test_mixed_pass_before_and_after():
    """The pass's rewrite in the IR's printed form: the wide tiles return for short sequences; a narrow kernel over
    (h, split, b) reads the first BLOCK_M rows of a short sequence over its split's keys into the partials; a merge
    kernel writes them to the packed rows. A varlen spec with contiguous K/V is left alone."""
    from attngen import ir
    from attngen.lang.spec import parse
    from attngen.passes import compile_program

    stages = {}
    spec = parse("kernel v {\n layout = varlen\n head_dim = 64\n dtype = bf16\n mask = causal\n"
                 " kv_layout = paged(page_size = 16)\n}")
    compile_program(spec, trace=lambda name, program: stages.setdefault(name, ir.format_program(program)))
    before, after = stages["split-kv"], stages["mixed"]
    assert "attn_fwd_short" not in before and "return if start_m >= n_q    #" in before
    assert "return if start_m >= Piecewise((0, SHORT_Q >= n_q), (n_q, True))" in after
    narrow = after.split("kernel attn_fwd_short")[1].split("kernel attn_combine_short")[0]
    assert "grid split in [0, NUM_SPLITS):" in narrow and "\n    grid b in [0, B):" in narrow
    assert "\n      grid h_kv in [0, H_KV):" in narrow
    assert "n_q: reg int32[] = Piecewise((n_q_all, (n_q_all > 0) & (BLOCK_M >= GROUP*n_q_all)), (0, True))" in narrow
    # the rows are (query, head of the GQA group) pairs
    assert "load Q[packed(GROUP*h_kv, :BLOCK_M (<GROUP*n_q), group=GROUP, first=q_start, rows first), :HEAD_DIM]" \
        in narrow
    assert "query = row // GROUP" in narrow
    assert "for start_n in [split_start, split_stop) step BLOCK_N" in narrow
    assert "store O_PART[b, split, h_kv, :BLOCK_M (<GROUP*n_q), :HEAD_DIM]" in narrow
    merge = after.split("kernel attn_combine_short")[1]
    assert "for split in [0, NUM_SPLITS):" in merge
    assert ("store O[packed(GROUP*h_kv, :BLOCK_M (<GROUP*n_q), group=GROUP, first=q_start, rows first), :HEAD_DIM] "
            "= acc / l_safe") in merge
    contiguous = compile_program(parse("kernel w {\n layout = varlen\n head_dim = 64\n dtype = bf16\n}"))
    assert [k.name for k in contiguous.kernels] == ["attn_fwd"] and not contiguous.attr("mixed")


@pytest.mark.parametrize("score, names", [("sinks = true", {"sinks": (4,)}),
                                          ("score = alibi", {"alibi_slopes": (6, 4)})])
def test_sinks_join_one_split_and_alibi_is_per_sequence(monkeypatch, score, names):
    """Per query head, under GQA packing: each row's own sink (in one split only) and ALiBi slope."""
    monkeypatch.setattr(mixed, "DEFAULT", FORCED)
    kernel = _kernel(f"mask = causal\n {score}\n heads = 4\n kv_heads = 2\n kv_layout = paged(page_size = 16)",
                     "vl_mixed_" + score.split()[0])
    g = torch.Generator(device=DEVICE).manual_seed(11)
    tensors = {name: torch.rand(shape, generator=g, device=DEVICE) for name, shape in names.items()}
    out, lse, (q, k, v, cu_q, cu_k) = _step(kernel, 4, 2, seed=11, **tensors)
    _check_forward(kernel, out, lse, q, k, v, cu_q, cu_k, tensors=tensors)


def test_explain_shows_the_narrow_items_and_the_policy(capsys):
    import os

    from attngen.cli import main
    from conftest import SPECS

    assert main(["explain", os.path.join(SPECS, "varlen_paged_d128.attn")]) == 0
    text = capsys.readouterr().out
    assert "applied: lower, tiling, online-softmax, exp2, fold-scale, varlen, mixed, causal-skip, paged" in text
    line = next(s for s in text.splitlines() if s.startswith("mixed:"))
    assert "attn_fwd_short" in line and "attn_combine_short" in line and str(mixed.DEFAULT) in line
    assert "kernel attn_fwd_short:" in text and "kernel attn_combine_short:" in text


@pytest.mark.gpu
def test_gpu_issue_step_runs_the_narrow_items(monkeypatch):
    """At the issue's sizes on a GPU (4 prompts of 2,048 beside 60 decodes over 1k..32k shuffled 64-token pages,
    d=128, bf16; the shipped spec's 32 query heads over 8 K/V heads), under the default policy: the narrow
    kernels run, and every sequence matches float64."""
    import os

    import attngen
    from conftest import SPECS

    kernel = attngen.load(os.path.join(SPECS, "varlen_paged_d128.attn"))
    g = torch.Generator(device=DEVICE).manual_seed(49)
    lens_q = [2048] * 4 + [1] * 60
    lens_k = [2048] * 4 + torch.randint(1024, 32769, (60,), generator=g, device=DEVICE).tolist()
    q, k, v, cu_q, cu_k = _packed(kernel, lens_q, lens_k, 32, 8, g)
    pool_k, pool_v, table = _pages(k, v, cu_k, 64, g)
    counts = _launches(kernel, monkeypatch)
    out, lse = kernel(q, pool_k, pool_v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=2048,
                      max_seqlen_k=max(lens_k), block_table=table, out=torch.full_like(q, float("nan")),
                      return_lse=True)
    assert counts == {"launch_attn_fwd": 1, "launch_attn_fwd_short": 1, "launch_attn_combine_short": 1}
    _check_forward(kernel, out, lse, q, k, v, cu_q, cu_k)


@pytest.mark.parametrize("body, heads, kv_heads, dtype, head_dim", [
    # pages of one token (a gather per key row), a window on both sides (splits past it see no key)
    ("mask = window(3, 5)\n kv_layout = paged(page_size = 1)", 2, 2, "fp32", 32),
    # fp16, soft-capped scores, 4 query heads over one K/V head, pages of 8
    ("mask = causal & window(6)\n score = softcap(2)\n kv_layout = paged(page_size = 8)", 4, 1, "fp16", 64),
])
def test_narrow_items_over_other_pages_and_scores(monkeypatch, body, heads, kv_heads, dtype, head_dim):
    monkeypatch.setattr(mixed, "DEFAULT", FORCED)
    kernel = _kernel(f"{body}\n heads = {heads}\n kv_heads = {kv_heads}", f"vl_mixed_{dtype}_{head_dim}",
                     head_dim=head_dim, dtype=dtype)
    counts = _launches(kernel, monkeypatch)
    out, lse, (q, k, v, cu_q, cu_k) = _step(kernel, heads, kv_heads, seed=head_dim)
    assert counts["launch_attn_fwd_short"] == 1
    _check_forward(kernel, out, lse, q, k, v, cu_q, cu_k)
