"""vLLM's option tables, as data, so presets can be checked without vLLM installed.

``vllm serve`` and ``vllm bench serve`` each accept a few hundred options.  To
reject unknown keys and badly typed values on a machine without vLLM (a laptop
writing a cluster config, CI), we ship a snapshot of both parsers' option
tables for every supported vLLM release (``data/vllm/0.32/``,
``data/vllm/0.33/``: whole tables, not deltas, so each is exactly what that
release's parser builds), generated from the real parsers by
:func:`dsv4_presets.schema_snapshot.snapshot_from_parser` (``python -m
dsv4_presets.vllm_check --write`` in an environment with that release installed).
A test in each release's vLLM session asserts that the shipped snapshot of the
installed release still equals what its parser builds, so drift is caught rather
than trusted;
:func:`table_diff` lists what changed between two releases.

Each option has a *kind*:

``bool``
    ``--x`` / ``--no-x`` (argparse ``BooleanOptionalAction``); YAML ``true``/``false``.
``flag``
    ``--x`` only (``store_true``); ``false`` means "leave it off".
``value``
    ``--x VALUE``; the value's *type* is one of ``int``, ``human-int`` (``16384`` or
    ``16k``), ``human-int-or-auto`` (the same, or ``auto``/``-1``: ``--max-model-len``),
    ``float``, ``str``, ``json`` (a mapping, sent as JSON) or ``json-or-str``.
``list``
    ``--x A B C`` (``nargs='+'`` or ``'*'``); YAML list.
``append``
    ``--x A --x B``; YAML list.
``optional``
    ``--x`` alone or ``--x VALUE`` (``nargs='?'``).
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import yaml

KINDS = ("bool", "flag", "value", "list", "append", "optional")
TYPES = ("int", "human-int", "human-int-or-auto", "float", "str", "json", "json-or-str")
# The types whose values are integers (INT_MINIMUMS bounds options of these types).
INT_TYPES = ("int", "human-int", "human-int-or-auto")

# Snapshot files inside the package, one folder per supported vLLM release
# (dsv4_presets/data/vllm/<major>.<minor>/).
SNAPSHOT_FILES = {"serve": "serve-options.yaml", "bench": "bench-serve-options.yaml"}


@dataclass(frozen=True)
class OptionSpec:
    """One vLLM command-line option, as its parser defines it."""

    name: str
    """Long option name without the leading ``--`` (e.g. ``kv-cache-dtype``)."""
    kind: str
    """One of :data:`KINDS`."""
    type: str = "str"
    """One of :data:`TYPES` (ignored for ``bool`` and ``flag``)."""
    choices: tuple[str, ...] = ()
    """Accepted values (as strings), empty when any value of ``type`` is accepted."""
    negated_by: str = ""
    """For a ``bool`` option whose false form is not ``--no-<name>``: the option
    (without ``--``) that sets it false.  vLLM 0.33 pairs ``--enable-x`` with
    ``--disable-x`` and accepts ``--no-`` only before the spelling it declared
    first, so ``disable-x: false`` is ``--enable-x`` there."""

    @property
    def false_flag(self) -> str:
        """The option (without ``--``) that sets this ``bool`` option false."""
        return self.negated_by or f"no-{self.name}"


@dataclass(frozen=True)
class OptionTable:
    """All options of one vLLM command (``serve`` or ``bench``)."""

    command: str
    vllm_version: str
    options: dict[str, OptionSpec] = field(default_factory=dict)
    env_vars: tuple[str, ...] = ()
    """Environment variables vLLM reads (``vllm.envs``); empty for ``bench``."""

    def get(self, name: str) -> OptionSpec | None:
        """The option called ``name`` (underscores accepted like vLLM does)."""
        return self.options.get(name.replace("_", "-"))

    def suggest(self, name: str) -> str | None:
        """The closest known option name, for "did you mean" messages."""
        found = difflib.get_close_matches(name.replace("_", "-"), self.options, n=1, cutoff=0.75)
        return found[0] if found else None

    def to_data(self) -> dict[str, Any]:
        """A YAML-ready mapping (the snapshot file format)."""
        options: dict[str, Any] = {}
        for name in sorted(self.options):
            spec = self.options[name]
            entry: dict[str, Any] = {"kind": spec.kind}
            if spec.kind not in ("bool", "flag"):
                entry["type"] = spec.type
            if spec.choices:
                entry["choices"] = list(spec.choices)
            if spec.negated_by:
                entry["negated_by"] = spec.negated_by
            options[name] = entry
        data: dict[str, Any] = {
            "command": self.command,
            "vllm_version": self.vllm_version,
            "options": options,
        }
        if self.env_vars:
            data["env_vars"] = list(self.env_vars)
        return data

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> OptionTable:
        """Inverse of :meth:`to_data`."""
        options = {
            name: OptionSpec(
                name=name,
                kind=str(entry["kind"]),
                type=str(entry.get("type", "str")),
                choices=tuple(str(c) for c in entry.get("choices", ())),
                negated_by=str(entry.get("negated_by", "")),
            )
            for name, entry in data["options"].items()
        }
        return cls(
            command=str(data["command"]),
            vllm_version=str(data["vllm_version"]),
            options=options,
            env_vars=tuple(str(v) for v in data.get("env_vars", ())),
        )


def shipped_table(command: str, release: str | tuple[int, int] | None = None) -> OptionTable:
    """The option table shipped with this package for ``command`` (``serve`` or ``bench``).

    One table per supported vLLM release (``data/vllm/<release>/``); ``release``
    is ``"0.33"``-style text or ``(0, 33)``, and ``None`` means the installed
    vLLM's release when it is a supported one, else the newest supported
    release (:func:`dsv4_presets.vllm_releases.default_facts`).
    """
    from dsv4_presets.vllm_releases import resolve

    if command not in SNAPSHOT_FILES:
        raise ValueError(f"command must be one of {sorted(SNAPSHOT_FILES)}, got {command!r}")
    return _table(command, resolve(release).table_dir)


@cache
def _table(command: str, table_dir: str) -> OptionTable:
    text = (
        resources.files("dsv4_presets")
        .joinpath("data", "vllm", table_dir, SNAPSHOT_FILES[command])
        .read_text(encoding="utf-8")
    )
    return OptionTable.from_data(yaml.safe_load(text))


def table_diff(old: OptionTable, new: OptionTable) -> dict[str, list[str]]:
    """What changed from ``old`` to ``new``: options added, respelled, removed and changed.

    ``spellings`` are added ``--disable-x`` / ``--enable-x`` names of a boolean
    option that ``old`` already had under the other prefix (vLLM 0.33's
    ``EnableDisableAction`` pairs them; the ``--no-`` forms stay accepted), so
    they are not new settings; ``added`` is everything else that is new.
    ``changed`` lists options present in both whose kind, value type or
    choices differ, as ``"name: what changed"``.  A rename shows up as one
    removal plus one addition (argparse has no notion of it).
    """
    new_names = sorted(set(new.options) - set(old.options))
    inverse = {"enable-": "disable-", "disable-": "enable-"}
    spellings = []
    for name in new_names:
        for prefix, other in inverse.items():
            partner = other + name.removeprefix(prefix)
            if (
                name.startswith(prefix)
                and partner in old.options
                and partner in new.options
                and new.options[name].kind == "bool"
                and old.options[partner].kind == "bool"
            ):
                spellings.append(name)
    added = [name for name in new_names if name not in spellings]
    removed = sorted(set(old.options) - set(new.options))
    changed = []
    for name in sorted(set(old.options) & set(new.options)):
        a, b = old.options[name], new.options[name]
        parts = []
        if a.kind != b.kind:
            parts.append(f"kind {a.kind} -> {b.kind}")
        if a.kind not in ("bool", "flag") and a.type != b.type:
            parts.append(f"type {a.type} -> {b.type}")
        if a.choices != b.choices:
            gone = [c for c in a.choices if c not in b.choices]
            new_choices = [c for c in b.choices if c not in a.choices]
            if gone:
                parts.append("choices removed: " + ", ".join(gone))
            if new_choices:
                parts.append("choices added: " + ", ".join(new_choices))
            if not gone and not new_choices:
                parts.append("choices reordered")
        if parts:
            changed.append(f"{name}: " + "; ".join(parts))
    return {"added": added, "spellings": spellings, "removed": removed, "changed": changed}


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int_ok(text: str) -> bool:
    """Whether vLLM's parser (argparse's ``type=int``, i.e. Python's ``int()``) takes
    ``text``: signs, surrounding spaces and digit-group underscores (``1_024``) too."""
    try:
        int(text)
    except ValueError:
        return False
    return True


def _check_scalar(spec: OptionSpec, value: object) -> str | None:
    """``None`` when ``value`` is acceptable for one element of ``spec``, else what is wrong."""
    if isinstance(value, bool) and spec.type != "str":
        return f"expected {spec.type}, got the boolean {value!r}"
    if spec.type == "int":
        if isinstance(value, int) or (isinstance(value, str) and _int_ok(value)):
            pass
        else:
            return f"expected an integer, got {value!r}"
    elif spec.type == "human-int":
        if isinstance(value, int) or (isinstance(value, str) and _human_int_ok(value)):
            pass
        else:
            return f"expected an integer such as 16384 or 16k, got {value!r}"
    elif spec.type == "human-int-or-auto":
        if isinstance(value, int) or (isinstance(value, str) and _human_int_or_auto_ok(value)):
            pass
        else:
            return f"expected an integer such as 16384 or 16k, or auto (-1), got {value!r}"
    elif spec.type == "float":
        if _is_number(value) or (isinstance(value, str) and _float_ok(value)):
            pass
        else:
            return f"expected a number, got {value!r}"
    elif spec.type == "json":
        if isinstance(value, Mapping | list) or (isinstance(value, str) and _json_ok(value)):
            pass
        else:
            return f"expected a mapping (sent to vLLM as JSON), got {value!r}"
    elif spec.type == "json-or-str":
        if not isinstance(value, Mapping | str):
            return f"expected a mapping or a string, got {value!r}"
    else:  # str
        if isinstance(value, Mapping | list):
            return f"expected a single value, got {type(value).__name__} {value!r}"
        if isinstance(value, str) and value.startswith("--"):
            return f"{value!r} starts with '--': vLLM's parser reads it as an option, not a value"
        if isinstance(value, bool):
            return f"expected a string, got the boolean {value!r}"
    if spec.choices and _scalar_text(value) not in spec.choices:
        shown = ", ".join(spec.choices)
        return f"{_scalar_text(value)!r} is not one of: {shown}"
    return None


def human_int(value: object) -> int | None:
    """The integer an ``int`` or human-readable value stands for, as vLLM reads it.

    ``16k`` is 16,000 and ``16K`` 16,384 (``vllm.utils.argparse_utils.human_readable_int``);
    ``None`` when ``value`` is not such a number (``-1``/``auto`` included).
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        return None
    text = value.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if not match:
        return None
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 10 ** (3 * "kmgt".index(suffix) + 3))
    if "." in number:
        return None
    return int(number) * 2 ** (10 * "KMGT".index(suffix) + 10)


_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")


def _human_int_ok(text: str) -> bool:
    """Whether vLLM's ``human_readable_int`` takes ``text`` (the same rules, 0.32 and
    0.33): digits with an optional decimal part and a k/m/g/t suffix (decimals only
    with the lowercase, decimal suffixes), else what ``int()`` takes."""
    text = text.strip()
    match = _HUMAN_INT.fullmatch(text)
    if match:
        number, suffix = match.groups()
        return suffix.islower() or "." not in number
    return _int_ok(text)


def _human_int_or_auto_ok(text: str) -> bool:
    """Whether vLLM's ``human_readable_int_or_auto`` (``--max-model-len``, 0.32 and 0.33)
    takes ``text``: ``-1`` or ``auto`` in any case (surrounding spaces stripped), else
    what ``human_readable_int`` takes."""
    text = text.strip()
    return text == "-1" or text.lower() == "auto" or _human_int_ok(text)


def _float_ok(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _json_ok(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict | list)
    except ValueError:
        return False


def check_value(spec: OptionSpec, value: object) -> str | None:
    """``None`` when ``value`` (as written in YAML) is valid for ``spec``, else the problem."""
    if spec.kind == "bool":
        return None if isinstance(value, bool) else f"expected true or false, got {value!r}"
    if spec.kind == "flag":
        return None if isinstance(value, bool) else f"expected true or false, got {value!r}"
    if spec.kind in ("list", "append"):
        items = value if isinstance(value, list) else [value]
        for item in items:
            problem = _check_scalar(spec, item)
            if problem:
                return problem
        return None
    if spec.kind == "optional" and value is True:
        return None
    return _check_scalar(spec, value)


# Integer options whose smallest meaningful value vLLM's *parser* does not check
# (argparse reads them with int() or human_readable_int, so "-1" parses) but
# its config classes do, later, on the GPU machine: ParallelConfig,
# SchedulerConfig, CacheConfig, ModelConfig, ... declare them with pydantic
# ``Field(ge=N)`` / ``Field(gt=0)``, so ``tensor-parallel-size: -1`` passes
# the parser and only fails when the server starts.  The smallest value each
# accepts, per command.  Sizes, budgets and counts of things that must exist
# start at 1; 0 is allowed only where vLLM gives it a meaning (noted per
# option); ranks start at 0.  The vllm sessions check every entry against the
# installed release's config classes (tests/presets/test_presets_vllm.py).
INT_MINIMUMS: dict[str, dict[str, int]] = {
    "serve": {
        # Parallel group sizes: at least one of each (ParallelConfig: ge=1).
        "tensor-parallel-size": 1,
        "pipeline-parallel-size": 1,
        "data-parallel-size": 1,
        "prefill-context-parallel-size": 1,
        "decode-context-parallel-size": 1,
        "nnodes": 1,
        "elastic-ep-max-dp-size": 1,
        "dp-sync-interval": 1,
        "max-parallel-loading-workers": 1,
        # 0 local engines is vLLM's sentinel for data parallelism launched
        # externally, e.g. a node running only API servers (ParallelConfig: ge=0).
        "data-parallel-size-local": 0,
        # Ranks count from 0.
        "data-parallel-rank": 0,
        "data-parallel-start-rank": 0,
        "node-rank": 0,
        # 0 API servers is what --headless runs (vllm serve sets it so itself).
        "api-server-count": 0,
        # A port number is 1..65535 (ParallelConfig: ge=1).
        "data-parallel-rpc-port": 1,
        # Micro-batching: 0 is its default (off) (ParallelConfig: ge=0).
        "ubatch-size": 0,
        "dbo-decode-token-threshold": 0,
        "dbo-prefill-token-threshold": 0,
        # Scheduler budgets: at least one token / sequence per step
        # (SchedulerConfig: ge=1).
        "max-num-batched-tokens": 1,
        "max-num-scheduled-tokens": 1,
        "max-num-seqs": 1,
        "max-num-active-seqs": 1,
        "stream-interval": 1,
        "prefill-schedule-interval": 1,
        # 0 disables the long-prefill cap; queue limits of 0 are accepted
        # (SchedulerConfig: ge=0).
        "long-prefill-token-threshold": 0,
        "max-num-queued-reqs": 0,
        "max-num-queued-tokens": 0,
        # A context of at least one token; -1 (vLLM's "auto") is also accepted,
        # see INT_SPECIAL_VALUES (ModelConfig: ge=-1, where 0 means nothing).
        "max-model-len": 1,
        # -1 is "no limit" and 0 "no logprobs" (ModelConfig: ge=-1).
        "max-logprobs": -1,
        # KV cache pages hold at least one token (CacheConfig: gt=0).
        "block-size": 1,
        "mamba-block-size": 1,
        "prefix-match-unit": 1,
        "replayssm-buffer-len": 1,
        # 0 retains only semantic prefix-cache checkpoints (CacheConfig: ge=0).
        "prefix-cache-retention-interval": 0,
        # LoRA: at least one adapter slot (LoRAConfig: ge=1).
        "max-loras": 1,
        "max-lora-cls-labels": 1,
        # Offloading: group size 0 is "off", prefetch 0 "none" (OffloadConfig: ge=0).
        "offload-group-size": 0,
        "offload-num-in-group": 1,
        "offload-prefetch-step": 0,
        # Checkpoint prefetching: at least one thread and one byte (LoadConfig: ge=1).
        "safetensors-prefetch-num-threads": 1,
        "safetensors-prefetch-block-size": 1,
        # A size limit in MiB; 0 is accepted (MultiModalConfig: ge=0).
        "mm-shm-cache-max-object-size-mb": 0,
        # A grace period in seconds; 0 aborts in-flight requests at once (VllmConfig: ge=0).
        "shutdown-timeout": 0,
    },
    "bench": {
        # dsv4 bench checks that num-prompts requests completed.
        "num-prompts": 1,
        "num-warmups": 0,
        # A cap of 0 in-flight requests would send nothing.
        "max-concurrency": 1,
        # Every request asks for at least one output token (vLLM's
        # SamplingParams refuses max_tokens < 1).
        "random-output-len": 1,
    },
}

# Bounds a release added after the oldest supported one: option -> (the first release
# that declares it, its minimum).  Before that release the option is unbounded (``seed``:
# any integer) or absent (an unknown option, reported as such).
INT_MINIMUMS_SINCE: dict[str, dict[str, tuple[tuple[int, int], int]]] = {
    "serve": {
        # ModelConfig: ge=0 (and le=2**32 - 1) from 0.34; 0.32 and 0.33 take any integer.
        "seed": ((0, 34), 0),
        # New in 0.34 (SchedulerConfig): a window of 0 turns cache-aware admission off;
        # an in-flight KV-load cap is at least one load.
        "cache-aware-admission-window": ((0, 34), 0),
        "max-num-inflight-kv-loads": ((0, 34), 1),
    },
    "bench": {},
}


def int_minimums(command: str, release: tuple[int, int] | None = None) -> dict[str, int]:
    """The smallest value vLLM ``release`` accepts for each bounded integer option of
    ``command`` (None: only the bounds every supported release has)."""
    since = {
        name: minimum
        for name, (first, minimum) in INT_MINIMUMS_SINCE.get(command, {}).items()
        if release is not None and release >= first
    }
    return {**INT_MINIMUMS.get(command, {}), **since}


# Values below an option's minimum that vLLM reads as a setting of their own.
INT_SPECIAL_VALUES: dict[str, dict[str, dict[int, str]]] = {
    "serve": {
        "max-model-len": {-1: "auto, the longest context that fits in GPU memory"},
    },
    "bench": {},
}


def check_minimum(
    command: str, name: str, value: object, release: tuple[int, int] | None = None
) -> str | None:
    """``None`` unless integer option ``name`` of ``command`` is below what vLLM
    ``release`` accepts (None: what every supported release accepts).

    Only options in :data:`INT_MINIMUMS` (and, from their release on,
    :data:`INT_MINIMUMS_SINCE`) are checked, and only values that
    :func:`check_value` already took as integers (``16k`` included): the type
    error comes first.
    """
    minimum = int_minimums(command, release).get(name.replace("_", "-"))
    if minimum is None:
        return None
    special = INT_SPECIAL_VALUES.get(command, {}).get(name.replace("_", "-"), {})
    items = value if isinstance(value, list) else [value]
    for item in items:
        number = _as_integer(item)
        if number is None or number >= minimum or number in special:
            continue
        expected = f"an integer >= {minimum}"
        if special:
            expected += " or " + ", ".join(f"{k} ({why})" for k, why in special.items())
        return f"expected {expected}, got {item!r}"
    return None


def _as_integer(value: object) -> int | None:
    """The integer an ``int``, ``human-int`` or numeric-string value stands for."""
    number = human_int(value)
    if number is None and isinstance(value, str) and _int_ok(value):
        number = int(value)
    return number


def _scalar_text(value: object) -> str:
    """How a YAML scalar is written on the command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # as vLLM's --config reader writes it: 8.0 stays "8.0"
    if isinstance(value, Mapping | list):
        return json.dumps(value)
    return str(value)


def render_option(name: str, value: object, spec: OptionSpec | None) -> list[str]:
    """The argv words for one option set to ``value`` (empty when it renders to nothing).

    Without a ``spec`` (an option unknown to the table) the value's YAML type
    decides, as vLLM's own ``--config`` reader does.
    """
    flag = f"--{name}"
    kind = spec.kind if spec else None
    if isinstance(value, bool) and kind in (None, "bool", "flag", "optional"):
        if value:
            return [flag]
        if kind == "bool" and spec is not None:
            return [f"--{spec.false_flag}"]
        return [f"--no-{name}"] if kind is None else []
    if isinstance(value, list) and kind in (None, "list"):
        return [flag, *(_scalar_text(v) for v in value)] if value else []
    if isinstance(value, list) and kind == "append":
        words: list[str] = []
        for item in value:
            words += [flag, _scalar_text(item)]
        return words
    text = _scalar_text(value)
    if text.startswith("-") and not text.startswith("--"):
        # argparse would read "-K" as an option of its own, not as the value, and
        # vLLM's parser (0.32 and 0.33) fails outright on a separate "-0.5": one word.
        return [f"{flag}={text}"]
    return [flag, text]


def config_value(value: object) -> object:
    """The value as it should appear in a ``vllm serve --config`` YAML file.

    vLLM's reader writes non-bool scalars back with ``str()``, so ``inf`` and
    plain numbers round-trip; mappings are passed through as nested YAML.
    """
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value
