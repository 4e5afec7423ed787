"""The README's headline figure: DP-SGD step time of real, unmodified models relative to non-private training,
fastdp against Opacus, from the latest table of ``bench/results/cpu-real-architectures.md``.

    python bench/plot_headline.py            # writes bench/results/headline.png

Reads the first table of that file (the latest run; its command and machine are stated there); an Opacus cell that
is not a ratio (the model fails or is refused) is drawn as an empty slot labelled "fails".
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PROVIDERS = {"front door": "fastdp (front door)", "Opacus hooks": "Opacus hooks", "Opacus ghost": "Opacus ghost"}


def latest_table(path: Path) -> tuple[str, list[dict[str, str]]]:
    """(the run's heading, the rows of the first markdown table) of a results file."""
    lines = path.read_text().splitlines()
    heading = next(line.lstrip("# ") for line in lines if line.startswith("## "))
    start = next(i for i, line in enumerate(lines) if line.startswith("| workload"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True)))
    return heading, rows


def time_ratio(cell: str) -> float | None:
    """The step-time ratio of a cell "1.18×, 1.10×" (time, memory); None for a failure."""
    m = re.match(r"([0-9.]+)×", cell)
    return float(m.group(1)) if m else None


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heading, rows = latest_table(RESULTS / "cpu-real-architectures.md")
    workloads = [row["workload"] for row in rows]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.26
    for k, (column, label) in enumerate(PROVIDERS.items()):
        for i, row in enumerate(rows):
            value = time_ratio(row[column])
            x = i + (k - 1) * width
            if value is None:
                ax.text(x, 1.05, "fails", rotation=90, ha="center", va="bottom", fontsize=8, color="gray")
            else:
                ax.bar(x, value, width, color=f"C{k}", label=label)
                ax.text(x, value * 1.05, f"{value:.2f}", rotation=90, ha="center", va="bottom", fontsize=7)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), loc="upper left", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylim(0.8, 80)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("DP-SGD step time / non-private")
    date = re.search(r"\d{4}-\d{2}-\d{2}", heading)
    when = date.group(0) if date else heading
    ax.set_title(f"Unmodified models: DP-SGD step time × non-private (2 CPU cores, {when})", fontsize=9)
    fig.tight_layout()
    out = RESULTS / "headline.png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
