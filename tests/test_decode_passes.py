"""The decoding passes (kv-lengths, pack-gqa, split-kv, paged): IR before/after, their effect on
causal-skip's ranges (brute force), no-ops for plain specs, and the verifier's new invariants."""

import random
import types
from dataclasses import replace

import pytest

from attngen import ir
from attngen.ir import sym
from attngen.codegen import exprs, render
from attngen.errors import InternalError
from attngen.ir import Loop, LoopKind, Masked
from attngen.passes import compile_program
from attngen.lang.spec import load_file, parse
from attngen.ir.verify import verify
from conftest import shipped_specs, spec_text


def stages(text):
    out = {}
    compile_program(parse(text), trace=lambda name, p: out.__setitem__(name, p))
    return out


def decode_text(**extra):
    keys = dict(split_kv="auto", kv_layout="paged(page_size = 16)", heads=8, kv_heads=2)
    keys.update(extra)
    return spec_text("dec", 64, "bf16", "causal(bottom_right)", **{k: v for k, v in keys.items() if v is not None})


@pytest.mark.parametrize("path", [p for p in shipped_specs() if "fwd_" in p])
def test_decoding_passes_leave_plain_specs_alone(path):
    s = {}
    compile_program(load_file(path), trace=lambda name, p: s.__setitem__(name, p))
    assert s["kv-lengths"] == s["pack-gqa"] == s["split-kv"] == s["fold-scale"]
    assert s["paged"] == s["causal-skip"]


def test_kv_lengths_reads_each_sequence_length():
    s = stages(decode_text())
    before, after = ir.format_program(s["fold-scale"]), ir.format_program(s["kv-lengths"])
    assert "for start_n in [0, N_K)" in before and "key < N_K" in before
    assert "n_k: reg int32[] = load SEQLENS[b]" in after and "for start_n in [0, n_k)" in after
    assert "keep key <= query + -N_Q + n_k and key < n_k" in after
    kernel = s["kv-lengths"].kernel("attn_fwd")
    assert sym.N_K not in {d.symbol for d in kernel.symbols}  # the capacity is no kernel argument


def test_pack_gqa_groups_query_heads_of_one_kv_head():
    after = ir.format_program(stages(decode_text())["pack-gqa"])
    assert "grid h_kv in [0, H_KV):" in after and "grid start_m in [0, GROUP*N_Q) step BLOCK_M" in after
    assert "load Q[b, packed(GROUP*h_kv, start_m:+BLOCK_M (<GROUP*N_Q), group=GROUP), :HEAD_DIM]" in after
    assert "load K[b, h_kv, start_n:+BLOCK_N (<n_k), :HEAD_DIM]" in after
    assert "query = row // GROUP" in after and "(h // GROUP)" not in after
    unpacked = ir.format_program(stages(decode_text(pack_gqa="false"))["pack-gqa"])
    assert "grid h in [0, H):" in unpacked and "packed(" not in unpacked


def test_split_kv_adds_a_grid_axis_and_a_combine_kernel():
    s = stages(decode_text())
    program = s["split-kv"]
    assert [k.name for k in program.kernels] == ["attn_fwd", "attn_combine"]
    text = ir.format_program(program)
    assert "grid split in [0, NUM_SPLITS):" in text
    assert "keys_per_split: reg int32[] = BLOCK_N*cdiv(cdiv(n_k, NUM_SPLITS), BLOCK_N)" in text
    assert "for start_n in [split_start, split_stop) step BLOCK_N:" in text
    assert "store O_PART[b, split, packed(" in text and "store LSE_PART[b, split, packed(" in text
    combine = ir.format_kernel(program.kernel("attn_combine"))
    # The combine merges BLOCK_S splits per load; splits past the count weigh nothing (-inf).
    assert "load LSE_PART[b, split:+BLOCK_S (<NUM_SPLITS), h, m] (else -inf)" in combine
    assert "for split in [0, NUM_SPLITS) step BLOCK_S:" in combine
    assert "store LSE[b, h, m] = m_run + log(l_safe)" in combine
    assert program.attr("combine_block_s") == 32  # d=128: a [32, 128] float32 chunk
    # split_kv = 1 is the plain kernel: no split axis, no combine.
    single = stages(decode_text(split_kv=1))["split-kv"]
    assert [k.name for k in single.kernels] == ["attn_fwd"] and "split" not in ir.format_program(single)


@pytest.mark.parametrize("page_size,per_tile", [(1, False), (16, False), (64, True), (256, True)])
def test_paged_addresses_keys_through_the_block_table(page_size, per_tile):
    program = stages(decode_text(kv_layout=f"paged(page_size = {page_size})"))["paged"]
    text = ir.format_program(program)
    lookup = ", per tile" if per_tile else ""
    assert f"load K[page(BLOCK_TABLE[b], start_n:+BLOCK_N, size={page_size}{lookup}), h_kv, :HEAD_DIM]" in text
    assert "in K: hbm bf16[NUM_PAGES, PAGE_SIZE, H_KV, HEAD_DIM]" in text
    assert program.attr("max_block_n") == (page_size if per_tile else None)
    source = render(parse(decode_text(kv_layout=f"paged(page_size = {page_size})")), program)
    assert ("page_n = tl.load(block_table_base + (start_n // " in source) == per_tile
    assert "pid_2 = tl.program_id(2)" in source and "b = pid_2 // NUM_SPLITS" in source  # 4 grid loops, folded


def _key_loops(kernel):
    return [st for st in ir.walk_stmts(kernel.body) if isinstance(st, Loop) and st.kind is LoopKind.SERIAL]


@pytest.mark.parametrize("mask", ["causal(bottom_right)", "none"])
def test_split_and_packed_ranges_visit_every_live_block_once(mask):
    """Brute force over random sizes: the splits' causal-skip ranges together visit each live key
    block exactly once, and an unmasked block keeps every element of every real row."""
    kernel = stages(spec_text("d", 64, "fp16", mask, split_kv="auto", heads=8, kv_heads=2))["causal-skip"].kernel("attn_fwd")
    loops = _key_loops(kernel)
    # Bounds as Python functions of the sizes (sympy's subs is too slow for a brute force).
    names = "N_Q n_k GROUP BLOCK_M BLOCK_N start_m split_start split_stop"
    host = {"triton": types.SimpleNamespace(cdiv=lambda a, b: -(-a // b)), "min": min, "max": max}
    bounds = [tuple(eval(f"lambda {names.replace(' ', ', ')}: {exprs.host(x)}", host) for x in (l.start, l.stop))
              for l in loops]
    masked = [any(isinstance(e, Masked) for st in ir.walk_stmts(l.body) for x in ir.stmt_exprs(st) for e in ir.walk_expr(x))
              for l in loops]
    rng = random.Random(1)
    for _ in range(80):
        bm, bn, group = rng.choice([16, 32]), rng.choice([16, 32, 64]), rng.choice([1, 2, 4])
        n_q, n_k, splits = rng.randint(1, 9), rng.randint(0, 300), rng.randint(1, 6)
        offset = n_k - n_q
        kps = bn * -(-(-(-n_k // splits)) // bn)
        for start_m in range(0, n_q * group, bm):
            rows = range(start_m, min(start_m + bm, n_q * group))
            seen = []
            for split in range(splits):
                values = (n_q, n_k, group, bm, bn, start_m, split * kps, min(n_k, split * kps + kps))
                for (start, stop), is_masked in zip(bounds, masked):
                    lo, hi = start(*values), stop(*values)
                    for start_n in range(lo, hi, bn):
                        seen.append(start_n)
                        keep = [[j < n_k and (mask == "none" or j <= r // group + offset) for j in range(start_n, start_n + bn)]
                                for r in rows]
                        assert is_masked or all(all(k) for k in keep), (n_q, n_k, group, bm, bn, splits, start_n)
            live = [s for s in range(0, n_k, bn)
                    if any(j < n_k and (mask == "none" or j <= r // group + offset) for r in rows for j in range(s, s + bn))]
            assert sorted(seen) == live, (n_q, n_k, group, bm, bn, splits, start_m)


def test_verifier_rejects_broken_decoding_ir():
    program = stages(decode_text(kv_layout="paged(page_size = 64)"))["paged"]
    # A per-tile page lookup without a bound on BLOCK_N.
    unbounded = ir.Program(program.name, program.spec_hash, program.kernels,
                           tuple((k, v) for k, v in program.attrs if k != "max_block_n"))
    with pytest.raises(InternalError, match="does not bound BLOCK_N"):
        verify(unbounded, "test")
    # Per-split partial outputs that no kernel merges.
    with pytest.raises(InternalError, match="no later kernel merges"):
        verify(replace(program, kernels=program.kernels[:1]), "test")
    # A block table that is not int32.
    kernel = program.kernel("attn_fwd")
    bad_table = ir.Buffer("BLOCK_TABLE", (sym.B, sym.MAX_PAGES), ir.DT.F32, ir.Space.HBM, ir.Role.INPUT)

    def retable(e):
        if isinstance(e, ir.Load) and any(isinstance(i, ir.Paged) for i in e.index):
            return replace(e, index=tuple(replace(i, table=bad_table) if isinstance(i, ir.Paged) else i for i in e.index))
        return e

    bad = replace(kernel, params=kernel.params[:-1] + (bad_table,), body=ir.map_exprs_in(kernel.body, retable))
    with pytest.raises(InternalError, match="must be an int32"):
        verify(program.replace_kernel(bad), "test")
    # The combine kernel reading a partial with another type than the one written.
    combine = program.kernel("attn_combine")
    wrong = replace(combine.params[0], dtype=ir.DT.F16)
    body = ir.map_exprs_in(combine.body, lambda e: replace(e, buffer=wrong) if isinstance(e, ir.Load) and e.buffer.name == "O_PART" else e)
    with pytest.raises(InternalError, match="reads O_PART as"):
        verify(program.replace_kernel(replace(combine, params=(wrong,) + combine.params[1:], body=body)), "test")
