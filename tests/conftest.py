"""Suite-wide setup.

On a machine without CUDA the kernel tests run the real Triton kernels through
Triton's interpreter.  Triton decides between compiling and interpreting when
``@triton.jit`` decorates a kernel, i.e. when ``dsv4_kernels`` is imported, so
the switch must be set here, before any test module imports the package.
"""

from __future__ import annotations

import os


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
