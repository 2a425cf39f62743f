"""Experiment: the warp-specialised Gluon decode kernel with its products swapped (keys as wgmma's M).

    python benchmarks/experiments/gluon_decode_swap.py OUT_DIR     (GPU: float64 checks, then timings)
    python benchmarks/experiments/gluon_decode_swap.py --compile   (no GPU: sm_90 compiles, ptxas -v)

The shipped paged decode (templates/gluon_decode.py.j2) and v13's contiguous form of it
(experiments/gluon_decode.py) pad the K/V head's 4 query rows to wgmma's M of 64: each key block's
scores are a [64, BLOCK_N] tile of which 4 rows count, and its consumer warpgroup runs the online
softmax (max, exp2, sum, the rescale) over all 64 rows: 32 scores a thread where 2 are real. The
one-split Triton kernel stalls on fixed-latency dependencies at batch 16 (ncu, NOTES v17), and the
padded Gluon kernel is no faster (v13); cuDNN's kernel reaches 90-92% of DRAM peak at batch 16 8k,
ours 86-87.5%, and neither deeper pipelines (v17), L2 prefetch (v18), the cache layout (v18) nor
warp-split blocks (v18) closed that gap.

Here the products are transposed, as FlashInfer's and FA3's decode kernels do: the keys fill wgmma's
M and the query rows its N (8, the smallest wgmma N; 16 for up to 16 rows):
  - S^T = K Q^T: A = the K block [BLOCK_N, D] straight from the TMA ring, B = Q^T from shared memory;
    a [BLOCK_N, 8] fp32 tile, 4 values a thread at BLOCK_N 64;
  - the online softmax runs down the columns: one cross-warp max a block; the row sums are kept as a
    [BLOCK_N, 8] tile of running sums, rescaled like the accumulator and summed once at the end;
  - P^T goes to shared memory ([8, BLOCK_N], 1 KB) and O^T += V^T P^T: A = the V block transposed
    (wgmma reads 16-bit A in either major order), B = P^T; a [D, 8] accumulator, 8 registers a thread
    where the padded kernel holds 64.
The loader warp, the partials and their merge are v13's (`gluon_decode._gd_loader`, the shipped combine).
Prediction: the consumer's work per block drops ~8x (softmax) and its registers ~4x, so if its
dependency chain is what holds the padded kernel below cuDNN, batch 16 one split +2-4% (to ~1.0x
cuDNN at 8k, 0.99x at 1k); batch 1 and 64 within 2% (start-up and bandwidth bound).
"""

from __future__ import annotations

import json
import os
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from gluon_decode import LOADER_REGS, _gd_loader, check, gdecode  # noqa: E402


@gluon.jit
def _sw_consumer(Q, OP, LP, k_smem, v_smem, q_smem, p_smem, k_ready, k_empty, v_ready, v_empty, b, hkv, split, j0, j1,
                 n_k, N_Q, GROUP, stride_q_b, stride_q_h, stride_q_n, stride_op_b, stride_op_s, stride_op_h, stride_op_n,
                 stride_lp_b, stride_lp_s, stride_lp_h, stride_lp_n, qk_scale, NQ: gl.constexpr,
                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """Key blocks [j0, j1) of (sequence b, K/V head hkv) against the group's NQ (padded) query rows, row r
    being query head hkv * GROUP + r % GROUP, query r // GROUP, held as columns: S^T, online softmax
    down the columns, O^T; the partial output and log-sum-exp stored."""
    # one layout for S^T [BLOCK_N, NQ] and O^T [HEAD_DIM, NQ]: wgmma's M over the 4 warps, N = NQ
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NQ, 16])
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    qr = gl.arange(0, NQ, layout=gl.SliceLayout(1, ld))
    qc = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    q_ptr = (Q + b.to(gl.int64) * stride_q_b + (hkv * GROUP + qr % GROUP).to(gl.int64)[:, None] * stride_q_h
             + (qr // GROUP)[:, None] * stride_q_n + qc[None, :])
    q_smem.store(gl.load(q_ptr, mask=(qr < GROUP * N_Q)[:, None], other=0.0))
    fence_async_shared()
    acc = gl.zeros([HEAD_DIM, NQ], gl.float32, layout=mma)
    zero_s = gl.zeros([BLOCK_N, NQ], gl.float32, layout=mma)
    l_acc = gl.zeros([BLOCK_N, NQ], gl.float32, layout=mma)
    cols = gl.arange(0, NQ, layout=gl.SliceLayout(0, mma))
    limit = n_k - N_Q + 1 + cols // GROUP  # column r sees the keys below this (causal, bottom-right)
    first_limit = n_k - N_Q + 1
    m_i = gl.full([NQ], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
    for j in range(j0, j1):
        s = (j - j0) % STAGES
        phase = ((j - j0) // STAGES) & 1
        mbarrier.wait(k_ready.index(s), phase)
        sc = warpgroup_mma(k_smem.index(s), q_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        sc = warpgroup_mma_wait(0, deps=(sc, ))
        mbarrier.arrive(k_empty.index(s), count=1)
        if (j + 1) * BLOCK_N > first_limit:
            keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
            keep = (keys[:, None] < limit[None, :]) & (keys < n_k)[:, None]
            sc = gl.where(keep, sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, 0) * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a column that has seen no key yet
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(sc * qk_scale - m_use[None, :])
        l_acc = l_acc * alpha[None, :] + p
        m_i = m_new
        acc = acc * alpha[None, :]
        p_smem.store(gl.permute(p.to(gl.bfloat16), (1, 0)))
        fence_async_shared()
        mbarrier.wait(v_ready.index(s), phase)
        if (j + 1) * BLOCK_N > n_k:  # the sequence's last block: zero its V rows past n_k (0 x NaN)
            io: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
            v_block = v_smem.index(s)
            v_keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, io))
            v_block.store(gl.where((v_keys < n_k)[:, None], v_block.load(io), 0.0))
            fence_async_shared()
        acc = warpgroup_mma(v_smem.index(s).permute((1, 0)), p_smem.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(s), count=1)
    l_i = gl.sum(l_acc, 0)
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)  # columns that saw no key give 0 and a log-sum-exp of -inf
    out_t: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, 4], [0, 1])  # [HEAD_DIM, NQ], D contiguous
    out = gl.convert_layout(acc / l_safe[None, :], out_t)
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, out_t))
    r = gl.arange(0, NQ, layout=gl.SliceLayout(0, out_t))
    o_ptr = (OP + b.to(gl.int64) * stride_op_b + split.to(gl.int64) * stride_op_s
             + (hkv * GROUP + r % GROUP).to(gl.int64)[None, :] * stride_op_h + (r // GROUP)[None, :] * stride_op_n
             + d[:, None])
    gl.store(o_ptr, out.to(OP.dtype.element_ty), mask=(r < GROUP * N_Q)[None, :])
    lp = (LP + b.to(gl.int64) * stride_lp_b + split.to(gl.int64) * stride_lp_s
          + (hkv * GROUP + cols % GROUP).to(gl.int64) * stride_lp_h + (cols // GROUP) * stride_lp_n)
    gl.store(lp, (m_i + gl.log2(l_safe)) * 0.6931471805599453, mask=cols < GROUP * N_Q)


@gluon.jit(do_not_specialize=["N_Q", "GROUP", "N_MAX", "NUM_SPLITS", "stride_q_b", "stride_q_h", "stride_q_n", "stride_op_b",
                              "stride_op_s", "stride_op_h", "stride_op_n", "stride_lp_b", "stride_lp_s", "stride_lp_h",
                              "stride_lp_n", "stride_bt_b"])
def sdecode_fwd(Q, OP, LP, SEQLENS, BT, k_desc, v_desc, N_Q, GROUP, N_MAX, NUM_SPLITS, stride_q_b, stride_q_h, stride_q_n,
                stride_op_b, stride_op_s, stride_op_h, stride_op_n, stride_lp_b, stride_lp_s, stride_lp_h, stride_lp_n,
                stride_bt_b, sm_scale, NQ: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                STAGES: gl.constexpr, PAGE: gl.constexpr, PAGED: gl.constexpr):
    """one program per (split, K/V head, sequence): v13's TMA loader warp, one swapped consumer warpgroup"""
    split = gl.program_id(0)
    hkv = gl.program_id(1)
    b = gl.program_id(2)
    n_k = gl.load(SEQLENS + b)
    kps = BLOCK_N * gl.cdiv(gl.cdiv(n_k, NUM_SPLITS), BLOCK_N)  # keys per split: whole blocks
    start = split * kps
    j0 = start // BLOCK_N
    j1 = gl.maximum(j0, gl.cdiv(gl.minimum(n_k, start + kps), BLOCK_N))
    qk_scale = sm_scale * 1.4426950408889634
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.bfloat16)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], layout)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [NQ, HEAD_DIM],
                                       gl.NVMMASharedLayout.get_default_for([NQ, HEAD_DIM], gl.bfloat16))
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [NQ, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([NQ, BLOCK_N], gl.bfloat16))
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    gl.warp_specialize([
        (_sw_consumer, (Q, OP, LP, k_smem, v_smem, q_smem, p_smem, k_ready, k_empty, v_ready, v_empty, b, hkv, split,
                        j0, j1, n_k, N_Q, GROUP, stride_q_b, stride_q_h, stride_q_n, stride_op_b, stride_op_s, stride_op_h,
                        stride_op_n, stride_lp_b, stride_lp_s, stride_lp_h, stride_lp_n, qk_scale, NQ, BLOCK_N, HEAD_DIM,
                        STAGES)),
        (_gd_loader, (Q, OP, LP, BT, k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                      b, hkv, split, j0, j1, n_k, N_Q, GROUP, N_MAX, stride_q_b, stride_q_h, stride_q_n,
                      stride_op_b, stride_op_s, stride_op_h, stride_op_n, stride_lp_b, stride_lp_s, stride_lp_h,
                      stride_lp_n, stride_bt_b, qk_scale, BLOCK_N, HEAD_DIM, STAGES, PAGE, PAGED)),
    ], [1], [LOADER_REGS])


def sdecode(q, k, v, seqlens, block_table=None, *, num_splits, BLOCK_N=64, STAGES=3, **kw):
    """gdecode (its tensors, partials and merge) with the swapped kernel; at most 16 query rows per K/V head."""
    rows = q.shape[1] // k.shape[2 if block_table is not None else 1] * q.shape[2]
    assert rows <= 16, "at most 16 query rows per K/V head"
    return gdecode(q, k, v, seqlens, block_table, num_splits=num_splits, BLOCK_N=BLOCK_N, STAGES=STAGES,
                   kernel=sdecode_fwd, NQ=8 if rows <= 8 else 16, **kw)


def compile_only() -> int:
    """sm_90 compiles of each variant on this machine (no GPU): shared memory, registers, spills."""
    from common import sm90_ptxas

    ptrs = {"Q": "*bf16", "OP": "*fp32", "LP": "*fp32", "SEQLENS": "*i32", "BT": "*i32"}
    for paged, page, block_n, stages, nq in ((False, 64, 64, 3, 8), (False, 64, 64, 6, 8), (False, 128, 128, 3, 8),
                                             (True, 16, 64, 3, 8), (False, 64, 64, 3, 16)):
        box = [page if paged else block_n, 128]
        const = dict(NQ=nq, BLOCK_N=block_n, HEAD_DIM=128, STAGES=stages, PAGE=page, PAGED=paged)
        print(f"paged={paged} page={page} BLOCK_N={block_n} STAGES={stages} NQ={nq}: "
              + sm90_ptxas(sdecode_fwd, box, const, ptrs), flush=True)
    return 0


CASES = ((16, 8192), (16, 1024), (16, 32768), (1, 8192), (1, 32768), (64, 8192))


def main() -> int:
    if "--compile" in sys.argv:
        return compile_only()
    from gluon_decode import bench_cases, variant_call

    out_dir = next((a for a in sys.argv[1:] if not a.startswith("--")), ".")
    os.makedirs(out_dir, exist_ok=True)
    worst = check(((1, 32, 8, 1, 4097, [4097], None), (7, 32, 8, 1, 1000, None, None),
                   (3, 8, 2, 3, 333, [3, 200, 333], None), (2, 32, 8, 1, 300, [0, 17], None),
                   (2, 16, 2, 2, 515, [515, 64], None), (1, 32, 8, 1, 4097, [4097], 16), (7, 32, 8, 1, 1000, None, 16),
                   (3, 8, 2, 3, 333, [2, 200, 333], 64), (5, 32, 8, 1, 2100, None, 16)),
                  ((1, 64, 3), (3, 64, 4), (16, 64, 6), (2, 128, 3)), fn=sdecode, nan_tail=True)
    print(f"float64 check passed (worst {worst:.2e})", flush=True)
    if "--check" in sys.argv:
        return 0
    rows = bench_cases(CASES, lambda batch, ctx, page, shipped, q, lens, table: {
        f"{kind}{block_n}x{stages}/s{splits}": variant_call(gdecode if kind == "pad" else sdecode, q, lens, table,
                                                           splits, block_n, stages)
        for splits in sorted({shipped, 1 if batch >= 16 else shipped})
        for kind, block_n, stages in (("pad", 64, 3), ("swap", 64, 3), ("swap", 64, 4), ("swap", 64, 6),
                                      ("swap", 128, 3))})
    with open(os.path.join(out_dir, "gluon_decode_swap.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\nGB/s [graph] / [layers] (cuDNN in the same process); x = err > 0.02 against the shipped call")
    for row in rows:
        cud = row["cudnn"], row["cudnn [layers]"]
        cud = f"{cud[0]:.0f}/{cud[1]:.0f}" if all(isinstance(c, float) for c in cud) else str(cud)
        print(f"B={row['batch']:>2} ctx={row['context']:>5}  cudnn {cud}")
        for tag in ("", "paged16 "):
            cells = []
            for name in [k[len(tag):] for k in row if k.startswith(tag) and not k.endswith(("err", "[layers]", "splits"))
                         and (tag or not k.startswith("paged16")) and k not in ("batch", "context", "layers")
                         and not k.startswith("cudnn")]:
                val = row[tag + name]
                if isinstance(val, float):
                    bad = "x" if row.get(f"{tag}{name} err", 0) > 0.02 else ""
                    cells.append(f"{name} {val:.0f}/{row[tag + name + ' [layers]']:.0f}{bad}")
                else:
                    cells.append(f"{name} {val[:40]}")
            print(f"   {tag or 'contig '} (shipped s{row[tag + 'shipped splits']}): " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
