"""Per-example clipping used by several variants: scale each example (row of dim 0) into a norm ball, in the
forward pass (inputs, ``clip_rows``) or in the backward pass (upstream gradients, ``clip_gradient``).

The fused ops of ``fastdp.ops.clip`` (math, autograd semantics, backends, behaviour under torch.func transforms),
re-exported where the layers that use them live."""

from fastdp.ops.clip import clip_gradient, clip_rows

__all__ = ["CLIP_MARGIN", "clip_gradient", "clip_rows"]

# Where a bound rule credits a clipped row with the bound C itself, the row is clipped to C (1 - 2^-20): the fp32 norm
# inside the op and the scaling's rounding leave a row up to a few u above its target (measured at most 2.2e-7
# relative, rows of 64 to 2^21 aligned entries), far below the margin of 9.5e-7.
CLIP_MARGIN = 1 - 2.0**-20
