"""The Hopper Gluon forward over packed variable-length sequences (`layout = varlen`; passes/warp_specialize.py,
templates/gluon_forward.py.j2).

On the CPU: which varlen programs get the Gluon forward (not paged ones, not the backward) and what explain says;
that the kernel's tile search (its `_ws_sequence_tile`, run as Python) visits every (sequence, head, query tile)
once; that its key blocks per tile (`_ws_key_blocks`) are the Triton varlen kernel's for the sequence's n_q and n_k;
that forward_varlen hands its tensors to the Gluon launch where ws_ready allows it; that the kernels compile for
sm_90 (Triton's compiler and ptxas, in a subprocess). On a Hopper GPU (`gpu`): the Gluon varlen forward against the
float64 reference of each sequence alone, outputs poisoned first, at real sizes, K and V rows no sequence uses NaN,
and out's rows past the last sequence (where a tile's store past its sequence would land) left as they were.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import os

import pytest
import torch

import attngen
from attngen.codegen import render
from attngen.ir import sym
from attngen.lang.spec import parse
from attngen.passes import compile_program
from attngen.policy import hopper
from conftest import DEVICE, HAS_GPU, SPECS, spec_text
from probe import probe
from test_gluon_variants import generated_function, same_key_blocks
from test_varlen import _check_forward, _offsets

HOPPER = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)

# name: the spec's lines past head_dim and dtype; each gets the Gluon varlen forward
SPECS_VARLEN = {
    "causal": {"mask": "causal"},
    "none": {"mask": "none"},
    "gqa": {"mask": "causal", "heads": 8, "kv_heads": 2},
    "softcap_window": {"mask": "causal & window(300)", "score": "softcap(30)"},
    "alibi": {"mask": "causal", "score": "alibi"},
    "sinks": {"mask": "causal & window(200)", "sinks": "true"},
}


def _text(name, variant, head_dim=128, dtype="bf16"):
    extra = dict(SPECS_VARLEN[variant])
    mask = extra.pop("mask")
    return spec_text(name, head_dim, dtype, mask, layout="varlen", **extra)


def _program(text):
    spec = parse(text)
    return spec, compile_program(spec)


# -- on the CPU ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(SPECS_VARLEN))
def test_varlen_forwards_get_the_gluon_kernel(variant):
    spec, program = _program(_text(f"gvl_{variant}", variant))
    masked = SPECS_VARLEN[variant]["mask"] != "none"
    assert program.warp_specialized.forward == hopper.forward_varlen(128, masked)
    assert program.warp_specialized.backward is None and not program.warp_specialized.forward.balance
    source = render(spec, program)
    assert "def _ws_sequence_tile(" in source and "def attn_fwd_ws(" in source
    assert "launch_attn_fwd_ws(q, k, v, out, lse," in source.split("def forward_varlen(")[1]


def test_shipped_training_spec_keeps_its_backward_on_triton():
    spec, program = _program(open(os.path.join(SPECS, "varlen_causal_d128.attn")).read())
    assert program.warp_specialized.forward is not None and program.warp_specialized.backward is None
    source = render(spec, program)
    assert "attn_bwd_dkdv_ws" not in source and "def backward_varlen(" in source


def test_paged_varlen_stays_on_triton_and_explain_says_why(capsys):
    from attngen.cli import main

    spec, program = _program(open(os.path.join(SPECS, "varlen_paged_d128.attn")).read())
    assert not program.warp_specialized
    assert "attn_fwd_ws" not in render(spec, program)
    main(["explain", os.path.join(SPECS, "varlen_paged_d128.attn")])
    assert "warp-specialize: no Hopper Gluon kernels (paged K/V" in capsys.readouterr().out
    main(["explain", os.path.join(SPECS, "varlen_causal_d128.attn")])
    text = capsys.readouterr().out
    assert "warp-specialize: on Hopper the forward runs the Gluon kernel" in text
    assert "the backward stays on the Triton kernels" in text


class _Pointer:
    """A pointer into a Python list: what `_ws_sequence_tile` adds offsets to and loads from, run as Python."""

    def __init__(self, values, offset=0):
        self.values, self.offset = values, offset

    def __add__(self, k):
        return _Pointer(self.values, self.offset + k)


class _Gl:
    @staticmethod
    def cdiv(a, b):
        return -(-a // b)

    @staticmethod
    def load(p):
        return p.values[p.offset]


def _sequence_tile(source):
    """The generated `_ws_sequence_tile` as a Python function over lists (its int64 casts dropped)."""
    tree = ast.parse(source.replace(".to(gl.int64)", ""))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_ws_sequence_tile")
    fn.decorator_list = []
    for a in fn.args.args:
        a.annotation = None
    scope = {"gl": _Gl}
    exec(compile(ast.Module([fn], []), "_ws_sequence_tile", "exec"), scope)
    return scope["_ws_sequence_tile"]


@pytest.mark.parametrize("mask", ["causal", "none"])
def test_the_tile_search_visits_every_sequence_tile_once(mask):
    spec, program = _program(_text(f"gvl_search_{mask}", "causal" if mask == "causal" else "none"))
    search = _sequence_tile(render(spec, program))
    block, heads = 128, 3
    lens_q = [0, 5, 128, 129, 0, 300, 1, 1000, 127]
    lens_k = [3, 0, 128, 200, 7, 300, 2, 900, 127]
    used = [n - 1 if n else 0 for n in lens_k]  # seqused_k shorter than the sequences
    cu_q = [0] + list(itertools.accumulate(lens_q))
    cu_k = [0] + list(itertools.accumulate(lens_k))
    B = len(lens_q)
    tiles = -(-cu_q[-1] // block) + B
    seen = []
    for t in range(tiles * heads + 5):  # a persistent grid's last round runs past the end
        b, h, start_m, q_start, n_q, k_start, n_k, valid = search(
            t, tiles, heads, B, _Pointer(cu_q), 1, _Pointer(cu_k), 1, _Pointer(used), 1, block)
        if valid:
            assert (q_start, n_q, k_start, n_k) == (cu_q[b], lens_q[b], cu_k[b], used[b])
            seen.append((b, h, start_m))
    expected = [(b, h, s) for h in range(heads) for b in range(B) for s in range(0, lens_q[b], block)]
    assert sorted(seen) == sorted(expected) and len(seen) == len(set(seen))
    if mask == "causal":  # a sequence's longest rows first: its tiles from the last row block back
        firsts = [s for b, h, s in seen if (b, h) == (7, 0)]
        assert firsts == sorted(firsts, reverse=True)


@pytest.mark.parametrize("variant", ["causal", "none", "softcap_window", "sinks"])
def test_each_tile_visits_the_triton_varlen_kernels_key_blocks(variant):
    spec, program = _program(_text(f"gvl_kb_{variant}", variant))
    key_blocks = generated_function(render(spec, program))
    kernel = program.kernel("attn_fwd")
    f = program.warp_specialized.forward
    block_m, block_n = f.main.block_m, f.main.block_n
    empty = 0
    for n_q in (1, 63, 257, 1000):
        for n_k in (0, 1, 100, 257, 1000, 1500):
            for start_m in range(0, n_q, block_m):
                values = {sym.start_m: start_m, sym.n_q: n_q, sym.n_k: n_k, sym.BLOCK_M: block_m, sym.BLOCK_N: block_n}
                empty += same_key_blocks(key_blocks, kernel, values, (variant, n_q, n_k, start_m))
    assert empty > 0


def test_forward_varlen_hands_its_sequences_to_the_gluon_launch(monkeypatch):
    """Where ws_ready says the Gluon kernel runs, forward_varlen launches it with the packed tensors, the
    sequences' offsets and lengths and the spec's run-time tensors; config["warp_specialized"] = False keeps
    the Triton kernel."""
    module = attngen.load(_text("gvl_launch", "sinks", 64, "fp16")).module
    q, k, v = (torch.randn(9, 2, 64, device=DEVICE).half() for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE)
    used = torch.tensor([4, 5], dtype=torch.int32, device=DEVICE)
    sinks = torch.randn(2, device=DEVICE)
    # the launcher's parameters are the kernel's run-time tensors, in its order
    assert list(inspect.signature(module.launch_attn_fwd_ws).parameters) == [
        "q", "k", "v", "o", "lse", "sinks", "cu_seqlens_q", "cu_seqlens_k", "seqlens_k", "sm_scale"]
    calls, ready = [], []
    monkeypatch.setattr(module, "ws_ready", lambda *a: ready.append(a) or True)
    monkeypatch.setattr(module, "launch_attn_fwd_ws", lambda *a, **kw: calls.append((a, kw)))
    out, lse = module.forward_varlen(q, k, v, cu, cu, used, sinks=sinks)
    ((args, kwargs),) = calls
    assert args == (q, k, v, out, lse) and ready[0][4] == 2 and lse.shape == (2, 9)
    assert kwargs["cu_seqlens_q"] is cu and kwargs["cu_seqlens_k"] is cu and kwargs["seqlens_k"] is used
    assert kwargs["sinks"] is sinks and kwargs["sm_scale"] == 64 ** -0.5
    module.forward_varlen(q, k, v, cu, cu, used, sinks=sinks, config={"warp_specialized": False})
    assert len(calls) == 1  # the Triton kernel ran


def test_ws_ready_counts_the_average_sequence():
    """ws_ready's thresholds see the average keys a sequence and the scores of sequences that long; CPU tensors
    never take the Gluon kernel."""
    module = attngen.load(_text("gvl_ready", "causal")).module
    q = torch.empty(4096, 16, 128, dtype=torch.bfloat16)
    assert not module.ws_ready(q, q, q, q, 8)  # not on a GPU
    assert module.WS_SHAPE["min_scores"] > 0 and module.WS_CAUSAL is False


def test_the_varlen_kernels_compile_for_sm90():
    cases = [("causal", 128, "bf16", True), ("causal", 128, "bf16", False), ("gqa", 128, "bf16", True),
             ("softcap_window", 128, "bf16", True), ("alibi", 64, "fp16", True), ("sinks", 64, "bf16", True),
             ("none", 64, "fp16", True)]
    jobs = []
    for variant, d, dtype, persistent in cases:
        kernel = attngen.load(_text(f"gvl_sm90_{variant}_{d}", variant, d, dtype))
        jobs.append((kernel.module.WS_SHAPE, {"path": str(kernel.path), "gluon_ws": True, "persistent": persistent}))
    for (shape, job), result in zip(jobs, probe([job for _, job in jobs])):
        assert "error" not in result, (job, result)
        assert result["warps"] == 4 * (1 + shape["consumers"]) and result["wgmma"] > 0, result
        # Q, K and V by TMA; the output by TMA where a tile holds only its sequence's rows, else row-masked stores
        assert result["tma_loads"] >= 3 and result["tma_stores"] >= 1 and result["global_stores"] > 0, result
        assert result["shared"] <= 232448, result


# -- on a Hopper GPU -------------------------------------------------------------------------------------


def _run(kernel, lens_q, lens_k, heads, kv_heads, tensors=None, seqused=None, tail=100, seed=0):
    """Runs the kernel on packed q, k, v of these lengths followed by `tail` rows that belong to no sequence: a
    tile's store past its sequence's last row lands there as it would on the next sequence's rows (the descriptors
    do not end there), so out's tail holds a sentinel that must stay. K and V rows no sequence uses (the tail, and
    past seqused_k) are NaN: the key bound must mask their scores and their V rows must not reach the output.
    out is poisoned with NaN first. Checks that the Gluon kernel ran and the tail kept its sentinel; returns (q, k,
    v, out, lse, cu_q, cu_k) over the sequences' rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    d, dt = kernel.spec.head_dim, kernel.spec.dtype.torch
    make = lambda n, h: torch.randn((n, h, d), generator=g, device="cuda").to(dt)
    total_q, total_k = sum(lens_q), sum(lens_k)
    q, k, v = make(total_q + tail, heads), make(total_k + tail, kv_heads), make(total_k + tail, kv_heads)
    cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
    k[total_k:], v[total_k:] = float("nan"), float("nan")
    for b, n in enumerate(seqused.tolist() if seqused is not None else []):
        k[int(cu_k[b]) + n:int(cu_k[b + 1])] = float("nan")
        v[int(cu_k[b]) + n:int(cu_k[b + 1])] = float("nan")
    out = torch.full_like(q, float("nan"))
    out[total_q:] = 7.0
    called = []
    launch = kernel.module.launch_attn_fwd_ws
    kernel.module.launch_attn_fwd_ws = lambda *a, **kw: (called.append(1), launch(*a, **kw))
    try:
        out, lse = kernel(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                          max_seqlen_k=max(lens_k), seqused_k=seqused, out=out, return_lse=True, **(tensors or {}))
    finally:
        kernel.module.launch_attn_fwd_ws = launch
    torch.cuda.synchronize()
    assert called, "the Gluon kernel did not run"
    assert (out[total_q:] == 7.0).all(), "a tile stored rows past its sequence"
    return q[:total_q], k, v, out[:total_q], lse[:, :total_q], cu_q, cu_k


LENGTHS = {  # (lens_q, lens_k): unequal, 0 and 1 among them, seq_q != seq_k both ways (513 queries over 200 keys:
    # bottom-right, its first 313 rows see no key under a causal mask)
    "mixed": ([1000, 0, 1, 777, 2048, 129, 3, 513], [1000, 5, 1, 900, 2048, 0, 300, 200]),
    "documents": ([1537, 2048, 31, 4000, 255, 128, 1, 2191], None),  # seq_q = seq_k, 10191 tokens
}


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon forward runs on sm_90 only")
@pytest.mark.parametrize("lengths", sorted(LENGTHS))
@pytest.mark.parametrize("variant", sorted(SPECS_VARLEN))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gluon_varlen_forward_against_float64(variant, head_dim, lengths, monkeypatch):
    kernel = attngen.load(_text(f"gvl_gpu_{variant}_{head_dim}", variant, head_dim))
    monkeypatch.setitem(kernel.module.WS_SHAPE, "min_scores", 0)  # the Gluon kernel at every size here
    monkeypatch.setitem(kernel.module.WS_SHAPE, "min_keys", 1)
    lens_q, lens_k = LENGTHS[lengths]
    lens_k = lens_k or lens_q
    heads = SPECS_VARLEN[variant].get("heads", 4)
    kv_heads = SPECS_VARLEN[variant].get("kv_heads", heads)
    tensors = {}
    g = torch.Generator(device="cuda").manual_seed(3)
    if SPECS_VARLEN[variant].get("score") == "alibi":
        tensors["alibi_slopes"] = torch.rand(len(lens_q), heads, generator=g, device="cuda") * 0.1
    if SPECS_VARLEN[variant].get("sinks"):
        tensors["sinks"] = torch.randn(heads, generator=g, device="cuda") * 2
    q, k, v, out, lse, cu_q, cu_k = _run(kernel, lens_q, lens_k, heads, kv_heads, tensors)
    _check_forward(kernel, out, lse, q, k, v, cu_q, cu_k, tensors=tensors)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon forward runs on sm_90 only")
@pytest.mark.parametrize("programs", [None, 3])
def test_gluon_varlen_seqused_k_and_few_programs(programs, monkeypatch):
    """seqused_k shorter than the sequences' keys (the rows past it NaN: masked, and their V rows zeroed), and a
    persistent grid of 3 programs, each taking the tiles of many sequences and heads in turn, or one program a
    tile."""
    kernel = attngen.load(_text("gvl_gpu_used", "gqa"))
    module = kernel.module
    monkeypatch.setitem(module.WS_SHAPE, "min_scores", 0)
    if programs:
        monkeypatch.setattr(module, "_ws_programs", lambda device: programs)
    else:
        monkeypatch.setitem(module.WS_SHAPE, "PERSISTENT", False)
    lens_q, lens_k = [300, 1, 0, 650, 64], [700, 1, 40, 650, 1000]
    used = torch.tensor([500, 1, 0, 129, 1000], dtype=torch.int32, device="cuda")
    q, k, v, out, lse, cu_q, cu_k = _run(kernel, lens_q, lens_k, 8, 2, seqused=used, seed=5)
    _check_forward(kernel, out, lse, q, k, v, cu_q, cu_k, used=used)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon forward runs on sm_90 only")
def test_flash_attn_varlen_func_takes_the_gluon_kernel(monkeypatch):
    """The drop-in at the bench's problem (8 causal documents packed into 16k tokens, d=128, H=16) launches the
    Gluon kernel (its builtin kernel's `launch_attn_fwd_ws`, counted), and its output matches float64 per
    sequence."""
    from attngen.api import varlen as api
    from attngen.lang.builtin import NO_WINDOW
    from attngen.runtime.registry import resolve

    g = torch.Generator(device="cuda").manual_seed(11)
    cuts = sorted(torch.randperm(16383, generator=torch.Generator().manual_seed(11))[:7].add(1).tolist())
    lens = [b - a for a, b in zip([0] + cuts, cuts + [16384])]
    q, k, v = (torch.randn(16384, 16, 128, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
    cu = _offsets(lens)
    plan = api._checked_plan(q, k, v, cu, cu, max(lens), max(lens), 0.0, None, True, NO_WINDOW, 0.0, None, None,
                             None, None)
    kernel = resolve(plan.key)  # the kernel the drop-in runs
    called = []
    launch = kernel.module.launch_attn_fwd_ws
    monkeypatch.setattr(kernel.module, "launch_attn_fwd_ws", lambda *a, **kw: (called.append(1), launch(*a, **kw)))
    out, lse, _ = attngen.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                                 return_attn_probs=True)
    torch.cuda.synchronize()
    assert called, "flash_attn_varlen_func did not launch the Gluon varlen kernel"
    _check_forward(kernel, out, lse, q, k, v, cu, cu)
