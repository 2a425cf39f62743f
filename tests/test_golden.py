"""Golden output: generated/ holds exactly what the generator emits for every spec in specs/."""

import os

import pytest
import triton

from attngen.codegen import render
from attngen.analysis.resources import SHARED_LIMIT
from attngen.passes import compile_program
from attngen.lang.spec import load_file
from conftest import ROOT, shipped_specs

GENERATED = os.path.join(ROOT, "generated")


@pytest.mark.parametrize("path", shipped_specs(), ids=os.path.basename)
def test_generated_source_matches(path):
    spec = load_file(path)
    expected = render(spec, compile_program(spec))
    golden = os.path.join(GENERATED, f"{spec.name}.py")
    assert os.path.exists(golden), f"{golden} is missing: run `attngen compile specs/*.attn`"
    with open(golden) as f:
        assert f.read() == expected, f"{golden} drifted from the generator: run `attngen compile specs/*.attn`"


def test_no_stale_generated_files():
    names = {load_file(p).name for p in shipped_specs()}
    stale = [f for f in os.listdir(GENERATED) if f.endswith(".py") and f[:-3] not in names]
    assert not stale, f"generated/ has files no spec produces: {stale}"


def test_header_names_spec_hash_and_generator():
    from attngen import __version__

    spec = load_file(shipped_specs()[0])
    text = render(spec, compile_program(spec))
    assert f"from spec '{spec.name}' (sha256 {spec.hash})" in text.splitlines()[0]
    assert f"attngen {__version__}" in text.splitlines()[0]


def test_generated_files_compile_for_sm90():
    """The committed modules go through Triton's real compiler for Hopper (no GPU needed), with
    their default configs: the interpreter accepts code the compiler would reject."""
    import importlib.util

    from probe import probe

    jobs, names = [], []
    for path in shipped_specs():
        spec = load_file(path)
        golden = os.path.join(GENERATED, f"{spec.name}.py")
        mod_spec = importlib.util.spec_from_file_location(f"golden_{spec.name}", golden)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        # Every kernel of the module (decoding specs add attn_combine, training specs the backward),
        # each with its own default launch config; jitted helpers (`_tanh`) are compiled inside them.
        kernels = [n for n, f in vars(module).items()
                   if isinstance(f, triton.runtime.KernelInterface) and not getattr(f, "is_gluon", lambda: False)()
                   and not n.startswith("_")]
        if hasattr(module, "WS_SHAPE"):  # the Gluon forward (passes/warp_specialize.py), at its own fixed shape
            jobs.append(dict(path=golden, gluon_ws=True))
            names.append(f"{spec.name}.attn_fwd_ws")
        if hasattr(module, "WS_BWD_SHAPE"):  # and the Gluon backward (its row passes are Triton kernels below),
            # at its shape for short sequences too where it has one
            for short in (False, True)[:1 + bool(module.WS_BWD_SHAPE["short_keys"])]:
                jobs.append(dict(path=golden, gluon_ws="backward", short=short))
                names.append(f"{spec.name}.attn_bwd_dkdv_ws{' (short)' if short else ''}")
        # a variant's run-time tensors (ir/variants.tensor_buffers): ALiBi's slopes, the sinks, declared tensors
        variant_ptrs = {"ALIBI_SLOPES": "*fp32", "SINKS": "*fp32",
                        **{f"ARG_{t.name}": "*" + t.dtype.replace("int", "i") for t in spec.variant.tensors}}
        if hasattr(module, "attn_bwd_order_ws"):  # the varlen backward's tile order (hopper.VARLEN_BWD_SCHEDULE)
            variant_ptrs["ORDER"] = "*i32"
        if spec.fp8_cache:  # an FP8 cache (kv_dtype = fp8_e4m3) and its descale factors
            variant_ptrs.update(K="*fp8e4nv", V="*fp8e4nv", K_DESCALE="*fp32", V_DESCALE="*fp32")
        if spec.dtype.fp8:  # an FP8 spec's descales, and its bf16 output
            variant_ptrs.update(Q_DESCALE="*fp32", K_DESCALE="*fp32", V_DESCALE="*fp32", O="*bf16")
        for kernel in kernels:
            launched_as = "attn_bwd_dkdv" if kernel == "attn_bwd_dkdv_split" else kernel  # (with its config)
            config = dict(getattr(module, "DEFAULT_BACKWARD_CONFIG", {}).get(launched_as, module.DEFAULT_CONFIG))
            warps, stages = config.pop("num_warps"), config.pop("num_stages")
            args = getattr(module, kernel).arg_names
            values = dict(HEAD_DIM=module.HEAD_DIM, HEAD_DIM_PADDED=module.HEAD_DIM_PADDED, **config)
            for name in ("HEAD_DIM_V", "HEAD_DIM_V_PADDED", "HEAD_DIM_ROPE_PADDED"):  # V of another head dim; K past V (v = k[:N])
                if hasattr(module, name):
                    values[name] = getattr(module, name)
            if hasattr(module, "COMBINE_BLOCK_S"):  # the combine kernel's splits per step
                values["BLOCK_S"] = module.COMBINE_BLOCK_S
            if hasattr(module, "WS_BWD_SHAPE"):  # the Gluon backward's row passes: ROW_BLOCK rows per program;
                # the prep pass zeroes claim words (CLAIMS per block of BLOCK_M rows) where the spec claims dQ tiles
                shape = module.WS_BWD_SHAPE
                values.update(BLOCK=shape["ROW_BLOCK"], BLOCK_M=shape["BLOCK_M"],
                              CLAIMS=shape["consumers"] if shape["dq_claim_keys"] else 0)
                if "D" in args:  # a head dim the Gluon tiles pad (d=96): the rows' tiles that wide over D columns
                    values.update(HEAD_DIM=module.HEAD_DIM_PADDED, D=module.HEAD_DIM)
            elif kernel == "attn_bwd_dkdv_sum_ws":  # the Triton backward's pass summing its group split's parts
                values.update(BLOCK=module.TRITON_BWD_SHAPE["SUM_BLOCK"])
                if "D" in args:  # (as wide as the tiles, over the D columns of the tensors)
                    values.update(HEAD_DIM=module.HEAD_DIM_PADDED, D=module.HEAD_DIM)
            if kernel == "fp8_vt_copy":  # FP8's V^T copy, 64 keys a program, in the Hopper kernel's key order
                values.update(BLOCK=64, PERMUTE=True)
            elif kernel == "attn_zero_unused_keys":  # the varlen backward's zeroing of key rows no sequence uses
                values.update(ROWS=64, BLOCK_DK=triton.next_power_of_2(module.HEAD_DIM),
                              BLOCK_DV=triton.next_power_of_2(getattr(module, "HEAD_DIM_V", module.HEAD_DIM)))
            jobs.append(dict(path=golden, kernel=kernel, num_warps=warps, num_stages=stages,
                             constexprs={k: v for k, v in values.items() if k in args},
                             ptr_dtypes={"LSE": "*fp32", "O_PART": "*fp32", "LSE_PART": "*fp32",
                                         "SEQLENS": "*i32", "BLOCK_TABLE": "*i32", "DELTA": "*fp32",
                                         "ROWS": "*fp32", "DQ_ACC": "*fp32", "CLAIM": "*i32", "PARTS": "*fp32",
                                             "DK_PART": "*fp32", "DV_PART": "*fp32",
                                         "CU_SEQLENS_Q": "*i32", "CU_SEQLENS_K": "*i32", "SEQLENS_K": "*i32",
                                         "VT": "*fp8e4nv", **variant_ptrs}))
            names.append(f"{spec.name}.{kernel}")
    assert any(name.endswith(".attn_combine") for name in names)
    for name, result in zip(names, probe(jobs)):
        assert "error" not in result, (name, result)
        assert result["shared"] <= SHARED_LIMIT[(9, 0)], (name, result)  # fits an H100/H200 as shipped


@pytest.mark.parametrize("path", shipped_specs(), ids=os.path.basename)
def test_every_kernel_the_host_code_launches_is_fast_launched(path):
    """The loader wraps a module's kernels in FastJIT (attngen/runtime/launch.py) but for the `_`-named helpers the
    Gluon kernels call: a kernel the host code launches under such a name takes Triton's own launch path (25-45 us
    of host time) and spoils every replay of the call (attngen/runtime/replay.py; the varlen backward's key-row
    zeroing did: benchmarks/NOTES.md [v59])."""
    import ast

    with open(os.path.join(GENERATED, f"{load_file(path).name}.py")) as f:
        tree = ast.parse(f.read())
    jitted = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
              and any("jit" in ast.unparse(d) for d in node.decorator_list)}
    launched = {node.func.value.id for node in ast.walk(tree) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Subscript) and isinstance(node.func.value, ast.Name)
                and node.func.value.id in jitted}
    assert launched, "no launch found: the test reads the module wrongly"
    assert not [name for name in launched if name.startswith("_")]
