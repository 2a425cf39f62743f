"""The wide Gluon backward's causal programs in pairs of key tiles (issue 51; policy/hopper.py WIDE_BWD_PAIRED,
`ir.GluonBackward.paired`): DeepSeek's (192, 128) on split tiles, program p taking key tile p and then tile T - 1 - p.

On the CPU: the switch's decision (off by default; causal split tiles only), the verifier's check, the sources it
changes and those it leaves, the generated pairing's tiles (its `_ws_bwd_pair_tile` run over every program), the
launcher's halved grid, explain, and the kernel compiled for sm_90a without spills. On a Hopper GPU (`gpu`, the switch
on): the backward against float64, odd tile counts, tiles no query sees and GQA included, gradients poisoned first.
"""

import dataclasses
import inspect
import textwrap
import types

import pytest
import torch

import attngen
from attngen.analysis.resources import wide_backward_shared_bytes
from attngen.cli import main
from attngen.errors import InternalError
from attngen.ir.verify import verify
from attngen.lang.spec import parse
from attngen.passes import compile_program
from attngen.policy import hopper
from attngen.testing.accuracy import Case
from conftest import spec_text
from probe import probe
from test_gluon_wide_backward import deepseek_backward_against_float64
from test_warp_specialize import HOPPER


def _deepseek(name, mask="causal"):
    return spec_text(name, 192, "bf16", mask, head_dim_v=128, direction="forward+backward")


@pytest.fixture
def wide(monkeypatch):
    """The wide backward on DeepSeek's split tiles, as the policy has them on."""
    monkeypatch.setattr(hopper, "WIDE_BACKWARD", True)
    monkeypatch.setattr(hopper, "SPLIT_TILES_192", True)


def test_the_switch_pairs_the_split_causal_backward_only(wide, monkeypatch):
    assert not hopper.WIDE_BWD_PAIRED and "WIDE_BWD_PAIRED" in hopper.SWITCHES
    assert not hopper.backward(192, True, 128).paired
    monkeypatch.setattr(hopper, "WIDE_BWD_PAIRED", True)
    assert hopper.backward(192, True, 128).paired
    # without a mask every tile has the same work; d=256's stages are its dQ tiles; a variant's tiles are the IR's
    assert not hopper.backward(192, False, 128).paired and not hopper.backward(256, True).paired
    assert not hopper.backward_variant(192, True).paired
    monkeypatch.setattr(hopper, "SPLIT_TILES_192", False)
    assert not hopper.backward(192, True, 128).paired  # (256-column tiles: more spills, see WIDE_BWD_PAIRED)
    monkeypatch.setattr(hopper, "SPLIT_TILES_192", True)
    program = compile_program(parse(_deepseek("wide_pairs_pass")))
    assert program.warp_specialized.backward.paired
    assert program.warp_specialized.backward.constants()["PAIRED"] is True


def test_the_verifier_checks_pairs(wide, monkeypatch):
    monkeypatch.setattr(hopper, "WIDE_BWD_PAIRED", True)
    program = compile_program(parse(_deepseek("wide_pairs_verify")))
    verify(program, "test")
    monkeypatch.setattr(hopper, "WIDE_BACKWARD_STAGES", True)
    staged = compile_program(parse(spec_text("wide_pairs_256", 256, "bf16", "causal", direction="forward+backward")))
    d128 = compile_program(parse(spec_text("wide_pairs_128", 128, "bf16", "causal", direction="forward+backward")))
    assert staged.warp_specialized.backward.main.stages == 2
    for other in (staged, d128):  # the staged wide form, the narrow kernel
        ws = other.warp_specialized
        broken = dataclasses.replace(other, warp_specialized=dataclasses.replace(
            ws, backward=dataclasses.replace(ws.backward, paired=True)))
        with pytest.raises(InternalError, match="paired key tiles"):
            verify(broken, "test")
    ws = program.warp_specialized
    for paired, waves in ((True, -1), (False, 2)):  # (tail waves belong to a paired launch)
        broken = dataclasses.replace(program, warp_specialized=dataclasses.replace(
            ws, backward=dataclasses.replace(ws.backward, paired=paired, pair_tail_waves=waves)))
        with pytest.raises(InternalError, match="pair_tail_waves"):
            verify(broken, "test")


def test_the_switch_changes_only_the_paired_sources(wide, monkeypatch):
    """With the switch on, the sources without a mask and d=256's are those of the switch off; the paired one has the
    pairs' partitions, the fourth barrier, the steps counted on across a program's tiles and one axis of programs."""
    texts = {}
    for paired in (False, True):
        monkeypatch.setattr(hopper, "WIDE_BWD_PAIRED", paired)
        for name, text in (("causal", _deepseek("wide_pairs_src")), ("none", _deepseek("wide_pairs_src_n", "none")),
                           ("d256", spec_text("wide_pairs_src256", 256, "bf16", "causal",
                                              direction="forward+backward"))):
            texts[name, paired] = attngen.load(text).path.read_text()
    assert texts["none", False] == texts["none", True] and texts["d256", False] == texts["d256", True]
    off, on = texts["causal", False], texts["causal", True]
    assert off != on
    for part in ("_ws_bwd_pair_consumer0, (", "_ws_bwd_pair_consumer1, (", "_ws_bwd_pair_loader, (",
                 "mbarrier.arrive(ds_bar.index(3), count=1)", "mbarrier.wait(ds_bar.index(3), 0)",
                 "attn_bwd_dkdv_ws[grid]", "_ws_bwd_pair_program(gl.program_id(0), gl.cdiv(N_K, BLOCK_N), PAIRED_HEADS)",
                 "mbarrier.wait(kv_bar, tile_i & 1)", "mbarrier.wait(ready.index(s), ((step0 + t) // STAGES) & 1)"):
        assert part in on and part not in off, part
    assert "attn_bwd_dkdv_ws[(cdiv(N_K, block_n), H_KV * split, B)]" in off


def _generated(module, *names):
    """The generated Gluon helpers `names` as Python functions over plain integers: their source run with a `gl` of
    Python's arithmetic."""
    gl = types.SimpleNamespace(constexpr=int, maximum=max, minimum=min, cdiv=lambda a, b: -(-a // b))
    scope = {"gl": gl}
    for name in names:
        exec(textwrap.dedent(inspect.getsource(getattr(module, name).fn)).split("\n", 1)[1], scope)  # (no decorator)
    return [scope[name] for name in names]


@pytest.mark.parametrize("heads, paired_heads", [(1, 1), (3, 2), (4, 0), (5, 3)])
def test_the_pairs_take_every_key_tile_once_and_even_work(heads, paired_heads, wide, monkeypatch):
    """Over the launcher's grid (the paired heads' cdiv(T, 2) programs each, then the others' T), the generated
    `_ws_bwd_pair_program` and `_ws_bwd_pair_tile` take every key tile of every head once; causal at N_Q = N_K, a paired
    head's programs have T + 1 query blocks each (the middle tile of an odd T alone: (T + 1) / 2) and a single head's
    come longest first; bottom-right with fewer queries, a tile's first query row is the per-tile grid's."""
    monkeypatch.setattr(hopper, "WIDE_BWD_PAIRED", True)
    program, pair_tile = _generated(attngen.load(_deepseek("wide_pairs_tiles")).module, "_ws_bwd_pair_program",
                                    "_ws_bwd_pair_tile")
    for n_k, n_q, offset in ((64 * 64, 64 * 64, 0), (2049, 2049, 0), (1000, 2049, 0), (64, 64, 0), (3001, 1000, 2001)):
        n_tiles = -(-n_k // 64)
        seen, work = [], {}
        for w in range(paired_heads * -(-n_tiles // 2) + (heads - paired_heads) * n_tiles):
            first, n_pair, bh = program(w, n_tiles, paired_heads)
            assert n_pair == (min(n_tiles - 2 * first, 2) if bh < paired_heads else 1)
            tiles = [pair_tile(first, i, n_tiles, n_q, offset, 64, 64) for i in range(n_pair)]
            seen += [(bh, start_n // 64) for start_n, _, _ in tiles]
            work.setdefault(bh, []).append(sum(n_m for _, _, n_m in tiles))
            for start_n, m_start, n_m in tiles:
                assert m_start == max(start_n - offset, 0) // 64 * 64 and n_m == max(-(-(n_q - m_start) // 64), 0)
        assert sorted(seen) == [(h, t) for h in range(heads) for t in range(n_tiles)], (n_k, n_q)
        if n_q == n_k and n_k % 64 == 0:
            middle = [n_tiles // 2 + 1] if n_tiles % 2 else []
            for bh, steps in work.items():
                assert steps == ([n_tiles + 1] * (n_tiles // 2) + middle if bh < paired_heads
                                 else list(range(n_tiles, 0, -1))), (bh, steps)


def test_the_launcher_ends_on_single_tiles(wide, monkeypatch):
    """The launcher with the switch on, the Gluon kernel stubbed out (interpreter), 4 multiprocessors: one axis of
    programs, the last cdiv(PAIR_TAIL_WAVES x 4, T) (batch, head)s single, the others paired (cdiv(T, 2) programs
    each), and the kernel told how many are paired and the K/V heads."""
    monkeypatch.setattr(hopper, "WIDE_BWD_PAIRED", True)
    m = attngen.load(_deepseek("wide_pairs_launch")).module
    assert m.WS_BWD_SHAPE["PAIRED"] is True and m.WS_BWD_SHAPE["PAIR_TAIL_WAVES"] == hopper.WIDE_BWD_PAIR_TAIL_WAVES
    monkeypatch.setattr(m, "_ws_device", lambda device: (True, 4))
    names, seen = m.attn_bwd_dkdv_ws.arg_names, []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((grid, dict(zip(names, args))))

    monkeypatch.setattr(m, "attn_bwd_dkdv_ws", Kernel())
    B, H = 2, 3
    for waves, n in ((2, 70), (2, 300), (1, 300), (0, 300), (2, 64 * 20)):
        monkeypatch.setitem(m.WS_BWD_SHAPE, "PAIR_TAIL_WAVES", waves)
        q, k, dk = (torch.randn(B, H, n, 192).bfloat16() for _ in range(3))
        v, do, dv = (torch.randn(B, H, n, 128).bfloat16() for _ in range(3))
        lse = torch.zeros(B, H, n)
        m.launch_attn_bwd_dkdv_ws(q, k, v, do, lse, lse, dk, dv, 0.5, dq_acc=torch.zeros(B, H, n, 256),
                                  rows=torch.zeros(B, H, 2, 64 * 20), split=1)
    # (tiles, single heads): (2, 4), (5, 2), (5, 1), (5, 0), (20, 1) of the 6
    assert [grid for grid, _ in seen] == [(4 * 2 + 2 * 1, 1, 1), (2 * 5 + 4 * 3, 1, 1), (1 * 5 + 5 * 3, 1, 1),
                                          (6 * 3, 1, 1), (1 * 20 + 5 * 10, 1, 1)]
    assert [args["PAIRED_HEADS"] for _, args in seen] == [2, 4, 5, 6, 5] and {args["H_KV"] for _, args in seen} == {H}


def test_explain_says_the_tiles_are_paired(capsys, tmp_path, wide, monkeypatch):
    spec = tmp_path / "wide_pairs.attn"
    spec.write_text(_deepseek("wide_pairs_explain"))
    for paired in (False, True):
        monkeypatch.setattr(hopper, "WIDE_BWD_PAIRED", paired)
        assert main(["explain", str(spec)]) == 0
        assert ("WIDE_BWD_PAIRED" in capsys.readouterr().out) == paired


def test_the_paired_backward_compiles_for_sm90_without_spills(wide, monkeypatch):
    """(192, 128)'s causal split backward, paired and not, compiled for sm_90a: no spills either way (ptxas -v), the
    same wgmma and shared memory within the model's (Triton adds at most 512 bytes; the pairs' one more mbarrier), the
    K and V loads written three times in the loader (the first tile's, the second's after its first Q and dO blocks,
    and the second's where it has none)."""
    jobs = []
    for paired in (False, True):
        monkeypatch.setattr(hopper, "WIDE_BWD_PAIRED", paired)
        kernel = attngen.load(_deepseek("wide_pairs_sm90"))
        jobs.append({"path": str(kernel.path), "gluon_ws": "backward", "ptxas": True})
    off, on = probe(jobs)
    assert "error" not in off and "error" not in on, (off, on)
    model = wide_backward_shared_bytes(hopper.BWD_WIDE_SPLIT, 256, 128, pieces=(128, 64))
    assert on["warps"] == 12 and on["registers"] <= 168 and on["global_stores"] == 0, on
    assert on["spill_stores"] == on["spill_loads"] == 0 and not on["wgmma_serialized"], on
    assert model <= on["shared"] <= min(model + 512, 232448), (on, model)
    assert on["wgmma"] == off["wgmma"] and on["tma_reduces"] == off["tma_reduces"] == 2 and on["tma_stores"] == 3
    # K, its second piece and V at least twice more (the PTX may copy a loop's loads besides)
    assert on["tma_loads"] >= off["tma_loads"] + 2 * 3, (off, on)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels run on sm_90 only")
@pytest.mark.parametrize("mask", ["causal(top_left)", "causal(bottom_right)"])
@pytest.mark.parametrize("case", [Case(1, 4, 2, 1000, 2049), Case(1, 16, 16, 2049, 2049), Case(2, 8, 2, 3001, 3001),
                                  Case(1, 4, 4, 4096, 4096), Case(1, 4, 4, 2049, 1000), Case(1, 2, 2, 64, 64)])
@pytest.mark.parametrize("paired", ["every_head", "half_the_heads"])
def test_paired_wide_backward_against_float64(mask, case, paired, wide, monkeypatch):
    """DeepSeek's (192, 128) through the paired wide Gluon backward: dQ, dK (192 wide) and dV (128) against float64's,
    every (batch, K/V head) paired (at these sizes the policy's tail waves would leave them all single) or the first
    half. 2049 keys: 33 tiles, the middle one alone; 1000 queries beside 2049 keys top-left: the second tiles of most
    pairs have no query (their K and V loaded after the loop); 4096: every pair 65 query blocks a head."""
    monkeypatch.setattr(hopper, "WIDE_BWD_PAIRED", True)
    every = paired == "every_head"
    m = deepseek_backward_against_float64(f"wide_pairs_gpu_{mask[7:10]}", mask, case, monkeypatch,
                                          patch=lambda m: monkeypatch.setattr(
                                              m, "ws_bwd_paired_heads",
                                              lambda heads, n_tiles, device: heads if every else heads // 2))
    assert m.WS_BWD_SHAPE.get("PAIRED") and m.WS_BWD_SHAPE.get("PIECES") == [128, 64]
