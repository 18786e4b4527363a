"""FedVeca Figs. 3 and 5 from a fedveca-mnist bench: test loss and accuracy against rounds, one column per case.

The paper's claims are about loss and accuracy against rounds at matched SGD steps, so this figure (and the table it
prints) reads each run's ``metrics.jsonl`` (the server's test-set loss and accuracy every round) and its local steps;
no clock. Curves are the mean over seeds, the band their range. The dashed line is the paper's centralized SGD
reference (sec. IV-A1): the same model trained on all of MNIST for FedVeca's mean total steps, batches of B drawn at
random, mean over ``--centralized-seeds`` seeds.

    python scripts/fedveca_paper_figure.py OUT_DIR [OUT_DIR ...] --png docs/reproduction/fedveca-mnist-paper.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import matplotlib
import numpy as np
import torch

from edge_client.learning.models import SquaredSVM
from server.datasets import load_dataset

matplotlib.use("Agg")
import matplotlib.pyplot as plt

CASES = ("fedveca-case_3", "fedveca-case_2", "fedveca-case_1")
ALGORITHMS = ("fedveca", "fednova", "fedavg")


def load(dirs: list[Path]) -> dict[tuple[str, str], list[list[dict]]]:
    """(case, algorithm) -> per seed, its metrics rows."""
    runs: dict[tuple[str, str], list[list[dict]]] = defaultdict(list)
    for d in dirs:
        for metrics in sorted(d.glob("runs/default/*/*/seed-*/metrics.jsonl")):
            if not (metrics.parent / "record.json").exists():  # unfinished
                continue
            case, algorithm = metrics.parts[-4], metrics.parts[-3]
            runs[case, algorithm].append([json.loads(line) for line in metrics.read_text().splitlines() if line])
    return runs


def centralized(steps: int, seeds: int, batch_size: int = 64, lr: float = 0.01) -> dict[str, float]:
    """Test loss and accuracy of centralized SGD after ``steps`` steps, mean over ``seeds`` (pixels in [0, 1])."""
    torch.set_num_threads(1)
    bundle = load_dataset("mnist-parity", seed=0)
    x, y = torch.from_numpy(bundle.train.x.reshape(len(bundle.train.x), -1)), torch.from_numpy(bundle.train.y)
    xt, yt = torch.from_numpy(bundle.test.x.reshape(len(bundle.test.x), -1)), torch.from_numpy(bundle.test.y)
    out: dict[str, list[float]] = {"loss": [], "accuracy": []}
    for seed in range(seeds):
        torch.manual_seed(seed)
        rng = np.random.default_rng(seed)
        model = SquaredSVM(x.shape[1])
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for _ in range(steps):
            idx = torch.from_numpy(rng.integers(0, len(y), batch_size))
            opt.zero_grad()
            SquaredSVM.loss(model(x[idx]), y[idx]).backward()
            opt.step()
        with torch.no_grad():
            scores = model(xt).reshape(-1)
            out["loss"].append(float(SquaredSVM.loss(scores, yt)))
            out["accuracy"].append(float(((scores < 0).long() == yt).float().mean()))  # label 1 where f < 0
    return {k: statistics.fmean(v) for k, v in out.items()}


def _mean_std(values: list[float], fmt: str) -> str:
    std = statistics.pstdev(values) if len(values) > 1 else 0.0
    return f"{fmt.format(statistics.fmean(values))} ± {fmt.format(std)}"


def table(runs: dict[tuple[str, str], list[list[dict]]]) -> str:
    lines = ["| case | method | seeds | final accuracy (%) | final test loss | mean accuracy over rounds (%) | "
             "local SGD steps per run |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for case in CASES:
        for algorithm in ALGORITHMS:
            seeds = runs.get((case, algorithm))
            if not seeds:
                continue
            final = [100 * rows[-1]["accuracy"] for rows in seeds]
            loss = [rows[-1]["loss"] for rows in seeds]
            mean_acc = [100 * statistics.fmean(r["accuracy"] for r in rows) for rows in seeds]
            steps = [sum(c["local_steps"] for r in rows for c in r["clients"].values()) for rows in seeds]
            lines.append(
                f"| {case.replace('_', ':')} | {algorithm} | {len(seeds)} | {_mean_std(final, '{:.2f}')} | "
                f"{_mean_std(loss, '{:.4f}')} | {_mean_std(mean_acc, '{:.2f}')} | {_mean_std(steps, '{:,.0f}')} |"
            )
    return "\n".join(lines)


def figure(runs: dict[tuple[str, str], list[list[dict]]], png: Path, reference: dict[str, float]) -> None:
    cases = [c for c in CASES if any((c, a) in runs for a in ALGORITHMS)]
    fig, axes = plt.subplots(2, len(cases), figsize=(4.6 * len(cases), 7), squeeze=False)
    for j, case in enumerate(cases):
        for algorithm in ALGORITHMS:
            seeds = runs.get((case, algorithm))
            if not seeds:
                continue
            length = min(len(rows) for rows in seeds)
            x = list(range(1, length + 1))
            for i, key in enumerate(("loss", "accuracy")):
                per_round = [[rows[k][key] for rows in seeds] for k in range(length)]
                ax = axes[i][j]
                (line,) = ax.plot(x, [statistics.fmean(v) for v in per_round], linewidth=1.4,
                                  label=f"{algorithm} ({len(seeds)} seeds)")  # fmt: skip
                ax.fill_between(x, [min(v) for v in per_round], [max(v) for v in per_round],
                                color=line.get_color(), alpha=0.15, linewidth=0)  # fmt: skip
        for i, key in enumerate(("loss", "accuracy")):
            axes[i][j].axhline(reference[key], color="grey", linestyle="--", linewidth=1, label="centralized SGD")
        axes[0][j].set_title(case.replace("_", ":"))
        axes[0][j].set_ylim(0.3, 0.8)
        axes[1][j].set_ylim(0.7, 0.9)
        axes[1][j].set_xlabel("round")
        for i, label in enumerate(("test loss (squared hinge)", "test accuracy")):
            axes[i][j].set_ylabel(label)
            axes[i][j].grid(alpha=0.3)
        axes[1][j].legend(loc="lower right", fontsize=8)
    fig.suptitle("SVM, MNIST even/odd, 5 clients: FedAvg and FedNova at FedVeca's total SGD steps")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dirs", nargs="+", type=Path, help="bench output directories (edge-server bench --out)")
    parser.add_argument("--png", type=Path, required=True, help="where to write the figure")
    parser.add_argument("--centralized-seeds", type=int, default=3, help="seeds of the centralized SGD reference")
    args = parser.parse_args()
    runs = load(args.out_dirs)
    steps = [sum(c["local_steps"] for r in rows for c in r["clients"].values())
             for (_, algorithm), seeds in runs.items() if algorithm == "fedveca" for rows in seeds]  # fmt: skip
    reference = centralized(round(statistics.fmean(steps)), args.centralized_seeds)
    figure(runs, args.png, reference)
    print(table(runs))
    print(
        f"\ncentralized SGD, {round(statistics.fmean(steps)):,} steps (FedVeca's mean), {args.centralized_seeds} "
        f"seeds: accuracy {100 * reference['accuracy']:.2f}%, test loss {reference['loss']:.4f}"
    )


if __name__ == "__main__":
    main()
