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
    first_cells = re.findall(r"^\| ((?:`[a-z0-9-]+`(?:, )?)+) \|", head, flags=re.M)
    table = {name for cell in first_cells for name in re.findall(r"`([a-z0-9-]+)`", cell)}
    assert table == {info.name for info in list_presets()}


def test_reference_lists_every_rule():
    from dsv4_presets.rules import BENCH_RULES, SERVE_RULES

    reference = (DOCS / "presets.md").read_text(encoding="utf-8")
    for rule in (*SERVE_RULES, *BENCH_RULES):
        for name in rule.name.split(" / "):
            assert f"`{name}`" in reference, name


def test_reference_traces_every_layer_option_to_a_source():
    """Every option a shipped layer sets beyond the seed's command is in the sources table."""
    from dsv4_presets import resolve_serve
    from dsv4_presets.presets import serve_preset_names

    reference = (DOCS / "presets.md").read_text(encoding="utf-8")
    sources = reference.split("## Every flag and where it comes from", 1)[1]
    seed = resolve_serve("h200-tp8-ep").args
    for name in serve_preset_names():
        config = resolve_serve(name, sets=["data-parallel-address=10.0.0.1"])
        for target in config.all_nodes():
            for key in target.args:
                if key in seed or key.startswith("data-parallel") or key in ("headless",):
                    continue
                assert f"`{key}`" in sources, (name, key)
            for var in target.env:
                assert f"`{var}`" in sources, (name, var)


def test_guide_client_guidance_matches_vllms_chat_template_keys():
    guide = (DOCS / "serving-guide.md").read_text(encoding="utf-8")
    assert '"chat_template_kwargs": {"thinking": True, "reasoning_effort": "max"}' in guide
    for text in ("/health", "/v1/models", "VLLM_ENGINE_READY_TIMEOUT_S", "393,216"):
        assert text in guide


def test_readmes_say_how_to_get_pytorchs_cpu_build_and_the_disk_needed():
    root = Path(__file__).resolve().parents[2]
    cpu = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    for readme in (
        "README.md",
        "packages/dsv4-kernels/README.md",
        "packages/dsv4-attention/README.md",
    ):
        text = " ".join((root / readme).read_text().split())
        assert cpu in text, readme
    presets = " ".join((root / "packages/dsv4-presets/README.md").read_text().split())
    assert "needs no torch" in presets and "https://download.pytorch.org/whl/cpu" in presets
    readme = " ".join((root / "README.md").read_text().split())
    assert "Disk: about 19 GB free" in readme
    assert "docs/contributing.md" in readme and (root / "docs" / "contributing.md").is_file()


def _fresh_clone_section() -> str:
    readme = (DOCS.parent / "README.md").read_text(encoding="utf-8")
    start = readme.index("## Fresh clone: the two commands")
    return readme[start : readme.index("\n## ", start + 1)]


def test_the_fresh_clone_commands_run_in_a_virtual_environment_and_ci_runs_them():
    """PEP 668 systems refuse pip into their own Python: the section makes a venv first,
    and .ci/run runs exactly the section's venv line and test command."""
    blocks = [block.strip() for block in _blocks(_fresh_clone_section())]
    venv = "python3 -m venv .venv && . .venv/bin/activate"
    bench = "python3 -m pip install nox && python3 -m nox -s bench"
    test = "python3 -m pip install nox && python3 -m nox"
    assert blocks[:3] == [venv, bench, test]
    ci = (DOCS.parent / ".ci" / "run").read_text(encoding="utf-8")
    lines = [line for line in ci.splitlines() if line.strip() and not line.startswith("#")]
    assert lines[-2:] == [venv, test.replace("&& python3", "&& exec python3")]
    assert lines[0] == "set -euo pipefail"
    assert (DOCS.parent / ".ci" / "run").stat().st_mode & 0o111  # executable
    ignored = (DOCS.parent / ".gitignore").read_text(encoding="utf-8").split()
    assert ".venv/" in ignored  # the clone's venv never shows up as a change


def test_the_torch_the_nox_sessions_install_is_documented():
    """What nox installs for torch, how to get the CPU build, and every variable
    noxfile.py reads, in the README's fresh-clone section and the contributing guide."""
    noxfile = (DOCS.parent / "noxfile.py").read_text(encoding="utf-8")
    variables = re.findall(r"os\.environ\.get\(\"([A-Z0-9_]+)\"", noxfile)
    assert "DSV4_TORCH_SPEC" in variables
    default = re.search(r'os\.environ\.get\("DSV4_TORCH_SPEC", "([^"]+)"\)', noxfile)
    assert default is not None
    cpu_index = "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu"
    section = " ".join(_fresh_clone_section().split())
    guide = " ".join((DOCS / "contributing.md").read_text(encoding="utf-8").split())
    for text in (section, guide):
        assert f"`{default.group(1)}`" in text
        assert cpu_index in text and "DSV4_TORCH_SPEC" in text
    for name in variables:
        assert re.search(rf"\b{name}\b", guide), name


def test_contributing_guide_names_real_places_and_sessions():
    root = DOCS.parent
    text = (DOCS / "contributing.md").read_text()
    paths = re.findall(r"`((?:packages|tests|benchmarks|docs)/[^`<*\s]*)`", text)
    assert len(paths) >= 5
    for path in paths:
        assert (root / path).exists(), path
    noxfile = (root / "noxfile.py").read_text()
    for session in ("lint", "tests", "vllm", "bench"):
        assert f"def {session}(session" in noxfile, session
    for command in (
        "python3 -m nox -s \"tests(package='dsv4-kernels')\"",
        "python3 -m nox -s \"vllm(release='0.32')\"",
        "python3 -m nox -s \"vllm(release='0.33')\"",
        "python3 -m nox -s \"vllm(release='0.34')\"",
        "python3 -m pytest -m gpu",
    ):
        assert command in text, command
