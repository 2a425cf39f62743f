"""Helpers the experiment scripts share: variant modules built from generated source, and a short
CUDA-graph timing for sweeps of hundreds of candidates."""

from __future__ import annotations

import importlib.util
import os


def load(path: str, name: str):
    """Import the Python file at `path` as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_variants(source: str, variants: dict, tag: str) -> dict:
    """{name: module} for each variant: its rewrite steps applied in order to `source`, written
    under /tmp/<tag>/ and imported."""
    os.makedirs(f"/tmp/{tag}", exist_ok=True)
    modules = {}
    for name, steps in variants.items():
        text = source
        for step in steps:
            text = step(text)
        path = f"/tmp/{tag}/{tag}_{name}.py"
        with open(path, "w") as f:
            f.write(text)
        modules[name] = load(path, f"{tag}_{name}")
    return modules


def module_outputs(part, variants: dict, inputs: dict, config: dict) -> dict:
    """{name: output} of a tuner part's call (outputs poisoned first) with each variant module in turn."""
    import torch

    outs = {}
    for name, module in variants.items():
        part.kernel.module = module
        part.tuning_run(inputs, config, poison=True)
        torch.cuda.synchronize()
        outs[name] = inputs["out"].clone()
    return outs


def alternate_modules(part, variants: dict, inputs: dict, config: dict, nbytes: int, row: dict, rounds: int = 2):
    """Time the call with each variant module as CUDA-graph replays, `rounds` rounds in alternating order
    (timings taken one after another drift by 1-2%, NOTES v20); append each round's GB/s to row[name]."""
    from attngen.tuning.search import bench, graphed

    for rep in range(rounds):
        for name, module in (variants.items() if rep % 2 == 0 else reversed(variants.items())):
            part.kernel.module = module
            ms = bench(graphed(lambda: part.tuning_run(inputs, config)), 50, True)
            row.setdefault(name, []).append(nbytes / (ms * 1e-3) / 1e9)


def quick_graph(fn) -> float:
    """fn captured in a CUDA graph; median ms of its replays (do_bench, 25 ms: a sweep measurement)."""
    import torch
    import triton

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=25, return_mode="median")


def error_text(e: Exception, width: int = 160) -> str:
    """A failed variant's row entry: the exception's type and the last line of its message."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[-1][:width] if msg else ''}"


def rel_err(got, want) -> float:
    """Relative Frobenius error of `got` against `want`, in float32."""
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


FORWARD_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


def bench_forward_variants(variants: dict, tag: str, seq_lens, head_dims, neighbours, tokens=16384, hidden=2048,
                           dev: str = "cuda"):
    """Time variants of the prefill forward that `attngen.attention()` runs (the sdpa spec of bf16 /
    head dim / mask). `variants` maps a name to its rewrite steps of the generated source (the first
    name is the base). Cases: batch tokens/N, heads hidden/d, causal and not; each variant at the tuned
    config and at `neighbours` (BLOCK_M, BLOCK_N, num_warps, num_stages); do_bench median. Each output
    is checked against the base's at the same config (relative Frobenius, lse max abs; `flag` above
    1e-2 / 1e-3; `equal_to_base` bit for bit) and the base against torch SDPA. Returns (rows, cases)."""
    import torch
    import triton

    import attngen
    from attngen.api import sdpa_spec

    rows, cases, base = [], [], next(iter(variants))
    for d in head_dims:
        for causal in (False, True):
            kernel = attngen.load(sdpa_spec("bf16", d, causal))
            modules = build_variants(kernel.source, variants, f"{tag}{d}{'c' if causal else 'f'}")
            for n in seq_lens:
                b, h = tokens // n, hidden // d
                gen = torch.Generator(device=dev).manual_seed(d + causal + n)
                q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(3))
                scale = d ** -0.5
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                tuned = kernel.config(q, k)
                configs = [tuple(tuned[key] for key in FORWARD_KEYS)]
                configs += [c for c in neighbours if c not in configs]
                out = torch.empty_like(q)
                lse = torch.empty(q.shape[:3], device=dev, dtype=torch.float32)
                sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
                for ci, cfg in enumerate(configs):
                    config = dict(zip(FORWARD_KEYS, cfg))
                    base_out = base_lse = None
                    for vname, module in modules.items():
                        row = dict(n=n, head_dim=d, causal=causal, batch=b, heads=h, variant=vname, config=cfg,
                                   tuned=ci == 0)

                        def run(module=module, config=config):
                            module.launch_attn_fwd(q=q, k=k, v=v, o=out, lse=lse, sm_scale=scale, **config)

                        try:
                            out.fill_(float("nan"))
                            lse.fill_(float("nan"))
                            run()
                            torch.cuda.synchronize()
                            if vname == base:
                                base_out, base_lse = out.clone(), lse.clone()
                                row["err_vs_sdpa"] = rel_err(out, sdpa)
                            elif base_out is not None:
                                row["err_vs_base"] = rel_err(out, base_out)
                                row["lse_err_vs_base"] = (lse - base_lse).abs().max().item()
                                row["equal_to_base"] = torch.equal(out, base_out) and torch.equal(lse, base_lse)
                                row["flag"] = not (row["err_vs_base"] <= 1e-2 and row["lse_err_vs_base"] <= 1e-3)
                            ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
                            row.update(ms=ms, tflops=flops / ms / 1e9)
                        except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
                            row["error"] = error_text(e)
                        rows.append(row)
                    cells = " ".join(f"{r['variant']}={r.get('tflops', float('nan')):.0f}" for r in rows[-len(modules):])
                    print(f"N={n} d={d} causal={causal} {cfg}{' tuned' if ci == 0 else ''}: {cells}", flush=True)
                cases.append(dict(n=n, head_dim=d, causal=causal, tuned=configs[0]))
                del q, k, v, out, lse, sdpa
    return rows, cases


def print_forward_variants(title: str, names, rows, cases, width: int = 9) -> None:
    """The table of bench_forward_variants' rows: TFLOP/s per case, config and variant; * marks the
    tuned config, ! an output that differs from the base's, = one bitwise equal to it."""
    print(f"\n{title}; * = tuned config, ! = output differs from base's by > 1e-2 (or lse by > 1e-3), "
          f"= bitwise equal to base")
    print(f"{'N':>6} {'d':>4} {'mask':>6} {'config':>18} " + " ".join(f"{v:>{width}}" for v in names) + "  max_err")
    for c in cases:
        sel = [r for r in rows if r["n"] == c["n"] and r["head_dim"] == c["head_dim"] and r["causal"] == c["causal"]]
        for cfg in dict.fromkeys(r["config"] for r in sel):
            cells, errs = [], []
            for vname in names:
                r = next(r for r in sel if r["config"] == cfg and r["variant"] == vname)
                cell = f"{r['tflops']:.1f}" if "tflops" in r else "err"
                mark = "!" if r.get("flag") else ("=" if r.get("equal_to_base") else "")
                cells.append(f"{cell + mark:>{width}}")
                if "err_vs_base" in r:
                    errs.append(r["err_vs_base"])
            star = "*" if cfg == c["tuned"] else " "
            print(f"{c['n']:>6} {c['head_dim']:>4} {'causal' if c['causal'] else 'full':>6} {str(cfg) + star:>18} "
                  + " ".join(cells) + f"  {max(errs) if errs else float('nan'):.1e}")
    for r in rows:
        if "error" in r:
            print(f"  N={r['n']} d={r['head_dim']} causal={r['causal']} {r['variant']} {r['config']}: {r['error']}")


def variant_cells(rows: list, names, width: int = 8) -> str:
    """One table line's cells: each named variant's TFLOP/s from `rows` (dicts with "variant"), `!`
    where its output was NaN or differed from the base's by more than 1e-2, `err` where it failed."""
    sel = {r["variant"]: r for r in rows}
    cells = []
    for name in names:
        r = sel.get(name, {})
        bad = r.get("nan") or r.get("err_vs_base", 0) > 1e-2
        cells.append(f"{r['tflops']:.1f}{'!' if bad else ''}" if "tflops" in r else "err")
    return " ".join(f"{c:>{width}}" for c in cells)


def gluon_variant_module(spec, name: str, shape: dict, tag: str, attr: str = "warp_specialized"):
    """The generated module of `spec` with a Gluon kernel rendered at another launch shape: the
    warp-specialize pass's attribute `attr` (warp_specialized: the forward; warp_specialized_bwd: the
    dK/dV kernel) with `shape`'s keys replaced (the templates read every key), written under /tmp/<tag>/
    and imported."""
    from attngen.codegen import render
    from attngen.passes import compile_program

    program = compile_program(spec)
    ws = dict(program.attr(attr), **shape)
    path = f"/tmp/{tag}/{spec.name}_{name}.py"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(render(spec, program.with_attrs(**{attr: tuple(ws.items())})))
    return load(path, f"{spec.name}_{name}")


def template_module(spec, name: str, path: str, shape: dict, tag: str, attr: str = "warp_specialized_bwd"):
    """gluon_variant_module(spec, name, shape, tag, attr) with the Gluon backward's template,
    gluon_backward.py.j2, read from `path` instead of the checkout's (an older or patched version)."""
    import jinja2

    import attngen.codegen as cg

    def load_template(tname: str) -> str:
        if tname == "gluon_backward.py.j2":
            with open(path) as f:
                return f.read()
        return cg.template_files().joinpath(tname).read_text()

    cg._ENV = jinja2.Environment(loader=jinja2.FunctionLoader(load_template), undefined=jinja2.StrictUndefined,
                                 keep_trailing_newline=True, autoescape=False)
    try:
        return gluon_variant_module(spec, name, shape, tag, attr=attr)
    finally:
        cg._ENV = None


def print_backward_rows(result: dict, names: list, checked: str) -> None:
    """The table of backward_variants_row rows in result["rows"] for the variants `names`: GPU us of all the
    call's kernels and the Gluon kernel's (best round), whole-call TFLOP/s beside Flex and cuDNN, gradient
    errors over 2e-2; then how many of result["checks"] (backward_float64_check rows of `checked`) passed."""
    nan = float("nan")
    print(f"{'mask':>6} {'N':>6} " + " ".join(f"{x + ' gpu':>10} {x + ' krn':>10}" for x in names) + "   "
          + " ".join(f"{x:>6}" for x in names + ["flex", "cudnn"]) + "  errs")
    for r in result["rows"]:
        cells = " ".join(f"{min(r.get(f'{x} gpu us', [nan])):10.1f} {min(r.get(f'{x} kernel us', [nan])):10.1f}"
                         for x in names)
        errs = " ".join(k_ for k_ in r if (k_.endswith("err") and r[k_] > 2e-2) or k_.endswith("error"))
        print(f"{'causal' if r['causal'] else 'full':>6} {r['n']:>6} {cells}   "
              + " ".join(f"{r.get(x, nan):6.0f}" for x in names + ["flex", "cudnn"]) + f"  {errs}")
    print_backward_checks(result["checks"], checked)


def print_backward_checks(checks: list, label: str) -> None:
    """How many backward_float64_check rows passed (no NaN left, relative errors <= 2e-2, the Gluon kernel ran),
    and the rows that did not."""
    bad = [c for c in checks if c["nan"] or max(c["dq_err"], c["dk_err"], c["dv_err"]) > 2e-2 or not c["ran_gluon"]]
    print(f"float64 checks ({label}): {len(checks) - len(bad)} of {len(checks)} passed" + "".join(f"\n  {c}" for c in bad))


def poisoned_case(b: int, h: int, hkv: int, n_q: int, n_k: int, d: int, seed: int):
    """A small odd float64-check case: bf16 q (b, h, n_q, d), k and v (b, hkv, n_k, d) from a generator seeded
    with `seed`, and out and lse filled with NaN, so that an element no program writes shows."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, n_q, d, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(b, hkv, n_k, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
    return q, k, v, torch.full_like(q, float("nan")), torch.full(q.shape[:3], float("nan"), device="cuda")


def prefill_case(d: int, causal: bool, n: int):
    """The prefill bench's inputs at (head dim, causal, N): bf16 q, k, v (16384 / N, 2048 / d, N, d), seeded
    by the case, empty out and lse, the softmax scale and the FLOPs by the FlashAttention convention."""
    import torch

    b, h, scale = 16384 // n, 2048 // d, d ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(n + d + causal)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    return q, k, v, torch.empty_like(q), torch.empty(q.shape[:3], device="cuda"), scale, flops


def bench_gluon_variants(variants: dict, cases, out_json: str, title: str, flex: bool = False) -> list:
    """Time Gluon forward variants ({name: shape keys}, the first the base) on `cases` (head dim,
    causal, N), bf16, batch 16384/N, hidden 2048, do_bench medians. Each variant's output is poisoned
    with NaN first and checked against the base's; the Triton kernel (tuned config), SDPA's cuDNN
    backend and, with `flex`, compiled FlexAttention run in the same process. Writes `out_json` after
    each case and prints a table (TFLOP/s). Returns the rows."""
    import json

    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen
    from attngen.api import sdpa_spec

    peers = ["triton", "cudnn"] + (["flex"] if flex else [])
    if flex:
        from attngen.bench import prefill_providers
        run_flex = {c: prefill_providers(c)["flex"] for c in (False, True)}
    rows = []
    for d, causal, n in cases:
        kernel = attngen.load(sdpa_spec("bf16", d, causal))
        q, k, v, out, lse, scale, flops = prefill_case(d, causal, n)
        ref = None
        for name, shape in variants.items():
            row = dict(head_dim=d, causal=causal, n=n, variant=name, shape=shape)
            try:
                module = gluon_variant_module(kernel.spec, name, shape, out_json.rsplit("/", 1)[-1].split(".")[0])
                out.fill_(float("nan"))
                lse.fill_(float("nan"))
                module.launch_attn_fwd_ws(q, k, v, out, lse, scale)
                torch.cuda.synchronize()
                ref = out.clone() if ref is None else ref
                row["err_vs_base"] = rel_err(out, ref)
                row["nan"] = bool(out.isnan().any().item() or lse.isnan().any().item())
                ms = triton.testing.do_bench(lambda: module.launch_attn_fwd_ws(q, k, v, out, lse, scale),
                                             warmup=25, rep=200, return_mode="median")
                row.update(ms=ms, tflops=flops / ms / 1e9)
            except Exception as e:  # noqa: BLE001 - a shape that does not compile is a result too
                row["error"] = error_text(e)
            rows.append(row)
        cfg = dict(kernel.config(q, k), warp_specialized=False)
        timed = {"triton": lambda: kernel.module.forward(q, k, v, scale, out=out, lse=lse, config=cfg)}

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

        timed["cudnn"] = cudnn
        if flex:
            timed["flex"] = lambda: run_flex[causal](q, k, v)
        for name, fn in timed.items():
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            rows.append(dict(head_dim=d, causal=causal, n=n, variant=name, ms=ms, tflops=flops / ms / 1e9))
        print(f"d={d} causal={causal} N={n}: " + " ".join(
            f"{r['variant']}={r.get('tflops', float('nan')):.0f}" for r in rows[-len(variants) - len(peers):]), flush=True)
        with open(out_json, "w") as f:
            json.dump(rows, f, indent=1)
    names = list(variants) + peers
    print(f"\n{title}, TFLOP/s (! = differs from base by > 1e-2 or NaN)")
    print(f"{'d':>4} {'mask':>6} {'N':>6} " + " ".join(f"{x:>8}" for x in names))
    for d, causal, n in cases:
        sel = [r for r in rows if (r["head_dim"], r["causal"], r["n"]) == (d, causal, n)]
        print(f"{d:>4} {'causal' if causal else 'full':>6} {n:>6} " + variant_cells(sel, names))
    for r in rows:
        if "error" in r:
            print(f"  d={r['head_dim']} causal={r['causal']} N={r['n']} {r['variant']}: {r['error']}")
    return rows


def sm90_ptxas(fn, box, const: dict, ptrs: dict, num_warps: int = 4) -> str:
    """Compile the Gluon kernel `fn` for sm_90 on this machine (no GPU needed) and run ptxas -v on it:
    its shared memory and ptxas's register and spill lines. `box` is the [rows, cols] block of its
    tensor descriptors (arguments named *desc, over a bf16 tensor), `const` its constexpr arguments,
    `ptrs` {argument: type} its pointers ("*bf16"...); the rest are i32 but sm_scale (fp32)."""
    import subprocess
    import tempfile

    import torch
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    base = torch.empty(256, 1024, dtype=torch.bfloat16)
    desc = TensorDescriptor(base, list(base.shape), list(base.stride()), box,
                            gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16))
    d = native_specialize_impl(CUDABackend, desc, False, True, True)[0]
    sig = {a: "constexpr" if a in const else ptrs.get(a, d if a.endswith("desc") else "fp32" if a == "sm_scale"
                                                      else "i32") for a in fn.arg_names}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=const,
                         attrs={(fn.arg_names.index(p),): [["tt.divisibility", 16]] for p in ptrs})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    res = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    lines = [ln.split("info    : ")[-1] for ln in res.stderr.splitlines() if "registers" in ln or "spill" in ln]
    return f"shared {compiled.metadata.shared} B; " + " | ".join(lines)


def decode_case(batch: int, ctx: int):
    """The decode bench's inputs at (batch, ctx), every sequence at capacity, seeded by the shape:
    q (B, 1, 32, 128), k and v (B, ctx, 8, 128) bf16, lens (B,) int32, and the K/V bytes (for GB/s)."""
    import torch

    from attngen.bench_decode import D, H, H_KV
    gen = torch.Generator("cuda").manual_seed(batch * ctx)
    q = torch.randn(batch, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    return q, k, v, lens, 2 * batch * ctx * H_KV * D * 2


def split_decode(kernel, module, q, k, v, lens, out, lse, splits: int, block_s: int, **launch):
    """Launch an experiment's split-KV decode kernel `kernel` (arguments Q, K, V, O_PART, LSE_PART,
    SEQLENS, the strides, NUM_SPLITS, sm_scale, then `launch`: its constexprs and num_warps...), one
    program per (split, K/V head, sequence), on q (B, H, 1, D) and k, v (B, H_KV, S, D) views; with one
    split it writes out (B, H, 1, D) and lse (B, H, 1) itself, else partials that the shipped merge of
    `module` (`attn_combine`, `block_s` splits a step) folds into them."""
    import torch

    B, H, _, D = q.shape
    H_KV = k.shape[1]
    if splits == 1:
        o_part, l_part = out.unsqueeze(1), lse.unsqueeze(1)
    else:
        o_part = torch.empty((B, splits, H, 1, D), device=q.device, dtype=torch.float32)
        l_part = torch.empty((B, splits, H, 1), device=q.device, dtype=torch.float32)
    kernel[(1, H_KV, B * splits)](
        q, k, v, o_part, l_part, lens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), l_part.stride(0), l_part.stride(1), l_part.stride(2),
        splits, D ** -0.5, **launch)
    if splits > 1:
        module.launch_attn_combine(o_part, l_part, out, lse, BLOCK_S=block_s, num_warps=4, num_stages=1)
    return out


def alternating_ms(fns: dict, rounds: int = 3, rep: int = 150) -> dict:
    """{name: [ms per round]}: each fn's do_bench median in `rounds` rounds, the order reversed every other
    round (timings taken one after another drift by 1-2% with their order, NOTES v20)."""
    import triton

    times = {name: [] for name in fns}
    for rnd in range(rounds):
        for name in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
            times[name].append(triton.testing.do_bench(fns[name], warmup=25, rep=rep, return_mode="median"))
    return times


def profiled_us(fn, prefix: str, reps: int = 10) -> dict:
    """{kernel: GPU us per call} of the kernels whose names start with `prefix`, by torch.profiler over `reps`
    back-to-back calls of fn after one more: no host time and no cache flush between calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / reps for e in prof.key_averages() if e.key.startswith(prefix)}


def backward_variants_row(mods: dict, base: str, d: int, causal: bool, n: int, flex: bool = False) -> dict:
    """One prefill-bench case (bf16, batch 16384/N, hidden 2048) of the backward variants `mods` (name ->
    generated module): each variant's gradients against `base`'s (relative error), its Gluon kernel's time by
    torch.profiler (4 alternating rounds of 10 calls; "gpu us": every attn_bwd* kernel of the call, the row passes
    too), and the whole `module.backward` call by do_bench in
    alternating rounds beside SDPA cuDNN's backward (and with `flex`, FlexAttention's, compiled as the bench
    does) as TFLOP/s. A variant that fails records its error instead."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attngen.bench import fa_flops, prefill_providers

    b, h, scale = 16384 // n, 2048 // d, d ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(n + d + causal)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    out, lse = mods[base].forward(q, k, v, scale)
    flops = fa_flops(b, h, n, n, d, causal, backward=True)
    row = dict(head_dim=d, causal=causal, n=n)
    grads, fns = {}, {}
    for x in [base] + [x for x in mods if x != base]:
        try:
            grads[x] = mods[x].backward(q, k, v, out, lse, do, scale)
            torch.cuda.synchronize()
            row[f"{x} err"] = max(rel_err(a, r) for a, r in zip(grads[x], grads[base]))
            fns[x] = lambda m=mods[x]: m.backward(q, k, v, out, lse, do, scale)
        except Exception as e:  # noqa: BLE001 - a variant that fails is a result too
            row[f"{x} error"] = error_text(e)
    kus, gus = {x: [] for x in fns}, {x: [] for x in fns}
    for rnd in range(4):
        for x in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
            us = profiled_us(fns[x], "attn_bwd")
            kus[x].append(sum(t for name, t in us.items() if name.startswith("attn_bwd_dkdv_ws")))
            gus[x].append(sum(us.values()))
    for x, ts in kus.items():
        row[f"{x} kernel us"] = ts
        row[f"{x} gpu us"] = gus[x]
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale)
    fns["cudnn"] = lambda: torch.autograd.grad(ref, (qg, kg, vg), do, retain_graph=True)
    if flex:
        try:
            fref = prefill_providers(causal)["flex"](qg, kg, vg)
            fns["flex"] = lambda: torch.autograd.grad(fref, (qg, kg, vg), do, retain_graph=True)
            fns["flex"]()
        except Exception as e:  # noqa: BLE001
            fns.pop("flex", None)
            row["flex error"] = error_text(e)
    for x, ts in alternating_ms(fns, rep=100).items():
        row[x] = flops / min(ts) / 1e9
        row[f"{x} rounds"] = [flops / t / 1e9 for t in ts]
    return row


class PoisonedTorch:
    """torch, except that `empty` fills what it returns: NaN (floating) or -1 (integers). Set as a generated
    module's `torch`, it shows an accumulator row left unzeroed or a counter not reset."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def empty(self, *args, **kwargs):
        t = self._torch.empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)


BACKWARD_CHECK_CASES = ((2, 4, 2, 333, None), (3, 2, 1, 700, 900), (1, 3, 1, 130, 200))
"""Small odd float64-check cases (b, h, h_kv, n_q, n_k), GQA among them; n_k None: 1111 under a causal mask (more
keys than queries), 777 without."""


def backward_checks(make, d: int, cases=BACKWARD_CHECK_CASES, reps: int = 1, **extra) -> list:
    """backward_float64_check rows, for each mask ("none", "top_left", "bottom_right"), of the module make(spec)
    (spec: backward_check_spec's at head dim d) on each case `reps` times; `extra` is added to each row."""
    import torch

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for mask in ("none", "top_left", "bottom_right"):
        m = make(backward_check_spec("bwd_check", mask, d))
        for b, h, hkv, n_q, n_k in cases:
            n_k = n_k or (1111 if mask != "none" else 777)
            for rep in range(reps):
                rows.append(dict(backward_float64_check(m, mask, b, h, hkv, n_q, n_k, gen), **extra,
                                 **({"rep": rep} if reps > 1 else {})))
                print("check", rows[-1], flush=True)
    return rows


def backward_rows(result: dict, path: str, d: int, lengths, make_mods, base: str, masks=(False, True)) -> None:
    """backward_variants_row of the modules make_mods(spec) (name -> module; `base` among them) for the bench's
    bf16 spec at head dim d, for each of `masks` (causal or not) at each length: appended to result["rows"],
    printed, and result written to `path` after each."""
    import json

    import attngen
    from attngen.api import sdpa_spec

    for causal in masks:
        for n in lengths:
            row = backward_variants_row(make_mods(attngen.load(sdpa_spec("bf16", d, causal)).spec), base, d, causal,
                                        n, flex=True)
            result["rows"].append(row)
            print(json.dumps({k_: v_ for k_, v_ in row.items() if "rounds" not in k_}), flush=True)
            with open(path, "w") as f:
                json.dump(result, f, indent=1)


def backward_check_spec(tag: str, mask: str, d: int):
    """The forward+backward bf16 spec named tag_mask_d, mask "none", "top_left" or "bottom_right", head dim d."""
    import attngen
    from attngen.spec import parse

    text = (f"kernel {tag}_{mask}_{d} {{\n    direction = forward+backward\n    mask = "
            f"{'none' if mask == 'none' else f'causal({mask})'}\n    head_dim = {d}\n    dtype = bf16\n}}\n")
    return attngen.load(parse(text, f"<{mask}>")).spec


def backward_float64_check(m, mask: str, b: int, h: int, hkv: int, n_q: int, n_k: int, gen) -> dict:
    """Generated module m's backward on bf16 inputs (b, h, n_q, D) and K/V (b, hkv, n_k, D) from `gen`, dQ, dK and dV
    poisoned with NaN first, against float64: relative errors, whether a NaN was left, and whether the one-kernel
    Gluon backward ran."""
    import torch

    d = m.HEAD_DIM
    q = torch.randn(b, h, n_q, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, hkv, n_k, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    do = torch.randn_like(q)
    out, lse = m.forward(q, k, v, d ** -0.5)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    ran = m.ws_bwd_ready(q, k, v, do, dk, dv) and m.ws_bwd_fused()
    m.backward(q, k, v, out, lse, do, d ** -0.5, dq=dq, dk=dk, dv=dv)
    gq, gk, gv = reference_grads(q, k, v, do, mask, d ** -0.5)
    return dict(head_dim=d, mask=mask, shape=[b, h, hkv, n_q, n_k], ran_gluon=ran, dq_err=rel_err(dq, gq),
                dk_err=rel_err(dk, gk), dv_err=rel_err(dv, gv),
                nan=bool(dq.isnan().any() or dk.isnan().any() or dv.isnan().any()))


def reference_grads(q, k, v, do, mask: str, scale: float):
    """dQ, dK, dV in float64 of softmax(q k^T * scale) v for q (B, H, N_Q, D), k and v (B, H_KV, N_K, D) (H a
    multiple of H_KV), mask "none", "top_left" or "bottom_right"; rows that see no key give 0."""
    import torch

    h, hkv, n_q, n_k = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    s = qr @ kr.repeat_interleave(h // hkv, 1).transpose(-1, -2) * scale
    if mask != "none":
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q if mask == "bottom_right" else 0)
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.autograd.grad(p @ vr.repeat_interleave(h // hkv, 1), (qr, kr, vr), do.double())


def write_rows(out_dir: str, name: str, rows: list) -> None:
    """rows as OUT_DIR/name with the device's name."""
    import json

    import torch

    with open(os.path.join(out_dir, name), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


def decode_layers_case(batch: int, ctx: int, gen):
    """One decode bench case on the GPU, as the decode experiments draw it: (layers, caches, q, full
    lengths, odd lengths); caches is a list of (k, v) per layer, (B, H_KV, ctx, D) views of (B, ctx, H_KV,
    D) storage (enough layers for attngen bench's [layers] timing), q (B, H, 1, D)."""
    import torch

    from attngen.bench_decode import DTYPE, H, H_KV, D, layer_count

    layers = max(2, layer_count(batch, ctx))
    caches = [(torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen).transpose(1, 2),
               torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen).transpose(1, 2))
              for _ in range(layers)]
    q = torch.randn(batch, H, 1, D, device="cuda", dtype=DTYPE, generator=gen)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    odd = torch.randint(1, ctx, (batch,), device="cuda", dtype=torch.int32, generator=gen)
    return layers, caches, q, lens, odd
