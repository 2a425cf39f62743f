"""Replaying one call's kernel launches on new tensors of the same layout, without the Python that made them.

An eager decoding step (`attention_with_kvcache`) whose signature repeats an earlier call's already skips
its checks (its plan in attngen/runtime/plans.py `PLANS`), but still runs the generated module's
`forward_kvcache`: views, allocations, the Gluon kernel's readiness check, two TMA descriptors, two launches
keyed afresh by FastJIT. That is ~60% of the call's host time (benchmarks/NOTES.md v34), and its outcome is the same on
every call of the signature but for addresses: the same binaries, grids, scalars and constexprs.

`record(fn, inputs)` runs fn once while watching it:
  * every Triton launch: each must be FastJIT's launch of a binary it keeps (its cached path;
    `launch.recording_hook`, in Triton's launch enter hooks meanwhile, sees every launch through
    Triton's own path), and its pointer arguments and descriptor bases must each be the address of
    exactly one of `inputs` or lie in a tensor fn allocated;
  * every torch operation (a TorchDispatchMode): each must allocate (`torch.empty` and kin) or make a
    view; anything else (a fill, a copy) is GPU work a replay would not repeat.
It returns a `Replay` (None where any of that fails). `replay(inputs)` allocates fn's scratch tensors as
one block, puts the call's addresses where the recorded ones were, and calls each binary's C launcher as
FastJIT's cached path would. It declines (returns False; the caller then runs fn) where that launch could
differ from the one fn would make: an input's address is aligned differently from the recorded one's
(Triton specialises binaries on 16-byte alignment), a Triton launch hook is set (a profiler), another
device is current, or Triton's debug flag changed.
The caller's key must hold everything else fn's choices read: shapes, strides, dtypes, devices, values.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import launch

_ALLOCATIONS = frozenset((torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
                          torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default,
                          torch.ops.aten.new_empty_strided.default))
_SCRATCH_ALIGN = 256  # bytes between scratch tensors in the one block (torch's allocator aligns to 512)


class Recording:
    """What a recorded call did: FastJIT's launches, (FastJIT, grid, arguments, key, pointers, device, debug
    flag, cache entry) each; the tensors torch allocated; whether anything else happened (`ok`)."""

    def __init__(self):
        self.launches: list = []
        self.allocations: list = []
        self.ok = True


class _Watch(TorchDispatchMode):
    """Notes each torch operation of a recorded call: allocations kept, views let through, anything else
    spoils the recording."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: torch would otherwise wrap `__torch_dispatch__` in `torch._disable_dynamo`, whose first call
        imports torch._dynamo: 1.5-2.2 s inside the first recorded backward of an eager training step on the H200
        (the third call of a signature; benchmarks/NOTES.md v57). Recording is eager only (torch.compile traces the
        custom ops), so nothing here is for Dynamo to skip."""
        return False

    def __init__(self, recording: Recording):
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.recording.allocations.append(result)
        elif not func.is_view:
            self.recording.ok = False
        return result


def record(fn, inputs: tuple):
    """Run fn() (whose launches read `inputs`, tensors or None, and tensors it allocates itself) and return
    (its result, a Replay of its launches or None where they cannot be replayed)."""
    chain = launch._knobs().runtime.launch_enter_hook
    if not launch.enabled() or launch.hooked() or not hasattr(chain, "add"):
        return fn(), None
    recording = Recording()
    before = getattr(launch.RECORDING, "current", None)
    launch.RECORDING.current = recording
    with _HOOK_LOCK:
        _HOOK_USERS[0] += 1
        chain.add(launch.recording_hook)
    try:
        with _Watch(recording):
            result = fn()
    finally:
        launch.RECORDING.current = before
        with _HOOK_LOCK:
            _HOOK_USERS[0] -= 1
            if not _HOOK_USERS[0]:
                chain.remove(launch.recording_hook)
    return result, Replay.build(recording, inputs)


def wanted(replay) -> bool:
    """Whether a plan holding `replay` (None: none recorded yet; False: its launches cannot be replayed)
    should record its next call."""
    return replay is None


# Recordings in progress in any thread: the hook leaves Triton's chain when the last one ends.
_HOOK_LOCK = threading.Lock()
_HOOK_USERS = [0]


class _Launch(NamedTuple):
    """One recorded launch: `run(*grid, stream, *before, *args, *tail)` with `args` completed per call:
    pointers (position, slot), then descriptors (position, slot, argument place, descriptor key, metadata,
    fields) right to left, each expanded into its tensor map and sizes (kept in FastJIT's `maps`)."""
    run: object
    grid: tuple
    before: tuple
    args: tuple
    pointers: tuple
    descriptors: tuple
    tail: tuple
    maps: dict | None
    make: object


class _Address:
    """Stands for a descriptor's base tensor where Triton's `make_tensordesc_arg` reads only its address."""
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class Replay:
    """The launches of one recorded call, repeatable on other inputs of the same layout (module doc)."""

    def __init__(self, inputs: tuple, scratch: tuple, nbytes: int, scratch_device, launches: tuple, device: int,
                 debug):
        self.inputs = inputs  # ((index into the call's inputs, 16-byte aligned), ...): slots 0..
        self.scratch = scratch  # byte offsets into the scratch block: the slots after the inputs'
        self.nbytes, self.scratch_device = nbytes, scratch_device
        self.launches = launches
        self.device, self.debug = device, debug  # the current device and Triton's debug flag when recorded

    @classmethod
    def build(cls, recording: Recording, inputs: tuple) -> Replay | None:
        if not recording.ok or not recording.launches:
            return None
        devices = {entry[5] for entry in recording.launches}
        debugs = {entry[6] for entry in recording.launches}
        scratch_devices = {t.device for t in recording.allocations}
        if len(devices) != 1 or len(debugs) != 1 or len(scratch_devices) > 1:
            return None
        used: dict = {}  # input index -> slot
        aligned: dict = {}  # input index -> 16-byte aligned
        addresses = [t.data_ptr() if isinstance(t, torch.Tensor) else None for t in inputs]
        # scratch tensors: (first address, end address, offset in the block)
        spans, offset = [], 0
        for t in recording.allocations:
            start = t.untyped_storage().data_ptr()
            nbytes = t.untyped_storage().nbytes()
            spans.append((start, start + nbytes, offset))
            offset += -(-nbytes // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
        scratch_offsets: list = []

        def slot(ptr: int):
            """The slot of an address: an input's (exactly one input starts there), else a scratch offset."""
            if not ptr:
                return None
            hits = [i for i, p in enumerate(addresses) if p == ptr]
            if len(hits) == 1:
                i = hits[0]
                if i not in used:
                    used[i] = len(used)
                    aligned[i] = ptr % 16 == 0
                return ("input", used[i])
            if hits:
                return None  # two inputs at one address: which one a later call means is unknown
            for start, end, base in spans:
                if start <= ptr < end:
                    if ptr % 16:  # the block keeps 16-byte alignment only
                        return None
                    scratch_offsets.append(base + ptr - start)
                    return ("scratch", len(scratch_offsets) - 1)
            return None  # neither an input nor a tensor the call allocated

        launches = []
        for fast, grid, args, key, ptrs, _, _, (compiled, tail, plan) in recording.launches:
            template = list(args)
            pointers = []
            for position, ptr in zip(fast._tensor_pos, ptrs):
                where = slot(ptr)
                if where is None:
                    return None
                template[position] = None
                pointers.append((position, where))
            descriptors = []
            if plan is not None:
                run, cooperative, pdl, descs, make, maps = plan
                before = (compiled.function, cooperative, pdl, None, None, compiled.packed_metadata, None, None, None)
                for j, i, meta in descs:  # right to left, as FastJIT splices them
                    d = args[i]
                    where = slot(d.base.data_ptr())
                    if where is None:
                        return None
                    fields = {name: value for name, value in vars(d).items() if name != "base"}
                    template[i] = None
                    descriptors.append((i, where, i, key[0][j], meta, fields))
            elif any(args[i] is not None for _, i in fast._desc_args):
                return None  # Triton's launcher would encode the descriptors it was given: the recorded call's
            else:
                run, make, maps = compiled.run, None, None
                before = (compiled.function, compiled.packed_metadata, None, None, None)
            grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
            launches.append(_Launch(run, grid3, before, tuple(template), tuple(pointers), tuple(descriptors),
                                    tail, maps, make))
        n_inputs = len(used)
        # slots: the inputs' first, then the scratch addresses in the order they were met
        resolved = []
        for item in launches:
            pointers = tuple((p, s if kind == "input" else n_inputs + s) for p, (kind, s) in item.pointers)
            descriptors = tuple((p, s if kind == "input" else n_inputs + s, i, k, m, f)
                                for p, (kind, s), i, k, m, f in item.descriptors)
            resolved.append(item._replace(pointers=pointers, descriptors=descriptors))
        order = sorted(used, key=used.get)
        return cls(tuple((i, aligned[i]) for i in order), tuple(scratch_offsets), offset,
                   scratch_devices.pop() if scratch_devices else None, tuple(resolved), devices.pop(), debugs.pop())

    def __call__(self, inputs: tuple) -> bool:
        """Launch the recorded kernels on `inputs` (laid out as the recorded call's); False, launching
        nothing, where the launches could differ from the ones the call would make."""
        knobs = launch._knobs()
        if launch.hooked() or knobs.runtime.debug != self.debug or launch._current_device() != self.device:
            return False
        slots = []
        for i, aligned in self.inputs:
            ptr = inputs[i].data_ptr()
            if (ptr % 16 == 0) != aligned:
                return False
            slots.append(ptr)
        if self.nbytes:
            block = torch.empty(self.nbytes, dtype=torch.uint8, device=self.scratch_device)
            base = block.data_ptr()
            slots.extend(base + offset for offset in self.scratch)
        stream = launch._raw_stream(self.device)
        for item in self.launches:
            args = list(item.args)
            for position, s in item.pointers:
                args[position] = slots[s]
            for position, s, place, desc_key, meta, fields in item.descriptors:
                ptr = slots[s]
                map_key = (place, ptr, desc_key)  # FastJIT's key of a kept tensor map: both paths share them
                expanded = item.maps.get(map_key)
                if expanded is None:
                    if len(item.maps) > 256:
                        item.maps.clear()
                    expanded = item.maps[map_key] = item.make(SimpleNamespace(base=_Address(ptr), **fields), meta)
                args[position:position + 1] = expanded
            item.run(*item.grid, stream, *item.before, *args, *item.tail)
        return True
