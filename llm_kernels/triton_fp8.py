"""float32 <-> float8_e4m3fn in Triton, written with integer bit operations.

Why not ``x.to(tl.float8e4nv)``: the Triton interpreter (the CPU test path) rounds that
conversion half-up and flushes subnormals to zero, so it disagrees with torch's cast (round to
nearest even, subnormals kept) on ties and on values below 2**-6; and the native cast needs
sm_89+. These two helpers give torch's bits on every device and under the interpreter, at a
few integer ops per element (the attention kernels that use them are bound by memory traffic).

e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 holds subnormals
``m * 2**-9``; the largest finite value is 448 (0x7E); 0x7F is NaN, never produced here because
callers saturate to +-448 first.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["float_to_fp8e4m3_bits", "fp8e4m3_bits_to_float"]


@triton.jit
def float_to_fp8e4m3_bits(x):
    """float32 ``x`` (already within +-448) -> its e4m3fn byte as int32, rounded to nearest
    even like torch's cast."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a_bits = bits & 0x7FFFFFFF
    a = a_bits.to(tl.float32, bitcast=True)
    # Normal range: drop 20 of float32's 23 mantissa bits, rounding to nearest even (a carry
    # into the exponent is the right result), then rebias the exponent from 127 to 7.
    lsb = (a_bits >> 20) & 1
    normal = ((a_bits + 0x7FFFF + lsb) >> 20) - (120 << 3)
    # Below 2**-6: a multiple of 2**-9, rounded to nearest even by the float32 adder (2**23
    # makes the unit in the last place 1). 8 encodes 2**-6, the first normal: still right.
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    return tl.where(a < 0.015625, sub, normal) | sign


@triton.jit
def fp8e4m3_bits_to_float(b):
    """An e4m3fn byte (any integer type) -> float32, exactly."""
    b = b.to(tl.int32) & 0xFF
    exponent = (b >> 3) & 0xF
    mantissa = b & 0x7
    sign_bits = (b & 0x80) << 24
    normal = (sign_bits | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    sub = mantissa.to(tl.float32) * 0.001953125
    sub = tl.where(sign_bits != 0, -sub, sub)
    return tl.where(exponent == 0, sub, normal)
