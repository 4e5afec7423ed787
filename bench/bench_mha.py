"""DP-SGD with ``nn.MultiheadAttention``: one training step of an attention classifier (token Embedding ->
``nn.MultiheadAttention`` self-attention, ``need_weights=False`` -> mean over positions -> Linear head, cross entropy)
for non-private torch, fastdp (``fastdp.PrivacyEngine``, and the variant API ``DPSGD``) and Opacus (hooks and ghost
clipping, with ``opacus.layers.DPMultiheadAttention`` swapped in by ``ModuleValidator.fix``), interleaved, medians
(``harness.compare``).

    python bench/bench_mha.py                                   # B 64, T 32, E 128, 4 heads
    python bench/bench_mha.py --batch 32 --seq 128 --repeats 30

Results go to bench/results/<device>-mha.csv.
"""

from __future__ import annotations

import argparse
import copy
import warnings

import bench_dpsgd
import harness
import torch
from bench_dpsgd import AttentionClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fastdp import PrivacyEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    info = harness.run_info(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    y = torch.randint(0, 10, (args.batch,), generator=gen).to(device)
    torch.manual_seed(0)
    base = AttentionClassifier(args.vocab, args.dim, args.heads, 10).to(device)
    clip, sigma, lr = bench_dpsgd.CLIP, bench_dpsgd.SIGMA, bench_dpsgd.LR

    def model() -> nn.Module:
        return copy.deepcopy(base)

    def frontdoor():
        private = model()
        optimizer = torch.optim.SGD(private.parameters(), lr=lr)
        loader = DataLoader(TensorDataset(torch.zeros(100 * args.batch, 1)), batch_size=args.batch)
        private, optimizer, criterion, _ = PrivacyEngine(accountant="rdp").make_private(
            module=private, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma, max_grad_norm=clip,
            criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost",
        )  # fmt: skip

        def step():
            optimizer.zero_grad(set_to_none=True)
            criterion(private(x), y).backward()  # the batch's mean cross-entropy (fastdp.engine.DPLoss)
            optimizer.step()

        return step

    def opacus(provider: str):
        def build():
            from opacus.validators import ModuleValidator

            fixed = ModuleValidator.fix(model())  # nn.MultiheadAttention -> opacus.layers.DPMultiheadAttention
            return bench_dpsgd.make_step(provider, fixed, x, y)

        return build

    builders = {
        "nonprivate": lambda: harness.nonprivate_step(model(), x, y, lr),
        "fastdp-frontdoor": frontdoor,
        "fastdp-dpsgd": lambda: bench_dpsgd.make_step("fastdp", model(), x, y),
        "opacus-hooks": opacus("opacus-hooks"),
        "opacus-ghost": opacus("opacus-ghost"),
    }
    results = harness.compare(builders, device, args.repeats)
    base_ms = results["nonprivate"][0]
    workload = f"mha-B{args.batch}-T{args.seq}-E{args.dim}-H{args.heads}-V{args.vocab}"
    rows = []
    for name, (median, p20, p80, peak) in results.items():
        print(f"{name:18s} {median:9.2f} ms ({p20:.2f}, {p80:.2f})  x {median / base_ms:.2f} non-private")
        rows.append(dict(workload=workload, provider=name, median_ms=round(median, 3), p20_ms=round(p20, 3),
                         p80_ms=round(p80, 3), ratio=round(median / base_ms, 3), peak_mb=peak,
                         repeats=args.repeats, **info))  # fmt: skip
    harness.write_rows(rows, None, f"{harness.device_name(device)}-mha")


if __name__ == "__main__":
    main()
