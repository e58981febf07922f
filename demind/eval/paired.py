"""Paired tests at the unit that varies independently, one test per seed.

Two methods scored on the same queries give paired per-query scores. A test over those pairs
assumes the queries are independent. They often are not: the exclusion instrument's 420 test
queries are 83 texts over 21 (include, exclude) label combinations, and every query of one
combination shares its ground truth and its hard negatives, so one combination that a method
gets right or wrong moves 20 queries at once. Counting those 20 as 20 observations overstates
significance by orders of magnitude (pseudo-replication).

The rule here: per-query differences are averaged within their *unit* (the combination, the
scene, ...; each query its own unit where the queries are independent), and the test runs
across units. Seeds are never pooled into one count: a query scored under three seeds is one
query, not three; :func:`paired_per_seed` gives one test per seed, and a reader looks for the
same direction in each.

Tests: the exact two-sided sign test over units (:func:`demind.eval.metrics.sign_test_p`) and,
where scipy is installed, the Wilcoxon signed-rank test on the unit mean differences.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass

from demind.eval.metrics import sign_test_p


@dataclass(frozen=True)
class PairedTest:
    """One paired comparison of A against B over independent units."""

    unit: str                  # what one independent observation is: "query", "combination", ...
    n_units: int               # units compared (ties included)
    better: int                # units where A's mean score is above B's
    worse: int                 # units where A's mean score is below B's
    mean_diff: float           # mean over units of (A - B)
    p_sign: float              # exact two-sided sign test on better vs worse
    p_wilcoxon: float | None   # Wilcoxon signed-rank on the unit differences; None without scipy

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """``12/3 of 20 combinations, mean +0.041, sign p 0.035, Wilcoxon p 0.02``."""
        wilcoxon = "" if self.p_wilcoxon is None else f", Wilcoxon p {self.p_wilcoxon:.3g}"
        units = self.unit[:-1] + "ies" if self.unit.endswith("y") else self.unit + "s"
        return (f"{self.better}/{self.worse} of {self.n_units} {units}, mean {self.mean_diff:+.3g}, "
                f"sign p {self.p_sign:.3g}{wilcoxon}")


def unit_differences(a: Sequence[float], b: Sequence[float],
                     units: Sequence[Hashable] | None = None) -> dict[Hashable, float]:
    """Mean of (a[i] - b[i]) within each unit, in order of first appearance.

    a, b: per-query scores of two methods on the same queries in the same order (length Q).
    units: (Q,) the unit each query belongs to; None makes each query its own unit.
    """
    if len(a) != len(b):
        raise ValueError(f"the two methods scored different numbers of queries ({len(a)} vs {len(b)})")
    if units is None:
        units = range(len(a))
    elif len(units) != len(a):
        raise ValueError(f"{len(units)} unit labels for {len(a)} queries")
    grouped: dict[Hashable, list[float]] = {}
    for x, y, u in zip(a, b, units):
        grouped.setdefault(u, []).append(float(x) - float(y))
    return {u: statistics.fmean(d) for u, d in grouped.items()}


def _wilcoxon_p(diffs: list[float]) -> float | None:
    try:
        from scipy.stats import wilcoxon
    except ImportError:  # scipy is in the robust extra; the sign test still stands
        return None
    if all(d == 0 for d in diffs):
        return 1.0
    return float(wilcoxon(diffs).pvalue)


def paired_by_unit(a: Sequence[float], b: Sequence[float], units: Sequence[Hashable] | None = None,
                   unit: str = "query") -> PairedTest:
    """Paired test of A against B over independent units (see the module docstring).

    a, b: (Q,) per-query scores; units: (Q,) labels or None (each query independent); unit: the
    units' name in reports. Ties between unit means count in ``n_units`` but not in the sign test.
    """
    diffs = list(unit_differences(a, b, units).values())
    if not diffs:
        raise ValueError("no queries to compare")
    better, worse = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    return PairedTest(unit=unit, n_units=len(diffs), better=better, worse=worse,
                      mean_diff=statistics.fmean(diffs), p_sign=sign_test_p(better, worse),
                      p_wilcoxon=_wilcoxon_p(diffs))


def paired_per_seed(a_by_seed: Mapping[int, Sequence[float]], b_by_seed: Mapping[int, Sequence[float]],
                    units: Sequence[Hashable] | Mapping[int, Sequence[Hashable]] | None = None,
                    unit: str = "query") -> dict[int, PairedTest]:
    """One :func:`paired_by_unit` per seed that both methods have; counts are never summed over seeds.

    units: one (Q,) label list shared by every seed, a seed -> labels mapping, or None.
    """
    seeds = sorted(set(a_by_seed) & set(b_by_seed))
    if not seeds:
        raise ValueError("the two methods share no seed")
    out = {}
    for seed in seeds:
        seed_units = units.get(seed) if isinstance(units, Mapping) else units
        out[seed] = paired_by_unit(a_by_seed[seed], b_by_seed[seed], seed_units, unit)
    return out


def format_paired(tests: Mapping[int, PairedTest]) -> str:
    """``seed 0: 12/3 of 20 combinations, ...; seed 1: ...`` (one clause per seed)."""
    return "; ".join(f"seed {seed}: {test.describe()}" for seed, test in sorted(tests.items()))
