"""Run a comparison campaign: one real vLLM server per run, in order, resumable.

For every planned run the runner

1. picks a free port and starts ``vllm serve`` as its own process group
   (``start_new_session``), its output going to ``server.log``;
2. waits for ``GET /health`` to answer 200 before a deadline, failing the run
   when the deadline passes or the server exits first;
3. sends warm-up completions, then runs ``vllm bench serve`` with an explicit
   result file (``bench.json``, saved with ``--save-detailed``) under its own
   deadline, watching the server meanwhile;
4. stops the server by its PID: SIGTERM to its process group, SIGKILL after
   the grace period, until no process of the group is left;
5. reads from ``server.log`` which vLLM served the run and whether the
   dsv4-attention plugin was active (:mod:`.server_log`);
6. waits for GPU memory to come back to what it was before the start
   (``nvidia-smi``; where there is none, the step is skipped and recorded).

The process plumbing is in :mod:`.process`, the run folder's format in
:mod:`.rundir`: everything about the run is written into
``runs/.NN-LABEL.partial`` and renamed to ``runs/NN-LABEL`` only when the run
is over, so a folder with the final name is always complete.  A later
invocation skips finished runs, kills a server orphaned by a killed campaign
(its PID is in the partial folder) and discards the partial folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..bench import bench_verdict
from ..local_http import get as http_get
from ..local_http import post_json as http_post_json
from .campaign import (
    Campaign,
    RunResult,
)
from .process import (
    free_port,
    gpu_memory_used_mib,
    host_versions,
    kill_orphan,
    process_start_time,
    start_in_group,
    stop_process_group,
)
from .progress import Progress
from .rundir import (
    BENCH_FILE,
    BENCH_LOG,
    CAMPAIGN_FILE,
    PARTIAL_SUFFIX,
    RESULT_FILE,
    SERVER_LOG,
    SERVER_PID_FILE,
    VERSIONS_FILE,
    load_result,
    partial_folder,
    read_bench_metrics,
    recorded_environment,
    tail,
    write_json,
)
from .server_log import read_server_log
from .spec import PlannedRun

__all__ = ["run_campaign"]


# --------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------


class _RunFailed(Exception):
    """A run could not produce a usable measurement; the message says why."""


class _Runner:
    def __init__(self, campaign: Campaign, progress: Progress):
        self.c = campaign
        self.o = campaign.options
        self.p = progress
        self._host_versions: dict[str, Any] | None = None

    # ---- process helpers -------------------------------------------------

    def _popen(
        self, argv: Sequence[str], env: Mapping[str, str], log: Path
    ) -> subprocess.Popen[bytes]:
        try:
            return start_in_group(argv, env, log)
        except OSError as exc:
            raise _RunFailed(f"could not start {argv[0]!r}: {exc}") from None

    def _sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def _wait_healthy(self, proc: subprocess.Popen[bytes], base_url: str) -> float:
        t0 = time.monotonic()
        deadline = t0 + self.o.health_timeout
        while True:
            code = proc.poll()
            if code is not None:
                raise _RunFailed(
                    f"server exited with code {code} before it was healthy "
                    f"(after {time.monotonic() - t0:.0f}s)"
                )
            status, _ = http_get(base_url + "/health", timeout=5)
            if status == 200:
                return time.monotonic() - t0
            if time.monotonic() >= deadline:
                raise _RunFailed(
                    f"health timeout: /health did not answer 200 within "
                    f"{self.o.health_timeout:.0f}s"
                )
            self.p.phase(f"waiting for /health ({time.monotonic() - t0:.0f}s)")
            self._sleep(self.o.poll_interval)

    def _warm_up(self, proc: subprocess.Popen[bytes], base_url: str, model: str) -> list[float]:
        times = []
        for i in range(self.o.warmup_requests):
            self.p.phase(f"warm-up request {i + 1}/{self.o.warmup_requests}")
            t0 = time.monotonic()
            status, body = http_post_json(
                base_url + "/v1/completions",
                {
                    "model": model,
                    "prompt": "Warm-up request.",
                    "max_tokens": self.o.warmup_max_tokens,
                    "temperature": 0.0,
                },
                timeout=min(600.0, self.o.bench_timeout),
            )
            if status != 200:
                code = proc.poll()
                died = f"; server exited with code {code}" if code is not None else ""
                raise _RunFailed(
                    f"warm-up request {i + 1} failed with HTTP {status}: "
                    f"{body[:200].decode(errors='replace')}{died}"
                )
            times.append(round(time.monotonic() - t0, 3))
        return times

    def _bench(
        self,
        server: subprocess.Popen[bytes],
        argv: Sequence[str],
        env: Mapping[str, str],
        log: Path,
    ) -> float:
        t0 = time.monotonic()
        proc = self._popen(argv, env, log)
        deadline = t0 + self.o.bench_timeout
        try:
            while proc.poll() is None:
                if server.poll() is not None:
                    raise _RunFailed(
                        f"server died during the benchmark (exit code {server.returncode})"
                    )
                if time.monotonic() >= deadline:
                    raise _RunFailed(f"benchmark did not finish within {self.o.bench_timeout:.0f}s")
                self.p.phase(f"benchmark running ({time.monotonic() - t0:.0f}s)")
                self._sleep(min(self.o.poll_interval, 0.5))
        finally:
            if proc.poll() is None:
                stop_process_group(proc, grace=10)
        if proc.returncode != 0:
            raise _RunFailed(f"vllm bench serve exited with code {proc.returncode}")
        if server.poll() is not None:
            raise _RunFailed(f"server died during the benchmark (exit code {server.returncode})")
        return time.monotonic() - t0

    def _wait_gpu_release(self, baseline: list[int] | None) -> dict[str, Any]:
        if baseline is None:
            return {"checked": False, "note": "nvidia-smi not found: no GPU memory to wait for"}
        t0 = time.monotonic()
        deadline = t0 + self.o.gpu_release_timeout
        used = gpu_memory_used_mib()
        released = False
        while used is not None:
            released = len(used) == len(baseline) and all(
                u <= b + self.o.gpu_release_margin_mib for u, b in zip(used, baseline, strict=True)
            )
            if released or time.monotonic() >= deadline:
                break
            self.p.phase("waiting for GPU memory to be released")
            self._sleep(self.o.poll_interval)
            used = gpu_memory_used_mib()
        outcome: dict[str, Any] = {
            "checked": True,
            "released": released,
            "baseline_mib": baseline,
            "used_mib": used,
            "seconds": round(time.monotonic() - t0, 3),
        }
        if not released:
            outcome["note"] = (
                f"GPU memory not back to baseline within {self.o.gpu_release_timeout:.0f}s"
            )
        return outcome

    # ---- one run ----------------------------------------------------------

    def run_one(self, run: PlannedRun, final: Path) -> RunResult:
        variant = self.c.variants[run.variant]
        partial = partial_folder(self.c.runs_dir, run.folder)
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
        host = self.o.host
        port = free_port(host)
        base_url = f"http://{host}:{port}"
        server_argv = variant.serve_argv(host, port)
        server_env = {**os.environ, **variant.env}
        bench_argv = self.c.bench.argv(
            base_url=base_url,
            model=variant.served_model,
            result_dir=str(partial),
            tokenizer=variant.tokenizer,
        )
        bench_env = {**os.environ, **self.c.bench.env}
        if self._host_versions is None:
            self._host_versions = host_versions()
        write_json(partial / "spec.json", {"run": run.to_dict(), **variant.to_dict()})
        write_json(
            partial / "command.json",
            {
                "server": server_argv,
                "server_shell": shlex.join(server_argv),
                "server_env_overrides": dict(variant.env),
                "bench": bench_argv,
                "bench_shell": shlex.join(bench_argv),
                "bench_env_overrides": dict(self.c.bench.env),
                "warmup": {
                    "requests": self.o.warmup_requests,
                    "max_tokens": self.o.warmup_max_tokens,
                    "endpoint": "/v1/completions",
                },
                "base_url": base_url,
            },
        )
        write_json(
            partial / "environment.json",
            {
                "server": recorded_environment(server_env),
                "bench": recorded_environment(bench_env),
            },
        )
        result: dict[str, Any] = {
            "label": run.label,
            "variant": run.variant,
            "index": run.index,
            "display": variant.spec.display,
            "port": port,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "status": "failed",
            "reason": None,
            "timings": {},
        }
        versions = dict(self._host_versions)
        baseline = gpu_memory_used_mib()
        server: subprocess.Popen[bytes] | None = None
        server_log = partial / SERVER_LOG
        t_run = time.monotonic()
        try:
            try:
                self.p.phase("starting server")
                server = self._popen(server_argv, server_env, server_log)
                write_json(
                    partial / SERVER_PID_FILE,
                    {
                        "pid": server.pid,
                        "start_time": process_start_time(server.pid),
                        "argv": server_argv,
                    },
                )
                result["timings"]["startup_s"] = round(self._wait_healthy(server, base_url), 3)
                status, body = http_get(base_url + "/version", timeout=10)
                if status == 200:
                    with contextlib.suppress(ValueError):
                        versions["vllm_server"] = json.loads(body).get("version")
                result["timings"]["warmup_s"] = self._warm_up(
                    server, base_url, variant.served_model
                )
                result["timings"]["bench_s"] = round(
                    self._bench(server, bench_argv, bench_env, partial / BENCH_LOG), 3
                )
                bench_path = partial / BENCH_FILE
                if not bench_path.is_file():
                    raise _RunFailed(f"vllm bench serve wrote no result file {BENCH_FILE}")
                try:
                    data = json.loads(bench_path.read_text())
                except ValueError as exc:
                    raise _RunFailed(f"{BENCH_FILE} is not valid JSON: {exc}") from None
                result["metrics"] = read_bench_metrics(data)
                why = bench_verdict(data, self.c.bench.num_prompts)
                if why is not None:
                    raise _RunFailed(why)
                result["status"] = "ok"
            except _RunFailed as exc:
                result["reason"] = str(exc)
        finally:
            if server is not None:
                self.p.phase("stopping server")
                result["server"] = stop_process_group(server, self.o.stop_grace)
        result["served_by"] = _served_by(server_log, versions.get("vllm_server"))
        versions["served_by"] = result["served_by"]
        result["gpu_release"] = self._wait_gpu_release(baseline)
        result["timings"]["total_s"] = round(time.monotonic() - t_run, 3)
        result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        if result["status"] != "ok":
            result["log_tail"] = tail(server_log)
            bench_log = partial / BENCH_LOG
            if bench_log.exists():
                result["bench_log_tail"] = tail(bench_log, 20)
        write_json(partial / VERSIONS_FILE, versions)
        write_json(partial / RESULT_FILE, result)
        with contextlib.suppress(FileNotFoundError):
            (partial / SERVER_PID_FILE).unlink()
        os.rename(partial, final)
        return RunResult(
            run.label,
            run.variant,
            result["status"],
            result["reason"],
            final,
            result.get("metrics", {}),
        )

    def discard_partial(self, run: PlannedRun) -> None:
        partial = partial_folder(self.c.runs_dir, run.folder)
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)


def _served_by(server_log: Path, api_version: Any) -> dict[str, Any]:
    """Which vLLM served the run and whether the dsv4-attention plugin was active in it.

    Both come from the server's own log (:mod:`.server_log`); the version
    falls back to ``GET /version`` only when the log has no start-up line.
    """
    seen = read_server_log(server_log)
    version, source = seen["vllm_version"], "server.log"
    if version is None and isinstance(api_version, str):
        version, source = api_version, "GET /version"
    return {
        "vllm_version": version,
        "vllm_version_source": source if version is not None else None,
        "plugin": seen["plugin"],
    }


def _check_manifest(campaign: Campaign) -> None:
    path = campaign.out_dir / CAMPAIGN_FILE
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except ValueError as exc:
            raise ValueError(f"--out: {path} is not valid JSON ({exc}); use a new --out") from None
        old_identity = old.get("identity")
        new_identity = json.loads(json.dumps(campaign.identity()))
        if old_identity != new_identity:
            diffs = [k for k in new_identity if (old_identity or {}).get(k) != new_identity[k]]
            raise ValueError(
                f"--out: {campaign.out_dir} holds a different campaign (differs in: "
                f"{', '.join(diffs) or 'format'}); resume only with the same --a/--b/--pattern/"
                f"--repeats/--bench, or choose a new --out"
            )
        return
    campaign.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(
        path,
        {
            **campaign.manifest(),
            "identity": campaign.identity(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    )


def run_campaign(campaign: Campaign, progress: Progress | None = None) -> list[RunResult]:
    """Execute (or resume) every planned run in order and return their outcomes.

    Raises :class:`CampaignInterrupted` when interrupted; the run in progress
    is stopped and its partial folder removed, finished runs are kept.
    """
    progress = progress or Progress(len(campaign.runs))
    _check_manifest(campaign)
    campaign.runs_dir.mkdir(parents=True, exist_ok=True)
    runner = _Runner(campaign, progress)
    # Servers orphaned by a campaign that was killed outright.
    for pid_file in sorted(campaign.runs_dir.glob(f".*{PARTIAL_SUFFIX}/{SERVER_PID_FILE}")):
        what = kill_orphan(pid_file, grace=campaign.options.stop_grace)
        if what:
            progress.event(what)
    for stale in sorted(campaign.runs_dir.glob(f".*{PARTIAL_SUFFIX}")):
        progress.event(f"discarding unfinished run folder {stale.name}")
        shutil.rmtree(stale, ignore_errors=True)

    results: list[RunResult] = []
    for position, run in enumerate(campaign.runs, start=1):
        final = campaign.runs_dir / run.folder
        old = load_result(final)
        if old is not None and (old.get("status") == "ok" or not campaign.options.retry_failed):
            progress.run_skipped(run.label, f"already {old.get('status')} (resumed)")
            results.append(
                RunResult(
                    run.label,
                    run.variant,
                    str(old.get("status")),
                    old.get("reason"),
                    final,
                    old.get("metrics", {}),
                    executed=False,
                )
            )
            continue
        if final.exists():
            attempt = 1
            while final.with_name(f"{final.name}.failed-{attempt}").exists():
                attempt += 1
            keep = final.with_name(f"{final.name}.failed-{attempt}")
            os.rename(final, keep)
            progress.event(f"{run.label}: retrying; earlier attempt kept as {keep.name}")
        variant = campaign.variants[run.variant]
        progress.run_started(position, run.label, f"variant {variant.spec.display}")
        try:
            outcome = runner.run_one(run, final)
        except BaseException:
            runner.discard_partial(run)
            raise
        summary = (
            f"ok: {outcome.metrics.get('output_throughput', float('nan')):.2f} tok/s, "
            f"mean TPOT {outcome.metrics.get('mean_tpot_ms', float('nan')):.2f} ms"
            if outcome.ok
            else f"FAILED: {outcome.reason} (log: {final / SERVER_LOG})"
        )
        progress.run_finished(run.label, summary)
        results.append(outcome)
    return results
