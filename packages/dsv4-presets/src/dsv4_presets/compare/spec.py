"""What a comparison runs: variant specs, the run plan, and their parsing.

A variant SPEC is one command-line word holding a serve preset and what to
change in it, separated by spaces (shell quoting applies inside, so values
may contain spaces)::

    SPEC   := SOURCE TOKEN*
    SOURCE := a shipped serve preset name (``h200-tp8-ep``)
            | a path to a YAML serve preset file (``./my-preset.yaml``)
    TOKEN  := KEY=VALUE        override one vLLM option, as ``dsv4 render --set``
                               (``max-num-batched-tokens=8192``)
            | env:NAME=VALUE   set an environment variable for the server, taken
                               literally (``env:DSV4_KERNELS_DISABLE=1``)
            | vllm:COMMAND     run this variant's server with another vLLM build:
                               the command that stands for ``vllm`` (shell-quoted,
                               ``vllm:'/opt/vllm-old/bin/python -m vllm.entrypoints.cli.main'``);
                               without it ``env:DSV4_VLLM=...`` of the spec, then
                               ``DSV4_VLLM`` of the caller, then the current
                               interpreter's vLLM
            | label:TEXT       the name shown in the report (default ``A`` / ``B``)

Examples: ``--a h200-tp8-ep --b 'h200-tp8-ep env:DSV4_KERNELS_DISABLE=1'``.

A *pattern* such as ``ABA`` or ``ABBA`` is repeated ``repeats`` times; runs
are named by variant and occurrence: ``A1 B1 A2``, then ``A3 B2 A4``, ...
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

__all__ = [
    "PlannedRun",
    "VariantSpec",
    "parse_env_assignment",
    "parse_spec",
    "plan_runs",
]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_OPTION_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
MAX_RUNS = 200


@dataclass(frozen=True)
class VariantSpec:
    """One side of a comparison, as the user wrote it (not yet resolved)."""

    variant: str
    source: str
    sets: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    vllm: tuple[str, ...] | None = None
    label: str | None = None
    text: str = ""

    @property
    def display(self) -> str:
        """Name used in tables: the label when given, else the variant letter."""
        return self.label or self.variant

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (what the user asked for)."""
        return {
            "variant": self.variant,
            "text": self.text,
            "source": self.source,
            "sets": list(self.sets),
            "env": dict(self.env),
            "vllm": list(self.vllm) if self.vllm is not None else None,
            "label": self.label,
        }


def parse_env_assignment(text: str, *, argument: str) -> tuple[str, str]:
    """Split ``NAME=VALUE`` with a valid environment variable name."""
    name, sep, value = text.partition("=")
    if not sep or not _ENV_NAME.match(name):
        raise ValueError(
            f"{argument}: expected NAME=VALUE with NAME a valid environment variable "
            f"name, got {text!r}"
        )
    return name, value


def parse_spec(text: str, *, variant: str) -> VariantSpec:
    """Parse one SPEC word (see the module docstring) for variant ``A`` or ``B``."""
    argument = f"--{variant.lower()}"
    if variant not in ("A", "B"):
        raise ValueError(f"variant must be 'A' or 'B', got {variant!r}")
    try:
        tokens = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"{argument}: cannot split {text!r} into words: {exc}") from None
    if not tokens:
        raise ValueError(f"{argument}: expected a serve preset name or YAML path, got nothing")
    source, rest = tokens[0], tokens[1:]
    if "=" in source or source.startswith(("env:", "vllm:", "label:")):
        raise ValueError(
            f"{argument}: the first word must be a serve preset name or a YAML preset path, "
            f"got {source!r}"
        )
    sets: list[str] = []
    env: list[tuple[str, str]] = []
    vllm: tuple[str, ...] | None = None
    label: str | None = None
    for token in rest:
        if token.startswith("env:"):
            env.append(parse_env_assignment(token[4:], argument=f"{argument} env:"))
        elif token.startswith("vllm:"):
            try:
                words = tuple(shlex.split(token[5:]))
            except ValueError as exc:
                raise ValueError(f"{argument}: bad vllm: command {token[5:]!r}: {exc}") from None
            if not words:
                raise ValueError(f"{argument}: vllm: needs a command, e.g. vllm:/opt/x/bin/vllm")
            if vllm is not None:
                raise ValueError(f"{argument}: vllm: given twice")
            vllm = words
        elif token.startswith("label:"):
            if not token[6:]:
                raise ValueError(f"{argument}: label: needs a text")
            label = token[6:]
        else:
            key, sep, _value = token.partition("=")
            if not sep or not _OPTION_KEY.match(key.lstrip("-")):
                raise ValueError(
                    f"{argument}: expected KEY=VALUE, env:NAME=VALUE, vllm:COMMAND or "
                    f"label:TEXT after the preset, got {token!r}"
                )
            sets.append(token[2:] if token.startswith("--") else token)
    return VariantSpec(variant, source, tuple(sets), tuple(env), vllm, label, text)


@dataclass(frozen=True)
class PlannedRun:
    """One server start in the campaign."""

    index: int
    label: str
    variant: str
    folder: str = field(default="")

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "index": self.index,
            "label": self.label,
            "variant": self.variant,
            "folder": self.folder,
        }


def plan_runs(pattern: str, repeats: int = 1) -> list[PlannedRun]:
    """Expand ``pattern`` (letters A and B) ``repeats`` times into named runs."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("--pattern: expected letters A and B such as ABA, got nothing")
    p = pattern.upper()
    if set(p) - {"A", "B"}:
        raise ValueError(f"--pattern: expected only the letters A and B, got {pattern!r}")
    if "A" not in p or "B" not in p:
        raise ValueError(f"--pattern: must contain both A and B, got {pattern!r}")
    if repeats < 1:
        raise ValueError(f"--repeats: expected a positive integer, got {repeats}")
    letters = p * repeats
    if len(letters) > MAX_RUNS:
        raise ValueError(f"--pattern/--repeats: {len(letters)} runs exceed the limit of {MAX_RUNS}")
    counts = {"A": 0, "B": 0}
    runs = []
    width = max(2, len(str(len(letters))))
    for i, v in enumerate(letters, start=1):
        counts[v] += 1
        label = f"{v}{counts[v]}"
        runs.append(PlannedRun(i, label, v, f"{i:0{width}d}-{label}"))
    return runs
