"""The Triton backward's GQA group split (issue 51, pass group-split): where attn_bwd_dkdv's grid (batch x K/V
heads x key tiles) leaves multiprocessors idle, attn_bwd_dkdv_split's programs each take a part of a group's query
heads and store float32 dK and dV parts, which the Gluon path's pass sums in order.

On the CPU: the pass's IR and the verifier's checks, the rule shared with the Gluon backward, groups of 7 and 3
split (the multiprocessors counted as many) against float64 at odd lengths, bit for bit run to run under
deterministic algorithms, and `attngen explain`'s line. On a GPU (`gpu`): the same at larger sizes with the Triton
backward asked for, and issue 51's 28/4 row split.
"""

from dataclasses import replace

import pytest
import torch

import attngen
from attngen import ir
from attngen.errors import InternalError
from attngen.ir.verify import verify
from attngen.lang.spec import parse
from attngen.passes import compile_program, group_split
from attngen.policy import configs, hopper, splits
from attngen.testing.accuracy import Case, compare_grads
from conftest import DEVICE, HAS_GPU, spec_text


def _program(name, mask="causal", **extra):
    return compile_program(parse(spec_text(name, 64, "bf16", mask, direction="forward+backward", **extra)))


def test_the_pass_adds_a_split_copy_of_the_dkdv_kernel():
    program = _program("tgs_ir", heads=28, kv_heads=4)
    assert program.triton_backward == ir.TritonBackward(max_group_split=configs.BWD_MAX_GROUP_SPLIT,
                                                        sum_block=configs.BWD_SUM_ELEMENTS // 64)
    whole, split = program.kernel("attn_bwd_dkdv"), program.kernel(group_split.KERNEL)
    text = ir.format_kernel(split)
    assert "grid part in [0, GROUP_SPLIT)" in text
    assert "for g in [((GROUP*part) // GROUP_SPLIT), ((GROUP*(part + 1)) // GROUP_SPLIT))" in text
    assert "store DK_PART[b, hkv, part, start_n:+BLOCK_N (<N_K), :HEAD_DIM] = dk * sm_scale" in text
    assert "out DK_PART: hbm fp32[B, H_KV, GROUP_SPLIT, N_K, HEAD_DIM]" in text
    # the group loop's body (causal-skip's ranges, the masks, the loads) is attn_bwd_dkdv's, which stays as it was
    (mine,), (theirs,) = ([st for st in ir.walk_stmts(k.body) if isinstance(st, ir.Loop) and st.var == group_split.g]
                          for k in (split, whole))
    assert mine.body == theirs.body and len(mine.body) == 3
    assert (theirs.start, theirs.stop) == (0, ir.sym.GROUP)
    assert "triton backward: max_group_split=8, sum_block=64" in ir.format_program(program)


@pytest.mark.parametrize("extra, why", [
    (dict(heads=8, kv_heads=2, layout="varlen"), "varlen: a grid over packed key tiles"),
    (dict(heads=8, kv_heads=2, head_dim_v=32), "two head dims: the summing pass takes one width"),
    (dict(), "forward only"),
])
def test_the_pass_leaves_these_alone(extra, why):
    direction = "forward" if not extra else "forward+backward"
    program = compile_program(parse(spec_text(f"tgs_no{len(extra)}", 64, "bf16", "causal", direction=direction,
                                              **extra)))
    assert program.triton_backward.max_group_split == 1, why
    assert all(k.name != group_split.KERNEL for k in program.kernels), why


def test_the_policy_turns_it_off(monkeypatch):
    monkeypatch.setattr(configs, "BWD_MAX_GROUP_SPLIT", 1)
    program = _program("tgs_off", heads=28, kv_heads=4)
    assert program.triton_backward == ir.TritonBackward()
    assert [k.name for k in program.kernels] == ["attn_fwd", "attn_bwd_dq", "attn_bwd_dkdv"]


def test_the_verifier_holds_the_field_to_the_kernel():
    program = _program("tgs_verify", heads=6, kv_heads=2)
    without = replace(program, kernels=tuple(k for k in program.kernels if k.name != group_split.KERNEL))
    with pytest.raises(InternalError, match="max_group_split 8 without attn_bwd_dkdv_split"):
        verify(without, "test")
    with pytest.raises(InternalError, match="max_group_split 1 with attn_bwd_dkdv_split"):
        verify(replace(program, triton_backward=ir.TritonBackward()), "test")
    with pytest.raises(InternalError, match="sum_block 24"):
        verify(replace(program, triton_backward=ir.TritonBackward(8, 24)), "test")
    split = program.kernel(group_split.KERNEL)
    rounded = replace(split, params=tuple(replace(p, dtype=ir.DT.BF16) if p.name == "DV_PART" else p
                                          for p in split.params))
    with pytest.raises(InternalError, match="DV_PART is"):
        verify(program.replace_kernel(rounded), "test")


def test_one_rule_for_both_backwards():
    assert hopper.group_split is splits.group_split
    m = attngen.load(spec_text("tgs_rule", 32, "fp16", "causal", direction="forward+backward", heads=28,
                               kv_heads=4)).module
    assert m.TRITON_BWD_SHAPE == {"max_group_split": configs.BWD_MAX_GROUP_SPLIT, "SUM_BLOCK": 4096 // 32}
    for args in ((68, 7, 132, 8), (17, 3, 132, 8), (500, 7, 132, 8), (5, 7, 78, 4)):
        assert m.group_split(*args) == splits.group_split(*args)
    cpu = torch.device("cpu")  # the interpreter counts as 8 multiprocessors (splits.multiprocessors)
    assert m.bwd_group_split(1, 4, 7, 2049, 128, cpu) == splits.group_split(68, 7, 8, 8) == 1
    assert m.bwd_group_split(1, 1, 7, 77, 64, cpu) == splits.group_split(2, 7, 8, 8) == 4


class _Spy:
    """Stands in for a launcher: records its keyword arguments, then calls it."""

    def __init__(self, launch):
        self.launch, self.calls = launch, []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        return self.launch(**kwargs)


def _split_run(kernel, case, monkeypatch, dtype):
    """Forward, then the backward into NaN-poisoned gradients with every group split as far as the rule lets it
    (the multiprocessors counted as many); returns the inputs, the gradients and the split launches' parts."""
    m = kernel.module
    monkeypatch.setattr(m, "multiprocessors", lambda device: 1 << 20)
    spy = _Spy(m.launch_attn_bwd_dkdv_split)
    monkeypatch.setattr(m, "launch_attn_bwd_dkdv_split", spy)
    d = kernel.spec.head_dim
    q, do = (torch.randn(case.batch, case.heads, case.n_q, d, device=DEVICE).to(dtype) for _ in range(2))
    k, v = (torch.randn(case.batch, case.kv_heads, case.n_k, d, device=DEVICE).to(dtype) for _ in range(2))
    out, lse = kernel.forward(q, k, v, kernel.spec.softmax_scale)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    kernel.backward(q, k, v, out, lse, do, grads=grads)
    return (q, k, v, do), grads, [call["dk_part"].shape[2] for call in spy.calls]


@pytest.mark.parametrize("mask", ["none", "causal", "causal(bottom_right)"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("case", [Case(1, 7, 1, 45, 77), Case(2, 6, 2, 70, 33), Case(1, 14, 2, 1, 65)])
def test_split_groups_against_float64(mask, dtype, case, monkeypatch):
    """Groups of 7 (7 parts) and 3 (3 parts), dQ, dK and dV poisoned first, against float64."""
    kernel = attngen.load(spec_text(f"tgs_{dtype}_{case.heads}_{mask[:6]}{len(mask)}", 32, dtype, mask,
                                    direction="forward+backward", heads=case.heads, kv_heads=case.kv_heads))
    inputs, grads, parts = _split_run(kernel, case, monkeypatch, kernel.spec.dtype.torch)
    assert parts == [case.heads // case.kv_heads]
    results = compare_grads(kernel.spec, *inputs, grads)
    assert all(r.ok for r in results), results


def test_split_is_deterministic_and_matches_the_whole_group(monkeypatch):
    """Under deterministic algorithms two split runs agree bit for bit; the split's dK and dV are the unsplit
    kernel's up to the float32 sums' order."""
    kernel = attngen.load(spec_text("tgs_det", 32, "bf16", "causal", direction="forward+backward", heads=6,
                                    kv_heads=2))
    case = Case(1, 6, 2, 50, 61)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        with monkeypatch.context() as mp:
            mp.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
            inputs, first, parts = _split_run(kernel, case, mp, torch.bfloat16)
        torch.manual_seed(0)
        with monkeypatch.context() as mp:
            mp.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
            _, second, _ = _split_run(kernel, case, mp, torch.bfloat16)
    assert parts == [3]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    whole = tuple(torch.full_like(t, float("nan")) for t in first)
    out, lse = kernel.forward(*inputs[:3], kernel.spec.softmax_scale)
    with monkeypatch.context() as mp:
        mp.setattr(kernel.module, "multiprocessors", lambda device: 1)  # the grid fills them: no split
        kernel.backward(*inputs[:3], out, lse, inputs[3], grads=whole)
    assert torch.equal(first[0], whole[0])  # dQ's kernel is the same
    for split, unsplit in zip(first[1:], whole[1:]):
        torch.testing.assert_close(split, unsplit, atol=1e-2, rtol=1e-2)


def test_explain_says_how_the_triton_group_is_split(capsys, tmp_path):
    from attngen.cli import main

    spec = tmp_path / "qwen.attn"
    spec.write_text(spec_text("qwen_tgs", 128, "bf16", "causal", direction="forward+backward", heads=28, kv_heads=4))
    main(["explain", "--shape", "B=1,H=28,H_KV=4,N=2049", str(spec)])
    out = capsys.readouterr().out
    assert "triton backward: max_group_split=8, sum_block=32" in out
    section = out.split("=== Triton backward grid")[1]
    assert "68 dK/dV programs (B x H_KV x 128-key tiles) for groups of 7 query heads: each group split over 7" in section
    main(["explain", "--shape", "B=8,H=28,H_KV=4,N=2049", str(spec)])
    assert "each program walks its whole group" in capsys.readouterr().out.split("=== Triton backward grid")[1]


# -- on a GPU ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("dtype, head_dim", [("bf16", 128), ("fp16", 64)])
@pytest.mark.parametrize("case", [Case(1, 28, 4, 2049, 2049), Case(1, 21, 7, 333, 1000), Case(2, 6, 2, 777, 129)])
def test_triton_split_on_the_gpu(mask, dtype, head_dim, case, monkeypatch):
    """The Triton backward (the Gluon one refused through the policy) at real sizes: issue 51's 28/4 row splits at
    the device's own multiprocessors; every case split as far as the rule lets it against float64, and bit for bit
    the same on a second run."""
    monkeypatch.setattr(hopper, "BWD_HEAD_DIMS", ())  # (the spec names below are this test's: compiled here)
    kernel = attngen.load(spec_text(f"tgs_gpu_{dtype}{head_dim}_{case.heads}_{case.n_k}_{mask}", head_dim, dtype,
                                    mask, direction="forward+backward", heads=case.heads, kv_heads=case.kv_heads))
    m = kernel.module
    assert kernel.program.warp_specialized.backward is None
    group = case.heads // case.kv_heads
    if case.n_k == 2049 and head_dim == 128 and mask == "causal":
        block_n = kernel.backward_config(torch.empty(1, case.heads, case.n_q, head_dim, device="cuda"),
                                         torch.empty(1, case.kv_heads, case.n_k, head_dim, device="cuda"))
        split = m.bwd_group_split(1, 4, 7, 2049, block_n["attn_bwd_dkdv"]["BLOCK_N"], torch.device("cuda"))
        assert split > 1, block_n  # (68 programs of 128 keys on 132 multiprocessors at the default config)
    inputs, grads, parts = _split_run(kernel, case, monkeypatch, kernel.spec.dtype.torch)
    assert parts == [min(group, configs.BWD_MAX_GROUP_SPLIT)]
    results = compare_grads(kernel.spec, *inputs, grads)
    assert all(r.ok for r in results), results
    again = tuple(torch.full_like(t, float("nan")) for t in grads)  # the same bits run to run: no atomics
    out, lse = kernel.forward(*inputs[:3], kernel.spec.softmax_scale)
    kernel.backward(*inputs[:3], out, lse, inputs[3], grads=again)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
