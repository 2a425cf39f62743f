"""attngen.attention as a drop-in for torch SDPA; Kernel argument checking; torch.compile."""

import pytest
import torch
import torch.nn.functional as F

import attngen
from attngen import KernelInputError
from conftest import DEVICE, empty_plans, spec_text


def rand(*shape, dtype=torch.float16):
    return torch.randn(*shape, device=DEVICE, dtype=torch.float32).to(dtype)


def sdpa64(q, k, v, **kw):
    """torch's own SDPA (math backend) in float64: the semantics attention() must match."""
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("n_q,n_k", [(37, 37), (20, 45), (45, 20)])
def test_matches_sdpa_semantics(is_causal, n_q, n_k):
    q, k, v = rand(2, 3, n_q, 64), rand(2, 3, n_k, 64), rand(2, 3, n_k, 64)
    out = attngen.attention(q, k, v, is_causal=is_causal)
    ref = sdpa64(q, k, v, is_causal=is_causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert (out.double() - ref).abs().max().item() < 5e-3


def test_gqa_and_scale_and_3d():
    q, k, v = rand(1, 8, 30, 32), rand(1, 2, 40, 32), rand(1, 2, 40, 32)
    out = attngen.attention(q, k, v, scale=0.2, enable_gqa=True)
    ref = sdpa64(q, k, v, scale=0.2, enable_gqa=True)
    assert (out.double() - ref).abs().max().item() < 5e-3
    q3, k3, v3 = rand(2, 10, 32), rand(2, 12, 32), rand(2, 12, 32)
    out3 = attngen.attention(q3, k3, v3)
    assert out3.shape == q3.shape
    assert (out3.double() - sdpa64(q3, k3, v3)).abs().max().item() < 5e-3


@pytest.mark.parametrize("call,match", [
    (lambda q, k, v: attngen.attention(q, k, v, attn_mask=torch.ones(1)), "attn_mask"),
    (lambda q, k, v: attngen.attention(q, k, v, dropout_p=0.1), "dropout_p"),
    (lambda q, k, v: attngen.attention(q, k[:, :2], v[:, :2]), "enable_gqa"),
    (lambda q, k, v: attngen.attention(q[..., :40], k[..., :40], v[..., :40]), "multiple of 16"),
    (lambda q, k, v: attngen.attention(q.double(), k.double(), v.double()), "float64"),
    (lambda q, k, v: attngen.attention(q, k[..., :32], v), "query and key must share a head dim"),
    (lambda q, k, v: attngen.attention(q, k, v[..., :40]), "value has head dim 40"),  # (v[..., :32]: head_dim_v)
    (lambda q, k, v: attngen.attention(q[0, 0], k[0, 0], v[0, 0]), "got shape"),
    (lambda q, k, v: attngen.attention(q, k, v, scale=float("nan")), "scale"),
])
def test_sdpa_argument_errors(call, match):
    q, k, v = rand(1, 4, 8, 64), rand(1, 4, 8, 64), rand(1, 4, 8, 64)
    with pytest.raises((KernelInputError, ValueError), match=match):
        call(q, k, v)


@pytest.fixture(scope="module")
def kernel():
    return attngen.load(spec_text("checked", 64, "fp16", "causal", heads=4, kv_heads=2))


@pytest.mark.parametrize("mutate,match", [
    (lambda q, k, v: (q.float(), k, v), "q has dtype torch.float32"),
    (lambda q, k, v: (q[..., :32], k, v), "q has head_dim 32"),
    (lambda q, k, v: (q[0], k, v), "q must have 4 dimensions"),
    (lambda q, k, v: (q, k[:1], v[:1]), "batch"),
    (lambda q, k, v: (q, k, v[:, :, :5]), "same shape"),
    (lambda q, k, v: (q[:, :3], k, v), "3 heads"),
    (lambda q, k, v: (q, k[:, :1], v[:, :1]), "kv_heads = 2"),
    (lambda q, k, v: (q.tolist(), k, v), "torch.Tensor"),
])
def test_kernel_rejects_bad_tensors_naming_the_argument(kernel, mutate, match):
    q, k, v = rand(2, 4, 8, 64), rand(2, 2, 8, 64), rand(2, 2, 8, 64)
    with pytest.raises((KernelInputError, TypeError), match=match):
        kernel(*mutate(q, k, v))


def test_cpu_tensors_outside_the_interpreter_are_rejected(kernel, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelInputError, match="on the CPU"):
        kernel(torch.randn(1, 4, 8, 64).half(), torch.randn(1, 2, 8, 64).half(), torch.randn(1, 2, 8, 64).half())


def test_kernel_object_exposes_source_and_spec(kernel):
    assert kernel.spec.name == "checked" and "@triton.jit" in kernel.source
    assert kernel.path.read_text() == kernel.source
    assert attngen.load(spec_text("checked", 64, "fp16", "causal", heads=4, kv_heads=2)) is kernel


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["d64 causal 3-D", "d128 gqa n_q != n_k", "d64 long"])
def test_replayed_inference_calls_compute_what_the_kernel_computes(case, monkeypatch):
    """On the GPU, an inference call whose signature repeats replays, from its third call on, the launches
    of its second (attngen/runtime/replay.py): each call, on fresh inputs at new addresses, matches float64 SDPA
    and is bit for bit the kernel's own path (replays off). "d64 long" takes the Gluon forward on sm_90."""
    from attngen.runtime import autograd, replay

    empty_plans(monkeypatch)
    replayed = []
    real_call = replay.Replay.__call__
    monkeypatch.setattr(replay.Replay, "__call__", lambda self, inputs: replayed.append(real_call(self, inputs))
                        or replayed[-1])
    dtype = torch.bfloat16 if "long" in case else torch.float16
    if "3-D" in case:
        shapes, kw = ((16, 130, 64), (16, 77, 64)), {"is_causal": True}
    elif "gqa" in case:
        shapes, kw = ((2, 8, 100, 128), (2, 2, 300, 128)), {"enable_gqa": True, "scale": 0.1}
    else:
        shapes, kw = ((4, 16, 2048, 64), (4, 16, 2048, 64)), {}
    for i in range(4):
        q, k, v = rand(*shapes[0], dtype=dtype), rand(*shapes[1], dtype=dtype), rand(*shapes[1], dtype=dtype)
        got = attngen.attention(q, k, v, **kw)
        assert (got.double() - sdpa64(q, k, v, **kw)).abs().max().item() < (2e-2 if dtype == torch.bfloat16 else 5e-3)
        with monkeypatch.context() as m:  # the kernel's own path: a fresh plan, no replay recorded
            empty_plans(m)
            m.setattr(autograd, "record", lambda fn, inputs: (fn(), None))
            for _ in range(3):
                want = attngen.attention(q, k, v, **kw)
        assert torch.equal(got, want), i
    assert replayed == [True, True]  # calls 3 and 4


def test_torch_compile_keeps_one_graph():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    def block(q, k, v):
        return attngen.attention(q * 2, k, v, is_causal=True) + 1

    compiled = torch.compile(block, backend=counter, fullgraph=True)
    q, k, v = rand(1, 2, 16, 32), rand(1, 2, 16, 32), rand(1, 2, 16, 32)
    out = compiled(q, k, v)
    assert counter.frame_count == 1
    assert (out.double() - (sdpa64(q * 2, k, v, is_causal=True) + 1)).abs().max().item() < 5e-3
    assert torch.ops.attngen.forward.default._schema.name == "attngen::forward"


def test_eager_calls_do_not_import_dynamo():
    """Eager calls, with gradients too, go through a plain autograd.Function: a custom op's first
    call imports torch._dynamo, which took seconds of a cached process's first result (GPU
    machine, benchmarks/compile_time.py --profile), and registering the custom ops 0.1 s: neither
    happens outside torch.compile. Checked in a fresh process."""
    import os
    import subprocess
    import sys

    child = (
        "import sys, torch, attngen\n"
        "q, k, v = (torch.randn(1, 2, 24, 32, device=sys.argv[1], requires_grad=True) for _ in range(3))\n"
        "out = attngen.attention(q, k, v, is_causal=True)\n"
        "out.sum().backward()\n"
        "with torch.no_grad():\n"
        "    attngen.attention(q, k, v)\n"
        "ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)\n"
        "assert (out.double() - ref).abs().max().item() < 1e-4 and q.grad is not None and v.grad is not None\n"
        "print('torch._dynamo' in sys.modules, 'attngen.runtime.ops' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", child, DEVICE], capture_output=True, text=True,
                          env=dict(os.environ), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False False"
