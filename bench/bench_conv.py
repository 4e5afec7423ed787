"""The per-example norm paths of each convolution of ResNet-18-GN (CIFAR-shaped), timed side by side: which path
``fastdp.nn.layers`` picks, what each path costs (norm and clipped sum), and the per-example work against the
non-private weight gradient it replaces.

Per convolution, from the A and G of one DP-SGD backward (B 32, 32 x 32 inputs by default), interleaved rounds of:

* ``im2col``: per-example weight gradients by a batched GEMM over im2col patches; norm of them, clipped sum a GEMV;
* ``convbwd``: per-example weight gradients by convolution backwards with the batch folded into the groups, a few
  examples per call (``_per_example_weight_conv``); norm and sum as im2col;
* ``gram-patches``: the certified float64 ghost norm from the patches' Gram (``certified_ghost_norm_sq``), clipped
  sum one weight-gradient convolution of the whole batch;
* ``gram-pixels``: the certified ghost norm from the input pixels' Gram (``certified_conv_ghost_norm_sq``), same sum;
* ``nonprivate``: the weight gradient of the whole batch alone (what the non-private backward pays for the layer).

Also prints the multiply-adds of each (per-example gradients T p d; Grams T^2 (d + p) or (H W)^2 C + T^2 p) and
one torch.profiler table of the DP step's clipping (norms and sums of every layer) by operator.

    python bench/bench_conv.py --threads 2 --repeats 9
    python bench/bench_conv.py --threads 1 --batch 32 --size 32 --profile
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
from resnet import ResNet18GN

from fastdp.algorithms import Batch
from fastdp.algorithms.base import per_example_cross_entropy
from fastdp.algorithms.dpsgd import _clip_and_sum, ghost_backward
from fastdp.nn import convert
from fastdp.nn import layers as L
from fastdp.ops import certified_conv_ghost_norm_sq, certified_ghost_norm_sq


def paths(layer, x: torch.Tensor, g: torch.Tensor) -> dict:
    """name -> closure computing that path's squared norms and clipped sum for the layer call (x, g)."""
    factors = torch.rand(x.shape[0])

    def direct(form):
        def run():
            blocks = form(x, g)
            return torch.cat([L._rowsq(b) for b in blocks]), L._weighted_blocks(factors, blocks)

        return run

    def gram(bound_of):
        def run():
            bound, mass = bound_of()
            sq = L._clip_sq(bound.reshape(x.shape[0], -1).sum(1), mass.reshape(x.shape[0], -1).sum(1),
                            math.prod(g.shape[2:]), torch.float32)  # fmt: skip
            return sq, layer.clipped_grad_sums((x,), g, factors, None)

        return run

    def im2col(x, g):
        saved = L.CONV_BACKWARD_MIN_POSITIONS
        L.CONV_BACKWARD_MIN_POSITIONS = 1 << 62
        try:
            return layer._per_example_weight_chunks(x, g)
        finally:
            L.CONV_BACKWARD_MIN_POSITIONS = saved

    out = {
        "im2col": direct(im2col),
        "convbwd": direct(layer._per_example_weight_conv),
        "gram-patches": gram(lambda: certified_ghost_norm_sq(*layer._grouped(x, g))),
    }
    if layer._spatial == 2:
        pixels = lambda: certified_conv_ghost_norm_sq(x, g, layer.kernel_size, layer.stride, layer._padding(),  # noqa: E731
                                                      layer.dilation)  # fmt: skip
        out["gram-pixels"] = gram(pixels)
    out["nonprivate"] = lambda: layer._weight_grad(x, g, layer.weight.shape, layer.groups)
    return out


def picked(layer, x: torch.Tensor, g: torch.Tensor) -> str:
    """The path ``per_example_sq_norms`` takes for (x, g)."""
    positions = math.prod(g.shape[2:])
    fan_in = layer.weight.shape[1] * math.prod(layer.kernel_size)
    if L._use_ghost(positions, layer.out_channels // layer.groups, fan_in) or not L._fits(
        x.shape[0], layer.out_channels, fan_in, itemsize=x.element_size()
    ):
        k = math.prod(layer.kernel_size)
        pays = L._pixel_gram_pays(x.shape[2:], g.shape[2:], layer._padding(), k, x.shape[1] // layer.groups)
        return "gram-pixels" if layer._spatial == 2 and pays else "gram-patches"
    return "convbwd" if L._conv_backward_pays(x, positions, math.prod(layer.kernel_size)) else "im2col"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=32, help="input height and width")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds (medians)")
    parser.add_argument("--profile", action="store_true", help="also a torch.profiler table of the clipping")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = convert(ResNet18GN())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=gen)
    batch = Batch(x, torch.randint(0, 10, (args.batch,), generator=gen), torch.ones(args.batch, dtype=torch.bool))
    run = ghost_backward(model, per_example_cross_entropy, batch)
    print(f"threads {args.threads}, B {args.batch}, {args.size} x {args.size}, torch {torch.__version__}; median ms of "
          f"{args.repeats} interleaved rounds; * = the path fastdp picks")  # fmt: skip
    names = ["im2col", "convbwd", "gram-patches", "gram-pixels", "nonprivate"]
    print(f"{'layer':34s} " + " ".join(f"{n:>12s}" for n in names) + "   MMAC per-example / Gram")
    totals = dict.fromkeys([*names, "picked", "best"], 0.0)
    for layer, (a,), g in zip(run.layers, run.saved, run.grads_out, strict=True):
        if not isinstance(layer, L._ConvNd):
            continue
        fns = paths(layer, a, g)
        for fn in fns.values():
            fn()
        times: dict = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1e3)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        choice = picked(layer, a, g)
        positions, k = math.prod(g.shape[2:]), math.prod(layer.kernel_size)
        d, p = layer.weight.shape[1] * k, layer.out_channels
        macs = a.shape[0] * positions * p * d / 1e6, a.shape[0] * positions * positions * (d + p) / 1e6
        name = f"{a.shape[1]}x{a.shape[2]}x{a.shape[3]}->{p} k{layer.kernel_size[0]} s{layer.stride[0]} T{positions}"
        cells = [f"{med[n]:11.2f}{'*' if n == choice else ' '}" if n in med else f"{'-':>12s}" for n in names]
        print(f"{name:34s} " + " ".join(cells) + f"   {macs[0]:.0f} / {macs[1]:.0f}")
        for n in med:
            totals[n] += med[n]
        totals["picked"] += med[choice]
        totals["best"] += min(v for n, v in med.items() if n != "nonprivate")
    print("totals: " + ", ".join(f"{n} {v:.1f}" for n, v in totals.items()))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        def clip():
            _clip_and_sum(run.layers, run.saved, run.grads_out, run.losses, batch.mask, 1.0, 1.0, 1.0, False)

        clip()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            clip()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return 0


if __name__ == "__main__":
    sys.exit(main())
