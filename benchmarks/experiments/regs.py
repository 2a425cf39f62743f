"""Registers, spills and shared memory of a generated kernel compiled for sm_90a, on a machine without a GPU.

    python benchmarks/experiments/regs.py '{"path": "generated/train_d128.py", "kernel": "attn_bwd_dkdv",
        "constexprs": {"HEAD_DIM": 128, "HEAD_DIM_PADDED": 128, "BLOCK_M": 64, "BLOCK_N": 128},
        "num_warps": 8, "num_stages": 2}'

Compiles through Triton (specialised as a launch would be, like tests/probe.py), then runs Triton's
bundled ptxas -v on the PTX. Optional keys: "dtype" ("*bf16" default), "ptr_dtypes", "desc_rank"
(4: descriptor arguments read [1, 1, BLOCK_M, D] blocks; 2: [BLOCK_M, D]), "desc_dtypes"
({"DQA_DESC": "fp32"}: element types of descriptor arguments other than dtype's). Prints JSON. Run without
TRITON_INTERPRET. Used for benchmarks/NOTES.md v5 (the dK/dV kernel's spills)."""
import importlib.util, json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget

def compile_stats(path, kernel, constexprs, num_warps, num_stages, dtype="*bf16", ptr_dtypes=None, desc_rank=4,
                  desc_dtypes=None):
    spec = importlib.util.spec_from_file_location(f"m{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
    fn = getattr(module, kernel)
    sig, const, attrs = {}, dict(constexprs), {}
    ptr_dtypes = ptr_dtypes or {}
    for i, arg in enumerate(fn.arg_names):
        if arg in const: sig[arg] = "constexpr"
        elif arg.endswith("_DESC"):
            bm, hd = const.get("BLOCK_M"), const.get("HEAD_DIM")
            ddt = (desc_dtypes or {}).get(arg, dtype[1:])
            sig[arg] = f"tensordesc<{ddt}[1, 1, {bm}, {hd}]>" if desc_rank == 4 else f"tensordesc<{ddt}[{bm}, {hd}]>"
        elif arg.startswith("stride_") and (arg.endswith("_d") or arg in ("stride_lse_n","stride_delta_n")):
            sig[arg], const[arg] = "constexpr", 1
        elif arg.startswith("stride_"):
            sig[arg] = "i32"; attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg in ptr_dtypes or arg in ("Q","K","V","O","DO","DQ","DK","DV"):
            sig[arg] = ptr_dtypes.get(arg, dtype); attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg in ("LSE","DELTA"): sig[arg] = "*fp32"; attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg == "sm_scale": sig[arg] = "fp32"
        else: sig[arg] = "i32"
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = c.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f: f.write(ptx)
    out = subprocess.run([ptxas, "-v", "-arch=sm_90a", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    info = [l for l in (out.stderr + out.stdout).splitlines() if "registers" in l or "spill" in l]
    return {"shared": c.metadata.shared, "ptxas": info, "wgmma": ptx.count("wgmma.mma_async")}

if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    print(json.dumps(compile_stats(**job)))
