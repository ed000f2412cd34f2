"""Sparse MLA decode with sink from the FP8 pages: split over keys, then combine.

Same contract as :func:`dsv4_kernels.sparse_mla_paged` (window slots + compressed
slots per token, ``-1`` holes, lengths, per-head sink, lse without the sink, a
token with no valid key gives ``out = 0`` and ``lse = -inf``), for decode steps:
few query tokens (1-4 per request for MTP and DSpark, each with its own rows),
head-exact at 1-16 heads (TP8) and at DP attention's 64 or 128.

With few tokens one program per token would leave the GPU idle, so each token's
column list (its ``a_width`` window columns, then its ``b_width`` compressed
columns) is cut into ``num_splits`` chunks of ``chunk`` columns (whole tiles of
64 keys), chosen on the host from the shapes alone (:func:`decode_splits`: no
device read, no synchronisation).  One program per (token, chunk) writes that
chunk's partial result into the caller's scratch (:class:`DecodeScratch`,
allocated once, outside the step) and a combine kernel merges the chunks, applies
the sink and writes ``out`` and ``lse``.  With many tokens (``num_splits == 1``)
the prefill kernel runs as it is (one program per token, no partials).  Nothing
is allocated in a call that is given ``out`` and a scratch: it can be captured
in a CUDA graph and replayed with new indices and lengths in the same buffers.

CUDA on Hopper runs the Gluon wgmma split kernel (:mod:`._gluon_decode`), more than
16 heads in blocks of 16, and launches the combine as the split kernel's programmatic
dependent; other GPUs and Triton's interpreter run the Triton split kernel
(:mod:`._triton_decode`); CPU tensors without the interpreter run the torch
reference (:func:`dsv4_kernels.reference.sparse_mla_decode`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch
import triton

from . import _sparse_mla_checks as _checks
from . import _triton_decode as _k
from ._paged_keys import WIDE_BLOCK_HEADS, PageView, check_paged_keys, launch, launch_split
from ._validation import (
    check_out,
    check_positive_int,
    check_tensor,
    interpreter_enabled,
    use_triton,
)
from .geometry import HEAD_DIM

__all__ = [
    "DECODE_TILES",
    "DecodePolicy",
    "DecodeScratch",
    "DecodeScratchSizes",
    "decode_scratch_sizes",
    "decode_splits",
    "make_decode_scratch",
    "sparse_mla_decode",
]

# Split policy (H200 sweep in docs/attention.md, "Decode"): keys per tile of the
# split kernels (the wgmma tile; the Triton kernel runs two of its 32-key tiles
# per 64), programs the policy aims for per multiprocessor (what fits at once:
# three wgmma programs at up to 8 heads, two at 16), the fewest tiles a chunk
# holds, the per-token kernel once ``NOSPLIT_DIV * tokens`` reaches that target,
# rows of at most ``SHORT_TILES`` tiles (SWA-only layers) unsplit once their tiles
# reach ``SHORT_NOSPLIT_PCT`` percent of the target (run 2 of the decode sweep: the
# combine costs more than half of a two-tile row saves), the multiprocessor count
# assumed where there is no GPU, and the most partials the combine merges per step
# (one step for up to 32 chunks).  Decode v2 (issue 32, H200 runs in docs/attention.md):
# ``HEAD_BLOCKS`` (1) runs more than 16 heads (DP attention) on the wgmma split kernel in
# blocks of 16 heads (0: the Triton kernel); ``PDL`` (1) launches the combine as a
# programmatic dependent of the split kernel, whose programs signal once their partial is
# stored (Hopper and later; not the interpreter).  ``WIDE_HT`` (0: off; 32 or 64) runs
# more than 16 heads in blocks of that many heads on two warpgroups instead, each key
# tile dequantised once per block (issue 41): built and checked for sm_90 offline, off
# until an H200 run measures it against the 16-head blocks and FlashMLA.
DECODE_TILES: dict[str, int] = dict(
    TILE_KEYS=64,
    PROGRAMS_PER_SM_H8=3,
    PROGRAMS_PER_SM=2,
    MIN_TILES_PER_SPLIT=1,
    NOSPLIT_DIV=2,
    SHORT_TILES=2,
    SHORT_NOSPLIT_PCT=60,
    CPU_SMS=4,
    COMBINE_SPLITS=32,
    HEAD_BLOCKS=1,
    PDL=1,
    WIDE_HT=0,
)

WIDE_HEAD_BLOCKS = (0, *WIDE_BLOCK_HEADS)  # the values DECODE_TILES["WIDE_HT"] takes


DecodePolicy = Mapping[str, int]
"""Entries of :data:`DECODE_TILES` to use instead of the measured defaults (the
``policy=`` argument of :func:`decode_splits`, :func:`decode_scratch_sizes` and
:func:`sparse_mla_decode`: sweeps pass their variants instead of rebinding the
table); an entry it leaves out keeps its default."""


def _policy(policy: DecodePolicy | None) -> Mapping[str, int]:
    if policy is None:
        return DECODE_TILES
    if not isinstance(policy, Mapping):
        raise ValueError(f"policy must be a mapping of DECODE_TILES entries, got {policy!r}")
    unknown = sorted(set(policy) - set(DECODE_TILES))
    if unknown:
        raise ValueError(
            f"policy: unknown entries {unknown}; DECODE_TILES has {sorted(DECODE_TILES)}"
        )
    for key, value in policy.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"policy[{key!r}] must be an int >= 0, got {value!r}")
    if policy.get("WIDE_HT", 0) not in WIDE_HEAD_BLOCKS:
        raise ValueError(
            f"policy['WIDE_HT'] must be one of {WIDE_HEAD_BLOCKS} (heads per wide block), "
            f"got {policy['WIDE_HT']!r}"
        )
    return {**DECODE_TILES, **policy}


def _pdl_runs(device: torch.device) -> bool:
    """Whether a programmatic dependent launch can run here: a CUDA device of compute
    capability 9.0 or later (host query, cached), not Triton's interpreter, a Triton with
    grid dependency control."""
    if device.type != "cuda" or interpreter_enabled() or not _k.HAS_GDC:
        return False
    return int(_device_properties(device).major) >= 9


@functools.cache
def _cached_properties(index: int) -> Any:
    return torch.cuda.get_device_properties(index)


def _device_properties(device: torch.device) -> Any:
    """A CUDA device's properties (one host query per device, cached)."""
    return _cached_properties(
        device.index if device.index is not None else torch.cuda.current_device()
    )


def num_sms(device: torch.device | str | None = None) -> int:
    """Multiprocessors of a CUDA device (host query, cached); ``CPU_SMS`` elsewhere."""
    dev = torch.device("cuda" if device is None else device)
    if dev.type != "cuda":
        return DECODE_TILES["CPU_SMS"]
    return int(_device_properties(dev).multi_processor_count)


def decode_splits(
    num_tokens: int,
    num_heads: int,
    a_width: int,
    b_width: int,
    sms: int,
    *,
    policy: DecodePolicy | None = None,
) -> tuple[int, int]:
    """``(num_splits, chunk)`` for a decode call, from sizes only.

    The ``tiles`` of 64 columns of a token's list are shared out so that
    ``num_tokens * num_splits`` programs fill ``sms`` multiprocessors at the
    policy's programs per multiprocessor: ``tiles_per_split = ceil(tiles *
    num_tokens / target)`` (at least ``MIN_TILES_PER_SPLIT``).  ``num_splits ==
    1`` (the per-token kernel, ``chunk`` the whole list) once the tokens alone
    reach ``1 / NOSPLIT_DIV`` of the target.  ``policy``: :data:`DecodePolicy`.
    """
    cfg = _policy(policy)
    tile = cfg["TILE_KEYS"]
    width = a_width + b_width
    tiles = max(1, -(-a_width // tile) + -(-b_width // tile))
    per_sm = cfg["PROGRAMS_PER_SM_H8"] if num_heads <= 8 else cfg["PROGRAMS_PER_SM"]
    target = max(1, sms * per_sm)
    if num_tokens <= 0 or cfg["NOSPLIT_DIV"] * num_tokens >= target or tiles <= 1:
        return 1, max(width, 1)
    short = tiles <= cfg["SHORT_TILES"]
    if short and 100 * tiles * num_tokens >= cfg["SHORT_NOSPLIT_PCT"] * target:
        return 1, max(width, 1)
    per_split = max(cfg["MIN_TILES_PER_SPLIT"], -(-tiles * num_tokens // target))
    splits = -(-tiles // per_split)
    if splits <= 1:
        return 1, max(width, 1)
    return splits, per_split * tile


@dataclasses.dataclass(frozen=True)
class DecodeScratchSizes:
    """Float32 elements of each scratch buffer for the largest decode batch."""

    partial_rows: int  # (token, chunk) rows: max over batches of tokens * splits
    max_heads: int
    max_tokens: int

    @property
    def partial_out(self) -> int:
        return self.partial_rows * self.max_heads * HEAD_DIM

    @property
    def partial_lse(self) -> int:
        return self.partial_rows * self.max_heads

    @property
    def lse(self) -> int:
        return self.max_tokens * self.max_heads

    @property
    def total(self) -> int:
        """All three, in float32 elements (``4 * total`` bytes)."""
        return self.partial_out + self.partial_lse + self.lse


def decode_scratch_sizes(
    max_tokens: int,
    max_heads: int,
    max_keys: int,
    device: torch.device | str | None = None,
    *,
    window: int = 128,
    sms: int | None = None,
    policy: DecodePolicy | None = None,
) -> DecodeScratchSizes:
    """The scratch a decode batch of up to ``max_tokens`` tokens, ``max_heads`` heads
    and ``max_keys`` columns per token (``window + compressed width``: 640 for
    V4-Flash C4A, ``128 + vLLM's C128A width`` for C128A) needs on ``device``
    (its multiprocessor count sets the splits; ``sms`` overrides it) under ``policy``
    (:data:`DecodePolicy`).  Every batch at most that large fits, whatever its split
    of columns between the two sources."""
    check_positive_int("max_tokens", max_tokens)
    check_positive_int("max_heads", max_heads)
    check_positive_int("max_keys", max_keys)
    sms = num_sms(device) if sms is None else check_positive_int("sms", sms)
    cfg = _policy(policy)
    per_sm = max(cfg["PROGRAMS_PER_SM_H8"], cfg["PROGRAMS_PER_SM"])
    rows = 1
    b_max = max(max_keys - window, 0)
    widths = {b_max, *range(0, b_max + 1, cfg["TILE_KEYS"])}
    for t in range(1, min(max_tokens, sms * per_sm) + 1):
        for b in widths:
            for h in {1, min(max_heads, 8), max_heads}:
                s = decode_splits(t, h, min(window, max_keys), b, sms, policy=cfg)[0]
                rows = max(rows, t * s if s > 1 else 1)
    return DecodeScratchSizes(rows, max_heads, max_tokens)


@dataclasses.dataclass
class DecodeScratch:
    """Preallocated float32 buffers of a decode call (views are taken per call)."""

    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    lse: torch.Tensor
    sizes: DecodeScratchSizes


def make_decode_scratch(
    sizes: DecodeScratchSizes,
    device: torch.device | str,
    buffer: torch.Tensor | None = None,
) -> DecodeScratch:
    """Allocate the scratch (or carve it from ``buffer``: a flat float32 tensor of at
    least ``sizes.total`` elements on ``device``, e.g. from vLLM's workspace)."""
    if buffer is None:
        buffer = torch.empty(sizes.total, dtype=torch.float32, device=device)
    buf = check_tensor("buffer", buffer, dtype=torch.float32, ndim=1)
    if buf.numel() < sizes.total or (buf.numel() > 1 and buf.stride(0) != 1):
        raise ValueError(f"buffer must be contiguous with >= {sizes.total} float32 elements")
    a, b = sizes.partial_out, sizes.partial_out + sizes.partial_lse
    return DecodeScratch(buf[:a], buf[a:b], buf[b : b + sizes.lse], sizes)


def _check_scratch(scratch: object, T: int, H: int, rows: int, device: torch.device) -> None:
    if not isinstance(scratch, DecodeScratch):
        raise ValueError(f"scratch must be a DecodeScratch, got {type(scratch).__name__}")
    z = scratch.sizes
    if z.max_heads < H or z.max_tokens < T or z.partial_rows < rows:
        raise ValueError(
            f"scratch holds {z.max_tokens} tokens, {z.max_heads} heads and {z.partial_rows} "
            f"partial rows; this call needs {T}, {H} and {rows}"
        )
    if scratch.partial_out.device != device:
        raise ValueError(f"scratch must be on {device} like q, got {scratch.partial_out.device}")


def sparse_mla_decode(
    q: torch.Tensor,
    swa_cache: torch.Tensor | PageView,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor | None,
    scale: float,
    *,
    swa_block_size: int | None = None,
    scratch: DecodeScratch,
    attn_sink: torch.Tensor | None = None,
    comp_cache: torch.Tensor | PageView | None = None,
    comp_indices: torch.Tensor | None = None,
    comp_lens: torch.Tensor | None = None,
    comp_block_size: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    num_splits: int | None = None,
    policy: DecodePolicy | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA with sink for a decode step, split over keys (module docstring).

    Arguments as :func:`dsv4_kernels.sparse_mla_paged` (``q`` ``[T, H, 512]`` bf16
    with any token and head strides, the caches as vLLM's per-layer views with any
    ``stride(0)``, int32 rows ``[T, K]`` of global slots with ``-1`` holes and
    ``[T]`` lengths), plus:

    Args:
        scratch: from :func:`make_decode_scratch`, sized by
            :func:`decode_scratch_sizes` for at least this call.
        out: ``[T, H, 512]`` bf16, written in place (allocated when None).
        lse: ``[T, H]`` float32; None writes it into the scratch (returned as a view).
        num_splits: force the number of key chunks (tests, sweeps); None chooses
            it from the sizes (:func:`decode_splits`).
        policy: split-policy entries instead of :data:`DECODE_TILES`' defaults
            (:data:`DecodePolicy`; sweeps).

    Returns:
        ``(out, lse)``.

    Raises:
        ValueError: naming the argument, as :func:`dsv4_kernels.sparse_mla_paged`,
            and for a scratch too small for the call.
    """
    q = _checks._check_q(q)
    device = q.device
    T, H, _ = q.shape
    scale = _checks._check_scale(scale)
    keys = check_paged_keys(swa_cache, swa_indices, swa_lens, swa_block_size, comp_cache,
                            comp_indices, comp_lens, comp_block_size, T, device)  # fmt: skip
    a_width = keys.window.width
    b_width = 0 if keys.comp is None else keys.comp.width
    cfg = _policy(policy)
    if num_splits is None:
        splits, chunk = decode_splits(T, H, a_width, b_width, num_sms(device), policy=cfg)
    else:
        splits = check_positive_int("num_splits", num_splits)
        tile = cfg["TILE_KEYS"]
        chunk = -(-max(a_width + b_width, 1) // (splits * tile)) * tile
    _check_scratch(scratch, T, H, T * splits if splits > 1 else 0, device)
    sink = None
    if attn_sink is not None:
        sink = check_tensor("attn_sink", attn_sink, dtype=torch.float32, ndim=1, device=device)
        if sink.shape[0] != H:
            raise ValueError(f"attn_sink must have {H} entries (one per head), got {sink.shape[0]}")
    check_out("out", out, (T, H, HEAD_DIM), torch.bfloat16, device)
    check_out("lse", lse, (T, H), torch.float32, device)
    if out is None:
        out = torch.empty((T, H, HEAD_DIM), dtype=torch.bfloat16, device=device)
    if lse is None:
        lse = scratch.lse[: T * H].view(T, H)
    if not use_triton(device):
        from .reference import decode as ref

        return ref.sparse_mla_decode(
            q, scale=scale, scratch=scratch, attn_sink=sink, out=out, lse=lse, **keys.arguments()
        )
    if T == 0:
        return out, lse
    if splits == 1:  # enough tokens: the per-token kernel, no partials
        launch(q, out, lse, sink, keys, scale=scale)
        return out, lse
    rows = T * splits
    po = scratch.partial_out[: rows * H * HEAD_DIM].view(rows, H, HEAD_DIM)
    plse = scratch.partial_lse[: rows * H].view(rows, H)
    pdl = bool(cfg["PDL"]) and _pdl_runs(device)
    launch_split(q, po, plse, keys, scale=scale, splits=splits, chunk=chunk,
                 head_blocks=bool(cfg["HEAD_BLOCKS"]), pdl=pdl, wide=cfg["WIDE_HT"])  # fmt: skip
    _k._decode_combine_kernel[(T * H,)](
        po, plse, out, lse, sink if sink is not None else plse, H, splits, out.stride(0),
        out.stride(1), lse.stride(0), HAS_SINK=sink is not None,
        SPLIT_BLOCK=min(cfg["COMBINE_SPLITS"], triton.next_power_of_2(splits)), PDL=pdl,
        num_warps=4, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return out, lse
