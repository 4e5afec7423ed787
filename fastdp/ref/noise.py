"""Reference of the fused per-tensor Gaussian noise, and the definition of the noise stream.

fastdp noise stream v1 (the CPU, CUDA and Triton kernels implement the same stream,
so all backends draw the same noise up to the rounding of log/sqrt/cos/sin in fp32):

* Elements of a list of tensors are numbered in list order, each tensor's first
  element at ``stream_starts(numels)[t]`` (previous sizes rounded up to a multiple
  of 4), so a tensor's noise does not depend on how the list is split into launches.
* Element ``e``, draw ``k`` (of ``num_draws``): Philox4x32-10 with key = the 64-bit
  ``seed`` and counter ``(q_lo, q_hi + k * 2**28, offset_lo, offset_hi)`` where
  ``q = e // 4``; the four 32-bit outputs become uniforms ``u = r * 2**-32 + 2**-33``
  (fp32, in (0, 1]) and two Box-Muller pairs ``sqrt(-2 ln u0) * (cos, sin)(2 pi u1)``;
  element ``e`` takes output ``e % 4``.
* With ``num_draws`` > 1 the noise is ``sum_k n_k / sqrt(num_draws)`` (still N(0, 1)).

One draw is bounded by ``sqrt(2 * 33 * ln 2) = 6.76`` standard deviations (the
smallest uniform is 2**-33; each Box-Muller pair has radius <= R = 6.77 with fp32 log
rounding); the 4-draw value, ``(n1 + n2 + n3 + n4) / 2``, has pair radius <= 2R = 13.54.
Every fastdp variant releases with 4 draws; the bound this leaves is
``fastdp.privacy.accounting.truncation_delta`` (``docs/privacy-randomness.md``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

_MASK32 = 0xFFFFFFFF
_PHILOX_MUL = (0xD2511F53, 0xCD9E8D57)
_PHILOX_WEYL = (0x9E3779B9, 0xBB67AE85)
_DRAW_SHIFT = 28
MAX_DRAWS = 1 << (32 - _DRAW_SHIFT)
MAX_STREAM_ELEMENTS = 1 << (32 + _DRAW_SHIFT + 2)


def stream_starts(numels: Sequence[int]) -> list[int]:
    """Index of each tensor's first element in the noise stream (multiples of 4)."""
    starts, position = [], 0
    for numel in numels:
        starts.append(position)
        position += (int(numel) + 3) // 4 * 4
    if position > MAX_STREAM_ELEMENTS:
        raise ValueError(f"fastdp noise: {position} elements exceed the stream's 2**62 limit")
    return starts


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * b for a constant a < 2**32 and int64 b in [0, 2**32)."""
    a1, a0 = a >> 16, a & 0xFFFF
    b1, b0 = b >> 16, b & 0xFFFF
    low = a0 * b0 + ((a1 * b0 + a0 * b1) << 16)  # < 2**50: exact in int64
    return a1 * b1 + (low >> 32), low & _MASK32


def philox4x32_10(counter: Sequence[torch.Tensor], key: tuple[int, int]) -> list[torch.Tensor]:
    """Philox4x32-10 (Salmon et al. 2011) on int64 tensors holding uint32 values."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        hi0, lo0 = _mulhilo(_PHILOX_MUL[0], c0)
        hi1, lo1 = _mulhilo(_PHILOX_MUL[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _PHILOX_WEYL[0]) & _MASK32
        k1 = (k1 + _PHILOX_WEYL[1]) & _MASK32
    return [c0, c1, c2, c3]


def _unit(r: torch.Tensor) -> torch.Tensor:
    """Uniform in (0, 1], computed in fp32 exactly as the kernels do, returned as float64."""
    return (r.to(torch.float32) * 2.0**-32 + 2.0**-33).to(torch.float64)


def standard_normal(
    seed: int, offset: int, start: int, numel: int, num_draws: int = 1, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Elements ``start .. start + numel`` of the noise stream, as float64 N(0, 1) draws."""
    if start % 4:
        raise ValueError(f"fastdp noise: stream start must be a multiple of 4, got {start}")
    groups = (numel + 3) // 4
    q = torch.arange(start // 4, start // 4 + groups, dtype=torch.int64, device=device)
    key = (seed & _MASK32, (seed >> 32) & _MASK32)
    c2 = torch.full_like(q, offset & _MASK32)
    c3 = torch.full_like(q, (offset >> 32) & _MASK32)
    total = torch.zeros(groups, 4, dtype=torch.float64, device=device)
    for draw in range(num_draws):
        c1 = (q >> 32) + (draw << _DRAW_SHIFT)
        r0, r1, r2, r3 = philox4x32_10((q & _MASK32, c1, c2, c3), key)
        rad0 = torch.sqrt(-2.0 * torch.log(_unit(r0)))
        rad1 = torch.sqrt(-2.0 * torch.log(_unit(r2)))
        angle0, angle1 = 2.0 * math.pi * _unit(r1), 2.0 * math.pi * _unit(r3)
        total += torch.stack(
            [rad0 * torch.cos(angle0), rad0 * torch.sin(angle0), rad1 * torch.cos(angle1), rad1 * torch.sin(angle1)],
            dim=1,
        )
    if num_draws > 1:
        total /= math.sqrt(num_draws)
    return total.reshape(-1)[:numel]


def noise_(
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    stds: Sequence[float],
    starts: Sequence[int],
    seed: int,
    offset: int,
    num_draws: int,
    step: float,
) -> None:
    """Reference kernel: ``g += s z`` for each grad or, with params, ``p -= step (g + s z)``.

    Same calling convention as the compiled kernels; computes in float64 and rounds once.
    """
    for t, grad in enumerate(grads):
        if grad.numel() == 0:
            continue
        z = standard_normal(seed, offset, starts[t], grad.numel(), num_draws, grad.device)
        noisy = grad.reshape(-1).to(torch.float64) + stds[t] * z
        if params:
            param = params[t].reshape(-1)
            param.copy_(param.to(torch.float64) - step * noisy)
        else:
            grad.reshape(-1).copy_(noisy)


RELEASE, RELEASE_SGD, RELEASE_ADAM = 2, 3, 4  # the release kinds (csrc/include/fastdp/noise.h)
HYPER_FIELDS = ("scale", "lr", "weight_decay", "decay", "momentum", "beta1_weight", "beta2", "beta2_weight", "eps",
                "step_size", "bc2_sqrt", "nesterov", "maximize", "amsgrad")  # fmt: skip


def release_(
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    states: Sequence[Sequence[torch.Tensor]],
    stds: Sequence[float],
    starts: Sequence[int],
    grad_weights: Sequence[float],
    seed: int,
    offset: int,
    num_draws: int,
    update: int,
    hyper: Sequence[float],
) -> None:
    """Reference of the release kinds: ``g <- (g + s z) / scale`` for each grad (the released mean), then for
    ``update`` 3 torch.optim.SGD's update of ``params[t]`` (momentum buffer ``states[0][t]``, its gradient weight
    ``grad_weights[t]``: 1 - dampening, 1 for a new zeroed buffer) or for 4 torch.optim.Adam's / AdamW's
    (``states``: exp_avg, exp_avg_sq, max_exp_avg_sq), in torch's order of operations. ``hyper``: the values of
    ``HYPER_FIELDS``. Float64 arithmetic, each result rounded once to its tensor's dtype."""
    h = dict(zip(HYPER_FIELDS, hyper, strict=True))
    for t, grad in enumerate(grads):
        if grad.numel() == 0:
            continue
        z = standard_normal(seed, offset, starts[t], grad.numel(), num_draws, grad.device)
        g = (grad.reshape(-1).to(torch.float64) + stds[t] * z) / h["scale"]
        grad.reshape(-1).copy_(g)
        if update == RELEASE:
            continue
        param = params[t].reshape(-1)
        p = param.to(torch.float64)
        d = -g if h["maximize"] else g
        if h["weight_decay"]:
            d = d + h["weight_decay"] * p
        state = [s[t].reshape(-1) if s else None for s in states]
        if update == RELEASE_SGD:
            if h["momentum"]:
                buf = h["momentum"] * state[0].to(torch.float64) + grad_weights[t] * d
                state[0].copy_(buf)
                d = d + h["momentum"] * buf if h["nesterov"] else buf
            param.copy_(p - h["lr"] * d)
            continue
        p = p * h["decay"]
        m = state[0].to(torch.float64)
        m = m + h["beta1_weight"] * (d - m)
        v = state[1].to(torch.float64) * h["beta2"] + h["beta2_weight"] * d * d
        state[0].copy_(m)
        state[1].copy_(v)
        if h["amsgrad"]:
            v = torch.maximum(state[2].to(torch.float64), v)
            state[2].copy_(v)
        param.copy_(p - h["step_size"] * (m / (v.sqrt() / h["bc2_sqrt"] + h["eps"])))
