"""Batch sums whose rounding is bounded whatever the data: the clipped gradient sums of a DP release.

The release's sensitivity is how far one example moves the *computed* sum. A sum over the batch in float32 rounds
each partial sum to 2^-24 of itself, and one example changes every partial sum after it: with thousands of aligned
clipped gradients (``|sum| ~ B C``) that moved the release by 1.31 C where the exact change is C (the privacy
review's case, ``tests/test_holes_frontdoor.py``). Here every reduction over examples is in float64, in a fixed
structure whose rounding is bounded by the data-independent :func:`sensitivity_slack`:

- a reduction over rows (an example's positions, or examples) is split into chunks of at most
  :data:`SUM_CHUNK_ROWS` rows; each chunk is one float64 GEMM, GEMV or scatter, within ``gamma_{K0+1} sum |terms|``
  of its exact value (Higham, Thm 3.1; the +1 is the product by the clip factor);
- the chunks' results are added by :class:`CompensatedSum` (Knuth's TwoSum: each addition's rounding is kept
  exactly and added back at the end), which adds at most ``(u + 4 n^2 u^2) sum |parts|`` for n parts (n < 2^24,
  checked): below ``2u sum |parts|``. Layer calls, a shared parameter's uses, micro-batches (virtual batches) are
  added the same way, so each such level adds ``2u`` more, whatever the number of parts;
- data-parallel ranks add their sums in an all-reduce of W terms: ``gamma_W``.

Per entry of a parameter's sum, the computed value is therefore within ``gamma_K sum |terms|`` of the exact one,
with ``K = SUM_CHUNK_ROWS + 64 + W`` (:func:`rounding_terms`; 64 covers the levels above with room). The terms of
example i have absolute size (Frobenius norm of the entrywise absolute values) at most ``c_i mass_i``, its *clipped
mass* (``fastdp.nn.forms.mass``: ``sum_t |a_t| |g_t|``, which exceeds the norm of the gradient when its positions
cancel). The clip rule (:func:`clip_sq_up`) keeps ``c_i mass_i <= MASS_RATIO C'`` besides
``c_i ||g_i|| <= C'``, so for a batch of B <= N examples (N: the data set's size, which bounds every Poisson batch)

    ||computed(D) - computed(D')|| <= C' + 2 gamma_K N MASS_RATIO C' = C' (1 + s),

and clipping at ``C' = C / (1 + s)`` (:func:`clip_bound`) keeps the release's sensitivity at C. For N = 10^6 the
slack s is about 4.8e-4; for the usual data sets below 1e-4. An example is clipped by its mass only when that exceeds
MASS_RATIO (1024) times its norm: positions cancelling at large magnitude, never ordinary gradients (about sqrt(T)).

The variants whose per-example bound lives in the network (clipless, weight clipping, backpropagation clipping) sum
their layers' gradients the same way (``fastdp.nn.layers.SummedLayer``); their examples' terms are within the
certified bound Delta itself, so the rounding adds at most ``s Delta`` and their noise is scaled by ``1 + s``
(``fastdp.algorithms.base.rounding_noise_factor``) instead of their bounds being lowered.

After the noise, the release is cast to the parameters' dtype: post-processing.
"""

from __future__ import annotations

import math

import torch

from fastdp.ref.norms import rounding_gamma

SUM_CHUNK_ROWS = 2048  # rows (examples x positions) per float64 GEMM / scatter of a clipped sum
MASS_RATIO = 1024.0  # c_i mass_i <= MASS_RATIO C' for every example (clip_sq_up)
MAX_PARTS = 2**24  # additions one CompensatedSum takes (its bound needs n^2 u^2 << u)
ROW_BLOCK = 64  # entries per float32 partial sum of a squared row norm (sq_norms_up)
_F64 = torch.float64


def rounding_terms(world_size: int = 1) -> int:
    """K of the module docstring: every entry of a released sum is within ``gamma_K sum |terms|`` of exact."""
    return SUM_CHUNK_ROWS + 64 + max(1, int(world_size))


def sensitivity_slack(num_examples: int, world_size: int = 1) -> float:
    """s of the module docstring: how much, relative to C', the rounding of the batch's float64 sum can add to one
    example's effect on it, for batches of at most ``num_examples`` examples (the data set's size), rounded up."""
    if not (isinstance(num_examples, int) and num_examples >= 1):
        raise ValueError(f"the number of examples bounding a batch must be a positive integer, got {num_examples}")
    gamma = rounding_gamma(rounding_terms(world_size), _F64)
    return 2 * gamma * num_examples * MASS_RATIO * (1 + 2.0**-20) + 2.0**-40  # + the clip factors' own rounding


def clip_bound(clip_norm: float, num_examples: int, world_size: int = 1) -> float:
    """C' = C / (1 + s), rounded down: the clip bound under which the released sum's sensitivity is ``clip_norm``
    (module docstring)."""
    slack = sensitivity_slack(num_examples, world_size)
    return math.nextafter(clip_norm / (1 + slack) * (1 - 2.0**-50), 0.0)


def sq_norms_up(t: torch.Tensor) -> torch.Tensor:
    """Per-example squared norms of ``t`` [B, ...], float64, never below the exact ones: the rows in blocks of
    :data:`ROW_BLOCK` entries normed in float32 (float64 for float64 rows; each block within ``gamma_{65}`` of
    exact whatever the order), the blocks' squares added in float64, the whole rounded up by those bounds, plus
    ``n 2^-125`` for the squares that fall below float32's normal range (each lost square is below 2^-126: entries
    of 2e-23 square to 0 in float32, which gave a norm of 0 and 4.1 C through a Linear with a huge output gradient).
    A float32 norm of a whole row can underestimate by ``gamma_n`` (0.07 % at 10^6 aligned entries, measured): a clip
    factor from it would let the example exceed its bound."""
    b = t.shape[0]
    n = math.prod(t.shape[1:])
    flat = t.reshape(b, n)
    if flat.dtype == _F64:
        return torch.linalg.vector_norm(flat, dim=1).square() * (1 + rounding_gamma(n + 4, _F64)) + n * 2.0**-1021
    whole = n - n % ROW_BLOCK
    total = torch.zeros(b, dtype=_F64, device=t.device)
    if whole:
        blocks = flat[:, :whole].unflatten(1, (whole // ROW_BLOCK, ROW_BLOCK))
        total += torch.linalg.vector_norm(blocks, dim=2, dtype=torch.float32).to(_F64).square().sum(1)
    if whole < n:
        total += torch.linalg.vector_norm(flat[:, whole:], dim=1, dtype=torch.float32).to(_F64).square()
    u32 = torch.finfo(torch.float32).eps / 2
    up = (1 + u32) ** 2 / (1 - rounding_gamma(ROW_BLOCK + 1, torch.float32)) * (1 + rounding_gamma(n + 4, _F64))
    return total * up + n * 2.0**-125  # inf where a block's squares exceed float32 (entries over ~1.8e19)


def world_size() -> int:
    """Processes of the default ``torch.distributed`` group (1 when not initialised)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def mass_allowance(mass: torch.Tensor) -> torch.Tensor:
    """``mass / MASS_RATIO`` (float64, rounded up): the norm an example whose terms have total size ``mass`` is clipped
    by at least (:func:`clip_sq_up`; DP-SGD-JL's ``allowance``)."""
    return mass * (1 / MASS_RATIO) * (1 + 2.0**-52)


def clip_sq_up(bound_sq: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """The squared norm an example is clipped by when its contribution is summed over its positions (a GEMM or a
    scatter): ``max(sqrt(bound_sq), mass / MASS_RATIO)^2``, float64, rounded up. ``bound_sq`` bounds the exact
    squared norm of its gradient, ``mass`` the size of the terms the sum adds for it (``sum_t |a_t| |g_t|``): the
    mass term keeps every example's clipped mass within ``MASS_RATIO C'``, which the sums' rounding bound needs
    (module docstring). It binds only where positions cancel at large magnitude (mass over 1024 times the norm;
    ordinary gradients have about sqrt(T))."""
    norm = torch.maximum(bound_sq.sqrt(), mass_allowance(mass))
    return norm * norm * (1 + 4 * torch.finfo(_F64).eps)


def _two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, err) with s = fl(a + b) and s + err == a + b exactly (Knuth's TwoSum, six float64 operations, each a
    separate eager op: nothing fused or reassociated)."""
    s = a + b
    back = s - a
    return s, (a - (s - back)).add_(b - back)


class CompensatedSum:
    """A running float64 sum ``hi + lo`` of tensors of one shape: each addition's rounding error is computed exactly
    (TwoSum, six float64 operations, each a separate eager op: nothing fused or reassociated) and accumulated in
    ``lo``; :meth:`value` rounds once. Bound: module docstring."""

    def __init__(self) -> None:
        self.hi: torch.Tensor | None = None
        self.lo: torch.Tensor | None = None
        self.parts = 0

    @torch.compiler.disable
    def add_(self, x: torch.Tensor) -> CompensatedSum:
        """Add ``x`` (converted to float64; taken over, not copied, when it is the first part)."""
        x = x.to(_F64)
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise RuntimeError(f"a compensated sum takes at most {MAX_PARTS} parts (its rounding bound needs it)")
        if self.hi is None:
            self.hi = x
            return self
        self.hi, err = _two_sum(self.hi, x)
        self.lo = err if self.lo is None else self.lo.add_(err)
        return self

    def value(self) -> torch.Tensor | None:
        """``hi + lo`` (None when nothing was added)."""
        return self.hi if self.lo is None else self.hi + self.lo


def add_all(parts) -> torch.Tensor:
    """The compensated float64 sum of the tensors ``parts`` (at least one)."""
    total = CompensatedSum()
    for part in parts:
        total.add_(part)
    if total.hi is None:
        raise ValueError("add_all needs at least one tensor")
    return total.value()


def outer_sum(
    left: torch.Tensor,
    right: torch.Tensor,
    left_scale: torch.Tensor | None = None,
    right_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_k s_k left_k right_k^T`` [p, d], float64, of rows ``left`` [N, p] and ``right`` [N, d], with ``s_k``
    [N] scaling the rows of one side (``left_scale`` or ``right_scale``: each example's clip factor repeated over
    its positions, put on the narrower side), in chunks of :data:`SUM_CHUNK_ROWS` rows added by
    :class:`CompensatedSum`."""
    n = left.shape[0]
    total = CompensatedSum()
    for start in range(0, max(n, 1), SUM_CHUNK_ROWS):
        part = slice(start, start + SUM_CHUNK_ROWS)
        lhs = left[part].to(_F64, copy=left_scale is not None)  # the copy scaled in place
        rhs = right[part].to(_F64, copy=right_scale is not None)
        if left_scale is not None:
            lhs.mul_(left_scale[part].to(_F64).unsqueeze(1))
        if right_scale is not None:
            rhs.mul_(right_scale[part].to(_F64).unsqueeze(1))
        total.add_(lhs.t() @ rhs)
    return total.value()


def weighted_sum(factors: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """``sum_i c_i x_i`` float64 for ``rows`` [B, ...] (one GEMV per chunk of :data:`SUM_CHUNK_ROWS` examples; a
    float64 sum over the chunk's rows where ``factors`` is None: every c_i = 1)."""
    flat = rows.reshape(rows.shape[0], math.prod(rows.shape[1:]))
    total = CompensatedSum()
    for start in range(0, max(flat.shape[0], 1), SUM_CHUNK_ROWS):
        part = slice(start, start + SUM_CHUNK_ROWS)
        chunk = flat[part].to(_F64)
        total.add_(chunk.sum(0) if factors is None else factors[part].to(_F64) @ chunk)
    return total.value().reshape(rows.shape[1:])


def index_sum(idx: torch.Tensor, rows: torch.Tensor, num_rows: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out[r] = sum_{k: idx_k = r} s_k rows_k`` [num_rows, n], float64 (an Embedding's clipped sum), in chunks of
    :data:`SUM_CHUNK_ROWS` rows; each chunk scatters into the rows it touches only (its unique ids), added to the
    running sum by TwoSum on those rows."""
    n = rows.shape[1]
    hi = torch.zeros(num_rows, n, dtype=_F64, device=rows.device)
    lo = None
    count = rows.shape[0]
    if count <= SUM_CHUNK_ROWS:
        values = rows.to(_F64) if scale is None else rows.to(_F64) * scale.to(_F64).unsqueeze(1)
        return hi.index_add_(0, idx, values)
    lo = torch.zeros_like(hi)
    for start in range(0, count, SUM_CHUNK_ROWS):
        part = slice(start, start + SUM_CHUNK_ROWS)
        values = rows[part].to(_F64)
        if scale is not None:
            values = values * scale[part].to(_F64).unsqueeze(1)
        ids, where = torch.unique(idx[part], return_inverse=True)
        chunk = torch.zeros(ids.shape[0], n, dtype=_F64, device=rows.device).index_add_(0, where, values)
        hi[ids], err = _two_sum(hi[ids], chunk)
        lo[ids] += err
    return hi.add_(lo)
