"""lower: spec -> the standard three-pass attention program.

This is the algorithm as a textbook writes it, with no tiling: for each (batch, head), the scores
S = Q K^T * scale go to HBM, a row softmax reads them back and writes P, and O = P V / rowsum reads
P again. Its N x N scratch is what the later passes remove; `attngen explain` prices this program as
the baseline next to the generated one.
"""

from __future__ import annotations

from .. import ir
from .. import sym
from ..ir import DT, Buffer, Call, Load, Masked, Op, Pred, PredKind, Ref, Role, Space, Span, Sym
from ..spec import Mask, Spec

NAME = "lower"

_DT = {"fp16": DT.F16, "bf16": DT.BF16, "fp32": DT.F32}


def io_dtype(spec: Spec) -> DT:
    return _DT[spec.dtype.value]


def mask_preds(spec: Spec) -> tuple[Pred, ...]:
    """The spec's mask as predicates on (query, key) positions."""
    if spec.mask is Mask.CAUSAL_TOP_LEFT:
        return (Pred(PredKind.CAUSAL, sym.ZERO),)
    if spec.mask is Mask.CAUSAL_BOTTOM_RIGHT:
        return (Pred(PredKind.CAUSAL, sym.N_K - sym.N_Q),)
    return ()


def run(spec: Spec) -> ir.Program:
    dt = io_dtype(spec)
    d = sym.HEAD_DIM
    q_buf = Buffer("Q", (sym.B, sym.H, sym.N_Q, d), dt, Space.HBM, Role.INPUT)
    k_buf = Buffer("K", (sym.B, sym.H_KV, sym.N_K, d), dt, Space.HBM, Role.INPUT)
    v_buf = Buffer("V", (sym.B, sym.H_KV, sym.N_K, d), dt, Space.HBM, Role.INPUT)
    o_buf = Buffer("O", (sym.B, sym.H, sym.N_Q, d), dt, Space.HBM, Role.OUTPUT)
    lse_buf = Buffer("LSE", (sym.B, sym.H, sym.N_Q), DT.F32, Space.HBM, Role.OUTPUT)
    s_buf = Buffer("S", (sym.N_Q, sym.N_K), DT.F32, Space.HBM, Role.SCRATCH)
    p_buf = Buffer("P", (sym.N_Q, sym.N_K), DT.F32, Space.HBM, Role.SCRATCH)
    m_buf = Buffer("m", (sym.N_Q,), DT.F32, Space.REG)
    l_buf = Buffer("l", (sym.N_Q,), DT.F32, Space.REG)

    rows = Span("offs_m", sym.ZERO, sym.N_Q)
    cols = Span("offs_n", sym.ZERO, sym.N_K)
    dims = Span("offs_d", sym.ZERO, d)
    kv_head = sym.FloorDiv(sym.h, sym.GROUP)
    q = Load(q_buf, (sym.b, sym.h, rows, dims))
    k = Load(k_buf, (sym.b, kv_head, cols, dims))
    v = Load(v_buf, (sym.b, kv_head, cols, dims))

    scores = Call(Op.MUL, (Call(Op.DOT_T, (q, k), _precision(dt)), Sym(sym.sm_scale)))
    preds = mask_preds(spec)
    if preds:
        scores = Masked(scores, preds, query=rows, key=cols)
    body = (
        ir.Comment("pass 1: scores to HBM"),
        ir.Assign(s_buf, scores),
        ir.Comment("pass 2: row softmax, HBM to HBM"),
        ir.Softmax(p_buf, m_buf, l_buf, Ref(s_buf)),
        ir.Comment("pass 3: weighted sum of values"),
        ir.Store(o_buf, (sym.b, sym.h, rows, dims),
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
        ir.SymbolDecl(sym.sm_scale, ir.SymKind.FLOAT, "softmax scale"),
    )
    kernel = ir.Kernel("attn_fwd", (q_buf, k_buf, v_buf, o_buf, lse_buf), symbols, (grid,),
                       doc="softmax(Q K^T * scale) V, one program per (batch, head)")
    attrs = dict(
        mask=spec.mask.value, dtype=spec.dtype.value, head_dim=spec.head_dim,
        head_dim_padded=spec.head_dim_padded,
    )
    # What the decoding passes act on; absent (so the IR text is unchanged) for a plain forward.
    if spec.is_split:
        attrs["split_kv"] = spec.split_kv or "auto"
    if spec.kv_layout.paged:
        attrs["page_size"] = spec.kv_layout.page_size
    if spec.packs_gqa:
        attrs["pack_gqa"] = True
    return ir.Program(spec.name, spec.hash, (kernel,)).with_attrs(**attrs)


def _precision(dt: DT) -> DT | None:
    """fp32 specs get true fp32 products (`ieee`), not tf32: fp32 is asked for for its accuracy."""
    return DT.F32 if dt is DT.F32 else None
