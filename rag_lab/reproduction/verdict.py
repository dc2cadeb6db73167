"""The one rule that turns two rows' per-seed numbers into a verdict: no section decides "A beats B" its own way.
`RULE` states it, and docs/generated/reproduction.md prints that statement."""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from scipy import stats

ALPHA = 0.05
TOLERANCE = 1.0
MIN_SEEDS = 3
BEATS, LEVEL, UNDECIDED = "beats", "level", "undecided"
RULE = f"""\
"A beats B" is a verdict only if a paired test over seeds says so. The two rows ran on the same seeds and worlds; their
values are paired by seed and the per-seed differences A - B go through a two-sided paired t-test (the t and p of
`scipy.stats.ttest_rel`). Where the row compared was picked from m variants (the best of several), or m claims form
one family, the p-values are Holm-adjusted over the m (one comparison of the family alone: Bonferroni, m p, which
Holm never exceeds) and the confidence interval of the mean difference is taken at level 1 - alpha / m. Three words:

- **beats**: at least {MIN_SEEDS} paired seeds and the adjusted p below alpha = {ALPHA}; the row with the higher mean
  beats the other.
- **level**: the test does not reject and the whole confidence interval lies within ±{TOLERANCE:g} (points of the
  metric); identical per-seed values are level.
- **undecided**: fewer than {MIN_SEEDS} paired seeds (two seeds give the t-test one degree of freedom and an sd read
  off one difference), or the test does not reject while the interval reaches beyond the tolerance: the seeds cannot
  tell a win from a tie.

Per-seed differences that are all equal and not zero (a metric counted in whole questions makes that happen by
chance) leave the t-test no spread to judge: there p is the exact sign test's, 2 x 0.5^n, so such a difference decides
only from 6 seeds on.

Each verdict reports both rows' mean ± sd, the per-seed differences, t, p (and the adjusted p) and n. A paper's claim
("reproduces", "reproduced", "reached") holds only where the rule orders the rows as the paper does; a threshold the
claim adds (a share of a gap, a 4-point gain) is checked on the means besides. The rule is
`rag_lab/reproduction/verdict.py`; `python scripts/verdict.py --a NAME V ... --b NAME V ... [--m M]` applies it to
per-seed numbers copied from a doc."""


@dataclass(frozen=True)
class Verdict:
    """One comparison under the rule: the rows' paired values, the test and the word."""
    a: str
    b: str
    a_values: tuple[float, ...]
    b_values: tuple[float, ...]
    word: str
    winner: Optional[str]
    t: Optional[float]
    p: Optional[float]
    p_adjusted: Optional[float]
    ci: Optional[tuple[float, float]]
    m: int
    alpha: float
    tolerance: float
    reason: str

    @property
    def n(self) -> int:
        return len(self.a_values)

    @property
    def diffs(self) -> tuple[float, ...]:
        return tuple(x - y for x, y in zip(self.a_values, self.b_values))

    @property
    def mean_diff(self) -> Optional[float]:
        return statistics.mean(self.diffs) if self.diffs else None

    def phrase(self) -> str:
        """`A beats B`, `level` or `undecided`, as a table cell or a bold verdict says it."""
        if self.word == BEATS:
            return f"{self.winner} beats {self.b if self.winner == self.a else self.a}"
        return self.word

    def test(self) -> str:
        """The test that decided, as `paired t T, p P` (the sign test where every difference is equal); "" untested."""
        if self.p is None:
            return ""
        if math.isfinite(self.t):
            return f"paired t {self.t:.2f}, p {self.p:.3f}"
        return f"every difference equal: sign test p {self.p:.3f}"

    def summary(self) -> str:
        """The verdict with what it rests on: each row's mean ± sd, the per-seed differences, t, p, n, the level."""
        def row(name: str, values: tuple[float, ...]) -> str:
            sd = f" ± {statistics.stdev(values):.1f}" if len(values) > 1 else ""
            return f"{name} {statistics.mean(values):.1f}{sd}" if values else f"{name} -"

        parts = [f"{row(self.a, self.a_values)} vs {row(self.b, self.b_values)}, n {self.n} paired seeds"]
        if self.diffs:
            parts.append("per-seed differences " + " / ".join(f"{d:+.1f}" for d in self.diffs))
        if self.p is not None:
            test = self.test()
            if self.m > 1:
                test += f" (Holm over {self.m}: {self.p_adjusted:.3f})"
            parts.append(test)
        if self.ci is not None:
            level = 100 * (1 - self.alpha / self.m)
            parts.append(f"{level:.3g}% CI of the difference [{self.ci[0]:+.1f}, {self.ci[1]:+.1f}]")
        text = f"{self.phrase()} ({'; '.join(parts)}; alpha {self.alpha:g}, tolerance ±{self.tolerance:g})"
        return f"{text}: {self.reason}" if self.reason else text


def ordered(verdict: Verdict, better: str) -> Optional[bool]:
    """A claim that `better` is above the other row, under the rule: True, False (the other row wins, or the rows are
    level), None (undecided)."""
    return None if verdict.word == UNDECIDED else verdict.winner == better


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment: the i-th smallest p times (m - i + 1), made monotone, capped at 1; same order."""
    m = len(pvalues)
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda j: pvalues[j])):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def _test(diffs: list[float], confidence: float) -> tuple[float, float, tuple[float, float]]:
    """t, two-sided p and the CI of the mean difference; differences that do not vary take the sign test's p."""
    mean, sd = statistics.mean(diffs), statistics.stdev(diffs)
    if sd <= 1e-9 * max(1.0, max(abs(d) for d in diffs)):  # equal up to float rounding (0.597 * 100 - 0.634 * 100)
        return (0.0, 1.0, (mean, mean)) if mean == 0.0 else (math.copysign(math.inf, mean), 2 * 0.5 ** len(diffs),
                                                              (mean, mean))
    se, dof = sd / math.sqrt(len(diffs)), len(diffs) - 1
    t = mean / se  # ttest_rel's statistic, without its precision warning on nearly constant differences
    half = float(stats.t.ppf(0.5 + confidence / 2, dof)) * se
    return t, float(2 * stats.t.sf(abs(t), dof)), (mean - half, mean + half)


def _decide(a: str, av: tuple, b: str, bv: tuple, p_adjusted: Optional[float], t, p, ci, m: int, alpha: float,
            tolerance: float) -> Verdict:
    if p_adjusted is None:
        word, winner, reason = UNDECIDED, None, f"fewer than {MIN_SEEDS} paired seeds ({len(av)})"
    elif p_adjusted < alpha:
        word, winner, reason = BEATS, (a if t > 0 else b), ""
    elif -tolerance <= ci[0] and ci[1] <= tolerance:
        word, winner, reason = LEVEL, None, ""
    else:
        word, winner, reason = UNDECIDED, None, "not significant, and the interval reaches beyond the tolerance"
    return Verdict(a, b, av, bv, word, winner, t, p, p_adjusted, ci, m, alpha, tolerance, reason)


def _paired(a_values: Sequence[float], b_values: Sequence[float]) -> tuple[tuple, tuple]:
    n = min(len(a_values), len(b_values))
    return tuple(a_values[:n]), tuple(b_values[:n])


def compare(a: str, a_values: Sequence[float], b: str, b_values: Sequence[float], *, alpha: float = ALPHA,
            tolerance: float = TOLERANCE, m: int = 1) -> Verdict:
    """The rule on two rows whose values are in seed order (a row that ran fewer seeds pairs its first n); `m`: the
    comparisons in the family (Bonferroni, m p: Holm's bound for any one of them)."""
    av, bv = _paired(a_values, b_values)
    if len(av) < MIN_SEEDS:
        return _decide(a, av, b, bv, None, None, None, None, m, alpha, tolerance)
    t, p, ci = _test([x - y for x, y in zip(av, bv)], 1 - alpha / m)
    return _decide(a, av, b, bv, min(1.0, m * p), t, p, ci, m, alpha, tolerance)


def compare_variants(baseline: str, baseline_values: Sequence[float], variants: dict[str, Sequence[float]], *,
                     alpha: float = ALPHA, tolerance: float = TOLERANCE) -> dict[str, Verdict]:
    """Every variant against one baseline, Holm-adjusted over all of them (the family when the best one is picked; a
    variant with fewer than MIN_SEEDS paired seeds counts, with p 1, and is undecided)."""
    m = len(variants)
    pairs = {name: _paired(values, baseline_values) for name, values in variants.items()}
    tests = {name: _test([x - y for x, y in zip(av, bv)], 1 - alpha / m) if len(av) >= MIN_SEEDS else None
             for name, (av, bv) in pairs.items()}
    holm_p = holm([1.0 if test is None else test[1] for test in tests.values()])  # an untested variant: p 1
    adjusted = {name: q for (name, test), q in zip(tests.items(), holm_p) if test is not None}
    out = {}
    for name, (av, bv) in pairs.items():
        t, p, ci = tests[name] or (None, None, None)
        out[name] = _decide(name, av, baseline, bv, adjusted.get(name), t, p, ci, m, alpha, tolerance)
    return out


def main(argv: Optional[list[str]] = None) -> None:
    """`--a NAME V ... --b NAME V ...`: the verdict on per-seed numbers copied from a doc, printed as one line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a", nargs="+", required=True, metavar="NAME_THEN_VALUES", help="row A: a name, then its "
                        "per-seed values in seed order")
    parser.add_argument("--b", nargs="+", required=True, metavar="NAME_THEN_VALUES", help="row B, the same seeds")
    parser.add_argument("--m", type=int, default=1,
                        help="comparisons in the family (the variants the best was picked from)")
    parser.add_argument("--alpha", type=float, default=ALPHA)
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="the largest difference called level")
    args = parser.parse_args(argv)
    try:
        a, b = [float(v) for v in args.a[1:]], [float(v) for v in args.b[1:]]
    except ValueError as err:
        parser.error(f"--a / --b: a name, then numbers: {err}")
    if not a or not b:
        parser.error("--a and --b take a name and at least one value each")
    verdict = compare(args.a[0], a, args.b[0], b, alpha=args.alpha, tolerance=args.tolerance, m=args.m)
    print(verdict.summary())
