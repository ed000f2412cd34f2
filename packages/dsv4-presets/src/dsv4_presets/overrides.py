"""``--set KEY=VALUE`` overrides: parsed once, here, into what the presets apply.

``tensor-parallel-size=4`` sets an option, ``speculative-config.method=dspark``
one key of a JSON option, ``env.NAME=VALUE`` an environment variable,
``model=...`` the model, and ``KEY=null`` removes a key.  Values are YAML.
Applying the option overrides is :func:`dsv4_presets.merge.apply_overrides`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from dsv4_presets.configs import PresetError
from dsv4_presets.merge import Override

__all__ = ["Sets", "parse_set", "parse_sets"]


def parse_set(item: str) -> tuple[list[str], Any]:
    """Split one ``key=value`` override into a key path and a YAML-typed value.

    ``tensor-parallel-size=4`` -> ``(["tensor-parallel-size"], 4)``;
    ``speculative-config.num_speculative_tokens=2`` sets one key of a mapping;
    ``env.VLLM_LOGGING_LEVEL=DEBUG`` sets an environment variable; ``key=null``
    removes the key.  Values are read as YAML scalars (``true``, ``16384``,
    ``{"a": 1}``); ``inf`` is kept as the string vLLM reads as infinity.
    """
    if not isinstance(item, str) or "=" not in item:
        raise PresetError(f"--set expects key=value, got {item!r}")
    key, text = item.split("=", 1)
    key = key.strip()
    if key.startswith("--"):
        key = key[2:]
    if not key or any(not part for part in key.split(".")):
        raise PresetError(f"--set expects key=value with a non-empty key, got {item!r}")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as exc:
        raise PresetError(f"--set {item!r}: value is not valid YAML: {exc}") from None
    parts = key.split(".")
    if parts[0] != "env":
        parts[0] = parts[0].replace("_", "-")
    return parts, value


@dataclass(frozen=True)
class Sets:
    """Parsed ``--set`` items: the model, environment changes and option overrides."""

    model: str | None = None
    env: tuple[tuple[str, Any], ...] = ()
    options: tuple[Override, ...] = ()


def parse_sets(sets: Sequence[str]) -> Sets:
    """Parse every ``--set`` item (a sequence of ``KEY=VALUE`` strings) once."""
    if isinstance(sets, str):
        raise PresetError(
            f"sets must be a sequence of 'key=value' strings, got the string {sets!r}"
        )
    model: str | None = None
    env: list[tuple[str, Any]] = []
    options: list[Override] = []
    for item in sets:
        parts, value = parse_set(item)
        if parts[0] == "env":
            if len(parts) != 2:
                raise PresetError(f"--set {item!r}: use env.NAME=value")
            env.append((parts[1], value))
        elif parts == ["model"]:
            if not isinstance(value, str) or not value:
                raise PresetError(f"--set model=...: expected a model name or path, got {value!r}")
            model = value
        else:
            options.append((tuple(parts), value))
    return Sets(model=model, env=tuple(env), options=tuple(options))
