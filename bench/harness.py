"""The one benchmark harness: timing (do_bench on GPU, a wall-clock loop on CPU), device naming, CSV output."""

from __future__ import annotations

import csv
import datetime
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def timer(device: torch.device, repeats: int, warmup: int = 1):
    """A function (fn -> (median, p20, p80) in ms): triton's do_bench on GPU, else ``warmup`` untimed
    calls then ``repeats`` timed ones."""

    def measure(fn) -> tuple[float, float, float]:
        if device.type == "cuda":
            import triton.testing

            med, p20, p80 = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8], warmup=25, rep=200)
            return med, p20, p80
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
        return statistics.median(times), q[1], q[7]

    return measure


def run_info(device: torch.device) -> dict:
    """Columns every result row carries: device, threads, versions, date. Also printed as the run's header."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    info = dict(device=device_name(device), threads=torch.get_num_threads(), torch=torch.__version__,
                triton=triton_version, date=datetime.date.today().isoformat())  # fmt: skip
    print(", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    return info


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{platform.machine()}"


def write_rows(rows: list[dict], out: Path | None, default_name: str) -> None:
    """Append ``rows`` (long format) to ``out`` or ``bench/results/<default_name>.csv``."""
    if not rows:
        print("no rows to write")
        return
    out = out or RESULTS / f"{default_name.replace(' ', '_')}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    new = not out.exists()
    with out.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {out}")
