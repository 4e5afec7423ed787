"""Property-based tests of every public op's input validation (issue 9).

Hypothesis draws each op's arguments, mostly valid and now and then bad, across dtypes, shapes (0-size dims,
wrong ranks, mismatched dims, a few long dims), layouts (transposed, sliced, expanded with stride 0,
channels-last), devices (cpu, meta), requires_grad, aliasing (a tensor twice, overlapping and interleaved views)
and scalars (NaN, Inf, negative, zero, bool, str, None, complex, ints too large for a float, tensors). An oracle
written from the ops' documented contracts says which arguments are bad. The property, for every draw:

* bad input: the op raises TypeError or ValueError (no other exception, no crash) whose message starts with
  ``fastdp`` and names one of the bad arguments; an in-place op leaves every tensor as it was;
* good input: the op returns the documented shapes and dtypes, and values that match the torch reference
  (``fastdp.ref``) to ``TOL`` for the dtype; an in-place op changes its target only.

Draws are derandomized (the same examples on every run); the CPU backends ("torch" and the csrc kernels of
``fastdp._C``) are drawn per example, Triton (interpreter) runs a few small examples per op family.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import fastdp
from fastdp._backend import available
from fastdp.ops import (
    add_noise_,
    bjorck_orthonormalize,
    certified_spectral_norm,
    certified_spectral_norms,
    clip_factors,
    clip_gradient,
    clip_rows,
    conv_lip_factor,
    conv_operator_norm,
    ghost_norm_sq,
    noisy_sgd_step_,
    power_iteration,
    rko_orthonormalize,
    spectral_normalize_and_orthonormalize,
)
from fastdp.ops.orthogonal import lipschitz_projection
from fastdp.ref import clip as ref_clip
from fastdp.ref import noise as ref_noise
from fastdp.ref import norms as ref_norms
from fastdp.ref import orthogonal as ref_orthogonal
from fastdp.ref import spectral as ref_spectral
from tests.conftest import TOL

# A requested backend that has no kernel for meta tensors falls back to the reference, with a warning; the Triton
# interpreter runs masked-off lanes in numpy too (divisions by zero norms in rows it then discards).
pytestmark = [
    pytest.mark.filterwarnings("ignore:fastdp .* on meta:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
]

PROFILE = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
# Examples per op (CPU backends drawn per example); FASTDP_VALIDATION_EXAMPLES=1000 for a deeper search.
EXAMPLES = int(os.environ.get("FASTDP_VALIDATION_EXAMPLES", "100"))
TRITON_EXAMPLES = 15

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
ALL_DTYPES = (
    *FLOATS,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    *([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else []),
)
LAYOUTS = ("contiguous", "transposed", "sliced", "expanded", "channels_last")
DIMS = st.sampled_from([1, 2, 3, 4, 5, 0, 1, 2, 3, 7, 33, 129])
MAX_NUMEL = 4096
NAN, INF = float("nan"), float("inf")
HUGE_INT = 10**400  # an int no float can hold
BAD_SCALARS = (NAN, INF, -INF, True, "1.0", None, 1j, HUGE_INT, torch.tensor(1.0), [1.0])
CPU_BACKENDS = ["torch"] + (["cuda"] if available("cuda", "cpu")[0] else [])
TRITON = available("triton", "cpu")[0]


# ----------------------------------------------------------------------------------------------- harness


@contextlib.contextmanager
def backend(name: str):
    previous = fastdp.set_backend(name)
    try:
        yield
    finally:
        fastdp.set_backend(previous)


def sometimes(valid, bad, p: int = 5):
    """``valid``, or (in about one draw of ``p``) ``bad``."""
    # The bad branch last: hypothesis favours (and shrinks to) small integers, here the valid branch.
    return st.integers(0, p - 1).flatmap(lambda i: bad if i == p - 1 else valid)


def _finite(x) -> bool:
    try:
        return math.isfinite(x)
    except (OverflowError, TypeError):
        return False


def is_real(v) -> bool:
    """A Python int or float (bool excluded): what the ops take for bounds, stds, lr, beta."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def positive_real_ok(v) -> bool:
    return is_real(v) and _finite(v) and v > 0


POSITIVE = st.one_of(st.floats(1e-3, 1e3), st.integers(1, 5))
BAD_POSITIVE = st.sampled_from([0.0, -0.0, -1.0, -3, *BAD_SCALARS])


def word(name: str) -> str:
    """Regex: ``name`` as a whole word (``grads`` matches ``grads[2]``, not ``dense_grads``)."""
    return rf"(?<![\w.]){re.escape(name)}(?![\w])"


def subject(name: str) -> str:
    """Regex for one-letter argument names (a, g, w): the name followed by a verb, not the article."""
    return rf"(?<![\w.]){re.escape(name)} (has|is|\[)"


def expect_refused(call, names: list[str]) -> None:
    """``call`` raises TypeError or ValueError whose message starts with ``fastdp`` and matches one of ``names``
    (regexes). Any other exception propagates and fails the test."""
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    message = str(info.value)
    event("refused")
    assert message.startswith("fastdp"), f"unprefixed message: {message!r}"
    assert any(re.search(n, message) for n in names), f"{message!r} names none of the bad arguments {names}"


def assert_same(actual: torch.Tensor, expected: torch.Tensor, msg: str) -> None:
    """Bitwise equal (NaN equal to NaN)."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{msg}: {m}")


def assert_tol(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, msg: str, scale=1.0) -> None:
    """Close to TOL[dtype] (atol times ``scale``), NaN where the reference has NaN."""
    tol = TOL.get(dtype, TOL[torch.float32])
    torch.testing.assert_close(
        actual.double(),
        expected.double(),
        rtol=tol["rtol"],
        atol=tol["atol"] * scale,
        equal_nan=True,
        msg=lambda m: f"{msg}: {m}",
    )
    event("compared with the reference")


def snapshot(tensors) -> list[torch.Tensor | None]:
    return [t.detach().clone() if isinstance(t, torch.Tensor) and t.device.type != "meta" else None for t in tensors]


def assert_unchanged(tensors, before, msg: str) -> None:
    for i, (t, b) in enumerate(zip(tensors, before, strict=True)):
        if b is not None:
            assert_same(t.detach(), b, f"{msg}: tensor {i} changed")


# --------------------------------------------------------------------------------------- tensor specs


@dataclasses.dataclass(frozen=True)
class Spec:
    """A tensor to build: logical shape and dtype, memory layout, device, values."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    layout: str = "contiguous"
    device: str = "cpu"
    requires_grad: bool = False
    fill: str = "normal"  # normal | small (entries ~0.05: spectral norm < 1) | zero | nan | inf
    seed: int = 0

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def meta(self) -> bool:
        return self.device == "meta"

    @property
    def finite(self) -> bool:
        """No NaN/Inf among the visible elements (meta tensors have none to check)."""
        return self.meta or self.numel == 0 or self.fill not in ("nan", "inf")

    @property
    def effective_layout(self) -> str:
        if self.rank == 0 or (self.layout == "channels_last" and self.rank != 4):
            return "contiguous"
        if self.layout == "transposed" and self.rank < 2:
            return "contiguous"
        return self.layout

    @property
    def self_overlapping(self) -> bool:
        """An expanded view whose elements share memory (stride 0 over a dim > 1)."""
        return self.effective_layout == "expanded" and not self.meta and self.numel > 1 and self.shape[0] > 1


def _values(shape, spec: Spec, visible: tuple | None) -> torch.Tensor:
    if spec.meta:
        return torch.empty(shape, dtype=spec.dtype, device="meta")
    gen = torch.Generator().manual_seed(spec.seed)
    if spec.dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if not (spec.dtype.is_floating_point or spec.dtype.is_complex):
        return torch.randint(-4, 5, shape, generator=gen, dtype=spec.dtype)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if spec.fill == "zero":
        x.zero_()
    elif spec.fill == "small":
        x *= 0.05
    elif spec.fill in ("nan", "inf") and visible is not None:
        x[visible] = NAN if spec.fill == "nan" else INF
    return x.to(spec.dtype)


def make(spec: Spec) -> torch.Tensor:
    """The tensor of ``spec``: its logical shape in the requested layout (a view of a wider or transposed buffer,
    an expanded view, channels-last), requires_grad on the underlying leaf."""
    shape, layout = spec.shape, spec.effective_layout
    visible = (0,) * spec.rank if spec.numel else None  # where a NaN/Inf goes: an element of the view
    if layout == "transposed":
        base = shape[::-1]
    elif layout == "sliced":
        base = (*shape[:-1], 2 * shape[-1] + 1)  # the view takes [..., 1::2]
        visible = (*visible[:-1], 1) if visible is not None else None
    elif layout == "expanded":
        base = (1, *shape[1:])
    else:
        base = shape
    x = _values(base, spec, visible)
    if spec.requires_grad and (spec.dtype.is_floating_point or spec.dtype.is_complex):
        x.requires_grad_(True)
    if layout == "transposed":
        x = x.permute(*reversed(range(spec.rank)))
    elif layout == "sliced":
        x = x[..., 1::2]
    elif layout == "expanded":
        x = x.expand(shape)
    elif layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    assert tuple(x.shape) == shape
    return x


@st.composite
def shapes(draw, ranks, bad_rank: bool = True):
    rank = draw(sometimes(st.sampled_from(ranks), st.integers(0, 5)) if bad_rank else st.sampled_from(ranks))
    shape = [draw(DIMS) for _ in range(rank)]
    while math.prod(shape) > MAX_NUMEL:
        shape[shape.index(max(shape))] = 3
    return tuple(shape)


@st.composite
def specs(draw, ranks, dtypes=FLOATS, fills=("normal",), bad_rank=True, bad_dtype=True, meta=True, shape=None,
          p_bad=5):  # fmt: skip
    """A Spec: mostly of an accepted rank and dtype; about one in ``p_bad`` draws of another, or on meta."""
    others = [d for d in ALL_DTYPES if d not in dtypes]
    dtype = sometimes(st.sampled_from(dtypes), st.sampled_from(others), p_bad) if bad_dtype else st.sampled_from(dtypes)
    return Spec(
        shape=draw(shapes(ranks, bad_rank)) if shape is None else shape,
        dtype=draw(dtype),
        layout=draw(st.sampled_from(LAYOUTS)),
        device=draw(sometimes(st.just("cpu"), st.just("meta"), p=p_bad + 1)) if meta else "cpu",
        requires_grad=draw(st.booleans()),
        fill=draw(st.sampled_from(fills)),
        seed=draw(st.integers(0, 2**16)),
    )


def tensor_bad(spec, ranks, dtypes=FLOATS) -> bool:
    """The spec is not a tensor of an accepted rank and dtype."""
    return not isinstance(spec, Spec) or spec.rank not in ranks or spec.dtype not in dtypes


NOT_TENSORS = st.sampled_from([None, 3.0, [[1.0, 2.0]], "x"])


def build(x):
    return make(x) if isinstance(x, Spec) else x


# ------------------------------------------------------------------------------------------------- clip


CLIP_NORMS = st.sampled_from(["l2", "l2", "l15"])
BAD_NORMS = st.sampled_from(["l1", "L2", "", None, 2])


def clip_bad(x, bound, norm) -> list[str]:
    bad = []
    if norm not in ("l2", "l15"):
        bad.append(word("norm"))
    if not positive_real_ok(bound):
        bad.append(word("bound"))
    least = 2 if norm == "l15" else 1
    if not isinstance(x, Spec) or x.dtype not in FLOATS or x.rank < least:
        bad.append(word("x"))
    return bad


CLIP_X = sometimes(specs(ranks=(1, 2, 3, 4), fills=("normal", "normal", "zero", "nan", "inf")), NOT_TENSORS, p=12)


@settings(max_examples=EXAMPLES, **PROFILE)
@given(x=CLIP_X, bound=sometimes(POSITIVE, BAD_POSITIVE), norm=sometimes(CLIP_NORMS, BAD_NORMS, p=8),
       which=st.sampled_from(["clip_rows", "clip_gradient"]), name=st.sampled_from(CPU_BACKENDS))  # fmt: skip
def test_clip_ops(x, bound, norm, which, name):
    op = clip_rows if which == "clip_rows" else clip_gradient
    bad = clip_bad(x, bound, norm)
    xt = build(x)
    before = snapshot([xt])
    with backend(name):
        if bad:
            expect_refused(lambda: op(xt, bound, norm), bad)
            assert_unchanged([xt], before, which)
            return
        y = op(xt, bound, norm)
    assert_unchanged([xt], before, f"{which} input")
    assert y.shape == xt.shape and y.dtype == xt.dtype and y.device == xt.device, which
    assert y.requires_grad == xt.requires_grad, which
    if x.meta:
        return
    if which == "clip_gradient":
        assert_same(y.detach(), xt.detach(), "clip_gradient forward is the identity")
    else:
        assert_tol(y.detach(), ref_clip.clip_rows(xt.detach(), float(bound), norm), x.dtype, f"clip_rows {x}")
    if xt.requires_grad and xt.numel():
        g = torch.randn(xt.shape, generator=torch.Generator().manual_seed(x.seed + 1), dtype=torch.float64)
        g = g.to(x.dtype)
        with backend(name):
            (dx,) = torch.autograd.grad(y, xt, g)
        if which == "clip_gradient":
            expected = ref_clip.clip_rows(g, float(bound), norm)
        else:
            expected = ref_clip.clip_rows_backward(g, xt.detach(), float(bound), norm)
        assert_tol(dx, expected, x.dtype, f"{which} backward {x}")


@settings(max_examples=EXAMPLES, **PROFILE)
@given(data=st.data(), bound=sometimes(st.floats(1e-3, 1e3), st.sampled_from([0.0, -1.0, NAN, INF])),
       norm=sometimes(CLIP_NORMS, st.sampled_from(["l1", ""]), p=8), name=st.sampled_from(CPU_BACKENDS))  # fmt: skip
def test_clip_rows_backward_op(data, bound, norm, name):
    """The raw op ``torch.ops.fastdp.clip_rows_backward`` (autograd calls it). Its schema makes the dispatcher
    refuse non-tensor and non-float arguments (a RuntimeError of torch's): only tensors and floats are drawn."""
    x = data.draw(specs(ranks=(1, 2, 3, 4), fills=("normal", "zero", "nan")), label="x")
    same = st.just(dataclasses.replace(x, layout=data.draw(st.sampled_from(LAYOUTS)), seed=x.seed + 1))
    grad = data.draw(sometimes(same, specs(ranks=(1, 2, 3, 4))), label="grad")
    bad = clip_bad(x, bound, norm)
    least = 2 if norm == "l15" else 1
    if grad.dtype not in FLOATS or grad.rank < least:
        bad.append(word("grad"))
    if (grad.shape, grad.dtype, grad.device) != (x.shape, x.dtype, x.device):
        bad += [word("grad"), word("x")]
    gt, xt = make(grad), make(x)
    before = snapshot([gt, xt])
    with backend(name):
        if bad:
            expect_refused(lambda: torch.ops.fastdp.clip_rows_backward(gt, xt, bound, norm), bad)
            return
        dx = torch.ops.fastdp.clip_rows_backward(gt, xt, bound, norm)
    assert_unchanged([gt, xt], before, "clip_rows_backward inputs")
    assert dx.shape == xt.shape and dx.dtype == xt.dtype and dx.device == xt.device
    if not x.meta:
        expected = ref_clip.clip_rows_backward(gt.detach(), xt.detach(), bound, norm)
        assert_tol(dx, expected, x.dtype, f"clip_rows_backward {x}")


# ------------------------------------------------------------------------------------------------ norms


@st.composite
def ghost_inputs(draw):
    """a [B, T, d] and g [B, T, p]: mostly with matching batch and sequence sizes, dtype and device."""
    a = draw(specs(ranks=(3,), fills=("normal", "zero")))
    if a.rank == 3 and draw(st.integers(0, 3)):
        b, t = a.shape[:2]
        if draw(st.integers(0, 5)) == 0:  # a long sequence: the csrc kernel's path (T > CPU_GEMM_MAX_SEQ)
            b, t = min(b, 3), 80
            a = dataclasses.replace(a, shape=(b, t, min(a.shape[2], 4)))
        g = draw(specs(ranks=(3,), fills=("normal", "zero"), shape=(b, t, draw(DIMS))))
        dtype = draw(sometimes(st.just(a.dtype), st.sampled_from(ALL_DTYPES)))
        g = dataclasses.replace(g, dtype=dtype, device=draw(sometimes(st.just(a.device), st.just("meta"))))
    else:
        g = draw(specs(ranks=(3,)))
    return draw(sometimes(st.just(a), NOT_TENSORS, p=15)), draw(sometimes(st.just(g), NOT_TENSORS, p=15))


@settings(max_examples=EXAMPLES, **PROFILE)
@given(inputs=ghost_inputs(), name=st.sampled_from(CPU_BACKENDS))
def test_ghost_norm_sq(inputs, name):
    a, g = inputs
    bad = [subject(n) for n, s in (("a", a), ("g", g)) if tensor_bad(s, (3,))]
    if not bad and (a.shape[:2] != g.shape[:2] or a.dtype != g.dtype or a.device != g.device):
        bad = [subject("a"), subject("g")]
    at, gt = build(a), build(g)
    before = snapshot([at, gt])
    with backend(name):
        if bad:
            expect_refused(lambda: ghost_norm_sq(at, gt), bad)
            return
        out = ghost_norm_sq(at, gt)
    assert_unchanged([at, gt], before, "ghost_norm_sq inputs")
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    assert out.shape == (a.shape[0],) and out.dtype == acc and out.device == at.device and not out.requires_grad
    if a.meta:
        return
    a64, g64 = at.detach().double(), gt.detach().double()
    expected = ref_norms.per_example_grad_norm_sq(a64, g64)  # the definition, on the same (rounded) inputs
    # Cancellation in <A_i, G_i>: the error scales with ||a_i||^2 ||g_i||^2 (Cauchy-Schwarz bound of the value).
    scale = (a64.pow(2).sum((1, 2)) * g64.pow(2).sum((1, 2))).clamp(min=1.0)
    tol = 1e-10 if acc == torch.float64 else 2e-5
    assert (out.double() - expected).abs().le(tol * scale).all(), f"ghost_norm_sq {a} {g}: {out} vs {expected}"
    event("compared with the reference")


@settings(max_examples=EXAMPLES, **PROFILE)
@given(sq=sometimes(specs(ranks=(2,), dtypes=(torch.float32, torch.float64), fills=("normal", "zero", "nan", "inf")),
                    NOT_TENSORS, p=12),
       clip_norm=sometimes(POSITIVE, BAD_POSITIVE), name=st.sampled_from(CPU_BACKENDS))  # fmt: skip
def test_clip_factors(sq, clip_norm, name):
    bad = []
    if tensor_bad(sq, (2,), (torch.float32, torch.float64)):
        bad.append(word("sq_norms"))
    if not positive_real_ok(clip_norm):
        bad.append(word("clip_norm"))
    sq_t = build(sq)
    before = snapshot([sq_t])
    with backend(name):
        if bad:
            expect_refused(lambda: clip_factors(sq_t, clip_norm), bad)
            return
        norms, factors = clip_factors(sq_t, clip_norm)
    assert_unchanged([sq_t], before, "clip_factors input")
    for out in (norms, factors):
        assert out.shape == (sq.shape[1],) and out.dtype == sq.dtype and not out.requires_grad
    if sq.meta:
        return
    sq_abs = sq_t.detach().abs()  # squared norms are >= 0; negative draws are tried below too
    for values in (sq_t.detach(), sq_abs):
        with backend(name):
            norms, factors = clip_factors(values, clip_norm)
        ref_n, ref_f = ref_norms.clip_factors(values.double(), float(clip_norm))
        assert_tol(norms, ref_n, sq.dtype, f"clip_factors norms {sq}")
        assert_tol(factors, ref_f, sq.dtype, f"clip_factors factors {sq}")


# ------------------------------------------------------------------------------------------------ noise

ALIASING = ("plain",) * 6 + ("same_twice", "overlap", "interleaved", "chunks", "single", "not_a_list", "not_tensor")


@dataclasses.dataclass
class Built:
    """A list argument as built, and why it is bad (empty: fine)."""

    value: object
    tensors: list[torch.Tensor]
    bad: bool


def build_list(data, mode: str, count: int, written: bool) -> Built:
    """A list of float tensors (any rank and layout) per the aliasing ``mode``; ``written``: the op writes them."""
    if mode == "not_a_list":
        value = data.draw(st.sampled_from([None, 3, "grads"]), label="list")
        return Built(value, [], True)
    if mode in ("overlap", "interleaved", "chunks", "same_twice"):
        buffer = torch.randn(12, dtype=torch.float64).to(data.draw(st.sampled_from(FLOATS), label="dtype"))
        if mode == "overlap":
            tensors = [buffer[0:7], buffer[5:12]]
        elif mode == "interleaved":
            tensors = [buffer[0::2], buffer[1::2]]
        elif mode == "chunks":
            tensors = [buffer[:4].view(2, 2), buffer[4:]]
        else:
            tensors = [buffer, buffer]
        return Built(tensors, tensors, mode in ("overlap", "same_twice"))
    ranks = (0, 1, 2, 3, 4)
    item = specs(ranks, fills=("normal", "zero", "nan"), bad_rank=False, p_bad=15)
    items = [data.draw(item, label="t") for _ in range(count)]
    if mode == "single":
        items = items[:1] or [Spec((3,))]
    tensors = [make(s) for s in items]
    bad = any(s.dtype not in FLOATS for s in items) or any(s.device != items[0].device for s in items)
    bad = bad or (written and any(s.self_overlapping for s in items))
    if mode == "single":
        return Built(tensors[0], tensors, bad)
    if mode == "not_tensor":
        return Built([*tensors, 3.0], tensors, True)
    return Built(tensors, tensors, bad)


def draw_stds(data, count: int) -> tuple[object, list[float] | None, bool]:
    """(stds argument, the per-tensor stds it means or None, bad)."""
    kind = data.draw(st.sampled_from(["scalar", "scalar", "list", "list", "tensor", "bad"]), label="stds kind")
    good_std = sometimes(st.one_of(st.floats(0.1, 10.0), st.integers(1, 3)), st.just(0.0), p=6)
    bad_std = st.sampled_from([-1.0, -1e-30, NAN, INF, True, "1", None, 1j, HUGE_INT])
    if kind == "scalar":
        v = data.draw(sometimes(good_std, bad_std), label="std")
        return (v, [float(v)] * count, False) if is_real(v) and _finite(v) and v >= 0 else (v, None, True)
    if kind == "list":
        n = data.draw(sometimes(st.just(count), st.sampled_from([count + 1, max(count - 1, 0)])), label="n")
        values = [data.draw(sometimes(good_std, bad_std, p=12), label="std") for _ in range(n)]
        ok = n == count and all(is_real(v) and _finite(v) and v >= 0 for v in values)
        return values, [float(v) for v in values] if ok else None, not ok
    if kind == "tensor":
        values = [data.draw(st.floats(0.1, 10.0), label="std") for _ in range(count)]
        t = torch.tensor(values, dtype=torch.float64)
        return t, values, False
    bad = data.draw(st.sampled_from(["2d", "complex", "meta", "bool", "str", "none", "short"]), label="bad stds")
    value = {
        "2d": torch.ones(1, max(count, 1)),
        "complex": torch.ones(count, dtype=torch.complex64),
        "meta": torch.ones(count, device="meta"),
        "bool": torch.ones(count, dtype=torch.bool),
        "str": "stds",
        "none": None,
        "short": torch.ones(count + 1),
    }[bad]
    return value, None, True


SEEDS = sometimes(st.integers(0, 2**63 - 1), st.sampled_from([-1, 2**63, 1.5, True, "0"]), p=8)
OFFSETS = sometimes(st.integers(0, 2**63 - 1), st.sampled_from([-1, 2**63, None, 2.0, True]), p=8)


def draw_seeding(data) -> tuple[object, object, object, list[str]]:
    """(seed, offset, secure, names of the bad ones)."""
    mode = data.draw(st.sampled_from(["fixed"] * 8 + ["entropy", "secure", "secure_seeded", "secure_str"]))
    if mode == "secure":
        return None, 0, True, []
    if mode == "secure_seeded":
        return 3, data.draw(st.sampled_from([0, 5])), True, [word("seed")]
    if mode == "secure_str":
        return None, 0, "yes", [word("secure")]
    seed = None if mode == "entropy" else data.draw(SEEDS, label="seed")
    offset = data.draw(OFFSETS, label="offset")
    bad = []
    if seed is not None and not (is_int(seed) and 0 <= seed < 2**63):
        bad.append(word("seed"))
    if not (is_int(offset) and 0 <= offset < 2**63):
        bad.append(word("offset"))
    return seed, offset, False, bad


def expected_noise(before: list[torch.Tensor], stds: list[float], seed: int, offset: int) -> list[torch.Tensor]:
    """float64 z per tensor from the noise stream (``fastdp.ref.noise``), scaled by its std."""
    starts = ref_noise.stream_starts([b.numel() for b in before])
    return [
        s * ref_noise.standard_normal(seed, offset, start, b.numel()).reshape(b.shape)
        for b, s, start in zip(before, stds, starts, strict=True)
    ]


@settings(max_examples=EXAMPLES, **PROFILE)
@given(data=st.data(), mode=st.sampled_from(ALIASING), count=st.sampled_from([2, 1, 3, 0, 4]),
       name=st.sampled_from(CPU_BACKENDS))  # fmt: skip
def test_add_noise_(data, mode, count, name):
    grads = build_list(data, mode, count, written=True)
    n = len(grads.value) if isinstance(grads.value, list) else 1
    stds, std_values, stds_bad = draw_stds(data, n)
    seed, offset, secure, bad = draw_seeding(data)
    bad = ([word("grads")] if grads.bad else []) + ([word("stds")] if stds_bad else []) + bad
    before = snapshot(grads.tensors)
    with backend(name):
        if bad:
            expect_refused(lambda: add_noise_(grads.value, stds, seed, offset, secure=secure), bad)
            assert_unchanged(grads.tensors, before, "add_noise_ refused")
            return
        add_noise_(grads.value, stds, seed, offset, secure=secure)
    for g, b in zip(grads.tensors, before, strict=True):
        assert b is None or (g.shape == b.shape and g.dtype == b.dtype)
    if seed is None or any(b is None for b in before):
        return  # OS-entropy noise (secure or no seed): no reference draw; meta tensors: no values
    noise = expected_noise(before, std_values, seed, offset)
    for t, (g, b, z, s) in enumerate(zip(grads.tensors, before, noise, std_values, strict=True)):
        if s == 0:
            assert_same(g.detach(), b, f"add_noise_ std 0 changed tensor {t}")
        else:
            assert_tol(g.detach(), b.double() + z, g.dtype, f"add_noise_ tensor {t} ({mode})", scale=max(1.0, s))


@st.composite
def steps(draw):
    """(lr, scale, names of the bad ones)."""
    if draw(st.integers(0, 15)) == 0:
        return 1e308, 1e-308, [word("lr"), word("scale")]  # each finite, lr / scale overflows
    lr = draw(sometimes(st.one_of(st.floats(-1.0, 1.0), st.integers(0, 2)),
                        st.sampled_from([NAN, INF, True, "0.1", None, torch.tensor(0.1), HUGE_INT]), p=8))  # fmt: skip
    scale = draw(sometimes(POSITIVE, BAD_POSITIVE, p=8))
    bad = [] if is_real(lr) and _finite(lr) else [word("lr")]
    bad += [] if positive_real_ok(scale) else [word("scale")]
    return lr, scale, bad


PARAM_MODES = ("match",) * 6 + ("shape", "dtype", "count", "empty", "param_is_grad", "expanded_grad", "interleaved")


def grad_like(p: torch.Tensor) -> torch.Tensor:
    return torch.randn(p.shape, dtype=torch.float64).to(p.dtype).to(p.device)


@settings(max_examples=EXAMPLES, **PROFILE)
@given(data=st.data(), mode=st.sampled_from(ALIASING), count=st.integers(1, 4), pmode=st.sampled_from(PARAM_MODES),
       step=steps(), name=st.sampled_from(CPU_BACKENDS))  # fmt: skip
def test_noisy_sgd_step_(data, mode, count, pmode, step, name):
    params = build_list(data, mode, count, written=True)
    params_value = [] if pmode == "empty" else params.value
    grads = [grad_like(p) for p in params.tensors]  # one per param, its own memory
    pair_bad = False  # a params/grads mismatch the op must refuse
    p0 = params.tensors[0] if params.tensors else None
    if pmode == "shape" and grads:
        grads[0], pair_bad = torch.zeros(p0.numel() + 1, dtype=p0.dtype, device=p0.device), True
    elif pmode == "dtype" and grads:
        grads[0], pair_bad = grads[0].to(torch.float64 if p0.dtype != torch.float64 else torch.float32), True
    elif pmode == "count":
        grads, pair_bad = [*grads, torch.zeros(3, device=p0.device if p0 is not None else "cpu")], True
    elif pmode == "empty":
        pair_bad = bool(grads)  # params=[] with grads: never noise the grads in place instead
    elif pmode == "param_is_grad" and grads:
        grads[0], pair_bad = p0, p0.numel() > 0 and p0.device.type != "meta"
    elif pmode == "expanded_grad" and grads and p0.dim() and p0.numel():
        grads[0] = grads[0].flatten()[:1].reshape([1] * p0.dim()).expand(p0.shape)  # read only: fine
    elif pmode == "interleaved" and grads and p0.numel():
        buffer = torch.randn(2 * p0.numel(), dtype=torch.float64).to(p0.dtype).to(p0.device)
        grads[0] = buffer[1::2].view(p0.shape)  # a strided view of its own buffer: fine
    lr, scale, bad = step
    stds, std_values, stds_bad = draw_stds(data, len(grads))
    seed, offset, secure, seed_bad = draw_seeding(data)
    bad = bad + seed_bad + ([word("stds")] if stds_bad else [])
    # grads are built like the params: a param of a bad dtype or device makes its grad bad too ("empty" passes []).
    bad += [word("params"), word("grads")] if params.bad and pmode != "empty" else []
    bad += [word("params"), word("grads")] if pair_bad else []
    everything = params.tensors + grads
    before = snapshot(everything)
    with backend(name):
        if bad:
            expect_refused(lambda: noisy_sgd_step_(params_value, grads, stds, lr, scale, seed, offset, secure=secure),
                           bad)  # fmt: skip
            assert_unchanged(everything, before, "noisy_sgd_step_ refused")
            return
        noisy_sgd_step_(params_value, grads, stds, lr, scale, seed, offset, secure=secure)
    n = len(params.tensors)
    assert_unchanged(grads, before[n:], "noisy_sgd_step_ changed a grad")
    if seed is None or any(b is None for b in before):
        return
    noise = expected_noise(before[:n], std_values, seed, offset)
    step_size = lr / scale
    for t, (p, b, g, z) in enumerate(zip(params.tensors, before[:n], before[n:], noise, strict=True)):
        expected = b.double() - step_size * (g.double() + z)
        g_max = float(g.double().abs().nan_to_num(0).max()) if g.numel() else 0.0
        size = 1.0 + abs(step_size) * (g_max + 7 * std_values[t])
        assert_tol(p.detach(), expected, p.dtype, f"noisy_sgd_step_ param {t} ({mode}, {pmode})", scale=size)


# --------------------------------------------------------------------------------------------- spectral

ITERS = sometimes(st.integers(1, 4), st.sampled_from([0, -1, 1.5, True, "3", None, 2**31]), p=8)
CONTAINERS = sometimes(st.sampled_from(["list", "tuple"]), st.sampled_from(["tensor", "iterator", "none"]), p=15)


def iters_ok(v, most: int = 2**31 - 1) -> bool:
    return is_int(v) and 1 <= v <= most


@st.composite
def matrix_lists(draw, fills=("normal", "zero", "nan")):
    """(matrix specs, container kind): 1-3 matrices, now and then none; any rank, dtype, device, values."""
    count = draw(sometimes(st.integers(1, 3), st.just(0), p=15))
    return [draw(specs(ranks=(2,), fills=fills, p_bad=8)) for _ in range(count)], draw(CONTAINERS)


def build_container(tensors: list, container: str):
    if container == "tuple":
        return tuple(tensors)
    if container == "tensor":
        return tensors[0] if tensors else torch.zeros(2, 2)
    if container == "iterator":
        return iter(tensors)
    return None if container == "none" else list(tensors)


def matrices_bad(items: list[Spec], container: str) -> bool:
    """Not a non-empty list/tuple of finite, non-empty, floating 2-D matrices on one device."""
    if container not in ("list", "tuple") or not items:
        return True
    if any(s.rank != 2 or s.numel == 0 or s.dtype not in FLOATS or not s.finite for s in items):
        return True
    return any(s.device != items[0].device for s in items)


@st.composite
def vector_lists(draw, items: list[Spec]):
    """(vector specs or None, container): warm starts u_l [n_l], mostly right, now and then not."""
    if draw(st.booleans()):
        return None, "list"
    specs_ = []
    for w in items:
        n = w.shape[1] if w.rank >= 2 else 1
        shape = draw(sometimes(st.sampled_from([(n,), (n, 1)]), st.just((n + 1,)), p=10))
        u = draw(specs(ranks=(len(shape),), shape=shape, fills=("normal", "normal", "zero", "nan"), p_bad=10))
        specs_.append(dataclasses.replace(u, device=draw(sometimes(st.just(w.device), st.just("meta"), p=10))))
    count = draw(sometimes(st.just(len(specs_)), st.sampled_from([len(specs_) + 1, max(len(specs_) - 1, 0)]), p=10))
    while len(specs_) < count:
        specs_.append(Spec((3,)))
    return specs_[:count], draw(sometimes(st.just("list"), st.sampled_from(["tensor", "iterator"]), p=15))


def vectors_bad(vectors: list[Spec] | None, container: str, items: list[Spec]) -> bool:
    if vectors is None:
        return False
    if container not in ("list", "tuple") or len(vectors) != len(items):
        return True
    for u, w in zip(vectors, items, strict=True):
        n = w.shape[1] if w.rank >= 2 else -1
        if u.numel != n or u.dtype not in FLOATS or u.device != w.device or not u.finite:
            return True
    return False


def warm_starts(vectors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The documented warm starts: each vector flattened; an all-zero one means the cold start."""
    out = []
    for u in vectors:
        u = u.detach().reshape(-1)
        out.append(ref_spectral.default_start(u.numel(), u.dtype) if not bool((u != 0).any()) else u)
    return out


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@settings(max_examples=EXAMPLES, **PROFILE)
@given(data=st.data(), weights=matrix_lists(), iters=ITERS)
def test_power_iteration(data, weights, iters):
    items, container = weights
    vectors, vcontainer = data.draw(vector_lists(items), label="vectors")
    bad = [word("weights")] if matrices_bad(items, container) else []
    bad += [word("vectors")] if vectors_bad(vectors, vcontainer, items) else []
    bad += [] if iters_ok(iters) else [word("iters")]
    ws = [make(s) for s in items]
    us = None if vectors is None else [make(s) for s in vectors]
    before = snapshot(ws + (us or []))
    us_arg = us if us is None else build_container(us, vcontainer)

    def call():
        return power_iteration(build_container(ws, container), us_arg, iters)

    if bad:
        expect_refused(call, bad)
        return
    sigma, u_out, v_out = call()
    assert_unchanged(ws + (us or []), before, "power_iteration inputs")
    out_dtype = torch.float64 if any(s.dtype == torch.float64 for s in items) else torch.float32
    assert sigma.shape == (len(items),) and sigma.dtype == out_dtype
    for s, u, v in zip(items, u_out, v_out, strict=True):
        assert u.shape == (s.shape[1],) and v.shape == (s.shape[0],) and u.dtype == v.dtype == acc_dtype(s.dtype)
    if any(s.meta for s in items):
        return
    starts = None if us is None else warm_starts(us)
    for i, w in enumerate(ws):
        ref_sigma, ref_u, ref_v = ref_spectral.power_iteration([w.detach()], None if starts is None else [starts[i]],
                                                               iters)  # fmt: skip
        dtype = acc_dtype(w.dtype)
        assert_tol(sigma[i], ref_sigma[0], dtype, f"power_iteration sigma {i}")
        assert_tol(u_out[i], ref_u[0], dtype, f"power_iteration u {i}")
        assert_tol(v_out[i], ref_v[0], dtype, f"power_iteration v {i}")
        top = float(torch.linalg.matrix_norm(w.detach().double(), ord=2))
        assert float(sigma[i]) <= top * (1 + 1e-3) + 1e-6, f"estimate {float(sigma[i])} above sigma_max {top}"
        if top > 0:  # also from an all-zero warm start (the vector a zero matrix returns)
            assert float(sigma[i]) > 0, f"power_iteration: estimate 0 for a non-zero matrix {items[i]}"


GRAM_ITERS = sometimes(st.integers(1, 8), st.sampled_from([0, 1024, 1.5, True, None]), p=8)


@settings(max_examples=EXAMPLES, **PROFILE)
@given(w=sometimes(specs(ranks=(2,), fills=("normal", "zero", "nan", "inf")), NOT_TENSORS, p=12),
       weights=matrix_lists(fills=("normal", "zero", "inf")), iters=GRAM_ITERS)  # fmt: skip
def test_certified_spectral_norms(w, weights, iters):
    """certified_spectral_norm (one matrix) and certified_spectral_norms (a list)."""
    iters_bad = [] if iters_ok(iters, 1023) else [word("iters")]
    bad = iters_bad + ([] if isinstance(w, Spec) and matrices_bad([w], "list") is False else [subject("w")])
    wt = build(w)
    if bad:
        expect_refused(lambda: certified_spectral_norm(wt, iters), bad)
    else:
        bound = certified_spectral_norm(wt, iters)
        assert bound.shape == () and bound.dtype == acc_dtype(w.dtype) and bound.device == wt.device
        if not w.meta:
            assert_tol(bound, ref_spectral.certified_spectral_norm(wt.detach(), iters), bound.dtype, "certified")
            top = float(torch.linalg.matrix_norm(wt.detach().double(), ord=2))
            assert float(bound) >= top, f"certified bound {float(bound)} below sigma_max {top}"
    items, container = weights
    bad = iters_bad + ([word("weights")] if matrices_bad(items, container) else [])
    ws = [make(s) for s in items]
    if bad:
        expect_refused(lambda: certified_spectral_norms(build_container(ws, container), iters), bad)
        return
    bounds = certified_spectral_norms(build_container(ws, container), iters)
    out_dtype = torch.float64 if any(s.dtype == torch.float64 for s in items) else torch.float32
    assert bounds.shape == (len(items),) and bounds.dtype == out_dtype
    if not any(s.meta for s in items):
        expected = torch.stack([ref_spectral.certified_spectral_norm(x, iters).to(out_dtype) for x in ws])
        assert_tol(bounds, expected, out_dtype, "certified_spectral_norms")


PAIR_OK = st.one_of(st.integers(1, 2), st.tuples(st.integers(1, 2), st.integers(1, 2)))


def pair_of(v) -> tuple[int, int] | None:
    """The (int, int) an int-or-pair argument means, None if it is not one."""
    if is_int(v):
        return (v, v)
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(is_int(x) for x in v):
        return tuple(v)
    return None


@st.composite
def conv_cases(draw):
    c_out = draw(sometimes(st.integers(1, 4), st.just(0), p=15))
    groups = draw(sometimes(st.sampled_from([1, 1, 2]), st.sampled_from([0, -1, 1.5, True, 3]), p=10))
    c_in_g, kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    if is_int(groups) and groups == 2:
        c_out = 2 * c_out
    weight = draw(specs(ranks=(4,), fills=("normal", "normal", "nan"), shape=(c_out, c_in_g, kh, kw), p_bad=10))
    weight = draw(sometimes(st.just(weight), st.one_of(NOT_TENSORS, specs(ranks=(2, 3), p_bad=10)), p=15))
    channels = c_in_g * groups if is_int(groups) and groups >= 1 else c_in_g
    hw = (draw(st.integers(1, 6)), draw(st.integers(1, 6)))
    bad_shapes = [(channels + 1, *hw), (float(channels), *hw), "abc", 3, (channels, 0, hw[1]), (channels, hw[0]), None]
    input_shape = draw(sometimes(st.just((channels, *hw)), st.sampled_from(bad_shapes), p=10))
    stride = draw(sometimes(PAIR_OK, st.sampled_from([0, -1, (1,), "1", None, 1.5, (1, 0)]), p=10))
    padding = draw(sometimes(st.one_of(st.integers(0, 1), st.tuples(st.integers(0, 1), st.integers(0, 1))),
                             st.sampled_from([-1, "same", None, (0, -1)]), p=10))  # fmt: skip
    dilation = draw(sometimes(PAIR_OK, st.sampled_from([0, -1, (1, 0)]), p=10))
    iters = draw(ITERS)
    vector = None
    if draw(st.booleans()) and isinstance(input_shape, tuple) and len(input_shape) == 3 and min(input_shape) >= 1:
        shape = tuple(int(s) for s in input_shape)
        vector = draw(specs(ranks=(3,), fills=("normal", "zero", "nan"), shape=shape, p_bad=10))
        vector = dataclasses.replace(vector, device=weight.device if isinstance(weight, Spec) else "cpu")
        vector = draw(sometimes(st.just(vector), st.sampled_from([Spec((1,)), Spec(shape, device="meta"), 3.0]), p=12))
    return dict(weight=weight, input_shape=input_shape, stride=stride, padding=padding, dilation=dilation,
                groups=groups, iters=iters, vector=vector)  # fmt: skip


def conv_bad(case) -> list[str]:
    w, shape, groups = case["weight"], case["input_shape"], case["groups"]
    bad = []
    w_ok = isinstance(w, Spec) and w.rank == 4 and w.numel > 0 and w.dtype in FLOATS  # finiteness: below
    if not (w_ok and w.finite):
        bad.append(word("weight"))
    shape_ok = isinstance(shape, tuple) and len(shape) == 3 and all(is_int(s) and s >= 1 for s in shape)
    if not shape_ok:
        bad.append(word("input_shape"))
    groups_ok = is_int(groups) and groups >= 1 and (not isinstance(w, Spec) or w.rank != 4 or w.shape[0] % groups == 0)
    if not groups_ok:
        bad.append(word("groups"))
    if w_ok and shape_ok and groups_ok and shape[0] != w.shape[1] * groups:
        bad += [word("input_shape"), word("groups"), word("weight")]
    pairs, pairs_ok = {}, True
    for name, least in (("stride", 1), ("padding", 0), ("dilation", 1)):
        pair = pair_of(case[name])
        if pair is None or min(pair) < least:
            bad.append(word(name))
            pairs_ok = False
        pairs[name] = pair
    if w_ok and shape_ok and pairs_ok:
        out = ref_spectral.conv_output_shape(shape, w.shape, pairs["stride"], pairs["padding"], pairs["dilation"])
        if min(out) < 1:
            bad.append(word("input_shape"))
    if not iters_ok(case["iters"]):
        bad.append(word("iters"))
    v = case["vector"]
    if v is not None:
        numel = math.prod(shape) if shape_ok else -1
        device = w.device if isinstance(w, Spec) else "cpu"
        if not isinstance(v, Spec) or v.numel != numel or v.dtype not in FLOATS or v.device != device or not v.finite:
            bad.append(word("vector"))
    return bad


@settings(max_examples=EXAMPLES, **PROFILE)
@given(case=conv_cases())
def test_conv_operator_norm(case):
    bad = conv_bad(case)
    args = dict(case, weight=build(case["weight"]), vector=build(case["vector"]))
    if bad:
        expect_refused(lambda: conv_operator_norm(**args), bad)
        return
    sigma, x = conv_operator_norm(**args)
    w = args["weight"]
    dtype = acc_dtype(w.dtype)
    assert sigma.shape == () and sigma.dtype == dtype and x.shape == case["input_shape"] and x.dtype == dtype
    if w.device.type == "meta":
        return
    vector = args["vector"]
    start = None if vector is None else warm_starts([vector])[0].reshape(vector.shape)
    pairs = [pair_of(case[n]) for n in ("stride", "padding", "dilation")]
    ref_sigma, ref_x = ref_spectral.conv_operator_norm(w.detach(), case["input_shape"], *pairs, case["groups"],
                                                       case["iters"], start)  # fmt: skip
    assert_tol(sigma, ref_sigma, dtype, "conv_operator_norm sigma")
    assert_tol(x, ref_x, dtype, "conv_operator_norm vector")
    # The operator as a dense matrix (one column per input basis vector): the estimate is <= its norm, and > 0
    # when the operator is not zero (also from an all-zero warm start).
    basis = torch.eye(math.prod(x.shape), dtype=torch.float64).reshape(-1, *x.shape)
    columns = torch.nn.functional.conv2d(basis, w.detach().double(), None, *pairs, case["groups"])
    top = float(torch.linalg.matrix_norm(columns.reshape(basis.shape[0], -1), ord=2))
    assert float(sigma) <= top * (1 + 1e-3) + 1e-6, f"conv_operator_norm {float(sigma)} above the norm {top}"
    assert top == 0 or float(sigma) > 0, f"conv_operator_norm: estimate 0 for an operator of norm {top}"


# ------------------------------------------------------------------------------------------- orthogonal

BETAS = sometimes(st.floats(0.05, 1.0), st.sampled_from([0.0, -0.5, 1.5, NAN, INF, True, "0.5", None, HUGE_INT]), p=8)


@settings(max_examples=EXAMPLES, **PROFILE)
@given(weights=matrix_lists(fills=("small", "zero", "nan")), iters=ITERS, beta=BETAS)
def test_bjorck_orthonormalize(weights, iters, beta):
    items, container = weights
    bad = [word("weights")] if matrices_bad(items, container) else []
    bad += [] if iters_ok(iters) else [word("iters")]
    bad += [] if is_real(beta) and _finite(beta) and 0 < beta <= 1 else [word("beta")]
    ws = [make(s) for s in items]
    before = snapshot(ws)
    if bad:
        expect_refused(lambda: bjorck_orthonormalize(build_container(ws, container), iters, beta), bad)
        return
    out = bjorck_orthonormalize(build_container(ws, container), iters, beta)
    assert_unchanged(ws, before, "bjorck_orthonormalize inputs")
    assert len(out) == len(ws)
    for w, o in zip(ws, out, strict=True):
        assert o.shape == w.shape and o.dtype == w.dtype and o.is_contiguous() and not o.requires_grad
        if w.device.type != "meta":
            expected = ref_orthogonal.bjorck_orthonormalize([w.detach()], iters, float(beta))[0]
            assert_tol(o, expected, w.dtype, "bjorck_orthonormalize")


@settings(max_examples=EXAMPLES, **PROFILE)
@given(data=st.data(), weights=matrix_lists(), power_iters=ITERS, bjorck_iters=ITERS)
def test_spectral_normalize_and_orthonormalize(data, weights, power_iters, bjorck_iters):
    items, container = weights
    vectors, vcontainer = data.draw(vector_lists(items), label="vectors")
    bad = [word("weights")] if matrices_bad(items, container) else []
    bad += [word("vectors")] if vectors_bad(vectors, vcontainer, items) else []
    bad += [] if iters_ok(power_iters) else [word("power_iters")]
    bad += [] if iters_ok(bjorck_iters) else [word("bjorck_iters")]
    ws = [make(s) for s in items]
    us = None if vectors is None else [make(s) for s in vectors]
    us_arg = us if us is None else build_container(us, vcontainer)

    def call():
        return spectral_normalize_and_orthonormalize(build_container(ws, container), us_arg, power_iters, bjorck_iters)

    if bad:
        expect_refused(call, bad)
        return
    projected, new_us = call()
    for w, p, u in zip(ws, projected, new_us, strict=True):
        assert p.shape == w.shape and p.dtype == w.dtype and u.shape == (w.shape[1],)
    if any(s.meta for s in items):
        return
    starts = None if us is None else warm_starts(us)
    for i, w in enumerate(ws):
        (expected,), (expected_u,) = ref_orthogonal.spectral_normalize_and_orthonormalize(
            [w.detach()], None if starts is None else [starts[i]], power_iters, bjorck_iters
        )
        assert_tol(projected[i], expected, w.dtype, f"projection {i} {items[i]}")
        assert_tol(new_us[i], expected_u, acc_dtype(w.dtype), f"projection vector {i}")
        assert bool(torch.isfinite(projected[i]).all()), f"projection {i} of a finite matrix is not finite"


HW = sometimes(st.one_of(st.integers(1, 8), st.tuples(st.integers(1, 8), st.integers(1, 8))),
               st.sampled_from([0, (0, 8), "ab", None, (8.0, 8), (8, 8, 8), -2]), p=10)  # fmt: skip
STRIDES = sometimes(PAIR_OK, st.sampled_from([0, -1, "1", None, (1, 0)]), p=10)


def hw_bad(kernel: Spec | None, hw, stride) -> list[str]:
    """The conv_lip_factor contract: positive int pairs; stride 1 needs H >= (kh - 1) / 2 and W >= (kw - 1) / 2."""
    bad = []
    hw_pair, stride_pair = pair_of(hw), pair_of(stride)
    if hw_pair is None or min(hw_pair) < 1:
        bad.append(word("input_hw"))
    if stride_pair is None or min(stride_pair) < 1:
        bad.append(word("stride"))
    if not bad and kernel is not None and stride_pair == (1, 1):
        (kh, kw), (h, w) = kernel.shape[2:], hw_pair
        if 2 * h < kh - 1 or 2 * w < kw - 1:
            bad.append(word("input_hw"))
    return bad


def conv_kernel_bad(k) -> bool:
    return not (isinstance(k, Spec) and k.rank == 4 and k.numel > 0 and k.dtype in FLOATS and k.finite)


def rko_reference(k: torch.Tensor, hw, stride, iters: int) -> torch.Tensor:
    """RKO as documented, from the references: M / certified ||M||_2, Björck, times deel-lip's factor."""
    coef = ref_orthogonal.conv_lip_factor(tuple(k.shape[2:]), pair_of(hw), pair_of(stride))
    matrix = k.detach().reshape(k.shape[0], -1)
    bound = ref_spectral.certified_spectral_norm(matrix).to(acc_dtype(k.dtype))
    scaled = (matrix.to(bound.dtype) / bound.clamp_min(1e-30)).to(k.dtype)
    ortho = ref_orthogonal.bjorck_orthonormalize([scaled], iters)[0]
    return (ortho.to(bound.dtype) * coef).to(k.dtype).reshape(k.shape)


KERNELS = sometimes(specs(ranks=(4,), fills=("normal", "small", "zero", "nan"), p_bad=8), NOT_TENSORS, p=15)


@settings(max_examples=EXAMPLES, **PROFILE)
@given(kernel=KERNELS, hw=HW, stride=STRIDES, iters=ITERS)
def test_rko_orthonormalize(kernel, hw, stride, iters):
    bad = [word("conv_weight")] if conv_kernel_bad(kernel) else []
    bad += hw_bad(kernel if not bad else None, hw, stride)
    bad += [] if iters_ok(iters) else [word("iters")]
    k = build(kernel)
    if bad:
        expect_refused(lambda: rko_orthonormalize(k, hw, stride, iters), bad)
        return
    out = rko_orthonormalize(k, hw, stride, iters)
    assert out.shape == k.shape and out.dtype == k.dtype
    if not kernel.meta:
        assert_tol(out, rko_reference(k, hw, stride, iters), k.dtype, f"rko {kernel}")


SIZES = sometimes(st.one_of(st.integers(1, 7), st.tuples(st.integers(1, 7), st.integers(1, 7))),
                  st.sampled_from([0, (0, 3), "ab", None, 3.0, (3, 3, 3), True]), p=8)  # fmt: skip


@settings(max_examples=EXAMPLES, **PROFILE)
@given(kernel_size=SIZES, input_hw=SIZES, stride=STRIDES)
def test_conv_lip_factor(kernel_size, input_hw, stride):
    kernel = pair_of(kernel_size)
    bad = [] if kernel is not None and min(kernel) >= 1 else [word("kernel_size")]
    bad += hw_bad(Spec((1, 1, *kernel)) if not bad else None, input_hw, stride)
    if bad:
        expect_refused(lambda: conv_lip_factor(kernel_size, input_hw, stride), bad)
        return
    coef = conv_lip_factor(kernel_size, input_hw, stride)
    assert coef == ref_orthogonal.conv_lip_factor(kernel, pair_of(input_hw), pair_of(stride))
    assert math.isfinite(coef) and 0 < coef <= 1


@st.composite
def projection_cases(draw):
    dense, dense_container = draw(matrix_lists())
    if draw(st.integers(0, 5)) == 5:
        dense, dense_container = [], "list"
    vectors, vcontainer = draw(vector_lists(dense))
    count = draw(st.sampled_from([1, 2, 0]))
    kernels = [draw(KERNELS) for _ in range(count)]
    hws = [draw(HW) for _ in range(draw(sometimes(st.just(count), st.integers(0, 3), p=10)))]
    strides = [draw(STRIDES) for _ in range(draw(sometimes(st.just(count), st.integers(0, 3), p=10)))]
    lists = draw(sometimes(st.just("list"), st.sampled_from(["none_dense", "tensor_convs"]), p=15))
    return dict(dense=dense, dense_container=dense_container, vectors=vectors, vcontainer=vcontainer,
                kernels=kernels, hws=hws, strides=strides, lists=lists, power_iters=draw(ITERS),
                iters=draw(ITERS))  # fmt: skip


@settings(max_examples=EXAMPLES, **PROFILE)
@given(case=projection_cases())
def test_lipschitz_projection(case):
    dense, kernels, hws, strides = case["dense"], case["kernels"], case["hws"], case["strides"]
    container = case["dense_container"]
    bad = []
    if case["lists"] != "list":
        bad += [word("dense_weights"), word("conv_weights")]
    if container not in ("list", "tuple") or (dense and matrices_bad(dense, container)):
        bad += [word("dense_weights"), word("weights")]
    if not (len(kernels) == len(hws) == len(strides)):
        bad.append("conv kernels")
    bad += [] if iters_ok(case["power_iters"]) else [word("power_iters")]
    bad += [] if iters_ok(case["iters"]) else [word("iters")]
    for i, k in enumerate(kernels):
        if conv_kernel_bad(k):
            bad.append(word("conv_weights"))
        elif i < min(len(hws), len(strides)) and hw_bad(k, hws[i], strides[i]):
            bad += [word("input_hw"), word("stride")]
    if case["vectors"] is not None and (vectors_bad(case["vectors"], case["vcontainer"], dense)):
        bad += [word("dense_vectors"), word("vectors")]
    tensors = [s for s in [*dense, *kernels] if isinstance(s, Spec)]
    if len({s.device for s in tensors}) > 1:
        bad.append(word("weights"))
    ws = [make(s) for s in dense]
    ks = [build(s) for s in kernels]
    us = None if case["vectors"] is None else build_container([make(s) for s in case["vectors"]], case["vcontainer"])
    dense_arg = None if case["lists"] == "none_dense" else build_container(ws, container)
    conv_arg = (ks[0] if ks else torch.zeros(1, 1, 1, 1)) if case["lists"] == "tensor_convs" else ks

    def call():
        return lipschitz_projection(dense_arg, us, conv_arg, hws, strides, case["power_iters"], case["iters"])

    if bad:
        expect_refused(call, bad)
        return
    dense_out, us_out, conv_out = call()
    assert len(dense_out) == len(ws) == len(us_out) and len(conv_out) == len(ks)
    if any(s.meta for s in tensors):
        return
    if ws:
        expected, expected_us = spectral_normalize_and_orthonormalize(ws, us, case["power_iters"], case["iters"])
        for i, (o, e, u, eu) in enumerate(zip(dense_out, expected, us_out, expected_us, strict=True)):
            assert_tol(o, e, o.dtype, f"lipschitz_projection dense {i}")
            assert_tol(u, eu, u.dtype, f"lipschitz_projection vector {i}")
    for i, (o, k) in enumerate(zip(conv_out, ks, strict=True)):
        expected = rko_orthonormalize(k, hws[i], strides[i], case["iters"])
        assert_tol(o, expected, k.dtype, f"lipschitz_projection conv {i}")


# ------------------------------------------------------------------------------- Triton (interpreter)

needs_triton = pytest.mark.skipif(not TRITON, reason="Triton cannot run here (not installed, or no interpreter)")
TRITON_PROFILE = dict(PROFILE, max_examples=TRITON_EXAMPLES)


@pytest.mark.interpret
@needs_triton
@settings(**TRITON_PROFILE)
@given(x=CLIP_X, bound=sometimes(POSITIVE, BAD_POSITIVE), norm=sometimes(CLIP_NORMS, BAD_NORMS, p=8),
       which=st.sampled_from(["clip_rows", "clip_gradient"]))  # fmt: skip
def test_clip_ops_triton(x, bound, norm, which):
    test_clip_ops.hypothesis.inner_test(x, bound, norm, which, "triton")


@pytest.mark.interpret
@needs_triton
@settings(**TRITON_PROFILE)
@given(sq=sometimes(specs(ranks=(2,), dtypes=(torch.float32, torch.float64), fills=("normal", "nan")), NOT_TENSORS),
       clip_norm=sometimes(POSITIVE, BAD_POSITIVE))  # fmt: skip
def test_clip_factors_triton(sq, clip_norm):
    test_clip_factors.hypothesis.inner_test(sq, clip_norm, "triton")


@pytest.mark.interpret
@needs_triton
@settings(**TRITON_PROFILE)
@given(data=st.data(), mode=st.sampled_from(["plain", "plain", "plain", "interleaved", "overlap"]),
       count=st.integers(1, 3))  # fmt: skip
def test_add_noise_triton(data, mode, count):
    test_add_noise_.hypothesis.inner_test(data, mode, count, "triton")


@pytest.mark.interpret
@needs_triton
@settings(**TRITON_PROFILE)
@given(data=st.data(), bound=sometimes(st.floats(1e-3, 1e3), st.sampled_from([0.0, NAN])), norm=CLIP_NORMS)
def test_clip_rows_backward_op_triton(data, bound, norm):
    test_clip_rows_backward_op.hypothesis.inner_test(data, bound, norm, "triton")


@pytest.mark.interpret
@needs_triton
@settings(**TRITON_PROFILE)
@given(data=st.data(), weights=matrix_lists(), small=matrix_lists(fills=("small", "zero", "nan")), iters=ITERS,
       beta=BETAS)  # fmt: skip
def test_power_iteration_and_bjorck_triton(data, weights, small, iters, beta):
    with backend("triton"):
        test_power_iteration.hypothesis.inner_test(data, weights, iters)
        test_bjorck_orthonormalize.hypothesis.inner_test(small, iters, beta)


# --------------------------------------------------------------------- the bad inputs found by the search

_z = torch.zeros


def _buffer_views(a: slice, b: slice) -> list[torch.Tensor]:
    buffer = torch.zeros(8)
    return [buffer[a], buffer[b]]


# (call, error, message) for inputs that crashed, were refused with an unclear error, or were silently accepted
# before issue 9 (docs/bad-inputs.md lists them with the old behaviour).
BAD_INPUTS = {
    "add_noise_ expanded grad": (lambda: add_noise_([_z(1).expand(4)], 1.0, seed=0), ValueError, "expanded view"),
    "add_noise_ overlapping views": (lambda: add_noise_(_buffer_views(slice(0, 5), slice(3, 8)), 1.0, seed=0),
                                     ValueError, r"grads\[\d\] overlaps grads\[\d\]"),
    "add_noise_ float8 grad": (lambda: add_noise_([_z(3).to(torch.float8_e4m3fn)], 1.0, seed=0), TypeError,
                               r"grads\[0\] has dtype"),
    "add_noise_ stds meta tensor": (lambda: add_noise_([_z(3)], torch.ones(1, device="meta"), seed=0), ValueError,
                                    "stds is a meta tensor"),
    "add_noise_ stds complex tensor": (lambda: add_noise_([_z(3)], torch.ones(1, dtype=torch.complex64), seed=0),
                                       TypeError, "stds has dtype"),
    "add_noise_ stds str": (lambda: add_noise_([_z(3)], "1.0", seed=0), TypeError, "stds must be"),
    "add_noise_ stds None": (lambda: add_noise_([_z(3)], None, seed=0), TypeError, "stds must be"),
    "add_noise_ stds bool": (lambda: add_noise_([_z(3)], True, seed=0), TypeError, "stds must be a float"),
    "add_noise_ stds list of str": (lambda: add_noise_([_z(3)], ["1"], seed=0), TypeError, r"stds\[0\] must be"),
    "add_noise_ stds huge int": (lambda: add_noise_([_z(3)], HUGE_INT, seed=0), ValueError, "finite and >= 0"),
    "add_noise_ negative std, no tensors": (lambda: add_noise_([], -1.0, seed=0), ValueError, "finite and >= 0"),
    "add_noise_ grads None": (lambda: add_noise_(None, 1.0, seed=0), TypeError, "grads must be a tensor or a list"),
    "add_noise_ offset None": (lambda: add_noise_([_z(3)], 1.0, seed=0, offset=None), TypeError,
                               "offset must be an int"),
    "add_noise_ secure with an offset": (lambda: add_noise_([_z(3)], 1.0, offset=5, secure=True), ValueError,
                                         "do not pass a seed or an offset"),
    "add_noise_ secure not a bool": (lambda: add_noise_([_z(3)], 1.0, secure="yes"), TypeError, "secure must be"),
    "noisy_sgd_step_ no params": (lambda: noisy_sgd_step_([], [_z(3)], 1.0, 0.1, seed=0), ValueError,
                                  "0 params but 1 grads"),
    "noisy_sgd_step_ lr / scale overflows": (lambda: noisy_sgd_step_([_z(3)], [_z(3)], 1.0, 1e308, 1e-308, seed=0),
                                             ValueError, "overflows"),
    "noisy_sgd_step_ lr str": (lambda: noisy_sgd_step_([_z(3)], [_z(3)], 1.0, "0.1", seed=0), TypeError,
                               "lr must be a real number"),
    "noisy_sgd_step_ lr tensor": (lambda: noisy_sgd_step_([_z(3)], [_z(3)], 1.0, torch.tensor(0.1), seed=0),
                                  TypeError, "lr must be a real number"),
    "noisy_sgd_step_ expanded param": (lambda: noisy_sgd_step_([_z(1).expand(3)], [_z(3)], 1.0, 0.1, seed=0),
                                       ValueError, r"params\[0\] is an expanded view"),
    "clip_rows bound huge int": (lambda: clip_rows(_z(2, 3), HUGE_INT), ValueError, "bound is"),
    "clip_factors clip_norm huge int": (lambda: clip_factors(_z(2, 3), HUGE_INT), ValueError, "clip_norm is"),
    "bjorck beta huge int": (lambda: bjorck_orthonormalize([_z(2, 2)], 2, HUGE_INT), ValueError, "beta is"),
    "power_iteration iters 2**70": (lambda: power_iteration([_z(2, 2)], iters=2**70), ValueError, "iters is"),
    "certified_spectral_norm iters 2000": (lambda: certified_spectral_norm(_z(2, 2), 2000), ValueError,
                                           "iters is 2000; it must be <= 1023"),
    "power_iteration NaN vector": (lambda: power_iteration([torch.eye(2)], [torch.tensor([NAN, 1.0])]), ValueError,
                                   r"vectors \[0\] contain NaN"),
    "power_iteration complex vector": (lambda: power_iteration([torch.eye(2)], [torch.ones(2, dtype=torch.cfloat)]),
                                       TypeError, r"vectors\[0\] has dtype"),
    "conv_operator_norm empty kernel": (lambda: conv_operator_norm(_z(0, 3, 3, 3), (3, 5, 5)), ValueError,
                                        "non-empty conv2d kernel"),
    "conv_operator_norm groups do not divide C_out": (lambda: conv_operator_norm(_z(3, 1, 3, 3), (2, 5, 5), groups=2),
                                                      ValueError, "groups is 2"),
    "conv_operator_norm groups float": (lambda: conv_operator_norm(_z(2, 3, 3, 3), (3, 5, 5), groups=1.0), TypeError,
                                        "groups must be an int"),
    "conv_operator_norm stride 0": (lambda: conv_operator_norm(_z(2, 3, 3, 3), (3, 5, 5), stride=0), ValueError,
                                    "stride is"),
    "conv_operator_norm padding -1": (lambda: conv_operator_norm(_z(2, 3, 3, 3), (3, 5, 5), padding=-1), ValueError,
                                      "padding is"),
    "conv_operator_norm dilation 0": (lambda: conv_operator_norm(_z(2, 3, 3, 3), (3, 5, 5), dilation=0), ValueError,
                                      "dilation is"),
    "conv_operator_norm stride None": (lambda: conv_operator_norm(_z(2, 3, 3, 3), (3, 5, 5), stride=None), ValueError,
                                       "stride is None"),
    "conv_operator_norm input_shape floats": (lambda: conv_operator_norm(_z(2, 3, 3, 3), (3.5, 5, 5)), ValueError,
                                              "input_shape is"),
    "conv_operator_norm input_shape str": (lambda: conv_operator_norm(_z(2, 3, 3, 3), "abc"), ValueError,
                                           "input_shape is"),
    "conv_operator_norm vector on meta": (lambda: conv_operator_norm(torch.ones(2, 3, 3, 3), (3, 5, 5),
                                                                     vector=_z(3, 5, 5, device="meta")),
                                          ValueError, "vector is on meta"),
    "conv_operator_norm int vector": (lambda: conv_operator_norm(torch.ones(2, 3, 3, 3), (3, 5, 5),
                                                                 vector=torch.ones(3, 5, 5, dtype=torch.int64)),
                                      TypeError, "vector has dtype"),
    "conv_operator_norm NaN vector": (lambda: conv_operator_norm(torch.ones(2, 3, 3, 3), (3, 5, 5),
                                                                 vector=torch.full((3, 5, 5), NAN)),
                                      ValueError, r"vector \[0\] contain NaN"),
    "spectral_normalize vectors as a tensor": (lambda: spectral_normalize_and_orthonormalize([torch.eye(3)],
                                                                                             torch.ones(3)),
                                               TypeError, "vectors must be a list"),
    "rko input smaller than half the kernel": (lambda: rko_orthonormalize(torch.ones(2, 2, 5, 5), (1, 1)), ValueError,
                                               "input_hw"),
    "conv_lip_factor kernel 9 on a 1x1 input": (lambda: conv_lip_factor(9, 1), ValueError, "smaller than half"),
    "conv_lip_factor kernel None": (lambda: conv_lip_factor(None, 8), ValueError, "kernel_size is None"),
    "rko int kernel": (lambda: rko_orthonormalize(torch.ones(2, 2, 3, 3, dtype=torch.int64), (8, 8)), TypeError,
                       "conv_weight has dtype"),
    "rko kernel not a tensor": (lambda: rko_orthonormalize([1.0], (8, 8)), TypeError, "conv_weight is a list"),
    "lipschitz_projection dense None": (lambda: lipschitz_projection(None), TypeError, "dense_weights must be a list"),
    "lipschitz_projection conv_weights a tensor": (lambda: lipschitz_projection([], conv_weights=torch.ones(2, 2, 3, 3),
                                                                                conv_input_hws=[8], conv_strides=[1]),
                                                   TypeError, "conv_weights must be a list"),
    "lipschitz_projection two devices": (lambda: lipschitz_projection([torch.eye(2)], None, [_z(2, 2, 3, 3,
                                                                                              device="meta")],
                                                                      [8], [1]),
                                         ValueError, "one device"),
    "lipschitz_projection vectors without matrices": (lambda: lipschitz_projection([], [torch.ones(3)]), ValueError,
                                                      "1 vectors for 0 weights"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_found_by_the_search(case):
    call, error, match = BAD_INPUTS[case]
    with pytest.raises(error, match=match) as info:
        call()
    assert str(info.value).startswith("fastdp"), str(info.value)


def test_inputs_wrongly_refused_or_answered_before():
    """Valid inputs the search found refused, or answered wrongly: now accepted, with the right answer."""
    add_noise_([_z(3, device="meta"), _z(3, device="meta")], 1.0, seed=0)  # was "shares memory" (data_ptr 0)
    a, b = _buffer_views(slice(0, None, 2), slice(1, None, 2))  # interleaved views share a buffer, not elements
    add_noise_([a, b], [1.0, 2.0], seed=1, offset=2)
    assert bool(a.ne(0).all()) and bool(b.ne(0).all())
    # A zero warm-start vector (what power iteration returns for a zero matrix) now means a cold start: the
    # estimate of a non-zero matrix was 0 and the projection of the next step NaN.
    (_,), (u,) = spectral_normalize_and_orthonormalize([_z(4, 3)])
    assert bool(u.eq(0).all())
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    (p,), _ = spectral_normalize_and_orthonormalize([w], [u])
    assert bool(torch.isfinite(p).all())
    torch.testing.assert_close(p.T @ p, torch.eye(3), atol=1e-3, rtol=0)
    sigma, _, _ = power_iteration([w], [u], 20)
    torch.testing.assert_close(sigma[0], torch.linalg.matrix_norm(w, ord=2), rtol=1e-4, atol=0)
    # Meta tensors: shape-only results (the finiteness check has no values to read).
    sigma, us, vs = power_iteration([_z(4, 3, device="meta")])
    assert sigma.device.type == "meta" and us[0].shape == (3,) and vs[0].shape == (4,)
    assert certified_spectral_norm(_z(4, 3, device="meta")).device.type == "meta"
    assert bjorck_orthonormalize([_z(4, 3, device="meta")])[0].shape == (4, 3)
    assert rko_orthonormalize(_z(2, 2, 3, 3, device="meta"), (8, 8)).shape == (2, 2, 3, 3)
    # Björck returns contiguous matrices, as documented and as its fake kernel says (a transposed view came back
    # transposed from the reference path).
    assert bjorck_orthonormalize([torch.eye(3)[:, :2].T.contiguous().T * 0.5], 2)[0].is_contiguous()
