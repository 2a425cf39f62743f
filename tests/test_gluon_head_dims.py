"""The Hopper Gluon kernels at head dims other than 64 and 128 (issue 51): d=256 (Gemma), d=96 (Phi) and the forward
at q.k 192 with v 128 (DeepSeek's prefill, `head_dim_v`).

On the CPU: which kernel each head dim's specs take and why (the pass's decision and the shapes from
attngen/policy/hopper.py), and that the Gluon kernels compile for sm_90 within shared memory (Triton's own
compiler, in a subprocess). On a Hopper GPU (`gpu`): against float64 at odd lengths, seq_q != seq_k and GQA,
the outputs poisoned first, gradients included.
"""

from dataclasses import replace

import pytest
import torch

import attngen
from attngen.errors import InternalError
from attngen.ir.verify import verify
from attngen.lang.spec import parse
from attngen.passes import compile_program, warp_specialize
from attngen.policy import hopper
from attngen.testing.accuracy import Case, compare, compare_grads
from conftest import spec_text
from probe import probe
from test_warp_specialize import HOPPER, _poisoned_run

SHARED = 232448  # an sm_90 program's shared memory


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_d256_takes_the_gluon_forward_and_the_wide_backward(mask):
    """d=256: the forward at FA3's 128-row tile with 64-key blocks, one program per tile (a second Q buffer would
    not fit beside the K/V ring); the backward on the wide path (BWD_WIDE: both consumers on 64 keys, each half of
    dK's and dV's columns: a consumer's whole dK and dV accumulators would be 256 registers a thread)."""
    text = spec_text(f"hd256_{mask}", 256, "bf16", mask, direction="forward+backward")
    program = compile_program(parse(text))
    assert warp_specialize.applies(program)
    forward = program.warp_specialized.forward
    assert forward.main == hopper.FORWARD_MAIN[256] and (forward.main.block_m, forward.main.block_n) == (128, 64)
    assert not forward.persistent and not forward.balance and forward.short_keys == 0
    backward = program.warp_specialized.backward
    assert backward.wide and backward.main == hopper.BWD_WIDE_STAGED and 256 not in hopper.BWD_HEAD_DIMS
    module = attngen.load(text).module
    assert hasattr(module, "attn_fwd_ws") and hasattr(module, "attn_bwd_dkdv_ws") and module.WS_BWD_SHAPE["wide"]
    assert module.WS_SHAPE["PERSISTENT"] is False


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_d96_takes_the_gluon_kernels_at_d128s_tiles(mask):
    """d=96: the forward and the backward at d=128's shapes and thresholds, 128 columns wide (register tiles
    have power-of-two shapes), their descriptors over the 96-column tensors."""
    text = spec_text(f"hd96_{mask}", 96, "bf16", mask, direction="forward+backward")
    program = compile_program(parse(text))
    assert warp_specialize.applies(program) and hopper.tile_dim(96) == program.attr("head_dim_padded") == 128
    causal = mask != "none"
    assert program.warp_specialized.forward == hopper.forward(128, causal)
    assert program.warp_specialized.backward == hopper.backward(128, causal)
    module = attngen.load(text).module
    assert hasattr(module, "attn_fwd_ws") and hasattr(module, "attn_bwd_dkdv_ws")
    assert module.HEAD_DIM == 96 and module._WS_Q_LAYOUT == module.gl.NVMMASharedLayout.get_default_for(
        [1, 1, 64, 128], module.gl.bfloat16)


def test_d96_varlen_stays_on_the_triton_kernels():
    """A packed varlen program at d=96: the Gluon kernels' row-masked stores are a tile wide, and a 128-column tile
    would write into the next head's columns; the pass refuses it (its variants at d=96 are dense: taken)."""
    varlen = compile_program(parse(spec_text("hd96_vl", 96, "bf16", "causal", layout="varlen",
                                             direction="forward+backward")))
    assert not warp_specialize.applies(varlen) and varlen.warp_specialized.forward is None
    window = compile_program(parse(spec_text("hd96_win", 96, "bf16", "causal & window(512)", score="softcap(30)",
                                             direction="forward+backward")))
    assert window.warp_specialized.forward is not None and window.warp_specialized.backward is not None


@pytest.mark.parametrize("head_dim", [80, 160, 192])
def test_other_head_dims_stay_on_the_triton_kernels(head_dim):
    program = compile_program(parse(spec_text(f"hd_{head_dim}", head_dim, "bf16", "causal",
                                              direction="forward+backward")))
    assert not warp_specialize.applies(program) and program.warp_specialized.forward is None


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_deepseek_192_128_takes_the_gluon_forward_and_the_wide_backward(mask):
    """q.k over 192 (tiles 256 wide), v over 128: the forward at SPLIT_FORWARD's shape on a persistent grid; the
    backward on the wide path (V, dO and dV 128 wide); a pair not in the table, or varlen, takes no Gluon kernel."""
    text = spec_text(f"hd192_{mask}", 192, "bf16", mask, head_dim_v=128, direction="forward+backward")
    program = compile_program(parse(text))
    assert warp_specialize.applies(program)
    forward = program.warp_specialized.forward
    assert forward.main == forward.short == hopper.SPLIT_FORWARD[(192, 128)] and forward.persistent
    assert program.warp_specialized.backward.wide
    module = attngen.load(text).module
    assert module.HEAD_DIM_PADDED == 256 and module.HEAD_DIM_V == 128
    assert module._WS_V_LAYOUT == module.gl.NVMMASharedLayout.get_default_for([1, 1, 64, 128], module.gl.bfloat16)
    for keys in (dict(head_dim=192, head_dim_v=64), dict(head_dim=128, head_dim_v=64),
                 dict(head_dim=192, head_dim_v=128, layout="varlen")):
        other = compile_program(parse(spec_text("hd_other", dtype="bf16", mask=mask, **keys)))
        assert not warp_specialize.applies(other) and other.warp_specialized.forward is None, keys


def test_d256_variants_and_varlen_take_the_gluon_forward():
    window = compile_program(parse(spec_text("hd256_win", 256, "bf16", "causal & window(512)", score="softcap(30)")))
    varlen = compile_program(parse(spec_text("hd256_vl", 256, "bf16", "causal", layout="varlen")))
    for program in (window, varlen):
        assert program.warp_specialized.forward is not None and not program.warp_specialized.forward.persistent


def _forward_jobs(texts):
    kernels = [attngen.load(text) for text in texts]
    return [(k.module.WS_SHAPE, {"path": str(k.path), "gluon_ws": True}) for k in kernels]


def test_the_forward_compiles_for_sm90():
    texts = [spec_text("hd256c_none", 256, "bf16", "none"), spec_text("hd256c_causal", 256, "fp16", "causal"),
             spec_text("hd256c_win", 256, "bf16", "causal & window(512)", score="softcap(30)"),
             spec_text("hd256c_vl", 256, "bf16", "causal", layout="varlen"),
             spec_text("hd96c_none", 96, "bf16", "none"), spec_text("hd96c_causal", 96, "fp16", "causal(bottom_right)"),
             spec_text("hd96c_win", 96, "bf16", "causal & window(512)", score="softcap(30)"),
             spec_text("hd192c_causal", 192, "bf16", "causal", head_dim_v=128),
             spec_text("hd192c_win", 192, "fp16", "causal & window(512)", score="softcap(30)", head_dim_v=128)]
    jobs = _forward_jobs(texts)
    for (shape, job), result in zip(jobs, probe([job for _, job in jobs])):
        assert "error" not in result, (job, result)
        assert result["warps"] == 4 * (1 + shape["consumers"]) and result["wgmma"] > 0, result
        assert result["tma_loads"] >= 3 and result["shared"] <= SHARED, result


def test_the_split_switch_gives_deepseeks_forward_tile_pieces(monkeypatch):
    """With SPLIT_TILES_192 the plain (192, 128) forward takes its Q and K tiles as 128 + 64 columns at SPLIT_FORWARD's
    shape (a variant's keeps 256-column tiles), and the verifier refuses pieces the kernel cannot take."""
    text = spec_text("hd192_split", 192, "bf16", "causal", head_dim_v=128, direction="forward+backward")
    window = spec_text("hd192_split_win", 192, "bf16", "causal & window(512)", head_dim_v=128)
    monkeypatch.setattr(hopper, "SPLIT_TILES_192", False)
    assert compile_program(parse(text)).warp_specialized.forward.pieces == ()
    monkeypatch.setattr(hopper, "SPLIT_TILES_192", True)
    program = compile_program(parse(text))
    forward = program.warp_specialized.forward
    assert forward.pieces == (128, 64) and forward.main == hopper.SPLIT_FORWARD[(192, 128)]
    assert compile_program(parse(window)).warp_specialized.forward.pieces == ()
    assert hopper.forward(256, True).pieces == () and hopper.forward(128, True).pieces == ()
    for bad in ((64, 128), (128, 32), (96, 96)):  # the output's 128 columns leave through the first piece's buffer
        decision = replace(program.warp_specialized, forward=replace(forward, pieces=bad))
        broken = replace(program, warp_specialized=decision)
        with pytest.raises(InternalError, match="tile pieces"):
            verify(broken, "test")


def test_the_split_forward_compiles_for_sm90_with_less_work(monkeypatch):
    """(192, 128)'s forward with SPLIT_TILES_192, both masks, for sm_90a: S as two wgmma over 128 and 64 columns (a fifth
    fewer wgmma than over 256 columns), 49 KB less shared memory (Q's and K's zero columns), no spills (ptxas)."""
    jobs = []
    for split in (False, True):
        monkeypatch.setattr(hopper, "SPLIT_TILES_192", split)
        texts = [spec_text(f"hd192_split_sm90_{m}", 192, "bf16", m, head_dim_v=128) for m in ("none", "causal")]
        jobs += [dict(job, ptxas=True) for _, job in _forward_jobs(texts)]
    results = probe(jobs)
    for job, result in zip(jobs, results):
        assert "error" not in result, (job, result)
        assert result["warps"] == 12 and result["spill_stores"] == 0 and result["registers"] <= 168, result
    for before, after in zip(results[:2], results[2:]):
        assert after["wgmma"] * 5 == before["wgmma"] * 4, (before, after)
        assert before["shared"] - after["shared"] == 49072 and after["tma_stores"] == before["tma_stores"], (
            before, after)


def test_the_d96_backward_compiles_for_sm90():
    """The fused kernel (dQ by TMA reductions into the 128-column accumulator), the dK/dV-only kernel of
    deterministic algorithms, and a variant's."""
    texts = [spec_text("hd96b_none", 96, "bf16", "none", direction="forward+backward"),
             spec_text("hd96b_causal", 96, "fp16", "causal", direction="forward+backward"),
             spec_text("hd96b_win", 96, "bf16", "causal & window(512)", score="softcap(30)",
                       direction="forward+backward")]
    paths = [str(attngen.load(text).path) for text in texts]
    jobs = [{"path": p, "gluon_ws": "backward"} for p in paths] + [{"path": paths[0], "gluon_ws": "backward",
                                                                    "dq_atomic": False}]
    for job, result in zip(jobs, probe(jobs)):
        assert "error" not in result, (job, result)
        assert result["warps"] == 12 and result["wgmma"] > 0 and result["shared"] <= SHARED, result
        assert (result["tma_reduces"] > 0) is job.get("dq_atomic", True), result


def test_the_d96_row_passes_mask_the_padding_columns():
    """The backward's row passes at d=96 in the interpreter: delta = rowsum(dO * O) over the tensors' 96 columns
    (not the next row's first 32), the 128-column accumulator zeroed, and dQ written in 96 columns only."""
    m = attngen.load(spec_text("hd96_rows", 96, "bf16", "none", direction="forward+backward")).module
    B, H, n_q, block = 1, 2, 70, m.WS_BWD_SHAPE["ROW_BLOCK"]
    n_pad = -(-n_q // m.WS_BWD_SHAPE["BLOCK_M"]) * m.WS_BWD_SHAPE["BLOCK_M"]
    out, do = (torch.randn(B, H, n_q, 96).bfloat16() for _ in range(2))
    lse = torch.randn(B, H, n_q)
    rows = torch.full((B, H, 2, n_pad), float("nan"))
    acc = torch.full((B, H, n_q, 128), float("nan"))
    m.attn_bwd_prep_ws[(n_pad // block, H, B)](out, do, lse, rows, acc, lse, *out.stride(), *do.stride(),
                                                *lse.stride(), H, n_q, n_pad, 0, BLOCK=block, HEAD_DIM=128, CLAIMS=0,
                                                BLOCK_M=m.WS_BWD_SHAPE["BLOCK_M"], D=96)
    delta = (out.float() * do.float()).sum(-1)
    assert torch.allclose(rows[:, :, 1, :n_q], delta, atol=1e-4) and (acc == 0).all()
    acc = torch.randn(B, H, n_q, 128)
    rows_of_100 = torch.full((B, H, n_q, 100), float("nan")).bfloat16()  # columns past 96 must stay unwritten
    dq = rows_of_100[..., :96]
    m.attn_bwd_dq_ws[(n_pad // block, H, B)](acc, dq, *dq.stride(), H, n_q, 0.5, BLOCK=block, HEAD_DIM=128, D=96)
    torch.testing.assert_close(dq, (0.5 * acc[..., :96]).bfloat16(), rtol=1e-2, atol=1e-2)
    assert rows_of_100[..., 96:].isnan().all()


# -- on a Hopper GPU -------------------------------------------------------------------------------------

CASES = [Case(2, 4, 4, 200, 333), Case(1, 8, 2, 129, 128), Case(1, 2, 2, 1, 1), Case(1, 2, 2, 1000, 77),
         Case(1, 4, 2, 333, 2111), Case(1, 2, 2, 1500, 1500)]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels run on sm_90 only")
@pytest.mark.parametrize("mask", ["none", "causal(top_left)", "causal(bottom_right)"])
@pytest.mark.parametrize("dtype, head_dim", [("bf16", 256), ("fp16", 256), ("bf16", 96), ("fp16", 96)])
@pytest.mark.parametrize("case", CASES)
def test_gluon_forward_against_float64(mask, dtype, head_dim, case, monkeypatch):
    heads = "" if case.heads == case.kv_heads else f"_g{case.heads}_{case.kv_heads}"
    kernel = attngen.load(spec_text(f"hdf_{dtype}{head_dim}{heads}_{mask[:6]}{len(mask)}", head_dim, dtype, mask,
                                    heads=case.heads, kv_heads=case.kv_heads))
    monkeypatch.setitem(kernel.module.WS_SHAPE, "min_scores", 0)  # small shapes: run the Gluon kernel anyway
    torch_dtype = kernel.spec.dtype.torch
    q = torch.randn(case.batch, case.heads, case.n_q, head_dim, device="cuda").to(torch_dtype)
    k, v = (torch.randn(case.batch, case.kv_heads, case.n_k, head_dim, device="cuda").to(torch_dtype) for _ in range(2))
    gluon = mask != "causal(bottom_right)" or case.n_k >= case.n_q
    assert kernel.module.ws_ready(q, k, v, q) is gluon
    called = []
    launch = kernel.module.launch_attn_fwd_ws
    monkeypatch.setattr(kernel.module, "launch_attn_fwd_ws", lambda *a: (called.append(1), launch(*a)))
    out, lse = _poisoned_run(kernel, q, k, v)
    assert bool(called) is gluon
    result = compare(kernel.spec, case, out, lse, q, k, v)
    assert result.ok, result


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels run on sm_90 only")
@pytest.mark.parametrize("mask", ["none", "causal(top_left)"])
@pytest.mark.parametrize("head_dim", [96, 256])
@pytest.mark.parametrize("case", [Case(1, 4, 2, 333, 2111), Case(1, 2, 2, 1500, 1500), Case(2, 4, 4, 4096, 4096)])
def test_training_against_float64(mask, head_dim, case, monkeypatch):
    """The forward and the backward (the Gluon one where the head dim has it) at real sizes, through
    `attngen.attention`'s autograd path, gradients against float64's."""
    heads = "" if case.heads == case.kv_heads else f"_g{case.heads}_{case.kv_heads}"
    kernel = attngen.load(spec_text(f"hdt_{head_dim}{heads}_{mask[:6]}", head_dim, "bf16", mask,
                                    direction="forward+backward", heads=case.heads, kv_heads=case.kv_heads))
    m = kernel.module
    monkeypatch.setitem(m.WS_SHAPE, "min_scores", 0)
    if hasattr(m, "WS_BWD_SHAPE"):
        monkeypatch.setitem(m.WS_BWD_SHAPE, "min_scores", 0)
    q, do = (torch.randn(case.batch, case.heads, case.n_q, head_dim, device="cuda").bfloat16() for _ in range(2))
    k, v = (torch.randn(case.batch, case.kv_heads, case.n_k, head_dim, device="cuda").bfloat16() for _ in range(2))
    out, lse = _poisoned_run(kernel, q, k, v)
    assert compare(kernel.spec, case, out, lse, q, k, v).ok
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    kernel.backward(q, k, v, out, lse, do, grads=grads)
    results = compare_grads(kernel.spec, q, k, v, do, grads)
    assert all(r.ok for r in results), results


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels run on sm_90 only")
@pytest.mark.parametrize("mask", ["none", "causal(top_left)", "causal(bottom_right)"])
@pytest.mark.parametrize("case", CASES + [Case(2, 16, 16, 4096, 4096)])
@pytest.mark.parametrize("split", [False, True], ids=["tiles256", "split_tiles"])
def test_deepseek_192_128_forward_against_float64(mask, case, split, monkeypatch):
    """The Gluon forward with V and the output 128 wide beside Q and K of 192, the output poisoned first, on 256-column
    tiles and (SPLIT_TILES_192) tiles of 128 + 64 columns; with the spec's backward at the same sizes."""
    monkeypatch.setattr(hopper, "SPLIT_TILES_192", split)
    heads = "" if case.heads == case.kv_heads else f"_g{case.heads}_{case.kv_heads}"
    kernel = attngen.load(spec_text(f"hd192f{heads}_{mask[:6]}{len(mask)}", 192, "bf16", mask, head_dim_v=128,
                                    direction="forward+backward", heads=case.heads, kv_heads=case.kv_heads))
    m = kernel.module
    assert m.WS_SHAPE.get("PIECES") == ([128, 64] if split else None)
    monkeypatch.setitem(m.WS_SHAPE, "min_scores", 0)
    q, k = (torch.randn(case.batch, h, n, 192, device="cuda").bfloat16()
            for h, n in ((case.heads, case.n_q), (case.kv_heads, case.n_k)))
    v = torch.randn(case.batch, case.kv_heads, case.n_k, 128, device="cuda").bfloat16()
    gluon = mask != "causal(bottom_right)" or case.n_k >= case.n_q
    out = torch.full((case.batch, case.heads, case.n_q, 128), float("nan"), device="cuda").bfloat16()
    assert m.ws_ready(q, k, v, out) is gluon
    called = []
    launch = m.launch_attn_fwd_ws
    monkeypatch.setattr(m, "launch_attn_fwd_ws", lambda *a: (called.append(1), launch(*a)))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    m.forward(q, k, v, kernel.spec.softmax_scale, out=out, lse=lse)
    assert bool(called) is gluon
    result = compare(kernel.spec, case, out, lse, q, k, v)
    assert result.ok, result
    do = torch.randn_like(out)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    kernel.backward(q, k, v, out, lse, do, grads=grads)
    results = compare_grads(kernel.spec, q, k, v, do, grads)
    assert all(r.ok for r in results), results
