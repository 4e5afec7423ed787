"""Privacy machinery: accountants and noise calibration, samplers, randomness sources."""

from fastdp.privacy.accounting import (
    MECHANISMS,
    PrivacyAccountant,
    effective_noise_multiplier,
    gdp_mu,
    gdp_to_epsilon,
    get_noise_multiplier,
    per_layer_noise_multiplier,
    zcdp_rho,
    zcdp_to_epsilon,
)
from fastdp.privacy.sampling import PoissonSampler, ShuffleSampler, pad_batch, physical_batch_size

__all__ = [
    "MECHANISMS",
    "PoissonSampler",
    "PrivacyAccountant",
    "ShuffleSampler",
    "effective_noise_multiplier",
    "gdp_mu",
    "gdp_to_epsilon",
    "get_noise_multiplier",
    "pad_batch",
    "per_layer_noise_multiplier",
    "physical_batch_size",
    "zcdp_rho",
    "zcdp_to_epsilon",
]
