"""What a run's ``server.log`` says about the server: vLLM's version and the dsv4-attention plugin.

Read from the log, never guessed from what is installed where the campaign
runs (a variant may run another vLLM build, or the plugin may be disabled or
refuse the version):

* vLLM 0.32's API server logs its version once at start-up
  (``vllm/entrypoints/serve/utils/api_utils.py``, ``log_version_and_model``):
  ``vLLM server version 0.32.0, serving model M`` without the logo, or, with
  the logo, a banner line ``... version 0.32.0`` (possibly in ANSI colours).
* The dsv4-attention plugin logs, through vLLM's logger, exactly one line per
  vLLM process, in one of two forms::

      dsv4-attention <ours>: active on vLLM <vllm> (<platform>); replaced: <names>
      dsv4-attention <ours>: inactive on vLLM <vllm>: <reason>

  No such line: ``absent``.  Either the plugin is not installed in the
  server's environment, or it never had to decide: it waits for vLLM's DSV4
  model package to be imported, which a server of another model never does
  (``DSV4_KERNELS_DISABLE=1`` is said at start-up, whatever the model).
  Several processes (API server, engine core, workers) each log one line; a
  run counts as ``active`` only when every line says so, and ``mixed`` when
  they disagree.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

__all__ = ["PLUGIN_LINE", "parse_server_log", "read_server_log"]

PLUGIN_LINE = re.compile(
    r"dsv4-attention (?P<ours>\S+): (?P<state>active|inactive) on vLLM (?P<vllm>[^\s:]+)"
    r"(?P<rest>.*)$"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_VERSION_PLAIN = re.compile(r"vLLM server version (?P<version>\S+?),? serving model")
_VERSION_LOGO = re.compile(r"█.*\bversion\s+(?P<version>\S+)")


def _plugin_entry(match: re.Match[str]) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "state": match["state"],
        "plugin_version": match["ours"],
        "vllm_version": match["vllm"],
    }
    rest = match["rest"].strip()
    if match["state"] == "active":
        platform = re.match(r"\((?P<platform>[^)]*)\)", rest)
        if platform:
            entry["platform"] = platform["platform"]
        replaced = rest.split("replaced:", 1)
        if len(replaced) == 2:
            entry["replaced"] = [n.strip() for n in replaced[1].split(",") if n.strip()]
    else:
        entry["reason"] = rest[1:].strip() if rest.startswith(":") else rest
    return entry


def parse_server_log(text: str) -> dict[str, Any]:
    """The server's vLLM version and the plugin's state from a server log's text.

    Returns ``{"vllm_version": str | None, "plugin": {"state": ..., "lines": [...]}}``
    where the plugin state is ``active``, ``inactive``, ``mixed`` or ``absent``;
    ``plugin.vllm_version`` is the version the plugin saw (None when absent).
    """
    vllm_version: str | None = None
    entries: list[dict[str, Any]] = []
    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        match = PLUGIN_LINE.search(line)
        if match:
            entries.append(_plugin_entry(match))
            continue
        if vllm_version is None:
            found = _VERSION_PLAIN.search(line) or _VERSION_LOGO.search(line)
            if found:
                vllm_version = found["version"]
    states = {e["state"] for e in entries}
    if not entries:
        state = "absent"
    elif len(states) == 1:
        state = states.pop()
    else:
        state = "mixed"
    plugin: dict[str, Any] = {"state": state, "lines": entries}
    if entries:
        plugin["vllm_version"] = entries[0]["vllm_version"]
        plugin["plugin_version"] = entries[0]["plugin_version"]
        reasons = [e["reason"] for e in entries if e.get("reason")]
        if reasons:
            plugin["reason"] = reasons[0]
        replaced = sorted({n for e in entries for n in e.get("replaced", [])})
        if replaced:
            plugin["replaced"] = replaced
    return {"vllm_version": vllm_version, "plugin": plugin}


def read_server_log(path: Path) -> dict[str, Any]:
    """:func:`parse_server_log` of the file at ``path`` (an empty log when it is missing)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        text = ""
    return parse_server_log(text)
