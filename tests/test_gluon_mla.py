"""The Hopper Gluon MLA decode kernel (templates/gluon_mla_decode.py.j2, passes/warp_specialize_mla.py behind policy
hopper.MLA_GLUON).

On the CPU: which latent specs get the Gluon kernel with the switch on and off and why the others keep the Triton
kernel (`attngen explain` says it), that the generated source takes the math from the IR and dispatches to the kernel,
that the switch-off source is the golden one, the overlapped schedule behind hopper.MLA_OVERLAP (an IR field, the
golden source unchanged with it off), and that the kernel compiles for sm_90 in both schedules (Triton's compiler and
ptxas, in a subprocess): two consumer warpgroups and a loader warp, the scores once (m64n32 wgmma over the block's two
halves of keys), P V on m64n256, shared memory within sm_90's 227 KB and as the resource model counts it, no wgmma
serialised by ptxas. On a Hopper GPU (`gpu`): the kernel in both schedules against float64 at real sizes with
tests/test_mla.py's tolerance, its launches counted.
"""

import os
import re
from dataclasses import replace

import pytest
import torch

import attngen
from attngen.analysis.resources import SHARED_LIMIT, shared_bytes_mla
from attngen.cli import main
from attngen.codegen import render
from attngen.errors import InternalError
from attngen.ir.verify import verify
from attngen.lang.spec import load_file, parse
from attngen.passes import applied_passes, compile_program, warp_specialize_mla
from attngen.policy import hopper
from conftest import HAS_GPU, SPECS, spec_text
from probe import probe

HOPPER = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)
MLA_SPEC = os.path.join(SPECS, "mla_decode.attn")
GOLDEN = os.path.join(SPECS, "..", "generated", "mla_decode.py")


@pytest.fixture
def mla_gluon(monkeypatch):
    """The switch on (the policy's default since its H200 run; tests that need it say so)."""
    monkeypatch.setattr(hopper, "MLA_GLUON", True)


def _latent(head_dim=576, head_dim_v=512, page_size=64, **extra):
    layout = {"kv_layout": f"paged(page_size = {page_size})"} if page_size else {}
    return spec_text(head_dim=head_dim, dtype="bf16", mask="causal(bottom_right)", head_dim_v=head_dim_v,
                     v=f"k[:{head_dim_v}]", split_kv="auto", **layout, **extra)


def test_switched_off_the_mla_spec_keeps_the_triton_kernel(monkeypatch, capsys):
    monkeypatch.setattr(hopper, "MLA_GLUON", False)
    assert "MLA_GLUON" in hopper.SWITCHES  # kernel caches key on it
    spec = load_file(MLA_SPEC)
    program = compile_program(spec)
    assert program.warp_specialized.mla is None and not program.warp_specialized
    assert "hopper.MLA_GLUON" in warp_specialize_mla.refusal(program)
    assert warp_specialize_mla.NAME not in applied_passes(program)
    source = render(spec, program)
    assert "attn_fwd_wsm" not in source and "gluon" not in source
    assert main(["explain", MLA_SPEC]) == 0
    assert "warp-specialize-mla: no Hopper Gluon kernel (the Gluon MLA kernel is switched off (policy hopper.MLA_GLUON)" \
        in capsys.readouterr().out


def test_switched_on_the_mla_spec_gets_the_gluon_kernel(mla_gluon, capsys):
    assert hopper.MLA_GLUON  # (the policy's default: the golden source is the switched-on one)
    spec = load_file(MLA_SPEC)
    program = compile_program(spec)
    assert warp_specialize_mla.refusal(program) is None and warp_specialize_mla.NAME in applied_passes(program)
    assert program.warp_specialized.mla == hopper.MLA_DECODE
    assert (hopper.MLA_DECODE.rows, hopper.MLA_DECODE.block_n, hopper.MLA_DECODE.consumers) == (64, 64, 2)
    assert program.warp_specialized.decode is None and program.warp_specialized.forward is None
    source = render(spec, program)
    compile(source, "mla_gluon.py", "exec")
    with open(GOLDEN) as f:
        assert source == f.read()
    # the dispatch: the Gluon kernel where it runs, the Triton kernel otherwise, the same split count and merge
    assert "ws = config.pop(\"warp_specialized\", True) and wsm_ready(q, k_cache, out)" in source
    assert "launch_attn_fwd_wsm(q, k_cache, o_part, lse_part, cache_seqlens, block_table, sm_scale)" in source
    assert "launch_attn_fwd_wsm(q, k_cache, out.unsqueeze(1), lse.unsqueeze(1)" in source
    # the IR's math through the hooks: the scale, the bottom-right diagonal over packed rows, the mask, the epilogue
    assert "qk_scale = sm_scale * 1.4426950408889634" in source
    assert "diag = n_k - N_Q + s_rows // GROUP" in source
    assert "keep = (keys[None, :] <= diag[:, None]) & (keys < n_k)[None, :]" in source
    assert "p = gl.exp2(sc * qk_scale - m_use[:, None])" in source
    assert "out = acc / l_o[:, None]" in source and "(m_i + gl.log2(l_safe)) * 0.6931471805599453" in source
    assert "_wsm_scores" not in source and "sc_next" not in source  # (the serial schedule: hopper.MLA_OVERLAP off)
    # V is the latent tile's first columns: the P V operand is the same shared buffer the scores read
    assert "v = kv_smem.index(2 * s + WG)" in source and not re.search(r"\bv_(smem|desc)\b", source.split("# -- the warp")[-1])
    assert main(["explain", MLA_SPEC]) == 0
    text = capsys.readouterr().out
    assert "gluon MLA decode: 64x64 tiles (packed query rows x keys), 2 stages, 2 consumers x 240 regs" in text
    assert ("warp-specialize-mla: on Hopper the Gluon MLA kernel runs calls of at least 64 packed query rows "
            "(heads x N_Q; fewer keep the Triton kernel): 64 rows x 64 keys a tile") in text


@pytest.fixture
def mla_overlap(monkeypatch):
    """The overlapped schedule (policy hopper.MLA_OVERLAP, off by default) with the Gluon kernel on."""
    monkeypatch.setattr(hopper, "MLA_GLUON", True)
    monkeypatch.setattr(hopper, "MLA_OVERLAP", True)


def test_the_overlap_switch_puts_the_overlapped_schedule_in_the_ir_and_the_source(mla_overlap, capsys):
    """hopper.MLA_OVERLAP selects MLA_DECODE_OVERLAP (ir.GluonMlaDecode.overlap), which the template turns into a
    consumer that issues block j + 1's scores before block j's softmax and waits for them with block j's P V; kernel
    caches key on the switch; explain says which schedule runs."""
    assert "MLA_OVERLAP" in hopper.SWITCHES  # kernel caches key on it
    spec = load_file(MLA_SPEC)
    program = compile_program(spec)
    m = program.warp_specialized.mla
    assert m == hopper.MLA_DECODE_OVERLAP and m.overlap and (m.block_n, m.stages) == (32, 4)
    assert replace(m, block_n=64, stages=2, overlap=False) == hopper.MLA_DECODE
    source = render(spec, program)
    compile(source, "mla_overlap.py", "exec")
    with open(GOLDEN) as f:
        assert source != f.read()
    consume = source.split("def _wsm_consume(")[1].split("@gluon.jit")[0]
    # the scores of the split's first block before the loop; in it, the next block's issued before this block's
    # softmax and P V (`_wsm_block`: it issues P V without waiting) and both waited for at the block's end
    assert consume.index("sc = warpgroup_mma_wait(0, deps=(_wsm_scores(") < consume.index("for j in range(j0, j1 - 1):")
    loop = consume.split("for j in range(j0, j1 - 1):")[1].split("if j0 < j1:")[0]
    assert (loop.index("sc_next = _wsm_scores(") < loop.index("= _wsm_block(sc, acc, l_i, m_i, j,")
            < loop.index("sc, acc = warpgroup_mma_wait(0, deps=(sc_next, acc))") < loop.index("mbarrier.arrive(empty"))
    assert "_wsm_block(sc, acc, l_i, m_i, j1 - 1," in consume  # the split's last block, with no next scores
    block = source.split("def _wsm_block(")[1].split("@gluon.jit")[0]
    assert "warpgroup_mma_wait" not in block and "is_async=True)\n    return acc, l_i, m_i" in block
    # the math from the IR's hooks, as in the serial schedule
    assert "keep = (keys[None, :] <= diag[:, None]) & (keys < n_k)[None, :]" in block
    assert "p = gl.exp2(sc * qk_scale - m_use[:, None])" in block
    assert main(["explain", MLA_SPEC]) == 0
    text = capsys.readouterr().out
    assert "gluon MLA decode: 64x32 tiles (packed query rows x keys), 4 stages" in text
    assert "from 64 packed rows, the next block's S overlapped" in text
    assert "each consumer issues the next block's S before this block's softmax and P V (hopper.MLA_OVERLAP)" in text


def test_the_seesaw_switch_puts_the_seesaw_schedule_in_the_ir_and_the_source(monkeypatch, capsys):
    """hopper.MLA_SEESAW selects MLA_DECODE_SEESAW (ir.GluonMlaDecode.seesaw; MLA_DECODE's tiles): consumer 0 takes
    a pair's first block's whole scores and softmax and hands its row maxima and P over (one mbarrier), consumer 1
    the second's from them, each adding its own block's P V from registers and the other's from the shared P tile;
    kernel caches key on the switch; explain says which schedule runs; the verifier takes it on even stages only."""
    monkeypatch.setattr(hopper, "MLA_GLUON", True)
    monkeypatch.setattr(hopper, "MLA_SEESAW", True)
    assert "MLA_SEESAW" in hopper.SWITCHES
    spec = load_file(MLA_SPEC)
    program = compile_program(spec)
    m = program.warp_specialized.mla
    assert m == hopper.MLA_DECODE_SEESAW and m.seesaw and replace(m, seesaw=False) == hopper.MLA_DECODE
    source = render(spec, program)
    compile(source, "mla_seesaw.py", "exec")
    consume = source.split("def _wsm_consume(")[1].split("@gluon.jit")[0]
    loop = consume.split("for t in range(0, gl.cdiv(j1 - j0, 2)):")[1].split("# the row sums")[0]
    first, second = loop.split("        else:\n")
    # consumer 0: its block's scores, softmax, P and row maxima handed over, then P_a V_a from registers; P_b V_b
    # from the shared tile once consumer 1 has stored it
    assert (first.index("sc = warpgroup_mma(q_smem.index(0), kv_smem.index(2 * sa)") < first.index("p_smem.store(p)")
            < first.index("mbarrier.arrive(a_bar, count=1)") < first.index("gl.convert_layout(p, p_op)")
            < first.index("mbarrier.wait(b_bar, t & 1)") < first.index("acc = warpgroup_mma(p_smem, kv_smem.index(2 * sb)"))
    # consumer 1: the second block's scores before a_bar; P_a V_a from the tile, then its own P stored, b_bar
    assert (second.index("kv_smem.index(2 * sb).permute") < second.index("mbarrier.wait(a_bar, t & 1)")
            < second.index("acc = warpgroup_mma(p_smem, kv_smem.index(2 * sa + 1)") < second.index("p_smem.store(p)")
            < second.index("mbarrier.arrive(b_bar, count=1)") < second.index("gl.convert_layout(p, p_op)"))
    assert "p = gl.exp2(sc * qk_scale - m_use[:, None])" in first and "keep = (keys[None, :] <= diag[:, None])" in second
    assert "mbarrier.init(bars.index(1), count=1)" in source and "'SEESAW': True" in source
    assert main(["explain", MLA_SPEC]) == 0
    text = capsys.readouterr().out
    assert "from 64 packed rows, blocks in seesaw pairs" in text and "(hopper.MLA_SEESAW, FlashMLA's seesaw)" in text
    verify(program, "test")
    verify(replace(program, warp_specialized=replace(program.warp_specialized, mla=replace(m, block_n=32, stages=4))),
           "test")  # (the 32 x 4 shape measured beside it)
    for shape, words in ((dict(stages=3), "seesaw"), (dict(overlap=True), "seesaw"), (dict(defer_pv=True), "serial")):
        with pytest.raises(InternalError, match=words):
            verify(replace(program, warp_specialized=replace(program.warp_specialized, mla=replace(m, **shape))), "t")


def test_the_verifier_refuses_the_overlap_on_one_stage(mla_overlap):
    """The next block's scores read a second tile of the ring while this block's P V reads the first."""
    program = compile_program(load_file(MLA_SPEC))
    verify(program, "test")
    one = replace(program.warp_specialized.mla, stages=1)
    with pytest.raises(InternalError, match="overlapped on 1 stage"):
        verify(replace(program, warp_specialized=replace(program.warp_specialized, mla=one)), "test")


@pytest.mark.parametrize("text,words", [
    (_latent(page_size=None), "a contiguous cache"),
    (_latent(page_size=16), "a page of 16 tokens"),
    (_latent(head_dim=80, head_dim_v=64, page_size=16), "(head_dim, head_dim_v) = (80, 64)"),
    (_latent().replace("causal(bottom_right)", "window(100)"), "no mask or a causal one"),
], ids=["contiguous", "paged16", "80-64", "window"])
def test_other_latent_specs_keep_the_triton_kernel_and_say_why(mla_gluon, text, words):
    program = compile_program(parse(text))
    assert program.warp_specialized.mla is None
    assert words in warp_specialize_mla.refusal(program)


def test_a_spec_without_a_latent_cache_is_not_the_pass_s(mla_gluon):
    program = compile_program(parse(spec_text(head_dim=128, dtype="bf16", mask="causal(bottom_right)",
                                              split_kv="auto", kv_layout="paged(page_size = 64)")))
    assert warp_specialize_mla.refusal(program) is None and not warp_specialize_mla.applies(program)
    assert program.warp_specialized.mla is None and program.warp_specialized.decode is not None


@pytest.mark.parametrize("schedule", ["serial", "overlap", "seesaw", "defer"])
def test_the_gluon_mla_decode_compiles_for_sm90(mla_gluon, monkeypatch, tmp_path, schedule):
    """ptxas (sm_90a) on the kernel as its launcher launches it: 12 warps (two consumer warpgroups and the loader
    padded to one), the scores once (36 m64n(BLOCK_N / 2)k16 a warpgroup: 576 columns over two consumers of half the
    block's keys each), P V on m64n256k16 (BLOCK_N / 16 a warpgroup), three TMA copies a block, the resource model's
    shared memory (within sm_90's 232,448 bytes), at most maxnreg registers, few spilled bytes and no wgmma
    serialised. Serial: blocks of 64 keys; overlapped (hopper.MLA_OVERLAP): of 32 in 4 stages, and each product in
    the code twice (the split's first block's scores before the loop, its last block's P V after it). Seesaw
    (hopper.MLA_SEESAW): each consumer a whole block's scores (36 m64n64k16) and each block's P V twice in the code
    (its own block's from registers, the other's from the shared tile). Deferred P V (hopper.MLA_DEFER_PV): the
    scores in the code twice (the split's first block's before the loop), each P V twice (its last block's after)."""
    overlap, seesaw, defer = (schedule == name for name in ("overlap", "seesaw", "defer"))
    monkeypatch.setattr(hopper, "MLA_OVERLAP", overlap)
    monkeypatch.setattr(hopper, "MLA_SEESAW", seesaw)
    monkeypatch.setattr(hopper, "MLA_DEFER_PV", defer)
    spec = load_file(MLA_SPEC)
    program = compile_program(spec)
    path = tmp_path / "mla_gluon_sm90.py"
    path.write_text(render(spec, program))
    (result,) = probe([{"path": str(path), "gluon_ws": "mla", "ptxas": True}])
    assert "error" not in result, result
    m, copies = program.warp_specialized.mla, 2 if overlap or seesaw or defer else 1
    assert (m.overlap, m.seesaw, m.defer_pv) == (overlap, seesaw, defer) and m.block_n == (32 if overlap else 64), m
    assert result["warps"] == 12, result
    assert result["wgmma_s"] == (2 if overlap or defer else 1) * 2 * 36, result
    assert result["wgmma_pv"] == copies * 2 * m.block_n // 16, result
    assert result["wgmma"] == result["wgmma_s"] + result["wgmma_pv"] and result["tma_loads"] >= 3, result
    model = shared_bytes_mla(576, 2, m.rows, m.block_n, m.stages, m.seesaw)
    assert model <= result["shared"] <= model + 1024 and result["shared"] <= SHARED_LIMIT[(9, 0)], (model, result)
    assert result["registers"] <= m.maxnreg and not result["wgmma_serialized"], result
    # NOTE: ptxas reports 56 bytes of spill stores (52 of loads) serial at maxnreg 168, none overlapped (its S
    # accumulators are [64, 16]); the bound catches a regression
    # (seesaw: 384 / 380 bytes, all in consumer 1, the worker partition: wgmma descriptors of its scores reloaded;
    # deferred P V: 36 / 52)
    bound = 0 if overlap else 400 if seesaw else 128
    assert result["spill_stores"] <= bound and result["spill_loads"] <= bound, result


def test_the_sweep_s_gluon_comparison_loads_the_switched_module_and_refuses_to_time_the_wrong_kernel():
    """benchmarks/mla_sweep.py --gluon turns the switch on for its own module (and back), names each module's
    schedule in its rows, and where the Gluon kernel cannot run (here: no GPU) it says so instead of timing the
    Triton kernel under the Gluon kernel's name."""
    import importlib.util

    path = os.path.join(SPECS, "..", "benchmarks", "mla_sweep.py")
    loaded = importlib.util.spec_from_file_location("mla_sweep_gluon", path)
    sweep = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(sweep)
    before = hopper.MLA_GLUON
    with pytest.raises(RuntimeError, match="wsm_ready"):
        sweep.gluon_against_triton(16, 1, 64, device="cpu")
    assert hopper.MLA_GLUON is before
    assert sweep.describe({"warp_specialized": 1, "num_splits": 4}) == "gluon MLA kernel num_splits=4"
    assert (sweep.describe({"warp_specialized": 1, "num_splits": 2}, "overlapped 32x4")
            == "gluon MLA kernel overlapped 32x4 num_splits=2")
    # another shape for a schedule, through the policy objects, is a module of its own (caches key on the switches,
    # not on the shapes) and leaves the policy as it was
    policy = hopper.MLA_GLUON, hopper.MLA_OVERLAP, hopper.MLA_DECODE, hopper.MLA_DECODE_OVERLAP
    kernel, name = sweep.load_gluon(overlap=False, shape=(32, 4))
    assert name == "serial 32x4" and (kernel.module.WSM_SHAPE["BLOCK_N"], kernel.module.WSM_SHAPE["STAGES"]) == (32, 4)
    assert (hopper.MLA_GLUON, hopper.MLA_OVERLAP, hopper.MLA_DECODE, hopper.MLA_DECODE_OVERLAP) == policy
    assert sweep.load_gluon(overlap=True)[1] == "overlapped 32x4" and sweep.load_gluon()[1] == "serial 64x2"
    assert sweep.load_gluon(seesaw=True)[1] == "seesaw 64x2" and hopper.MLA_SEESAW is False
    # 16 heads' 16 packed rows: a module whose min_rows lets the Gluon kernel take them, the policy left as it was
    kernel, _ = sweep.load_gluon(min_rows=1)
    assert kernel.module.WSM_SHAPE["MIN_ROWS"] == 1 and hopper.MLA_DECODE.min_rows == 64


# -- on a Hopper GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon MLA kernel is sm_90's")
@pytest.mark.parametrize("schedule", ["serial", "overlap", "seesaw", "defer"])
@pytest.mark.parametrize("n_q", [1, 2])
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_gluon_mla_decode_at_real_sizes(mla_gluon, monkeypatch, heads, n_q, schedule):
    """DeepSeek-V3's decode at batch 4 x up to 4k keys (a full sequence, N_Q keys, odd lengths), 576/512 bf16,
    64-token pages shuffled over a pool whose other slots are NaN, at the rule's split count, one split and 3, in
    each schedule (hopper.MLA_OVERLAP: a split of one block has no next block to overlap; hopper.MLA_SEESAW: splits
    of odd and even block counts, an odd one's last pair without its second block; hopper.MLA_DEFER_PV: the serial
    one with its P V waited for behind the next block's S); the Gluon kernel runs (the
    Triton partial kernel would raise) and its launches are counted; a CUDA graph's replay gives the eager result."""
    from test_mla import _within

    monkeypatch.setattr(hopper, "MLA_OVERLAP", schedule == "overlap")
    monkeypatch.setattr(hopper, "MLA_SEESAW", schedule == "seesaw")
    monkeypatch.setattr(hopper, "MLA_DEFER_PV", schedule == "defer")
    module = attngen.load(MLA_SPEC).module
    assert hasattr(module, "attn_fwd_wsm") and hasattr(module, "_wsm_scores") == (schedule == "overlap")
    assert module.WSM_SHAPE.get("SEESAW", False) == (schedule == "seesaw")
    # (calls of fewer packed rows than MIN_ROWS keep the Triton kernel: the padded tile is tested here all the same)
    monkeypatch.setitem(module.WSM_SHAPE, "MIN_ROWS", 1)

    def no_triton(*args, **kwargs):
        raise AssertionError("the Triton partial kernel ran: the Gluon MLA kernel should have")

    launches = []
    gluon = module.launch_attn_fwd_wsm
    monkeypatch.setattr(module, "launch_attn_fwd", no_triton)
    monkeypatch.setattr(module, "launch_attn_fwd_wsm", lambda *a, **k: (launches.append(1), gluon(*a, **k))[1])
    gen = torch.Generator("cuda").manual_seed(51)
    batch, pages_per_seq, page = 4, 64, 64
    q = (torch.randn(batch, n_q, heads, 576, generator=gen, device="cuda") * 0.3).bfloat16()
    pool = torch.full((batch * pages_per_seq + 5, page, 1, 576), float("nan"), device="cuda").bfloat16()
    order = torch.randperm(batch * pages_per_seq + 5, generator=gen, device="cuda")[: batch * pages_per_seq]
    lens = torch.tensor([pages_per_seq * page, n_q, 2049, 3001], dtype=torch.int32, device="cuda")
    for b in range(batch):  # each sequence's keys on its shuffled pages; slots past its length stay NaN
        keys = torch.randn(int(lens[b]), 576, generator=gen, device="cuda").bfloat16()
        rows = order.view(batch, pages_per_seq)[b]
        flat = pool[rows].view(-1, 576)
        flat[: int(lens[b])] = keys
        pool[rows] = flat.view(pages_per_seq, page, 1, 576)
    table = order.view(batch, pages_per_seq).to(torch.int32)
    for num_splits in (0, 1, 3):
        out = torch.full((batch, heads, n_q, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        module.forward_kvcache(q.transpose(1, 2), pool, None, lens, table, out=out, num_splits=num_splits)
        reference_pool = torch.nan_to_num(pool, nan=0.0)  # (slots past a sequence are masked: any value will do)
        _within(out.transpose(1, 2), q, reference_pool, lens, table, 512)
    assert len(launches) == 3
    # captured in a CUDA graph (no host sync in the launch), the replay gives the eager call's result
    graph, captured = torch.cuda.CUDAGraph(), torch.empty_like(out)
    with torch.cuda.graph(graph):
        module.forward_kvcache(q.transpose(1, 2), pool, None, lens, table, out=captured, num_splits=3)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon MLA kernel is sm_90's")
def test_gpu_calls_of_fewer_rows_than_min_rows_keep_the_triton_kernel(mla_gluon, monkeypatch):
    """16 heads x 1 query (16 packed rows) take the Triton kernel's 16-row tiles, 128 heads the Gluon kernel
    (MLA_DECODE.min_rows = 64), both against float64."""
    from test_mla import _within

    module = attngen.load(MLA_SPEC).module
    assert module.WSM_SHAPE["MIN_ROWS"] == hopper.MLA_DECODE.min_rows == 64
    launches = []
    gluon = module.launch_attn_fwd_wsm
    monkeypatch.setattr(module, "launch_attn_fwd_wsm", lambda *a, **k: (launches.append(1), gluon(*a, **k))[1])
    gen = torch.Generator("cuda").manual_seed(7)
    pool = torch.randn(40, 64, 1, 576, generator=gen, device="cuda").bfloat16()
    table = torch.randperm(40, generator=gen, device="cuda")[:36].view(2, 18).to(torch.int32)
    lens = torch.tensor([1100, 777], dtype=torch.int32, device="cuda")
    for heads, expected in ((16, 0), (128, 1)):
        q = (torch.randn(2, 1, heads, 576, generator=gen, device="cuda") * 0.3).bfloat16()
        before = len(launches)
        out = torch.full((2, heads, 1, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        module.forward_kvcache(q.transpose(1, 2), pool, None, lens, table, out=out)
        _within(out.transpose(1, 2), q, pool, lens, table, 512)
        assert len(launches) - before == expected, heads



@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "triton"])
def test_the_split_count_fills_one_wave_where_the_gluon_kernel_runs(mla_gluon, monkeypatch, gluon):
    """Where the Gluon MLA kernel runs (`gluon_runs_here` and `wsm_ready`, faked here: the interpreter has no sm_90)
    its programs are bound by the tensor cores, one a multiprocessor, so the split count fills one wave
    (policy/splits.py choose_wave_splits; on the H200 1 split at batch 64 x 8k gave 457 TFLOP/s, the memory-bound
    rule's 4 gave 369): attention_with_kvcache's plan and the module's own count (num_splits=0) both take it. Where
    the Triton kernel runs, both keep the memory-bound rule. The shape is one where the two rules differ."""
    from attngen.runtime.parts import KVCachePart
    from attngen.runtime.plans import PLANS
    from conftest import record_split_launches

    PLANS.clear()  # (a plan kept from an earlier call of this signature would not load the faked kernel)
    modules, counts = record_split_launches(monkeypatch, "wsm", lambda *args: gluon, caches=1)
    monkeypatch.setattr(KVCachePart, "gluon_runs_here", lambda self: gluon)
    gen = torch.Generator().manual_seed(3)
    heads, pages = 128, 20
    q = torch.randn(1, 1, heads, 576, generator=gen).bfloat16()
    pool = torch.randn(pages + 1, 64, 1, 576, generator=gen).bfloat16()
    table = torch.randperm(pages + 1, generator=gen)[:pages].view(1, pages).to(torch.int32)
    lens = torch.tensor([pages * 64 - 37], dtype=torch.int32)
    attngen.attention_with_kvcache(q, pool, None, lens, table, head_dim_v=512)
    PLANS.clear()  # (nor should a later call keep this one's plan of the faked kernel)
    module = modules[-1]
    config = module.DEFAULT_CONFIG | {"warp_specialized": int(gluon)}
    out = torch.empty(1, heads, 1, 512, dtype=torch.bfloat16)
    module.forward_kvcache(q.transpose(1, 2), pool, None, lens, table, out=out, num_splits=0, config=dict(config))
    programs = -(-heads // config["BLOCK_M"])  # batch 1, one latent head, one query
    key_blocks = -(-pages * 64 // config["BLOCK_N"])
    wave, memory = module.choose_wave_splits(programs, key_blocks, 8), module.choose_num_splits(programs, key_blocks, 8)
    assert wave != memory  # (8: the interpreter's stand-in for the SMs)
    assert counts == [("wsm", wave)] * 2 if gluon else [("triton", memory)] * 2
    # one wave: programs x splits within the SMs, one more split past them
    assert programs * wave <= 8 < programs * (wave + 1)
