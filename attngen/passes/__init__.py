"""The lowering pipeline, in order. `compile_program` runs it; `attngen explain` prints each stage.

    lower           spec -> the textbook three-pass algorithm (N x N scores in HBM)
    tiling          query-block grid x key-block loops; S and P still go through HBM
    online-softmax  one pass with running max / sum / rescaled accumulator; no N x N scratch
    recompute       (forward+backward specs) dQ and dK/dV kernels that recompute P from the LSE
    exp2            softmax statistics in base 2, log2(e) folded into the scale
    fold-scale      scores kept unscaled; the scale applied where they are consumed (one FMA)
    descale         (FP8 inputs or an FP8 cache) q_descale * k_descale (k_descale alone for a cache) joins the
                    softmax scale, v_descale scales the output; FP8 inputs' P is quantised to e4m3 for P V
    kv-lengths      (decoding) per-sequence key counts n_k = SEQLENS[b] replace N_K
    varlen          (packed variable-length sequences) programs over all sequences' tiles, each finding its
                    sequence by a binary search over the cu_seqlens; per-sequence n_q, n_k; packed rows
    pack-gqa        (GQA packing) query heads sharing a K/V head fill one tile; grid over K/V heads
    split-kv        (Flash-Decoding) a grid axis over key splits; partial outputs + a combine kernel
    mixed           (paged varlen) short sequences (decodes) as narrow split-KV work items beside the wide tiles,
                    and a kernel merging their splits; the wide tiles skip them
    causal-skip     split key loops into masked and mask-free ranges; skip dead blocks
    paged           (paged cache) K/V addresses through the block table
    latent-kv       (v = k[:N], MLA) one read of each K tile: V's columns feed both products, the rest only Q K^T
    tma             (training, no mask, 16-bit, head dim >= 64, not varlen) dK/dV's streamed Q and dO tiles via TMA descriptors
    group-split     (dense backward, one head dim) a copy of the dK/dV kernel whose programs take a part of a GQA
                    group's query heads, storing float32 parts that the launcher sums in order
    warp-specialize (prefill or varlen not paged, 16-bit, one head dim 64/128, auto tiles) the forward (and backward) also as Hopper Gluon kernels
    warp-specialize-decode (split-KV decoding, contiguous or pages >= 16, 16-bit, one head dim 64/128) also as a Hopper Gluon kernel
    warp-specialize-mla (MLA decode 576/512, pages of 64k tokens, policy hopper.MLA_GLUON on) also as a Hopper Gluon
                    kernel: S computed once by two consumer warpgroups, each adding P V into half the value columns

The passes marked with a condition are no-ops for specs that do not ask for them.
Every pass but `lower` is a pure function Program -> Program in its own module, with a NAME.
"""

from __future__ import annotations

from typing import Callable

from .. import ir
from ..ir.verify import verify as check
from ..lang.spec import Spec
from . import (causal_skip, descale, exp2, fold_scale, group_split, kv_lengths, latent_kv, lower, mixed, online_softmax,
               pack_gqa, paged, recompute, split_kv, tiling, tma, varlen, warp_specialize, warp_specialize_decode,
               warp_specialize_mla)

PIPELINE = (tiling, online_softmax, recompute, exp2, fold_scale, descale, kv_lengths, varlen, pack_gqa, split_kv, mixed,
            causal_skip, paged, latent_kv, tma, group_split, warp_specialize, warp_specialize_decode, warp_specialize_mla)
"""The passes after `lower`, in order."""

PASS_NAMES = (lower.NAME,) + tuple(p.NAME for p in PIPELINE)


def applied_passes(program: ir.Program) -> tuple[str, ...]:
    """The passes that act on this (final) program: a pass with an `applies` test may be a no-op."""
    return (lower.NAME,) + tuple(p.NAME for p in PIPELINE if getattr(p, "applies", lambda _: True)(program))


def compile_program(spec: Spec, trace: Callable[[str, ir.Program], None] | None = None,
                    verify: bool = True) -> ir.Program:
    """Lower a spec through every pass; `trace(name, program)` sees the program after each one."""
    program = lower.run(spec)
    if verify:
        check(program, lower.NAME)
    if trace:
        trace(lower.NAME, program)
    for p in PIPELINE:
        program = p.run(program)
        if verify:
            check(program, p.NAME)
        if trace:
            trace(p.NAME, program)
    return program
