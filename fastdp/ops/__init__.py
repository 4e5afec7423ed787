"""fastdp's ``torch.library`` ops (namespace ``torch.ops.fastdp``) and their Python entry points."""

from fastdp.ops.noise import add_noise_, noisy_sgd_step_
from fastdp.ops.norms import clip_factors, ghost_norm_sq

__all__ = ["add_noise_", "clip_factors", "ghost_norm_sq", "noisy_sgd_step_"]
