"""The FP8 (UE8M0) page layout as compile-time globals of the Triton and Gluon kernels.

The kernels read these names directly (Triton takes a ``tl.constexpr`` global as
a compile-time constant), so the layout is stated once, from
:mod:`dsv4_kernels.geometry`, instead of being passed to every kernel and
threaded through every helper.
"""

from __future__ import annotations

import triton.language as tl

from . import geometry as _g

HEAD_DIM = tl.constexpr(_g.HEAD_DIM)  # 512 values per latent KV head
NOPE = tl.constexpr(_g.NOPE_DIM)  # 448 FP8 values ...
ROPE = tl.constexpr(_g.ROPE_DIM)  # ... then 64 bf16 rope values
QBLOCK = tl.constexpr(_g.QUANT_BLOCK)  # 64 values share one scale byte
NQ = tl.constexpr(_g.NUM_QUANT_BLOCKS)  # 7 scale bytes per token
NQ_PAD = tl.constexpr(_g.TOKEN_SCALE_BYTES)  # 8: the 7 blocks padded (block 7: the rope)
DATA_BYTES = tl.constexpr(_g.TOKEN_DATA_BYTES)  # 576 data bytes per token in a page
SCALE_BYTES = tl.constexpr(_g.TOKEN_SCALE_BYTES)  # 8 scale bytes per token in a page
