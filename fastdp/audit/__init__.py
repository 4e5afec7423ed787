"""Empirical privacy audit of fastdp's variants: each one's claims tested against what it actually releases.

Three audits, for every variant (``python -m fastdp.audit`` runs them all and writes ``bench/results/audit.md``):

* **noise** (:func:`noise_audit`): with zero gradients (a batch of padding rows), the released update of every
  tensor l over many steps is N(0, (s_l / b)^2), s_l the variant's claimed noise std on the sum and b = qN: a
  Kolmogorov–Smirnov test and a chi-square test of the std; the claimed stds and sensitivities are compared with
  values derived independently from the hyperparameters, and must compose to the accountant's sigma.
* **sensitivity** (:func:`sensitivity_audit`): worst-case canaries (huge inputs, least-likely labels, many
  copies, aligned gradients, searched candidates), added, removed or masked as padding, move the *noiseless*
  released update by at most Delta_g / b per sensitivity group; DP-SGD-JL's random sensitivity is checked
  against its per-step value and its chi-square law.
* **membership inference** (:func:`membership_audit`): insert or leave out one canary over many runs, attack
  with the likelihood-ratio statistic, and turn the attack's TPR/FPR (Clopper–Pearson bounds) into an empirical
  lower bound on epsilon, reported beside the accountant's epsilon.

Two fuzzers run beside them: the sensitivity fuzzer (:mod:`fastdp.audit.fuzz`, random architectures x adversarial
batches) and the certified-bound fuzzer (:mod:`fastdp.audit.bounds`: the spectral-norm certificates of the Lipschitz
variants against the float64 SVD, on adversarial matrices and during projected training).

:class:`DoubleDividedBackpropClip` (the backprop-clipping paper's bug: noise b times too small) shows that the
audits catch a broken variant: its noise audit fails and its empirical epsilon exceeds its claimed epsilon.

Statistical thresholds (:mod:`fastdp.audit.stats`): each test statistic has an exact null law and is rejected at
level 1e-9, so a correct implementation fails a run of fewer than 1000 statistics with probability < 1e-6.
"""

from fastdp.audit.claims import Claim, Expectation, claim_of, expected_claim, noiseless
from fastdp.audit.membership import MembershipAudit, accountant_epsilon, membership_audit
from fastdp.audit.noise import NoiseAudit, noise_audit
from fastdp.audit.sensitivity import SensitivityAudit, sensitivity_audit
from fastdp.audit.setups import BROKEN, CASES, AuditCase, DoubleDividedBackpropClip, build_case
from fastdp.audit.stats import (
    DEFAULT_ALPHA,
    best_threshold,
    check_standard_normal,
    clopper_pearson,
    epsilon_lower_bound,
)

__all__ = [
    "BROKEN",
    "CASES",
    "DEFAULT_ALPHA",
    "AuditCase",
    "Claim",
    "DoubleDividedBackpropClip",
    "Expectation",
    "MembershipAudit",
    "NoiseAudit",
    "SensitivityAudit",
    "accountant_epsilon",
    "best_threshold",
    "build_case",
    "check_standard_normal",
    "claim_of",
    "clopper_pearson",
    "epsilon_lower_bound",
    "expected_claim",
    "membership_audit",
    "noise_audit",
    "noiseless",
    "sensitivity_audit",
]
