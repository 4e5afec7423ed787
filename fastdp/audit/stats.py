"""Statistics of the audits: Clopper–Pearson intervals, the empirical epsilon of a membership attack, and the
acceptance tests of the noise audit.

Failure probabilities. Every test statistic here has an exact null distribution under a correct implementation
(Kolmogorov–Smirnov against a fully specified continuous law, a chi-square variance test with known mean, exact
binomial intervals), so a threshold ``alpha`` is the probability that a correct implementation fails that one
statistic. The audits default to ``alpha = 1e-9`` per statistic: a run that evaluates fewer than 1000 of them
(the test suite and ``make audit`` do) fails a correct implementation with probability below 1e-6 (union bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

DEFAULT_ALPHA = 1e-9  # per statistic; < 1000 statistics per run -> family-wise failure probability < 1e-6


def clopper_pearson(successes: int, trials: int, alpha: float) -> tuple[float, float]:
    """Exact binomial confidence bounds (lo, hi) for the success probability p after ``successes`` of ``trials``,
    each one-sided at level ``alpha``: P(p < lo) <= alpha and P(p > hi) <= alpha (two-sided level 1 - 2 alpha).

    lo = Beta^-1(alpha; k, n - k + 1) (0 for k = 0), hi = Beta^-1(1 - alpha; k + 1, n - k) (1 for k = n)."""
    if not (isinstance(trials, (int, np.integer)) and trials >= 1):
        raise ValueError(f"trials must be an integer >= 1, got {trials!r}")
    if not 0 <= successes <= trials:
        raise ValueError(f"successes must be in [0, trials={trials}], got {successes}")
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5) (one-sided level of each bound), got {alpha}")
    k, n = int(successes), int(trials)
    lo = 0.0 if k == 0 else float(stats.beta.ppf(alpha, k, n - k + 1))
    hi = 1.0 if k == n else float(stats.beta.ppf(1 - alpha, k + 1, n - k))
    return lo, hi


def epsilon_lower_bound(
    true_positives: int, positives: int, false_positives: int, negatives: int, delta: float, confidence: float
) -> float:
    """Empirical epsilon lower bound of a membership test (Jagielski et al. 2020; Nasr et al. 2021), with
    probability >= ``confidence`` over the runs.

    A mechanism that is (epsilon, delta)-DP forces every test between its outputs on adjacent data sets to satisfy
    TPR <= e^eps FPR + delta and 1 - FPR <= e^eps (1 - TPR) + delta. With TPR >= TPR_lo and FPR <= FPR_hi
    (Clopper–Pearson, each one-sided at (1 - confidence) / 2, so both hold with probability >= ``confidence``):

        eps >= max(0, log((TPR_lo - delta) / FPR_hi), log((1 - delta - FPR_hi) / (1 - TPR_lo))).

    The test must be fixed before the counted runs (e.g. its threshold chosen on separate runs)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1), got {delta}")
    alpha = (1 - confidence) / 2
    tpr_lo, _ = clopper_pearson(true_positives, positives, alpha)
    _, fpr_hi = clopper_pearson(false_positives, negatives, alpha)
    bounds = [0.0]
    if tpr_lo - delta > 0 and fpr_hi > 0:
        bounds.append(math.log((tpr_lo - delta) / fpr_hi))
    if 1 - delta - fpr_hi > 0 and 1 - tpr_lo > 0:
        bounds.append(math.log((1 - delta - fpr_hi) / (1 - tpr_lo)))
    return max(bounds)


def best_threshold(scores_in: np.ndarray, scores_out: np.ndarray, delta: float, confidence: float) -> float:
    """The threshold t of the test "member iff score >= t" with the largest :func:`epsilon_lower_bound` on these
    (selection) runs, ties broken by the largest TPR - FPR; candidates are the midpoints between consecutive
    distinct scores. Use it on other runs."""
    scores_in, scores_out = np.asarray(scores_in, dtype=np.float64), np.asarray(scores_out, dtype=np.float64)
    values = np.unique(np.concatenate([scores_in, scores_out]))
    if values.size < 2:
        return float(values[0]) if values.size else 0.0
    candidates = (values[1:] + values[:-1]) / 2
    sorted_in, sorted_out = np.sort(scores_in), np.sort(scores_out)
    tp = scores_in.size - np.searchsorted(sorted_in, candidates, side="left")
    fp = scores_out.size - np.searchsorted(sorted_out, candidates, side="left")
    best, best_key = float(candidates[0]), (-1.0, -math.inf)
    seen: dict[tuple[int, int], float] = {}
    for t, k_in, k_out in zip(candidates, tp, fp, strict=True):
        counts = (int(k_in), int(k_out))
        if counts not in seen:
            seen[counts] = epsilon_lower_bound(counts[0], scores_in.size, counts[1], scores_out.size, delta,
                                               confidence)  # fmt: skip
        key = (seen[counts], counts[0] / scores_in.size - counts[1] / scores_out.size)
        if key > best_key:
            best, best_key = float(t), key
    return best


@dataclass(frozen=True)
class StandardNormalCheck:
    """Whether samples z_1..z_n (the standardised released noise of one tensor) are N(0, 1).

    ``ks_pvalue``: Kolmogorov–Smirnov test against N(0, 1) (exact null: the law is fully specified).
    ``std_ratio``: sqrt(mean z^2), the empirical std over the claimed one (known mean 0, so n degrees of freedom);
    under the null n std_ratio^2 ~ chi2_n, and [``std_lo``, ``std_hi``] is its two-sided acceptance interval at
    ``alpha``. Passes iff ks_pvalue >= alpha and std_lo <= std_ratio <= std_hi."""

    n: int
    mean: float
    std_ratio: float
    std_lo: float
    std_hi: float
    ks_statistic: float
    ks_pvalue: float
    alpha: float

    @property
    def passed(self) -> bool:
        return self.ks_pvalue >= self.alpha and self.std_lo <= self.std_ratio <= self.std_hi


def check_standard_normal(z: np.ndarray, alpha: float = DEFAULT_ALPHA) -> StandardNormalCheck:
    """KS test and chi-square std test of ``z`` against N(0, 1) (see :class:`StandardNormalCheck`)."""
    z = np.asarray(z, dtype=np.float64).reshape(-1)
    n = z.size
    if n < 2:
        raise ValueError(f"the noise check needs at least 2 samples, got {n}")
    ks = stats.kstest(z, "norm")
    std_lo = math.sqrt(stats.chi2.ppf(alpha / 2, n) / n)
    std_hi = math.sqrt(stats.chi2.ppf(1 - alpha / 2, n) / n)
    return StandardNormalCheck(n=n, mean=float(z.mean()), std_ratio=float(np.sqrt(np.mean(z * z))), std_lo=std_lo,
                               std_hi=std_hi, ks_statistic=float(ks.statistic), ks_pvalue=float(ks.pvalue),
                               alpha=alpha)  # fmt: skip
