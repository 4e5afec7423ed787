"""What each variant claims for one step, read two ways: from the variant itself, and derived independently.

A step releases, per trainable tensor l, ``(S_l + N(0, s_l^2)) / b``: S_l the sum of the examples' bounded
contributions, s_l the noise std on the sum, b = qN the expected batch size. The variant claims

* sensitivity groups: disjoint sets of tensors g with an add/remove L2 bound Delta_g on one example's joint
  contribution to them (DP-SGD: one group, every tensor, Delta = C; per-layer clipping: one group per layer;
  Lipschitz variants and backprop clipping: one group per tensor);
* the noise std s_l of every tensor (equal within a group);
* the accounting event (sigma, q): the group mechanisms (multipliers s_g / Delta_g) must compose to sigma,
  ``(sum_g (Delta_g / s_g)^2)^(-1/2) = sigma`` (``fastdp.privacy.per_layer_noise_multiplier``).

:func:`claim_of` reads these numbers from the variant's own code (``DPSGD._noise_stds``, ``Clipless.noise_stds``
and ``last_bounds``, ``parameter_sensitivities``), :func:`expected_claim` re-derives them from the
hyperparameters and the model (exact spectral norms for the Lipschitz bounds), so a wrong scale in either is
caught. The audit knows the variants by type on purpose: it checks each one's claim against its paper.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from fastdp.algorithms import DPSGD, JL, BackpropClip, Clipless, Variant
from fastdp.algorithms.base import rounding_noise_factor, trainable_parameters
from fastdp.algorithms.dpsgd import dp_layers
from fastdp.nn.backprop import parameter_sensitivities
from fastdp.nn.lipschitz import BoundedInput, GroupSort2, LipschitzLinear, TauCrossEntropy
from fastdp.privacy.accounting import per_layer_noise_multiplier

EXACT = (1 - 1e-6, 1 + 1e-6)  # claimed / expected for closed-form claims (float32 stds carry ~1e-7 rounding)
# Lipschitz bounds use certified spectral norms (>= the exact one, by at most a factor rank^(1/2^13) per layer,
# lipschitz.CERTIFY_ITERS): the claim may exceed the exact-norm bound by 1% at most, never fall below it.
CERTIFIED = (1 - 1e-6, 1.01)


@dataclass(frozen=True)
class Claim:
    """One step's claim (see the module docstring); sensitivities and stds are on the clipped *sum*."""

    names: tuple[str, ...]  # trainable parameters, in trainable_parameters order
    groups: tuple[tuple[int, ...], ...]  # indices into names; one group per bound
    sensitivities: tuple[float, ...]  # Delta_g per group
    stds: tuple[float, ...]  # s_l per tensor
    noise_multiplier: float  # sigma, what the accountant records
    sample_rate: float  # q
    expected_batch_size: float  # b = qN, the release's divisor
    projections: float = math.inf  # JL: sensitivity C Z_r with Z_r = (chi2_r / r)^(-1/2), random; inf: exact

    def group_of(self) -> list[int]:
        """Group index of every tensor."""
        out = [-1] * len(self.names)
        for g, members in enumerate(self.groups):
            for i in members:
                out[i] = g
        return out

    def composed_noise_multiplier(self) -> float:
        """(sum_g (Delta_g / s_g)^2)^(-1/2): the multiplier the released tensors amount to. Raises if a group's
        tensors have different stds (the composition then needs the per-tensor split, which no variant claims)."""
        group_stds = []
        for g, members in enumerate(self.groups):
            stds = {self.stds[i] for i in members}
            if max(stds) > min(stds) * (1 + 1e-6):
                raise ValueError(f"group {g} ({', '.join(self.names[i] for i in members)}) has unequal stds {stds}")
            group_stds.append(self.stds[members[0]])
        return per_layer_noise_multiplier(self.sensitivities, group_stds)


@dataclass(frozen=True)
class Expectation:
    """The claim re-derived independently: ``sensitivities`` per group and ``stds`` per tensor, with the accepted
    range [lo, hi] of claimed / expected; ``how`` says what it was derived from."""

    groups: tuple[tuple[int, ...], ...]
    sensitivities: tuple[float, ...]
    stds: tuple[float, ...]
    lo: float
    hi: float
    how: str


class _NoiselessKeys:
    """The keys of a :func:`noiseless` twin: the original's JL tangents (reproducible keys derive them from the step
    alone), and a noise key that is never refused for a repeated step: the twin adds no noise (std 0), and the
    audit evaluates adjacent batches at one step index."""

    def __init__(self, keys) -> None:
        self._keys = keys
        self.reproducible, self.label = keys.reproducible, keys.label

    def noise_key(self, step: int) -> tuple[int, int]:
        return 0, step

    def tangent_key(self, step: int, projections: int) -> tuple[int, int]:
        return self._keys.tangent_key(step, projections)


def noiseless(variant: Variant) -> Variant:
    """A shallow copy of ``variant`` with noise multiplier 0: its release is the noiseless released update
    (sum / b), computed by the variant's own code. The copy shares the original's prepared-model state and JL
    tangents; its noise key (of a zero std) may serve one step index several times."""
    if not variant.private:
        return variant
    twin = copy.copy(variant)
    twin.noise_multiplier = 0.0
    twin.keys = _NoiselessKeys(variant.keys)
    return twin


def claim_of(variant: Variant, model: nn.Module) -> Claim | None:
    """The variant's own claim for ``model`` (None for a non-private variant). Call after at least one step of
    ``variant`` on ``model`` (layers converted, token positions recorded)."""
    if not variant.private:
        return None
    params = trainable_parameters(model)
    names = _names(model, params)
    sigma, q = variant.privacy_event()
    every = (tuple(range(len(params))),)
    projections = math.inf
    if isinstance(variant, DPSGD):
        stds = variant._noise_stds(model, params)
        if isinstance(variant.clip_norm, float):
            groups, sensitivities = every, (variant.clip_norm,)
        else:
            index = {id(p): i for i, p in enumerate(params)}
            groups = tuple(tuple(index[id(p)] for p in layer.dp_parameters()) for layer in dp_layers(model))
            sensitivities = tuple(variant.clip_norm)
    elif isinstance(variant, JL):
        # JL's release computes its std inline: sigma C on every tensor (fastdp.algorithms.jl)
        groups, sensitivities = every, (variant.clip_norm,)
        stds = [variant.noise_multiplier * variant.clip_norm] * len(params)
        projections = float(variant.projections)
    elif isinstance(variant, Clipless):  # and WeightClip
        with torch.no_grad():
            stds = variant.noise_stds(model).double().tolist()
        groups = tuple((i,) for i in range(len(params)))
        sensitivities = tuple(variant.last_bounds.double().tolist())
    elif isinstance(variant, BackpropClip):
        bounds = parameter_sensitivities(model)
        groups = tuple((i,) for i in range(len(params)))
        sensitivities = tuple(float(bounds[p]) for p in params)
        # as BackpropClip.release: times 1 + s for the rounding of the float64 batch sums
        scale = variant.noise_multiplier * math.sqrt(len(params)) * rounding_noise_factor(variant.num_examples)
        stds = [scale * s for s in sensitivities]
    else:
        raise ValueError(
            f"the audit has no claim reader for variant {variant.name!r}; add one to fastdp.audit.claims "
            "(claim_of and expected_claim)"
        )
    return Claim(names=names, groups=groups, sensitivities=tuple(float(s) for s in sensitivities),
                 stds=tuple(float(s) for s in stds), noise_multiplier=float(sigma), sample_rate=float(q),
                 expected_batch_size=float(variant.expected_batch_size), projections=projections)  # fmt: skip


def expected_claim(variant: Variant, model: nn.Module) -> Expectation | None:
    """The claim derived from the variant's hyperparameters and the model, without the variant's code: DP-SGD
    sigma C (per-layer: sigma sqrt(L) C_l on layer l), JL sigma C, backprop clipping sigma sqrt(N) C1 C2 on
    weights and sigma sqrt(N) C2 on biases ([B, d] inputs), Lipschitz MLPs sigma sqrt(D) Delta_l (global:
    sigma sqrt(sum Delta^2)) with Delta_l from exact spectral norms; the last two times 1 + s, the rounding of their
    float64 batch sums (``fastdp.ops.summation.sensitivity_slack``). None where no derivation applies (a
    non-private variant, or a Lipschitz model other than a chain of LipschitzLinear and 1-Lipschitz
    activations)."""
    if not variant.private:
        return None
    params = trainable_parameters(model)
    n = len(params)
    every = (tuple(range(n)),)
    if isinstance(variant, DPSGD):
        sigma = variant.noise_multiplier
        if isinstance(variant.clip_norm, float):
            c = variant.clip_norm
            return Expectation(every, (c,), (sigma * c,) * n, *EXACT, "sigma C on every tensor (Abadi et al.)")
        owners = _owner_index(model, params)
        layers = len(variant.clip_norm)
        if max(owners) + 1 != layers:
            raise ValueError(f"per-layer clipping with {layers} clip norms on a model with {max(owners) + 1} layers")
        groups = tuple(tuple(i for i in range(n) if owners[i] == layer) for layer in range(layers))
        stds = tuple(sigma * math.sqrt(layers) * variant.clip_norm[owners[i]] for i in range(n))
        return Expectation(groups, tuple(variant.clip_norm), stds, *EXACT,
                           "per-layer clipping: sigma sqrt(L) C_l on layer l")  # fmt: skip
    if isinstance(variant, JL):
        c = variant.clip_norm
        how = "sigma C on every tensor (Bu et al.; sensitivity C Z_r, accounted by the JL PLD)"
        return Expectation(every, (c,), (variant.noise_multiplier * c,) * n, *EXACT, how)
    if isinstance(variant, BackpropClip):
        bounds = tuple(variant.input_clip * variant.grad_clip if p.dim() >= 2 else variant.grad_clip for p in params)
        scale = variant.noise_multiplier * math.sqrt(n) * rounding_noise_factor(variant.num_examples)
        how = ("sigma sqrt(N) C1 C2 on weights, sigma sqrt(N) C2 on biases (Stevens et al., corrected), times 1 + s "
               "for the rounding of the float64 batch sums")  # fmt: skip
        return Expectation(tuple((i,) for i in range(n)), bounds, tuple(scale * d for d in bounds), *EXACT, how)
    if isinstance(variant, Clipless):
        bounds = _lipschitz_chain_bounds(variant, model, params)
        if bounds is None:
            return None
        # sigma itself unless the logit-clip count shares the step's noise; 1 + s: the float64 batch sums' rounding
        sigma = variant.gradient_noise_multiplier * rounding_noise_factor(variant.num_examples)
        if variant.strategy == "global":
            stds = (sigma * math.sqrt(sum(d * d for d in bounds)),) * n
        else:
            stds = tuple(sigma * math.sqrt(n) * d for d in bounds)
        how = "Lipschitz chain bounds from exact spectral norms (Bethune et al.; Barczewski and Ramon)"
        return Expectation(tuple((i,) for i in range(n)), tuple(bounds), stds, *CERTIFIED, how)
    return None


def _names(model: nn.Module, params: list[nn.Parameter]) -> tuple[str, ...]:
    by_id = {id(p): name for name, p in model.named_parameters()}
    return tuple(by_id.get(id(p), f"param{i}") for i, p in enumerate(params))


def _owner_index(model: nn.Module, params: list[nn.Parameter]) -> list[int]:
    """For each parameter, the index of the module owning it directly, counting modules with trainable parameters
    in ``model.modules()`` order (the order per-layer clip norms are given in)."""
    owner: dict[int, int] = {}
    layers = 0
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        for p in own:
            owner[id(p)] = layers
        layers += bool(own)
    return [owner[id(p)] for p in params]


def _lipschitz_chain_bounds(variant: Clipless, model: nn.Module, params: list[nn.Parameter]) -> list[float] | None:
    """Per-example gradient-norm bounds of a Sequential chain BoundedInput? -> (Flatten | LipschitzLinear | ReLU |
    GroupSort2)* under TauCrossEntropy, from exact spectral norms (float64 SVD): forward X_k = ||W_k|| X_{k-1} +
    ||b_k||, backward G = L_loss prod_{j > k} ||W_j||; Delta_{W_k} = G X_{k-1}, Delta_{b_k} = G."""
    if not isinstance(model, nn.Sequential) or not isinstance(variant.loss_fn, TauCrossEntropy):
        return None
    x_bound = math.inf if variant.input_bound is None else variant.input_bound
    inputs: list[tuple[LipschitzLinear, float]] = []
    for layer in model:
        if isinstance(layer, BoundedInput):
            x_bound = min(x_bound, layer.bound)
        elif isinstance(layer, LipschitzLinear):
            weight = layer.weight.detach().double()
            if weight.dim() != 2:
                return None
            inputs.append((layer, x_bound))
            norm = float(torch.linalg.matrix_norm(weight, ord=2))
            bias = 0.0 if layer.bias is None else float(layer.bias.detach().double().norm())
            x_bound = norm * x_bound + bias
        elif not isinstance(layer, (nn.Flatten, nn.ReLU, GroupSort2)):
            return None
    g_bound = math.sqrt(2.0)  # ||softmax(tau z) - onehot(y)|| <= sqrt(2), divided by tau and multiplied by tau
    if variant.logit_clip is not None:  # logit-clip quantile: each example's logit gradient clipped to C_t
        g_bound = min(g_bound, float(variant.logit_clip))
    bounds: dict[int, float] = {}
    for layer, x_in in reversed(inputs):
        bounds[id(layer.weight)] = g_bound * x_in
        if layer.bias is not None:
            bounds[id(layer.bias)] = g_bound
        g_bound *= float(torch.linalg.matrix_norm(layer.weight.detach().double(), ord=2))
    if any(id(p) not in bounds for p in params):
        return None
    return [bounds[id(p)] for p in params]
