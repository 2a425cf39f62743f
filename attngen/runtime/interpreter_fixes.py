"""Workarounds for Triton interpreter bugs, applied only when kernels run in the interpreter.

Triton 3.6's interpreter keeps bfloat16 values as their uint16 bit patterns and multiplies those
bit patterns in `tl.dot`, so every bf16 matrix product it computes is garbage (on a GPU the same
code is right). `apply()` wraps the interpreter's dot to widen bf16 operands to float32 first, which
is what the tensor cores do in effect. It touches nothing outside the interpreter.
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
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16 or b.dtype == tl.bfloat16:
            a = interpreter.TensorHandle(convert(a.data, a.dtype, tl.float32, None).view(np.float32), tl.float32) \
                if a.dtype == tl.bfloat16 else a
            b = interpreter.TensorHandle(convert(b.data, b.dtype, tl.float32, None).view(np.float32), tl.float32) \
                if b.dtype == tl.bfloat16 else b
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    _applied = True
