"""Sensitivity audit: no single example moves the noiseless released update by more than the claimed bound.

For a pair of adjacent batches (D, D'), differing in one example e (added, removed, or masked as padding), the
*noiseless* released update u = sum / b (the variant's own release with sigma = 0,
:func:`fastdp.audit.claims.noiseless`) must satisfy, for every sensitivity group g of the claim,

    ||u_g(D') - u_g(D)||_2 <= Delta_g / b     (up to fp rounding: ``tolerance``, relative)

The ratio ||u_g(D') - u_g(D)|| b / Delta_g is reported; its maximum over groups and pairs must be <= 1.

Pairs tried (worst cases for a clipping or bound bug): canaries with a huge input norm (1e6), with the label the
model finds least likely (on a huge and on an in-distribution input), and the worst of ``search`` random
candidates (input norms 1 to 1e6, every label); each added to a batch, present but masked as padding, and added
to a batch that already holds 8 copies of it (many copies of an extreme example: their gradients all align);
a batch of examples along one fixed direction (aligned gradients) plus one more; and ordinary examples removed.

DP-SGD-JL claims no fixed bound: its clip factors come from r random projections, so one example can move the
update by C ||g|| / M, M = sqrt(mean_j <g, v_j>^2) its norm estimate, and the accountant (Bu et al. 2021 Thm B.7)
assumes M / ||g|| ~ sqrt(chi2_r / r) for tangents v_j ~ N(0, I) drawn independently of the data. The audit
checks both: the change against C max(||g|| / M, z_floor) (z_floor: the smallest factor the accountant credits),
with g the example's exact gradient (``torch.func``) and M recomputed from the step's tangents, or the change's
own estimate M(change) against C (``_Auditor.jl_ratio``); and, over ``jl_steps`` steps, r (M / ||g||)^2 of a huge
canary (always clipped) against chi2_r with a Kolmogorov–Smirnov test at level ``alpha``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy import stats

from fastdp.algorithms import JL, Batch
from fastdp.algorithms.base import trainable_parameters
from fastdp.algorithms.dpsgd import per_example_gradients
from fastdp.algorithms.jl import NORM_EPS, draw_tangents
from fastdp.audit.claims import Claim, claim_of, noiseless
from fastdp.audit.setups import AuditCase, concat, synthetic_batch
from fastdp.audit.stats import DEFAULT_ALPHA

# relative slack for fp rounding, by the model's dtype: float64 (the audit's default; rounding ~1e-15) or float32
# (sums of a few dozen contributions, each clipped in fp32: rounding ~1e-6)
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}
HUGE = 1e6  # input norm of the extreme canaries
COPIES = 8  # copies of a canary already in the batch for the "copies" pairs
SEARCH_NORMS = (1.0, 30.0, 1e3, 1e6)


@dataclass
class Observation:
    """One adjacent pair: ``change`` = ||u(D') - u(D)|| b over all tensors (on the sum; a non-private variant: the
    change of its mean), ``ratios`` per group (change of the group / Delta_g; empty without a claim), ``jl_ratio``
    (JL: ``_Auditor.jl_ratio``, the change against C max(Z, z_floor))."""

    scenario: str
    change: float
    ratios: tuple[float, ...] = ()
    jl_ratio: float | None = None

    @property
    def bound_ratio(self) -> float:
        """The ratio that must stay <= 1: JL's per-step bound, else the worst group's."""
        if self.jl_ratio is not None:
            return self.jl_ratio
        return max(self.ratios, default=math.nan)


@dataclass
class JLDistribution:
    """JL's norm-estimate law: KS test of r (M_k / ||g||)^2 over ``steps`` steps against chi2_r."""

    projections: int
    steps: int
    ks_pvalue: float
    alpha: float
    all_clipped: bool

    @property
    def passed(self) -> bool:
        return self.ks_pvalue >= self.alpha and self.all_clipped


@dataclass
class SensitivityAudit:
    case: str
    claimed: bool
    tolerance: float
    observations: list[Observation] = field(default_factory=list)
    jl: JLDistribution | None = None

    @property
    def worst(self) -> Observation:
        key = (lambda o: o.bound_ratio) if self.claimed else (lambda o: o.change)
        return max(self.observations, key=key)

    @property
    def max_ratio(self) -> float:
        return self.worst.bound_ratio if self.claimed else math.nan

    @property
    def max_ratio_to_c(self) -> float:
        """JL: the largest change / C (may exceed 1: the sensitivity is random); else :attr:`max_ratio`."""
        if self.jl is None:
            return self.max_ratio
        return max(max(o.ratios) for o in self.observations)

    @property
    def passed(self) -> bool | None:
        """None for a non-private variant (nothing claimed, nothing to pass)."""
        if not self.claimed:
            return None
        return self.max_ratio <= 1 + self.tolerance and (self.jl is None or self.jl.passed)


def _updates(case: AuditCase, batch: Batch, step: int) -> list[torch.Tensor]:
    twin = noiseless(case.variant)
    twin.gradient(case.model, batch, step)
    return [p.grad.detach().clone() for p in trainable_parameters(case.model)]


def _insert(batch: Batch, example: Batch, position: int) -> Batch:
    return Batch(torch.cat([batch.x[:position], example.x, batch.x[position:]]),
                 torch.cat([batch.y[:position], example.y, batch.y[position:]]),
                 torch.cat([batch.mask[:position], example.mask, batch.mask[position:]]))  # fmt: skip


def _drop(batch: Batch, row: int) -> Batch:
    keep = torch.arange(batch.x.shape[0]) != row
    return Batch(batch.x[keep], batch.y[keep], batch.mask[keep])


def _example(x: torch.Tensor, y: int) -> Batch:
    return Batch(x.reshape(1, -1), torch.tensor([int(y)]), torch.ones(1, dtype=torch.bool))


def _least_likely(case: AuditCase, x: torch.Tensor) -> int:
    with torch.no_grad():
        return int(case.model(x.reshape(1, -1)).argmin(dim=1))


class _Auditor:
    """Evaluates adjacent pairs of one case against its claim."""

    def __init__(self, case: AuditCase, claim: Claim | None) -> None:
        self.case, self.claim = case, claim
        self.step = 0
        self.jl = case.variant if isinstance(case.variant, JL) else None
        if self.jl is not None and not self.jl.keys.reproducible:
            raise ValueError("the JL sensitivity audit recomputes the step's tangents: audit a JL variant with a "
                             "reproducible seed (reproducible_seed=...)")  # fmt: skip

    def pair(self, scenario: str, without: Batch, with_: Batch, example: Batch) -> Observation:
        self.step += 1
        b = self.case.variant.expected_batch_size if self.case.variant.private else 1.0
        diff = [(a - c).double() for a, c in zip(_updates(self.case, with_, self.step),
                                                  _updates(self.case, without, self.step), strict=True)]  # fmt: skip
        change = math.sqrt(sum(float(d.pow(2).sum()) for d in diff)) * b
        if self.claim is None:
            return Observation(scenario, change)
        ratios = tuple(math.sqrt(sum(float(diff[i].pow(2).sum()) for i in group)) * b / delta
                       for group, delta in zip(self.claim.groups, self.claim.sensitivities, strict=True))  # fmt: skip
        jl_ratio = None if self.jl is None else self.jl_ratio(example, [d * b for d in diff], self.step)
        return Observation(scenario, change, ratios, jl_ratio)

    def jl_ratio(self, example: Batch, change: list[torch.Tensor], step: int) -> float:
        """``change`` (the release's leave-one-out change, times b) against DP-SGD-JL's accounted bound
        ``C max(Z, z_floor)`` at ``step`` (``fastdp.algorithms.jl``, "Rounding"): the smallest of three ratios, each
        <= 1 when the bound holds for the vector actually summed -- the change against ``C max(Z(g), z_floor)``
        for torch.func's gradient g of the example; the change's own JL estimate ``M(change)`` against C (a change
        ``w g'`` has ``||change|| <= C Z(g')`` exactly when ``M(change) <= C``); the change against ``C z_floor``.
        The first alone misjudges an example whose computed gradient is mostly rounding (torch.func's g is then
        another vector than the one summed)."""
        c, z_floor = self.jl.clip_norm, self.jl.z_floor
        size = math.sqrt(sum(float(t.double().pow(2).sum()) for t in change))
        g, norm = self.exact_gradient(example)
        m = self.norm_estimate(g, step)
        reference = c * max(norm / m, z_floor) if m > 0 else math.inf
        return min(size / reference, self.norm_estimate(change, step) / c, size / (c * z_floor))

    def exact_gradient(self, example: Batch) -> tuple[list[torch.Tensor], float]:
        model = self.case.model
        grads = per_example_gradients(model, self.jl.loss_fn, example.x, example.y)
        g = [t[0].double() for t in grads]
        return g, math.sqrt(sum(float(t.pow(2).sum()) for t in g))

    def norm_estimate(self, g: list[torch.Tensor], step: int) -> float:
        params = trainable_parameters(self.case.model)
        r = self.jl.projections
        tangents = draw_tangents(params, self.jl.keys, step, r, 0, r)
        dots = sum((v.double().reshape(r, -1) @ t.double().reshape(-1)) for v, t in zip(tangents, g, strict=True))
        return float(dots.pow(2).mean().sqrt())


def sensitivity_audit(
    case: AuditCase,
    base_rows: int = 16,
    search: int = 32,
    jl_steps: int = 200,
    seed: int = 0,
    alpha: float = DEFAULT_ALPHA,
    tolerance: float | None = None,
) -> SensitivityAudit:
    """Audit ``case`` (module docstring): ``base_rows`` ordinary examples, ``search`` random canary candidates,
    ``jl_steps`` steps of JL's chi-square check. The bound is checked up to a relative ``tolerance`` (default
    :data:`TOLERANCE` of the model's dtype; a float64 model gives the sharpest check)."""
    dtype = case.dtype
    if tolerance is None:
        if dtype not in TOLERANCE:
            raise ValueError(f"the sensitivity audit runs float64 or float32 models, got {dtype}; pass a tolerance")
        tolerance = TOLERANCE[dtype]
    gen = torch.Generator().manual_seed(seed)
    base = synthetic_batch(base_rows, dtype, seed=seed + 1)
    features = base.x.shape[1]

    def direction() -> torch.Tensor:
        u = torch.randn(features, generator=gen, dtype=torch.float64)
        return (u / u.norm()).to(dtype)

    auditor = _Auditor(case, None)
    # one step first: converts the model's layers and records what the claim is read from
    _updates(case, base, 0)
    auditor.claim = claim_of(case.variant, case.model)
    with torch.no_grad():
        classes = int(case.model(base.x[:1]).shape[1])
    audit = SensitivityAudit(case.name, auditor.claim is not None, tolerance)

    canaries: list[tuple[str, Batch]] = []
    u = direction()
    canaries.append(("huge input", _example(HUGE * u, int(torch.randint(0, classes, (1,), generator=gen)))))
    u = direction()
    canaries.append(("huge input, least-likely label", _example(HUGE * u, _least_likely(case, HUGE * u))))
    x0 = base.x[0]
    canaries.append(("in-distribution input, least-likely label", _example(x0, _least_likely(case, x0))))
    if search > 0:
        best, best_score = None, -1.0
        for k in range(search):
            x = SEARCH_NORMS[k % len(SEARCH_NORMS)] * direction()
            candidate = _example(x, k % classes)
            obs = auditor.pair("search", base, _insert(base, candidate, base_rows), candidate)
            score = obs.bound_ratio if audit.claimed else obs.change
            if score > best_score:
                best, best_score = candidate, score
        canaries.append((f"worst of {search} random candidates", best))

    for name, canary in canaries:
        position = int(torch.randint(0, base_rows + 1, (1,), generator=gen))
        with_canary = _insert(base, canary, position)
        masked = Batch(with_canary.x, with_canary.y, with_canary.mask.clone())
        masked.mask[position] = False
        copies = concat(base, *([canary] * COPIES))
        audit.observations += [
            auditor.pair(f"add: {name}", base, with_canary, canary),
            auditor.pair(f"mask as padding: {name}", masked, with_canary, canary),
            auditor.pair(f"add to {COPIES} copies: {name}", copies, concat(copies, canary), canary),
        ]
    for row in (0, base_rows - 1):
        removed = _example(base.x[row], int(base.y[row]))
        audit.observations.append(auditor.pair(f"remove ordinary example {row}", _drop(base, row), base, removed))
    u = direction()
    label = int(torch.randint(0, classes, (1,), generator=gen))
    scales = torch.logspace(0, 6, base_rows, dtype=torch.float64).to(dtype)
    aligned = Batch(scales[:, None] * u, torch.full((base_rows,), label), torch.ones(base_rows, dtype=torch.bool))
    extra = _example(1e3 * u, label)
    audit.observations.append(auditor.pair("add to a batch along one direction", aligned, concat(aligned, extra),
                                           extra))  # fmt: skip

    if auditor.jl is not None and jl_steps > 0:
        audit.jl = _jl_distribution(auditor, _example(HUGE * direction(), 0), jl_steps, alpha)
    return audit


def _jl_distribution(auditor: _Auditor, canary: Batch, steps: int, alpha: float) -> JLDistribution:
    """r (M_k / ||g||)^2 over ``steps`` steps (M_k read off the canary's released contribution C ||g|| / (M_k +
    1e-6) / b), KS against chi2_r."""
    jl, case = auditor.jl, auditor.case
    _, norm = auditor.exact_gradient(canary)
    b = jl.expected_batch_size
    values, clipped = [], True
    for k in range(steps):
        step = 10_000 + k
        update = _updates(case, canary, step)
        contribution = math.sqrt(sum(float(t.double().pow(2).sum()) for t in update)) * b
        estimate = jl.clip_norm * norm / contribution - NORM_EPS
        clipped = clipped and estimate + NORM_EPS > jl.clip_norm
        values.append(jl.projections * (estimate / norm) ** 2)
    pvalue = float(stats.kstest(np.asarray(values), stats.chi2(jl.projections).cdf).pvalue)
    return JLDistribution(jl.projections, steps, pvalue, alpha, clipped)
