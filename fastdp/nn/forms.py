"""Per-example gradients of a parameter used more than once in one forward (tied or shared weights), in one backward.

A parameter used by several DP layer calls (GPT-2's ``wte`` read by the token Embedding and by the ``lm_head`` Linear,
a layer called twice, a block applied at several depths) has as each example's gradient the *sum* of its uses'
gradients, so its squared norm is not the sum of the uses' squared norms: it has cross terms,
``||sum_u g_u||^2 = sum_{u, v} <g_u, g_v>``. Each DP layer describes each use's per-example gradient by a *form* that
keeps it factored, and the inner products of two forms are computed without forming either gradient where that is
cheaper (the ghost inner product of two uses' (A, G) pairs), or the uses' per-example gradients are formed, summed and
normed (the direct path) where that is cheaper and fits :data:`fastdp.nn.layers.DIRECT_MEMORY_BUDGET`.

Forms (per example i, in the parameter's own layout, viewed as a matrix [m, n] where it has two factors):

* :class:`Dense` ``t [B, *shape]``: the per-example gradient itself, the very tensor summed (biases, norm affines,
  convolution weights);
* :class:`Outer` ``left [B, T, m]``, ``right [B, T, n]``: ``sum_t left_it right_it^T`` (a Linear: G and A; HF's
  transposed ``Conv1D``: A and G);
* :class:`Rows` ``idx [B, T]``, ``g [B, T, n]`` over ``rows`` rows: ``sum_t e_{idx_it} g_it^T`` (an Embedding).

Rigour, as for one use (``fastdp.ref.norms.certified_ghost_norm_sq``): every inner product is computed in float64
(fp32, fp16 and bf16 products are exact there) with its rounding bounded by ``gamma_K m_u m_v``, where the *mass*
``m_u`` (:func:`mass`) bounds the Frobenius norm of the use's absolute terms (``sum_t |left_t| |right_t|``,
``sum_t |g_t|``, ``||t||``) and K counts the operations one term goes through (Cauchy-Schwarz, Higham Thm 3.1). The
bound on ``||sum_u g_u||^2`` is the clamped float64 sum plus ``gamma_K (sum_u m_u)^2``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from fastdp.ops import rounding_gamma, summation

GRAM_CHUNK_ELEMENTS = 1 << 24  # float64 entries of the [b, T, T'] products formed at a time (128 MiB)


@dataclass
class Dense:
    """The per-example gradient ``t [B, *shape]`` itself (summed as it is)."""

    t: torch.Tensor

    def positions(self) -> int:
        return 0

    def examples(self) -> int:
        return self.t.shape[0]


@dataclass
class Outer:
    """``sum_t left[i, t] right[i, t]^T`` [m, n]: ``left [B, T, m]``, ``right [B, T, n]``."""

    left: torch.Tensor
    right: torch.Tensor

    def positions(self) -> int:
        return self.left.shape[1]

    def examples(self) -> int:
        return self.left.shape[0]


@dataclass
class Rows:
    """``sum_t e_{idx[i, t]} g[i, t]^T`` [rows, n]: ``idx [B, T]`` row ids, ``g [B, T, n]`` (rows that get no gradient,
    e.g. an Embedding's ``padding_idx``, zeroed in ``g``)."""

    idx: torch.Tensor
    g: torch.Tensor
    rows: int

    def positions(self) -> int:
        return self.g.shape[1]

    def examples(self) -> int:
        return self.g.shape[0]


Form = Dense | Outer | Rows
_F64 = torch.float64


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t [B, ...]`` as ``[B, prod(...)]`` (also for B = 0, where ``reshape(0, -1)`` is ambiguous)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def _select(form: Form, part: slice) -> Form:
    """``form`` for the examples ``part``."""
    if isinstance(form, Dense):
        return Dense(form.t[part])
    if isinstance(form, Outer):
        return Outer(form.left[part], form.right[part])
    return Rows(form.idx[part], form.g[part], form.rows)


def _width(form: Form) -> int:
    """The length of the dot products a Gram of ``form`` takes (per position pair)."""
    if isinstance(form, Outer):
        return form.left.shape[2] + form.right.shape[2]
    if isinstance(form, Rows):
        return form.g.shape[2]
    return math.prod(form.t.shape[1:])


def mass(form: Form) -> torch.Tensor:
    """float64 [B], rounded up: a bound on the Frobenius norm of the absolute terms of each example's gradient (which
    bounds the gradient's norm, and the size of what a sum of it rounds)."""
    u = torch.finfo(_F64).eps / 2
    if isinstance(form, Dense):
        flat = _rows(form.t).to(_F64)
        return torch.linalg.vector_norm(flat, dim=1) * (1 + rounding_gamma(flat.shape[1] + 4, _F64))
    if isinstance(form, Outer):
        left, right = form.left.to(_F64), form.right.to(_F64)
        rows = torch.linalg.vector_norm(left, dim=2) * torch.linalg.vector_norm(right, dim=2)
        width = max(left.shape[2], right.shape[2])
    else:
        rows = torch.linalg.vector_norm(form.g.to(_F64), dim=2)
        width = form.g.shape[2]
    return rows.sum(1) * (1 + rounding_gamma(width + rows.shape[1] + 4, _F64) + 4 * u)


def _inner(f: Form, h: Form, shape: torch.Size) -> tuple[torch.Tensor, int]:
    """(float64 [b] ``<grad_i(f), grad_i(h)>`` as computed, K): the computed value is within ``gamma_K mass(f)
    mass(h)`` of the exact one. ``shape``: the parameter's shape (the layout of Dense forms)."""
    if isinstance(h, Dense) and not isinstance(f, Dense):
        f, h = h, f
    if isinstance(f, Dense):
        d = f.t.to(_F64)
        if isinstance(h, Dense):
            return (_rows(d) * _rows(h.t.to(_F64))).sum(1), math.prod(d.shape[1:]) + 2
        if isinstance(h, Outer):  # sum_t left_t^T D right_t
            left, right = h.left.to(_F64), h.right.to(_F64)
            m, n = left.shape[2], right.shape[2]
            dr = torch.bmm(d.reshape(d.shape[0], m, n), right.transpose(1, 2))  # [b, m, T]
            return (dr * left.transpose(1, 2)).sum((1, 2)), n + m * left.shape[1] + 2
        rows = d.reshape(d.shape[0], h.rows, -1)  # sum_t <D[idx_t], g_t>
        gathered = torch.gather(rows, 1, h.idx.unsqueeze(2).expand(-1, -1, rows.shape[2]))
        return (gathered * h.g.to(_F64)).sum((1, 2)), h.g.shape[1] * h.g.shape[2] + 2
    if isinstance(f, Outer) and isinstance(h, Outer):  # sum_{t,s} <l_t, l'_s> <r_t, r'_s>
        gram_l = torch.bmm(f.left.to(_F64), h.left.to(_F64).transpose(1, 2))
        gram_r = torch.bmm(f.right.to(_F64), h.right.to(_F64).transpose(1, 2))
        return gram_l.mul_(gram_r).sum((1, 2)), _width(f) + _width(h) + f.positions() * h.positions() + 2
    if isinstance(f, Rows) and isinstance(h, Rows):  # sum_{t,s} [idx_t == idx'_s] <g_t, g'_s>
        same = (f.idx.unsqueeze(2) == h.idx.unsqueeze(1)).to(_F64)
        gram = torch.bmm(f.g.to(_F64), h.g.to(_F64).transpose(1, 2))
        return (same * gram).sum((1, 2)), f.g.shape[2] + f.positions() * h.positions() + 2
    if isinstance(f, Outer):
        f, h = h, f
    # Rows f, Outer h: sum_{t,s} left_s[idx_t] <g_t, right_s>
    left = torch.gather(h.left.to(_F64), 2, f.idx.unsqueeze(1).expand(-1, h.positions(), -1))  # [b, S, T]
    dots = torch.bmm(h.right.to(_F64), f.g.to(_F64).transpose(1, 2))  # [b, S, T]
    return (left * dots).sum((1, 2)), f.g.shape[2] + f.positions() * h.positions() + 2


def shared_norm_sq(uses: list[Form], shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bound, masses)``, float64 [B]: ``bound[i] >= ||sum_u grad_i(use u)||^2`` whatever the rounding (the uses'
    pairwise inner products, each once, cross terms twice), and the sum of the uses' masses."""
    masses = [mass(f) for f in uses]
    b = masses[0].shape[0]
    span = max(max(f.positions(), 1) for f in uses) ** 2
    chunk = max(1, GRAM_CHUNK_ELEMENTS // span)
    total = torch.zeros(b, dtype=_F64, device=masses[0].device)
    worst = 0
    for start in range(0, b, chunk):
        part = slice(start, start + chunk)
        pieces = [_select(f, part) for f in uses]
        for i, f in enumerate(pieces):
            for j in range(i, len(pieces)):
                value, k = _inner(f, pieces[j], shape)
                total[part] += value if i == j else 2 * value
                worst = max(worst, k)
    summed = torch.stack(masses).sum(0)
    k = worst + len(uses) * len(uses) + 4  # + the additions of the pairs' values
    return total.clamp_min(0) + rounding_gamma(k, _F64) * summed * summed, summed


def dense(form: Form, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The per-example gradients ``[B, *shape]`` of ``form``, in ``dtype``."""
    if isinstance(form, Dense):
        return form.t.to(dtype).reshape(form.t.shape[0], *shape)
    if isinstance(form, Outer):
        out = torch.bmm(form.left.to(dtype).transpose(1, 2), form.right.to(dtype))
        return out.reshape(out.shape[0], *shape)
    b, n = form.g.shape[0], form.g.shape[2]
    flat = (torch.arange(b, device=form.idx.device).unsqueeze(1) * form.rows + form.idx).reshape(-1)
    out = form.g.new_zeros(b * form.rows, n, dtype=dtype).index_add_(0, flat, form.g.reshape(-1, n).to(dtype))
    return out.reshape(b, *shape)


def clipped_sum(form: Form, factors: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``sum_i c_i grad_i(form)`` float64, shaped as the parameter: chunked float64 GEMMs (Outer), scatters (Rows),
    GEMVs (Dense), whose rounding ``fastdp.ops.summation`` bounds."""
    if isinstance(form, Dense):
        return summation.weighted_sum(factors, form.t).reshape(shape)
    positions = form.positions()
    scale = factors.repeat_interleave(positions) if positions != 1 else factors
    if isinstance(form, Outer):
        left, right = form.left.reshape(-1, form.left.shape[2]), form.right.reshape(-1, form.right.shape[2])
        return summation.outer_sum(left, right, left_scale=scale).reshape(shape)
    g = form.g.reshape(-1, form.g.shape[2])
    return summation.index_sum(form.idx.reshape(-1), g, form.rows, scale).reshape(shape)


def formed_sq_norms(per_example: list[torch.Tensor]) -> torch.Tensor:
    """Per-example squared norms [B] (float64, rounded up) of one layer call's formed per-example gradients (one tensor
    ``[B, *shape]`` per parameter): the norm of the very tensors :func:`formed_weighted_sums` sums."""
    return sum(summation.sq_norms_up(t) for t in per_example)


def formed_weighted_sums(per_example: list[torch.Tensor], factors: torch.Tensor) -> list[torch.Tensor]:
    """``sum_i c_i g_i`` (float64) of each of one layer call's formed per-example gradients (one GEMV each)."""
    return [clipped_sum(Dense(t), factors, t.shape[1:]) for t in per_example]


def direct_is_cheaper(uses: list[Form], numel: int) -> bool:
    """Whether forming the uses' per-example gradients costs less than the float64 Grams of every pair of uses, in
    fp32 multiply-adds: a product form ``T_u numel``; Rows a zero fill, scatter and norm of ``numel`` per example,
    about 64 float64 Gram multiply-adds per element (the rule of :class:`fastdp.nn.layers.Embedding`); a float64
    multiply-add about two fp32 ones (``fastdp.nn.layers._use_ghost``: for one product form this is its rule)."""
    direct = sum(f.positions() * numel if isinstance(f, Outer) else 128 * numel if isinstance(f, Rows) else numel
                 for f in uses)  # fmt: skip
    gram = sum(2 * max(f.positions(), 1) * max(h.positions(), 1) * (_width(f) + _width(h)) // 2
               for f in uses for h in uses)  # fmt: skip
    return direct < gram


def shared_parameters(layers: list) -> set[int]:
    """``id``s of the trainable parameters that more than one of the layer calls ``layers`` uses."""
    seen: set[int] = set()
    shared: set[int] = set()
    for layer in layers:
        for p in layer.dp_parameters():
            (shared if id(p) in seen else seen).add(id(p))
    return shared


@dataclass
class SharedParameter:
    """A trainable parameter of layer calls that share parameters: its uses' forms and, where :func:`formed_norm_sq`
    took the direct path, the sum of their per-example gradients (the very tensor normed and summed)."""

    param: torch.nn.Parameter
    forms: list[Form]
    per_example: torch.Tensor | None = None


def parameter_uses(layers: list, saved: list, grads_out: list, formed: list | None = None) -> list[SharedParameter]:
    """Every trainable parameter of the layer calls ``layers`` (first use first) with its uses' forms: ``Dense`` for
    a call whose per-example gradients were formed in its gradient hook (``formed``, ``fastdp.nn.ghost``)."""
    uses: dict[int, SharedParameter] = {}
    for layer, a, g, ts in zip(layers, saved, grads_out, formed or [None] * len(layers), strict=True):
        forms = layer.per_example_forms(a, g) if ts is None else [Dense(t) for t in ts]
        for p, form in zip(layer.dp_parameters(), forms, strict=True):
            uses.setdefault(id(p), SharedParameter(p, [])).forms.append(form)
    return list(uses.values())


def map_tensors(uses: list[SharedParameter], fn) -> list[SharedParameter]:
    """``uses`` with ``fn`` applied to every field of their forms and to their per-example gradients (``fn`` returns
    what it does not map, e.g. integer token ids or a row count, as it is)."""
    mapped = []
    for use in uses:
        forms = [dataclasses.replace(f, **{k.name: fn(getattr(f, k.name)) for k in dataclasses.fields(f)})
                 for f in use.forms]  # fmt: skip
        mapped.append(SharedParameter(use.param, forms, None if use.per_example is None else fn(use.per_example)))
    return mapped


def formed_norm_sq(uses: list[SharedParameter], acc: torch.dtype, budget: int) -> torch.Tensor:
    """Per-example squared norms [B], float64 and rounded up, summed over the parameters ``uses``
    (:func:`parameter_uses`).

    Per parameter: its uses' per-example gradients formed in ``acc`` and summed where :func:`direct_is_cheaper` and
    the ``[B, *shape]`` tensor fits ``budget`` bytes (their norm is that of the very tensor summed; kept in
    ``per_example`` for :func:`formed_sums`); else :func:`shared_norm_sq`, clipped by the uses' summed mass over
    ``MASS_RATIO`` too (``fastdp.ops.summation.clip_sq_up``)."""
    total = None
    for use in uses:
        p, forms = use.param, use.forms
        b = forms[0].examples()
        if direct_is_cheaper(forms, p.numel()) and b * p.numel() * torch.finfo(acc).bits // 8 <= budget:
            use.per_example = functools.reduce(torch.add, (dense(f, p.shape, acc) for f in forms))
            sq = summation.sq_norms_up(use.per_example)
        else:
            bound, masses = shared_norm_sq(forms, p.shape)
            sq = summation.clip_sq_up(bound, masses)
        total = sq if total is None else total + sq
    return total


def formed_sums(uses: list[SharedParameter], factors: torch.Tensor) -> dict[int, torch.Tensor]:
    """``sum_i c_i grad_i`` per parameter of ``uses`` (by ``id``), float64: one weighted sum of the formed
    per-example gradients where :func:`formed_norm_sq` formed them, else each use's clipped sum, added
    (``fastdp.ops.summation.add_all``)."""
    sums = {}
    for use in uses:
        shape = use.param.shape
        forms = [Dense(use.per_example)] if use.per_example is not None else use.forms
        sums[id(use.param)] = summation.add_all(clipped_sum(f, factors, shape) for f in forms)
    return sums
