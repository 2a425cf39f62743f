"""The `attngen` command line.

    attngen compile SPEC... [-o DIR]       write DIR/<name>.py for each spec (default DIR: generated/)
    attngen check SPEC... [--seed N]       validate against float64 on random inputs; exit 1 on failure
    attngen explain SPEC [--pass NAME] [--shape ...]   the IR after each pass, costs, resources
    attngen bench [--suite prefill|decode|variants|varlen|shapes|fp8|all] ...   attngen against the peers on this GPU
    attngen tune SPEC... [--kind ...] [--seqlens N...] [--batch B...] [--heads H...]   search tiles for this GPU

A spec error prints `FILE:LINE:COL: error: MESSAGE` and exits 2; a failed check (or a tuning where
no candidate passed validation) exits 1; a bug in attngen exits 3 with a short report. No user
error prints a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import ir
from .analysis import cost, masks
from .analysis.resources import (Target, check_spec_tiles, infeasible, infeasible_backward, registers, shared_bytes,
                                 shared_bytes_backward, tile_widths)
from .bench import prefill as bench
from .bench import fp8 as bench_fp8
from .bench import shapes as bench_shapes
from .bench import variants as bench_variants
from .bench import varlen as bench_varlen
from .codegen import render
from .env import interpreting
from .errors import AttnGenError, InternalError, SpecError
from .lang.spec import load_file
from .passes import (PASS_NAMES, applied_passes, compile_program, warp_specialize, warp_specialize_decode,
                     warp_specialize_mla)
from .policy import hopper
from .policy import mixed as mixed_policy
from .policy.configs import backward_config, default_config
from .policy.splits import choose_num_splits, group_split
from .policy.tma import reads_through_descriptors
from .runtime.cache import write_atomic
from .runtime.kernel import load
from .testing.accuracy import format_result, validate
from .tuning import Packed, Shape, save, tunables, tune
from .tuning.report import Progress, format_outcome
from .tuning.space import TuneError, restrict
from .version import __version__

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_BUG = 0, 1, 2, 3


def _spec(path: str):
    return load_file(path)


def _use_interpreter_without_gpu(quiet: bool = False) -> bool:
    """Run kernels in Triton's interpreter when there is no GPU; returns whether it does."""
    if interpreting():
        return True
    import torch

    if torch.cuda.is_available():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    if not quiet:
        print("note: no CUDA GPU here; running kernels in Triton's interpreter at small sizes", file=sys.stderr)
    return True


# -- compile -----------------------------------------------------------------------------------


def cmd_compile(args) -> int:
    out_dir = Path(args.output)
    specs = [_spec(p) for p in args.specs]  # every spec parses before anything is written
    names = {}
    for spec in specs:
        if spec.name in names:
            raise SpecError(f"kernel '{spec.name}' is also defined in {names[spec.name]}", *_where(spec))
        names[spec.name] = spec.filename
    for spec in specs:
        check_spec_tiles(spec)
        path = out_dir / f"{spec.name}.py"
        write_atomic(path, render(spec, compile_program(spec)))
        print(path)
    return EXIT_OK


def _where(spec):
    line, col = spec.position("kernel")
    return spec.filename, line, col


# -- check -------------------------------------------------------------------------------------


def cmd_check(args) -> int:
    interpreted = _use_interpreter_without_gpu()
    failed = 0
    for path in args.specs:
        spec = _spec(path)
        kernel = load(spec)
        variant = spec.variant
        mask = variant.mask.text() if variant.mask is not None else spec.mask.value
        extra = (f", score {variant.score.text()}" if variant.score is not None else "") + (", sinks" if variant.sinks else "")
        dims = f"head_dim {spec.head_dim}" + (f", head_dim_v {spec.head_dim_v}" if spec.splits_head_dims else "")
        print(f"{spec.filename}: kernel {spec.name} [{spec.hash}] ({spec.dtype.value}, {dims}, "
              f"mask {mask}{extra}){' in the interpreter' if interpreted else ''}")
        results = validate(kernel, seed=args.seed, progress=lambda r: print("  " + format_result(r), flush=True))
        bad = sum(not r.ok for r in results)
        failed += bad
        print(f"  {len(results) - bad}/{len(results)} cases within tolerance")
    return EXIT_FAIL if failed else EXIT_OK


# -- explain -----------------------------------------------------------------------------------


def _parse_shape(text: str | None, spec) -> dict:
    # A split-KV spec is for decoding: one new token against an 8k cache, unless told otherwise.
    n_q, n_k = (1, 8192) if spec.is_split else (4096, 4096)
    sizes = {"B": 1, "H": spec.heads or 16, "N_Q": n_q, "N_K": n_k}
    if text:
        for part in text.split(","):
            key, sep, value = part.partition("=")
            key = key.strip().upper()
            if not sep or not value.strip().isdigit():
                raise SpecError(f"--shape takes KEY=NUMBER pairs (B, H, H_KV, N, N_Q, N_K); got '{part}'", "<command line>")
            if key == "N":
                sizes["N_Q"] = sizes["N_K"] = int(value)
            elif key in ("B", "H", "H_KV", "N_Q", "N_K"):
                sizes[key] = int(value)
            else:
                raise SpecError(f"--shape: unknown size '{key}'; expected B, H, H_KV, N, N_Q or N_K", "<command line>")
    # MLA (v = k[:N]): every query head reads the one latent head
    sizes.setdefault("H_KV", spec.kv_heads or (1 if spec.v_from_k else sizes["H"] // (spec.group or 1)))
    if sizes["H_KV"] < 1 or sizes["H"] % sizes["H_KV"]:
        raise SpecError(f"--shape: H={sizes['H']} is not a multiple of H_KV={sizes['H_KV']}", "<command line>")
    sizes["GROUP"] = sizes["H"] // sizes["H_KV"]
    return sizes


MIXED_NARROW = ("attn_fwd_short", "attn_combine_short")
"""A mixed program's narrow kernels: no work where the sequences are priced longer than SHORT_Q."""


def _print_passes(program: ir.Program) -> None:
    """Which passes acted on the program and which were no-ops; for a varlen program, how programs find their
    sequence and tile."""
    applied = applied_passes(program)
    print("=== passes ===")
    print("applied: " + ", ".join(applied))
    print("no-op:   " + ", ".join(n for n in PASS_NAMES if n not in applied))
    if program.attr("varlen"):
        print("varlen:  per head, cdiv(TOTAL_Q, BLOCK_M) + B programs over the query tiles of all sequences: program "
              "`tile` runs the last sequence b with CU_SEQLENS_Q[b] // BLOCK_M + b <= tile, from query "
              "(tile - CU_SEQLENS_Q[b] // BLOCK_M - b) * BLOCK_M of it, and returns past the sequence's last tile "
              "(dK/dV: key tiles, CU_SEQLENS_K and BLOCK_N)")
        if program.attr("mixed"):
            print("mixed:   a sequence of at most SHORT_Q queries (a decode) is skipped by those tiles and runs as a "
                  "narrow work item instead: attn_fwd_short, one program per (sequence, split, K/V head), a tile of "
                  "BLOCK_M (query, head of the GQA group) rows over split `split` of NUM_SPLITS slices of its keys, "
                  "partial O and LSE to a workspace, merged by attn_combine_short (one program per (sequence, K/V "
                  "head)); the host picks BLOCK_M (SHORT_Q = BLOCK_M // GROUP) and NUM_SPLITS from the batch, heads, "
                  "max_seqlen_q/k and the SMs "
                  f"(attngen/policy/mixed.py, {mixed_policy.DEFAULT})")
        if program.warp_specialized.forward is not None:
            print("         warp-specialize: on Hopper the forward runs the Gluon kernel over the same tiles (a "
                  "persistent grid: each program walks tiles t, t + programs, ...), TMA over the packed tensors, tiles "
                  "ending past their sequence stored row-masked; " + _gluon_backward_line(program))
        else:
            print("         warp-specialize: no Hopper Gluon kernels (" + _no_gluon_reason(program) + ")")
    elif warp_specialize.fp8_refusal(program):
        print("warp-specialize: no Hopper Gluon kernel (" + warp_specialize.fp8_refusal(program) + ")")
    elif program.attr("dtype") == "fp8_e4m3" and program.warp_specialized.forward is not None:
        print("warp-specialize: on Hopper the forward runs the Gluon kernel on e4m3 tiles (wgmma k32), V read as "
              "V^T tiles through its (B, H_KV, D, N_K) view where its keys are contiguous (attention() copies V so; "
              "a V with its head dim contiguous runs the Triton kernel), qk_scale and V's descale loaded per tile, "
              "the bf16 output stored through its Q buffers" + _fp8_kernel_line(program.warp_specialized.forward))
    elif warp_specialize_decode.fp8_refusal(program):
        print("warp-specialize-decode: no Hopper Gluon kernel (" + warp_specialize_decode.fp8_refusal(program) + ")")
    elif program.attr("head_dim_v") is not None and program.warp_specialized.forward is not None:
        pieces = program.warp_specialized.forward.pieces
        tiles = (f"in column pieces {' + '.join(map(str, pieces))} (policy/hopper.py SPLIT_TILES_192: S a product "
                 "per piece)" if pieces else f"{program.attr('head_dim_padded')} columns wide")
        print(f"warp-specialize: on Hopper the forward runs the Gluon kernel, Q and K tiles {tiles} (head_dim = "
              f"{program.attr('head_dim')}), V and the output {program.attr('head_dim_v')} (head_dim_v); "
              + _gluon_dense_backward_line(program))
    elif program.attr("head_dim_v") is not None:
        print(f"warp-specialize: no Hopper Gluon kernels (head_dim_v = {program.attr('head_dim_v')} differs from "
              f"head_dim = {program.attr('head_dim')}: the Gluon forward takes (head_dim, head_dim_v) "
              f"{', '.join(map(str, hopper.SPLIT_FORWARD))} and the other templates one head dim for Q, K and V); "
              "the Triton kernels run")
    elif program.warp_specialized.forward is not None and any(k.name == "attn_bwd_dkdv" for k in program.kernels):
        print("warp-specialize: " + _gluon_dense_backward_line(program))
    if program.attr("v_from_k"):  # MLA: what the latent cache's read and the packed heads come to
        d, d_v = program.attr("head_dim"), program.attr("head_dim_v")
        print(f"latent-kv: V is K's first {d_v} columns: each key tile is read once, as kv = K[:, :{d_v}] (Q K^T's "
              f"first part and the P V operand) and k_rope = K[:, {d_v}:{d}] (Q K^T's rest); no V tensor")
        if program.attr("pack_gqa"):
            print("pack-gqa: the GROUP query heads of a K/V head fill one program's rows (GROUP x N_Q rows, BLOCK_M "
                  "at a time), so each tile read serves all of them")
        print("warp-specialize-mla: " + _mla_line(program))


def _mla_line(program: ir.Program) -> str:
    """What explain says of a latent decode's Gluon kernel: the tile it runs, or why the Triton kernel runs."""
    mla = program.warp_specialized.mla
    if mla is None:
        return "no Hopper Gluon kernel (" + warp_specialize_mla.refusal(program) + ")"
    d, d_v = program.attr("head_dim"), program.attr("head_dim_v")
    if mla.seesaw:
        scores = (f"the blocks taken in pairs (hopper.MLA_SEESAW, FlashMLA's seesaw): consumer 0 computes the "
                  f"first's whole S over all {d} columns and its softmax, consumer 1 the second's from consumer 0's "
                  f"row maxima, so one warpgroup's softmax runs beside the other's products; each adds both blocks' "
                  f"P V into {d_v // mla.consumers} of the {d_v} value columns")
    else:
        scores = (f"{mla.consumers} consumer warpgroups each computing S for {mla.block_n // 2} of the keys over all "
                  f"{d} columns (S once), exchanging row maxima, each adding P V into {d_v // mla.consumers} of the "
                  f"{d_v} value columns")
    return (f"on Hopper the Gluon MLA kernel runs calls of at least {mla.min_rows} packed query rows (heads x N_Q; "
            f"fewer keep the Triton kernel): {mla.rows} rows x {mla.block_n} keys a tile "
            f"(128 heads in {128 // mla.rows} programs), Q [{mla.rows}, {d}] resident in "
            f"shared memory, a TMA ring of {mla.stages} latent tiles [{mla.block_n}, {d}] (V = its first {d_v} "
            f"columns, no second load); {scores}; the Triton path's merge, its split count one "
            f"wave's (programs x splits within the multiprocessors: policy/splits.py choose_wave_splits)"
            + ("; each consumer issues the next block's S before this block's softmax and P V (hopper.MLA_OVERLAP)"
               if mla.overlap else ""))


def _fp8_kernel_line(forward) -> str:
    """The FP8 Gluon forward's exponentials where part of them leave MUFU (policy/hopper.py FP8_EXP2_EMULATION), and its P
    operand where FP8_PERMUTE_P relabels it."""
    permute = ("; P's e4m3 operand taken from the scores' registers, its keys permuted within each 16 and V^T's alike "
               "(the launcher's copy of V; hopper.FP8_PERMUTE_P)" if forward.permute_p else "")
    if not forward.exp2_fma:
        return permute
    return (f"; exp2 of the last 1/{2 ** forward.exp2_fma_halvings} of each key block's columns on the FMA pipe "
            "(a degree-3 polynomial, codegen/exp2_fma.py), the rest on MUFU" + permute)


def _gluon_backward_line(program: ir.Program) -> str:
    """What explain says of a varlen program's backward under warp-specialize."""
    if program.warp_specialized.backward is None:
        why = warp_specialize.varlen_backward_refusal(program) if program.attr("backward", False) else None
        return "the backward stays on the Triton kernels" + (f" ({why})" if why else "")
    rows = ("lse and delta by TMA from the rows' copy shifted by q_start % 4, at a row that is a multiple of 4"
            if program.warp_specialized.backward.rows_smem else
            "lse and delta by pointer (policy/hopper.py VARLEN_ROWS_SMEM is off)")
    heads = program.warp_specialized.backward.order_heads
    order = (f"; the tiles with the most query blocks first, {heads} K/V heads at a time (attn_bwd_order_ws, per call; "
             "policy/hopper.py VARLEN_BWD_SCHEDULE)") if heads else ""
    backward = program.warp_specialized.backward
    programs = ("a persistent grid, a program a multiprocessor taking the key tiles of the dK/dV grid above in turn "
                "(policy/hopper.py VARLEN_BWD_PERSISTENT; dK and dV out through its dQ buffers)" if backward.persistent
                else "one program per key tile of the dK/dV grid above")
    zeroed = " (a whole tile at once: VARLEN_BWD_LEAN)" if backward.zero_whole else ""
    masked = " (S^T before exp2, the rows' delta unmasked: VARLEN_BWD_MASK_S)" if backward.mask_scores else ""
    return (f"the backward runs the Gluon kernel, {programs} (its dQ added by "
            f"TMA reductions; rows past a sequence masked{masked}, its K and V rows past n_k zeroed{zeroed}, dK and dV "
            f"of a tile ending past the sequence stored row-masked; {rows}{order})")


def _gluon_dense_backward_line(program: ir.Program) -> str:
    """What explain says of a (not varlen) program's backward under warp-specialize."""
    backward = program.warp_specialized.backward
    if backward is None:
        reason = warp_specialize.backward_refusal(program)
        return "the backward stays on the Triton kernels" + (f" ({reason})" if reason else "")
    if backward.wide and backward.pieces:
        return ("the backward runs the Gluon kernel's wide path with its Q and K tiles in column pieces "
                f"{' + '.join(map(str, backward.pieces))} (policy/hopper.py SPLIT_TILES_192, BWD_WIDE_SPLIT): "
                "consumer i holding piece i's columns of dK and dQ, the last one all of dV's too, S^T and dP^T for "
                "half of a step's query rows, P^T and dS^T exchanged through shared memory; "
                f"{backward.main.stages} stage(s) of Q and dO"
                + ("; a program takes key tiles p and T - 1 - p of a head's T, the longest with the shortest "
                   "(policy/hopper.py WIDE_BWD_PAIRED)" if backward.paired else ""))
    if backward.wide:
        return ("the backward runs the Gluon kernel's wide path (policy/hopper.py BWD_WIDE): both consumer "
                "warpgroups on the program's keys, each holding half of dK's and dV's columns and computing S^T and "
                "dP^T for half of a step's query rows, P^T and dS^T exchanged through shared memory"
                + (f"; {backward.main.stages} stages of Q and dO, each held in the consumers' float32 dQ tiles until "
                   "its dQ is made (policy/hopper.py BWD_WIDE_STAGED)" if backward.main.stages > 1 else
                   "; one stage of Q and dO"))
    return "the backward runs the Gluon kernel (dQ, dK and dV in one kernel, dQ added by TMA reductions)"


def _no_gluon_reason(program: ir.Program) -> str:
    """Why warp-specialize left a varlen program on the Triton kernels."""
    if program.attr("head_dim_v") is not None:
        return "head_dim_v differs from head_dim: the Gluon forward takes one head dim for Q, K and V"
    if program.attr("page_size") is not None:
        return "paged K/V: the Gluon forward reads contiguous packed K/V by TMA"
    if program.attr("head_dim") != program.attr("head_dim_padded"):
        return (f"head dim {program.attr('head_dim')}: the Gluon kernels run it {program.attr('head_dim_padded')} "
                "columns wide, and a packed tile's row-masked stores would write into the next head's columns")
    return "its spec is outside the Gluon forward's: 16-bit, head dim 64, 128 or 256, auto tiles, supported masks"


def cmd_explain(args) -> int:
    spec = _spec(args.spec)
    if args.pass_name and args.pass_name not in PASS_NAMES:
        raise SpecError(f"--pass: no pass named '{args.pass_name}'; passes: {', '.join(PASS_NAMES)}", "<command line>")
    stages: dict[str, ir.Program] = {}

    def show(name, program):
        stages[name] = program
        if args.pass_name in (None, name):
            print(f"=== after {name} ===")
            print(ir.format_program(program))

    compile_program(spec, trace=show)
    if args.pass_name is None:
        _print_passes(stages[PASS_NAMES[-1]])
    sizes = _parse_shape(args.shape, spec)
    config = default_config(spec)
    sizes.update(HEAD_DIM=spec.head_dim, HEAD_DIM_PADDED=spec.head_dim_padded,
                 BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"])
    if spec.splits_head_dims:
        sizes.update(HEAD_DIM_V=spec.head_dim_v, HEAD_DIM_V_PADDED=spec.head_dim_v_padded)
    if spec.is_split:  # decoding: the split count a launch would use on an sm_90 with 132 SMs
        programs = sizes["B"] * sizes["H_KV"] * -(-sizes["N_Q"] * sizes["GROUP"] // config["BLOCK_M"])
        sizes["NUM_SPLITS"] = spec.split_kv or choose_num_splits(programs, -(-sizes["N_K"] // config["BLOCK_N"]), 132)
    first, last = stages[PASS_NAMES[0]], stages[PASS_NAMES[-1]]
    if last.attr("combine_block_s") is not None:  # the combine kernel's splits per load, as the launch picks it
        sizes["BLOCK_S"] = min(last.attr("combine_block_s"), 1 << (max(1, sizes["NUM_SPLITS"]) - 1).bit_length())
    if last.attr("mixed"):  # every sequence of N_Q queries: the wide tiles take them all (no narrow work item)
        sizes.setdefault("SHORT_Q", 0)
    forward_kernels = tuple(k.name for k in last.kernels if not k.name.startswith("attn_bwd")
                            and not (last.attr("mixed") and sizes["SHORT_Q"] == 0 and k.name in MIXED_NARROW))
    directions = [("forward", ("attn_fwd",), forward_kernels, "standard three-pass algorithm")]
    if spec.backward:
        directions.append(("backward", ("attn_bwd",), ("attn_bwd_dq", "attn_bwd_dkdv"),
                           "standard backward (P stored by the forward, dP and dS through HBM)"))
    print("=== cost (matrix-product FLOPs and HBM bytes) ===")
    shape = ", ".join(f"{k}={sizes[k]}" for k in ("B", "H", "H_KV", "N_Q", "N_K", "BLOCK_M", "BLOCK_N", "NUM_SPLITS")
                      if k in sizes)
    rows = []
    for direction, naive_kernels, final_kernels, label in directions:
        naive, final = cost.program_cost(first, naive_kernels), cost.program_cost(last, final_kernels)
        print(f"{direction}, {label} ({PASS_NAMES[0]}):")
        print(f"  flops = {cost.printed(naive.flops)}")
        print(f"  bytes = {cost.printed(naive.bytes)}")
        print(f"{direction}, generated ({', '.join(final_kernels)}):")
        print(f"  flops = {cost.printed(final.flops)}")
        print(f"  bytes = {cost.printed(final.bytes)}")
        fa = masks.fa_flops(spec, sizes, direction == "backward")
        rows.append((direction, naive, final, fa))
    dims = f"head_dim {spec.head_dim}" + (f", head_dim_v {spec.head_dim_v}" if spec.splits_head_dims else "")
    print(f"at {shape}, {dims}, {spec.dtype.value}:")
    for direction, naive, final, fa in rows:
        for label, c in (("standard", naive), ("generated", final)):
            flops, nbytes = cost.evaluate(c.flops, sizes), cost.evaluate(c.bytes, sizes)
            print(f"  {direction:8s} {label:9s}  {flops / 1e9:12.2f} GFLOP  {nbytes / 1e6:12.2f} MB  "
                  f"({flops / max(nbytes, 1):.1f} FLOP/byte)")
        if spec.splits_head_dims:  # (cost.fa_flops' generalisation: the backward's products by their widths)
            per = "2*(3*d + 2*d_v)" if direction == "backward" else "2*(d + d_v)"
            rule = f"{per} per kept score" + (", /2 causal" if spec.variant.mask is None and spec.mask.is_causal else "")
        else:
            rule = "4*B*H*N_Q*N_K*d" + (", /2 causal" if spec.mask.is_causal else "") if spec.variant.mask is None \
                else "4*d per kept score"
            rule += ", x2.5 backward" if direction == "backward" else ""
        print(f"  {direction:8s} FlashAttention convention ({rule}): {fa / 1e9:.2f} GFLOP")
    if spec.variant:
        _explain_variant(spec, sizes)
    _explain_group_split(last, sizes)
    if spec.backward:
        _explain_triton_group_split(last, sizes, backward_config(spec)["attn_bwd_dkdv"]["BLOCK_N"])
    if spec.dtype.fp8 or spec.fp8_cache:
        _explain_fp8(last)
    target = Target.current()
    print(f"=== resources on {target.name} (default config {config}) ===")
    widths = tile_widths(spec)
    smem = shared_bytes(widths[0], spec.dtype.bytes, config["BLOCK_M"], config["BLOCK_N"],
                        config["num_stages"], target, paged=spec.kv_layout.paged, head_dim_v_padded=widths[1])
    print(f"  shared memory {smem:,} of {target.shared_limit:,} bytes; "
          f">= {registers(spec.head_dim_v_padded, config['BLOCK_M'], config['BLOCK_N'], config['num_warps']):.0f} "
          "fp32 registers per thread")
    problem = infeasible(spec, config, target)
    if problem:
        print(f"  does not fit: {problem}")
    if spec.backward:
        for name, cfg in backward_config(spec).items():
            tma = reads_through_descriptors(spec, name)
            smem = shared_bytes_backward(name, spec.head_dim_padded, spec.dtype.bytes, cfg["BLOCK_M"], cfg["BLOCK_N"],
                                         cfg["num_stages"], target, tma=tma, head_dim_v_padded=spec.head_dim_v_padded)
            print(f"  {name} (default config {cfg}): shared memory {smem:,} of {target.shared_limit:,} bytes")
            problem = infeasible_backward(spec, name, cfg, target, tma=tma)
            if problem:
                print(f"  does not fit: {problem}")
    return EXIT_OK


def _explain_group_split(program: ir.Program, sizes: dict) -> None:
    """How the Gluon backward's dense launch at these sizes shares each GQA group's query heads over programs
    (splits.group_split on an sm_90 with 132 multiprocessors)."""
    gluon = program.warp_specialized.backward
    if gluon is None or program.attr("varlen"):
        return
    shape = gluon.short if sizes["N_K"] <= gluon.short_keys else gluon.main
    print("=== Gluon backward grid (sm_90, 132 multiprocessors) ===")
    print(_group_split_line(sizes, shape.block_n, gluon.max_group_split, " (not under deterministic algorithms)"))


def _explain_triton_group_split(program: ir.Program, sizes: dict, block_n: int) -> None:
    """How the Triton backward's dK/dV launch (attn_bwd_dkdv, BLOCK_N keys a program: the default config) at these
    sizes shares each GQA group's query heads over programs of attn_bwd_dkdv_split (pass group-split), on a GPU of
    132 multiprocessors."""
    most = program.triton_backward.max_group_split
    print("=== Triton backward grid (132 multiprocessors) ===")
    if most == 1:
        print("  each dK/dV program walks its whole group (no attn_bwd_dkdv_split: pass group-split does not apply)")
        return
    print(_group_split_line(sizes, block_n, most, ""))


def _group_split_line(sizes: dict, block_n: int, most: int, when: str) -> str:
    """The line saying how many dK/dV programs of `block_n` keys a launch has and how its groups are split."""
    programs = sizes["B"] * sizes["H_KV"] * -(-sizes["N_K"] // block_n)
    split = group_split(programs, sizes["GROUP"], 132, most)
    line = f"  {programs} dK/dV programs (B x H_KV x {block_n}-key tiles) for groups of {sizes['GROUP']} query heads: "
    if split == 1:
        return line + "each program walks its whole group"
    heads = [sizes["GROUP"] * (p + 1) // split - sizes["GROUP"] * p // split for p in range(split)]
    return line + (f"each group split over {split} programs ({programs * split} in all; heads "
                   f"{', '.join(map(str, heads))}), their float32 dK and dV summed after{when}")


def _explain_fp8(program: ir.Program) -> None:
    """Where the forward of an FP8 spec (or over an FP8 cache) rounds to e4m3 and applies its descales, read from
    the final IR."""
    print("=== fp8: where values are quantised and descaled (pass descale) ===")
    kernel = program.kernel("attn_fwd")
    inputs = [f"{b.name} ({b.dtype.value})" for b in kernel.params if b.dtype is ir.DT.F8E4M3]
    print(f"  e4m3 inputs: {', '.join(inputs)}; the products accumulate in fp32")
    casts = set()
    for st in ir.walk_stmts(kernel.body):
        for e in (e for x in ir.stmt_exprs(st) for e in ir.walk_expr(x)):
            if isinstance(e, ir.Call) and e.op is ir.Op.CAST and e.dtype is ir.DT.F8E4M3:
                casts.add(ir.format_expr(e))
        if isinstance(st, ir.Assign) and st.target.name in ("qk_scale", "v_descale"):
            print(f"  {st.target.name} = {ir.format_expr(st.value)}")
        if isinstance(st, ir.Store) and st.target.name in ("O", "O_PART"):
            print(f"  out ({st.target.dtype.value}) = {ir.format_expr(st.value)}")
    if casts:
        print(f"  rounded to e4m3 for P V: {', '.join(sorted(casts))} (p in [0, 1] after the running max, unscaled)")
    else:  # an FP8 cache: q and P stay 16-bit
        print(f"  K and V widened to {program.attr('dtype')} in registers before both products (exact: every e4m3 "
              "value is a 16-bit one); P stays 16-bit")


def _explain_variant(spec, sizes) -> None:
    """The mask's predicates (bounded in closed form or evaluated per block), its block map and kept scores,
    and the score modifier and sinks."""
    variant = spec.variant
    print("=== variant ===")
    if variant.mask is not None:
        print(f"mask = {variant.mask.text()} ({'bottom-right' if spec.bottom_right else 'top-left'} aligned)")
        for pred in masks.predicates(spec):
            how = ("bounded in closed form: the kernels skip the tiles it drops and mask only the tiles it cuts"
                   if masks.bounded(pred) else
                   "the analysis cannot bound: evaluated on every live block")
            print(f"  {masks.describe(pred)}\n      {how}")
        n_q, n_k, bm, bn = sizes["N_Q"], sizes["N_K"], sizes["BLOCK_M"], sizes["BLOCK_N"]
        found = masks.classify(spec, n_q, n_k, bm, bn)
        tiles = len(found.cells) * len(found.cells[0])
        print(f"block map at N_Q={n_q}, N_K={n_k}, BLOCK_M={bm}, BLOCK_N={bn} "
              f"('.' empty, '#' full, '~' partial; rows are query blocks"
              f"{', coarsened to at most 32 x 32' if max(len(found.cells), len(found.cells[0])) > 32 else ''}):")
        for line in found.text():
            print("  " + line)
        print(f"  {tiles} tiles: {found.count(masks.Block.EMPTY)} empty (skipped), {found.count(masks.Block.FULL)} "
              f"full (no mask), {found.count(masks.Block.PARTIAL)} partial (masked)")
        kept = masks.kept_scores(spec, n_q, n_k)
        print(f"  kept scores per head: {kept:,} of {n_q * n_k:,} ({kept / max(1, n_q * n_k):.1%})")
    if variant.score is not None:
        print(f"score = {variant.score.text()}")
    if variant.sinks:
        print("sinks = true: one learned logit per query head joins each row's softmax denominator")
    if variant.runtime_tensors():
        print(f"run-time tensors (keywords): {', '.join(variant.runtime_tensors())}")


# -- bench -------------------------------------------------------------------------------------


def _providers(text: str | None, known: tuple[str, ...]) -> tuple[str, ...] | None:
    """--providers as names of `known` (None: all); an unknown one is a usage error."""
    names = tuple(text.split(",")) if text else None
    unknown = set(names or ()) - set(known)
    if unknown:
        raise SpecError(f"--providers: unknown {', '.join(sorted(unknown))}; known: {', '.join(known)}",
                        "<command line>")
    return names


def cmd_bench(args) -> int:
    def ints(text, what):
        try:
            return tuple(int(x) for x in text.split(",")) if text else None
        except ValueError:
            raise SpecError(f"--{what} takes comma-separated whole numbers; got '{text}'", "<command line>") from None

    if args.suite == "variants":
        lengths, head_dims = ints(args.lengths, "lengths"), ints(args.head_dims, "head-dims")
        shape = {key: value for key, value in (("seqlen", lengths and lengths[0]), ("head_dim", head_dims and head_dims[0]),
                                               ("batch", args.batch), ("heads", args.heads)) if value}
        names = _providers(args.providers, bench_variants.PROVIDERS)
        if args.check:
            _use_interpreter_without_gpu()
        directions = ("forward", "backward") if args.direction == "both" else (args.direction,)
        return bench_variants.main(args.output, shape, directions, names, args.check)
    if args.suite == "fp8":
        names = _providers(args.providers, bench_fp8.PROVIDERS)
        if args.check:
            _use_interpreter_without_gpu()
        return bench_fp8.main(args.output, names, ints(args.lengths, "lengths"), args.check)
    if args.suite in ("varlen", "shapes"):
        suite = bench_varlen if args.suite == "varlen" else bench_shapes
        names = _providers(args.providers, suite.PROVIDERS)
        if args.check:
            _use_interpreter_without_gpu()
        directions = ("forward", "backward") if args.direction == "both" else (args.direction,)
        return suite.main(args.output, names, directions, args.check)
    suites = ("prefill", "decode") if args.suite == "all" else (args.suite,)
    providers = tuple(args.providers.split(",")) if args.providers else None
    unknown = set(providers or ()) - set(bench.PREFILL_PROVIDERS)
    if unknown:
        raise SpecError(f"--providers: unknown {', '.join(sorted(unknown))}; known: {', '.join(bench.PREFILL_PROVIDERS)}",
                        "<command line>")
    directions = ("forward", "backward") if args.direction == "both" else (args.direction,)
    return bench.main(suites, args.output, ints(args.lengths, "lengths"), ints(args.head_dims, "head-dims") or (64, 128),
                      providers, directions)


# -- tune --------------------------------------------------------------------------------------

TOKENS = 16384  # default batch = TOKENS // N_K: the FlashAttention benchmarks' 16k tokens per batch
HIDDEN = 2048   # default heads = HIDDEN // head_dim


def _positive(text: str, what: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise TuneError(f"{what} takes positive whole numbers; got '{text}'")
    return int(text)


def _whole(text: str, what: str) -> int:
    """A whole number >= 0 (which keys take 0 is checked against the kernel's space)."""
    if not text.isdigit():
        raise TuneError(f"{what} takes whole numbers; got '{text}'")
    return int(text)


def _seqlen(text: str) -> tuple[int, int]:
    """'4096' (N_Q = N_K) or '512:4096' (N_Q:N_K)."""
    n_q, sep, n_k = text.partition(":")
    return _positive(n_q, "--seqlens"), _positive(n_k if sep else n_q, "--seqlens")


def _values(items) -> dict:
    values = {}
    for item in items or ():
        key, sep, choice = item.partition("=")
        if not sep or not key.strip():
            raise TuneError(f"--values takes KEY=V1,V2,... (e.g. block_n=32,64); got '{item}'")
        values[key.strip()] = tuple(_whole(v.strip(), f"--values {key.strip()}") for v in choice.split(","))
    return values


DEFAULT_SEQLENS = {  # (on a GPU, in the interpreter), as --seqlens takes them
    "forward": (["1024", "4096", "16384"], ["64"]),
    "backward": (["1024", "4096", "16384"], ["64"]),
    "decode": (["1:1024", "1:8192", "1:32768"], ["1:64"]),  # one new token against the cache's capacity
    "chunked": (["512:4096", "512:16384"], ["16:64"]),     # a paged cache without split: chunked prefill
}
DECODE_BATCHES = ([1, 16, 64], [2])
# A varlen spec's kernels: --seqlens are the packed tokens (queries[:keys]), --batch the sequences packed into them
# (documents of random lengths, as the bench's document rows). Paged, the keys are sequences x the capacity of a
# block table row: chunked prefills of 2k new tokens on average over caches of 16k..32k.
VARLEN_SEQLENS = {False: (["4096", "16384"], ["96"]), True: (["16384:262144"], ["48:192"])}  # by paged
VARLEN_BATCHES = ([8], [3])


def _tune_shapes(spec, args, interpreted: bool, kind: str) -> list:
    """The shapes to tune one kind of kernel at: every --seqlens x --batch x --heads, with defaults
    by kind and device."""
    if kind == "decode" and not spec.is_split:
        kind = "chunked"
    group = spec.group or 1
    if spec.varlen:
        seqlens = [_seqlen(t) for t in (args.seqlens or VARLEN_SEQLENS[spec.kv_layout.paged][interpreted])]
    else:
        seqlens = [_seqlen(t) for t in (args.seqlens or DEFAULT_SEQLENS[kind][interpreted])]
    shapes = []
    for heads, kv_heads in [_heads(t) for t in args.heads] if args.heads else [_default_heads(spec, interpreted, kind)]:
        kv_heads = kv_heads or spec.kv_heads or heads // group
        if (heads < 1 or kv_heads < 1 or heads % kv_heads or (spec.heads and heads != spec.heads)
                or (spec.kv_heads and kv_heads != spec.kv_heads) or (spec.group and heads != kv_heads * spec.group)):
            fixed = ", ".join(f"{k} = {getattr(spec, k)}" for k in ("heads", "kv_heads", "group") if getattr(spec, k))
            raise TuneError(f"--heads {heads}:{kv_heads} does not fit kernel '{spec.name}'"
                            + (f" ({fixed})" if fixed else " (query heads must be a multiple of kv heads)"))
        for n_q, n_k in seqlens:
            default_batch = DECODE_BATCHES[interpreted] if kind == "decode" else [1 if interpreted else max(1, TOKENS // n_k)]
            for batch in args.batch or (VARLEN_BATCHES[interpreted] if spec.varlen else default_batch):
                if batch < 1:
                    raise TuneError(f"--batch takes positive whole numbers; got {batch}")
                if spec.varlen:
                    shapes.append(_packed_shape(spec, batch, heads, kv_heads, n_q, n_k))
                else:
                    shapes.append(Shape(batch, heads, kv_heads, n_q, n_k))
    return shapes


def _packed_shape(spec, batch: int, heads: int, kv_heads: int, total_q: int, total_k: int) -> Packed:
    """A varlen kernel's tuning shape: `batch` sequences of at least one query packed into `total_q` tokens."""
    if batch > total_q:
        raise TuneError(f"--batch {batch} sequences do not fit {total_q} tokens (--seqlens): kernel '{spec.name}' is "
                        "varlen, whose --seqlens are the packed tokens and --batch the sequences in them")
    if spec.kv_layout.paged and total_k < total_q:
        raise TuneError(f"--seqlens {total_q}:{total_k}: kernel '{spec.name}' keeps keys in pages, whose sequences "
                        "hold their queries' keys and more: give at least as many keys as queries")
    return Packed(batch, heads, kv_heads, total_q, total_k)


def _heads(text: str) -> tuple[int, int | None]:
    """'32' or '32:8' (query heads : key/value heads)."""
    heads, sep, kv_heads = text.partition(":")
    return _positive(heads, "--heads"), _positive(kv_heads, "--heads") if sep else None


def _default_heads(spec, interpreted: bool, kind: str) -> tuple[int, int | None]:
    """The spec's heads; else, decoding, 32 query heads on 8 key/value heads (Llama-style GQA, as
    `attngen bench`); else hidden 2048 / head_dim, in the spec's group."""
    group = spec.group or 1
    if spec.heads:
        return spec.heads, None
    if kind in ("decode", "chunked") and not spec.kv_heads and not spec.group and not interpreted:
        return 32, 8
    return (2 * group if interpreted else max(group, HIDDEN // spec.head_dim // group * group)), None


KINDS = ("forward", "backward", "decode")


def _capability():
    """The current CUDA device's compute capability, or None without a GPU."""
    import torch

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def gluon_note(part, capability) -> str | None:
    """What tuning `part` does not reach on a GPU of this capability: the calls that run the passes
    warp-specialize's or warp-specialize-decode's fixed-shape Gluon kernels instead of the Triton
    kernel the tuner tunes."""
    if capability != (9, 0):
        return None
    kernel = part if hasattr(part, "program") else part.kernel
    gluon = kernel.program.warp_specialized
    shape = {"forward": gluon.forward, "backward": gluon.backward, "kvcache": gluon.decode}.get(part.kind)
    if shape is None:
        return None
    if part.kind == "kvcache":
        return (f"on this GPU, calls with at most {shape.rows} query rows per K/V head (heads/kv_heads x seqlen_q) "
                f"on caches TMA can read may run the fixed-shape Gluon kernel (pass warp-specialize-decode): "
                f"warp_specialized=1 entries run it at their split count, warp_specialized=0 ones the Triton "
                f"kernel; the Triton keys serve the Triton kernel elsewhere too (more rows, other GPUs)")
    left = "smaller calls, other GPUs" + (", deterministic algorithms" if part.kind == "backward" else "")
    return (f"on this GPU, {part.kind} calls of at least {shape.min_scores:,} scores (B*H*N_Q*N_K) run the "
            f"fixed-shape Gluon kernel (pass warp-specialize); these configs serve the Triton kernel elsewhere "
            f"({left})")


def cmd_tune(args) -> int:
    interpreted = _use_interpreter_without_gpu()
    if args.write_table and interpreted:
        raise TuneError("--write-table writes a table to ship for a GPU; run it on that GPU "
                        "(timings in the interpreter mean nothing)")
    if (args.max_configs is not None and args.max_configs < 1) or args.rep < 1:
        raise TuneError("--max-configs and --rep take positive whole numbers")
    values = _values(args.values)
    plans = []
    for path in args.specs:  # every spec and argument is checked before anything is tuned
        kernel = load(_spec(path))
        available = tunables(kernel)
        if not available:
            raise TuneError(f"kernel '{kernel.spec.name}' ({path}) has no kernel the tuner can tune")
        parts = [part for part in available if not args.kind or part.kind in args.kind]
        if not parts:
            have = sorted({part.kind for part in available})
            raise TuneError(f"--kind {' '.join(args.kind)}: kernel '{kernel.spec.name}' has only {', '.join(have)}")
        for part in parts:
            restrict(part.tuning_space(), values)
            plans.append((part, _tune_shapes(kernel.spec, args, interpreted, part.kind)))
    failed = 0
    for part, shapes in plans:
        outcome = tune(part, shapes, values=values, budget=args.max_configs, rep_ms=args.rep, seed=args.seed,
                       progress=Progress(getattr(part, "label", part.spec.name)))
        print(format_outcome(outcome), flush=True)
        note = gluon_note(part, _capability())
        if note:
            print(f"  note: {note}")
        if not outcome.ok:
            failed += 1
            print(f"  no candidate passed validation at {', '.join(map(str, outcome.missing))}")
        table = Path(args.write_table) / f"{outcome.device.slug}.json" if args.write_table else None
        written = save(outcome, table)
        if written:
            print(f"  wrote {len(outcome.best)} entr{'y' if len(outcome.best) == 1 else 'ies'} to {written}")
    return EXIT_FAIL if failed else EXIT_OK


# -- entry point -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attngen", description="Compile .attn attention specs to Triton kernels.")
    parser.add_argument("--version", action="version", version=f"attngen {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("compile", help="write the generated Triton module of each spec")
    p.add_argument("specs", nargs="+", metavar="SPEC")
    p.add_argument("-o", "--output", default="generated", metavar="DIR", help="output folder (default: generated/)")
    p.set_defaults(run=cmd_compile)

    p = sub.add_parser("check", help="validate kernels against a float64 reference on random inputs")
    p.add_argument("specs", nargs="+", metavar="SPEC")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: fresh each run)")
    p.set_defaults(run=cmd_check)

    p = sub.add_parser("explain", help="print the IR after each pass, the cost model and the resources")
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("--pass", dest="pass_name", default=None, metavar="NAME", help="print only the IR after this pass")
    p.add_argument("--shape", default=None, metavar="B=1,H=16,N=4096",
                   help="sizes to evaluate the cost formulas at (B, H, H_KV, N, N_Q, N_K; default B=1, H=16 "
                        "or the spec's, N=4096, or N_Q=1 N_K=8192 for a split-KV spec)")
    p.set_defaults(run=cmd_explain)

    p = sub.add_parser("bench", help="time attngen against SDPA backends, FlexAttention and naive attention (GPU)")
    p.add_argument("--suite", choices=("prefill", "decode", "variants", "varlen", "shapes", "fp8", "all"), default="all",
                   help="all: prefill and decode; variants: masks and score modifiers against FlexAttention; "
                        "varlen: packed variable-length batches and SDPA through the flash-attention slot; "
                        "shapes: issue 51's head shapes (d=96, 256, GQA 28/4, d=64 odd lengths, 192/128) "
                        "against cuDNN, FlexAttention and FA2; fp8: the FP8 forward (also with q and k "
                        "Hadamard-rotated) against attngen's bf16 forward and cuDNN at d=128, with each one's error "
                        "against float64")
    p.add_argument("--direction", choices=("forward", "backward", "both"), default="both")
    p.add_argument("--lengths", default=None, metavar="512,1024,...", help="prefill sequence lengths")
    p.add_argument("--head-dims", default=None, metavar="64,128")
    p.add_argument("--providers", default=None, metavar="attngen,flex,...")
    p.add_argument("--batch", type=int, default=None, metavar="B", help="variants: batch (default 1)")
    p.add_argument("--heads", type=int, default=None, metavar="H", help="variants: heads (default 16)")
    p.add_argument("--check", action="store_true",
                   help="variants, varlen, shapes: run each row at a tiny size (in the interpreter without a GPU) and compare "
                        "attngen and the peer with float64 instead of timing")
    p.add_argument("-o", "--output", default="benchmarks/results", metavar="DIR",
                   help="folder for <gpu>.json (rows are merged with what is there)")
    p.set_defaults(run=cmd_bench)

    p = sub.add_parser("tune", help="search the tile configs of each spec for this GPU and cache the best")
    p.add_argument("specs", nargs="+", metavar="SPEC")
    p.add_argument("--kind", nargs="+", choices=KINDS, default=None,
                   help="which of the spec's kernels to tune (default: all: the forward, a forward+backward "
                        "spec's two backward kernels, or a split/paged spec's decode kernel)")
    p.add_argument("--seqlens", nargs="+", metavar="N|NQ:NK",
                   help="sequence lengths to tune at (default on a GPU: "
                        f"{' '.join(DEFAULT_SEQLENS['forward'][0])}; for decoding, "
                        f"{' '.join(DEFAULT_SEQLENS['decode'][0])}, new tokens : cache capacity; a paged spec "
                        f"without split, {' '.join(DEFAULT_SEQLENS['chunked'][0])}; 64 or 1:64 in the interpreter; "
                        "a varlen spec: the packed tokens, TQ or TQ:TK, default "
                        f"{' '.join(VARLEN_SEQLENS[False][0])}, paged {' '.join(VARLEN_SEQLENS[True][0])})")
    p.add_argument("--batch", nargs="+", type=int, metavar="B",
                   help=f"batch sizes (default: {TOKENS} // N_K; for decoding 1 16 64; a varlen spec: the sequences "
                        f"packed into the tokens, default {VARLEN_BATCHES[0][0]})")
    p.add_argument("--heads", nargs="+", metavar="H|H:H_KV",
                   help=f"query heads, or query : key/value heads (default: the spec's, else {HIDDEN} // head_dim; "
                        "for decoding 32:8)")
    p.add_argument("--values", nargs="+", metavar="KEY=V1,V2",
                   help="narrow the values tried for keys the spec leaves auto, e.g. block_n=32,64")
    p.add_argument("--max-configs", type=int, default=None, metavar="N",
                   help="try at most N candidates, nearest the default first (default: 16; 4 in the interpreter)")
    p.add_argument("--rep", type=int, default=25, metavar="MS", help="do_bench's rep per measurement (default: 25 ms)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the tuning inputs (default: 0)")
    p.add_argument("--write-table", default=None, metavar="DIR",
                   help="write DIR/<gpu>.json (a table to ship in attngen/tuned/) instead of the user's cache")
    p.set_defaults(run=cmd_tune)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except InternalError as e:
        print(f"attngen: internal error (a bug in attngen, please report it): {e}", file=sys.stderr)
        return EXIT_BUG
    except SpecError as e:
        print(e.format(), file=sys.stderr)
        return EXIT_USAGE
    except AttnGenError as e:
        print(f"attngen: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("attngen: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
