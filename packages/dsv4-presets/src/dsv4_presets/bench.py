"""Running ``vllm bench serve`` with a bench preset, and judging the result it saved.

``vllm bench serve`` exits 0 even when every request failed, so the saved
JSON is the only trustworthy verdict: :func:`bench_verdict` (the one judgement,
shared with ``dsv4 compare``) accepts a result only when every prompt
completed and none failed.  The server is asked which model it serves through
:mod:`dsv4_presets.local_http`, never through an HTTP proxy.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsv4_presets import local_http
from dsv4_presets.configs import BenchConfig
from dsv4_presets.vllm_exec import vllm_command

# Headline metrics `dsv4 bench` prints, with their units.
SUMMARY_METRICS = (
    ("completed", ""),
    ("duration", "s"),
    ("request_throughput", "req/s"),
    ("output_throughput", "tok/s"),
    ("total_token_throughput", "tok/s"),
    ("mean_ttft_ms", "ms"),
    ("median_ttft_ms", "ms"),
    ("mean_tpot_ms", "ms"),
    ("median_tpot_ms", "ms"),
    ("mean_itl_ms", "ms"),
)


class BenchResultError(RuntimeError):
    """The benchmark did not produce a complete, failure-free result."""


def _check_expected(expected_prompts: int) -> None:
    if isinstance(expected_prompts, bool) or not isinstance(expected_prompts, int):
        raise ValueError(f"expected_prompts must be an int, got {expected_prompts!r}")
    if expected_prompts < 1:
        raise ValueError(f"expected_prompts must be positive, got {expected_prompts}")


def bench_verdict(data: Mapping[str, Any], expected_prompts: int) -> str | None:
    """Why a ``vllm bench serve`` result cannot be used, or ``None`` when it can.

    The one judgement of a bench JSON, used by ``dsv4 bench`` and
    ``dsv4 compare`` alike.  Both counts are out of ``expected_prompts``, the
    requests the preset sends (warm-ups excluded): a result is usable when no
    request failed and every one of them completed.
    """
    _check_expected(expected_prompts)
    completed = data.get("completed")
    failed = data.get("failed", 0)
    if isinstance(completed, bool) or not isinstance(completed, int):
        return "the result has no 'completed' count"
    problems = []
    if isinstance(failed, int) and not isinstance(failed, bool) and failed > 0:
        errors = [e for e in data.get("errors", []) or [] if e]
        if errors:
            first = f"; first error: {str(errors[0])[:300]}"
        else:
            first = " (the result keeps no per-request errors; --set save-detailed=true keeps them)"
        problems.append(f"{failed} of {expected_prompts} requests failed{first}")
    if completed < expected_prompts:
        problems.append(f"only {completed} of {expected_prompts} requests completed")
    return "; ".join(problems) if problems else None


def read_bench_result(path: str | Path, *, expected_prompts: int) -> dict[str, Any]:
    """Load a ``vllm bench serve --save-result`` JSON file and check it with :func:`bench_verdict`.

    Raises :class:`BenchResultError` when the file is missing or unreadable,
    or when the verdict is not clean.
    """
    _check_expected(expected_prompts)
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BenchResultError(
            f"vllm bench serve saved no result at {path} (did it crash before the end?)"
        ) from None
    except (OSError, ValueError) as exc:
        raise BenchResultError(f"cannot read benchmark result {path}: {exc}") from None
    if not isinstance(data, Mapping):
        raise BenchResultError(f"benchmark result {path} is not a JSON object")
    why = bench_verdict(data, expected_prompts)
    if why is not None:
        raise BenchResultError(f"benchmark result {path}: {why}")
    return dict(data)


def summary_lines(result: Mapping[str, Any]) -> list[str]:
    """Human-readable lines for the headline metrics present in ``result``."""
    lines = []
    for key, unit in SUMMARY_METRICS:
        value = result.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            text = f"{value:.2f}" if isinstance(value, float) else str(value)
            lines.append(f"  {key:<24} {text} {unit}".rstrip())
    return lines


def served_model(base_url: str, *, timeout: float = 10.0) -> str:
    """The first model id the OpenAI-compatible server at ``base_url`` serves."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        data = local_http.get_json(url, timeout=timeout)
    except (OSError, ValueError) as exc:
        raise BenchResultError(
            f"cannot ask {url} which model it serves ({exc}); pass --model"
        ) from None
    models = data.get("data") if isinstance(data, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise BenchResultError(f"{url} lists no model; pass --model")
    return str(models[0]["id"])


def run_bench(
    config: BenchConfig,
    *,
    base_url: str,
    model: str,
    result_dir: str,
    result_filename: str,
    tokenizer: str | None = None,
) -> tuple[int, Path]:
    """Run ``vllm bench serve``; returns its exit status and the result file's path."""
    argv = [
        *vllm_command(),
        "bench",
        "serve",
        *config.to_argv(
            base_url=base_url,
            model=model,
            result_dir=result_dir,
            result_filename=result_filename,
            tokenizer=tokenizer,
        ),
    ]
    completed = subprocess.run(argv, check=False)
    return completed.returncode, Path(result_dir) / result_filename
