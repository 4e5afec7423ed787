"""DP-SGD (Abadi et al. 2016): per-example clipping to C, Gaussian noise on the clipped sum.

One step, for the batch B (Poisson-sampled with rate q from N examples):
    g_i  = grad of loss_i,   c_i = min(1, C / (||g_i||_2 + 1e-6))      (||.|| over all parameters)
    G    = sum_i c_i g_i + N(0, (sigma C)^2 I)
    grad = G / (q N)                                                  (expected batch size)
Adjacency add/remove-one: the sum has L2 sensitivity C, so the noise multiplier sigma is
what the accountant records with sample rate q.

Two ways to get the clipped sum, same result:
* ``mode="ghost"`` (default): one forward and one backward through fastdp DP layers
  (``fastdp.nn``; plain torch layers are converted): per-example norms from each layer's
  input and output gradient, then each layer's clipped sum as one GEMM (book-keeping).
* ``mode="reference"``: per-example gradients from ``torch.func`` (vmap of grad); any
  module, slow; the baseline for tests.

Per-layer clipping: ``clip_norm`` may be a list with one threshold C_l per DP layer (in
``model.modules()`` order). Layer l's part of each per-example gradient is clipped to C_l
and its sum gets noise std sigma * sqrt(L) * C_l: L Gaussian mechanisms with multipliers
sigma * sqrt(L), which account as one with multiplier (sum_l (sigma sqrt L)^-2)^-1/2 = sigma
(``fastdp.privacy.per_layer_noise_multiplier``).

Mixed precision (``set_precision("bf16" | "fp16")``): the sensitivity bound holds under low-precision rounding.
Only the model's forward runs under autocast (``Variant._forward``), and so, through the dtypes autocast chose, the
backward that produces each DP layer's output gradient G; each layer's saved input A is the low-precision tensor
its matmul consumed. Everything after the backward runs outside autocast with fp32 accumulation (``_clip_and_sum``):
each example's squared norm ||a_i^T g_i||^2 (or its ghost form), its clip factor c_i, and its contribution
c_i a_i^T g_i to the clipped sum are computed from the *same* A and G rows. The sensitivity argument never needed
A and G to be exact: it needs each example's contribution to depend on that example alone (no layer mixes
examples, ``check_supported``; the loss scale is a fixed constant) and to have norm <= C. Rounding in the forward
and backward only makes a_i, g_i different functions of example i; given them, the norm and the contribution are
computed exactly as in fp32 training, so ||c_i a_i^T g_i|| <= C up to fp32 rounding of these fp32 computations
(relative ~1e-7, the same caveat as fp32 training). What rounding changes is which gradient gets clipped, i.e. the
accuracy, not the bound (tests/test_precision.py: each example's contribution <= C (1 + 1e-5) under bf16 and fp16,
adversarial inputs included; its norm is close to, not equal to, the fp32 per-example gradient's from torch.func).
fp16 scales the summed loss by a fixed power of two S before the backward: the squared norms are divided by S^2 and
the factors by S in fp32, both exact. The reference mode (``torch.func`` per-example gradients) is fp32 only:
torch.func's vmap fails on the autocast backward of LayerNorm.

Non-finite examples under bf16/fp16: an example whose squared norm (or loss) is not finite in some layer (an
overflow in its forward or backward, common in fp16; NaN/Inf in its input) contributes exactly zero: its factor is
set to 0 and the NaN/Inf entries of A and G to 0 before the sums, and its loss is left out of the summed loss. That
is a per-example operation like clipping (the decision reads that example alone), so the sum stays finite, every
example's contribution is its clipped gradient or zero (norm <= C either way), and the step is released and
accounted as usual. Refusing or skipping the step instead would reveal, unnoised, that some example of the batch was
non-finite. Such examples are counted in ``nonfinite_examples`` (reported by ``describe``: a count over the private
data, not noised, so a diagnostic for the data owner, not something to publish with the model).

In fp32 (both modes) there is no such step: it costs an elementwise pass over every layer's A and G, measured at
+10-18% of the step time of the mlp-256 benchmark on CPU (README, "Bad input and faults"), and in fp32 a non-finite
example comes only from non-finite data (the trainer refuses it when the data set is loaded) or a diverged model. Its
NaN reaches the sum and the weights, and the trainer stops the run at the end of the epoch (FloatingPointError, no
record, checkpoint, result or epsilon), as for the other variants.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.func import functional_call, grad, vmap

from fastdp._precision import exact_fp32
from fastdp.algorithms.base import (
    Batch,
    Variant,
    per_example_cross_entropy,
    release_noisy_mean,
    sum_dtype,
    trainable_parameters,
)
from fastdp.nn import (
    DPLayer,
    GhostClipping,
    batch_statistics_layers,
    check_supported,
    convert,
    refuse_batch_statistics,
)
from fastdp.nn.forms import (
    formed_norm_sq,
    formed_sq_norms,
    formed_sums,
    formed_weighted_sums,
    map_tensors,
    parameter_uses,
    shared_parameters,
)
from fastdp.nn.layers import DIRECT_MEMORY_BUDGET
from fastdp.ops import clip_factors, summation
from fastdp.ops.summation import CompensatedSum
from fastdp.privacy.accounting import per_layer_noise_multiplier
from fastdp.privacy.rng import PrivacyKeys

NORM_EPS = 1e-6  # in the clip factor's denominator (Opacus' convention)
MODES = ("ghost", "reference")


def per_example_gradients(
    model: torch.nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, forward=None
) -> list[torch.Tensor]:
    """Gradient of each example's loss w.r.t. each trainable parameter: tensors of shape [B, *p.shape].
    ``forward(fn, x)`` runs the model's forward ``fn`` (default ``fn(x)``; DP-SGD passes its ``_forward``)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())

    def example_loss(trainable, xi, yi):
        def run(inputs):
            return functional_call(model, {**trainable, **frozen, **buffers}, (inputs,))

        out = run(xi.unsqueeze(0)) if forward is None else forward(run, xi.unsqueeze(0))
        return loss_fn(out, yi.unsqueeze(0)).sum()

    grads = vmap(grad(example_loss), in_dims=(None, 0, 0), randomness="different")(params, x, y)
    return [grads[n] for n in names]


def dp_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The DP layers of ``model`` with trainable parameters, in ``model.modules()`` order (per-layer clipping)."""
    return [m for m in model.modules() if isinstance(m, DPLayer) and m.dp_parameters()]


def _check_per_layer(model: torch.nn.Module, clip_norm: float | Sequence[float]) -> list[torch.nn.Module]:
    """The DP layers of ``model`` (:func:`dp_layers`); per-layer clipping: refuse a count of clip norms that is not
    one per layer."""
    layers = dp_layers(model)
    if not isinstance(clip_norm, (int, float)) and len(layers) != len(clip_norm):
        raise ValueError(
            f"per-layer clipping: {len(clip_norm)} clip norms for {len(layers)} DP layers with trainable "
            "parameters; give one per layer, in model.modules() order (DP layers are fastdp.nn layers: "
            "fastdp.nn.convert(model) makes them, as the ghost mode does)"
        )
    return layers


def _factors(sq_norms: torch.Tensor, clip_norm: float | Sequence[float]) -> torch.Tensor:
    """Clip factors [L, B] from per-layer squared norms [L, B]: one global bound, or one per layer."""
    if isinstance(clip_norm, (int, float)):
        _, factors = clip_factors(sq_norms, float(clip_norm))
        return factors.unsqueeze(0).expand_as(sq_norms)
    bounds = torch.tensor(clip_norm, dtype=sq_norms.dtype, device=sq_norms.device).unsqueeze(1)
    return (bounds / (sq_norms.sqrt() + NORM_EPS)).clamp(max=1.0)


def _finite_entries(value):
    """``value`` (a tensor, or a list/tuple of them) with its NaN and +-Inf entries replaced by 0; integer tensors
    (token ids) are returned as they are. With its clip factor set to 0, an example dropped as not finite then
    contributes exactly 0 (0 times finite entries); the rows of the examples kept are all finite (their norms are),
    so they are unchanged. One elementwise pass (``nan_to_num``: several times cheaper on CPU than a row-masked
    ``torch.where``)."""
    if isinstance(value, (list, tuple)):
        return type(value)(_finite_entries(v) for v in value)
    if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
        return value
    return torch.nan_to_num(value, nan=0.0, posinf=0.0, neginf=0.0)


def ghost_clipped_gradient_sum(
    model: torch.nn.Module,
    loss_fn,
    batch: Batch,
    clip_norm: float | Sequence[float],
    scale: float = 1.0,
    forward=None,
    loss_scale: float = 1.0,
    finite_only: bool = False,
    form_budget: int | None = DIRECT_MEMORY_BUDGET,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(sum over real examples of the clipped per-example gradients per trainable parameter, times ``scale``;
    summed loss). ``scale`` rides on the clip factors (DP-SGD passes 1/(qN), saving a pass over the gradients).

    One forward and one backward through fastdp DP layers; per-example gradients are never formed where the
    ghost norm is cheaper. ``model`` must consist of DP layers (see :func:`fastdp.nn.convert`).

    Low precision (see the module docstring): ``forward(model, x)`` runs the model (default ``model(x)``; DP-SGD
    passes its autocast ``_forward``); the backward is of ``loss_scale`` times the summed loss, and the squared
    norms and the clip factors are unscaled in fp32. ``finite_only``: an example with a non-finite norm in any
    layer (an overflow in its forward or backward) contributes zero and its loss is left out of the summed loss.
    ``form_budget``: a layer call whose per-example gradients are smaller than its A and G (and this many bytes)
    forms them in its gradient hook and drops A and G (``fastdp.nn.ghost``); None keeps every A and G.
    """
    sums, loss, _ = _ghost_clipped_gradient_sum(model, loss_fn, batch, clip_norm, scale, forward, loss_scale,
                                                finite_only, form_budget)  # fmt: skip
    return sums, loss


def _ghost_clipped_gradient_sum(
    model, loss_fn, batch, clip_norm, scale, forward, loss_scale, finite_only, form_budget
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """:func:`ghost_clipped_gradient_sum`, and the number of real examples left out as not finite (``finite_only``;
    else None)."""
    params = trainable_parameters(model)
    check_supported(model)  # every step: train/eval mode and tied weights can change after convert()
    if batch.x.shape[0] == 0:
        zeros = [torch.zeros_like(p, dtype=sum_dtype(p)) for p in params]
        none = torch.zeros((), dtype=torch.int64, device=batch.x.device) if finite_only else None
        return zeros, torch.zeros((), device=batch.x.device), none
    run = ghost_backward(model, loss_fn, batch, forward, loss_scale, form_budget)
    return clipped_sums_of_backward(model, run, batch.mask, clip_norm, scale, loss_scale, finite_only)


def clipped_sums_of_backward(
    model, run: GhostBackward, mask: torch.Tensor, clip_norm, scale: float, loss_scale: float, finite_only: bool
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """The clipped sums (per trainable parameter, times ``scale``), summed loss and non-finite count
    (``finite_only``) of a backward through DP layers, however it was run: by :func:`ghost_backward`, or by a
    user's own loop through the front door (``fastdp.engine``). ``run.grads_out`` must be the gradients of
    ``loss_scale`` times the sum of the per-example losses."""
    if not isinstance(clip_norm, (int, float)):
        order = {id(m): i for i, m in enumerate(_check_per_layer(model, clip_norm))}
        clip_norm = [clip_norm[order[id(layer)]] for layer in run.layers]
    with exact_fp32():  # the sums' rounding allowance is IEEE float32's, whatever the user's TF32/bf16 settings
        layer_sums, shared_sums, loss, dropped = _clip_and_sum(run.layers, run.saved, run.grads_out, run.formed,
                                                               run.losses, mask, clip_norm, scale, loss_scale,
                                                               finite_only)  # fmt: skip
    return run.by_parameter(layer_sums, shared_sums), loss, dropped


@dataclass
class GhostBackward:
    """One forward and one backward through DP layers (:func:`ghost_backward`): per layer call, its layer, what it
    saved (A) and its output gradient G, or (``formed``) the per-example gradients its hook formed in their place
    (``fastdp.nn.ghost``; A and G are then None); the masked per-example losses (detached)."""

    params: list[torch.nn.Parameter]
    layers: list[torch.nn.Module]
    saved: list[tuple | None]
    grads_out: list[torch.Tensor | None]
    losses: torch.Tensor
    formed: list[list[torch.Tensor] | None] | None = None
    formed_from_half: bool = False  # some ``formed`` came from an A or G below float32 (autocast)

    @classmethod
    def of_records(cls, params: list, records: list, losses: torch.Tensor) -> GhostBackward:
        """From a :class:`fastdp.nn.GhostClipping` context's records after the backward; a call whose output got no
        gradient (unused by the loss) gets a zero G."""
        for r in records:
            r.check_saved()
        grads = [r.grad if r.grad is not None or r.formed is not None else torch.zeros(r.shape, dtype=r.dtype,
                 device=losses.device) for r in records]  # fmt: skip
        formed = [r.formed for r in records]
        return cls(params, [r.layer for r in records], [r.saved for r in records], grads, losses,
                   formed if any(f is not None for f in formed) else None,
                   any(r.formed_from_half for r in records))  # fmt: skip

    def by_parameter(
        self, layer_sums: list[list[torch.Tensor] | None], shared: dict[int, torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """Per-call sums (one tensor per ``dp_parameters()`` of each layer call, or None for a call whose sums are in
        ``shared``, by parameter ``id``) as one tensor per trainable parameter, in ``params`` order and its
        ``sum_dtype``; a parameter two calls use gets the sum of both calls' sums (a tied weight, a layer called
        twice)."""
        sums = {key: CompensatedSum().add_(total) for key, total in (shared or {}).items()}
        for layer, totals in zip(self.layers, layer_sums, strict=True):
            if totals is None:
                continue
            for p, total in zip(layer.dp_parameters(), totals, strict=True):
                sums.setdefault(id(p), CompensatedSum()).add_(total)
        return [sums[id(p)].value().to(sum_dtype(p)) for p in self.params]


def ghost_backward(
    model, loss_fn, batch: Batch, forward=None, loss_scale: float = 1.0, form_budget: int | None = None
) -> GhostBackward:
    """The forward of a non-empty ``batch`` in a GhostClipping context and one backward of ``loss_scale`` times the
    summed loss: each DP layer's A and G (or, with ``form_budget``, the per-example gradients formed in their place
    where smaller: ``fastdp.nn.ghost``), no weight gradient. Refuses layers called on a tensor that is not
    batch-first and trainable parameters used outside a DP layer."""
    params = trainable_parameters(model)
    losses, records = _ghost_forward(model, loss_fn, batch, forward, form_budget)
    size = batch.x.shape[0]
    for r in records:
        if len(r.shape) == 0 or r.shape[0] != size:
            raise ValueError(
                f"{type(r.layer).__name__} was called on a tensor whose first dimension ({tuple(r.shape)}) is not "
                f"the batch ({size} examples): DP layers need batch-first inputs so each row belongs to one example "
                "(a Linear or Conv applied to a tensor shared by the examples, e.g. a learned prompt, must see it "
                "expanded to the batch; an Embedding expands a shared [1, T] index itself)"
            )
    layers = [r.layer for r in records]
    owned = {id(p) for layer in layers for p in layer.dp_parameters()}
    missing = [p for p in params if id(p) not in owned]
    if missing:
        check_supported(model)  # names the modules if that is the cause
        raise ValueError(
            f"{len(missing)} trainable parameters were not used through a fastdp DP layer in the forward; "
            "freeze them or use DPSGD(mode='reference')"
        )
    # the layers' hooks collect G (of loss_scale times the loss); parameters were detached, so no .grad is touched
    (losses.sum() * loss_scale if loss_scale != 1.0 else losses.sum()).backward()
    return GhostBackward.of_records(params, records, losses.detach())


def _ghost_forward(model, loss_fn, batch: Batch, forward, form_budget: int | None) -> tuple[torch.Tensor, list]:
    """(masked per-example losses, the DP layers' records) of the forward in a GhostClipping context. A function of
    its own for torch.compile: a graph break inside the context (each layer's hook registration) makes dynamo run
    the frame that holds the context eagerly, and this keeps that frame small."""
    with GhostClipping(batch.x.shape[0], form_budget) as ctx:
        losses = loss_fn(model(batch.x) if forward is None else forward(model, batch.x), batch.y) * batch.mask
    return losses, ctx.records


def _clip_and_sum(
    layers: list,
    saved: list,
    grads_out: list,
    formed: list | None,
    losses: torch.Tensor,
    mask: torch.Tensor,
    clip_norm,
    scale: float,
    loss_scale: float,
    finite_only: bool,
) -> tuple[list[list[torch.Tensor] | None], dict[int, torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """After the backward, from each DP layer call's saved input A and output gradient G (or the per-example
    gradients its hook formed in their place, ``formed``): per-example norms, clip factors, the clipped sums, the
    summed loss, the non-finite count (``finite_only``). Pure tensor work, outside autocast (fp32 accumulation), one
    graph under torch.compile.

    Clipped sums: one list per layer call whose parameters no other call uses (None for the others), and a dict
    (parameter ``id`` -> sum) for the parameters of calls that share one (tied weights, a layer called twice: their
    per-example gradients sum the uses, normed with the cross terms, ``fastdp.nn.forms``)."""
    shared = shared_parameters(layers)
    alone = [not any(id(p) in shared for p in layer.dp_parameters()) for layer in layers]
    if shared and not isinstance(clip_norm, (int, float)):
        raise ValueError(
            "per-layer clipping needs each trainable parameter in one layer called once per forward, but this "
            "model shares parameters between layer calls (tied weights, or a layer called more than once); give "
            "one clip norm"
        )
    formed = formed or [None] * len(layers)
    dtypes = [t.dtype for t in grads_out if t is not None] + [ts[0].dtype for ts in formed if ts]
    acc = torch.float64 if torch.float64 in dtypes else torch.float32
    caches = [{} if own else None for own in alone]  # per-example gradients a layer formed for its norm, reused
    calls = list(zip(layers, saved, grads_out, caches, formed, alone, strict=True))
    rows = [layer.per_example_sq_norms(a, g, cache) if ts is None else formed_sq_norms(ts)
            for layer, a, g, cache, ts, own in calls if own]  # fmt: skip
    sharing = [i for i, own in enumerate(alone) if not own]
    uses = parameter_uses([layers[i] for i in sharing], [saved[i] for i in sharing], [grads_out[i] for i in sharing],
                          [formed[i] for i in sharing])  # fmt: skip
    if uses:
        row = formed_norm_sq(uses, acc, DIRECT_MEMORY_BUDGET)
        rows.append(row.to(rows[0].dtype) if rows else row)
    sq_norms = torch.stack(rows)
    inexact = math.frexp(loss_scale)[0] != 0.5  # a power of two divides exactly (fp16's loss scale)
    if loss_scale != 1.0:
        sq_norms = sq_norms / (loss_scale * loss_scale)
        if inexact:  # e.g. the front door's 1/n: the division rounded up, so no norm is underestimated
            sq_norms = sq_norms * (1 + 4 * torch.finfo(sq_norms.dtype).eps)
    factors = _factors(sq_norms, clip_norm) * (mask.to(sq_norms.dtype) * (scale / loss_scale))
    if inexact:  # and the rounding of scale / loss_scale in the factor taken off
        factors = factors * (1 - 4 * torch.finfo(factors.dtype).eps)
    dropped = None
    if finite_only:  # an example whose norm (or loss) is not finite contributes 0: factor 0, finite entries
        keep = torch.isfinite(sq_norms).all(0) & torch.isfinite(losses)
        dropped = (mask & ~keep).sum()
        factors = torch.where(keep, factors, 0)
        saved, grads_out, losses = _finite_entries(saved), _finite_entries(grads_out), torch.where(keep, losses, 0)
        caches = [None if cache is None else {k: _finite_entries(v) for k, v in cache.items()} for cache in caches]
        formed = [None if ts is None else _finite_entries(ts) for ts in formed]
        uses = map_tensors(uses, _finite_entries)
    own_factors = iter(factors)
    sums = [(layer.clipped_grad_sums(a, g, next(own_factors), cache) if ts is None else
             formed_weighted_sums(ts, next(own_factors))) if own else None
            for layer, a, g, cache, ts, own in zip(layers, saved, grads_out, caches, formed, alone,
                                                   strict=True)]  # fmt: skip
    shared_sums = formed_sums(uses, factors[-1]) if uses else {}
    return sums, shared_sums, losses.sum(), dropped


def clipped_gradient_sum(
    model: torch.nn.Module,
    loss_fn,
    batch: Batch,
    clip_norm: float | Sequence[float],
    scale: float = 1.0,
    forward=None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Same as :func:`ghost_clipped_gradient_sum` from ``torch.func`` per-example gradients (reference; fp32:
    ``DPSGD`` refuses low precision in this mode). Any module, except layers with batch statistics in training mode
    (refused: they make one example's gradient depend on the others)."""
    refuse_batch_statistics(
        batch_statistics_layers(model), "DPSGD(mode='reference') takes each example's gradient alone, but "
    )
    params = trainable_parameters(model)
    if batch.x.shape[0] == 0:
        return [torch.zeros_like(p, dtype=sum_dtype(p)) for p in params], torch.zeros((), device=batch.x.device)
    per_example = per_example_gradients(model, loss_fn, batch.x, batch.y, forward)
    if isinstance(clip_norm, (int, float)):
        groups = [list(range(len(params)))]
    else:  # one group per DP layer
        index = {id(p): i for i, p in enumerate(params)}
        groups = [[index[id(p)] for p in layer.dp_parameters()] for layer in _check_per_layer(model, clip_norm)]
    sq_norms = torch.stack([sum(summation.sq_norms_up(per_example[i]) for i in group) for group in groups])
    factors = _factors(sq_norms, clip_norm) * (batch.mask.to(sq_norms.dtype) * scale)
    sums = [None] * len(params)
    with exact_fp32():  # TF32/bf16 products would round c_i and the gradients beyond the clip
        for group, c in zip(groups, factors, strict=True):
            for i in group:
                sums[i] = summation.weighted_sum(c, per_example[i])
    with torch.no_grad():
        loss = (loss_fn(model(batch.x) if forward is None else forward(model, batch.x), batch.y) * batch.mask).sum()
    return sums, loss


class DPSGD(Variant):
    """DP-SGD with per-example clipping; ``noise_multiplier`` sigma, noise std sigma * C on the sum."""

    name = "dpsgd"
    private = True
    front_door = "ghost"
    form_budget = DIRECT_MEMORY_BUDGET
    low_precision_refusal = None  # sound under bf16/fp16 autocast: see the module docstring
    _graph_state = ("nonfinite_examples",)

    def __init__(
        self,
        clip_norm: float | Sequence[float],
        noise_multiplier: float,
        sample_rate: float,
        num_examples: int,
        reproducible_seed: int | None = None,
        mode: str = "ghost",
        loss_fn=per_example_cross_entropy,
    ) -> None:
        super().__init__(loss_fn)
        bounds = [clip_norm] if isinstance(clip_norm, (int, float)) else list(clip_norm)
        if not bounds or not all(math.isfinite(c) and c > 0 for c in bounds):
            raise ValueError(f"clip norm C must be finite and > 0 (one value, or one per DP layer), got {clip_norm}")
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"noise multiplier must be finite and >= 0, got {noise_multiplier}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
        if mode not in MODES:
            raise ValueError(f"unknown DP-SGD mode {mode!r}; choose one of {', '.join(MODES)}")
        self.clip_norm = float(clip_norm) if isinstance(clip_norm, (int, float)) else [float(c) for c in bounds]
        self.noise_multiplier = float(noise_multiplier)
        self.sample_rate = float(sample_rate)
        self.expected_batch_size = self.sample_rate * num_examples
        self.num_examples = int(num_examples)
        self.keys = PrivacyKeys(reproducible_seed)  # None: OS entropy; an int: reproducible, NOT FOR RELEASE
        self.mode = mode
        self._prepared: weakref.WeakSet = weakref.WeakSet()  # models converted (by identity; a freed id can recur)
        self.nonfinite_examples: torch.Tensor | int = 0  # bf16/fp16: real examples left out as not finite, so far

    @classmethod
    def from_config(cls, config, *, noise_multiplier, sample_rate, num_examples, noise_seed) -> DPSGD:
        return cls(config.clip_norm, noise_multiplier, sample_rate, num_examples, reproducible_seed=noise_seed)

    def prepare(self, model: torch.nn.Module) -> None:
        """Ghost mode: convert torch layers to DP layers once per model (in place; parameters are kept)."""
        if self.mode == "ghost" and model not in self._prepared:
            convert(model)
            self._prepared.add(model)

    def row_layers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """Ghost mode: every DP layer's input rows are normed and clipped per example (reference mode: torch.func
        takes each example alone, only the losses are checked)."""
        return dp_layers(model) if self.mode == "ghost" else []

    def _noise_stds(self, model: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[float]:
        """Noise std per trainable parameter tensor (``params``, in ``trainable_parameters`` order; on the sum)."""
        if isinstance(self.clip_norm, float):
            return [self.noise_multiplier * self.clip_norm] * len(params)
        layers = _check_per_layer(model, self.clip_norm)
        scale = self.noise_multiplier * math.sqrt(len(layers))
        std_of = {id(p): scale * c for layer, c in zip(layers, self.clip_norm, strict=True)
                  for p in layer.dp_parameters()}  # fmt: skip
        return [std_of[id(p)] for p in params]

    def sum_clip_norm(self) -> float | list[float]:
        """The clip bound(s) the sums are clipped at: C' = C / (1 + s) (``fastdp.ops.summation.clip_bound``), so that
        with the float64 sums' rounding one example moves the release by at most C, the noise's calibration."""
        world = summation.world_size()
        if isinstance(self.clip_norm, float):
            return summation.clip_bound(self.clip_norm, self.num_examples, world)
        return [summation.clip_bound(c, self.num_examples, world) for c in self.clip_norm]

    def clipped_sum(self, model: torch.nn.Module, batch: Batch, step: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        # 1/(qN) rides on the clip factors and the noise std is scaled to match (release): the same release as
        # noise on the sum divided by qN, without a division pass over the gradients
        self.prepare(model)
        scale = 1.0 / self.expected_batch_size
        if self.mode == "reference":
            return clipped_gradient_sum(model, self.loss_fn, batch, self.sum_clip_norm(), scale, self._forward)
        # bf16/fp16: a non-finite example contributes zero (module docstring, "Non-finite examples")
        sums, loss, dropped = _ghost_clipped_gradient_sum(model, self.loss_fn, batch, self.sum_clip_norm(), scale,
                                                          self._forward, self.loss_scale,
                                                          self.precision != "fp32", self.form_budget)  # fmt: skip
        if dropped is not None:
            self.nonfinite_examples = self.nonfinite_examples + dropped
        return sums, loss

    def sums_of_backward(
        self, model: torch.nn.Module, run: GhostBackward, mask: torch.Tensor, step: int, loss_scale: float = 1.0
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """:meth:`clipped_sum` of a backward the caller ran (the front door: the user's own forward, loss and
        ``loss.backward()``; ``run.grads_out`` are gradients of ``loss_scale`` times the sum of the per-example
        losses, e.g. 1/n for a mean: folded into the clip factors, not a copy of G), times the fp16 loss scale
        :meth:`set_precision` set, if any (the trainer scales its backward by it). Ghost mode; low-precision A or G
        (the user's autocast) get the non-finite handling of bf16/fp16."""
        if self.mode != "ghost":
            raise ValueError("DPSGD(mode='reference') recomputes per-example gradients with torch.func and cannot "
                             "use a backward run by the caller; use mode='ghost'")  # fmt: skip
        low = run.formed_from_half or any(
            t.is_floating_point() and t.dtype != torch.float64 and t.dtype != torch.float32
            for t in [*run.grads_out, *(a for saved in run.saved if saved is not None for a in saved)]
            if t is not None
        )
        scale, finite_only = 1.0 / self.expected_batch_size, low or self.precision != "fp32"
        sums, loss, dropped = clipped_sums_of_backward(model, run, mask, self.sum_clip_norm(), scale,
                                                       loss_scale * self.loss_scale, finite_only)  # fmt: skip
        if dropped is not None:
            self.nonfinite_examples = self.nonfinite_examples + dropped
        return sums, loss

    def set_precision(self, precision: str, loss_scale: float | None = None) -> None:
        if precision != "fp32" and self.mode == "reference":
            raise ValueError(
                "DPSGD(mode='reference') runs in fp32 only: torch.func's vmap fails on the backward of an autocast "
                "LayerNorm ('expected scalar type BFloat16 but found Float', seen with torch 2.13 on CPU), so the "
                f"reference cannot cover every model. Use mode='ghost' (the default) for {precision}, or fp32"
            )
        super().set_precision(precision, loss_scale)

    def release(self, model: torch.nn.Module, sums: list[torch.Tensor], step: int) -> None:
        params = trainable_parameters(model)
        stds = [std / self.expected_batch_size for std in self._noise_stds(model, params)]
        release_noisy_mean(params, sums, stds, 1.0, self.keys, step)

    def privacy_event(self) -> tuple[float, float]:
        if isinstance(self.clip_norm, float):
            return self.noise_multiplier, self.sample_rate
        layers = len(self.clip_norm)
        stds = [self.noise_multiplier * math.sqrt(layers) * c for c in self.clip_norm]
        return per_layer_noise_multiplier(self.clip_norm, stds), self.sample_rate

    def describe(self) -> dict:
        return {
            "variant": self.name,
            "mode": self.mode,
            "clip_norm": self.clip_norm,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "expected_batch_size": self.expected_batch_size,
            "precision": self.precision,
            "loss_scale": self.loss_scale,
            "nonfinite_examples": int(self.nonfinite_examples),
            "privacy_randomness": self.keys.label,
        }
