"""Experiment: decoding as a warp-specialised Gluon kernel (a TMA loader warp, one consumer warpgroup).

    python benchmarks/experiments/gluon_decode.py OUT_DIR     (GPU: float64 checks, then timings)
    python benchmarks/experiments/gluon_decode.py --compile   (no GPU: sm_90 compiles, ptxas -v)

The shipped decode kernels (generated/decode_d128.py, decode_paged16_d128.py) are Triton programs
whose K/V loads go through Triton's software pipeline: every thread computes addresses and issues
16-byte cp.async copies, and a paged program first loads its block table row by row (ncu, NOTES v8:
+63% instructions and 226 registers against 128 at batch 1; issue slots 14% busy, stalls on fixed
latency). Where they trail (NOTES v12): batch 16 at 0.94-0.97x cuDNN, paged 16-token pages at batch
1 at 0.86-0.94x of contiguous.

Here one program = one (sequence, K/V head, split), as shipped, but:
  - a loader warp streams K and V blocks by TMA into a ring of STAGES shared buffers, each signalled
    on an mbarrier; a paged program's loader reads the block table 32 entries at a time, a chunk
    ahead, and copies each page with its own TMA message (a [PAGE, D] box of the pool seen as
    (pages x page_size, kv_heads x D)), so the table's latency never sits between two copies;
  - the consumer warpgroup computes on wgmma: the query rows of the K/V head's group (GROUP x N_Q,
    here 4) padded to wgmma's 64, Q in registers, K and V from the ring; online softmax in exp2.
The partials and their merge are the shipped module's (o_part, lse_part, attn_combine).
Prediction: deeper prefetch at no register cost (6 stages of 64 keys = 192 KB in flight per SM) and
no address arithmetic in the consumer: batch 16 and 64 +3-6% (to ~1.0-1.05x cuDNN); paged batch 1
up to contiguous (the table no longer serialises the start); batch 1 contiguous +0-3% (the ramp,
one TMA round trip, stays).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

TABLE_CHUNK = gl.constexpr(32)  # block-table entries the paged loader reads at once: one per lane
LOADER_REGS = gl.constexpr(40)


@gluon.jit
def _gd_consumer(Q, OP, LP, BT, k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                 b, hkv, split, j0, j1, n_k, N_Q, GROUP, N_MAX, stride_q_b, stride_q_h, stride_q_n,
                 stride_op_b, stride_op_s, stride_op_h, stride_op_n, stride_lp_b, stride_lp_s, stride_lp_h,
                 stride_lp_n, stride_bt_b, qk_scale,
                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PAGE: gl.constexpr,
                 PAGED: gl.constexpr):
    """The group's rows (row r: query head hkv * GROUP + r % GROUP, query r // GROUP) over key blocks
    [j0, j1): scores, online softmax, output; the partial output and log-sum-exp stored."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    valid = rows < GROUP * N_Q
    q_ptr = (Q + b.to(gl.int64) * stride_q_b + (hkv * GROUP + rows % GROUP).to(gl.int64)[:, None] * stride_q_h
             + (rows // GROUP)[:, None] * stride_q_n + cols[None, :])
    q = gl.convert_layout(gl.load(q_ptr, mask=valid[:, None], other=0.0), q_layout)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)
    zero_s = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
    s_rows = gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    # query row n sees keys below limit = n_k - N_Q + 1 + n (the causal mask aligned bottom-right)
    limit = n_k - N_Q + 1 + s_rows // GROUP
    m_i = gl.full([64], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, s_layout))
    first_limit = n_k - N_Q + 1  # row 0's
    for j in range(j0, j1):
        i = j - j0
        s = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(k_ready.index(s), phase)
        sc = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        sc = warpgroup_mma_wait(0, deps=(sc, ))
        mbarrier.arrive(k_empty.index(s), count=1)
        if (j + 1) * BLOCK_N > first_limit:  # some row must not see all of this block
            keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            keep = (keys[None, :] < limit[:, None]) & (keys < n_k)[None, :]
            sc = gl.where(keep, sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, 1) * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(sc * qk_scale - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        mbarrier.wait(v_ready.index(s), phase)
        acc = warpgroup_mma(p16, v_smem.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(s), count=1)
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    out = gl.convert_layout(acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None], ld)
    o_ptr = (OP + b.to(gl.int64) * stride_op_b + split.to(gl.int64) * stride_op_s
             + (hkv * GROUP + rows % GROUP).to(gl.int64)[:, None] * stride_op_h + (rows // GROUP)[:, None] * stride_op_n
             + cols[None, :])
    gl.store(o_ptr, out.to(OP.dtype.element_ty), mask=valid[:, None])
    lse = (m_i + gl.log2(l_safe)) * 0.6931471805599453
    lp = (LP + b.to(gl.int64) * stride_lp_b + split.to(gl.int64) * stride_lp_s + (hkv * GROUP + s_rows % GROUP) * stride_lp_h
          + (s_rows // GROUP) * stride_lp_n)
    gl.store(lp, lse, mask=s_rows < GROUP * N_Q)


@gluon.jit
def _gd_loader(Q, OP, LP, BT, k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
               b, hkv, split, j0, j1, n_k, N_Q, GROUP, N_MAX, stride_q_b, stride_q_h, stride_q_n,
               stride_op_b, stride_op_s, stride_op_h, stride_op_n, stride_lp_b, stride_lp_s, stride_lp_h,
               stride_lp_n, stride_bt_b, qk_scale,
               BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PAGE: gl.constexpr,
               PAGED: gl.constexpr):
    """K and V blocks [j0, j1) of (sequence b, K/V head hkv) into the ring, by TMA."""
    nbytes: gl.constexpr = BLOCK_N * HEAD_DIM * 2
    if PAGED:
        PPB: gl.constexpr = BLOCK_N // PAGE  # pages per block
        BPC: gl.constexpr = TABLE_CHUNK // PPB  # blocks per table chunk
        t_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        idx = gl.arange(0, TABLE_CHUNK, layout=t_layout)
        n_pages = (n_k + PAGE - 1) // PAGE
        bt = BT + b.to(gl.int64) * stride_bt_b
        p0 = j0 * PPB
        cur = gl.load(bt + p0 + idx, mask=p0 + idx < n_pages, other=0)
        nxt = gl.load(bt + p0 + TABLE_CHUNK + idx, mask=p0 + TABLE_CHUNK + idx < n_pages, other=0)
        for j in range(j0, j1):
            i = j - j0
            s = i % STAGES
            phase = (i // STAGES) & 1
            if i % BPC == 0:
                if i > 0:
                    cur = nxt
                    pn = p0 + (i // BPC + 1) * TABLE_CHUNK
                    nxt = gl.load(bt + pn + idx, mask=pn + idx < n_pages, other=0)
            mbarrier.wait(k_empty.index(s), phase ^ 1)  # a fresh barrier counts as freed
            mbarrier.expect(k_ready.index(s), nbytes)
            for p in gl.static_range(PPB):
                page = gl.sum(gl.where(idx == (i % BPC) * PPB + p, cur, 0), 0)
                tma.async_copy_global_to_shared(k_desc, [page * PAGE, hkv * HEAD_DIM], k_ready.index(s),
                                                k_smem.index(s).slice(p * PAGE, PAGE))
            mbarrier.wait(v_empty.index(s), phase ^ 1)
            mbarrier.expect(v_ready.index(s), nbytes)
            for p in gl.static_range(PPB):
                page = gl.sum(gl.where(idx == (i % BPC) * PPB + p, cur, 0), 0)
                tma.async_copy_global_to_shared(v_desc, [page * PAGE, hkv * HEAD_DIM], v_ready.index(s),
                                                v_smem.index(s).slice(p * PAGE, PAGE))
    else:
        row0 = b * N_MAX  # the sequence's first row in the (B x N_MAX, H_KV x D) view
        for j in range(j0, j1):
            i = j - j0
            s = i % STAGES
            phase = (i // STAGES) & 1
            mbarrier.wait(k_empty.index(s), phase ^ 1)
            mbarrier.expect(k_ready.index(s), nbytes)
            tma.async_copy_global_to_shared(k_desc, [row0 + j * BLOCK_N, hkv * HEAD_DIM], k_ready.index(s),
                                            k_smem.index(s))
            mbarrier.wait(v_empty.index(s), phase ^ 1)
            mbarrier.expect(v_ready.index(s), nbytes)
            tma.async_copy_global_to_shared(v_desc, [row0 + j * BLOCK_N, hkv * HEAD_DIM], v_ready.index(s),
                                            v_smem.index(s))


@gluon.jit(do_not_specialize=["N_Q", "GROUP", "N_MAX", "NUM_SPLITS", "stride_q_b", "stride_q_h", "stride_q_n", "stride_op_b",
                              "stride_op_s", "stride_op_h", "stride_op_n", "stride_lp_b", "stride_lp_s", "stride_lp_h",
                              "stride_lp_n", "stride_bt_b"])
def gdecode_fwd(Q, OP, LP, SEQLENS, BT, k_desc, v_desc, N_Q, GROUP, N_MAX, NUM_SPLITS, stride_q_b, stride_q_h, stride_q_n,
                stride_op_b, stride_op_s, stride_op_h, stride_op_n, stride_lp_b, stride_lp_s, stride_lp_h, stride_lp_n,
                stride_bt_b, sm_scale, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                PAGE: gl.constexpr, PAGED: gl.constexpr):
    """one program per (split, K/V head, sequence): a TMA loader warp, one consumer warpgroup"""
    split = gl.program_id(0)
    hkv = gl.program_id(1)
    b = gl.program_id(2)
    n_k = gl.load(SEQLENS + b)
    kps = BLOCK_N * gl.cdiv(gl.cdiv(n_k, NUM_SPLITS), BLOCK_N)  # keys per split: whole blocks
    start = split * kps
    stop = gl.minimum(n_k, start + kps)
    j0 = start // BLOCK_N
    j1 = gl.maximum(j0, gl.cdiv(stop, BLOCK_N))
    qk_scale = sm_scale * 1.4426950408889634
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
    gl.warp_specialize([
        (_gd_consumer, (Q, OP, LP, BT, k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                        b, hkv, split, j0, j1, n_k, N_Q, GROUP, N_MAX, stride_q_b, stride_q_h, stride_q_n,
                        stride_op_b, stride_op_s, stride_op_h, stride_op_n, stride_lp_b, stride_lp_s, stride_lp_h,
                        stride_lp_n, stride_bt_b, qk_scale, BLOCK_N, HEAD_DIM, STAGES, PAGE, PAGED)),
        (_gd_loader, (Q, OP, LP, BT, k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                      b, hkv, split, j0, j1, n_k, N_Q, GROUP, N_MAX, stride_q_b, stride_q_h, stride_q_n,
                      stride_op_b, stride_op_s, stride_op_h, stride_op_n, stride_lp_b, stride_lp_s, stride_lp_h,
                      stride_lp_n, stride_bt_b, qk_scale, BLOCK_N, HEAD_DIM, STAGES, PAGE, PAGED)),
    ], [1], [LOADER_REGS])


def _module():
    """The shipped contiguous decode module: its combine kernel merges our partials."""
    import attngen
    from attngen.decode import kvcache_spec

    return attngen.load(kvcache_spec("bf16", 128, True, None)).module


def gdecode(q, k, v, seqlens, block_table=None, *, num_splits, BLOCK_N=64, STAGES=6, out=None, lse=None,
            sm_scale=None, kernel=None, **constexprs):
    """q (B, H, N_Q, D); contiguous k/v (B, H_KV, N_MAX, D) views of (B, N_MAX, H_KV, D) storage, or page
    pools (NUM_PAGES, PAGE, H_KV, D) with block_table (B, MAX_PAGES). Returns (out, lse). `kernel`: another
    kernel of gdecode_fwd's signature (default gdecode_fwd), launched with `constexprs` besides its own."""
    B, H, N_Q, D = q.shape
    paged = block_table is not None
    if paged:
        pages, page, H_KV, _ = k.shape
        flat = [t.reshape(pages * page, H_KV * D) for t in (k, v)]
        box = [page, D]
    else:
        H_KV, n_max = k.shape[1], k.shape[2]
        page = BLOCK_N
        flat = [t.transpose(1, 2).reshape(B * n_max, H_KV * D) for t in (k, v)]
        box = [BLOCK_N, D]
    for t, src in zip(flat, (k, v)):
        assert t.data_ptr() == src.data_ptr(), "the K/V storage must be (rows, kv heads, D) contiguous"
    layout = gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)
    k_desc, v_desc = (GluonTensorDescriptor(t, list(t.shape), list(t.stride()), box, layout) for t in flat)
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32) if lse is None else lse
    if num_splits == 1:
        o_part, lse_part = out.unsqueeze(1), lse.unsqueeze(1)
    else:
        o_part = torch.empty((B, num_splits, H, N_Q, D), device=q.device, dtype=torch.float32)
        lse_part = torch.empty((B, num_splits, H, N_Q), device=q.device, dtype=torch.float32)
    bt = block_table if paged else seqlens
    assert q.stride(3) == 1
    (gdecode_fwd if kernel is None else kernel)[(num_splits, H_KV, B)](
        q, o_part, lse_part, seqlens, bt, k_desc, v_desc, N_Q, H // H_KV, 0 if paged else n_max, num_splits,
        q.stride(0), q.stride(1), q.stride(2), *o_part.stride()[:4], *lse_part.stride(), bt.stride(0), sm_scale,
        BLOCK_N=BLOCK_N, HEAD_DIM=D, STAGES=STAGES, PAGE=page, PAGED=paged, num_warps=4, **constexprs)
    if num_splits > 1:
        _module().launch_attn_combine(o_part, lse_part, out, lse, BLOCK_S=32, num_warps=4, num_stages=1)
    return out, lse


def reference(q, k, v, seqlens):
    """float64 attention over each sequence's first seqlens[b] keys, the causal mask bottom-right;
    k, v (B, H_KV, N, D). Returns (out, lse) on the CPU."""
    B, H, N_Q, D = q.shape
    group = H // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((B, H, N_Q), float("-inf"), dtype=torch.float64)
    for b in range(B):
        n = int(seqlens[b])
        kk = k[b, :, :n].double().cpu().repeat_interleave(group, 0)
        vv = v[b, :, :n].double().cpu().repeat_interleave(group, 0)
        s = q[b].double().cpu() @ kk.transpose(-1, -2) * D ** -0.5
        keep = torch.arange(n)[None, :] <= torch.arange(N_Q)[:, None] + n - N_Q
        s = s.masked_fill(~keep, float("-inf"))
        lse[b] = torch.logsumexp(s, -1)
        seen = lse[b].isfinite()
        out[b] = torch.where(seen[..., None], torch.softmax(s, -1).nan_to_num(0.0) @ vv, 0.0)
    return out, lse


def pages_of(x, page, gen):
    """x (B, H_KV, N, D) copied into a pool of `page`-token pages in shuffled order; (pool, table)."""
    B, H_KV, N, D = x.shape
    n_pages = -(-N // page)
    pad = x.new_zeros(B, n_pages * page, H_KV, D)
    pad[:, :N] = x.transpose(1, 2)
    perm = torch.randperm(B * n_pages, device=x.device, generator=gen)
    pool = torch.empty_like(pad.view(B * n_pages, page, H_KV, D))
    pool[perm] = pad.view(B * n_pages, page, H_KV, D)
    return pool, perm.view(B, n_pages).int()


def check(cases, configs, strict=True, fn=None, nan_tail=False) -> float:
    """Largest output error against float64 over `cases` ((B, H, H_KV, N_Q, N, lengths or None, page or
    None)) and `configs` ((num_splits, BLOCK_N, STAGES)) of `fn` (gdecode's signature; default gdecode);
    outputs poisoned first, and with `nan_tail` every K/V row past a sequence's length NaN (what a real
    cache holds there is unknown). Not `strict`: print every failure instead of raising at the first."""
    fn = gdecode if fn is None else fn
    gen = torch.Generator("cuda").manual_seed(3)
    worst = 0.0
    for B, H, H_KV, N_Q, N, lengths, page in cases:
        q = torch.randn(B, H, N_Q, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(B, N, H_KV, 128, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
                for _ in range(2))
        if lengths is None:
            lengths = torch.randint(0, N + 1, (B,), generator=torch.Generator().manual_seed(B + N)).tolist()
        seqlens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
        want, want_lse = reference(q, k, v, seqlens)
        for b, n in enumerate(lengths if nan_tail else ()):
            k[b, :, n:] = float("nan")
            v[b, :, n:] = float("nan")
        kc, vc, table = k, v, None
        if page:
            kc, table = pages_of(k, page, torch.Generator("cuda").manual_seed(N))
            vc, _ = pages_of(v, page, torch.Generator("cuda").manual_seed(N))
        for num_splits, block_n, stages in configs:
            out = torch.full_like(q, float("nan"))
            lse = torch.full(q.shape[:3], float("nan"), device="cuda")
            fn(q, kc, vc, seqlens, table, num_splits=num_splits, BLOCK_N=block_n, STAGES=stages, out=out, lse=lse)
            torch.cuda.synchronize()
            err = (out.double().cpu() - want).abs().max().item()
            finite = want_lse.isfinite()
            lse_err = (lse.double().cpu()[finite] - want_lse[finite]).abs().max().item() if finite.any() else 0.0
            lse_ok = bool((lse.cpu()[~finite] == float("-inf")).all())
            if not (err < 2e-2 and lse_err < 1e-3 and lse_ok):
                if not strict:
                    print(f"FAIL B={B} N_Q={N_Q} N={N} page={page} splits={num_splits} BLOCK_N={block_n} STAGES={stages}: "
                          f"out err {err:.3g}, lse err {lse_err:.3g}, empty rows -inf {lse_ok}", flush=True)
                    continue
                raise AssertionError(f"B={B} N_Q={N_Q} N={N} lengths={lengths} page={page} splits={num_splits} "
                                     f"BLOCK_N={block_n}: out err {err:.3g}, lse err {lse_err:.3g}, empty rows -inf {lse_ok}")
            worst = max(worst, err)
    return worst


def compile_only() -> int:
    """sm_90 compiles of each variant on this machine (no GPU): shared memory, registers, spills."""
    from common import sm90_ptxas

    ptrs = {"Q": "*bf16", "OP": "*fp32", "LP": "*fp32", "SEQLENS": "*i32", "BT": "*i32"}
    for paged, page, block_n, stages in ((False, 64, 64, 6), (False, 128, 128, 3), (True, 16, 64, 6),
                                         (True, 64, 64, 6), (True, 16, 128, 3)):
        box = [page if paged else block_n, 128]
        const = dict(BLOCK_N=block_n, HEAD_DIM=128, STAGES=stages, PAGE=page, PAGED=paged)
        print(f"paged={paged} page={page} BLOCK_N={block_n} STAGES={stages}: "
              + sm90_ptxas(gdecode_fwd, box, const, ptrs))
    return 0


CASES = ((1, 8192), (1, 32768), (16, 1024), (16, 8192), (16, 32768), (64, 8192), (64, 32768))


def shipped_splits(batch: int, ctx: int, page) -> int:
    """The split count attention_with_kvcache takes for this shape (tuned table, else the heuristic)."""
    import attngen
    from attngen.bench_decode import H, H_KV
    from attngen.decode import _auto_splits, kvcache_spec
    from attngen.tuning.key import Shape

    kernel = attngen.load(kvcache_spec("bf16", 128, True, page))
    config = kernel.tuner("kvcache").config(Shape(batch, H, H_KV, 1, ctx), 0)
    return config.pop("num_splits", 0) or _auto_splits(kernel.module, config, batch, H, H_KV, 1, ctx,
                                                       torch.device("cuda"))


def variant_call(fn, q, lens, table, splits: int, block_n: int, stages: int):
    """fn (gdecode's signature) as a call on one layer's (k, v), which are page pools when `table` is
    given, else flash-attn's (B, N, H_KV, D) caches; q (B, 1, H, D). Returns the output as (B, H, 1, D)."""
    def call(kl, vl):
        if table is not None:
            return fn(q.transpose(1, 2), kl, vl, lens, table, num_splits=splits, BLOCK_N=block_n, STAGES=stages)[0]
        return fn(q.transpose(1, 2), kl.transpose(1, 2), vl.transpose(1, 2), lens, num_splits=splits,
                  BLOCK_N=block_n, STAGES=stages)[0]
    return call


def bench_cases(cases, variants, int_lengths: bool = True) -> list:
    """For each (batch, ctx) of `cases` (every sequence full): contiguous and 16-token paged caches of enough
    layers for the [layers] timing, the shipped `attention_with_kvcache` (given the length as an int if
    `int_lengths`, as the decode bench does, else as a tensor) and `variants(batch, ctx, page, shipped splits,
    q, lens, table)`'s {name: call(k, v)} (outputs (B, H, 1, D)), each checked against the shipped call's
    output (`name err`) and timed as [graph] and [layers] GB/s, cuDNN beside them. Returns one row per case."""
    import attngen
    from attngen.bench_decode import D, DTYPE, H, H_KV, bench_graph, bench_layers, gbps, layer_count, paged_copy, sdpa

    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    for batch, ctx in cases:
        layers = max(2, layer_count(batch, ctx))
        caches = [(torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen),
                   torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen)) for _ in range(layers)]
        q = torch.randn(batch, 1, H, D, device="cuda", dtype=DTYPE, generator=gen)
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        row = {"batch": batch, "context": ctx, "layers": layers}
        for page in (None, 16):
            tag = "paged16 " if page else ""
            if page:
                perm = torch.randperm(batch * ctx // page, device="cuda", generator=gen)
                layer_kv = [(paged_copy(k, page, perm), paged_copy(v, page, perm)) for k, v in caches]
                table = perm.view(batch, -1).int()
            else:
                layer_kv, table = caches, None
            shipped = shipped_splits(batch, ctx, page)
            row[f"{tag}shipped splits"] = shipped
            calls = {"shipped": lambda kl, vl: attngen.attention_with_kvcache(
                q, kl, vl, cache_seqlens=ctx if int_lengths else lens, block_table=table)}
            calls.update(variants(batch, ctx, page, shipped, q, lens, table))
            k0, v0 = layer_kv[0]
            want = calls["shipped"](k0, v0).float()
            for name, call in calls.items():
                try:
                    got = call(k0, v0)
                    got = got if name == "shipped" else got.transpose(1, 2)
                    row[f"{tag}{name} err"] = (got.float() - want).abs().max().item()
                    row[f"{tag}{name}"] = gbps(batch, ctx, bench_graph(lambda: call(k0, v0)))
                    row[f"{tag}{name} [layers]"] = gbps(batch, ctx, bench_layers(
                        [lambda kl=kl, vl=vl: call(kl, vl) for kl, vl in layer_kv]))
                except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                    row[f"{tag}{name}"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:120]}"
        ms, how = sdpa("CUDNN_ATTENTION", q, *caches[0])
        row["cudnn"] = gbps(batch, ctx, ms) if ms else how
        ms, how = sdpa("CUDNN_ATTENTION", q, None, None, caches)
        row["cudnn [layers]"] = gbps(batch, ctx, ms) if ms else how
        rows.append(row)
        print(json.dumps(row), flush=True)
        del caches, layer_kv
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    if "--compile" in sys.argv:
        return compile_only()
    out_dir = next((a for a in sys.argv[1:] if not a.startswith("--")), ".")
    os.makedirs(out_dir, exist_ok=True)
    configs = ((1, 64, 6), (3, 64, 4), (16, 64, 6), (2, 64, 3))
    if "--diagnose" in sys.argv:
        configs = ((1, 64, 6), (1, 128, 3), (16, 64, 6), (16, 128, 3), (3, 128, 3), (2, 64, 2), (1, 64, 3))
    worst = check(((1, 32, 8, 1, 4097, [4097], None), (7, 32, 8, 1, 1000, None, None),
                   (3, 8, 2, 3, 333, [3, 200, 333], None), (2, 32, 8, 1, 300, [0, 17], None),
                   (1, 32, 8, 1, 4097, [4097], 16), (7, 32, 8, 1, 1000, None, 16), (3, 8, 2, 3, 333, [2, 200, 333], 64),
                   (5, 32, 8, 1, 2100, None, 16)), configs, strict="--diagnose" not in sys.argv)
    print(f"float64 check done (worst passing {worst:.2e})", flush=True)
    if "--diagnose" in sys.argv:
        return 0
    rows = bench_cases(CASES, lambda batch, ctx, page, shipped, q, lens, table: {
        f"g{block_n}x{stages}/s{splits}": variant_call(gdecode, q, lens, table, splits, block_n, stages)
        for splits in sorted({shipped, 1 if batch >= 16 else 2 * shipped, max(1, shipped // 2)})
        for block_n, stages in ((64, 6), (64, 3))}, int_lengths=False)
    with open(os.path.join(out_dir, "gluon_decode.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\nGB/s [graph] / [layers]; best Gluon variant per layout")
    for row in rows:
        for tag in ("", "paged16 "):
            gl_names = [k[len(tag):] for k in row if k.startswith(tag + "g") and not k.endswith(("err", "[layers]"))
                        and isinstance(row[k], float)]
            best = max(gl_names, key=lambda n: row[f"{tag}{n} [layers]"], default=None)
            cells = f"shipped {row[tag + 'shipped']:.0f}/{row[tag + 'shipped [layers]']:.0f} (s{row[tag + 'shipped splits']})"
            if best:
                cells += f"  best {best} {row[tag + best]:.0f}/{row[tag + best + ' [layers]']:.0f}"
            cud = row["cudnn"], row["cudnn [layers]"]
            cud = f"{cud[0]:.0f}/{cud[1]:.0f}" if all(isinstance(c, float) for c in cud) else str(cud)
            print(f"B={row['batch']:>2} ctx={row['context']:>5} {tag or 'contig  '} {cells}  cudnn {cud}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
