"""Experiment: a persistent, balanced (stream-K) warp-specialised Gluon decode kernel.

    python benchmarks/experiments/gluon_decode_persistent.py OUT_DIR   (GPU: float64 checks, then timings)
    python benchmarks/experiments/gluon_decode_persistent.py --compile (no GPU: sm_90 compiles, ptxas -v)

Where decoding trails cuDNN (README, NOTES v12-v14): batch 16 at 0.94-0.97x (128 (sequence, K/V head)
units on 132 SMs: one split leaves 4 SMs idle, two give 256 programs and a merge), batch 64 1k at
0.97x (512 programs of 1024 keys in four waves, each program paying its own pipeline ramp).
The balanced split of v12 (experiments/decode_balanced.py) cut all K/V blocks into one equal range per
program, but as a Triton kernel each (sequence, head) piece of a range started its own software
pipeline, so a range that crossed a piece boundary paid a second ramp, and it lost.

Here the range is streamed by a warp-specialised program: the grid is one program per SM; all K/V
blocks, in (sequence, K/V head, block) order, are cut into G equal ranges; a loader warp walks its
range by TMA into a ring (contiguous caches as a (B x N_MAX, H_KV x D) view; paged ones page by page
through the block table, a chunk of 32 entries ahead) without stopping at piece boundaries, and the
consumer warpgroup (the group's query rows padded to wgmma's 64) closes a piece at each boundary: a
piece that is a whole (sequence, head) writes the output directly, a part writes a partial at slot
program + unit (unique: ranges are in order). A merge kernel finds a unit's programs by arithmetic
and merges its partials; whole units it skips.

Prediction: batch 64 1k +10-20% (one ramp per SM instead of four), batch 16 +3-6% (132 SMs busy, no
split merge at 1k), batch 64 8k/32k +0-3%, batch 1 within 3% (the same number of ramps; its units span
16 programs each, as 16 splits do now).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LOADER_REGS = gl.constexpr(40)


@gluon.jit
def _combine_fn(a, b):
    return a + b


@gluon.jit
def _pd_next_seq(SEQLENS, b, B, stride_sl):
    """The first sequence after b with keys, and its key count (b = B-1 and 0 keys past the last)."""
    b = b + 1
    n_k = gl.load(SEQLENS + gl.minimum(b, B - 1) * stride_sl)
    while (n_k == 0) & (b < B - 1):
        b = b + 1
        n_k = gl.load(SEQLENS + b * stride_sl)
    return b, n_k


@gluon.jit
def _pd_consumer(Q, OUT, LSE, OP, LP, SEQLENS, BT, k_desc, v_desc, q_smem, k_smem, v_smem, k_ready, k_empty,
                 v_ready, v_empty, g, count, b0, h0, j0, nk0, B, H_KV, N_Q, GROUP, N_MAX, stride_q_b, stride_q_h,
                 stride_q_n, stride_o_b, stride_o_h, stride_o_n, stride_l_b, stride_l_h, stride_l_n, stride_sl,
                 stride_bt_b, qk_scale, sm_scale_ln, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PAGE: gl.constexpr, PAGED: gl.constexpr):
    """The program's blocks in order; at each unit's last block (or the range's) the piece is closed:
    the output and log-sum-exp stored, to OUT/LSE for a whole unit, else to slot g + unit of OP/LP."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    io: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, io))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io))
    s_rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    n_rows = GROUP * N_Q
    valid = rows < n_rows
    head_of = rows % GROUP
    query_of = rows // GROUP
    b = b0
    h = h0
    j = j0
    n_k = nk0
    nb = gl.cdiv(n_k, BLOCK_N)
    whole = j0 == 0
    if count > 0:
        q_ptr = (Q + b.to(gl.int64) * stride_q_b + (h * GROUP + head_of).to(gl.int64)[:, None] * stride_q_h
                 + query_of[:, None] * stride_q_n + cols[None, :])
        q_smem.store(gl.load(q_ptr, mask=valid[:, None], other=0.0))
        fence_async_shared()
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    for it in range(count):
        s = it % STAGES
        phase = (it // STAGES) & 1
        mbarrier.wait(k_ready.index(s), phase)
        sc = warpgroup_mma(q_smem, k_smem.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        sc = warpgroup_mma_wait(0, deps=(sc, ))
        mbarrier.arrive(k_empty.index(s), count=1)
        first_limit = n_k - N_Q + 1
        if (j + 1) * BLOCK_N > first_limit:  # a block some row must not see all of
            keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            limit = first_limit + s_rows // GROUP
            keep = (keys[None, :] < limit[:, None]) & (keys < n_k)[None, :]
            sc = gl.where(keep, sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, 1) * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(sc * qk_scale - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        mbarrier.wait(v_ready.index(s), phase)
        acc = warpgroup_mma(p, v_smem.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(s), count=1)
        unit_end = j == nb - 1
        if unit_end | (it == count - 1):  # close the piece
            l_safe = gl.where(l_i == 0.0, 1.0, l_i)
            out = gl.convert_layout(acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None], io)
            lse = (m_i + gl.log2(l_safe)) * 0.6931471805599453
            if whole & unit_end:
                o_ptr = (OUT + b.to(gl.int64) * stride_o_b + (h * GROUP + head_of).to(gl.int64)[:, None] * stride_o_h
                         + query_of[:, None] * stride_o_n + cols[None, :])
                gl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=valid[:, None])
                l_ptr = (LSE + b.to(gl.int64) * stride_l_b + (h * GROUP + s_rows % GROUP).to(gl.int64) * stride_l_h
                         + (s_rows // GROUP) * stride_l_n)
                gl.store(l_ptr, lse, mask=s_rows < n_rows)
            else:
                slot = (g + b * H_KV + h).to(gl.int64)
                op_ptr = OP + (slot * n_rows + rows[:, None]) * HEAD_DIM + cols[None, :]
                gl.store(op_ptr, out, mask=valid[:, None])
                gl.store(LP + slot * n_rows + s_rows, lse, mask=s_rows < n_rows)
            acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
            m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
            l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
        j = j + 1
        if j == nb:  # the next unit: the next head, or the next sequence with keys
            j = 0
            whole = j == 0
            h = h + 1
            if h == H_KV:
                h = 0
                b, n_k = _pd_next_seq(SEQLENS, b, B, stride_sl)
                nb = gl.cdiv(n_k, BLOCK_N)
            if it + 1 < count:
                q_ptr = (Q + b.to(gl.int64) * stride_q_b + (h * GROUP + head_of).to(gl.int64)[:, None] * stride_q_h
                         + query_of[:, None] * stride_q_n + cols[None, :])
                q_smem.store(gl.load(q_ptr, mask=valid[:, None], other=0.0))
                fence_async_shared()


@gluon.jit
def _pd_loader(Q, OUT, LSE, OP, LP, SEQLENS, BT, k_desc, v_desc, q_smem, k_smem, v_smem, k_ready, k_empty,
               v_ready, v_empty, g, count, b0, h0, j0, nk0, B, H_KV, N_Q, GROUP, N_MAX, stride_q_b, stride_q_h,
               stride_q_n, stride_o_b, stride_o_h, stride_o_n, stride_l_b, stride_l_h, stride_l_n, stride_sl,
               stride_bt_b, qk_scale, sm_scale_ln, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PAGE: gl.constexpr, PAGED: gl.constexpr):
    """The program's K/V blocks by TMA into the ring, walking (sequence, head, block) without a stop at
    unit boundaries; paged: the block table's entries a chunk of 32 at a time, the next chunk ahead."""
    b = b0
    h = h0
    j = j0
    n_k = nk0
    nb = gl.cdiv(n_k, BLOCK_N)
    if PAGED:
        RPC: gl.constexpr = k_desc.block_type.shape[0]
        COPIES: gl.constexpr = BLOCK_N // RPC
        nbytes: gl.constexpr = BLOCK_N * k_desc.block_type.nbytes // RPC
        CHUNK: gl.constexpr = 32
        BPC: gl.constexpr = CHUNK * PAGE // BLOCK_N  # blocks per chunk of entries
        idx = gl.arange(0, CHUNK, layout=gl.BlockedLayout([1], [32], [1], [0]))
        # `cur` holds chunk c_have of sequence b_have; `nxt` chunk c_nxt of b_nxt
        c = j // BPC
        n_pages = gl.cdiv(n_k, PAGE)
        cur = gl.load(BT + b.to(gl.int64) * stride_bt_b + c * CHUNK + idx, mask=c * CHUNK + idx < n_pages, other=0)
        b_have = b
        c_have = c
        b_nxt = b
        c_nxt = c + 1
        nxt = gl.load(BT + b.to(gl.int64) * stride_bt_b + c_nxt * CHUNK + idx, mask=c_nxt * CHUNK + idx < n_pages,
                      other=0)
    else:
        nbytes: gl.constexpr = k_desc.block_type.nbytes
    for it in range(count):
        s = it % STAGES
        phase = (it // STAGES) & 1
        if PAGED:
            c = j // BPC
            if (c != c_have) | (b != b_have):
                n_pages = gl.cdiv(n_k, PAGE)
                if (c == c_nxt) & (b == b_nxt):
                    cur = nxt
                else:
                    cur = gl.load(BT + b.to(gl.int64) * stride_bt_b + c * CHUNK + idx, mask=c * CHUNK + idx < n_pages,
                                  other=0)
                b_have = b
                c_have = c
                # the chunk after it in walk order: the sequence's next, else its first again (next head)
                c_nxt = c + 1
                if c_nxt * CHUNK >= n_pages:
                    c_nxt = 0
                nxt = gl.load(BT + b.to(gl.int64) * stride_bt_b + c_nxt * CHUNK + idx,
                              mask=c_nxt * CHUNK + idx < n_pages, other=0)
                b_nxt = b
            mbarrier.wait(k_empty.index(s), phase ^ 1)
            mbarrier.expect(k_ready.index(s), nbytes)
            for cc in gl.static_range(COPIES):
                key = j * BLOCK_N + cc * RPC
                page = gl.sum(gl.where(idx == (key // PAGE) % CHUNK, cur, 0), 0)
                tma.async_copy_global_to_shared(k_desc, [page * PAGE + key % PAGE, h * HEAD_DIM], k_ready.index(s),
                                                k_smem.index(s).slice(cc * RPC, RPC))
            mbarrier.wait(v_empty.index(s), phase ^ 1)
            mbarrier.expect(v_ready.index(s), nbytes)
            for cc in gl.static_range(COPIES):
                key = j * BLOCK_N + cc * RPC
                page = gl.sum(gl.where(idx == (key // PAGE) % CHUNK, cur, 0), 0)
                tma.async_copy_global_to_shared(v_desc, [page * PAGE + key % PAGE, h * HEAD_DIM], v_ready.index(s),
                                                v_smem.index(s).slice(cc * RPC, RPC))
        else:
            row = b * N_MAX + j * BLOCK_N
            mbarrier.wait(k_empty.index(s), phase ^ 1)
            mbarrier.expect(k_ready.index(s), nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, h * HEAD_DIM], k_ready.index(s), k_smem.index(s))
            mbarrier.wait(v_empty.index(s), phase ^ 1)
            mbarrier.expect(v_ready.index(s), nbytes)
            tma.async_copy_global_to_shared(v_desc, [row, h * HEAD_DIM], v_ready.index(s), v_smem.index(s))
        j = j + 1
        if j == nb:
            j = 0
            h = h + 1
            if h == H_KV:
                h = 0
                b, n_k = _pd_next_seq(SEQLENS, b, B, stride_sl)
                nb = gl.cdiv(n_k, BLOCK_N)


@gluon.jit(do_not_specialize=["B", "H_KV", "N_Q", "GROUP", "N_MAX", "stride_q_b", "stride_q_h", "stride_q_n",
                              "stride_o_b", "stride_o_h", "stride_o_n", "stride_l_b", "stride_l_h", "stride_l_n",
                              "stride_bt_b"])
def pdecode_fwd(Q, OUT, LSE, OP, LP, SEQLENS, BT, k_desc, v_desc, B, H_KV, N_Q, GROUP, N_MAX, stride_q_b, stride_q_h,
                stride_q_n, stride_o_b, stride_o_h, stride_o_n, stride_l_b, stride_l_h, stride_l_n, stride_sl,
                stride_bt_b, sm_scale, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                STAGES: gl.constexpr, PAGE: gl.constexpr, PAGED: gl.constexpr, BMAX: gl.constexpr):
    """One program per SM: the g-th of G equal ranges of all K/V blocks in (sequence, head, block) order."""
    g = gl.program_id(0)
    G = gl.num_programs(0)
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    bi = gl.arange(0, BMAX, layout=lay)
    lens = gl.load(SEQLENS + bi * stride_sl, mask=bi < B, other=0)
    per_seq = gl.cdiv(lens, BLOCK_N) * H_KV  # blocks of a sequence, all heads
    ends = gl.associative_scan(per_seq, 0, _combine_fn)
    T = gl.sum(per_seq, 0)
    start = (g * T) // G
    count = ((g + 1) * T) // G - start
    b0 = gl.minimum(gl.sum((ends <= start).to(gl.int32), 0), B - 1)  # the sequence holding block `start`
    sel = bi == b0
    nk0 = gl.sum(gl.where(sel, lens, 0), 0)
    nb0 = gl.maximum(gl.cdiv(nk0, BLOCK_N), 1)
    off = start - (gl.sum(gl.where(sel, ends, 0), 0) - gl.sum(gl.where(sel, per_seq, 0), 0))
    h0 = off // nb0
    j0 = off % nb0
    qk_scale = sm_scale * 1.4426950408889634
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], gl.bfloat16)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [ROWS, HEAD_DIM], q_layout)
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.bfloat16)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    gl.warp_specialize([(_pd_consumer, (Q, OUT, LSE, OP, LP, SEQLENS, BT, k_desc, v_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready,
            v_empty, g, count, b0, h0, j0, nk0, B, H_KV, N_Q, GROUP, N_MAX, stride_q_b, stride_q_h, stride_q_n,
            stride_o_b, stride_o_h, stride_o_n, stride_l_b, stride_l_h, stride_l_n, stride_sl, stride_bt_b,
            qk_scale, sm_scale, ROWS, BLOCK_N, HEAD_DIM, STAGES, PAGE, PAGED)),
                        (_pd_loader, (Q, OUT, LSE, OP, LP, SEQLENS, BT, k_desc, v_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready,
            v_empty, g, count, b0, h0, j0, nk0, B, H_KV, N_Q, GROUP, N_MAX, stride_q_b, stride_q_h, stride_q_n,
            stride_o_b, stride_o_h, stride_o_n, stride_l_b, stride_l_h, stride_l_n, stride_sl, stride_bt_b,
            qk_scale, sm_scale, ROWS, BLOCK_N, HEAD_DIM, STAGES, PAGE, PAGED))], [1], [LOADER_REGS])


@triton.jit
def pdecode_merge(OUT, LSE, OP, LP, SEQLENS, B, H_KV, GROUP, N_Q, G, stride_o_b, stride_o_h, stride_o_n,
                  stride_l_b, stride_l_h, stride_l_n, stride_sl, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BMAX: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program per (query, head, sequence): the partials of its unit merged by log-sum-exp; a unit
    one program held whole was written by it; a sequence without keys gets 0 and -inf."""
    n = tl.program_id(0)
    hq = tl.program_id(1)
    b = tl.program_id(2)
    hkv = hq // GROUP
    n_rows = GROUP * N_Q
    r = n * GROUP + hq % GROUP
    bi = tl.arange(0, BMAX)
    per_seq = tl.cdiv(tl.load(SEQLENS + bi * stride_sl, mask=bi < B, other=0), BLOCK_N) * H_KV
    ends = tl.cumsum(per_seq, 0)
    T = tl.maximum(tl.sum(per_seq, 0), 1)
    sel = bi == b
    nb = tl.sum(tl.where(sel, per_seq, 0), 0) // H_KV
    first = tl.sum(tl.where(sel, ends - per_seq, 0), 0) + hkv * nb
    last = first + nb - 1
    p0 = ((first + 1) * G + T - 1) // T - 1  # the program whose range holds block `first`
    p1 = ((last + 1) * G + T - 1) // T - 1
    cols = tl.arange(0, HEAD_DIM)
    o_ptr = OUT + b.to(tl.int64) * stride_o_b + hq.to(tl.int64) * stride_o_h + n * stride_o_n + cols
    l_ptr = LSE + b.to(tl.int64) * stride_l_b + hq.to(tl.int64) * stride_l_h + n * stride_l_n
    if nb == 0:
        tl.store(o_ptr, tl.zeros([HEAD_DIM], tl.float32).to(OUT.dtype.element_ty))
        tl.store(l_ptr, float("-inf"))
    elif p1 > p0:
        unit = b * H_KV + hkv
        m = tl.full([BLOCK_S], float("-inf"), tl.float32)
        s_idx = tl.arange(0, BLOCK_S)
        for c in range(p0, p1 + 1, BLOCK_S):  # the running max per lane first
            slot = (c + s_idx + unit).to(tl.int64)
            ok = (c + s_idx <= p1) & (((c + s_idx + 1) * T) // G > ((c + s_idx) * T) // G)  # a range not empty
            m = tl.maximum(m, tl.load(LP + slot * n_rows + r, mask=ok, other=float("-inf")))
        m_all = tl.max(m, 0)
        m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
        acc = tl.zeros([HEAD_DIM], tl.float32)
        den = tl.zeros([BLOCK_S], tl.float32)
        for c in range(p0, p1 + 1, BLOCK_S):
            slot = (c + s_idx + unit).to(tl.int64)
            ok = (c + s_idx <= p1) & (((c + s_idx + 1) * T) // G > ((c + s_idx) * T) // G)
            w = tl.exp(tl.load(LP + slot * n_rows + r, mask=ok, other=float("-inf")) - m_use)
            parts = tl.load(OP + (slot * n_rows + r)[:, None] * HEAD_DIM + cols[None, :], mask=ok[:, None], other=0.0)
            acc += tl.sum(parts * w[:, None], 0)
            den += w
        total = tl.sum(den, 0)
        safe = tl.where(total == 0.0, 1.0, total)
        tl.store(o_ptr, (acc / safe).to(OUT.dtype.element_ty))
        tl.store(l_ptr, tl.where(total == 0.0, float("-inf"), m_use + tl.log(safe)))


_SMS = {}


def pdecode(q, k, v, seqlens, block_table=None, *, BLOCK_N=64, STAGES=3, programs=None, out=None, lse=None,
            sm_scale=None, bufs=None):
    """q (B, H, N_Q, D); contiguous k/v (B, N_MAX, H_KV, D) caches, or page pools (NUM_PAGES, PAGE, H_KV, D)
    with block_table (B, MAX_PAGES). Returns (out, lse). `bufs`: a dict kept between calls for the partials."""
    B, H, N_Q, D = q.shape
    paged = block_table is not None
    if paged:
        pages, page, H_KV, _ = k.shape
        flat = [t.view(pages * page, H_KV * D) for t in (k, v)]
        box = [min(page, BLOCK_N), D]
        n_max = 0
    else:
        _, n_max, H_KV, _ = k.shape
        page = BLOCK_N
        flat = [t.view(B * n_max, H_KV * D) for t in (k, v)]
        box = [BLOCK_N, D]
    layout = gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)
    k_desc, v_desc = (GluonTensorDescriptor(t, list(t.shape), list(t.stride()), box, layout) for t in flat)
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32) if lse is None else lse
    if programs is None:
        dev = q.device.index or 0
        if dev not in _SMS:
            _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
        programs = _SMS[dev]
    group = H // H_KV
    n_rows = group * N_Q
    slots = programs + B * H_KV
    key = (slots, n_rows, D)
    if bufs is not None and bufs.get("key") == key:
        op, lp = bufs["op"], bufs["lp"]
    else:
        op = torch.empty((slots, n_rows, D), device=q.device, dtype=torch.float32)
        lp = torch.empty((slots, n_rows), device=q.device, dtype=torch.float32)
        if bufs is not None:
            bufs.update(key=key, op=op, lp=lp)
    bt = block_table if paged else seqlens
    bmax = max(16, triton.next_power_of_2(B))
    pdecode_fwd[(programs,)](
        q, out, lse, op, lp, seqlens, bt, k_desc, v_desc, B, H_KV, N_Q, group, n_max, q.stride(0), q.stride(1),
        q.stride(2), out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        seqlens.stride(0), bt.stride(0), sm_scale, ROWS=64, BLOCK_N=BLOCK_N, HEAD_DIM=D, STAGES=STAGES, PAGE=page,
        PAGED=paged, BMAX=bmax, num_warps=4)
    pdecode_merge[(N_Q, H, B)](
        out, lse, op, lp, seqlens, B, H_KV, group, N_Q, programs, out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2), seqlens.stride(0), BLOCK_N=BLOCK_N, HEAD_DIM=D, BMAX=bmax,
        BLOCK_S=32, num_warps=4)
    return out, lse


def check(cases, configs) -> float:
    """Largest output error against float64 over `cases` ((B, H, H_KV, N_Q, N, lengths or None, page or
    None)) and `configs` ((BLOCK_N, STAGES, programs or None)); outputs poisoned first."""
    from gluon_decode import pages_of, reference

    gen = torch.Generator("cuda").manual_seed(5)
    worst = 0.0
    for B, H, H_KV, N_Q, N, lengths, page in cases:
        q = torch.randn(B, H, N_Q, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        kc, vc = (torch.randn(B, N, H_KV, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        k, v = kc.transpose(1, 2), vc.transpose(1, 2)
        if lengths is None:
            lengths = torch.randint(0, N + 1, (B,), generator=torch.Generator().manual_seed(B + N)).tolist()
        seqlens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
        want, want_lse = reference(q, k, v, seqlens)
        table = None
        if page:
            kc, table = pages_of(k, page, torch.Generator("cuda").manual_seed(N))
            vc, _ = pages_of(v, page, torch.Generator("cuda").manual_seed(N))
        for block_n, stages, programs in configs:
            out = torch.full_like(q, float("nan"))
            lse = torch.full(q.shape[:3], float("nan"), device="cuda")
            pdecode(q, kc, vc, seqlens, table, BLOCK_N=block_n, STAGES=stages, programs=programs, out=out, lse=lse)
            torch.cuda.synchronize()
            err = (out.double().cpu() - want).abs().max().item()
            finite = want_lse.isfinite()
            lse_err = (lse.double().cpu()[finite] - want_lse[finite]).abs().max().item() if finite.any() else 0.0
            lse_ok = bool((lse.cpu()[~finite] == float("-inf")).all())
            if not (err < 2e-2 and lse_err < 1e-3 and lse_ok):
                raise AssertionError(f"B={B} N_Q={N_Q} N={N} lengths={lengths} page={page} BLOCK_N={block_n} "
                                     f"STAGES={stages} programs={programs}: out err {err:.3g}, lse err {lse_err:.3g}, "
                                     f"empty rows -inf {lse_ok}")
            worst = max(worst, err)
    return worst


def compile_only() -> int:
    """sm_90 compiles of each variant on this machine (no GPU): shared memory, registers, spills."""
    from common import sm90_ptxas

    ptrs = {"Q": "*bf16", "OUT": "*bf16", "LSE": "*fp32", "OP": "*fp32", "LP": "*fp32", "SEQLENS": "*i32",
                "BT": "*i32"}
    for paged, page, block_n, stages in ((False, 64, 64, 3), (True, 16, 64, 3), (True, 64, 64, 4)):
        box = [min(page, block_n), 128]
        const = dict(ROWS=64, BLOCK_N=block_n, HEAD_DIM=128, STAGES=stages, PAGE=page, PAGED=paged, BMAX=64)
        print(f"paged={paged} page={page} BLOCK_N={block_n} STAGES={stages}: "
              + sm90_ptxas(pdecode_fwd, box, const, ptrs))
    return 0


CASES = ((1, 8192), (1, 32768), (16, 1024), (16, 8192), (16, 32768), (64, 1024), (64, 8192), (64, 32768))


def main() -> int:
    if "--compile" in sys.argv:
        return compile_only()
    import attngen
    from attngen.bench_decode import D, DTYPE, H, H_KV, bench_graph, bench_layers, gbps, layer_count, paged_copy, sdpa

    out_dir = next((a for a in sys.argv[1:] if not a.startswith("--")), ".")
    os.makedirs(out_dir, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = ((64, 3, None), (64, 4, None), (64, 2, 7), (64, 3, 300))
    worst = check(((1, 32, 8, 1, 4097, [4097], None), (7, 32, 8, 1, 1000, None, None),
                   (3, 8, 2, 3, 333, [3, 200, 333], None), (4, 32, 8, 1, 300, [0, 17, 0, 0], None),
                   (2, 32, 8, 1, 300, [0, 0], None), (1, 32, 8, 1, 64, [64], None),
                   (1, 32, 8, 1, 4097, [4097], 16), (7, 32, 8, 1, 1000, None, 16),
                   (3, 8, 2, 3, 333, [2, 200, 333], 64), (5, 32, 8, 1, 2100, None, 16),
                   (40, 32, 8, 1, 700, None, 16)), configs)
    print(f"float64 check done (worst {worst:.2e})", flush=True)
    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    variants = [("p64x3", 64, 3, sms), ("p64x4", 64, 4, sms), ("p64x2x2", 64, 2, 2 * sms)]
    for batch, ctx in CASES:
        layers = max(2, layer_count(batch, ctx))
        caches = [(torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen),
                   torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen)) for _ in range(layers)]
        q = torch.randn(batch, 1, H, D, device="cuda", dtype=DTYPE, generator=gen)
        for spread in (False, True):
            if spread:
                if batch == 1:
                    continue
                lens = torch.randint(ctx // 2, ctx + 1, (batch,), device="cuda", generator=gen, dtype=torch.int32)
            else:
                lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
            tokens = int(lens.sum())
            rate = lambda ms: gbps(1, tokens, ms)  # noqa: E731 - K/V bytes of the tokens present
            row = {"batch": batch, "context": ctx, "spread": spread, "layers": layers}
            for page in (None, 16):
                tag = "paged16 " if page else ""
                if page:
                    perm = torch.randperm(batch * ctx // page, device="cuda", generator=gen)
                    layer_kv = [(paged_copy(k, page, perm), paged_copy(v, page, perm)) for k, v in caches]
                    table = perm.view(batch, -1).int()
                else:
                    layer_kv, table = caches, None
                calls = {"shipped": lambda kl, vl: attngen.attention_with_kvcache(q, kl, vl, cache_seqlens=lens,
                                                                                  block_table=table)}
                for name, block_n, stages, programs in variants:
                    bufs = {}

                    def call(kl, vl, block_n=block_n, stages=stages, programs=programs, bufs=bufs):
                        return pdecode(q.transpose(1, 2), kl, vl, lens, table, BLOCK_N=block_n, STAGES=stages,
                                       programs=programs, bufs=bufs)[0].transpose(1, 2)
                    calls[name] = call
                k0, v0 = layer_kv[0]
                want = calls["shipped"](k0, v0).float()
                for name, call in calls.items():
                    try:
                        row[f"{tag}{name} err"] = (call(k0, v0).float() - want).abs().max().item()
                        row[f"{tag}{name}"] = rate(bench_graph(lambda: call(k0, v0)))
                        row[f"{tag}{name} [layers]"] = rate(bench_layers(
                            [lambda kl=kl, vl=vl: call(kl, vl) for kl, vl in layer_kv]))
                    except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                        row[f"{tag}{name}"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:120]}"
                del layer_kv
            if not spread:
                ms, how = sdpa("CUDNN_ATTENTION", q, *caches[0])
                row["cudnn"] = rate(ms) if ms else how
                ms, how = sdpa("CUDNN_ATTENTION", q, None, None, caches)
                row["cudnn [layers]"] = rate(ms) if ms else how
            rows.append(row)
            print(json.dumps(row), flush=True)
        del caches
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "gluon_decode_persistent.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\nGB/s [graph] / [layers]")
    names = ["shipped"] + [v[0] for v in variants]
    for row in rows:
        for tag in ("", "paged16 "):
            cells = []
            for n in names:
                a, b = row.get(tag + n), row.get(tag + n + " [layers]")
                cells.append(f"{n} {a:.0f}/{b:.0f}" if isinstance(a, float) and isinstance(b, float) else f"{n} {a}")
            if not tag and "cudnn" in row:
                cud = row["cudnn"], row["cudnn [layers]"]
                cells.append(f"cudnn {cud[0]:.0f}/{cud[1]:.0f}" if all(isinstance(c, float) for c in cud) else str(cud))
            print(f"B={row['batch']:>2} ctx={row['context']:>5} {'spread' if row['spread'] else 'full  '} "
                  f"{tag or 'contig  '} " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
