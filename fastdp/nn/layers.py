"""Drop-in DP layers: torch modules that, inside a :class:`~fastdp.nn.ghost.GhostClipping` step, give per-example
gradient norms and clipped gradient sums from one backward (no per-example gradients are materialised where a
ghost norm is cheaper).

Each class subclasses its torch counterpart with no extra state, so outside a DP step it is that module, its
``state_dict`` is unchanged, and :func:`fastdp.nn.convert` turns a torch module into one in place. Per layer:

* ``per_example_sq_norms(saved, G, cache)`` -> [B]: sum over the layer's trainable parameters of ||grad_i||^2;
* ``clipped_grad_sums(saved, G, c, cache)`` -> one tensor per trainable parameter: sum_i c_i grad_i.

Where a per-example weight gradient is cheaper than the ghost norm it is formed once, kept in ``cache``
(a dict per layer call, or None), and its clipped sum is then a weighted sum instead of a second GEMM.

G is the gradient of the summed per-example losses w.r.t. the layer output (rows are per-example).
Norms accumulate in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fastdp.nn.ghost import active_context
from fastdp.ops import ghost_norm_sq


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _rowsq(t: torch.Tensor) -> torch.Tensor:
    """Per-example sum of squares of a [B, ...] tensor, in the accumulation dtype."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:])).to(_acc(t)).pow(2).sum(1)


def _use_ghost(positions: int, out_features: int, in_features: int) -> bool:
    """Ghost norm (T x T Gram products) when cheaper than the per-example gradient: 2 T^2 < p d."""
    return 2 * positions * positions < out_features * in_features


def _sequence_weight_sq(a: torch.Tensor, g: torch.Tensor, cache: dict | None) -> torch.Tensor:
    """||a_i^T g_i||_F^2 for a [B, T, d], g [B, T, p]: ghost norm, or the per-example gradient [B, p, d]
    (kept in ``cache["weight"]``) when that is smaller."""
    _, t, d = a.shape
    p = g.shape[2]
    if _use_ghost(t, p, d):
        return ghost_norm_sq(a, g).to(_acc(a))
    per_example = torch.einsum("btp,btd->bpd", g, a)
    if cache is not None:
        cache["weight"] = per_example
    return _rowsq(per_example)


def _scale_rows(grad_out: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """c_i * G_i for each example i, in the accumulation dtype (clipped sums in fp32 for half types)."""
    acc = _acc(grad_out)
    return grad_out.to(acc) * factors.to(acc).reshape(-1, *([1] * (grad_out.dim() - 1)))


def _weighted(factors: torch.Tensor, per_example: torch.Tensor) -> torch.Tensor:
    """sum_i c_i x_i for x [B, ...], in the accumulation dtype (fp32 for half types, so rounding cannot push one
    example's clipped contribution past its bound)."""
    acc = _acc(per_example)
    return torch.einsum("b,b...->...", factors.to(acc), per_example.to(acc))


class DPLayer:
    """Mixin for DP layers: trainable parameters in ``named_parameters(recurse=False)`` order."""

    def dp_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters(recurse=False) if p.requires_grad]

    def _detached(self, name: str):
        p = getattr(self, name)
        return None if p is None else p.detach()


class Linear(nn.Linear, DPLayer):
    """``torch.nn.Linear``; inputs [B, d] or [B, ..., d] (sequence positions flattened into T)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = active_context()
        if ctx is None or not self.dp_parameters():
            return super().forward(x)
        out = F.linear(x, self._detached("weight"), self._detached("bias"))
        return ctx.tap(self, (x.detach(),), out)

    @staticmethod
    def _flat(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = math.prod(a.shape[1:-1])
        return a.reshape(a.shape[0], positions, a.shape[-1]), g.reshape(g.shape[0], positions, g.shape[-1])

    def per_example_sq_norms(self, saved, grad_out: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        (a,) = saved
        total = torch.zeros(a.shape[0], dtype=_acc(a), device=a.device)
        if a.dim() == 2:
            if self.weight.requires_grad:
                total += _rowsq(a) * _rowsq(grad_out)
            if self.bias is not None and self.bias.requires_grad:
                total += _rowsq(grad_out)
            return total
        a3, g3 = self._flat(a, grad_out)
        if self.weight.requires_grad:
            total += _sequence_weight_sq(a3, g3, cache)
        if self.bias is not None and self.bias.requires_grad:
            total += _rowsq(g3.sum(1))
        return total

    def clipped_grad_sums(
        self, saved, grad_out: torch.Tensor, factors: torch.Tensor, cache: dict | None = None
    ) -> list[torch.Tensor]:
        (a,) = saved
        a, weighted = a.to(_acc(a)), _scale_rows(grad_out, factors)
        weighted = weighted.reshape(-1, grad_out.shape[-1])
        sums = []
        if self.weight.requires_grad and cache and "weight" in cache:
            sums.append(_weighted(factors, cache["weight"]))
        elif self.weight.requires_grad:
            sums.append(weighted.t() @ a.reshape(-1, a.shape[-1]))
        if self.bias is not None and self.bias.requires_grad:
            sums.append(weighted.sum(0))
        return sums


class _ConvNd(DPLayer):
    """Shared by Conv1d/Conv2d: per-example norms through the unfolded input (im2col)."""

    _spatial: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = active_context()
        if ctx is None or not self.dp_parameters():
            return super().forward(x)
        if self.padding_mode != "zeros":
            raise ValueError(
                f"fastdp.nn.{type(self).__name__}: padding_mode={self.padding_mode!r} is not supported in DP "
                "training; use padding_mode='zeros' (or pad the input with F.pad before the layer)"
            )
        out = self._conv_forward(x, self._detached("weight"), self._detached("bias"))
        return ctx.tap(self, (x.detach(),), out)

    def _padding(self) -> tuple[int, ...]:
        if isinstance(self.padding, str):
            if self.padding == "valid":
                return (0,) * self._spatial
            raise ValueError(
                f"fastdp.nn.{type(self).__name__}: padding='same' is not supported; give the padding as integers"
            )
        return tuple(self.padding)

    def _unfold(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C_in * prod(k), L] columns of the input, L = output positions."""
        if self._spatial == 1:
            x = x.unsqueeze(2)
            k, s, p, d = (1, *self.kernel_size), (1, *self.stride), (0, *self._padding()), (1, *self.dilation)
        else:
            k, s, p, d = self.kernel_size, self.stride, self._padding(), self.dilation
        return F.unfold(x, k, dilation=d, padding=p, stride=s)

    def _grouped(self, x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a [B * groups, L, C_in/g * k], g [B * groups, L, C_out/g]) per example and group."""
        b, groups = x.shape[0], self.groups
        cols = self._unfold(x)  # [B, C_in * k, L]
        positions = cols.shape[-1]
        a = cols.reshape(b, groups, -1, positions).transpose(2, 3).reshape(b * groups, positions, -1)
        g = grad_out.reshape(b, groups, -1, positions).transpose(2, 3).reshape(b * groups, positions, -1)
        return a, g

    def _weight_grad(self, x: torch.Tensor, grad_out: torch.Tensor, weight_shape, groups: int) -> torch.Tensor:
        weight_grad = torch.nn.grad.conv1d_weight if self._spatial == 1 else torch.nn.grad.conv2d_weight
        return weight_grad(x, weight_shape, grad_out, self.stride, self._padding(), self.dilation, groups)

    def _per_example_weight(self, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
        """[B, *weight.shape] per-example weight gradients: one convolution backward with the batch folded
        into the groups (no im2col)."""
        b = x.shape[0]
        folded = self._weight_grad(
            x.reshape(1, b * x.shape[1], *x.shape[2:]),
            grad_out.reshape(1, b * grad_out.shape[1], *grad_out.shape[2:]),
            (b * self.weight.shape[0], *self.weight.shape[1:]),
            b * self.groups,
        )
        return folded.reshape(b, *self.weight.shape)

    def per_example_sq_norms(self, saved, grad_out: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        (x,) = saved
        b = x.shape[0]
        total = torch.zeros(b, dtype=_acc(x), device=x.device)
        if self.weight.requires_grad and b:
            positions = math.prod(grad_out.shape[2:])
            fan_in = self.weight.shape[1] * math.prod(self.kernel_size)
            if _use_ghost(positions, self.out_channels // self.groups, fan_in):
                a, g = self._grouped(x, grad_out)
                total += ghost_norm_sq(a, g).to(_acc(x)).reshape(b, self.groups).sum(1)
            else:
                per_example = self._per_example_weight(x, grad_out)
                if cache is not None:
                    cache["weight"] = per_example
                total += _rowsq(per_example)
        if self.bias is not None and self.bias.requires_grad:
            total += _rowsq(grad_out.flatten(2).sum(2))
        return total

    def clipped_grad_sums(
        self, saved, grad_out: torch.Tensor, factors: torch.Tensor, cache: dict | None = None
    ) -> list[torch.Tensor]:
        (x,) = saved
        x, weighted = x.to(_acc(x)), _scale_rows(grad_out, factors)
        sums = []
        if self.weight.requires_grad and cache and "weight" in cache:
            sums.append(_weighted(factors, cache["weight"]))
        elif self.weight.requires_grad:
            sums.append(self._weight_grad(x, weighted, self.weight.shape, self.groups))
        if self.bias is not None and self.bias.requires_grad:
            sums.append(weighted.flatten(2).sum((0, 2)))
        return sums


class Conv1d(_ConvNd, nn.Conv1d):
    """``torch.nn.Conv1d`` (padding_mode 'zeros', any stride/padding/dilation/groups)."""

    _spatial = 1


class Conv2d(_ConvNd, nn.Conv2d):
    """``torch.nn.Conv2d`` (padding_mode 'zeros', any stride/padding/dilation/groups)."""

    _spatial = 2


class Embedding(nn.Embedding, DPLayer):
    """``torch.nn.Embedding`` (dense gradients; ``padding_idx`` rows get none).

    Per-example norm, whichever is cheaper: the ghost norm over token matches,
    sum_{t,s} [idx_t == idx_s] <G_t, G_s> (T^2 dim work, vocabulary-free), or the per-example gradient's rows
    scattered by token id (V dim memory per example, kept for the clipped sum) when 8 V < T^2: the scatter and
    its passes over B V dim memory cost about 8 times a Gram product's multiply-add per element.
    """

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        ctx = active_context()
        if ctx is None or not self.dp_parameters():
            return super().forward(idx)
        if self.sparse or self.max_norm is not None:
            raise ValueError("fastdp.nn.Embedding: sparse=True and max_norm are not supported in DP training")
        out = F.embedding(idx, self._detached("weight"), self.padding_idx)
        return ctx.tap(self, (idx,), out)

    def _tokens(self, idx: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = idx.reshape(idx.shape[0], math.prod(idx.shape[1:]))
        g = grad_out.reshape(idx.shape[0], idx.shape[1], grad_out.shape[-1])
        if self.padding_idx is not None:
            g = g * (idx != self.padding_idx).unsqueeze(-1).to(g.dtype)
        return idx, g

    def per_example_sq_norms(self, saved, grad_out: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        (idx,) = saved
        if not self.weight.requires_grad:
            return torch.zeros(idx.shape[0], dtype=_acc(grad_out), device=idx.device)
        idx, g = self._tokens(idx, grad_out)
        b, t, dim = g.shape
        if 8 * self.num_embeddings < t * t:
            rows = (torch.arange(b, device=idx.device).unsqueeze(1) * self.num_embeddings + idx).reshape(-1)
            per_example = g.new_zeros(b * self.num_embeddings, dim).index_add_(0, rows, g.reshape(-1, dim))
            per_example = per_example.reshape(b, self.num_embeddings, dim)
            if cache is not None:
                cache["weight"] = per_example
            return _rowsq(per_example)
        g = g.to(_acc(grad_out))
        same = (idx.unsqueeze(2) == idx.unsqueeze(1)).to(g.dtype)  # [B, T, T]
        return (same * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))

    def clipped_grad_sums(
        self, saved, grad_out: torch.Tensor, factors: torch.Tensor, cache: dict | None = None
    ) -> list[torch.Tensor]:
        (idx,) = saved
        if not self.weight.requires_grad:
            return []
        if cache and "weight" in cache:
            return [_weighted(factors, cache["weight"])]
        idx, g = self._tokens(idx, grad_out)
        weighted = _scale_rows(g, factors).reshape(-1, g.shape[-1])
        total = torch.zeros(self.num_embeddings, g.shape[-1], dtype=weighted.dtype, device=g.device)
        return [total.index_add_(0, idx.reshape(-1), weighted)]


class _AffineNorm(DPLayer):
    """Shared by LayerNorm/GroupNorm: y = x_hat * w + b with x_hat the normalised input (saved)."""

    # Subclasses define _normalise(x), _broadcast(param, x) and _reduce(t).

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = active_context()
        if ctx is None or not self.dp_parameters():
            return super().forward(x)
        x_hat = self._normalise(x)
        out = x_hat
        if self.weight is not None:
            out = out * self._broadcast(self._detached("weight"), x)
        if self.bias is not None:
            out = out + self._broadcast(self._detached("bias"), x)
        return ctx.tap(self, (x_hat.detach(),), out)

    def _per_example(self, saved, grad_out: torch.Tensor) -> list[torch.Tensor]:
        """Per-example gradients [B, *param.shape] of the trainable affine parameters (they are small)."""
        (x_hat,) = saved
        acc = _acc(grad_out)
        x_hat, grad_out = x_hat.to(acc), grad_out.to(acc)
        grads = []
        if self.weight is not None and self.weight.requires_grad:
            grads.append(self._reduce(grad_out * x_hat))
        if self.bias is not None and self.bias.requires_grad:
            grads.append(self._reduce(grad_out))
        return grads

    def per_example_sq_norms(self, saved, grad_out: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        grads = self._per_example(saved, grad_out)
        return sum((_rowsq(g) for g in grads), torch.zeros(grad_out.shape[0], dtype=_acc(grad_out),
                                                             device=grad_out.device))  # fmt: skip

    def clipped_grad_sums(
        self, saved, grad_out: torch.Tensor, factors: torch.Tensor, cache: dict | None = None
    ) -> list[torch.Tensor]:
        return [_weighted(factors, g) for g in self._per_example(saved, grad_out)]


class LayerNorm(_AffineNorm, nn.LayerNorm):
    """``torch.nn.LayerNorm`` with per-example norms of its affine parameters."""

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, None, None, self.eps)

    def _broadcast(self, p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return p

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over every dimension but the batch and the normalised ones."""
        keep = len(self.normalized_shape)
        return (
            t.flatten(0, t.dim() - keep - 1).reshape(t.shape[0], -1, *t.shape[t.dim() - keep :]).sum(1)
            if t.shape[0]
            else t.new_zeros(0, *t.shape[t.dim() - keep :])
        )


class GroupNorm(_AffineNorm, nn.GroupNorm):
    """``torch.nn.GroupNorm`` (the DP-compatible replacement of BatchNorm) with per-example affine norms."""

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x, self.num_groups, None, None, self.eps)

    def _broadcast(self, p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return p.reshape(1, -1, *([1] * (x.dim() - 2)))

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t.flatten(2).sum(2)


# torch module type -> its DP layer; convert() swaps classes in place (no state is added).
DP_LAYERS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: Linear,
    nn.Conv1d: Conv1d,
    nn.Conv2d: Conv2d,
    nn.Embedding: Embedding,
    nn.LayerNorm: LayerNorm,
    nn.GroupNorm: GroupNorm,
}
