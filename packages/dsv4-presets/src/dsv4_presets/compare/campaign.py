"""What a campaign is: the resolved variants and benchmark, the run options, the outcomes.

These are plain data, built by :mod:`.cli` and executed by :mod:`.runner`;
``campaign.json`` is :meth:`Campaign.manifest` plus :meth:`Campaign.identity`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .rundir import BENCH_FILE
from .spec import PlannedRun, VariantSpec

__all__ = [
    "Campaign",
    "CampaignInterrupted",
    "ResolvedBench",
    "ResolvedVariant",
    "RunOptions",
    "RunResult",
]


class CampaignInterrupted(Exception):
    """Raised when the campaign is asked to stop (SIGINT/SIGTERM)."""


@dataclass(frozen=True)
class ResolvedVariant:
    """A variant ready to start: its ``vllm serve`` arguments, environment and vLLM."""

    spec: VariantSpec
    preset: str
    model: str
    served_model: str
    tokenizer: str | None
    serve_args: tuple[str, ...]
    env: Mapping[str, str]
    vllm: tuple[str, ...]
    validation: Mapping[str, Any] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)

    def serve_argv(self, host: str, port: int) -> list[str]:
        """The full server command line for one run."""
        return [*self.vllm, "serve", *self.serve_args, "--host", host, "--port", str(port)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (what runs, not only what was asked)."""
        return {
            "spec": self.spec.to_dict(),
            "preset": self.preset,
            "model": self.model,
            "served_model": self.served_model,
            "tokenizer": self.tokenizer,
            "serve_args": list(self.serve_args),
            "env": dict(self.env),
            "vllm": list(self.vllm),
            "validation": dict(self.validation),
            "config": dict(self.config),
        }


@dataclass(frozen=True)
class ResolvedBench:
    """The benchmark every run executes, identical for A and B.

    ``build_args`` returns everything after ``vllm bench serve``.
    """

    name: str
    num_prompts: int
    vllm: tuple[str, ...]
    build_args: Callable[..., list[str]]
    env: Mapping[str, str] = field(default_factory=dict)

    def argv(
        self, *, base_url: str, model: str, result_dir: str, tokenizer: str | None
    ) -> list[str]:
        """The full ``vllm bench serve`` command line for one run."""
        args = list(
            self.build_args(
                base_url=base_url,
                model=model,
                result_dir=result_dir,
                result_filename=BENCH_FILE,
                tokenizer=tokenizer,
            )
        )
        # The report needs vLLM's saved JSON with per-request latencies.
        for flag in ("--save-result", "--save-detailed"):
            if flag not in args:
                args.append(flag)
        return [*self.vllm, "bench", "serve", *args]

    def fingerprint(self) -> list[str]:
        """The bench arguments with per-run values replaced (for resume checks)."""
        return self.argv(base_url="URL", model="MODEL", result_dir="DIR", tokenizer=None)


@dataclass(frozen=True)
class RunOptions:
    """Deadlines and knobs of a campaign (seconds unless stated)."""

    host: str = "127.0.0.1"
    health_timeout: float = 1800.0
    bench_timeout: float = 3600.0
    stop_grace: float = 60.0
    gpu_release_timeout: float = 300.0
    gpu_release_margin_mib: int = 1024
    warmup_requests: int = 2
    warmup_max_tokens: int = 8
    retry_failed: bool = False
    poll_interval: float = 1.0


@dataclass
class Campaign:
    """Everything a campaign needs: where, what, in which order."""

    out_dir: Path
    runs: list[PlannedRun]
    variants: dict[str, ResolvedVariant]
    bench: ResolvedBench
    options: RunOptions = field(default_factory=RunOptions)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def runs_dir(self) -> Path:
        """Folder holding one sub-folder per run."""
        return self.out_dir / "runs"

    def manifest(self) -> dict[str, Any]:
        """The campaign description written to ``campaign.json``."""
        return {
            "format": "dsv4-compare/1",
            "options": dataclasses.asdict(self.options),
            "runs": [r.to_dict() for r in self.runs],
            "variants": {k: v.to_dict() for k, v in self.variants.items()},
            "bench": {
                "name": self.bench.name,
                "num_prompts": self.bench.num_prompts,
                "argv_template": self.bench.fingerprint(),
                "env": dict(self.bench.env),
            },
            **self.extra,
        }

    def identity(self) -> dict[str, Any]:
        """What must not change between a campaign and its resumption."""
        return {
            "runs": [(r.label, r.variant) for r in self.runs],
            "variants": {
                k: {"serve_args": list(v.serve_args), "env": dict(v.env), "vllm": list(v.vllm)}
                for k, v in self.variants.items()
            },
            "bench": self.bench.fingerprint(),
        }


@dataclass
class RunResult:
    """The outcome of one run as stored in ``result.json``."""

    label: str
    variant: str
    status: str
    reason: str | None
    folder: Path
    metrics: dict[str, Any] = field(default_factory=dict)
    executed: bool = True

    @property
    def ok(self) -> bool:
        """True when the run completed with every request successful."""
        return self.status == "ok"
