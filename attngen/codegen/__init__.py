"""Code generation: the final IR rendered into a Python source file of Triton (and, on Hopper, Gluon) kernels.

`emit.py` spells each IR kernel's body in Triton; the Jinja2 template `attention.py.j2` (in the
top-level `templates/` folder, installed as `attngen.templates`) lays out the module around them:
header, constants, kernels, launchers. `exprs.py` prints the IR's sympy sizes as code; `hooks.py`
renders the math the Gluon templates take from the IR (the scale, the exp2 argument, the running max,
the mask, the log-sum-exp, the backward's values) into their hook points.
"""

from __future__ import annotations

import inspect
from importlib import resources
from pathlib import Path

import jinja2
import sympy

from .. import ir
from ..ir import variants
from ..analysis.resources import Target
from ..lang.spec import Spec
from ..passes import applied_passes
from ..passes.lower import descale_buffers
from ..policy import mixed, splits
from ..policy.configs import backward_config, default_config
from ..version import __version__
from . import exp2_fma
from .emit import KernelEmitter
from .hooks import score_hooks

TEMPLATE = "attention.py.j2"


def template_files():
    """The templates folder: the installed `attngen.templates` package, or, when attngen is run
    from a source checkout that was never installed, the checkout's top-level `templates/`."""
    try:
        return resources.files("attngen.templates")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent.parent / "templates"


def _environment() -> jinja2.Environment:
    def load(name: str) -> str:
        return template_files().joinpath(name).read_text()

    return jinja2.Environment(
        loader=jinja2.FunctionLoader(load),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


_ENV: jinja2.Environment | None = None


def render(spec: Spec, program: ir.Program) -> str:
    """The generated module's source text for a spec and its final IR."""
    global _ENV
    if _ENV is None:
        _ENV = _environment()
    kernels = [KernelEmitter(k).emit() for k in program.kernels]
    names = {k.name for k in kernels}
    backward = {"attn_bwd_dq", "attn_bwd_dkdv"} <= names
    if program.attr("varlen"):
        entries = ["varlen"] + (["varlen_backward"] if backward else [])
    else:
        entries = ["kvcache" if program.attr("kvcache") else "forward"] + (["backward"] if backward else [])
    constants = {"HEAD_DIM": spec.head_dim, "HEAD_DIM_PADDED": spec.head_dim_padded}
    if spec.splits_head_dims:
        constants.update(HEAD_DIM_V=spec.head_dim_v, HEAD_DIM_V_PADDED=spec.head_dim_v_padded)
    if spec.v_from_k:
        rope = spec.head_dim - spec.head_dim_v
        constants["HEAD_DIM_ROPE_PADDED"] = 1 << (rope - 1).bit_length()
    if program.attr("page_size") is not None:
        constants["PAGE_SIZE"] = program.attr("page_size")
    if program.attr("max_block_n") is not None:  # the runtime reads it without rebuilding the program
        constants["MAX_BLOCK_N"] = program.attr("max_block_n")
    if program.attr("combine_block_s") is not None:
        constants["COMBINE_BLOCK_S"] = program.attr("combine_block_s")
    if program.attr("mixed"):
        constants["NARROW_CONFIG"] = dict(mixed.NARROW_LAUNCH)
    triton_split = program.triton_backward.max_group_split > 1
    group_splits = triton_split or bool(program.warp_specialized.backward and not program.attr("varlen"))
    gl_dtype = {"bf16": "bfloat16", "fp16": "float16", "fp8_e4m3": "float8e4nv"}.get(spec.dtype.value, "")
    context = dict(
        generator=f"attngen {__version__}",
        spec_name=spec.name,
        spec_hash=spec.hash,
        spec_lines=spec.canonical().rstrip("\n").split("\n"),
        passes=list(applied_passes(program)),
        constants=constants,
        head_dim_v=spec.head_dim_v if spec.splits_head_dims else None,
        v_from_k=spec.v_from_k,
        torch_dtype=str(spec.dtype.torch).removeprefix("torch."),
        kv_torch_dtype=str(spec.kv_dtype.torch).removeprefix("torch.") if spec.kv_dtype else "",
        out_dtype=str(spec.dtype.output.torch).removeprefix("torch.") if spec.dtype.fp8 else None,
        default_config=default_config(spec, target=Target.default()),  # the same source on every machine
        kernels=kernels,
        attrs=dict(program.attrs),
        entries=entries,
        backward_config=backward_config(spec) if backward else {},
        split_heuristic=_split_heuristic_source(bool(program.warp_specialized.mla) or bool(
            program.warp_specialized.decode and program.warp_specialized.decode.one_wave))
        if program.attr("split_kv") == "auto" else "",
        imports_functools=program.attr("split_kv") == "auto" or triton_split,
        gluon_fwd=program.warp_specialized.forward,
        gluon_bwd=program.warp_specialized.backward,
        # the run-time rule for splitting a GQA group's query heads (attngen/policy/splits.py), pasted in where a
        # dense backward may split (the Gluon one, or the Triton one's attn_bwd_dkdv_split)
        group_split=inspect.getsource(splits.group_split).rstrip() if group_splits else "",
        triton_bwd=program.triton_backward,
        multiprocessors=inspect.getsource(splits.multiprocessors).rstrip()
        if triton_split and program.attr("split_kv") != "auto" else "",
        gluon_decode=program.warp_specialized.decode,
        fwd_hooks=score_hooks(program.kernel("attn_fwd"), _gluon_scope(program))
        if program.warp_specialized.forward else None,
        # a varlen forward takes the variant path (key blocks and masks per sequence, rows that see no key)
        fwd_variant=bool(program.warp_specialized.forward) and (bool(spec.variant) or bool(program.attr("varlen"))),
        # so does a varlen backward (query blocks and masks per sequence, rows past a sequence masked)
        bwd_variant=bool(program.warp_specialized.backward) and (bool(spec.variant) or bool(program.attr("varlen"))),
        bwd_hooks=score_hooks(program.kernel("attn_bwd_dkdv"), _gluon_scope(program))
        if program.warp_specialized.backward else None,
        dq_hooks=score_hooks(program.kernel("attn_bwd_dq"), _gluon_scope(program))
        if program.warp_specialized.backward else None,
        gluon_mla=program.warp_specialized.mla,
        decode_hooks=score_hooks(program.kernel("attn_fwd"), ("qk_scale", "n_k", "split"))
        if program.warp_specialized.decode or program.warp_specialized.mla else None,
        decode_variant=bool(program.warp_specialized.decode) and bool(spec.variant),
        causal={"causal(top_left)": "top_left", "causal(bottom_right)": "bottom_right"}.get(spec.mask.value, ""),
        gl_dtype=gl_dtype,
        # the Gluon decode kernel's ring: an FP8 cache's e4m3, else the queries' dtype
        kv_gl_dtype="float8e4nv" if spec.fp8_cache else gl_dtype,
        # FP8 inputs (the Gluon forward): P V's operand as the IR rounds P, and the output's dtype
        fp8=spec.dtype.fp8,
        gl_p_dtype=_GL_DTYPES.get(_p_operand_dtype(program.kernel("attn_fwd"))) if spec.dtype.fp8 else "",
        exp2_fma_helper=exp2_fma.helper("gl") if program.warp_specialized.forward
        and program.warp_specialized.forward.exp2_fma else "",
        gl_out_dtype={"bf16": "bfloat16", "fp16": "float16"}.get(spec.dtype.output.value, "") if spec.dtype.fp8 else "",
        # register tiles have power-of-two shapes: a Gluon kernel runs d=96 at its padded width (warp-specialize)
        ws_dim="HEAD_DIM" if spec.head_dim == spec.head_dim_padded else "HEAD_DIM_PADDED",
        tensors=_runtime_tensors(spec),
        bwd_tensors=_runtime_tensors(spec, program.kernel("attn_bwd_dq")) if backward else [],
        sinks=spec.variant.sinks,
        uses_tanh=any(e.fn.has(sympy.tanh) for k in program.kernels for st in ir.walk_stmts(k.body)
                      for x in ir.stmt_exprs(st) for e in ir.walk_expr(x) if isinstance(e, ir.Pointwise)),
    )
    return _ENV.get_template(TEMPLATE).render(**context)


_GL_DTYPES = {ir.DT.BF16: "bfloat16", ir.DT.F16: "float16", ir.DT.F8E4M3: "float8e4nv"}


def _p_operand_dtype(kernel: ir.KernelIR) -> ir.DT | None:
    """The dtype the IR casts P V's first operand to (an FP8 program's e4m3), or None where it casts none."""
    for st in ir.walk_stmts(kernel.body):
        for e in ir.stmt_exprs(st):
            for n in ir.walk_expr(e):
                if isinstance(n, ir.Call) and n.op is ir.Op.DOT_ACC:
                    first = n.args[0]
                    return first.dtype if isinstance(first, ir.Call) and first.op is ir.Op.CAST else None
    return None


def _gluon_scope(program: ir.Program) -> tuple[str, ...]:
    """The IR values the Gluon forward and backward hold under the IR's names: qk_scale, and a varlen tile's
    n_q and n_k."""
    return ("qk_scale", "n_q", "n_k") if program.attr("varlen") else ("qk_scale",)


def _runtime_tensors(spec: Spec, kernel=None) -> list[dict]:
    """The keyword tensors the entry points take (a variant's declared tensors, ALiBi slopes, sinks, an FP8
    spec's descales): the keyword, the launchers' parameter name, whether a (heads,) tensor is expanded to
    (batch, heads) (`alibi`) and whether a (1,) one is expanded to (batch, kv_heads) (`descale`); with `kernel`,
    only those it takes (the backward kernels read the score modifier's tensors, not the sinks)."""
    names = spec.runtime_tensors()
    descales = descale_buffers(spec)
    buffers = variants.tensor_buffers(spec.variant) + descales
    taken = None if kernel is None else {p.name for p in kernel.params}
    return [dict(arg=name, param=b.name.lower(), alibi=b.name == variants.ALIBI, descale=b in descales)
            for name, b in zip(names, buffers) if taken is None or b.name in taken]


def _split_heuristic_source(waves: bool) -> str:
    """The run-time split-count rules (attngen/policy/splits.py), pasted into modules that choose at launch;
    `waves`: also the one-wave rule of a kernel whose programs hold a multiprocessor each (the Gluon MLA kernel, the
    FP8 cache's Gluon decode kernel)."""
    import inspect

    rules = (splits.multiprocessors, splits.choose_num_splits) + ((splits.choose_wave_splits,) if waves else ())
    return "\n\n".join(inspect.getsource(f) for f in rules).rstrip()
