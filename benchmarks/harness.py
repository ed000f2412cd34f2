"""Shared benchmark harness: check each provider, then time it, side by side.

A benchmark *case* is one shape of one kernel.  It carries its providers (our
kernel, the upstream launch design reimplemented, ...) and the number of bytes
that must move at least (each input read once, each output written once).  The
``floor`` provider is that byte count over the device-to-device copy bandwidth
measured in the same run.

For every provider the harness (1) poisons its outputs (preallocated
buffers the provider writes into: ``out=`` buffers, the cache), (2) runs it
once, (3) checks every element of those buffers against the reference, and
only then (4) times it with ``triton.testing.do_bench`` (median and the
20th/80th percentiles, in microseconds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import subprocess
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

FLOOR = "floor"
SAME_BYTES_COPY = "torch-copy-same-bytes"


@dataclasses.dataclass
class Provider:
    """One implementation of a case's operation, bound to prepared inputs."""

    name: str
    run: Callable[[], object]
    # Overwrites the outputs with a sentinel before the checked run.
    poison: Callable[[], None]
    # Raises AssertionError when the outputs of the last run are wrong.
    check: Callable[[], None]


@dataclasses.dataclass
class BenchCase:
    """One kernel at one shape, with its providers and bytes-moved floor."""

    kernel: str
    case: str
    tokens: int
    floor_bytes: int
    providers: list[Provider]
    params: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Result:
    kernel: str
    provider: str
    case: str
    tokens: int
    p20_us: float
    p50_us: float
    p80_us: float
    floor_us: float
    floor_bytes: int
    params: dict[str, Any]


ROOT = Path(__file__).resolve().parent.parent  # the project's checkout


def git_sha(root: Path = ROOT) -> str:
    """The project's commit, as recorded with every result.

    ``DSV4_GIT_SHA`` when set (a copy of the tree without git, e.g. on a GPU
    machine); else ``git -C root`` when ``root`` is the top of its own work
    tree (a copy of the tree inside another checkout must not record that
    checkout's commit), with ``-dirty`` for uncommitted changes to tracked
    files; else ``"unknown"``.
    """
    if os.environ.get("DSV4_GIT_SHA"):
        return os.environ["DSV4_GIT_SHA"]

    def git(*args: str) -> str:
        res = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
        )
        return res.stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root.resolve():
            return "unknown"
        sha = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def environment(device: torch.device) -> dict[str, str]:
    """GPU name and library versions recorded with every result."""
    import triton

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {
        "gpu": gpu or "cpu",
        "device": device.type,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "git_sha": git_sha(),
    }


@contextlib.contextmanager
def _read_only_l2_flush() -> Iterator[None]:
    """Make do_bench flush L2 by *reading* its 256 MB buffer instead of zeroing it.

    do_bench empties L2 before every timed call with ``cache.zero_()``, which
    leaves L2 full of dirty lines; the timed kernel then pays to write back up
    to ~60 MB that are not its own (about 12 us on an H200, the same for every
    provider, but enough to hide the floor).  A read evicts our data just as
    well and leaves L2 clean.  Everything else is do_bench as shipped.
    """
    from triton import runtime

    driver = runtime.driver.active
    original = driver.clear_cache
    sink = torch.empty((), dtype=torch.int64, device="cuda")

    def clear_cache(cache: torch.Tensor) -> None:
        torch.sum(cache.view(torch.int32), dim=0, dtype=torch.int64, out=sink)

    driver.clear_cache = clear_cache
    try:
        yield
    finally:
        driver.clear_cache = original


def _time_us(fn: Callable[[], object], device: torch.device, rep_ms: int) -> tuple[float, ...]:
    if device.type == "cuda":
        import triton.testing

        with _read_only_l2_flush():
            q = triton.testing.do_bench(fn, warmup=25, rep=rep_ms, quantiles=[0.2, 0.5, 0.8])
        return tuple(float(x) * 1e3 for x in q)
    # CPU smoke: wall clock, a handful of repeats.
    import time

    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return times[1], times[2], times[3]


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, rep_ms: int = 200) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    if device.type != "cuda":
        nbytes = 64 << 20
    src = torch.empty(nbytes // 4, dtype=torch.int32, device=device).random_()
    dst = torch.empty_like(src)
    _, p50, _ = _time_us(lambda: dst.copy_(src), device, rep_ms)
    return 2 * nbytes / (p50 * 1e-6)


def same_bytes_copy(floor_bytes: int, device: torch.device) -> Provider:
    """A torch device-to-device copy moving ``floor_bytes`` (half read, half written).

    A yardstick in the same run: what one launch moving exactly a case's floor
    bytes costs under the same timing (launch, ramp-up and L2 effects included),
    where the ``floor`` provider assumes the bandwidth of a 2 GiB copy.
    """
    src = torch.randint(0, 256, (max(floor_bytes // 2, 1),), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def check() -> None:
        assert torch.equal(dst, src), "copy differs"

    def poison() -> None:  # every byte differs from what the copy must write
        torch.bitwise_not(src, out=dst)

    return Provider(SAME_BYTES_COPY, lambda: dst.copy_(src), poison, check)


_SAID: set[str] = set()
# (peer, why) for every peer said not to run in this process, in the order said
NOT_RUN: list[tuple[str, str]] = []


def say_once(line: str, log: Callable[[str], None] = print) -> None:
    """Log ``line`` the first time this process is asked to (a provider that cannot run
    is said once per run, not once per case or per kernel)."""
    if line not in _SAID:
        _SAID.add(line)
        log(line)


def not_run(peer: str, why: str, log: Callable[[str], None] = print) -> None:
    """Say once that ``peer`` did not run, and why: ``"FlashMLA: not run (why)"`` (and
    remember it in :data:`NOT_RUN` for the run's table)."""
    line = f"{peer}: not run ({why})"
    if line not in _SAID:
        NOT_RUN.append((peer, why))
    say_once(line, log)


def progress_line(r: Result, unit: str = "us") -> str:
    """The line logged when a provider of a case has been checked and timed."""
    return f"  {r.kernel:<40} {r.case:<22} {r.provider:<26} p50 {r.p50_us:9.2f} {unit}"


def run_cases(
    cases: Iterable[BenchCase],
    device: torch.device,
    bandwidth: float,
    rep_ms: int = 100,
    log: Callable[[str], None] = print,
) -> list[Result]:
    """Check, then time every provider of every case; add the floor provider."""
    results: list[Result] = []
    for case in cases:
        floor_us = case.floor_bytes / bandwidth * 1e6
        for prov in case.providers:
            prov.poison()
            prov.run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            try:
                prov.check()
            except AssertionError as exc:
                raise AssertionError(
                    f"{case.kernel}/{case.case}: provider {prov.name} gave wrong output: {exc}"
                ) from exc
            p20, p50, p80 = _time_us(prov.run, device, rep_ms)
            result = Result(
                case.kernel,
                prov.name,
                case.case,
                case.tokens,
                p20,
                p50,
                p80,
                floor_us,
                case.floor_bytes,
                case.params,
            )
            results.append(result)
            log(progress_line(result))
        results.append(
            Result(
                case.kernel,
                FLOOR,
                case.case,
                case.tokens,
                floor_us,
                floor_us,
                floor_us,
                floor_us,
                case.floor_bytes,
                case.params,
            )
        )
    return results


def write_jsonl(results: Sequence[Result], env: dict[str, str], path: Path) -> None:
    """One JSON object per (kernel, provider, case), with the environment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in results:
            row = dataclasses.asdict(r)
            row.update(env)
            f.write(json.dumps(row, sort_keys=True) + "\n")
