"""The Hopper Gluon forward on FP8 (e4m3) inputs (issue 52), behind policy/hopper.py FP8_GLUON.

On the CPU: the pass's decision with the switch off (the Triton kernel, and the reason explain prints) and on (the
shape of `hopper.forward_fp8`; what it refuses), the 16-bit kernels' source untouched by it, and the kernel compiled
for sm_90 by Triton's own compiler in a subprocess (tests/probe.py): every wgmma an e4m3 one with a K step of 32,
within shared memory, and ptxas's registers and spills beside the bf16 kernel's. On a Hopper GPU (`gpu`): the
Gluon kernel taken (the switch on for this test's own spec names and kernel cache) and held to test_fp8.py's
element-wise e4m3 bound against float64 of the dequantised inputs, at d=128 and 64, causal and not, GQA.
"""

import re
import subprocess
from dataclasses import replace

import pytest
import torch

import attngen
from attngen.cli import main
from attngen.codegen import exp2_fma, render
from attngen.errors import InternalError
from attngen.ir.verify import verify
from attngen.lang.spec import parse
from attngen.passes import compile_program, warp_specialize
from attngen.policy import hopper
from conftest import ROOT, SPECS, spec_text
from probe import probe
from test_fp8 import dequant, quantized, row_bound

SHARED = 232448  # an sm_90 program's shared memory
E4M3_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.e4m3\.e4m3")


def _program(name, head_dim=128, mask="causal", **extra):
    spec = parse(spec_text(name, head_dim, "fp8_e4m3", mask, direction="forward", **extra))
    return spec, compile_program(spec)


@pytest.fixture
def fp8_gluon(monkeypatch):
    """The FP8 Gluon forward switched on (on by default, at d=128), at both head dims it has shapes for (the policy
    leaves d=64 on the Triton kernel, which is as fast there). The tests that build modules under it render them into
    their own files, or load them under spec names and a kernel cache of their own: a module cached meanwhile under a
    name the API shares would keep the kernel."""
    monkeypatch.setattr(hopper, "FP8_GLUON", True)
    monkeypatch.setattr(hopper, "FP8_HEAD_DIMS", (64, 128))


# -- the decision ----------------------------------------------------------------------------------------


def test_the_policys_fp8_decision_by_head_dim():
    """As shipped: d=128 FP8 takes the Gluon forward with P's operand permuted and made beside its product; d=64 the
    Triton kernel (as fast there), and `fp8_refusal` says so."""
    _, d128 = _program("gf8_policy_128", 128)
    forward = d128.warp_specialized.forward
    assert forward.permute_p and not forward.early_p and warp_specialize.fp8_refusal(d128) is None
    _, d64 = _program("gf8_policy_64", 64)
    assert not d64.warp_specialized.forward
    assert warp_specialize.fp8_refusal(d64) == "head dim 64: the FP8 Gluon forward takes 128"


def test_with_the_switch_off_fp8_stays_on_the_triton_kernel_and_explain_says_why(monkeypatch, capsys):
    monkeypatch.setattr(hopper, "FP8_GLUON", False)
    _, program = _program("gf8_default")
    assert not program.warp_specialized and not warp_specialize.applies(program)
    assert "FP8_GLUON is off" in warp_specialize.fp8_refusal(program)
    assert main(["explain", f"{SPECS}/fp8_causal_d128.attn"]) == 0
    assert "warp-specialize: no Hopper Gluon kernel (policy/hopper.py FP8_GLUON is off" in capsys.readouterr().out


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal", "causal(bottom_right)"])
def test_switched_on_fp8_takes_the_gluon_forward(fp8_gluon, head_dim, mask):
    _, program = _program(f"gf8_on_{head_dim}", head_dim, mask)
    assert warp_specialize.fp8_refusal(program) is None
    forward = program.warp_specialized.forward
    assert forward == hopper.forward_fp8(head_dim, mask != "none") and program.warp_specialized.backward is None
    assert forward.main == forward.short == hopper.FP8_FORWARD[head_dim] and forward.short_keys == 0
    assert forward.main.block_n % 32 == 0  # P V's K step on e4m3 wgmma


@pytest.mark.parametrize("extra, reason", [
    (dict(head_dim=96), "head dim 96"),
    (dict(head_dim=256), "head dim 256"),
    (dict(mask="causal & window(64)"), "no variant"),
    (dict(score="softcap(20)"), "no variant"),
    (dict(block_m=64, block_n=64), "auto tiles"),
])
def test_switched_on_fp8_refuses_what_the_template_does_not_take(fp8_gluon, extra, reason):
    head_dim, mask = extra.pop("head_dim", 128), extra.pop("mask", "causal")
    _, program = _program("gf8_refused", head_dim, mask, **extra)
    assert not program.warp_specialized and reason in warp_specialize.fp8_refusal(program)


def test_sixteen_bit_programs_do_not_see_the_switch(monkeypatch):
    """The switch decides FP8 programs only: a bf16 spec's program and source are the same either way."""
    spec = parse(spec_text("gf8_bf16", 128, "bf16", "causal", direction="forward"))
    monkeypatch.setattr(hopper, "FP8_GLUON", False)
    off = compile_program(spec)
    monkeypatch.setattr(hopper, "FP8_GLUON", True)
    on = compile_program(spec)
    assert off == on and render(spec, off) == render(spec, on)
    assert warp_specialize.fp8_refusal(on) is None


@pytest.mark.parametrize("permute_p", [True, False])
def test_the_source_takes_the_irs_descales_and_p_cast(fp8_gluon, monkeypatch, permute_p):
    """The FP8 kernel's math is the IR's (pass descale): each tile's qk_scale over its q and k descales, V's factor
    in the epilogue, P rounded to e4m3 as the IR casts it and carried as a k_width 4 operand; V read as V^T tiles
    (with FP8_PERMUTE_P, the launcher's copy of V with its keys permuted, and P relabelled in place)."""
    monkeypatch.setattr(hopper, "FP8_PERMUTE_P", permute_p)
    spec, program = _program(f"gf8_source_{permute_p}")
    assert program.warp_specialized.forward.permute_p is permute_p
    source = render(spec, program)
    kernel = source[source.index("def _ws_rows("):source.index("def _ws_consume(")]
    assert "qk_scale = qk_scale * 1.4426950408889634 * gl.load(Q_DESCALE + b * stride_q_descale_0 + (h // GROUP)" \
        in kernel
    assert "v_descale = gl.load(V_DESCALE + b * stride_v_descale_0 + (h // GROUP) * stride_v_descale_1)" in kernel
    assert "(acc * v_descale / gl.convert_layout(l_i, row_o)[:, None]).to(gl.bfloat16)" in kernel
    assert "k_width=4" in kernel
    assert "v_smem.index(sp).reshape([HEAD_DIM, BLOCK_N]).permute((1, 0))" in kernel
    if permute_p:
        helper = source[source.index("def _ws_p_operand("):source.index("def _ws_rows(")]
        assert "assert_trivial=True" in helper and "cvt.rn.satfinite.e4m3x2.f32" in helper
        assert "dtype=gl.float8e4nv" in helper and "p.to(gl.float8e4nv)" not in kernel
        # beside the P V products (FP8_EARLY_P off): the loop's and the last block's
        assert kernel.count("acc = warpgroup_mma(_ws_p_operand(p, BM, BLOCK_N, p_layout), ") == 2
        assert "tma_layouts(q, k, o)" in source and "_gluon_desc(fp8_vt(v, permute=True), " in source
    else:
        assert "p.to(gl.float8e4nv)" in kernel and "_ws_p_operand" not in source
        assert "tma_layouts(q, k, v.transpose(2, 3), o)" in source  # a V with its head dim contiguous: Triton's


# -- compiled for sm_90 (Triton's compiler and ptxas, on the CPU) ----------------------------------------


def _ptxas(ptx_path) -> tuple[int, int]:
    """(registers, spill store bytes) of the PTX file's kernel, by ptxas -v for sm_90a."""
    import triton

    ptxas = f"{triton.__path__[0]}/backends/nvidia/bin/ptxas"
    done = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx_path), "-o", str(ptx_path) + ".cubin"],
                          capture_output=True, text=True, check=True)
    registers = int(re.search(r"Used (\d+) registers", done.stderr).group(1))
    spills = re.search(r"(\d+) bytes spill stores", done.stderr)
    return registers, int(spills.group(1)) if spills else 0


@pytest.mark.parametrize("head_dim, mask, bf16_spec", [
    (128, "causal", "fwd_causal_d128"),
    (128, "none", "fwd_gqa_d128"),
    (64, "causal", "fwd_causal_d64"),
])
def test_fp8_gluon_forward_compiles_to_e4m3_wgmma(fp8_gluon, tmp_path, head_dim, mask, bf16_spec):
    spec, program = _program(f"gf8_sm90_{head_dim}", head_dim, mask)
    path = tmp_path / f"{spec.name}.py"
    path.write_text(render(spec, program))
    jobs = [{"path": str(path), "gluon_ws": True, "ptx_to": str(tmp_path / "fp8.ptx")},
            {"path": f"{ROOT}/generated/{bf16_spec}.py", "gluon_ws": True, "ptx_to": str(tmp_path / "bf16.ptx")}]
    fp8, bf16 = probe(jobs)
    assert "error" not in fp8, fp8
    assert fp8["wgmma"] > 0 and fp8["wgmma_e4m3"] == fp8["wgmma"] and bf16["wgmma_e4m3"] == 0
    assert fp8["shared"] <= SHARED and fp8["warps"] == 4 * (hopper.FP8_FORWARD[head_dim].consumers + 1)
    ptx = (tmp_path / "fp8.ptx").read_text()
    widths = set(E4M3_WGMMA.findall(ptx))
    assert widths == {str(hopper.FP8_FORWARD[head_dim].block_n), str(head_dim)}  # Q K^T's N, P V's
    shape = hopper.FP8_FORWARD[head_dim]
    regs, spills = _ptxas(tmp_path / "fp8.ptx")
    regs_bf16, spills_bf16 = _ptxas(tmp_path / "bf16.ptx")
    print(f"d={head_dim} {mask}: fp8 {regs} registers, {spills} bytes spilled; bf16 {regs_bf16}, {spills_bf16}")
    assert regs <= shape.maxnreg
    # P carried in e4m3 takes fewer registers than in bf16; its layout change adds shuffles, not spills past 1 KB
    assert spills <= max(2 * spills_bf16, 64) and spills <= 1024


# -- exp2 on the FMA pipe (FP8_EXP2_EMULATION) ------------------------------------------------------------


def test_the_exp2_switch_sets_the_share_and_nothing_else(fp8_gluon, monkeypatch):
    """FP8_EXP2_EMULATION is a switch the kernel caches key on; on, the FP8 forward's decision carries the policy's
    share of each key block's exponentials for the FMA pipe and is otherwise the same; off, none. The FP8 forward keeps
    the 16-bit kernel's overlap of a block's softmax with the previous block's P V (OVERLAP) and its ping-pong
    setting (PINGPONG)."""
    assert "FP8_EXP2_EMULATION" in hopper.SWITCHES and hopper.FP8_EXP2_EMULATION is False
    for head_dim in hopper.FP8_HEAD_DIMS:
        monkeypatch.setattr(hopper, "FP8_EXP2_EMULATION", False)
        _, off = _program(f"gf8_exp2_off_{head_dim}", head_dim)
        monkeypatch.setattr(hopper, "FP8_EXP2_EMULATION", True)
        _, on = _program(f"gf8_exp2_on_{head_dim}", head_dim)
        f_off, f_on = off.warp_specialized.forward, on.warp_specialized.forward
        assert f_off.exp2_fma == 0.0 and f_on.exp2_fma == hopper.FP8_EXP2_FMA[head_dim] > 0
        assert replace(f_on, exp2_fma=0.0) == f_off
        assert "EXP2_FMA" not in f_off.constants() and f_on.constants()["EXP2_FMA"] == f_on.exp2_fma
        bf16 = hopper.forward(head_dim, True)
        assert (f_on.overlap, f_on.pingpong) == (bf16.overlap, bf16.pingpong) and f_on.overlap


def test_a_spec_loaded_with_the_exp2_switch_on_is_another_module(fp8_gluon, monkeypatch, tmp_path):
    """Turned at run time (the lead's A/B in one process), the switch gets its own module: the cache keys on it."""
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    text = spec_text("gf8_exp2_load", 128, "fp8_e4m3", "causal", direction="forward")
    off = attngen.load(text)
    monkeypatch.setattr(hopper, "FP8_EXP2_EMULATION", True)
    on = attngen.load(text)
    assert on is not off and on.path != off.path
    assert "EXP2_FMA" not in off.module.WS_SHAPE and on.module.WS_SHAPE["EXP2_FMA"] == hopper.FP8_EXP2_FMA[128]
    assert hasattr(on.module, "_exp2_fma") and not hasattr(off.module, "_exp2_fma")


def test_the_exp2_switch_leaves_other_sources_alone(monkeypatch):
    """On, it changes neither a 16-bit program nor an FP8 one on the Triton kernel (FP8_GLUON off)."""
    monkeypatch.setattr(hopper, "FP8_GLUON", False)
    for dtype in ("bf16", "fp8_e4m3"):
        spec = parse(spec_text(f"gf8_exp2_{dtype}", 128, dtype, "causal", direction="forward"))
        monkeypatch.setattr(hopper, "FP8_EXP2_EMULATION", False)
        off = compile_program(spec)
        monkeypatch.setattr(hopper, "FP8_EXP2_EMULATION", True)
        on = compile_program(spec)
        assert off == on and render(spec, off) == render(spec, on) and "_exp2_fma" not in render(spec, on)


def test_the_source_takes_the_emulated_exp2_for_the_share(fp8_gluon, monkeypatch):
    """The scores' exponential is _ws_exp2 (k halvings of the tile, the last part on _exp2_fma, codegen/exp2_fma.py's
    text), the rows' rescaling factor still gl.exp2; off, no trace of it."""
    monkeypatch.setattr(hopper, "FP8_EXP2_EMULATION", True)
    monkeypatch.setitem(hopper.FP8_EXP2_FMA, 128, 0.25)
    spec, program = _program("gf8_exp2_source")
    source = render(spec, program)
    assert exp2_fma.helper("gl") in source
    softmax = source[source.index("def _ws_softmax("):source.index("def _ws_release_q(")]
    assert softmax.count("p = _ws_exp2(") == 2 and "alpha = gl.exp2(m_i - m_new)" in softmax
    split = source[source.index("def _ws_exp2("):source.index("def _ws_softmax(")]
    assert split.count("_ws_halves(") == 2 and split.count("_ws_joined(gl.exp2(") == 2
    assert "p = _exp2_fma(fma1)" in split and "assert_trivial=True" in split
    monkeypatch.setattr(hopper, "FP8_EXP2_EMULATION", False)
    assert "_exp2_fma" not in render(*_program("gf8_exp2_source"))


@pytest.mark.parametrize("share", [0.3, 1.0, 1 / 32])
def test_the_verifier_holds_the_share_to_halvings_of_the_key_block(fp8_gluon, share):
    """1/2^k of the key block, at least 8 columns (a halving splits the tile by a register's column bit)."""
    _, program = _program("gf8_exp2_verify")
    odd = replace(program.warp_specialized.forward, exp2_fma=share)
    with pytest.raises(InternalError, match="exp2_fma"):
        verify(replace(program, warp_specialized=replace(program.warp_specialized, forward=odd)), "test")


def test_the_verifier_refuses_the_emulated_exp2_on_16_bit_inputs():
    spec = parse(spec_text("gf8_exp2_bf16", 128, "bf16", "causal", direction="forward"))
    program = compile_program(spec)
    odd = replace(program.warp_specialized.forward, exp2_fma=0.25)
    with pytest.raises(InternalError, match="16-bit inputs"):
        verify(replace(program, warp_specialized=replace(program.warp_specialized, forward=odd)), "test")


def _sass_ex2(ptx_path) -> tuple[int, int, bool]:
    """(MUFU.EX2 count in the SASS, spill store bytes, whether ptxas serialised the wgmma) of the PTX file's kernel."""
    import triton

    bin_dir = f"{triton.__path__[0]}/backends/nvidia/bin"
    cubin = str(ptx_path) + ".cubin"
    done = subprocess.run([f"{bin_dir}/ptxas", "-arch=sm_90a", "-v", str(ptx_path), "-o", cubin],
                          capture_output=True, text=True, check=True)
    sass = subprocess.run([f"{bin_dir}/cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    spills = re.search(r"(\d+) bytes spill stores", done.stderr)
    return sass.count("MUFU.EX2"), int(spills.group(1)) if spills else 0, "serializ" in done.stderr


@pytest.mark.parametrize("head_dim, mask", [(128, "causal"), (64, "none")])
def test_the_emulated_exp2_takes_a_share_of_mufu_off_without_spills(fp8_gluon, monkeypatch, tmp_path, head_dim, mask):
    """Compiled for sm_90 (tests/probe.py), the switch on against off: the share of the scores' ex2.approx (PTX)
    and MUFU.EX2 (SASS) gone, the rows' rescaling ones left, no data moved between threads for the split (the
    tile's halves are a thread's registers: as many shuffles), no more spills, the wgmma not serialised, and the
    softmax still overlapping the previous block's P V (a wait for all but the last wgmma group in the loop)."""
    jobs, ptx = [], {}
    for on in (False, True):
        monkeypatch.setattr(hopper, "FP8_EXP2_EMULATION", on)
        spec, program = _program(f"gf8_exp2_sm90_{head_dim}_{int(on)}", head_dim, mask)
        path = tmp_path / f"{spec.name}.py"
        path.write_text(render(spec, program))
        ptx[on] = tmp_path / f"{spec.name}.ptx"
        jobs.append({"path": str(path), "gluon_ws": True, "ptx_to": str(ptx[on])})
    off_result, on_result = probe(jobs)
    assert "error" not in on_result, on_result
    assert on_result["shared"] == off_result["shared"] and on_result["wgmma"] == off_result["wgmma"]
    shape, share = hopper.FP8_FORWARD[head_dim], hopper.FP8_EXP2_FMA[head_dim]
    per_tile = shape.block_m // shape.consumers * shape.block_n // 128  # a consumer thread's scores of a block
    text = {on: ptx[on].read_text() for on in (False, True)}
    ex2 = {on: text[on].count("ex2.approx") for on in (False, True)}
    sites = ex2[False] // per_tile  # the softmax's inlined copies (the rows' alpha: fewer a thread than a tile's scores)
    assert ex2[False] - ex2[True] == share * per_tile * sites > 0
    (mufu_off, spills_off, serial_off), (mufu_on, spills_on, serial_on) = _sass_ex2(ptx[False]), _sass_ex2(ptx[True])
    print(f"d={head_dim} {mask}: MUFU.EX2 {mufu_off} -> {mufu_on}, spills {spills_off} -> {spills_on} bytes")
    assert mufu_off - mufu_on == ex2[False] - ex2[True]
    assert spills_on <= spills_off and not serial_on and not serial_off
    assert text[True].count("shfl.sync") == text[False].count("shfl.sync")
    assert text[True].count("wgmma.wait_group.sync.aligned 1;") == text[False].count("wgmma.wait_group.sync.aligned 1;") > 0


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_the_permuted_p_operand_moves_no_data_and_packs_once(fp8_gluon, monkeypatch, tmp_path, mask):
    """Compiled for sm_90 (PTX): with FP8_PERMUTE_P and FP8_EARLY_P off (the policy's), P reaches the P V product
    without warp shuffles (those left are the rows' max and sum, as in the 16-bit kernel) and with no byte permutes
    (its four e4m3 values a register packed by the conversion itself), where the unpermuted operand takes shuffles
    and hundreds of byte permutes; the same shared memory, spills within the FP8 shapes' 64-byte bound."""
    results = {}
    for permute in (True, False):
        monkeypatch.setattr(hopper, "FP8_PERMUTE_P", permute)
        monkeypatch.setattr(hopper, "FP8_EARLY_P", not permute)
        spec, program = _program(f"gf8_permute_{mask}_{permute}", 128, mask)
        path = tmp_path / f"{spec.name}.py"
        path.write_text(render(spec, program))
        (result,) = probe([{"path": str(path), "gluon_ws": True, "ptx_to": str(tmp_path / f"{permute}.ptx")}])
        assert "error" not in result, result
        ptx = (tmp_path / f"{permute}.ptx").read_text()
        results[permute] = (result, ptx.count("shfl.sync"), ptx.count("prmt.b32"), _ptxas(tmp_path / f"{permute}.ptx"))
    (on, shfl_on, prmt_on, (regs_on, spills_on)), (off, shfl_off, prmt_off, (_, spills_off)) = results[True], results[False]
    bf16 = f"{ROOT}/generated/{'fwd_causal_d128' if mask == 'causal' else 'fwd_gqa_d128'}.py"
    (plain,) = probe([{"path": bf16, "gluon_ws": True, "ptx_to": str(tmp_path / "bf16.ptx")}])
    assert "error" not in plain, plain
    shfl_bf16 = (tmp_path / "bf16.ptx").read_text().count("shfl.sync")
    print(f"{mask}: shfl.sync {shfl_on} / {shfl_off} (bf16 {shfl_bf16}), prmt {prmt_on} / {prmt_off}, "
          f"spills {spills_on} / {spills_off}")
    assert shfl_on == shfl_bf16 < shfl_off and prmt_on == 0 < prmt_off
    # (float32 P carried around the loop: at 3 stages 20 bytes spilled against 16)
    assert on["shared"] == off["shared"] and regs_on <= hopper.FP8_FORWARD[128].maxnreg and spills_on <= 64


@pytest.mark.parametrize("name", sorted(hopper.FP8_FORWARD_ALTERNATIVES))
def test_fp8_alternative_shapes_compile(fp8_gluon, monkeypatch, tmp_path, name):
    """The shapes FP8_FORWARD_ALTERNATIVES offers for the d=128 A/B compile for sm_90 within shared memory and
    spill no more than FP8_FORWARD[128] may (test_fp8_gluon_forward_compiles_to_e4m3_wgmma's bound)."""
    shape = hopper.FP8_FORWARD_ALTERNATIVES[name]
    monkeypatch.setitem(hopper.FP8_FORWARD, 128, shape)
    spec, program = _program(f"gf8_alt_{name}")
    assert program.warp_specialized.forward.main == shape
    path = tmp_path / f"{spec.name}.py"
    path.write_text(render(spec, program))
    (result,) = probe([{"path": str(path), "gluon_ws": True, "ptx_to": str(tmp_path / "alt.ptx")}])
    assert "error" not in result, result
    assert result["shared"] <= SHARED and result["wgmma_e4m3"] == result["wgmma"] > 0
    regs, spills = _ptxas(tmp_path / "alt.ptx")
    print(f"{name}: {result['shared']} bytes of shared memory, {regs} registers, {spills} bytes spilled")
    assert regs <= shape.maxnreg and spills <= 64


@pytest.mark.parametrize("n_k", [48, 37, 5])
def test_the_launchers_v_copy_matches_the_kernels_p_relabelling(fp8_gluon, monkeypatch, tmp_path, n_k):
    """`fp8_vt(v, permute=True)` (the launcher's V^T under FP8_PERMUTE_P, a Triton copy: the interpreter here) against
    `_ws_p_operand`'s relabelling of P's columns (the same reshape and permute, done here by torch): P V of the
    relabelled P over the copy's keys is P V, in float64, for key counts that fill their last 16 and that do not (the
    scores' columns past N_K are 0, as the mask leaves them); V given with its head dim contiguous and with its keys
    contiguous. Without `permute` (the Triton FP8 kernel's V^T) the copy is V^T exactly."""
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    module = attngen.load(spec_text(f"gf8_vcopy_{n_k}", 64, "fp8_e4m3", "none", direction="forward")).module
    gen = torch.Generator().manual_seed(n_k)
    v = torch.randn(2, 3, n_k, 64, dtype=torch.float64, generator=gen)
    p = torch.rand(2, 3, 7, n_k, dtype=torch.float64, generator=gen)
    want = p @ v
    n_pad = -(-n_k // 16) * 16
    padded = torch.cat([p, p.new_zeros(2, 3, 7, n_pad - n_k)], dim=-1)
    operand = padded.reshape(2, 3, 7, n_pad // 16, 2, 2, 2, 2).permute(0, 1, 2, 3, 5, 6, 4, 7).reshape(2, 3, 7, n_pad)
    for given in (v, v.transpose(-1, -2).contiguous().transpose(-1, -2)):
        vt = module.fp8_vt(given, permute=True)
        assert vt.shape == (2, 3, 64, n_pad) and vt.is_contiguous() and torch.isfinite(vt).all()
        torch.testing.assert_close(operand @ vt.transpose(-1, -2), want, rtol=1e-12, atol=1e-12)
        assert torch.equal(module.fp8_vt(given), v.transpose(-1, -2))
    assert not torch.equal(operand[..., :n_k], p) or n_k < 2  # (the relabelling moves columns)


# -- real sizes (GPU) -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("exp2_emulation, permute_p", [(False, True), (False, False), (True, True)])
def test_gpu_fp8_gluon_forward_against_float64(fp8_gluon, monkeypatch, tmp_path, head_dim, causal, outliers,
                                               exp2_emulation, permute_p):
    """The Gluon kernel (asserted taken: `ws_ready`) at N_Q = 4096, N_K = 4096 (and 4000 x 4096 + 100 without a
    mask: a partial last row block, and a last key block whose 16 keys are not all there; + 128 unpermuted), GQA
    16/4, within test_fp8.py's element-wise e4m3 bound of float64 on the dequantised inputs, its output poisoned
    first; level with the FP8 Triton kernel on the same inputs. With FP8_EXP2_EMULATION, part of each block's exponentials on the FMA
    pipe; with FP8_PERMUTE_P, P's operand relabelled and V (given with its head dim contiguous) copied by the
    launcher with its keys permuted; held to the same bounds."""
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hopper, "FP8_EXP2_EMULATION", exp2_emulation)
    monkeypatch.setattr(hopper, "FP8_PERMUTE_P", permute_p)
    monkeypatch.setattr(hopper, "FP8_EARLY_P", not permute_p)  # (P converted beside its product where permuted)
    name = f"gf8_gpu_{head_dim}_{int(causal)}_{int(exp2_emulation)}_{int(permute_p)}"
    kernel = attngen.load(spec_text(name, head_dim, "fp8_e4m3", "causal" if causal else "none",
                                    direction="forward"))
    assert kernel.module.WS_SHAPE.get("EXP2_FMA", 0.0) == (hopper.FP8_EXP2_FMA[head_dim] if exp2_emulation else 0.0)
    assert kernel.module.WS_SHAPE.get("PERMUTE_P", False) is permute_p
    # (V^T's rows must be 16-byte aligned for TMA where V is given keys-contiguous: the permuted copy pads them)
    n_q, n_k = (4096, 4096) if causal else (4000, 4096 + (100 if permute_p else 128))
    gen = torch.Generator(device="cuda").manual_seed(2)
    _, (q8, qd), (k8, kd), (v8, vd) = quantized(2, 16, 4, n_q, n_k, head_dim, outliers, gen)
    v_t = v8.transpose(-1, -2).contiguous().transpose(-1, -2)  # keys contiguous, as the Triton kernel reads V
    v_in = v8 if permute_p else v_t  # (the launcher copies V, from any layout)
    module = kernel.module
    out = torch.full((2, 16, n_q, head_dim), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((2, 16, n_q), float("nan"), device="cuda")
    assert module.ws_ready(q8, k8, v_in, out)
    descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    module.forward(q8, k8, v_in, out=out, lse=lse, **descales)
    triton_out, _ = module.forward(q8, k8, v_t, config={"warp_specialized": False}, **descales)
    qf, kf, vf = dequant(q8, qd, 16), dequant(k8, kd, 4), dequant(v8, vd, 4)
    for b in range(2):  # a batch at a time: float64 scores of 16 x 4096 x 4096 are 2 GiB
        bound, ref = row_bound(qf[b:b + 1], kf[b:b + 1], vf[b:b + 1], causal, head_dim ** -0.5)
        err = (out[b:b + 1].double() - ref).abs()
        assert (err <= bound).all(), (err - bound).max().item()
        triton_err = (triton_out[b:b + 1].double() - ref).abs().max().item()
        assert err.max().item() <= 2 * triton_err + 2.0 ** -9, (err.max().item(), triton_err)
    assert torch.isfinite(lse).all()


def test_explain_describes_the_switched_on_kernel(fp8_gluon, monkeypatch, tmp_path, capsys):
    path = tmp_path / "gf8_explain.attn"
    path.write_text(spec_text("gf8_explain", 128, "fp8_e4m3", "causal", direction="forward"))
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "warp-specialize: on Hopper the forward runs the Gluon kernel on e4m3 tiles (wgmma k32)" in out
    assert "no Hopper Gluon kernel" not in out and "FMA pipe" not in out
    assert "P's e4m3 operand taken from the scores' registers, its keys permuted within each 16" in out
    monkeypatch.setattr(hopper, "FP8_EXP2_EMULATION", True)
    monkeypatch.setitem(hopper.FP8_EXP2_FMA, 128, 0.25)
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "exp2 of the last 1/4 of each key block's columns on the FMA pipe" in out and "exp2_fma=0.25" in out


def test_the_verifier_holds_an_fp8_forward_to_e4m3s_k_step(fp8_gluon):
    """P V's K dimension is the key block: e4m3 wgmma steps 32 keys, so a block of 48 keys is refused."""
    _, program = _program("gf8_verify")
    forward = program.warp_specialized.forward
    odd = replace(forward, main=replace(forward.main, block_n=48), short=replace(forward.short, block_n=48))
    with pytest.raises(InternalError, match="not a multiple of 32"):
        verify(replace(program, warp_specialized=replace(program.warp_specialized, forward=odd)), "test")
    verify(program, "test")
    # P's permuted operand is the e4m3 kernel's: a 16-bit program's P operand is already its scores' registers
    bf16 = compile_program(parse(spec_text("gf8_verify_bf16", 128, "bf16", "causal", direction="forward")))
    permuted = replace(bf16.warp_specialized.forward, permute_p=True)
    with pytest.raises(InternalError, match="permute_p for 16-bit inputs"):
        verify(replace(bf16, warp_specialized=replace(bf16.warp_specialized, forward=permuted)), "test")
