"""Seeds, generators and the poison value every check shares."""

from __future__ import annotations

import os

import torch

__all__ = ["POISON", "fresh_seed", "generator"]

# Fills int32 outputs before a kernel runs: never a valid index, never -1, so
# an element the kernel did not write is seen after the run.
POISON = -7777


def fresh_seed() -> int:
    """A new random seed per call (fresh inputs every run); record it with the result."""
    return int.from_bytes(os.urandom(4), "little")


def generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator on ``device`` seeded with ``seed``."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
