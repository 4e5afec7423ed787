"""fastdp's ``torch.library`` ops (namespace ``torch.ops.fastdp``) and their Python entry points."""

from fastdp.ops.noise import add_noise_, noisy_sgd_step_

__all__ = ["add_noise_", "noisy_sgd_step_"]
