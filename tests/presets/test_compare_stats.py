"""Statistics of dsv4 compare on constructed inputs with known answers."""

from __future__ import annotations

import math
import random

import pytest

from dsv4_presets.compare import stats
from dsv4_presets.compare.stats import (
    Pair,
    bootstrap_relative_change,
    pair_runs,
    relative_change,
    student_t_cdf,
    student_t_ppf,
    t_interval,
)

# Two-sided 97.5% quantiles of Student's t from published tables.
T_TABLE_975 = {
    1: 12.706204736,
    2: 4.302652730,
    3: 3.182446305,
    4: 2.776445105,
    5: 2.570581836,
    10: 2.228138852,
    30: 2.042272456,
    120: 1.979930405,
}


@pytest.mark.parametrize(("df", "expected"), sorted(T_TABLE_975.items()))
def test_t_quantile_matches_table(df: int, expected: float) -> None:
    assert student_t_ppf(0.975, df) == pytest.approx(expected, abs=1e-8)
    assert student_t_ppf(0.025, df) == pytest.approx(-expected, abs=1e-8)


def test_t_quantile_other_levels() -> None:
    assert student_t_ppf(0.995, 3) == pytest.approx(5.840909309, abs=1e-8)
    assert student_t_ppf(0.95, 7) == pytest.approx(1.894578605, abs=1e-8)
    # Large df tends to the normal quantile.
    assert student_t_ppf(0.975, 1e7) == pytest.approx(1.959963985, abs=1e-5)
    assert student_t_ppf(0.5, 4) == 0.0


def test_t_cdf_cauchy_closed_form() -> None:
    # df = 1 is the Cauchy distribution: F(t) = 1/2 + atan(t)/pi.
    rng = random.Random(1)
    for _ in range(50):
        t = rng.uniform(-30, 30)
        assert student_t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)


def test_t_cdf_df2_closed_form() -> None:
    # df = 2: F(t) = 1/2 + t / (2 sqrt(2 + t^2)).
    rng = random.Random(2)
    for _ in range(50):
        t = rng.uniform(-20, 20)
        assert student_t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)


def test_t_interval_known_answer() -> None:
    # mean 3, s = sqrt(2.5), n = 5, t(0.975, 4) = 2.776445105
    ci = t_interval([1.0, 2.0, 3.0, 4.0, 5.0], 0.95)
    half = 2.776445105 * math.sqrt(2.5) / math.sqrt(5)
    assert ci.defined
    assert ci.mean == pytest.approx(3.0)
    assert ci.low == pytest.approx(3.0 - half, abs=1e-8)
    assert ci.high == pytest.approx(3.0 + half, abs=1e-8)
    assert ci.std == pytest.approx(math.sqrt(2.5))


def test_t_interval_two_values() -> None:
    # n = 2: half width = 12.7062 * |a - b| / 2.
    ci = t_interval([-1.0, -3.0], 0.95)
    assert ci.low == pytest.approx(-2.0 - 12.706204736, abs=1e-7)
    assert ci.high == pytest.approx(-2.0 + 12.706204736, abs=1e-7)


def test_t_interval_undefined_for_one_pair() -> None:
    ci = t_interval([2.5])
    assert not ci.defined
    assert ci.low is None and ci.high is None
    assert ci.mean == 2.5
    assert "one pair" in (ci.undefined_reason or "")
    empty = t_interval([])
    assert not empty.defined and empty.mean is None


def test_t_interval_coverage_on_normal_data() -> None:
    rng = random.Random(7)
    hits = 0
    trials = 400
    for _ in range(trials):
        values = [rng.gauss(1.5, 2.0) for _ in range(4)]
        ci = t_interval(values, 0.9)
        assert ci.low is not None and ci.high is not None
        hits += ci.low <= 1.5 <= ci.high
    # Exact coverage is 90%; 400 trials put the estimate within ~ +-4.5% (3 sigma).
    assert 0.85 <= hits / trials <= 0.95


def test_bad_confidence_and_q() -> None:
    with pytest.raises(ValueError, match="confidence"):
        t_interval([1.0, 2.0], 1.0)
    with pytest.raises(ValueError, match="q must"):
        student_t_ppf(1.0, 3)
    with pytest.raises(ValueError, match="df must"):
        student_t_ppf(0.9, 0)


def test_relative_change_seed_numbers() -> None:
    # The seed's A/B/A: A1 638.67, B 629.61, A2 639.44 tokens/s.
    baseline = (638.67 + 639.44) / 2
    assert baseline == pytest.approx(639.055)
    assert relative_change(629.61, baseline) == pytest.approx(-1.47796, abs=1e-4)
    tpot_baseline = (102.26 + 101.88) / 2
    assert relative_change(104.80, tpot_baseline) == pytest.approx(2.67464, abs=1e-4)
    with pytest.raises(ValueError, match="baseline"):
        relative_change(1.0, 0.0)


def test_pair_runs_aba_and_abba() -> None:
    aba = [("A1", "A"), ("B1", "B"), ("A2", "A")]
    assert pair_runs(aba, dict.fromkeys(["A1", "B1", "A2"], True)) == [Pair("B1", ("A1", "A2"))]
    abba = [("A1", "A"), ("B1", "B"), ("B2", "B"), ("A2", "A")]
    got = pair_runs(abba, dict.fromkeys(["A1", "B1", "B2", "A2"], True))
    assert got == [Pair("B1", ("A1", "A2")), Pair("B2", ("A1", "A2"))]


def test_pair_runs_failed_runs() -> None:
    seq = [("A1", "A"), ("B1", "B"), ("A2", "A"), ("A3", "A"), ("B2", "B"), ("A4", "A")]
    ok = {"A1": True, "B1": True, "A2": False, "A3": True, "B2": False, "A4": True}
    got = pair_runs(seq, ok)
    # B1 keeps A1 only; A2 is named as missing; the failed B2 is not paired at all.
    assert got == [Pair("B1", ("A1",), ("A2",))]
    ok_none = {"A1": False, "B1": True, "A2": False}
    lonely = pair_runs(seq[:3], ok_none)
    assert lonely == [Pair("B1", (), ("A1", "A2"))]
    assert not lonely[0].complete
    with pytest.raises(ValueError, match="variant"):
        pair_runs([("C1", "C")], {})


def test_bootstrap_constant_samples_give_exact_interval() -> None:
    # Every A request 10 ms, every B request 12 ms: the change is exactly +20%.
    samples = {
        "A1": [[10.0]] * 5,
        "B1": [[12.0]] * 7,
        "A2": [[10.0]] * 6,
    }
    ci = bootstrap_relative_change([Pair("B1", ("A1", "A2"))], samples, resamples=200, seed=3)
    assert ci.defined
    assert ci.estimate == pytest.approx(20.0)
    assert ci.low == pytest.approx(20.0)
    assert ci.high == pytest.approx(20.0)


def test_bootstrap_point_estimate_is_mean_of_pair_changes() -> None:
    rng = random.Random(5)
    samples = {k: [[rng.uniform(5, 15)] for _ in range(20)] for k in ("A1", "B1", "A2", "B2", "A3")}
    pairs = [Pair("B1", ("A1", "A2")), Pair("B2", ("A2", "A3"))]
    means = {k: sum(v[0] for v in s) / len(s) for k, s in samples.items()}
    expected = (
        relative_change(means["B1"], (means["A1"] + means["A2"]) / 2)
        + relative_change(means["B2"], (means["A2"] + means["A3"]) / 2)
    ) / 2
    ci = bootstrap_relative_change(pairs, samples, resamples=300, seed=1)
    assert ci.estimate == pytest.approx(expected)
    assert ci.low is not None and ci.high is not None
    assert ci.low < ci.estimate < ci.high


def test_bootstrap_pools_itl_clusters() -> None:
    # Per-request ITL lists: the run mean is over all ITLs, not the mean of request means.
    samples = {"A1": [[1.0, 1.0, 1.0], [4.0]], "B1": [[2.0], [2.0, 2.0]]}
    ci = bootstrap_relative_change([Pair("B1", ("A1",))], samples, resamples=50)
    # A1 pooled mean = 7/4 = 1.75; B1 = 2; change = +14.2857%.
    assert ci.estimate == pytest.approx((2.0 - 1.75) / 1.75 * 100)


def test_bootstrap_coverage_on_known_shift() -> None:
    # True TPOT means: A 10 ms, B 11 ms -> +10%.  Percentile bootstrap on 60 requests
    # per run should cover the truth in most of the repetitions.
    rng = random.Random(11)
    hits = 0
    trials = 60
    for t in range(trials):
        samples = {
            "A1": [[rng.gauss(10.0, 1.0)] for _ in range(60)],
            "B1": [[rng.gauss(11.0, 1.0)] for _ in range(60)],
            "A2": [[rng.gauss(10.0, 1.0)] for _ in range(60)],
        }
        ci = bootstrap_relative_change(
            [Pair("B1", ("A1", "A2"))], samples, confidence=0.9, resamples=300, seed=t
        )
        assert ci.low is not None and ci.high is not None
        hits += ci.low <= 10.0 <= ci.high
    assert hits / trials >= 0.75


def test_bootstrap_undefined_cases() -> None:
    assert not bootstrap_relative_change([], {}).defined
    one_request = {"A1": [[1.0]], "B1": [[2.0], [2.0]]}
    ci = bootstrap_relative_change([Pair("B1", ("A1",))], one_request)
    assert not ci.defined and "A1" in (ci.undefined_reason or "")
    missing = bootstrap_relative_change([Pair("B1", ("A1",))], {"B1": [[1.0], [2.0]]})
    assert not missing.defined and "no per-request samples" in (missing.undefined_reason or "")
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_relative_change([Pair("B1", ("A1",))], one_request, resamples=1)


def test_mean_and_std_reject_short_input() -> None:
    with pytest.raises(ValueError, match="empty"):
        stats.mean([])
    with pytest.raises(ValueError, match="at least 2"):
        stats.sample_std([1.0])
