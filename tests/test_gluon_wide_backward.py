"""The Gluon backward's wide path at d=256 and DeepSeek's 192 / 128 (issue 51; policy/hopper.py WIDE_BACKWARD and
BWD_WIDE): both consumer warpgroups on a program's 64 keys, each holding half of dK's and dV's columns.

On the CPU: the pass's decision with the switch off (the Triton backward, and explain says why) and on (the wide
shape; variants and varlen still refused), the verifier's checks of the wide shape, the generated sources of the other
head dims unchanged by it, and the kernel compiled for sm_90 within shared memory. On a Hopper GPU (`gpu`, the switch
on): the backward against float64 at real sizes, GQA and causal included, gradients poisoned first.
"""

import dataclasses

import pytest
import torch

import attngen
from attngen.analysis.resources import wide_backward_shared_bytes
from attngen.cli import main
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


def _program(name, mask="causal", head_dim=256, **keys):
    return compile_program(parse(spec_text(name, head_dim, "bf16", mask, direction="forward+backward", **keys)))


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_the_switch_decides_d256s_backward(mask, monkeypatch):
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", False)
    off = _program(f"wide_off_{mask}", mask)
    assert off.warp_specialized.forward is not None and off.warp_specialized.backward is None
    assert "WIDE_BACKWARD" in warp_specialize.backward_refusal(off)
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", True)
    on = _program(f"wide_on_{mask}", mask)
    backward = on.warp_specialized.backward
    assert warp_specialize.backward_refusal(on) is None
    assert backward == hopper.backward(256, mask != "none") and backward.wide
    assert (backward.main.block_m, backward.main.block_n, backward.main.consumers) == (64, 64, 2)
    assert backward.dq_atomic and backward.rows_smem and backward.max_group_split == 1 and not backward.split


def test_the_switch_decides_deepseeks_backward(monkeypatch):
    """(192, 128): the same wide shape, Q and K tiles 256 wide; other pairs keep the Triton backward."""
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", False)
    off = _program("wide_ds_off", head_dim=192, head_dim_v=128)
    assert off.warp_specialized.backward is None and "WIDE_BACKWARD" in warp_specialize.backward_refusal(off)
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", True)
    on = _program("wide_ds_on", head_dim=192, head_dim_v=128)
    assert on.attr("head_dim_padded") == 256 and on.warp_specialized.backward == hopper.backward(192, True)
    assert on.warp_specialized.backward.wide
    other = compile_program(parse(spec_text("wide_ds_other", 128, "bf16", "causal", head_dim_v=64,
                                            direction="forward+backward")))
    assert other.warp_specialized.backward is None


def test_the_switch_leaves_the_other_head_dims_and_shapes(monkeypatch):
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", True)
    for d in (64, 96, 128):
        backward = _program(f"wide_d{d}", head_dim=d).warp_specialized.backward
        assert backward is not None and not backward.wide
    window = _program("wide_win", "causal & window(512)")
    varlen = _program("wide_vl", layout="varlen")
    deepseek = compile_program(parse(spec_text("wide_ds_win", 192, "bf16", "causal & window(512)", head_dim_v=128,
                                               direction="forward+backward")))
    for program in (window, varlen, deepseek):
        assert program.warp_specialized.forward is not None and program.warp_specialized.backward is None
        assert warp_specialize.backward_refusal(program)


def test_explain_says_which_backward_runs(capsys, tmp_path, monkeypatch):
    spec = tmp_path / "wide.attn"
    spec.write_text(spec_text("wide_explain", 256, "bf16", "causal", direction="forward+backward"))
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", False)
    assert main(["explain", str(spec)]) == 0
    assert ("the backward stays on the Triton kernels (head dim 256: the Gluon backward's wide path"
            in capsys.readouterr().out)
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", True)
    assert main(["explain", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "the backward runs the Gluon kernel's wide path" in out and "wide" in out.split("gluon backward:")[1]


def test_the_verifier_checks_the_wide_shape(monkeypatch):
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", True)
    program = _program("wide_verify")
    verify(program, "test")
    ws = program.warp_specialized
    for bad in (dataclasses.replace(ws.backward.main, consumers=4),  # not 2 consumers
                dataclasses.replace(ws.backward.main, block_n=128)):  # (short differs from main)
        broken = dataclasses.replace(program, warp_specialized=dataclasses.replace(
            ws, backward=dataclasses.replace(ws.backward, main=bad)))
        with pytest.raises(InternalError, match="wide path"):
            verify(broken, "test")
    d128 = _program("wide_verify128", head_dim=128)
    wide128 = dataclasses.replace(d128, warp_specialized=dataclasses.replace(
        d128.warp_specialized, backward=dataclasses.replace(d128.warp_specialized.backward, wide=True)))
    with pytest.raises(InternalError, match="wide path"):
        verify(wide128, "test")


def test_the_wide_backward_compiles_for_sm90(monkeypatch):
    """Both masks, with dQ (the only form the wide path has), d=256 and (192, 128): 12 warps, one K and one V tile,
    dQ by TMA reductions, dK and dV by TMA stores, within shared memory."""
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", True)
    paths = [str(attngen.load(spec_text(f"wide_sm90_{m}", 256, dt, m, direction="forward+backward")).path)
             for m, dt in (("none", "bf16"), ("causal", "fp16"))]
    paths += [str(attngen.load(spec_text(f"wide_sm90_ds_{m}", 192, "bf16", m, head_dim_v=128,
                                         direction="forward+backward")).path) for m in ("none", "causal")]
    jobs = [{"path": p, "gluon_ws": "backward"} for p in paths]
    for job, result in zip(jobs, probe(jobs)):
        assert "error" not in result, (job, result)
        assert result["warps"] == 12 and result["wgmma"] > 0 and result["shared"] <= SHARED, result
        assert result["tma_reduces"] > 0 and result["tma_stores"] > 0 and result["global_stores"] == 0, result


BOTH_PAIRS = frozenset({(256, 256), (192, 128)})
"""hopper.BWD_WIDE_STAGED_PAIRS with (192, 128) added: its staged kernel lost on the H200 and is not the policy's, but
stays compiled and tested so that the experiment can be repeated by the policy alone."""


def test_the_staged_pairs_by_default(monkeypatch):
    """With WIDE_BACKWARD_STAGES on, d=256 takes two stages and (192, 128), where they lost, one on its 256-column
    tiles (and SPLIT_TILES_192's own two stages on split ones, the default)."""
    assert hopper.WIDE_BACKWARD_STAGES
    assert hopper.backward(256, True).main == hopper.BWD_WIDE_STAGED
    assert hopper.backward(192, True, 128).main == hopper.BWD_WIDE_SPLIT
    monkeypatch.setattr(hopper, "SPLIT_TILES_192", False)
    assert hopper.backward(192, True, 128).main == hopper.BWD_WIDE

@pytest.mark.parametrize("dims", [(256, None), (192, 128)])
def test_the_stages_switch_decides_the_wide_shape(dims, monkeypatch):
    """WIDE_BACKWARD_STAGES picks BWD_WIDE_STAGED (two Q/dO stages) over BWD_WIDE; it is one of the switches kernel
    caches key on, so a module loaded under each setting is its own, and explain says which runs."""
    d, dv = dims
    keys = {"head_dim_v": dv} if dv else {}
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", True)
    monkeypatch.setattr(hopper, "SPLIT_TILES_192", False)  # (192, 128)'s 256-column tiles
    assert "WIDE_BACKWARD_STAGES" in hopper.SWITCHES
    shapes, modules = {}, {}
    for staged in (False, True):
        monkeypatch.setattr(hopper, "WIDE_BACKWARD_STAGES", staged)
        monkeypatch.setattr(hopper, "BWD_WIDE_STAGED_PAIRS", BOTH_PAIRS)  # (192, 128)'s staged kernel too
        backward = _program(f"wide_stages_{d}", head_dim=d, **keys).warp_specialized.backward
        assert backward.wide and backward.main == backward.short
        shapes[staged] = backward.main
        modules[staged] = attngen.load(spec_text(f"wide_stages_{d}", d, "bf16", "causal",
                                                 direction="forward+backward", **keys))
        assert modules[staged].module.WS_BWD_SHAPE["STAGES"] == shapes[staged].stages
    assert shapes == {False: hopper.BWD_WIDE, True: hopper.BWD_WIDE_STAGED}
    assert shapes[False].stages == 1 and shapes[True].stages == 2
    assert dataclasses.replace(shapes[True], stages=1) == shapes[False]  # (only the stages differ)
    assert modules[False].path != modules[True].path
    assert "_ws_bwd_stage(" in modules[True].path.read_text()
    assert "_ws_bwd_stage(" not in modules[False].path.read_text()


def test_explain_says_how_many_stages_the_wide_path_takes(capsys, tmp_path, monkeypatch):
    spec = tmp_path / "wide_stages.attn"
    spec.write_text(spec_text("wide_stages_explain", 256, "bf16", "causal", direction="forward+backward"))
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", True)
    for staged, says in ((False, "one stage of Q and dO"), (True, "2 stages of Q and dO")):
        monkeypatch.setattr(hopper, "WIDE_BACKWARD_STAGES", staged)
        monkeypatch.setattr(hopper, "BWD_WIDE_STAGED_PAIRS", BOTH_PAIRS)  # (192, 128)'s staged kernel too
        assert main(["explain", str(spec)]) == 0
        assert says in capsys.readouterr().out


def test_the_shared_memory_model_of_the_wide_path():
    """Two stages fit at d=256 and (192, 128) only because each stage is the consumers' dQ tiles; a third fits
    neither, nor two with separate dQ tiles."""
    limit = SHARED
    for dv in (256, 128):
        assert wide_backward_shared_bytes(hopper.BWD_WIDE, 256, dv) <= limit
        assert wide_backward_shared_bytes(hopper.BWD_WIDE_STAGED, 256, dv) <= limit
        third = dataclasses.replace(hopper.BWD_WIDE_STAGED, stages=3)
        assert wide_backward_shared_bytes(third, 256, dv) > limit
        # one stage's Q, dO and dQ tiles, and a second Q and dO: what two stages would take without sharing
        one = wide_backward_shared_bytes(hopper.BWD_WIDE, 256, dv)
        assert one + 2 * 64 * (256 + dv) > limit
    assert wide_backward_shared_bytes(hopper.BWD_WIDE_STAGED, 256, 256) == 230480  # K, V 64 KB, stages 128, P^T/dS^T 32
    assert wide_backward_shared_bytes(hopper.BWD_WIDE_STAGED, 256, 128) == 214096


def test_the_staged_wide_backward_compiles_for_sm90_with_fewer_spills(monkeypatch):
    """The kernel at BWD_WIDE_STAGED and at BWD_WIDE, d=256 both masks and (192, 128) causal, compiled for sm_90a:
    within shared memory, as the resource model counts it (Triton adds at most 512 bytes of alignment), 12 warps,
    dQ by TMA reductions from the stages, and ptxas spills no more than the one-stage kernel's (on 256-column tiles:
    SPLIT_TILES_192's have their own test)."""
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", True)
    monkeypatch.setattr(hopper, "SPLIT_TILES_192", False)
    cases = [(256, None, "none", "bf16"), (256, None, "causal", "fp16"), (192, 128, "causal", "bf16")]
    jobs, shapes = [], []
    for staged in (False, True):
        monkeypatch.setattr(hopper, "WIDE_BACKWARD_STAGES", staged)
        monkeypatch.setattr(hopper, "BWD_WIDE_STAGED_PAIRS", BOTH_PAIRS)  # (192, 128)'s staged kernel too
        for d, dv, mask, dtype in cases:
            keys = {"head_dim_v": dv} if dv else {}
            kernel = attngen.load(spec_text(f"wide_spill_{d}_{mask}", d, dtype, mask, direction="forward+backward",
                                            **keys))
            jobs.append({"path": str(kernel.path), "gluon_ws": "backward", "ptxas": True})
            shapes.append((hopper.backward(d, mask != "none", dv).main, dv or 256))
    results = probe(jobs)
    for job, result, (shape, dv) in zip(jobs, results, shapes):
        assert "error" not in result, (job, result)
        model = wide_backward_shared_bytes(shape, 256, dv)
        assert model <= result["shared"] <= min(model + 512, SHARED), (job, result, model)
        assert result["warps"] == 12 and result["tma_reduces"] > 0 and result["global_stores"] == 0, result
    one, two = results[:len(cases)], results[len(cases):]
    for case, before, after in zip(cases, one, two):
        assert after["spill_stores"] <= before["spill_stores"] and after["spill_loads"] <= before["spill_loads"], (
            case, before, after)
        assert after["registers"] <= 168, (case, after)


def test_the_split_switch_decides_deepseeks_tiles(monkeypatch):
    """SPLIT_TILES_192 (on by default since its H200 run, one of the switches kernel caches key on) gives (192, 128)'s
    wide backward Q and K tiles of 128 + 64 columns at BWD_WIDE_SPLIT, and leaves d=256's (and its source) as they
    were."""
    assert hopper.SPLIT_TILES_192 and "SPLIT_TILES_192" in hopper.SWITCHES
    monkeypatch.setattr(hopper, "SPLIT_TILES_192", False)
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", True)
    assert hopper.backward(192, True, 128).pieces == ()
    d256_off = attngen.load(spec_text("wide_split_d256", 256, "bf16", "causal", direction="forward+backward"))
    off = attngen.load(spec_text("wide_split_ds", 192, "bf16", "causal", head_dim_v=128, direction="forward+backward"))
    monkeypatch.setattr(hopper, "SPLIT_TILES_192", True)
    program = _program("wide_split_ds", head_dim=192, head_dim_v=128)
    backward = program.warp_specialized.backward
    assert backward == hopper.backward(192, True, 128) and backward.wide
    assert backward.pieces == hopper.tile_pieces(192) == (128, 64) and backward.main == hopper.BWD_WIDE_SPLIT
    assert hopper.backward(256, True).pieces == () and hopper.backward(256, True).main == hopper.BWD_WIDE_STAGED
    on = attngen.load(spec_text("wide_split_ds", 192, "bf16", "causal", head_dim_v=128, direction="forward+backward"))
    assert on.path != off.path and on.module.WS_BWD_SHAPE["PIECES"] == [128, 64]
    assert "PIECES" not in off.module.WS_BWD_SHAPE and "q1_desc" not in off.path.read_text()
    d256_on = attngen.load(spec_text("wide_split_d256", 256, "bf16", "causal", direction="forward+backward"))
    assert d256_on.path.read_text() == d256_off.path.read_text()


@pytest.mark.parametrize("pieces", [(128, 32), (64, 64, 64), (96, 96), (256,)])
def test_the_verifier_checks_the_tile_pieces(pieces, monkeypatch):
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", True)
    monkeypatch.setattr(hopper, "SPLIT_TILES_192", True)
    program = _program("wide_split_verify", head_dim=192, head_dim_v=128)
    verify(program, "test")
    ws = program.warp_specialized
    broken = dataclasses.replace(program, warp_specialized=dataclasses.replace(
        ws, backward=dataclasses.replace(ws.backward, pieces=pieces)))
    with pytest.raises(InternalError, match="tile pieces"):
        verify(broken, "test")


def test_explain_says_the_tiles_are_pieces(capsys, tmp_path, monkeypatch):
    spec = tmp_path / "wide_split.attn"
    spec.write_text(spec_text("wide_split_explain", 192, "bf16", "causal", head_dim_v=128,
                              direction="forward+backward"))
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", True)
    for split in (False, True):
        monkeypatch.setattr(hopper, "SPLIT_TILES_192", split)
        assert main(["explain", str(spec)]) == 0
        assert ("column pieces 128 + 64" in capsys.readouterr().out) == split


def test_the_shared_memory_model_of_the_split_tiles():
    """Q and K in pieces free the 64 zero columns of each tile: two stages of Q and dO fit beside separate dQ tiles
    (128 + 64 columns), a third does not."""
    split = wide_backward_shared_bytes(hopper.BWD_WIDE_SPLIT, 256, 128, pieces=(128, 64))
    assert hopper.BWD_WIDE_SPLIT.stages == 2 and split == 205888 <= SHARED
    # K 24 KB and V 16 KB, two stages of Q and dO 80 KB, P^T and dS^T 32 KB, the dQ tiles 48 KB, the rows 1 KB
    assert split == 1024 * (24 + 16 + 80 + 32 + 48 + 1) + 8 * (1 + 4 + 3)
    third = dataclasses.replace(hopper.BWD_WIDE_SPLIT, stages=3)
    assert wide_backward_shared_bytes(third, 256, 128, pieces=(128, 64)) > SHARED


def test_the_split_tiles_compile_for_sm90_without_spills(monkeypatch):
    """(192, 128)'s wide backward with SPLIT_TILES_192, both masks, compiled for sm_90a: within shared memory as the
    model counts it (Triton adds at most 512 bytes), 12 warps, a sixth fewer wgmma than on 256-column tiles (S^T over
    192 columns, dK and dQ over 192), dQ by two TMA reductions, dK by two TMA stores and dV by one, and ptxas spills
    no more than the 256-column kernel (24 / 16 bytes without a mask, 32 / 24 causal; the split one none)."""
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", True)
    jobs = []
    for split in (False, True):
        monkeypatch.setattr(hopper, "SPLIT_TILES_192", split)
        for mask in ("none", "causal"):
            kernel = attngen.load(spec_text(f"wide_split_sm90_{mask}", 192, "bf16", mask, head_dim_v=128,
                                            direction="forward+backward"))
            jobs.append({"path": str(kernel.path), "gluon_ws": "backward", "ptxas": True})
    results = probe(jobs)
    for job, result in zip(jobs, results):
        assert "error" not in result, (job, result)
        assert result["warps"] == 12 and result["registers"] <= 168 and result["global_stores"] == 0, result
    model = wide_backward_shared_bytes(hopper.BWD_WIDE_SPLIT, 256, 128, pieces=(128, 64))
    for before, after in zip(results[:2], results[2:]):
        assert model <= after["shared"] <= min(model + 512, SHARED), (after, model)
        assert after["spill_stores"] <= before["spill_stores"] and after["spill_loads"] <= before["spill_loads"], (
            before, after)
        assert after["wgmma"] < before["wgmma"] and after["tma_stores"] == 3 and after["tma_reduces"] == 2, after


def test_the_split_launcher_passes_each_piece_its_descriptor(monkeypatch):
    """The launcher with SPLIT_TILES_192, the Gluon kernel stubbed out (interpreter): each of the kernel's descriptor
    parameters gets its tensor in boxes of its piece's columns (Q, K, dK 128 and 64, dQ's float32 accumulator too),
    V, dV and dO 128, by the kernel's own parameter names."""
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", True)
    monkeypatch.setattr(hopper, "SPLIT_TILES_192", True)
    m = attngen.load(spec_text("wide_split_launch", 192, "bf16", "causal", head_dim_v=128,
                               direction="forward+backward")).module
    names, seen = m.attn_bwd_dkdv_ws.arg_names, {}

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.update(zip(names, args), grid=grid)

    monkeypatch.setattr(m, "attn_bwd_dkdv_ws", Kernel())
    B, H, n = 1, 2, 70
    q, k, dk = (torch.randn(B, H, n, 192).bfloat16() for _ in range(3))
    v, do, dv = (torch.randn(B, H, n, 128).bfloat16() for _ in range(3))
    dq_acc = torch.zeros(B, H, n, 256)
    rows = torch.zeros(B, H, 2, 128)
    lse = torch.zeros(B, H, n)
    m.launch_attn_bwd_dkdv_ws(q, k, v, do, lse, lse, dk, dv, 0.5, dq_acc=dq_acc, rows=rows, split=1)
    expected = {"q_desc": (q, 128), "q1_desc": (q, 64), "k_desc": (k, 128), "k1_desc": (k, 64), "dk_desc": (dk, 128),
                "dk1_desc": (dk, 64), "dq_desc": (dq_acc, 128), "dq1_desc": (dq_acc, 64), "v_desc": (v, 128),
                "dv_desc": (dv, 128), "do_desc": (do, 128)}
    for name, (tensor, cols) in expected.items():
        assert seen[name].base is tensor and seen[name].block_shape[3] == cols, name
    assert seen["grid"] == (2, H, B)


def test_deepseeks_row_passes_take_o_and_do_128_wide(monkeypatch):
    """The fused launcher's row passes at (192, 128) in the interpreter, the Gluon kernel stubbed out: delta =
    rowsum(dO * O) over O's and dO's 128 columns (not the next row's), the 256-column accumulator zeroed, dQ written
    in 192 columns only (zeros: the stub adds nothing)."""
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", True)
    m = attngen.load(spec_text("wide_ds_rows", 192, "bf16", "causal", head_dim_v=128,
                               direction="forward+backward")).module
    seen = {}
    monkeypatch.setattr(m, "launch_attn_bwd_dkdv_ws", lambda *a, **kw: seen.update(kw))
    monkeypatch.setattr(m, "ws_bwd_group_split", lambda *a: 1)  # (it asks the GPU for its multiprocessors)
    B, H, n_q = 1, 2, 70
    q, k = (torch.randn(B, H, n_q, 192).bfloat16() for _ in range(2))
    v, out, do = (torch.randn(B, H, n_q, 128).bfloat16() for _ in range(3))
    lse = torch.randn(B, H, n_q)
    rows_of_200 = torch.full((B, H, n_q, 200), float("nan")).bfloat16()  # columns past 192 must stay unwritten
    dq = rows_of_200[..., :192]
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    m.launch_attn_bwd_ws(q, k, v, out, do, lse, dq, dk, dv, 0.5)
    delta = (out.float() * do.float()).sum(-1)
    assert seen["dq_acc"].shape[-1] == 256 and (seen["dq_acc"] == 0).all()
    assert torch.allclose(seen["rows"][:, :, 1, :n_q], delta, atol=1e-3)
    assert (dq == 0).all() and rows_of_200[..., 192:].isnan().all()


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels run on sm_90 only")
@pytest.mark.parametrize("mask", ["none", "causal(top_left)", "causal(bottom_right)"])
@pytest.mark.parametrize("case", [Case(1, 4, 2, 1000, 2049), Case(2, 4, 4, 2049, 2049), Case(1, 8, 8, 1500, 1000),
                                  Case(1, 4, 1, 1024, 1024), Case(1, 16, 2, 4097, 4097)])
@pytest.mark.parametrize("staged", [False, True], ids=["one_stage", "two_stages"])
def test_wide_backward_against_float64(mask, case, staged, monkeypatch):
    """The forward and the wide Gluon backward through the kernel's autograd path, dQ, dK and dV against
    float64's (the tolerances of the other Gluon backward tests: compare_grads), at BWD_WIDE and BWD_WIDE_STAGED
    (WIDE_BACKWARD_STAGES); the last case's programs take 8 heads x 65 query blocks, the stages' ring many times."""
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", True)
    monkeypatch.setattr(hopper, "WIDE_BACKWARD_STAGES", staged)
    monkeypatch.setattr(hopper, "BWD_WIDE_STAGED_PAIRS", BOTH_PAIRS)  # (192, 128)'s staged kernel too
    heads = "" if case.heads == case.kv_heads else f"_g{case.heads}_{case.kv_heads}"
    kernel = attngen.load(spec_text(f"wide_gpu{heads}_{mask[:6]}{len(mask)}", 256, "bf16", mask,
                                    direction="forward+backward", heads=case.heads, kv_heads=case.kv_heads))
    m = kernel.module
    assert m.WS_BWD_SHAPE.get("wide") and m.WS_BWD_SHAPE["STAGES"] == (2 if staged else 1)
    monkeypatch.setitem(m.WS_SHAPE, "min_scores", 0)
    monkeypatch.setitem(m.WS_BWD_SHAPE, "min_scores", 0)
    called = []
    launch = m.launch_attn_bwd_dkdv_ws
    monkeypatch.setattr(m, "launch_attn_bwd_dkdv_ws", lambda *a, **kw: (called.append(1), launch(*a, **kw)))
    q, do = (torch.randn(case.batch, case.heads, case.n_q, 256, device="cuda").bfloat16() for _ in range(2))
    k, v = (torch.randn(case.batch, case.kv_heads, case.n_k, 256, device="cuda").bfloat16() for _ in range(2))
    out, lse = _poisoned_run(kernel, q, k, v)
    assert compare(kernel.spec, case, out, lse, q, k, v).ok
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    kernel.backward(q, k, v, out, lse, do, grads=grads)
    assert called, "the wide Gluon backward did not run"
    results = compare_grads(kernel.spec, q, k, v, do, grads)
    assert all(r.ok for r in results), results



@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels run on sm_90 only")
@pytest.mark.parametrize("mask", ["none", "causal(top_left)"])
@pytest.mark.parametrize("case", [Case(1, 4, 2, 1000, 2049), Case(1, 16, 16, 2049, 2049), Case(2, 8, 2, 3001, 3001)])
@pytest.mark.parametrize("form", ["one_stage", "two_stages", "split_tiles"])
def test_wide_backward_192_128_against_float64(mask, case, form, monkeypatch):
    """DeepSeek's (192, 128) through the wide Gluon backward: dQ, dK (192 wide) and dV (128) against float64's, at
    BWD_WIDE, BWD_WIDE_STAGED (dO then fills half of its stage's tile) and with SPLIT_TILES_192 (Q and K tiles of 128
    + 64 columns, BWD_WIDE_SPLIT's two stages)."""
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", True)
    monkeypatch.setattr(hopper, "WIDE_BACKWARD_STAGES", form == "two_stages")
    monkeypatch.setattr(hopper, "BWD_WIDE_STAGED_PAIRS", BOTH_PAIRS)  # (192, 128)'s staged kernel too
    monkeypatch.setattr(hopper, "SPLIT_TILES_192", form == "split_tiles")
    m = deepseek_backward_against_float64(f"wide_gpu_ds_{mask[:6]}", mask, case, monkeypatch)
    assert m.WS_BWD_SHAPE["STAGES"] == (1 if form == "one_stage" else 2)
    assert m.WS_BWD_SHAPE.get("PIECES") == ([128, 64] if form == "split_tiles" else None)


def deepseek_backward_against_float64(name, mask, case, monkeypatch, patch=None):
    """Check the (192, 128) kernel the policy gives now (spec `name` with `mask`, the case's heads) through the wide
    Gluon backward: dQ, dK and dV against float64's, the forward's output and lse and the gradients poisoned first;
    `patch(module)` first where given. Returns the kernel's module."""
    heads = "" if case.heads == case.kv_heads else f"_g{case.heads}_{case.kv_heads}"
    kernel = attngen.load(spec_text(f"{name}{heads}", 192, "bf16", mask, head_dim_v=128,
                                    direction="forward+backward", heads=case.heads, kv_heads=case.kv_heads))
    m = kernel.module
    if patch is not None:
        patch(m)
    monkeypatch.setitem(m.WS_SHAPE, "min_scores", 0)
    monkeypatch.setitem(m.WS_BWD_SHAPE, "min_scores", 0)
    called = []
    launch = m.launch_attn_bwd_dkdv_ws
    monkeypatch.setattr(m, "launch_attn_bwd_dkdv_ws", lambda *a, **kw: (called.append(1), launch(*a, **kw)))
    q, k = (torch.randn(case.batch, h, n, 192, device="cuda").bfloat16()
            for h, n in ((case.heads, case.n_q), (case.kv_heads, case.n_k)))
    v = torch.randn(case.batch, case.kv_heads, case.n_k, 128, device="cuda").bfloat16()
    do = torch.randn(case.batch, case.heads, case.n_q, 128, device="cuda").bfloat16()
    out = torch.full((case.batch, case.heads, case.n_q, 128), float("nan"), device="cuda").bfloat16()
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    m.forward(q, k, v, kernel.spec.softmax_scale, out=out, lse=lse)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    kernel.backward(q, k, v, out, lse, do, grads=grads)
    assert called, "the wide Gluon backward did not run"
    results = compare_grads(kernel.spec, q, k, v, do, grads)
    assert all(r.ok for r in results), results
    return m
