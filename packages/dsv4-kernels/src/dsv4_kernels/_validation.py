"""Host-side argument checks shared by the public wrappers.

Every check reads only shapes, dtypes, devices and Python ints: nothing here
synchronises the GPU.  Failures raise ``ValueError`` naming the argument and
what was expected.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from .geometry import TOKEN_BYTES, page_stride_bytes

INDEX_DTYPES = (torch.int32,)


def interpreter_enabled() -> bool:
    """True when Triton's interpreter is on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def use_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` run the Triton kernels (else the torch reference)."""
    return device.type == "cuda" or interpreter_enabled()


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | Sequence[int] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check that ``t`` is a tensor with the given dtype(s), rank(s) and device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in dtypes:
            want = " or ".join(str(d) for d in dtypes)
            raise ValueError(f"{name} must have dtype {want}, got {t.dtype}")
    if ndim is not None:
        ranks = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in ranks:
            want = " or ".join(str(r) for r in ranks)
            raise ValueError(f"{name} must be {want}-dimensional, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs, got {t.device}")
    return t


def check_length(name: str, t: torch.Tensor, expected: int, what: str) -> None:
    """Check ``t.shape[0] == expected`` (``what`` says where ``expected`` comes from)."""
    if t.shape[0] != expected:
        raise ValueError(f"{name} must have {expected} entries ({what}), got {t.shape[0]}")


def check_min_length(name: str, t: torch.Tensor, expected: int, what: str) -> None:
    """Check ``t.shape[0] >= expected`` (vLLM passes buffers longer than the batch)."""
    if t.shape[0] < expected:
        raise ValueError(f"{name} must have at least {expected} entries ({what}), got {t.shape[0]}")


def check_nonnegative_int(name: str, value: object) -> int:
    """Check that ``value`` is a Python int >= 0 and return it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def check_positive_int(name: str, value: object) -> int:
    """Check that ``value`` is a Python int > 0 and return it."""
    value = check_nonnegative_int(name, value)
    if value == 0:
        raise ValueError(f"{name} must be > 0, got 0")
    return value


def check_out(
    name: str,
    out: torch.Tensor | None,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    *,
    allow_more_rows: bool = False,
) -> None:
    """Check a caller-supplied output buffer (no allocation happens when it is given).

    With ``allow_more_rows`` the buffer may have more rows than ``shape[0]``
    (a workspace sized for the largest batch); the caller uses its first rows.
    """
    if out is None:
        return
    check_tensor(name, out, dtype=dtype, device=device)
    got = tuple(out.shape)
    rows_ok = got[:1] == shape[:1] or (allow_more_rows and got[:1] >= shape[:1])
    if len(got) != len(shape) or got[1:] != shape[1:] or not rows_ok:
        want = f"({'>= ' if allow_more_rows else ''}{shape[0]}{', ' if shape[1:] else ''}"
        want += ", ".join(str(d) for d in shape[1:]) + ")"
        raise ValueError(f"{name} must have shape {want}, got {got}")
    if out.dim() > 0 and out.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")


def page_stride_of(cache: torch.Tensor, slots: int) -> int:
    """Bytes between two pages of a paged FP8 cache view: ``stride(0)``, taken from the
    tensor (vLLM's block-outer views put a whole block between two pages of one layer),
    or ``page_stride_bytes(slots)`` for a cache of at most one page (whose stride(0) is
    never used)."""
    return int(cache.stride(0)) if cache.shape[0] > 1 else page_stride_bytes(slots)


def page_bytes_view(cache: torch.Tensor, slots: int, stride: int) -> torch.Tensor:
    """A 1-D uint8 view of every byte from page 0 to the end of the last page's data."""
    num_pages = cache.shape[0]
    extent = 0 if num_pages == 0 else (num_pages - 1) * stride + slots * TOKEN_BYTES
    return torch.as_strided(cache, (extent,), (1,), cache.storage_offset())


def check_page_cache(
    name: str, cache: object, slots: int, device: torch.device | None = None
) -> tuple[torch.Tensor, int]:
    """Validate a paged FP8 (UE8M0) cache view; return it and its page stride in bytes.

    The one rule for every kernel: ``[num_pages, >= page]`` uint8 contiguous in its last
    dimension, or a ``[num_pages, slots, 584]`` view with inner strides ``(584, 1)``,
    where ``page = page_stride_bytes(slots)`` (``round_up(slots * 584, 576)``), with any
    page stride ``stride(0) >= page`` (pages side by side, or vLLM's block-outer views,
    where one block holds the pages of every layer of a group) and any storage offset.
    Never synchronises.
    """
    c = check_tensor(name, cache, dtype=torch.uint8, ndim=(2, 3), device=device)
    page = page_stride_bytes(slots)
    if c.dim() == 2:
        if c.shape[1] < page or c.stride(1) != 1:
            raise ValueError(
                f"{name} must be [num_pages, >= {page}] uint8 contiguous in its last dimension "
                f"(page_stride_bytes({slots}) bytes per page of {slots} slots), got shape "
                f"{tuple(c.shape)} and strides {c.stride()}"
            )
    elif (
        tuple(c.shape[1:]) != (slots, TOKEN_BYTES)
        or c.stride(2) != 1
        or (slots > 1 and c.stride(1) != TOKEN_BYTES)
    ):
        raise ValueError(
            f"a 3-D {name} must be a [num_pages, {slots}, {TOKEN_BYTES}] view with inner "
            f"strides ({TOKEN_BYTES}, 1), got shape {tuple(c.shape)} and strides {c.stride()}"
        )
    stride = page_stride_of(c, slots)
    if stride < page:
        raise ValueError(
            f"{name} page stride (stride(0)) must be >= {page} bytes: pages at least {page} "
            f"bytes apart (page_stride_bytes({slots})), got stride(0) = {stride} for shape "
            f"{tuple(c.shape)}"
        )
    return c, stride


def check_block_table_width(
    name: str, table: torch.Tensor, longest: int, slots: int, what: str
) -> None:
    """Check that ``table`` has a column for every page of the longest request:
    ``ceil(longest / slots)`` (``what`` says where ``longest`` comes from)."""
    need = -(-longest // slots)
    if need > table.shape[1]:
        raise ValueError(
            f"{name} has {table.shape[1]} columns, narrower than the longest request needs "
            f"(ceil({what} / {slots}) = {need})"
        )
