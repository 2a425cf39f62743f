"""Workarounds for Triton interpreter bugs, applied only when kernels run in the interpreter.

Triton 3.6's interpreter keeps bfloat16 values as their uint16 bit patterns and multiplies those
bit patterns in `tl.dot`, so every bf16 matrix product it computes is garbage (on a GPU the same
code is right). `apply()` wraps the interpreter's dot to widen bf16 operands to float32 first, which
is what the tensor cores do in effect. Its float -> float8e4nv conversion truncates the mantissa (and its
"rtne" mode rounds ties up, without carrying into the exponent), where the GPU's cvt.rn rounds to nearest
even: `apply()` routes those downcasts through torch's float8_e4m3fn conversion, which rounds as the GPU
does (an FP8 KV cache's quantisation is tested against it). It touches nothing outside the interpreter.
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

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype.primitive_bitwidth > 8:
            import torch

            wide = convert(input, input_dtype, tl.float32, None).view(np.float32) \
                if input_dtype != tl.float32 else np.asarray(input, dtype=np.float32)
            return torch.from_numpy(np.ascontiguousarray(wide)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return convert(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert_float
    _applied = True
