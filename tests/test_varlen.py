"""Packed variable-length sequences (`layout = varlen`): the kernels against float64, sequence by sequence.

Each case packs sequences of odd, unequal lengths (a zero-length one among them) end to end, runs the kernel
on NaN-poisoned outputs, and compares every sequence's slice with the float64 reference of that sequence alone
(bottom-right aligned, as flash-attn's varlen functions align), by the rule of attngen/testing/accuracy.py.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

import attngen
from attngen.policy import hopper
from attngen.errors import SpecError
from attngen.lang.spec import parse
from attngen.testing.accuracy import Case, compare, compare_grads, spec_reference

from conftest import DEVICE, SPECS

def _kernel(body: str, name: str, head_dim: int = 32, dtype: str = "fp32"):
    return attngen.load(f"kernel {name} {{\n layout = varlen\n head_dim = {head_dim}\n dtype = {dtype}\n{body}\n}}")


def _offsets(lengths) -> torch.Tensor:
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device=DEVICE)


def _packed(kernel, lens_q, lens_k, heads, kv_heads, generator, requires_grad=False):
    spec = kernel.spec
    dt = spec.dtype.torch
    make = lambda n, h: torch.randn((n, h, spec.head_dim), generator=generator, device=DEVICE).to(dt)
    q, k, v = make(sum(lens_q), heads), make(sum(lens_k), kv_heads), make(sum(lens_k), kv_heads)
    if requires_grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, _offsets(lens_q), _offsets(lens_k)


def _sequence(t, cu, b):
    """Sequence b's rows of a packed (total, heads, d) tensor as (1, heads, n, d)."""
    return t[int(cu[b]):int(cu[b + 1])].transpose(0, 1)[None]


def _per_sequence(tensors: dict, b: int) -> dict:
    out = dict(tensors)
    slopes = out.get("alibi_slopes")
    if slopes is not None and slopes.dim() == 2:
        out["alibi_slopes"] = slopes[b:b + 1]
    return out


def _check_forward(kernel, out, lse, q, k, v, cu_q, cu_k, used=None, tensors=None):
    spec = kernel.spec
    heads = q.shape[1]
    assert lse.shape == (heads, q.shape[0]) and lse.dtype == torch.float32
    for b in range(cu_q.shape[0] - 1):
        n_q = int(cu_q[b + 1] - cu_q[b])
        if n_q == 0:
            continue
        ks, vs = _sequence(k, cu_k, b), _sequence(v, cu_k, b)
        if used is not None:
            ks, vs = ks[:, :, :int(used[b])], vs[:, :, :int(used[b])]
        qs = _sequence(q, cu_q, b)
        got = _sequence(out, cu_q, b)
        got_lse = lse[:, int(cu_q[b]):int(cu_q[b + 1])][None]
        result = compare(spec, Case(1, heads, k.shape[1], n_q, ks.shape[2]), got, got_lse, qs, ks, vs,
                         tensors=_per_sequence(tensors or {}, b))
        assert result.ok, f"sequence {b}: {result}"


@pytest.mark.parametrize("lens_q, lens_k", [
    ([5, 0, 37, 3, 17], [9, 4, 37, 0, 40]),      # unequal, seq_q != seq_k both ways, empty q, empty k
    ([19, 19, 19], [19, 19, 19]),                  # equal
])
@pytest.mark.parametrize("mask", ["causal", "none"])
def test_forward_matches_float64_per_sequence(lens_q, lens_k, mask):
    kernel = _kernel(f"mask = {mask}\n heads = 4\n kv_heads = 2", f"vl_fwd_{mask}")
    g = torch.Generator(device=DEVICE).manual_seed(len(lens_q))
    q, k, v, cu_q, cu_k = _packed(kernel, lens_q, lens_k, 4, 2, g)
    out = torch.full_like(q, float("nan"))
    out, lse = kernel(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                      max_seqlen_k=max(lens_k), out=out, return_lse=True, config={"BLOCK_M": 16, "BLOCK_N": 16})
    _check_forward(kernel, out, lse, q, k, v, cu_q, cu_k)


VARIANTS = {
    "window_softcap": ("mask = causal & window(6)\n score = softcap(2)", {}),
    "window_pair": ("mask = window(3, 5)", {}),
    "alibi": ("mask = causal\n score = alibi", {"alibi_slopes": "BH"}),
    "alibi_heads": ("score = alibi", {"alibi_slopes": "H"}),
    "sinks": ("mask = causal & window(7)\n sinks = true", {"sinks": "H"}),
}


def _variant_tensors(names: dict, batch: int, heads: int, generator) -> dict:
    out = {}
    for name, shape in names.items():
        size = (batch, heads) if shape == "BH" else (heads,)
        t = torch.rand(size, generator=generator, device=DEVICE) * 0.1 if name == "alibi_slopes" else \
            torch.randn(size, generator=generator, device=DEVICE)
        out[name] = t
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_forward_per_sequence(variant):
    body, tensor_names = VARIANTS[variant]
    kernel = _kernel(body, f"vl_{variant}")
    lens_q, lens_k = [7, 0, 21, 1], [12, 3, 21, 30]
    g = torch.Generator(device=DEVICE).manual_seed(7)
    q, k, v, cu_q, cu_k = _packed(kernel, lens_q, lens_k, 2, 2, g)
    tensors = _variant_tensors(tensor_names, len(lens_q), 2, g)
    out = torch.full_like(q, float("nan"))
    out, lse = kernel(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=21, max_seqlen_k=30, out=out,
                      return_lse=True, config={"BLOCK_M": 16, "BLOCK_N": 16}, **tensors)
    _check_forward(kernel, out, lse, q, k, v, cu_q, cu_k, tensors=tensors)


def test_seqused_k_limits_each_sequence_to_its_first_keys():
    kernel = _kernel("mask = causal", "vl_used")
    lens_q, lens_k = [4, 9, 1], [20, 9, 33]
    used = torch.tensor([13, 0, 33], dtype=torch.int32, device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    q, k, v, cu_q, cu_k = _packed(kernel, lens_q, lens_k, 2, 2, g)
    out, lse = kernel(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=9, max_seqlen_k=33, seqused_k=used,
                      out=torch.full_like(q, float("nan")), return_lse=True, config={"BLOCK_M": 16, "BLOCK_N": 16})
    _check_forward(kernel, out, lse, q, k, v, cu_q, cu_k, used=used)


def _check_grads(kernel, q, k, v, cu_q, cu_k, do, tensors=None):
    spec = kernel.spec
    for b in range(cu_q.shape[0] - 1):
        qs, ks, vs = (_sequence(t.detach(), cu, b) for t, cu in ((q, cu_q), (k, cu_k), (v, cu_k)))
        if ks.shape[2] == 0:
            continue
        got = tuple(_sequence(t.grad, cu, b) for t, cu in ((q, cu_q), (k, cu_k), (v, cu_k)))
        seq_tensors = _per_sequence(tensors or {}, b)
        if spec.variant.sinks:  # the sinks' gradient sums over every sequence: the caller checks it
            got += (torch.zeros_like(seq_tensors["sinks"]),)
        results = compare_grads(spec, qs, ks, vs, _sequence(do, cu_q, b), got, tensors=seq_tensors)
        for r in results[:3]:
            assert r.ok, f"sequence {b}: {r}"


@pytest.mark.parametrize("variant", ["causal", "window_softcap", "sinks"])
def test_backward_matches_float64_per_sequence(variant):
    body, tensor_names = {"causal": ("mask = causal", {}), **VARIANTS}[variant]
    kernel = _kernel(f"direction = forward+backward\n heads = 4\n kv_heads = 2\n {body}", f"vl_bwd_{variant}")
    lens_q, lens_k = [6, 0, 23, 11], [10, 5, 23, 0]
    g = torch.Generator(device=DEVICE).manual_seed(11)
    q, k, v, cu_q, cu_k = _packed(kernel, lens_q, lens_k, 4, 2, g, requires_grad=True)
    tensors = _variant_tensors(tensor_names, len(lens_q), 4, g)
    if "sinks" in tensors:
        tensors["sinks"].requires_grad_()
    out = kernel(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=23, max_seqlen_k=23, **tensors)
    do = torch.randn(out.shape, generator=g, device=DEVICE)
    out.backward(do)
    _check_grads(kernel, q, k, v, cu_q, cu_k, do, tensors)
    if "sinks" in tensors:
        expected = sinks_gradient(kernel, q.detach(), k.detach(), v.detach(), do, cu_q, cu_k, tensors["sinks"])
        torch.testing.assert_close(tensors["sinks"].grad.double(), expected, atol=1e-4, rtol=1e-4)


def sinks_gradient(kernel, q, k, v, do, cu_q, cu_k, sinks):
    """d loss / d sinks (float64) for loss = sum(out * do) over the sequences of cu_q and cu_k: the sinks' gradient
    sums over every sequence, so float64 autograd of the per-sequence references, summed."""
    sinks = sinks.detach().double().requires_grad_()
    total = 0
    for b in range(cu_q.shape[0] - 1):
        qs, ks, vs = (_sequence(t, cu, b) for t, cu in ((q, cu_q), (k, cu_k), (v, cu_k)))
        ref, _ = spec_reference(kernel.spec, qs, ks, vs, kernel.spec.softmax_scale, {"sinks": sinks})
        total = total + (ref * _sequence(do, cu_q, b).double()).sum()
    return torch.autograd.grad(total, sinks)[0]


def test_the_sinks_gradient_sums_only_the_sequences_rows():
    """Packed tensors longer than the sequences (rows from cu_seqlens_q[-1] on are no sequence's; the forward leaves
    their out and lse as they were, here a finite lse and out and dO of any value): the sinks' gradient sums over the
    sequences' rows only, against float64 autograd of the per-sequence references."""
    kernel = _kernel("direction = forward+backward\n heads = 2\n kv_heads = 1\n mask = causal & window(7)\n sinks = true",
                     "vl_bwd_sinks_tail")
    lens_q, lens_k, tail = [6, 0, 13], [10, 5, 13], 9
    g = torch.Generator(device=DEVICE).manual_seed(5)
    q, k, v, cu_q, cu_k = _packed(kernel, [*lens_q, tail], lens_k, 2, 1, g)
    cu_q = cu_q[:-1]
    sinks = torch.randn(2, generator=g, device=DEVICE)
    module = kernel.module
    out, lse = module.forward_varlen(q, k, v, cu_q, cu_k, cu_k[1:] - cu_k[:-1], sinks=sinks)
    out[sum(lens_q):] = torch.randn((tail, 2, kernel.spec.head_dim), generator=g, device=DEVICE)
    lse[:, sum(lens_q):] = 0.0
    do = torch.randn(out.shape, generator=g, device=DEVICE)
    *_, dsinks = module.backward_varlen(q, k, v, out, lse, do, cu_q, cu_k, cu_k[1:] - cu_k[:-1], sinks=sinks)
    expected = sinks_gradient(kernel, q, k, v, do, cu_q, cu_k, sinks)
    torch.testing.assert_close(dsinks.double(), expected, atol=1e-4, rtol=1e-4)


def test_backward_writes_every_key_row():
    """dk and dv arrive NaN-poisoned: the rows of keys past seqlens_k, of a sequence with no query and past
    cu_seqlens_k[-1] come back exactly 0 (no zeroed allocation behind them any more), the used rows match float64."""
    kernel = _kernel("direction = forward+backward\n heads = 2\n kv_heads = 1\n mask = causal & window(3)",
                     "vl_bwd_rows")
    lens_q, lens_k, tail = [3, 0, 8, 5], [21, 5, 8, 7], 4
    used = torch.tensor([18, 5, 6, 7], dtype=torch.int32, device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(17)
    q, k, v, cu_q, cu_k = _packed(kernel, lens_q, [*lens_k, tail], 2, 1, g)
    cu_k = cu_k[:-1]
    module = kernel.module
    config = {"BLOCK_M": 16, "BLOCK_N": 16}
    out, lse = module.forward_varlen(q, k, v, cu_q, cu_k, used, config=config)
    do = torch.randn(out.shape, generator=g, device=DEVICE)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    module.backward_varlen(q, k, v, out, lse, do, cu_q, cu_k, used, dq=dq, dk=dk, dv=dv,
                           config={"attn_bwd_dq": config, "attn_bwd_dkdv": config})
    unused = torch.ones(k.shape[0], dtype=torch.bool, device=DEVICE)
    for b in range(len(lens_q)):
        unused[int(cu_k[b]):int(cu_k[b]) + int(used[b])] = False
    assert int(unused.sum()) == 3 + 2 + tail  # sequence 0's last 3 keys, sequence 2's last 2, the tail
    assert (dk[unused] == 0).all() and (dv[unused] == 0).all(), "a key row no sequence uses is not zero"
    assert (dk[int(cu_k[1]):int(cu_k[2])] == 0).all(), "the keys of a sequence without queries get no gradient"
    for b in (0, 2, 3):
        n_k = int(used[b])
        qs, dos, dqs = (_sequence(t, cu_q, b) for t in (q, do, dq))
        ks, vs, dks, dvs = (_sequence(t, cu_k, b)[:, :, :n_k] for t in (k, v, dk, dv))
        for r in compare_grads(kernel.spec, qs, ks, vs, dos, (dqs, dks, dvs)):
            assert r.ok, f"sequence {b}: {r}"


def test_backward_bf16_shipped_spec():
    kernel = attngen.load(os.path.join(SPECS, "varlen_causal_d128.attn"))
    lens_q, lens_k = [3, 17, 0], [3, 30, 2]
    g = torch.Generator(device=DEVICE).manual_seed(5)
    q, k, v, cu_q, cu_k = _packed(kernel, lens_q, lens_k, 32, 8, g, requires_grad=True)
    out, lse = kernel(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=17, max_seqlen_k=30,
                      return_lse=True)
    _check_forward(kernel, out.detach(), lse, q.detach(), k.detach(), v.detach(), cu_q, cu_k)
    do = torch.randn(out.shape, generator=g, device=DEVICE).to(out.dtype)
    out.backward(do)
    _check_grads(kernel, q, k, v, cu_q, cu_k, do)


def _pages(k, v, cu_k, page_size, generator):
    """k and v (total, H_KV, D) copied into pools of shuffled pages; returns (k_pool, v_pool, block_table)."""
    lens = [int(cu_k[b + 1] - cu_k[b]) for b in range(cu_k.shape[0] - 1)]
    per = [max(1, -(-n // page_size)) for n in lens]
    order = torch.randperm(sum(per), generator=generator, device=generator.device).to(DEVICE)
    pools = [torch.zeros((sum(per), page_size) + tuple(k.shape[1:]), dtype=k.dtype, device=DEVICE) for _ in "kv"]
    table = torch.zeros((len(lens), max(per) + 1), dtype=torch.int32, device=DEVICE)
    used = 0
    for b, n in enumerate(lens):
        for j in range(per[b]):
            page = int(order[used + j])
            table[b, j] = page
            rows = slice(int(cu_k[b]) + j * page_size, int(cu_k[b]) + min(n, (j + 1) * page_size))
            for pool, t in zip(pools, (k, v)):
                pool[page, :rows.stop - rows.start] = t[rows]
        used += per[b]
    return pools[0], pools[1], table


def test_paged_mixed_prefill_and_decode_in_one_launch():
    kernel = _kernel("mask = causal\n kv_layout = paged(page_size = 16)", "vl_paged")
    # a chunked prefill (9 new queries over 40 keys), two decodes, a full prefill, an empty sequence
    lens_q, lens_k = [9, 1, 1, 21, 0], [40, 17, 1, 21, 5]
    g = torch.Generator(device=DEVICE).manual_seed(13)
    q, k, v, cu_q, cu_k = _packed(kernel, lens_q, lens_k, 2, 2, g)
    k_pool, v_pool, table = _pages(k, v, cu_k, 16, g)
    calls = _count_launches(kernel)
    out, lse = kernel(q, k_pool, v_pool, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=21, max_seqlen_k=40,
                      block_table=table, out=torch.full_like(q, float("nan")), return_lse=True,
                      config={"BLOCK_M": 16, "BLOCK_N": 16})
    assert calls == [1]
    _check_forward(kernel, out, lse, q, k, v, cu_q, cu_k)
    # seqused_k: sequences 0 and 3 use fewer keys than they hold
    used = torch.tensor([33, 17, 1, 4, 5], dtype=torch.int32, device=DEVICE)
    out, lse = kernel(q, k_pool, v_pool, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=21, max_seqlen_k=40,
                      block_table=table, seqused_k=used, out=torch.full_like(q, float("nan")), return_lse=True,
                      config={"BLOCK_M": 16, "BLOCK_N": 16})
    _check_forward(kernel, out, lse, q, k, v, cu_q, cu_k, used=used)


def _count_launches(kernel) -> list:
    """A list whose one entry counts the forward kernel's launches from now on."""
    calls = [0]
    launch = kernel.module.launch_attn_fwd

    def counted(*args, **kwargs):
        calls[0] += 1
        return launch(*args, **kwargs)

    kernel.module.launch_attn_fwd = counted
    return calls


def test_paged_shipped_spec_bf16():
    kernel = attngen.load(os.path.join(SPECS, "varlen_paged_d128.attn"))
    lens_q, lens_k = [5, 1, 70], [70, 64, 70]
    g = torch.Generator(device=DEVICE).manual_seed(17)
    q, k, v, cu_q, cu_k = _packed(kernel, lens_q, lens_k, 32, 8, g)
    pool_k, pool_v, table = _pages(k, v, cu_k, 64, g)
    out, lse = kernel(q, pool_k, pool_v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=70, max_seqlen_k=70,
                      block_table=table, out=torch.full_like(q, float("nan")), return_lse=True)
    _check_forward(kernel, out, lse, q, k, v, cu_q, cu_k)


class _Grid:
    """Stands in for a @triton.jit kernel: records the grid of each launch."""

    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args, **kwargs: None


def test_grid_follows_tokens_not_the_longest_sequence(monkeypatch):
    kernel = _kernel("mask = causal", "vl_grid")
    lens = [4096] + [7] * 63  # one long prompt beside 63 short ones
    q = torch.zeros((sum(lens), 2, 32), device=DEVICE)
    k = torch.zeros_like(q)
    cu = _offsets(lens)
    grid = _Grid()
    monkeypatch.setattr(kernel.module, "attn_fwd", grid)
    kernel(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4096, max_seqlen_k=4096,
           config={"BLOCK_M": 64, "BLOCK_N": 64})
    assert grid.grids == [(math.ceil(sum(lens) / 64) + 64, 2)]
    # a padded batch would take 64 sequences x 4096 / 64 tiles = 4096 programs a head; this takes 135


def test_sequence_search_finds_every_tile():
    """Every program maps to the (sequence, tile) the numbering cu[b] // BLOCK_M + b gives, each tile once."""
    block = 16
    lens = [0, 5, 16, 17, 0, 33, 1]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    seen = []
    for tile in range(cu[-1] // block + len(lens)):
        b = max(i for i in range(len(lens)) if cu[i] // block + i <= tile)
        start = (tile - (cu[b] // block + b)) * block
        if start < lens[b]:
            seen.append((b, start))
    assert seen == [(b, s) for b, n in enumerate(lens) for s in range(0, n, block)]


def test_bad_tensors_are_named_before_any_launch():
    kernel = _kernel("mask = causal", "vl_bad")
    q = torch.zeros((10, 2, 32), device=DEVICE)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    ok = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        kernel(q, q, q, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)
    with pytest.raises(TypeError, match="bogus"):
        kernel(q, q, q, bogus=cu, **ok)
    with pytest.raises(ValueError, match="cu_seqlens_q must be int32"):
        kernel(q, q, q, **dict(ok, cu_seqlens_q=cu.long()))
    with pytest.raises(ValueError, match="cu_seqlens_k has 2 entries"):
        kernel(q, q, q, **dict(ok, cu_seqlens_k=cu[:2]))
    with pytest.raises(ValueError, match="seqused_k"):
        kernel(q, q, q, seqused_k=cu, **ok)
    with pytest.raises(ValueError, match="q must have 3 dimensions"):
        kernel(q[None], q, q, **ok)
    with pytest.raises(ValueError, match="k has dtype"):
        kernel(q, q.half(), q, **ok)
    with pytest.raises(ValueError, match="block_table"):
        kernel(q, q, q, block_table=cu[None], **ok)
    with pytest.raises(TypeError, match="max_seqlen_q"):
        kernel(q, q, q, **dict(ok, max_seqlen_q=6.0))
    with pytest.raises(ValueError, match="out must be"):
        kernel(q, q, q, out=q[:5], **ok)
    paged = _kernel("mask = causal\n kv_layout = paged(page_size = 16)", "vl_bad_paged")
    pool = torch.zeros((3, 16, 2, 32), device=DEVICE)
    with pytest.raises(TypeError, match="block_table"):
        paged(q, pool, pool, **ok)
    with pytest.raises(ValueError, match="block_table must have one row per sequence"):
        paged(q, pool, pool, block_table=torch.zeros((3, 2), dtype=torch.int32, device=DEVICE), **ok)


@pytest.mark.parametrize("line, message", [
    ("split_kv = 4", "split_kv must be 1"),
    ("pack_gqa = true", "does not pack GQA rows"),
    ("mask = causal(top_left)", "bottom-right"),
])
def test_spec_refuses_what_varlen_does_not_support(line, message):
    with pytest.raises(SpecError, match=message) as raised:
        parse(f"kernel v {{\n layout = varlen\n head_dim = 64\n dtype = bf16\n {line}\n}}", "v.attn")
    assert raised.value.line == 5


def test_paged_varlen_has_no_backward():
    with pytest.raises(SpecError, match="no backward"):
        parse("kernel v {\n layout = varlen\n direction = forward+backward\n head_dim = 64\n dtype = bf16\n"
              " kv_layout = paged(page_size = 16)\n}", "v.attn")


def test_dense_spec_text_is_unchanged_and_varlen_means_bottom_right():
    dense = parse("kernel v {\n head_dim = 64\n dtype = bf16\n mask = causal\n}")
    assert "    layout =" not in dense.canonical() and not dense.varlen
    packed = parse("kernel v {\n layout = varlen\n head_dim = 64\n dtype = bf16\n mask = causal\n}")
    assert packed.varlen and packed.bottom_right and "mask = causal(bottom_right)" in packed.canonical()
    assert "layout = varlen" in packed.canonical() and packed.hash != dense.hash


def test_explain_shows_the_per_sequence_tiling():
    from attngen.passes import applied_passes, compile_program
    from attngen import ir

    spec = attngen.runtime.kernel.as_spec(os.path.join(SPECS, "varlen_causal_d128.attn"))
    program = compile_program(spec)
    text = ir.format_program(program)
    assert "grid tile in [0, B + cdiv(TOTAL_Q, BLOCK_M)):" in text
    assert "grid tile in [0, B + cdiv(TOTAL_K, BLOCK_N)):" in text
    assert "b = last b with CU_SEQLENS_Q[b] // BLOCK_M + b <= tile" in text
    assert "return if start_m >= n_q" in text
    assert "LSE: hbm fp32[H, TOTAL_Q]" in text
    passes = applied_passes(program)
    assert "varlen" in passes and "warp-specialize" in passes and "tma" not in passes
    # the forward has a Hopper Gluon kernel over the same tiles (the backward only where the policy allows it)
    assert program.warp_specialized.forward is not None
    assert (program.warp_specialized.backward is not None) == hopper.VARLEN_BACKWARD


def test_varlen_pass_before_and_after():
    """The pass's rewrite in the IR's printed form: the (b, h, query block) grid becomes (h, tile) with the
    sequence search, N_Q / N_K become n_q / n_k, and every index a packed row."""
    from attngen.passes import compile_program
    from attngen import ir

    stages = {}
    spec = parse("kernel v {\n layout = varlen\n head_dim = 64\n dtype = bf16\n mask = causal\n}")
    compile_program(spec, trace=lambda name, program: stages.setdefault(name, ir.format_program(program)))
    before, after = stages["kv-lengths"], stages["varlen"]
    assert "grid b in [0, B):" in before and "load Q[b, h, start_m:+BLOCK_M (<N_Q), :HEAD_DIM]" in before
    assert "keep key <= query + N_K - N_Q" in before
    assert "grid b in" not in after and "N_Q" not in after.split("kernel attn_fwd")[1]
    assert "grid h in [0, H):\n    grid tile in [0, B + cdiv(TOTAL_Q, BLOCK_M)):" in after
    assert "load Q[q_start + (start_m:+BLOCK_M (<n_q)), h, :HEAD_DIM]" in after
    assert "load K[k_start + (start_n:+BLOCK_N (<n_k)), (h // GROUP), :HEAD_DIM]" in after
    assert "store LSE[h, q_start + (start_m:+BLOCK_M (<n_q))]" in after
    assert "keep key <= query + n_k - n_q" in after
    assert "n_k: reg int32[] = load SEQLENS_K[b]" in after
    assert "n_q: reg int32[] = load CU_SEQLENS_Q[b + 1] - q_start" in after


def test_gradients_through_torch_compile_in_one_graph():
    """A compiled training step through `autograd.varlen_forward` (what a varlen kernel call records) stays one
    graph (the custom ops attngen::varlen_forward / varlen_backward, the sinks a Tensor[]) and gives the eager
    gradients."""
    from torch._dynamo.testing import CompileCounter

    from attngen.runtime.autograd import varlen_forward

    kernel = _kernel("direction = forward+backward\n mask = causal & window(5)\n sinks = true", "vl_compile")
    lens_q, lens_k = [4, 0, 11], [9, 3, 11]
    g = torch.Generator(device=DEVICE).manual_seed(19)
    q, k, v, cu_q, cu_k = _packed(kernel, lens_q, lens_k, 2, 2, g)
    sinks = torch.randn(2, generator=g, device=DEVICE)
    do = torch.randn(q.shape, generator=g, device=DEVICE)

    key, seqlens_k = kernel.key, cu_k[1:] - cu_k[:-1]

    def loss(q, k, v, sinks):
        out, _ = varlen_forward(key, q, k, v, cu_q, cu_k, seqlens_k, kernel.spec.softmax_scale, (sinks,))
        return (out * do).sum()

    counter = CompileCounter()
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    runs = []
    for fn in (loss, compiled):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        fn(*leaves).backward()
        runs.append([t.grad for t in leaves])
    assert counter.frame_count == 1
    for eager, traced in zip(*runs):
        assert torch.allclose(eager, traced, atol=1e-6, rtol=0)


@pytest.mark.gpu
def test_gpu_packed_documents_and_a_mixed_serving_step():
    """At real sizes on a GPU: 8 documents of random lengths packed into 4096 tokens through the shipped
    training spec (forward and backward), and 4 prefills beside 28 decodes over shuffled 64-token pages."""
    g = torch.Generator(device=DEVICE).manual_seed(23)
    cuts = sorted(torch.randperm(4095, generator=torch.Generator().manual_seed(23))[:7].add(1).tolist())
    lens = [b - a for a, b in zip([0] + cuts, cuts + [4096])]
    kernel = attngen.load(os.path.join(SPECS, "varlen_causal_d128.attn"))
    q, k, v, cu_q, cu_k = _packed(kernel, lens, lens, 32, 8, g, requires_grad=True)
    out, lse = kernel(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                      return_lse=True)
    _check_forward(kernel, out.detach(), lse, q.detach(), k.detach(), v.detach(), cu_q, cu_k)
    do = torch.randn(out.shape, generator=g, device=DEVICE).to(out.dtype)
    out.backward(do)
    _check_grads(kernel, q, k, v, cu_q, cu_k, do)

    paged = attngen.load(os.path.join(SPECS, "varlen_paged_d128.attn"))
    lens_q = [1000, 2048, 77, 513] + [1] * 28
    lens_k = [1000 + 3000, 2048, 77 + 64, 513 + 900] + [int(n) for n in torch.randint(1, 8000, (28,), generator=g,
                                                                                      device=DEVICE)]
    q, k, v, cu_q, cu_k = _packed(paged, lens_q, lens_k, 32, 8, g)
    pool_k, pool_v, table = _pages(k, v, cu_k, 64, g)
    out, lse = paged(q, pool_k, pool_v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=2048,
                     max_seqlen_k=max(lens_k), block_table=table, out=torch.full_like(q, float("nan")),
                     return_lse=True)
    _check_forward(paged, out, lse, q, k, v, cu_q, cu_k)


def test_row_offsets_past_32_bits_are_refused_before_any_launch(monkeypatch):
    """Rows inside a sequence are 32-bit offsets: packed rows spanning past the limit are refused; a page pool
    is not held to it as a whole, its pages being 64-bit offsets (the limit lowered to 1000 elements here)."""
    import attngen.runtime.arguments as arguments_module
    from attngen.runtime.varlen import arguments

    monkeypatch.setattr(arguments_module, "INT32_MAX", 1000)
    cu = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    small = torch.zeros((3, 2, 32), device=DEVICE)  # rows span 2 * 64 + 32 elements
    spec = _kernel("mask = causal", "vl_span").spec
    arguments(spec, small, small, small, cu, cu, 3, 3)
    long = torch.zeros((20, 2, 32), device=DEVICE)  # 19 * 64 + 32 > 1000
    with pytest.raises(ValueError, match="q spans 1,248 elements within one sequence's rows of one head"):
        arguments(spec, long, small, small, cu, cu, 3, 3)
    paged = _kernel("mask = causal\n kv_layout = paged(page_size = 16)", "vl_span_paged").spec
    pool = torch.zeros((4, 16, 2, 32), device=DEVICE)  # a page spans 15 * 64 + 32, the pool 4,096 elements
    arguments(paged, small, pool, pool, cu, cu, 3, 3, block_table=torch.zeros((1, 1), dtype=torch.int32, device=DEVICE))
