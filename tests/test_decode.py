"""Decoding over a KV cache: attention_with_kvcache against a float64 reference that gathers each
sequence's pages into contiguous tensors; merge_states; argument checking; CUDA graphs on a GPU.

Fresh random inputs, outputs poisoned with NaN first, lengths that are 0 or not multiples of the
page size, block tables with pages out of order and shared between sequences.
"""

from pathlib import Path

import pytest
import torch

import attngen
from attngen import KernelInputError
from attngen.testing import reference
from attngen.testing.accuracy import ATOL, FUDGE
from attngen.lang.spec import DType
from conftest import DEVICE, empty_plans

_DT = {torch.float16: DType.FP16, torch.bfloat16: DType.BF16, torch.float32: DType.FP32}


def rand(*shape, dtype=torch.float16, device=DEVICE, gen=None):
    return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def make_cache(lengths, page_size, kv_heads, d, dtype, gen, shared=False, device=DEVICE):
    """Page pool and block table for sequences of `lengths`: pages in random order, spare pages in
    the pool, and (shared=True) sequence 1 reusing sequence 0's first page."""
    batch = len(lengths)
    per_seq = max(1, max(-(-n // page_size) for n in lengths))
    num_pages = batch * per_seq + 5
    k = rand(num_pages, page_size, kv_heads, d, dtype=dtype, device=device, gen=gen)
    v = rand(num_pages, page_size, kv_heads, d, dtype=dtype, device=device, gen=gen)
    order = torch.randperm(num_pages, generator=gen, device=device)[: batch * per_seq]
    table = order.view(batch, per_seq).to(torch.int32)
    if shared and batch > 1:
        table[1, 0] = table[0, 0]
    return k, v, table


def check(out, lse, q, k, v, seqlens, table, causal, scale=None):
    """err <= FUDGE * err(same-precision reference) + ATOL, lse likewise; empty rows exactly 0 / -inf."""
    ref, ref_lse = reference.kvcache_attention(q, k, v, seqlens.cpu(), None if table is None else table.cpu(),
                                               causal, scale)
    low, low_lse = reference.kvcache_attention(q, k, v, seqlens.cpu(), None if table is None else table.cpu(),
                                               causal, scale, dtype=q.dtype)
    assert not torch.isnan(out).any(), "unwritten (poisoned) output elements"
    empty = torch.isneginf(ref_lse)
    assert torch.isneginf(lse[empty]).all(), "rows with no key must have lse -inf"
    assert (out.transpose(1, 2)[empty] == 0).all(), "rows with no key must be exactly 0"
    atol = ATOL[_DT[q.dtype]]
    err = (out.double() - ref).abs().max().item()
    low_err = (low.double() - ref).abs().max().item()
    assert err <= FUDGE * low_err + atol, (err, low_err)
    fin = ~empty
    if fin.any():
        lse_err = (lse.double() - ref_lse)[fin].abs().max().item()
        low_lse_err = (low_lse.double() - ref_lse)[fin].abs().max().item()
        assert lse_err <= FUDGE * low_lse_err + atol, (lse_err, low_lse_err)
    return err


def run(q, k, v, seqlens, table=None, **kw):
    out = torch.full_like(q, float("nan"))
    return attngen.attention_with_kvcache(q, k, v, seqlens, table, out=out, return_softmax_lse=True, **kw)


@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("seqlen_q,num_splits", [(1, 0), (1, 3), (4, 1), (5, 2)])
def test_paged_cache_matches_gathered_reference(page_size, seqlen_q, num_splits):
    gen = torch.Generator(DEVICE).manual_seed(page_size * 100 + seqlen_q * 10 + num_splits)
    lengths = [0, 37, 150, 3] if page_size < 128 else [0, 37, 300, 129]
    lengths = [max(n, seqlen_q) if n else 0 for n in lengths]
    k, v, table = make_cache(lengths, page_size, 2, 32, torch.float16, gen, shared=page_size == 16)
    q = rand(len(lengths), seqlen_q, 8, 32, gen=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out, lse = run(q, k, v, seqlens, table, num_splits=num_splits)
    assert out.shape == q.shape and lse.shape == (len(lengths), 8, seqlen_q) and lse.dtype == torch.float32
    check(out, lse, q, k, v, seqlens, table, causal=True)


@pytest.mark.parametrize("dtype,causal", [(torch.float16, True), (torch.bfloat16, True), (torch.float32, True),
                                          (torch.float16, False)])
def test_contiguous_cache_with_splits_gqa_and_dtypes(dtype, causal):
    gen = torch.Generator(DEVICE).manual_seed(7)
    lengths = [45, 0, 130]
    k, v = rand(3, 140, 2, 48, dtype=dtype, gen=gen), rand(3, 140, 2, 48, dtype=dtype, gen=gen)
    q = rand(3, 3, 6, 48, dtype=dtype, gen=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    for splits in (1, 4):
        out, lse = run(q, k, v, seqlens, causal=causal, num_splits=splits)
        check(out, lse, q, k, v, seqlens, None, causal)


def test_more_splits_than_one_combine_step():
    """The combine kernel merges COMBINE_BLOCK_S splits per load and carries a running max across
    steps: 40 splits of a 1100-key sequence (35 non-empty in the interpreter's 32-key tiles, so the
    second step holds real splits), an empty sequence and a short one whose later splits are empty."""
    gen = torch.Generator(DEVICE).manual_seed(17)
    lengths = [1100, 0, 37]
    k, v = rand(3, 1100, 1, 64, gen=gen), rand(3, 1100, 1, 64, gen=gen)
    q = rand(3, 1, 3, 64, gen=gen)
    k[0, 1060:] = (q[0, :, :1].float().mean(1, keepdim=True) * 3).to(k.dtype)  # the largest scores in the last splits
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out, lse = run(q, k, v, seqlens, num_splits=40)
    check(out, lse, q, k, v, seqlens, None, causal=True)


@pytest.mark.parametrize("splits,width", [(2, 2), (3, 4), (5, 8), (40, 32)])
def test_combine_loads_the_split_count_rounded_up_to_a_power_of_two(monkeypatch, splits, width):
    """The merge's BLOCK_S follows the launch's split count (a 32-wide step at 2 splits cost a
    batch-16 step 1.1-1.5%, NOTES v20), at most COMBINE_BLOCK_S, and the result stays right where
    the last step is partly masked (3 and 5 splits) or there are two steps (40)."""
    from attngen.lang.builtin import kvcache_spec
    from attngen.runtime.kernel import load

    module = load(kvcache_spec("fp16", 32, True, None)).module
    widths, launch = [], module.launch_attn_combine

    def spy(*args, **kw):
        widths.append(kw["BLOCK_S"])
        return launch(*args, **kw)

    monkeypatch.setattr(module, "launch_attn_combine", spy)
    gen = torch.Generator(DEVICE).manual_seed(splits)
    lengths = [1290, 0, 45]
    k, v = rand(3, 1290, 1, 32, gen=gen), rand(3, 1290, 1, 32, gen=gen)
    q = rand(3, 1, 2, 32, gen=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out, lse = run(q, k, v, seqlens, num_splits=splits)
    assert widths == [min(width, module.COMBINE_BLOCK_S)]
    check(out, lse, q, k, v, seqlens, None, causal=True)


def test_chunked_prefill_with_queries_longer_than_the_cache():
    """Bottom-right causal: with seqlen_q > cache_seqlens, the first rows see no key (0, -inf)."""
    gen = torch.Generator(DEVICE).manual_seed(3)
    lengths = [5, 40]
    k, v, table = make_cache(lengths, 16, 1, 32, torch.float16, gen)
    q = rand(2, 9, 2, 32, gen=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out, lse = run(q, k, v, seqlens, table, num_splits=2)
    assert torch.isneginf(lse[0, :, :4]).all() and (out[0, :4] == 0).all()
    check(out, lse, q, k, v, seqlens, table, causal=True)


def test_the_check_fails_a_wrong_result():
    """A dropped key block or a small scaling must fail the comparison used above."""
    gen = torch.Generator(DEVICE).manual_seed(5)
    k, v, table = make_cache([100], 16, 1, 32, torch.float16, gen)
    q = rand(1, 1, 2, 32, gen=gen)
    seqlens = torch.tensor([100], dtype=torch.int32, device=DEVICE)
    out, lse = run(q, k, v, seqlens, table)
    check(out, lse, q, k, v, seqlens, table, True)
    short, short_lse = run(q, k, v, seqlens - 16, table)
    with pytest.raises(AssertionError):
        check(short, short_lse, q, k, v, seqlens, table, True)
    with pytest.raises(AssertionError):
        check(out * 1.02, lse, q, k, v, seqlens, table, True)


def test_split_counts_agree_and_scale_is_used():
    gen = torch.Generator(DEVICE).manual_seed(11)
    k, v, table = make_cache([200, 77], 16, 2, 32, torch.float32, gen)
    q = rand(2, 1, 4, 32, dtype=torch.float32, gen=gen)
    seqlens = torch.tensor([200, 77], dtype=torch.int32, device=DEVICE)
    outs = [run(q, k, v, seqlens, table, num_splits=s, softmax_scale=0.3)[0] for s in (1, 2, 7)]
    assert all((o - outs[0]).abs().max().item() < 1e-5 for o in outs)
    check(outs[1], run(q, k, v, seqlens, table, num_splits=2, softmax_scale=0.3)[1], q, k, v, seqlens, table,
          True, scale=0.3)


def test_auto_split_heuristic():
    from attngen.policy.splits import choose_num_splits

    assert choose_num_splits(programs=8, key_blocks=1, sms=132) == 1         # nothing to split
    assert choose_num_splits(programs=0, key_blocks=64, sms=132) == 1
    assert choose_num_splits(programs=8, key_blocks=4, sms=132) <= 4         # no split without a block
    assert choose_num_splits(programs=8, key_blocks=3, sms=132, max_splits=2) <= 2
    # a split count that gives no split fewer blocks than the count below is lowered: 6 blocks in 4 splits are
    # 2 + 2 + 2 + 0, as many a split as in 3
    assert choose_num_splits(programs=3, key_blocks=6, sms=132) == 3



def test_wave_split_rule_fills_one_wave():
    """choose_wave_splits (kernels bound by the tensor cores, a program a multiprocessor): the most splits whose
    programs fit one wave, at least 1, none without a key block, within max_splits."""
    import random

    from attngen.policy.splits import choose_wave_splits

    rng = random.Random(52)
    for _ in range(500):
        programs, blocks, sms = rng.randint(1, 300), rng.randint(1, 600), rng.choice((8, 78, 114, 132))
        cap = rng.choice((1, 4, 128))
        s = choose_wave_splits(programs, blocks, sms, cap)
        assert 1 <= s <= max(1, min(blocks, cap))
        assert s == 1 or programs * s <= sms
        assert s == 1 or -(-blocks // s) < -(-blocks // (s - 1))  # each split has a block the count below lacks
        if s < min(blocks, cap) and programs * (s + 1) <= sms:  # one more would fit: only an empty split stops it
            assert -(-blocks // (s + 1)) == -(-blocks // s)
    assert choose_wave_splits(0, 64, 132) == choose_wave_splits(8, 1, 132) == 1

def test_auto_split_rule_at_the_tuned_points():
    """The rule reproduces the split counts the H200's tuned decode entries chose (32/8 heads, BLOCK_N = 128, 132
    SMs; attngen/tuned/nvidia-h200_sm90_triton-3.6.json) from batch 16, where FP8 caches, untuned, need them."""
    import json

    from attngen.policy.splits import choose_num_splits

    tuned = json.loads((Path(attngen.__file__).parent / "tuned" / "nvidia-h200_sm90_triton-3.6.json").read_text())
    points = 0
    for problem in tuned["problems"].values():
        if not problem["specs"][0] in ("decode_d128", "decode_paged16_d128"):
            continue
        for bucket in problem["buckets"].values():
            shape, config = bucket["shape"], bucket["config"]
            if shape["B"] < 16 or config["BLOCK_N"] != 128:
                continue
            programs, blocks = shape["B"] * shape["H_KV"], shape["N_K"] // config["BLOCK_N"]
            assert choose_num_splits(programs, blocks, 132) == config["num_splits"], (problem["specs"], shape)
            points += 1
    assert points == 10  # batch 16 at 1k, 8k and 32k, batch 64 at 8k and 32k (1k's BLOCK_N is 64), in both specs
    # batch 16 and 64 at 8k and 32k
    assert [choose_num_splits(b * 8, n // 128, 132) for b in (16, 64) for n in (8192, 32768)] == [2, 4, 1, 2]
    # and batch 1, where the tuned tables take 8 and 16
    assert [choose_num_splits(8, n // 128, 132) for n in (8192, 32768)] == [8, 16]


def test_merge_states_against_float64():
    gen = torch.Generator(DEVICE).manual_seed(2)
    k, v, table = make_cache([90, 33], 16, 2, 32, torch.float32, gen)
    q = rand(2, 2, 4, 32, dtype=torch.float32, gen=gen)
    # Split the keys at 40: prefix [0, 40) and suffix, each attended without a mask.
    full_k = torch.stack([reference.gather_cache(k, n, table[b].cpu()) for b, n in enumerate([33, 33])])
    full_v = torch.stack([reference.gather_cache(v, n, table[b].cpu()) for b, n in enumerate([33, 33])])
    a = attngen.attention_with_kvcache(q, full_k[:, :20], full_v[:, :20], 20, causal=False, return_softmax_lse=True)
    b = attngen.attention_with_kvcache(q, full_k[:, 20:], full_v[:, 20:], 13, causal=False, return_softmax_lse=True)
    out, lse = attngen.merge_states(a[0], a[1], b[0], b[1])
    ref, ref_lse = reference.kvcache_attention(q, full_k, full_v, [33, 33], causal=False)
    assert (out.double() - ref).abs().max().item() < 1e-5 and (lse.double() - ref_lse).abs().max().item() < 1e-5
    # Empty states: weight 0; two empty states give 0 and -inf, never NaN.
    empty_lse = torch.full_like(a[1], float("-inf"))
    out2, lse2 = attngen.merge_states(a[0], a[1], torch.zeros_like(a[0]), empty_lse)
    assert torch.equal(out2, a[0]) and torch.allclose(lse2, a[1])
    out3, lse3 = attngen.merge_states(a[0], empty_lse, b[0], empty_lse)
    assert (out3 == 0).all() and torch.isneginf(lse3).all()


def _args():
    gen = torch.Generator(DEVICE).manual_seed(0)
    k, v, table = make_cache([20, 5], 16, 2, 32, torch.float16, gen)
    q = rand(2, 1, 4, 32, gen=gen)
    return dict(q=q, k_cache=k, v_cache=v, cache_seqlens=torch.tensor([20, 5], dtype=torch.int32, device=DEVICE),
                block_table=table)


BAD_ARGUMENTS = [
    (dict(cache_seqlens=lambda a: a["cache_seqlens"].long()), "cache_seqlens must be int32"),
    (dict(cache_seqlens=lambda a: a["cache_seqlens"][:1]), r"cache_seqlens must have shape \(2,\)"),
    (dict(cache_seqlens=lambda a: 2.5), "cache_seqlens must be an int32 tensor"),
    (dict(cache_seqlens=lambda a: 10_000), "does not fit"),
    (dict(block_table=lambda a: a["block_table"].long()), "block_table must be int32"),
    (dict(block_table=lambda a: a["block_table"][:1]), "block_table must have shape"),
    (dict(block_table=lambda a: a["block_table"][0]), "block_table must have 2 dimensions"),
    (dict(q=lambda a: a["q"][0]), "q must have 4 dimensions"),
    (dict(q=lambda a: a["q"].float()), "k_cache has dtype"),
    (dict(q=lambda a: a["q"][..., :16]), "head_dim"),
    (dict(q=lambda a: a["q"][:, :, :3]), "not a multiple"),
    (dict(v_cache=lambda a: a["v_cache"][:3]), "same shape"),
    (dict(k_cache=lambda a: a["k_cache"][:, :12], v_cache=lambda a: a["v_cache"][:, :12]), "powers of two"),
    (dict(k_cache=lambda a: a["k_cache"].tolist()), "torch.Tensor"),
    (dict(num_splits=lambda a: -1), "num_splits"),
    (dict(num_splits=lambda a: 1000), "num_splits"),
    (dict(softmax_scale=lambda a: float("inf")), "softmax_scale"),
    (dict(out=lambda a: a["q"][:1]), "out must be"),
]


@pytest.mark.parametrize("change,match", BAD_ARGUMENTS)
def test_bad_arguments_are_named_before_any_launch(change, match):
    args = _args()
    for key, make in change.items():
        args[key] = make(args)
    with pytest.raises((KernelInputError, TypeError), match=match):
        attngen.attention_with_kvcache(**args)


@pytest.mark.parametrize("change,match", BAD_ARGUMENTS)
def test_bad_arguments_are_refused_after_good_calls_were_planned(change, match):
    """A call repeats the checks' outcome of an earlier call with the same layouts (its plan in `PLANS`): one
    that differs in anything the checks read is checked afresh, whatever ran before."""
    good = _args()
    attngen.attention_with_kvcache(**good)
    attngen.attention_with_kvcache(**dict(good, cache_seqlens=20, out=torch.empty_like(good["q"])))
    args = _args()
    for key, make in change.items():
        args[key] = make(args)
    with pytest.raises((KernelInputError, TypeError), match=match):
        attngen.attention_with_kvcache(**args)


def test_a_planned_call_checks_its_output_memory_and_reads_this_calls_values(monkeypatch):
    """The second call of a signature skips the checks (one `_checked_plan`), still refuses an out that
    shares memory with an input (addresses are not in the signature), and computes with its own lengths,
    queries and caches."""
    from attngen.api import kvcache as decode

    empty_plans(monkeypatch)
    planned = []
    checked = decode._checked_plan
    monkeypatch.setattr(decode, "_checked_plan", lambda *a: planned.append(1) or checked(*a))
    gen = torch.Generator(DEVICE).manual_seed(3)
    for lengths in ([20, 5], [3, 33], [0, 17]):
        k, v, table = make_cache([33, 33], 16, 2, 32, torch.float16, gen)
        q = rand(2, 1, 4, 32, gen=gen)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        out = torch.full_like(q, float("nan"))
        got, lse = attngen.attention_with_kvcache(q, k, v, seqlens, table, out=out, return_softmax_lse=True)
        assert got is out
        check(out, lse, q, k, v, seqlens, table, causal=True)
    assert len(planned) == 1
    with pytest.raises(KernelInputError, match="out shares memory with q"):
        attngen.attention_with_kvcache(q, k, v, seqlens, table, out=q)
    assert len(planned) == 1


def test_int_lengths_share_one_plan_and_each_is_checked(monkeypatch):
    """A decoding loop passes a growing int as cache_seqlens: its calls share one plan (one `_checked_plan`),
    each computes with its own length, and a length past the cache is refused after planning."""
    from attngen.api import kvcache as decode

    empty_plans(monkeypatch)
    planned = []
    checked = decode._checked_plan
    monkeypatch.setattr(decode, "_checked_plan", lambda *a: planned.append(1) or checked(*a))
    gen = torch.Generator(DEVICE).manual_seed(5)
    k, v = rand(2, 40, 2, 32, gen=gen), rand(2, 40, 2, 32, gen=gen)
    for n in (5, 17, 40, 0):
        q = rand(2, 1, 4, 32, gen=gen)
        out, lse = attngen.attention_with_kvcache(q, k, v, n, return_softmax_lse=True)
        check(out, lse, q, k, v, torch.full((2,), n, dtype=torch.int32, device=DEVICE), None, causal=True)
    assert len(planned) == 1
    for n in (41, -1):
        with pytest.raises(KernelInputError, match=f"cache_seqlens = {n} does not fit a cache of 40 tokens"):
            attngen.attention_with_kvcache(q, k, v, n)
    assert len(planned) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["d128 lengths", "d128 int", "paged16 d128", "d96 out=", "d64 one split",
                                  "longer cache batch", "paged16 d64 int"])
def test_replayed_calls_compute_what_the_module_computes(case, monkeypatch):
    """On the GPU, from a signature's third call on, the launches recorded at its second are replayed
    (attngen/runtime/replay.py) on the call's own tensors: over caches whose values change in place and caches at
    new addresses (and an int length that changes every call), every call matches float64 and is bit for
    bit the module's own path (replays off), with NaN-poisoned outputs. Gluon kernels (d=64 and 128 on
    sm_90) and the Triton kernel (d=96)."""
    from attngen.api import kvcache as decode
    from attngen.runtime import replay

    empty_plans(monkeypatch)
    replayed = []
    real_call = replay.Replay.__call__
    monkeypatch.setattr(replay.Replay, "__call__", lambda self, inputs: replayed.append(real_call(self, inputs))
                        or replayed[-1])
    d = 64 if "d64" in case else 96 if "d96" in case else 128
    paged = "paged" in case
    lengths = [300, 77, 1]
    gen = torch.Generator(DEVICE).manual_seed(11)
    kwargs = {"num_splits": 1} if "one split" in case else {}

    def caches():
        if paged:
            return make_cache([304] * 3, 16, 2, d, torch.bfloat16, gen)
        extra = 2 if "longer" in case else 0
        return rand(3 + extra, 304, 2, d, dtype=torch.bfloat16, gen=gen), \
            rand(3 + extra, 304, 2, d, dtype=torch.bfloat16, gen=gen), None

    def call(q, k, v, table, i):
        # an int that changes every call, as a decoding loop's: one plan, one replay for all of them
        seqlens = 300 - 7 * i if "int" in case else torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        if "out=" in case:
            out = torch.full_like(q, float("nan"))
            got, lse = attngen.attention_with_kvcache(q, k, v, seqlens, table, return_softmax_lse=True, out=out,
                                                      **kwargs)
            assert got is out
        else:
            got, lse = attngen.attention_with_kvcache(q, k, v, seqlens, table, return_softmax_lse=True, **kwargs)
        return got, lse, seqlens

    k, v, table = caches()
    for i in range(6):
        if i == 3:
            k, v, table = caches()  # new addresses: the replay builds the Gluon kernel's tensor maps afresh
        else:
            k.copy_(rand(*k.shape, dtype=k.dtype, gen=gen))
        q = rand(3, 1, 8, d, dtype=torch.bfloat16, gen=gen)
        got, lse, seqlens = call(q, k, v, table, i)
        if isinstance(seqlens, int):
            seqlens = torch.full((3,), seqlens, dtype=torch.int32, device=DEVICE)
        check(got, lse, q, k[:3] if table is None else k, v[:3] if table is None else v, seqlens, table, causal=True)
        with monkeypatch.context() as m:  # the module's own path: a fresh plan, no replay recorded
            empty_plans(m)
            m.setattr(decode, "record", lambda fn, inputs: (fn(), None))
            for _ in range(3):
                want, want_lse, _ = call(q, k, v, table, i)
        assert torch.equal(got, want) and torch.equal(lse, want_lse), i
    assert replayed == [True] * 4  # calls 3 to 6


@pytest.mark.parametrize("grads,match", [
    (("q",), r"^q requires grad, but attention_with_kvcache has no backward .*torch.no_grad\(\) or torch.inference_mode\(\)"),
    (("k_cache", "v_cache"), r"^k_cache and v_cache require grad, but attention_with_kvcache has no backward"),
], ids=["q", "caches"])
def test_inputs_that_require_grad_are_refused_unless_grad_is_off(grads, match):
    """Decoding has no backward: a result silently detached from the graph would be wrong for
    training, so it is refused; under no_grad or inference_mode the same call runs."""
    args = _args()
    for name in grads:
        args[name] = args[name].clone().requires_grad_()
    with pytest.raises(KernelInputError, match=match):
        attngen.attention_with_kvcache(**args)
    with torch.no_grad():
        plain, lse = attngen.attention_with_kvcache(**args, return_softmax_lse=True)
    with torch.inference_mode():
        assert torch.equal(attngen.attention_with_kvcache(**args), plain)
    assert not plain.requires_grad
    d = {n: t.detach() for n, t in args.items()}
    check(plain, lse, d["q"], d["k_cache"], d["v_cache"], d["cache_seqlens"], d["block_table"], causal=True)


def test_contiguous_cache_shorter_batch_and_debug_value_checks(monkeypatch):
    args = _args()
    k = rand(1, 30, 2, 32)
    with pytest.raises(KernelInputError, match="holds 1 sequences but q has batch 2"):
        attngen.attention_with_kvcache(args["q"], k, k, args["cache_seqlens"])
    monkeypatch.setenv("ATTNGEN_CHECK_KVCACHE", "1")
    bad = args["block_table"].clone()
    bad[0, 1] = 10_000
    with pytest.raises(KernelInputError, match="block_table\\[0\\] names pages outside the pool"):
        attngen.attention_with_kvcache(**dict(args, block_table=bad))
    with pytest.raises(KernelInputError, match="cache_seqlens must lie in"):
        attngen.attention_with_kvcache(**dict(args, cache_seqlens=args["cache_seqlens"] + 100))


def test_cli_checks_a_decoding_spec(capsys):
    import os
    import tempfile

    from attngen.cli import main
    from conftest import spec_text

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "dec.attn")
        with open(path, "w") as f:
            f.write(spec_text("dec_cli", 16, "fp16", "causal(bottom_right)", split_kv="auto",
                              kv_layout="paged(page_size = 16)", heads=2, kv_heads=1))
        assert main(["check", path, "--seed", "1"]) == 0
    assert "6/6 cases within tolerance" in capsys.readouterr().out


# -- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16, 64, 256])
@pytest.mark.parametrize("seqlen_q", [1, 7])
def test_gpu_real_sizes(page_size, seqlen_q):
    gen = torch.Generator("cuda").manual_seed(1)
    lengths = [0, 1, 4093, 8192, 777, 5000]
    q = rand(len(lengths), seqlen_q, 32, 128, dtype=torch.bfloat16, device="cuda", gen=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    if page_size is None:
        k = rand(len(lengths), 8192, 8, 128, dtype=torch.bfloat16, device="cuda", gen=gen)
        v, table = rand(*k.shape, dtype=torch.bfloat16, device="cuda", gen=gen), None
    else:
        k, v, table = make_cache(lengths, page_size, 8, 128, torch.bfloat16, gen, shared=True, device="cuda")
    for splits in (0, 1, 5):
        out, lse = run(q, k, v, seqlens, table, num_splits=splits)
        check(out, lse, q, k, v, seqlens, table, causal=True)


@pytest.mark.gpu
def test_gpu_decode_step_captured_in_a_cuda_graph():
    """The launch path reads nothing back from the GPU: one decode step is captured and replayed,
    on new data written in place, and matches an eager call."""
    gen = torch.Generator("cuda").manual_seed(4)
    lengths = [300, 4000, 1]
    k, v, table = make_cache(lengths, 16, 8, 128, torch.bfloat16, gen, device="cuda")
    q = rand(3, 1, 32, 128, dtype=torch.bfloat16, device="cuda", gen=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    step = lambda: attngen.attention_with_kvcache(q, k, v, seqlens, table, return_softmax_lse=True)  # noqa: E731
    step()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for _ in range(2):
        q.copy_(rand(*q.shape, dtype=q.dtype, device="cuda", gen=gen))
        seqlens.copy_(torch.tensor([301, 4001, 2], dtype=torch.int32))
        graph.replay()
        eager, eager_lse = step()
        assert torch.equal(out, eager) and torch.equal(lse, eager_lse)
        check(out, lse, q, k, v, seqlens, table, causal=True)


@pytest.mark.parametrize("page_size", [None, 16])
def test_auto_split_sees_the_kv_heads_of_either_cache_layout(page_size, monkeypatch):
    """The module's split choice counts programs as B * H_KV * query blocks, for a contiguous cache
    (B, H_KV, N, D view) and a page pool (NUM_PAGES, PAGE_SIZE, H_KV, D) alike (a contiguous cache
    once passed N for H_KV there, so decoding at batch 1 never split)."""
    from attngen.lang.builtin import kvcache_spec
    from attngen.runtime.kernel import load

    gen = torch.Generator(DEVICE).manual_seed(5)
    seen = []
    module = load(kvcache_spec("fp32", 32, True, page_size)).module
    real = module.choose_num_splits
    monkeypatch.setattr(module, "choose_num_splits", lambda programs, blocks, sms, *a: seen.append(programs) or real(programs, blocks, sms, *a))
    q = rand(1, 1, 4, 32, dtype=torch.float32, gen=gen)
    if page_size:
        k, v, table = make_cache([300], page_size, 2, 32, torch.float32, gen)
    else:
        k, v, table = rand(1, 300, 2, 32, dtype=torch.float32, gen=gen), rand(1, 300, 2, 32, dtype=torch.float32, gen=gen), None
    attngen.attention_with_kvcache(q, k, v, torch.tensor([300], dtype=torch.int32, device=DEVICE), table)
    assert seen == [2]  # batch 1 x 2 K/V heads x one block of 2 packed query rows
