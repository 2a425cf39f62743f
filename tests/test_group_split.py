"""The Gluon backward's GQA group split (issue 51): where (batch x K/V heads x key tiles) leaves multiprocessors
idle, several programs share a group's query heads, each adding its heads' dK and dV in float32 into a workspace
that a pass after sums in order.

On the CPU: the policy's rule and the module's copy of it, the pass that sums the parts (Triton, in the
interpreter, bit for bit against the sums in order), `attngen explain`'s line, and the split kernel compiled
for sm_90 (ptxas: no more spills than the unsplit one). On a Hopper GPU (`gpu`): groups of 7 and 3 split against
float64 at odd lengths, deterministic algorithms bit for bit, and issue 51's rows at their real sizes taking the
Gluon kernels.
"""

import re
import subprocess
from pathlib import Path

import pytest
import torch

import attngen
from attngen.policy import hopper
from attngen.testing.accuracy import Case, compare_grads
from conftest import DEVICE, HAS_GPU, spec_text
from probe import probe

HOPPER = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)
PTXAS = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _waves_times_heads(programs, group, sms, parts):
    return -(-programs * parts // sms) * -(-group // parts)


@pytest.mark.parametrize("programs, group, sms, max_split, expected", [
    (68, 7, 132, 8, 7),      # issue 51's Qwen row: B=1, 4 K/V heads, 17 key tiles
    (68, 7, 132, 1, 1),      # never split
    (68, 7, 132, 3, 3),      # capped: 2 waves of 3 heads beat 1 wave of 7
    (1024, 7, 132, 8, 1),    # the grid fills the multiprocessors
    (132, 7, 132, 8, 1),
    (100, 2, 132, 8, 1),     # 2 waves of 1 head tie 1 wave of 2: the smaller count
    (33, 4, 132, 8, 4),      # 132 programs of 1 head
    (40, 1, 132, 8, 1),      # no group
    (17, 3, 132, 8, 3),
])
def test_the_split_rule(programs, group, sms, max_split, expected):
    split = hopper.group_split(programs, group, sms, max_split)
    assert split == expected
    if programs < sms:  # the fewest waves x heads a program among the allowed counts, the smallest of equals
        costs = {p: _waves_times_heads(programs, group, sms, p) for p in range(1, min(group, max_split) + 1)}
        assert costs[split] == min(costs.values()) and all(costs[p] > costs[split] for p in range(1, split))


def test_the_module_runs_the_policys_rule(monkeypatch):
    m = attngen.load(spec_text("gs_rule", 128, "bf16", "causal", direction="forward+backward", heads=28,
                               kv_heads=4)).module
    assert m.WS_BWD_SHAPE["max_group_split"] == hopper.BWD_MAX_GROUP_SPLIT > 1
    for args in ((68, 7, 132, 8), (17, 3, 132, 8), (500, 7, 132, 8), (5, 7, 78, 4)):
        assert m.group_split(*args) == hopper.group_split(*args)
    monkeypatch.setattr(hopper, "VARLEN_BACKWARD", True)  # (off by default; its own spec name here)
    varlen = attngen.load(spec_text("gs_varlen", 128, "bf16", "causal", direction="forward+backward", heads=8,
                                    kv_heads=2, layout="varlen"))
    assert varlen.program.warp_specialized.backward.max_group_split == 1  # its grid is over packed key tiles


@pytest.mark.parametrize("head_dim, dtype", [(128, "fp16"), (64, "fp16")])
@pytest.mark.parametrize("batch, kv_heads, split, n_k", [(1, 4, 7, 2049), (2, 1, 3, 77), (1, 2, 2, 130)])
def test_the_parts_are_summed_in_order(head_dim, dtype, batch, kv_heads, split, n_k):
    """attn_bwd_dkdv_sum_ws: dK and dV, poisoned first and laid out (B, N, H_KV, D), are the parts' float32 sums
    taken part by part in order (the same bits every run), in their dtype; rows past N_K are not written.
    (fp16: Triton's interpreter rounds float32 to bfloat16 toward zero, the GPU to nearest.)"""
    m = attngen.load(spec_text(f"gs_sum{head_dim}", head_dim, dtype, "causal", direction="forward+backward",
                               heads=4, kv_heads=1)).module
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    parts = torch.randn(2, batch, kv_heads * split, n_k, head_dim, device=DEVICE)
    dk, dv = (torch.full((batch, n_k + 3, kv_heads, head_dim), float("nan"), device=DEVICE).to(torch_dtype)
              .transpose(1, 2) for _ in range(2))
    block = m.WS_BWD_SHAPE["ROW_BLOCK"]
    m.attn_bwd_dkdv_sum_ws[(-(-n_k // block), kv_heads, batch)](
        parts, dk, dv, *dk.stride(), *dv.stride(), split, n_k, BLOCK=block, HEAD_DIM=head_dim)
    for out, mine in ((dk, parts[0]), (dv, parts[1])):
        want = torch.zeros(batch, kv_heads, n_k, head_dim, device=DEVICE)
        grouped = mine.view(batch, kv_heads, split, n_k, head_dim)
        for p in range(split):
            want = want + grouped[:, :, p]
        assert torch.equal(out[:, :, :n_k], want.to(torch_dtype))
        assert out[:, :, n_k:].isnan().all()


def test_explain_says_how_the_group_is_split(capsys, tmp_path):
    from attngen.cli import main

    spec = tmp_path / "qwen.attn"
    spec.write_text(spec_text("qwen_gs", 128, "bf16", "causal", direction="forward+backward", heads=28, kv_heads=4))
    main(["explain", "--shape", "B=1,H=28,H_KV=4,N=2049", str(spec)])
    out = capsys.readouterr().out
    assert "max_group_split=8" in out
    assert "68 dK/dV programs" in out and "split over 7 programs (476 in all" in out, out
    main(["explain", "--shape", "B=8,H=28,H_KV=4,N=2049", str(spec)])
    assert "544 dK/dV programs" in capsys.readouterr().out.split("Gluon backward grid")[1].split("\n")[1]


def _spills(ptx: str) -> int:
    done = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", ptx, "-o", "/dev/null"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", done.stderr))


@pytest.mark.skipif(not PTXAS.exists(), reason="Triton's ptxas is not installed")
def test_the_split_kernel_compiles_for_sm90_without_more_spills(tmp_path):
    """The dK/dV kernel with PARTIAL (float32 sums stored from registers, no dK/dV TMA stores) at both head dims,
    causal and not, the short shape too; ptxas spills no more than the unsplit kernel's. (Without dQ, the
    deterministic algorithms' kernel, it would spill more at d=128: that launch is never split.)"""
    paths = {(d, mask): str(attngen.load(spec_text(f"gs_probe{d}{mask[:3]}", d, "bf16", mask,
                                                   direction="forward+backward", heads=14, kv_heads=2)).path)
             for d in (64, 128) for mask in ("none", "causal")}
    cases = [(key, {}) for key in paths] + [((64, "causal"), {"short": True})]
    jobs = []
    for i, (key, extra) in enumerate(cases):
        for partial in (False, True):
            # (DQ_CLAIM: the partial kernel never claims, so the unsplit one compared without it)
            jobs.append(dict(path=paths[key], gluon_ws="backward", partial=partial, dq_claim=False,
                             ptx_to=str(tmp_path / f"{i}_{partial}.ptx"), **extra))
    results = probe(jobs)
    for job, result in zip(jobs, results):
        assert "error" not in result, (job, result)
        if job["partial"]:  # dK and dV from registers (no TMA store), the rest as unsplit
            assert result["tma_stores"] == 0 and result["global_stores"] > 0, (job, result)
        else:
            assert result["tma_stores"] >= 2 and result["global_stores"] == 0, (job, result)
    for unsplit, split in zip(jobs[::2], jobs[1::2]):
        assert _spills(split["ptx_to"]) <= _spills(unsplit["ptx_to"]), split


# -- on a Hopper GPU ---------------------------------------------------------------------------------------


class _LaunchSpy:
    """Stands in for a kernel: records each launch's grid and keyword arguments, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
@pytest.mark.parametrize("mask", ["none", "causal", "causal(bottom_right)"])
@pytest.mark.parametrize("dtype, head_dim", [("bf16", 128), ("fp16", 64)])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", [Case(1, 28, 4, 333, 333), Case(2, 21, 7, 200, 129), Case(1, 7, 1, 1000, 77),
                                  Case(1, 6, 2, 1, 65), Case(1, 14, 2, 2049, 2049)])
def test_split_groups_against_float64(mask, dtype, head_dim, deterministic, case, monkeypatch):
    """Groups of 7 and 3 split over programs (the multiprocessors counted as many, so that every call splits at
    the rule's count), dQ, dK and dV poisoned first; the launch's grid holds H_KV x split programs a key tile.
    Under deterministic algorithms the dK/dV kernels are not split, and two runs agree bit for bit."""
    kernel = attngen.load(spec_text(f"gs_{dtype}{head_dim}_g{case.heads}_{case.kv_heads}_{mask[:6]}{len(mask)}",
                                    head_dim, dtype, mask, direction="forward+backward", heads=case.heads,
                                    kv_heads=case.kv_heads))
    m = kernel.module
    monkeypatch.setitem(m.WS_BWD_SHAPE, "min_scores", 0)
    monkeypatch.setitem(m.WS_BWD_SHAPE, "min_keys", 0)
    monkeypatch.setattr(m, "_ws_device", lambda device: (True, 100000))
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
    spy, sums = _LaunchSpy(m.attn_bwd_dkdv_ws), _LaunchSpy(m.attn_bwd_dkdv_sum_ws)
    monkeypatch.setattr(m, "attn_bwd_dkdv_ws", spy)
    monkeypatch.setattr(m, "attn_bwd_dkdv_sum_ws", sums)
    torch_dtype = kernel.spec.dtype.torch
    q, do = (torch.randn(case.batch, case.heads, case.n_q, head_dim, device="cuda").to(torch_dtype) for _ in range(2))
    k, v = (torch.randn(case.batch, case.kv_heads, case.n_k, head_dim, device="cuda").to(torch_dtype) for _ in range(2))
    out, lse = kernel.forward(q, k, v, kernel.spec.softmax_scale)
    group = case.heads // case.kv_heads
    split = m.ws_bwd_group_split(case.batch, case.kv_heads, group, case.n_k, q.device)
    assert 1 < split <= group
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    kernel.backward(q, k, v, out, lse, do, grads=grads)
    if not deterministic:
        (grid, kwargs), = spy.launches
        assert grid[1] == case.kv_heads * split and kwargs["PARTIAL"] and not kwargs["DQ_CLAIM"]
        assert len(sums.launches) == 1
    else:  # the Gluon dK/dV kernel (d=128), not split, or the Triton one, whose split sums in order too (pass group-split)
        assert [(grid[1], kwargs["PARTIAL"]) for grid, kwargs in spy.launches] == (
            [(case.kv_heads, False)] if m.WS_BWD_SHAPE["split"] else [])
        block_n = kernel.backward_config(q, k)["attn_bwd_dkdv"]["BLOCK_N"]
        triton_split = 1 if m.WS_BWD_SHAPE["split"] else m.bwd_group_split(case.batch, case.kv_heads, group, case.n_k,
                                                                          block_n, q.device)
        assert len(sums.launches) == (1 if triton_split > 1 else 0)
    results = compare_grads(kernel.spec, q, k, v, do, grads)
    assert all(r.ok for r in results), results
    if deterministic:
        again = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        kernel.backward(q, k, v, out, lse, do, grads=again)
        assert all(torch.equal(a, b) for a, b in zip(grads, again))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels run on sm_90 only")
@pytest.mark.parametrize("head_dim, batch, heads, kv_heads, n, gluon_forward", [
    (128, 1, 28, 4, 2049, True),   # Qwen: its backward split over the group
    (64, 3, 12, 12, 3000, True),   # odd lengths: masked tail tiles, not a fallback
    (64, 16, 32, 32, 1024, False),  # causal d=64 under MIN_KEYS keys: the Triton forward (measured faster)
])
def test_issue_51_rows_take_the_gluon_kernels(head_dim, batch, heads, kv_heads, n, gluon_forward, monkeypatch):
    """Issue 51's small and ragged shapes at their real sizes, causal, through attngen.attention's layout ((B, N,
    H, D) storage): which kernels they take, and their gradients against float64."""
    kernel = attngen.load(spec_text(f"gs_row{head_dim}_{heads}_{kv_heads}", head_dim, "bf16", "causal",
                                    direction="forward+backward", heads=heads, kv_heads=kv_heads))
    m = kernel.module
    q, do = (torch.randn(batch, n, heads, head_dim, device="cuda").bfloat16().transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(batch, n, kv_heads, head_dim, device="cuda").bfloat16().transpose(1, 2) for _ in range(2))
    out, lse = kernel.forward(q, k, v, kernel.spec.softmax_scale)
    assert m.ws_ready(q, k, v, out) is gluon_forward
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    assert m.ws_bwd_ready(q, k, v, do, grads[1], grads[2])
    split = m.ws_bwd_group_split(batch, kv_heads, heads // kv_heads, n, q.device)
    assert (split > 1) is (heads // kv_heads == 7)
    kernel.backward(q, k, v, out, lse, do, grads=grads)
    results = compare_grads(kernel.spec, q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous(), grads)
    assert all(r.ok for r in results), results
