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
    facts the rules check against (GPU architecture, GPUs per node; attention
    heads, FP8 weight block, speculative methods the weights support).
``dsv4.required``
    options the user must set (``--set data-parallel-address=10.0.0.1``),
    each with the text that explains it.
``dsv4.nodes``
    for multi-node presets: one entry per node kind (``name``, ``description``,
    ``args`` added on that node, ``setup`` shell lines to run first, ``serve:
    false`` when the node runs no vLLM).

Later layers override earlier ones key by key; mappings (``speculative-config``,
``env``) merge key by key; a ``null`` value removes the key.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from dsv4_presets.schema import config_value, render_option, shipped_table

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
)
PURPOSES = ("benchmark", "production")
NODE_FIELDS = ("name", "description", "args", "setup", "serve")

# Rendering order: options are grouped by topic so that renderings of different
# presets line up; options not listed follow in the order the layers set them.
ARG_ORDER = (
    "trust-remote-code",
    "kv-cache-dtype",
    "block-size",
    "headless",
    "enable-expert-parallel",
    "tensor-parallel-size",
    "pipeline-parallel-size",
    "data-parallel-size",
    "data-parallel-size-local",
    "data-parallel-start-rank",
    "data-parallel-address",
    "data-parallel-rpc-port",
    "data-parallel-backend",
    "tokenizer-mode",
    "tool-call-parser",
    "enable-auto-tool-choice",
    "reasoning-parser",
    "enable-prefix-caching",
    "max-num-batched-tokens",
)

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
BENCH_ORDER = (
    "backend",
    "dataset-name",
    "random-input-len",
    "random-output-len",
    "num-prompts",
    "num-warmups",
    "request-rate",
    "ignore-eos",
    "temperature",
    "seed",
)


class PresetError(ValueError):
    """A preset cannot be loaded or resolved (bad file, unknown name, bad ``--set``)."""


# --------------------------------------------------------------------------- #
# Files
# --------------------------------------------------------------------------- #


def _data_dir() -> Any:
    return resources.files("dsv4_presets").joinpath("data")


def _shipped(kind: str) -> dict[str, Any]:
    """Shipped preset files of ``kind`` (``serve``, ``bench`` or ``layers``), by name."""
    root = _data_dir().joinpath(kind)
    found: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for child in node.iterdir():
            if child.is_dir():
                walk(child, f"{prefix}{child.name}/")
            elif child.name.endswith(".yaml"):
                found[prefix + child.name[: -len(".yaml")]] = child

    walk(root, "")
    return dict(sorted(found.items()))


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
    directory: Path | None
    """Folder of a user file (for relative ``extends``); ``None`` for shipped files."""
    args: dict[str, Any]
    meta: dict[str, Any]


def _parse(text: str, source: str, directory: Path | None) -> _File:
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
            name = key[2:] if key.startswith("--") else key
            name, value = _canonical_bool(name.replace("_", "-"), value)
            args[name] = value
    return _File(source=source, directory=directory, args=args, meta=meta)


def _is_bool_option(name: str) -> bool:
    return any(
        (spec := shipped_table(command).get(name)) is not None and spec.kind == "bool"
        for command in ("serve", "bench")
    )


def _canonical_bool(name: str, value: Any) -> tuple[str, Any]:
    """``no-enable-prefix-caching: true`` is read as ``enable-prefix-caching: false``."""
    if name.startswith("no-") and isinstance(value, bool) and _is_bool_option(name[3:]):
        return name[3:], not value
    return name, value


def _read_shipped(kind: str, name: str) -> _File:
    entry = _shipped(kind)[name]
    label = {"serve": "preset", "bench": "bench preset", "layers": "layer"}[kind]
    return _parse(entry.read_text(encoding="utf-8"), f"{label} {name}", None)


def _read_path(path: Path) -> _File:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PresetError(f"cannot read preset file {str(path)!r}: {exc.strerror}") from None
    return _parse(text, str(path), path.resolve().parent)


def _looks_like_path(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) or (os.sep in name and Path(name).exists())


def _find(name: str, *, relative_to: Path | None, kinds: Sequence[str]) -> _File:
    """Look ``name`` up as a shipped layer/preset of ``kinds``, then as a file."""
    if not isinstance(name, str) or not name:
        raise PresetError(f"a preset or layer name must be a non-empty string, got {name!r}")
    for kind in kinds:
        if name in _shipped(kind):
            return _read_shipped(kind, name)
    candidates = []
    if relative_to is not None:
        candidates.append(relative_to / name)
    candidates.append(Path(name))
    for path in candidates:
        if path.is_file():
            return _read_path(path)
    shipped = ", ".join(n for kind in kinds for n in _shipped(kind))
    raise PresetError(
        f"unknown preset or layer {name!r}: not a shipped one ({shipped}) and no file "
        f"{' or '.join(repr(str(p)) for p in candidates)}"
    )


# --------------------------------------------------------------------------- #
# Merging
# --------------------------------------------------------------------------- #


def _merge_into(target: dict[str, Any], update: Mapping[str, Any]) -> None:
    """Apply ``update`` over ``target``: mappings merge, ``None`` deletes, others replace."""
    for key, value in update.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            merged = dict(target[key])
            _merge_into(merged, value)
            target[key] = merged
        elif isinstance(value, Mapping):
            fresh: dict[str, Any] = {}
            _merge_into(fresh, value)
            target[key] = fresh
        else:
            target[key] = value


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
        _apply(
            _find(parent, relative_to=file.directory, kinds=kinds),
            out,
            (*stack, file.source),
            kinds,
        )
    out.sources.append(file.source)
    args = dict(file.args)
    if "model" in args:
        model = args.pop("model")
        if model is not None and not isinstance(model, str):
            raise PresetError(f"{file.source}: 'model' must be a string, got {model!r}")
        out.model = model
    _merge_into(out.args, args)
    env = file.meta.get("env")
    if env is not None:
        if not isinstance(env, dict):
            raise PresetError(f"{file.source}: '{META_KEY}.env' must be a mapping, got {env!r}")
        _merge_into(out.env, env)
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
            out.meta.setdefault("required", {})
            out.meta["required"] = {**out.meta["required"], **value}
        else:
            out.meta[key] = value


# --------------------------------------------------------------------------- #
# --set overrides
# --------------------------------------------------------------------------- #


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


def _apply_sets(out: _Resolved, sets: Sequence[str]) -> None:
    if isinstance(sets, str):
        raise PresetError(
            f"sets must be a sequence of 'key=value' strings, got the string {sets!r}"
        )
    for item in sets:
        parts, value = parse_set(item)
        if parts[0] == "env":
            if len(parts) != 2:
                raise PresetError(f"--set {item!r}: use env.NAME=value")
            if value is None:
                out.env.pop(parts[1], None)
            else:
                out.env[parts[1]] = value
            continue
        if parts == ["model"]:
            if not isinstance(value, str) or not value:
                raise PresetError(f"--set model=...: expected a model name or path, got {value!r}")
            out.model = value
            continue
        nested: Any = value
        for part in reversed(parts[1:]):
            nested = {part: nested}
        _merge_into(out.args, {parts[0]: nested})


# --------------------------------------------------------------------------- #
# Serve presets
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class NodeSpec:
    """One kind of node in a multi-node preset."""

    name: str
    description: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    """Options added (or overridden) on this node."""
    setup: tuple[str, ...] = ()
    """Shell lines to run on this node before vLLM (``{option-name}`` is filled in)."""
    serve: bool = True
    """False for nodes that run no vLLM process themselves (Ray workers)."""


def _env_text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _order(keys: Iterable[str], order: Sequence[str]) -> list[str]:
    keys = list(keys)
    rank = {name: i for i, name in enumerate(order)}
    known = sorted((k for k in keys if k in rank), key=rank.__getitem__)
    return known + [k for k in keys if k not in rank]


@dataclass(frozen=True)
class ServeConfig:
    """A resolved ``vllm serve`` launch: model, options and environment.

    ``args`` maps vLLM option names (dashed, no leading ``--``) to YAML values,
    for the selected ``node`` of a multi-node preset (the first node unless
    another was asked for).
    """

    name: str
    model: str
    args: dict[str, Any]
    env: dict[str, str]
    description: str = ""
    sources: tuple[str, ...] = ()
    """The files applied, first to last."""
    purpose: str | None = None
    hardware: dict[str, Any] = field(default_factory=dict)
    checkpoint: dict[str, Any] = field(default_factory=dict)
    required: dict[str, str] = field(default_factory=dict)
    nodes: tuple[NodeSpec, ...] = ()
    node: str | None = None
    common_args: dict[str, Any] = field(default_factory=dict, repr=False)
    set_args: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def node_names(self) -> list[str]:
        """Names of the nodes of a multi-node preset (empty for single-node presets)."""
        return [n.name for n in self.nodes]

    @property
    def node_spec(self) -> NodeSpec | None:
        """The selected node, or ``None`` for single-node presets."""
        for spec in self.nodes:
            if spec.name == self.node:
                return spec
        return None

    def for_node(self, node: str) -> ServeConfig:
        """The same preset for another node of a multi-node preset."""
        if not self.nodes:
            raise PresetError(f"preset {self.name!r} is single-node; it has no node {node!r}")
        for spec in self.nodes:
            if spec.name == node:
                args = dict(self.common_args)
                _merge_into(args, spec.args)
                _merge_into(args, self.set_args)
                return dataclasses.replace(self, node=node, args=args)
        raise PresetError(
            f"preset {self.name!r} has no node {node!r}; its nodes are: "
            f"{', '.join(self.node_names)}"
        )

    def ordered_args(self) -> list[tuple[str, Any]]:
        """``args`` in rendering order."""
        return [(key, self.args[key]) for key in _order(self.args, ARG_ORDER)]

    def to_argv(self) -> list[str]:
        """Everything after ``vllm serve``: the model, then the options."""
        table = shipped_table("serve")
        argv = [self.model]
        for key, value in self.ordered_args():
            argv += render_option(key, value, table.get(key))
        return argv

    def to_config(self) -> dict[str, Any]:
        """A mapping for ``vllm serve --config`` (the model included as ``model``)."""
        data: dict[str, Any] = {"model": self.model}
        for key, value in self.ordered_args():
            key, value = _config_bool(key, value)
            data[key] = config_value(value)
        return data

    def to_config_yaml(self) -> str:
        """:meth:`to_config` as YAML text, with a header naming the preset."""
        where = f" (node {self.node})" if self.node else ""
        header = (
            f"# dsv4 preset {self.name}{where}: vllm serve --config this-file.yaml\n"
            "# Generated by `dsv4 render --format config`; keys are vLLM option names.\n"
        )
        return header + yaml.safe_dump(self.to_config(), sort_keys=False, width=100)

    def env_strings(self) -> dict[str, str]:
        """The environment variables as strings (booleans become 1/0)."""
        return {key: _env_text(value) for key, value in self.env.items()}

    def to_env_file(self) -> str:
        """An environment file: the preset's variables plus DSV4_MODEL and DSV4_VLLM_ARGS.

        It is valid for ``set -a; . ./file; set +a`` and systemd's
        ``EnvironmentFile=``; run vLLM with
        ``eval "vllm serve \\"$DSV4_MODEL\\" $DSV4_VLLM_ARGS"``.
        """
        where = f" (node {self.node})" if self.node else ""
        lines = [
            f"# dsv4 preset {self.name}{where}",
            "# use: set -a; . ./this.env; set +a; "
            'eval "vllm serve \\"$DSV4_MODEL\\" $DSV4_VLLM_ARGS"',
        ]
        for key, value in self.env_strings().items():
            lines.append(f"{key}={shlex.quote(value)}")
        lines.append(f"DSV4_PRESET={shlex.quote(self.name)}")
        lines.append(f"DSV4_MODEL={shlex.quote(self.model)}")
        args = shlex.join(self.to_argv()[1:])
        lines.append(f"DSV4_VLLM_ARGS={shlex.quote(args)}")
        return "\n".join(lines) + "\n"

    def setup_lines(self) -> list[str]:
        """The selected node's setup shell lines with ``{option}`` filled in."""
        spec = self.node_spec
        if spec is None:
            return []
        values = {key: str(value) for key, value in self.args.items()}
        out = []
        for line in spec.setup:
            try:
                out.append(line.format(**values))
            except (KeyError, IndexError) as exc:
                raise PresetError(
                    f"preset {self.name!r}, node {spec.name!r}: setup line {line!r} names "
                    f"{exc}, which the preset does not set"
                ) from None
        return out


def _config_bool(key: str, value: Any) -> tuple[str, Any]:
    """Write ``key: false`` of a ``--x/--no-x`` option as ``no-key: true``.

    vLLM's ``--config`` reader turns ``key: false`` into ``--no-key`` only when
    the *top-level* parser knows ``--no-key``; under ``vllm serve`` it does not
    (the option belongs to the ``serve`` subparser), so ``false`` is silently
    dropped and vLLM's default (often ``true``) applies.  ``no-key: true`` is
    read as the flag ``--no-key`` and always works.
    """
    if value is False and _is_bool_option(key):
        return f"no-{key}", True
    return key, value


def _nodes(value: Any, source: str) -> tuple[NodeSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not value:
        raise PresetError(f"{source}: '{META_KEY}.nodes' must be a non-empty list, got {value!r}")
    specs = []
    for i, entry in enumerate(value):
        where = f"{source}: {META_KEY}.nodes[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise PresetError(f"{where}: expected a mapping with a 'name', got {entry!r}")
        for key in entry:
            if key not in NODE_FIELDS:
                raise PresetError(
                    f"{where}: unknown key {key!r}; expected one of {', '.join(NODE_FIELDS)}"
                )
        args = entry.get("args") or {}
        if not isinstance(args, dict):
            raise PresetError(f"{where}.args: expected a mapping of options, got {args!r}")
        setup = entry.get("setup") or []
        if not isinstance(setup, list) or not all(isinstance(s, str) for s in setup):
            raise PresetError(f"{where}.setup: expected a list of shell lines, got {setup!r}")
        serve = entry.get("serve", True)
        if not isinstance(serve, bool):
            raise PresetError(f"{where}.serve: expected true or false, got {serve!r}")
        specs.append(
            NodeSpec(
                name=entry["name"],
                description=str(entry.get("description", "")),
                args={k.replace("_", "-"): v for k, v in args.items()},
                setup=tuple(setup),
                serve=serve,
            )
        )
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise PresetError(f"{source}: node names must be unique, got {names}")
    return tuple(specs)


def _resolve_file(name_or_path: str, kinds: Sequence[str]) -> tuple[str, _File]:
    if not isinstance(name_or_path, str) or not name_or_path:
        raise PresetError(f"preset must be a name or a path, got {name_or_path!r}")
    for kind in kinds:
        if name_or_path in _shipped(kind):
            return name_or_path, _read_shipped(kind, name_or_path)
    path = Path(name_or_path)
    if path.is_file():
        return path.stem, _read_path(path)
    shipped = ", ".join(n for kind in kinds for n in _shipped(kind))
    hint = " (no such file)" if _looks_like_path(name_or_path) else ""
    raise PresetError(
        f"unknown preset {name_or_path!r}{hint}: give a shipped preset ({shipped}) "
        "or the path of a YAML file"
    )


def resolve_serve(
    name_or_path: str,
    *,
    model: str | None = None,
    sets: Sequence[str] = (),
    node: str | None = None,
) -> ServeConfig:
    """Resolve a shipped serve preset or a user YAML file to a :class:`ServeConfig`.

    ``model`` replaces the preset's model (a hub id or a local folder);
    ``sets`` are ``key=value`` overrides applied last (see :func:`parse_set`);
    ``node`` picks the node of a multi-node preset (default: its first node).
    """
    name, file = _resolve_file(name_or_path, ("serve",))
    out = _Resolved()
    _apply(file, out, (), ("layers", "serve"))
    common_args = dict(out.args)
    set_state = _Resolved()
    _apply_sets(set_state, sets)
    if set_state.model is not None:
        out.model = set_state.model
    _merge_into(out.env, set_state.env)
    # Deletions requested by --set key=null must survive re-merging per node.
    set_args: dict[str, Any] = {}
    for item in sets:
        parts, value = parse_set(item)
        if parts[0] in ("env", "model"):
            continue
        nested: Any = value
        for part in reversed(parts[1:]):
            nested = {part: nested}
        _merge_into_keep_none(set_args, {parts[0]: nested})
    if model is not None:
        if not isinstance(model, str) or not model:
            raise PresetError(f"model must be a non-empty string, got {model!r}")
        out.model = model
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
    nodes = _nodes(meta.get("nodes"), f"preset {name}")
    config = ServeConfig(
        name=name,
        model=out.model,
        args={},
        env={key: _env_text(value) for key, value in out.env.items()},
        description=str(file.meta.get("description", "")),
        sources=tuple(out.sources),
        purpose=purpose,
        hardware=dict(meta.get("hardware") or {}),
        checkpoint=dict(meta.get("checkpoint") or {}),
        required={str(k): str(v) for k, v in (meta.get("required") or {}).items()},
        nodes=nodes,
        node=None,
        common_args=common_args,
        set_args=set_args,
    )
    if nodes:
        return config.for_node(node if node is not None else nodes[0].name)
    if node is not None:
        raise PresetError(f"preset {name!r} is single-node; --node {node!r} does not apply")
    args = dict(common_args)
    _merge_into(args, set_args)
    return dataclasses.replace(config, args=args)


def _merge_into_keep_none(target: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _merge_into_keep_none(target[key], value)
        else:
            target[key] = dict(value) if isinstance(value, Mapping) else value


# --------------------------------------------------------------------------- #
# Bench presets
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class BenchConfig:
    """A resolved ``vllm bench serve`` run (everything but the server and result file)."""

    name: str
    args: dict[str, Any]
    description: str = ""
    sources: tuple[str, ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        """The value of the ``vllm bench serve`` option ``key`` (dashed name)."""
        return self.args.get(key.replace("_", "-"), default)

    @property
    def num_prompts(self) -> int:
        """How many requests are measured (warm-ups not counted)."""
        return int(self.args["num-prompts"])

    @property
    def num_warmups(self) -> int:
        """Warm-up requests sent before measuring."""
        return int(self.args.get("num-warmups", 0))

    @property
    def dataset_name(self) -> str | None:
        """The dataset (``random`` for the seed's benchmark)."""
        value = self.args.get("dataset-name")
        return None if value is None else str(value)

    @property
    def input_len(self) -> int | None:
        """Prompt length of the random dataset, in tokens."""
        value = self.args.get("random-input-len")
        return None if value is None else int(value)

    @property
    def output_len(self) -> int | None:
        """Output length of the random dataset, in tokens."""
        value = self.args.get("random-output-len")
        return None if value is None else int(value)

    @property
    def seed(self) -> int | None:
        """The dataset's random seed."""
        value = self.args.get("seed")
        return None if value is None else int(value)

    @property
    def request_rate(self) -> float:
        """Requests per second (``inf`` sends them all at once)."""
        value = self.args.get("request-rate", "inf")
        return float(value)

    def ordered_args(self) -> list[tuple[str, Any]]:
        """``args`` in rendering order."""
        return [(key, self.args[key]) for key in _order(self.args, BENCH_ORDER)]

    def to_argv(
        self,
        *,
        base_url: str,
        model: str,
        result_dir: str,
        result_filename: str,
        tokenizer: str | None = None,
    ) -> list[str]:
        """Everything after ``vllm bench serve``; the result is always saved to a named file."""
        for label, value in (
            ("base_url", base_url),
            ("model", model),
            ("result_dir", result_dir),
            ("result_filename", result_filename),
        ):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{label} must be a non-empty string, got {value!r}")
        if os.sep in result_filename or "/" in result_filename:
            raise ValueError(
                f"result_filename must be a bare file name (put folders in result_dir), "
                f"got {result_filename!r}"
            )
        table = shipped_table("bench")
        argv: list[str] = []
        items = self.ordered_args()
        # --backend first, like the seed's command, then where and what to measure.
        for key, value in items:
            if key == "backend":
                argv += render_option(key, value, table.get(key))
        argv += ["--base-url", base_url, "--model", model]
        if tokenizer is not None:
            argv += ["--tokenizer", tokenizer]
        for key, value in items:
            if key != "backend":
                argv += render_option(key, value, table.get(key))
        argv += ["--save-result", "--result-dir", result_dir, "--result-filename", result_filename]
        return argv

    def to_config(self) -> dict[str, Any]:
        """A mapping usable as ``vllm bench serve --config`` (without server and result file)."""
        data: dict[str, Any] = {}
        for key, value in self.ordered_args():
            key, value = _config_bool(key, value)
            data[key] = config_value(value)
        return data


def resolve_bench(name_or_path: str, *, sets: Sequence[str] = ()) -> BenchConfig:
    """Resolve a shipped bench preset or a YAML file of ``vllm bench serve`` options."""
    name, file = _resolve_file(name_or_path, ("bench",))
    out = _Resolved()
    _apply(file, out, (), ("bench",))
    for key in out.meta:
        if key not in ("description",):
            raise PresetError(
                f"bench preset {name!r}: '{META_KEY}.{key}' applies to serve presets only"
            )
    if out.model is not None:
        raise PresetError(
            f"bench preset {name!r} sets 'model'; dsv4 bench takes the served model from "
            "the server (or --model): remove it"
        )
    _apply_sets(out, sets)
    if out.env:
        raise PresetError(f"bench preset {name!r}: environment variables apply to serve presets")
    if out.model is not None:
        raise PresetError("--set model=... does not apply to bench presets: use --model")
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
    for name in serve_preset_names():
        file = _read_shipped("serve", name)
        extends = tuple(_as_list(file.meta.get("extends"), name))
        out.append(PresetInfo(name, "serve", str(file.meta.get("description", "")), extends))
    for name in bench_preset_names():
        file = _read_shipped("bench", name)
        extends = tuple(_as_list(file.meta.get("extends"), name))
        out.append(PresetInfo(name, "bench", str(file.meta.get("description", "")), extends))
    return out


def preset_kind(name_or_path: str) -> str:
    """``serve`` or ``bench``: which kind of preset a name or file is.

    A user file is a bench preset when it extends one, or when it sets
    ``num-prompts`` or ``dataset-name`` (options only ``vllm bench serve`` has).
    """
    if name_or_path in _shipped("serve"):
        return "serve"
    if name_or_path in _shipped("bench"):
        return "bench"
    _, file = _resolve_file(name_or_path, ("serve", "bench"))
    for parent in _as_list(file.meta.get("extends"), file.source):
        if parent in _shipped("bench"):
            return "bench"
        if parent in _shipped("serve") or parent in _shipped("layers"):
            return "serve"
    if "num-prompts" in file.args or "dataset-name" in file.args:
        return "bench"
    return "serve"
