"""Tables, plot and target summary for the kernel benchmark results."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from .harness import FLOOR, SAME_BYTES_COPY, Result

OURS = "dsv4-kernels"
# Kernels whose "ours" (bold, speed-ups, floor ratio) is another provider than OURS.
OURS_BY_KERNEL = {"prefill_layer": "dsv4-attention"}
# Matplotlib's "tab10" colours: one per provider, the same in every panel.
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip
FLOOR_COLOUR = "#000000"


def provider_colours(results: Sequence[Result]) -> dict[str, str]:
    """One colour per provider across all panels: ours first, the floor black, others in order."""
    names = list(dict.fromkeys([OURS, *(r.provider for r in results)]))
    others = [p for p in names if p != FLOOR]
    colours = {p: PALETTE[i % len(PALETTE)] for i, p in enumerate(others)}
    colours[FLOOR] = FLOOR_COLOUR
    return colours


def _geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _pivot(results: Sequence[Result]) -> dict[str, dict[str, dict[str, Result]]]:
    """kernel -> case -> provider -> result, in first-seen order."""
    table: dict[str, dict[str, dict[str, Result]]] = defaultdict(dict)
    for r in results:
        table[r.kernel].setdefault(r.case, {})[r.provider] = r
    return table


SMOKE_BANNER = (
    "**CPU smoke run**: no CUDA GPU; the kernels ran through Triton's interpreter on tiny "
    "shapes. Every provider's output was checked, but the times are CPU wall clock and say "
    "nothing about GPU speed, so no speed-ups or floor ratios are shown. GPU figures need a GPU."
)


def write_table(results: Sequence[Result], env: dict[str, str], path: Path, command: str) -> str:
    """Markdown: per kernel, p50 of every provider, our speed-ups and our distance to the floor.

    A CPU smoke run (``env["mode"] == "cpu-smoke"``) keeps its banner at the
    top and shows the times only: nothing bold, no speed-ups, no floor ratios, no
    copy bandwidth, and a column only for a provider that ran for that kernel.
    """
    smoke = env.get("mode") == "cpu-smoke"
    lines = [SMOKE_BANNER, ""] if smoke else []
    where = f"Device: {env['gpu']}" if smoke else f"GPU: {env['gpu']}"
    bandwidth = "" if smoke else f"copy bandwidth {env.get('copy_bandwidth_gbps', '?')} GB/s; "
    # the peers that did not run (``env["not_run"]``) have no columns: one line says why,
    # and says it for vLLM's bundled FlashMLA too where its status would repeat it
    not_run = [f"Not run: {env['not_run']}.", ""] if env.get("not_run") else []
    bundled = env.get("vllm_flashmla", "")
    if not bundled or (not_run and bundled.startswith("unavailable")):
        bundled = ""
    lines += [
        f"{where}; torch {env['torch']}; Triton {env['triton']}; git {env['git_sha']}; "
        f"{bandwidth}mode {env.get('mode')}",
        "",
        *([f"vLLM 0.33 bundled FlashMLA: {bundled}", ""] if bundled else []),
        *not_run,
        f"Command: `{command}`",
        "",
        "Times are medians in microseconds (GPU: triton.testing.do_bench; CPU smoke: wall clock);"
        " p20 and p80 are in results.jsonl.",
        "",
    ]
    for kernel, cases in _pivot(results).items():
        ours_name = OURS_BY_KERNEL.get(kernel, OURS)
        providers = list(
            dict.fromkeys(p for row in cases.values() for p in row if p not in (ours_name, FLOOR))
        )
        head = ["case", "tokens", *providers]
        if smoke:  # a column per provider that ran for this kernel (ours too)
            ours_ran = any(ours_name in row for row in cases.values())
            timed = [*providers, *([ours_name] if ours_ran else [])]
            head = ["case", "tokens", *timed]
            lines += [f"### {kernel}", "", "| " + " | ".join(head) + " |"]
            lines.append("|" + "---|" * len(head))
            for case, row in cases.items():
                cells = [case, str(next(iter(row.values())).tokens)]
                cells += [f"{row[p].p50_us:.2f}" if p in row else "-" for p in timed]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
            continue
        seed_style = {"per-request-workers-128", "per-request-workers-256"} <= set(providers)
        if seed_style:
            head.append("256 vs 128")
        head += [ours_name, *(f"speed-up vs {p}" for p in providers), "floor", "ours / floor"]
        lines += [f"### {kernel}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for case, row in cases.items():
            cells = [case, str(next(iter(row.values())).tokens)]
            cells += [f"{row[p].p50_us:.2f}" if p in row else "-" for p in providers]
            if seed_style:
                a, b = row["per-request-workers-128"].p50_us, row["per-request-workers-256"].p50_us
                cells.append(
                    f"{(a - b) / a * 100:+.1f}% faster"
                    if b <= a
                    else f"{(b - a) / a * 100:.1f}% slower"
                )
            ours = row.get(ours_name)
            if ours is not None:
                cells.append(f"**{ours.p50_us:.2f}**")
                cells += [
                    f"{row[p].p50_us / ours.p50_us:.2f}x" if p in row else "-" for p in providers
                ]
                floor = row[FLOOR].p50_us if FLOOR in row else float("nan")
                cells += [f"{floor:.2f}", f"{ours.p50_us / floor:.2f}x" if floor > 0 else "-"]
            else:
                cells += ["-"] * (1 + len(providers) + 2)
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    text = "\n".join(lines).rstrip() + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def write_plot(results: Sequence[Result], env: dict[str, str], path: Path) -> None:
    """Grouped bars of p50 per case and provider, one panel per kernel (log scale)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    pivot = _pivot([r for r in results if r.kernel != "empty_triton_launch"])
    colours = provider_colours(results)
    fig, axes = plt.subplots(len(pivot), 1, figsize=(12, 3.6 * len(pivot)), squeeze=False)
    for ax, (kernel, cases) in zip(axes[:, 0], pivot.items(), strict=True):
        providers = list(dict.fromkeys(p for row in cases.values() for p in row))
        width = 0.8 / len(providers)
        for i, prov in enumerate(providers):
            xs = [j + i * width for j in range(len(cases))]
            ys = [row[prov].p50_us if prov in row else 0 for row in cases.values()]
            ax.bar(xs, ys, width, label=prov, color=colours[prov])
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
        ax.set_xticklabels(list(cases), rotation=20, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("p50 (us)")
        ax.set_title(kernel, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"{env['gpu']} ({env.get('mode')}), torch {env['torch']}, "
        f"Triton {env['triton']}, {env['git_sha']}",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.985))  # room for the suptitle
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _target(label: str, value: float, limit: float, higher_is_better: bool) -> str:
    ok = value >= limit if higher_is_better else value <= limit
    op = ">=" if higher_is_better else "<="
    return f"  [{'MET ' if ok else 'MISS'}] {label}: {value:.2f} (target {op} {limit})"


def _floor_target(label: str, row: dict[str, Result], limit: float) -> str:
    """Time over the floor, with time over a same-bytes copy beside it when measured."""
    line = _target(f"{label} time / floor", row[OURS].p50_us / row[FLOOR].p50_us, limit, False)
    if SAME_BYTES_COPY in row:
        line += (
            f"; time / same-bytes torch copy: {row[OURS].p50_us / row[SAME_BYTES_COPY].p50_us:.2f}"
        )
    return line


def summarise(results: Sequence[Result], smoke: bool, gpu: bool = False) -> str:
    """The issue targets, each with the number seen in this run (GPU runs only).

    A CPU smoke run's times are interpreter wall clock: no verdict is printed; nor for
    ``--smoke`` on a GPU (``gpu``), whose tiny shapes are none of the targets' cases.
    """
    if smoke and gpu:
        return (
            "Targets: not evaluated (--smoke: the small matrix holds none of the targets' "
            "cases; run without --smoke for the targets)."
        )
    if smoke:
        return (
            "Targets: not evaluated (CPU smoke run: interpreter wall-clock times say nothing "
            "about GPU speed; run on a GPU for the targets)."
        )
    pivot = _pivot(results)
    lines = ["Targets:"]
    combine = pivot.get("combine_topk_swa_indices", {})
    if combine:

        def speedup(row: dict[str, Result]) -> float:
            return row["per-request-workers-256"].p50_us / row[OURS].p50_us

        issue = [r for r in combine.values() if r[OURS].params.get("issue_matrix")]
        which = f"the issue's {len(issue)} cases"
        lines.append(
            _target(
                f"combine geomean speed-up vs per-request-workers-256 ({which})",
                _geomean([speedup(r) for r in issue]),
                2.5,
                True,
            )
        )
        if len(issue) < len(combine):
            lines.append(
                f"  (all {len(combine)} combine cases: "
                f"{_geomean([speedup(r) for r in combine.values()]):.2f}x)"
            )
        for case in ("c4a-1x16384", "c4a-1x16384@131072"):
            if case in combine:
                row = combine[case]
                lines.append(_floor_target(f"combine {case}", row, 1.18))
        launch = pivot.get("empty_triton_launch", {}).get("launch", {}).get("triton")
        if launch and "c4a-1x1024" in combine:
            lines.append(
                _target(
                    "combine c4a-1x1024 time / empty Triton launch",
                    combine["c4a-1x1024"][OURS].p50_us / launch.p50_us,
                    1.5,
                    False,
                )
            )
    for case, row in pivot.get("compute_global_topk_indices_and_lens", {}).items():
        if row[OURS].tokens >= 16384:  # the seed-like 16x1024 batch and the long-context one
            lines.append(_floor_target(f"global {case}", row, 1.18))
    cache_speedups = []
    for kernel, cases in pivot.items():
        if "k_cache" not in kernel:
            continue
        for case, row in cases.items():
            if "per-request-workers-128" in row and OURS in row:
                cache_speedups.append(row["per-request-workers-128"].p50_us / row[OURS].p50_us)
            if OURS in row and row[OURS].tokens >= 16384 and row[FLOOR].p50_us > 0:
                lines.append(_floor_target(f"{kernel} {case}", row, 1.25))
    if cache_speedups:
        lines.append(
            _target(
                "k-cache geomean speed-up vs per-request-workers-128",
                _geomean(cache_speedups),
                5.0,
                True,
            )
        )
    return "\n".join(lines)
