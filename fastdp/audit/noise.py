"""Noise audit: with zero gradients, the released update of tensor l is N(0, (s_l / b)^2) per coordinate.

Every step runs on a batch of padding rows only (mask False: each variant must give them a zero contribution),
so ``p.grad`` after ``variant.gradient`` is the noise alone, divided by the expected batch size b = qN. Over
``steps`` steps (keys 1..steps, each a fresh draw), tensor l's coordinates divided by s_l / b (the variant's own
claimed std, :func:`fastdp.audit.claims.claim_of`) must be i.i.d. N(0, 1): a Kolmogorov–Smirnov test and a
chi-square test of the std (:func:`fastdp.audit.stats.check_standard_normal`), each at level ``alpha``.

The claimed stds are then checked against :func:`fastdp.audit.claims.expected_claim` (derived from the
hyperparameters, not the variant's code) and the claimed sensitivities and stds must compose to the accounting
event's sigma. A variant that adds b times too little noise (the backprop-clipping paper's bug) fails the std test
of every tensor; one whose claimed std is wrong fails the comparison with the expectation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from fastdp.algorithms.base import trainable_parameters
from fastdp.audit.claims import claim_of, expected_claim
from fastdp.audit.setups import AuditCase, padding_batch
from fastdp.audit.stats import DEFAULT_ALPHA, StandardNormalCheck, check_standard_normal

SIGMA_TOLERANCE = 1e-5  # composed multiplier vs the accountant's sigma (float32 stds)


@dataclass
class TensorNoise:
    """The noise check of one tensor: its name, claimed std on the sum, expected std (None: no derivation), the
    claimed-over-expected ratio and the sample check."""

    name: str
    claimed_std: float
    expected_std: float | None
    check: StandardNormalCheck


@dataclass
class NoiseAudit:
    """The noise audit of one variant. ``claim_ok``: claimed stds and sensitivities within the expectation's range;
    ``composed_sigma``: the multiplier the claimed (Delta_g, s_g) compose to, vs ``accountant_sigma``."""

    case: str
    steps: int
    tensors: list[TensorNoise] = field(default_factory=list)
    claim_ok: bool = True
    claim_notes: list[str] = field(default_factory=list)
    composed_sigma: float = math.nan
    accountant_sigma: float = math.nan
    zero_update: bool | None = None  # non-private variants: the zero-gradient update is exactly 0

    @property
    def private(self) -> bool:
        return self.zero_update is None

    @property
    def sigma_ok(self) -> bool:
        return abs(self.composed_sigma - self.accountant_sigma) <= SIGMA_TOLERANCE * self.accountant_sigma

    @property
    def samples_ok(self) -> bool:
        return all(t.check.passed for t in self.tensors)

    @property
    def passed(self) -> bool:
        if not self.private:
            return bool(self.zero_update)
        return self.samples_ok and self.claim_ok and self.sigma_ok

    @property
    def min_pvalue(self) -> float:
        return min((t.check.ks_pvalue for t in self.tensors), default=math.nan)

    @property
    def std_ratio_range(self) -> tuple[float, float]:
        ratios = [t.check.std_ratio for t in self.tensors]
        return (min(ratios), max(ratios)) if ratios else (math.nan, math.nan)


def noise_audit(case: AuditCase, steps: int, rows: int = 8, alpha: float = DEFAULT_ALPHA) -> NoiseAudit:
    """Run ``steps`` zero-gradient steps of ``case`` (a batch of ``rows`` padding rows each; the model is not
    updated) and check every tensor's released noise against its claim (module docstring)."""
    if steps < 1:
        raise ValueError(f"the noise audit needs at least 1 step, got {steps}")
    variant, model = case.variant, case.model
    batch = padding_batch(rows, case.dtype, seed=1)
    params = trainable_parameters(model)
    samples: list[list[np.ndarray]] = [[] for _ in params]
    for step in range(1, steps + 1):
        variant.gradient(model, batch, step)
        for i, p in enumerate(params):
            samples[i].append(p.grad.detach().double().reshape(-1).numpy().copy())
    audit = NoiseAudit(case.name, steps)
    claim = claim_of(variant, model)
    if claim is None:
        audit.zero_update = all(not np.any(np.concatenate(s)) for s in samples)
        return audit
    expected = expected_claim(variant, model)
    b = claim.expected_batch_size
    for i, name in enumerate(claim.names):
        z = np.concatenate(samples[i]) / (claim.stds[i] / b)
        audit.tensors.append(TensorNoise(name, claim.stds[i], None if expected is None else expected.stds[i],
                                         check_standard_normal(z, alpha)))  # fmt: skip
    audit.accountant_sigma = claim.noise_multiplier
    try:
        audit.composed_sigma = claim.composed_noise_multiplier()
    except ValueError as err:
        audit.claim_ok = False
        audit.claim_notes.append(str(err))
    if expected is None:
        audit.claim_notes.append("no independent derivation of the claim for this model")
        return audit
    if expected.groups != claim.groups:
        audit.claim_ok = False
        audit.claim_notes.append(f"sensitivity groups {claim.groups} differ from the expected {expected.groups}")
    for what, got, want in (("sensitivity", claim.sensitivities, expected.sensitivities),
                            ("std", claim.stds, expected.stds)):  # fmt: skip
        for j, (g, w) in enumerate(zip(got, want, strict=True)):
            if not expected.lo <= g / w <= expected.hi:
                audit.claim_ok = False
                audit.claim_notes.append(f"{what} {j}: claimed {g:.6g}, expected {w:.6g} ({expected.how})")
    return audit
