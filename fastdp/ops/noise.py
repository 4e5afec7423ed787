"""Fused per-tensor Gaussian noise: ``fastdp::add_noise_``, ``fastdp::noisy_sgd_step_`` and the release
``release_`` (noise, the division by q*N and an optimizer's update in one pass).

Units. ``grads`` hold the *sum* of the (clipped) per-example gradients, so the
sensitivity of tensor t is the clip bound Delta_t and its noise std is
``stds[t] = sigma_t * Delta_t`` (global noise: every std equal). The fused step
divides by ``scale``, the expected batch size q*N (never the realised size):

    add_noise_:       g_t <- g_t + N(0, stds[t]^2 I)
    noisy_sgd_step_:  p_t <- p_t - lr * (g_t + N(0, stds[t]^2 I)) / scale
    release_:         g_t <- (g_t + N(0, stds[t]^2 I)) / scale, then (optional) torch.optim.SGD's or Adam's
                      update of the parameters from g_t, with their optimizer state

Randomness is the counter-based fastdp noise stream (``fastdp.ref.noise``): a
(seed, offset) pair fixes the draw, bitwise on a given backend, whatever the list
is split into; the caller must use a new offset (e.g. the step number) per step.

Draws. ``num_draws=4`` makes each noise value the sum of 4 independent draws divided
by 2: Opacus' mitigation of the floating-point attacks on Box-Muller samplers (Jin et
al., S&P 2022), which exploit the gaps in the set of floats one draw can produce, and
a support of 13.54 standard deviations per pair of coordinates instead of 6.76 (see
``docs/privacy-randomness.md``). Every fastdp variant releases with 4 draws, keyed by
OS entropy or, on explicit request, by a reproducible seed
(``fastdp.privacy.rng.PrivacyKeys``). The ops' default, one draw under an explicit
seed, is for direct users and experiments: it is reproducible, its values are bounded
at 6.76 standard deviations (the smallest uniform is 2**-33), and it is **not for DP
releases** (with small noise multipliers over many steps that bound alone can exceed
delta). ``secure=True`` takes seed and offset (126 bits) from the OS entropy source,
with 4 draws. Neither makes Philox a cryptographic generator: the guarantee rests on
the key and counter staying secret, and fp32 rounding of ``g + noise`` remains.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from fastdp import _backend, _ext
from fastdp.privacy.rng import NOISE_DRAWS, SEED_BITS, os_entropy_seed
from fastdp.ref import noise as ref

__all__ = ["OptimizerUpdate", "add_noise_", "add_noise_at_", "noisy_sgd_step_", "release_"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPES = (*_KERNEL_DTYPES, torch.float64)
SECURE_DRAWS = NOISE_DRAWS  # the 4-draw sum: secure=True, num_draws=4, every fastdp variant
_EXACT_OVERLAP_ELEMENTS = 1 << 20


def _kernel(backend: str, op: str = "noise_"):
    """The backend's ``noise_`` or ``release_`` (each with one calling convention: ``fastdp.ref.noise``)."""
    if backend == "torch":
        return getattr(ref, op)
    if backend == "triton":
        from fastdp.kernels import noise as triton_noise

        return getattr(triton_noise, op)
    return getattr(_ext._C, op)


def _run_contiguous(run, lists: list[list[torch.Tensor]], written: set[int], *args) -> None:
    """``run(*buffers, *args)``: each of ``lists`` (the kernel's tensor-list arguments, in order) as contiguous
    buffers; a non-contiguous tensor of a list in ``written`` (positions) gets its buffer's result copied back."""
    buffers = [[x.contiguous() for x in tensors] for tensors in lists]
    run(*buffers, *args)
    for k in written:
        for target, buf in zip(lists[k], buffers[k], strict=True):
            if buf.data_ptr() != target.data_ptr():
                target.copy_(buf)


def _check(grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor], stds: Sequence[float]) -> None:
    """Refuse what the kernels cannot do correctly, saying what to do instead."""
    if len(stds) != len(grads):
        raise ValueError(f"fastdp noise: {len(grads)} tensors but {len(stds)} stds; pass one std per tensor")
    if params and len(params) != len(grads):
        raise ValueError(f"fastdp noise: {len(params)} params but {len(grads)} grads; pass one grad per param")
    for t, s in enumerate(stds):
        if not math.isfinite(s) or s < 0:
            raise ValueError(f"fastdp noise: std {t} is {s}; stds must be finite and >= 0")
    seen: set[int] = set()
    for name, tensors in (("grads", grads), ("params", params)):
        for t, x in enumerate(tensors):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"fastdp noise: {name}[{t}] is a {type(x).__name__}, expected a torch.Tensor")
            if x.dtype not in _DTYPES:  # float8 and other floating dtypes have no kernel or reference rounding
                raise TypeError(
                    f"fastdp noise: {name}[{t}] has dtype {x.dtype}; noise needs a floating-point tensor "
                    "(float32, float16, bfloat16 or float64)"
                )
            if x.device != grads[0].device:
                raise ValueError(
                    f"fastdp noise: {name}[{t}] is on {x.device} but grads[0] is on {grads[0].device}; "
                    "move all tensors to one device"
                )
            if x.device.type == "meta" or not x.numel():
                continue  # meta tensors have no memory (every data_ptr is 0)
            if x.data_ptr() in seen:
                raise ValueError(
                    f"fastdp noise: {name}[{t}] shares memory with an earlier tensor; each tensor must "
                    "appear once (it would get noise twice)"
                )
            seen.add(x.data_ptr())
    for t, (p, g) in enumerate(zip(params, grads, strict=False)):
        if p.shape != g.shape or p.dtype != g.dtype:
            raise ValueError(
                f"fastdp noise: params[{t}] is {tuple(p.shape)} {p.dtype} but grads[{t}] is "
                f"{tuple(g.shape)} {g.dtype}; each grad must match its param"
            )


def _check_seed(seed: int, offset: int) -> None:
    if not 0 <= seed < 2**SEED_BITS or not 0 <= offset < 2**SEED_BITS:
        raise ValueError(f"fastdp noise: seed and offset must be in [0, 2**63), got {seed} and {offset}")


def _addresses(x: torch.Tensor) -> torch.Tensor:
    """The byte addresses of every element of x (int64, with repeats for an overlapping view)."""
    index = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(x.shape, x.stride(), strict=True):
        index = index.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    first = x.data_ptr() + index.reshape(-1, 1) * x.element_size()
    return (first + torch.arange(x.element_size(), dtype=torch.int64)).reshape(-1)


def _check_memory(grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
    """Refuse tensors whose elements share memory: a written tensor that overlaps itself (an expanded view,
    stride 0) or any two tensors of the lists that overlap (a partial view of another, not only the same
    tensor twice). Each element would get several draws or several updates. Address ranges first; the exact
    element addresses only where two ranges intersect (interleaved views such as x[::2] and x[1::2] pass)."""
    written = params if params else grads
    spans = []
    for name, tensors in (("grads", grads), ("params", params)):
        for t, x in enumerate(tensors):
            numel = x.numel()
            if not numel or x.is_meta:
                continue
            if x.is_contiguous():  # the common case: no stride to inspect
                extent = numel
            else:
                shape, strides = x.shape, x.stride()
                if tensors is written and any(n > 1 and s == 0 for n, s in zip(shape, strides, strict=True)):
                    raise ValueError(
                        f"fastdp noise: {name}[{t}] is an expanded view (a stride of 0): its elements share memory "
                        f"and would get noise several times; pass {name}[{t}].clone() or a tensor that owns its memory"
                    )
                extent = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1
            lo = x.data_ptr()
            spans.append((lo, lo + extent * x.element_size(), name, t, x))
    spans.sort(key=lambda span: span[0])
    active: list[tuple] = []
    for lo, hi, name, t, x in spans:
        active = [span for span in active if span[1] > lo]  # spans that reach past this one's start
        for _, _, other_name, other_t, other in active:
            # Beyond _EXACT_OVERLAP_ELEMENTS the address lists would cost too much: intersecting ranges are refused.
            small = x.numel() + other.numel() <= _EXACT_OVERLAP_ELEMENTS
            if not small or bool(torch.isin(_addresses(x), _addresses(other)).any()):
                raise ValueError(
                    f"fastdp noise: {name}[{t}] overlaps {other_name}[{other_t}] in memory; each element must "
                    "appear once (it would get noise twice): pass tensors that do not share memory"
                )
        active.append((lo, hi, name, t, x))


def _apply(
    grads: list[torch.Tensor],
    params: list[torch.Tensor],
    stds: list[float],
    seed: int,
    offset: int,
    num_draws: int,
    step: float,
    starts: Sequence[int] | None = None,
) -> None:
    """Validate, then run the selected backend per dtype on contiguous buffers. ``starts``: each tensor's first
    element in the noise stream (default: the list numbered from 0, ``fastdp.ref.noise.stream_starts``)."""
    _check(grads, params, stds)
    _check_memory(grads, params)
    _check_seed(seed, offset)
    if num_draws not in (1, SECURE_DRAWS):
        raise ValueError(f"fastdp noise: num_draws must be 1 or {SECURE_DRAWS}, got {num_draws}")
    fused = bool(params)
    starts = ref.stream_starts([g.numel() for g in grads]) if starts is None else starts
    # std = 0 adds nothing: skip (an exact no-op, also for -0.0 entries).
    work = [t for t, g in enumerate(grads) if g.numel() and (fused or stds[t] != 0.0)]
    if not work:
        return
    device_type = grads[0].device.type
    backend = _backend.select("noise", device_type)
    for dtype in dict.fromkeys(grads[t].dtype for t in work):
        group = [t for t in work if grads[t].dtype == dtype]
        run = _kernel(backend if dtype in _KERNEL_DTYPES else "torch")  # float64: the reference
        lists = [[grads[t] for t in group], [params[t] for t in group] if fused else []]
        with torch.no_grad():
            _run_contiguous(run, lists, {1 if fused else 0}, [stds[t] for t in group], [starts[t] for t in group],
                            seed, offset, num_draws, step)  # fmt: skip


@torch.library.custom_op("fastdp::add_noise_", mutates_args=("grads",))
def _add_noise_op(grads: list[torch.Tensor], stds: list[float], seed: int, offset: int, num_draws: int) -> None:
    _apply(grads, [], stds, seed, offset, num_draws, 0.0)


@_add_noise_op.register_fake
def _(grads, stds, seed, offset, num_draws):
    return None


def _check_step_lists(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """The fused step needs one grad per param (an empty params list would noise the grads in place instead)."""
    if len(params) != len(grads):
        raise ValueError(f"fastdp noise: {len(params)} params but {len(grads)} grads; pass one grad per param")


@torch.library.custom_op("fastdp::noisy_sgd_step_", mutates_args=("params",))
def _noisy_sgd_step_op(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    stds: list[float],
    step: float,
    seed: int,
    offset: int,
    num_draws: int,
) -> None:
    _check_step_lists(params, grads)
    _apply(grads, params, stds, seed, offset, num_draws, step)


@_noisy_sgd_step_op.register_fake
def _(params, grads, stds, step, seed, offset, num_draws):
    return None


def _real(value, what: str) -> float:
    """value as a float; TypeError for anything but a real number (bool, str, None, complex, a tensor)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"fastdp noise: {what} must be a real number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        return math.inf  # an int too large for a float: refused by the finiteness checks, which name it


def _as_list(tensors, name: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Iterable):
        raise TypeError(f"fastdp noise: {name} must be a tensor or a list of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    for t, x in enumerate(tensors):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"fastdp noise: {name}[{t}] is a {type(x).__name__}, expected a torch.Tensor")
    return tensors


def _one_std(value: float) -> list[float]:
    """A std for every tensor, checked here: with no tensors, _check would not see it."""
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"fastdp noise: stds is {value}; stds must be finite and >= 0")
    return [value]


def _as_stds(stds, count: int) -> list[float]:
    if isinstance(stds, torch.Tensor):
        if stds.dim() > 1:
            raise ValueError(f"fastdp noise: stds must be a scalar or a 1-D tensor, got shape {tuple(stds.shape)}")
        if stds.dtype.is_complex or stds.dtype == torch.bool:
            raise TypeError(f"fastdp noise: stds has dtype {stds.dtype}; pass real numbers (a float tensor)")
        if stds.device.type == "meta":
            raise ValueError("fastdp noise: stds is a meta tensor (it has no values); pass floats or a real tensor")
        values = stds.detach().cpu().double().reshape(-1).tolist()
        return _one_std(values[0]) * count if stds.dim() == 0 else values
    if isinstance(stds, numbers.Real) and not isinstance(stds, bool):
        return _one_std(_real(stds, "stds")) * count
    if isinstance(stds, (str, bytes)) or not isinstance(stds, Iterable):
        raise TypeError(f"fastdp noise: stds must be a float, a list of floats or a tensor, got {type(stds).__name__}")
    return [_real(s, f"stds[{t}]") for t, s in enumerate(stds)]


def _seed_offset(seed: int | None, offset: int, secure: bool, num_draws: int | None) -> tuple[int, int, int]:
    if not isinstance(secure, bool):
        raise TypeError(f"fastdp noise: secure must be a bool, got {type(secure).__name__}")
    if num_draws is not None and (isinstance(num_draws, bool) or not isinstance(num_draws, int)):
        raise TypeError(f"fastdp noise: num_draws must be an int (1 or {SECURE_DRAWS}), got {type(num_draws).__name__}")
    if num_draws is not None and num_draws not in (1, SECURE_DRAWS):
        raise ValueError(
            f"fastdp noise: num_draws must be 1 (one Box-Muller draw, bounded at 6.76 std: not for DP releases) or "
            f"{SECURE_DRAWS} (the sum of {SECURE_DRAWS} draws divided by 2), got {num_draws}"
        )
    if secure:
        if seed is not None or not (isinstance(offset, int) and offset == 0):
            raise ValueError(
                "fastdp noise: secure=True draws its own seed and offset from the OS entropy source; do not pass "
                "a seed or an offset"
            )
        if num_draws == 1:
            raise ValueError(f"fastdp noise: secure=True always sums {SECURE_DRAWS} draws; do not pass num_draws=1")
        return os_entropy_seed(), os_entropy_seed(), SECURE_DRAWS
    for name, value in (("seed", seed), ("offset", offset)):
        if (value is not None or name == "offset") and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"fastdp noise: {name} must be an int, got {type(value).__name__}")
    seed = os_entropy_seed() if seed is None else seed
    _check_seed(seed, offset)
    return seed, offset, 1 if num_draws is None else num_draws


def add_noise_(
    grads: Sequence[torch.Tensor] | torch.Tensor,
    stds: Sequence[float] | torch.Tensor | float,
    seed: int | None = None,
    offset: int = 0,
    *,
    secure: bool = False,
    num_draws: int | None = None,
) -> None:
    """Add N(0, stds[t]^2) to every element of ``grads[t]``, in place.

    Args:
        grads: tensors (float32/16, bfloat16, float64; any layout) on one device,
            usually the sums of clipped per-example gradients. No element may appear twice:
            expanded (stride-0) views and tensors that overlap another in memory are refused.
        stds: one std per tensor (noise on the sum: sigma_t * Delta_t), or one for all;
            real numbers (not bool), finite and >= 0.
        seed: key of the noise stream in [0, 2**63); ``None`` draws one from OS entropy.
        offset: counter in [0, 2**63); use a new one per step (e.g. the step index).
        secure: OS-entropy seed and offset, 4-draw sum (see the module docstring); pass
            neither a seed nor an offset with it.
        num_draws: 1 (default without ``secure``: one Box-Muller draw per value, bounded at
            6.76 std, not for DP releases) or 4 (the sum of 4 draws divided by 2: what every
            fastdp variant releases with; default with ``secure``).
    """
    grads = _as_list(grads, "grads")
    stds = _as_stds(stds, len(grads))
    seed, offset, num_draws = _seed_offset(seed, offset, secure, num_draws)
    if _backend.eager(grads):
        _apply(grads, [], stds, seed, offset, num_draws, 0.0)
        return
    _check(grads, [], stds)  # here too: a meta tensor in the list would dispatch past the kernel's check
    with torch.no_grad():
        torch.ops.fastdp.add_noise_(grads, stds, seed, offset, num_draws)


def add_noise_at_(
    tensors: Sequence[torch.Tensor], stds: Sequence[float] | float, starts: Sequence[int], seed: int, offset: int,
    num_draws: int = SECURE_DRAWS,
) -> None:  # fmt: skip
    """Add N(0, stds[t]^2) to ``tensors[t]``, in place, tensor t taking the noise stream's elements ``starts[t]``,
    ``starts[t] + 1``, ... under ``(seed, offset)``: what :func:`add_noise_` of a longer list draws for some of its
    tensors or for a piece of one (an element's draw depends only on the key, the counter and its stream index;
    ``fastdp.ref.noise.stream_starts`` numbers a list). So one layer's part of a draw, or a large draw a block at a
    time through a small buffer, gets the values of the whole draw. Eager only (no ``torch.library`` op).

    Args:
        tensors: as ``grads`` of :func:`add_noise_`.
        stds: one std per tensor, or one for all.
        starts: one stream index per tensor, each a multiple of 4 (where a tensor of the numbered list starts, plus
            a multiple of 4 inside it) and >= 0.
        seed, offset: the key and counter, each in [0, 2**63).
        num_draws: 1 or 4 (default: 4, the release's draws).
    """
    tensors = _as_list(tensors, "tensors")
    stds = _as_stds(stds, len(tensors))
    starts = list(starts)
    if len(starts) != len(tensors):
        raise ValueError(f"fastdp noise: {len(tensors)} tensors but {len(starts)} starts; pass one start per tensor")
    for t, start in enumerate(starts):
        if isinstance(start, bool) or not isinstance(start, numbers.Integral) or start < 0 or start % 4:
            raise ValueError(f"fastdp noise: starts[{t}] is {start!r}; a stream start is an int >= 0, a multiple "
                             "of 4 (fastdp.ref.noise.stream_starts)")  # fmt: skip
        if start + tensors[t].numel() > ref.MAX_STREAM_ELEMENTS:
            raise ValueError(f"fastdp noise: tensors[{t}] ends past the stream's 2**62 elements")
    _apply(tensors, [], stds, seed, offset, num_draws, 0.0, [int(s) for s in starts])


def noisy_sgd_step_(
    params: Sequence[torch.Tensor] | torch.Tensor,
    grads: Sequence[torch.Tensor] | torch.Tensor,
    stds: Sequence[float] | torch.Tensor | float,
    lr: float,
    scale: float = 1.0,
    seed: int | None = None,
    offset: int = 0,
    *,
    secure: bool = False,
    num_draws: int | None = None,
) -> None:
    """Fused noise and SGD update: ``p -= lr * (g + N(0, stds[t]^2)) / scale``; grads are not changed.

    ``scale`` is the divisor that turns the noisy sum into a mean: the expected batch
    size q*N under Poisson sampling (1.0 if ``grads`` are already means and ``stds``
    were scaled to match). ``lr`` and ``scale`` are real numbers (not bool, not tensors),
    finite, ``scale > 0`` and ``lr / scale`` finite. One grad per param, of its shape and
    dtype; the params are written, so they follow the rules for ``grads`` of :func:`add_noise_`
    (read-only grads may be expanded views). Other arguments as in :func:`add_noise_`.
    """
    params, grads = _as_list(params, "params"), _as_list(grads, "grads")
    _check_step_lists(params, grads)
    lr, scale = _real(lr, "lr"), _real(scale, "scale")
    if not (math.isfinite(lr) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"fastdp noise: lr must be finite and scale finite and > 0, got lr={lr}, scale={scale}")
    if not math.isfinite(lr / scale):
        raise ValueError(f"fastdp noise: lr / scale ({lr} / {scale}) overflows; use a smaller lr or a larger scale")
    stds = _as_stds(stds, len(grads))
    seed, offset, num_draws = _seed_offset(seed, offset, secure, num_draws)
    if _backend.eager(params + grads):
        _apply(grads, params, stds, seed, offset, num_draws, lr / scale)
        return
    _check(grads, params, stds)
    with torch.no_grad():
        torch.ops.fastdp.noisy_sgd_step_(params, grads, stds, lr / scale, seed, offset, num_draws)


@dataclass
class OptimizerUpdate:
    """One optimizer parameter group's update, applied by :func:`release_` in the same pass as the noise.

    ``kind``: "sgd" (torch.optim.SGD: ``states[0]`` the momentum buffers, none without momentum) or "adam"
    (torch.optim.Adam / AdamW: exp_avg, exp_avg_sq, and max_exp_avg_sq with amsgrad). ``index``: the positions of
    ``params`` in the release's ``grads`` (one param per grad, of its shape and dtype; so is every state tensor).
    ``grad_weights`` (SGD): each buffer's weight of the gradient, 1 - dampening, or 1 for a new zeroed buffer
    (torch's first step copies the gradient). ``hyper``: this step's values of ``fastdp.ref.noise.HYPER_FIELDS``
    other than ``scale`` (a missing value is 0; ``decay`` and ``bc2_sqrt`` default to 1)."""

    kind: str
    index: list[int]
    params: list[torch.Tensor]
    states: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] = ([], [], [])
    grad_weights: list[float] | None = None
    hyper: dict[str, float] = field(default_factory=dict)

    def needed_states(self) -> tuple[bool, bool, bool]:
        """Which of ``states`` the update reads and writes (the kernels' rule: a value is "on" when nonzero in
        float32); the others are not passed to the kernels."""
        on = {name: abs(float(self.hyper.get(name, 0.0))) > 2.0**-150 for name in ("momentum", "amsgrad")}  # float32 0
        if self.kind == "sgd":
            return on["momentum"], False, False
        return self.kind == "adam", self.kind == "adam", self.kind == "adam" and on["amsgrad"]

    def hyper_values(self, scale: float) -> list[float]:
        values = {"decay": 1.0, "bc2_sqrt": 1.0, **self.hyper, "scale": scale}
        unknown = set(values) - set(ref.HYPER_FIELDS)
        if unknown:
            raise ValueError(f"fastdp release: unknown hyperparameters {sorted(unknown)}; known: {ref.HYPER_FIELDS}")
        for name, value in values.items():
            if not math.isfinite(float(value)):
                raise ValueError(f"fastdp release: hyperparameter {name} is {value}; it must be finite")
        return [float(values.get(name, 0.0)) for name in ref.HYPER_FIELDS]


_UPDATE_KINDS = {"sgd": ref.RELEASE_SGD, "adam": ref.RELEASE_ADAM}  # and "release" (no update): release_'s own


def _check_update(u: OptimizerUpdate, grads: list[torch.Tensor], claimed: set[int]) -> None:
    if u.kind not in _UPDATE_KINDS:
        raise ValueError(f"fastdp release: update kind {u.kind!r}; expected one of {sorted(_UPDATE_KINDS)}")
    if len(u.params) != len(u.index) or any(s and len(s) != len(u.index) for s in u.states):
        raise ValueError("fastdp release: an update needs one param (and one tensor per state list) per index")
    missing = [k for k, need in enumerate(u.needed_states()) if need and not (u.states[k] or not u.index)]
    if missing:
        raise ValueError(f"fastdp release: this {u.kind} update reads and writes optimizer states {missing} (SGD: "
                         "the momentum buffer when momentum != 0; Adam: exp_avg, exp_avg_sq, and max_exp_avg_sq with "
                         "amsgrad); pass one tensor per param in each")  # fmt: skip
    if u.kind == "sgd" and u.states[0] and (u.grad_weights is None or len(u.grad_weights) != len(u.index)):
        raise ValueError("fastdp release: SGD with momentum needs one gradient weight per momentum buffer")
    for position, t in enumerate(u.index):
        if not 0 <= t < len(grads) or t in claimed:
            raise ValueError(f"fastdp release: index {t} is out of range or updated twice")
        claimed.add(t)
        g = grads[t]
        for x in (u.params[position], *(s[position] for s in u.states if s)):
            if x.shape != g.shape or x.dtype != g.dtype or x.device != g.device:
                raise ValueError(
                    f"fastdp release: a param or optimizer state of grads[{t}] is {tuple(x.shape)} {x.dtype} on "
                    f"{x.device}, its grad {tuple(g.shape)} {g.dtype} on {g.device}; they must match"
                )


def release_(
    grads: Sequence[torch.Tensor],
    stds: Sequence[float],
    scale: float,
    seed: int,
    offset: int,
    num_draws: int,
    updates: Sequence[OptimizerUpdate] = (),
) -> None:
    """The release of one DP step in one pass: ``grads[t] <- (grads[t] + N(0, stds[t]^2)) / scale`` in place
    (float32 or float64 sums: the released mean), and for the tensors an :class:`OptimizerUpdate` names, the
    optimizer's update of their parameters from that mean (post-processing: torch.optim's order of operations, its
    results up to fp32 rounding). Every other argument as for :func:`add_noise_` (seed and offset explicit: the
    callers are the variants, with their keys). Eager only: called outside compiled graphs."""
    grads = _as_list(grads, "grads")
    stds = [_real(s, f"stds[{t}]") for t, s in enumerate(stds)]
    scale = _real(scale, "scale")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"fastdp release: scale must be finite and > 0, got {scale}")
    if num_draws not in (1, SECURE_DRAWS):
        raise ValueError(f"fastdp noise: num_draws must be 1 or {SECURE_DRAWS}, got {num_draws}")
    _check(grads, [], stds)
    _check_seed(seed, offset)
    for t, g in enumerate(grads):
        if g.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"fastdp release: grads[{t}] has dtype {g.dtype}; the sums are float32 or float64")
    claimed: set[int] = set()
    for u in updates:
        _check_update(u, grads, claimed)
    written = [*grads, *(x for u in updates for x in (*u.params, *(x for s in u.states for x in s)))]
    _check_memory(written, [])
    starts = ref.stream_starts([g.numel() for g in grads])
    plain = OptimizerUpdate("release", [t for t in range(len(grads)) if t not in claimed], [])
    backend = _backend.select("noise", grads[0].device.type) if grads else "torch"
    with torch.no_grad():
        for u in (plain, *updates):
            kind = _UPDATE_KINDS.get(u.kind, ref.RELEASE)
            weights = u.grad_weights if u.grad_weights is not None else [1.0] * len(u.index)
            hyper = u.hyper_values(scale)
            for dtype in (torch.float32, torch.float64):
                chosen = [i for i, t in enumerate(u.index) if grads[t].dtype == dtype and grads[t].numel()]
                if not chosen:
                    continue
                lists = [[grads[u.index[i]] for i in chosen], [u.params[i] for i in chosen] if u.params else [],
                         *([s[i] for i in chosen] if need else [] for s, need in zip(u.states, u.needed_states(),
                                                                                       strict=True))]  # fmt: skip
                kernel = _kernel(backend if dtype == torch.float32 else "torch", "release_")  # float64: the reference

                def run(g, p, s0, s1, s2, *rest, kernel=kernel):  # the kernels take the states as one list
                    kernel(g, p, [s0, s1, s2], *rest)

                _run_contiguous(run, lists, set(range(5)), [stds[u.index[i]] for i in chosen],
                                [starts[u.index[i]] for i in chosen], [float(weights[i]) for i in chosen], seed,
                                offset, num_draws, kind, hyper)  # fmt: skip
