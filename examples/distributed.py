"""Data-parallel private training with torchrun: an ordinary front-door script, on one process or on N.

    torchrun --standalone --nproc_per_node 2 examples/distributed.py     # 2 processes (gloo on CPU, nccl on GPU)
    python examples/distributed.py                                       # the same training in one process
    python examples/distributed.py --smoke                               # one epoch on 300 examples (the tests)

Nothing in the loop changes: initialise the default process group before ``make_private`` and fastdp finds it.
The loader's ``batch_size`` is the global expected batch size; rank 0's Poisson sample is shared and each process
loads its shard; the bounded sums are all-reduced and the noise is added once; every process holds the same model
(no ``DistributedDataParallel``: fastdp's optimizer step does its work). Data: scikit-learn's bundled digits.

Prints (rank 0) one JSON object: the variant, the number of processes, the steps taken, epsilon at delta and the
test accuracy.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fastdp import PrivacyEngine
from fastdp.engine import BatchMemoryManager
from fastdp.train.models import build_model

BOUNDS = {
    "dpsgd": {"max_grad_norm": 1.0},
    "jl": {"max_grad_norm": 1.0, "projections": 4},
    "clipless": {},
    "backprop": {"input_clip": 4.0, "grad_clip": 0.5},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=list(BOUNDS), default="dpsgd")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128, help="global expected batch size")
    parser.add_argument("--max-physical-batch-size", type=int, default=None, help="virtual batches (optional)")
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--reproducible-seed", type=int, default=None, help="NOT FOR RELEASE: replayable draws")
    parser.add_argument("--out", default=None, help="rank 0 saves the trained state_dict here")
    parser.add_argument("--smoke", action="store_true", help="one epoch on the first 300 training examples")
    args = parser.parse_args()
    train_rows = 300 if args.smoke else 1500
    if args.smoke:
        args.epochs, args.batch_size = 1, 64

    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # started by torchrun
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if distributed else 0

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    train = TensorDataset(x[:train_rows], y[:train_rows])
    torch.manual_seed(0)  # the same initial model everywhere (rank 0's is broadcast anyway)
    if args.variant == "clipless":
        model = build_model("lipschitz_mlp", (64,), 10, hidden=64, depth=2, input_bound=8.0)
    else:
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    loader = DataLoader(train, batch_size=args.batch_size)

    engine = PrivacyEngine(accountant="pld" if args.variant == "jl" else "rdp")
    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=args.noise_multiplier,
        criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost",  # its returned criterion: fastdp.engine.DPLoss
        variant=args.variant, reproducible_seed=args.reproducible_seed, **BOUNDS[args.variant],
    )  # fmt: skip
    for _ in range(args.epochs):
        batches = loader
        if args.max_physical_batch_size:
            batches = BatchMemoryManager(data_loader=loader, max_physical_batch_size=args.max_physical_batch_size,
                                         optimizer=optimizer)  # fmt: skip
        for xb, yb in batches:
            optimizer.zero_grad()
            loss = criterion(model(xb.to(device)), yb.to(device))
            loss.backward()
            optimizer.step()

    model.eval()
    with torch.no_grad():
        accuracy = (model(x[1500:].to(device)).argmax(1).cpu() == y[1500:]).float().mean().item()
    state = {k: v.detach().cpu() for k, v in model._module.state_dict().items()}
    if distributed:  # every process holds the same model: check it bitwise
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, [v.numpy().tobytes() for v in state.values()])
        assert all(d == digests[0] for d in digests), "the processes' models differ"
    if rank == 0:
        print(json.dumps({"variant": args.variant, "processes": dist.get_world_size() if distributed else 1,
                          "steps": engine.accountant.steps, "epsilon": engine.get_epsilon(1e-5), "delta": 1e-5,
                          "accuracy": accuracy}))  # fmt: skip
        if args.out:
            torch.save(state, args.out)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
