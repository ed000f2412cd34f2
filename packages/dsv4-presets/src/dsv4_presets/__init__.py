"""Launch presets, the ``dsv4`` command and paired A/B/A serving benchmarks for DeepSeek-V4.

The public API::

    from dsv4_presets import resolve_serve, resolve_bench, validate

    config = resolve_serve("h200-tp8-ep", sets=["max-num-batched-tokens=8192"])
    config.to_argv()        # everything after `vllm serve`
    validate(config)        # [] when the DSV4 rules (and vLLM's parser, if installed) agree
"""

from __future__ import annotations

__version__ = "0.1.0"

from dsv4_presets.findings import Finding, Report
from dsv4_presets.presets import (
    BenchConfig,
    NodeSpec,
    PresetError,
    ServeConfig,
    list_presets,
    parse_set,
    resolve_bench,
    resolve_serve,
)
from dsv4_presets.validate import check, validate

__all__ = [
    "BenchConfig",
    "Finding",
    "NodeSpec",
    "PresetError",
    "Report",
    "ServeConfig",
    "__version__",
    "check",
    "list_presets",
    "parse_set",
    "resolve_bench",
    "resolve_serve",
    "validate",
]
