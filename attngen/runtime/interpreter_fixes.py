"""Workarounds for Triton interpreter bugs, applied only when kernels run in the interpreter.

Triton 3.6's interpreter keeps bfloat16 values as their uint16 bit patterns and multiplies those
bit patterns in `tl.dot`, so every bf16 matrix product it computes is garbage (on a GPU the same
code is right). `apply()` wraps the interpreter's dot to widen bf16 operands to float32 first, which
is what the tensor cores do in effect. Its float32 -> float8e4nv conversion truncates and drops the carry
of a mantissa that rounds up (0.4935 becomes 0.25, not 0.5), where the GPU's `cvt.rn.satfinite` rounds to
nearest and saturates at 448: `apply()` converts to and from float8e4nv through torch's float8_e4m3fn
(round to nearest) after clamping to +-448, and widens float8e4nv dot operands the same way. It touches
nothing outside the interpreter.
"""

from __future__ import annotations

_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    convert = getattr(interpreter, "_convert_float", None)
    if builder is None or convert is None or not hasattr(builder, "create_dot"):
        return
    import torch

    original = builder.create_dot
    original_fp_to_fp = builder.create_fp_to_fp

    def fp8_to_float32(x):
        return torch.from_numpy(np.ascontiguousarray(x)).view(torch.float8_e4m3fn).float().numpy()

    def widen(h):
        if h.dtype == tl.bfloat16:
            return interpreter.TensorHandle(convert(h.data, h.dtype, tl.float32, None).view(np.float32), tl.float32)
        if h.dtype == tl.float8e4nv:
            return interpreter.TensorHandle(fp8_to_float32(h.data), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar == tl.float8e4nv:
            wide = widen(src).data if src.dtype != tl.float32 else src.data
            x = torch.from_numpy(np.ascontiguousarray(wide, dtype=np.float32)).clamp(-448.0, 448.0)
            return interpreter.TensorHandle(x.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), tl.float8e4nv)
        if src.dtype == tl.float8e4nv and dst_type.scalar == tl.float32:
            return interpreter.TensorHandle(fp8_to_float32(src.data), tl.float32)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_dot = create_dot
    builder.create_fp_to_fp = create_fp_to_fp
    _applied = True
