"""The Hopper Gluon decode kernel over an FP8 (e4m3) KV cache (templates/gluon_decode.py.j2 with `kv_gl_dtype`,
passes/warp_specialize_decode.py behind policy hopper.FP8_DECODE_GLUON), with one consumer warpgroup or, behind
hopper.FP8_DECODE_2WG, two (hopper.DECODE_FP8_2WG).

On the CPU: which FP8-cache specs get the Gluon kernel with the switch on and off; that its generated source takes
the descales from the IR (K's factor in the scale, V's on the output) and widens the e4m3 tiles in registers; that
it compiles for sm_90 (Triton's compiler and ptxas, in a subprocess) without spilling, beside the 16-bit kernel. On a
Hopper GPU (`gpu`): the kernel against float64 of the dequantised cache at real sizes, with test_fp8kv.py's
tolerance (the widening is exact, so the 16-bit rule holds unloosened).

Each spec here has a name of its own: a module compiled with the switch on must not be one the API (switch off)
shares through the disk cache.
"""

import re
from dataclasses import replace

import pytest
import torch

import attngen
from attngen.codegen import render
from attngen import ir
from attngen.errors import InternalError
from attngen.ir.verify import verify
from attngen.lang.spec import load_file, parse
from attngen.passes import compile_program, warp_specialize_decode
from attngen.policy import hopper
from conftest import HAS_GPU
from probe import probe

HOPPER = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)
FP8 = torch.float8_e4m3fn
LAYOUTS = {"contiguous": "contiguous", "paged16": "paged(page_size = 16)"}


def _text(name, mask="causal(bottom_right)", layout="contiguous", kv_dtype="fp8_e4m3", head_dim=128, dtype="bf16"):
    return (f"kernel {name} {{\n    mask = {mask}\n    head_dim = {head_dim}\n    dtype = {dtype}\n"
            f"    kv_dtype = {kv_dtype}\n    split_kv = auto\n    kv_layout = {layout}\n}}\n")


@pytest.fixture
def fp8_gluon(monkeypatch):
    """The Gluon FP8 decode with one consumer warpgroup (hopper.FP8_DECODE_GLUON on, FP8_DECODE_2WG off: the tests
    of DECODE_FP8's kernel; `two_wg` turns the second on, the shared state's: FP8_DECODE_HALVES off; `halves` the
    policy's), q exact and K widened (FP8_DECODE_Q8 0), the memory-bound split rule (FP8_DECODE_ONE_WAVE off)."""
    monkeypatch.setattr(hopper, "FP8_DECODE_GLUON", True)
    monkeypatch.setattr(hopper, "FP8_DECODE_2WG", False)
    monkeypatch.setattr(hopper, "FP8_DECODE_HALVES", False)
    monkeypatch.setattr(hopper, "FP8_DECODE_Q8", 0)
    monkeypatch.setattr(hopper, "FP8_DECODE_ONE_WAVE", False)


@pytest.fixture
def two_wg(fp8_gluon, monkeypatch):
    """The Gluon FP8 decode with two consumer warpgroups (hopper.FP8_DECODE_2WG on)."""
    monkeypatch.setattr(hopper, "FP8_DECODE_2WG", True)


def test_by_default_an_fp8_cache_keeps_the_triton_kernel(monkeypatch):
    monkeypatch.setattr(hopper, "FP8_DECODE_GLUON", False)
    spec = parse(_text("gfp8_off"))
    program = compile_program(spec)
    assert program.warp_specialized.decode is None and "attn_fwd_wsd" not in render(spec, program)
    assert "hopper.FP8_DECODE_GLUON" in warp_specialize_decode.fp8_refusal(program)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mask", ["causal(bottom_right)", "none"])
def test_switched_on_an_fp8_cache_gets_the_gluon_decode(fp8_gluon, mask, layout):
    spec = parse(_text(f"gfp8_on_{mask[:4]}_{layout}", mask, LAYOUTS[layout]))
    program = compile_program(spec)
    assert warp_specialize_decode.fp8_refusal(program) is None
    assert program.warp_specialized.decode == hopper.DECODE_FP8 == hopper.decode("fp8_e4m3")
    source = render(spec, program)
    compile(source, "gfp8.py", "exec")
    # the ring holds the cache's e4m3 bytes; the consumer widens both tiles to bf16 as wgmma's register A operand
    assert "k_smem = gl.allocate_shared_memory(gl.float8e4nv," in source
    assert "_WSD_LAYOUT = gl.NVMMASharedLayout.get_default_for(_WSD_BOX, gl.float8e4nv)" in source
    assert "k_tile = _gl_e4m3_to_bf16(k_smem.index(s).load(a_op))" in source
    assert "v_tile = _gl_e4m3_to_bf16(v_smem.index(s).permute((1, 0)).load(a_op))" in source
    # pass descale's math, from the IR: K's factor of (b, hkv) in the scale, V's on the output
    assert ("qk_scale = sm_scale * 1.4426950408889634 * gl.load(K_DESCALE + b.to(gl.int64) * stride_k_descale_0 "
            "+ hkv * stride_k_descale_1)") in source
    assert "gl.convert_layout(acc * v_descale / l_safe[None, :], out_t)" in source
    assert "k_descale, *k_descale.stride(), v_descale, *v_descale.stride()" in source  # the launcher passes them


def test_the_16bit_kernel_keeps_its_shape_and_an_fp8_variant_keeps_the_triton_kernel(fp8_gluon):
    spec = parse(_text("gfp8_bf16", kv_dtype="bf16").replace("    kv_dtype = bf16\n", ""))
    program = compile_program(spec)
    assert program.warp_specialized.decode == hopper.DECODE
    source = render(spec, program)
    assert "gl.float8e4nv" not in source and "gl.convert_layout(acc / l_safe[None, :], out_t)" in source
    window = compile_program(parse(_text("gfp8_window", mask="window(300)")))
    assert window.warp_specialized.decode is None
    assert "with a variant" in warp_specialize_decode.fp8_refusal(window)


def test_the_fp8_gluon_decode_compiles_for_sm90(fp8_gluon, tmp_path):
    """Compiled for sm_90 beside the 16-bit kernel (generated/decode_paged16_d128.py): the consumer warpgroup and
    the loader, wgmma for both products, the ring's copies, and no spills up to the most rows it takes."""
    assert hopper.DECODE_FP8.rows == 32
    jobs = []
    for name, mask, layout, rows in (("c_causal", "causal(bottom_right)", "contiguous", 8),
                                     ("p_causal", "causal(bottom_right)", "paged16", 8),
                                     ("p_none", "none", "paged16", 16), ("c_d64", "none", "contiguous", 32),
                                     ("c_fp16", "causal(bottom_right)", "contiguous", 8)):
        spec = parse(_text(f"gfp8_sm90_{name}", mask, LAYOUTS[layout], head_dim=64 if "d64" in name else 128,
                           dtype="fp16" if "fp16" in name else "bf16"))
        path = tmp_path / f"gfp8_sm90_{name}.py"
        path.write_text(render(spec, compile_program(spec)))
        jobs.append({"path": str(path), "gluon_ws": "decode", "rows": rows, "ptxas": True})
    bf16 = {"path": "generated/decode_paged16_d128.py", "gluon_ws": "decode", "rows": 8, "ptxas": True}
    results = probe(jobs + [bf16])
    for job, result in zip(jobs + [bf16], results):
        assert "error" not in result, (job, result)
        assert result["warps"] == 8 and result["wgmma"] > 0 and result["tma_loads"] >= 2, (job, result)
        assert result["spill_stores"] == 0 and result["spill_loads"] == 0, (job, result)
    # a block of 128 e4m3 keys is the 16-bit kernel's 64 keys' bytes: the same ring, twice the wgmma a block
    assert abs(results[1]["shared"] - results[-1]["shared"]) < 4096, results
    assert results[1]["wgmma"] == 2 * results[-1]["wgmma"], results


def test_the_policy_takes_two_consumer_warpgroups_by_default():
    assert hopper.FP8_DECODE_GLUON and hopper.FP8_DECODE_2WG and hopper.FP8_DECODE_HALVES  # (on since their H200 runs)
    assert "FP8_DECODE_HALVES" in hopper.SWITCHES
    shape = compile_program(parse(_text("g2wg_default"))).warp_specialized.decode
    # (q as two e4m3 terms a row, K read from the ring as S^T's operand: no K permuted for the register operand)
    assert hopper.FP8_DECODE_Q8 == 2
    # (at d=128 over 256-key blocks in two stages: FP8_DECODE_2WG_BLOCK_N, FP8_DECODE_2WG_STAGES)
    assert shape == replace(hopper.DECODE_FP8_2WG, halves=True, q_e4m3=2, permute_k=False, one_wave=True,
                            block_n=hopper.FP8_DECODE_2WG_BLOCK_N[128], stages=hopper.FP8_DECODE_2WG_STAGES[128])
    assert (shape.block_n, shape.stages) == (256, 2)
    assert shape.constants()["HALVES"] and shape.constants()["Q_E4M3"] == 2
    # d=64 takes the halves too (each warpgroup all of O^T's 64 rows over its half of a block), over 256-key blocks
    # (each half two m64 tiles of S^T), q as two e4m3 terms
    assert 64 in hopper.FP8_DECODE_Q8_HEAD_DIMS and 64 in hopper.FP8_DECODE_2WG_HEAD_DIMS
    d64 = compile_program(parse(_text("g2wg_default_d64", head_dim=64))).warp_specialized.decode
    assert d64 == replace(shape, block_n=hopper.FP8_DECODE_2WG_BLOCK_N[64], stages=hopper.DECODE_FP8_2WG.stages)
    assert d64.block_n == 256
    # a variant keeps the shared state (its hooks' per-column reads and sinks take one partition's layouts)
    for d in (64, 128):
        window = compile_program(parse(_text(f"g2wg_window_d{d}", mask="window(300)", head_dim=d)))
        assert window.warp_specialized.decode is None or not window.warp_specialized.decode.halves


def test_halves_source(two_wg, monkeypatch, tmp_path):
    """FP8_DECODE_HALVES: each consumer warpgroup a partition of its own (4 warps, 12 with the loader's, launched at
    maxnreg) over its half of every block's keys, with its own P^T tile and softmax state; both release each slot
    (two arrivals); warpgroup 1 hands its max, sum and O^T over at the end and warpgroup 0 merges and stores. ptxas:
    no spills up to the shape's rows."""
    monkeypatch.setattr(hopper, "FP8_DECODE_HALVES", True)
    spec = parse(_text("ghalves_src", layout=LAYOUTS["paged16"]))
    source = render(spec, compile_program(spec))
    compile(source, "ghalves.py", "exec")
    assert "warps_per_cta=[4, 1], instr_shape=[16, NQ, 16])" in source and "warps_per_cta=[8, 1]" not in source
    assert "(_wsd_consumer0, (" in source and "(_wsd_consumer1, (" in source and "], [4, 1], [CONSUMER_REGS, LOADER_REGS])" in source
    assert "mbarrier.init(k_empty.index(i), count=2)" in source and "mbarrier.init(v_empty.index(i), count=2)" in source
    loop = source.split("for j in range(j0, j1):")[1].split("# rows that saw no key")[0]
    assert "k_smem.index(s).slice(WG * KB, KB).load(k_rows)" in loop and "p_smem.index(WG).store(" in loop
    assert "keys = j * BLOCK_N + WG * KB + gl.arange(0, KB" in loop and "gl.thread_barrier()" not in loop
    merge = source.split("# the two warpgroups' states meet")[1].split("l_safe = ")[0]
    assert (merge.index("o_smem.store(acc)") < merge.index("mbarrier.arrive(merge_bar, count=1)")
            < merge.index("mbarrier.wait(merge_bar, 0)") < merge.index("acc = acc * alpha[None, :] + o_smem.load(mma)"))
    printed = "\n".join(ir.format_warp_specialized(compile_program(spec).warp_specialized))
    assert "2 consumer warpgroups, e4m3 widened by sign, K's head dim permuted, each a partition over half" in printed
    assert "mask=(o_rows < n_store)[None, :])" in source and "maxnreg=WSD_SHAPE[\"maxnreg\"]" in source
    path = tmp_path / "ghalves_sm90.py"
    path.write_text(source)
    results = probe([{"path": str(path), "gluon_ws": "decode", "rows": rows, "ptxas": True} for rows in (8, 32)])
    for result in results:
        assert "error" not in result and result["warps"] == 12, results
        assert result["spill_stores"] == 0 and result["spill_loads"] == 0, results


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_split_loader_source(two_wg, monkeypatch, tmp_path, layout):
    """FP8_DECODE_SPLIT_LOADER: K's copies and V's each from a loader warp of its own, each
    waiting on its own ring's slots; `explain` says so; ptxas: no spills, with and without halves."""
    monkeypatch.setattr(hopper, "FP8_DECODE_SPLIT_LOADER", True)
    assert "FP8_DECODE_SPLIT_LOADER" in hopper.SWITCHES
    sources = {}
    for halves in (True, False):
        monkeypatch.setattr(hopper, "FP8_DECODE_HALVES", halves)
        spec = parse(_text(f"gsplit_{layout}_{halves}", layout=LAYOUTS[layout]))
        program = compile_program(spec)
        assert program.warp_specialized.decode.split_loader and program.warp_specialized.decode.halves == halves
        printed = "\n".join(ir.format_warp_specialized(program.warp_specialized))
        assert "K's and V's copies from a loader warp each" in printed
        sources[halves] = source = render(spec, program)
        compile(source, "gsplit.py", "exec")
        assert "(_wsd_loader_k, (" in source and "(_wsd_loader_v, (" in source and "(_wsd_loader, (" not in source
        loaders = "LOADER_REGS, LOADER_REGS])" if halves else "[1, 1], [LOADER_REGS, LOADER_REGS])"
        assert loaders in source
        # each loader's loop takes its own tensor's copies only, behind its own ring's empty barriers
        loop = source.split("def _wsd_loader(")[1].split("@gluon.jit")[0]
        k_part, v_part = loop.split("if KV == 0:")[1].split("if KV == 1:")
        assert "k_empty" in k_part and "v_desc" not in k_part and "v_empty" in v_part and "k_desc" not in v_part
        assert "_wsd_loader(Q, OP" in source.split("def _wsd_loader_v(")[1].split("@gluon.jit")[0]
    paths = []
    for halves, source in sources.items():
        paths.append(tmp_path / f"gsplit_{layout}_{halves}.py")
        paths[-1].write_text(source)
    results = probe([{"path": str(p), "gluon_ws": "decode", "rows": 32, "ptxas": True} for p in paths])
    for result in results:  # (4 + 4 + 1 + 1 and 8 + 1 + 1 warps, launched as 12)
        assert "error" not in result and result["warps"] == 12, results
        assert result["spill_stores"] == 0 and result["spill_loads"] == 0, results
        assert result["tma_loads"] >= 2, results


@pytest.mark.parametrize("terms, halves, p8", [(2, True, False), (1, True, False), (2, False, False), (1, True, True)])
def test_q_e4m3_source(two_wg, monkeypatch, tmp_path, terms, halves, p8):
    """FP8_DECODE_Q8: q's rows as e4m3 terms in shared memory, S^T = K Q^T on e4m3 wgmma with K's block read from the
    ring as it lies (no K widened in registers; V still is), each column scaled back by its row's power of two;
    `explain` says so, the verifier refuses it with K permuted; sm_90: no spills, e4m3 wgmma. FP8_DECODE_P8 (off): P^T
    in e4m3 (times 2^8, taken out with V's factor) and V^T's bytes as P V's e4m3 operand, every wgmma e4m3."""
    monkeypatch.setattr(hopper, "FP8_DECODE_HALVES", halves)
    monkeypatch.setattr(hopper, "FP8_DECODE_Q8", terms)
    monkeypatch.setattr(hopper, "FP8_DECODE_P8", p8)
    assert "FP8_DECODE_Q8" in hopper.SWITCHES
    spec = parse(_text(f"gq8_{terms}_{halves}_{p8}", layout=LAYOUTS["paged16"]))
    program = compile_program(spec)
    shape = program.warp_specialized.decode
    assert shape.q_e4m3 == terms and not shape.permute_k and shape.halves == halves
    assert shape.constants()["Q_E4M3"] == terms
    printed = "\n".join(ir.format_warp_specialized(program.warp_specialized))
    assert ("Q as two e4m3 terms a row" if terms == 2 else "Q rounded to e4m3 a row") in printed
    source = render(spec, program)
    compile(source, "gq8.py", "exec")
    assert f"q_smem = gl.allocate_shared_memory(gl.float8e4nv, [{terms}, NQ, HEAD_DIM], q_layout)" in source
    loop = source.split("for j in range(j0, j1):")[1].split("# rows that saw no key")[0]
    assert "k_tile" not in loop and ("v_tile = _gl_e4m3_to_bf16(" in loop) == (not p8)
    assert ("p * 256.0).to(gl.float8e4nv)" in loop) == p8 and ("v_descale * 0.00390625" in source) == p8
    assert loop.count("sc = warpgroup_mma(k_op, q_smem.index(") == terms
    assert "* q_factor[None, :]" in loop
    assert ("q_smem.index(1).store((q_x - q_hi.to(gl.float32)).to(gl.float8e4nv))" in source) == (terms == 2)
    for bad in (dict(permute_k=True), dict(q_e4m3=3)):
        with pytest.raises(InternalError, match="q_e4m3"):
            verify(replace(program, warp_specialized=replace(program.warp_specialized, decode=replace(shape, **bad))),
                   "test")
    path = tmp_path / f"gq8_{terms}_{halves}_{p8}.py"
    path.write_text(source)
    ptx = tmp_path / "gq8.ptx"
    # (the halves' 256-key blocks at d=128, FP8_DECODE_2WG_BLOCK_N: a few bytes of spills at 32 rows, none at 16)
    rows = 16 if halves else 32
    jobs = [{"path": str(path), "gluon_ws": "decode", "rows": rows, "ptxas": True, "ptx_to": str(ptx)}]
    jobs += [{"path": str(path), "gluon_ws": "decode", "rows": 32, "ptxas": True}] if halves else []
    result, *at_32 = probe(jobs)
    assert "error" not in result and result["spill_stores"] == 0 and result["spill_loads"] == 0, result
    assert all("error" not in r and r["spill_stores"] <= 32 and r["spill_loads"] <= 32 for r in at_32), at_32
    e4m3 = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{rows}k32\.f32\.e4m3\.e4m3", ptx.read_text())
    # S^T's K step is 32 e4m3 values: 4 a 128-wide head dim, for each term and m64 tile of a consumer's keys, in each
    # consumer partition (and with P in e4m3, P V's: 128 rows of V^T, 2 x m64, over a half block's keys in k32 steps)
    half = shape.block_n // 2 if halves else 64
    assert len(e4m3) == (4 * terms * (half // 64) + (half // 16 if p8 else 0)) * (2 if halves else 1), len(e4m3)
    assert ("bf16.bf16" in ptx.read_text()) == (not p8)  # P V: bf16 (V widened) or e4m3


def test_two_consumer_warpgroups_are_a_switch_of_the_policy(fp8_gluon, monkeypatch):
    """FP8_DECODE_2WG picks DECODE_FP8_2WG at d=128 (d=64's O^T is one warpgroup's M), keys the kernel caches, and
    leaves the 16-bit kernel's shape and source alone; `explain` prints the consumers."""
    assert "FP8_DECODE_2WG" in hopper.SWITCHES and hopper.FP8_DECODE_2WG is False  # (the fixture's)
    assert hopper.DECODE_FP8.consumers == 1 and not hopper.DECODE_FP8.widen_by_sign
    assert "CONSUMERS" not in hopper.DECODE_FP8.constants()
    shipped = compile_program(parse(_text("g2wg_off"))).warp_specialized.decode
    assert shipped == hopper.DECODE_FP8
    monkeypatch.setattr(hopper, "FP8_DECODE_2WG", True)
    program = compile_program(parse(_text("g2wg_on")))
    assert program.warp_specialized.decode == hopper.DECODE_FP8_2WG == hopper.decode("fp8_e4m3", 128)
    assert program.warp_specialized.decode.constants()["CONSUMERS"] == 2
    printed = "\n".join(ir.format_warp_specialized(program.warp_specialized))
    assert "2 consumer warpgroups, e4m3 widened by sign, K's head dim permuted" in printed
    assert compile_program(parse(_text("g2wg_d64", head_dim=64))).warp_specialized.decode == hopper.DECODE_FP8
    # the 16-bit kernel's source is the golden one with the switch on (test_golden renders the policy's defaults)
    for name in ("decode_paged16_d128", "decode_d128"):
        spec = load_file(f"specs/{name}.attn")
        program = compile_program(spec)
        assert program.warp_specialized.decode == hopper.DECODE
        with open(f"generated/{name}.py") as f:
            assert render(spec, program) == f.read(), name


def test_two_consumer_warpgroups_source(two_wg, monkeypatch):
    """DECODE_FP8_2WG with V staged (stage_v, off by default: it lost its A/B)."""
    monkeypatch.setattr(hopper, "DECODE_FP8_2WG", replace(hopper.DECODE_FP8_2WG, stage_v=True))
    spec = parse(_text("g2wg_src", layout=LAYOUTS["paged16"]))
    source = render(spec, compile_program(spec))
    compile(source, "g2wg.py", "exec")
    # eight consumer warps: the products' M split between the two warpgroups, launched as such
    assert "warps_per_cta=[8, 1], instr_shape=[16, NQ, 16])" in source
    assert "io: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])" in source
    assert "num_warps=8," in source and "'CONSUMERS': 2" in source
    # a slot goes back once both warpgroups have read it: K's after the column max, V's after a barrier
    loop = source.split("for j in range(j0, j1):")[1].split("# rows that saw no key")[0]
    assert loop.index("p = gl.exp2(") < loop.index("mbarrier.arrive(k_empty.index(s), count=1)")
    assert loop.count("mbarrier.arrive(k_empty") == 1 and loop.count("mbarrier.arrive(v_empty") == 1
    assert loop.index("gl.thread_barrier()") < loop.index("mbarrier.arrive(v_empty.index(s), count=1)")
    # e4m3 widened by a sign-extending permute; the same math from the IR (descales, epilogue)
    assert "prmt.b32 lo, $2, 0, 0x9180;" in source and "and.b32 $0, lo, 0x87F087F0;" in source
    assert "0x07F007F0" not in source
    assert "gl.convert_layout(acc * v_descale / l_safe[None, :], out_t)" in source
    # V widened into a 16-bit shared tile, its rows past n_k zeroed on the way, wgmma's A operand from there
    assert "v_wide = _gl_e4m3_to_bf16(v_smem.index(s).load(wide))" in loop
    assert "vw_smem.store(v_wide)" in loop and "v_tile" not in loop
    assert "acc = warpgroup_mma(vw_smem.permute((1, 0)), p_smem.permute((1, 0)), acc, is_async=True)" in loop
    assert loop.index("gl.thread_barrier()") < loop.index("acc = warpgroup_mma(vw_smem")
    # K read in rows of 16 bytes and relabelled as wgmma's fragment in place, Q's columns in the same order: the
    # generated order is the relabelling's (column k of the product holds K's and Q's column q_dims[k])
    assert "k_tile = _gl_e4m3_to_bf16(k_smem.index(s).load(k_rows))" in loop
    assert "k_tile = gl.convert_layout(k_tile, a_op, assert_trivial=True)" in loop
    reshape = loop.split("k_tile = k_tile.")[1].split("\n")[0]
    assert reshape == "reshape([BLOCK_N, 2, 4, 4, 2, 2]).permute((0, 1, 3, 4, 2, 5)).reshape([BLOCK_N, HEAD_DIM])"
    q_dims = eval(source.split("q_dims = ")[1].split("\n")[0], {"cols": torch.arange(128)})
    assert torch.equal(q_dims, torch.arange(128).reshape(2, 4, 4, 2, 2).permute(0, 2, 3, 1, 4).reshape(128))
    assert "stride_q_n + q_dims[None, :])" in source


def test_two_consumer_warpgroups_default_reads_v_as_registers(two_wg):
    """DECODE_FP8_2WG as shipped (stage_v off, permute_k on): V^T is wgmma's register operand, widened from the e4m3
    ring as it lies (no 16-bit V tile); K read permuted."""
    spec = parse(_text("g2wg_default_src", layout=LAYOUTS["paged16"]))
    source = render(spec, compile_program(spec))
    loop = source.split("for j in range(j0, j1):")[1].split("# rows that saw no key")[0]
    assert "v_tile = _gl_e4m3_to_bf16(v_smem.index(s).permute((1, 0)).load(a_op))" in loop
    assert "acc = warpgroup_mma(v_tile, p_smem.permute((1, 0)), acc, is_async=True)" in loop
    assert "vw_smem" not in source
    assert "k_tile = gl.convert_layout(k_tile, a_op, assert_trivial=True)" in loop


def test_staged_k_source(two_wg, monkeypatch):
    """stage_k: K widened into kw_smem (wgmma's A operand from there), its slot released once the tile is there."""
    monkeypatch.setattr(hopper, "DECODE_FP8_2WG", replace(hopper.DECODE_FP8_2WG, stage_k=True, stage_v=True,
                                                          permute_k=False))
    spec = parse(_text("g2wg_k_src"))
    source = render(spec, compile_program(spec))
    compile(source, "g2wg_k.py", "exec")
    loop = source.split("for j in range(j0, j1):")[1].split("# rows that saw no key")[0]
    assert "kw_smem.store(_gl_e4m3_to_bf16(k_smem.index(s).load(wide)))" in loop and "k_tile" not in loop
    assert loop.count("mbarrier.arrive(k_empty") == 1
    assert (loop.index("kw_smem.store(") < loop.index("gl.thread_barrier()")
            < loop.index("sc = warpgroup_mma(kw_smem, q_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)")
            < loop.index("mbarrier.arrive(k_empty") < loop.index("sc = warpgroup_mma_wait(0"))
    assert "K widened in shared memory, V widened in shared memory" in "\n".join(
        ir.format_warp_specialized(compile_program(spec).warp_specialized))


def test_two_consumer_warpgroups_compile_for_sm90(two_wg, tmp_path, monkeypatch):
    """Beside the one-warpgroup FP8 kernel: twelve warps (two consumer warpgroups and the loader's), half the wgmma
    instructions a warpgroup issues (each takes 64 of a block's keys and 64 of O^T's rows), no spills up to the most
    rows the shape takes (ptxas -v's registers in the message); both tiles register operands read as they lie (stage_v,
    permute_k off) the same shared memory; V staged and K permuted 32 KB more and under half their shared loads; K
    staged instead of permuted (stage_k) 32 KB more again."""
    shapes = {"1wg": None, "2wg_regs": replace(hopper.DECODE_FP8_2WG, stage_v=False, permute_k=False),
              "2wg": replace(hopper.DECODE_FP8_2WG, stage_v=True),
              "2wg_k": replace(hopper.DECODE_FP8_2WG, stage_k=True, stage_v=True, permute_k=False)}
    jobs = []
    for key, shape in shapes.items():
        monkeypatch.setattr(hopper, "FP8_DECODE_2WG", shape is not None)
        monkeypatch.setattr(hopper, "DECODE_FP8_2WG", shape or hopper.DECODE_FP8_2WG)
        for name, mask, layout in (("c_causal", "causal(bottom_right)", "contiguous"),
                                   ("p_none", "none", "paged16")):
            spec = parse(_text(f"g2wg_sm90_{name}_{key}", mask, LAYOUTS[layout]))
            path = tmp_path / f"g2wg_sm90_{name}_{key}.py"
            path.write_text(render(spec, compile_program(spec)))
            jobs.append({"path": str(path), "gluon_ws": "decode", "rows": hopper.DECODE_FP8_2WG.rows, "ptxas": True})
    monkeypatch.setattr(hopper, "DECODE_FP8_2WG", shapes["2wg_k"])
    fp16 = parse(_text("g2wg_sm90_fp16", dtype="fp16"))  # (K and V widened by `.to()`, both staged)
    (tmp_path / "g2wg_sm90_fp16.py").write_text(render(fp16, compile_program(fp16)))
    jobs.append({"path": str(tmp_path / "g2wg_sm90_fp16.py"), "gluon_ws": "decode", "rows": 32, "ptxas": True})
    results = probe(jobs)
    for job, result in zip(jobs, results):
        assert "error" not in result, (job, result)
        assert result["spill_stores"] == 0 and result["spill_loads"] == 0, (job, result)
    assert results[-1]["warps"] == 12
    one, regs, staged, staged_k = results[:2], results[2:4], results[4:6], results[6:8]
    # (DECODE_FP8_2WG's ring may hold more stages of K and V's e4m3 blocks than DECODE_FP8's)
    ring = (hopper.DECODE_FP8_2WG.stages - hopper.DECODE_FP8.stages) * 2 * hopper.DECODE_FP8_2WG.block_n * 128
    for a, b, c, k in zip(one, regs, staged, staged_k):
        assert (a["warps"], b["warps"], c["warps"]) == (8, 12, 12), results
        assert b["wgmma"] * 2 == a["wgmma"] == c["wgmma"] * 2 and a["tma_loads"] == b["tma_loads"] == c["tma_loads"]
        # half the tile a thread: fewer shared loads of the e4m3 bytes; staged, 16 bytes a load for V
        # (a stage's mbarriers: a few bytes each)
        assert 0 <= b["shared"] - a["shared"] - ring <= 64 and b["shared_loads"] < a["shared_loads"], results
        assert c["shared"] == b["shared"] + 128 * 128 * 2 and 2 * c["shared_loads"] < b["shared_loads"], results
        assert k["shared"] == c["shared"] + 128 * 128 * 2, results


# -- on a Hopper GPU -------------------------------------------------------------------------------------------

# the FP8 kernels the GPU tests run: DECODE_FP8 (one consumer warpgroup), DECODE_FP8_2WG, it with both tiles register
# operands read as they lie, with K staged instead of permuted, with K read as it lies; each under spec names of its own
# (the kernel caches key on the switches, not on the shapes)
SHAPES = {"1wg": None, "2wg": {}, "2wg_regs": {"stage_v": False, "permute_k": False},
          "2wg_k": {"stage_k": True, "stage_v": True, "permute_k": False},
          "2wg_v": {"stage_v": True}, "2wg_unpermuted": {"stage_v": True, "permute_k": False}, "2wg_halves": {},
          "2wg_halves_split": {}, "2wg_halves_q8": {}, "2wg_halves_q8x1": {}, "2wg_q8": {}, "1wg_q8": None,
          "1wg_q8_d64": None, "2wg_halves_q8_d64": {}}
# every layout and mask for the shipped shapes, one for the A/Bs' others
REAL_SIZES = ([(layout, causal, shape) for shape in ("1wg", "2wg", "2wg_halves") for layout in sorted(LAYOUTS)
               for causal in (True, False)] + [("paged16", True, shape) for shape in ("2wg_regs", "2wg_k", "2wg_v", "2wg_unpermuted")]
              + [(layout, True, "2wg_halves_split") for layout in sorted(LAYOUTS)]
              + [(layout, causal, "2wg_halves_q8") for layout in sorted(LAYOUTS) for causal in (True, False)]
              + [("paged16", True, shape) for shape in ("2wg_halves_q8x1", "2wg_q8", "1wg_q8")]
              + [(layout, True, "1wg_q8_d64") for layout in sorted(LAYOUTS)]
              + [(layout, causal, "2wg_halves_q8_d64") for layout in sorted(LAYOUTS) for causal in (True, False)])


def _terms(name) -> int:
    """The e4m3 terms a row of q the shape takes (FP8_DECODE_Q8)."""
    return 1 if "q8x1" in name else 2 if "q8" in name else 0


def _take_shape(monkeypatch, name) -> int:
    """Switch the policy to SHAPES[name] ("halves" in it: hopper.FP8_DECODE_HALVES on, "split":
    FP8_DECODE_SPLIT_LOADER, "q8": FP8_DECODE_Q8 2, "q8x1": 1, "d64": at d=64 too); its consumer warpgroups."""
    fields = SHAPES[name]
    monkeypatch.setattr(hopper, "FP8_DECODE_Q8", _terms(name))
    monkeypatch.setattr(hopper, "FP8_DECODE_Q8_HEAD_DIMS", (64, 128) if "d64" in name else (128,))
    monkeypatch.setattr(hopper, "FP8_DECODE_2WG", fields is not None)
    monkeypatch.setattr(hopper, "FP8_DECODE_HALVES", "halves" in name)
    monkeypatch.setattr(hopper, "FP8_DECODE_SPLIT_LOADER", "split" in name)
    monkeypatch.setattr(hopper, "DECODE_FP8_2WG", replace(hopper.DECODE_FP8_2WG, **(fields or {})))
    return 1 if fields is None else 2


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon decode kernel is sm_90's")
@pytest.mark.parametrize("layout, causal, shape", REAL_SIZES)
def test_gpu_fp8_gluon_decode_at_real_sizes(fp8_gluon, monkeypatch, layout, causal, shape):
    """B = 16, 32/8 heads, d = 128 (and 64: "d64" shapes), up to 8k keys (odd lengths), shuffled 16-token pages,
    per-(sequence, head) descales; the Gluon kernel runs (the Triton one would raise), at the rule's split count and
    at one split, with one consumer warpgroup and with two (hopper.FP8_DECODE_2WG, and the A/Bs of its fields;
    FP8_DECODE_HALVES: each a partition over half of every block's keys, merged at the end; FP8_DECODE_Q8: q as
    e4m3 terms, the bound that of a computation taking q so)."""
    from test_fp8kv import _check, _dequantized, _descale

    consumers = _take_shape(monkeypatch, shape)
    mask = "causal(bottom_right)" if causal else "none"
    d = 64 if "d64" in shape else 128
    module = attngen.load(_text(f"gfp8_gpu_{layout}_{mask[:4]}_{shape}", mask, LAYOUTS[layout], head_dim=d)).module
    assert hasattr(module, "attn_fwd_wsd") and module.WSD_SHAPE.get("CONSUMERS", 1) == consumers
    assert module.WSD_SHAPE.get("HALVES", False) == ("halves" in shape)
    assert hasattr(module, "_wsd_loader_v") == ("split" in shape)
    assert module.WSD_SHAPE.get("Q_E4M3", 0) == _terms(shape)

    def no_triton(*args, **kwargs):
        raise AssertionError("the Triton partial kernel ran: the Gluon kernel should have")

    monkeypatch.setattr(module, "launch_attn_fwd", no_triton)
    gen = torch.Generator().manual_seed(52)
    batch, heads, kv_heads, n, page = 16, 32, 8, 8192, 16
    lens = torch.randint(n // 2, n + 1, (batch,), generator=gen, dtype=torch.int32)
    lens[0], lens[1] = n, 1  # a full cache and a single key
    lens = lens.cuda()
    q = torch.randn(batch, 1, heads, d, generator=gen).to(torch.bfloat16).cuda()
    k_descale, v_descale = _descale((batch, kv_heads), gen).cuda(), _descale((batch, kv_heads), gen).cuda()
    k = (torch.randn(batch, n, kv_heads, d, generator=gen) * 4).to(FP8).cuda()
    v = (torch.randn(batch, n, kv_heads, d, generator=gen) * 4).to(FP8).cuda()
    k64, v64 = _dequantized(k, k_descale, False), _dequantized(v, v_descale, False)
    if layout == "paged16":  # the same keys in shuffled pages, spare pages of NaN bytes in the pool
        pages = n // page
        order = torch.randperm(batch * pages + 7, generator=gen)[: batch * pages].cuda()
        pool_k = torch.full((batch * pages + 7, page, kv_heads, d), float("nan"), device="cuda").to(FP8)
        pool_v = pool_k.clone()
        pool_k[order] = k.view(batch * pages, page, kv_heads, d)
        pool_v[order] = v.view(batch * pages, page, kv_heads, d)
        table = order.view(batch, pages).to(torch.int32)
        caches = (pool_k, pool_v, lens, table)
    else:  # flash-attn's (B, N, H_KV, D) storage as the module's (B, H_KV, N, D)
        caches = (k.transpose(1, 2), v.transpose(1, 2), lens, None)
    for num_splits in (0, 1):
        out = torch.full((batch, heads, 1, d), float("nan"), dtype=torch.bfloat16, device="cuda")
        module.forward_kvcache(q.transpose(1, 2), *caches, out=out, num_splits=num_splits,
                               k_descale=k_descale, v_descale=v_descale)
        # (the reference on the contiguous dequantised cache: the same values the pages hold)
        _check(out.transpose(1, 2), q, k64, v64, lens, None, q_e4m3=_terms(shape), causal=causal)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon decode kernel is sm_90's")
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_gpu_every_e4m3_byte_widens_exactly(fp8_gluon, monkeypatch, shape):
    """One key a sequence: the softmax's weight is exactly 1, so the output is V's widened values times v_descale = 1,
    bit for bit, for every finite e4m3 byte (subnormals, both zeros, the largest) in every head and column."""
    _take_shape(monkeypatch, shape)
    module = attngen.load(_text(f"gfp8_gpu_bytes_{shape}", "none", "contiguous")).module
    monkeypatch.setattr(module, "launch_attn_fwd", None)  # (a call would raise: the Gluon kernel must run)
    batch, heads, kv_heads, d, n = 2, 32, 8, 128, 256
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # 254 of them
    v = finite[torch.arange(batch * kv_heads * d) % finite.numel()].view(batch, 1, kv_heads, d)
    v = torch.cat([v, torch.zeros(batch, n - 1, kv_heads, d, dtype=torch.uint8)], 1).view(FP8).cuda()
    k = torch.randn(batch, n, kv_heads, d).to(FP8).cuda()
    ones = torch.ones(batch, kv_heads, device="cuda")
    q = torch.randn(batch, heads, 1, d, dtype=torch.bfloat16, device="cuda")
    out = torch.full((batch, heads, 1, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    lens = torch.ones(batch, dtype=torch.int32, device="cuda")
    module.forward_kvcache(q, k.transpose(1, 2), v.transpose(1, 2), lens, None, out=out, num_splits=1,
                           k_descale=ones, v_descale=ones)
    want = v[:, 0].float().repeat_interleave(heads // kv_heads, dim=1).to(torch.bfloat16)  # (batch, heads, d)
    assert torch.equal(out[:, :, 0], want)


@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "triton"])
def test_the_split_count_fills_one_wave_where_the_gluon_kernel_runs(monkeypatch, gluon):
    """FP8_DECODE_ONE_WAVE: where the FP8 cache's Gluon decode kernel runs (`gluon_runs_here` and `wsd_ready`, faked
    here: the interpreter has no sm_90) its programs hold a multiprocessor each, so the split count fills one wave
    (policy/splits.py choose_wave_splits; on the H200 one split at batch 16 x 8k gave 1.72x bf16's tokens/s, the
    memory-bound rule's 2 gave 1.59x): attention_with_kvcache's plan and the module's own count (num_splits=0) both
    take it. Where the Triton kernel runs, both keep the memory-bound rule. The shape is one where the two differ."""
    from attngen.runtime.parts import KVCachePart
    from attngen.runtime.plans import PLANS
    from conftest import record_split_launches

    assert hopper.FP8_DECODE_ONE_WAVE and "FP8_DECODE_ONE_WAVE" in hopper.SWITCHES
    kv_heads = 8
    PLANS.clear()  # (a plan kept from an earlier call of this signature would not load the faked kernel)
    # (ready for the module's view of a contiguous cache, (batch, K/V heads, seq, dim), as the real one)
    modules, counts = record_split_launches(
        monkeypatch, "wsd", lambda q, k, v, out: gluon and k.shape[1] == v.shape[1] == kv_heads, caches=2)
    monkeypatch.setattr(KVCachePart, "gluon_runs_here", lambda self: gluon)
    gen = torch.Generator().manual_seed(4)
    heads, n = 32, 64 * 128
    q = torch.randn(1, 1, heads, 128, generator=gen).bfloat16()
    k, v = (torch.randn(1, n, kv_heads, 128, generator=gen).to(FP8) for _ in range(2))
    lens = torch.tensor([n - 37], dtype=torch.int32)
    attngen.attention_with_kvcache(q, k, v, lens)
    PLANS.clear()  # (nor should a later call keep this one's plan of the faked kernel)
    module = modules[-1]
    assert module.WSD_SHAPE["ONE_WAVE"]
    config = module.DEFAULT_CONFIG | {"warp_specialized": int(gluon)}
    out = torch.empty(1, heads, 1, 128, dtype=torch.bfloat16)
    ones = torch.ones(1, kv_heads)
    module.forward_kvcache(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), lens, None, out=out, num_splits=0,
                           config=dict(config), k_descale=ones, v_descale=ones)
    programs = kv_heads * -(-(heads // kv_heads) // config["BLOCK_M"])  # batch 1, one query
    key_blocks = -(-n // config["BLOCK_N"])
    wave, memory = module.choose_wave_splits(programs, key_blocks, 8), module.choose_num_splits(programs, key_blocks, 8)
    assert wave != memory  # (8: the interpreter's stand-in for the SMs)
    assert counts == [("wsd", wave)] * 2 if gluon else [("triton", memory)] * 2


def test_q_e4m3_at_d64_compiles_for_sm90(fp8_gluon, monkeypatch, tmp_path):
    """d=64's one-warpgroup kernel (FP8_DECODE_2WG off) with q as two e4m3 terms: S^T's two e4m3 products (128 keys:
    two m64; d = 64: two k32 steps), no spills up to 32 rows."""
    monkeypatch.setattr(hopper, "FP8_DECODE_Q8", 2)
    monkeypatch.setattr(hopper, "FP8_DECODE_Q8_HEAD_DIMS", (64, 128))
    spec = parse(_text("gq8_d64", "none", "contiguous", head_dim=64))
    program = compile_program(spec)
    assert program.warp_specialized.decode.q_e4m3 == 2 and program.warp_specialized.decode.consumers == 1
    path, ptx = tmp_path / "gq8_d64.py", tmp_path / "gq8_d64.ptx"
    path.write_text(render(spec, program))
    results = probe([{"path": str(path), "gluon_ws": "decode", "rows": rows, "ptxas": True, "ptx_to": str(ptx)}
                     for rows in (8, 32)])
    for result in results:
        assert "error" not in result and result["spill_stores"] == 0 and result["spill_loads"] == 0, results
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n32k32\.f32\.e4m3\.e4m3", ptx.read_text())) == 2 * 2 * 2


def test_d64_halves_compile_for_sm90(fp8_gluon, monkeypatch, tmp_path):
    """d=64 with the policy's two warpgroups (halves over 256-key blocks, q as two e4m3 terms): each warpgroup's half
    of a block is two m64 tiles of S^T (two e4m3 terms each, two k32 steps) and O^T's 64 rows over its 128 keys; no
    spills at 8 and 32 rows, contiguous and paged. Without halves two warpgroups cannot split d=64's O^T (verify)."""
    monkeypatch.setattr(hopper, "FP8_DECODE_2WG", True)
    monkeypatch.setattr(hopper, "FP8_DECODE_HALVES", True)
    monkeypatch.setattr(hopper, "FP8_DECODE_Q8", 2)
    jobs = []
    for layout, rows in (("contiguous", 32), ("paged16", 8)):
        spec = parse(_text(f"gd64_halves_{layout}", "causal(bottom_right)", LAYOUTS[layout], head_dim=64))
        program = compile_program(spec)
        shape = program.warp_specialized.decode
        assert (shape.consumers, shape.halves, shape.block_n, shape.q_e4m3) == (2, True, 256, 2)
        path = tmp_path / f"gd64_halves_{layout}.py"
        path.write_text(render(spec, program))
        jobs.append({"path": str(path), "gluon_ws": "decode", "rows": rows, "ptxas": True,
                     "ptx_to": str(tmp_path / f"{layout}.ptx")})
    results = probe(jobs)
    for result in results:
        assert "error" not in result and result["warps"] == 12, results
        assert result["spill_stores"] == 0 and result["spill_loads"] == 0, results
    ptx = (tmp_path / "contiguous.ptx").read_text()
    # per warpgroup and block: 2 m64 tiles x 2 terms x 2 k32 steps of S^T
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n32k32\.f32\.e4m3\.e4m3", ptx)) == 2 * 2 * 2 * 2
    shared = replace(program.warp_specialized.decode, halves=False)
    with pytest.raises(InternalError, match="head dim 64"):
        verify(replace(program, warp_specialized=replace(program.warp_specialized, decode=shared)), "test")
