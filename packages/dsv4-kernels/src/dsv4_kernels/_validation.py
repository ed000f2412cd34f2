"""Host-side argument checks shared by the public wrappers.

Every check reads only shapes, dtypes, devices and Python ints: nothing here
synchronises the GPU.  Failures raise ``ValueError`` naming the argument and
what was expected.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

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
