"""Runs a :class:`~bench.reproduce.specs.Plan` through fastdp's trainer: tuning runs first, then, as soon as a
cell's tuning runs are all in, its evaluation runs at the chosen grid point.

Every run is one ``fastdp.train.trainer.Trainer(TrainConfig(...)).run()`` in a worker process with one torch thread
(``jobs`` workers side by side; ``jobs=1`` runs in this process). A run that raises (a diverging learning rate, a
missing data file) is recorded with its error and takes no part in the selection; it never stops the others.
"""

from __future__ import annotations

import math
import multiprocessing
import statistics
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass

from bench.reproduce.specs import Cell, Plan
from fastdp.train.trainer import TrainConfig, Trainer

# Training rows per data set (80% of each), only to start the longest runs first.
_TRAIN_ROWS = {"yeast": 1187, "magic": 15216, "shuttle": 39277, "campaign": 32950, "breast_cancer": 455,
               "german_credit": 800, "nursery": 10368, "mnist": 8000, "adult": 39073, "default_credit": 24000,
               "dropout": 3539}  # fmt: skip
_MODEL_COST = {"opacus_cnn": 30.0, "backprop_cnn": 20.0, "cnn": 60.0, "lipschitz_mlp": 2.5, "weightclip_mlp": 2.5}

RESULT_KEYS = ("status", "error", "value", "test_accuracy", "test_auroc", "epsilon_spent", "noise_multiplier",
               "steps", "train_seconds", "wall_seconds")  # fmt: skip


@dataclass(frozen=True)
class Job:
    cell: int  # index into plan.cells
    phase: str  # "tune" or "eval"
    point: int  # index into the cell's grid
    seed: int

    def config(self, plan: Plan, data_dir: str | None) -> dict:
        cell = plan.cells[self.cell]
        return cell.config(cell.grid[self.point], self.seed, data_dir)

    def cost(self, plan: Plan) -> float:
        cell = plan.cells[self.cell]
        point = {**cell.base, **cell.grid[self.point]}
        work = point.get("epochs", 10) * _TRAIN_ROWS.get(cell.dataset, 1000) * _MODEL_COST.get(cell.method.model, 1.0)
        return work / 1e4 + 2.0  # + setup, calibration and accounting


def use_projection(model, projection: str) -> None:
    """Switch every ``LipschitzLinear`` of ``model`` to ``projection`` and apply it once, so training starts inside
    the constraint set (papers/01 Alg. 1 line 3). The bounds come from the current weights either way, so this
    changes what the model may learn, never its privacy accounting.

    This is how the fixed-norm method (Fix-Lip-DP-SGD) runs: variant ``weightclip`` on ``weightclip_mlp``, switched to
    ``"fixed"`` after the :class:`Trainer` is built and before it runs (the trainer accepts only ``lipschitz_mlp`` and
    ``weightclip_mlp`` for the Lipschitz variants, so a separately named model would need a trainer change)."""
    from fastdp.nn.lipschitz import PROJECTIONS, LipschitzLinear

    if projection not in PROJECTIONS:
        raise ValueError(f"unknown projection {projection!r}; choose one of {', '.join(PROJECTIONS)}")
    layers = [m for m in model.modules() if isinstance(m, LipschitzLinear)]
    if not layers:
        raise ValueError(f"projection {projection!r} needs LipschitzLinear layers; the model has none")
    for layer in layers:
        layer.projection = projection
        layer.project_()


def train_one(config: dict, projection: str | None = None, metric: str = "test_accuracy") -> dict:
    """One training run with the existing trainer; returns the result fields of :data:`RESULT_KEYS`."""
    start = time.perf_counter()
    try:
        trainer = Trainer(TrainConfig(**config, quiet=True, progress=False))
        if projection is not None:
            use_projection(trainer.model, projection)
        result = trainer.run()
    except Exception as exc:  # noqa: BLE001 - a failed point is recorded and skipped, the sweep goes on
        return {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "value": math.nan,
                "wall_seconds": time.perf_counter() - start}  # fmt: skip
    value = result.get(metric)
    return {
        "status": "ok",
        "error": "",
        "value": math.nan if value is None else float(value),
        "test_accuracy": result["test_accuracy"],
        "test_auroc": result["test_auroc"],
        "epsilon_spent": result["epsilon"],
        "noise_multiplier": result["variant_config"].get("noise_multiplier"),
        "steps": result["steps"],
        "train_seconds": result["train_seconds"],
        "wall_seconds": time.perf_counter() - start,
    }


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


class _InlineExecutor:
    """``jobs=1``: run each job when it is submitted, in this process (one torch thread, restored after)."""

    def __enter__(self):
        import torch

        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        return self

    def __exit__(self, *exc) -> None:
        import torch

        torch.set_num_threads(self._threads)

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        future.set_result(fn(*args))
        return future


def select_point(cell: Cell, rows: list[dict]) -> int | None:
    """Index of the grid point with the best mean metric over the tuning seeds (ties: the first). A point with a
    failed or NaN run is out; None if no point is left."""
    best, best_value = None, -math.inf
    for point in range(len(cell.grid)):
        values = [r["value"] for r in rows if r["point"] == point]
        if not values or any(not (isinstance(v, float) and math.isfinite(v)) for v in values):
            continue
        mean = statistics.fmean(values)
        if mean > best_value:
            best, best_value = point, mean
    return best


def execute(
    plan: Plan,
    jobs: int = 2,
    data_dir: str | None = None,
    on_row: Callable[[dict], None] | None = None,
    log: Callable[[str], None] = print,
) -> tuple[list[dict], dict[int, int | None]]:
    """Run the plan; returns (one row per run, the chosen grid point per cell index or None when all failed)."""
    tune_rows: dict[int, list[dict]] = {i: [] for i in range(len(plan.cells))}
    tune_left = {i: len(c.grid) * len(plan.tune_seeds) for i, c in enumerate(plan.cells)}
    chosen: dict[int, int | None] = {}
    rows: list[dict] = []
    initial = [
        Job(i, "tune", p, s) for i, c in enumerate(plan.cells) for p in range(len(c.grid)) for s in plan.tune_seeds
    ]
    initial.sort(key=lambda job: -job.cost(plan))  # longest first: less idle time at the end
    total = len(initial) + len(plan.cells) * len(plan.eval_seeds)
    start = time.perf_counter()
    if jobs > 1:
        executor = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker)
    else:
        executor = _InlineExecutor()
    with executor:
        futures: dict[Future, Job] = {}

        def submit(job: Job) -> None:
            cell = plan.cells[job.cell]
            future = executor.submit(train_one, job.config(plan, data_dir), cell.method.projection, cell.metric)
            futures[future] = job

        for job in initial:
            submit(job)
        while futures:
            done, _ = wait(list(futures), return_when=FIRST_COMPLETED)
            for future in done:
                job = futures.pop(future)
                cell = plan.cells[job.cell]
                row = make_row(cell, job, future.result())
                rows.append(row)
                if on_row is not None:
                    on_row(row)
                value = "failed" if row["status"] != "ok" else f"{row['value']:.4f}"
                log(f"[{len(rows)}/{total} {time.perf_counter() - start:6.0f}s] {job.phase} {cell.key} "
                    f"point {job.point} seed {job.seed}: {cell.metric} {value}")  # fmt: skip
                if job.phase != "tune":
                    continue
                tune_rows[job.cell].append(row)
                tune_left[job.cell] -= 1
                if tune_left[job.cell] == 0:
                    chosen[job.cell] = select_point(cell, tune_rows[job.cell])
                    if chosen[job.cell] is None:
                        log(f"{cell.key}: every tuning run failed; no evaluation runs")
                        continue
                    for seed in plan.eval_seeds:
                        submit(Job(job.cell, "eval", chosen[job.cell], seed))
    return rows, chosen


def make_row(cell: Cell, job: Job, result: dict) -> dict:
    """One CSV row: what ran (cell, grid point, seed, every setting) and what came out."""
    point = {**cell.base, **cell.grid[job.point]}
    return {
        "section": cell.section,
        "method": cell.method.key,
        "variant": cell.method.variant,
        "model": cell.method.model,
        "projection": cell.method.projection or "",
        "dataset": cell.dataset,
        "epsilon": cell.epsilon,
        "delta": cell.delta,
        "phase": job.phase,
        "point": job.point,
        "seed": job.seed,
        "metric": cell.metric,
        **{k: point.get(k, _DEFAULTS[k]) if k in RELEVANT[cell.method.variant] else "" for k in SETTINGS},
        **{k: result.get(k, "") for k in RESULT_KEYS},
    }


# The settings a row can record and, per variant, the ones that matter to it: those are recorded (effective values,
# TrainConfig defaults where a cell does not set them) and shown in the report; the others are left blank.
SETTINGS = ("epochs", "batch_size", "lr", "optimizer", "hidden", "clip_norm", "max_weight_norm", "tau", "input_clip")
RELEVANT = {
    "dpsgd": ("epochs", "batch_size", "lr", "optimizer", "hidden", "clip_norm"),
    "clipless": ("epochs", "batch_size", "lr", "optimizer", "hidden", "tau"),
    "weightclip": ("epochs", "batch_size", "lr", "optimizer", "hidden", "max_weight_norm", "tau"),
    "backprop": ("epochs", "batch_size", "lr", "optimizer", "input_clip", "clip_norm"),
    "jl": ("epochs", "batch_size", "lr", "optimizer", "clip_norm"),
}
_DEFAULTS = {k: TrainConfig.__dataclass_fields__[k].default for k in SETTINGS}
COLUMNS = ("section", "method", "variant", "model", "projection", "dataset", "epsilon", "delta", "phase", "point",
           "seed", "metric", *SETTINGS, *RESULT_KEYS)  # fmt: skip
