"""Membership-inference canary audit: an empirical lower bound on epsilon, next to the accountant's epsilon.

Setting (the one where the accountant's bound is a single Gaussian mechanism and the optimal attack is known, so
the lower bound can come close to it): one full-batch step (q = 1, b = N) on a data set D_out of N - 1 examples,
or on D_in = D_out plus one canary: of a huge input with the label the model finds least likely and ``search``
random candidates, the one whose noiseless contribution is largest in units of the claimed noise (the attack's
expected separation; chosen before any run, from the model and the claim only). Each run is one call of
``variant.gradient`` with a fresh noise key (a new step index); nothing else changes between runs. The released
update is the mechanism's output (the parameters after an optimizer step are post-processing of it).

Attack: the white-box likelihood-ratio statistic of a Gaussian mechanism, s = sum_l <u_l, c_l> / (s_l / b)^2,
with u the released update, c the canary's noiseless contribution (its released update with minus without it,
:func:`fastdp.audit.claims.noiseless`, recomputed for every run where it depends on the step, as JL's does) and
s_l the claimed noise std of tensor l (1 for a non-private variant). "Member" iff s >= t. The threshold t is
chosen on ``select`` runs per world (:func:`fastdp.audit.stats.best_threshold`), and the counts come from
``runs`` fresh runs per world, so t is independent of them. The lower bound (:func:`epsilon_lower_bound`) holds
with probability >= ``confidence``: an accountant epsilon below it means the claim is false (at that confidence).
It is a lower bound from one attack, not a proof of privacy: a value far below the accountant's epsilon says
this attack could not do better, not that a better one does not exist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fastdp.algorithms import JL, Batch
from fastdp.algorithms.base import trainable_parameters
from fastdp.audit.claims import claim_of, noiseless
from fastdp.audit.setups import AuditCase, build_case, concat, synthetic_batch
from fastdp.audit.stats import best_threshold, epsilon_lower_bound
from fastdp.privacy.accounting import PrivacyAccountant

HUGE = 1e6
SEARCH_NORMS = (1.0, 30.0, 1e3, 1e6)


@dataclass
class MembershipAudit:
    """Result of one membership audit. ``separation``: (mean_in - mean_out) / std_out of the statistic on the
    counted runs; for a Gaussian mechanism the optimal test separates by at most 1 / sigma (``max_separation``)."""

    case: str
    noise_multiplier: float
    sample_rate: float
    examples: int
    delta: float
    confidence: float
    accountant: str
    accountant_epsilon: float
    epsilon_lower_bound: float
    threshold: float
    tpr: float
    fpr: float
    select: int
    runs: int
    separation: float

    @property
    def separation_stderr(self) -> float:
        """Standard error of :attr:`separation` (Gaussian statistic): sqrt(2 / runs + separation^2 / (2 runs))."""
        return math.sqrt(2 / self.runs + self.separation**2 / (2 * self.runs))

    @property
    def max_separation(self) -> float:
        return math.inf if self.noise_multiplier == 0 else 1.0 / self.noise_multiplier

    @property
    def passed(self) -> bool:
        """The empirical lower bound does not exceed the accountant's epsilon."""
        return self.epsilon_lower_bound <= self.accountant_epsilon


def accountant_epsilon(case: AuditCase, delta: float, mechanism: str = "pld") -> float:
    """The accountant's epsilon for one step of ``case`` (its ``privacy_event``; JL with its projections); inf for
    a non-private variant."""
    event = case.variant.privacy_event()
    if event is None:
        return math.inf
    accountant = PrivacyAccountant(mechanism)
    projections = case.variant.projections if isinstance(case.variant, JL) else math.inf
    accountant.step(event[0], event[1], projections=projections)
    return accountant.get_epsilon(delta)


def _released(case: AuditCase, batch: Batch, step: int, twin=None) -> list[torch.Tensor]:
    (case.variant if twin is None else twin).gradient(case.model, batch, step)
    return [p.grad.detach().double().clone() for p in trainable_parameters(case.model)]


def _candidates(case: AuditCase, features: int, search: int, seed: int) -> list[Batch]:
    """A huge input (norm 1e6) with the label the model finds least likely, then ``search`` random candidates
    (input norms 1 to 1e6, labels in turn)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        classes = int(case.model(torch.zeros(1, features, dtype=case.dtype)).shape[1])
    out = []
    for k in range(search + 1):
        u = torch.randn(features, generator=gen, dtype=torch.float64)
        x = ((HUGE if k == 0 else SEARCH_NORMS[k % len(SEARCH_NORMS)]) * u / u.norm()).to(case.dtype).reshape(1, -1)
        if k == 0:
            with torch.no_grad():
                label = int(case.model(x).argmin(dim=1))
        else:
            label = k % classes
        out.append(Batch(x, torch.tensor([label]), torch.ones(1, dtype=torch.bool)))
    return out


def membership_audit(
    name: str,
    noise_multiplier: float,
    examples: int = 32,
    select: int = 500,
    runs: int = 2000,
    delta: float = 1e-5,
    confidence: float = 0.95,
    seed: int = 0,
    mechanism: str = "pld",
    search: int = 64,
) -> MembershipAudit:
    """Membership audit of audit case ``name`` at noise multiplier ``noise_multiplier`` with ``examples`` = N
    (module docstring): ``select`` threshold-selection runs and ``runs`` counted runs per world, float32. The
    canary is the one, among a huge input with the least likely label and ``search`` random candidates, with the
    largest expected separation sqrt(sum_l ||c_l||^2 / (s_l / b)^2) (chosen from noiseless contributions and the
    claimed stds, before any run)."""
    if examples < 2 or select < 1 or runs < 1 or search < 0:
        raise ValueError(f"need examples >= 2, select >= 1, runs >= 1, search >= 0; got {examples}, {select}, "
                         f"{runs}, {search}")  # fmt: skip
    case = build_case(name, noise_multiplier=noise_multiplier, num_examples=examples, sample_rate=1.0, seed=seed)
    base = synthetic_batch(examples - 1, case.dtype, seed=seed + 1)
    twin = noiseless(case.variant)
    without = _released(case, base, 0, twin)  # also converts the model's layers before the claim is read
    claim = claim_of(case.variant, case.model)
    if claim is None:
        weights = [1.0] * len(without)
    else:
        weights = [(claim.expected_batch_size / s) ** 2 for s in claim.stds]

    def contribution(canary: Batch, step: int, without: list[torch.Tensor]) -> list[torch.Tensor]:
        with_canary = _released(case, concat(base, canary), step, twin)
        return [a - b for a, b in zip(with_canary, without, strict=True)]

    def expected_separation(canary: Batch) -> float:
        c = contribution(canary, 0, without)
        return math.sqrt(sum(w * float((t * t).sum()) for w, t in zip(weights, c, strict=True)))

    canary = max(_candidates(case, base.x.shape[1], search, seed + 2), key=expected_separation)
    worlds = {False: base, True: concat(base, canary)}
    fixed = contribution(canary, 0, without)
    # JL: the canary's clip factor depends on the step's tangents. Contributions of examples add up (no layer mixes
    # examples), so the canary's alone is its released update on a batch of just the canary: one call per run.
    per_step = any(
        not torch.equal(a, b)
        for a, b in zip(fixed, contribution(canary, 1, _released(case, base, 1, twin)), strict=True)
    )

    def scores(member: bool, first: int, count: int) -> np.ndarray:
        out = np.empty(count)
        for k in range(count):
            step = first + k
            update = _released(case, worlds[member], step)
            c = _released(case, canary, step, twin) if per_step else fixed
            out[k] = sum(w * float((g * ci).sum()) for w, g, ci in zip(weights, update, c, strict=True))
        return out

    first = 2
    select_out, select_in = scores(False, first, select), scores(True, first + select, select)
    threshold = best_threshold(select_in, select_out, delta, confidence)
    first += 2 * select
    out, in_ = scores(False, first, runs), scores(True, first + runs, runs)
    tp, fp = int((in_ >= threshold).sum()), int((out >= threshold).sum())
    spread = float(out.std())
    event = case.variant.privacy_event()
    separation = (float(in_.mean()) - float(out.mean())) / spread if event is not None and spread > 0 else math.inf
    return MembershipAudit(
        case=name, noise_multiplier=0.0 if event is None else event[0],
        sample_rate=1.0, examples=examples, delta=delta, confidence=confidence, accountant=mechanism,
        accountant_epsilon=accountant_epsilon(case, delta, mechanism),
        epsilon_lower_bound=epsilon_lower_bound(tp, runs, fp, runs, delta, confidence), threshold=threshold,
        tpr=tp / runs, fpr=fp / runs, select=select, runs=runs, separation=separation,
    )  # fmt: skip
