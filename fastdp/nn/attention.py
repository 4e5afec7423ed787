"""The DP ``nn.MultiheadAttention``: per-example norms, clipped sums and JL projections of its in-projection and
key/value biases from one backward, its output projection a DP :class:`~fastdp.nn.layers.Linear` that it calls.

torch's attention reads ``out_proj.weight`` and ``in_proj_weight`` inside ``F.multi_head_attention_forward``, so
neither is a layer call a DP layer could tap. Inside a DP step this class computes the same function itself, batch
first, with detached parameters: the in-projection (q, k, v and the ``bias_k``/``bias_v`` rows) is tapped once, the
attention runs on those tensors, and the output projection is ``self.out_proj(...)``, which
:func:`fastdp.nn.convert` has made a DP Linear (it taps itself). Outside a DP step, and when nothing in it trains,
``forward`` is torch's (its fast paths included).

The in-projection is three Linears, ``q = x_q W_q^T + b_q`` (rows 0:E of the packed ``in_proj_weight`` [3E, E]),
``k = x_k W_k^T + b_k`` (E:2E), ``v = x_v W_v^T + b_v`` (2E:3E), on inputs with L (query) or S (key, value)
positions. They are grouped by input: one group [B, T, 3E] for self-attention (query is key is value: a single Linear
of x), a query group and a key/value group [B, S, 2E] when key is value, else three groups (always three for the
separate ``q/k/v_proj_weight`` of kdim, vdim != E). Each group's weight gradient lives in its own rows, so an
example's squared norm is the sum of the groups' (each a certified ghost norm or a per-example gradient, as a
:class:`Linear` on a sequence), plus the in-projection bias's ``||[sum_t G_q, sum_s G_k, sum_s G_v]||^2`` and the
``bias_k``/``bias_v`` gradients (the output gradient of each example's appended key/value row, [B, E]: small, used
as they are).

What the tap hooks (the "carrier"): the group's output itself for self-attention without ``bias_k``, else the groups'
outputs and the two bias rows flattened per example and concatenated, [B, L 3E ... + 2E]; the layer splits its G back
by the saved inputs' shapes. The record is batch-first whatever ``batch_first`` says: inputs are transposed in, the
output out.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fastdp.nn.forms import Dense, Form, Outer
from fastdp.nn.ghost import active_context
from fastdp.nn.layers import (
    DP_LAYERS,
    DPLayer,
    _as_consumed,
    _clipped_weight_sum,
    _mass,
    _projections,
    _rowsq,
    _sequence_weight_sq,
)
from fastdp.ops import summation

__all__ = ["MultiheadAttention"]

# Rows (in units of E) of the packed in-projection that each input group produces, by the number of groups.
_GROUP_ROWS = {1: ((0, 3),), 2: ((0, 1), (1, 3)), 3: ((0, 1), (1, 2), (2, 3))}
_SEPARATE = ("q_proj_weight", "k_proj_weight", "v_proj_weight")  # the in-projection when kdim or vdim != E


def _forward_mode_ad() -> bool:
    """Whether forward-mode AD is on (a ``torch.autograd.forward_ad.dual_level``; ``torch.func.jvp`` opens one too):
    CPU's fused ``scaled_dot_product_attention`` has no forward derivative (torch 2.13 raises for
    ``_scaled_dot_product_flash_attention_for_cpu``), so the step then takes the math formulation."""
    return torch.autograd.forward_ad._current_level >= 0


def _math_attention(q, k, v, mask, dropout: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T / sqrt(head_dim) + mask), dropped out, @ v; those weights [B, h, L, S]): torch's
    ``need_weights`` formulation (the weights it returns are the dropped-out ones too). ``causal``: SDPA's
    ``is_causal``, position l attends to s <= l (top-left aligned)."""
    scores = (q * math.sqrt(1.0 / q.shape[-1])) @ k.transpose(-2, -1)
    if causal:
        allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, -1)
    if dropout > 0:
        weights = F.dropout(weights, dropout)
    return weights @ v, weights


class MultiheadAttention(nn.MultiheadAttention, DPLayer):
    """``torch.nn.MultiheadAttention`` (module docstring): any ``batch_first``, ``bias``, ``add_bias_kv``,
    ``add_zero_attn``, ``kdim``/``vdim``, ``dropout``; masks (``key_padding_mask``, 2-D and 3-D ``attn_mask``, bool
    or float), ``is_causal``, ``need_weights`` and ``average_attn_weights`` as torch's. Inside a DP step the inputs
    must be batched (3-D)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx = active_context()
        if ctx is None or not (self._trains() or any(p.requires_grad for p in self.out_proj.parameters())):
            return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                   average_attn_weights, is_causal)  # fmt: skip
        if query.dim() != 3 or query.is_nested or key.is_nested or value.is_nested:
            raise ValueError(
                f"fastdp.nn.MultiheadAttention: a DP step needs batched 3-D inputs whose batch dimension holds the "
                f"examples, got a {query.dim()}-D{' nested' if query.is_nested else ''} query; add the batch dimension"
            )
        F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, self.num_heads)  # torch's own errors
        key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                             other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                             target_type=query.dtype)  # fmt: skip
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                      target_type=query.dtype, check_other=False)  # fmt: skip
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                               "method `generate_square_subsequent_mask` to create this mask.")  # fmt: skip
        causal = is_causal and key_padding_mask is None and not need_weights  # torch: the hint replaces the mask
        self_attention, shared_kv = query is key and key is value, key is value
        if not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        b, tgt, e = query.shape
        src = key.shape[1]
        q, k, v, bias_rows = self._in_projection(ctx, query, key, value, self_attention, shared_kv)
        heads, head_dim = self.num_heads, self.head_dim
        appended = 0
        if bias_rows is not None:  # bias_k, bias_v as one more key/value position
            rows = bias_rows.unflatten(-1, (heads, head_dim)).transpose(1, 2)  # [B, h, 2, hd]
            k, v = torch.cat([k, rows[:, :, :1]], 2), torch.cat([v, rows[:, :, 1:]], 2)
            appended += 1
        if self.add_zero_attn:
            zeros = k.new_zeros(b, heads, 1, head_dim)
            k, v = torch.cat([k, zeros], 2), torch.cat([v, zeros], 2)
            appended += 1
        mask = None if causal else self._mask(attn_mask, key_padding_mask, b, tgt, src, appended, q.dtype)
        dropout = self.dropout if self.training else 0.0
        weights = None
        if need_weights or _forward_mode_ad():
            out, weights = _math_attention(q, k, v, mask, dropout, causal)
        else:
            out = F.scaled_dot_product_attention(q, k, v, mask, dropout, causal)
        out = self.out_proj(out.transpose(1, 2).reshape(b, tgt, e))  # a DP Linear: taps itself
        if not self.batch_first:
            out = out.transpose(0, 1)
        if weights is not None and average_attn_weights:
            weights = weights.mean(1)
        return out, weights

    def _in_projection(self, ctx, query, key, value, self_attention: bool, shared_kv: bool):
        """(q [B, h, L, head_dim], k, v [B, h, S, head_dim], the bias_k/bias_v rows [B, 2, E] or None), batch-first,
        from detached parameters: one Linear per input group, then the one tap of the layer's own parameters (module
        docstring)."""
        e, b = self.embed_dim, query.shape[0]
        packed = self._qkv_same_embed_dim
        rows = _GROUP_ROWS[1 if self_attention and packed else 2 if shared_kv and packed else 3]
        bias = self._detached("in_proj_bias")
        pieces = []
        for i, (x, (lo, hi)) in enumerate(zip((query, key, value), rows, strict=False)):
            weight = self._detached("in_proj_weight")[lo * e : hi * e] if packed else self._detached(_SEPARATE[i])
            pieces.append(F.linear(x, weight, None if bias is None else bias[lo * e : hi * e]))
        bias_rows = None
        if self.bias_k is not None:
            bias_rows = torch.cat([self._detached("bias_k"), self._detached("bias_v")], 1)
            bias_rows = bias_rows.to(pieces[0].dtype).expand(b, 2, e)
        if self._trains():
            parts = [*pieces, *([bias_rows] if bias_rows is not None else [])]
            sizes = [math.prod(t.shape[1:]) for t in parts]
            flat = [t.reshape(b, n) for t, n in zip(parts, sizes, strict=True)]
            carrier = parts[0] if len(parts) == 1 else torch.cat(flat, 1)
            carrier = ctx.tap(self, tuple(_as_consumed(x) for x in (query, key, value)[: len(rows)]), carrier)
            if len(parts) == 1:
                pieces = [carrier]
            else:
                parts = [piece.view(t.shape) for piece, t in zip(carrier.split(sizes, 1), parts, strict=True)]
                pieces, bias_rows = parts[: len(pieces)], (parts[-1] if bias_rows is not None else None)
        heads = [self._heads(t) for t in pieces]  # q, k, v as [B, h, T, hd], views of the groups' outputs
        return *(t for group in heads for t in group), bias_rows

    def _heads(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The n projections of a group's output [B, T, n E] as [B, h, T, head_dim] views. Unbound from one
        permuted view, not sliced: the backward then stacks their gradients in one copy (slices' backward fills a
        zero [B, T, n E] tensor per slice and adds into it)."""
        if t.shape[-1] == self.embed_dim:
            return (t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2),)
        return t.unflatten(-1, (-1, self.num_heads, self.head_dim)).permute(2, 0, 3, 1, 4).unbind(0)

    def _mask(self, attn_mask, key_padding_mask, b: int, tgt: int, src: int, appended: int, dtype: torch.dtype):
        """The additive float mask [B or 1, h or 1, L, S + appended] of ``attn_mask`` (2-D [L, S], or 3-D
        [B * heads, L, S]: example i's heads are rows i * heads ...) and ``key_padding_mask`` [B, S], both already
        float (torch's ``_canonical_mask``), with 0 (attend) for the appended bias_k and zero positions, as torch
        pads them; None if neither."""
        mask = None
        if attn_mask is not None:
            shape = (tgt, src) if attn_mask.dim() == 2 else (b * self.num_heads, tgt, src)
            if tuple(attn_mask.shape) != shape:
                raise RuntimeError(f"The shape of the {attn_mask.dim()}D attn_mask is {attn_mask.shape}, but should "
                                   f"be {shape}.")  # fmt: skip
            mask = attn_mask.view(-1 if attn_mask.dim() == 3 else 1, self.num_heads if attn_mask.dim() == 3 else 1,
                                  tgt, src)  # fmt: skip
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (b, src):
                raise RuntimeError(f"expected key_padding_mask of shape {(b, src)}, but got "
                                   f"{tuple(key_padding_mask.shape)}")  # fmt: skip
            padding = key_padding_mask.view(b, 1, 1, src)
            mask = padding if mask is None else mask + padding
        if mask is not None and appended:
            mask = F.pad(mask, (0, appended))
        return None if mask is None else mask.to(dtype)

    # ------------------------------------------------------------------------------------------- after the backward

    def _groups(self, saved, grad_out: torch.Tensor):
        """([(A [B, T, d], G [B, T, p])] per input group, G of the bias_k/bias_v rows [B, 2, E] or None), split from
        the carrier's G (module docstring)."""
        b, e = grad_out.shape[0], self.embed_dim
        shapes = [(a.shape[1], (hi - lo) * e) for a, (lo, hi) in zip(saved, _GROUP_ROWS[len(saved)], strict=True)]
        if self.bias_k is not None:
            shapes.append((2, e))
        parts = grad_out.reshape(b, sum(t * p for t, p in shapes)).split([t * p for t, p in shapes], 1)
        parts = [part.view(b, *shape) for part, shape in zip(parts, shapes, strict=True)]
        return list(zip(saved, parts, strict=False)), (parts[-1] if self.bias_k is not None else None)

    def _group_weight(self, index: int) -> nn.Parameter:
        """The parameter holding group ``index``'s weight rows: the packed ``in_proj_weight``, or q/k/v_proj_weight."""
        return self.in_proj_weight if self._qkv_same_embed_dim else getattr(self, _SEPARATE[index])

    def _trains_parameter(self, name: str) -> bool:
        """Whether the parameter ``name`` exists and trains."""
        p = getattr(self, name)
        return p is not None and p.requires_grad

    def _trainable_names(self) -> list[str]:
        """Names of ``dp_parameters()``, in its order."""
        return [name for name, p in self._parameters.items() if p is not None and p.requires_grad]

    def per_example_sq_norms(self, saved, grad_out: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        groups, bias_rows = self._groups(saved, grad_out)
        total = torch.zeros(grad_out.shape[0], dtype=torch.float64, device=grad_out.device)
        for i, (a, g) in enumerate(groups):
            if self._group_weight(i).requires_grad:
                own = {} if cache is not None else None
                total += _sequence_weight_sq(a, g, own)
                if own:
                    cache[f"weight{i}"] = own["weight"]
        if self._trains_parameter("in_proj_bias"):
            bias = torch.cat([g.sum(1) for _, g in groups], 1)  # per-example in-projection bias gradients
            if cache is not None:
                cache["bias"] = bias
            total += _rowsq(bias)
        for j, name in enumerate(("bias_k", "bias_v")):
            if self._trains_parameter(name):
                total += _rowsq(bias_rows[:, j])
        return total

    def clipped_grad_sums(
        self, saved, grad_out: torch.Tensor, factors: torch.Tensor, cache: dict | None = None
    ) -> list[torch.Tensor]:
        groups, bias_rows = self._groups(saved, grad_out)
        sums, weights = {}, []
        for i, (a, g) in enumerate(groups):
            if self._group_weight(i).requires_grad:
                key = f"weight{i}"
                weights.append(summation.weighted_sum(factors, cache[key]) if cache and key in cache
                               else _clipped_weight_sum(a, g, factors))  # fmt: skip
        if weights and self._qkv_same_embed_dim:
            sums["in_proj_weight"] = weights[0] if len(weights) == 1 else torch.cat(weights, 0)
        elif weights:
            trained = [name for name in _SEPARATE if self._trains_parameter(name)]
            sums.update(zip(trained, weights, strict=True))
        if self._trains_parameter("in_proj_bias"):
            bias = (
                cache["bias"]
                if cache and "bias" in cache
                else torch.cat([g.to(torch.float64).sum(1) for _, g in groups], 1)
            )  # as JL projects it
            sums["in_proj_bias"] = summation.weighted_sum(factors, bias)
        for j, name in enumerate(("bias_k", "bias_v")):
            if self._trains_parameter(name):
                sums[name] = summation.weighted_sum(factors, bias_rows[:, j]).view(1, 1, -1)
        return [sums[name] for name in self._trainable_names()]

    def per_example_forms(self, saved, grad_out: torch.Tensor) -> list[Form]:
        """``fastdp.nn.forms`` of each trainable parameter (an attention called more than once in a forward): the
        packed in-projection's ``sum_t g_t a_t^T`` over every group's positions, each group's G placed in its rows of
        ``[B, T_i, 3E]`` (zeros elsewhere); a separate q/k/v weight's own group; the biases' per-example gradients."""
        groups, bias_rows = self._groups(saved, grad_out)
        b, e = grad_out.shape[0], self.embed_dim
        of: dict[str, Form] = {}
        if self._qkv_same_embed_dim and self.in_proj_weight.requires_grad:
            rows = _GROUP_ROWS[len(groups)]
            lefts = [F.pad(g, (lo * e, (3 - hi) * e)) for (_, g), (lo, hi) in zip(groups, rows, strict=True)]
            of["in_proj_weight"] = Outer(torch.cat(lefts, 1), torch.cat([a for a, _ in groups], 1))
        elif not self._qkv_same_embed_dim:
            for i, (a, g) in enumerate(groups):
                if self._group_weight(i).requires_grad:
                    of[_SEPARATE[i]] = Outer(g, a)
        if self._trains_parameter("in_proj_bias"):
            of["in_proj_bias"] = Dense(torch.cat([g.sum(1) for _, g in groups], 1))
        for j, name in enumerate(("bias_k", "bias_v")):
            if self._trains_parameter(name):
                of[name] = Dense(bias_rows[:, j].reshape(b, 1, 1, e))
        return [of[name] for name in self._trainable_names()]

    def per_example_projections(
        self, saved, grad_out: torch.Tensor, tangents: list[torch.Tensor], cache: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The groups' per-example weight and bias gradients formed in float64 and projected a chunk of examples at a
        time (:func:`~fastdp.nn.layers._projections`), each on its rows of the tangents; the bias_k/bias_v gradients
        (G's rows, summed as they are: no positions) directly."""
        of = dict(zip(self._trainable_names(), tangents, strict=True))
        rows = _GROUP_ROWS[len(saved)]
        e = self.embed_dim
        split = []  # tangents in the order of the pieces below
        for i, (lo, hi) in enumerate(rows):
            if self._group_weight(i).requires_grad:
                split.append(of["in_proj_weight"][:, lo * e : hi * e] if self._qkv_same_embed_dim
                             else of[_SEPARATE[i]])  # fmt: skip
        if self._trains_parameter("in_proj_bias"):
            split += [of["in_proj_bias"][:, lo * e : hi * e] for lo, hi in rows]
        split += [of[name] for name in ("bias_k", "bias_v") if self._trains_parameter(name)]

        def pieces(part_saved, part_grad):
            groups, bias_rows = self._groups(part_saved, part_grad.to(torch.float64))
            groups = [(a.to(torch.float64), g) for a, g in groups]
            out = [(torch.einsum("btp,btd->bpd", g, a), _mass(a, g), a.shape[1]) for i, (a, g) in enumerate(groups)
                   if self._group_weight(i).requires_grad]  # fmt: skip
            if self._trains_parameter("in_proj_bias"):
                out += [(g.sum(1), _mass(None, g), g.shape[1]) for _, g in groups]
            for j, name in enumerate(("bias_k", "bias_v")):
                if self._trains_parameter(name):
                    row = bias_rows[:, j : j + 1]
                    out.append((row[:, 0], _mass(None, row), 0))
            return out

        return _projections(pieces, saved, grad_out, split)


DP_LAYERS[nn.MultiheadAttention] = MultiheadAttention
