"""DP recurrent layers: one training step of a recurrent classifier (a 1-layer LSTM or GRU, a Linear head on the last
hidden state, mean cross-entropy) per provider, interleaved, medians (``harness.compare``):

* ``nonprivate``: the torch module (``nn.LSTM``/``nn.GRU``: oneDNN/cuDNN fused kernels) and SGD;
* ``fastdp``: the same model through ``fastdp.PrivacyEngine`` (DP-SGD, ghost clipping: ``fastdp.nn.LSTM``/``GRU``);
* ``opacus-hooks``: ``opacus.layers.DPLSTM``/``DPGRU`` through Opacus' ``PrivacyEngine`` (grad_sample_mode "hooks":
  per-example gradients of every time step's ``RNNLinear``);
* ``opacus-ghost``: the same with grad_sample_mode "ghost" (fast gradient clipping), where Opacus can run it.

    python bench/bench_rnn.py                      # B 64, T 32, input 64, hidden 128, LSTM and GRU, 15 rounds
    python bench/bench_rnn.py --threads 1          # on a shared machine: one thread waits for no descheduled other
    FASTDP_BACKEND=torch python bench/bench_rnn.py # fastdp with the torch time loops instead of fastdp._C's

Results are appended to bench/results/<device>-rnn.csv.
"""

from __future__ import annotations

import argparse
import warnings

import harness
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CLIP, SIGMA, LR = 1.0, 1.0, 0.01


class Classifier(nn.Module):
    """A recurrent layer (batch-first) and a Linear head on its last hidden state."""

    def __init__(self, rnn: nn.Module, hidden: int, classes: int) -> None:
        super().__init__()
        self.rnn, self.head = rnn, nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, state = self.rnn(x)
        return self.head((state[0] if isinstance(state, tuple) else state)[-1])


def make_model(provider: str, kind: str, d: int, hidden: int, classes: int) -> nn.Module:
    torch.manual_seed(0)
    if provider.startswith("opacus"):
        from opacus.layers import DPGRU, DPLSTM

        rnn = {"lstm": DPLSTM, "gru": DPGRU}[kind](d, hidden, batch_first=True)
    else:
        rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[kind](d, hidden, batch_first=True)
    return Classifier(rnn, hidden, classes)


def make_step(provider: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, examples: int):
    """A closure running one training step of ``provider`` on the fixed batch (x, y); the private providers' loaders
    only set the sample rate (batch size / ``examples``)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    criterion = nn.CrossEntropyLoss()
    if provider == "nonprivate":
        module = model
    else:
        loader = DataLoader(TensorDataset(torch.zeros(examples, 1)), batch_size=x.shape[0])
        if provider == "fastdp":
            from fastdp import PrivacyEngine

            engine = PrivacyEngine(accountant="rdp")
            module, optimizer, criterion, _ = engine.make_private(module=model, optimizer=optimizer,
                                                                  data_loader=loader, noise_multiplier=SIGMA,
                                                                  max_grad_norm=CLIP, criterion=criterion,
                                                                  grad_sample_mode="ghost")  # fmt: skip
        else:
            from opacus import PrivacyEngine

            engine = PrivacyEngine(accountant="rdp")
            common = dict(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=SIGMA,
                          max_grad_norm=CLIP)  # fmt: skip
            if provider == "opacus-ghost":  # the loss wrapper runs its two backwards
                module, optimizer, criterion, _ = engine.make_private(**common, grad_sample_mode="ghost",
                                                                      criterion=criterion)  # fmt: skip
            else:
                module, optimizer, _ = engine.make_private(**common, grad_sample_mode="hooks")

    def step():
        optimizer.zero_grad(set_to_none=True)
        criterion(module(x), y).backward()
        optimizer.step()

    return step


PROVIDERS = ("nonprivate", "fastdp", "opacus-hooks", "opacus-ghost")


def recurrence_note(device: torch.device) -> str:
    """Which time loops fastdp's recurrent layers run here (the fastdp rows' note)."""
    from fastdp.nn.recurrent import _extension

    ext = _extension(torch.zeros(1, device=device))
    if ext is None:
        return "recurrence: torch loops"
    return f"recurrence: fastdp._C ({ext.recurrence_isa()} gate kernels, {ext.recurrence_gemm()} step GEMMs)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["lstm", "gru"], choices=["lstm", "gru"])
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--input", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    info = harness.run_info(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.seq, args.input, generator=gen).to(device)
    y = torch.randint(0, args.classes, (args.batch,), generator=gen).to(device)
    note = recurrence_note(device) if "fastdp" in args.providers else ""
    print(note)
    rows = []
    for kind in args.kinds:
        builders, failed = {}, {}
        for provider in args.providers:
            try:  # built and run once here, so a provider that cannot run this model is reported, not timed
                model = make_model(provider, kind, args.input, args.hidden, args.classes).to(device)
                step = make_step(provider, model, x, y, 1000 * args.batch)
                step()
                builders[provider] = lambda step=step: step
            except Exception as error:  # noqa: BLE001 - reported in the table and the CSV
                failed[provider] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        results = harness.compare(builders, device, args.repeats)
        base = results["nonprivate"][0] if "nonprivate" in results else float("nan")
        workload = f"{kind}-B{args.batch}-T{args.seq}-d{args.input}-H{args.hidden}"
        print(workload)
        for provider in args.providers:
            if provider in failed:
                print(f"  {provider:14s} not run: {failed[provider]}")
                rows.append(dict(workload=workload, provider=provider, median_ms="", p20_ms="", p80_ms="", ratio="",
                                 note=failed[provider], **info))  # fmt: skip
                continue
            median, p20, p80, _ = results[provider]
            print(f"  {provider:14s} {median:9.2f} ms ({p20:.2f}, {p80:.2f})  x {median / base:.2f} non-private")
            rows.append(dict(workload=workload, provider=provider, median_ms=round(median, 3), p20_ms=round(p20, 3),
                             p80_ms=round(p80, 3), ratio=round(median / base, 3),
                             note=note if provider == "fastdp" else "", **info))  # fmt: skip
    harness.write_rows(rows, None, f"{harness.device_name(device)}-rnn")


if __name__ == "__main__":
    main()
