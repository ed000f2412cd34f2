"""The supported-release table and the per-release option tables (no vLLM needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dsv4_presets import vllm_releases
from dsv4_presets.schema import (
    INT_MINIMUMS_SINCE,
    OptionSpec,
    OptionTable,
    render_option,
    shipped_table,
    table_diff,
)

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "serving-guide.md"


def test_release_of_reads_versions_and_names_the_argument_on_bad_input():
    assert vllm_releases.release_of("0.33.0") == (0, 33)
    assert vllm_releases.release_of("0.32") == (0, 32)
    assert vllm_releases.release_of("v0.33.1rc2+cu130") == (0, 33)
    with pytest.raises(ValueError, match=r"version must look like MAJOR\.MINOR.*'dev'"):
        vllm_releases.release_of("dev")


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "1.0"])
def test_unknown_releases_are_refused_naming_the_supported_ones(version):
    with pytest.raises(vllm_releases.UnsupportedVllmRelease) as info:
        vllm_releases.facts_for(version)
    assert f"vLLM {version} is not a release" in str(info.value)
    assert "(supported: 0.32, 0.33, 0.34)" in str(info.value)


def test_the_table_says_where_the_parser_moved():
    old, new = vllm_releases.facts_for("0.32.0"), vllm_releases.facts_for("0.33.0")
    assert old.where("make_arg_parser") == (
        "vllm.entrypoints.launchers.cli_args",
        "make_arg_parser",
    )
    assert new.where("make_arg_parser") == (
        "vllm.entrypoints.common.cli_args",
        "make_arg_parser",
    )
    assert new.where("bench_add_cli_args") == ("vllm.benchmarks.serve", "add_cli_args")
    moved = {n for n in old.symbols if old.symbols[n] != new.symbols[n]}
    assert moved == {"make_arg_parser", "validate_parsed_serve_args", "log_version_and_model"}
    with pytest.raises(KeyError, match=r"name 'nope' is not in the vLLM 0\.33 facts table"):
        new.where("nope")


def test_resolve_takes_text_tuples_and_facts_and_names_bad_input():
    facts = vllm_releases.RELEASES[(0, 32)]
    assert vllm_releases.resolve("0.32") is facts
    assert vllm_releases.resolve((0, 32)) is facts
    assert vllm_releases.resolve(facts) is facts
    with pytest.raises(TypeError, match="release must be"):
        vllm_releases.resolve(0.32)  # type: ignore[arg-type]


def test_default_release_without_vllm_is_the_newest(monkeypatch):
    monkeypatch.setattr(vllm_releases, "installed_version", lambda: None)
    assert vllm_releases.default_facts().name == "0.34"
    monkeypatch.setattr(vllm_releases, "installed_version", lambda: "0.32.0")
    assert vllm_releases.default_facts().name == "0.32"
    monkeypatch.setattr(vllm_releases, "installed_version", lambda: "0.33.0")
    assert vllm_releases.default_facts().name == "0.33"
    monkeypatch.setattr(vllm_releases, "installed_version", lambda: "0.99.0")
    assert vllm_releases.default_facts().name == "0.34"


@pytest.mark.parametrize("release", ["0.32", "0.33", "0.34"])
@pytest.mark.parametrize("command", ["serve", "bench"])
def test_each_release_ships_its_own_tables(release, command):
    table = shipped_table(command, release)
    assert table.command == command
    assert vllm_releases.release_of(table.vllm_version) == vllm_releases.release_of(release)
    assert len(table.options) > (200 if command == "serve" else 50)


def test_disable_spellings_render_their_own_false_form():
    # 0.33 pairs --enable-x/--disable-x and has no --no-disable-x for the pair.
    new = shipped_table("serve", "0.33")
    spec = new.options["disable-prefix-caching"]
    assert spec.negated_by == "enable-prefix-caching"
    assert render_option("disable-prefix-caching", False, spec) == ["--enable-prefix-caching"]
    assert render_option("enable-prefix-caching", False, new.options["enable-prefix-caching"]) == [
        "--no-enable-prefix-caching"
    ]
    assert "disable-prefix-caching" not in shipped_table("serve", "0.32").options


def test_table_diff_finds_added_respelled_removed_and_changed():
    def table(**options: OptionSpec) -> OptionTable:
        return OptionTable("serve", "0", options)

    old = table(
        **{
            "enable-x": OptionSpec("enable-x", "bool"),
            "gone": OptionSpec("gone", "value", "int"),
            "mode": OptionSpec("mode", "value", "str", ("a", "b")),
        }
    )
    new = table(
        **{
            "enable-x": OptionSpec("enable-x", "bool"),
            "disable-x": OptionSpec("disable-x", "bool", negated_by="enable-x"),
            "fresh": OptionSpec("fresh", "value", "int"),
            "mode": OptionSpec("mode", "value", "str", ("b", "c")),
        }
    )
    assert table_diff(old, new) == {
        "added": ["fresh"],
        "spellings": ["disable-x"],
        "removed": ["gone"],
        "changed": ["mode: choices removed: a; choices added: c"],
    }


def _guide_section(old: str, new: str) -> str:
    """The guide's part on what changed from release ``old`` to ``new``."""
    text = GUIDE.read_text(encoding="utf-8")
    start = text.index("## 12. vLLM 0.32, 0.33 and 0.34")
    start = text.index(f"### {old} -> {new}", start)
    end = min(
        i
        for i in (text.find("\n### ", start + 1), text.find("\n## ", start + 1), len(text))
        if i != -1
    )
    return text[start:end]


@pytest.mark.parametrize(("old", "new"), [("0.32", "0.33"), ("0.33", "0.34")])
def test_the_guide_lists_exactly_the_option_differences_between_the_releases(old, new):
    section = _guide_section(old, new)
    serve = table_diff(shipped_table("serve", old), shipped_table("serve", new))
    bench = table_diff(shipped_table("bench", old), shipped_table("bench", new))
    assert bench == {"added": [], "spellings": [], "removed": [], "changed": []}
    listed = set(re.findall(r"`--([a-z0-9-]+)`", section))
    for name in serve["added"] + serve["removed"]:
        assert f"`--{name}`" in section, name
    for entry in serve["changed"]:
        assert f"`--{entry.split(':')[0]}`" in section, entry
    # Every --disable-x / --enable-x respelling is listed, and nothing else is invented.
    expected = set(serve["added"] + serve["removed"] + serve["spellings"])
    expected |= {entry.split(":")[0] for entry in serve["changed"]}
    partners = {spec.negated_by for spec in shipped_table("serve", new).options.values()}
    assert expected <= listed
    # Options whose lower bound this release added (INT_MINIMUMS_SINCE) have their own list.
    bounded = {
        name
        for name, (first, _) in INT_MINIMUMS_SINCE["serve"].items()
        if first == vllm_releases.release_of(new)
    }
    assert bounded <= listed
    prose = {"enable-x", "disable-x", "no-", "no-disable-prefix-caching"}  # the explanation
    assert listed - expected <= partners | prose | bounded, (
        listed - expected - partners - prose - bounded
    )


def test_the_snapshot_tells_an_int_or_auto_option_from_a_plain_human_int():
    """A parser whose type also reads ``auto`` as -1 (vLLM's ``--max-model-len``) is
    snapshotted as ``human-int-or-auto``, so ``max-model-len: auto`` is checked as vLLM
    reads it; a plain human-readable integer stays ``human-int``."""
    import argparse

    from dsv4_presets.schema import check_value
    from dsv4_presets.schema_snapshot import snapshot_from_parser

    def human(text: str) -> int:
        text = text.strip()
        if text.endswith("k"):
            return int(float(text[:-1]) * 1000)
        return int(text)

    def human_or_auto(text: str) -> int:
        return -1 if text.strip().lower() == "auto" else human(text)

    parser = argparse.ArgumentParser()
    parser.add_argument("--max-model-len", type=human_or_auto)
    parser.add_argument("--max-num-batched-tokens", type=human)
    table = snapshot_from_parser(parser, command="serve", vllm_version="0")
    spec = table.options["max-model-len"]
    assert spec.type == "human-int-or-auto"
    assert table.options["max-num-batched-tokens"].type == "human-int"
    for text in ("auto", "AUTO", " auto ", "-1", "16k", 4096):
        assert check_value(spec, text) is None, text
    for text in ("autox", "-auto", "au to", "none", ""):
        assert check_value(spec, text) is not None, text
    assert check_value(table.options["max-num-batched-tokens"], "auto") is not None
    # Both shipped releases' --max-model-len is such an option.
    for release in ("0.32", "0.33", "0.34"):
        assert shipped_table("serve", release).options["max-model-len"].type == spec.type


def test_the_vllm_extra_installs_exactly_the_supported_releases():
    """``pip install "./packages/dsv4-presets[vllm]"`` takes a release the table has."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "packages/dsv4-presets/pyproject.toml").read_text())
    oldest, newest = min(vllm_releases.RELEASES), max(vllm_releases.RELEASES)
    assert project["project"]["optional-dependencies"]["vllm"] == [
        f"vllm>={oldest[0]}.{oldest[1]},<{newest[0]}.{newest[1] + 1}"
    ]
