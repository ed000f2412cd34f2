"""Launch presets as data: layered vLLM ``--config`` YAML files, resolved to commands.

A preset file is a mapping in vLLM's own ``--config`` format: every key is a
``vllm serve`` option name (``kv-cache-dtype: fp8``, ``enable-prefix-caching:
false``), plus ``model`` for the checkpoint.  One extra key, ``dsv4``, holds
what vLLM has no option for and is never passed to vLLM:

``dsv4.extends``
    a layer, shipped preset or file (or a list of them) applied first, in
    order; this file's own keys then override them.  Names are looked up as
    shipped layers (``checkpoint/v4-flash``), shipped presets
    (``h200-tp8-ep``), then paths relative to the including file.
``dsv4.description``
    one line for ``dsv4 presets``.
``dsv4.env``
    environment variables for the vLLM process.
``dsv4.purpose``
    ``benchmark`` or ``production`` (benchmark presets keep prefix caching off).
``dsv4.hardware`` / ``dsv4.checkpoint``
    facts the rules check against (vendor, GPU architecture, GPUs per node;
    attention heads, FP8 weight block, the drafter the checkpoint ships).
``dsv4.required``
    options the user must set (``--set data-parallel-address=10.0.0.1``),
    each with the text that explains it.
``dsv4.nodes``
    one entry per node kind of a multi-node preset, or per role of a
    single-node split (``name``, ``description``, ``args`` and ``env`` added
    on that node, ``setup`` shell lines to run first, ``serve: false`` when the
    node runs no vLLM).
``dsv4.same_host``
    ``true`` when all ``nodes`` entries share one machine (a prefill/decode split).
``dsv4.min_vllm``
    the oldest vLLM release the preset works with (``dsv4 validate`` checks it).

Later layers override earlier ones key by key; mappings (``speculative-config``,
``env``) merge key by key; a ``null`` value removes the key; a boolean's two
vLLM 0.33 spellings (``enable-x``, ``disable-x``) are one key
(:mod:`dsv4_presets.merge`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from dsv4_presets.configs import (
    ARG_ORDER,
    BENCH_ORDER,
    BenchConfig,
    NodeSpec,
    PresetError,
    ServeConfig,
    nodes_from_data,
)
from dsv4_presets.merge import apply_overrides, canonical_bool, merge_args, merge_options
from dsv4_presets.overrides import parse_set, parse_sets

__all__ = [
    "ARG_ORDER",
    "BENCH_ORDER",
    "BenchConfig",
    "NodeSpec",
    "PresetError",
    "PresetInfo",
    "ServeConfig",
    "bench_preset_names",
    "layer_names",
    "list_presets",
    "not_a_bench_preset",
    "parse_set",
    "preset_kind",
    "resolve_bench",
    "resolve_serve",
    "serve_preset_names",
]

META_KEY = "dsv4"
META_FIELDS = (
    "extends",
    "description",
    "env",
    "purpose",
    "hardware",
    "checkpoint",
    "required",
    "nodes",
    "same_host",
    "min_vllm",
)
PURPOSES = ("benchmark", "production")
KINDS = ("serve", "bench", "layers")
_LABELS = {"serve": "preset", "bench": "bench preset", "layers": "layer"}

# Options of `vllm bench serve` that `dsv4 bench` always sets itself.
BENCH_MANAGED = (
    "base-url",
    "host",
    "port",
    "model",
    "tokenizer",
    "save-result",
    "append-result",
    "result-dir",
    "result-filename",
)


# --------------------------------------------------------------------------- #
# Files: package data is read once per process
# --------------------------------------------------------------------------- #


@cache
def _shipped_texts() -> dict[str, dict[str, str]]:
    """Every shipped YAML file by kind (``serve``, ``bench``, ``layers``) and name."""
    root = resources.files("dsv4_presets").joinpath("data")
    out: dict[str, dict[str, str]] = {}
    for kind in KINDS:
        found: dict[str, str] = {}

        def walk(node: Any, prefix: str, found: dict[str, str] = found) -> None:
            for child in node.iterdir():
                if child.is_dir():
                    walk(child, f"{prefix}{child.name}/")
                elif child.name.endswith(".yaml"):
                    found[prefix + child.name[: -len(".yaml")]] = child.read_text(encoding="utf-8")

        walk(root.joinpath(kind), "")
        out[kind] = dict(sorted(found.items()))
    return out


def _shipped(kind: str) -> dict[str, str]:
    return _shipped_texts()[kind]


def serve_preset_names() -> list[str]:
    """Names of the shipped serve presets."""
    return list(_shipped("serve"))


def bench_preset_names() -> list[str]:
    """Names of the shipped bench presets."""
    return list(_shipped("bench"))


def layer_names() -> list[str]:
    """Names of the shipped layers (``base``, ``checkpoint/v4-flash``, ...)."""
    return list(_shipped("layers"))


@dataclass(frozen=True)
class _File:
    """One parsed preset or layer file."""

    source: str
    """Where it came from: ``layer checkpoint/v4-flash``, ``preset h200-tp8-ep`` or a path."""
    name: str
    """The shipped name, or the file's stem."""
    directory: Path | None
    """Folder of a user file (for relative ``extends``); ``None`` for shipped files."""
    args: dict[str, Any]
    meta: dict[str, Any]


def _parse(text: str, source: str, name: str, directory: Path | None) -> _File:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PresetError(f"{source}: not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PresetError(
            f"{source}: expected a mapping of vLLM option names to values "
            f"(vLLM's --config format), got {type(data).__name__}"
        )
    args: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise PresetError(f"{source}: option names must be strings, got {key!r}")
        if key == META_KEY:
            if not isinstance(value, dict):
                raise PresetError(f"{source}: '{META_KEY}' must be a mapping, got {value!r}")
            for mkey in value:
                if mkey not in META_FIELDS:
                    raise PresetError(
                        f"{source}: unknown key '{META_KEY}.{mkey}'; "
                        f"expected one of: {', '.join(META_FIELDS)}"
                    )
            meta = dict(value)
        else:
            option = key[2:] if key.startswith("--") else key
            option, value = canonical_bool(option.replace("_", "-"), value)
            args[option] = value
    return _File(source=source, name=name, directory=directory, args=args, meta=meta)


def _looks_like_path(name: str, kinds: Sequence[str]) -> bool:
    """A YAML file name, or a name with a folder where no shipped name has one (layers do)."""
    if name.endswith((".yaml", ".yml")):
        return True
    return (os.sep in name or "/" in name) and "layers" not in kinds


def _lookup(
    name: str, *, kinds: Sequence[str], relative_to: Path | None = None, what: str = "preset"
) -> _File:
    """The one lookup: a shipped file of ``kinds`` by name, else a YAML file by path.

    Paths are tried relative to ``relative_to`` (the including file's folder)
    first, then as given.
    """
    if not isinstance(name, str) or not name:
        raise PresetError(f"a {what} name must be a non-empty string, got {name!r}")
    for kind in kinds:
        text = _shipped(kind).get(name)
        if text is not None:
            return _parse(text, f"{_LABELS[kind]} {name}", name, None)
    candidates = [relative_to / name] if relative_to is not None else []
    candidates.append(Path(name))
    for path in candidates:
        if path.is_file():
            try:
                text = path.read_text(encoding="utf-8")
            except OSError as exc:
                raise PresetError(
                    f"cannot read preset file {str(path)!r}: {exc.strerror}"
                ) from None
            except UnicodeDecodeError as exc:
                raise PresetError(
                    f"cannot read preset file {str(path)!r}: it is not UTF-8 text (byte "
                    f"0x{exc.object[exc.start]:02x} at offset {exc.start}); preset files "
                    "must be YAML encoded as UTF-8"
                ) from None
            return _parse(text, str(path), path.stem, path.resolve().parent)
    for path in candidates:
        if path.is_dir():
            raise PresetError(
                f"{str(path)!r} is a directory, not a {what} name or a {what} file: "
                f"give a shipped {what} name or the path of a YAML file "
                f"(such as {str(path / 'my-preset.yaml')!r})"
            )
    other = _other_kind(name, kinds)
    if other is not None:
        raise PresetError(other)
    if _looks_like_path(name, kinds):
        tried = " or ".join(repr(str(p)) for p in candidates)
        raise PresetError(f"unknown {what} {name!r}: no such file ({tried} does not exist)")
    listing = "`dsv4 presets -v`" if "layers" in kinds else "`dsv4 presets`"
    raise PresetError(
        f"unknown {what} {name!r}: no shipped {what} or file of that name; {listing} lists them"
    )


def not_a_bench_preset(name: str, *, file: bool = False) -> str:
    """What ``dsv4 bench`` says when given the serve preset (or serve preset file) ``name``."""
    what = "a serve preset"
    if file:
        what += " file (it extends no bench preset and sets neither num-prompts nor dataset-name)"
    return (
        f"{name!r} is {what}, not a bench preset: dsv4 bench runs a bench preset "
        f"({', '.join(bench_preset_names())}; `dsv4 presets` lists both kinds) against a "
        f"server already running (--base-url); start one with `dsv4 serve {name}`"
    )


def _other_kind(name: str, kinds: Sequence[str]) -> str | None:
    """Why ``name`` cannot be used here when it is a shipped file of another kind."""
    for kind in KINDS:
        if kind in kinds or name not in _shipped(kind):
            continue
        labels = {**_LABELS, "serve": "serve preset"}
        wanted = " or ".join(labels[k] for k in kinds)
        if kind == "layers":
            return (
                f"{name!r} is a layer, not a {wanted}: layers are applied by a preset "
                f"file's '{META_KEY}.extends' (`dsv4 presets -v` lists each preset's layers)"
            )
        if kinds == ("bench",):
            return not_a_bench_preset(name)
        return f"{name!r} is a {labels[kind]}, not a {wanted}: " + (
            "bench presets run with `dsv4 bench`"
            if kind == "bench"
            else "`dsv4 presets` lists each kind"
        )
    return None


# --------------------------------------------------------------------------- #
# Layering
# --------------------------------------------------------------------------- #


@dataclass
class _Resolved:
    sources: list[str] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    env: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def _as_list(value: Any, what: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return value
    raise PresetError(f"{what}: expected a name or a list of names, got {value!r}")


def _apply(file: _File, out: _Resolved, stack: tuple[str, ...], kinds: Sequence[str]) -> None:
    if file.source in stack:
        chain = " -> ".join((*stack, file.source))
        raise PresetError(f"'{META_KEY}.extends' forms a cycle: {chain}")
    for parent in _as_list(file.meta.get("extends"), f"{file.source}: {META_KEY}.extends"):
        parent_file = _lookup(
            parent, kinds=kinds, relative_to=file.directory, what="preset or layer"
        )
        _apply(parent_file, out, (*stack, file.source), kinds)
    out.sources.append(file.source)
    args = dict(file.args)
    if "model" in args:
        model = args.pop("model")
        if model is not None and not isinstance(model, str):
            raise PresetError(f"{file.source}: 'model' must be a string, got {model!r}")
        out.model = model
    merge_args(out.args, args)
    env = file.meta.get("env")
    if env is not None:
        if not isinstance(env, dict):
            raise PresetError(f"{file.source}: '{META_KEY}.env' must be a mapping, got {env!r}")
        merge_options(out.env, env)
    for key, value in file.meta.items():
        if key in ("extends", "env"):
            continue
        if key == "description" and stack:
            continue  # a description belongs to the file that was asked for
        if key == "required":
            if not isinstance(value, dict):
                raise PresetError(
                    f"{file.source}: '{META_KEY}.required' must map option names to "
                    f"explanations, got {value!r}"
                )
            out.meta["required"] = {**out.meta.get("required", {}), **value}
        else:
            out.meta[key] = value


# --------------------------------------------------------------------------- #
# Serve presets
# --------------------------------------------------------------------------- #


def resolve_serve(
    name_or_path: str,
    *,
    model: str | None = None,
    sets: Sequence[str] = (),
    node: str | None = None,
) -> ServeConfig:
    """Resolve a shipped serve preset or a user YAML file to a :class:`ServeConfig`.

    ``model`` replaces the preset's model (a hub id or a local folder);
    ``sets`` are ``key=value`` overrides applied last, on every node (see
    :func:`parse_set`); ``node`` picks the node of a multi-node preset
    (default: its first node).
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        raise PresetError(f"preset must be a name or a path, got {name_or_path!r}")
    file = _lookup(name_or_path, kinds=("serve",))
    name = file.name
    out = _Resolved()
    _apply(file, out, (), ("layers", "serve"))
    overrides = parse_sets(sets)
    for chosen in (overrides.model, model):
        if chosen is not None:
            if not isinstance(chosen, str) or not chosen:
                raise PresetError(f"model must be a non-empty string, got {chosen!r}")
            out.model = chosen
    if not out.model:
        raise PresetError(
            f"preset {name!r} names no model: add 'model: <hub id or path>' or pass --model"
        )
    meta = out.meta
    purpose = meta.get("purpose")
    if purpose is not None and purpose not in PURPOSES:
        raise PresetError(
            f"preset {name!r}: '{META_KEY}.purpose' must be one of {PURPOSES}, got {purpose!r}"
        )
    for key in ("hardware", "checkpoint"):
        if key in meta and not isinstance(meta[key], dict):
            raise PresetError(f"preset {name!r}: '{META_KEY}.{key}' must be a mapping")
    same_host = meta.get("same_host", False)
    if not isinstance(same_host, bool):
        raise PresetError(f"preset {name!r}: '{META_KEY}.same_host' must be true or false")
    min_vllm = meta.get("min_vllm")
    if min_vllm is not None and not isinstance(min_vllm, str):
        raise PresetError(
            f"preset {name!r}: '{META_KEY}.min_vllm' must be a quoted version such as "
            f'"0.32.0", got {min_vllm!r}'
        )
    nodes = nodes_from_data(meta.get("nodes"), f"preset {name}")
    config = ServeConfig(
        name=name,
        model=out.model,
        args={},
        env={},
        description=str(file.meta.get("description", "")),
        sources=tuple(out.sources),
        purpose=purpose,
        hardware=dict(meta.get("hardware") or {}),
        checkpoint=dict(meta.get("checkpoint") or {}),
        required={str(k): str(v) for k, v in (meta.get("required") or {}).items()},
        nodes=nodes,
        same_host=same_host,
        min_vllm=min_vllm,
        common_args=dict(out.args),
        common_env=dict(out.env),
        overrides=overrides.options,
        env_overrides=overrides.env,
    )
    if nodes:
        return config.for_node(node if node is not None else nodes[0].name)
    if node is not None:
        raise PresetError(f"preset {name!r} is single-node; --node {node!r} does not apply")
    return config.for_node(None)


# --------------------------------------------------------------------------- #
# Bench presets
# --------------------------------------------------------------------------- #


def resolve_bench(name_or_path: str, *, sets: Sequence[str] = ()) -> BenchConfig:
    """Resolve a shipped bench preset or a YAML file of ``vllm bench serve`` options."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise PresetError(f"preset must be a name or a path, got {name_or_path!r}")
    file = _lookup(name_or_path, kinds=("bench",))
    name = file.name
    out = _Resolved()
    _apply(file, out, (), ("bench",))
    for key in out.meta:
        if key != "description":
            raise PresetError(
                f"bench preset {name!r}: '{META_KEY}.{key}' applies to serve presets only"
            )
    if out.model is not None:
        raise PresetError(
            f"bench preset {name!r} sets 'model'; dsv4 bench takes the served model from "
            "the server (or --model): remove it"
        )
    overrides = parse_sets(sets)
    if out.env or overrides.env:
        raise PresetError(f"bench preset {name!r}: environment variables apply to serve presets")
    if overrides.model is not None:
        raise PresetError("--set model=... does not apply to bench presets: use --model")
    apply_overrides(out.args, overrides.options)
    for key in BENCH_MANAGED:
        if key in out.args:
            raise PresetError(
                f"bench preset {name!r} sets {key!r}, which dsv4 bench sets itself "
                "(--base-url, --model, --tokenizer, --result-dir, --result-filename): remove it"
            )
    if "num-prompts" not in out.args:
        raise PresetError(
            f"bench preset {name!r} must set num-prompts (dsv4 bench checks that many "
            "requests completed)"
        )
    num = out.args["num-prompts"]
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise PresetError(
            f"bench preset {name!r}: num-prompts must be a positive integer, got {num!r}"
        )
    return BenchConfig(
        name=name,
        args=out.args,
        description=str(file.meta.get("description", "")),
        sources=tuple(out.sources),
    )


# --------------------------------------------------------------------------- #
# Listing
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class PresetInfo:
    """One line of ``dsv4 presets``."""

    name: str
    kind: str
    """``serve`` or ``bench``."""
    description: str
    layers: tuple[str, ...]


def list_presets() -> list[PresetInfo]:
    """Every shipped preset, serve presets first."""
    out = []
    for kind in ("serve", "bench"):
        for name in _shipped(kind):
            file = _lookup(name, kinds=(kind,))
            extends = tuple(_as_list(file.meta.get("extends"), name))
            out.append(PresetInfo(name, kind, str(file.meta.get("description", "")), extends))
    return out


def preset_kind(name_or_path: str) -> str:
    """``serve`` or ``bench``: which kind of preset a name or file is.

    A user file is a bench preset when it extends one, or when it sets
    ``num-prompts`` or ``dataset-name`` (options only ``vllm bench serve`` has).
    """
    for kind in ("serve", "bench"):
        if name_or_path in _shipped(kind):
            return kind
    file = _lookup(name_or_path, kinds=("serve", "bench"))
    for parent in _as_list(file.meta.get("extends"), file.source):
        if parent in _shipped("bench"):
            return "bench"
        if parent in _shipped("serve") or parent in _shipped("layers"):
            return "serve"
    if "num-prompts" in file.args or "dataset-name" in file.args:
        return "bench"
    return "serve"
