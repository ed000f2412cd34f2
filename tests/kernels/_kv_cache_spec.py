"""Slow references for the FP8 (UE8M0) K cache, written straight from docs/design.md.

Plain Python on floats (float64, where every step here is exact), a loop per
token and per value; independent of ``dsv4_kernels.reference`` (vectorised
torch) and of the Triton kernels.  The E4M3 encoder is built from the format's
definition (bias 7, 3 mantissa bits, subnormals, no infinities, 448 the
largest finite value) and rounds to the nearest value, ties to the even code.
"""

from __future__ import annotations

import bisect
import math
import struct

import torch

NOPE = 448
ROPE = 64
QBLOCK = 64
NQ = 7
DATA = 576
SCALE = 8
TOKEN = DATA + SCALE
ALIGN = 576
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
BIAS = 127


def e4m3_value(code: int) -> float:
    """Value of a non-negative E4M3 (fn) code 0..126."""
    exp, man = code >> 3, code & 7
    if exp == 0:
        return man / 8 * 2.0**-6
    return (1 + man / 8) * 2.0 ** (exp - 7)


_CODES = list(range(127))  # 0x7F is NaN
_VALUES = [e4m3_value(c) for c in _CODES]


def e4m3_encode(v: float) -> int:
    """Nearest E4M3 code to ``v`` (|v| <= 448), ties to the even code; keeps the sign of -0."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    assert a <= FP8_MAX, a
    j = bisect.bisect_left(_VALUES, a)
    if _VALUES[j] == a:
        return sign | _CODES[j]
    lo, hi = _CODES[j - 1], _CODES[j]
    dlo, dhi = a - _VALUES[j - 1], _VALUES[j] - a
    if dlo < dhi or (dlo == dhi and lo % 2 == 0):
        return sign | lo
    return sign | hi


def e4m3_decode(code: int) -> float:
    value = e4m3_value(code & 0x7F)
    return -value if code & 0x80 else value


def block_exponent(block: list[float]) -> int:
    """``e = ceil(log2(max(amax, 1e-4) / 448))``."""
    amax = max(abs(v) for v in block)
    return math.ceil(math.log2(max(amax, AMAX_FLOOR) / FP8_MAX))


def quantize_token(values: list[float], rope_bytes: bytes) -> tuple[bytes, bytes]:
    """One token's 576 data bytes and 8 scale bytes."""
    codes = bytearray()
    scales = bytearray()
    for q in range(NQ):
        block = values[q * QBLOCK : (q + 1) * QBLOCK]
        e = block_exponent(block)
        scales.append(e + BIAS)
        for v in block:
            codes.append(e4m3_encode(min(max(v / 2.0**e, -FP8_MAX), FP8_MAX)))
    scales.append(0)
    return bytes(codes) + rope_bytes, bytes(scales)


def dequantize_token(data: bytes, scales: bytes) -> list[float]:
    """512 values (as floats) of one token: ``code * 2**(byte - 127)``, then rope as bf16."""
    vals = [e4m3_decode(data[j]) * 2.0 ** (scales[j // QBLOCK] - BIAS) for j in range(NOPE)]
    for j in range(ROPE):
        (half,) = struct.unpack_from("<H", data, NOPE + 2 * j)
        vals.append(struct.unpack("<f", struct.pack("<I", half << 16))[0])
    return vals


def page_stride(slots: int) -> int:
    return math.ceil(slots * TOKEN / ALIGN) * ALIGN


def spec_insert(
    cache: torch.Tensor, k: torch.Tensor, slot_mapping: list[int], block_size: int
) -> torch.Tensor:
    """Return a copy of ``cache`` ([pages, stride] uint8, CPU) with the tokens written."""
    stride = page_stride(block_size)
    buf = bytearray(cache.contiguous().numpy().tobytes())
    num_pages = cache.shape[0]
    kf = k.float().tolist()
    kb = k.contiguous().view(torch.uint8).numpy().tobytes()
    for t, slot in enumerate(slot_mapping):
        if slot < 0 or slot >= num_pages * block_size:
            continue
        page, s = divmod(slot, block_size)
        rope = kb[t * 1024 + 2 * NOPE : t * 1024 + 1024]
        data, scales = quantize_token(kf[t][:NOPE], rope)
        base = page * stride
        buf[base + s * DATA : base + (s + 1) * DATA] = data
        at = base + block_size * DATA + s * SCALE
        buf[at : at + SCALE] = scales
    return torch.frombuffer(buf, dtype=torch.uint8).reshape(cache.shape).clone()


def spec_gather(
    out: torch.Tensor,
    cache: torch.Tensor,
    seq_lens: list[int],
    gather_lens: list[int] | None,
    block_table: list[list[int]],
    block_size: int,
    offset: int,
) -> torch.Tensor:
    """Return a copy of ``out`` (CPU bf16) with every gathered row written."""
    stride = page_stride(block_size)
    buf = cache.contiguous().numpy().tobytes()
    res = out.clone()
    for b, seq in enumerate(seq_lens):
        g = seq if gather_lens is None else gather_lens[b]
        for i in range(g):
            pos = seq - g + i
            page = block_table[b][pos // block_size]
            s = pos % block_size
            base = page * stride
            data = buf[base + s * DATA : base + (s + 1) * DATA]
            at = base + block_size * DATA + s * SCALE
            vals = dequantize_token(data, buf[at : at + SCALE])
            res[b, offset + i] = torch.tensor(vals, dtype=torch.float64).to(torch.bfloat16)
    return res


def roundtrip_bound(block: list[float]) -> list[float]:
    """Per-value error bound of quantise-then-dequantise for one block of 64.

    With the block's UE8M0 exponent ``e``, a value lands in E4M3 at ``x / 2**e``;
    rounding to nearest is off by at most half a unit in the last place: a
    relative ``2**-4`` of the value's own binade (3 mantissa bits) in the
    normal range, and ``2**-10 * 2**e`` in the subnormal range.
    """
    e = block_exponent(block)
    out = []
    for v in block:
        a = abs(v)
        normal = 2.0 ** (math.floor(math.log2(a)) - 4) if a > 0 else 0.0
        out.append(max(normal, 2.0 ** (e - 10)))
    return out
