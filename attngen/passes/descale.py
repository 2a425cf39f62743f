"""descale: apply FP8 descale factors where they cost nothing, and say where values are quantised.

An FP8 spec's Q, K and V hold e4m3 values that stand for `x * descale` (FA3's convention: float32 factors
Q_DESCALE, K_DESCALE, V_DESCALE per (batch, K/V head); a per-tensor factor arrives expanded). Where each
one applies:

  - Q K^T: the tensor cores multiply the stored e4m3 values (float32 accumulation), and q_descale *
    k_descale scales every score alike, so it joins the softmax scale: `qk_scale = sm_scale * log2 e *
    q_descale * k_descale`, two scalar loads and two multiplies per program, none per score.
  - P V: P is quantised to e4m3 for the FP8 product (`cast<fp8_e4m3>(p)`, online-softmax's operand cast),
    as it is, scaled by nothing. After the running max every p is in [0, 1], the largest exactly 1 in
    each row, so nothing overflows e4m3's 448; p >= 2^-6 keeps e4m3's relative precision of 2^-4, and a
    smaller p (a subnormal, steps of 2^-9) is off by at most 2^-10 against a row sum l >= 1. FA3 does the
    same. Scaling P up (by 448 / rowmax, or a power of two) would move small p out of the subnormals at the
    price of a multiply per score and a matching divide of l, for weights that the sum already makes
    small; l and the rescaling alpha stay in float32 from the unquantised p.
  - the output: V's factor scales every column of P V alike, so it is applied once, to the accumulator
    in the epilogue (`acc * v_descale / l_safe`), before the bf16 store.

An FP8 KV cache (`kv_dtype = fp8_e4m3`, decoding specs) has K_DESCALE and V_DESCALE alone: q is 16-bit, and
lower widens the e4m3 K and V tiles to q's dtype in registers, so P V stays a 16-bit product; the factors go
where they go for FP8 inputs, `qk_scale = sm_scale * log2 e * k_descale` and `acc * v_descale / l_safe`.

Applies to specs with dtype = fp8_e4m3 (forward only: the spec refuses a backward) or kv_dtype = fp8_e4m3; a
no-op otherwise.
"""

from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..errors import InternalError
from ..ir import Assign, Buffer, Call, DT, Load, Op, Ref, Space, Store
from .grid import grid_path, rebuild

NAME = "descale"


def applies(program: ir.Program) -> bool:
    return DT.F8E4M3.value in (program.attr("dtype"), program.attr("kv_dtype"))


def _kv_head(kernel: ir.KernelIR) -> tuple:
    """The (batch, K/V head) index of this program: K's load's leading items."""
    for st in ir.walk_stmts(kernel.body):
        for x in ir.stmt_exprs(st):
            for e in ir.walk_expr(x):
                if isinstance(e, Load) and e.buffer.name == "K":
                    return e.index[:2]
    raise InternalError(f"{NAME}: kernel {kernel.name} loads no K")


def run(program: ir.Program) -> ir.Program:
    if not applies(program):
        return program
    kernel = program.kernel("attn_fwd")
    params = {b.name: b for b in kernel.params}
    at = _kv_head(kernel)
    # Q_DESCALE only where q is FP8 too; the product of the factors present scales the scores.
    qk_descales = [Load(params[n], at) for n in ("Q_DESCALE", "K_DESCALE") if n in params]
    v_descale = Load(params["V_DESCALE"], at)
    v_scale = Buffer("v_descale", (), DT.F32, Space.REG)
    found = {"qk_scale": False, "O": False}

    def stmt(st):
        if isinstance(st, Assign) and st.target.name == "qk_scale":
            found["qk_scale"] = True
            value = st.value
            for factor in qk_descales:
                value = Call(Op.MUL, (value, factor))
            return replace(st, value=value)
        if isinstance(st, Store) and st.target.name == "O":
            value = st.value
            if not (isinstance(value, Call) and value.op is Op.DIV):
                raise InternalError(f"{NAME}: expected the output store acc / l, got {ir.format_expr(value)}")
            found["O"] = True
            scaled = replace(value, args=(Call(Op.MUL, (value.args[0], Ref(v_scale))), value.args[1]))
            return (ir.Comment("V's descale: one factor for every column of P V"), Assign(v_scale, v_descale),
                    replace(st, value=scaled))
        return st

    path = grid_path(kernel, NAME)
    body = ir.map_stmts(path[-1].body, stmt)
    missing = [name for name, seen in found.items() if not seen]
    if missing:
        raise InternalError(f"{NAME}: kernel {kernel.name} has no {' or '.join(missing)} to scale")
    return program.replace_kernel(replace(kernel, body=rebuild(path, body)))
