"""Experiment: the paged Gluon decode loader's first block-table chunk loaded beside the sequence length.

    python benchmarks/experiments/paged_first_chunk.py OUT_DIR   (GPU, sm_90)

NOTES v15 left paged 16 at 0.93x of contiguous at batch 1, 1k keys (332 against 358 GB/s): a program
there streams one or two 64-key blocks, and its first TMA copy waited on two dependent loads: the
sequence length (its split's first block depends on it), then the block-table chunk that holds that
block's pages. The contiguous kernel waits on one. The change tried here (PATCH: replacements in the
generated module of specs/decode_paged16_d128.attn as of NOTES v16; it was not adopted): (1) each
partition loads the length itself instead of the prelude, so the consumer's Q load and the loader's
table load are in flight beside it, and (2) the loader loads the first chunk at the entry the split
would have if the sequence filled its table row, keeping it when the length gives the same entry (a
full cache; split 0 always), loading again otherwise.

Variants:
  shipped       the generated module as it is
  first chunk   PATCH applied
  reload        PATCH applied, the guess never kept (`if e0 == f0` made false): the chunk loaded after
                the length, as shipped, with (1) in place
Each runs at the tuned table's config for each shape (CUDA-graph replays, the tuner's timing), on full
caches (the bench's) and on lengths spread from the capacity to half of it (the tuner's: the guess
misses for every split but the first of a sequence shorter than its row), in alternating order, twice.
The shipped contiguous kernel is timed in the same process for the ratio. Outputs of both variants are
poisoned, then compared with each other and with the contiguous call on the same tokens.
Prediction: batch 1 1k +3-5% (one L2 round trip of ~0.5-0.8 us of ~12 us), batch 1 8k +1-2%, batch 16
and up within 1%; spread lengths unchanged except split 0's programs.
"""

from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PATCH = [('@gluon.jit\n'
  'def _wsd_consumer(Q, OP, LP, BT, k_desc, v_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, '
  'hkv, split, j0,\n'
  '                  j1, n_k, N_Q, GROUP, stride_q_b, stride_q_h, stride_q_n, stride_op_b, stride_op_s, '
  'stride_op_h,\n'
  '                  stride_op_n, stride_lp_b, stride_lp_s, stride_lp_h, stride_lp_n, stride_bt_b, stride_bt_p, '
  'qk_scale,\n'
  '                  ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,\n'
  '                  PAGE: gl.constexpr, CAUSAL: gl.constexpr):\n'
  '    """The group\'s rows (row r: query head hkv * GROUP + r % GROUP, query r // GROUP) over key blocks\n'
  '    [j0, j1): scores, online softmax, output; the partial output and log-sum-exp stored."""\n'
  '    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, '
  'BLOCK_N, 16])\n',
  '@gluon.jit\n'
  'def _wsd_blocks(n_k, split, NUM_SPLITS, BLOCK_N: gl.constexpr):\n'
  '    """The key blocks [j0, j1) of a split of n_k keys: whole blocks, as attn_fwd\'s."""\n'
  '    keys_per_split = BLOCK_N * gl.cdiv(gl.cdiv(n_k, NUM_SPLITS), BLOCK_N)\n'
  '    start = split * keys_per_split\n'
  '    j0 = start // BLOCK_N\n'
  '    return j0, gl.maximum(j0, gl.cdiv(gl.minimum(n_k, start + keys_per_split), BLOCK_N))\n'
  '\n'
  '\n'
  '@gluon.jit\n'
  'def _wsd_consumer(Q, OP, LP, SEQLENS, BT, k_desc, v_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, '
  'v_empty, b,\n'
  '                  hkv, split, N_Q, GROUP, NUM_SPLITS, MAX_PAGES, stride_q_b, stride_q_h, stride_q_n, '
  'stride_op_b,\n'
  '                  stride_op_s, stride_op_h, stride_op_n, stride_lp_b, stride_lp_s, stride_lp_h, stride_lp_n,\n'
  '                  stride_seqlens_b, stride_bt_b, stride_bt_p, qk_scale, ROWS: gl.constexpr, BLOCK_N: '
  'gl.constexpr,\n'
  '                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PAGE: gl.constexpr, CAUSAL: gl.constexpr):\n'
  '    """The group\'s rows (row r: query head hkv * GROUP + r % GROUP, query r // GROUP) over the split\'s key\n'
  '    blocks: scores, online softmax, output; the partial output and log-sum-exp stored."""\n'
  '    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, '
  'BLOCK_N, 16])\n'),
 ('    valid = rows < GROUP * N_Q\n'
  '    q_ptr = (Q + b.to(gl.int64) * stride_q_b + (hkv * GROUP + rows % GROUP).to(gl.int64)[:, None] * stride_q_h\n',
  '    valid = rows < GROUP * N_Q\n'
  "    n_k = gl.load(SEQLENS + b.to(gl.int64) * stride_seqlens_b)  # in flight beside Q's load\n"
  '    q_ptr = (Q + b.to(gl.int64) * stride_q_b + (hkv * GROUP + rows % GROUP).to(gl.int64)[:, None] * stride_q_h\n'),
 ('    fence_async_shared()\n    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)\n',
  '    fence_async_shared()\n'
  '    j0, j1 = _wsd_blocks(n_k, split, NUM_SPLITS, BLOCK_N)\n'
  '    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)\n'),
 ('@gluon.jit\n'
  'def _wsd_loader(Q, OP, LP, BT, k_desc, v_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, '
  'hkv, split, j0,\n'
  '                j1, n_k, N_Q, GROUP, stride_q_b, stride_q_h, stride_q_n, stride_op_b, stride_op_s, stride_op_h,\n'
  '                stride_op_n, stride_lp_b, stride_lp_s, stride_lp_h, stride_lp_n, stride_bt_b, stride_bt_p, '
  'qk_scale,\n'
  '                ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,\n'
  '                PAGE: gl.constexpr, CAUSAL: gl.constexpr):\n'
  '    """K and V blocks [j0, j1) of (sequence b, K/V head hkv) into the ring by TMA: COPIES copies of RPC\n'
  '    rows per block (a page each when pages are smaller than a block, else a part of one page)."""\n',
  '@gluon.jit\n'
  'def _wsd_loader(Q, OP, LP, SEQLENS, BT, k_desc, v_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, '
  'v_empty, b,\n'
  '                hkv, split, N_Q, GROUP, NUM_SPLITS, MAX_PAGES, stride_q_b, stride_q_h, stride_q_n, stride_op_b,\n'
  '                stride_op_s, stride_op_h, stride_op_n, stride_lp_b, stride_lp_s, stride_lp_h, stride_lp_n,\n'
  '                stride_seqlens_b, stride_bt_b, stride_bt_p, qk_scale, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,\n'
  '                HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PAGE: gl.constexpr, CAUSAL: gl.constexpr):\n'
  '    """The split\'s K and V blocks of (sequence b, K/V head hkv) into the ring by TMA: COPIES copies of RPC\n'
  '    rows per block (a page each when pages are smaller than a block, else a part of one page)."""\n'),
 ('    idx = gl.arange(0, CHUNK, layout=gl.BlockedLayout([1], [32], [1], [0]))\n'
  "    n_pages = gl.cdiv(n_k, PAGE)  # entries past the sequence's pages are not read (page 0 stands in)\n"
  '    bt = BT + b.to(gl.int64) * stride_bt_b\n'
  "    e0 = (j0 * BLOCK_N) // PAGE  # the program's first entry\n"
  '    cur = gl.load(bt + (e0 + idx) * stride_bt_p, mask=e0 + idx < n_pages, other=0)\n'
  '    nxt = gl.load(bt + (e0 + CHUNK + idx) * stride_bt_p, mask=e0 + CHUNK + idx < n_pages, other=0)\n',
  '    idx = gl.arange(0, CHUNK, layout=gl.BlockedLayout([1], [32], [1], [0]))\n'
  '    bt = BT + b.to(gl.int64) * stride_bt_b\n'
  "    # The first chunk of entries is loaded beside the sequence's length, not after it: at the first entry\n"
  '    # the split would have if the sequence filled its table row (a full cache; split 0 always), and loaded\n'
  '    # again only if the length moves it. One round trip less before the first copy.\n'
  '    g0, _ = _wsd_blocks(MAX_PAGES * PAGE, split, NUM_SPLITS, BLOCK_N)\n'
  '    f0 = (g0 * BLOCK_N) // PAGE\n'
  '    guess = gl.load(bt + (f0 + idx) * stride_bt_p, mask=f0 + idx < MAX_PAGES, other=0)\n'
  '    n_k = gl.load(SEQLENS + b.to(gl.int64) * stride_seqlens_b)\n'
  '    j0, j1 = _wsd_blocks(n_k, split, NUM_SPLITS, BLOCK_N)\n'
  "    n_pages = gl.cdiv(n_k, PAGE)  # entries past the sequence's pages are not read (page 0 stands in)\n"
  "    e0 = (j0 * BLOCK_N) // PAGE  # the program's first entry\n"
  '    if e0 == f0:\n'
  '        cur = gl.where(e0 + idx < n_pages, guess, 0)\n'
  '    else:\n'
  '        cur = gl.load(bt + (e0 + idx) * stride_bt_p, mask=e0 + idx < n_pages, other=0)\n'
  '    nxt = gl.load(bt + (e0 + CHUNK + idx) * stride_bt_p, mask=e0 + CHUNK + idx < n_pages, other=0)\n'),
 ('                              "stride_op_s", "stride_op_h", "stride_op_n", "stride_lp_b", "stride_lp_s", '
  '"stride_lp_h",\n'
  '                              "stride_lp_n", "stride_bt_b"])\n'
  'def attn_fwd_wsd(Q, OP, LP, SEQLENS, BT, k_desc, v_desc, N_Q, GROUP, NUM_SPLITS, stride_q_b, stride_q_h, '
  'stride_q_n,\n'
  '                 stride_op_b, stride_op_s, stride_op_h, stride_op_n, stride_lp_b, stride_lp_s, stride_lp_h, '
  'stride_lp_n,\n'
  '                 stride_seqlens_b, stride_bt_b, stride_bt_p, sm_scale, ROWS: gl.constexpr, BLOCK_N: '
  'gl.constexpr,\n'
  '                 HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PAGE: gl.constexpr, CAUSAL: gl.constexpr,\n'
  '                 LOADER_REGS: gl.constexpr):\n'
  '    """one program per (split, K/V head, sequence): a TMA loader warp, one consumer warpgroup"""\n'
  '    split = gl.program_id(0)\n',
  '                              "stride_op_s", "stride_op_h", "stride_op_n", "stride_lp_b", "stride_lp_s", '
  '"stride_lp_h",\n'
  '                              "stride_lp_n", "stride_bt_b", "MAX_PAGES"])\n'
  'def attn_fwd_wsd(Q, OP, LP, SEQLENS, BT, k_desc, v_desc, N_Q, GROUP, NUM_SPLITS, MAX_PAGES, stride_q_b, '
  'stride_q_h,\n'
  '                 stride_q_n, stride_op_b, stride_op_s, stride_op_h, stride_op_n, stride_lp_b, stride_lp_s, '
  'stride_lp_h,\n'
  '                 stride_lp_n, stride_seqlens_b, stride_bt_b, stride_bt_p, sm_scale, ROWS: gl.constexpr,\n'
  '                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PAGE: gl.constexpr,\n'
  '                 CAUSAL: gl.constexpr, LOADER_REGS: gl.constexpr):\n'
  '    """one program per (split, K/V head, sequence): a TMA loader warp, one consumer warpgroup; each loads\n'
  '    the sequence\'s length itself, so that nothing waits for it before the partitions start"""\n'
  '    split = gl.program_id(0)\n'),
 ('    b = gl.program_id(2)\n'
  '    n_k = gl.load(SEQLENS + b.to(gl.int64) * stride_seqlens_b)\n'
  "    # this split's keys: whole blocks, as attn_fwd's\n"
  '    keys_per_split = BLOCK_N * gl.cdiv(gl.cdiv(n_k, NUM_SPLITS), BLOCK_N)\n'
  '    start = split * keys_per_split\n'
  '    j0 = start // BLOCK_N\n'
  '    j1 = gl.maximum(j0, gl.cdiv(gl.minimum(n_k, start + keys_per_split), BLOCK_N))\n'
  '    qk_scale = sm_scale * 1.4426950408889634\n',
  '    b = gl.program_id(2)\n    qk_scale = sm_scale * 1.4426950408889634\n'),
 ('    gl.warp_specialize([\n'
  '        (_wsd_consumer, (Q, OP, LP, BT, k_desc, v_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, '
  'v_empty, b, hkv,\n'
  '                          split, j0, j1, n_k, N_Q, GROUP, stride_q_b, stride_q_h, stride_q_n, stride_op_b, '
  'stride_op_s,\n'
  '                          stride_op_h, stride_op_n, stride_lp_b, stride_lp_s, stride_lp_h, stride_lp_n, '
  'stride_bt_b,\n'
  '                          stride_bt_p, qk_scale, ROWS, BLOCK_N, HEAD_DIM, STAGES, PAGE, CAUSAL)),\n'
  '        (_wsd_loader, (Q, OP, LP, BT, k_desc, v_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, '
  'b, hkv,\n'
  '                        split, j0, j1, n_k, N_Q, GROUP, stride_q_b, stride_q_h, stride_q_n, stride_op_b, '
  'stride_op_s,\n'
  '                        stride_op_h, stride_op_n, stride_lp_b, stride_lp_s, stride_lp_h, stride_lp_n, '
  'stride_bt_b,\n'
  '                        stride_bt_p, qk_scale, ROWS, BLOCK_N, HEAD_DIM, STAGES, PAGE, CAUSAL)),\n'
  '    ], [1], [LOADER_REGS])\n',
  '    gl.warp_specialize([\n'
  '        (_wsd_consumer, (Q, OP, LP, SEQLENS, BT, k_desc, v_desc, q_smem, k_smem, v_smem, k_ready, k_empty, '
  'v_ready, v_empty,\n'
  '                          b, hkv, split, N_Q, GROUP, NUM_SPLITS, MAX_PAGES, stride_q_b, stride_q_h, stride_q_n, '
  'stride_op_b,\n'
  '                          stride_op_s, stride_op_h, stride_op_n, stride_lp_b, stride_lp_s, stride_lp_h, '
  'stride_lp_n,\n'
  '                          stride_seqlens_b, stride_bt_b, stride_bt_p, qk_scale, ROWS, BLOCK_N, HEAD_DIM, STAGES, '
  'PAGE, CAUSAL)),\n'
  '        (_wsd_loader, (Q, OP, LP, SEQLENS, BT, k_desc, v_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, '
  'v_empty,\n'
  '                        b, hkv, split, N_Q, GROUP, NUM_SPLITS, MAX_PAGES, stride_q_b, stride_q_h, stride_q_n, '
  'stride_op_b,\n'
  '                        stride_op_s, stride_op_h, stride_op_n, stride_lp_b, stride_lp_s, stride_lp_h, '
  'stride_lp_n,\n'
  '                        stride_seqlens_b, stride_bt_b, stride_bt_p, qk_scale, ROWS, BLOCK_N, HEAD_DIM, STAGES, '
  'PAGE, CAUSAL)),\n'
  '    ], [1], [LOADER_REGS])\n'),
 ('        q, o_part, lse_part, seqlens, block_table, _wsd_descriptor(k_cache), _wsd_descriptor(v_cache), N_Q,\n'
  '        H // H_KV, o_part.shape[1],\n'
  '        q.stride(0), q.stride(1), q.stride(2), *o_part.stride()[:4], *lse_part.stride(), seqlens.stride(0),\n',
  '        q, o_part, lse_part, seqlens, block_table, _wsd_descriptor(k_cache), _wsd_descriptor(v_cache), N_Q,\n'
  '        H // H_KV, o_part.shape[1], block_table.shape[1],\n'
  '        q.stride(0), q.stride(1), q.stride(2), *o_part.stride()[:4], *lse_part.stride(), seqlens.stride(0),\n')]

SHAPES = ((1, 1024), (1, 8192), (1, 32768), (16, 1024), (16, 8192), (16, 32768), (64, 1024), (64, 8192))


def main() -> int:
    import attngen
    from attngen.tuning import Shape
    from attngen.tuning.search import bench, graphed
    from common import build_variants

    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    paged = attngen.load(os.path.join(ROOT, "specs/decode_paged16_d128.attn")).tuner("kvcache")
    contig = attngen.load(os.path.join(ROOT, "specs/decode_d128.attn")).tuner("kvcache")
    with open(paged.kernel.path) as f:
        source = f.read()
    patch = [lambda t, old=old, new=new: t.replace(old, new) for old, new in PATCH]
    for old, _ in PATCH:
        assert source.count(old) == 1, f"the generated module has changed since the experiment: {old[:60]!r}"
    variants = build_variants(source, {"shipped": [], "first chunk": patch,
                                       "reload": patch + [lambda t: t.replace("    if e0 == f0:\n", "    if e0 < 0:\n")]},
                              "paged_first_chunk")
    shipped = paged.kernel.module
    rows = []
    for batch, ctx in SHAPES:
        shape = Shape(batch, 32, 8, 1, ctx)
        gen = torch.Generator("cuda").manual_seed(batch * ctx)
        x_p = paged.tuning_inputs(shape, "cuda", gen)
        # the contiguous cache holding the same tokens as the paged one
        page = x_p["k"].shape[1]
        gather = x_p["table"].long()
        k_c = x_p["k"][gather].reshape(batch, -1, 8, 128)[:, :ctx].contiguous()
        v_c = x_p["v"][gather].reshape(batch, -1, 8, 128)[:, :ctx].contiguous()
        x_c = dict(x_p, k=k_c, v=v_c, table=None, out=torch.empty_like(x_p["out"]), lse=torch.empty_like(x_p["lse"]))
        cfg_p = dict(paged._config(shape, 0))
        cfg_p.setdefault("warp_specialized", 1)
        cfg_c = dict(contig._config(shape, 0))
        for cfg in (cfg_p, cfg_c):
            cfg.pop("BLOCK_M", None)
        assert page == 16
        for mix, full in (("full", True), ("spread", False)):
            lens = torch.full_like(x_p["lens"], ctx) if full else x_p["lens"]
            xp, xc = dict(x_p, lens=lens), dict(x_c, lens=lens)
            row = {"batch": batch, "context": ctx, "mix": mix, "paged config": cfg_p, "contiguous config": cfg_c}
            contig.tuning_run(xc, cfg_c, poison=True)
            want = xc["out"].clone()
            for name, module in variants.items():
                paged.kernel.module = module
                paged.tuning_run(xp, cfg_p, poison=True)
                torch.cuda.synchronize()
                row[f"{name} max diff"] = (xp["out"].float() - want.float()).abs().max().item()
            nbytes = 2 * int(lens.sum()) * 8 * 128 * 2
            for rep in range(2):
                for name, module in (variants.items() if rep == 0 else reversed(variants.items())):
                    paged.kernel.module = module
                    ms = bench(graphed(lambda: paged.tuning_run(xp, cfg_p)), 50, True)
                    row.setdefault(name, []).append(nbytes / (ms * 1e-3) / 1e9)
                ms = bench(graphed(lambda: contig.tuning_run(xc, cfg_c)), 50, True)
                row.setdefault("contiguous", []).append(nbytes / (ms * 1e-3) / 1e9)
            paged.kernel.module = shipped
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(out_dir, "paged_first_chunk.json"), "w") as f:
                json.dump(rows, f, indent=1)
    print("\nGB/s [graph], best of two: shipped / first chunk / reload / contiguous (paged splits), max |diff| vs "
          "contiguous")
    for r in rows:
        ship, first, reload, cont = (max(r[k]) for k in ("shipped", "first chunk", "reload", "contiguous"))
        print(f"  B={r['batch']:2d} {r['context']:5d} {r['mix']:6s} {ship:6.0f} / {first:6.0f} / {reload:6.0f} / "
              f"{cont:6.0f}  {first / ship:5.3f}x  paged/contig {first / cont:5.3f}  splits "
              f"{r['paged config'].get('num_splits')}  diff {max(r[k + ' max diff'] for k in variants):.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
