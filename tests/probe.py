"""Compile generated kernels for a GPU target on a machine without one.

Triton's ptxas runs on the CPU, so `triton.compile` for sm_90 works here, specialised the way a real
launch would be (pointers and strides 16-aligned, unit strides constant). That gives the real
compiler's shared memory and catches code the interpreter accepts but the compiler rejects.

Triton cannot compile in a process where it was imported in interpreter mode, so tests call
`probe(jobs)`, which runs this file in a subprocess without TRITON_INTERPRET:
    job = {"path": generated .py, "kernel": "attn_fwd", "constexprs": {...}, "num_warps": 4,
           "num_stages": 3, "ptr_dtypes": {"LSE": "*fp32", ...}}
and returns, per job, {"shared": bytes} or {"error": message}. A job {"path": ..., "gluon_ws": true}
compiles the module's warp-specialised Gluon forward (`attn_fwd_ws`) as its launcher would launch it
({"gluon_ws": "backward"}: its Gluon dK/dV kernel, `attn_bwd_dkdv_ws`, with "dq_atomic" / "dq_local" /
"late_rows" / "dq_claim" to set those constexprs, "partial": a split group's float32 partial sums; a spec's declared
tensors, ARG_<name>, are *fp32 pointers unless "arg_ptrs" ({"ARG_<name>": "*i32", ...}) says; "decode": its
Gluon split-KV kernel, `attn_fwd_wsd`, for
"rows" (default 8) padded query rows per K/V head; "short": true, the forward or backward at its shape for short
sequences; a forward or wide backward whose Q and K tiles are column pieces (WS_SHAPE["PIECES"],
WS_BWD_SHAPE["PIECES"]) its pieces' descriptors; a varlen module's forward and backward take their packed sequences'
arguments; an FP8 module's forward its
descales, V^T descriptor and bf16 output) and adds {"warps": ..., "wgmma": count, "tma_loads": count, "tma_stores":
count, "global_stores": count}, for the forward "wgmma_e4m3": how many of its wgmma take e4m3 operands (a decode job:
"shared_loads", its ld.shared count, and with "ptxas": true ptxas -v's "registers", "spill_stores" and "spill_loads").
{"gluon_ws": "mla"}: the Gluon MLA decode kernel, `attn_fwd_wsm`, as its launcher launches it, with "wgmma_s" and
"wgmma_pv" (its m64n(BLOCK_N / 2) score (seesaw: m64nBLOCK_N) and m64n256 P V instructions) and "ptxas" as a decode
job's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

_PTR = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32", "float8_e4m3fn": "*fp8e4nv"}


def _compile_gluon_ws(module, job):
    import torch
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.experimental.gluon._runtime import GluonASTSource

    d = module.HEAD_DIM_PADDED  # the tiles' width: a head dim of 96 runs 128 columns wide over 96-column tensors
    # descriptors carry their block type; CPU memory will do
    t = torch.empty(2, 4, 256, module.HEAD_DIM, dtype=module.DTYPE)

    def desc(rows, layout, cols=d, base=t):
        made = module.GluonTensorDescriptor(base, list(base.shape), list(base.stride()), [1, 1, rows, cols], layout)
        return native_specialize_impl(CUDABackend, made, False, True, True)[0]

    if job.get("gluon_ws") == "decode":  # the split-KV kernel: 2-D descriptors over the page pools or caches
        shape, fn = module.WSD_SHAPE, module.attn_fwd_wsd
        page = getattr(module, "PAGE_SIZE", shape["BLOCK_N"])  # a contiguous cache's loader ignores PAGE
        pool = torch.empty(64 * page, 8 * d, dtype=getattr(module, "KV_DTYPE", module.DTYPE))  # an FP8 cache's e4m3
        kv = native_specialize_impl(CUDABackend, module.GluonTensorDescriptor(
            pool, list(pool.shape), list(pool.stride()), module._WSD_BOX, module._WSD_LAYOUT), False, True, True)[0]
        descs = {"k_desc": kv, "v_desc": kv}
        const = dict(NQ=job.get("rows", 8), BLOCK_N=shape["BLOCK_N"], HEAD_DIM=d, STAGES=shape["STAGES"],
                     PAGE=page, CAUSAL=module.WSD_CAUSAL, LOADER_REGS=shape["loader_regs"])
        ptrs = {"Q": _PTR[str(module.DTYPE).removeprefix("torch.")], "OP": "*fp32", "LP": "*fp32", "SEQLENS": "*i32",
                "BT": "*i32"}
        # a variant's tensors, an FP8 cache's descale factors
        ptrs.update({p: "*fp32" for p in ("SINKS", "ALIBI_SLOPES", "K_DESCALE", "V_DESCALE") if p in fn.arg_names})
        # four warps a consumer warpgroup (WSD_SHAPE has "CONSUMERS" where more than one); "HALVES": a partition each,
        # the default one four warps, launched at maxnreg
        if shape.get("HALVES"):
            const["CONSUMER_REGS"] = shape["consumer_regs"]
            compiled, ptx = _compile_split_kv(fn, descs, ptrs, const, job, num_warps=4, maxnreg=shape["maxnreg"])
        else:
            compiled, ptx = _compile_split_kv(fn, descs, ptrs, const, job, num_warps=4 * shape.get("CONSUMERS", 1))
        return {"shared": compiled.metadata.shared, "warps": compiled.metadata.num_warps,
                "wgmma": ptx.count("wgmma.mma_async"), "tma_loads": ptx.count("cp.async.bulk.tensor.2d.shared"),
                f"wgmma_n{const['NQ']}": ptx.count(f"wgmma.mma_async.sync.aligned.m64n{const['NQ']}k16"),
                "shared_loads": len(re.findall(r"\bld\.shared\.", ptx)), **(_ptxas(ptx) if job.get("ptxas") else {})}
    if job.get("gluon_ws") == "mla":  # the MLA decode kernel: two 2-D descriptors over the latent page pool
        return _compile_gluon_mla(module, job)
    if job.get("gluon_ws") == "backward":  # the dK/dV kernel (job "dq_atomic": with dQ, default the shape's)
        shape, fn = module.WS_BWD_SHAPE, module.attn_bwd_dkdv_ws
        short = "SHORT_" if job.get("short", False) else ""  # the launch's shape for short sequences (short_keys)
        consumers = shape[short + "consumers"]
        kv_keys = shape[short + "BLOCK_N"] // (1 if shape.get("wide") else consumers)  # (wide: shared keys)
        q, kv = desc(shape["BLOCK_M"], module._WS_BWD_Q_LAYOUT), desc(kv_keys, module._WS_BWD_KV_LAYOUT)
        dq_atomic = job.get("dq_atomic", shape["DQ_ATOMIC"])
        dq_local = dq_atomic and job.get("dq_local", False)  # each consumer's own keys' dQ (DQ_LOCAL)
        cols = d if dq_local else d // consumers
        acc = torch.empty(2, 4, 256, d, dtype=torch.float32)  # the float32 accumulator is the tiles' width
        dq = (desc(shape["BLOCK_M"], module._WS_BWD_DQ_LAYOUTS[cols], cols, acc)
              if dq_atomic else kv)
        rows_smem = dq_atomic and job.get("rows_smem", shape["ROWS_SMEM"])
        rows = (desc(2, module._WS_BWD_ROWS_LAYOUT, module._WS_BWD_ROWS_BLOCK[3], torch.empty(4, 4, 2, 256))
                if rows_smem else kv)  # (a varlen launch's: 4 shifted copies of the rows)
        descs = {"q_desc": q, "do_desc": q, "k_desc": kv, "v_desc": kv, "dk_desc": kv, "dv_desc": kv, "dq_desc": dq,
                 "rows_desc": rows}
        if hasattr(module, "_WS_BWD_V_LAYOUT"):  # V, dV and dO narrower than Q and K (head_dim_v)
            tv = torch.empty(2, 4, 256, module.HEAD_DIM_V, dtype=module.DTYPE)
            v = desc(kv_keys, module._WS_BWD_V_LAYOUT, module.HEAD_DIM_V, tv)
            descs.update(v_desc=v, dv_desc=v, do_desc=desc(shape["BLOCK_M"], module._WS_BWD_DO_LAYOUT,
                                                            module.HEAD_DIM_V, tv))
        if "q1_desc" in fn.arg_names:  # the wide path's Q, K and dK in column pieces, dQ a piece's columns a tile
            tq = torch.empty(2, 4, 256, module.HEAD_DIM, dtype=module.DTYPE)
            layouts, (p0, p1) = module._WS_BWD_PIECE_LAYOUTS, shape["PIECES"]
            first, second = ({name: desc(rows, layouts[rows, w], w, tq) for name, rows in
                              (("q", shape["BLOCK_M"]), ("k", kv_keys), ("dk", kv_keys))} for w in (p0, p1))
            descs.update({f"{n}_desc": first[n] for n in first}, **{f"{n}1_desc": second[n] for n in second},
                         dq_desc=desc(shape["BLOCK_M"], module._WS_BWD_DQ_LAYOUTS[p0], p0, acc),
                         dq1_desc=desc(shape["BLOCK_M"], module._WS_BWD_DQ_LAYOUTS[p1], p1, acc))
        const = dict(BLOCK_M=shape["BLOCK_M"], BLOCK_N=shape[short + "BLOCK_N"], HEAD_DIM=d, STAGES=shape[short + "STAGES"],
                     AHEAD=shape["AHEAD"], PREFETCH=shape["PREFETCH"] and not rows_smem, DQ_ATOMIC=dq_atomic,
                     DQ_LOCAL=dq_local, LATE_ROWS=job.get("late_rows", shape["LATE_ROWS"]),
                     DQ_CLAIM=dq_atomic and not dq_local and not job.get("partial", False)
                     and job.get("dq_claim", shape["dq_claim_keys"] > 0),
                     ROWS_SMEM=rows_smem, CAUSAL=module.WS_CAUSAL, CONSUMERS=consumers)
        if "PARTIAL" in fn.arg_names:  # a dense kernel: "partial", its group's query heads split over programs
            const["PARTIAL"] = job.get("partial", False)
            if not const["PARTIAL"]:
                const["SPLIT"] = 1  # (an unsplit launch passes 1, which Triton specialises as a constant)
        # a variant's ALIBI_SLOPES; a dense kernel's DK_PART (the split groups' float32 partial sums)
        pointers = ("LSE", "DELTA", "CLAIM") + tuple(p for p in ("ALIBI_SLOPES", "DK_PART") if p in fn.arg_names)
        # a varlen kernel's: dK and dV for its row-masked stores, the sequences' offsets and lengths
        # (and with hopper.VARLEN_BWD_SCHEDULE the slots' tiles)
        pointers += tuple(p for p in ("DK", "DV", "CU_SEQLENS_Q", "CU_SEQLENS_K", "SEQLENS_K", "ORDER")
                          if p in fn.arg_names)
        maxnreg = shape[short + "maxnreg"]
    else:
        shape, fn = module.WS_SHAPE, module.attn_fwd_ws
        short = "SHORT_" if job.get("short", False) else ""  # the launch's shape for short sequences (short_keys)
        block_n = shape[short + "BLOCK_N"]
        q = desc(shape["BLOCK_M"] // shape["consumers"], module._WS_Q_LAYOUT)
        kv = desc(block_n, module._WS_KV_LAYOUT_SHORT if block_n == shape["SHORT_BLOCK_N"] else module._WS_KV_LAYOUT)
        descs = {"q_desc": q, "o_desc": q, "k_desc": kv, "v_desc": kv}
        if hasattr(module, "_WS_VT_LAYOUT"):  # e4m3 inputs: V^T tiles over (B, H_KV, D, N_K), a bf16 output
            vt = torch.empty(2, 4, d, 256, dtype=module.DTYPE)
            o = torch.empty(2, 4, 256, d, dtype=torch.bfloat16)
            descs.update(v_desc=desc(d, module._WS_VT_LAYOUT, block_n, vt),
                         o_desc=desc(shape["BLOCK_M"] // shape["consumers"], module._WS_O_LAYOUT, d, o))
        elif hasattr(module, "_WS_V_LAYOUT"):  # V and the output narrower than Q and K (head_dim_v)
            dv = module.HEAD_DIM_V
            tv = torch.empty(2, 4, 256, dv, dtype=module.DTYPE)
            descs.update(v_desc=desc(block_n, module._WS_V_LAYOUT, dv, tv),
                         o_desc=desc(shape["BLOCK_M"] // shape["consumers"], module._WS_O_LAYOUT, dv, tv))
        if "q1_desc" in fn.arg_names:  # Q and K in column pieces (WS_SHAPE["PIECES"]), a descriptor each
            tq = torch.empty(2, 4, 256, module.HEAD_DIM, dtype=module.DTYPE)
            rows_q = shape["BLOCK_M"] // shape["consumers"]
            for suffix, w in zip(("", "1"), shape["PIECES"]):
                descs[f"q{suffix}_desc"] = desc(rows_q, module._WS_PIECE_LAYOUTS[rows_q, w], w, tq)
                descs[f"k{suffix}_desc"] = desc(block_n, module._WS_PIECE_LAYOUTS[block_n, w], w, tq)
        const = dict(BLOCK_M=shape[short + "BLOCK_M"], BLOCK_N=block_n, HEAD_DIM=d, STAGES=shape[short + "STAGES"],
                     OVERLAP=shape["OVERLAP"], PINGPONG=shape["PINGPONG"], CAUSAL=module.WS_CAUSAL,
                     QBUF=2 if job.get("persistent", shape["PERSISTENT"]) else 1, CONSUMERS=shape[short + "consumers"])
        maxnreg = shape[short + "maxnreg"]
        # a variant's tensors, an FP8 spec's descales
        pointers = tuple(p for p in ("LSE", "SINKS", "ALIBI_SLOPES", "Q_DESCALE", "K_DESCALE", "V_DESCALE")
                         if p in fn.arg_names)
        # a varlen kernel's: the output for its row-masked stores, the sequences' offsets and lengths
        pointers += tuple(p for p in ("O", "CU_SEQLENS_Q", "CU_SEQLENS_K", "SEQLENS_K") if p in fn.arg_names)
    pointers += tuple(p for p in fn.arg_names if p.startswith("ARG_"))  # a spec's declared tensors
    io = _PTR[str(module.DTYPE).removeprefix("torch.")]
    typed = {"CLAIM": "*i32", "CU_SEQLENS_Q": "*i32", "CU_SEQLENS_K": "*i32", "SEQLENS_K": "*i32", "O": io, "DK": io,
             "DV": io, "ORDER": "*i32", **job.get("arg_ptrs", {})}
    sig = {arg: "constexpr" if arg in const else descs.get(arg, typed.get(arg, "*fp32") if arg in pointers
                                                            else "fp32" if arg == "sm_scale" else "i32")
           for arg in fn.arg_names}
    attrs = {(fn.arg_names.index(p),): [["tt.divisibility", 16]] for p in pointers}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, maxnreg=maxnreg))
    ptx = compiled.asm["ptx"]
    if job.get("ptx_to"):  # for a look at the code (ptxas -v: spills, serialised wgmma)
        with open(job["ptx_to"], "w") as f:
            f.write(ptx)
    return {"shared": compiled.metadata.shared, "warps": compiled.metadata.num_warps,
            "wgmma": ptx.count("wgmma.mma_async"), "tma_loads": ptx.count("cp.async.bulk.tensor.4d.shared"),
            "tma_stores": ptx.count("cp.async.bulk.tensor.4d.global.shared"),
            "tma_reduces": ptx.count("cp.reduce.async.bulk.tensor.4d"), "global_stores": ptx.count("st.global"),
            "wgmma_e4m3": ptx.count(".f32.e4m3.e4m3"), **(_ptxas(ptx) if job.get("ptxas") else {})}


def _compile_split_kv(fn, descs, ptrs, const, job, **options):
    """A Gluon split-KV kernel compiled for sm_90: `descs` its descriptors' specialisations, `ptrs` its pointers'
    types (16-byte aligned), `const` its constexprs, every other argument an i32 but sm_scale; (compiled, its PTX)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {arg: "constexpr" if arg in const else descs.get(arg, ptrs.get(arg, "fp32" if arg == "sm_scale" else "i32"))
           for arg in fn.arg_names}
    attrs = {(fn.arg_names.index(p),): [["tt.divisibility", 16]] for p in ptrs}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    if job.get("ptx_to"):  # for a look at the code (ptxas -v: spills, serialised wgmma)
        with open(job["ptx_to"], "w") as f:
            f.write(ptx)
    return compiled, ptx


def _compile_gluon_mla(module, job):
    """`attn_fwd_wsm` compiled as `launch_attn_fwd_wsm` launches it (a pool of 64 pages of one latent head)."""
    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    shape, fn = module.WSM_SHAPE, module.attn_fwd_wsm
    seesaw = shape.get("SEESAW", False)  # (its scores a whole block's: m64nBLOCK_N)
    pool = torch.empty(64 * module.PAGE_SIZE, module.HEAD_DIM, dtype=module.DTYPE)

    def desc(cols, layout):
        made = module.GluonTensorDescriptor(pool, list(pool.shape), list(pool.stride()), [shape["BLOCK_N"], cols], layout)
        return native_specialize_impl(CUDABackend, made, False, True, True)[0]

    descs = {"kv_desc": desc(module.HEAD_DIM_V // 2, module._WSM_KV_LAYOUT),
             "rope_desc": desc(module.HEAD_DIM - module.HEAD_DIM_V, module._WSM_ROPE_LAYOUT)}
    const = dict(ROWS=shape["ROWS"], BLOCK_N=shape["BLOCK_N"], STAGES=shape["STAGES"], PAGE=module.PAGE_SIZE,
                 CAUSAL=module.WSM_CAUSAL, CONSUMER_REGS=shape["consumer_regs"], LOADER_REGS=shape["loader_regs"])
    ptrs = {"Q": _PTR[str(module.DTYPE).removeprefix("torch.")], "OP": "*fp32", "LP": "*fp32", "SEQLENS": "*i32",
            "BT": "*i32"}
    compiled, ptx = _compile_split_kv(fn, descs, ptrs, const, job, num_warps=4, maxnreg=shape["maxnreg"])
    return {"shared": compiled.metadata.shared, "warps": compiled.metadata.num_warps,
            "wgmma": ptx.count("wgmma.mma_async"), "tma_loads": ptx.count("cp.async.bulk.tensor.2d.shared"),
            "wgmma_s": ptx.count(f"wgmma.mma_async.sync.aligned.m64n{shape['BLOCK_N'] // (1 if seesaw else 2)}k16"),
            "wgmma_pv": ptx.count("wgmma.mma_async.sync.aligned.m64n256k16"),
            **(_ptxas(ptx) if job.get("ptxas") else {})}


def _ptxas(ptx: str) -> dict:
    """ptxas -v's resource use of a kernel's PTX for sm_90a: {"registers": the most any function uses, "spill_stores",
    "spill_loads": bytes, "wgmma_serialized": whether ptxas warned that it serialized the wgmma pipeline}."""
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "kernel.cubin")],
                              capture_output=True, text=True, check=True)
    text = done.stdout + done.stderr
    return {"registers": max(int(n) for n in re.findall(r"Used (\d+) registers", text)),
            "wgmma_serialized": "wgmma.mma_async instructions are serialized" in text,
            "spill_stores": sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", text)),
            "spill_loads": sum(int(n) for n in re.findall(r"(\d+) bytes spill loads", text))}


def _compile(job):
    import importlib.util

    import triton
    from triton.backends.compiler import GPUTarget

    if "module" in job:  # a kernel inside a package (attngen.api.paged), imported by name
        module = importlib.import_module(job["module"])
    else:
        spec = importlib.util.spec_from_file_location(f"probe_{abs(hash(job['path']))}", job["path"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    if job.get("gluon_ws"):
        return _compile_gluon_ws(module, job)
    fn = getattr(module, job["kernel"])
    io = _PTR[str(getattr(module, "DTYPE", "float16")).removeprefix("torch.")]  # hand-written kernels: fp16
    special = job.get("ptr_dtypes", {})
    sig, const, attrs = {}, dict(job["constexprs"]), {}
    if "USE_TMA" in fn.arg_names:  # descriptor loads (passes/tma.py): compiled as the GPU runs them unless told
        const.setdefault("USE_TMA", True)
    for i, arg in enumerate(fn.arg_names):
        if arg in const:
            sig[arg] = "constexpr"
        elif arg.endswith("_DESC") and const["USE_TMA"]:  # [1, 1, BLOCK_M, D] blocks of a (B, H, N, D) tensor
            sig[arg] = f"tensordesc<{io[1:]}[1, 1, {const['BLOCK_M']}, {const['HEAD_DIM']}]>"
        elif arg.endswith("_DESC"):
            sig[arg], const[arg] = "constexpr", None
        elif arg.startswith("stride_") and (arg.endswith("_d") or arg in job.get("unit_strides", ("stride_lse_n",))):
            sig[arg], const[arg] = "constexpr", 1
        elif arg.startswith("stride_"):
            sig[arg] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg in special or (arg.isupper() and arg in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")):
            sig[arg] = special.get(arg, io)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg == "sm_scale":
            sig[arg] = "fp32"
        else:
            sig[arg] = "i32"
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", job.get("capability", 90), 32),
                              options=dict(num_warps=job["num_warps"], num_stages=job["num_stages"]))
    return {"shared": compiled.metadata.shared, "wgmma": "wgmma" in compiled.asm["ptx"]}


def probe(jobs: list[dict]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], input=json.dumps(jobs), capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.splitlines()[-1])


if __name__ == "__main__":
    results = []
    for job in json.loads(sys.stdin.read()):
        try:
            results.append(_compile(job))
        except Exception as e:  # noqa: BLE001 - reported per job
            results.append({"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"})
    print(json.dumps(results))
