"""Per-example clipping used by several variants: scale each example (row of dim 0) into a norm ball, in the
forward pass (inputs, ``clip_rows``) or in the backward pass (upstream gradients, ``clip_gradient``).

The fused ops of ``fastdp.ops.clip`` (math, autograd semantics, backends, behaviour under torch.func transforms),
re-exported where the layers that use them live."""

from fastdp.ops.clip import clip_gradient, clip_rows

__all__ = ["clip_gradient", "clip_rows"]
