"""Inline PTX shared by the sparse MLA kernels: FP8 (E4M3) codes with a UE8M0 scale to bf16."""

from __future__ import annotations

import triton.language as tl

__all__ = ["E4M3_ASM"]

# Four E4M3 codes (one int32 word, code 0 in the low byte) times their UE8M0 scale, to
# four bf16 ($0-$3, in order): the hardware's e4m3x2 -> f16x2 conversion; an f16
# holding an E4M3 value (never an f16 subnormal) re-read as bf16 by moving its
# exponent and mantissa down 3 bits is value * 2**-112 (zero stays zero); then two
# exact bf16x2 multiplies, by 2**112 and by the scale ($5: 2**(byte - 127) as a bf16
# pair).
E4M3_ASM = tl.constexpr(
    """{
.reg .b16 c01, c23;
.reg .b32 h01, h23, t01, t23, k;
mov.b32 k, 0x77807780;
mov.b32 {c01, c23}, $4;
cvt.rn.f16x2.e4m3x2 h01, c01;
cvt.rn.f16x2.e4m3x2 h23, c23;
shr.b32 t01, h01, 3;
shr.b32 t23, h23, 3;
and.b32 t01, t01, 0x0FFF0FFF;
and.b32 t23, t23, 0x0FFF0FFF;
and.b32 h01, h01, 0x80008000;
and.b32 h23, h23, 0x80008000;
or.b32 t01, t01, h01;
or.b32 t23, t23, h23;
mul.rn.bf16x2 t01, t01, k;
mul.rn.bf16x2 t23, t23, k;
mul.rn.bf16x2 t01, t01, $5;
mul.rn.bf16x2 t23, t23, $5;
mov.b32 {$0, $1}, t01;
mov.b32 {$2, $3}, t23;
}"""
)
