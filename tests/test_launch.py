"""The short launch path (attngen/runtime/launch.py): a cached binary is only ever launched for arguments
Triton would have compiled that same binary for, with the arguments in Triton's order."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from conftest import DEVICE, HAS_GPU, ROOT

from attngen.runtime import launch
from attngen.runtime.launch import FastJIT


def _triton_specialization(x, specialize: bool = True):
    """What Triton 3.6's binder records for one non-constexpr argument."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    return native_specialize_impl(CUDABackend, x, False, specialize, True)


def _scalars():
    return [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31),
            -(2**31) - 1, 2**40, 2**63 - 1, 2**63, 2**64 - 16, 0.5, 1.0, 0.0, 3.0, None, True, False]


def _tensors():
    base = torch.empty(64, dtype=torch.bfloat16)
    return [base, base[1:], base[8:], base[3:], torch.empty(8, dtype=torch.float32),
            torch.empty(8, dtype=torch.float32)[1:], torch.empty(8, dtype=torch.int32)]


def test_signature_never_lumps_together_what_triton_tells_apart():
    """Two calls share FastJIT's key only when Triton's binder specialises every argument the same
    way: a key that lumped them together would launch a binary compiled for the other. (Scalars are
    keyed by value and type, finer than Triton; tensors exactly as Triton does: dtype, alignment.)"""
    fast = FastJIT.__new__(FastJIT)
    fast.learn((0,), 2)
    calls = [(t, x) for t in _tensors() for x in _scalars()]
    keys = [fast.signature(c, {})[0] for c in calls]
    specs = [tuple(_triton_specialization(a) for a in c) for c in calls]
    for i, j in itertools.combinations(range(len(calls)), 2):
        if keys[i] == keys[j]:
            assert specs[i] == specs[j], (calls[i][1], calls[j][1], specs[i], specs[j])
        if calls[i][1] is calls[j][1] or (type(calls[i][1]) is type(calls[j][1]) and calls[i][1] == calls[j][1]):
            # the same scalar: the keys differ exactly where Triton tells the tensors apart
            assert (keys[i] == keys[j]) == (specs[i][0] == specs[j][0])


class _FakeCompiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    def run(self, *args):
        self.log.append(("cached", args))


class _FakeJIT:
    """Enough of a triton.JITFunction for FastJIT: params and `fn[grid](...)`."""

    def __init__(self, names, constexprs, do_not_specialize=()):
        self.params = [SimpleNamespace(name=n, is_constexpr=n in constexprs, do_not_specialize=n in do_not_specialize)
                       for n in names]
        self.log, self.compiled = [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            self.compiled.append(_FakeCompiled(self.log))
            return self.compiled[-1]
        return launch


@pytest.fixture
def no_hooks(monkeypatch):
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None)
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_raw_stream", lambda device: 1234)


def test_repeat_call_goes_to_the_cached_binary_in_triton_argument_order(no_hooks):
    fn = _FakeJIT(["X", "n", "s", "BLOCK", "D"], constexprs=("BLOCK", "D"))
    fast = FastJIT(fn)
    x = torch.empty(64, dtype=torch.float16)
    fast[(3, 2)](x, 32, 0.5, D=64, BLOCK=16, num_warps=4)
    assert [e[0] for e in fn.log] == ["triton"]
    y = torch.empty(64, dtype=torch.float16)
    fast[(5,)](y, 32, 0.5, D=64, BLOCK=16, num_warps=4)  # another tensor, same dtype and alignment
    # tensors go to the launcher as their addresses
    assert fn.log[-1] == ("cached", (5, 1, 1, 1234, "fn", "meta", None, None, None, y.data_ptr(), 32, 0.5, 16, 64))
    # each change takes Triton's path once (and caches a binary of its own)
    for args, kwargs in (((x[1:], 32, 0.5), {}), ((x, 48, 0.5), {}), ((x, 1, 0.5), {}), ((x, True, 0.5), {}),
                         ((x, 1.0, 0.5), {}), ((x, 2**31, 0.5), {}), ((x.float(), 32, 0.5), {}),
                         ((x, 32, 0.5), {"num_warps": 8}), ((x, 32, 0.5), {"BLOCK": 32})):
        before = len(fn.compiled)
        fast[(1,)](*args, **dict(dict(D=64, BLOCK=16, num_warps=4), **kwargs))
        assert fn.log[-1][0] == "triton" and len(fn.compiled) == before + 1, (args, kwargs)
        fast[(1,)](*args, **dict(dict(D=64, BLOCK=16, num_warps=4), **kwargs))
        assert fn.log[-1][0] == "cached" and fn.log[-1][1][9:12] == (args[0].data_ptr(), *args[1:]), (args, kwargs)


def test_layout_changes_take_tritons_path(no_hooks):
    """A scalar where the first call had a tensor, or the reverse, is never served from the cache."""
    fn = _FakeJIT(["X", "n", "BLOCK"], constexprs=("BLOCK",))
    fast = FastJIT(fn)
    x = torch.empty(8)
    fast[(1,)](x, 16, BLOCK=4)
    fast[(1,)](x, 16, BLOCK=4)
    fast[(1,)](16, x, BLOCK=4)
    fast[(1,)](16, x, BLOCK=4)
    fast[(1,)](x, x, BLOCK=4)
    fast[(1,)](x, x, BLOCK=4)
    fast[(1,)](x, 16, BLOCK=4)
    assert [e[0] for e in fn.log] == ["triton", "cached", "triton", "triton", "triton", "triton", "cached"]
    assert len(fast._cache) == 1


def test_tensors_after_scalars_go_to_the_launcher_in_place(no_hooks):
    fn = _FakeJIT(["n", "X", "s", "Y", "BLOCK"], constexprs=("BLOCK",))
    fast = FastJIT(fn)
    x, y = torch.empty(8), torch.empty(4, dtype=torch.float16)
    fast[(2, 3, 4)](7, x, 0.5, y, BLOCK=8)
    fast[(2, 3, 4)](7, x, 0.5, y, BLOCK=8)
    assert fn.log[-1] == ("cached", (2, 3, 4, 1234, "fn", "meta", None, None, None, 7, x.data_ptr(), 0.5, y.data_ptr(), 8))


def test_hooks_unusual_arguments_and_callable_grids_take_tritons_path(no_hooks, monkeypatch):
    from triton import knobs

    fn = _FakeJIT(["X", "BLOCK"], constexprs=("BLOCK",))
    fast = FastJIT(fn)
    x = torch.empty(8)
    fast[(1,)](x, BLOCK=4)
    fast[(1,)](x, BLOCK=4)
    assert [e[0] for e in fn.log] == ["triton", "cached"]
    fast[lambda meta: (1,)](x, BLOCK=4)
    fast[(1,)](object(), BLOCK=4)
    fast[(1,)](x)  # a constexpr left to its default
    fast[(1,)](x)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    fast[(1,)](x, BLOCK=4)
    assert [e[0] for e in fn.log] == ["triton", "cached"] + ["triton"] * 5


def test_fast_launch_is_off_in_the_interpreter_and_by_variable(monkeypatch):
    import attngen

    kernel = attngen.load(f"{ROOT}/specs/decode_d128.attn")
    assert isinstance(kernel.module.attn_fwd, FastJIT) == HAS_GPU
    monkeypatch.setenv("ATTNGEN_FAST_LAUNCH", "0")
    assert not launch.enabled()


@pytest.mark.gpu
def test_cached_launches_compute_what_tritons_path_computes():
    """On the GPU: the same kernel through FastJIT's cached path and through Triton's, on aligned and
    misaligned views, gives bit-identical outputs, and the misaligned call got a binary of its own. (Head
    dim 96: the Triton decode kernel; at 64 and 128 an sm_90 GPU runs the Gluon one, tested below.)"""
    import attngen

    gen = torch.Generator(DEVICE).manual_seed(0)
    q = torch.randn(2, 1, 8, 96, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(2, 300, 2, 96, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    lens = torch.tensor([300, 77], device=DEVICE, dtype=torch.int32)
    kernel = attngen.load(attngen.lang.builtin.kvcache_spec("bf16", 96, True, None))
    fast = kernel.module.attn_fwd
    assert isinstance(fast, FastJIT)
    first = attngen.attention_with_kvcache(q, k, v, lens)
    again = attngen.attention_with_kvcache(q, k, v, lens)
    flat = torch.empty(q.numel() + 1, device=DEVICE, dtype=q.dtype)
    q_odd = flat[1:].view_as(q).copy_(q)  # 2-byte aligned: not a multiple of 16 bytes
    odd = attngen.attention_with_kvcache(q_odd, k, v, lens)
    entries = len(fast._cache)
    kernel.module.attn_fwd = fast.fn  # Triton's own path
    try:
        plain = attngen.attention_with_kvcache(q_odd, k, v, lens)
    finally:
        kernel.module.attn_fwd = fast
    assert torch.equal(first, again) and torch.equal(odd, plain) and torch.equal(odd, first)
    assert entries >= 2


def test_loading_a_seen_spec_object_skips_its_canonical_text(monkeypatch):
    """`load` of a Spec object it has loaded before is a lookup (a decoding step loads its spec on
    every call); an equal but new Spec object, or spec text, still finds the same kernel."""
    import attngen
    from attngen.lang.spec import Spec

    spec = attngen.parse(open(f"{ROOT}/specs/fwd_d64.attn").read(), "fwd_d64.attn")
    kernel = attngen.load(spec)

    def canonical(self):
        raise AssertionError("canonical text rebuilt")

    with monkeypatch.context() as m:
        m.setattr(Spec, "canonical", canonical)
        assert attngen.load(spec) is kernel
    again = attngen.parse(open(f"{ROOT}/specs/fwd_d64.attn").read(), "fwd_d64.attn")
    assert again is not spec and attngen.load(again) is kernel
    assert attngen.load(f"{ROOT}/specs/fwd_d64.attn") is kernel


def test_gluon_descriptors_are_keyed_by_all_but_their_address():
    """A Gluon kernel's TMA descriptors count as values: two calls share a key only when their
    descriptors agree in everything but the base's address (another cache of the same layout)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    fast = FastJIT.__new__(FastJIT)
    fast._tensor_pos = None  # nothing learnt yet
    t = torch.empty(64, 256, dtype=torch.bfloat16)
    layout = gl.NVMMASharedLayout.get_default_for([16, 128], gl.bfloat16)

    def desc(base=t, block=(16, 128), layout=layout, shape=None):
        return TensorDescriptor(base, list(shape or base.shape), list(base.stride()), list(block), layout)

    args = (t, desc(), 3)
    assert fast._cacheable(args) and fast._desc_pos == {0}
    key = fast.signature(args, {})[0]
    assert fast.signature((t, desc(base=torch.empty_like(t)), 3), {})[0] == key
    others = (desc(block=(32, 128)), desc(layout=gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)),
              desc(shape=(32, 256)), desc(base=t.half()), desc(base=t[:, 8:]))
    for other in others:
        assert fast.signature((t, other, 3), {})[0] != key
    assert not fast._cacheable((t, 5, 3))  # a scalar where the first call had a descriptor: Triton's path


def test_layout_tokens_stand_for_one_object_and_are_never_reissued(monkeypatch):
    """Keys carry a layout as a number for that very object: equal layouts that are distinct objects
    get distinct numbers (a miss, not a wrong hit), and clearing the table issues fresh numbers."""
    from triton.experimental.gluon import language as gl

    from attngen.runtime import launch

    monkeypatch.setattr(launch, "_LAYOUT_TOKENS", {})
    a = gl.NVMMASharedLayout.get_default_for([16, 128], gl.bfloat16)
    b = gl.NVMMASharedLayout.get_default_for([16, 128], gl.bfloat16)
    assert a == b and a is not b
    first = launch._layout_token(a)
    assert launch._layout_token(a) == first and launch._layout_token(b) != first
    seen = {first, launch._layout_token(b)}
    for _ in range(300):  # past the table's bound: it is cleared, numbers go on
        token = launch._layout_token(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2))
        assert token not in seen
        seen.add(token)
    assert launch._layout_token(a) not in seen  # a forgotten object comes back under a new number


class _FakeLauncher:
    """Triton 3.6's CudaLauncher around a recording C launcher: `launch` is Triton's own
    `wrap_handle_tensordesc`, which expands each descriptor through `make_tensordesc_arg` per launch."""

    def __init__(self, log, signature, metas, scratch=0):
        from triton.backends.nvidia.driver import wrap_handle_tensordesc

        self.launch = wrap_handle_tensordesc(lambda *args: log.append(("C", args)), signature, metas)
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.global_scratch_size, self.profile_scratch_size = scratch, 0

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):  # as CudaLauncher.__call__ (no scratch)
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None,
                    *args)


def fake_gluon_kernel(monkeypatch, scratch=0):
    """A Gluon kernel (X, n, K, Y, V, BLOCK), K and V TMA descriptors, as FastJIT sees it: (its JIT function,
    whose Triton path compiles a kernel around `launcher` and launches it; `launcher`, Triton 3.6's
    CudaLauncher logging the C launcher's arguments in `log`; `made`, the base address of each tensor map
    built, by a stand-in for the driver's `make_tensordesc_arg`)."""
    import triton.backends.nvidia.driver as driver

    made = []

    def make_tensordesc_arg(arg, meta):  # the driver call Triton makes per descriptor and launch
        made.append(arg.base.data_ptr())
        return [("map", arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), meta["swizzle"]), *arg.shape,
                *arg.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", make_tensordesc_arg)
    log = []
    signature = {0: "*bf16", 1: "i32", 2: "tensordesc<bf16[16, 128]>", 3: "*fp32", 4: "tensordesc<bf16[16, 128]>",
                 5: "constexpr"}
    launcher = _FakeLauncher(log, signature, [{"swizzle": 128}, {"swizzle": 64}], scratch)
    # passed None for K and V (as the Triton dK/dV kernel is where TMA cannot read its tensors), Triton compiles
    # another binary, whose K and V are constexprs
    plain = _FakeLauncher(log, {**signature, 2: "constexpr", 4: "constexpr"}, None, scratch)
    fn = _FakeJIT(["X", "n", "K", "Y", "V", "BLOCK"], constexprs=("BLOCK",))

    def triton_path(grid):  # Triton's launch: compile (here: a compiled kernel around `launcher`), launch
        def run(*args, **kwargs):
            use = launcher if args[2] is not None else plain
            compiled = SimpleNamespace(run=use, function="fn", packed_metadata="meta")
            fn.log.append(("triton",))
            use(*grid, 1, 1234, "fn", "meta", None, None, None, *args, kwargs["BLOCK"])
            return compiled
        return run

    fn.__class__ = type("_FakeGluonJIT", (_FakeJIT,), {"__getitem__": lambda self, grid: triton_path(grid)})
    return fn, launcher, log, made


def tma_descriptor(kind: str):
    """(base, rows) -> a [rows, 256] descriptor of 16 x 128 blocks: Gluon's (with its shared layout) or Triton's
    (triton.tools.tensor_descriptor, as the Triton dK/dV kernel takes; the compiler picks its swizzle)."""
    if kind == "gluon":
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

        layout = gl.NVMMASharedLayout.get_default_for([16, 128], gl.bfloat16)
        return lambda t, rows=64: GluonDescriptor(t, [rows, 256], [256, 1], [16, 128], layout)
    from triton.tools.tensor_descriptor import TensorDescriptor

    return lambda t, rows=64: TensorDescriptor(t, [rows, 256], [256, 1], [16, 128])


@pytest.mark.parametrize("kind", ["gluon", "triton"])
@pytest.mark.parametrize("scratch", [0, 256])
def test_tensor_maps_are_built_once_per_address_and_layout(no_hooks, monkeypatch, scratch, kind):
    """A cached launch of a kernel on TMA descriptors (Gluon's, or Triton's host descriptors) hands the C
    launcher exactly what Triton's launcher would, but encodes a descriptor's tensor map only for a base
    address or layout it has not seen (Triton: every launch). A launcher that needs scratch memory keeps
    Triton's path."""
    fn, launcher, log, made = fake_gluon_kernel(monkeypatch, scratch)
    fast = FastJIT(fn)
    k, v = torch.empty(64, 256, dtype=torch.bfloat16), torch.empty(64, 256, dtype=torch.bfloat16)
    desc = tma_descriptor(kind)

    def as_ptrs(args):
        return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)

    x, x2, y = torch.empty(8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.bfloat16), torch.empty(8)
    built, paths = [], []
    for args in ((x, 5, desc(k), y, desc(v)), (x, 5, desc(k), y, desc(v)), (x2, 5, desc(k), y, desc(v)),
                 (x, 5, desc(v), y, desc(k)), (x, 5, desc(k, rows=32), y, desc(v)),
                 (x, 5, desc(k, rows=32), y, desc(v)), (x, 5, desc(k, rows=32), y, desc(v))):
        before = len(made)
        fast[(3, 2)](*args, BLOCK=16)
        built.append(len(made) - before)
        paths.append(fn.log[-1][0] if fn.log else "cached")
        got = as_ptrs(log[-1][1])
        launcher(3, 2, 1, 1234, "fn", "meta", None, None, None, *args, 16)  # Triton's launcher, same arguments
        assert got == as_ptrs(log[-1][1])
        fn.log.clear()
    # Triton's path where the signature is new (the first call, a new shape), two maps per launch
    if scratch:
        assert paths == ["triton", "cached", "cached", "cached", "triton", "cached", "cached"] and built == [2] * 7
    else:
        # each map once per (argument, address, layout): none for another x; K and V swapped: new to each
        # argument; a new shape: Triton's path, then maps of its own binary's
        assert paths == ["triton", "cached", "cached", "cached", "triton", "cached", "cached"]
        assert built == [2, 2, 0, 2, 2, 2, 0]


@pytest.mark.parametrize("kind", ["gluon", "triton"])
def test_descriptors_after_calls_that_passed_none_are_learnt(no_hooks, monkeypatch, kind):
    """A kernel whose first calls pass None where it takes descriptors (the Triton dK/dV kernel on an expanded
    do: `out.sum().backward()` as a first step), then descriptors: the binary on descriptors is kept too, and
    its later launches take the cached path with their tensor maps kept, handing the C launcher what Triton's
    launcher would; the binary on None stays cached."""
    fn, launcher, log, made = fake_gluon_kernel(monkeypatch)
    fast = FastJIT(fn)
    desc = tma_descriptor(kind)
    k, v = torch.empty(64, 256, dtype=torch.bfloat16), torch.empty(64, 256, dtype=torch.bfloat16)
    x, y = torch.empty(8, dtype=torch.bfloat16), torch.empty(8)
    paths, built = [], []

    def as_ptrs(args):
        return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)

    for with_desc in (False, False, True, True, True, False):
        args = (x, 5, desc(k), y, desc(v)) if with_desc else (x, 5, None, y, None)
        fn.log.clear()
        before = len(made)
        fast[(3, 2)](*args, BLOCK=16)
        paths.append(fn.log[-1][0] if fn.log else "cached")
        built.append(len(made) - before)
        if with_desc:  # (the binary on None is launched through its own launcher, Triton's path or not)
            got = log[-1][1]
            launcher(3, 2, 1, 1234, "fn", "meta", None, None, None, *args, 16)  # Triton's launcher, same arguments
            assert as_ptrs(got) == as_ptrs(log[-1][1])
    assert paths == ["triton", "cached", "triton", "cached", "cached", "cached"]
    assert built == [0, 0, 2, 2, 0, 0]  # Triton's path encodes its own; then once per argument and address


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_GPU and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the Gluon decode kernel runs on sm_90 only")
@pytest.mark.parametrize("page_size", [16, None])
def test_kept_tensor_maps_read_the_pool_they_were_built_for(page_size):
    """On Hopper: decoding through the Gluon kernel, its tensor maps kept by FastJIT, over three page pools
    (or contiguous caches) of one layout (each map is built for its pool's address) and a freed pool's
    address taken by a new one; bit-identical to Triton's own launch path, which encodes every map afresh."""
    import attngen

    gen = torch.Generator(DEVICE).manual_seed(0)
    q = torch.randn(3, 1, 8, 128, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    lens = torch.tensor([700, 1, 333], device=DEVICE, dtype=torch.int32)
    table = torch.randperm(3 * 48, device=DEVICE, generator=gen).view(3, 48).int() if page_size else None

    def pool():
        shape = (3 * 48, 16, 2, 128) if page_size else (3, 48 * 16, 2, 128)
        return torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16, generator=gen)

    kernel = attngen.load(attngen.lang.builtin.kvcache_spec("bf16", 128, True, page_size))
    fast = kernel.module.attn_fwd_wsd
    assert isinstance(fast, FastJIT)
    pools = [(pool(), pool()) for _ in range(3)]
    outs = [attngen.attention_with_kvcache(q, k, v, lens, table) for _ in range(2) for k, v in pools]
    assert any(entry[2] is not None for entry in fast._cache.values())  # the launches kept their maps
    del pools[1]
    pools.insert(1, (pool(), pool()))  # a new pool, likely at the freed one's address
    outs[1] = outs[4] = attngen.attention_with_kvcache(q, *pools[1], lens, table)
    outs[4] = attngen.attention_with_kvcache(q, *pools[1], lens, table)
    kernel.module.attn_fwd_wsd = fast.fn  # Triton's own path
    try:
        plain = [attngen.attention_with_kvcache(q, k, v, lens, table) for k, v in pools]
    finally:
        kernel.module.attn_fwd_wsd = fast
    for i in range(6):
        assert torch.equal(outs[i], plain[i % 3]), i
    assert not torch.equal(plain[0], plain[1])


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_GPU and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the Triton dK/dV kernel takes TMA descriptors on sm_90")
def test_the_triton_backward_keeps_its_descriptor_binary_after_an_expanded_output_gradient(monkeypatch):
    """On Hopper: the Triton dK/dV kernel (d=128 without a mask at 256 keys) first passed an expanded output
    gradient (None for its q and do descriptors: `out.sum().backward()` as a first step), then contiguous ones
    (descriptors): only the first call of each binary takes Triton's launch path (before, every call on
    descriptors did, for the rest of the process), and every call's gradients match float64."""
    import attngen
    from attngen.lang.builtin import sdpa_spec
    from attngen.testing.accuracy import compare_grads

    class Counting:  # a JIT function whose Triton launch path counts its calls
        def __init__(self, fn):
            self.fn, self.calls = fn, 0

        def __getattr__(self, name):
            return getattr(self.fn, name)

        def __getitem__(self, grid):
            self.calls += 1
            return self.fn[grid]

    kernel = attngen.load(sdpa_spec("fp16", 128, False))
    assert isinstance(kernel.module.attn_bwd_dkdv, FastJIT)
    counting = Counting(kernel.module.attn_bwd_dkdv.fn)
    monkeypatch.setattr(kernel.module, "attn_bwd_dkdv", FastJIT(counting))  # nothing learnt yet
    gen = torch.Generator(DEVICE).manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 128, device=DEVICE, dtype=torch.float16, generator=gen) for _ in range(3))
    out, lse = kernel.forward(q, k, v, 128 ** -0.5)
    paths = []
    for expanded in (True, True, False, False, False):
        do = (torch.ones((), device=DEVICE, dtype=torch.float16).expand(q.shape) if expanded
              else torch.randn(q.shape, device=DEVICE, dtype=torch.float16, generator=gen))
        before = counting.calls
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        kernel.backward(q, k, v, out, lse, do, grads=grads)
        paths.append(counting.calls - before)
        for result in compare_grads(kernel.spec, q, k, v, do, grads):
            assert result.ok, (expanded, result)
    assert paths == [1, 0, 1, 0, 0]
