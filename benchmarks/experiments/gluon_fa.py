"""A Gluon (Triton 3.6) forward kernel for Hopper, for experiments/gluon_forward.py.

Non-causal, N_Q a multiple of BLOCK_M and N_K of BLOCK_N, contiguous (B, H, N, D) tensors viewed as 2-D
(B*H*N, D) for TMA. One CTA = 128 query rows: a loader warp (TMA: Q once, then K and V blocks into a
ring of STAGES buffers, each signalled on its own mbarrier) and two consumer warpgroups of 64 rows
each (online softmax in exp2 with the scale folded in, both products on wgmma, P from registers).
A consumer frees a K or V buffer by arriving on its `empty` barrier (count 2: both consumers); the
consumers synchronise only within their own warpgroup. The output goes out through Q's shared buffer
and a TMA store."""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (tma, mbarrier, fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_wait)


@gluon.jit
def _consume(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
             q_row, kv_row, lse_off, n_blocks, qk_scale, BM: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
             STAGES: gl.constexpr, OVERLAP: gl.constexpr, WG: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q = q_smem.index(WG)
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BM, HEAD_DIM], gl.float32, layout=o_layout)
    zero_s = gl.zeros([BM, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    if OVERLAP:
        # softmax of block j runs while the tensor cores do P_{j-1} V_{j-1} (FA3's intra-warpgroup overlap)
        mbarrier.wait(k_ready.index(0), 0)
        sc = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        sc = warpgroup_mma_wait(0, deps=(sc, ))
        mbarrier.arrive(k_empty.index(0), count=1)
        m_i = gl.max(sc, 1) * qk_scale
        p = gl.exp2(sc * qk_scale - m_i[:, None])
        l_i = gl.sum(p, 1)
        alpha = gl.full([BM], 1.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
        for j in range(1, n_blocks):
            s = j % STAGES
            ph = (j // STAGES) & 1
            sp = (j - 1) % STAGES
            php = ((j - 1) // STAGES) & 1
            mbarrier.wait(k_ready.index(s), ph)
            sc = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            pb = gl.convert_layout(p.to(gl.bfloat16), p_layout)
            mbarrier.wait(v_ready.index(sp), php)
            acc = warpgroup_mma(pb, v_smem.index(sp), acc, is_async=True)
            sc = warpgroup_mma_wait(1, deps=(sc, ))
            mbarrier.arrive(k_empty.index(s), count=1)
            m_new = gl.maximum(m_i, gl.max(sc, 1) * qk_scale)
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(sc * qk_scale - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(v_empty.index(sp), count=1)
        sl = (n_blocks - 1) % STAGES
        phl = ((n_blocks - 1) // STAGES) & 1
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        pb = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        mbarrier.wait(v_ready.index(sl), phl)
        acc = warpgroup_mma(pb, v_smem.index(sl), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(sl), count=1)
    else:
        for j in range(n_blocks):
            s = j % STAGES
            ph = (j // STAGES) & 1
            mbarrier.wait(k_ready.index(s), ph)
            sc = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            sc = warpgroup_mma_wait(0, deps=(sc, ))
            mbarrier.arrive(k_empty.index(s), count=1)
            m_new = gl.maximum(m_i, gl.max(sc, 1) * qk_scale)
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(sc * qk_scale - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            pb = gl.convert_layout(p.to(gl.bfloat16), p_layout)
            mbarrier.wait(v_ready.index(s), ph)
            acc = warpgroup_mma(pb, v_smem.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(v_empty.index(s), count=1)
            m_i = m_new
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    q.store((acc / l_o[:, None]).to(gl.bfloat16))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row + WG * BM, 0], q)
    offs = gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
    gl.store(LSE + lse_off + WG * BM + offs, (m_i + gl.log2(l_i)) * 0.6931471805599453)
    tma.store_wait(0)


@gluon.jit
def _consumer0(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
             q_row, kv_row, lse_off, n_blocks, qk_scale, BM: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
             STAGES: gl.constexpr, OVERLAP: gl.constexpr):
    _consume(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_row, kv_row, lse_off, n_blocks, qk_scale, BM, BLOCK_N, HEAD_DIM, STAGES, OVERLAP, 0)


@gluon.jit
def _consumer1(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
             q_row, kv_row, lse_off, n_blocks, qk_scale, BM: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
             STAGES: gl.constexpr, OVERLAP: gl.constexpr):
    _consume(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_row, kv_row, lse_off, n_blocks, qk_scale, BM, BLOCK_N, HEAD_DIM, STAGES, OVERLAP, 1)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
             q_row, kv_row, lse_off, n_blocks, qk_scale, BM: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
             STAGES: gl.constexpr, OVERLAP: gl.constexpr):
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + BM, 0], q_bar, q_smem.index(1))
    for j in range(n_blocks):
        s = j % STAGES
        ph = (j // STAGES) & 1
        mbarrier.wait(k_empty.index(s), ph ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), ph ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def gfa_fwd(q_desc, k_desc, v_desc, o_desc, LSE, N_Q, N_K, H, GROUP, qk_scale,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr):
    BM: gl.constexpr = BLOCK_M // 2
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    h = bh % H
    b = bh // H
    q_row = bh * N_Q + pid_m * BLOCK_M
    kv_row = (b * (H // GROUP) + h // GROUP) * N_K
    lse_off = bh.to(gl.int64) * N_Q + pid_m * BLOCK_M
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, BM, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    n_blocks = N_K // BLOCK_N
    gl.warp_specialize([(_consumer0, (q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_row, kv_row, lse_off, n_blocks, qk_scale, BM, BLOCK_N, HEAD_DIM, STAGES, OVERLAP)), (_consumer1, (q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_row, kv_row, lse_off, n_blocks, qk_scale, BM, BLOCK_N, HEAD_DIM, STAGES, OVERLAP)), (_loader, (q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_row, kv_row, lse_off, n_blocks, qk_scale, BM, BLOCK_N, HEAD_DIM, STAGES, OVERLAP))], [4, 1], [240, 24])


def forward(q, k, v, out, lse, sm_scale, BLOCK_M=128, BLOCK_N=128, STAGES=2, OVERLAP=False, maxnreg=168):
    B, H, N_Q, D = q.shape
    H_KV, N_K = k.shape[1], k.shape[2]
    assert N_Q % BLOCK_M == 0 and N_K % BLOCK_N == 0 and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    BM = BLOCK_M // 2
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    ql = gl.NVMMASharedLayout.get_default_for([BM, D], gdt)
    kl = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gdt)
    q2, k2, v2, o2 = (t.view(-1, D) for t in (q, k, v, out))
    qd = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [BM, D], ql)
    od = TensorDescriptor(o2, list(o2.shape), list(o2.stride()), [BM, D], ql)
    kd = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [BLOCK_N, D], kl)
    vd = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [BLOCK_N, D], kl)
    grid = (N_Q // BLOCK_M, B * H)
    gfa_fwd[grid](qd, kd, vd, od, lse, N_Q, N_K, H, H // H_KV, sm_scale * 1.4426950408889634,
                  BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=D, STAGES=STAGES, OVERLAP=OVERLAP, num_warps=4, maxnreg=maxnreg)
