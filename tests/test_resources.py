"""The resource model: hand-computed shared memory, the real compiler, and pruning messages."""

import os

import pytest

from attngen import load
from attngen.analysis.resources import (SHARED_LIMIT, Target, infeasible, infeasible_backward, registers,
                                        shared_bytes, shared_bytes_backward)
from attngen.lang.spec import parse
from attngen.policy.tma import reads_through_descriptors
from conftest import ROOT, spec_text

H100 = Target((9, 0), SHARED_LIMIT[(9, 0)], "H100")
A100 = Target((8, 0), SHARED_LIMIT[(8, 0)], "A100")


@pytest.mark.parametrize("dp,elem,bm,bn,stages,target,expected", [
    # wgmma: Q tile + num_stages x (K tile + V tile)
    (128, 2, 128, 64, 3, H100, 128 * 128 * 2 + 3 * 2 * 64 * 128 * 2),     # 131072
    (64, 2, 128, 64, 2, H100, 128 * 64 * 2 + 2 * 2 * 64 * 64 * 2),        # 49152
    (64, 2, 64, 128, 1, H100, 64 * 64 * 2 + 128 * 64 * 2),                # one stage: one tile
    # mma (no wgmma): num_stages - 1 K/V pairs, and P through shared memory
    (64, 2, 16, 64, 3, H100, 16 * 64 * 2 + 4 * 64 * 64 * 2 + 16 * 64 * 2 + 128),
    (128, 2, 128, 64, 3, A100, 128 * 128 * 2 + 4 * 64 * 128 * 2 + 128 * 64 * 2 + 128),
    (64, 4, 64, 32, 2, H100, 64 * 64 * 4 + 2 * 32 * 64 * 4 + 64 * 32 * 4 + 128),
])
def test_shared_memory_matches_hand_computed(dp, elem, bm, bn, stages, target, expected):
    assert shared_bytes(dp, elem, bm, bn, stages, target) == expected


@pytest.mark.parametrize("stages,real", [(3, 39168), (5, 72192), (7, 105216)])
def test_paged_kernels_buffer_fewer_tiles(stages, real):
    """sm_90 compiles of the generated 16-token-page decode kernel (BLOCK_M=16, BLOCK_N=64, d=128):
    the model is an upper bound within 1 KB plus alignment."""
    model = shared_bytes(128, 2, 16, 64, stages, H100, paged=True)
    assert real <= model <= real + 2048
    assert model < shared_bytes(128, 2, 16, 64, stages, H100)


def test_registers_estimate():
    assert registers(128, 128, 64, 8) == (128 * 128 + 128 * 64) / 256


def test_infeasible_configs_say_why_with_numbers():
    spec = parse(spec_text(head_dim=256, dtype="fp16"))
    why = infeasible(spec, dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4), H100)
    assert "589,824 bytes of shared memory" in why and "232,448" in why  # 2*256*(128 + 8*128)
    why = infeasible(spec, dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=1), H100)
    assert "registers" in why and "255" in why
    assert infeasible(spec, dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2), H100) is None


def test_a_fixed_tile_the_heuristic_cannot_complete_gets_the_nearest_config_that_fits():
    """Found by the spec fuzzer on an H100: `block_n = 256` at head dim 176 (256 padded) passes the spec
    check (some completion fits), but the heuristic's 64 rows and 2 stages around it need 557,056 bytes;
    Triton refused it at launch. The default config is now the nearest one that fits, on either GPU."""
    from attngen.policy.configs import default_config, heuristic

    spec = parse("kernel k { block_n = 256 head_dim = 176 dtype = bf16 }")
    start = dict(heuristic(spec), BLOCK_N=256)
    assert "557,056 bytes" in infeasible(spec, start, H100)
    for target in (H100, A100):
        config = default_config(spec, target=target)
        assert infeasible(spec, config, target) is None and config["BLOCK_N"] == 256
        assert 1 <= sum(config[k] != start[k] for k in start) <= 2
    assert default_config(spec, interpreter=True)["BLOCK_N"] == 256  # no limits in the interpreter


@pytest.mark.parametrize("target", [H100, A100], ids=["sm90", "sm80"])
def test_every_spec_that_passes_the_tile_check_gets_a_default_config_that_fits(target):
    """Over head dims, dtypes and fixed tiles that the heuristic would not choose (the largest, the
    smallest, deep pipelines), contiguous and paged: whenever the spec check accepts a spec, its
    default config fits the same GPU and keeps every value the spec fixes."""
    from attngen.policy.configs import default_config
    from attngen.errors import SpecError
    from attngen.analysis.resources import check_spec_tiles

    accepted = 0
    for head_dim, dtype, extra in [(d, t, x) for d in (64, 176, 256) for t in ("bf16", "fp32")
                                   for x in ({}, {"kv_layout": "paged(page_size = 64)", "split_kv": "auto"})]:
        for bm, bn, stages in [(m, n, st) for m in ("auto", 16, 256) for n in ("auto", 256) for st in ("auto", 4)]:
            keys = {k: v for k, v in (("block_m", bm), ("block_n", bn), ("num_stages", stages)) if v != "auto"}
            if extra and "block_m" in keys:
                continue  # a decode tile's rows follow the call
            spec = parse(spec_text("k", head_dim, dtype, **extra, **keys))
            try:
                check_spec_tiles(spec, target)
            except SpecError:
                continue
            accepted += 1
            config = default_config(spec, target=target)
            assert infeasible(spec, config, target) is None, (spec.canonical(), config)
            assert all(config[k.upper() if k.startswith("block") else k] == v for k, v in keys.items())
    assert accepted >= 40


def test_a_decoding_call_whose_rows_make_the_default_too_big_gets_a_config_that_fits():
    """A decode tile's BLOCK_M follows the call's query rows (up to 64). With a spec's fixed block_n and
    num_stages, 64 rows made the default config need 279,552 bytes of shared memory (16-token pages,
    d=128); the call's config now fits and keeps the spec's values."""
    from attngen.tuning import Shape

    spec = spec_text("k_fit", 128, "bf16", "causal(bottom_right)", kv_layout="paged(page_size = 16)",
                     block_n=256, num_stages=3)
    part = load(spec).part("kvcache")
    for shape in (Shape(4, 64, 1, 1, 4096), Shape(4, 8, 2, 1, 4096)):  # 64 rows per K/V head; 4
        config = part.config(shape)
        assert infeasible(part.spec, config) is None, config
        assert (config["BLOCK_N"], config["num_stages"]) == (256, 3)


PROBES = [
    (64, "fp16", 128, 64, 3, 4), (128, "bf16", 128, 64, 2, 8), (80, "fp16", 64, 32, 3, 4),
    (64, "fp16", 16, 32, 3, 4), (32, "fp32", 64, 32, 2, 4),
]


@pytest.fixture(scope="module")
def compiled():
    """Every probe compiled for sm_90 by the real Triton compiler, in one subprocess."""
    from probe import probe

    jobs = []
    for head_dim, dtype, bm, bn, stages, warps in PROBES:
        kernel = load(spec_text(f"probe_{head_dim}_{dtype}", head_dim, dtype, "causal"))
        jobs.append(dict(path=str(kernel.path), kernel="attn_fwd", num_warps=warps, num_stages=stages,
                         constexprs=dict(HEAD_DIM=head_dim, HEAD_DIM_PADDED=kernel.spec.head_dim_padded,
                                         BLOCK_M=bm, BLOCK_N=bn), ptr_dtypes={"LSE": "*fp32"}))
    return dict(zip(PROBES, probe(jobs)))


@pytest.mark.parametrize("case", PROBES)
def test_model_matches_the_real_sm90_compiler(case, compiled):
    head_dim, dtype, bm, bn, stages, warps = case
    result = compiled[case]
    assert "error" not in result, result
    padded = 1 << (head_dim - 1).bit_length()
    model = shared_bytes(padded, 4 if dtype == "fp32" else 2, bm, bn, stages, H100)
    # Exact for 16-bit inputs; for fp32 the model may round the P buffer up by its alignment slack.
    assert result["shared"] <= model <= result["shared"] + 2048, (result, model)


# -- the backward kernels ------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel,dp,elem,bm,bn,stages,target,expected", [
    # dQ on wgmma: Q and dO resident, num_stages x (K tile + V tile)
    ("attn_bwd_dq", 128, 2, 128, 64, 3, H100, 2 * 2 * 128 * 128 + 3 * 2 * 2 * 64 * 128),          # 163840
    ("attn_bwd_dq", 128, 2, 128, 128, 3, H100, 2 * 2 * 128 * 128 + 3 * 2 * 2 * 128 * 128),        # 262144: too big
    # dK/dV on wgmma: K and V resident, num_stages x (Q tile + dO tile + lse and delta rows)
    ("attn_bwd_dkdv", 128, 2, 64, 128, 3, H100, 2 * 2 * 128 * 128 + 3 * (2 * 2 * 64 * 128 + 8 * 64)),
    # dK/dV on mma (block_n 16 < 64): num_stages - 1 streamed pairs, and P through shared memory
    ("attn_bwd_dkdv", 64, 2, 64, 16, 3, H100, 2 * 2 * 16 * 64 + 2 * (2 * 2 * 64 * 64 + 8 * 64) + 2 * 64 * 16 + 128),
    ("attn_bwd_dq", 128, 2, 128, 64, 3, A100, 2 * 2 * 128 * 128 + 2 * 2 * 2 * 64 * 128 + 2 * 128 * 64 + 128),
])
def test_backward_shared_memory_matches_hand_computed(kernel, dp, elem, bm, bn, stages, target, expected):
    assert shared_bytes_backward(kernel, dp, elem, bm, bn, stages, target) == expected


def test_tma_descriptor_loads_add_alignment_and_barriers_on_hopper_only():
    plain = shared_bytes_backward("attn_bwd_dkdv", 128, 2, 64, 128, 3, H100)
    assert shared_bytes_backward("attn_bwd_dkdv", 128, 2, 64, 128, 3, H100, tma=True) == plain + 1024 + 8 * 3
    # the launcher never builds descriptors below sm_90: the kernel runs its pointer loads there
    assert shared_bytes_backward("attn_bwd_dkdv", 128, 2, 64, 128, 3, A100, tma=True) == \
        shared_bytes_backward("attn_bwd_dkdv", 128, 2, 64, 128, 3, A100)


def test_backward_infeasible_names_the_kernel_and_the_numbers():
    spec = parse(spec_text(head_dim=128, dtype="bf16", direction="forward+backward"))
    why = infeasible_backward(spec, "attn_bwd_dq", dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3), H100,
                              tma=False)
    assert why.startswith("attn_bwd_dq needs 262,144 bytes of shared memory") and "232,448" in why
    why = infeasible_backward(spec, "attn_bwd_dkdv", dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2), H100,
                              tma=reads_through_descriptors(spec, "attn_bwd_dkdv"))
    assert "attn_bwd_dkdv keeps at least 320 fp32 registers" in why  # (2*128*128 + 64*128) / 128
    assert infeasible_backward(spec, "attn_bwd_dkdv", dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3),
                               H100, tma=reads_through_descriptors(spec, "attn_bwd_dkdv")) is None
    with pytest.raises(ValueError, match="no backward kernel 'attn_bwd'"):
        infeasible_backward(spec, "attn_bwd", dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2), H100, tma=False)


BACKWARD_PROBES = [  # (kernel, head_dim, dtype, block_m, block_n, stages): both paths, one and several stages
    ("attn_bwd_dq", 128, "bf16", 128, 64, 2), ("attn_bwd_dq", 64, "fp16", 16, 64, 3),
    ("attn_bwd_dkdv", 128, "bf16", 64, 128, 3), ("attn_bwd_dkdv", 80, "fp16", 64, 16, 1),
    ("attn_bwd_dkdv", 32, "fp32", 64, 32, 2),
]


@pytest.fixture(scope="module")
def compiled_backward():
    from probe import probe

    jobs = []
    for name, head_dim, dtype, bm, bn, stages in BACKWARD_PROBES:
        kernel = load(spec_text(f"probe_bwd_{head_dim}_{dtype}", head_dim, dtype, "causal", direction="forward+backward"))
        jobs.append(dict(path=str(kernel.path), kernel=name, num_warps=4, num_stages=stages,
                         constexprs=dict(HEAD_DIM=head_dim, HEAD_DIM_PADDED=kernel.spec.head_dim_padded,
                                         BLOCK_M=bm, BLOCK_N=bn),
                         ptr_dtypes={"LSE": "*fp32", "DELTA": "*fp32"}, unit_strides=("stride_lse_n", "stride_delta_n")))
    return dict(zip(BACKWARD_PROBES, probe(jobs)))


@pytest.mark.parametrize("case", BACKWARD_PROBES)
def test_backward_model_matches_the_real_sm90_compiler(case, compiled_backward):
    name, head_dim, dtype, bm, bn, stages = case
    result = compiled_backward[case]
    assert "error" not in result, result
    padded = 1 << (head_dim - 1).bit_length()
    tma = False  # these probes are causal specs: no descriptor loads (passes/tma.py)
    model = shared_bytes_backward(name, padded, 4 if dtype == "fp32" else 2, bm, bn, stages, H100, tma=tma)
    assert result["shared"] <= model <= result["shared"] + 2048, (result, model)


def test_backward_model_covers_tma_descriptor_loads():
    """The non-causal d=128 dK/dV kernel reads Q and dO through TMA descriptors (passes/tma.py):
    the model's alignment and barrier term keeps it an upper bound of the real sm_90 compile."""
    from probe import probe

    jobs = [dict(path=os.path.join(ROOT, "generated", "train_d128.py"), kernel="attn_bwd_dkdv", num_warps=w, num_stages=s,
                 constexprs=dict(HEAD_DIM=128, HEAD_DIM_PADDED=128, BLOCK_M=bm, BLOCK_N=bn),
                 ptr_dtypes={"LSE": "*fp32", "DELTA": "*fp32"}, unit_strides=("stride_lse_n", "stride_delta_n"))
            for bm, bn, w, s in ((64, 128, 8, 3), (64, 64, 4, 2))]
    for job, result in zip(jobs, probe(jobs)):
        assert "error" not in result, result
        c = job["constexprs"]
        model = shared_bytes_backward("attn_bwd_dkdv", 128, 2, c["BLOCK_M"], c["BLOCK_N"], job["num_stages"], H100,
                                      tma=True)
        assert result["shared"] <= model <= result["shared"] + 2048, (job, result, model)
