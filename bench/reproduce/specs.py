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

import dataclasses
import itertools
from dataclasses import dataclass

from bench.reproduce import paper
from bench.reproduce.paper import PaperValue

SECTIONS: dict[str, str] = {
    "lipdp": "lip-dp (papers/00 Table 3a/7): test AUROC at epsilon = 1 on ADBench sets",
    "weightclip": "Weight clipping (papers/01 Table 1): test accuracy at the table's epsilon, delta = 1/n",
    "backprop": "Backpropagation clipping (papers/02, corrected results): MNIST test accuracy",
    "jl": "DP-SGD-JL (papers/03 Fig. 3, Fig. 4, Table 3): epsilon against r, MNIST accuracy, largest batch",
}


# The DP layers of ``mlp`` at TrainConfig's depth 2: two hidden Linear layers and the classifier.
MLP_DP_LAYERS = 3


@dataclass(frozen=True)
class Method:
    """A training method: a fastdp variant on a model. ``projection`` (Lipschitz models only) switches every
    ``LipschitzLinear`` to that projection before training (``"fixed"``: Fix-Lip-DP-SGD, ||W||_2 = C always).
    ``per_layer`` (DP-SGD only): the model's number of DP layers, each clipped to its own C_l = the grid's C
    (``fastdp.algorithms.dpsgd`` per-layer clipping: layer l's sum gets noise std sigma sqrt(L) C_l, so the release
    is one Gaussian of multiplier sigma for its L2 sensitivity sqrt(sum_l C_l^2) = sqrt(L) C)."""

    key: str
    label: str
    variant: str
    model: str
    projection: str | None = None
    per_layer: int | None = None


METHODS: dict[str, Method] = {
    m.key: m
    for m in (
        Method("dpsgd", "DP-SGD", "dpsgd", "mlp"),
        Method("dpsgd-per-layer", "DP-SGD, per-layer clipping", "dpsgd", "mlp", per_layer=MLP_DP_LAYERS),
        Method("clipless", "clipless (lip-dp)", "clipless", "lipschitz_mlp"),
        Method("weightclip", "weightclip (Lip-DP-SGD)", "weightclip", "weightclip_mlp"),
        Method("fixed", "fixed norm (Fix-Lip-DP-SGD)", "weightclip", "weightclip_mlp", projection="fixed"),
        Method("backprop-cnn", "backprop clipping, CNN", "backprop", "opacus_cnn"),
        Method("backprop-cnn-repo", "backprop clipping, bias-free CNN (repo)", "backprop", "backprop_cnn"),
        Method("backprop-linear", "backprop clipping, linear", "backprop", "linear"),
        Method("dpsgd-cnn", "DP-SGD (CNN)", "dpsgd", "opacus_cnn"),
        Method("jl-10", "DP-SGD-JL(10)", "jl", "opacus_cnn"),
        Method("jl-20", "DP-SGD-JL(20)", "jl", "opacus_cnn"),
        Method("jl-30", "DP-SGD-JL(30)", "jl", "opacus_cnn"),
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
        """TrainConfig keyword arguments of grid ``point`` at ``seed`` (per-layer methods: ``clip_norm`` C becomes one
        C_l = C per DP layer)."""
        config = {
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
        if self.method.per_layer:
            config["clip_norm"] = [float(config["clip_norm"])] * self.method.per_layer
        return config


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


# papers/01 Table 1's larger sets: (expected batch size, epochs) per set, so that one run takes seconds on one CPU
# thread (training rows: adult 39,073 -> 382 steps, default_credit 24,000 -> 469, dropout 3,539 -> 276).
_WEIGHTCLIP_MORE = {"adult": (1024, 10), "default_credit": (512, 10), "dropout": (256, 20)}


def _weightclip_more_cells(full: bool) -> list[Cell]:
    """papers/01's per-layer-clipped DP-SGD baseline beside the flat one on breast cancer, German credit and nursery
    (the flat DP-SGD cells' grids), and the four methods on Adult, default credit and dropout."""
    per_layer = METHODS["dpsgd-per-layer"]
    cells = [
        dataclasses.replace(c, method=per_layer, paper=paper.WEIGHTCLIP.get((per_layer.key, c.dataset)))
        for c in _weightclip_cells(full)
        if c.method.key == "dpsgd"
    ]
    for dataset, (batch, epochs) in _WEIGHTCLIP_MORE.items():
        epsilon, delta = paper.WEIGHTCLIP_EPSILON[dataset], 1.0 / paper.WEIGHTCLIP_N[dataset]
        base = {"optimizer": "adam", "hidden": 32, "epochs": epochs, "batch_size": batch, "tau": 1.0}
        for key in ("dpsgd", "dpsgd-per-layer", "weightclip", "fixed"):
            bound = "max_weight_norm" if METHODS[key].variant == "weightclip" else "clip_norm"
            if full:
                grid = _grid(batch_size=(batch // 4, batch, 4 * batch), lr=(0.001, 0.003, 0.01),
                             **{bound: (1.0, 3.0, 9.0)})  # fmt: skip
            else:
                grid = _grid(lr=(0.003, 0.01), **{bound: (1.0, 4.0)})
            value = paper.WEIGHTCLIP.get((key, dataset))
            cells.append(Cell("weightclip", METHODS[key], dataset, epsilon, delta, "test_accuracy", base, grid, value))
    return cells


def _backprop_repo_cells(full: bool) -> list[Cell]:
    """The repository's later bias-free 4-tensor CNN (``backprop_cnn``) at its corrected configuration: at the
    paper's epsilons, and at the joint epsilons its 'epsilon = 1' and 'epsilon = 3' settings really had
    (``paper.BACKPROP_JOINT_EPSILON``, :mod:`bench.reproduce.backprop_accounting`) beside the accuracies it reports
    for those settings. One grid point by default (the repository's configuration, nothing to tune)."""
    grid = [BACKPROP_PAPER_POINT]
    if full:
        grid += [{**BACKPROP_PAPER_POINT, "clip_norm": 1.0}]
        grid += list(_grid(batch_size=(1024,), epochs=(20,), lr=(0.003, 0.01), input_clip=(3.0,), clip_norm=(1.0,)))
    targets = [(epsilon, paper.BACKPROP.get(epsilon), "") for epsilon in sorted(paper.BACKPROP)]
    for setting, joint in paper.BACKPROP_JOINT_EPSILON.items():
        note = f"the repository's 'epsilon = {setting:g}' setting, jointly accounted"
        targets.append((joint, paper.BACKPROP[setting], note))
    method, base = METHODS["backprop-cnn-repo"], {"optimizer": "adam"}
    cells = []
    for epsilon, value, note in targets:
        cell = Cell("backprop", method, "mnist", epsilon, paper.BACKPROP_DELTA, "test_accuracy", base, tuple(grid),
                    value, note)  # fmt: skip
        cells.append(cell)
    return cells


# papers/03 Fig. 4 (bench.reproduce.jl_rows: the protocol): every method at DP-SGD's noise multiplier for epsilon 3
# on our MNIST split, expected batch 512; per epoch count, (sigma, {r: the cell's epsilon}), each JL(r)'s epsilon at
# that sigma plus 1%, rounded up (jl_rows.fig4_setting computes them; tests/test_jl_reproduce.py checks these).
JL_FIG4 = {10: (1.424, {10: 8.12, 20: 3.71, 30: 3.37}), 20: (1.82, {10: 5.84, 20: 3.39, 30: 3.24})}


def jl_fig4_epochs(full: bool) -> int:
    return 20 if full else 10


def _jl_cells(full: bool) -> list[Cell]:
    """papers/03 Fig. 4: DP-SGD and DP-SGD-JL(r) (r = 10, 20; --full also 30) with the tutorial CNN on MNIST, all at
    DP-SGD's sigma for epsilon 3; learning rates tuned per method. JL(3) and JL(5), the paper's smallest, are not
    trainable at delta 1e-5 (bench.reproduce.jl_rows.fig4_setting). Fig. 3 and Table 3 are computed, not trained
    (``jl_rows.section_lines``)."""
    from bench.reproduce import jl_rows

    epochs = jl_fig4_epochs(full)
    sigma, targets = JL_FIG4[epochs]
    base = {"optimizer": "sgd", "batch_size": jl_rows.FIG4_BATCH, "epochs": epochs, "clip_norm": 1.0,
            "noise_multiplier": sigma, "accountant": "pld", "standardize": "off"}  # fmt: skip
    grid = _grid(lr=(0.5, 1.0, 2.0, 4.0) if full else (1.0, 2.0))
    figure = PaperValue(float("nan"), "papers/03 Fig. 4 (an image: JL(3) 'very close to', JL(20) 'almost "
                        "indistinguishable from' DP-SGD)")  # fmt: skip
    cells = [Cell("jl", METHODS["dpsgd-cnn"], "mnist", jl_rows.FIG4_DP_SGD_EPSILON, jl_rows.DELTA, "test_accuracy",
                  base, grid, figure, f"sigma {sigma}")]  # fmt: skip
    for r in jl_rows.FIG4_PROJECTIONS_FULL if full else jl_rows.FIG4_PROJECTIONS:
        cells.append(Cell("jl", METHODS[f"jl-{r}"], "mnist", targets[r], jl_rows.DELTA, "test_accuracy",
                          {**base, "projections": r}, grid, figure, f"sigma {sigma}, DP-SGD's"))  # fmt: skip
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
    cells += _weightclip_more_cells(full) + _backprop_repo_cells(full)
    cells += _jl_cells(full)
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
