"""The tables and plots of a bench, in the layouts of the papers.

- ``accuracy``: TACO Table V: final accuracy mean +- std over seeds after R rounds, and rounds to the target (the
  mean over seeds; ``x`` when no seed reached it, ``k/n`` appended when only k of n seeds did).
- ``time_to_accuracy``: TACO's time-to-accuracy: wall clock and client compute (the slowest client's compute per
  round, summed; network excluded) until the target.
- ``compute``: TACO Table I: client seconds per 100 local updates, with the percentage over FedAvg, and the local
  updates a run made in all (honest clients; what FedVeca's tau accounting compares).
- ``freeloaders``: TACO Table VIII: TPR (expelled freeloaders / freeloaders) and FPR (expelled honest clients /
  honest clients), only when a run had freeloaders.
Each table is written as Markdown and CSV; ``report.md`` holds them all with the suite's description and the plots.
"""

from __future__ import annotations

import csv
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from server.suites import Suite

Table = tuple[list[str], list[list[str]]]


def _mean_std(values: list[float], scale: float = 100.0) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values) * scale
    std = statistics.pstdev(values) * scale if len(values) > 1 else 0.0
    return f"{mean:.2f}±{std:.2f}"


def _percent(values: list[float]) -> str:
    return f"{statistics.fmean(values) * 100:.1f}%" if values else "-"


def _reached(values: list[float | None], fmt: str) -> str:
    hit = [v for v in values if v is not None]
    if not hit:
        return "x"
    text = fmt.format(statistics.fmean(hit))
    return text if len(hit) == len(values) else f"{text} ({len(hit)}/{len(values)})"


def _grouped(records: list[dict[str, Any]]) -> tuple[list[str], list[str], dict[tuple[str, str], list[dict]]]:
    columns = list(dict.fromkeys(r["column"] for r in records))
    algorithms = list(dict.fromkeys(r["algorithm"] for r in records))
    cells: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        cells[(r["algorithm"], r["column"])].append(r)
    return columns, algorithms, cells


def accuracy_table(records: list[dict[str, Any]], target: float) -> Table:
    columns, algorithms, cells = _grouped(records)
    header = ["Method"]
    for col in columns:
        rounds = max(r["summary"]["rounds"] for r in records if r["column"] == col)
        header += [f"{col} Acc(%) {rounds}R", f"{col} Rounds ({target * 100:g}%)"]
    rows = []
    for algo in algorithms:
        row = [algo]
        for col in columns:
            runs = cells.get((algo, col), [])
            row.append(_mean_std([r["summary"]["final_accuracy"] for r in runs]))
            row.append(_reached([r["summary"]["rounds_to_target"] for r in runs], "{:.0f}") if runs else "-")
        rows.append(row)
    return header, rows


def time_table(records: list[dict[str, Any]], target: float) -> Table:
    columns, algorithms, cells = _grouped(records)
    header = ["Method"]
    for col in columns:
        header += [f"{col} wall clock to {target * 100:g}% (s)", f"{col} client compute to {target * 100:g}% (s)"]
    rows = []
    for algo in algorithms:
        row = [algo]
        for col in columns:
            runs = cells.get((algo, col), [])
            row.append(_reached([r["summary"]["time_to_target_s"] for r in runs], "{:.3g}") if runs else "-")
            row.append(_reached([r["summary"]["client_compute_to_target_s"] for r in runs], "{:.3g}") if runs else "-")
        rows.append(row)
    return header, rows


def _per_100(runs: list[dict[str, Any]]) -> float | None:
    steps = sum(p["local_steps"] for r in runs for p in r["curve"])
    compute = sum(p["compute_s"] for r in runs for p in r["curve"])
    return 100.0 * compute / steps if steps else None


def compute_table(records: list[dict[str, Any]]) -> Table:
    columns, algorithms, cells = _grouped(records)
    header = ["Method"]
    for col in columns:
        header += [f"{col} s / 100 local updates", f"{col} local updates per run"]
    rows = []
    for algo in algorithms:
        row = [algo]
        for col in columns:
            runs = cells.get((algo, col), [])
            mine = _per_100(runs)
            base = _per_100(cells.get(("fedavg", col), []))
            if mine is None:
                row.append("-")
            elif base:
                row.append(f"{mine:.3f}s ({(mine / base - 1) * 100:+.2f}%)")
            else:
                row.append(f"{mine:.3f}s")
            steps = [sum(p["local_steps"] for p in r["curve"]) for r in runs]
            row.append(f"{statistics.fmean(steps):,.0f}" if steps else "-")
        rows.append(row)
    return header, rows


def freeloader_table(records: list[dict[str, Any]]) -> Table | None:
    if not any(r["summary"].get("freeloaders") for r in records):
        return None
    columns, algorithms, cells = _grouped(records)
    header = ["Method"]
    for col in columns:
        header += [f"{col} TPR", f"{col} FPR"]
    rows = []
    for algo in algorithms:
        row = [algo]
        for col in columns:
            tpr, fpr = [], []
            for r in cells.get((algo, col), []):
                s = r["summary"]
                free, excluded = set(s.get("freeloaders") or []), set(s.get("excluded") or [])
                honest = s["clients"] - len(free)
                if free:
                    tpr.append(len(excluded & free) / len(free))
                if honest:
                    fpr.append(len(excluded - free) / honest)
            row += [_percent(tpr), _percent(fpr)]
        rows.append(row)
    return header, rows


def markdown(table: Table) -> str:
    header, rows = table
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _mean_curve(runs: list[dict[str, Any]], x: str) -> tuple[list[float], list[float]]:
    """Accuracy per round averaged over seeds, against rounds or against cumulative slowest-client compute."""
    length = min(len(r["curve"]) for r in runs)
    acc = [statistics.fmean(r["curve"][i]["accuracy"] for r in runs) for i in range(length)]
    if x == "round":
        return list(range(1, length + 1)), acc
    totals = []
    for r in runs:
        total, cum = 0.0, []
        for p in r["curve"][:length]:
            total += p["slowest_compute_s"]
            cum.append(total)
        totals.append(cum)
    return [statistics.fmean(t[i] for t in totals) for i in range(length)], acc


def plot_columns(records: list[dict[str, Any]], target: float, out_dir: Path) -> list[Path]:
    """One PNG per column: accuracy against rounds and against client compute time, one curve per algorithm."""
    columns, algorithms, cells = _grouped(records)
    paths = []
    for col in columns:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for algo in algorithms:
            runs = cells.get((algo, col))
            if not runs:
                continue
            for ax, x in ((axes[0], "round"), (axes[1], "compute")):
                xs, ys = _mean_curve(runs, x)
                ax.plot(xs, ys, label=algo, linewidth=1.5)
        for ax, label in ((axes[0], "round"), (axes[1], "client compute time (s, slowest client per round, summed)")):
            ax.axhline(target, color="grey", linestyle="--", linewidth=1)
            ax.set_xlabel(label)
            ax.set_ylabel("test accuracy")
            ax.grid(alpha=0.3)
        axes[0].legend(loc="lower right", fontsize=8)
        fig.suptitle(col)
        fig.tight_layout()
        safe = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in col)
        path = out_dir / f"accuracy-{safe}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def write_report(suite: Suite, records: list[dict[str, Any]], out_dir: Path, *, mode: str, duration_s: float) -> str:
    """Write every table (.md and .csv), the plots and report.md; returns report.md's text."""
    target = suite.runs()[0].config.run.target_accuracy
    tables: dict[str, Table | None] = {
        "accuracy": accuracy_table(records, target),
        "time_to_accuracy": time_table(records, target),
        "compute": compute_table(records),
        "freeloaders": freeloader_table(records),
    }
    titles = {
        "accuracy": "Round-to-accuracy (TACO Table V layout)",
        "time_to_accuracy": "Time-to-accuracy (mean over the seeds that reached the target)",
        "compute": "Client computation time per 100 local updates (TACO Table I layout)",
        "freeloaders": "Freeloader detection (TACO Table VIII: TPR / FPR)",
    }
    parts = [f"# bench {suite.name}", ""]
    if suite.description:
        parts += [suite.description, ""]
    parts += [
        f"Mode: {mode}. Seeds: {', '.join(map(str, suite.seeds))}. Runs: {len(records)}. "
        f"This invocation took {duration_s / 60:.1f} min.",
        "",
    ]
    if suite.scaled:
        parts += [f"Scaled from the paper: {suite.scaled}", ""]
    for name, table in tables.items():
        if table is None:
            continue
        (out_dir / f"{name}.md").write_text(markdown(table) + "\n")
        with (out_dir / f"{name}.csv").open("w", newline="") as fh:
            csv.writer(fh).writerows([table[0], *table[1]])
        parts += [f"## {titles[name]}", "", markdown(table), ""]
    for path in plot_columns(records, target, out_dir):
        parts += [f"![{path.stem}]({path.name})", ""]
    if suite.paper:
        parts += ["## The paper", "", suite.paper, ""]
    text = "\n".join(parts)
    (out_dir / "report.md").write_text(text)
    (out_dir / "records.json").write_text(json.dumps(records) + "\n")
    return text
