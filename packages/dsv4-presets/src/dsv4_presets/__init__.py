"""Launch presets, the ``dsv4`` command and paired A/B/A serving benchmarks for DeepSeek-V4."""

from __future__ import annotations

__version__ = "0.1.0"
