"""Distance biases (ALiBi and its kin) split into a key term and a row term (analysis/distance.py,
policy/hopper.py LINEAR_DISTANCE and LINEAR_DISTANCE_MASKED).

On the CPU: the decomposition of score modifiers; which programs' Gluon kernels take the split form; the generated
Gluon forward's online-softmax step (`_ws_variant_softmax`, run as Python over torch tensors) over every key block of
query tiles, against attention built from the full score matrix in float64, the split form and the |.| form alike;
the context-parallel ring's choice of the abs-free ALiBi spec for a block (`ring.alibi_side`) against its kept pairs
counted one by one; the kernels compile for sm_90. On a Hopper GPU (`gpu`): the context-parallel blocks' ALiBi specs
against float64 at real sizes.
"""

import ast
import math
import re
import textwrap

import pytest
import sympy
import torch

import attngen
from attngen.analysis.distance import any_distance, distance_bias, linear_distance
from attngen.codegen import render
from attngen.distributed import ring
from attngen.distributed.schedule import Block
from attngen.ir import sym
from attngen.lang.builtin import NO_WINDOW, positional_alibi_spec
from attngen.lang.spec import parse
from attngen.passes import compile_program
from attngen.policy import hopper
from conftest import HAS_GPU, spec_text
from probe import probe

HOPPER = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)
S, Q, K = sym.S, sym.q_idx, sym.k_idx
SLOPE = sympy.Function("ALIBI_SLOPES")(sym.b, sym.q_head)
SHIFT = sympy.Function("ARG_shift")(sym.b)


# -- the decomposition ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fn, absolute", [
    (1.0 * S - 1.4426950408889634 * SLOPE * sympy.Abs(K - Q), True),  # attention()'s ALiBi, top-left
    (S - SLOPE * sympy.Abs(Q + sym.N_K - sym.N_Q - K), True),  # bottom-right
    (S - SLOPE * sympy.Abs(Q - K + SHIFT), True),  # a context-parallel block's
    (S - SLOPE * (Q - K + SHIFT), False),  # ... below the diagonal
    (S - SLOPE * (K - Q - SHIFT), False),  # ... above it
    (2 * S + 3 * (Q - K) + 5, False),  # a linear relative bias with a constant
    (S - 0.5 * sympy.Abs(Q - K - 7) + SLOPE, True),
])
def test_distance_biases_decompose_into_the_form_they_stand_for(fn, absolute):
    bias = distance_bias(fn)
    assert bias is not None and bias.absolute is absolute
    assert sympy.simplify(bias.at(S, Q, K) - fn) == 0
    for e in (bias.coef, bias.shift, bias.rest):
        assert not e.has(Q, K, S)


@pytest.mark.parametrize("fn", [
    30 * sympy.tanh(S / 30),  # softcap
    S,  # no positions
    S - sympy.Abs(Q - K) - sympy.Abs(Q - K - 5),  # two distances
    S - sympy.Abs(2 * Q - K),  # not a distance
    S - SLOPE * sympy.Abs(Q - K) * Q,  # a coefficient that varies along the rows
    S * S - sympy.Abs(Q - K),  # not linear in the score
    -S - sympy.Abs(Q - K),  # a negative alpha turns the running max around
    S - (Q - K) ** 2,
    S + sym.FloorDivS(Q - K, 4),
])
def test_other_modifiers_are_no_distance_bias(fn):
    assert distance_bias(fn) is None


def _program(text):
    spec = parse(text)
    return spec, compile_program(spec)


def _alibi_text(name, mask, direction="forward"):
    return spec_text(name, 128, "bf16", mask, score="alibi", direction=direction)


@pytest.mark.parametrize("text, linear, masked", [
    (_alibi_text("gd_causal", "causal"), True, True),  # every kept distance >= 0
    (_alibi_text("gd_none", "none"), False, False),  # both signs: the |.| form everywhere
    (_alibi_text("gd_window", "window(200, 70)"), False, True),  # both sides of the diagonal
    (_alibi_text("gd_causal_window", "window(300)"), True, True),  # (window(n): the n keys up to the query)
    (positional_alibi_spec("bf16", 128, True), False, True),  # shift[b] of unknown sign
    (positional_alibi_spec("bf16", 128, False, side="below"), True, False),
    (positional_alibi_spec("bf16", 128, False, side="above"), True, False),
    (positional_alibi_spec("bf16", 128, True, side="below"), True, True),
    (spec_text("gd_softcap", 128, "bf16", "causal", score="softcap(30)"), False, True),
])
def test_the_gluon_kernels_take_the_split_form_where_it_holds_on_every_block(text, linear, masked, monkeypatch):
    spec, program = _program(text)
    assert (linear_distance(program.kernel("attn_fwd")) is not None) is linear
    both_signs = any_distance(program.kernel("attn_fwd")) is not None and not linear
    for masked_too in (False, True):  # the policy takes masked programs only where LINEAR_DISTANCE_MASKED says
        for by_block in (False, True):  # and blocks of both signs only where LINEAR_DISTANCE_BY_BLOCK says
            monkeypatch.setattr(hopper, "LINEAR_DISTANCE_MASKED", masked_too)
            monkeypatch.setattr(hopper, "LINEAR_DISTANCE_BY_BLOCK", by_block)
            ws = compile_program(spec).warp_specialized
            expected = linear and (masked_too or not masked)
            assert ws.forward.distance is expected and (ws.backward is None or ws.backward.distance is expected)
            assert ws.forward.distance_by_block is (both_signs and by_block and not masked)
    monkeypatch.setattr(hopper, "LINEAR_DISTANCE", False)
    assert not compile_program(spec).warp_specialized.forward.distance


# -- the generated online-softmax step, run as Python -------------------------------------------------------


class _TorchGl:
    """The gl calls `_ws_variant_softmax` and its key-block function make, on torch tensors (and Python integers)."""

    float32 = torch.float32

    @staticmethod
    def SliceLayout(*_):
        return None

    @staticmethod
    def arange(a, b, layout=None):
        return torch.arange(a, b)

    @staticmethod
    def max(x, axis):
        return x.max(axis).values

    @staticmethod
    def sum(x, axis):
        return x.sum(axis)

    @staticmethod
    def maximum(a, b):
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b)) if torch.is_tensor(a) or torch.is_tensor(b) \
            else max(a, b)

    @staticmethod
    def minimum(a, b):
        return torch.minimum(torch.as_tensor(a), torch.as_tensor(b)) if torch.is_tensor(a) or torch.is_tensor(b) \
            else min(a, b)

    @staticmethod
    def cdiv(a, b):
        return -(-a // b)

    @staticmethod
    def where(c, a, b):
        return torch.where(torch.as_tensor(c), torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32))

    @staticmethod
    def exp2(x):
        return torch.exp2(x)

    @staticmethod
    def abs(x):
        return x.abs()

    @staticmethod
    def full(shape, value, dtype, layout=None):
        return torch.full(tuple(shape), value, dtype=dtype)

    @staticmethod
    def zeros(shape, dtype, layout=None):
        return torch.zeros(tuple(shape), dtype=dtype)

    @staticmethod
    def zeros_like(x):
        return torch.zeros_like(x)


def _function(source, name):
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    fn.decorator_list = []
    for a in fn.args.args:
        a.annotation = None
    code = ast.unparse(fn).replace("m_new.type.layout", "None")  # (a Gluon tensor's layout; torch's has none)
    scope = {"gl": _TorchGl}
    exec(compile(code, name, "exec"), scope)
    return scope[name]


def _run_tiles(source, q, k, v, sm_scale, reads: dict, block_m, block_n):
    """The generated forward's softmax steps over every query tile of [N_Q] rows (one warpgroup a tile) and the key
    blocks `_ws_key_blocks` gives it, as the Gluon consumer makes them: (out, lse) in float64 from float32 steps."""
    step = _function(source, "_ws_variant_softmax")
    blocks = _function(source, "_ws_key_blocks")
    params = [a.arg for a in next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)
                                  and n.name == "_ws_variant_softmax").args.args]
    n_q, n_k = q.shape[0], k.shape[0]
    qk_scale = sm_scale * math.log2(math.e)
    scope = {"gl": _TorchGl, "BLOCK_N": block_n, "s_layout": None, **reads}
    kd = None
    if "kd" in params:  # the consumer's key term, c * (k - k0), as the template computes it once a tile
        line = re.search(r"^\s*kd = (.*?)  # c \* \(k - k0\)$", source, re.M).group(1)
        kd = eval(line, scope)
    pad = -(-n_k // block_n) * block_n
    kp = torch.zeros(pad + block_n, k.shape[1]); kp[:n_k] = k  # rows past N_K read as zeros (TMA)
    vp = torch.zeros(pad + block_n, v.shape[1]); vp[:n_k] = v
    out = torch.empty(n_q, v.shape[1], dtype=torch.float64)
    lse = torch.empty(n_q, dtype=torch.float64)
    for start_m in range(0, n_q, block_m):
        lo, full_lo, full_hi, n = blocks(start_m, n_q, n_k, block_m, block_n)
        rows = slice(start_m, start_m + block_m)
        qt = torch.zeros(block_m, q.shape[1]); qt[:min(block_m, n_q - start_m)] = q[rows]
        acc = torch.zeros(block_m, v.shape[1])
        m_i = l_i = None
        for i in range(n):
            j = lo + i
            sc = qt @ kp[j * block_n:(j + 1) * block_n].T
            args = dict(sc=sc, m_i=sc.max(1).values if i == 0 else m_i, l_i=sc.max(1).values if i == 0 else l_i,
                        j=j, full_lo=full_lo, full_hi=full_hi, row0=torch.tensor(start_m), N_Q=n_q, N_K=n_k, qk_scale=qk_scale,
                        kd=kd, FIRST=i == 0, BLOCK_N=block_n, layout=None, **reads)
            p, m_i, l_i, alpha = step(*(args[a] for a in params))
            acc = acc * alpha[:, None] + p @ vp[j * block_n:(j + 1) * block_n]
        live = min(block_m, n_q - start_m)
        l_safe = torch.where(l_i == 0, torch.ones_like(l_i), l_i)
        out[rows] = (acc / l_safe[:, None])[:live].double()
        lse[rows] = ((m_i + torch.log2(l_i)) * math.log(2))[:live].double()
    return out, lse


def _reference(q, k, v, sm_scale, keep, bias):
    """Attention from the full score matrix in float64: scores * sm_scale + bias where `keep`."""
    scores = q.double() @ k.double().T * sm_scale + bias
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, 1)
    p = torch.exp(scores - lse[:, None]).nan_to_num(0.0)
    return p @ v.double(), lse


def _positions(n_q, n_k):
    return torch.arange(n_q)[:, None].double(), torch.arange(n_k)[None, :].double()


CASES = {
    # name: (spec text, n_q, n_k, reads, the reference's keep and bias from (qi, kj, slope, shift))
    "causal_top_left": (_alibi_text("gdr_causal", "causal"), 150, 300, {"alibi_slopes": 0.37}, 0),
    "cp_below": (positional_alibi_spec("bf16", 128, False, side="below"), 140, 200, {"arg_slopes": 0.3, "arg_shift": 460.0}, 460),
    "cp_above": (positional_alibi_spec("bf16", 128, False, side="above"), 140, 200, {"arg_slopes": 0.3, "arg_shift": -200.0}, -200),
    "cp_causal_below": (positional_alibi_spec("bf16", 128, True, side="below"), 190, 190, {"arg_slopes": 0.5, "arg_shift": 0.0}, 0),
    "cp_abs": (positional_alibi_spec("bf16", 128, False), 140, 200, {"arg_slopes": 0.3, "arg_shift": 60.0}, 60),
    "none": (_alibi_text("gdr_none", "none"), 330, 390, {"alibi_slopes": 0.23}, 0),  # blocks on both sides
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("linear", [True, False])
def test_the_forward_step_matches_float64_over_every_key_block(case, linear, monkeypatch):
    monkeypatch.setattr(hopper, "LINEAR_DISTANCE", linear)
    monkeypatch.setattr(hopper, "LINEAR_DISTANCE_MASKED", True)  # (the split form under a causal mask too)
    monkeypatch.setattr(hopper, "LINEAR_DISTANCE_BY_BLOCK", linear)  # (and each block's own form where signs differ)
    text, n_q, n_k, reads, shift = CASES[case]
    spec, program = _program(text.replace("forward+backward", "forward"))
    source = render(spec, program)
    forward = program.warp_specialized.forward
    assert forward.distance is (linear and case not in ("cp_abs", "none"))
    assert forward.distance_by_block is (linear and case in ("cp_abs", "none"))
    assert ("kd = " in source) is linear
    torch.manual_seed(hash(case) % 1000)
    q, k, v = (torch.randn(n, 128) for n in (n_q, n_k, n_k))
    sm_scale = 0.125
    slope = next(x for name, x in reads.items() if "slope" in name)
    qi, kj = _positions(n_q, n_k)
    d = qi - kj + shift
    if case.startswith("causal") or case == "cp_causal_below":  # ("none": no mask)
        keep = kj <= qi + (shift if case.startswith("causal") else 0)
    else:
        keep = torch.ones(n_q, n_k, dtype=torch.bool)
    if case in ("cp_below", "cp_above"):  # the abs-free spec stands for |d| where d has the side's sign
        assert ((d >= 0) if case == "cp_below" else (d <= 0)).all()
    bias = -slope * d.abs()
    ref, ref_lse = _reference(q, k, v, sm_scale, keep, bias)
    for block_m, block_n in ((64, 128), (64, 64)):
        out, lse = _run_tiles(source, q, k, v, sm_scale, reads, block_m, block_n)
        live = torch.isfinite(ref_lse)
        assert torch.allclose(out[live], ref[live], atol=2e-5, rtol=1e-4), (out - ref).abs().max()
        assert torch.allclose(lse[live], ref_lse[live], atol=2e-4, rtol=1e-5), (lse - ref_lse).abs().max()


def _backward_pt(source):
    """The generated Gluon backward's P^T of the split form as a Python function of its names (its lines from the key
    term's coefficient to the last `pt = `, branches kept, and the positions held through the loop with them)."""
    held = re.findall(r"^    ((?:qa|kr) = .*)$", source, re.M)
    body = re.search(r"^        c = .*?^        (?:else:\n            )?pt = gl\.exp2\(.*?$", source, re.M | re.S).group(0)
    lines = [ln for ln in textwrap.dedent(body).splitlines() if not ln.strip().startswith("#")]
    code = "\n".join(ln.strip() for ln in held) + "\n" + "\n".join(lines)

    def pt(**names):
        scope = {"gl": _TorchGl, "col_s": None, "s_layout": None, **names}
        exec(code, scope)
        return scope["pt"]
    return pt


@pytest.mark.parametrize("case", ["causal_top_left", "cp_below", "cp_above", "cp_causal_below", "cp_abs", "none"])
def test_the_backward_recomputes_p_from_the_split_form(case, monkeypatch):
    """P^T of a key tile against a query block, as the generated backward computes it from the raw S^T and the rows'
    lse (base 2): exactly the float64 softmax's P where the mask keeps a pair (the kernel zeroes the others after);
    ALiBi without a mask step by step (LINEAR_DISTANCE_BY_BLOCK_BACKWARD), its steps below, across and above."""
    monkeypatch.setattr(hopper, "LINEAR_DISTANCE_MASKED", True)  # (the split form under a causal mask too)
    monkeypatch.setattr(hopper, "LINEAR_DISTANCE_BY_BLOCK_BACKWARD", True)
    text, n_q, n_k, reads, shift = CASES[case]
    spec, program = _program(text.replace("forward\n", "forward+backward\n"))
    backward = program.warp_specialized.backward
    assert backward.distance is (case not in ("cp_abs", "none")) and backward.distance_by_block is (not backward.distance)
    pt = _backward_pt(render(spec, program))
    torch.manual_seed(5)
    q, k, v = (torch.randn(n, 128) for n in (n_q, n_k, n_k))
    sm_scale = 0.125
    slope = next(x for name, x in reads.items() if "slope" in name)
    qi, kj = _positions(n_q, n_k)
    d = qi - kj + shift
    keep = kj <= qi + (shift if case.startswith("causal") else 0) if "causal" in case else torch.ones(n_q, n_k).bool()
    _, ref_lse = _reference(q, k, v, sm_scale, keep, -slope * d.abs())
    p_ref = torch.exp(q.double() @ k.double().T * sm_scale - slope * d.abs() - ref_lse[:, None])
    steps = [(m, r, 64, 64) for m, r in ((0, 0), (64, 0), (76, 64), (64, 126), (0, 126), (200, 0))
             if m + 64 <= n_q and r + 64 <= n_k]  # (steps across, below and above the diagonal)
    for start_m, row0, block_m, bn in steps:
        qs, ks = slice(start_m, start_m + block_m), slice(row0, row0 + bn)
        st = (k[ks] @ q[qs].T).float()
        got = pt(st=st, qk_scale=sm_scale * math.log2(math.e), lse=(ref_lse[qs] / math.log(2)).float(),
                 start_m=torch.tensor(start_m), row0=torch.tensor(row0), BLOCK_M=block_m, BN=bn,
                 cols=start_m + torch.arange(block_m), rows=row0 + torch.arange(bn), **reads)
        kept = keep[qs, ks].T
        assert torch.allclose(got[kept].double(), p_ref[qs, ks].T[kept], rtol=2e-5, atol=1e-7), case


# -- the ring's choice of spec ------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [
    Block(0, 64, 0, 64, True, NO_WINDOW, 0),  # a diagonal block: below
    Block(0, 64, 0, 64, True, NO_WINDOW, -1),  # shifted past its diagonal: straddles
    Block(0, 64, 0, 80, False, NO_WINDOW, 80),  # an earlier chunk's keys: below, at the edge
    Block(0, 64, 0, 80, False, NO_WINDOW, 79),
    Block(0, 64, 0, 80, False, NO_WINDOW, -63),  # a later chunk's: above, at the edge
    Block(0, 64, 0, 80, False, NO_WINDOW, -62),
    Block(0, 50, 0, 90, False, (10, 0), 0),  # a window left of the diagonal
    Block(0, 50, 0, 90, False, (10, 3), 0),
    Block(0, 50, 0, 90, False, (10, 3), 3),
    Block(0, 50, 0, 90, False, (0, 7), -7),  # a window to the right
    Block(0, 50, 0, 90, False, (-1, 5), 5),
])
def test_the_ring_takes_the_abs_free_spec_only_where_every_kept_pair_has_one_sign(block):
    nq, nk = block.q_end - block.q_start, block.k_end - block.k_start
    qi, kj = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    keep = torch.ones(nq, nk, dtype=torch.bool)
    if block.causal:
        keep &= kj <= qi
    left, right = block.window
    if left >= 0:
        keep &= kj >= qi - left
    if right >= 0:
        keep &= kj <= qi + right
    d = (qi - kj + block.shift)[keep]
    expected = "below" if (d >= 0).all() else "above" if (d <= 0).all() else None
    assert ring.alibi_side(block) == expected


def test_the_split_form_compiles_for_sm90(monkeypatch):
    monkeypatch.setattr(hopper, "LINEAR_DISTANCE_MASKED", True)
    jobs = []
    for name, text in (("gd_sm90_causal", _alibi_text("gd_sm90_causal", "causal", "forward+backward")),
                       ("gd_sm90_below", positional_alibi_spec("bf16", 128, False, side="below"))):
        kernel = attngen.load(text)
        assert "kd = " in kernel.path.read_text()
        jobs.append({"path": str(kernel.path), "gluon_ws": True, "ptxas": True})
    for result in probe(jobs):
        assert "error" not in result, result
        assert result["wgmma"] > 0 and result["spill_stores"] <= 64, result


# -- on a Hopper GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon forward runs on sm_90 only")
@pytest.mark.parametrize("side, causal, shift", [("below", True, 0), ("below", False, 4096), ("below", False, 1000),
                                                  ("above", False, -1000), (None, False, 300), (None, True, 0)])
def test_gpu_context_parallel_alibi_blocks_against_float64(side, causal, shift):
    from test_gluon_variants import _against_reference

    kernel = attngen.load(positional_alibi_spec("bf16", 128, causal, side=side))
    n_q, n_k = (1000, 1000) if causal else (1000, 1000)
    B, H = 2, 4
    q, k, v = (torch.randn(B, H, n, 128, device="cuda", dtype=torch.bfloat16) for n in (n_q, n_k, n_k))
    tensors = {"slopes": torch.rand(B, H, device="cuda") * 0.2,
               "shift": torch.full((B,), shift, dtype=torch.int32, device="cuda")}
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, n_q), float("nan"), device="cuda")
    kernel.module.forward(q, k, v, out=out, lse=lse, **tensors)
    _against_reference(kernel, q, k, v, out, lse, tensors)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
@pytest.mark.parametrize("side, causal, shift", [("below", True, 0), ("below", False, 1000), ("above", False, -1000),
                                                  (None, False, 300)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_context_parallel_alibi_blocks_backward_against_float64(side, causal, shift, head_dim, monkeypatch):
    B, H = 2, 4
    kernel = attngen.load(positional_alibi_spec("bf16", head_dim, causal, side=side))
    _gpu_backward_against_float64(kernel, head_dim, {"slopes": torch.rand(B, H, device="cuda") * 0.2,
                                                     "shift": torch.full((B,), shift, dtype=torch.int32, device="cuda")},
                                  monkeypatch)


def _gpu_backward_against_float64(kernel, head_dim, tensors, monkeypatch, n=777):
    """The Gluon backward (at every size: its thresholds zeroed) of `kernel`'s module on fresh (2, 4, n, head_dim)
    bf16 inputs, the gradients poisoned first, against float64 by the project's rule."""
    from test_gluon_variants_backward import _close, _reference_grads

    module, spec = kernel.module, kernel.spec
    for key in ("min_scores", "min_keys"):
        monkeypatch.setitem(module.WS_BWD_SHAPE, key, 0)
        monkeypatch.setitem(module.WS_SHAPE, key, 0)
    q, k, v, do = (torch.randn(2, 4, n, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = module.forward(q, k, v, **tensors)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    assert module.ws_bwd_ready(q, k, v, do, dk, dv)
    got = module.backward(q, k, v, out, lse, do, dq=dq, dk=dk, dv=dv, **tensors)
    ref = _reference_grads(spec, q, k, v, do, tensors, torch.float64)
    low = _reference_grads(spec, q, k, v, do, tensors, torch.bfloat16)
    for name, g, r, lo in zip(("dq", "dk", "dv"), got, ref, low):
        _close(name, g, r, lo, spec.dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon forward runs on sm_90 only")
@pytest.mark.parametrize("n_q, n_k", [(1000, 1000), (700, 1500), (1500, 700)])
@pytest.mark.parametrize("by_block", [True, False])
def test_gpu_alibi_without_a_mask_block_by_block_against_float64(n_q, n_k, by_block, monkeypatch):
    """ALiBi without a mask (blocks below, across and above the diagonal) with LINEAR_DISTANCE_BY_BLOCK on and off."""
    from test_gluon_variants import _against_reference

    monkeypatch.setattr(hopper, "LINEAR_DISTANCE_BY_BLOCK", by_block)
    kernel = attngen.load(_alibi_text("gd_gpu_none", "none"))
    assert kernel.program.warp_specialized.forward.distance_by_block is by_block
    module = kernel.module
    monkeypatch.setitem(module.WS_SHAPE, "min_scores", 0)
    monkeypatch.setitem(module.WS_SHAPE, "min_keys", 1)
    B, H = 2, 4
    q = torch.randn(B, H, n_q, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, H, n_k, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    tensors = {"alibi_slopes": torch.rand(B, H, device="cuda") * 0.2}
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, n_q), float("nan"), device="cuda")
    module.forward(q, k, v, out=out, lse=lse, **tensors)
    _against_reference(kernel, q, k, v, out, lse, tensors)


@pytest.mark.parametrize("raw_max", [True, False])
def test_a_variant_without_a_modifier_may_take_its_max_over_the_raw_scores(raw_max, monkeypatch):
    monkeypatch.setattr(hopper, "VARIANT_RAW_MAX", raw_max)
    spec, program = _program(spec_text("gd_raw", 128, "bf16", "causal & window(100)"))
    assert program.warp_specialized.forward.raw_max is raw_max
    source = render(spec, program)
    step = source[source.index("def _ws_variant_softmax"):source.index("def _ws_key_blocks")]
    assert ("gl.max(sc, 1) * qk_scale" in step) is raw_max
    n = 333
    torch.manual_seed(3)
    q, k, v = (torch.randn(n, 128) for _ in range(3))
    qi, kj = _positions(n, n)
    ref, ref_lse = _reference(q, k, v, 0.09, (kj <= qi) & (kj >= qi - 99), torch.zeros(n, n, dtype=torch.float64))
    out, lse = _run_tiles(source, q, k, v, 0.09, {}, 64, 128)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4) and torch.allclose(lse, ref_lse, atol=2e-4, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
@pytest.mark.parametrize("by_block", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_alibi_without_a_mask_backward_step_by_step_against_float64(by_block, head_dim, monkeypatch):
    """ALiBi without a mask, the backward with LINEAR_DISTANCE_BY_BLOCK_BACKWARD on and off (steps below, across and
    above the diagonal), against float64."""
    monkeypatch.setattr(hopper, "LINEAR_DISTANCE_BY_BLOCK_BACKWARD", by_block)
    kernel = attngen.load(spec_text("gd_gpu_none_bwd", head_dim, "bf16", "none", score="alibi",
                                    direction="forward+backward"))
    assert kernel.program.warp_specialized.backward.distance_by_block is by_block
    _gpu_backward_against_float64(kernel, head_dim, {"alibi_slopes": torch.rand(2, 4, device="cuda") * 0.2}, monkeypatch)
