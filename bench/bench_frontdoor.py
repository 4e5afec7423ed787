"""The front door's overhead: a DP-SGD step through ``fastdp.PrivacyEngine`` (the user's forward, ``loss.backward()``,
``optimizer.step()``) beside the same step through the variant API (``DPSGD.gradient``) and non-private torch.

Same model, batch, clip norm and noise multiplier for every provider; timed side by side, interleaved, medians
(``harness.compare``). The front door should add no measurable time: both run one forward, one backward, the same
per-example norms, clipped sums and noise. Results go to bench/results/<device>-frontdoor.csv.

    python bench/bench_frontdoor.py
    python bench/bench_frontdoor.py --batch 256 1024 --repeats 15
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings
from pathlib import Path

import harness
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fastdp import PrivacyEngine
from fastdp.algorithms import DPSGD

CLIP, SIGMA, LR, N = 1.0, 1.0, 0.01, 60_000


def workloads() -> dict:
    return {
        "mlp": (
            lambda: nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)),
            (784,),
        ),  # fmt: skip
        "cnn": (
            lambda: nn.Sequential(
                nn.Conv2d(1, 16, 5, 2),
                nn.ReLU(),
                nn.Conv2d(16, 32, 4, 2),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(32 * 5 * 5, 10),
            ),
            (1, 28, 28),
        ),  # fmt: skip
    }


def front_door_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """One private step of a user's loop after ``make_private`` (the batch fixed, as for the other providers)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(TensorDataset(torch.zeros(N, *x.shape[1:]), torch.zeros(N, dtype=torch.long)),
                        batch_size=x.shape[0])  # fmt: skip
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, _ = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                              noise_multiplier=SIGMA, max_grad_norm=CLIP)  # fmt: skip

    def step():
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step


def make_step(provider: str, build, x: torch.Tensor, y: torch.Tensor):
    torch.manual_seed(0)
    model = build().to(x.device)
    if provider == "nonprivate":
        return harness.nonprivate_step(model, x, y, LR)
    if provider == "variant-api":
        return harness.variant_step(DPSGD(CLIP, SIGMA, sample_rate=x.shape[0] / N, num_examples=N), model, x, y, LR)
    return front_door_step(model, x, y)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", nargs="+", type=int, default=[256])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    info = harness.run_info(device)
    print(", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    rows = []
    for name, (build, shape) in workloads().items():
        for b in args.batch:
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(b, *shape, generator=gen).to(device)
            y = torch.randint(0, 10, (b,), generator=gen).to(device)
            providers = ("nonprivate", "variant-api", "front-door")
            results = harness.compare({p: functools.partial(make_step, p, build, x, y) for p in providers}, device,
                                      args.repeats)  # fmt: skip
            base = results["nonprivate"][0]
            for provider, (med, p20, p80, _peak) in results.items():
                rows.append(dict(workload=f"{name}-{b}", provider=provider, batch=b, median_ms=f"{med:.3f}",
                                 p20_ms=f"{p20:.3f}", p80_ms=f"{p80:.3f}", time_vs_nonprivate=f"{med / base:.3f}",
                                 **info))  # fmt: skip
                print(f"{name}-{b:<6d} {provider:12s} {med:9.2f} ms ({p20:.2f}, {p80:.2f})  x{med / base:5.2f}",
                      flush=True)  # fmt: skip
    harness.write_rows(rows, args.out, f"{info['device']}-frontdoor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
