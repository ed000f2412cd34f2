"""Statistics for paired A/B/A serving comparisons, in plain Python.

Three pieces, each usable on its own and checked on constructed inputs:

* :func:`pair_runs` pairs every B run with its neighbouring A runs: the
  nearest A run before it and the nearest A run after it in the campaign
  order.  A neighbour that failed is left out of the baseline; a B run
  with no successful neighbour is unpaired.
* :func:`t_interval` is the Student t interval of a mean; over the
  per-pair relative changes it gives the *paired* interval.  With one pair
  the interval is undefined (there is no spread to estimate) and the
  function says so instead of inventing one.
* :func:`bootstrap_relative_change` resamples the requests inside every run
  (a stratified percentile bootstrap) to give an interval for the mean
  relative change from per-request latencies.  It captures request-to-request
  noise within runs, not run-to-run drift, so it is narrower than the paired
  interval and never a substitute for more repeats.

The t quantile is computed from the regularised incomplete beta function
(continued fraction) so that the package needs neither SciPy nor NumPy.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "BootstrapInterval",
    "Pair",
    "TInterval",
    "bootstrap_relative_change",
    "mean",
    "pair_runs",
    "relative_change",
    "sample_std",
    "student_t_cdf",
    "student_t_ppf",
    "t_interval",
]


def mean(values: Sequence[float]) -> float:
    """Arithmetic mean; ``ValueError`` for an empty sequence."""
    if len(values) == 0:
        raise ValueError("values must not be empty")
    return math.fsum(values) / len(values)


def sample_std(values: Sequence[float]) -> float:
    """Sample standard deviation (n - 1 in the denominator); needs two values."""
    if len(values) < 2:
        raise ValueError(f"values must hold at least 2 numbers, got {len(values)}")
    m = mean(values)
    return math.sqrt(math.fsum((v - m) ** 2 for v in values) / (len(values) - 1))


def relative_change(value: float, baseline: float) -> float:
    """``(value - baseline) / baseline`` in percent; ``baseline`` must be non-zero."""
    if baseline == 0:
        raise ValueError("baseline must be non-zero to form a relative change")
    return (value - baseline) / baseline * 100.0


# --------------------------------------------------------------------------
# Student t distribution
# --------------------------------------------------------------------------


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c = 1.0
    d = 1.0 - qab * x / qap
    d = tiny if abs(d) < tiny else d
    d = 1.0 / d
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = tiny if abs(d) < tiny else d
        c = 1.0 + aa / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = tiny if abs(d) < tiny else d
        c = 1.0 + aa / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta function I_x(a, b) for 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom (``df > 0``)."""
    if not df > 0:
        raise ValueError(f"df must be positive, got {df}")
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2.0, 0.5, x)
    return 1.0 - tail if t >= 0 else tail


def student_t_ppf(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom.

    Found by bisection on :func:`student_t_cdf` to about 1e-12.
    """
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must lie strictly between 0 and 1, got {q}")
    if not df > 0:
        raise ValueError(f"df must be positive, got {df}")
    if q == 0.5:
        return 0.0
    if q < 0.5:
        return -student_t_ppf(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < q:
        lo, hi = hi, hi * 2.0
        if hi > 1e12:
            raise ValueError(f"quantile {q} for df={df} is out of numerical range")
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if student_t_cdf(mid, df) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


class _Interval:
    """What both interval kinds share: a method name, bounds and a JSON form."""

    METHOD = ""
    low: float | None
    high: float | None

    @property
    def defined(self) -> bool:
        """True when ``low`` and ``high`` hold an interval."""
        return self.low is not None and self.high is not None

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form: the method, then every field in order."""
        return {"method": self.METHOD, **dataclasses.asdict(self)}  # type: ignore[call-overload]


@dataclass(frozen=True)
class TInterval(_Interval):
    """A Student t interval for a mean, or the reason it is undefined."""

    METHOD = "student-t over paired relative changes"

    n: int
    mean: float | None
    low: float | None
    high: float | None
    confidence: float
    std: float | None = None
    t_quantile: float | None = None
    undefined_reason: str | None = None


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence}")


def t_interval(values: Sequence[float], confidence: float = 0.95) -> TInterval:
    """Two-sided t interval ``mean ± t_{(1+c)/2, n-1} · s / √n`` of ``values``.

    With fewer than two values the interval is undefined and
    ``undefined_reason`` says why (``mean`` is still given for one value).
    """
    _check_confidence(confidence)
    n = len(values)
    if n == 0:
        return TInterval(0, None, None, None, confidence, undefined_reason="no complete pair")
    if n == 1:
        return TInterval(
            1,
            float(values[0]),
            None,
            None,
            confidence,
            undefined_reason=(
                "only one pair: a paired interval needs at least two pairs "
                "(run more repeats, e.g. --repeats 3)"
            ),
        )
    m = mean(values)
    s = sample_std(values)
    tq = student_t_ppf(0.5 + confidence / 2.0, n - 1)
    half = tq * s / math.sqrt(n)
    return TInterval(n, m, m - half, m + half, confidence, std=s, t_quantile=tq)


# --------------------------------------------------------------------------
# Pairing
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    """One B run and the A runs that form its baseline.

    ``b`` and the entries of ``a`` are run labels (``"B1"``, ``"A2"``);
    ``a_missing`` names neighbouring A runs left out because they failed.
    """

    b: str
    a: tuple[str, ...]
    a_missing: tuple[str, ...] = field(default=())

    @property
    def complete(self) -> bool:
        """True when at least one neighbouring A run succeeded."""
        return len(self.a) > 0


def pair_runs(sequence: Sequence[tuple[str, str]], ok: Mapping[str, bool]) -> list[Pair]:
    """Pair every successful B run with its neighbouring A runs.

    ``sequence`` lists ``(label, variant)`` in campaign order, variant ``"A"``
    or ``"B"``; ``ok[label]`` says whether the run succeeded.  For each B run
    the neighbours are the nearest A run before it and the nearest A run after
    it; failed neighbours go to ``a_missing``.  Failed B runs are not paired.
    """
    pairs: list[Pair] = []
    for i, (label, variant) in enumerate(sequence):
        if variant not in ("A", "B"):
            raise ValueError(f"sequence[{i}] has variant {variant!r}; expected 'A' or 'B'")
        if variant != "B" or not ok.get(label, False):
            continue
        neighbours: list[str] = []
        for j in range(i - 1, -1, -1):
            if sequence[j][1] == "A":
                neighbours.append(sequence[j][0])
                break
        for j in range(i + 1, len(sequence)):
            if sequence[j][1] == "A":
                neighbours.append(sequence[j][0])
                break
        good = tuple(n for n in neighbours if ok.get(n, False))
        bad = tuple(n for n in neighbours if not ok.get(n, False))
        pairs.append(Pair(label, good, bad))
    return pairs


# --------------------------------------------------------------------------
# Bootstrap over per-request samples
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class BootstrapInterval(_Interval):
    """A percentile bootstrap interval, or the reason it is undefined."""

    METHOD = "percentile bootstrap, requests resampled within each run"

    estimate: float | None
    low: float | None
    high: float | None
    confidence: float
    resamples: int
    seed: int
    undefined_reason: str | None = None


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (q in [0, 1]) of sorted values."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] * (1.0 - frac) + sorted_values[hi] * frac


def _pooled_mean(clusters: Sequence[Sequence[float]]) -> float:
    """Mean over all values of the given clusters (one cluster per request)."""
    total = 0.0
    count = 0
    for c in clusters:
        total += math.fsum(c)
        count += len(c)
    if count == 0:
        raise ValueError("no values to average")
    return total / count


def _statistic(pairs: Sequence[Pair], run_means: Mapping[str, float]) -> float:
    changes = []
    for p in pairs:
        baseline = mean([run_means[a] for a in p.a])
        changes.append(relative_change(run_means[p.b], baseline))
    return mean(changes)


def bootstrap_relative_change(
    pairs: Sequence[Pair],
    samples: Mapping[str, Sequence[Sequence[float]]],
    *,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> BootstrapInterval:
    """Interval for the mean relative change (%) of B vs its A baseline.

    ``samples[label]`` holds one run's per-request observations, one inner
    sequence per request (one TPOT value per request, or all of a request's
    inter-token latencies).  A run's statistic is the mean over all values of
    its requests.  The estimate is the mean over complete pairs of
    ``(mean(B) - mean(mean(A_k))) / mean(mean(A_k))``; each resample draws the
    requests of every run independently with replacement and recomputes it.
    """
    _check_confidence(confidence)
    if resamples < 10:
        raise ValueError(f"resamples must be at least 10, got {resamples}")

    def undefined(reason: str) -> BootstrapInterval:
        return BootstrapInterval(None, None, None, confidence, resamples, seed, reason)

    complete = [p for p in pairs if p.complete]
    if not complete:
        return undefined("no complete pair")
    labels = sorted({p.b for p in complete} | {a for p in complete for a in p.a})
    clusters: dict[str, list[Sequence[float]]] = {}
    for label in labels:
        if label not in samples:
            return undefined(f"run {label} has no per-request samples")
        usable = [c for c in samples[label] if len(c) > 0]
        if len(usable) < 2:
            return undefined(
                f"run {label} has {len(usable)} usable requests; the bootstrap needs at least 2"
            )
        clusters[label] = usable
    point = _statistic(complete, {k: _pooled_mean(v) for k, v in clusters.items()})
    rng = random.Random(seed)
    stats: list[float] = []
    for _ in range(resamples):
        means = {label: _pooled_mean(rng.choices(cs, k=len(cs))) for label, cs in clusters.items()}
        stats.append(_statistic(complete, means))
    stats.sort()
    alpha = 1.0 - confidence
    return BootstrapInterval(
        point,
        _percentile(stats, alpha / 2.0),
        _percentile(stats, 1.0 - alpha / 2.0),
        confidence,
        resamples,
        seed,
    )
