"""The docs show what the code does: the guide's rendered command and its preset list."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from dsv4_presets import resolve_serve
from dsv4_presets.presets import list_presets

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


def test_guide_shows_the_exact_rendered_seed_command():
    guide = (DOCS / "serving-guide.md").read_text(encoding="utf-8")
    after = guide.split("prints exactly:", 1)[1]
    block = _blocks(after)[0]
    words = shlex.split(block.replace("\\\n", " "))
    assert words == ["vllm", "serve", *resolve_serve("h200-tp8-ep").to_argv()]


def test_guide_lists_every_shipped_preset():
    guide = (DOCS / "serving-guide.md").read_text(encoding="utf-8")
    head = guide.split("## 1.", 1)[0]
    table = {m.group(1) for m in re.finditer(r"^\| `([a-z0-9-]+)` \|", head, flags=re.M)}
    assert table == {info.name for info in list_presets()}


def test_reference_lists_every_rule():
    from dsv4_presets.rules import BENCH_RULES, SERVE_RULES

    reference = (DOCS / "presets.md").read_text(encoding="utf-8")
    for rule in (*SERVE_RULES, *BENCH_RULES):
        for name in rule.name.split(" / "):
            assert f"`{name}`" in reference, name
