"""Attention variants (issue 48) in the decoding kernels: split-KV and paged, with GQA packing.

The generated module's `forward_kvcache` of decoding specs holding each variant (windows, chunks, a general
expression, softcap, ALiBi, sinks), and `attngen.attention_with_kvcache` with flash-attn's window_size,
softcap, alibi_slopes and sinks, against the float64 reference that builds the full matrices from the
variant tree per sequence (bottom-right aligned). Outputs are poisoned with NaN first; cache lengths are
ragged, one shorter than the window and one 0.
"""


import pytest
import sympy
import torch

import attngen
from attngen import KernelInputError
from attngen.ir import sym
from attngen.lang import variants as v
from attngen.lang.builtin import kvcache_spec
from attngen.lang.spec import DType, parse
from attngen.passes import compile_program
from attngen.testing import reference
from attngen.testing.accuracy import ATOL, FUDGE, spec_variant
from conftest import DEVICE, empty_plans

CASES = {
    "window": "mask = window(7)",
    "window_lr": "mask = window(5, 3)",
    "chunked": "mask = causal & chunked(12)",
    "general": "mask = q - k < 20 and (k < 5 or q >= k)",
    "softcap": "mask = causal(bottom_right)\n    score = softcap(2)",
    "alibi": "mask = causal(bottom_right)\n    score = alibi",
    "sinks": "mask = none\n    sinks = true",
    "sinks_window": "mask = window(7)\n    sinks = true",
}


def decoding_spec(variant: str, layout: str, dtype: str = "fp32", head_dim: int = 32):
    return parse(f"kernel dec {{\n    {variant}\n    head_dim = {head_dim}\n    dtype = {dtype}\n    split_kv = auto\n"
                 f"    kv_layout = {layout}\n}}\n")



def runtime_tensors(variant: v.Variant, batch: int, heads: int, gen) -> dict:
    tensors = {}
    if isinstance(variant.score, v.Alibi):
        tensors["alibi_slopes"] = torch.rand(batch, heads, generator=gen).to(DEVICE)
    if variant.sinks:  # large enough to weigh against the scores
        tensors["sinks"] = (torch.randn(heads, generator=gen) + 1.5).to(DEVICE)
    return tensors


def assert_close(out, lse, ref, ref_lse, atol):
    """Same finite / infinite log-sum-exps, then both within atol; no poisoned element left."""
    assert not torch.isnan(out).any(), "unwritten (poisoned) output elements"
    assert not torch.isnan(lse).any(), "unwritten (poisoned) log-sum-exps"
    out, lse, ref, ref_lse = (t.double().cpu() for t in (out, lse, ref, ref_lse))  # the reference may be on the GPU
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), "rows with no key (and no sink) must have lse -inf"
    assert (out - ref).abs().max().item() <= atol
    if fin.any():
        assert (lse - ref_lse)[fin].abs().max().item() <= atol


# (layout, heads, kv_heads, seqlen_q, num_splits): GQA packing with 2 and 8 heads a group, 1 and 3 new tokens,
# one split (the partial kernel writes the outputs) and three (partials and the merge)
SHAPES = [
    ("contiguous", 4, 2, 1, 3),
    ("contiguous", 8, 1, 3, 1),
    ("paged(page_size = 16)", 4, 2, 3, 1),
    ("paged(page_size = 16)", 8, 1, 1, 3),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0][:5]}-h{s[1]}kv{s[2]}-q{s[3]}-s{s[4]}")
@pytest.mark.parametrize("case", list(CASES))
def test_forward_kvcache_variants(case, shape):
    layout, heads, kv_heads, seqlen_q, splits = shape
    spec = decoding_spec(CASES[case], layout)
    variant = spec_variant(spec)
    module = attngen.load(spec).module
    gen = torch.Generator().manual_seed(48)
    lens = torch.tensor([70, 5, 0, 37], dtype=torch.int32)  # ragged: shorter than the window, and empty
    batch, d, capacity = len(lens), 32, 70
    q = torch.randn(batch, heads, seqlen_q, d, generator=gen).to(DEVICE)
    k = torch.randn(batch, kv_heads, capacity, d, generator=gen).to(DEVICE)
    v_ = torch.randn(batch, kv_heads, capacity, d, generator=gen).to(DEVICE)
    tensors = runtime_tensors(variant, batch, heads, gen)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, heads, seqlen_q), float("nan"), device=DEVICE)
    if layout.startswith("paged"):
        k_pages, table = module.as_pages(k)
        v_pages, _ = module.as_pages(v_)
        module.forward_kvcache(q, k_pages, v_pages, lens.to(DEVICE), table, None, out, lse, num_splits=splits, **tensors)
    else:
        module.forward_kvcache(q, k, v_, lens.to(DEVICE), None, None, out, lse, num_splits=splits, **tensors)
    refs = []
    for b in range(batch):
        n = int(lens[b])
        per_seq = {name: t[b : b + 1] if name == "alibi_slopes" else t for name, t in tensors.items()}
        refs.append(reference.variant_attention(q[b : b + 1], k[b : b + 1, :, :n], v_[b : b + 1, :, :n], variant,
                                                bottom_right=True, tensors=per_seq))
    ref, ref_lse = (torch.cat(x) for x in zip(*refs))
    assert_close(out, lse, ref, ref_lse, 2e-5)


def test_decoding_forward_takes_the_tensors():
    """The module's `forward` (full caches) passes its keyword tensors on; without them it refuses."""
    spec = decoding_spec(CASES["sinks_window"], "paged(page_size = 16)")
    variant = spec.variant
    module = attngen.load(spec).module
    gen = torch.Generator().manual_seed(1)
    q, k, v_ = (torch.randn(2, 4, n, 32, generator=gen).to(DEVICE) for n in (2, 40, 40))
    sinks = torch.randn(4, generator=gen).to(DEVICE)
    out, lse = module.forward(q, k, v_, sinks=sinks)
    ref, ref_lse = reference.variant_attention(q, k, v_, variant, bottom_right=True, tensors={"sinks": sinks})
    assert_close(out, lse, ref, ref_lse, 2e-5)
    with pytest.raises(TypeError, match="sinks="):
        module.forward(q, k, v_)


def _keys_read(program, n_k: int, n_q: int, group: int, block_n: int, splits: int) -> int:
    """Keys the attn_fwd programs of one (batch, K/V head) read: the key loops' trip counts x BLOCK_N, summed
    over the splits, evaluated from the program's own bounds (query block 0 holding every row)."""
    from attngen import ir

    kernel = program.kernel("attn_fwd")
    sizes = {"n_k": n_k, "N_Q": n_q, "GROUP": group, "BLOCK_N": block_n, "NUM_SPLITS": splits, "BLOCK_M": 64,
             "start_m": 0}

    def value(expr, env):
        expr = sympy.sympify(expr)
        while expr.free_symbols:
            expr = expr.subs({s: env[s.name] for s in expr.free_symbols})
        return int(expr)

    total = 0
    for split in range(splits):
        env = dict(sizes, split=split)
        for st in ir.walk_stmts(kernel.body):
            if isinstance(st, ir.Assign) and isinstance(st.value, ir.Sym) and not st.target.shape:
                env[st.target.name] = value(st.value.expr, env)
            if isinstance(st, ir.Loop) and st.var == sym.start_n:
                lo, hi = value(st.start, env), value(st.stop, env)
                total += max(0, -(-(hi - lo) // block_n)) * block_n
    return total


def test_window_narrows_every_split():
    """A sliding window of 4096 over a cache of 128k keys: the splits together read ~4096 keys, each a share."""
    spec = kvcache_spec("fp16", 128, True, None, (4095, -1))
    program = compile_program(spec)
    n_k, block_n = 131072, 64
    for splits in (1, 4, 16):
        read = _keys_read(program, n_k, 1, 8, block_n, splits)
        assert 4096 <= read <= 4096 + block_n * (splits + 1), (splits, read)
    plain = compile_program(kvcache_spec("fp16", 128, True, None))
    assert _keys_read(plain, n_k, 1, 8, block_n, 4) >= n_k


# -- attention_with_kvcache: flash-attn's arguments ---------------------------------------------------------

API_CASES = [
    dict(window_size=(6, -1)),
    dict(window_size=(6, 3), causal=False),
    dict(window_size=(-1, 2), causal=False),
    dict(softcap=3.0),
    dict(alibi="heads"),
    dict(alibi="batch", causal=False),
    dict(sinks=True),
    dict(sinks="bf16", window_size=(6, 0)),
]


@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("args", API_CASES, ids=lambda a: "-".join(f"{k}{v}" for k, v in a.items()))
def test_attention_with_kvcache_variants(args, page_size, monkeypatch):
    empty_plans(monkeypatch)
    gen = torch.Generator().manual_seed(7)
    dtype, heads, kv_heads, d = torch.float16, 4, 2, 32
    lens = [41, 3, 0]
    batch, seqlen_q = len(lens), 2
    args = dict(args)
    causal = args.pop("causal", True)
    alibi = args.pop("alibi", None)
    if alibi:
        shape = (heads,) if alibi == "heads" else (batch, heads)
        args["alibi_slopes"] = torch.rand(*shape, generator=gen).to(DEVICE)
    sinks = args.pop("sinks", None)
    if sinks:  # a model's sinks may be 16-bit parameters: taken in float32
        args["sinks"] = (torch.randn(heads, generator=gen) + 1.5).to(DEVICE, torch.bfloat16 if sinks == "bf16" else None)
    q = torch.randn(batch, seqlen_q, heads, d, generator=gen).to(dtype).to(DEVICE)
    if page_size:
        pages = batch * 3 + 2
        k = torch.randn(pages, page_size, kv_heads, d, generator=gen).to(dtype).to(DEVICE)
        v_ = torch.randn(pages, page_size, kv_heads, d, generator=gen).to(dtype).to(DEVICE)
        table = torch.randperm(pages, generator=gen)[: batch * 3].view(batch, 3).to(torch.int32).to(DEVICE)
    else:
        k = torch.randn(batch, 48, kv_heads, d, generator=gen).to(dtype).to(DEVICE)
        v_ = torch.randn(batch, 48, kv_heads, d, generator=gen).to(dtype).to(DEVICE)
        table = None
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    out, lse = attngen.attention_with_kvcache(q, k, v_, seqlens, table, causal=causal, return_softmax_lse=True,
                                              out=out, **args)
    cpu = {name: t.cpu() if isinstance(t, torch.Tensor) else t for name, t in args.items()}
    table_cpu = None if table is None else table.cpu()
    ref, ref_lse = reference.kvcache_attention(q.cpu(), k.cpu(), v_.cpu(), seqlens.cpu(), table_cpu, causal, **cpu)
    low, _ = reference.kvcache_attention(q.cpu(), k.cpu(), v_.cpu(), seqlens.cpu(), table_cpu, causal,
                                         dtype=torch.float32, **cpu)
    atol = FUDGE * (low - ref).abs().max().item() + ATOL[DType.FP16]
    assert_close(out.transpose(1, 2).contiguous().transpose(1, 2), lse, ref, ref_lse, atol)


def test_kvcache_variant_plans(monkeypatch):
    """A windowed call keeps a plan like a plain one (its own: the window is part of the signature); a call
    with sinks keeps one too, without the tensors: a later call with other sinks of the same layout takes them,
    and may record its launches (a replay takes each call's sinks as an input: the GPU test below)."""
    from attngen.runtime.plans import PLANS

    empty_plans(monkeypatch)
    q = torch.randn(1, 1, 2, 32, dtype=torch.float16, device=DEVICE)
    k = torch.randn(1, 40, 2, 32, dtype=torch.float16, device=DEVICE)
    windowed = attngen.attention_with_kvcache(q, k, k, 40, window_size=(7, 0))
    plain = attngen.attention_with_kvcache(q, k, k, 40)
    assert len(PLANS) == 2
    assert not torch.allclose(windowed, plain)
    outs = [attngen.attention_with_kvcache(q, k, k, 40, sinks=torch.full((2,), -1e4, device=DEVICE))]
    plan = PLANS.plans("kvcache")[-1]  # the sinks' plan, as its first call kept it: nothing recorded yet
    assert len(PLANS) == 3 and plan.tensors == () and plan.replay is None
    outs += [attngen.attention_with_kvcache(q, k, k, 40, sinks=torch.full((2,), s, device=DEVICE))
             for s in (0.0, 0.0, 3.0, -1e4)]
    assert len(PLANS) == 3
    torch.testing.assert_close(outs[0], plain)  # a sink of -1e4 weighs nothing
    torch.testing.assert_close(outs[-1], plain)
    torch.testing.assert_close(outs[1], outs[2])
    assert (outs[3].float().norm() < outs[1].float().norm()).item()  # a larger sink takes more of the weight


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["sinks window d64", "alibi (B, H) bf16 paged16 d128"])
def test_gpu_replayed_variant_calls_read_their_own_tensors(case, monkeypatch):
    """Decoding calls with sinks or ALiBi slopes replay from a signature's third call on (gpt-oss decodes with
    sinks every step), each with its own tensors: sinks and slopes of other values at new addresses every call,
    the slopes given in bfloat16 (a float32 copy per call, made outside the replay). Every call matches float64 and
    is bit for bit the module's own path (replays off)."""
    from attngen.api import kvcache as decode
    from attngen.runtime import replay
    from test_decode import make_cache

    empty_plans(monkeypatch)
    replayed = []
    real_call = replay.Replay.__call__
    monkeypatch.setattr(replay.Replay, "__call__", lambda self, inputs: replayed.append(real_call(self, inputs))
                        or replayed[-1])
    gen = torch.Generator(DEVICE).manual_seed(5)
    d, heads, batch = (64, 8, 3) if "d64" in case else (128, 8, 3)
    if "paged" in case:
        k, v, table = make_cache([304] * batch, 16, 2, d, torch.bfloat16, gen)
    else:
        k, v = (torch.randn(batch, 304, 2, d, dtype=torch.bfloat16, device=DEVICE, generator=gen) for _ in range(2))
        table = None
    seqlens = torch.tensor([300, 77, 1], dtype=torch.int32, device=DEVICE)
    for i in range(5):
        q = torch.randn(batch, 1, heads, d, dtype=torch.bfloat16, device=DEVICE, generator=gen)
        if "sinks" in case:
            args = dict(sinks=torch.randn(heads, device=DEVICE, generator=gen) + 1.5, window_size=(40, 0))
        else:
            args = dict(alibi_slopes=torch.rand(batch, heads, device=DEVICE, generator=gen).to(torch.bfloat16))
        got, lse = attngen.attention_with_kvcache(q, k, v, seqlens, table, return_softmax_lse=True, **args)
        with monkeypatch.context() as m:  # the module's own path: a fresh plan, no replay recorded
            empty_plans(m)
            m.setattr(decode, "record", lambda fn, inputs: (fn(), None))
            for _ in range(3):
                want, want_lse = attngen.attention_with_kvcache(q, k, v, seqlens, table, return_softmax_lse=True,
                                                                **args)
        assert torch.equal(got, want) and torch.equal(lse, want_lse), i
        cpu = {name: t.float().cpu() if isinstance(t, torch.Tensor) else t for name, t in args.items()}
        inputs = (q.cpu(), k.cpu(), v.cpu(), seqlens.cpu(), None if table is None else table.cpu(), True)
        ref, ref_lse = reference.kvcache_attention(*inputs, **cpu)
        low, _ = reference.kvcache_attention(*inputs, dtype=torch.float32, **cpu)
        assert_close(got, lse, ref, ref_lse, FUDGE * (low - ref).abs().max().item() + ATOL[DType.BF16])
    assert replayed == [True] * 3  # calls 3 to 5


BAD = [
    (dict(window_size=(-2, 0)), "window_size"),
    (dict(window_size=(4,)), "window_size"),
    (dict(window_size=(True, 0)), "window_size"),
    (dict(window_size=(2.5, 0)), "window_size"),
    (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("inf")), "softcap"),
    (dict(softcap=5.0, alibi_slopes=torch.ones(2)), "softcap and alibi_slopes"),
    (dict(alibi_slopes=torch.ones(3)), "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(1, 2, dtype=torch.int64)), "alibi_slopes"),
    (dict(sinks=torch.ones(1, 2)), "sinks"),
    (dict(sinks=torch.ones(2, dtype=torch.int32)), "sinks"),
    (dict(sinks=torch.ones(2, requires_grad=True)), "sinks"),
]


@pytest.mark.parametrize("args,name", BAD, ids=[n + str(i) for i, (_, n) in enumerate(BAD)])
def test_variant_arguments_refused_before_launch(args, name, monkeypatch):
    def no_load(*_a, **_k):
        raise AssertionError("a kernel was loaded for a call with a bad argument")

    monkeypatch.setattr("attngen.api.kvcache.load", no_load)
    q = torch.randn(1, 1, 2, 32, dtype=torch.float16, device=DEVICE)
    k = torch.randn(1, 16, 1, 32, dtype=torch.float16, device=DEVICE)
    args = {n: t.to(DEVICE) if isinstance(t, torch.Tensor) and not t.requires_grad else t for n, t in args.items()}
    with pytest.raises(KernelInputError, match=name):
        attngen.attention_with_kvcache(q, k, k, 16, **args)
    assert issubclass(KernelInputError, ValueError)


def test_variant_tensor_not_a_tensor(monkeypatch):
    monkeypatch.setattr("attngen.api.kvcache.load", lambda *_a, **_k: pytest.fail("loaded a kernel"))
    q = torch.randn(1, 1, 2, 32, dtype=torch.float16, device=DEVICE)
    with pytest.raises(TypeError, match="alibi_slopes"):
        attngen.attention_with_kvcache(q, q, q, 1, alibi_slopes=[1.0, 1.0])
