"""``dsv4 compare``: paired A/B/A serving comparisons against real vLLM servers."""

from __future__ import annotations

import argparse
import math
import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from .campaign import Campaign, CampaignInterrupted, RunOptions
from .progress import Progress
from .report import write_report
from .resolve import resolve_bench_spec, resolve_variant
from .runner import run_campaign
from .spec import parse_env_assignment, parse_spec, plan_runs

__all__ = ["add_arguments", "main", "register", "run"]

DESCRIPTION = """\
Compare two vLLM server setups, A and B, by running them one after the other in
an interleaved pattern (A B A by default) on this machine: for each run start
`vllm serve` on its own port, wait for /health, warm up, run `vllm bench serve`,
stop the server by its PID and wait for its GPU memory to be released.  Every
run is saved under --out (spec, commands, environment, versions, logs, vLLM's
JSON); running the same command again resumes where it stopped.  The report
gives the seed's table (Run | Variant | Mean Output Throughput | Mean TPOT, as
in the seed: the vLLM pull request this project grew from), the change of each
B run against the mean of its neighbouring A runs, and confidence intervals.
"""

EPILOG = """\
SPEC (one shell word; quote it):
  PRESET [KEY=VALUE ...] [env:NAME=VALUE ...] [vllm:COMMAND] [label:TEXT]
    PRESET          a shipped serve preset (dsv4 presets) or a YAML preset file
    KEY=VALUE       override a vLLM option, like dsv4 render --set
    env:NAME=VALUE  environment variable for this variant's server
    vllm:COMMAND    command standing for `vllm` for this variant's server
                    (another build); env:DSV4_VLLM=... does the same
    label:TEXT      name shown in the report

examples:
  # our kernels against vLLM's own, on one TP8 node
  dsv4 compare --a h200-tp8-ep --b 'h200-tp8-ep env:DSV4_KERNELS_DISABLE=1' \\
      --pattern ABA --repeats 3 --out results/kernels-on-off
  # one flag
  dsv4 compare --a h200-tp8-ep --b 'h200-tp8-ep max-num-batched-tokens=8192'
  # two vLLM builds
  dsv4 compare --a 'h200-tp8-ep label:new' \\
      --b "h200-tp8-ep label:old vllm:'/opt/vllm-old/bin/python -m vllm.entrypoints.cli.main'"

exit status: 0 every run succeeded, 1 a run failed (see the report),
2 bad arguments or validation errors, 130 interrupted (resume with the same command).
"""


# The one place the run options' defaults live: RunOptions itself.
_DEFAULTS = RunOptions()
# Deadlines in seconds: (flag, RunOptions field, help with {default}).
_DEADLINES = (
    (
        "--health-timeout",
        "health_timeout",
        "seconds for a server to become healthy (default: {default})",
    ),
    ("--bench-timeout", "bench_timeout", "seconds for one benchmark (default: {default})"),
    (
        "--stop-grace",
        "stop_grace",
        "seconds between SIGTERM and SIGKILL when stopping (default: {default})",
    ),
    (
        "--gpu-release-timeout",
        "gpu_release_timeout",
        "seconds to wait for GPU memory to return to its level before the run "
        "(default: {default}; skipped without nvidia-smi)",
    ),
)


def _parsed(text: str, cast: Callable[[str], Any], ok: Callable[[Any], bool], kind: str,
            bad: str) -> Any:  # fmt: skip
    """``cast(text)`` when it parses (else "expected ``kind``") and ``ok`` holds (else
    "expected ``bad``"), as the one-line error argparse prints with the flag's name."""
    try:
        value = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {bad}, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    return _parsed(text, float, lambda v: v > 0 and not math.isinf(v), "a number of seconds",
                   "a positive number")  # fmt: skip


def _non_negative_int(text: str) -> int:
    return _parsed(text, int, lambda v: v >= 0, "an integer", "an integer >= 0")


def _positive_int(text: str) -> int:
    return _parsed(text, int, lambda v: v > 0, "an integer", "a positive integer")


def _confidence(text: str) -> float:
    return _parsed(text, float, lambda v: 0.0 < v < 1.0, "a number in (0, 1)",
                   "a number in (0, 1) such as 0.95")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``dsv4 compare`` options to ``parser``."""
    what = parser.add_argument_group("what to compare")
    what.add_argument("--a", metavar="SPEC", help="variant A (the reference); see SPEC below")
    what.add_argument("--b", metavar="SPEC", help="variant B (the candidate); see SPEC below")
    what.add_argument(
        "--pattern",
        default="ABA",
        help="run order, letters A and B (default: ABA; ABBA also works)",
    )
    what.add_argument(
        "--repeats",
        type=_positive_int,
        default=1,
        help="repeat the pattern N times (default: 1); two or more B runs "
        "give a paired confidence interval",
    )
    what.add_argument("--model", help="model for both variants (replaces the presets' model)")
    what.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="vLLM option override for both variants (repeatable)",
    )
    what.add_argument(
        "--env",
        dest="envs",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment variable for both variants' servers (repeatable)",
    )
    what.add_argument(
        "--bench",
        default="random-1024-64",
        help="bench preset or YAML file (default: random-1024-64, the benchmark of the "
        "seed, the vLLM pull request this project grew from)",
    )
    what.add_argument(
        "--bench-set",
        dest="bench_sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="vllm bench serve option override (repeatable)",
    )
    what.add_argument(
        "--bench-vllm",
        metavar="COMMAND",
        help="command standing for `vllm` for the benchmark client, the same "
        "for A and B (default: DSV4_VLLM, else this Python's vLLM)",
    )
    what.add_argument(
        "--no-validate",
        action="store_true",
        help="do not apply the preset rules (e.g. a tiny test model that is not "
        "DSV4); the skip is recorded in the campaign and the report",
    )

    where = parser.add_argument_group("where and how")
    where.add_argument(
        "--out",
        type=Path,
        help="campaign folder (default: results/compare-<date>-<time>); give an "
        "existing one to resume it",
    )
    where.add_argument(
        "--host", default=_DEFAULTS.host, help=f"server address (default: {_DEFAULTS.host})"
    )
    for flag, field, help_text in _DEADLINES:
        default = getattr(_DEFAULTS, field)
        where.add_argument(
            flag,
            type=_positive_float,
            default=default,
            metavar="S",
            help=help_text.format(default=f"{default:g}"),
        )
    where.add_argument(
        "--warmup-requests",
        type=_non_negative_int,
        default=_DEFAULTS.warmup_requests,
        metavar="N",
        help="completions sent before the benchmark, besides the bench "
        f"preset's own warm-ups (default: {_DEFAULTS.warmup_requests})",
    )
    where.add_argument(
        "--retry-failed",
        action="store_true",
        help="on resume, run failed runs again (the failed folder is kept as NN-LABEL.failed-K)",
    )
    where.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan and each run's commands, start nothing",
    )
    where.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild the report of --out from its saved runs, start nothing",
    )

    rep = parser.add_argument_group("report")
    rep.add_argument(
        "--confidence",
        type=_confidence,
        default=0.95,
        help="confidence level of the intervals (default: 0.95)",
    )
    rep.add_argument(
        "--bootstrap-resamples",
        type=_positive_int,
        default=2000,
        metavar="N",
        help="resamples of the per-request bootstrap (default: 2000)",
    )
    rep.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: 0)")
    rep.add_argument("--no-plot", action="store_true", help="do not write report.png")
    rep.add_argument("--no-progress", action="store_true", help="no live progress line")


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``compare`` to the ``dsv4`` sub-commands; ``args.func`` is :func:`run`."""
    parser = subparsers.add_parser(
        "compare",
        help="paired A/B/A serving comparison against real vLLM servers",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


# --------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------


def _build_campaign(args: argparse.Namespace, out: Path) -> Campaign:
    if not args.a or not args.b:
        raise ValueError("--a and --b: both variants are required (a SPEC each)")
    runs = plan_runs(args.pattern, args.repeats)
    common_env = [parse_env_assignment(e, argument="--env") for e in args.envs]
    validate = not args.no_validate
    variants = {
        letter: resolve_variant(
            parse_spec(text, variant=letter),
            model=args.model,
            sets=args.sets,
            env=common_env,
            validate=validate,
        )
        for letter, text in (("A", args.a), ("B", args.b))
    }
    bench = resolve_bench_spec(
        args.bench, sets=args.bench_sets, bench_vllm=args.bench_vllm, validate=validate
    )
    options = RunOptions(
        host=args.host,
        health_timeout=args.health_timeout,
        bench_timeout=args.bench_timeout,
        stop_grace=args.stop_grace,
        gpu_release_timeout=args.gpu_release_timeout,
        warmup_requests=args.warmup_requests,
        retry_failed=args.retry_failed,
    )
    extra = {
        "pattern": args.pattern.upper(),
        "repeats": args.repeats,
        "validation": "skipped (--no-validate)" if args.no_validate else "applied",
        "argv": list(sys.argv),
    }
    return Campaign(
        out_dir=out, runs=runs, variants=variants, bench=bench, options=options, extra=extra
    )


def _print_dry_run(campaign: Campaign) -> None:
    print(f"campaign folder: {campaign.out_dir}")
    for key, v in campaign.variants.items():
        print(
            f"variant {key} ({v.spec.display}): preset {v.preset}, model {v.model}, "
            f"validation {v.validation.get('status')}"
        )
        if v.env:
            print("  env: " + " ".join(f"{k}={shlex.quote(val)}" for k, val in v.env.items()))
        print(
            "  server: "
            + shlex.join(v.serve_argv(campaign.options.host, 0)).replace(
                "--port 0", "--port <free port>"
            )
        )
    print(
        "bench:  "
        + shlex.join(
            campaign.bench.argv(
                base_url="http://HOST:PORT",
                model="<served model>",
                result_dir="<run folder>",
                tokenizer=None,
            )
        )
    )
    print("runs: " + " ".join(r.label for r in campaign.runs))


def run(args: argparse.Namespace) -> int:
    """Execute ``dsv4 compare`` with parsed arguments; returns the exit status."""
    out: Path = args.out or Path("results") / time.strftime("compare-%Y%m%d-%H%M%S")

    def _report() -> tuple[dict[str, Any], str]:
        return write_report(
            out,
            confidence=args.confidence,
            resamples=args.bootstrap_resamples,
            seed=args.seed,
            plot=not args.no_plot,
        )

    if args.report_only:
        if args.out is None:
            print("dsv4 compare: --report-only needs --out DIR", file=sys.stderr)
            return 2
        try:
            report, text = _report()
        except ValueError as exc:
            print(f"dsv4 compare: {exc}", file=sys.stderr)
            return 2
        print(text)
        return 1 if report["failed_runs"] else 0
    try:
        campaign = _build_campaign(args, out)
    except ValueError as exc:
        print(f"dsv4 compare: {exc}", file=sys.stderr)
        return 2
    if args.no_validate:
        print(
            "dsv4 compare: preset validation skipped (--no-validate); recorded in the report",
            file=sys.stderr,
        )
    if args.dry_run:
        _print_dry_run(campaign)
        return 0
    progress = Progress(len(campaign.runs), live=False if args.no_progress else None)
    progress.event(f"campaign {out}: {' '.join(r.label for r in campaign.runs)}")

    def _on_term(signum: int, frame: FrameType | None) -> None:
        raise CampaignInterrupted(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, _on_term)
    interrupted = False
    try:
        run_campaign(campaign, progress)
    except (KeyboardInterrupt, CampaignInterrupted):
        interrupted = True
        progress.event(
            f"interrupted: finished runs are kept in {out}; run the same command again to resume"
        )
    except ValueError as exc:
        print(f"dsv4 compare: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    report, text = _report()
    print(text)
    progress.event(
        f"report: {out / 'report.md'}, {out / 'report.json'}"
        + (f", {out / 'report.png'}" if report.get("plot") else "")
    )
    if interrupted:
        return 130
    return 1 if report["failed_runs"] else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point (``python -m dsv4_presets.compare``)."""
    parser = argparse.ArgumentParser(
        prog="dsv4 compare",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
