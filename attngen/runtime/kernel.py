"""Loading a spec as a callable kernel.

`load(spec)` parses the spec, lowers it, renders the Triton module (or finds it in the disk cache),
imports it from its file, and wraps it in a `Kernel`: the object users call. A `Kernel` checks every
tensor against its spec before anything is launched (a mismatch is a `ValueError` naming the
argument), picks the launch configuration (tuned for the GPU and shape bucket when a tuned entry
exists: attngen/runtime/tables.py), allocates outputs and launches. Its backward kernels and KV-cache entry
have launch configs of their own (`Kernel.part`, attngen/runtime/parts.py); the tuner (attngen/tuning/)
adapts each part from above.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

from ..analysis.resources import check_spec_tiles, infeasible
from ..codegen import render
from ..env import interpreting
from ..errors import KernelInputError
from ..lang.spec import Spec, load_file, parse
from ..passes import compile_program
from .. import policy
from ..policy import configs
from . import autograd, cache, interpreter_fixes, launch, registry, tables, varlen, warmup
from .arguments import (check_attention_inputs, check_disjoint, check_indexing, check_like, check_out, new_output,
                        output_shape,
                        check_packed_indexing, check_recording, check_runtime_tensors, check_scale, gradient_tensors, on_other_gpu,
                        tensor_signature, unit_descale)
from .keys import Shape, problem_text
from .parts import PARTS, BackwardPart, KVCachePart
from .plans import PLANS

_LOADED: dict[str, "Kernel"] = {}
# id(spec) -> (spec, mode, kernel): `load` of a Spec object it has seen (the API's lru-cached specs)
# skips the canonical text, ~20 us of a decoding step's Python.
_BY_ID: dict[int, tuple] = {}
_LOCK = threading.Lock()


def _import(path: Path, key: str) -> ModuleType:
    name = f"attngen_kernels.{path.stem}_{key}"
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def as_spec(spec_or_text: "Spec | str | os.PathLike") -> Spec:
    """A Spec from a Spec, a path to a .attn file, or spec text."""
    if isinstance(spec_or_text, Spec):
        return spec_or_text
    if isinstance(spec_or_text, os.PathLike):
        return load_file(os.fspath(spec_or_text))
    if not isinstance(spec_or_text, str):
        raise TypeError(f"load() takes a Spec, a path or spec text, not {type(spec_or_text).__name__}")
    text = spec_or_text
    if "{" not in text and (text.endswith(".attn") or os.path.exists(text)):
        return load_file(text)
    return parse(text, "<string>")


def load(spec_or_text: "Spec | str | os.PathLike", *, autotune: bool | None = None) -> "Kernel":
    """Generate (or fetch from the cache) the kernel a spec describes and import it.

    The same spec (by canonical text) loads once per process; the generated file is reused across
    processes through the disk cache. Calls use tuned configs where they exist and never tune,
    unless `autotune=True` (or, with `autotune=None`, the environment variable ATTNGEN_AUTOTUNE=1):
    then a call whose shape bucket nobody tuned on this GPU tunes it first, once, and saves it.
    """
    mode = "interpret" if interpreting() else "compile"
    turned = policy.switches()  # (the generated code depends on them: a module per setting)
    if autotune is None:
        hit = _BY_ID.get(id(spec_or_text))
        if hit is not None and hit[0] is spec_or_text and hit[1] == mode and hit[3] == turned:
            return hit[2]
    spec = as_spec(spec_or_text)
    canonical = spec.canonical()
    keyed = canonical + "".join(f"\n# policy switch {value!r}" for value in turned)
    if mode == "interpret":
        interpreter_fixes.apply()
    with _LOCK:
        kernel = _LOADED.get(keyed + mode)
        if kernel is None:
            check_spec_tiles(spec)
            program_box = {}

            def generate() -> str:
                program_box["program"] = compile_program(spec)
                return render(spec, program_box["program"])

            path, source = cache.cached_source(spec.name, keyed, generate)
            module = _import(path, cache.cache_key(keyed) + ("_i" if mode == "interpret" else ""))
            if mode == "compile":
                launch.install(module)
            kernel = Kernel(spec, source, path, module, program_box.get("program"))
            _LOADED[keyed + mode] = kernel
        # (registered on every load that gets here: modules of one spec under other switch settings share its
        # key, and the ops must resolve the one the switches now choose)
        registry.register(kernel)
        if autotune is None:
            if spec is spec_or_text:
                if len(_BY_ID) > 256:
                    _BY_ID.clear()
                _BY_ID[id(spec)] = (spec, mode, kernel, turned)
            return kernel
        # The same module and file, its own autotune setting (and its own key for the custom ops),
        # loaded once per setting too. Its call plans are its own: `PLANS` keys them by the Kernel object.
        variant = f"{keyed}{mode} autotune={autotune}"
        if variant not in _LOADED:
            _LOADED[variant] = copy.copy(kernel)
            _LOADED[variant].autotune = autotune
            _LOADED[variant]._parts = {}  # its own, which follow its own autotune setting
            _LOADED[variant]._backward_configs = {}
            registry.register(_LOADED[variant])
        return _LOADED[variant]


registry.set_loader(load)



class Kernel:
    """A generated attention kernel. Call it like attention: `kernel(q, k, v)`.

    Attributes: `spec` (the parsed spec), `source` (the generated Triton text), `path` (the file it
    was imported from), `module` (the imported module), `autotune` (tune untuned shape buckets on
    first use: True, False, or None to follow ATTNGEN_AUTOTUNE).
    """

    def __init__(self, spec: Spec, source: str, path: Path, module: ModuleType, program=None,
                 autotune: bool | None = None):
        self.spec = spec
        self.autotune = autotune
        self.source = source
        self.path = path
        self.module = module
        self._program = program
        self._parts: dict = {}
        self._backward_configs: dict = {}  # `backward_config`'s memo
        # The keyword tensors its calls take (a variant's declared tensors, alibi_slopes, sinks, an FP8 spec's
        # descales), in order.
        self.tensor_names = spec.runtime_tensors()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def program(self):
        """The final IR (recomputed on demand when the source came from the disk cache)."""
        if self._program is None:
            self._program = compile_program(self.spec)
        return self._program

    def __repr__(self) -> str:
        return f"<attngen.Kernel {self.spec.name} [{self.spec.hash}] from {self.path}>"

    # -- configuration -----------------------------------------------------------------------------
    @property
    def kvcache(self) -> bool:
        """Whether the spec is a kernel over a KV cache (split-KV or paged): `forward_kvcache`. A paged varlen
        kernel is not: it takes packed sequences (`forward_varlen`)."""
        return (self.spec.is_split or self.spec.kv_layout.paged) and not self.spec.varlen

    def part(self, name: str):
        """One launch of this kernel with a launch config of its own (attngen/runtime/parts.py): "forward" (this
        kernel), "attn_bwd_dq" / "attn_bwd_dkdv" (`BackwardPart`), "kvcache" (`KVCachePart`). One object per
        part, so run-time lookups memoise on it."""
        if name == "forward":
            return self
        found = self._parts.get(name)
        if found is None:
            found = KVCachePart(self) if name == "kvcache" else BackwardPart(self, name)
            found = self._parts.setdefault(name, found)
        return found

    def config(self, q: torch.Tensor, k: torch.Tensor) -> dict:
        """The launch configuration for these inputs: the tuned one for this GPU and shape bucket
        (this process's tuning > the user's cache > the table shipped in the package; the nearest
        tuned bucket if this one has none), else the heuristic of attngen/policy/configs.py."""
        shape = Shape.of(q, k)
        if self.kvcache:  # full caches through `forward`: the kvcache kernel's config, split by heuristic
            config = self.part("kvcache").config(shape, q.device.index)
            config.pop("num_splits", None)
            return config
        return tables.launch_config(self, shape, q.device.index)  # memoised: a few dictionary lookups

    @property
    def key(self) -> str:
        """The name the custom ops (attngen/runtime/autograd.py) know this kernel by."""
        key = f"{self.spec.hash}:{'interpret' if interpreting() else 'compile'}"
        return key if self.autotune is None else f"{key}:autotune={self.autotune}"

    def backward_config(self, q: torch.Tensor, k: torch.Tensor) -> dict:
        """Launch configurations of the backward kernels, by kernel name: tuned as the forward's.
        Memoised per shape and tuning generation (as `tables.launch_choice` is, one level down)."""
        memo_key = (tables.generation(), q.device.index, q.shape, k.shape)
        found = self._backward_configs.get(memo_key)
        if found is None:
            if len(self._backward_configs) > 1024:
                self._backward_configs.clear()
            shape = Shape.of(q, k)
            found = {part: tables.launch_config(self.part(part), shape, q.device.index) for part in PARTS}
            self._backward_configs[memo_key] = found
        return {part: dict(config) for part, config in found.items()}

    # -- calling -----------------------------------------------------------------------------------
    def __call__(self, q, k, v, *, scale: float | None = None, return_lse: bool = False,
                 out: torch.Tensor | None = None, config: dict | None = None, **tensors):
        """softmax(q k^T * scale) v for q (B, H, N_Q, D) and k, v (B, H_KV, N_K, D).

        Returns the output (shaped and typed like q), and with `return_lse=True` also the natural-log
        log-sum-exp of each query row's scores, (B, H, N_Q) float32 (-inf for rows with no visible key).
        When q, k or v (or the sinks) require grad, the call is recorded for autograd (forward+backward
        specs only).

        `tensors`: the spec's run-time tensors by keyword (`tensor_names`: its declared tensors,
        `alibi_slopes` (H,) or (B, H) float32, `sinks` (H,); an FP8 spec's `q_descale`, `k_descale`, `v_descale`,
        an FP8 cache's `k_descale`, `v_descale`, float32 (1,), (H_KV,) or (B, H_KV), 1 where not given), checked by
        `arguments.check_runtime_tensors`;
        a variant's sinks get a gradient, its other tensors are constants. An FP8 spec's output is bfloat16.

        A call without `config=` whose signature repeats an earlier call's (its plan in `PLANS`, the one cache
        of the three call paths) skips the checks that call passed (but whether `out` shares memory with an
        input: addresses are not in the signature), and from the signature's third call on replays the launches
        of its second (attngen/runtime/replay.py), with autograd or without, as `attngen.attention` does. With
        run-time tensors, calls without autograd plan and replay the same way (each call's own tensors, their
        layouts in the signature); calls recorded for autograd are checked every time.

        A varlen spec's kernel (`layout = varlen`) takes packed sequences instead: `kernel(q, k, v, *,
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None, block_table=None, scale=None,
        return_lse=False, out=None, **tensors)` (attngen/runtime/varlen.py).
        """
        if self.spec.varlen:
            return varlen.call(self, q, k, v, scale=scale, return_lse=return_lse, out=out, config=config, **tensors)
        signature = None
        if config is None and not torch.compiler.is_compiling():
            signature = self._signature(q, k, v, scale, return_lse, out, tensors)
            plan = None if signature is None else PLANS.get(signature)
            if plan is not None:
                if not autograd.needs_grad(q, k, v):  # (with run-time tensors, always: `_signature`)
                    if out is not None:
                        check_disjoint(out, "out", {"q": q, "k": k, "v": v})
                    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32) if return_lse else None
                    out = autograd.replayed_forward(plan.inference, plan.key, plan.scale, False, q, k, v, lse, out,
                                                    self._planned_tensors(q, tensors))
                    return (out, lse) if return_lse else out
                if self.spec.backward and out is None:  # (grad mode is not in the signature: refused below)
                    return autograd.planned_forward(plan.training, plan.key, plan.scale, False, q, k, v, return_lse)
        check_attention_inputs(self.spec, q, k, v)
        extra = check_runtime_tensors(self.spec, q, tensors, kv_heads=k.shape[1]) if tensors or self.tensor_names else ()
        sm_scale = check_scale(scale, self.spec)
        grad = autograd.needs_grad(q, k, v, *extra)
        check_recording(self.spec, grad, torch.compiler.is_compiling(), out, config)
        if grad or torch.compiler.is_compiling():
            out, lse = autograd.attention_forward(self.key, q, k, v, sm_scale, extra)
        else:
            out, lse = self.forward(q, k, v, sm_scale, out=out, config=config, tensors=extra)  # (checks out)
        if signature is not None:  # (a call that passed every check)
            # (the plan's key is fixed by the signature)
            PLANS.keep(signature, autograd.Plan.new(self.key, sm_scale, False))
        return (out, lse) if return_lse else out

    def _signature(self, q, k, v, scale, return_lse, out, tensors: dict) -> tuple | None:
        """The key of `PLANS`: this Kernel (its call path: a copy loaded with its own autotune setting keeps
        its own plans), each tensor's `tensor_signature` (out's too, or None), the scale and `return_lse`,
        whether Triton interprets and the tuning tables' generation (a replay keeps the config it was recorded
        with); for a spec with run-time tensors, the keywords given, their layouts and grad mode (all that
        `check_runtime_tensors` reads). None where an argument is not of the plain type the checks expect (checked
        afresh), or for run-time tensors in a call recorded for autograd (the sinks' gradient is made by torch
        operations a replay would not repeat)."""
        if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
                and (out is None or type(out) is torch.Tensor)
                and (scale is None or type(scale) in (float, int)) and type(return_lse) is bool):
            return None
        given = ()
        if tensors or self.tensor_names:
            if any(type(t) is not torch.Tensor for t in tensors.values()) or autograd.needs_grad(
                    q, k, v, *tensors.values()):
                return None
            given = (tuple((name, tensor_signature(t)) for name, t in sorted(tensors.items())),
                     torch.is_grad_enabled())
        return (self, tensor_signature(q), tensor_signature(k), tensor_signature(v),
                None if out is None else tensor_signature(out), scale, return_lse, interpreting(),
                tables.generation(), policy.generation(), *given)

    def _planned_tensors(self, q, tensors: dict) -> tuple:
        """A planned call's run-time tensors in `tensor_names` order, as `check_runtime_tensors` passed them at the
        signature's first call (an FP8 descale not given: 1; every other name was given, or that call failed)."""
        return tuple(tensors[name] if name in tensors else unit_descale(q.device) for name in self.tensor_names)

    def forward(self, q, k, v, scale: float, out: torch.Tensor | None = None, config: dict | None = None,
                lse: torch.Tensor | None = None, tensors: tuple = ()):
        """Run the forward on checked inputs; returns (out, lse). No autograd. `lse`, if given, is a
        contiguous float32 (B, H, N_Q) tensor on q's device to write the log-sum-exp into (not checked:
        attngen's autograd path allocates it). `tensors`: the checked run-time tensors, in `tensor_names`
        order."""
        if on_other_gpu(q):
            # Triton launches on the current device: make q's current for this call (the tuning
            # lookup, the launch and the stream it runs on).
            with torch.cuda.device(q.device):
                return self.forward(q, k, v, scale, out=out, config=config, lse=lse, tensors=tensors)
        dtype = self.spec.dtype.output.torch
        if out is not None:
            check_out(out, q, inputs={"q": q, "k": k, "v": v}, shape=output_shape(q, v), dtype=dtype)
        else:
            out = new_output(q, v, dtype)
        if out.stride() != q.stride():  # else q's checks cover out (empty_like(q) differs when q is expanded)
            check_indexing("out", out)
            if self.spec.packs_gqa:
                check_packed_indexing("out", out, q.shape[1] // k.shape[1])
        if lse is None:
            lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        if q.numel() and q.shape[2]:
            launch = dict(self.config(q, k))
            if config:
                launch.update(config)
            warmup.wait()
            self.module.forward(q, k, v, scale, out=out, lse=lse, config=launch, **self._keywords(tensors))
        return out, lse

    def _keywords(self, tensors: tuple) -> dict:
        """The generated module's keyword tensors; sinks in float32, as its kernels read them."""
        named = dict(zip(self.tensor_names, tensors))
        if named.get("sinks") is not None:
            named["sinks"] = named["sinks"].float()
        return named

    def backward(self, q, k, v, out, lse, do, scale: float | None = None, config: dict | None = None,
                 grads: tuple | None = None, **tensors):
        """Gradients (dq, dk, dv) for the output gradient `do`, from what `forward` returned; a spec with
        sinks adds their gradient (H,), in the sinks' dtype, last.

        `grads`, if given, are the three tensors to write dq, dk and dv into (shaped like q, k, v).
        `tensors`: the run-time tensors the forward took, by keyword.
        """
        if self.spec.dtype.fp8:
            raise KernelInputError(f"kernel '{self.spec.name}' takes FP8 inputs and is forward-only: the backward "
                                   "stays 16-bit")
        if not self.spec.backward:
            raise KernelInputError(f"kernel '{self.spec.name}' is forward-only: write direction = forward+backward")
        check_attention_inputs(self.spec, q, k, v)
        extra = check_runtime_tensors(self.spec, q, tensors, kv_heads=k.shape[1]) if tensors or self.tensor_names else ()
        check_like(out, q, "out", output_shape(q, v))
        check_like(do, q, "do", output_shape(q, v))  # read only: an expanded gradient (from out.sum()) is fine
        if not (isinstance(lse, torch.Tensor) and lse.shape == q.shape[:3] and lse.dtype == torch.float32):
            raise KernelInputError(f"lse must be a float32 tensor of shape {tuple(q.shape[:3])}")
        if lse.layout is not torch.strided or lse.device != q.device:
            raise KernelInputError(f"lse must be a dense tensor on {q.device}; got a {lse.layout} tensor on {lse.device}")
        sm_scale = check_scale(scale, self.spec)
        if grads is not None:
            read = {"q": q, "k": k, "v": v, "out": out, "do": do, "lse": lse}
            for name, g, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
                check_out(g, like, name, inputs=read)
                read[name] = g
        return self._backward(q, k, v, out, lse, do, sm_scale, config, grads, extra)

    def backward_saved(self, q, k, v, out, lse, do, scale: float, tensors: tuple = ()):
        """`backward` for autograd: q, k, v and `scale` are what a checked `forward` call took, `out` and
        `lse` what it returned, kept unchanged since by autograd (its version counters raise on an
        in-place change); only the output gradient `do` is checked. Saves the host time of the checks,
        which a short backward is bound by."""
        check_like(do, q, "do", output_shape(q, v))
        return self._backward(q, k, v, out, lse, do, scale, None, None, tensors)

    def _backward(self, q, k, v, out, lse, do, sm_scale: float, config: dict | None, grads: tuple | None,
                  tensors: tuple = ()):
        if on_other_gpu(q):
            with torch.cuda.device(q.device):
                return self._backward(q, k, v, out, lse, do, sm_scale, config, grads, tensors)
        dq, dk, dv = gradient_tensors(q, k, v) if grads is None else grads
        sinks = dict(zip(self.tensor_names, tensors)).get("sinks")
        if q.numel() == 0 or k.numel() == 0:
            # Nothing attends: every gradient is zero (and no kernel can be launched on an empty grid).
            zeros = (dq.zero_(), dk.zero_(), dv.zero_())
            return zeros if sinks is None else zeros + (torch.zeros_like(sinks),)
        launch = self.backward_config(q, k)
        for name, extra in (config or {}).items():
            launch[name] = dict(launch[name], **extra)
        warmup.wait()
        grads = self.module.backward(q, k, v, out, lse, do, sm_scale, dq=dq, dk=dk, dv=dv, config=launch,
                                     **self._keywords(tensors))
        if sinks is None:
            return grads
        return grads[:3] + (grads[3].to(sinks.dtype),)

    def varlen_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale: float, tensors: tuple = (), *,
                       block_table=None, max_seqlens: tuple[int, int] | None = None, out=None, lse=None):
        """(out, lse) of a varlen kernel on checked packed inputs (attngen/runtime/varlen.py `forward`, whose
        keywords these are), for autograd and for the API's planned calls."""
        return varlen.forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, block_table, scale, out=out,
                              tensors=tensors, max_seqlens=max_seqlens, lse=lse)

    def varlen_backward(self, q, k, v, out, lse, do, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale: float,
                        tensors: tuple = (), grads: tuple | None = None):
        """The gradients of `varlen_forward` (dq, dk, dv[, dsinks]), into `grads` (dq, dk, dv) where given; only
        `do` is checked."""
        return varlen.backward(self, q, k, v, out, lse, do, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale, tensors,
                               grads)

    # -- what the config lookup reads (attngen/runtime/tables.py) ---------------------------------
    def tuning_problem(self) -> str:
        # NOTE: the forward kernel is the same code whether or not the spec has a backward.
        return problem_text(self.spec, "forward", ignore=("direction",))

    def tuning_space(self) -> dict:
        return configs.search_space(self.spec)

    def tuning_default(self) -> dict:
        return configs.default_config(self.spec, interpreter=interpreting())

    def tuning_infeasible(self, config: dict, target) -> str | None:
        return infeasible(self.spec, config, target)
