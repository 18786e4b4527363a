"""What a run leaves behind: metrics.jsonl (one line per round), summary.json and report.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


class MetricsLog:
    """Appends one JSON object per round and flushes it, so a crashed run keeps every finished round."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")


def summarize(rows: list[dict[str, Any]], target_accuracy: float, **extra: Any) -> dict[str, Any]:
    """Round- and time-to-accuracy figures.

    ``client_compute_to_target_s`` sums, over the rounds up to the first that reached the target, the compute time of
    that round's slowest client: TACO's time-to-accuracy metric (network time excluded).
    """
    reached = next((r for r in rows if r["accuracy"] >= target_accuracy), None)
    compute_to = None
    if reached is not None:
        compute_to = sum(r["slowest_compute_s"] for r in rows if r["round"] <= reached["round"])
    last = rows[-1] if rows else {}
    return {
        "final_accuracy": last.get("accuracy"),
        "final_loss": last.get("loss"),
        "best_accuracy": max((r["accuracy"] for r in rows), default=None),
        "rounds": len(rows),
        "wall_clock_s": last.get("elapsed_s"),
        "target_accuracy": target_accuracy,
        "rounds_to_target": reached["round"] if reached else None,
        "time_to_target_s": reached["elapsed_s"] if reached else None,
        "client_compute_to_target_s": compute_to,
        "client_compute_total_s": sum(r["slowest_compute_s"] for r in rows),
        **extra,
    }


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    path.write_text(json.dumps(summary, indent=2) + "\n")


def plot_report(rows: list[dict[str, Any]], target_accuracy: float, path: Path, title: str) -> None:
    """Accuracy against rounds and against wall-clock time, with the target drawn in."""
    rounds = [r["round"] for r in rows]
    acc = [r["accuracy"] for r in rows]
    elapsed = [r["elapsed_s"] for r in rows]
    reached = next((i for i, a in enumerate(acc) if a >= target_accuracy), None)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, xs, label in ((axes[0], rounds, "round"), (axes[1], elapsed, "wall-clock time (s)")):
        ax.plot(xs, acc, marker="o", markersize=3)
        ax.axhline(target_accuracy, color="grey", linestyle="--", linewidth=1, label=f"target {target_accuracy:.2f}")
        if reached is not None:
            ax.axvline(
                xs[reached],
                color="tab:green",
                linestyle=":",
                linewidth=1,
                label=f"reached at {xs[reached]:.0f}" if ax is axes[0] else f"reached at {xs[reached]:.1f} s",
            )
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    axes[0].xaxis.get_major_locator().set_params(integer=True)
    axes[0].set_ylabel("test accuracy")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
