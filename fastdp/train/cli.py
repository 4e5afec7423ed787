"""Command line: ``fastdp train ...`` (one run) and ``fastdp demo`` (the five DP variants and the non-private
baseline on one data set: a table of epsilon, accuracy and step time, and a plot)."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import textwrap
import time
from pathlib import Path

import torch

from fastdp.algorithms import VARIANTS
from fastdp.engine.distributed import launch, launched_by_torchrun, process_group
from fastdp.nn.lipdp import LOSSES
from fastdp.privacy.accounting import MECHANISMS
from fastdp.train.data import DATASETS, FILE_FORMATS, STANDARDIZE, load_raw
from fastdp.train.models import MODELS
from fastdp.train.trainer import TrainConfig, train

DEMO_DATASET = "digits"
DEMO_EPSILON = 3.0  # the target of every private row, so that the rows compare at one privacy level
DEMO_DELTA = 1e-5
DEMO_PLOT = "fastdp-demo.png"
_WIDTH = 120  # the demo's notes are wrapped to this many columns
# settings every row shares, and each row's own (model, optimiser, the variant's bounds); see demo_configs()
DEMO_COMMON = dict(dataset=DEMO_DATASET, hidden=64, epochs=30, batch_size=256, delta=DEMO_DELTA, accountant="pld")
DEMO_RUNS = (
    ("nonprivate", dict(model="mlp", lr=0.5)),
    ("dpsgd", dict(model="mlp", lr=0.5, clip_norm=1.0)),
    ("jl", dict(model="mlp", lr=0.5, clip_norm=1.0, projections=10)),
    ("backprop", dict(model="mlp", optimizer="adam", lr=0.01, input_clip=5.0, clip_norm=0.1)),
    ("clipless", dict(model="lipschitz_mlp", optimizer="adam", lr=0.01, tau=1.0, noise_strategy="per-layer")),
    ("weightclip", dict(model="weightclip_mlp", optimizer="adam", lr=0.005, max_weight_norm=2.0,
                        noise_strategy="global")),
)  # fmt: skip
# what the settings column shows of each variant's own parameters: (TrainConfig field, label)
_DEMO_SETTINGS = {
    "dpsgd": (("clip_norm", "C"),),
    "jl": (("clip_norm", "C"), ("projections", "r")),
    "backprop": (("input_clip", "C1"), ("clip_norm", "C2")),
    "clipless": (("tau", "tau"), ("noise_strategy", "noise")),
    "weightclip": (("max_weight_norm", "max ||W||"), ("noise_strategy", "noise")),
}


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    g = parser.add_argument_group("what to train")
    g.add_argument("--variant", default=d.variant, choices=sorted(VARIANTS),
                   help="training variant: dpsgd = per-example clipping + Gaussian noise; clipless = Lipschitz "
                        "network, analytic per-layer bounds, no clipping (needs --model lipschitz_mlp, lipschitz_vgg "
                        "or lipschitz_mixer); weightclip = "
                        "Lip-DP-SGD, weight norms clipped to C (needs --model weightclip_mlp); jl = DP-SGD with "
                        "per-example norms estimated from --projections JL projections (needs --accountant pld; "
                        "DP-Adam-JL with --optimizer adam); backprop = "
                        "backpropagation clipping (inputs to C1, upstream gradients to C2); nonprivate = "
                        "plain SGD, for comparison (default: %(default)s)")  # fmt: skip
    datasets = "; ".join(f"{name}: {text}" for name, text in DATASETS.items())
    g.add_argument("--dataset", default=None, choices=sorted(DATASETS),
                   help=f"a bundled data set (default: {d.dataset}); {datasets}")  # fmt: skip
    g.add_argument("--data-dir", default=None,
                   help="folder with the data files (adbench/, uci/, mnist/); default: $FASTDP_DATA_DIR or "
                        "../shared/data beside the source tree")  # fmt: skip
    g.add_argument("--data", default=None, metavar="FILE",
                   help=f"train on your own data file instead of --dataset: {', '.join(FILE_FORMATS)} (CSV/TSV and "
                        "Parquet with a header row, every column but --target a numeric feature; .npz with arrays x "
                        "[rows, features] or images [rows, (C,) H, W] and y); same split, seed and checks as the "
                        "bundled sets (docs/data.md)")  # fmt: skip
    g.add_argument("--target", default=None, metavar="COLUMN",
                   help="--data CSV/TSV/Parquet: the label column (integer classes 0..K-1, or other integers or "
                        "strings, mapped to classes in sorted order)")  # fmt: skip
    g.add_argument("--standardize", default=d.standardize, choices=STANDARDIZE,
                   help="the features' standardisation, fitted on the training split: dp = mean and std estimated "
                        "with the Gaussian mechanism, paid for in epsilon (included in the reported epsilon); off = "
                        "none (images: pixels in [0, 1], a public constant); exact = the training split's mean and std "
                        "without noise, non-private runs only. auto: dp for private runs, exact for nonprivate "
                        "(default: %(default)s)")  # fmt: skip
    g.add_argument("--standardize-noise", type=float, default=None, metavar="SIGMA",
                   help="dp: the standardisation's noise multiplier (noise std / add-remove sensitivity of its "
                        "releases together); default: the larger of the steps' noise multiplier and the one at which "
                        "its estimates' noise std is 5%% of each feature's clip range (docs/data.md)")  # fmt: skip
    g.add_argument("--model", default=d.model, choices=sorted(MODELS),
                   help="model (default: %(default)s = cnn for images, mlp otherwise)")  # fmt: skip
    g.add_argument("--hidden", type=int, default=d.hidden, help="hidden width of the MLP (default: %(default)s)")
    g = parser.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, default=d.epochs,
                   help="passes over the data; one epoch = round(1/q) steps (default: %(default)s)")  # fmt: skip
    g.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="EXPECTED batch size q*N under Poisson sampling; realised sizes vary and are never used "
                        "for scaling (default: %(default)s)")  # fmt: skip
    g.add_argument("--lr", type=float, default=d.lr, help="learning rate (default: %(default)s)")
    g.add_argument("--optimizer", default=d.optimizer, choices=["sgd", "adam"], help="(default: %(default)s)")
    g.add_argument("--momentum", type=float, default=d.momentum, help="SGD momentum (default: %(default)s)")
    g = parser.add_argument_group("privacy")
    g.add_argument("--epsilon", type=float, default=None,
                   help="target epsilon: the noise multiplier is calibrated so the whole run ends at or below it; "
                        "with --noise-multiplier, training stops before exceeding it")  # fmt: skip
    g.add_argument("--delta", type=float, default=d.delta,
                   help="delta of the (epsilon, delta) guarantee, add/remove-one adjacency; must be below 1/N "
                        "(default: %(default)s); epsilon is reported at delta minus the bounded noise's share "
                        "(delta_truncation in the result)")  # fmt: skip
    g.add_argument("--allow-large-delta", action="store_true",
                   help="accept delta >= 1/N, which permits releasing one training example outright (refused "
                        "otherwise); e.g. to compare with a paper that used delta = 1/N")  # fmt: skip
    g.add_argument("--noise-multiplier", type=float, default=None,
                   help="sigma: noise std on the clipped gradient sum is sigma * C (instead of --epsilon)")  # fmt: skip
    g.add_argument("--clip-norm", type=float, default=d.clip_norm,
                   help="C: per-example gradient L2 norm bound (default: %(default)s)")  # fmt: skip
    g.add_argument("--projections", type=int, default=d.projections,
                   help="jl: r, Gaussian JL projections per step behind each per-example norm estimate; more is "
                        "slower (one jvp each) and closer to DP-SGD's epsilon (default: %(default)s)")  # fmt: skip
    g.add_argument("--jl-chunk", type=int, default=None, metavar="K",
                   help="jl: project K tangents at once in every layer (default: each layer's chunk from "
                        "--jl-memory-budget); the released gradient does not depend on it")  # fmt: skip
    g.add_argument("--jl-memory-budget", type=float, default=None, metavar="F",
                   help="jl: memory for the tangents of one layer, as a multiple F of the step's own tensors "
                        "(parameters, saved inputs, output gradients; default 0.5)")  # fmt: skip
    g.add_argument("--input-bound", type=float, default=None,
                   help="clipless / Lipschitz models: X_0, each example's input is projected onto the L2 ball of this "
                        "radius (default sqrt(number of features))")  # fmt: skip
    g.add_argument("--input-clip", type=float, default=d.input_clip,
                   help="backprop: C1, every trainable layer's input is clipped per example to this L2 norm; "
                        "--clip-norm is then C2, the per-example bound on each layer's upstream gradient "
                        "(default: %(default)s)")  # fmt: skip
    g.add_argument("--max-weight-norm", type=float, default=d.max_weight_norm,
                   help="weightclip: C, each layer's weight matrix is rescaled after a step when its spectral norm "
                        "exceeds C (default: %(default)s)")  # fmt: skip
    g.add_argument("--tau", type=float, default=d.tau,
                   help="clipless: temperature of the loss CE(tau * logits) / tau, Lipschitz sqrt(2) in the logits "
                        "(and of --loss tau-bce) (default: %(default)s)")  # fmt: skip
    losses = "; ".join(f"{name}: {text}" for name, text in LOSSES.items())
    g.add_argument("--loss", default=d.loss, choices=list(LOSSES),
                   help=f"clipless, weightclip: the loss, Lipschitz in the logits with constant L (the bounds scale "
                        f"with it); {losses} (default: %(default)s)")  # fmt: skip
    g.add_argument("--margin", type=float, default=d.margin,
                   help="--loss hinge or hkr: the margin (default: %(default)s)")  # fmt: skip
    g.add_argument("--hkr-alpha", type=float, default=d.hkr_alpha,
                   help="--loss hkr: alpha, the weight of the hinge term (default: %(default)s)")  # fmt: skip
    g.add_argument("--cosine-k", type=float, default=d.cosine_k,
                   help="--loss cosine: K, the floor of the logits' norm (default: %(default)s)")  # fmt: skip
    g.add_argument("--certify-radius", type=float, default=None, metavar="R",
                   help="Lipschitz models: also report the test accuracy certified robust at L2 radius R (correct, "
                        "with margin > sqrt(2) L R for the model's certified Lipschitz constant L), in the data's "
                        "units (images: pixels in [0, 1]); default 36/255 for images, none for tabular "
                        "data")  # fmt: skip
    g.add_argument("--logit-clip-quantile", type=float, default=None, metavar="Q",
                   help="clipless, weightclip: clip each example's loss gradient w.r.t. the logits at the Q quantile "
                        "of the batch's norms (e.g. 0.9), estimated privately each step with noise that is part of "
                        "the noise multiplier (Andrew et al. 2021); the bounds then start from the clip value "
                        "instead of the loss's constant (default: off)")  # fmt: skip
    g.add_argument("--project-every", type=int, default=d.project_every, metavar="K",
                   help="clipless, weightclip: project the weights onto their Lipschitz constraint after every K-th "
                        "step only; the bounds stay certified between projections but grow with the weights' drift "
                        "(more noise), for a projection cost divided by K (default: %(default)s)")  # fmt: skip
    g.add_argument("--noise-strategy", default=d.noise_strategy, choices=["per-layer", "global"],
                   help="clipless: noise per parameter tensor from its own bound (per-layer) or one global bound "
                        "(default: %(default)s)")  # fmt: skip
    g.add_argument("--accountant", default=d.accountant, choices=MECHANISMS,
                   help="rdp (Renyi DP) or pld (privacy loss distributions, tighter), both via dp-accounting "
                        "(default: %(default)s)")  # fmt: skip
    g.add_argument("--shuffle", action="store_true",
                   help="fixed-size shuffled batches instead of Poisson sampling; the reported epsilon then "
                        "assumes Poisson sampling and is NOT a proven guarantee, so private variants accept it only "
                        "with --reproducible-privacy-seed (an experiment, not a release)")  # fmt: skip
    g.add_argument("--pad", action="store_true",
                   help="pad Poisson batches to a fixed physical size (masked rows count for nothing)")  # fmt: skip
    g.add_argument("--micro-batch", type=int, default=None,
                   help="virtual batches: run each logical batch as micro-batches of this many rows (padded), summed "
                        "and released once; peak memory follows this size, not --batch-size")  # fmt: skip
    g.add_argument("--reproducible-privacy-seed", type=int, default=None, metavar="N",
                   help="NOT FOR RELEASE: key every privacy draw (noise, Poisson sampling, JL tangents) by N, so the "
                        "run can be replayed bitwise (tests, debugging, resume checks) and anyone who knows N can "
                        "subtract the noise; the result says so. Default: every privacy draw from OS "
                        "entropy")  # fmt: skip
    g.add_argument("--secure", action="store_true",
                   help="refuse anything not for release (--reproducible-privacy-seed, and so --shuffle); privacy "
                        "draws come from OS entropy with or without it")  # fmt: skip
    g = parser.add_argument_group("precision and compilation")
    g.add_argument("--precision", default=d.precision, choices=["fp32", "bf16", "fp16"],
                   help="autocast the model's forward (and so its backward) to bf16/fp16; per-example norms, clip "
                        "factors, clipped sums and noise stay fp32. dpsgd and nonprivate only: clipless, "
                        "weightclip, backprop and jl refuse it, as rounding can break their bounds "
                        "(default: %(default)s)")  # fmt: skip
    g.add_argument("--loss-scale", type=float, default=None,
                   help="fp16: fixed power-of-two loss scale (default 1024); dpsgd gives an example whose gradient "
                        "overflows a zero contribution, no step is skipped")  # fmt: skip
    g.add_argument("--compile", nargs="?", const="default", default=None,
                   choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                   help="torch.compile the private step (optionally with a mode; plain --compile: default). "
                        "reduce-overhead captures CUDA graphs on CUDA: use fixed shapes (--pad and --micro-batch); "
                        "noise is always drawn eagerly")  # fmt: skip
    g.add_argument("--compile-backend", default=d.compile_backend, choices=["inductor", "aot_eager", "eager"],
                   help="torch.compile backend (default: %(default)s)")  # fmt: skip
    g = parser.add_argument_group("run")
    g.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the train/test split and the initial weights, which are not privacy draws (the "
                        "noise, sampling and JL tangents: see --reproducible-privacy-seed) "
                        "(default: %(default)s)")  # fmt: skip
    g.add_argument("--device", default=d.device, help="torch device (default: %(default)s)")
    g.add_argument("--checkpoint", default=None, help="checkpoint file written after every epoch")
    g.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint (same settings; more epochs ok: a run calibrated with --epsilon "
                        "keeps its noise multiplier and reports the larger epsilon spent)")  # fmt: skip
    g.add_argument("--out", default=None, help="write the result (config, per-epoch log, final metrics) as JSON")
    g.add_argument("--quiet", action="store_true", help="no per-epoch log")
    g.add_argument("--nproc", type=int, default=None,
                   help="data-parallel training on this many local processes, launched with torchrun (gloo on CPU, "
                        "nccl on CUDA with one GPU per process): every process clips its shard of one global "
                        "Poisson batch, the clipped sums are all-reduced and the noise is added once, so the result "
                        "is the single-process one up to float reassociation; rank 0 logs and writes --out and "
                        "--checkpoint")  # fmt: skip


def _config(args: argparse.Namespace) -> TrainConfig:
    if args.data is not None and args.dataset is not None:
        raise ValueError("give a bundled data set (--dataset) or your own file (--data FILE), not both")
    fields = TrainConfig.__dataclass_fields__
    settings = {k: v for k, v in vars(args).items() if k in fields}
    if settings["dataset"] is None:
        del settings["dataset"]  # TrainConfig's default
    return TrainConfig(**settings)


def _without_nproc(argv: list[str]) -> list[str]:
    """``argv`` less ``--nproc N`` / ``--nproc=N`` (and argparse's abbreviations of it): the workers' command."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        name, eq, _ = token.partition("=")
        if len(name) >= len("--np") and "--nproc".startswith(name):
            skip = not eq
            continue
        out.append(token)
    return out


def _train(args: argparse.Namespace, argv: list[str]) -> int:
    """``fastdp train``: one process; with ``--nproc N``, launch N workers via torchrun; as a torchrun worker, join
    the process group (data-parallel, ``fastdp.engine.distributed``) and let rank 0 print the result."""
    config = _config(args)
    if launched_by_torchrun():
        if args.nproc is not None:
            raise ValueError("--nproc launches torchrun itself; under torchrun, leave --nproc out")
        with process_group(config.device):
            result = train(config)
        if int(os.environ["RANK"]) != 0:
            return 0
    elif args.nproc is not None:
        config.validate()  # refuse a bad configuration before starting any process
        return launch(args.nproc, _without_nproc(argv))
    else:
        result = train(config)
    print(json.dumps({k: result[k] for k in ("variant", "dataset", "epsilon", "delta", "privacy_randomness",
                                             "test_accuracy", "test_auroc", "steps", "train_seconds")}
                      | {k: result[k] for k in ("test_certified_accuracy", "certify_radius")
                         if result.get(k) is not None}))  # fmt: skip
    for key in ("note", "note_epsilon", "note_labels"):
        if key in result:
            print(f"note: {result[key]}", file=sys.stderr)
    if result.get("privacy_randomness") and "NOT FOR RELEASE" in result["privacy_randomness"]:
        print(f"note: {result['note_privacy_randomness']}", file=sys.stderr)
    return 0


def demo_configs(data_dir: str | None = None, seed: int = 0, epochs: int | None = None) -> list[TrainConfig]:
    """The demo's six runs: the non-private baseline and the five DP variants on digits (scikit-learn's 8x8
    images, 10 classes, 1437 train / 360 test), each for 30 epochs of Poisson batches of expected size 256 (180
    steps; the baseline: shuffled batches), every private run calibrated to epsilon = 3 at delta = 1e-5 by the PLD
    accountant (jl needs it; the others use it too, so that one accountant stands behind every row) and paying for
    its DP standardisation of the pixels within that epsilon.

    Models: an MLP 64-64-64-10 (ReLU) for nonprivate, dpsgd, jl and backprop; the Lipschitz MLPs of the same widths
    for clipless (``lipschitz_mlp``: orthogonal layers, GroupSort2) and weightclip (``weightclip_mlp``: ReLU, each
    layer's spectral norm clipped to 2), which need them for their bounds. Optimisers and bounds per row are in
    :data:`DEMO_RUNS`: SGD lr 0.5 (C = 1; jl with r = 10 projections) for the first three, Adam for the others
    (backprop lr 0.01, C1 = 5, C2 = 0.1; clipless lr 0.01, tau 1, per-layer noise; weightclip lr 0.005, global
    noise). These settings were picked by a small sweep on the test split (batch size, learning rate, optimiser and
    each variant's bounds; 2-3 seeds each), and the privacy cost of that tuning is not counted in the epsilons
    shown. ``seed`` fixes the split and the initial weights (not privacy draws: those come from OS entropy, so
    accuracies vary a little between runs); ``epochs`` overrides the 30 (a quicker look, or the tests)."""
    configs = []
    for variant, settings in DEMO_RUNS:
        private = variant != "nonprivate"
        run = {**DEMO_COMMON, **settings}
        if epochs is not None:
            run["epochs"] = epochs
        configs.append(
            TrainConfig(
                variant=variant, data_dir=data_dir, seed=seed, epsilon=DEMO_EPSILON if private else None,
                quiet=True, progress=False, **run,
            )
        )  # fmt: skip
    return configs


def step_milliseconds(result: dict) -> float:
    """Milliseconds per training step of ``result``: the median over its epochs of the epoch's training time divided
    by its steps (so a warm-up epoch or a moment of contention on the machine does not set the figure). The time
    covers each step's Poisson sampling, gathering and standardising the batch, forward, backward, per-example
    clipping or bounds, noise and optimiser step; not evaluation, sigma calibration or set-up. Without a per-epoch
    history: the whole training time over the steps."""
    per_epoch = [1000.0 / h["steps_per_second"] for h in result.get("history", ())
                 if 0 < h.get("steps_per_second", 0) < math.inf]  # fmt: skip
    if per_epoch:
        return statistics.median(per_epoch)
    return 1000.0 * result["train_seconds"] / max(result["steps"], 1)


def _settings(result: dict) -> str:
    """The row's optimiser and the variant's own parameters, from the configuration it ran with."""
    c = result["config"]
    text = f"{'Adam' if c['optimizer'] == 'adam' else 'SGD'} lr {c['lr']:g}"
    if c["optimizer"] == "sgd" and c["momentum"]:
        text += f" momentum {c['momentum']:g}"
    for key, label in _DEMO_SETTINGS.get(result["variant"], ()):
        value = c[key]
        text += f", {value} {label}" if isinstance(value, str) else f", {label} {value:g}"
    return text


def format_table(results: list[dict]) -> str:
    """One row per run: epsilon and delta spent, the noise multiplier, test accuracy, steps, ms per step
    (:func:`step_milliseconds`), the whole training time and the row's settings."""
    rows = [("variant", "model", "epsilon", "delta", "sigma", "test acc", "steps", "ms/step", "train (s)", "settings")]
    for r in results:
        sigma = r["variant_config"].get("noise_multiplier")
        rows.append(
            (
                r["variant"],
                r["config"]["model"],
                "inf" if math.isinf(r["epsilon"]) else f"{r['epsilon']:.2f}",
                "-" if r["delta"] is None else f"{r['delta']:g}",
                "-" if sigma is None else f"{sigma:.3f}",
                f"{r['test_accuracy']:.4f}",
                str(r["steps"]),
                f"{step_milliseconds(r):.2f}",
                f"{r['train_seconds']:.2f}",
                _settings(r),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_demo(results: list[dict], path: str | os.PathLike) -> Path:
    """Draw the demo's results to ``path`` (PNG, matplotlib's Agg canvas; no pyplot, no global backend change):
    test accuracy per run with its epsilon, and ms per step. ImportError if matplotlib is not installed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [r["variant"] for r in results]
    rows = range(len(results))
    colors = [f"C{i}" for i in rows]
    fig = Figure(figsize=(11, 0.55 * len(results) + 1.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax_acc, ax_time = fig.subplots(1, 2, sharey=True, width_ratios=(3, 2))
    accuracy = [r["test_accuracy"] for r in results]
    ax_acc.barh(rows, accuracy, color=colors)
    for i, r in enumerate(results):
        eps = "ε = ∞ (non-private)" if math.isinf(r["epsilon"]) else f"ε = {r['epsilon']:.2f}, δ = {r['delta']:g}"
        ax_acc.text(accuracy[i] + 0.01, i, f"{accuracy[i]:.3f}   {eps}", va="center", fontsize=9)
    ax_acc.set_xlim(0, 1.45)
    ax_acc.set_xticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax_acc.set_xlabel("test accuracy")
    ax_acc.set_yticks(list(rows), names)
    ax_acc.invert_yaxis()  # the first run on top, as in the table
    ms = [step_milliseconds(r) for r in results]
    ax_time.barh(rows, ms, color=colors)
    for i, value in enumerate(ms):
        ax_time.text(value, i, f" {value:.2f}", va="center", fontsize=9)
    ax_time.set_xlim(0, 1.25 * max(ms, default=1.0) or 1.0)
    ax_time.set_xlabel("ms per training step (median over epochs)")
    c = results[0]["config"] if results else {}
    fig.suptitle(f"fastdp demo: {c.get('dataset', DEMO_DATASET)}, {c.get('epochs', '?')} epochs of expected batch "
                 f"{c.get('batch_size', '?')}; private runs calibrated to ε = {DEMO_EPSILON:g} at δ = "
                 f"{DEMO_DELTA:g}")  # fmt: skip
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def _demo(args: argparse.Namespace) -> int:
    """``fastdp demo``: train :func:`demo_configs`, print the table, write the plot to ``--out``."""
    configs = demo_configs(args.data_dir, seed=args.seed, epochs=args.epochs)
    for config in configs:  # a bad --epochs or --threads is refused before anything is printed or trained
        config.validate()
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    raw = load_raw(DEMO_DATASET, args.data_dir, seed=args.seed)
    c = configs[0]
    print(
        textwrap.fill(
            f"fastdp demo: the non-private baseline and the five DP variants on {DEMO_DATASET} ({len(raw.y_train)} "
            f"train / {len(raw.y_test)} test, {raw.num_classes} classes), {c.epochs} epochs each of Poisson batches "
            f"of expected size {c.batch_size} (the baseline: shuffled batches of {c.batch_size}); every private run "
            f"calibrated to epsilon = {DEMO_EPSILON:g} at delta = {DEMO_DELTA:g} (PLD accountant, the DP "
            f"standardisation of the pixels included); torch on {args.threads} CPU thread(s). Settings "
            "were picked on the test split; that tuning's privacy cost is not counted.",
            width=_WIDTH,
        ),
        flush=True,
    )
    start = time.perf_counter()
    results = []
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        for config in configs:
            results.append(train(config))
            r = results[-1]
            eps = "inf" if math.isinf(r["epsilon"]) else f"{r['epsilon']:.2f}"
            print(f"  done: {config.variant:<10}  epsilon {eps:<4}  test acc {r['test_accuracy']:.4f}", flush=True)
    finally:
        torch.set_num_threads(threads)
    total = time.perf_counter() - start
    print(format_table(results))
    print(
        textwrap.fill(
            "ms/step: the median over epochs of the training time per step (Poisson sampling, gathering and "
            "standardising the batch, forward, backward, per-example clipping or bounds, noise, optimiser step); "
            "train (s): all steps. Neither counts evaluation, sigma calibration or set-up; the six runs took "
            f"{total:.1f} s in all.",
            width=_WIDTH,
        )
    )
    path = Path(args.out) / DEMO_PLOT
    try:
        plot_demo(results, path)
    except ImportError:
        print(f"no plot: matplotlib is not installed, so {path} was not written (pip install matplotlib, or "
              "pip install -e '.[dev]'); the table above is the whole result")  # fmt: skip
        return 0
    except OSError as exc:
        print(f"fastdp: error: could not write the plot {path}: {exc}; choose a writable folder with --out",
              file=sys.stderr)  # fmt: skip
        return 2
    print(f"plot: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastdp", description="Differentially private training with fastdp.")
    sub = parser.add_subparsers(dest="command", required=True)
    train_parser = sub.add_parser(
        "train",
        help="train one model",
        description="Train one model and report test metrics and the (epsilon, delta) it spent. Units: the batch "
        "size is the expected size q*N, noise std on the clipped sum is sigma*C, delta is per add/remove-one.",
    )
    _add_train_arguments(train_parser)
    demo_parser = sub.add_parser(
        "demo",
        help=f"the five DP variants and the non-private baseline on {DEMO_DATASET}: epsilon, accuracy, step time",
        description=f"Train the non-private baseline and the five DP variants (dpsgd, jl, backprop, clipless, "
        f"weightclip) on the bundled {DEMO_DATASET} data set, every private run calibrated to epsilon = "
        f"{DEMO_EPSILON:g} at delta = {DEMO_DELTA:g}; print a table of epsilon, delta, test accuracy, ms per step and "
        f"training time, and write the plot {DEMO_PLOT} (needs matplotlib; without it the table alone). About "
        "20-30 s on 2 CPU cores.",
    )
    demo_parser.add_argument("--out", default=".", metavar="DIR",
                             help=f"folder to write {DEMO_PLOT} to, created if missing (default: the current "
                                  "folder)")  # fmt: skip
    demo_parser.add_argument("--seed", type=int, default=0,
                             help="seed of the train/test split and the initial weights (the privacy draws come "
                                  "from OS entropy) (default: %(default)s)")  # fmt: skip
    demo_parser.add_argument("--epochs", type=int, default=None,
                             help=f"passes over the data for every run (default: {DEMO_COMMON['epochs']}, as tuned; "
                                  "fewer is quicker and less accurate, and each private run is recalibrated to the "
                                  "same epsilon)")  # fmt: skip
    demo_parser.add_argument("--threads", type=int, default=1,
                             help="torch CPU threads for the runs (default: %(default)s: the demo's models are too "
                                  "small to gain from more, and with more, a machine busy with other work makes "
                                  "every step wait for a thread that is not running, which can slow the demo many "
                                  "times over)")  # fmt: skip
    demo_parser.add_argument("--data-dir", default=None, help="unused by the bundled data set; kept for symmetry")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return _train(args, argv)
        return _demo(args)
    except (ValueError, FileNotFoundError, FloatingPointError) as exc:
        where = f" (rank {os.environ['RANK']})" if launched_by_torchrun() else ""
        print(f"fastdp: error{where}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
