"""Fixtures for the kernel tests: the device the Triton kernels run on."""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels._validation import interpreter_enabled


@pytest.fixture
def kernel_device() -> torch.device:
    """Where the Triton kernels run: CUDA if present, else the CPU through the interpreter."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    assert interpreter_enabled(), "CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py)"
    return torch.device("cpu")


@pytest.fixture
def gpu() -> torch.device:
    assert torch.cuda.is_available(), "this test needs a CUDA GPU"
    return torch.device("cuda")
