"""DP-SGD-JL (Bu et al. 2021): per-example norms estimated from r Johnson-Lindenstrauss projections.

One step, for the batch B (Poisson-sampled with rate q from N examples), with g_i the gradient of example i's loss:
    v_1..v_r ~ N(0, I_d)                       fresh each step, shared by the batch, independent of the data
    P_ij     = <g_i, v_j>                      r projections per example, no per-example norm
    M_i      = sqrt((1/r) sum_j P_ij^2)         E[M_i^2] = ||g_i||^2,  M_i / ||g_i|| ~ sqrt(chi2_r / r)
    w_i      = min(1, C / (M_i + ...))          constants (see "Rounding" below for the ...)
    G        = sum_i w_i g_i + N(0, (sigma C)^2 I)
    grad     = G / (q N)

How. One forward and one backward through fastdp's DP layers (``fastdp.nn``, as DP-SGD's ghost mode: plain torch
layers are converted): each layer keeps its input A and output gradient G, and gives each example's projections
``P_ij = <a_i^T g_i, v_j>`` (each DP layer's ``per_example_projections``: its per-example gradient formed in float64
for a chunk of examples at a time and projected, never kept; an Embedding gathers the tangents' rows by token
instead); the re-weighted sum is then each layer's clipped sum of the same A and G with factors w_i (one GEMM). The
paper computes P with r forward-mode jvp's and the sum with a second, re-weighted backward; fastdp departs from it
because there the estimate and the sum are two computations with different rounding (next paragraph).

Rounding (privacy review, issue 14). The accountant (``fastdp.privacy.jl``) needs each example's contribution to be
at most ``C Z`` with ``Z = ||g|| / M(g)``, M the projection estimate *of the very vector summed*. When the jvp's and
the backward's roundings differ, an example whose positions cancel at large magnitude (its true gradient tiny against
``u sum_t |a_t| |g_t|``) had an estimate of one rounding and a contribution of another: 1.44 x the bound at 1e7 in
fp32. Now both come from the same A and G: ``err_i`` bounds the float64 projections' error, and the sum is float64
with its rounding inside the clip bound ``C' = C / (1 + s)`` (``fastdp.ops.summation``), given each example's
clipped mass within ``MASS_RATIO C'``: the layers' ``allowance`` is ``E_i = mass_i / MASS_RATIO``, and
``w_i = min(1, C' / (max(M_i + err_i + 1e-6, K E_i) (1 + 4u)))`` with ``K = 1 / z_floor``
(``fastdp.privacy.jl.jl_z_floor``: the smallest Z the accountant credits, 0.46 for r = 10). The contribution
``w_i g_i`` has norm at most ``C' Z``, and with the sum's rounding one example moves the release by at most
``C max(Z, z_floor)``, which the accountant accounts. The bias's sums over positions are float64, the vectors
projected.

Tangents come from fastdp's counter-based noise stream (4-draw sums, like the noise) under a key of their own:
by default one OS-entropy key per step, drawn the first time the step is seen and kept until its release, so every
micro-batch of a logical step (and, data-parallel, every rank) projects on the same r tangents, as the analysis
assumes (one set per step); with a reproducible seed (NOT FOR RELEASE) the noise seed mixed with a constant, counter
``step * r + j`` (``fastdp.privacy.rng.PrivacyKeys.tangent_key``). They are drawn one DP layer at a time (that
layer's parameters' part of each tangent, the same values as drawing the whole model's), ``chunk`` tangents of the
layer at a time, held in float64 while that layer projects on them, never stored r x d, never reused across steps.

Memory and chunks (issue 19). The projections are the only memory DP-SGD-JL adds to what a ghost-norm step holds:
one layer's tangents (float64) and that layer's working set for a block of examples. Half of a budget goes to each
(``layer_plan``): the chunk (tangents a layer projects at once) and the block (examples at once), each at least 1.
The budget is ``memory_budget`` times the step's reference memory R (parameters + every DP layer's saved input A and
output gradient G: about what a non-private step keeps alive), at least 4 MiB; ``memory_budget_bytes`` gives it in
bytes, ``chunk`` fixes the chunk for every layer. Default 0.5: bench_jl's MLP at batch 256 peaks at 1.94x its
non-private step for any r, as DP-SGD does (it was 14x at r = 10 with the whole model's tangents drawn 8 at a time),
its CNN at 1.17x (was 3.3x); ``docs/variant-jl.md``. The chunk is not a privacy or math setting: the tangents, the
order in which P's columns are summed over layers and the bounds' validity are the same for every chunk. Bit for
bit, what may differ is float64: the last bits of P (a layer's projections of c tangents or b examples side by side
are GEMMs whose rounding, MKL's or cuBLAS', may differ with c and b) and ``err``,
a bound for every tangent that a layer computes from the largest tangent of its chunk (so smaller chunks can give a
slightly smaller bound). Both move the clip factors' denominators by ~1e-14 of M (measured on bench_jl's workloads,
err itself being ~1e-10 of M), and the factors are rounded to float32 before the sum: the released sums are
identical for chunks 1, 3, r and small budgets on every model kind the tests try (tests/test_jl_memory.py), and can
differ (by one float32 rounding of one example's factor) only when a factor lies within that ~1e-14 of a float32
rounding boundary, about 5e-7 of the clipped examples.

Privacy. w_i g_i can exceed C when M_i under-estimates ||g_i||, so a step is not a Gaussian mechanism with
sensitivity C: it is dominated by a Gaussian mechanism whose sensitivity Z_r = (chi2_r / r)^(-1/2) is random and
revealed (Bu et al. 2021 Thm B.7). The accountant is the PLD of that mixture (``fastdp.privacy.jl``); RDP cannot account
it (its privacy loss has moments only below r/2) and is refused. DP-Adam-JL is this gradient fed to Adam (the
trainer's ``--optimizer adam``; torch's Adam, whose second-moment bias correction uses beta2 -- the paper's
Algorithm 2 misprints beta1 there).

Models: those of DP-SGD's ghost mode (every trainable parameter in a DP layer; layers that mix examples refused,
``fastdp.nn.check_supported``; a layer's rows must be examples, ``fastdp.nn.rows``). Dropout is allowed: the
projections and the sum read the same forward.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from fastdp._precision import exact_fp32
from fastdp.algorithms.base import (
    SUMMED_IN_LOW_PRECISION,
    Batch,
    Variant,
    draw_eagerly,
    per_example_cross_entropy,
    release_noisy_mean,
    sum_dtype,
    trainable_parameters,
)
from fastdp.algorithms.dpsgd import GhostBackward, dp_layers, ghost_backward
from fastdp.nn import check_supported, convert
from fastdp.ops import add_noise_at_, rounding_gamma, summation
from fastdp.privacy.jl import jl_z_floor
from fastdp.privacy.rng import NOISE_DRAWS, PrivacyKeys
from fastdp.ref.noise import stream_starts

NORM_EPS = 1e-6  # in the clip factor's denominator, as in DP-SGD


def _tangents_of(
    params: list[torch.Tensor], which: list[int], keys: PrivacyKeys, step: int, projections: int, first: int,
    count: int, dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """Tangents ``first .. first + count - 1`` of ``step`` restricted to ``params[k]`` for k in ``which``: one
    ``[count, *params[k].shape]`` tensor each, drawn in float32 (float64 for float64 parameters), rounded to the
    parameter's dtype (as the model sees them), then held in ``dtype`` (default: the parameter's; float64 for the
    projections: exact). Only one tangent of these parameters in the drawing dtype exists at a time."""
    if torch.compiler.is_compiling():
        return _tangents_of_eagerly(params, which, keys, step, projections, first, count, dtype)
    seed, base = keys.tangent_key(step, projections)
    starts = stream_starts([p.numel() for p in params])
    chosen = [params[k] for k in which]
    out = [torch.empty(count, *p.shape, dtype=dtype or p.dtype, device=p.device) for p in chosen]
    for j in range(count):
        draws = [torch.zeros(p.shape, dtype=torch.float64 if p.dtype == torch.float64 else torch.float32,
                             device=p.device) for p in chosen]  # fmt: skip
        add_noise_at_(draws, 1.0, [starts[k] for k in which], seed, base + first + j, NOISE_DRAWS)
        for held, drawn, p in zip(out, draws, chosen, strict=True):
            held[j].copy_(drawn.to(p.dtype))
    return out


_tangents_of_eagerly = draw_eagerly(_tangents_of)


def draw_tangents(
    params: list[torch.Tensor], keys: PrivacyKeys, step: int, projections: int, first: int, count: int
) -> list[torch.Tensor]:
    """Tangents ``first .. first + count - 1`` of ``step``: one [count, *p.shape] N(0, 1) tensor per parameter (4-draw
    sums). Tangent j is counter ``base + j`` under the step's tangent key (``keys.tangent_key``: one key per step,
    whatever the chunking or the micro-batch), the parameters' elements numbered in list order as in one
    ``add_noise_`` call (``fastdp.ref.noise.stream_starts``). Under torch.compile they are drawn eagerly
    (``draw_eagerly``): never replayed from a captured graph. :func:`jl_projections` draws the same tangents one
    layer at a time."""
    return _tangents_of(params, list(range(len(params))), keys, step, projections, first, count)


# Memory (module docstring, "Memory and chunks"). While it projects, DP-SGD-JL holds, beyond the parameters and each
# DP layer's A and G, one layer's tangents (float64) and that layer's float64 working set for the examples it projects
# at once (copies of their A and G, unfolded patches, per-example gradients, their products with the tangents). Half
# the budget goes to each: the chunk (tangents at a time) and the rows (examples at a time) of every layer call.
DEFAULT_MEMORY_BUDGET = 0.5
MIN_BUDGET_BYTES = 4 << 20  # a relative budget below 4 MiB is raised to it (small models: fewer, larger calls)


def reference_bytes(run: GhostBackward) -> int:
    """R: bytes of the trainable parameters and of every DP layer call's saved inputs (A) and output gradients (G):
    about what a non-private step of the same model and batch keeps alive (parameters, gradients, activations)."""
    tensors = list(run.params) + [g for g in run.grads_out if g is not None]
    for saved in run.saved:
        tensors += [t for t in (saved or ()) if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def tangent_bytes(layer: nn.Module) -> int:
    """What one more tangent of ``layer`` costs while it is projected, bytes: the tangent in float64 and a float64
    working copy (a layer may lay several tangents out side by side)."""
    return 16 * sum(p.numel() for p in layer.dp_parameters())


def row_bytes(layer: nn.Module, saved: tuple, grad_out: torch.Tensor, count: int) -> int:
    """An estimate of the float64 working set per example of ``layer.per_example_projections`` on ``count``
    tangents, bytes: its A (times the patches' overlap, ``prod(kernel_size) / prod(stride)``, for a convolution)
    and G in float64, then a 2-D Linear's products ``G V_j`` (in_features per tangent) or, for other layers, the
    per-example gradient (the layer's parameter count) and the projections."""
    b = max(1, grad_out.shape[0])
    a = sum(t.numel() for t in saved if isinstance(t, torch.Tensor)) // b
    g = grad_out.numel() // b
    kernel, stride = getattr(layer, "kernel_size", None), getattr(layer, "stride", None)
    if isinstance(kernel, tuple) and isinstance(stride, tuple):
        a = a * max(1, math.prod(kernel) // max(1, math.prod(stride)))
    if isinstance(layer, nn.Linear) and len(saved) == 1 and saved[0].dim() == 2:
        return 8 * (a + g + count * a)
    return 8 * (a + g + sum(p.numel() for p in layer.dp_parameters()) + count)


def layer_plan(run: GhostBackward, projections: int, budget_bytes: float, chunk: int | None = None) -> list:
    """``(chunk, rows)`` of each DP layer call: tangents projected at once (``chunk`` if given, else as many as fit in
    half the budget, :func:`tangent_bytes` each) and examples at once (as many as fit in the other half,
    :func:`row_bytes` each, at most the batch); each at least 1."""
    plan = []
    for layer, saved, grad_out in zip(run.layers, run.saved, run.grads_out, strict=True):
        size = chunk or max(1, min(projections, int(budget_bytes / 2 // max(1, tangent_bytes(layer)))))
        rows = max(1, min(grad_out.shape[0], int(budget_bytes / 2 // max(1, row_bytes(layer, saved, grad_out, size)))))
        plan.append((size, rows))
    return plan


def _project(layer, saved: tuple, grad_out: torch.Tensor, tangents: list, cache, rows: int):
    """``layer.per_example_projections`` ``rows`` examples at a time (each a row of A and G). A layer that keeps
    per-example tensors in its cache for the clipped sum (which must then be the very tensors projected, for the
    whole batch) is projected whole."""
    b = grad_out.shape[0]
    batch_major = all(not isinstance(t, torch.Tensor) or (t.dim() and t.shape[0] == b) for t in saved)
    if rows >= b or not batch_major:
        return layer.per_example_projections(saved, grad_out, tangents, cache)
    parts = []
    for start in range(0, b, rows):
        part = slice(start, start + rows)
        probe: dict = {}
        sliced = tuple(t[part] if isinstance(t, torch.Tensor) else t for t in saved)
        parts.append(layer.per_example_projections(sliced, grad_out[part], tangents, probe))
        if probe:
            return layer.per_example_projections(saved, grad_out, tangents, cache)
    return tuple(torch.cat(pieces) for pieces in zip(*parts, strict=True))


def jl_projections(
    run: GhostBackward,
    keys: PrivacyKeys,
    step: int,
    projections: int,
    chunk: int | None = None,
    caches: list | None = None,
    memory_budget: float = DEFAULT_MEMORY_BUDGET,
    memory_budget_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(P [B, r], err [B], allowance [B])``, float64, summed over the DP layers of ``run``: the projections of each
    example's gradient onto the step's r tangents, the bound on their rounding (for every j) and the bound on the
    clipped sum's rounding per unit weight (each DP layer's ``per_example_projections``). ``caches``: one dict per
    layer call, filled for the layers' clipped sums.

    One layer call at a time: its tangents are drawn (:func:`draw_tangents`' values, the layer's parameters only),
    a chunk at a time, and projected, a block of examples at a time (:func:`layer_plan`; ``chunk`` fixes the
    tangents at once for every layer) within the memory budget: ``memory_budget_bytes``, else ``memory_budget``
    times :func:`reference_bytes` (at least :data:`MIN_BUDGET_BYTES`). Chunks and blocks change what is held at
    once, not what is computed: each column of P is the same sum over layers in the same order, each example's the
    same sum over its layer's positions, and ``err`` is each layer's bound maximised over its chunks, summed over the
    layers (for each layer, a bound for every one of its tangents, whatever their grouping). Only the layers' float64
    GEMMs may round differently for a different number of tangents or examples side by side (last bits of P; module
    docstring, "Memory and chunks")."""
    b = run.grads_out[0].shape[0] if run.grads_out else 0
    device = run.losses.device
    p = torch.zeros(b, projections, dtype=torch.float64, device=device)
    err = torch.zeros(b, dtype=torch.float64, device=device)
    allowance = torch.zeros_like(err)
    caches = caches if caches is not None else [None] * len(run.layers)
    if memory_budget_bytes is None:
        budget = max(memory_budget * reference_bytes(run), MIN_BUDGET_BYTES)
    else:
        budget = memory_budget_bytes
    plan = layer_plan(run, projections, budget, chunk)
    index = {id(q): k for k, q in enumerate(run.params)}
    for layer, saved, grad_out, cache, (size, rows) in zip(run.layers, run.saved, run.grads_out, caches, plan,
                                                           strict=True):  # fmt: skip
        which = [index[id(q)] for q in layer.dp_parameters()]
        layer_err = torch.zeros_like(err)
        for first in range(0, projections, size):
            count = min(size, projections - first)
            tangents = _tangents_of(run.params, which, keys, step, projections, first, count, torch.float64)
            proj, e, a = _project(layer, saved, grad_out, tangents, cache, rows)
            del tangents
            p[:, first : first + count] += proj
            layer_err = torch.maximum(layer_err, e)
            if first == 0:
                allowance += a
        err += layer_err
    return p, err, allowance


def norm_estimates(p: torch.Tensor) -> torch.Tensor:
    """M_i = sqrt(mean_j P_ij^2): the JL estimate of each example's gradient norm."""
    return p.pow(2).mean(dim=1).sqrt()


def jl_weights(
    p: torch.Tensor, err: torch.Tensor, allowance: torch.Tensor, clip_norm: float, z_floor: float, acc: torch.dtype
) -> torch.Tensor:
    """``w_i = min(1, C / (max(M_i + err_i + 1e-6, allowance_i / z_floor) (1 + 4u)))`` (module docstring,
    "Rounding"): the factor whose contribution ``w_i g_i`` stays within ``C max(Z, z_floor)`` and whose clipped mass
    within ``MASS_RATIO C`` (``fastdp.ops.summation``). M is rounded up (its own float64 rounding); ``(1 + 4u)``
    covers rounding w to ``acc`` (u its unit roundoff)."""
    m = norm_estimates(p) * (1 + rounding_gamma(p.shape[1] + 4, torch.float64))
    denominator = torch.maximum(m + err + NORM_EPS, allowance / z_floor) * (1 + 4 * torch.finfo(acc).eps / 2)
    return (clip_norm / denominator).clamp(max=1.0)


def _clipped_sum(run: GhostBackward, weights: torch.Tensor, caches: list) -> list[torch.Tensor]:
    sums = []
    with exact_fp32():  # the per-example gradients a layer forms are normed as formed, in IEEE float32
        for layer, saved, grad_out, cache in zip(run.layers, run.saved, run.grads_out, caches, strict=True):
            sums.append(layer.clipped_grad_sums(saved, grad_out, weights, cache))
    return run.by_parameter(sums)


class JL(Variant):
    """DP-SGD-JL: clip factors from r JL norm estimates; noise std sigma * C on the sum; its own accountant."""

    name = "jl"
    private = True
    front_door = "ghost"
    draws_tangents = True  # data-parallel OS-entropy runs share each step's tangent key (fastdp.engine.distributed)
    low_precision_refusal = (
        "its rounding bounds (fastdp.algorithms.jl, 'Rounding') are made for fp32 and float64 layer inputs and "
        "sums; " + SUMMED_IN_LOW_PRECISION
    )

    def __init__(
        self,
        clip_norm: float,
        noise_multiplier: float,
        sample_rate: float,
        num_examples: int,
        projections: int = 10,
        reproducible_seed: int | None = None,
        loss_fn=per_example_cross_entropy,
        chunk: int | None = None,
        memory_budget: float = DEFAULT_MEMORY_BUDGET,
        memory_budget_bytes: int | None = None,
    ) -> None:
        super().__init__(loss_fn)
        if not (math.isfinite(clip_norm) and clip_norm > 0):
            raise ValueError(f"clip norm C must be finite and > 0, got {clip_norm}")
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"noise multiplier must be finite and >= 0, got {noise_multiplier}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
        if isinstance(projections, bool) or not isinstance(projections, int) or projections < 1:
            raise ValueError(
                f"JL projections r must be an integer >= 1, got {projections!r} (exact norms: use the dpsgd variant)"
            )
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk (tangents a layer projects at a time) must be None (from the memory budget) or "
                             f"an integer >= 1, got {chunk!r}")  # fmt: skip
        if (
            isinstance(memory_budget, bool)
            or not isinstance(memory_budget, (int, float))
            or not (math.isfinite(memory_budget) and memory_budget > 0)
        ):
            raise ValueError(f"memory_budget (a multiple of the step's reference memory, see jl_projections) must be "
                             f"finite and > 0, got {memory_budget!r}")  # fmt: skip
        if memory_budget_bytes is not None and (
            isinstance(memory_budget_bytes, bool) or not isinstance(memory_budget_bytes, int) or memory_budget_bytes < 1
        ):
            raise ValueError(f"memory_budget_bytes must be None or an integer >= 1, got {memory_budget_bytes!r}")
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.sample_rate = float(sample_rate)
        self.expected_batch_size = self.sample_rate * num_examples
        self.num_examples = int(num_examples)
        self.projections = projections
        self.keys = PrivacyKeys(reproducible_seed)  # None: OS entropy; an int: reproducible, NOT FOR RELEASE
        self.chunk = chunk  # None: each layer's chunk from the memory budget (jl_projections)
        self.memory_budget = float(memory_budget)
        self.memory_budget_bytes = memory_budget_bytes
        # the smallest Z the accountant credits (sigma = 0, noiseless: the bins' quantile without a tail cut)
        self.z_floor = jl_z_floor(projections, self.noise_multiplier if self.noise_multiplier > 0 else math.inf)
        self._prepared: weakref.WeakSet = weakref.WeakSet()  # models converted (by identity; a freed id can recur)

    @classmethod
    def from_config(cls, config, *, noise_multiplier, sample_rate, num_examples, noise_seed) -> JL:
        # jl_chunk / jl_memory_budget: TrainConfig fields (the CLI's --jl-chunk, --jl-memory-budget) or entries of its
        # ``extra`` dict; absent or None, the defaults (each layer's chunk from a budget of DEFAULT_MEMORY_BUDGET)
        extra = getattr(config, "extra", None) or {}
        chunk = getattr(config, "jl_chunk", None) or extra.get("jl_chunk")
        budget = getattr(config, "jl_memory_budget", None) or extra.get("jl_memory_budget") or DEFAULT_MEMORY_BUDGET
        return cls(config.clip_norm, noise_multiplier, sample_rate, num_examples, projections=config.projections,
                   reproducible_seed=noise_seed, chunk=chunk, memory_budget=budget)  # fmt: skip

    @classmethod
    def accounting_projections(cls, config) -> float:
        return config.projections

    def prepare(self, model: nn.Module) -> None:
        """Convert torch layers to DP layers once per model (in place; parameters are kept), as DP-SGD's ghost mode."""
        if model not in self._prepared:
            convert(model)
            self._prepared.add(model)

    def row_layers(self, model: nn.Module) -> list[nn.Module]:
        """Every DP layer's input rows are projected and summed per example."""
        return dp_layers(model)

    def clip_weights(self, run: GhostBackward, mask: torch.Tensor, step: int, caches: list) -> torch.Tensor:
        """w_i (:func:`jl_weights`) on real rows (``mask``), 0 on padding."""
        p, err, allowance = jl_projections(run, self.keys, step, self.projections, self.chunk, caches,
                                           self.memory_budget, self.memory_budget_bytes)  # fmt: skip
        acc = torch.float64 if run.grads_out and run.grads_out[0].dtype == torch.float64 else torch.float32
        clip = summation.clip_bound(self.clip_norm, self.num_examples, summation.world_size())
        weights = jl_weights(p, err, allowance, clip, self.z_floor, acc)
        return (weights * mask.to(weights.dtype)).to(acc)  # rounded to acc: jl_weights' (1 + 4u) covers it

    def sums_of_backward(
        self, model: nn.Module, run: GhostBackward, mask: torch.Tensor, step: int, loss_scale: float = 1.0
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """:meth:`clipped_sum` of a backward the caller ran (the front door, ``fastdp.engine``); fp32/float64.
        ``run.grads_out`` are gradients of ``loss_scale`` times the summed per-example losses: divided out first
        (the projections' rounding bounds are those of the gradients they project)."""
        low = [str(g.dtype) for g in run.grads_out if g.dtype not in (torch.float32, torch.float64)]
        if low:
            raise ValueError(f"DP-SGD-JL trains in fp32 only, but the backward ran in {low[0]} (autocast): "
                             f"{self.low_precision_refusal}. Run the forward without autocast")  # fmt: skip
        if loss_scale != 1.0:
            run.grads_out = [g / loss_scale for g in run.grads_out]
        caches = [{} for _ in run.layers]
        return _clipped_sum(run, self.clip_weights(run, mask, step, caches), caches), run.losses.sum()

    def clipped_sum(self, model: nn.Module, batch: Batch, step: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        self.prepare(model)
        check_supported(model)  # every step: train/eval mode and tied weights can change after convert()
        if batch.x.shape[0] == 0:
            params = trainable_parameters(model)
            return [torch.zeros_like(p, dtype=sum_dtype(p)) for p in params], torch.zeros((), device=batch.x.device)
        return self.sums_of_backward(model, ghost_backward(model, self.loss_fn, batch, self._forward), batch.mask, step)

    def release(self, model: nn.Module, sums: list[torch.Tensor], step: int) -> None:
        params = trainable_parameters(model)
        stds = [self.noise_multiplier * self.clip_norm] * len(params)
        release_noisy_mean(params, sums, stds, self.expected_batch_size, self.keys, step)

    def privacy_event(self) -> tuple[float, float]:
        return self.noise_multiplier, self.sample_rate

    def describe(self) -> dict:
        return {
            "variant": self.name,
            "clip_norm": self.clip_norm,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "expected_batch_size": self.expected_batch_size,
            "projections": self.projections,
            "privacy_randomness": self.keys.label,
        }
