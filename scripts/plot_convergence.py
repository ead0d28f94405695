"""Plot the loss curves that ``bench_train.py --convergence-steps`` wrote, one line per mode.

    python scripts/plot_convergence.py benchmarks/convergence_flan_h200.csv benchmarks/convergence_flan_h200.png
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict

LABELS = {
    "padded": "1: padded to longest + attention_mask (FA2)",
    "ours": "3: varpack shards, PackedIterableDataset (FA2 varlen, compiled)",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv")
    parser.add_argument("png")
    parser.add_argument("--title", default="Llama 0.51B, random init, bf16, H200: same data per step, ~8.2k real tokens/step")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
    with open(args.csv, newline="") as f:
        for row in csv.DictReader(f):
            steps, losses = curves[row["mode"]]
            steps.append(int(row["step"]))
            losses.append(float(row["loss"]))

    fig, (ax, diff_ax) = plt.subplots(2, 1, figsize=(8, 6), dpi=120, sharex=True, height_ratios=(3, 1))
    for mode, (steps, losses) in curves.items():
        ax.plot(steps, losses, label=LABELS.get(mode, mode), linewidth=1.2, alpha=0.85)
    ax.set_ylabel("loss per trained token")
    ax.set_title(args.title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if {"ours", "padded"} <= curves.keys():
        steps, ours = curves["ours"]
        diff = [a - b for a, b in zip(ours, curves["padded"][1])]
        diff_ax.plot(steps[: len(diff)], diff, color="black", linewidth=0.8)
        diff_ax.set_ylabel("3 minus 1")
        diff_ax.grid(alpha=0.3)
    diff_ax.set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(args.png)
    print(args.png)


if __name__ == "__main__":
    main()
