"""Clipless and weight-clipping DP steps vs the non-private step of the same Lipschitz network, growing batch.

Workloads: ``lipdp-cnn``, VGG5-small-like (papers/00 speed experiment: BoundedInput, four RKO convolutions of 32,
32, 64, 64 channels with GroupSort2 and L2-norm pooling, a LipschitzLinear head; CIFAR-10-shaped data) and
``mlp-512``, the 784-512-512-10 MLP (MNIST-shaped data): orthogonal LipschitzLinear + GroupSort2 for clipless,
LipschitzLinear with bias, spectral norm clipped to 1, + ReLU for weightclip. Providers: ``nonprivate`` (forward,
backward, SGD step, no projection) of each variant's network (``nonprivate:weightclip`` for the ReLU MLP),
``clipless`` / ``weightclip`` (the same plus the certified bounds, per-layer noise and the projection Pi), each
compared with the non-private step of its own network. Beside each private step, in the same interleaved rounds:
``bounds`` (the release's bound computation: the carried certificates and the bound rules) and ``projection`` (Pi
and the certificate of the weights it leaves), reported as shares of the private step. Results go to
bench/results/<device>-clipless-steps.csv.

Floors (2 CPU cores): a step costs about 6 B P multiply-adds (P parameters); the projection of an n x m dense layer
about 2 n^2 m (one float64 Gram product and one float32 product for the certified Björck step or the
Cholesky-checked rescaling), whatever the batch: the projection's share is about 2 n / (3 B) of a non-private
step per dense layer (1.33 for n = 512 at B = 256, 0.08 at B = 4096). ``--project-every K ...`` adds providers
``<variant>@K`` (the variant projecting after every K-th step only): each timed call runs K steps, one of them
projected, and the time is reported per step.

    python bench/bench_clipless.py --batches 256 1024 4096 --project-every 4 16
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import harness
import torch
from torch import nn

from fastdp.algorithms import Clipless, WeightClip
from fastdp.nn.lipschitz import BoundedInput, GroupSort2, L2NormPool2d, LipschitzConv2d, LipschitzLinear, project_
from fastdp.ops.spectral import deferred_finite_checks

VARIANTS = {"clipless": Clipless, "weightclip": WeightClip}


def vgg5_small(classes: int = 10) -> nn.Module:
    def conv(cin: int, cout: int, hw: int) -> list[nn.Module]:
        return [LipschitzConv2d(cin, cout, 3, input_hw=(hw, hw), padding=1), GroupSort2()]

    return nn.Sequential(
        BoundedInput(15.0), *conv(3, 32, 32), *conv(32, 32, 32), L2NormPool2d(2),
        *conv(32, 64, 16), *conv(64, 64, 16), L2NormPool2d(2), nn.Flatten(), LipschitzLinear(64 * 8 * 8, classes),
    )  # fmt: skip


def mlp_512(variant: str) -> nn.Module:
    if variant == "weightclip":

        def dense(n_in: int, n_out: int) -> LipschitzLinear:
            return LipschitzLinear(n_in, n_out, bias=True, projection="clip", max_norm=1.0)

        return nn.Sequential(BoundedInput(4.0), dense(784, 512), nn.ReLU(), dense(512, 512), nn.ReLU(), dense(512, 10))
    return nn.Sequential(BoundedInput(4.0), LipschitzLinear(784, 512), GroupSort2(), LipschitzLinear(512, 512),
                         GroupSort2(), LipschitzLinear(512, 10))  # fmt: skip


WORKLOADS = {  # name -> (model builder for a variant, one example's shape, the variants it runs)
    "lipdp-cnn": (lambda variant: vgg5_small(), (3, 32, 32), ("clipless",)),
    "mlp-512": (mlp_512, (784,), ("clipless", "weightclip")),
}


def build(workload: str, provider: str, x: torch.Tensor, y: torch.Tensor):
    """The step closure of ``provider`` (``nonprivate[:<variant>]``, a variant, ``<variant>@K``: K steps of the
    variant projecting after every K-th, or ``<variant>:bounds`` / ``<variant>:projection``: that part of the
    variant's step alone) on a fresh, identically initialised model."""
    make_model, _, _ = WORKLOADS[workload]
    provider, _, every = provider.partition("@")
    variant_name, _, part = provider.partition(":")
    torch.manual_seed(0)
    if variant_name == "nonprivate":  # the network of the variant named after the colon (default: clipless's)
        return harness.nonprivate_step(make_model(part or "clipless").to(x.device), x, y, 0.01)
    model = make_model(variant_name).to(x.device)
    k = int(every or 1)
    variant = VARIANTS[variant_name](2.0, sample_rate=x.shape[0] / 50_000, num_examples=50_000, project_every=k)
    if not part:
        step = harness.variant_step(variant, model, x, y, 0.01)  # after_step: the projection (every k-th step)

        def steps():
            for _ in range(k):
                step()

        return steps if k > 1 else step

    def bounds():
        with torch.no_grad(), deferred_finite_checks():
            variant.noise_stds(model)

    def projection():
        with deferred_finite_checks():
            project_(model)

    bounds()  # the first call certifies from scratch (Gram iteration); the step then carries the certificate
    return bounds if part == "bounds" else projection


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--batches", nargs="+", type=int, default=None, help="default: 256 1024 4096 (CPU), to 50000")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--project-every",
        nargs="*",
        type=int,
        default=[],
        metavar="K",
        help="also time each variant projecting after every K-th step only (per step)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    batches = args.batches or ([256, 1024, 4096] if device.type == "cpu" else [256, 1024, 4096, 16384, 50000])
    info = harness.run_info(device)
    for workload in args.workloads:
        make_model, shape, variants = WORKLOADS[workload]
        params = sum(p.numel() for p in make_model(variants[0]).parameters())
        print(f"{workload}: {params} parameters", flush=True)
        baselines = {v: "nonprivate" if v == "clipless" else f"nonprivate:{v}" for v in variants}
        providers = list(dict.fromkeys(baselines.values()))
        providers += [f"{v}{part}" for v in variants for part in ("", ":bounds", ":projection")]
        providers += [f"{v}@{k}" for v in variants for k in args.project_every if k > 1]
        for b in batches:
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(b, *shape, generator=gen).to(device)
            y = torch.randint(0, 10, (b,), generator=gen).to(device)
            results = harness.compare({p: functools.partial(build, workload, p, x, y) for p in providers}, device,
                                      args.repeats, warmup=1)  # fmt: skip
            rows = []  # written after each batch: a run cut short by a time limit keeps what it measured
            for provider, result in results.items():
                if result is None:
                    print(f"{workload} batch {b:6d} {provider:22s} out of memory", flush=True)
                    continue
                med, p20, p80, peak = result
                name, _, every = provider.partition("@")
                med, p20, p80 = (t / int(every or 1) for t in (med, p20, p80))  # per step
                variant_name, _, part = name.partition(":")
                own = provider if variant_name == "nonprivate" else baselines[variant_name]
                base = (results.get(own) or (None,))[0]
                step = (results.get(variant_name) or (None,))[0] if part and variant_name != "nonprivate" else None
                share = f"{med / step:.3f}" if step else ""
                ratio = med / base if base else float("nan")
                rows.append(dict(workload=workload, params=params, provider=provider, batch=b, median_ms=f"{med:.2f}",
                                 p20_ms=f"{p20:.2f}", p80_ms=f"{p80:.2f}", time_vs_nonprivate=f"{ratio:.3f}",
                                 share_of_step=share, peak_mem_mb=f"{peak:.0f}", **info))  # fmt: skip
                note = f"  {float(share):.0%} of the {variant_name} step" if share else ""
                line = f"{workload} batch {b:6d} {provider:22s} {med:9.2f} ms ({p20:.1f}, {p80:.1f})  x{ratio:.2f}"
                print(line + note, flush=True)
            harness.write_rows(rows, args.out, f"{info['device']}-clipless-steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
