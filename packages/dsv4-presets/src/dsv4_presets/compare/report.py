"""Build the comparison report from the saved run folders.

The report is computed only from what the runs saved (``result.json`` and
vLLM's ``bench.json``), so it can be rebuilt at any time
(``dsv4 compare --report-only --out DIR``).  Failed runs are listed with their
reason and log, and never enter a mean, a pair or an interval.

Outputs, all under the campaign folder: ``report.md`` (the seed's table,
the relative change of every B run against the mean of its neighbouring A
runs, the intervals), ``report.json`` (the same for machines) and
``report.png`` (needs matplotlib: ``pip install './packages/dsv4-presets[plot]'``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import stats
from .rundir import BENCH_FILE, CAMPAIGN_FILE, SERVER_LOG, load_result

__all__ = [
    "METRICS",
    "build_report",
    "burst_fraction",
    "per_request_itl_ms",
    "per_request_tpot_ms",
    "render_markdown",
    "render_plot",
    "write_report",
]

# (key in the bench JSON, column title, unit, True when higher is better)
METRICS: tuple[tuple[str, str, str, bool], ...] = (
    ("output_throughput", "Mean Output Throughput", "tokens/s", True),
    ("mean_tpot_ms", "Mean TPOT", "ms", False),
)
REPORT_FORMAT = "dsv4-compare-report/1"


def per_request_tpot_ms(bench: Mapping[str, Any]) -> list[list[float]]:
    """Per-request TPOT in ms from a ``--save-detailed`` bench JSON.

    vLLM's definition: ``(latency - ttft) / (output_len - 1)`` for successful
    requests with more than one output token; one single-value list per
    request, so their mean is vLLM's ``mean_tpot_ms``.
    """
    lat = bench.get("latencies")
    ttft = bench.get("ttfts")
    out = bench.get("output_lens")
    if not (isinstance(lat, list) and isinstance(ttft, list) and isinstance(out, list)):
        return []
    errors = bench.get("errors") or [""] * len(lat)
    samples = []
    for latency, first, n, err in zip(lat, ttft, out, errors, strict=False):
        if err or not isinstance(n, int) or n <= 1:
            continue
        samples.append([(float(latency) - float(first)) / (n - 1) * 1000.0])
    return samples


def per_request_itl_ms(bench: Mapping[str, Any]) -> list[list[float]]:
    """Every successful request's inter-token latencies in ms (one list per request)."""
    itls = bench.get("itls")
    out = bench.get("output_lens")
    if not (isinstance(itls, list) and isinstance(out, list)):
        return []
    errors = bench.get("errors") or [""] * len(itls)
    return [
        [float(x) * 1000.0 for x in request]
        for request, n, err in zip(itls, out, errors, strict=False)
        if not err and isinstance(n, int) and n > 0 and request
    ]


BURST_ITL_S = 1e-4
BURST_FRACTION = 0.5


def burst_fraction(bench: Mapping[str, Any]) -> float | None:
    """Share of successful requests' inter-token latencies under 0.1 ms.

    Real decode steps take milliseconds; near-zero gaps mean tokens reached the
    client in bursts (an overloaded API server or client), so TPOT and ITL then
    describe delivery rather than generation.  None without per-request data.
    """
    gaps = [x for request in per_request_itl_ms(bench) for x in request]
    if not gaps:
        return None
    return sum(1 for x in gaps if x < BURST_ITL_S * 1000.0) / len(gaps)


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def build_report(
    out_dir: Path, *, confidence: float = 0.95, resamples: int = 2000, seed: int = 0
) -> dict[str, Any]:
    """Read a campaign folder and compute the report (a JSON-ready dict)."""
    manifest = _load_json(out_dir / CAMPAIGN_FILE)
    if not isinstance(manifest, dict):
        raise ValueError(f"--out: {out_dir} holds no {CAMPAIGN_FILE}; not a dsv4 compare folder")
    variants = manifest.get("variants", {})
    runs_out: list[dict[str, Any]] = []
    sequence: list[tuple[str, str]] = []
    ok: dict[str, bool] = {}
    values: dict[str, dict[str, float]] = {}
    tpot_samples: dict[str, list[list[float]]] = {}
    itl_samples: dict[str, list[list[float]]] = {}
    for planned in manifest.get("runs", []):
        label, variant, folder = planned["label"], planned["variant"], planned["folder"]
        sequence.append((label, variant))
        run_dir = out_dir / "runs" / folder
        result = load_result(run_dir)
        display = variants.get(variant, {}).get("spec", {}).get("label") or variant
        entry: dict[str, Any] = {
            "label": label,
            "variant": variant,
            "display": display,
            "folder": f"runs/{folder}",
        }
        if result is None:
            entry.update(status="not run", reason="the campaign has not reached this run")
            ok[label] = False
        else:
            metrics = result.get("metrics", {})
            entry.update(
                status=result.get("status"),
                reason=result.get("reason"),
                metrics=metrics,
                timings=result.get("timings", {}),
                server_log=f"runs/{folder}/{SERVER_LOG}",
                served_by=result.get("served_by"),
            )
            good = result.get("status") == "ok" and all(
                isinstance(metrics.get(k), (int, float)) for k, *_ in METRICS
            )
            ok[label] = good
            if good:
                values[label] = {k: float(metrics[k]) for k, *_ in METRICS}
                bench = _load_json(run_dir / BENCH_FILE)
                if isinstance(bench, dict):
                    tpot_samples[label] = per_request_tpot_ms(bench)
                    itl_samples[label] = per_request_itl_ms(bench)
                    bursts = burst_fraction(bench)
                    entry["burst_fraction"] = bursts
                    if bursts is not None and bursts > BURST_FRACTION:
                        entry["warning"] = (
                            f"{bursts:.0%} of inter-token latencies are under 0.1 ms: tokens "
                            "reached the client in bursts, so this run's TPOT/ITL describe "
                            "delivery, not generation (overloaded API server or client?)"
                        )
        runs_out.append(entry)

    pairs = stats.pair_runs(sequence, ok)
    complete = [p for p in pairs if p.complete]
    pairs_out = []
    per_metric_changes: dict[str, list[float]] = {k: [] for k, *_ in METRICS}
    for p in pairs:
        item: dict[str, Any] = {"b": p.b, "a": list(p.a), "a_failed": list(p.a_missing)}
        if p.complete:
            for key, *_ in METRICS:
                baseline = stats.mean([values[a][key] for a in p.a])
                change = stats.relative_change(values[p.b][key], baseline)
                item[key] = {
                    "b": values[p.b][key],
                    "a_mean": baseline,
                    "relative_change_pct": change,
                }
                per_metric_changes[key].append(change)
        else:
            item["note"] = "no successful neighbouring A run; not used"
        pairs_out.append(item)

    summary: dict[str, Any] = {}
    for key, title, unit, higher_better in METRICS:
        changes = per_metric_changes[key]
        summary[key] = {
            "title": title,
            "unit": unit,
            "higher_is_better": higher_better,
            "mean_relative_change_pct": stats.mean(changes) if changes else None,
            "paired_interval": stats.t_interval(changes, confidence).to_dict(),
        }
    summary["mean_tpot_ms"]["request_bootstrap"] = stats.bootstrap_relative_change(
        complete, tpot_samples, confidence=confidence, resamples=resamples, seed=seed
    ).to_dict()
    summary["mean_itl_ms"] = {
        "title": "Mean ITL",
        "unit": "ms",
        "higher_is_better": False,
        "request_bootstrap": stats.bootstrap_relative_change(
            complete, itl_samples, confidence=confidence, resamples=resamples, seed=seed
        ).to_dict(),
    }
    return {
        "format": REPORT_FORMAT,
        "out_dir": str(out_dir),
        "confidence": confidence,
        "variants": {
            k: {
                "display": v.get("spec", {}).get("label") or k,
                "spec": v.get("spec", {}).get("text"),
                "preset": v.get("preset"),
                "model": v.get("model"),
                "serve_args": v.get("serve_args"),
                "env": v.get("env"),
                "vllm": v.get("vllm"),
                "validation": v.get("validation"),
            }
            for k, v in variants.items()
        },
        "bench": manifest.get("bench", {}),
        "runs": runs_out,
        "pairs": pairs_out,
        "summary": summary,
        "failed_runs": [r["label"] for r in runs_out if r["status"] == "failed"],
        "not_run": [r["label"] for r in runs_out if r["status"] == "not run"],
        "notes": [
            "relative change = (B - mean of the neighbouring A runs) / that mean",
            "the paired interval is a Student t interval over the per-pair relative changes",
            "the request bootstrap resamples requests within each run: it reflects request "
            "noise only, not run-to-run drift, and is narrower than the paired interval",
        ],
    }


def _fmt_pct(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:+.2f}%"


def _fmt_interval(d: Mapping[str, Any], estimate_key: str) -> str:
    est = d.get(estimate_key)
    if d.get("low") is None or d.get("high") is None:
        head = f"{_fmt_pct(est)}, " if est is not None else ""
        return f"{head}interval undefined: {d.get('undefined_reason')}"
    return f"{_fmt_pct(est)} [{_fmt_pct(d['low'])}, {_fmt_pct(d['high'])}]"


def _vllm_text(served_by: Mapping[str, Any]) -> str:
    version = served_by.get("vllm_version")
    if version is None:
        return "unknown (no start-up line in server.log)"
    source = served_by.get("vllm_version_source")
    return f"{version}" + (f" (from {source})" if source and source != "server.log" else "")


def _plugin_text(plugin: Mapping[str, Any]) -> str:
    state = plugin.get("state", "absent")
    if state == "absent":
        return "absent (no dsv4-attention line: not installed, or the model is not DSV4)"
    version = plugin.get("plugin_version", "?")
    if state == "active":
        replaced = ", ".join(plugin.get("replaced", [])) or "nothing listed"
        return f"active ({version}; replaced: {replaced})"
    if state == "inactive":
        return f"inactive ({version}: {plugin.get('reason', 'no reason given')})"
    return f"mixed: processes disagree ({version}); see server.log"


def render_markdown(report: Mapping[str, Any]) -> str:
    """The human-readable report: the seed's table, pairs, intervals, failures."""
    variants = report["variants"]
    lines = ["# dsv4 compare", ""]
    for k in ("A", "B"):
        v = variants.get(k, {})
        lines.append(f"- **{k}** ({v.get('display')}): `{v.get('spec')}`")
    bench = report.get("bench", {})
    lines += [f"- bench: `{bench.get('name')}` ({bench.get('num_prompts')} prompts)", ""]
    lines += ["| Run | Variant | Mean Output Throughput | Mean TPOT |", "| --- | --- | --- | --- |"]
    for r in report["runs"]:
        if r["status"] == "ok":
            m = r["metrics"]
            lines.append(
                f"| {r['label']} | {r['display']} | {m['output_throughput']:.2f} tokens/s "
                f"| {m['mean_tpot_ms']:.2f} ms |"
            )
        else:
            where = f" (log: {r['server_log']})" if r.get("server_log") else ""
            reason = str(r["reason"]).replace("|", "\\|").replace("\n", " ")
            lines.append(
                f"| {r['label']} | {r['display']} | {r['status'].upper()}: {reason}{where} | |"
            )
    lines.append("")
    lines.append("## Each B run against the mean of its neighbouring A runs")
    lines.append("")
    if not report["pairs"]:
        lines.append("No successful B run: nothing to compare.")
    else:
        lines += [
            "| B run | A runs | Output throughput (B vs A) | Mean TPOT (B vs A) |",
            "| --- | --- | --- | --- |",
        ]
        for p in report["pairs"]:
            if "output_throughput" not in p:
                lines.append(
                    f"| {p['b']} | none ({', '.join(p['a_failed'])} failed) | not used | not used |"
                )
                continue
            thr, tpot = p["output_throughput"], p["mean_tpot_ms"]
            a_text = ", ".join(p["a"]) + (
                f" ({', '.join(p['a_failed'])} failed)" if p["a_failed"] else ""
            )
            lines.append(
                f"| {p['b']} | {a_text} | {thr['b']:.2f} vs {thr['a_mean']:.2f} tokens/s "
                f"({_fmt_pct(thr['relative_change_pct'])}) | {tpot['b']:.2f} vs "
                f"{tpot['a_mean']:.2f} ms ({_fmt_pct(tpot['relative_change_pct'])}) |"
            )
    conf = round(100 * float(report["confidence"]))
    s = report["summary"]
    lines += ["", f"## Intervals ({conf}%) for the relative change of B vs A", ""]
    lines.append(
        "- Output throughput, paired t over pairs: "
        + _fmt_interval(s["output_throughput"]["paired_interval"], "mean")
    )
    lines.append(
        "- Mean TPOT, paired t over pairs: "
        + _fmt_interval(s["mean_tpot_ms"]["paired_interval"], "mean")
    )
    boot = s["mean_tpot_ms"]["request_bootstrap"]
    lines.append(
        f"- Mean TPOT, per-request bootstrap ({boot['resamples']} resamples): "
        + _fmt_interval(boot, "estimate")
    )
    boot = s["mean_itl_ms"]["request_bootstrap"]
    lines.append(
        f"- Mean ITL, per-request bootstrap ({boot['resamples']} resamples): "
        + _fmt_interval(boot, "estimate")
    )
    lines += [
        "",
        "Negative TPOT/ITL changes and positive throughput changes mean B is faster.",
        "The paired interval is the one to trust; the per-request bootstrap covers "
        "request-to-request noise inside runs only.",
    ]
    served = [r for r in report["runs"] if r.get("served_by")]
    if served:
        lines += ["", "## Servers (read from each run's server.log)", ""]
        lines += ["| Run | vLLM | dsv4-attention |", "| --- | --- | --- |"]
        for r in served:
            lines.append(
                f"| {r['label']} | {_vllm_text(r['served_by'])} | "
                f"{_plugin_text(r['served_by'].get('plugin') or {})} |"
            )
    warned = [r for r in report["runs"] if r.get("warning")]
    if warned:
        lines += ["", "## Warnings", ""]
        for r in warned:
            lines.append(f"- {r['label']}: {r['warning']}")
    failed = [r for r in report["runs"] if r["status"] == "failed"]
    if failed:
        lines += ["", "## Failed runs (never averaged in)", ""]
        for r in failed:
            lines.append(f"- {r['label']} ({r['display']}): {r['reason']} - {r['server_log']}")
    if report["not_run"]:
        lines += [
            "",
            f"Not run yet: {', '.join(report['not_run'])} (resume with the same command).",
        ]
    return "\n".join(lines) + "\n"


def render_plot(report: Mapping[str, Any], path: Path) -> str | None:
    """Write the PNG; returns None, or why no plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install './packages/dsv4-presets[plot]')"
    runs: Sequence[Mapping[str, Any]] = report["runs"]
    labels = [r["label"] for r in runs]
    colours = {"A": "#1f77b4", "B": "#ff7f0e"}
    fig, axes = plt.subplots(1, 2, figsize=(max(6.0, 1.4 * len(runs) + 3.0), 3.8))
    for ax, (key, title, unit, _) in zip(axes, METRICS, strict=True):
        for i, r in enumerate(runs):
            if r["status"] == "ok":
                ax.bar(i, r["metrics"][key], color=colours.get(r["variant"], "grey"))
                ax.annotate(
                    f"{r['metrics'][key]:.4g}",
                    (i, r["metrics"][key]),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
            else:
                ax.bar(i, 0.0, color="none")
                ax.annotate(
                    r["status"],
                    (i, 0.0),
                    ha="center",
                    va="bottom",
                    color="red",
                    rotation=90,
                    fontsize=8,
                )
        ax.set_xticks(range(len(runs)), labels)
        ax.set_title(title)
        ax.set_ylabel(unit)
        s = report["summary"][key]
        sub = _fmt_interval(s["paired_interval"], "mean")
        ax.set_xlabel(f"B vs A: {sub}"[:90], fontsize=8)
    fig.suptitle(
        " vs ".join(f"{k}={v['display']}" for k, v in report["variants"].items()), fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_report(
    out_dir: Path,
    *,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
    plot: bool = True,
) -> tuple[dict[str, Any], str]:
    """Build and write ``report.json``, ``report.md`` and ``report.png``."""
    report = build_report(out_dir, confidence=confidence, resamples=resamples, seed=seed)
    if plot:
        why = render_plot(report, out_dir / "report.png")
        report["plot"] = "report.png" if why is None else None
        if why is not None:
            report["plot_skipped"] = why
    text = render_markdown(report)
    if report.get("plot_skipped"):
        text += f"\nNo plot: {report['plot_skipped']}\n"
    for name, content in (
        ("report.json", json.dumps(report, indent=2) + "\n"),
        ("report.md", text),
    ):
        tmp = out_dir / (name + ".tmp")
        tmp.write_text(content)
        tmp.replace(out_dir / name)
    return report, text
