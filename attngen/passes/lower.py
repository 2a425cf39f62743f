"""lower: spec -> the standard three-pass attention program.

This is the algorithm as a textbook writes it, with no tiling: for each (batch, head), the scores
S = Q K^T * scale go to HBM, a row softmax reads them back and writes P, and O = P V / rowsum reads
P again. Its N x N scratch is what the later passes remove; `attngen explain` prices this program as
the baseline next to the generated one.
"""

from __future__ import annotations

from .. import ir
from ..ir import sym, variants
from ..ir import DT, Buffer, Call, Load, Masked, Op, Pointwise, Pred, PredKind, Ref, Role, Space, Span, Stat, Sym
from ..lang.spec import Mask, Spec

NAME = "lower"

_DT = {"fp16": DT.F16, "bf16": DT.BF16, "fp32": DT.F32, "fp8_e4m3": DT.F8E4M3}


def io_dtype(spec: Spec) -> DT:
    """The dtype of Q, K and V (and of P where it meets V)."""
    return _DT[spec.dtype.value]


def out_dtype(spec: Spec) -> DT:
    """The dtype of O: the inputs', but bf16 for FP8 inputs."""
    return _DT[spec.dtype.output.value]


def descale_buffers(spec: Spec) -> tuple[Buffer, ...]:
    """The descale factors of an FP8 spec (Q_DESCALE, K_DESCALE, V_DESCALE) or of an FP8 cache (K_DESCALE,
    V_DESCALE), one float32 per (batch, K/V head); a per-tensor (1,) or per-head factor is expanded to that shape by
    the launcher. Empty for other specs; pass `descale` applies them."""
    return tuple(Buffer(name.upper(), (sym.B, sym.H_KV), DT.F32, Space.HBM, Role.INPUT) for name in spec.descales)


def alignment(spec: Spec):
    """The offset of a mask's query position from the row index: 0 top-left, N_K - N_Q bottom-right."""
    return sym.N_K - sym.N_Q if spec.bottom_right else sym.ZERO


def mask_preds(spec: Spec) -> tuple[Pred, ...]:
    """The spec's mask as predicates on (query, key) positions."""
    if spec.variant.mask is not None:
        return variants.mask_preds(spec.variant.mask, alignment(spec))
    if spec.mask is Mask.CAUSAL_TOP_LEFT:
        return (Pred(PredKind.CAUSAL, sym.ZERO),)
    if spec.mask is Mask.CAUSAL_BOTTOM_RIGHT:
        return (Pred(PredKind.CAUSAL, sym.N_K - sym.N_Q),)
    return ()


def value_dims(spec: Spec) -> Span:
    """The span over V's and O's head dim: Q's and K's (`offs_d`) unless the spec sets another head_dim_v."""
    if spec.splits_head_dims:
        return Span("offs_dv", sym.ZERO, sym.HEAD_DIM_V)
    return Span("offs_d", sym.ZERO, sym.HEAD_DIM)


def run(spec: Spec) -> ir.Program:
    dt = io_dtype(spec)
    kv_dt = _DT[spec.kv_dtype.value] if spec.kv_dtype is not None else dt
    d, dv = sym.HEAD_DIM, value_dims(spec).size
    q_buf = Buffer("Q", (sym.B, sym.H, sym.N_Q, d), dt, Space.HBM, Role.INPUT)
    k_buf = Buffer("K", (sym.B, sym.H_KV, sym.N_K, d), kv_dt, Space.HBM, Role.INPUT)
    # `v = k[:N]` (MLA): no V tensor; the values are K's first HEAD_DIM_V columns.
    v_buf = k_buf if spec.v_from_k else Buffer("V", (sym.B, sym.H_KV, sym.N_K, dv), kv_dt, Space.HBM, Role.INPUT)
    o_buf = Buffer("O", (sym.B, sym.H, sym.N_Q, dv), out_dtype(spec), Space.HBM, Role.OUTPUT)
    lse_buf = Buffer("LSE", (sym.B, sym.H, sym.N_Q), DT.F32, Space.HBM, Role.OUTPUT, Stat.LSE)
    s_buf = Buffer("S", (sym.N_Q, sym.N_K), DT.F32, Space.HBM, Role.SCRATCH)
    p_buf = Buffer("P", (sym.N_Q, sym.N_K), DT.F32, Space.HBM, Role.SCRATCH)
    m_buf = Buffer("m", (sym.N_Q,), DT.F32, Space.REG)
    l_buf = Buffer("l", (sym.N_Q,), DT.F32, Space.REG)

    rows = Span("offs_m", sym.ZERO, sym.N_Q)
    cols = Span("offs_n", sym.ZERO, sym.N_K)
    dims = Span("offs_d", sym.ZERO, d)
    dims_v = value_dims(spec)
    kv_head = sym.FloorDiv(sym.h, sym.GROUP)
    q = Load(q_buf, (sym.b, sym.h, rows, dims))
    k = Load(k_buf, (sym.b, kv_head, cols, dims))
    v = Load(v_buf, (sym.b, kv_head, cols, dims_v))
    if spec.fp8_cache:
        # e4m3 tiles are widened to q's dtype in registers (the bytes read are the point); pass `descale` applies
        # the factors outside the products, K's to the softmax scale and V's to the output, as for FP8 inputs.
        k, v = Call(Op.CAST, (k,), dt), Call(Op.CAST, (v,), dt)

    scores = Call(Op.MUL, (Call(Op.DOT_T, (q, k), _precision(dt)), Sym(sym.sm_scale)))
    extra = variants.tensor_buffers(spec.variant)
    fn = variants.score_fn(spec.variant, alignment(spec), extra)
    if fn is not None:
        read = set(variants.reads(fn))
        scores = Pointwise(scores, fn, query=rows, key=cols, tensors=tuple(b for b in extra if b.name in read))
    sink = None
    if spec.variant.sinks:
        sinks = next(b for b in extra if b.name == variants.SINKS)
        sink = Load(sinks, (sym.h,))
    preds = mask_preds(spec)
    if preds:
        scores = Masked(scores, preds, query=rows, key=cols)
    body = (
        ir.Comment("pass 1: scores to HBM"),
        ir.Assign(s_buf, scores),
        ir.Comment("pass 2: row softmax, HBM to HBM"),
        ir.Softmax(p_buf, m_buf, l_buf, Ref(s_buf), sink),
        ir.Comment("pass 3: weighted sum of values"),
        ir.Store(o_buf, (sym.b, sym.h, rows, dims_v),
                 Call(Op.DIV, (Call(Op.DOT, (Ref(p_buf), v), _precision(dt)), Ref(l_buf)))),
        ir.Store(lse_buf, (sym.b, sym.h, rows), Call(Op.ADD, (Ref(m_buf), Call(Op.LOG, (Ref(l_buf),))))),
    )
    grid = ir.Loop(sym.b, sym.ZERO, sym.B, sym.ONE,
                   (ir.Loop(sym.h, sym.ZERO, sym.H, sym.ONE, body, ir.LoopKind.GRID),),
                   ir.LoopKind.GRID)
    symbols = (
        ir.SymbolDecl(sym.B, ir.SymKind.SIZE, "batch", specialize=False),
        ir.SymbolDecl(sym.H, ir.SymKind.SIZE, "query heads"),
        ir.SymbolDecl(sym.H_KV, ir.SymKind.SIZE, "key/value heads"),
        ir.SymbolDecl(sym.GROUP, ir.SymKind.SIZE, "query heads per key/value head",
                      derive=sym.FloorDiv(sym.H, sym.H_KV)),
        ir.SymbolDecl(sym.N_Q, ir.SymKind.SIZE, "query length", specialize=False),
        ir.SymbolDecl(sym.N_K, ir.SymKind.SIZE, "key/value length", specialize=False),
        ir.SymbolDecl(sym.HEAD_DIM, ir.SymKind.CONSTEXPR, "head dim"),
    ) + ((ir.SymbolDecl(sym.HEAD_DIM_V, ir.SymKind.CONSTEXPR, "head dim of V and O"),) if spec.splits_head_dims else ()) + (
        ir.SymbolDecl(sym.sm_scale, ir.SymKind.FLOAT, "softmax scale"),
    )
    operands = (q_buf, k_buf) if spec.v_from_k else (q_buf, k_buf, v_buf)
    kernel = ir.KernelIR("attn_fwd", operands + (o_buf, lse_buf) + extra + descale_buffers(spec), symbols, (grid,),
                       doc="softmax(Q K^T * scale) V, one program per (batch, head)")
    kernels = (kernel, _naive_backward(kernel, p_buf, q, k, v, rows, dims, dims_v, kv_head)) if spec.backward else (kernel,)
    attrs = dict(
        mask=spec.variant.mask.text() if spec.variant.mask is not None else spec.mask.value, dtype=spec.dtype.value, head_dim=spec.head_dim,
        head_dim_padded=spec.head_dim_padded, backward=spec.backward,
    )
    if spec.splits_head_dims:  # absent for a plain spec, so that its IR text is what it always was
        attrs.update(head_dim_v=spec.head_dim_v, head_dim_v_padded=spec.head_dim_v_padded)
    if spec.kv_dtype is not None:  # likewise
        attrs["kv_dtype"] = spec.kv_dtype.value
    if spec.v_from_k:
        attrs["v_from_k"] = True
    # What the decoding passes act on; absent (so the IR text is unchanged) for a plain forward.
    if spec.is_split:
        attrs["split_kv"] = spec.split_kv or "auto"
    if spec.kv_layout.paged:
        attrs["page_size"] = spec.kv_layout.page_size
    if spec.packs_gqa:
        attrs["pack_gqa"] = True
    if spec.varlen:
        attrs["varlen"] = True
    if spec.variant.score is not None:
        attrs["score"] = spec.variant.score.text()
    if spec.variant.sinks:
        attrs["sinks"] = True
    if spec.fixes_tiles:
        attrs["fixed_tiles"] = True  # tiles written by hand: the kernel keeps exactly them (warp-specialize)
    return ir.Program(spec.name, spec.hash, kernels).with_attrs(**attrs)


def _naive_backward(fwd: ir.KernelIR, p_buf: Buffer, q, k, v, rows, dims, dims_v, kv_head) -> ir.KernelIR:
    """The textbook backward: P was stored by the forward and is read back; dP and dS go through
    HBM too. `recompute` replaces this kernel; it is here to be priced and printed."""
    params = {b.name: b for b in fwd.params}
    like = lambda b, name, role: Buffer(name, b.shape, b.dtype, Space.HBM, role)
    do_buf = like(params["O"], "DO", Role.INPUT)
    dq_buf, dk_buf, dv_buf = (like(params[n], f"D{n}", Role.OUTPUT) for n in ("Q", "K", "V"))
    dp_buf = Buffer("dP", p_buf.shape, DT.F32, Space.HBM, Role.SCRATCH)
    ds_buf = Buffer("dS", p_buf.shape, DT.F32, Space.HBM, Role.SCRATCH)
    delta = Buffer("delta", (sym.N_Q,), DT.F32, Space.REG)
    do = Load(do_buf, (sym.b, sym.h, rows, dims_v))
    o_in = Buffer("O", params["O"].shape, params["O"].dtype, Space.HBM, Role.INPUT)
    o = Load(o_in, (sym.b, sym.h, rows, dims_v))
    dt = params["Q"].dtype
    dot = lambda op, a, b_: Call(op, (a, b_), _precision(dt))
    trans = lambda x: Call(Op.TRANS, (x,))
    scaled = lambda x: Call(Op.MUL, (x, Sym(sym.sm_scale)))
    body = (
        ir.Comment("P was written to HBM by the forward; read it back"),
        ir.Assign(dp_buf, dot(Op.DOT_T, do, v)),
        ir.Assign(delta, Call(Op.ROWSUM, (Call(Op.MUL, (do, o)),))),
        ir.Assign(ds_buf, Call(Op.MUL, (Ref(p_buf), Call(Op.SUB, (Ref(dp_buf), Ref(delta)))))),
        ir.Store(dq_buf, (sym.b, sym.h, rows, dims), scaled(dot(Op.DOT, Ref(ds_buf), k))),
        ir.Store(dk_buf, (sym.b, kv_head, Span("offs_n", sym.ZERO, sym.N_K), dims),
                 scaled(dot(Op.DOT, trans(Ref(ds_buf)), q)), accumulate=True),
        ir.Store(dv_buf, (sym.b, kv_head, Span("offs_n", sym.ZERO, sym.N_K), dims_v),
                 dot(Op.DOT, trans(Ref(p_buf)), do), accumulate=True),
    )
    grid = ir.Loop(sym.b, sym.ZERO, sym.B, sym.ONE,
                   (ir.Loop(sym.h, sym.ZERO, sym.H, sym.ONE, body, ir.LoopKind.GRID),), ir.LoopKind.GRID)
    return ir.KernelIR("attn_bwd", (params["Q"], params["K"], params["V"], o_in, do_buf, dq_buf, dk_buf, dv_buf),
                     fwd.symbols, (grid,), doc="dQ, dK, dV from the stored P, one program per (batch, head)")


def _precision(dt: DT) -> DT | None:
    """fp32 specs get true fp32 products (`ieee`), not tf32: fp32 is asked for for its accuracy."""
    return DT.F32 if dt is DT.F32 else None
