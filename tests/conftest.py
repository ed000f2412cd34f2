"""Suite-wide setup.

On a machine without CUDA the kernel tests run the real Triton kernels through
Triton's interpreter.  Triton decides between compiling and interpreting when
``@triton.jit`` decorates a kernel, i.e. when ``dsv4_kernels`` is imported, so
the switch must be set here, before any test module imports the package.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _hypothesis_profile() -> None:
    """Property tests draw the same examples on every run (a CI result is reproducible);
    ``HYPOTHESIS_PROFILE=explore`` draws fresh ones each run, to look for new cases."""
    try:
        from hypothesis import settings
    except ImportError:  # the GPU machine's suite may run without hypothesis installed
        return
    settings.register_profile("repeatable", derandomize=True)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


_hypothesis_profile()


@pytest.fixture(autouse=True)
def _environment_as_it_was() -> Iterator[None]:
    """Every test leaves ``os.environ`` as it found it.  Code under test may set variables
    (the presets' CLI sets ``VLLM_LOGGING_LEVEL`` for the vLLM it starts), and the suites
    run a test file per worker process: a file must not change what a later file of the
    same process, or the processes its tests start, see."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
