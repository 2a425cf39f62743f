"""The warp-specialize pass and the Hopper Gluon kernels it brings (passes/warp_specialize.py): the
forward, and the backward (dQ, dK, dV in one kernel; dK, dV only beside the Triton dQ kernel).

On the CPU: which specs get it, that the generated Gluon kernels compile for sm_90 (Triton's own
compiler, in a subprocess), the backward's row passes (Triton kernels, in the interpreter), and that
every call without a Hopper GPU runs the Triton kernels. On a Hopper GPU (`gpu`): the Gluon kernels
against float64 at odd sizes, GQA and strided inputs, with the outputs poisoned first, deterministic
algorithms, and the fallback for inputs TMA cannot read.
"""

import random
from dataclasses import replace

import pytest
import torch

import attngen
from attngen.testing.accuracy import Case, compare, compare_grads
from attngen.passes import compile_program, warp_specialize
from attngen import tuning
from attngen.lang.spec import parse
from attngen.policy import hopper
from conftest import DEVICE, HAS_GPU, spec_text
from probe import probe

HOPPER = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("text, expected", [
    (spec_text("a", 128, "bf16", "none"), True),
    (spec_text("b", 64, "fp16", "none"), True),
    (spec_text("c", 128, "bf16", "none", direction="forward+backward"), True),
    (spec_text("d", 128, "bf16", "none", heads=32, kv_heads=8), True),
    (spec_text("e", 128, "bf16", "causal"), True),
    (spec_text("e2", 64, "fp16", "causal(bottom_right)", heads=8, kv_heads=2), True),
    (spec_text("f", 128, "fp32", "none"), False),  # wgmma on 16-bit inputs only
    (spec_text("g", 80, "fp16", "none"), False),  # padded head dim
    (spec_text("h", 32, "fp16", "none"), False),
    (spec_text("i", 128, "bf16", "none", kv_layout="contiguous", split_kv=4), False),  # decoding kernels
    (spec_text("j", 128, "bf16", "none", block_n=64), False),  # tiles fixed by hand: kept, in the Triton kernel
])
def test_which_specs_get_the_gluon_forward(text, expected):
    program = compile_program(parse(text))
    assert warp_specialize.applies(program) is expected
    gluon = program.warp_specialized.forward
    shape = gluon.constants() if gluon is not None else {}
    spec = parse(text)
    min_keys = hopper.MIN_KEYS.get((spec.head_dim, spec.mask.is_causal))
    short_keys = hopper.SHORT_KEYS.get((spec.head_dim, spec.mask.is_causal))
    rows = {64: 192, 128: 128}.get(spec.head_dim)  # three consumer warpgroups of 64 rows at d=64, two at d=128
    short = hopper.FORWARD_SHORT.get((spec.head_dim, spec.mask.is_causal))
    assert (shape.get("BLOCK_M") == rows and shape.get("min_keys") == min_keys and shape.get("EARLY_P") is True
            and shape.get("SHORT_BLOCK_M") == (short and short.block_m)
            and shape.get("SHORT_BLOCK_N") == (short and short.block_n)
            and shape.get("TRIM") is True and shape.get("PERSISTENT") is True
            and shape.get("short_keys") == short_keys
            and shape.get("BALANCE") is hopper.BALANCE.get((spec.head_dim, spec.mask.is_causal))) is expected
    kernel = attngen.load(text)
    assert hasattr(kernel.module, "attn_fwd_ws") is expected
    passes = kernel.source.split("\n", 3)[2].removeprefix("# Passes: ").rstrip(".").split(", ")  # the header line
    assert ("warp-specialize" in passes) is expected


def _makespans(plan, slot, P, n_m, HB):
    """(place order, dealt) longest program of a persistent grid of P programs over n_m * HB units, a short unit
    (t % n_m == n_m - 1) costing half; checks that each round of the dealt order takes every unit once."""
    T = n_m * HB
    E, r1, J1 = plan(P, n_m, HB)
    place, dealt = [0.0] * P, [0.0] * P
    for r in range(-(-T // P)):
        got = set()
        for p in range(P):
            if r * P + p < T:
                place[p] += 0.5 if (r * P + p) % n_m == n_m - 1 else 1.0
            t, ok = slot(r, p, P, n_m, HB, E, r1, J1)
            if ok:
                assert r * P <= t < min(T, r * P + P) and t not in got, (P, n_m, HB, r, p, t)
                got.add(t)
                dealt[p] += 0.5 if t % n_m == n_m - 1 else 1.0
        assert len(got) == min(P, T - r * P), (P, n_m, HB, r)
    return max(place), max(dealt)


@pytest.mark.parametrize("mask", ["none", "causal(top_left)"])
def test_the_persistent_grid_deals_short_tiles_evenly(mask):
    """_ws_balanced_slot (plain integer arithmetic, run here as Python) deals each round's units to the programs
    as a permutation; at the bench's d=64 shapes on 132 SMs the longest program's work drops (place order gave
    a few programs every short tile), and it is never worse than place order by more than one short unit."""
    module = attngen.load(spec_text(f"ws_balance_{mask[:6]}", 64, "bf16", mask)).module
    assert module.WS_SHAPE["BALANCE"] is hopper.BALANCE[(64, mask != "none")] is True
    plan, slot = module._ws_balance_plan.fn, module._ws_balanced_slot.fn
    # (P, units a head, heads x batches) -> (place order, dealt): N = 1024, 2048, 4096 without a mask
    # (192-row tiles), causal N = 4096 (11 pairs a head, the first with a 64-row tile)
    for shape, want in {(132, 6, 512): (24, 21.5), (132, 11, 256): (22, 20.5), (132, 22, 128): (22, 21),
                        (132, 11, 128): (11, 10.5), (132, 43, 64): (21, 21)}.items():
        assert _makespans(plan, slot, *shape) == want, shape
    rng = random.Random(0)
    for _ in range(300):
        shape = rng.randint(1, 140), rng.randint(1, 90), rng.randint(1, 40)
        place, dealt = _makespans(plan, slot, *shape)
        assert dealt <= place + 0.5, shape


def test_the_gluon_kernel_compiles_for_sm90():
    shapes = ((128, "bf16", "none"), (64, "fp16", "none"), (128, "fp16", "causal(bottom_right)"))
    kernels = [attngen.load(spec_text(f"ws{d}{mask[:3]}", d, dt, mask)) for d, dt, mask in shapes]
    # each spec's kernel as launched, and at its shape for short sequences where it has one (d=64: two consumer
    # warpgroups; causal d=128: 64-key blocks)
    jobs = [(k.module.WS_SHAPE, {"path": str(k.path), "gluon_ws": True, "short": short})
            for k in kernels for short in (False, True) if not short or k.module.WS_SHAPE["short_keys"]]
    assert len(jobs) == 5
    for (shape, job), result in zip(jobs, probe([job for _, job in jobs])):
        assert "error" not in result, result
        # consumer warpgroups (three at d=64, two at d=128 and in d=64's short shape) + the loader warp padded to a
        # warpgroup; both products on wgmma, K/V by TMA
        consumers = shape["SHORT_consumers" if job["short"] else "consumers"]
        assert result["warps"] == 4 * (1 + consumers) and result["wgmma"] > 0 and result["tma_loads"] >= 3, result
        assert result["shared"] <= 232448, result


@pytest.mark.parametrize("text, expected", [
    (spec_text("bw_a", 128, "bf16", "none", direction="forward+backward"),
     dict(PREFETCH=False, STAGES=2, split=True, ROW_BLOCK=32, dq_local_rows=0, short_keys=0)),
    (spec_text("bw_b", 128, "fp16", "causal(bottom_right)", direction="forward+backward", heads=8, kv_heads=2),
     dict(PREFETCH=True, STAGES=2, split=True, ROW_BLOCK=32, dq_local_rows=0, short_keys=0)),
    (spec_text("bw_c", 64, "bf16", "none", direction="forward+backward"),
     dict(PREFETCH=False, STAGES=3, split=False, ROW_BLOCK=64, dq_local_rows=1024, short_keys=0)),
    (spec_text("bw_c2", 64, "fp16", "causal", direction="forward+backward"),  # short: one consumer of 64 keys
     dict(PREFETCH=True, STAGES=2, split=False, ROW_BLOCK=64, dq_local_rows=0, short_keys=2048, SHORT_BLOCK_N=64,
          SHORT_consumers=1, SHORT_STAGES=3, SHORT_maxnreg=128)),
    (spec_text("bw_d", 128, "bf16", "none"), None),  # forward only
    (spec_text("bw_e", 128, "fp32", "none", direction="forward+backward"), None),
    (spec_text("bw_f", 80, "fp16", "none", direction="forward+backward"), None),
])
def test_which_specs_get_the_gluon_backward(text, expected):
    program = compile_program(parse(text))
    gluon = program.warp_specialized.backward
    shape = gluon.constants() if gluon is not None else None
    assert (shape is None) is (expected is None)
    kernel = attngen.load(text)
    assert hasattr(kernel.module, "attn_bwd_dkdv_ws") is (expected is not None)
    if shape is not None:
        shape = dict(shape)
        assert {key: shape[key] for key in expected} == expected
        assert shape["BLOCK_N"] == 128 and shape["DQ_ATOMIC"] and shape["ROWS_SMEM"]
        assert shape["min_keys"] == hopper.BWD_MIN_KEYS[program.attr("mask") != "none"]
        key = (program.attr("head_dim"), program.attr("mask") != "none")
        assert shape["LATE_ROWS"] == hopper.BWD_LATE_ROWS[key]
        assert shape["dq_claim_keys"] == hopper.BWD_DQ_CLAIM_KEYS[key]
        assert shape["dq_claim_keys"] == (1024 if key == (128, True) else 0)
        # the shape for short sequences keeps a consumer's keys (one K/V descriptor) and is taken up to short_keys
        assert shape["SHORT_BLOCK_N"] // shape["SHORT_consumers"] == shape["BLOCK_N"] // shape["consumers"] == 64
        short = shape["short_keys"]
        assert kernel.module.ws_bwd_shape(max(short, 1)) == ("SHORT_" if short else "") and kernel.module.ws_bwd_shape(short + 1) == ""
        if not short:
            assert all(shape["SHORT_" + k] == shape[k] for k in ("BLOCK_N", "STAGES", "consumers", "maxnreg"))


def test_the_gluon_backward_compiles_for_sm90():
    paths = [attngen.load(spec_text(f"wsb{mask[:3]}{d}", d, dt, mask, direction="forward+backward")).path
             for d, dt, mask in ((128, "bf16", "none"), (128, "fp16", "causal(top_left)"),
                                 (128, "bf16", "causal(bottom_right)"), (64, "bf16", "none"), (64, "fp16", "causal"))]
    jobs = [{"path": str(p), "gluon_ws": "backward"} for p in paths]
    jobs += [{"path": str(p), "gluon_ws": "backward", "dq_atomic": False} for p in paths[:2]]  # dK, dV only
    jobs += [{"path": str(p), "gluon_ws": "backward", "dq_local": True} for p in (paths[0], paths[3])]  # DQ_LOCAL
    # every LATE_ROWS at both head dims, not only the pass's (d=128 1 without a mask, 2 causal; d=64 0)
    jobs += [{"path": str(paths[i]), "gluon_ws": "backward", "late_rows": r} for i, r in ((0, 0), (0, 2), (3, 1), (3, 2))]
    # DQ_CLAIM at both head dims (the pass's: d=128 causal), and off where the pass has it
    jobs += [{"path": str(paths[i]), "gluon_ws": "backward", "dq_claim": c} for i, c in ((0, True), (1, False), (4, True))]
    # causal d=64's shape for short sequences (one consumer), with and without DQ_LOCAL and dQ
    jobs += [{"path": str(paths[4]), "gluon_ws": "backward", "short": True, **extra}
             for extra in ({}, {"dq_local": True}, {"dq_atomic": False})]
    for job, result in zip(jobs, probe(jobs)):
        assert "error" not in result, (job, result)
        # Q and dO streamed, K and V once per consumer, dK and dV stored by TMA; all products on wgmma; consumer
        # warpgroups and the loader warp padded to a warpgroup
        consumers = 1 if job.get("short") else 2
        assert result["warps"] == 4 * (1 + consumers) and result["wgmma"] > 0, result
        if job.get("short"):  # two programs share a multiprocessor (228 KB, 1 KB of it reserved per program)
            assert 2 * (result["shared"] + 1024) <= 233472, result
        assert result["tma_loads"] >= 2 + 2 * consumers and result["tma_stores"] >= 2, result
        # with dQ: each consumer's columns (DQ_LOCAL: its keys' partial sum, every column) added into the
        # float32 accumulator by a TMA reduction
        assert (result["tma_reduces"] > 0) is job.get("dq_atomic", True), (job, result)
        # DQ_CLAIM: a claimed tile's first part stored by TMA beside dK and dV
        claim = job.get("dq_claim", job["path"] in map(str, paths[1:3])) and job.get("dq_atomic", True)
        assert (result["tma_stores"] > 4) is claim, (job, result)
        assert result["shared"] <= 232448, result


def test_tune_says_which_calls_the_gluon_kernels_take():
    """`attngen tune` notes on Hopper that big calls run the fixed-shape Gluon kernels it does not tune."""
    from attngen.cli import gluon_note

    train = attngen.load(spec_text("ws_tune_note", 128, "bf16", "causal", direction="forward+backward"))
    forward, dq, dkdv = tuning.tunables(train)
    for part in (forward, dq, dkdv):
        note = gluon_note(part, (9, 0))
        assert note and f"{part.kind} calls" in note and f"{2 ** 25:,}" in note, note
        assert ("deterministic" in note) is (part.kind == "backward")
        assert gluon_note(part, (8, 0)) is None and gluon_note(part, None) is None
    fp32 = attngen.load(spec_text("ws_tune_note32", 128, "fp32", "none", direction="forward+backward"))
    assert all(gluon_note(part, (9, 0)) is None for part in tuning.tunables(fp32))


@pytest.mark.parametrize("n_q, head_dim", [(1, 64), (70, 128), (129, 64)])
def test_the_backward_row_passes(n_q, head_dim):
    """attn_bwd_prep_ws (lse in log2 units, +inf past N_Q and for rows that saw no key; delta; zeros
    into the dQ accumulator) and attn_bwd_dq_ws (dQ = sm_scale * accumulator), in Triton."""
    m = attngen.load(spec_text(f"wsb_rows{head_dim}", head_dim, "fp16", "causal(bottom_right)",
                               direction="forward+backward")).module
    B, H, block = 2, 3, m.WS_BWD_SHAPE["ROW_BLOCK"]  # rows per program; the rows are laid out in query blocks
    assert m.WS_BWD_SHAPE["BLOCK_M"] % block == 0 and block * head_dim == 4096
    n_pad = -(-n_q // m.WS_BWD_SHAPE["BLOCK_M"]) * m.WS_BWD_SHAPE["BLOCK_M"]
    out, do = (torch.randn(B, H, n_q, head_dim, device=DEVICE).half() for _ in range(2))
    do = do.transpose(1, 2).contiguous().transpose(1, 2)  # (B, N, H, D) storage: strides are honoured
    lse = torch.randn(B, H, n_q, device=DEVICE) * 4
    lse[0, 1, 0] = float("-inf")  # a row that saw no key
    rows = torch.full((B, H, 2, n_pad), float("nan"), device=DEVICE)
    acc = torch.full((B, H, n_q, head_dim), float("nan"), device=DEVICE)
    grid = (n_pad // block, H, B)
    m.attn_bwd_prep_ws[grid](out, do, lse, rows, acc, lse, *out.stride(), *do.stride(), *lse.stride(), H, n_q, n_pad, 0,
                             BLOCK=block, HEAD_DIM=head_dim, CLAIMS=0, BLOCK_M=m.WS_BWD_SHAPE["BLOCK_M"])
    want_lse = torch.full((B, H, n_pad), float("inf"), device=DEVICE)
    want_lse[..., :n_q] = torch.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    want_delta = torch.zeros(B, H, n_pad, device=DEVICE)
    want_delta[..., :n_q] = (out.double() * do.double()).sum(-1).float()
    torch.testing.assert_close(rows[:, :, 0], want_lse)
    torch.testing.assert_close(rows[:, :, 1], want_delta, rtol=1e-4, atol=1e-4)
    assert torch.equal(acc, torch.zeros_like(acc))
    # DQ_CLAIM: the claim words zeroed instead, and the accumulator only below ZERO_ROWS (rows no key block reaches)
    claims = torch.full((B, H, n_pad // m.WS_BWD_SHAPE["BLOCK_M"], 2), -1, device=DEVICE, dtype=torch.int32)
    acc.fill_(float("nan"))
    rows.fill_(float("nan"))
    zero_rows = 64 if n_q > 64 else 0
    m.attn_bwd_prep_ws[grid](out, do, lse, rows, acc, claims, *out.stride(), *do.stride(), *lse.stride(), H, n_q, n_pad,
                             zero_rows, BLOCK=block, HEAD_DIM=head_dim, CLAIMS=2, BLOCK_M=m.WS_BWD_SHAPE["BLOCK_M"])
    assert torch.equal(claims, torch.zeros_like(claims))
    assert torch.equal(acc[:, :, :zero_rows], torch.zeros_like(acc[:, :, :zero_rows]))
    assert acc[:, :, zero_rows:].isnan().all()
    torch.testing.assert_close(rows[:, :, 0], want_lse)
    torch.testing.assert_close(rows[:, :, 1], want_delta, rtol=1e-4, atol=1e-4)
    acc.normal_()
    dq = torch.full((B, n_q, H, head_dim), float("nan"), device=DEVICE).half().transpose(1, 2)
    m.attn_bwd_dq_ws[(n_pad // block, H, B)](acc, dq, *dq.stride(), H, n_q, 0.125, BLOCK=block, HEAD_DIM=head_dim)
    torch.testing.assert_close(dq, (acc * 0.125).half())


def test_without_hopper_the_triton_kernel_runs(monkeypatch):
    kernel = attngen.load(spec_text("ws_fallback", 64, "fp16", "none"))
    q, k, v = (torch.randn(1, 2, n, 64, device=DEVICE).half() for n in (37, 53, 53))
    if not HOPPER:
        assert not kernel.module.ws_ready(q, k, v, q)
    called = []
    monkeypatch.setattr(kernel.module, "launch_attn_fwd_ws", lambda *a: called.append(a))
    out, lse = kernel.module.forward(q, k, v, config={"warp_specialized": False})
    assert not called
    result = compare(kernel.spec, Case(1, 2, 2, 37, 53), out, lse, q, k, v)
    assert result.ok, result


class PoisonedTorch:
    """A generated module's `torch` whose `empty` hands out NaN (floating) or -1 (integer) filled tensors."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def empty(self, *shape, **kwargs):
        out = self.real.empty(*shape, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -1)


def _poisoned_run(kernel, q, k, v):
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device=q.device)
    kernel.module.forward(q, k, v, kernel.spec.softmax_scale, out=out, lse=lse)
    return out, lse


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon forward runs on sm_90 only")
@pytest.mark.parametrize("mask", ["none", "causal(top_left)", "causal(bottom_right)"])
@pytest.mark.parametrize("dtype, head_dim", [("bf16", 128), ("fp16", 64), ("fp16", 128)])
@pytest.mark.parametrize("case", [Case(2, 4, 4, 200, 333), Case(1, 8, 2, 129, 128), Case(1, 2, 2, 1, 1),
                                  Case(3, 2, 1, 64, 4097), Case(1, 2, 2, 1000, 77), Case(1, 4, 2, 333, 2111),
                                  Case(2, 2, 2, 1500, 1500)])
@pytest.mark.parametrize("programs", [None, 3, 7])
def test_gluon_forward_against_float64(mask, dtype, head_dim, case, programs, monkeypatch):
    """programs=None: the grid as shipped; 3 and 7: a persistent grid of that many programs, so that every
    program takes several tiles (of several heads and batches, with causal tiles of different lengths) at these
    sizes, dealt by _ws_balanced_slot where a short row block leaves a warpgroup idle (d=64 at 200, 1000, 64
    rows; 129 and 64 at d=128; causal where the head has an odd number of row blocks)."""
    heads = "" if case.heads == case.kv_heads else f"_g{case.heads}_{case.kv_heads}"
    kernel = attngen.load(spec_text(f"ws_{dtype}_{head_dim}{heads}_{mask[:6]}{len(mask)}", head_dim, dtype, mask,
                                    heads=case.heads, kv_heads=case.kv_heads))
    monkeypatch.setitem(kernel.module.WS_SHAPE, "min_scores", 0)  # these shapes are small: run the Gluon kernel anyway
    if programs:
        monkeypatch.setitem(kernel.module.WS_SHAPE, "PERSISTENT", True)
        monkeypatch.setattr(kernel.module, "_ws_programs", lambda device: programs)
    torch_dtype = kernel.spec.dtype.torch
    q = torch.randn(case.batch, case.heads, case.n_q, head_dim, device="cuda").to(torch_dtype)
    k, v = (torch.randn(case.batch, case.kv_heads, case.n_k, head_dim, device="cuda").to(torch_dtype) for _ in range(2))
    gluon = case.n_k >= kernel.module.WS_SHAPE["min_keys"] and (mask != "causal(bottom_right)" or case.n_k >= case.n_q)
    assert kernel.module.ws_ready(q, k, v, q) is gluon
    called = []
    launch = kernel.module.launch_attn_fwd_ws
    kernel.module.launch_attn_fwd_ws = lambda *a: (called.append(1), launch(*a))
    try:
        out, lse = _poisoned_run(kernel, q, k, v)
    finally:
        kernel.module.launch_attn_fwd_ws = launch
    assert bool(called) is gluon
    result = compare(kernel.spec, case, out, lse, q, k, v)
    assert result.ok, result


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon forward runs on sm_90 only")
@pytest.mark.parametrize("mask", ["none", "causal(top_left)", "causal(bottom_right)"])
@pytest.mark.parametrize("dtype, head_dim", [("fp16", 64), ("bf16", 128)])
@pytest.mark.parametrize("case", [Case(2, 4, 4, 200, 333), Case(1, 4, 2, 333, 2111), Case(3, 2, 1, 64, 4097)])
@pytest.mark.parametrize("programs", [None, 3])
def test_gluon_forward_short_shape_against_float64(mask, dtype, head_dim, case, programs, monkeypatch):
    """The shape for short sequences (FORWARD_SHORT: at d=64 two consumer warpgroups instead of three, causal d=128
    64-key blocks) at every length and mask, which the shipped thresholds take only up to short_keys keys."""
    heads = "" if case.heads == case.kv_heads else f"_g{case.heads}_{case.kv_heads}"
    kernel = attngen.load(spec_text(f"ws_short_{dtype}_{head_dim}{heads}_{mask[:6]}{len(mask)}", head_dim, dtype, mask,
                                    heads=case.heads, kv_heads=case.kv_heads))
    for key, value in (("min_scores", 0), ("min_keys", 1), ("short_keys", 1 << 30)):
        monkeypatch.setitem(kernel.module.WS_SHAPE, key, value)
    if programs:
        monkeypatch.setattr(kernel.module, "_ws_programs", lambda device: programs)
    torch_dtype = kernel.spec.dtype.torch
    q = torch.randn(case.batch, case.heads, case.n_q, head_dim, device="cuda").to(torch_dtype)
    k, v = (torch.randn(case.batch, case.kv_heads, case.n_k, head_dim, device="cuda").to(torch_dtype) for _ in range(2))
    assert kernel.module.ws_ready(q, k, v, q) is (mask != "causal(bottom_right)" or case.n_k >= case.n_q)
    out, lse = _poisoned_run(kernel, q, k, v)
    result = compare(kernel.spec, case, out, lse, q, k, v)
    assert result.ok, result


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon forward runs on sm_90 only")
def test_gluon_forward_strided_inputs_and_the_pointer_fallback(monkeypatch):
    kernel = attngen.load(spec_text("ws_strided", 128, "bf16", "none", heads=4, kv_heads=2))
    monkeypatch.setitem(kernel.module.WS_SHAPE, "min_scores", 0)
    # (B, N, H, D) storage viewed as (B, H, N, D); k and v sliced from one fused buffer: TMA reads these
    q = torch.randn(2, 301, 4, 128, device="cuda").bfloat16().transpose(1, 2)
    kv = torch.randn(2, 2, 2, 190, 128, device="cuda").bfloat16()
    k, v = kv[0], kv[1]
    assert kernel.module.ws_ready(q, k, v, torch.empty_like(q))
    out, lse = _poisoned_run(kernel, q, k, v)
    assert compare(kernel.spec, Case(2, 4, 2, 301, 190), out, lse, q, k, v).ok
    # a base 2 bytes off 16-byte alignment: TMA cannot read it, the Triton kernel runs
    buf = torch.randn(2 * 4 * 300 * 128 + 1, device="cuda").bfloat16()
    q2 = buf[1:].view(2, 4, 300, 128)
    assert not kernel.module.ws_ready(q2, k, v, torch.empty_like(q2))
    out, lse = _poisoned_run(kernel, q2, k, v)
    assert compare(kernel.spec, Case(2, 4, 2, 300, 190), out, lse, q2, k, v).ok


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon forward runs on sm_90 only")
def test_small_calls_take_the_triton_kernel():
    """Below min_scores a call is host-bound, and the Gluon launch costs more host time."""
    kernel = attngen.load(spec_text("ws_small", 128, "bf16", "none"))
    small = torch.randn(1, 16, 128, 128, device="cuda").bfloat16()
    big = torch.randn(1, 16, 2048, 128, device="cuda").bfloat16()
    assert 16 * 128 * 128 < kernel.module.WS_SHAPE["min_scores"] <= 16 * 2048 * 2048
    assert not kernel.module.ws_ready(small, small, small, small)
    assert kernel.module.ws_ready(big, big, big, big)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
@pytest.mark.parametrize("mask", ["none", "causal(top_left)", "causal(bottom_right)"])
@pytest.mark.parametrize("dtype, head_dim", [("bf16", 128), ("fp16", 128), ("bf16", 64)])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", [Case(2, 4, 4, 200, 333), Case(1, 8, 2, 129, 128), Case(1, 2, 2, 1, 1),
                                  Case(1, 4, 2, 1000, 77), Case(1, 4, 2, 333, 2111), Case(2, 2, 2, 1500, 1500)])
def test_gluon_backward_against_float64(mask, dtype, head_dim, deterministic, case, monkeypatch):
    """dQ, dK, dV poisoned, then from the one Gluon kernel, or under deterministic algorithms from the
    Triton dQ kernel and the Gluon dK/dV kernel (d=128) or the Triton one (d=64). Where the spec has
    DQ_LOCAL (d=64 without a mask, from dq_local_rows query rows on), with it and without."""
    heads = "" if case.heads == case.kv_heads else f"_g{case.heads}_{case.kv_heads}"
    kernel = attngen.load(spec_text(f"wsb_{dtype}{head_dim}{heads}_{mask[:6]}{len(mask)}", head_dim, dtype, mask,
                                    direction="forward+backward", heads=case.heads, kv_heads=case.kv_heads))
    m = kernel.module
    monkeypatch.setitem(m.WS_BWD_SHAPE, "min_scores", 0)  # small shapes: run the Gluon kernel anyway
    monkeypatch.setitem(m.WS_BWD_SHAPE, "min_keys", 0)
    torch_dtype = kernel.spec.dtype.torch
    q, do = (torch.randn(case.batch, case.heads, case.n_q, head_dim, device="cuda").to(torch_dtype) for _ in range(2))
    k, v = (torch.randn(case.batch, case.kv_heads, case.n_k, head_dim, device="cuda").to(torch_dtype) for _ in range(2))
    out, lse = kernel.forward(q, k, v, kernel.spec.softmax_scale)
    calls = []
    for name in ("launch_attn_bwd_ws", "launch_attn_bwd_dkdv_ws", "launch_attn_bwd_dq"):
        monkeypatch.setattr(m, name, lambda *a, f=getattr(m, name), name=name, **kw: (calls.append(name), f(*a, **kw)))
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
    local, claim = m.WS_BWD_SHAPE["dq_local_rows"], m.WS_BWD_SHAPE["dq_claim_keys"]
    assert local == (1024 if (head_dim, mask) == (64, "none") else 0)
    assert claim == (1024 if head_dim == 128 and mask != "none" else 0)
    # DQ_LOCAL (from dq_local_rows query rows) and DQ_CLAIM (up to dq_claim_keys keys) on and off where the spec
    # has them; with DQ_CLAIM the module's torch.empty poisoned, so that accumulator rows or claim words left
    # unwritten show
    settings = [("dq_local_rows", local)] if not (local or claim) or deterministic else (
        [("dq_local_rows", 0), ("dq_local_rows", 1)] if local else [("dq_claim_keys", 0), ("dq_claim_keys", 1 << 30)])
    for key, value in settings:
        monkeypatch.setitem(m.WS_BWD_SHAPE, key, value)
        monkeypatch.setattr(m, "torch", PoisonedTorch(torch) if key == "dq_claim_keys" and value else torch)
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        assert m.ws_bwd_ready(q, k, v, do, grads[1], grads[2])
        calls.clear()
        kernel.backward(q, k, v, out, lse, do, grads=grads)
        if not deterministic:
            assert calls == ["launch_attn_bwd_ws", "launch_attn_bwd_dkdv_ws"]
        else:
            assert calls == ["launch_attn_bwd_dq"] + (["launch_attn_bwd_dkdv_ws"] if head_dim == 128 else [])
        results = compare_grads(kernel.spec, q, k, v, do, grads)
        assert all(r.ok for r in results), (key, value, results)


class _LaunchSpy:
    """Stands in for a Gluon kernel: records each launch's keyword arguments, then launches the kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
@pytest.mark.parametrize("mask", ["none", "causal(top_left)", "causal(bottom_right)"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("case", [Case(2, 4, 2, 333, 1111), Case(1, 2, 2, 1, 1), Case(1, 4, 1, 1000, 77),
                                  Case(2, 2, 2, 700, 700)])
def test_gluon_backward_short_shape_against_float64(mask, dtype, case, tmp_path, monkeypatch):
    """The backward's shape for short sequences (BWD_SHORT: causal d=64 one consumer warpgroup of 64 keys, two
    programs a multiprocessor) at every length and mask (the module rendered with it as its short shape and
    short_keys above every length; the shipped thresholds take it only causal, up to short_keys keys); with
    DQ_LOCAL and without, dQ, dK and dV poisoned first."""
    import importlib.util

    from attngen.codegen import render

    spec = parse(spec_text(f"wsb_short_{dtype}_{mask[:6]}{len(mask)}", 64, dtype, mask, direction="forward+backward",
                           heads=case.heads, kv_heads=case.kv_heads))
    program = compile_program(spec)
    short_shape = hopper.BWD_SHORT[(64, True)]
    assert short_shape.consumers == 1
    gluon = program.warp_specialized.backward
    gluon = replace(gluon, min_scores=0, min_keys=0, short_keys=1 << 30, short=short_shape)
    path = tmp_path / f"{spec.name}.py"
    path.write_text(render(spec, replace(program, warp_specialized=replace(program.warp_specialized, backward=gluon))))
    loader = importlib.util.spec_from_file_location(spec.name, path)
    m = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(m)
    spy = _LaunchSpy(m.attn_bwd_dkdv_ws)
    monkeypatch.setattr(m, "attn_bwd_dkdv_ws", spy)
    torch_dtype = spec.dtype.torch
    q, do = (torch.randn(case.batch, case.heads, case.n_q, 64, device="cuda").to(torch_dtype) for _ in range(2))
    k, v = (torch.randn(case.batch, case.kv_heads, case.n_k, 64, device="cuda").to(torch_dtype) for _ in range(2))
    out, lse = m.forward(q, k, v, spec.softmax_scale)
    for local in (0, 1):
        m.WS_BWD_SHAPE["dq_local_rows"] = local
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        spy.launches.clear()
        m.backward(q, k, v, out, lse, do, spec.softmax_scale, *grads)
        assert [(c["CONSUMERS"], c["BLOCK_N"], c["DQ_LOCAL"]) for c in spy.launches] == [(1, 64, bool(local))]
        results = compare_grads(spec, q, k, v, do, grads)
        assert all(r.ok for r in results), (local, results)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
def test_gluon_backward_strided_and_expanded_inputs(monkeypatch):
    kernel = attngen.load(spec_text("wsb_strided", 128, "bf16", "causal", direction="forward+backward",
                                    heads=4, kv_heads=2))
    m = kernel.module
    monkeypatch.setitem(m.WS_BWD_SHAPE, "min_scores", 0)
    monkeypatch.setitem(m.WS_BWD_SHAPE, "min_keys", 0)
    q = torch.randn(2, 301, 4, 128, device="cuda").bfloat16().transpose(1, 2)  # (B, N, H, D) storage
    kv = torch.randn(2, 2, 2, 190, 128, device="cuda").bfloat16()
    k, v = kv[0], kv[1]
    out, lse = kernel.forward(q, k, v, kernel.spec.softmax_scale)
    for do, gluon in ((torch.randn_like(q), True), (torch.ones(1, 1, 1, 1, device="cuda").bfloat16().expand_as(q), False)):
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        assert m.ws_bwd_ready(q, k, v, do, grads[1], grads[2]) is gluon  # an expanded dO (stride 0): pointers
        kernel.backward(q, k, v, out, lse, do, grads=grads)
        assert all(r.ok for r in compare_grads(kernel.spec, q.contiguous(), k, v, do.contiguous(), grads))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
def test_small_backward_calls_take_the_triton_kernels():
    """Below min_scores scores the Gluon backward's host time (descriptors, three launches) is not hidden."""
    m = attngen.load(spec_text("wsb_short", 128, "bf16", "none", direction="forward+backward")).module
    small = torch.randn(1, 16, 256, 128, device="cuda").bfloat16()
    long = torch.randn(32, 16, 512, 128, device="cuda").bfloat16()
    assert 16 * 256 * 256 < m.WS_BWD_SHAPE["min_scores"] <= 32 * 16 * 512 * 512
    assert not m.ws_bwd_ready(*[small] * 6)
    assert m.ws_bwd_ready(*[long] * 6)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_deterministic_algorithms_give_the_same_gradients_twice(head_dim):
    """dQ by TMA reductions lands in any order; under torch.use_deterministic_algorithms(True) two
    runs must agree bit for bit."""
    kernel = attngen.load(spec_text(f"wsb_det{head_dim}", head_dim, "bf16", "causal", direction="forward+backward"))
    q, k, v, do = (torch.randn(4, 16, 2048, head_dim, device="cuda").bfloat16() for _ in range(4))
    out, lse = kernel.forward(q, k, v, kernel.spec.softmax_scale)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first = kernel.module.backward(q, k, v, out, lse, do, kernel.spec.softmax_scale)
        second = kernel.module.backward(q, k, v, out, lse, do, kernel.spec.softmax_scale)
    finally:
        torch.use_deterministic_algorithms(before)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# -- the paged decoding kernel (passes/warp_specialize_decode.py) ---------------------------------


@pytest.mark.parametrize("text, expected", [
    (spec_text("wsd_a", 128, "bf16", "causal(bottom_right)", split_kv="auto", kv_layout="paged(page_size = 16)"), True),
    (spec_text("wsd_b", 64, "fp16", "none", split_kv=4, kv_layout="paged(page_size = 256)"), True),
    (spec_text("wsd_c", 128, "bf16", "causal(bottom_right)", split_kv="auto"), True),  # a contiguous cache
    (spec_text("wsd_c2", 64, "fp16", "none", split_kv=2), True),
    (spec_text("wsd_c3", 128, "bf16", "causal(top_left)", split_kv="auto"), False),  # the Triton kernel's mask
    (spec_text("wsd_d", 128, "bf16", "causal(bottom_right)", split_kv="auto", kv_layout="paged(page_size = 8)"), False),
    (spec_text("wsd_e", 128, "fp32", "causal(bottom_right)", split_kv="auto", kv_layout="paged(page_size = 16)"), False),
    (spec_text("wsd_f", 80, "fp16", "causal(bottom_right)", split_kv="auto", kv_layout="paged(page_size = 16)"), False),
    (spec_text("wsd_g", 128, "bf16", "causal(bottom_right)", kv_layout="paged(page_size = 64)", pack_gqa="true"), False),
    (spec_text("wsd_h", 128, "bf16", "causal(bottom_right)", split_kv="auto", kv_layout="paged(page_size = 16)",
               block_n=16), False),  # tiles fixed by hand
])
def test_which_specs_get_the_gluon_decode(text, expected):
    from attngen.passes import warp_specialize_decode

    program = compile_program(parse(text))
    assert warp_specialize_decode.applies(program) is expected
    assert (program.warp_specialized.decode == hopper.decode()) is expected
    kernel = attngen.load(text)
    assert hasattr(kernel.module, "attn_fwd_wsd") is expected
    assert ("warp-specialize-decode" in kernel.source.split("\n", 3)[2]) is expected
    assert not hasattr(kernel.module, "attn_fwd_ws")  # decoding specs never get the prefill Gluon kernel


def test_the_gluon_decode_compiles_for_sm90():
    from attngen.lang.builtin import kvcache_spec

    # (dtype, head dim, causal, page size, query rows per K/V head as wgmma's N: 8 is decoding's 4 padded)
    shapes = (("bf16", 128, True, 16, 8), ("fp16", 64, False, 64, 8), ("bf16", 128, True, 256, 64),
              ("bf16", 64, True, 32, 16), ("bf16", 128, True, None, 8), ("fp16", 64, False, None, 32))
    paths = [attngen.load(kvcache_spec(dt, d, causal, page)).path for dt, d, causal, page, _ in shapes]
    jobs = [{"path": str(p), "gluon_ws": "decode", "rows": rows} for p, (*_, rows) in zip(paths, shapes)]
    for (_, d, _, page, rows), result in zip(shapes, probe(jobs)):
        assert "error" not in result, result
        # one consumer warpgroup + the loader warp padded to a warpgroup; K and V each one TMA copy per page in
        # a 64-key block (one per block for pages of 64 keys and more, and for contiguous caches), in messages
        # of 128-byte rows (the swizzle's width: two per copy at d=128)
        assert result["warps"] == 8, result
        assert result["tma_loads"] == 2 * max(1, 64 // (page or 64)) * (d * 2 // 128), result
        # both products swapped, on wgmma with N = the rows: S^T = K Q^T, d / 16 instructions of 64 keys;
        # O^T = V^T P^T, d / 64 x 64 / 16
        assert result["wgmma"] == 2 * d // 16 and result[f"wgmma_n{rows}"] == result["wgmma"], result
        # 3 stages of 64-key K and V blocks, Q and P^T, and scratch for the layout changes: at most the float32
        # O^T tile (the store's layout) and the barriers
        fixed = 3 * 2 * 64 * d * 2 + rows * (d + 64) * 2
        assert fixed <= result["shared"] <= fixed + rows * d * 4 + 1024, result


def test_without_hopper_paged_decoding_runs_the_triton_kernel():
    from attngen.lang.builtin import kvcache_spec
    from test_decode import make_cache, rand

    kernel = attngen.load(kvcache_spec("fp16", 64, True, 16))
    gen = torch.Generator(DEVICE).manual_seed(0)
    k, v, table = make_cache([5, 40], 16, 2, 64, torch.float16, gen)
    q = rand(2, 8, 1, 64, gen=gen)
    if not HOPPER:
        assert not kernel.module.wsd_ready(q, k, v, q)
    called = []
    launch = kernel.module.launch_attn_fwd_wsd
    kernel.module.launch_attn_fwd_wsd = lambda *a: called.append(a)
    try:
        seqlens = torch.tensor([5, 40], dtype=torch.int32, device=DEVICE)
        out, _ = kernel.module.forward_kvcache(q, k, v, seqlens, table, config={"warp_specialized": False})
    finally:
        kernel.module.launch_attn_fwd_wsd = launch
    assert not called and not out.isnan().any()


def assert_same_descriptor(fast, checked):
    """A descriptor built without TensorDescriptor's constructor holds the fields of `checked` (built with
    it), the same base tensor, and passes the constructor's checks."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    assert vars(fast).keys() == vars(checked).keys()
    for name, value in vars(checked).items():
        assert getattr(fast, name) is value if name == "base" else getattr(fast, name) == value, name
    TensorDescriptor(**vars(fast))  # the constructor's checks pass


@pytest.mark.parametrize("dtype, head_dim, page_size", [("bf16", 128, 16), ("fp16", 64, 256), ("bf16", 64, 32)])
def test_pool_descriptors_are_what_the_checked_constructor_builds(dtype, head_dim, page_size):
    """`_wsd_descriptor` skips TensorDescriptor's constructor (its checks are `wsd_ready`'s): on every pool
    layout the readiness rules accept (dense pools, a pool cut out of a larger one, slots padded out), it
    holds the same fields as the constructor's descriptor, which accepts them."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from attngen.lang.builtin import kvcache_spec

    module = attngen.load(kvcache_spec(dtype, head_dim, True, page_size)).module
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    dense = torch.empty(7, page_size, 2, head_dim, dtype=torch_dtype)
    big = torch.empty(9, page_size, 2, head_dim, dtype=torch_dtype)
    padded = torch.empty(5, page_size, 3, head_dim, dtype=torch_dtype)[:, :, :2]  # slots of 3 heads, 2 used
    for pool in (dense, big[2:], padded):
        assert_same_descriptor(module._wsd_descriptor(pool), TensorDescriptor(
            pool, [pool.shape[0] * page_size, 2 * head_dim], [pool.stride(1), 1], module._WSD_BOX, module._WSD_LAYOUT))


@pytest.mark.parametrize("dtype, head_dim", [("bf16", 128), ("fp16", 64)])
def test_cache_descriptors_are_what_the_checked_constructor_builds(dtype, head_dim):
    """Over a contiguous cache `_wsd_descriptor` sees the (B, H_KV, N_MAX, D) view of flash-attn's (B, N_MAX, H_KV,
    D) storage as (rows, H_KV x D), sequence b from row b x stride(0) / stride(2) on, and skips the constructor:
    on a dense cache, its first sequences, and its first slots (sequences further apart than N_MAX rows) it
    holds the constructor's fields, which it accepts, and its last row is the view's last key."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from attngen.lang.builtin import kvcache_spec

    module = attngen.load(kvcache_spec(dtype, head_dim, True, None)).module
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    big = torch.empty(5, 70, 2, head_dim, dtype=torch_dtype)
    for cache in (big, big[:3], big[:, :33]):
        view = cache.transpose(1, 2)
        seq_rows = cache.stride(0) // cache.stride(1)
        rows = (cache.shape[0] - 1) * seq_rows + cache.shape[1]
        desc = module._wsd_descriptor(view)
        assert_same_descriptor(desc, TensorDescriptor(view, [rows, 2 * head_dim], [2 * head_dim, 1], module._WSD_BOX,
                                                      module._WSD_LAYOUT))
        last = cache[-1, -1].flatten()  # the last sequence's last key: row rows - 1 of the 2-D view
        assert last.data_ptr() == view.data_ptr() + (rows - 1) * 2 * head_dim * view.element_size()


@pytest.mark.parametrize("dtype, head_dim, causal", [("bf16", 128, True), ("fp16", 64, False)])
def test_gluon_descriptors_are_what_the_checked_constructor_builds(dtype, head_dim, causal):
    """`_gluon_desc` skips TensorDescriptor's constructor (the forward's and backward's descriptors: eight a
    backward call): on the layouts `tma_layouts` accepts (contiguous, heads-minor, cut out of a larger
    tensor) and on the backward's fresh float32 buffers, with each box the kernels read, it holds the same
    fields as the constructor's descriptor, which accepts them."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from attngen.lang.builtin import sdpa_spec

    module = attngen.load(sdpa_spec(dtype, head_dim, causal)).module
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    B, H, N = 2, 3, 40
    contiguous = torch.empty(B, H, N, head_dim, dtype=torch_dtype)
    heads_minor = torch.empty(B, N, H, head_dim, dtype=torch_dtype).transpose(1, 2)
    cut = torch.empty(B, H, N + 8, head_dim, dtype=torch_dtype)[:, :, 8:]
    shape = module.WS_BWD_SHAPE
    n_pad = module.cdiv(N, shape["BLOCK_M"]) * shape["BLOCK_M"]
    cases = [(t, [1, 1, rows, head_dim], layout) for t in (contiguous, heads_minor, cut)
             for rows, layout in ((module.WS_SHAPE["BLOCK_M"] // module.WS_SHAPE["consumers"], module._WS_Q_LAYOUT),
                                  (module.WS_SHAPE["BLOCK_N"], module._WS_KV_LAYOUT),
                                  (module.WS_SHAPE["SHORT_BLOCK_N"], module._WS_KV_LAYOUT_SHORT),
                                  (shape["BLOCK_M"], module._WS_BWD_Q_LAYOUT),
                                  (shape["BLOCK_N"] // shape["consumers"], module._WS_BWD_KV_LAYOUT))]
    cases += [(torch.empty(B, H, N, head_dim), [1, 1, shape["BLOCK_M"], cols], layout)
              for cols, layout in module._WS_BWD_DQ_LAYOUTS.items()]
    cases += [(torch.empty(B, H, 2, n_pad), module._WS_BWD_ROWS_BLOCK, module._WS_BWD_ROWS_LAYOUT)]
    for t, block, layout in cases:
        assert module.tma_layouts(t)
        assert_same_descriptor(module._gluon_desc(t, block, layout),
                               TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon decode runs on sm_90 only")
@pytest.mark.parametrize("dtype, head_dim, causal", [(torch.bfloat16, 128, True), (torch.float16, 64, False)])
@pytest.mark.parametrize("heads, kv_heads, seqlen_q", [(32, 8, 1), (8, 2, 3), (16, 2, 8), (8, 2, 17)])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
@pytest.mark.parametrize("layout", ["dense", "cut", "heads_major"])
def test_gluon_decode_over_a_contiguous_cache_against_float64(dtype, head_dim, causal, heads, kv_heads, seqlen_q,
                                                              num_splits, layout):
    """Through attention_with_kvcache over a contiguous cache: odd lengths (0, 1, block edges) in a capacity that
    is not a whole number of blocks (a sequence's last block reads into the next one's keys, the last one's
    past the tensor), every slot past a length NaN, outputs poisoned. "cut": the first sequences and slots of a
    larger cache; "heads_major": a (B, H_KV, N, D) cache seen as (B, N, H_KV, D), which TMA cannot read as
    rows of all heads: the Triton kernel. More than 64 query rows per K/V head: the Triton kernel too."""
    from attngen.lang.builtin import kvcache_spec
    from test_decode import check, rand, run

    gen = torch.Generator("cuda").manual_seed(head_dim + seqlen_q + num_splits)
    lengths = [max(n, seqlen_q) if n > 1 else n for n in (0, 1, 1350, 65, 1000, 64, 1349)]
    batch, capacity = len(lengths), 1350
    extra = 2 if layout == "cut" else 0
    if layout == "heads_major":
        k, v = (rand(batch, kv_heads, capacity, head_dim, dtype=dtype, device="cuda", gen=gen).transpose(1, 2)
                for _ in range(2))
    else:
        k, v = (rand(batch + extra, capacity + 7 * extra, kv_heads, head_dim, dtype=dtype, device="cuda",
                     gen=gen) for _ in range(2))
    for b, n in enumerate(lengths):
        k[b, n:] = float("nan")
        v[b, n:] = float("nan")
    if extra:
        k, v = k[:batch, :capacity], v[:batch, :capacity]
    q = rand(batch, seqlen_q, heads, head_dim, dtype=dtype, device="cuda", gen=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    module = attngen.load(kvcache_spec({torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype], head_dim, causal,
                                       None)).module
    gluon = heads // kv_heads * seqlen_q <= module.WSD_SHAPE["ROWS"] and layout != "heads_major"
    called = []
    launch = module.launch_attn_fwd_wsd
    module.launch_attn_fwd_wsd = lambda *a: (called.append(1), launch(*a))
    try:
        out, lse = run(q, k, v, seqlens, causal=causal, num_splits=num_splits)
    finally:
        module.launch_attn_fwd_wsd = launch
    assert bool(called) is gluon
    check(out, lse, q, k, v, seqlens, None, causal=causal)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon decode runs on sm_90 only")
@pytest.mark.parametrize("dtype, head_dim, causal", [(torch.bfloat16, 128, True), (torch.float16, 64, False),
                                                     (torch.float16, 128, False), (torch.bfloat16, 64, True)])
@pytest.mark.parametrize("page_size", [16, 32, 256])
@pytest.mark.parametrize("heads, kv_heads, seqlen_q", [(32, 8, 1), (8, 2, 3), (16, 2, 8), (8, 2, 17)])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_gluon_decode_against_float64(dtype, head_dim, causal, page_size, heads, kv_heads, seqlen_q, num_splits):
    """Through attention_with_kvcache: odd lengths (0, 1, a page and one, block edges), pages shared between
    sequences and in random order, outputs poisoned; 17 queries of a group of 4 are 68 rows, more than
    the kernel's 64: those calls must take the Triton kernel."""
    from attngen.lang.builtin import kvcache_spec
    from test_decode import check, make_cache, rand, run

    gen = torch.Generator("cuda").manual_seed(page_size + head_dim + seqlen_q + num_splits)
    lengths = [0, 1, 2 * page_size + 1, 1000, 64, 4097]
    lengths = [max(n, seqlen_q) if n > 1 else n for n in lengths]
    k, v, table = make_cache(lengths, page_size, kv_heads, head_dim, dtype, gen, shared=True, device="cuda")
    q = rand(len(lengths), seqlen_q, heads, head_dim, dtype=dtype, device="cuda", gen=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    module = attngen.load(kvcache_spec({torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype], head_dim, causal,
                                       page_size)).module
    gluon = heads // kv_heads * seqlen_q <= module.WSD_SHAPE["ROWS"]
    called = []
    launch = module.launch_attn_fwd_wsd
    module.launch_attn_fwd_wsd = lambda *a: (called.append(1), launch(*a))
    try:
        out, lse = run(q, k, v, seqlens, table, causal=causal, num_splits=num_splits)
    finally:
        module.launch_attn_fwd_wsd = launch
    assert bool(called) is gluon
    check(out, lse, q, k, v, seqlens, table, causal=causal)
