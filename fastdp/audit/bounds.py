"""Certified-bound fuzzer: every cheap certificate of a spectral norm checked against the float64 SVD, on random and
adversarial weights and during projected training.

Clipless and weight-clipping DP calibrate their noise to bounds on the layers' spectral norms; a bound below the
true norm is a privacy hole. The certificates checked (``fastdp.ref.spectral`` and ``fastdp.ref.orthogonal`` hold
their proofs):

* ``bjorck``: :func:`fastdp.ops.certified_bjorck_step`: the bound it returns against ||output||_2;
* ``cholesky``: :func:`fastdp.ops.certified_norm_cholesky` (a warm Lanczos estimate checked by a Cholesky
  factorisation; +inf when the check fails, which is counted, not an error);
* ``gram``: :func:`fastdp.ops.certified_spectral_norm` (12 Gram iterations, the fallback);
* ``carry``: :func:`fastdp.ops.frobenius_distance_up`: ||w||_2 + ||d||_F against ||w + d||_2;
* ``training``: clipless and weight-clipping MLPs trained with random learning rates (up to updates larger than the
  weights), with the weights tampered with between steps (``.data`` writes that bypass autograd's version counter,
  a dtype round trip, a single huge entry), projecting after every step or every second or third (``project_every``:
  the bounds carried across unprojected steps): at every release and after every projection, each layer's
  ``lipschitz()`` (what the noise is calibrated to) against the SVD of the weights it describes.

Matrix families (:data:`FAMILIES`): Gaussian, orthogonal plus a perturbation (the clipless regime), rank one,
clustered top singular values (the hardest case for the estimate), a geometric spectrum (condition number 1e12),
duplicated rows, a single huge entry, tiny and huge scales (1e-30 and 1e30), all-zero; float32 and float64.

A check is ``ok`` when bound >= sigma_max (both float64; the SVD's own error, about 1e-15 relative, is allowed
as 4 ulps). ``python -m fastdp.audit`` runs :func:`run_bound_fuzz` into its report; ``tests/test_bound_fuzz.py``
runs a slice in ``make test``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from fastdp.algorithms import Batch, Clipless, WeightClip
from fastdp.nn.lipschitz import BoundedInput, GroupSort2, LipschitzLinear
from fastdp.ops import certified_bjorck_step, certified_norm_cholesky, certified_spectral_norm, frobenius_distance_up

FAMILIES = ("gaussian", "near-orthogonal", "rank-one", "clustered", "geometric", "duplicate-rows", "spike", "tiny",
            "huge", "zero")  # fmt: skip
CHECKS = ("bjorck", "cholesky", "gram", "carry", "training")
SVD_SLACK = 4 * 2.0**-52  # the float64 SVD's relative error allowance


def sigma_max(w: torch.Tensor) -> float:
    """The float64 largest singular value of w (exact float32 -> float64 conversion)."""
    return float(torch.linalg.matrix_norm(w.detach().double(), 2)) if w.numel() else 0.0


def draw_matrix(family: str, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A matrix of ``family`` with random shape (1 to 96 on a side, one in eight up to 320: several blocks of the Gram
    product; tall, wide or square)."""
    most = 321 if int(torch.randint(0, 8, (), generator=gen)) == 0 else 97
    rows = int(torch.randint(1, most, (), generator=gen))
    cols = int(torch.randint(1, most, (), generator=gen))
    g64 = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    if family == "gaussian":
        w = g64 / math.sqrt(cols)
    elif family == "near-orthogonal":
        q = torch.linalg.qr(g64 if rows >= cols else g64.T).Q
        q = q if rows >= cols else q.T
        eps = float(10 ** torch.empty(()).uniform_(-6, 0, generator=gen))
        w = q + eps * torch.randn(rows, cols, generator=gen, dtype=torch.float64) / math.sqrt(max(rows, cols))
    elif family == "rank-one":
        w = torch.outer(torch.randn(rows, generator=gen, dtype=torch.float64),
                        torch.randn(cols, generator=gen, dtype=torch.float64))  # fmt: skip
    elif family in ("clustered", "geometric"):
        u = torch.linalg.qr(torch.randn(rows, rows, generator=gen, dtype=torch.float64)).Q
        v = torch.linalg.qr(torch.randn(cols, cols, generator=gen, dtype=torch.float64)).Q
        k = min(rows, cols)
        if family == "clustered":  # top singular values within 1e-4 of each other, then a gap
            s = 1.0 - 1e-4 * torch.rand(k, generator=gen, dtype=torch.float64)
            s[k // 2 :] *= 0.5
        else:
            s = torch.logspace(0, -12, k, dtype=torch.float64)
        w = (u[:, :k] * s) @ v[:, :k].T
    elif family == "duplicate-rows":
        w = g64[:1].expand(rows, cols).clone() + 1e-7 * g64
    elif family == "spike":
        w = g64 / math.sqrt(cols)
        w[int(torch.randint(0, rows, (), generator=gen)), int(torch.randint(0, cols, (), generator=gen))] = 1e6
    elif family == "tiny":
        w = g64 * 1e-30
    elif family == "huge":
        w = g64 * 1e30
    elif family == "zero":
        w = torch.zeros(rows, cols, dtype=torch.float64)
    else:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    return w.to(dtype)


@dataclass
class BoundOutcome:
    check: str
    case: str
    bound: float
    truth: float

    @property
    def ok(self) -> bool:
        return self.bound >= self.truth * (1 - SVD_SLACK) or math.isnan(self.truth)

    @property
    def ratio(self) -> float:
        """truth / bound: <= 1 when the bound holds (0 for an infinite bound)."""
        return self.truth / self.bound if self.bound > 0 else (0.0 if self.truth == 0 else math.inf)


@dataclass
class BoundReport:
    outcomes: list[BoundOutcome] = field(default_factory=list)
    cholesky_failed: int = 0  # Cholesky checks that returned +inf (a failed estimate, not an error)

    @property
    def failures(self) -> list[BoundOutcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def passed(self) -> bool:
        return bool(self.outcomes) and not self.failures

    def add(self, check: str, case: str, bound: torch.Tensor | float, truth: float) -> None:
        self.outcomes.append(BoundOutcome(check, case, float(bound), truth))


def _matrix_checks(report: BoundReport, family: str, dtype: torch.dtype, gen: torch.Generator) -> None:
    w = draw_matrix(family, gen, dtype)
    case = f"{family} {tuple(w.shape)} {str(dtype).removeprefix('torch.')}"
    truth = sigma_max(w)
    scale = float(10 ** torch.empty(()).uniform_(-2, 2, generator=gen))
    out, bound = certified_bjorck_step(w, scale)
    report.add("bjorck", f"{case} scale {scale:.3g}", bound, sigma_max(out))
    vector = None
    for step in range(2):  # cold, then warm from the first call's vector
        bound, vector = certified_norm_cholesky(w, vector)
        if math.isinf(float(bound)):
            report.cholesky_failed += 1
        report.add("cholesky", f"{case} {'warm' if step else 'cold'}", bound, truth)
    report.add("gram", case, certified_spectral_norm(w, iters=12).double(), truth)
    magnitude = float(10 ** torch.empty(()).uniform_(-8, 0, generator=gen)) * max(truth, 1e-30)
    d = (torch.randn(w.shape, generator=gen, dtype=torch.float64) * magnitude).to(dtype)
    if torch.isfinite(w + d).all():  # the sum of the two bounds rounded up (Python's + rounds to nearest)
        carried = float(certified_spectral_norm(w, iters=12).double()) + float(frobenius_distance_up(w + d, w))
        carried = math.nextafter(carried, math.inf)
        report.add("carry", case, carried, sigma_max(w + d))


def _mlp(projection: str, widths: list[int], dtype: torch.dtype) -> nn.Sequential:
    layers: list[nn.Module] = [BoundedInput(4.0)]
    for i in range(len(widths) - 1):
        bias = projection != "orthogonal"
        layers.append(LipschitzLinear(widths[i], widths[i + 1], bias=bias, projection=projection, max_norm=1.0))
        if i < len(widths) - 2:
            layers.append(GroupSort2() if projection == "orthogonal" else nn.ReLU())
    return nn.Sequential(*layers).to(dtype)


def _check_layers(report: BoundReport, model: nn.Module, case: str) -> None:
    for name, module in model.named_modules():
        if isinstance(module, LipschitzLinear):
            report.add("training", f"{case} {name}", module.lipschitz().double(), sigma_max(module.weight))


def _tamper(model: nn.Module, how: str, gen: torch.Generator) -> None:
    """Change the weights behind the certificates' back (no autograd version bump for ``.data``)."""
    layer = next(m for m in model.modules() if isinstance(m, LipschitzLinear))
    if how == "data-write":
        layer.weight.data.add_(0.5 * torch.randn(layer.weight.shape, generator=gen).to(layer.weight.dtype))
    elif how == "round-trip":
        layer.weight.data = layer.weight.data.half().to(layer.weight.dtype)
    elif how == "spike":
        layer.weight.data[0, 0] = 50.0


def _training_checks(report: BoundReport, variant_name: str, gen: torch.Generator, steps: int) -> None:
    dtype = torch.float64 if bool(torch.randint(0, 2, (), generator=gen)) else torch.float32
    widths = [int(torch.randint(2, 40, (), generator=gen)) * 2 for _ in range(3)] + [3]
    projection = "orthogonal" if variant_name == "clipless" else "clip"
    torch.manual_seed(int(torch.randint(0, 2**31, (), generator=gen)))
    model = _mlp(projection, widths, dtype)
    lr = float(10 ** torch.empty(()).uniform_(-3, 1, generator=gen))
    rows = int(torch.randint(4, 64, (), generator=gen))
    cls = Clipless if variant_name == "clipless" else WeightClip
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    tamper = ("none", "data-write", "round-trip", "spike")[int(torch.randint(0, 4, (), generator=gen))]
    every = int(torch.randint(1, 4, (), generator=gen))  # project_every: bounds carried across unprojected steps
    variant = cls(1.0, sample_rate=0.5, num_examples=2 * rows, reproducible_seed=0, project_every=every)
    case = (f"{variant_name} widths {widths} {str(dtype).removeprefix('torch.')} lr {lr:.3g} tamper {tamper} "
            f"project every {every}")  # fmt: skip
    for step in range(steps):
        x = torch.randn(rows, widths[0], generator=gen, dtype=torch.float64).to(dtype) * 3
        y = torch.randint(0, 3, (rows,), generator=gen)
        _check_layers(report, model, f"{case} step {step} release")  # what the release reads
        variant.gradient(model, Batch(x, y, torch.ones(rows, dtype=torch.bool)), step)
        optimizer.step()
        if step == steps // 2:
            _tamper(model, tamper, gen)
        _check_layers(report, model, f"{case} step {step} carried")
        variant.after_step(model)
        _check_layers(report, model, f"{case} step {step} projected")


def run_bound_fuzz(examples: int = 200, seed: int = 0, training_runs: int = 8, steps: int = 6) -> BoundReport:
    """``examples`` matrices spread over the families and both dtypes, then ``training_runs`` projected trainings
    (half clipless, half weightclip) of ``steps`` steps each."""
    gen = torch.Generator().manual_seed(seed)
    report = BoundReport()
    for i in range(examples):
        family = FAMILIES[i % len(FAMILIES)]
        dtype = torch.float32 if (i // len(FAMILIES)) % 2 == 0 else torch.float64
        _matrix_checks(report, family, dtype, gen)
    for i in range(training_runs):
        _training_checks(report, ("clipless", "weightclip")[i % 2], gen, steps)
    return report


def format_bound_report(report: BoundReport) -> str:
    """Markdown: per check, the number of cases, failures and the largest sigma_max / bound; the failures."""
    lines = [
        f"{len(report.outcomes)} checks; failures: {len(report.failures)}; Cholesky checks that failed (+inf, "
        f"covered by the carried certificate): {report.cholesky_failed}",
        "",
        "| check | cases | failures | largest sigma_max / bound |",
        "|---|---|---|---|",
    ]
    for check in CHECKS:
        rows = [o for o in report.outcomes if o.check == check]
        if rows:
            worst = max(o.ratio for o in rows)
            lines.append(f"| {check} | {len(rows)} | {sum(not o.ok for o in rows)} | {worst:.9f} |")
    for o in report.failures[:10]:
        lines.append(f"- **violation** {o.check}: {o.case}: bound {o.bound!r} < sigma_max {o.truth!r}")
    return "\n".join(lines)


__all__ = ["FAMILIES", "BoundReport", "draw_matrix", "format_bound_report", "run_bound_fuzz", "sigma_max"]
