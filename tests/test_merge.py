"""attngen.api.merge: two attention states merged in one kernel (Triton's interpreter on a CPU) against the merge
computed in float64 from the log-sum-exps: odd sizes and head dims, strided views of larger tensors merged in place
as the ring passes them (the rest of the tensors untouched), a separate poisoned output, bfloat16 and float32
partials and accumulators, rows where one or both states are empty; and attngen.merge_states under
policy.context_parallel.FUSED_MERGE on a GPU."""

from __future__ import annotations

import math

import pytest
import torch

import attngen
from attngen.api.merge import merge
from attngen.policy import context_parallel
from conftest import DEVICE

B, H, ROWS = 2, 3, 37


def reference(a, lse_a, b, lse_b):
    """(out, lse) float64: each state weighted by e^(its lse - the merged lse), an empty one (-inf) by 0."""
    la, lb = lse_a.double(), lse_b.double()
    lse = torch.logaddexp(la, lb)
    empty = torch.isneginf(lse)
    wa, wb = (torch.where(empty, 0.0, torch.exp(x - lse)) for x in (la, lb))
    return wa[..., None] * a.double() + wb[..., None] * b.double(), lse


def states(dtype_a, dtype_b, width, gen):
    """The ring's layouts: state a the rows 5..5+ROWS of a larger (B, H, N, D) accumulator and its lse, state b a
    (B, ROWS, H, D) partial seen as (B, H, ROWS, D), its lse a transposed (B, ROWS, H); rows 0-2 of a empty (a
    ring's first step), 3-5 of b, 6-7 of both (a row no key reaches)."""
    n = ROWS + 11
    big = torch.randn(B, H, n, width, generator=gen, device=DEVICE).to(dtype_a)
    big_lse = 3 * torch.randn(B, H, n, generator=gen, device=DEVICE)
    rows = slice(5, 5 + ROWS)
    a, lse_a = big[:, :, rows], big_lse[:, :, rows]
    b = torch.randn(B, ROWS, H, width, generator=gen, device=DEVICE).to(dtype_b).transpose(1, 2)
    lse_b = (3 * torch.randn(B, ROWS, H, generator=gen, device=DEVICE)).transpose(1, 2)
    lse_a[:, :, 0:3] = lse_b[:, :, 3:6] = -math.inf
    lse_a[:, :, 6:8] = lse_b[:, :, 6:8] = -math.inf
    return big, big_lse, (a, lse_a, b, lse_b)


def check(got, got_lse, want, want_lse, low, low_lse, label):
    """got against float64 `want`, within 4 times the error of `low`, the same merge in PyTorch at got's precision,
    plus 1e-6; the log-sum-exps' -inf exactly where the reference's."""
    assert torch.equal(torch.isneginf(got_lse), torch.isneginf(want_lse)), label
    finite = ~torch.isneginf(want_lse)
    for name, g, w, lo in (("out", got, want, low), ("lse", got_lse[finite], want_lse[finite], low_lse[finite])):
        err = (g.double() - w).abs().max().item()
        bound = 4 * (lo.double() - w).abs().max().item() + 1e-6
        assert err <= bound, f"{label} {name}: error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("dtype_a, dtype_b", [(torch.float32, torch.bfloat16), (torch.float32, torch.float32),
                                              (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("width", [24, 80])
def test_merge_in_place_against_float64(dtype_a, dtype_b, width):
    gen = torch.Generator(DEVICE).manual_seed(width)
    big, big_lse, (a, lse_a, b, lse_b) = states(dtype_a, dtype_b, width, gen)
    want, want_lse = reference(a, lse_a, b, lse_b)
    low, low_lse = attngen.merge_states(a.transpose(1, 2), lse_a, b.transpose(1, 2), lse_b)
    before, before_lse = big.clone(), big_lse.clone()
    merge(a, lse_a, b, lse_b, a, lse_a)
    check(a, lse_a, want, want_lse, low.transpose(1, 2), low_lse, f"{dtype_a} <- {dtype_b} d={width}")
    assert (a[:, :, 6:8] == 0).all()  # (both empty: 0, as merge_states gives)
    outside = torch.ones(big.shape[2], dtype=torch.bool)
    outside[5:5 + ROWS] = False
    assert torch.equal(big[:, :, outside], before[:, :, outside])
    assert torch.equal(big_lse[:, :, outside], before_lse[:, :, outside])


def test_merge_into_a_poisoned_output():
    gen = torch.Generator(DEVICE).manual_seed(7)
    _, _, (a, lse_a, b, lse_b) = states(torch.float32, torch.bfloat16, 40, gen)
    a_before, lse_a_before = a.clone(), lse_a.clone()
    out = torch.full((B, ROWS, H, 40), float("nan"), device=DEVICE).transpose(1, 2)
    lse = torch.full((B, H, ROWS), float("nan"), device=DEVICE)
    merge(a, lse_a, b, lse_b, out, lse)
    want, want_lse = reference(a, lse_a, b, lse_b)
    low, low_lse = attngen.merge_states(a.transpose(1, 2), lse_a, b.transpose(1, 2), lse_b)
    check(out, lse, want, want_lse, low.transpose(1, 2), low_lse, "separate output")
    assert torch.equal(a, a_before) and torch.equal(lse_a, lse_a_before)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_states_fused_on_gpu(monkeypatch, dtype):
    """merge_states on a GPU under FUSED_MERGE: the kernel's result, within the bound of PyTorch's ops, at a
    decoding step's and a ring step's sizes."""
    gen = torch.Generator(DEVICE).manual_seed(3)
    for batch, rows, heads, width in ((8, 1, 32, 128), (1, 4099, 8, 128), (2, 33, 4, 96)):
        a, b = (torch.randn(batch, rows, heads, width, generator=gen, device=DEVICE).to(dtype) for _ in range(2))
        lse_a, lse_b = (3 * torch.randn(batch, heads, rows, generator=gen, device=DEVICE) for _ in range(2))
        lse_a[..., :1] = -math.inf
        lse_b[:, :1, -1:] = -math.inf
        low, low_lse = attngen.merge_states(a, lse_a, b, lse_b)
        monkeypatch.setattr(context_parallel, "FUSED_MERGE", True)
        out, lse = attngen.merge_states(a, lse_a, b, lse_b)
        monkeypatch.setattr(context_parallel, "FUSED_MERGE", False)
        want, want_lse = reference(a.transpose(1, 2), lse_a, b.transpose(1, 2), lse_b)
        assert out.dtype == dtype and out.is_contiguous() and lse.is_contiguous()
        check(out.transpose(1, 2), lse, want, want_lse, low.transpose(1, 2), low_lse, f"{dtype} {rows} rows")
