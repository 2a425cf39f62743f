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
from attngen.analysis.distance import linear_distance
from attngen.codegen import render
from attngen.ir import sym
from attngen.lang.spec import parse
from attngen.passes import compile_program
from attngen.policy import hopper
from conftest import DEVICE, HAS_GPU, SPECS, spec_text
from probe import probe
from test_gluon_variants import generated_function, same_key_blocks, triton_blocks
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

GLUON_BACKWARD_VARIANTS = sorted(SPECS_VARLEN)
"""The variants whose varlen backward the Gluon kernel takes: all of these."""


def _text(name, variant, head_dim=128, dtype="bf16", **more):
    extra = dict(SPECS_VARLEN[variant], **more)
    mask = extra.pop("mask")
    return spec_text(name, head_dim, dtype, mask, layout="varlen", **extra)


def _program(text):
    spec = parse(text)
    return spec, compile_program(spec)


@pytest.fixture
def gluon_varlen_backward(monkeypatch):
    """The Gluon varlen backward switched on (policy/hopper.py VARLEN_BACKWARD, off by default: slower than the
    Triton varlen backward so far) for the tests of that kernel (a switch is part of the kernel cache keys)."""
    monkeypatch.setattr(hopper, "VARLEN_BACKWARD", True)


@pytest.fixture(params=[(False, False, False, False), (True, False, False, False), (True, True, False, False),
                        (True, False, True, False), (True, True, True, False), (True, True, False, True),
                        (False, True, False, True)],
                ids=["packed", "scheduled", "scheduled_lean", "scheduled_persistent", "scheduled_lean_persistent",
                     "scheduled_lean_mask_s", "packed_lean_mask_s"])
def gluon_varlen_backward_scheduled(request, monkeypatch):
    """gluon_varlen_backward with hopper.VARLEN_BWD_SCHEDULE off (the packed order) and on, and on with
    hopper.VARLEN_BWD_LEAN (rows past a sequence zeroed a whole tile at once), VARLEN_BWD_PERSISTENT (a persistent
    grid) or both; and VARLEN_BWD_MASK_S (S^T masked before the exponential, the rows' delta read unmasked) with
    VARLEN_BWD_LEAN in either order."""
    monkeypatch.setattr(hopper, "VARLEN_BACKWARD", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_SCHEDULE", request.param[0])
    monkeypatch.setattr(hopper, "VARLEN_BWD_LEAN", request.param[1])
    monkeypatch.setattr(hopper, "VARLEN_BWD_PERSISTENT", request.param[2])
    monkeypatch.setattr(hopper, "VARLEN_BWD_MASK_S", request.param[3])


# -- on the CPU ------------------------------------------------------------------------------------------


def test_by_default_a_varlen_backward_takes_the_triton_kernels(monkeypatch):
    monkeypatch.setattr(hopper, "VARLEN_BACKWARD", False)
    _, program = _program(_text("gvlb_default_causal", "causal", direction="forward+backward"))
    assert program.warp_specialized.forward is not None and program.warp_specialized.backward is None


@pytest.mark.parametrize("variant", sorted(SPECS_VARLEN))
def test_varlen_forwards_get_the_gluon_kernel(variant):
    spec, program = _program(_text(f"gvl_{variant}", variant))
    masked = SPECS_VARLEN[variant]["mask"] != "none"
    distance = linear_distance(program.kernel("attn_fwd")) is not None  # (ALiBi: analysis/distance.py)
    assert program.warp_specialized.forward == hopper.forward_varlen(128, masked, distance)
    assert program.warp_specialized.backward is None and not program.warp_specialized.forward.balance
    source = render(spec, program)
    assert "def _ws_sequence_tile(" in source and "def attn_fwd_ws(" in source
    assert "launch_attn_fwd_ws(q, k, v, out, lse," in source.split("def forward_varlen(")[1]


@pytest.mark.usefixtures("gluon_varlen_backward")
@pytest.mark.parametrize("variant", GLUON_BACKWARD_VARIANTS)
def test_varlen_backwards_get_the_gluon_kernel(variant):
    spec, program = _program(_text(f"gvlb_{variant}", variant, direction="forward+backward"))
    masked = SPECS_VARLEN[variant]["mask"] != "none"
    decision = program.warp_specialized.backward
    assert decision == hopper.backward_varlen(128, masked, linear_distance(program.kernel("attn_fwd")) is not None)
    # no claimed (stored) dQ tiles, whose rows past a sequence are the next one's; one shape for every call
    assert decision.dq_claim_keys == 0 and decision.short == decision.main and decision.short_keys == 0
    source = render(spec, program)
    assert "def _ws_bwd_key_tile(" in source and "def attn_bwd_dkdv_ws(" in source
    backward = source.split("def backward_varlen(")[1]
    assert "launch_attn_bwd_ws(q, k, v, out, do, lse, dq, dk, dv," in backward
    assert "ws_bwd_fused() and seqlens_k.shape[0] and ws_bwd_ready(" in backward
    # rows past a sequence are the next one's: the masked blocks mask them by the IR's query bound
    assert "(cols < n_q)[None, :]" in source.split("def _ws_bwd_consume(")[1]


@pytest.mark.usefixtures("gluon_varlen_backward")
def test_a_varlen_backward_at_other_head_dims_keeps_the_triton_kernels():
    spec, program = _program(spec_text("gvlb_d80", 80, "bf16", "causal", layout="varlen",
                                       direction="forward+backward"))
    assert program.warp_specialized.backward is None
    assert "attn_bwd_dkdv_ws" not in render(spec, program)


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
    assert "the backward runs the Gluon kernel" in text


@pytest.mark.usefixtures("gluon_varlen_backward")
def test_explain_says_the_backward_runs_the_gluon_kernel(capsys):
    from attngen.cli import main

    main(["explain", os.path.join(SPECS, "varlen_causal_d128.attn")])
    text = capsys.readouterr().out
    assert "the backward runs the Gluon kernel, one program per key tile of the dK/dV grid" in text
    assert "lse and delta by TMA from the rows' copy shifted by q_start % 4" in text


def test_explain_says_the_backward_takes_its_tiles_in_order(monkeypatch, capsys):
    from attngen.cli import main

    monkeypatch.setattr(hopper, "VARLEN_BACKWARD", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_SCHEDULE", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_LEAN", False)
    monkeypatch.setattr(hopper, "VARLEN_BWD_PERSISTENT", False)
    main(["explain", os.path.join(SPECS, "varlen_causal_d128.attn")])
    text = capsys.readouterr().out
    assert f"the tiles with the most query blocks first, {hopper.VARLEN_BWD_ORDER_HEADS} K/V heads at a time" in text
    assert "VARLEN_BWD_PERSISTENT" not in text and "VARLEN_BWD_LEAN" not in text


def test_explain_names_the_lean_and_persistent_backward(monkeypatch, capsys):
    from attngen.cli import main

    monkeypatch.setattr(hopper, "VARLEN_BACKWARD", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_LEAN", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_PERSISTENT", True)
    main(["explain", os.path.join(SPECS, "varlen_causal_d128.attn")])
    text = capsys.readouterr().out
    assert "the backward runs the Gluon kernel, a persistent grid, a program a multiprocessor" in text
    assert "zeroed (a whole tile at once: VARLEN_BWD_LEAN)" in text
    monkeypatch.setattr(hopper, "VARLEN_BWD_SCHEDULE", False)  # (a persistent grid takes the order's work items)
    main(["explain", os.path.join(SPECS, "varlen_causal_d128.attn")])
    assert "one program per key tile of the dK/dV grid" in capsys.readouterr().out


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


def _sequence_tile(source, name="_ws_sequence_tile"):
    """The generated tile search `name` as a Python function over lists (its int64 casts dropped)."""
    tree = ast.parse(source.replace(".to(gl.int64)", ""))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    fn.decorator_list = []
    for a in fn.args.args:
        a.annotation = None
    scope = {"gl": _Gl}
    exec(compile(ast.Module([fn], []), name, "exec"), scope)
    return scope[name]


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


@pytest.mark.usefixtures("gluon_varlen_backward")
@pytest.mark.parametrize("block_n", [64, 128])
def test_the_backward_key_tile_search_visits_every_sequence_key_tile_once(block_n):
    """The Gluon backward's grid, cdiv(TOTAL_K, BLOCK_N) + B programs a K/V head, run through its `_ws_bwd_key_tile`
    as Python: every (sequence, key tile of its seqused_k keys) exactly once, lengths 0 and 1 among them, and the
    other programs past their sequence's keys (they return)."""
    spec, program = _program(_text(f"gvlb_search_{block_n}", "causal", direction="forward+backward"))
    search = _sequence_tile(render(spec, program), "_ws_bwd_key_tile")
    lens_q = [0, 5, 128, 129, 0, 300, 1, 1000, 127, 3]
    lens_k = [3, 0, 128, 200, 7, 300, 1, 900, 127, 64]
    used = [n - 1 if n > 1 else n for n in lens_k]  # seqused_k shorter than the sequences
    cu_q = [0] + list(itertools.accumulate(lens_q))
    cu_k = [0] + list(itertools.accumulate(lens_k))
    B = len(lens_q)
    seen = []
    for tile in range(-(-cu_k[-1] // block_n) + B):
        b, start_n, q_start, n_q, k_start, n_k = search(tile, B, _Pointer(cu_q), 1, _Pointer(cu_k), 1, _Pointer(used),
                                                        1, block_n)
        assert (q_start, n_q, k_start, n_k) == (cu_q[b], lens_q[b], cu_k[b], used[b]) and start_n >= 0
        if start_n < n_k:  # (the kernel returns otherwise)
            seen.append((b, start_n))
    expected = [(b, s) for b in range(B) for s in range(0, used[b], block_n)]
    assert sorted(seen) == expected and len(seen) == len(set(seen))


@pytest.mark.usefixtures("gluon_varlen_backward")
@pytest.mark.parametrize("variant", ["causal", "none", "softcap_window", "alibi"])
def test_each_key_tile_visits_the_triton_varlen_kernels_query_blocks(variant):
    """A sequence's key tile visits exactly the query blocks the Triton varlen dK/dV kernel's loops give it (its
    `_ws_bwd_query_blocks` over the sequence's n_q and n_k), and the last partial query block is among the masked
    ones (its rows past n_q are the next sequence's: only the masked blocks' query bound keeps them out)."""
    spec, program = _program(_text(f"gvlb_qb_{variant}", variant, direction="forward+backward"))
    query_blocks = generated_function(render(spec, program), "_ws_bwd_query_blocks")
    kernel = program.kernel("attn_bwd_dkdv")
    shape = program.warp_specialized.backward.main
    block_m, block_n = shape.block_m, shape.block_n
    for n_q in (1, 63, 257, 1000):
        for n_k in (1, 100, 257, 1000, 1500):
            for start_n in range(0, n_k, block_n):
                lo, full_lo, full_hi, n = query_blocks(start_n, n_q, n_k, block_m, block_n)
                values = {sym.start_n: start_n, sym.n_q: n_q, sym.n_k: n_k, sym.BLOCK_M: block_m,
                          sym.BLOCK_N: block_n}
                masked, full = triton_blocks(kernel, values, block_m, sym.start_m)
                visited = set(range(lo, lo + n))
                unmasked = visited & set(range(full_lo, full_hi))
                where = (variant, n_q, n_k, start_n)
                assert unmasked == full and visited - unmasked == masked, where
                assert all((m + 1) * block_m <= n_q for m in unmasked), where


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


@pytest.mark.usefixtures("gluon_varlen_backward")
def test_backward_varlen_hands_its_sequences_to_the_gluon_launch(monkeypatch):
    """Where ws_bwd_ready and ws_bwd_fused say the Gluon kernel runs, backward_varlen launches it with the packed
    tensors, the sequences' offsets and lengths and the modifier's tensors; config["attn_bwd_dkdv"]
    ["warp_specialized"] = False, or deterministic algorithms, keep the Triton kernels."""
    module = attngen.load(_text("gvlb_launch", "alibi", 64, "fp16", direction="forward+backward")).module
    q, k, v, o, do = (torch.randn(9, 2, 64, device=DEVICE).half() for _ in range(5))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE)
    used = torch.tensor([4, 5], dtype=torch.int32, device=DEVICE)
    lse = torch.randn(2, 9, device=DEVICE)
    slopes = torch.rand(2, device=DEVICE)
    assert list(inspect.signature(module.launch_attn_bwd_ws).parameters) == [
        "q", "k", "v", "out", "do", "lse", "dq", "dk", "dv", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k",
        "seqlens_k", "sm_scale"]
    calls, ready = [], []
    monkeypatch.setattr(module, "ws_bwd_ready", lambda *a: ready.append(a) or True)
    monkeypatch.setattr(module, "ws_bwd_fused", lambda: True)
    monkeypatch.setattr(module, "launch_attn_bwd_ws", lambda *a, **kw: calls.append((a, kw)))
    dq, dk, dv = module.backward_varlen(q, k, v, o, lse, do, cu, cu, used, alibi_slopes=slopes)
    ((args, kwargs),) = calls
    assert args == (q, k, v, o, do, lse, dq, dk, dv) and ready[0][6] == 2
    assert kwargs["cu_seqlens_q"] is cu and kwargs["cu_seqlens_k"] is cu and kwargs["seqlens_k"] is used
    assert kwargs["alibi_slopes"].shape == (2, 2) and kwargs["sm_scale"] == 64 ** -0.5
    module.backward_varlen(q, k, v, o, lse, do, cu, cu, used, alibi_slopes=slopes,
                           config={"attn_bwd_dkdv": {"warp_specialized": False}})
    monkeypatch.setattr(module, "ws_bwd_fused", lambda: False)
    module.backward_varlen(q, k, v, o, lse, do, cu, cu, used, alibi_slopes=slopes)
    assert len(calls) == 1  # the Triton kernels ran


class _Launches:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the call (and runs `run(*args)` if given)."""

    def __init__(self, run=None):
        self.calls, self.run = [], run

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            if self.run is not None:
                self.run(*args)

        return launch


def _rows_box_corner(source):
    """The corner of the varlen loader's TMA box over the rows (its `rows_desc` copy's coordinate list), as a Python
    function of (q_start, h, start_m)."""
    loader = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "_ws_bwd_loader")
    (corner,) = [c.args[1] for c in ast.walk(loader) if isinstance(c, ast.Call) and c.args
                 and isinstance(c.args[0], ast.Name) and c.args[0].id == "rows_desc"]
    return eval(f"lambda q_start, h, start_m: {ast.unparse(corner)}")


def _number_rows(*args):
    """The row pass's stand-in: the rows (lse, delta; its fourth argument) hold their position, (h * 2 + r) * 10^4 +
    row."""
    rows = args[3]
    rows.copy_(torch.arange(rows.shape[1] * 2).view(1, -1, 2, 1) * 1e4 + torch.arange(rows.shape[3]))


def _record_varlen_backward(module, monkeypatch, lengths, heads):
    """launch_attn_bwd_ws on CPU tensors of these sequences, its kernels recorded, not run (the row pass numbers the
    rows: _number_rows). Returns the records by kernel name."""
    kernels = {name: _Launches(_number_rows if name == "attn_bwd_prep_ws" else None)
               for name in ("attn_bwd_prep_ws", "attn_bwd_dkdv_ws", "attn_bwd_dq_ws")}
    for name, fake in kernels.items():
        monkeypatch.setattr(module, name, fake)
    total = sum(lengths)
    q, k, v, o, do, dq, dk, dv = (torch.randn(total, heads, 64).bfloat16() for _ in range(8))
    lse = torch.randn(heads, total)
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
    module.launch_attn_bwd_ws(q, k, v, o, do, lse, dq, dk, dv, cu, cu, torch.tensor(lengths, dtype=torch.int32), 0.125)
    return kernels


def test_the_varlen_backwards_rows_box_starts_at_a_multiple_of_4(monkeypatch, gluon_varlen_backward):
    """A TMA box's innermost coordinate must be 16-byte aligned (an unaligned one is an illegal instruction on
    Hopper), and the lse/delta rows run along the tokens, where a sequence may start at any row. The varlen launch
    reads them by TMA (ROWS_SMEM) from four shifted copies of the row pass's rows: for every sequence start and query
    block the loader's box corner is a multiple of 4 in its copy, and the box there holds that block's rows. (The
    launch in the packed order, which makes the copies apart: the ordered one's row pass writes them itself.)"""
    monkeypatch.setattr(hopper, "VARLEN_BWD_SCHEDULE", False)
    kernel = attngen.load(_text("gvlb_rows", "causal", 64, "bf16", direction="forward+backward"))
    module = kernel.module
    assert module.WS_BWD_SHAPE["ROWS_SMEM"]  # (hopper.VARLEN_ROWS_SMEM)
    lengths, heads = [1, 130, 7, 66, 2, 3], 2  # sequences starting at rows 1, 131, 138, 204, 206: every shift
    calls = _record_varlen_backward(module, monkeypatch, lengths, heads)
    ((_, args, kwargs),) = calls["attn_bwd_dkdv_ws"].calls
    assert kwargs["ROWS_SMEM"] is True and kwargs["PREFETCH"] is False
    block_m = kwargs["BLOCK_M"]
    desc = args[7]  # (q, k, v, do, dk, dv, dq, rows descriptors)
    assert desc.block_shape == module._WS_BWD_ROWS_BLOCK == [1, 1, 2, block_m]
    copies = desc.base
    assert copies.shape[:3] == (4, heads, 2) and copies.is_contiguous()
    ((_, prep_args, _),) = calls["attn_bwd_prep_ws"].calls
    rows = prep_args[3]
    corner = _rows_box_corner(kernel.path.read_text())
    starts = [0] + list(itertools.accumulate(lengths))
    for q_start, n_q in zip(starts, lengths):
        for h in range(heads):
            for start_m in range(0, n_q, block_m):
                c, hh, r, at = corner(q_start, h, start_m)
                assert at % 4 == 0 and (c, hh, r) == (q_start % 4, h, 0), (q_start, start_m, (c, hh, r, at))
                box = copies[c, h, :, at:at + block_m]
                live = min(block_m, n_q - start_m)  # (rows past the sequence: masked in the kernel)
                assert torch.equal(box[:, :live], rows[0, h, :, q_start + start_m:q_start + start_m + live])


def test_the_varlen_backward_reads_its_rows_by_pointer_without_varlen_rows_smem(monkeypatch, gluon_varlen_backward):
    """hopper.VARLEN_ROWS_SMEM off (the fallback): the varlen launch takes the pointer path for lse and delta
    (ROWS_SMEM off) and gives the kernel the rows' delta view."""
    monkeypatch.setattr(hopper, "VARLEN_ROWS_SMEM", False)
    module = attngen.load(_text("gvlb_rows_ptr", "causal", 64, "bf16", direction="forward+backward")).module
    assert not module.WS_BWD_SHAPE["ROWS_SMEM"]
    calls = _record_varlen_backward(module, monkeypatch, [1, 130, 7], 2)
    ((_, args, kwargs),) = calls["attn_bwd_dkdv_ws"].calls
    assert kwargs["ROWS_SMEM"] is False
    delta = args[9]  # (q, k, v, do, dk, dv, dq, rows descriptors, LSE, DELTA)
    assert delta.shape == (2, 138) and delta.stride(1) == 1


@pytest.mark.parametrize("order_heads, kv_heads, group", [(4, 2, 2), (4, 6, 3), (1, 3, 1)])
def test_the_backward_tile_order_takes_every_tile_once_longest_first(monkeypatch, order_heads, kv_heads, group):
    """hopper.VARLEN_BWD_SCHEDULE on: attn_bwd_order_ws (run in the interpreter) orders a K/V head's key tiles, every
    one once with its sequence, by the query blocks each visits (the generated search and query blocks, run as
    Python), most first and ties by number, the tiles past their sequence's keys last (past ORDER_TILES tiles, the
    packed order with the sequences); the launch's grid takes that order for every K/V head once, `group` heads at a
    time (the largest divisor of H_KV up to VARLEN_BWD_ORDER_HEADS), heads fastest."""
    monkeypatch.setattr(hopper, "VARLEN_BACKWARD", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_SCHEDULE", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_ORDER_HEADS", order_heads)
    kernel = attngen.load(_text(f"gvlb_order_{order_heads}", "causal", 64, "bf16", direction="forward+backward"))
    module, source = kernel.module, kernel.path.read_text()
    assert module.WS_BWD_SHAPE["ORDER_HEADS"] == order_heads
    search = _sequence_tile(source, "_ws_bwd_key_tile")
    query_blocks = generated_function(source, "_ws_bwd_query_blocks")
    block_m, block_n = module.WS_BWD_SHAPE["BLOCK_M"], module.WS_BWD_SHAPE["BLOCK_N"]
    lens_q = [0, 5, 128, 129, 0, 300, 1, 1000, 127, 3, 700]
    lens_k = [3, 0, 128, 200, 7, 300, 1, 900, 127, 64, 700]
    used = [n - 1 if n > 1 else n for n in lens_k]  # seqused_k shorter than the sequences
    cu_q = [0] + list(itertools.accumulate(lens_q))
    cu_k = [0] + list(itertools.accumulate(lens_k))
    B, tiles = len(lens_q), -(-cu_k[-1] // block_n) + len(lens_q)

    def sequence(tile):
        return search(tile, B, _Pointer(cu_q), 1, _Pointer(cu_k), 1, _Pointer(used), 1, block_n)

    def work(tile):
        b, start_n, _, n_q, _, n_k = sequence(tile)
        return query_blocks(start_n, n_q, n_k, block_m, block_n)[3] if start_n < n_k else -1

    i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    order, seqs = module._ws_bwd_order(i32(cu_q), i32(cu_k), i32(used), tiles, block_m, block_n).tolist()
    assert sorted(order) == list(range(tiles)) and seqs == [sequence(t)[0] for t in order]
    keys = [(-work(t), t) for t in order]
    assert keys == sorted(keys) and work(order[0]) > 1 and work(order[-1]) == -1, keys
    # the kernel's prologue reads its slot's tile and sequence back (_ws_bwd_ordered_tile, run as Python): the values
    # the search gives that tile
    ordered_tile = _sequence_tile(source.replace(".to(gl.int32)", ""), "_ws_bwd_ordered_tile")
    for slot, tile in enumerate(order):
        monkeypatch.setattr(_Gl, "program_id", staticmethod(lambda axis, slot=slot: slot), raising=False)
        monkeypatch.setattr(_Gl, "num_programs", staticmethod(lambda axis: tiles), raising=False)
        got = ordered_tile(_Pointer(order + seqs), _Pointer(cu_q), 1, _Pointer(cu_k), 1, _Pointer(used), 1, block_n)
        assert got == sequence(tile), (slot, tile)
    monkeypatch.setitem(module.WS_BWD_SHAPE, "ORDER_TILES", tiles - 1)
    packed = module._ws_bwd_order(i32(cu_q), i32(cu_k), i32(used), tiles, block_m, block_n).tolist()
    assert packed == [list(range(tiles)), [sequence(t)[0] for t in range(tiles)]]
    monkeypatch.setitem(module.WS_BWD_SHAPE, "ORDER_TILES", tiles)
    # the launch: the grid (heads of a group, slots of the order, groups); the kernel's (tile, K/V head) of a program
    calls = _record_varlen_backward(module, monkeypatch, [1, 130, 7, 300], kv_heads)
    ((grid, args, _),) = calls["attn_bwd_dkdv_ws"].calls
    launch_tiles = -(-438 // block_n) + 4
    assert grid == (group, launch_tiles, kv_heads // group)
    (given,) = [a for a in args if isinstance(a, torch.Tensor) and a.shape == (2, launch_tiles)]
    prologue = source.split("def attn_bwd_dkdv_ws(")[1]
    assert "hkv = gl.program_id(2) * gl.num_programs(0) + gl.program_id(0)" in prologue
    assert "_ws_bwd_ordered_tile(ORDER," in prologue and "slot = gl.program_id(1)" in source
    programs = [(given[0, y].item(), z * grid[0] + x) for z in range(grid[2]) for y in range(grid[1]) for x in range(grid[0])]
    assert sorted(programs) == [(t, h) for t in range(launch_tiles) for h in range(kv_heads)]


@pytest.mark.parametrize("kv_heads, order_heads, group", [(2, 64, 2), (6, 64, 6), (6, 4, 3)])
def test_the_persistent_backward_takes_every_work_item_once(monkeypatch, kv_heads, order_heads, group):
    """hopper.VARLEN_BWD_PERSISTENT: the launch's grid is a program a multiprocessor (no more than the work items), and
    its programs' work items, one a round (the generated _ws_bwd_item and _ws_bwd_work, run as Python), are every
    (slot of the order, K/V head) once, numbered as the ordered grid's programs start, each with the values
    _ws_bwd_ordered_tile gives that grid's program of the slot; a program that takes a round's first item takes the
    next round's last. The order takes all K/V heads together (up to VARLEN_BWD_PERSISTENT_ORDER_HEADS)."""
    monkeypatch.setattr(hopper, "VARLEN_BACKWARD", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_SCHEDULE", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_PERSISTENT", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_PERSISTENT_ORDER_HEADS", order_heads)
    kernel = attngen.load(_text(f"gvlb_persistent_{order_heads}", "causal", 64, "bf16", direction="forward+backward"))
    module, source = kernel.module, kernel.path.read_text()
    assert all(f"_ws_bwd_tiles_{p}" in source for p in ("consumer0", "consumer1", "loader"))
    work, item = _sequence_tile(source, "_ws_bwd_work"), _sequence_tile(source, "_ws_bwd_item")
    ordered_tile = _sequence_tile(source.replace(".to(gl.int32)", ""), "_ws_bwd_ordered_tile")
    lengths = [1, 130, 7, 300]
    cu = [0] + list(itertools.accumulate(lengths))
    block_n = module.WS_BWD_SHAPE["BLOCK_N"]
    tiles = -(-cu[-1] // block_n) + len(lengths)
    for programs in (3, 10 ** 4):
        monkeypatch.setattr(module, "_ws_programs", lambda device, n=programs: n)
        ((grid, args, _),) = _record_varlen_backward(module, monkeypatch, lengths, kv_heads)["attn_bwd_dkdv_ws"].calls
        assert grid == (min(programs, kv_heads * tiles),)
        at = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.shape == (2, tiles))
        order, (slots, heads, items) = args[at].flatten().tolist(), args[at + 1:at + 4]
        assert (slots, heads, items) == (tiles, group, kv_heads * tiles)
        taken = {}
        for program in range(grid[0]):
            rounds = [item(r, program, grid[0]) for r in range(-(-items // grid[0]))]
            assert rounds[:2] == [program, 2 * grid[0] - 1 - program][:len(rounds)]
            for w in (w for w in rounds if w < items):
                hkv, *tile = work(w, _Pointer(order), slots, heads, _Pointer(cu), 1, _Pointer(cu), 1, _Pointer(lengths),
                                  1, block_n)
                slot = w // heads % slots
                monkeypatch.setattr(_Gl, "program_id", staticmethod(lambda axis, slot=slot: slot), raising=False)
                monkeypatch.setattr(_Gl, "num_programs", staticmethod(lambda axis: tiles), raising=False)
                assert tuple(tile) == ordered_tile(_Pointer(order), _Pointer(cu), 1, _Pointer(cu), 1,
                                                   _Pointer(lengths), 1, block_n), (w, slot)
                assert w not in taken
                taken[w] = (slot, hkv)
        # the ordered grid (heads of a group, slots, groups) numbered as its programs start: x fastest, then y, z
        started = [(y, z * heads + x) for z in range(kv_heads // heads) for y in range(tiles) for x in range(heads)]
        assert [taken[w] for w in range(items)] == started


@pytest.mark.parametrize("lean", [False, True])
def test_the_persistent_varlen_backward_compiles_for_sm90(monkeypatch, tmp_path, lean):
    """hopper.VARLEN_BWD_PERSISTENT on (with and without VARLEN_BWD_LEAN): the Gluon varlen backward's persistent
    partitions compile for sm_90, with TMA stores of dK and dV (from the dQ buffers) beside the row-masked ones."""
    monkeypatch.setattr(hopper, "VARLEN_BACKWARD", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_SCHEDULE", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_PERSISTENT", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_LEAN", lean)
    jobs = []
    for variant, d, dtype in (("causal", 128, "bf16"), ("alibi", 64, "fp16")):
        kernel = attngen.load(_text(f"gvlb_sm90_persistent_{variant}", variant, d, dtype, direction="forward+backward"))
        assert "WORK" in inspect.signature(kernel.module.attn_bwd_dkdv_ws.fn).parameters
        jobs.append({"path": str(kernel.path), "gluon_ws": "backward", "ptx_to": str(tmp_path / f"{variant}.ptx")})
    for job, result in zip(jobs, probe(jobs)):
        assert "error" not in result, (job, result)
        assert result["tma_loads"] >= 4 and result["tma_reduces"] >= 1 and result["tma_stores"] >= 2, result
        assert result["global_stores"] > 0 and result["shared"] <= 232448, result


def test_the_ordered_launchs_row_pass_writes_the_shifted_rows_itself(monkeypatch):
    """With hopper.VARLEN_BWD_SCHEDULE on, the row pass (run in the interpreter) writes the four shifted copies of the
    rows that the loader reads by TMA itself: they equal the copies _ws_bwd_shifted_rows makes of the packed
    launch's rows (every value a sequence's box can read), and no copy of them is made."""
    monkeypatch.setattr(hopper, "VARLEN_BACKWARD", True)
    lengths, heads, made = [1, 130, 7, 66, 2, 3], 2, {}
    for schedule in (False, True):
        monkeypatch.setattr(hopper, "VARLEN_BWD_SCHEDULE", schedule)
        module = attngen.load(_text(f"gvlb_shifted_{schedule}", "causal", 64, "bf16",
                                    direction="forward+backward")).module
        copied = []
        monkeypatch.setattr(module, "_ws_bwd_shifted_rows", lambda *a, f=module._ws_bwd_shifted_rows:
                            copied.append(1) or f(*a))
        kernels = {name: _Launches() for name in ("attn_bwd_dkdv_ws", "attn_bwd_dq_ws")}
        for name, fake in kernels.items():
            monkeypatch.setattr(module, name, fake)
        g = torch.Generator().manual_seed(0)
        total = sum(lengths)
        q, k, v, o, do, dq, dk, dv = (torch.randn(total, heads, 64, generator=g).bfloat16() for _ in range(8))
        lse = torch.randn(heads, total, generator=g)
        cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
        module.launch_attn_bwd_ws(q, k, v, o, do, lse, dq, dk, dv, cu, cu, torch.tensor(lengths, dtype=torch.int32),
                                  0.125)
        ((_, args, _),) = kernels["attn_bwd_dkdv_ws"].calls
        made[schedule] = args[7].base  # (q, k, v, do, dk, dv, dq, rows descriptors)
        assert len(copied) == (0 if schedule else 1)
    packed, shifted = made[False], made[True]
    assert shifted.shape == packed.shape == (4, heads, 2, 256)
    for s in range(4):  # (a copy's last s values are past the rows: no sequence's, left unwritten)
        n = packed[s].numel() - s
        assert torch.equal(shifted[s].flatten()[:n], packed[s].flatten()[:n]), s


def test_the_backward_tile_order_is_on_by_default_and_a_switch(monkeypatch):
    """hopper.VARLEN_BWD_SCHEDULE (on since its H200 run) orders the varlen backward's key tiles; without it the packed
    order: no order kernel, no ORDER."""
    assert hopper.VARLEN_BWD_SCHEDULE is True and "VARLEN_BWD_SCHEDULE" in hopper.SWITCHES
    assert hopper.backward_varlen(128, True).order_heads == hopper.VARLEN_BWD_ORDER_HEADS > 0
    monkeypatch.setattr(hopper, "VARLEN_BWD_SCHEDULE", False)
    assert hopper.backward_varlen(128, True).order_heads == 0
    spec, program = _program(_text("gvlb_order_off", "causal", direction="forward+backward"))
    source = render(spec, program)
    assert "attn_bwd_dkdv_ws" in source and "ORDER" not in source and "attn_bwd_order_ws" not in source


def test_the_lean_backward_changes_only_the_zeroing(monkeypatch):
    """hopper.VARLEN_BWD_LEAN (on since its H200 run) is a switch of the kernel caches; with it on, the varlen
    backward's consumers zero their rows past a sequence by _ws_bwd_zero_tail and the module differs from the one
    without it in that alone; a dense program never takes it (the verifier refuses it there)."""
    import dataclasses

    from attngen.errors import InternalError
    from attngen.ir.verify import verify

    assert "VARLEN_BWD_LEAN" in hopper.SWITCHES
    monkeypatch.setattr(hopper, "VARLEN_BACKWARD", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_LEAN", False)
    text = _text("gvlb_lean", "causal", direction="forward+backward")
    spec, program = _program(text)
    off = render(spec, program)
    assert program.warp_specialized.backward.zero_whole is False and "_ws_bwd_zero_tail" not in off
    monkeypatch.setattr(hopper, "VARLEN_BWD_LEAN", True)
    spec, program = _program(text)
    on = render(spec, program)
    assert program.warp_specialized.backward.zero_whole is True
    assert on.count("_ws_bwd_zero_tail(k, n_k - row0, BN, HEAD_DIM)") == 1
    assert on.count("_ws_bwd_zero_tail(v, n_k - row0, BN, HEAD_DIM)") == 1
    start = on.index("@gluon.jit\ndef _ws_bwd_zero_tail(")
    end = on.index("@gluon.jit", start + 1)
    assert on[:start] + on[end:] == off.replace("_ws_zero_rows(k, n_k", "_ws_bwd_zero_tail(k, n_k").replace(
        "_ws_zero_rows(v, n_k", "_ws_bwd_zero_tail(v, n_k")
    dense_spec, dense = _program(text.replace("    layout = varlen\n", ""))
    assert dense.warp_specialized.backward is not None and dense.warp_specialized.backward.zero_whole is False
    for field in ("zero_whole", "persistent"):  # (VARLEN_BWD_PERSISTENT's field: varlen only too)
        bad = dataclasses.replace(dense.warp_specialized.backward, **{field: True})
        with pytest.raises(InternalError, match="zero_whole" if field == "zero_whole" else "persistent grid"):
            verify(dataclasses.replace(dense, warp_specialized=dataclasses.replace(dense.warp_specialized, backward=bad)),
                   "test")


VARLEN_BWD_LEAN_SPILLS = {"causal": 156, "softcap_window": 668}
"""Bytes a thread of the ordered varlen Gluon backward spills with hopper.VARLEN_BWD_LEAN (ptxas -v, sm_90a): the
whole-tile zeroing; without it 268 and 768 (VARLEN_BWD_SPILLS: the packed order's, within 8 bytes)."""


@pytest.mark.parametrize("variant", sorted(VARLEN_BWD_LEAN_SPILLS))
def test_the_lean_varlen_backward_compiles_for_sm90_and_spills_less(monkeypatch, tmp_path, variant):
    """With hopper.VARLEN_BWD_LEAN the Gluon varlen backward (the default tile order) compiles for sm_90 with its TMA
    loads and dQ reductions, and ptxas spills no more than VARLEN_BWD_LEAN_SPILLS, less than the same kernel without
    the switch (VARLEN_BWD_MASK_S off: the numbers were measured before it)."""
    monkeypatch.setattr(hopper, "VARLEN_BACKWARD", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_MASK_S", False)
    jobs = []
    for lean in (False, True):
        monkeypatch.setattr(hopper, "VARLEN_BWD_LEAN", lean)
        kernel = attngen.load(_text(f"gvlb_sm90_lean_{variant}", variant, 128, "bf16", direction="forward+backward"))
        assert ("_ws_bwd_zero_tail" in kernel.path.read_text()) is lean
        jobs.append({"path": str(kernel.path), "gluon_ws": "backward", "ptx_to": str(tmp_path / f"{lean}.ptx")})
    results = probe(jobs)
    for result in results:
        assert "error" not in result, result
        assert result["tma_loads"] >= 4 and result["tma_reduces"] >= 1 and result["shared"] <= 232448, result
    off, on = (_ptxas_spills(job["ptx_to"]) for job in jobs)
    assert on <= VARLEN_BWD_LEAN_SPILLS[variant] < off, (variant, off, on)


def test_mask_s_masks_the_scores_and_bounds_the_rows(monkeypatch):
    """hopper.VARLEN_BWD_MASK_S (on since measured) is a switch of the kernel caches; with it on, the varlen
    backward masks a masked block's S^T to -inf before exp2 where no score modifier sits between them (a softcap
    spec keeps the P^T mask), its consumers read the rows' delta unmasked, and its launch pads the rows by 3 and ends
    their descriptor 3 short of the padding; the module differs from the one without it in that alone; a dense
    program never takes it (the verifier refuses it there)."""
    import dataclasses

    from attngen.cli import _gluon_backward_line
    from attngen.errors import InternalError
    from attngen.ir.verify import verify

    assert "VARLEN_BWD_MASK_S" in hopper.SWITCHES
    monkeypatch.setattr(hopper, "VARLEN_BACKWARD", True)
    sources = {}
    for variant in ("causal", "softcap_window"):
        text = _text(f"gvlb_mask_s_{variant}", variant, direction="forward+backward")
        for on in (False, True):
            monkeypatch.setattr(hopper, "VARLEN_BWD_MASK_S", on)
            spec, program = _program(text)
            assert program.warp_specialized.backward.mask_scores is on
            assert ("VARLEN_BWD_MASK_S" in _gluon_backward_line(program)) is on
            sources[variant, on] = render(spec, program)
    off, on = sources["causal", False], sources["causal", True]
    mask = "(rows[:, None] <= cols[None, :] + (n_k - n_q)) & (cols < n_q)[None, :]"
    assert f"pt = gl.where({mask}, pt, 0.0)" in off and "pt = gl.where(" not in on
    assert f"st = gl.where({mask}, st, float(\"-inf\"))" in on
    assert on.index("st = gl.where(") < on.index("pt = gl.exp2(st * qk_scale - lse[None, :])")
    assert "delta = gl.where(cols < n_q, delta, 0.0)" in off and "delta = gl.where" not in on
    assert "n_pad = cdiv(TOTAL_Q + 3, block_m) * block_m" in on
    assert "_WS_BWD_ROWS_LAYOUT, [4, H, 2, n_pad - 3])" in on
    # nothing else moved: the lines the switch touches (comments included) are its own
    strip = lambda src: [line for line in src.splitlines() if not any(
        key in line for key in ("gl.where(", "pt = gl.exp2(st", "n_pad = cdiv(TOTAL_Q", "_WS_BWD_ROWS_LAYOUT",
                                "(start_m < full_lo * BLOCK_M)", "ROWS_SMEM and (start_m + BLOCK_M > n_q)", "# ",
                                "live = rows < "))]
    assert strip(off) == strip(on.replace("ZERO_ROWS, CU_SEQLENS_Q, stride_cu, BATCH, ", "ZERO_ROWS, ").replace(
        "mask=(rows < N_Q)[:, None])", "mask=mask)").replace(" cu_seqlens_q, cu_seqlens_q.stride(0), B,", ""))
    # the row pass reads rows up to the sequences' end, no further (rows past it: lse +inf, delta 0)
    assert "live = rows < tl.minimum(tl.load(CU_SEQLENS_Q + BATCH * stride_cu), N_Q)" in on
    assert "CU_SEQLENS_Q + BATCH" not in off
    # a score modifier between S^T and exp2 (softcap: -inf would not stay -inf): P^T masked, the delta unmasked
    soft = sources["softcap_window", True]
    assert "pt = gl.where(" in soft and "st = gl.where(" not in soft and "delta = gl.where" not in soft
    dense_spec, dense = _program(_text("gvlb_mask_s_dense", "causal", direction="forward+backward").replace(
        "    layout = varlen\n", ""))
    assert dense.warp_specialized.backward.mask_scores is False
    bad = dataclasses.replace(dense.warp_specialized.backward, mask_scores=True)
    with pytest.raises(InternalError, match="mask_scores"):
        verify(dataclasses.replace(dense, warp_specialized=dataclasses.replace(dense.warp_specialized, backward=bad)),
               "test")


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "packed"])
@pytest.mark.parametrize("lens, tail", [((1, 64, 127), 0), ((61, 3, 128), 0), ((5,), 0), ((61, 3, 128), 7),
                                        ((1, 64), 63)])
def test_mask_s_rows_read_are_written_or_zero(monkeypatch, ordered, lens, tail):
    """What VARLEN_BWD_MASK_S's unmasked delta rests on, with the launch's own row pass (in the interpreter) over
    rows poisoned with NaN first: within the rows' descriptor (copy s's first n_pad - 3 rows, n_pad from TOTAL_Q + 3)
    every lse is a number and every delta finite, each sequence's own rows are inside it at copy q_start % 4 with
    their own lse and delta, and rows past the sequences have lse +inf and delta 0 (TMA reads zeros past the
    descriptor), also `tail` rows of q past cu_seqlens_q[B] whose out is NaN and lse a finite number (the forward
    never wrote them); dQ's accumulator is zeroed on every row. Without the 3 rows of padding a TOTAL_Q that is a
    multiple of BLOCK_M puts copy 0's last rows outside it (lens summing to 192); without the bound at
    cu_seqlens_q[B] the tail's rows get their lse and a NaN delta (a GPU run's dQ past the sequences was not 0)."""
    monkeypatch.setattr(hopper, "VARLEN_BACKWARD", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_SCHEDULE", ordered)
    monkeypatch.setattr(hopper, "VARLEN_BWD_MASK_S", True)
    module = attngen.load(_text(f"gvlb_mask_s_rows_{ordered}", "causal", 64, "fp16", direction="forward+backward")).module
    source = inspect.getsource(module)
    assert "n_pad = cdiv(TOTAL_Q + 3, block_m) * block_m" in source and "_WS_BWD_ROWS_LAYOUT, [4, H, 2, n_pad - 3])" in source
    g = torch.Generator(device=DEVICE).manual_seed(0)
    H, d, used = 2, 64, sum(lens)
    total = used + tail
    block_m = module.WS_BWD_SHAPE["BLOCK_M"]
    out, do = (torch.randn((total, H, d), generator=g, device=DEVICE).to(torch.float16) for _ in range(2))
    lse = torch.randn((H, total), generator=g, device=DEVICE)
    lse[:, 0] = float("-inf")  # (a row that saw no key: +inf in log2 units)
    out[used:] = float("nan")  # the tail: no sequence's, never written by the forward
    cu_q = _offsets(lens)
    n_pad = (total + 3 + block_m - 1) // block_m * block_m
    if ordered:  # the row pass writes the four shifted copies itself
        copies = torch.full((4, H, 2, n_pad), float("nan"), device=DEVICE)
        target = copies
    else:  # the rows, then their copies (_ws_bwd_shifted_rows)
        flat = torch.full((H * 2 * n_pad + 3,), float("nan"), device=DEVICE)
        target = flat[:H * 2 * n_pad].view(1, H, 2, n_pad)
    o4, do4, lse3 = module._ws_heads_first(out), module._ws_heads_first(do), lse.unsqueeze(0)
    dq_acc = torch.full((1, H, total, d), float("nan"), device=DEVICE)
    block = module.WS_BWD_SHAPE["ROW_BLOCK"]
    module.attn_bwd_prep_ws[(n_pad // block, H, 1)](o4, do4, lse3, target, dq_acc, lse3, *o4.stride(), *do4.stride(),
                                                   *lse3.stride(), H, total, n_pad, 0, cu_q, cu_q.stride(0), len(lens),
                                                   BLOCK=block, HEAD_DIM=d, CLAIMS=0, BLOCK_M=block_m, num_warps=4)
    assert (dq_acc == 0).all()
    if not ordered:
        copies = module._ws_bwd_shifted_rows(flat, H, n_pad)
    seen = copies[..., :n_pad - 3]  # the descriptor's rows
    assert not seen[:, :, 0].isnan().any() and seen[:, :, 1].isfinite().all()
    lse2 = torch.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = (out.float() * do.float()).sum(-1).T  # (H, TOTAL_Q)
    for q_start, n_q in zip(_offsets(lens).tolist(), lens):
        s, cols = q_start % 4, torch.arange(q_start, q_start + n_q) - q_start % 4
        assert int(cols.max()) < n_pad - 3, (q_start, n_q, n_pad)
        torch.testing.assert_close(seen[s, :, 0, cols], lse2[:, q_start:q_start + n_q])
        torch.testing.assert_close(seen[s, :, 1, cols], delta[:, q_start:q_start + n_q], rtol=1e-5, atol=1e-5)
    for s in range(4):  # rows past the sequences
        assert (seen[s, :, 0, used - s:] == float("inf")).all() and (seen[s, :, 1, used - s:] == 0).all()


VARLEN_BWD_MASK_S_SPILLS = {"causal": 48, "softcap_window": 588}
"""Bytes a thread of the ordered, lean varlen Gluon backward spills with hopper.VARLEN_BWD_MASK_S (ptxas -v, sm_90a):
against VARLEN_BWD_LEAN_SPILLS without it (156, 668)."""


@pytest.mark.parametrize("variant", sorted(VARLEN_BWD_MASK_S_SPILLS))
def test_the_mask_s_varlen_backward_compiles_for_sm90_and_spills_less(monkeypatch, tmp_path, variant):
    """With hopper.VARLEN_BWD_MASK_S the ordered, lean Gluon varlen backward compiles for sm_90 with its TMA loads and
    dQ reductions, and ptxas spills no more than VARLEN_BWD_MASK_S_SPILLS, less than the same kernel without it."""
    monkeypatch.setattr(hopper, "VARLEN_BACKWARD", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_LEAN", True)
    jobs = []
    for on in (False, True):
        monkeypatch.setattr(hopper, "VARLEN_BWD_MASK_S", on)
        kernel = attngen.load(_text(f"gvlb_sm90_mask_s_{variant}", variant, 128, "bf16", direction="forward+backward"))
        assert ("delta = gl.where" in kernel.path.read_text()) is not on
        jobs.append({"path": str(kernel.path), "gluon_ws": "backward", "ptx_to": str(tmp_path / f"{on}.ptx")})
    for result in probe(jobs):
        assert "error" not in result, result
        assert result["tma_loads"] >= 4 and result["tma_reduces"] >= 1 and result["shared"] <= 232448, result
    off, on = (_ptxas_spills(job["ptx_to"]) for job in jobs)
    assert on <= VARLEN_BWD_MASK_S_SPILLS[variant] < off, (variant, off, on)


def test_ws_ready_counts_the_average_sequence():
    """ws_ready's thresholds see the average keys a sequence and the scores of sequences that long; CPU tensors
    never take the Gluon kernel."""
    module = attngen.load(_text("gvl_ready", "causal")).module
    q = torch.empty(4096, 16, 128, dtype=torch.bfloat16)
    assert not module.ws_ready(q, q, q, q, 8)  # not on a GPU
    assert module.WS_SHAPE["min_scores"] > 0 and module.WS_CAUSAL is False


@pytest.mark.usefixtures("gluon_varlen_backward")
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


def _ptxas_spills(ptx_path):
    """Bytes a thread spills in attn_bwd_dkdv_ws (stores), from `ptxas -v` on the PTX for sm_90a."""
    import subprocess

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx_path, "-o", os.devnull], capture_output=True,
                         text=True, check=True).stderr
    return int(out.split("bytes spill stores")[0].rsplit(",", 1)[1])


VARLEN_BWD_SPILLS = {"causal": 268, "gqa": 268, "softcap_window": 760, "alibi": 100, "none": 0}
"""Bytes a thread of the varlen Gluon backward spills (ptxas -v, sm_90a), by SPECS_VARLEN entry, as measured with lse
and delta read by TMA from the rows' shifted copies (ROWS_SMEM, as the dense kernel reads them; by pointer, with
hopper.VARLEN_ROWS_SMEM off: 676, 676, 1212, 36, 0); its dense form's (the same spec's variant kernel over
rectangular batches) were 96, 96, 352, 72, 0, and the plain dense causal d=128 kernel's 16. Most of the excess is
the sequence's sizes and offsets (n_q, n_k, q_start, k_start), loaded from memory, so held in registers through the
loop, where the dense kernel rematerialises its sizes from its arguments (with them taken from arguments instead, 140
bytes at causal d=128, before the varlen epilogue, K/V zeroing and the masked delta were added)."""


@pytest.mark.usefixtures("gluon_varlen_backward")
def test_the_varlen_backward_compiles_for_sm90_and_spills_no_more_than_measured(tmp_path, monkeypatch):
    """The Gluon varlen backward compiles for sm_90 (TMA loads and dQ reductions, row-masked dK and dV stores where
    the dense kernel has none), and ptxas spills no more than VARLEN_BWD_SPILLS in it (in the packed order: the
    ordered kernel's compile has its own test)."""
    monkeypatch.setattr(hopper, "VARLEN_BWD_SCHEDULE", False)
    cases = [("causal", 128, "bf16"), ("gqa", 128, "bf16"), ("softcap_window", 128, "bf16"), ("alibi", 64, "fp16"),
             ("none", 64, "fp16")]
    jobs = []
    for variant, d, dtype in cases:
        for layout in ("varlen", "dense"):
            text = _text(f"gvlb_sm90_{variant}_{d}", variant, d, dtype, direction="forward+backward")
            if layout == "dense":  # the same spec over rectangular batches, a variant where varlen's is one
                text = text.replace("    layout = varlen\n", "" if variant not in ("causal", "gqa", "none")
                                    else "    sinks = true\n")
            kernel = attngen.load(text)
            jobs.append((kernel.module.WS_BWD_SHAPE, {"path": str(kernel.path), "gluon_ws": "backward",
                                                     "ptx_to": str(tmp_path / f"{variant}_{d}_{layout}.ptx")}))
    # and each consumer's own keys' dQ (DQ_LOCAL: d=64 without a mask from 1024 rows a sequence on average)
    jobs.append((jobs[-2][0], dict(jobs[-2][1], dq_local=True, ptx_to=str(tmp_path / "dq_local.ptx"))))
    results = probe([job for _, job in jobs])
    for (shape, job), result in zip(jobs, results):
        assert "error" not in result, (job, result)
        assert result["warps"] == 4 * (1 + shape["consumers"]) and result["wgmma"] > 0, result
        assert result["tma_loads"] >= 4 and result["tma_reduces"] >= 1 and result["shared"] <= 232448, result
    for i, (variant, _, _) in enumerate(cases):
        varlen, dense = results[2 * i], results[2 * i + 1]
        assert varlen["global_stores"] > 0 and dense["global_stores"] == 0, (varlen, dense)
        # lse and delta by TMA in both (ROWS_SMEM): one load more than the pointer path's
        assert varlen["tma_loads"] == dense["tma_loads"], (varlen, dense)
        spills = [_ptxas_spills(jobs[2 * i + j][1]["ptx_to"]) for j in (0, 1)]
        assert spills[0] <= VARLEN_BWD_SPILLS[variant], (variant, spills)


@pytest.mark.parametrize("variant, d, dtype", [("causal", 128, "bf16"), ("alibi", 64, "fp16")])
def test_the_ordered_varlen_backward_compiles_for_sm90(monkeypatch, tmp_path, variant, d, dtype):
    """hopper.VARLEN_BWD_SCHEDULE on: the Gluon varlen backward that reads its tile from ORDER compiles for sm_90 and
    spills no more than the packed order's (VARLEN_BWD_SPILLS)."""
    monkeypatch.setattr(hopper, "VARLEN_BACKWARD", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_SCHEDULE", True)
    kernel = attngen.load(_text(f"gvlb_sm90_order_{variant}", variant, d, dtype, direction="forward+backward"))
    assert "ORDER" in inspect.signature(kernel.module.attn_bwd_dkdv_ws.fn).parameters
    ptx = str(tmp_path / "ordered.ptx")
    # and the order's kernel (a sort of 16384 lanes: ORDER_TILES' largest block) as its launch compiles it
    strides = ("stride_cu_seqlens_q_0", "stride_cu_seqlens_k_0", "stride_seqlens_k_0")
    order_job = {"path": str(kernel.path), "kernel": "attn_bwd_order_ws", "num_warps": 8, "num_stages": 1,
                 "constexprs": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK": hopper.VARLEN_BWD_ORDER_TILES},
                 "ptr_dtypes": dict.fromkeys(("ORDER", "CU_SEQLENS_Q", "CU_SEQLENS_K", "SEQLENS_K"), "*i32"),
                 "unit_strides": strides}
    result, order = probe([{"path": str(kernel.path), "gluon_ws": "backward", "ptx_to": ptx}, order_job])
    assert "error" not in result and "error" not in order, (result, order)
    assert result["tma_loads"] >= 4 and result["tma_reduces"] >= 1 and result["shared"] <= 232448, result
    assert _ptxas_spills(ptx) <= VARLEN_BWD_SPILLS[variant]


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


def _gpu_case(variant, lengths):
    """(lens_q, lens_k, heads, kv_heads, tensors) of a GPU test: LENGTHS[lengths], the variant's heads, and its
    run-time tensors (ALiBi slopes per sequence and head, sinks per head)."""
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
    return lens_q, lens_k, heads, kv_heads, tensors


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon forward runs on sm_90 only")
@pytest.mark.parametrize("lengths", sorted(LENGTHS))
@pytest.mark.parametrize("variant", sorted(SPECS_VARLEN))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gluon_varlen_forward_against_float64(variant, head_dim, lengths, monkeypatch):
    kernel = attngen.load(_text(f"gvl_gpu_{variant}_{head_dim}", variant, head_dim))
    monkeypatch.setitem(kernel.module.WS_SHAPE, "min_scores", 0)  # the Gluon kernel at every size here
    monkeypatch.setitem(kernel.module.WS_SHAPE, "min_keys", 1)
    lens_q, lens_k, heads, kv_heads, tensors = _gpu_case(variant, lengths)
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


def _run_backward(kernel, lens_q, lens_k, heads, kv_heads, tensors=None, seqused=None, tail=100, seed=0):
    """The Gluon varlen backward on packed q, k, v, do of these lengths followed by `tail` rows that belong to no
    sequence (its K/V rows, and those past seqused_k, NaN), after the forward (then out's tail NaN, lse's 0: the
    forward leaves them as they were); dq, dk and dv are poisoned with NaN first, and their tail rows hold a sentinel. Checks that the Gluon kernel ran; that dk and dv are exactly 0 in
    their tail and past seqused_k (zero_unused_keys writes them before the kernel, and a key tile that ends past its
    sequence stores row-masked, so a stray store would leave its value there); that dq's tail, which no
    sequence's rows reach but a tile's dQ reductions past its last sequence's rows do, got exactly 0 (dS is 0 past a
    sequence: the row pass writes 0 there and the reductions add only zeros); that every row of every sequence was
    written (finite). Returns (q, k, v, do, dq, dk, dv, cu_q, cu_k, grads[3:]) over the sequences' rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    d, dt = kernel.spec.head_dim, kernel.spec.dtype.torch
    make = lambda n, h: torch.randn((n, h, d), generator=g, device="cuda").to(dt)
    total_q, total_k = sum(lens_q), sum(lens_k)
    q, k, v = make(total_q + tail, heads), make(total_k + tail, kv_heads), make(total_k + tail, kv_heads)
    do = make(total_q + tail, heads)
    cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
    used = seqused if seqused is not None else cu_k[1:] - cu_k[:-1]
    unused = torch.zeros(total_k + tail, dtype=torch.bool, device="cuda")
    unused[total_k:] = True
    for b, n in enumerate(used.tolist()):
        unused[int(cu_k[b]) + n:int(cu_k[b + 1])] = True
    k[unused], v[unused] = float("nan"), float("nan")
    module = kernel.module
    out, lse = module.forward_varlen(q, k, v, cu_q, cu_k, used, **(tensors or {}))
    # the rows past the sequences, which the forward leaves as they were: NaN out, a finite lse (P would not be 0)
    out[total_q:], lse[:, total_q:] = float("nan"), 0.0
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    dq[total_q:] = 7.0
    dk[unused], dv[unused] = 7.0, 7.0
    called = []
    launch = module.launch_attn_bwd_ws
    module.launch_attn_bwd_ws = lambda *a, **kw: (called.append(1), launch(*a, **kw))[1]
    try:
        grads = module.backward_varlen(q, k, v, out, lse, do, cu_q, cu_k, used, dq=dq, dk=dk, dv=dv,
                                       **(tensors or {}))
    finally:
        module.launch_attn_bwd_ws = launch
    torch.cuda.synchronize()
    assert called, "the Gluon backward did not run"
    assert (dk[unused] == 0).all() and (dv[unused] == 0).all(), "a key row no sequence uses is not 0 (a stray store?)"
    assert (dq[total_q:] == 0.0).all(), "a query tile's dQ added non-zero past its sequence"
    assert dq[:total_q].isfinite().all() and dk[~unused].isfinite().all() and dv[~unused].isfinite().all()
    return q[:total_q], k, v, do[:total_q], dq[:total_q], dk, dv, cu_q, cu_k, grads[3:]


def _check_backward(kernel, q, k, v, do, dq, dk, dv, cu_q, cu_k, used=None, tensors=None):
    """Each sequence's dq, dk, dv (its first seqused_k keys) against float64 autograd of the sequence alone."""
    from attngen.testing.accuracy import compare_grads

    from test_varlen import _per_sequence, _sequence

    for b in range(cu_q.shape[0] - 1):
        n = int(used[b]) if used is not None else int(cu_k[b + 1] - cu_k[b])
        if n == 0 or cu_q[b + 1] == cu_q[b]:
            continue
        qs, dos, dqs = (_sequence(t, cu_q, b) for t in (q, do, dq))
        ks, vs, dks, dvs = (_sequence(t, cu_k, b)[:, :, :n] for t in (k, v, dk, dv))
        seq_tensors = _per_sequence(tensors or {}, b)
        got = (dqs, dks, dvs) + ((torch.zeros_like(seq_tensors["sinks"]),) if kernel.spec.variant.sinks else ())
        for r in compare_grads(kernel.spec, qs, ks, vs, dos, got, tensors=seq_tensors)[:3]:
            assert r.ok, f"sequence {b}: {r}"


@pytest.mark.usefixtures("gluon_varlen_backward_scheduled")
@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
@pytest.mark.parametrize("lengths", sorted(LENGTHS))
@pytest.mark.parametrize("variant", GLUON_BACKWARD_VARIANTS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gluon_varlen_backward_against_float64(variant, head_dim, lengths, monkeypatch):
    """dq, dk, dv per sequence against float64 at real sizes (unequal lengths, 0 and 1, seq_q != seq_k both ways, or
    documents), causal and not, GQA, softcap with a window, ALiBi, sinks (their gradient against float64 autograd
    of the per-sequence references, summed)."""
    kernel = attngen.load(_text(f"gvlb_gpu_{variant}_{head_dim}", variant, head_dim, direction="forward+backward"))
    monkeypatch.setitem(kernel.module.WS_BWD_SHAPE, "min_scores", 0)  # the Gluon kernels at every size here
    monkeypatch.setitem(kernel.module.WS_SHAPE, "min_scores", 0)
    lens_q, lens_k, heads, kv_heads, tensors = _gpu_case(variant, lengths)
    # (the sinks' gradient sums over the sequences' rows only: the tail's count nothing)
    q, k, v, do, dq, dk, dv, cu_q, cu_k, rest = _run_backward(kernel, lens_q, lens_k, heads, kv_heads, tensors)
    _check_backward(kernel, q, k, v, do, dq, dk, dv, cu_q, cu_k, tensors=tensors)
    if "sinks" in tensors:
        from test_varlen import sinks_gradient

        expected = sinks_gradient(kernel, q, k, v, do, cu_q, cu_k, tensors["sinks"])
        torch.testing.assert_close(rest[0].double(), expected, atol=5e-2, rtol=2e-2)


@pytest.mark.usefixtures("gluon_varlen_backward_scheduled")
@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
def test_gluon_varlen_backward_seqused_k(monkeypatch):
    """seqused_k shorter than the sequences' keys: the rows past it NaN in K and V (zeroed in shared memory: dQ and
    dS must not see them) and their dk, dv rows left as they were."""
    kernel = attngen.load(_text("gvlb_gpu_used", "gqa", direction="forward+backward"))
    monkeypatch.setitem(kernel.module.WS_BWD_SHAPE, "min_scores", 0)
    lens_q, lens_k = [300, 1, 0, 650, 64], [700, 1, 40, 650, 1000]
    used = torch.tensor([500, 1, 0, 129, 1000], dtype=torch.int32, device="cuda")
    q, k, v, do, dq, dk, dv, cu_q, cu_k, _ = _run_backward(kernel, lens_q, lens_k, 8, 2, seqused=used, seed=5)
    _check_backward(kernel, q, k, v, do, dq, dk, dv, cu_q, cu_k, used=used)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_gluon_varlen_backward_persistent_with_few_programs(programs, lean, monkeypatch):
    """hopper.VARLEN_BWD_PERSISTENT with 1, 3 or 7 programs: each takes many key tiles in turn (the ring's, dS
    buffers' and K/V barrier's phases carried across them, tiles without queries and tiles past their sequence among
    them), GQA, seqused_k shorter than some sequences; gradients against float64 per sequence."""
    monkeypatch.setattr(hopper, "VARLEN_BACKWARD", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_SCHEDULE", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_PERSISTENT", True)
    monkeypatch.setattr(hopper, "VARLEN_BWD_LEAN", lean)
    kernel = attngen.load(_text("gvlb_gpu_persistent", "gqa", direction="forward+backward"))
    monkeypatch.setitem(kernel.module.WS_BWD_SHAPE, "min_scores", 0)
    monkeypatch.setattr(kernel.module, "_ws_programs", lambda device: programs)
    lens_q, lens_k = [300, 1, 0, 650, 64, 513], [700, 1, 40, 650, 1000, 200]
    used = torch.tensor([500, 1, 0, 129, 1000, 200], dtype=torch.int32, device="cuda")
    q, k, v, do, dq, dk, dv, cu_q, cu_k, _ = _run_backward(kernel, lens_q, lens_k, 8, 2, seqused=used, seed=7)
    _check_backward(kernel, q, k, v, do, dq, dk, dv, cu_q, cu_k, used=used)


@pytest.mark.usefixtures("gluon_varlen_backward_scheduled")
@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
def test_flash_attn_varlen_funcs_backward_takes_the_gluon_kernel(monkeypatch):
    """The drop-in's backward at the bench's problem (8 causal documents packed into 16k tokens, d=128, H=16)
    launches the Gluon backward (its builtin kernel's `launch_attn_bwd_ws`, counted), and its gradients match
    float64 per sequence."""
    from attngen.api import varlen as api
    from attngen.lang.builtin import NO_WINDOW
    from attngen.runtime.registry import resolve

    from test_varlen import _check_grads

    g = torch.Generator(device="cuda").manual_seed(13)
    cuts = sorted(torch.randperm(16383, generator=torch.Generator().manual_seed(13))[:7].add(1).tolist())
    lens = [b - a for a, b in zip([0] + cuts, cuts + [16384])]
    q, k, v = (torch.randn(16384, 16, 128, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
               for _ in range(3))
    cu = _offsets(lens)
    plan = api._checked_plan(q, k, v, cu, cu, max(lens), max(lens), 0.0, None, True, NO_WINDOW, 0.0, None, None,
                             None, None)
    kernel = resolve(plan.key)
    called = []
    launch = kernel.module.launch_attn_bwd_ws
    monkeypatch.setattr(kernel.module, "launch_attn_bwd_ws", lambda *a, **kw: (called.append(1), launch(*a, **kw))[1])
    out = attngen.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    do = torch.randn(out.shape, generator=g, device="cuda").to(out.dtype)
    out.backward(do)
    torch.cuda.synchronize()
    assert called, "flash_attn_varlen_func's backward did not launch the Gluon varlen kernel"
    _check_grads(kernel, q, k, v, cu, cu, do)
