"""The one merge rule of the presets: layers, nodes and ``--set`` all apply through here.

Mappings merge, ``None`` deletes, other values replace; a vLLM boolean with two
names (0.33's ``enable-x`` / ``disable-x``) is one setting (:func:`merge_args`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

from dsv4_presets.schema import OptionSpec, shipped_table

Override = tuple[tuple[str, ...], Any]
"""One ``--set`` option override: the key path (``("speculative-config", "method")``) and value."""


def _bool_spec(name: str) -> OptionSpec | None:
    for command in ("serve", "bench"):
        spec = shipped_table(command).get(name)
        if spec is not None and spec.kind == "bool":
            return spec
    return None


@functools.cache
def bool_spellings(name: str) -> frozenset[str]:
    """Every option name that sets the same boolean as ``name``, ``name`` included.

    On vLLM 0.33 ``enable-x`` and ``disable-x`` are one setting (the table's
    ``negated_by`` links them); elsewhere, and for non-booleans, just ``name``.
    """
    spec = _bool_spec(name)
    if spec is None:
        return frozenset({name})
    names = {name}
    if spec.negated_by and _bool_spec(spec.negated_by) is not None:
        names.add(spec.negated_by)
    for prefix, inverse in (("enable-", "disable-"), ("disable-", "enable-")):
        partner = inverse + name.removeprefix(prefix)
        other = _bool_spec(partner) if name.startswith(prefix) else None
        if other is not None and other.negated_by == name:
            names.add(partner)
    return frozenset(names)


def _is_bool_option(name: str) -> bool:
    return _bool_spec(name) is not None


def canonical_bool(name: str, value: Any) -> tuple[str, Any]:
    """``no-enable-prefix-caching: true`` is read as ``enable-prefix-caching: false``."""
    if name.startswith("no-") and isinstance(value, bool) and _is_bool_option(name[3:]):
        return name[3:], not value
    return name, value


def merge_options(target: dict[str, Any], update: Mapping[str, Any]) -> None:
    """Apply ``update`` over ``target``: mappings merge, ``None`` deletes, others replace."""
    for key, value in update.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping):
            merged = dict(target[key]) if isinstance(target.get(key), dict) else {}
            merge_options(merged, value)
            target[key] = merged
        else:
            target[key] = value


def merge_args(target: dict[str, Any], update: Mapping[str, Any]) -> None:
    """:func:`merge_options` for vLLM options, where one boolean may have two names.

    vLLM 0.33 spells some booleans two ways (``enable-x`` and ``disable-x``, one
    setting).  A later layer that sets one spelling replaces an earlier layer's
    other spelling in its place, and ``None`` removes both, so a user's
    ``disable-prefix-caching: false`` over a preset's ``enable-prefix-caching:
    false`` leaves one setting (prefix caching on), not two contradicting flags.
    """
    for key, value in update.items():
        for other in bool_spellings(key) - {key}:
            if other in target and key not in target:
                if value is None:
                    target.pop(other)
                else:  # the other spelling's place, renamed: the rendering order holds
                    items = [(key if k == other else k, v) for k, v in target.items()]
                    target.clear()
                    target.update(items)
            else:
                target.pop(other, None)
        merge_options(target, {key: value})


def apply_overrides(target: dict[str, Any], overrides: Iterable[Override]) -> None:
    """Apply ``--set`` overrides in order (a ``None`` value removes the key)."""
    for parts, value in overrides:
        nested: Any = value
        for part in reversed(parts[1:]):
            nested = {part: nested}
        merge_args(target, {parts[0]: nested})
