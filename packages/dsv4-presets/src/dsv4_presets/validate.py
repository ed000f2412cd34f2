"""Validation entry points: our DSV4 rules, then (when available) vLLM's own checks."""

from __future__ import annotations

import re

from dsv4_presets import rules
from dsv4_presets.configs import BenchConfig, ServeConfig
from dsv4_presets.findings import Finding, Report
from dsv4_presets.schema import shipped_table
from dsv4_presets.vllm_exec import VLLM_INSTALL_HINT, vllm_available
from dsv4_presets.vllm_releases import UnsupportedVllmRelease, facts_for


def version_tuple(text: str) -> tuple[int, int, int] | None:
    """``"0.32.0"`` -> ``(0, 32, 0)``; ``"0.32.1.dev3+gabc"`` -> ``(0, 32, 1)``; else None."""
    match = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if not match:
        return None
    return int(match[1]), int(match[2]), int(match[3] or 0)


def check_min_vllm(config: ServeConfig, installed: str) -> list[Finding]:
    """An error when the installed vLLM is older than the preset's ``dsv4.min_vllm``."""
    if config.min_vllm is None:
        return []
    want, have = version_tuple(config.min_vllm), version_tuple(installed)
    if want is None or have is None or have >= want:
        return []
    return [
        Finding(
            "error",
            "vllm-version",
            f"preset {config.name} needs vLLM >= {config.min_vllm} (the release its options "
            f"and DSV4 code paths were checked against); this vLLM is {installed}: upgrade "
            f"({VLLM_INSTALL_HINT})",
        )
    ]


def check(config: ServeConfig | BenchConfig, *, with_vllm: bool | None = None) -> Report:
    """Validate a resolved preset and say what was checked.

    ``with_vllm``: ``True`` runs vLLM's parser and checks (and fails with
    ``RuntimeError`` if vLLM cannot be imported), ``False`` runs only our
    rules, ``None`` uses vLLM when it is importable.  A vLLM that is not a
    supported release (:mod:`dsv4_presets.vllm_releases`) gives one
    ``vllm-release`` error naming the supported releases, and none of its
    checks run.

    A multi-node serve preset is checked once per node: each node's findings
    are prefixed with the node's name.
    """
    use_vllm = vllm_available() if with_vllm is None else bool(with_vllm)
    if use_vllm and not vllm_available():
        raise RuntimeError(
            "with_vllm=True but vLLM is not importable here: install it "
            f"({VLLM_INSTALL_HINT}) or pass with_vllm=False"
        )
    report = Report()
    if use_vllm and not _release_supported(report):
        use_vllm = False
    if isinstance(config, BenchConfig):
        report.findings += rules.check_bench(config)
        if use_vllm:
            from dsv4_presets import vllm_check

            found, notes = vllm_check.check_bench(config)
            report.findings += found
            report.notes += notes
            report.vllm_version = vllm_check.vllm_version()
        else:
            report.vllm_release = facts_for(shipped_table("bench").vllm_version).name
            report.notes.append("vLLM not used: its bench parser was not run")
        return report
    if not isinstance(config, ServeConfig):
        raise TypeError(f"config must be a ServeConfig or BenchConfig, got {type(config).__name__}")

    targets = config.all_nodes()
    per_node: list[list[Finding]] = []
    for note in rules.not_applied(config):
        report.notes.append(note)
    for target in targets:
        found = rules.check_serve(target)
        if use_vllm and (target.node_spec is None or target.node_spec.serve):
            from dsv4_presets import vllm_check

            more, notes = vllm_check.check_serve(target)
            found += more
            for note in notes:
                if note not in report.notes:
                    report.notes.append(note)
            report.vllm_version = vllm_check.vllm_version()
            found += check_min_vllm(target, report.vllm_version)
        per_node.append(found)
    seen: set[tuple[str, str, str]] = set()
    for target, found in zip(targets, per_node, strict=False):
        for finding in found:
            # A problem every node has is reported once, without a node prefix.
            everywhere = all(finding in other for other in per_node)
            text = finding.message
            if target.node and not everywhere:
                text = f"node {target.node}: {text}"
            key = (finding.level, finding.rule, text)
            if key not in seen:
                seen.add(key)
                report.findings.append(Finding(finding.level, finding.rule, text))
    if not use_vllm:
        table = shipped_table("serve")
        report.vllm_release = facts_for(table.vllm_version).name
        report.notes.append(
            "checked without vLLM: the DSV4 rules, and option names and types against the "
            f"shipped vLLM {table.vllm_version} option table; install vLLM for its parser, "
            "registries and the minimum-version check"
        )
    return report


def _release_supported(report: Report) -> bool:
    """Record the installed vLLM's release on ``report``; False (and an error) if unsupported."""
    from dsv4_presets import vllm_check

    version = vllm_check.vllm_version()
    try:
        report.vllm_release = facts_for(version).name
    except (UnsupportedVllmRelease, ValueError) as exc:
        report.findings.append(Finding("error", "vllm-release", str(exc)))
        return False
    return True


def validate(config: ServeConfig | BenchConfig, *, with_vllm: bool | None = None) -> list[Finding]:
    """The findings (errors and warnings) for a resolved preset; see :func:`check`."""
    return check(config, with_vllm=with_vllm).findings
