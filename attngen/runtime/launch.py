"""A shorter launch path for the generated kernels' repeat calls.

`kernel[grid](*args, **constexprs)` through Triton's `JITFunction.run` costs tens of microseconds of
Python per launch (binding ~30 arguments by name, the compile-cache key, a check of the kernel's
globals, launch metadata for hooks that are not set): at batch 1 a decoding step's GPU work is
shorter than that. `FastJIT` wraps a generated module's `@triton.jit` function, and the runtime
puts it in the module's namespace in place of the function (the module's `launch_*` functions
look it up there), so the generated source stays plain Triton. A call goes:

  * first with a given argument signature: through Triton (`fn[grid](...)`), which compiles or finds
    the binary and launches it; FastJIT keeps the compiled kernel under that signature;
  * later with the same signature: straight to the compiled kernel's launcher.

The signature is finer than what Triton specialises a binary on, so a cached binary is never
launched for arguments it was not compiled for: every non-tensor argument's exact value and type
(Triton looks at an integer's width and whether it is 1 or a multiple of 16), each tensor's dtype
and whether its address is a multiple of 16, the keyword values (constexprs, num_warps, num_stages),
the device and Triton's debug flag. Gluon kernels' host-side TMA descriptors count as values, keyed by
all they hold but the base's address (its dtype and alignment, shape, strides, block shape, layout
object); a cached launch keeps each descriptor's tensor map under that key and the base's address,
where Triton's launcher would encode it again (a driver call) every launch. A decoding step repeats the
same strides and sizes, so it hits; a new sequence length takes Triton's path once. Anything else
(a tensor where the first call had a scalar or the reverse, a value that is not a plain int, float,
bool or None, a launch hook installed, e.g. by a profiler, a grid that is a function) takes
Triton's own path every time.
`ATTNGEN_FAST_LAUNCH=0` turns the short path off (read when a module is imported).
"""

from __future__ import annotations

import itertools
import operator
import os
import threading

import torch
from .. import env


def enabled() -> bool:
    return env.fast_launch()


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set: None, or (Triton 3.6) a HookChain with no calls but
    `recording_hook`, is not."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    if calls is None:
        return True
    for call in calls:
        if call is not recording_hook:
            return True
    return False


def recording_hook(*args, **kwargs) -> None:
    """Triton's launch enter hook while a call is recorded (attngen/runtime/replay.py): Triton calls it for every
    launch through its own path (FastJIT's cached path calls none), which spoils this thread's recording;
    `_hooked` does not count it."""
    recording = getattr(RECORDING, "current", None)
    if recording is not None:
        recording.ok = False


# .current: the attngen.runtime.replay.Recording this thread is making, if any: FastJIT reports each launch to it.
RECORDING = threading.local()


def hooked() -> bool:
    """Whether Triton's launch enter or exit hook is set (a profiler): launches then take Triton's path."""
    runtime = _knobs().runtime
    return _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook)


def _stream_handle(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# The current stream's handle: torch's raw getter, as Triton's own launch path uses, where it exists.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _stream_handle)
# The current device: torch's C getter (which initialises CUDA itself) without torch.cuda.current_device's
# Python around it, where it exists.
_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None)


def _current_device() -> int:
    return _cuda_get_device() if _cuda_get_device is not None else torch.cuda.current_device()


class FastJIT:
    """Stands in for a `triton.JITFunction` in a generated module: `fast[grid](*args, **kwargs)`
    launches as `fn[grid](*args, **kwargs)` would. Other attributes are the function's."""

    def __init__(self, fn):
        self.fn = fn
        params = fn.params
        self._constexprs = tuple(p.name for p in params if p.is_constexpr)
        n = sum(not p.is_constexpr for p in params)
        # The cached path needs the signature to be (positional params..., constexpr params...),
        # which is how attngen generates kernels; otherwise every call takes Triton's path.
        self._ordered = all(not p.is_constexpr for p in params[:n])
        self._n_positional = n
        self._tensor_pos: tuple | None = None  # where the first cached call had tensors
        self._value_pos: tuple = ()
        self._desc_pos: frozenset = frozenset()  # which of the values are TMA descriptors
        self._desc_args: tuple = ()
        self._cache: dict = {}

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __repr__(self) -> str:
        return f"<FastJIT {self.fn!r}>"

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def signature(self, args: tuple, kwargs: dict) -> tuple:
        """(cache key, tensors' addresses) of one call. The key: every non-tensor argument's exact
        value and type (finer than Triton's specialisation, and a few C-level operations), each
        tensor's dtype and 16-byte alignment, the keyword arguments. Raises AttributeError or
        TypeError (unhashable) where the call does not fit the layout learned from the first one."""
        values = self._values(args)
        if self._desc_args:  # TMA descriptors: keyed by everything they hold but the base's address (or None)
            values = list(values)
            for j, _ in self._desc_args:
                if values[j] is not None:
                    values[j] = _desc_key(values[j])
            values = tuple(values)
        tensors = self._tensors(args)
        ptrs = [t.data_ptr() for t in tensors]
        key = (values, tuple(map(type, values)), tuple([p % 16 == 0 for p in ptrs]), tuple([t.dtype for t in tensors]),
               tuple(kwargs.items()))
        return key, ptrs

    def learn(self, tensor_pos: tuple, n: int) -> None:
        """Fix the layout: tensors at `tensor_pos`, scalars at the other of `n` positions."""
        self._tensor_pos = tensor_pos
        self._value_pos = tuple(i for i in range(n) if i not in tensor_pos)
        self._tensors, self._values = _getter(self._tensor_pos), _getter(self._value_pos)
        self._prefix = tensor_pos == tuple(range(len(tensor_pos)))  # tensors first: attngen's kernels
        self._desc_pos, self._desc_args = frozenset(), ()  # learnt by `_learn_descriptors` from calls that pass them

    def _cacheable(self, args: tuple) -> bool:
        """Whether this call's arguments are tensors where the layout has tensors and plain Python
        scalars elsewhere (learning the layout on the first call)."""
        if self._tensor_pos is None:
            self.learn(tuple(i for i, x in enumerate(args) if isinstance(x, torch.Tensor)), len(args))
        self._learn_descriptors(args)
        return (all(isinstance(args[i], torch.Tensor) for i in self._tensor_pos)
                and all((args[i] is None or _is_desc(args[i])) if j in self._desc_pos else type(args[i]) in _SCALARS
                        for j, i in enumerate(self._value_pos)))

    def _learn_descriptors(self, args: tuple) -> bool:
        """Add the places among the values where this call passes TMA descriptors and earlier calls did not
        (the first call, or only None there: a kernel passed None where TMA cannot read a tensor, as the
        Triton dK/dV kernel is for an expanded do, is another binary); whether there were any. Keys made
        before stay valid: a place that held None keys None either way."""
        new = [j for j, i in enumerate(self._value_pos) if j not in self._desc_pos and _is_desc(args[i])]
        if new:
            self._desc_pos = self._desc_pos.union(new)
            # (place among the values, place among the arguments) of each descriptor
            self._desc_args = tuple((j, self._value_pos[j]) for j in sorted(self._desc_pos))
        return bool(new)

    def run(self, grid, args: tuple, kwargs: dict):
        knobs = _knobs()
        recording = getattr(RECORDING, "current", None)
        if (not self._ordered or len(args) != self._n_positional or type(grid) is not tuple
                or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)):
            if recording is not None:  # Triton's path: not a launch a replay can repeat
                recording.ok = False
            return self.fn[grid](*args, **kwargs)
        device = _current_device()
        hit = None
        if self._tensor_pos is not None:
            try:
                key, ptrs = self.signature(args, kwargs)
                hit = self._cache.get((device, knobs.runtime.debug, key))
            except (AttributeError, TypeError):  # not a tensor where one was; an unhashable value
                if not self._learn_descriptors(args):
                    if recording is not None:
                        recording.ok = False
                    return self.fn[grid](*args, **kwargs)
                # (a descriptor where earlier calls passed None: keyed from now on, and this call a miss)
        if hit is None:
            if recording is not None:  # a compile or a binary not kept yet
                recording.ok = False
            compiled = self.fn[grid](*args, **kwargs)
            if self._cacheable(args) and hasattr(compiled, "run") and hasattr(compiled, "packed_metadata"):
                try:
                    tail = tuple(kwargs[name] for name in self._constexprs)
                    key, _ = self.signature(args, kwargs)
                except (KeyError, TypeError):  # a constexpr left to its default; an unhashable value
                    return compiled
                if len(self._cache) > 1024:
                    self._cache.clear()
                plan = _tma_plan(compiled, self._desc_args) if self._desc_args else None
                self._cache[(device, knobs.runtime.debug, key)] = (compiled, tail, plan)
            return compiled
        if recording is not None:
            recording.launches.append((self, grid, args, key, ptrs, device, knobs.runtime.debug, hit))
        compiled, tail, plan = hit
        if plan is not None:
            self._launch_tma(grid, args, key[0], ptrs, device, compiled, tail, plan)
            return compiled
        # The tensors go in as their addresses: Triton's launcher then skips, per pointer, a method call
        # and a driver query (cuPointerGetAttribute) that the checks before every launch make moot.
        if self._prefix:
            launch_args = (*ptrs, *args[len(ptrs):])
        else:
            launch_args = list(args)
            for i, p in zip(self._tensor_pos, ptrs):
                launch_args[i] = p
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], grid_1, grid_2, _raw_stream(device), compiled.function, compiled.packed_metadata,
                     None, None, None, *launch_args, *tail)
        return compiled

    def _launch_tma(self, grid, args, values, ptrs, device, compiled, tail, plan) -> None:
        """Launch a kernel that takes TMA descriptors (a Gluon kernel, or a Triton one on host descriptors)
        straight through its C launcher, each descriptor's tensor map built once per
        (argument, base address, descriptor key) and kept in `plan`, rather than once per launch."""
        launch, cooperative, pdl, descs, make, maps = plan
        launch_args = list(args)
        for i, p in zip(self._tensor_pos, ptrs):
            launch_args[i] = p
        for j, i, meta in descs:  # right to left: each splice leaves the places before it
            d = args[i]
            map_key = (i, d.base.data_ptr(), values[j])
            expanded = maps.get(map_key)
            if expanded is None:
                if len(maps) > 256:
                    maps.clear()
                expanded = maps[map_key] = make(d, meta)
            launch_args[i:i + 1] = expanded
        launch(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, _raw_stream(device),
               compiled.function, cooperative, pdl, None, None, compiled.packed_metadata, None, None, None,
               *launch_args, *tail)


_SCALARS = (int, float, bool, type(None))


def _is_desc(x) -> bool:
    """Whether x is a host-side TMA descriptor: Gluon's (triton.experimental.gluon.nvidia.hopper, with a shared
    layout) or Triton's (triton.tools.tensor_descriptor, which the Triton dK/dV kernel takes)."""
    return type(x).__name__ == "TensorDescriptor" and hasattr(x, "block_shape") and hasattr(x, "base")


def _desc_key(d) -> tuple:
    """A descriptor's part of the key: the base's dtype and 16-byte alignment, shape, strides, block
    shape, layout (as `_layout_token`) and padding (the launcher builds the tensor map from the base's
    address per call)."""
    layout = getattr(d, "layout", None)  # Triton's descriptors have none: the compiler picks the swizzle
    return (d.base.dtype, d.base.data_ptr() % 16 == 0, tuple(d.shape), tuple(d.strides), tuple(d.block_shape),
            None if layout is None else _layout_token(layout), d.padding)


def _layout_token(layout) -> int:
    """A number that stands for this very layout object in keys. Gluon's layouts hash in Python (a tuple
    of their fields built per call) and a key is hashed twice a launch per descriptor; the generated
    modules pass the same module-level layout objects every call. Equal layouts that are distinct
    objects get distinct numbers (a cache miss, never a wrong hit); a kept reference stops an id from
    being reused, and numbers are never reissued after the table is cleared (`next` on the counter is
    one C call: two threads never draw the same number; both drawing for one object is a miss)."""
    entry = _LAYOUT_TOKENS.get(id(layout))
    if entry is None:
        if len(_LAYOUT_TOKENS) > 256:
            _LAYOUT_TOKENS.clear()
        entry = _LAYOUT_TOKENS[id(layout)] = (layout, next(_TOKENS))
    return entry[1]


_LAYOUT_TOKENS: dict = {}  # id(layout) -> (layout, token)
_TOKENS = itertools.count()


def _tma_plan(compiled, desc_args: tuple):
    """How FastJIT launches a compiled kernel that takes TMA descriptors, keeping their tensor maps:
    (C launcher, cooperative flag, PDL flag, ((place among values, place among arguments, metadata), ...)
    right to left, the function that expands one descriptor into the launcher's arguments, a dict of
    expanded descriptors). Triton 3.6's launcher rebuilds every tensor map on every launch (a driver call
    each, in `wrap_handle_tensordesc`); a map depends only on the base's address, shape, strides, block
    shape, layout and padding, all in its key, so one built earlier is the one Triton would build.
    None where the launcher is not laid out as in Triton 3.6 or needs scratch memory: Triton's launcher
    then runs as it is."""
    launcher = compiled.run
    inner = getattr(launcher, "launch", None)
    try:
        cells = dict(zip(inner.__code__.co_freevars, (c.cell_contents for c in inner.__closure__)))
        launch, indices, metas = cells["launcher"], cells["tensordesc_indices"], cells["tensordesc_meta"]
        make = inner.__globals__["make_tensordesc_arg"]
        cooperative, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
        scratch = launcher.global_scratch_size or launcher.profile_scratch_size
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    if (scratch or sorted(indices) != [i for _, i in desc_args] or len(metas) != len(desc_args)
            or not all(isinstance(meta, dict) for meta in metas)):  # without metadata the base itself is passed
        return None
    descs = tuple((j, i, meta) for (j, i), meta in zip(desc_args, metas))
    return launch, cooperative, pdl, descs[::-1], make, {}


def _getter(positions: tuple):
    """args -> the tuple of args at `positions` (operator.itemgetter, which returns a bare item for one)."""
    if len(positions) >= 2:
        return operator.itemgetter(*positions)
    if positions:
        i = positions[0]
        return lambda args: (args[i],)
    return lambda args: ()


def _knobs():
    global _KNOBS
    if _KNOBS is None:
        from triton import knobs

        _KNOBS = knobs
    return _KNOBS


_KNOBS = None


def install(module) -> None:
    """Put a FastJIT in place of each kernel of a generated module (compiled mode)."""
    if not enabled():
        return
    from triton.runtime.jit import JITFunction

    for name, value in list(vars(module).items()):
        # Kernels, Gluon ones too (their descriptors are keyed by value); not the `_`-named helpers the
        # Gluon kernels call, which the compiler must find as they are.
        if isinstance(value, JITFunction) and not name.startswith("_"):
            setattr(module, name, FastJIT(value))
