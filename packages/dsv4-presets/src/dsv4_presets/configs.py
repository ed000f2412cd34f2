"""Resolved launches and how they render: :class:`ServeConfig`, :class:`BenchConfig`, nodes.

:mod:`dsv4_presets.presets` reads preset files and resolves them into these
objects; everything here works on the resolved values only.  The one merge
rule of the project (:mod:`dsv4_presets.merge`) is applied here again when a
multi-node preset switches node.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from dsv4_presets.merge import (
    Override,
    _bool_spec,
    apply_overrides,
    bool_spellings,
    canonical_bool,
    merge_args,
    merge_options,
)
from dsv4_presets.schema import config_value, render_option, shipped_table

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

NODE_FIELDS = ("name", "description", "args", "env", "setup", "serve")

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
# Serve
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class NodeSpec:
    """One kind of node (or, with ``same_host``, one role on the node) of a preset."""

    name: str
    description: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    """Options added (or overridden) on this node."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables added on this node (``CUDA_VISIBLE_DEVICES`` of a role)."""
    setup: tuple[str, ...] = ()
    """Shell lines to run on this node before vLLM (``{option-name}`` is filled in)."""
    serve: bool = True
    """False for nodes that run no vLLM process themselves (Ray workers, a router)."""


def nodes_from_data(value: Any, source: str) -> tuple[NodeSpec, ...]:
    """Parse a preset's ``dsv4.nodes`` list (``source`` names the preset in errors)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not value:
        raise PresetError(f"{source}: 'dsv4.nodes' must be a non-empty list, got {value!r}")
    specs = []
    for i, entry in enumerate(value):
        where = f"{source}: dsv4.nodes[{i}]"
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
        env = entry.get("env") or {}
        if not isinstance(env, dict):
            raise PresetError(f"{where}.env: expected a mapping of variables, got {env!r}")
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
                args=dict(canonical_bool(k.replace("_", "-"), v) for k, v in args.items()),
                env=dict(env),
                setup=tuple(setup),
                serve=serve,
            )
        )
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise PresetError(f"{source}: node names must be unique, got {names}")
    return tuple(specs)


def env_text(value: Any) -> str:
    """An environment value as a string (booleans become 1/0)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _order(keys: Iterable[str], order: Sequence[str]) -> list[str]:
    keys = list(keys)
    # a boolean's other spelling (0.33's disable-x for enable-x) takes its place
    rank = {alias: i for i, name in enumerate(order) for alias in bool_spellings(name)}
    known = sorted((k for k in keys if k in rank), key=rank.__getitem__)
    return known + [k for k in keys if k not in rank]


def _config_bool(key: str, value: Any) -> tuple[str, Any]:
    """Write ``key: false`` of a ``--x/--no-x`` option as ``no-key: true``.

    vLLM's ``--config`` reader turns ``key: false`` into ``--no-key`` only when
    the *top-level* parser knows ``--no-key``; under ``vllm serve`` it does not
    (the option belongs to the ``serve`` subparser), so ``false`` is silently
    dropped and vLLM's default (often ``true``) applies.  ``no-key: true`` is
    read as the flag ``--no-key`` and always works.  Where the release's
    table names another false form (vLLM 0.33: ``disable-x: false`` is
    ``--enable-x``), that one is written instead.
    """
    spec = _bool_spec(key) if value is False else None
    if spec is not None:
        return spec.false_flag, True
    return key, value


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
    same_host: bool = False
    """True when every node entry runs on one machine (roles of a single-node split)."""
    min_vllm: str | None = None
    """The oldest vLLM release the preset is known to work with."""
    common_args: dict[str, Any] = field(default_factory=dict, repr=False)
    common_env: dict[str, str] = field(default_factory=dict, repr=False)
    overrides: tuple[Override, ...] = field(default=(), repr=False)
    env_overrides: tuple[tuple[str, str | None], ...] = field(default=(), repr=False)

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

    def for_node(self, node: str | None) -> ServeConfig:
        """The same preset for another node (``None``: the preset without nodes)."""
        spec = None
        if node is not None:
            if not self.nodes:
                raise PresetError(f"preset {self.name!r} is single-node; it has no node {node!r}")
            spec = next((s for s in self.nodes if s.name == node), None)
            if spec is None:
                raise PresetError(
                    f"preset {self.name!r} has no node {node!r}; its nodes are: "
                    f"{', '.join(self.node_names)}"
                )
        args = dict(self.common_args)
        env: dict[str, Any] = dict(self.common_env)
        if spec is not None:
            merge_args(args, spec.args)
            merge_options(env, spec.env)
        apply_overrides(args, self.overrides)
        merge_options(env, dict(self.env_overrides))
        return dataclasses.replace(
            self, node=node, args=args, env={k: env_text(v) for k, v in env.items()}
        )

    def all_nodes(self) -> list[ServeConfig]:
        """This preset once per node (itself alone for single-node presets)."""
        return [self.for_node(n) for n in self.node_names] if self.nodes else [self]

    def ordered_args(self) -> list[tuple[str, Any]]:
        """``args`` in rendering order."""
        return [(key, self.args[key]) for key in _order(self.args, ARG_ORDER)]

    def to_argv(self) -> list[str]:
        """Everything after ``vllm serve``: the model, then the options."""
        table = shipped_table("serve")
        argv = [self.model]
        for key, value in self._flag_args():
            argv += render_option(key, value, table.get(key))
        return argv

    def _flag_args(self) -> list[tuple[str, Any]]:
        """:meth:`ordered_args` with each boolean's false form written as the flag vLLM
        reads (``_config_bool``): two spellings of one flag (``enable-x: true`` and,
        on vLLM 0.33, ``disable-x: false``) give it once, at the first one's place with
        the later value, as in :meth:`to_config`."""
        merged: dict[str, Any] = {}
        for key, value in self.ordered_args():
            flag, flag_value = _config_bool(key, value)
            merged[flag] = value if flag == key else flag_value
        return list(merged.items())

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
        return {key: env_text(value) for key, value in self.env.items()}

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


# --------------------------------------------------------------------------- #
# Bench
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

    def _optional_int(self, key: str) -> int | None:
        value = self.args.get(key)
        return None if value is None else int(value)

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
        return self._optional_int("random-input-len")

    @property
    def output_len(self) -> int | None:
        """Output length of the random dataset, in tokens."""
        return self._optional_int("random-output-len")

    @property
    def seed(self) -> int | None:
        """The dataset's random seed."""
        return self._optional_int("seed")

    @property
    def request_rate(self) -> float:
        """Requests per second (``inf`` sends them all at once)."""
        return float(self.args.get("request-rate", "inf"))

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
