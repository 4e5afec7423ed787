"""Reproduce the papers' tables with fastdp (issue 7): lip-dp's AUROC at epsilon = 1 (papers/00), weight clipping's
accuracies (papers/01) and backpropagation clipping's MNIST curve (papers/02), beside the published numbers.

    python -m bench.reproduce            # default: small sweeps, 3 seeds, <= 30 min on 2 CPU cores (make reproduce)
    python -m bench.reproduce --full     # larger, paper-protocol sweeps, 5 seeds (hours)

Writes bench/results/reproduction.md, reproduction_runs.csv, reproduction_plot.csv (and reproduction.png where
matplotlib is installed). See :mod:`bench.reproduce.specs` for the protocol and the grids.
"""
