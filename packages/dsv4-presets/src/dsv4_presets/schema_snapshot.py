"""Building an :class:`~dsv4_presets.schema.OptionTable` from a live argparse parser.

Needs vLLM only to get the parser: ``python -m dsv4_presets.vllm_check --write``
runs :func:`snapshot_from_parser` over ``vllm serve``'s and ``vllm bench serve``'s
parsers of the installed release and writes the snapshot the package ships.
"""

from __future__ import annotations

import argparse
from typing import Any

from dsv4_presets.schema import OptionSpec, OptionTable

_PROBES = ("1", "1.5", "16k", '{"a": 1}', "{}", "abc", "auto")


def _probe(fn: Any, text: str) -> tuple[bool, Any]:
    try:
        return True, fn(text)
    except Exception:
        return False, None


def _classify_type(fn: Any) -> str:
    """Name the value type an argparse ``type=`` callable accepts, by probing it."""
    if fn is None or fn is str:
        return "str"
    results = {text: _probe(fn, text) for text in _PROBES}
    ok_json, val_json = results['{"a": 1}']
    if not ok_json or isinstance(val_json, str):
        # Config dataclasses reject unknown keys but accept an empty mapping.
        ok_json, val_json = results["{}"]
    ok_abc, _val_abc = results["abc"]
    ok_int, val_int = results["1"]
    ok_float, val_float = results["1.5"]
    ok_k, val_k = results["16k"]
    if ok_json and not isinstance(val_json, str) and not ok_abc:
        return "json"
    if ok_json and not isinstance(val_json, str) and ok_abc:
        return "json-or-str"
    if ok_int and isinstance(val_int, int) and not isinstance(val_int, bool):
        if ok_k and val_k == 16000:
            # vLLM's human_readable_int_or_auto (--max-model-len) also reads "auto" as -1
            ok_auto, val_auto = results["auto"]
            return "human-int-or-auto" if ok_auto and val_auto == -1 else "human-int"
        if not ok_float:
            return "int"
    if ok_float and isinstance(val_float, float) and not ok_abc:
        return "float"
    return "str"


def _kind(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return "bool"
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreConstAction):
        return "flag"
    if isinstance(action, argparse._AppendAction):
        return "append"
    if action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1):
        return "list"
    if action.nargs == "?":
        return "optional"
    return "value"


def _false_spelling(parser: argparse.ArgumentParser, action: argparse.Action, name: str) -> str:
    """The option that sets boolean ``--name`` false, when it is not ``--no-name`` ("" then)."""
    registered = parser._option_string_actions
    if registered.get(f"--no-{name}") is action:
        return ""
    for prefix, inverse in (("enable-", "disable-"), ("disable-", "enable-")):
        partner = inverse + name.removeprefix(prefix)
        if name.startswith(prefix) and registered.get(f"--{partner}") is action:
            return partner
    raise ValueError(
        f"option --{name}: vLLM's parser registers neither --no-{name} nor an "
        "--enable-/--disable- partner, so it cannot be set false from a preset"
    )


def snapshot_from_parser(
    parser: argparse.ArgumentParser,
    *,
    command: str,
    vllm_version: str,
    env_vars: tuple[str, ...] = (),
) -> OptionTable:
    """Read every long option of an argparse parser into an :class:`OptionTable`.

    Help, version and ``--config`` are left out: they are not preset settings.
    """
    options: dict[str, OptionSpec] = {}
    skip = {"help", "version", "config"}
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs:
            continue
        kind = _kind(action)
        names = [s[2:] for s in longs if not (kind == "bool" and s.startswith("--no-"))]
        choices: tuple[str, ...] = ()
        if action.choices is not None:
            choices = tuple(str(c) for c in action.choices if c is not None)
            if isinstance(action.choices, set | frozenset | dict):
                choices = tuple(sorted(choices))  # unordered in vLLM: keep the file stable
        type_name = "str" if kind in ("bool", "flag") else _classify_type(action.type)
        for name in names:
            if name in skip:
                continue
            negated_by = _false_spelling(parser, action, name) if kind == "bool" else ""
            options[name] = OptionSpec(
                name=name, kind=kind, type=type_name, choices=choices, negated_by=negated_by
            )
    return OptionTable(
        command=command, vllm_version=vllm_version, options=options, env_vars=env_vars
    )


# --------------------------------------------------------------------------- #
# Checking and rendering values against a table
# --------------------------------------------------------------------------- #
