"""What the reproduction runs: one :class:`Cell` per (paper, method, data set, epsilon), each with a small
hyperparameter grid, and the seeds it is tuned and evaluated on.

Protocol (the same for every cell): every grid point is trained on the *tuning* seeds; the point with the best mean
metric (ties: the first in grid order) is then trained on the *evaluation* seeds, whose mean ± std is reported. A
seed fixes the stratified train/test split, the initialisation and (as the reproducible privacy seed: these runs
are experiments, labelled NOT FOR RELEASE) the Poisson batches and the noise, so tuning and evaluation use different
splits and every run can be replayed. Like the papers, the privacy cost of this tuning is not accounted: each reported
epsilon is that of one training run.

Every setting not listed in a grid is the :class:`fastdp.train.trainer.TrainConfig` default (RDP accountant, Poisson
sampling, add/remove-one adjacency, noise calibrated so that the run ends at or below the target epsilon).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from bench.reproduce import paper
from bench.reproduce.paper import PaperValue

SECTIONS: dict[str, str] = {
    "lipdp": "lip-dp (papers/00 Table 3a/7): test AUROC at epsilon = 1 on ADBench sets",
    "weightclip": "Weight clipping (papers/01 Table 1): test accuracy at the table's epsilon, delta = 1/n",
    "backprop": "Backpropagation clipping (papers/02, corrected results): MNIST test accuracy",
}


@dataclass(frozen=True)
class Method:
    """A training method: a fastdp variant on a model. ``projection`` (Lipschitz models only) switches every
    ``LipschitzLinear`` to that projection before training (``"fixed"``: Fix-Lip-DP-SGD, ||W||_2 = C always)."""

    key: str
    label: str
    variant: str
    model: str
    projection: str | None = None


METHODS: dict[str, Method] = {
    m.key: m
    for m in (
        Method("dpsgd", "DP-SGD", "dpsgd", "mlp"),
        Method("clipless", "clipless (lip-dp)", "clipless", "lipschitz_mlp"),
        Method("weightclip", "weightclip (Lip-DP-SGD)", "weightclip", "weightclip_mlp"),
        Method("fixed", "fixed norm (Fix-Lip-DP-SGD)", "weightclip", "weightclip_mlp", projection="fixed"),
        Method("backprop-cnn", "backprop clipping, CNN", "backprop", "opacus_cnn"),
        Method("backprop-linear", "backprop clipping, linear", "backprop", "linear"),
    )
}


@dataclass(frozen=True)
class Cell:
    """One row of the result table: a method on a data set at one epsilon, tuned over ``grid``.

    ``base`` holds the TrainConfig fields every grid point shares; each grid point overrides some of them.
    ``metric`` is the result key compared (``test_auroc`` or ``test_accuracy``)."""

    section: str
    method: Method
    dataset: str
    epsilon: float
    delta: float
    metric: str
    base: dict
    grid: tuple[dict, ...]
    paper: PaperValue | None
    note: str = ""

    @property
    def key(self) -> str:
        return f"{self.section}/{self.method.key}/{self.dataset}/eps={self.epsilon:g}"

    def config(self, point: dict, seed: int, data_dir: str | None = None) -> dict:
        """TrainConfig keyword arguments of grid ``point`` at ``seed``."""
        return {
            **self.base,
            **point,
            "variant": self.method.variant,
            "model": self.method.model,
            "dataset": self.dataset,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "seed": seed,
            "reproducible_privacy_seed": seed,
            "data_dir": data_dir,
        }


@dataclass(frozen=True)
class Plan:
    cells: tuple[Cell, ...]
    tune_seeds: tuple[int, ...]
    eval_seeds: tuple[int, ...]
    full: bool


def _grid(**axes) -> tuple[dict, ...]:
    """Cartesian product of the axes, in the order given (the first axis varies slowest)."""
    names = list(axes)
    return tuple(dict(zip(names, values, strict=True)) for values in itertools.product(*axes.values()))


# Expected batch sizes per ADBench set (training split: yeast 1,187, magic 15,216, shuttle 39,277, campaign
# 32,950 rows). Default: a small and a large one; --full: the lip-dp sweep's {2000, 5000, 10000} where they fit.
_LIPDP_BATCHES = {"yeast": (128, 512), "magic": (512, 2048), "shuttle": (1024, 4096), "campaign": (1024, 4096)}
_LIPDP_BATCHES_FULL = {
    "yeast": (128, 256, 512),
    "magic": (512, 2000, 5000),
    "shuttle": (2000, 5000, 10000),
    "campaign": (2000, 5000, 10000),
}

# The corrected backprop-clipping configuration of the authors' repository (papers/02 §3.3): expected batch 256,
# 5 epochs, Adam lr 0.01, input clip C1 = 3, upstream-gradient clip 1e-7 in mean-loss units = 256 * 1e-7 per
# example (fastdp's C2 is per example, sum units).
BACKPROP_PAPER_POINT = {"batch_size": 256, "epochs": 5, "lr": 0.01, "input_clip": 3.0, "clip_norm": 256 * 1e-7}


def _lipdp_cells(full: bool) -> list[Cell]:
    cells = []
    for dataset in ("yeast", "magic", "shuttle", "campaign"):
        batches = (_LIPDP_BATCHES_FULL if full else _LIPDP_BATCHES)[dataset]
        lrs = (0.001, 0.003, 0.01, 0.03) if full else (0.003, 0.01, 0.03)
        epochs = (20, 50) if full else (20,)
        base = {"optimizer": "adam", "hidden": 64, "clip_norm": 1.0}
        taus = (0.5, 1.0, 4.0, 16.0) if full else (1.0, 8.0)
        grids = {
            "dpsgd": _grid(epochs=epochs, batch_size=batches, lr=lrs),
            "clipless": _grid(epochs=epochs, batch_size=batches, lr=lrs, tau=taus),
        }
        for key, grid in grids.items():
            value = paper.LIPDP.get((key, dataset))
            cells.append(
                Cell("lipdp", METHODS[key], dataset, 1.0, paper.LIPDP_DELTA[dataset], "test_auroc", base, grid, value)
            )
    return cells


def _weightclip_cells(full: bool) -> list[Cell]:
    cells = []
    for dataset in ("breast_cancer", "german_credit", "nursery"):
        epsilon, delta = paper.WEIGHTCLIP_EPSILON[dataset], 1.0 / paper.WEIGHTCLIP_N[dataset]
        batches = (32, 128, 512) if full else (64, 256)
        if dataset == "breast_cancer":  # 455 training rows: keep the expected batch below the data set
            batches = tuple(min(b, 256) for b in batches)
        lrs = (0.001, 0.003, 0.01) if full else (0.003, 0.01)
        norms = (1.0, 3.0, 9.0) if full else (1.0, 4.0)
        base = {"optimizer": "adam", "hidden": 32, "epochs": 20, "tau": 1.0}
        for key in ("dpsgd", "weightclip", "fixed"):
            bound = "clip_norm" if key == "dpsgd" else "max_weight_norm"
            grid = _grid(batch_size=batches, lr=lrs, **{bound: norms})
            value = paper.WEIGHTCLIP.get((key, dataset))
            cells.append(Cell("weightclip", METHODS[key], dataset, epsilon, delta, "test_accuracy", base, grid, value))
    return cells


def _backprop_cells(full: bool) -> list[Cell]:
    cells = []
    epsilons = (0.1, 0.2, 0.5, 1.0, 2.0, 3.0) if full else (0.1, 0.2, 1.0, 3.0)
    for epsilon in epsilons:
        cnn = [BACKPROP_PAPER_POINT, {**BACKPROP_PAPER_POINT, "clip_norm": 1.0}]
        if full:  # the paper's Fig. 2 MNIST point (batch 4096, 25 epochs, C1 = 1) and a grid around it
            cnn += list(_grid(batch_size=(1024, 4096), epochs=(25,), lr=(0.003, 0.01), input_clip=(1.0, 3.0),
                              clip_norm=(1.0,)))  # fmt: skip
        else:
            cnn += list(_grid(batch_size=(1024,), epochs=(20,), lr=(0.003, 0.01), input_clip=(3.0,), clip_norm=(1.0,)))
        batches, lrs = ((256, 1024, 4096), (0.003, 0.01, 0.03)) if full else ((256, 1024), (0.003, 0.01))
        # small batches for 5 epochs (the paper's corrected setting), larger ones for 20
        linear = tuple(
            {**p, "epochs": 5 if p["batch_size"] <= 256 else 20, "input_clip": 3.0, "clip_norm": 1.0}
            for p in _grid(batch_size=batches, lr=lrs)
        )
        base = {"optimizer": "adam"}
        for key, grid in (("backprop-cnn", tuple(cnn)), ("backprop-linear", linear)):
            note = "" if key == "backprop-cnn" else "the paper's number is for its CNN"
            value = paper.BACKPROP.get(epsilon)
            cells.append(
                Cell(
                    "backprop",
                    METHODS[key],
                    "mnist",
                    epsilon,
                    paper.BACKPROP_DELTA,
                    "test_accuracy",
                    base,
                    grid,
                    value,
                    note,
                )
            )
    return cells


def build_plan(
    full: bool = False,
    sections: list[str] | None = None,
    methods: list[str] | None = None,
    datasets: list[str] | None = None,
    epsilons: list[float] | None = None,
    seeds: int | None = None,
    tune_seeds: int | None = None,
    max_points: int | None = None,
    epochs: int | None = None,
) -> Plan:
    """The cells to run, filtered; ``max_points`` keeps the first grid points of each cell and ``epochs``
    overrides every run's epoch count (both for quick checks of the machinery, not for results)."""
    for name, given, known in (("section", sections, SECTIONS), ("method", methods, METHODS)):
        unknown = sorted(set(given or ()) - set(known))
        if unknown:
            raise ValueError(f"unknown {name} {', '.join(unknown)}; choose from {', '.join(known)}")
    cells = _lipdp_cells(full) + _weightclip_cells(full) + _backprop_cells(full)
    cells = [
        c
        for c in cells
        if (not sections or c.section in sections)
        and (not methods or c.method.key in methods)
        and (not datasets or c.dataset in datasets)
        and (not epsilons or any(abs(c.epsilon - e) < 1e-9 for e in epsilons))
    ]
    if not cells:
        raise ValueError("the filters (--sections/--methods/--datasets/--epsilons) select no cell")
    if max_points is not None or epochs is not None:
        trimmed = []
        for c in cells:
            grid = c.grid[: max_points or len(c.grid)]
            if epochs is not None:
                grid = tuple({**p, "epochs": epochs} for p in grid)
                base = {**c.base, "epochs": epochs}
            else:
                base = c.base
            trimmed.append(Cell(c.section, c.method, c.dataset, c.epsilon, c.delta, c.metric, base, grid, c.paper,
                                c.note))  # fmt: skip
        cells = trimmed
    n_eval = seeds if seeds is not None else (5 if full else 3)
    n_tune = tune_seeds if tune_seeds is not None else (3 if full else 2)
    if n_eval < 1 or n_tune < 1:
        raise ValueError(f"need at least one evaluation and one tuning seed, got {n_eval} and {n_tune}")
    return Plan(tuple(cells), tuple(range(1000, 1000 + n_tune)), tuple(range(n_eval)), full)
