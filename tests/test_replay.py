"""Replays of a call's launches (attngen/runtime/replay.py): a replay hands each binary's launcher exactly what the
call itself would, with the new call's addresses, or declines; a call it could not repeat is never
recorded. (Fake kernels on the CPU, as tests/test_launch.py; the GPU tests in tests/test_decode.py run
the real decoding kernels through replays.)"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from test_launch import _FakeJIT, fake_gluon_kernel, tma_descriptor

from attngen.runtime import launch, replay
from attngen.runtime.launch import FastJIT


@pytest.fixture
def no_hooks(monkeypatch):
    from triton import knobs
    from triton.knobs import HookChain

    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", HookChain())
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", HookChain(reversed=True))
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_raw_stream", lambda device: 1234)


def _module():
    """A generated module in miniature: two kernels, and a host function that allocates a scratch tensor
    between them (as forward_kvcache's partial outputs)."""
    module = types.ModuleType("fake_generated")
    first = _FakeJIT(["Q", "K", "P", "n", "s", "BLOCK"], constexprs=("BLOCK",))
    second = _FakeJIT(["P", "O", "n", "BLOCK"], constexprs=("BLOCK",))
    module.partial, module.merge = FastJIT(first), FastJIT(second)

    def forward(q, k, out, zero=False):
        part = torch.empty(4, 8, dtype=torch.float32)
        if zero:
            part.zero_()
        module.partial[(2, 3)](q, k, part, 8, 0.5, BLOCK=16)
        module.merge[(2,)](part[1:], out.unsqueeze(0), 8, BLOCK=16)

    module.forward = forward
    return module, first, second


def _tensors(offset=0):
    flat = torch.empty(64 + offset, dtype=torch.float16)
    return flat[offset:offset + 32], torch.empty(32, dtype=torch.float16), torch.empty(16, dtype=torch.float32)


def test_a_replay_launches_what_the_call_would_on_the_new_addresses(no_hooks):
    module, first, second = _module()
    q, k, out = _tensors()
    module.forward(q, k, out)  # Triton's path: compiles, FastJIT keeps the binaries
    _, kept = replay.record(lambda: module.forward(q, k, out), (q, k, out))
    assert kept is not None and [e[0] for e in first.log] == ["triton", "cached"]
    q2, k2, out2 = _tensors()
    before = len(first.log), len(second.log)
    assert kept((q2, k2, out2))
    got = first.log[-1][1], second.log[-1][1]
    assert (len(first.log), len(second.log)) == (before[0] + 1, before[1] + 1)
    module.forward(q2, k2, out2)  # the call itself, through FastJIT's cached path
    want = first.log[-1][1], second.log[-1][1]
    # the same arguments but for the scratch tensor's address: the replay's one block against torch.empty
    scratch = got[0][11]
    assert got[0][:11] == want[0][:11] and got[0][12:] == want[0][12:]
    assert got[0][9:11] == (q2.data_ptr(), k2.data_ptr())
    assert got[1][9] == scratch + 8 * 4 and got[1][10:] == want[1][10:] and got[1][10] == out2.data_ptr()
    assert want[1][9] - want[0][11] == 8 * 4 and scratch % 16 == 0


def test_what_a_replay_could_not_repeat_is_not_recorded(no_hooks):
    module, first, _ = _module()
    q, k, out = _tensors()
    # the first call compiles: Triton's path
    assert replay.record(lambda: module.forward(q, k, out), (q, k, out))[1] is None
    assert replay.record(lambda: module.forward(q, k, out), (q, k, out))[1] is not None
    # GPU work torch does (a fill) between the launches
    assert replay.record(lambda: module.forward(q, k, out, zero=True), (q, k, out))[1] is None
    # an address two inputs share: which one a later call means is unknown
    assert replay.record(lambda: module.forward(q, k, out), (q, k, out, q[:4]))[1] is None
    # a pointer that is neither an input nor scratch
    assert replay.record(lambda: module.forward(q, k, out), (q, out))[1] is None
    # nothing launched through FastJIT (the interpreter, fast launches off)
    assert replay.record(lambda: None, (q, k, out))[1] is None

    def triton_launch(*args):  # a kernel launched through Triton's own path: it calls the enter hooks
        from triton import knobs

        knobs.runtime.launch_enter_hook(SimpleNamespace(name="kernel"))

    def with_a_triton_launch():
        module.forward(q, k, out)
        triton_launch(q)

    assert replay.record(with_a_triton_launch, (q, k, out))[1] is None
    assert replay.record(lambda: module.forward(q, k, out), (q, k, out))[1] is not None
    assert not launch.hooked()  # the recording's hook is gone, and was never counted as a user's


def test_a_replay_declines_where_the_launch_could_differ(no_hooks, monkeypatch):
    from triton import knobs

    module, first, second = _module()
    q, k, out = _tensors()
    module.forward(q, k, out)
    _, kept = replay.record(lambda: module.forward(q, k, out), (q, k, out))
    n = len(first.log), len(second.log)

    def declines(*tensors):
        return not kept(tensors) and (len(first.log), len(second.log)) == n

    assert declines(*_tensors(offset=1))  # q 2 bytes off 16-byte alignment: Triton compiles another binary
    with monkeypatch.context() as m:
        m.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
        assert declines(q, k, out)
    with monkeypatch.context() as m:
        m.setattr(launch, "_current_device", lambda: 1)
        assert declines(q, k, out)
    with monkeypatch.context() as m:
        m.setattr(knobs.runtime, "debug", not knobs.runtime.debug)
        assert declines(q, k, out)
    assert replay.wanted(None) and not replay.wanted(kept) and not replay.wanted(False)
    assert kept((q, k, out))


@pytest.mark.parametrize("kind", ["gluon", "triton"])
def test_replayed_descriptor_launches_keep_their_tensor_maps_per_address(no_hooks, monkeypatch, kind):
    """A kernel's TMA descriptors (Gluon's, or Triton's host descriptors): the replay gives the C launcher what
    Triton's launcher would for the new call's caches, building a tensor map only for a base address FastJIT
    has not built one for."""
    fn, launcher, log, made = fake_gluon_kernel(monkeypatch)
    module = types.ModuleType("fake_gluon")
    module.kernel = FastJIT(fn)
    desc = tma_descriptor(kind)

    def forward(x, k, v):
        y = torch.empty(8)
        module.kernel[(3, 2)](x, 5, desc(k), y, desc(v), BLOCK=16)

    def caches():
        return torch.empty(64, 256, dtype=torch.bfloat16), torch.empty(64, 256, dtype=torch.bfloat16)

    x = torch.empty(8, dtype=torch.bfloat16)
    k, v = caches()
    forward(x, k, v)
    _, kept = replay.record(lambda: forward(x, k, v), (x, k, v))
    assert kept is not None and len(made) == 4  # Triton's launch, then FastJIT's kept maps
    k2, v2 = caches()
    y_at = 13 + 2 + 5  # the C launcher's arguments: 13 of the launch's own, then x, 5, K's map and sizes, y
    for caches_now, new_maps in (((k, v), 0), ((k2, v2), 2), ((k2, v2), 0), ((v2, k2), 2)):
        before = len(made)
        assert kept((x, *caches_now))
        assert len(made) - before == new_maps
        got = list(log[-1][1])
        probe = torch.empty(8)
        launcher(3, 2, 1, 1234, "fn", "meta", None, None, None, x, 5, desc(caches_now[0]), probe,
                 desc(caches_now[1]), 16)  # Triton's launcher
        want = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in log[-1][1]]
        assert want[y_at] == probe.data_ptr() and got[y_at] % 16 == 0  # y: the replay's scratch block
        want[y_at] = got[y_at]
        assert got == want


def test_descriptors_a_launcher_encodes_itself_are_not_recorded(no_hooks, monkeypatch):
    """Where FastJIT keeps no tensor maps (a launcher that needs scratch memory: Triton's launcher encodes
    the descriptors it is handed), a replay would hand it the recorded call's descriptors, reading the old
    caches: such a call is not recorded."""
    fn, launcher, log, made = fake_gluon_kernel(monkeypatch, scratch=256)
    module = types.ModuleType("fake_gluon")
    module.kernel = FastJIT(fn)
    desc = tma_descriptor("triton")
    x, y = torch.empty(8, dtype=torch.bfloat16), torch.empty(8)
    k, v = torch.empty(64, 256, dtype=torch.bfloat16), torch.empty(64, 256, dtype=torch.bfloat16)

    def forward():
        module.kernel[(3, 2)](x, 5, desc(k), y, desc(v), BLOCK=16)

    forward()
    launches = []
    real = replay.Replay.build.__func__
    monkeypatch.setattr(replay.Replay, "build", classmethod(
        lambda cls, recording, inputs: launches.append(len(recording.launches)) or real(cls, recording, inputs)))
    assert replay.record(forward, (x, k, y, v))[1] is None
    assert launches == [1]  # the launch took FastJIT's cached path, and only the descriptors stopped it


def test_launches_passed_no_descriptors_are_kept_and_replayed(no_hooks, monkeypatch):
    """A kernel that takes descriptors, passed None for them (another binary), takes FastJIT's cached path and
    is replayed; with descriptors again, the first binary is launched from FastJIT's cache too."""
    fn, launcher, log, made = fake_gluon_kernel(monkeypatch)
    module = types.ModuleType("fake_gluon")
    module.kernel = FastJIT(fn)
    desc = tma_descriptor("triton")
    k, v = torch.empty(64, 256, dtype=torch.bfloat16), torch.empty(64, 256, dtype=torch.bfloat16)

    def forward(x, with_desc):
        y = torch.empty(8)
        module.kernel[(3, 2)](x, 5, desc(k) if with_desc else None, y, desc(v) if with_desc else None, BLOCK=16)

    x = torch.empty(8, dtype=torch.bfloat16)
    for with_desc in (True, False, False):
        fn.log.clear()
        forward(x, with_desc)
    assert fn.log == []  # the second call without descriptors took the cached path
    _, kept = replay.record(lambda: forward(x, False), (x,))
    assert kept is not None
    x2 = torch.empty(8, dtype=torch.bfloat16)
    assert kept((x2,))
    got = log[-1][1]
    # the C launcher's arguments: 13 of the launch's own, then x, 5, K, y (the replay's scratch block), V, BLOCK
    assert got[13:16] == (x2.data_ptr(), 5, None) and got[16] % 16 == 0 and got[17:] == (None, 16)
    forward(x, True)
    assert fn.log == []


def test_recording_an_allocation_does_not_import_dynamo():
    """The watch over a recorded call lets torch allocate inside it without importing torch._dynamo (which
    TorchDispatchMode's default wrapper of `__torch_dispatch__` does on its first call: 1.5-2.2 s in the first
    recorded backward of an eager training step on the H200), and still sees an allocation and a fill apart. In a
    fresh interpreter: this process may have imported Dynamo already."""
    code = ("import sys, torch, attngen\n"
            "from attngen.runtime.replay import _Watch, Recording\n"
            "assert 'torch._dynamo' not in sys.modules\n"
            "r = Recording()\n"
            "with _Watch(r):\n"
            "    torch.empty(3)\n"
            "assert 'torch._dynamo' not in sys.modules, 'imported'\n"
            "assert len(r.allocations) == 1 and r.ok\n"
            "with _Watch(r):\n"
            "    torch.ones(2).fill_(3)\n"
            "assert not r.ok\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ATTNGEN_WARMUP": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
