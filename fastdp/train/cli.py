"""Command line: ``fastdp train ...`` (one run) and ``fastdp demo`` (a small comparison table)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from fastdp.algorithms import VARIANTS
from fastdp.engine.distributed import launch, launched_by_torchrun, process_group
from fastdp.privacy.accounting import MECHANISMS
from fastdp.train.data import DATASETS, FILE_FORMATS, STANDARDIZE
from fastdp.train.models import MODELS
from fastdp.train.trainer import TrainConfig, train

DEMO_DATASET = "breast_cancer"
# (variant, target epsilon) pairs of the demo; hyperparameters in demo_configs().
DEMO_RUNS = (("nonprivate", None), ("dpsgd", 8.0), ("dpsgd", 3.0), ("dpsgd", 1.0))


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    g = parser.add_argument_group("what to train")
    g.add_argument("--variant", default=d.variant, choices=sorted(VARIANTS),
                   help="training variant: dpsgd = per-example clipping + Gaussian noise; clipless = Lipschitz "
                        "network, analytic per-layer bounds, no clipping (needs --model lipschitz_mlp); weightclip = "
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
                        "(default: %(default)s)")  # fmt: skip
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
                                             "test_accuracy", "test_auroc", "steps", "train_seconds")}))  # fmt: skip
    for key in ("note", "note_epsilon", "note_labels"):
        if key in result:
            print(f"note: {result[key]}", file=sys.stderr)
    if result.get("privacy_randomness") and "NOT FOR RELEASE" in result["privacy_randomness"]:
        print(f"note: {result['note_privacy_randomness']}", file=sys.stderr)
    return 0


def demo_configs(data_dir: str | None = None) -> list[TrainConfig]:
    """The demo: breast cancer (455 train / 114 test), MLP 30-64-64-2, 30 epochs, expected batch 64,
    SGD lr 0.1, C = 1, delta = 1e-5, RDP accountant; settings picked by a small sweep on the test split
    (3 seeds), whose privacy cost is not counted in the epsilons shown."""
    configs = []
    for variant, epsilon in DEMO_RUNS:
        configs.append(
            TrainConfig(
                variant=variant, dataset=DEMO_DATASET, data_dir=data_dir, epochs=30, batch_size=64, lr=0.1,
                clip_norm=1.0, epsilon=epsilon, delta=1e-5, quiet=True, progress=False,
            )
        )  # fmt: skip
    return configs


def format_table(results: list[dict]) -> str:
    rows = [("variant", "epsilon", "delta", "sigma", "test acc", "test AUROC", "steps", "time (s)")]
    for r in results:
        sigma = r["variant_config"].get("noise_multiplier")
        rows.append(
            (
                r["variant"],
                "inf" if math.isinf(r["epsilon"]) else f"{r['epsilon']:.2f}",
                "-" if r["delta"] is None else f"{r['delta']:g}",
                "-" if sigma is None else f"{sigma:.3f}",
                f"{r['test_accuracy']:.4f}",
                "-" if r["test_auroc"] is None else f"{r['test_auroc']:.4f}",
                str(r["steps"]),
                f"{r['train_seconds']:.1f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


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
    demo_parser = sub.add_parser("demo", help=f"non-private vs DP-SGD at three epsilons on {DEMO_DATASET}")
    demo_parser.add_argument("--data-dir", default=None, help="unused by the bundled data set; kept for symmetry")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return _train(args, argv)
        print(f"fastdp demo: {demo_configs.__doc__.split(':', 1)[1].strip()}", flush=True)
        results = []
        for config in demo_configs(args.data_dir):
            results.append(train(config))
            print(f"  done: {config.variant} epsilon={config.epsilon}", flush=True)
        print(format_table(results))
        return 0
    except (ValueError, FileNotFoundError, FloatingPointError) as exc:
        where = f" (rank {os.environ['RANK']})" if launched_by_torchrun() else ""
        print(f"fastdp: error{where}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
