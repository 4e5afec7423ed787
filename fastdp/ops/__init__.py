"""fastdp's ``torch.library`` ops (namespace ``torch.ops.fastdp``) and their Python entry points."""

from fastdp.ops.clip import clip_gradient, clip_rows
from fastdp.ops.noise import OptimizerUpdate, add_noise_, add_noise_at_, noisy_sgd_step_, release_
from fastdp.ops.norms import (
    certified_conv_ghost_norm_sq,
    certified_ghost_norm_sq,
    certified_projections,
    certified_token_match_norm_sq,
    clip_factors,
    ghost_norm_sq,
    rounding_gamma,
)
from fastdp.ops.orthogonal import (
    bjorck_orthonormalize,
    certified_bjorck_step,
    conv_lip_factor,
    rko_orthonormalize,
    spectral_normalize_and_orthonormalize,
)
from fastdp.ops.spectral import (
    certified_norm_cholesky,
    certified_spectral_norm,
    certified_spectral_norms,
    certify_norm_at_most,
    conv_operator_norm,
    frobenius_distance_up,
    power_iteration,
)

__all__ = [
    "OptimizerUpdate",
    "add_noise_",
    "add_noise_at_",
    "bjorck_orthonormalize",
    "certified_bjorck_step",
    "certified_norm_cholesky",
    "certify_norm_at_most",
    "certified_conv_ghost_norm_sq",
    "certified_ghost_norm_sq",
    "certified_projections",
    "certified_token_match_norm_sq",
    "certified_spectral_norm",
    "certified_spectral_norms",
    "clip_factors",
    "clip_gradient",
    "clip_rows",
    "conv_lip_factor",
    "conv_operator_norm",
    "frobenius_distance_up",
    "ghost_norm_sq",
    "noisy_sgd_step_",
    "release_",
    "power_iteration",
    "rounding_gamma",
    "rko_orthonormalize",
    "spectral_normalize_and_orthonormalize",
]
