"""The tables and plots of a bench, in the layouts of the papers.

- ``accuracy``: TACO Table V: final accuracy mean +- std over seeds after R rounds, and rounds to the target (the
  mean over seeds; ``x`` when no seed reached it, ``k/n`` appended when only k of n seeds did).
- ``time_to_accuracy``: TACO's time-to-accuracy: wall clock and client compute (the slowest client's compute per
  round, summed; network excluded) until the target, and the parallel clock when the runs kept one (in-process: each
  round as long as its slowest device, ``server.fleet_summary``).
- ``compute``: TACO Table I: client seconds per 100 local updates, with the percentage over FedAvg, and the local
  updates a run made in all (honest clients; what FedVeca's tau accounting compares).
- ``freeloaders``: TACO Table VIII: TPR (expelled freeloaders / freeloaders) and FPR (expelled honest clients /
  honest clients), only when a run had freeloaders.
- ``alpha``: TACO Table II: the mean alpha_i (eq. 7) per group of clients (TACO's label groups A/B/C on
  ``taco-groups``, else honest; freeloaders apart), for the algorithms that compute it; ``alpha_per_round.csv`` has
  the group means round by round and every such run gets ``alpha.png`` (alpha per client over rounds) in its folder.
- ``fleet``: per device class, rounds missed and seconds per 100 local steps, only when the runs had a fleet.
Each table is written as Markdown and CSV; ``report.md`` holds them all with the suite's description and the plots.
Rows are the algorithms and columns the variant and partition, except in a suite of one algorithm in several
variants (an ablation): there the variants are the rows and the partitions the columns.
"""

from __future__ import annotations

import csv
import json
import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from server.experiments.partitions import taco_group
from server.experiments.simulate import client_ids
from server.experiments.suites import Suite
from server.strategies.taco import Taco

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


Runs = list[dict[str, Any]]
#: One sub-column of a table: its header after the column's name, and its cell from the runs of one algorithm in
#: that column (``column`` maps every algorithm to its runs there, for baselines such as FedAvg).
Field = tuple[str, Callable[[Runs, dict[str, Runs]], str]]


def _by_variant(records: Runs) -> bool:
    """An ablation: one algorithm in several variants, so the variants are the rows."""
    return len({r["algorithm"] for r in records}) == 1 and len({r.get("variant") for r in records}) > 1


def _row_header(records: Runs) -> str:
    return "Variant" if _by_variant(records) else "Method"


def _grid(records: Runs) -> tuple[list[str], list[str], dict[str, dict[str, Runs]]]:
    """Columns and rows in the order they ran, and the runs of each row in each column."""
    row, col = ("variant", "partition") if _by_variant(records) else ("algorithm", "column")
    columns = list(dict.fromkeys(r[col] for r in records))
    algorithms = list(dict.fromkeys(r[row] for r in records))
    grid: dict[str, dict[str, Runs]] = {c: defaultdict(list) for c in columns}
    for r in records:
        grid[r[col]][r[row]].append(r)
    return columns, algorithms, grid


def _table(records: Runs, fields: list[Field]) -> Table:
    """Methods (or variants) as rows; per column (variant and partition) one sub-column per field."""
    columns, algorithms, grid = _grid(records)
    header = [_row_header(records)] + [f"{col} {name}" for col in columns for name, _ in fields]
    rows = [
        [algo] + [cell(grid[col].get(algo, []), grid[col]) if grid[col].get(algo) else "-"
                  for col in columns for _, cell in fields]
        for algo in algorithms
    ]  # fmt: skip
    return header, rows


def _to_target(runs: Runs, target: float, what: str) -> list[float | None]:
    """Per run: the round, wall clock or summed slowest-client compute at which accuracy first reached ``target``.

    Read from the curve rather than the run's summary, so a suite's target can be changed after its runs; a run of a
    variant with a target of its own (``record["target"]``) is measured against that one.
    """
    out: list[float | None] = []
    for r in runs:
        compute = 0.0
        value = None
        for point in r["curve"]:
            compute += point["slowest_compute_s"]
            if point["accuracy"] >= r.get("target", target):
                value = {"round": point["round"], "wall": point["elapsed_s"], "compute": compute,
                         "parallel": point.get("parallel_elapsed_s")}[what]  # fmt: skip
                break
        out.append(value)
    return out


def _goal(records: Runs, target: float) -> str:
    """The target for a header: ``97%``, or ``target`` when columns have targets of their own."""
    targets = {r.get("target", target) for r in records}
    return f"{target * 100:g}%" if len(targets) == 1 else "target"


def accuracy_table(records: Runs, target: float) -> Table:
    rounds = max(r["summary"]["rounds"] for r in records)
    return _table(
        records,
        [
            (f"Acc(%) {rounds}R", lambda runs, _: _mean_std([r["summary"]["final_accuracy"] for r in runs])),
            (
                f"Rounds ({_goal(records, target)})",
                lambda runs, _: _reached(_to_target(runs, target, "round"), "{:.0f}"),
            ),
        ],
    )


def time_table(records: Runs, target: float) -> Table:
    to = f"to {_goal(records, target)} (s)"
    fields: list[Field] = [
        (f"wall clock {to}", lambda runs, _: _reached(_to_target(runs, target, "wall"), "{:.3g}")),
        # the sum of each round's slowest client compute, as the devices measured it (their clocks, transfers excluded)
        (
            f"client compute (device clock) {to}",
            lambda runs, _: _reached(_to_target(runs, target, "compute"), "{:.3g}"),
        ),
    ]
    if any(r["curve"] and r["curve"][0].get("parallel_elapsed_s") is not None for r in records):
        fields.insert(1, (f"parallel clock {to}", lambda runs, _: _reached(_to_target(runs, target, "parallel"),
                                                                              "{:.3g}")))  # fmt: skip
    return _table(records, fields)


def _per_100(runs: Runs) -> float | None:
    steps = sum(p["local_steps"] for r in runs for p in r["curve"])
    compute = sum(p["compute_s"] for r in runs for p in r["curve"])
    return 100.0 * compute / steps if steps else None


def _seconds_per_100(runs: Runs, column: dict[str, Runs]) -> str:
    mine, base = _per_100(runs), _per_100(column.get("fedavg", []))
    if mine is None:
        return "-"
    return f"{mine:.3f}s ({(mine / base - 1) * 100:+.2f}%)" if base else f"{mine:.3f}s"


def compute_table(records: Runs) -> Table:
    def updates(runs: Runs, _: dict[str, Runs]) -> str:
        return f"{statistics.fmean(sum(p['local_steps'] for p in r['curve']) for r in runs):,.0f}"

    return _table(records, [("s / 100 local updates", _seconds_per_100), ("local updates per run", updates)])


def _detection(runs: Runs, honest: bool) -> str:
    """Share of freeloaders (TPR) or of honest clients (FPR) that were expelled, averaged over runs."""
    shares = []
    for r in runs:
        s = r["summary"]
        free, excluded = set(s.get("freeloaders") or []), set(s.get("excluded") or [])
        group = s["clients"] - len(free) if honest else len(free)
        if group:
            shares.append(len(excluded - free if honest else excluded & free) / group)
    return _percent(shares)


def freeloader_table(records: Runs) -> Table | None:
    if not any(r["summary"].get("freeloaders") for r in records):
        return None
    return _table(
        records, [("TPR", lambda runs, _: _detection(runs, False)), ("FPR", lambda runs, _: _detection(runs, True))]
    )


GROUPS = ("Group A", "Group B", "Group C", "Honest", "Freeloaders")
#: Table II averages from round 2: in round 1 there is no previous global update and freeloaders upload zeros
ALPHA_FROM_ROUND = 2


def _group(record: dict[str, Any], client: str) -> str:
    if client in (record["summary"].get("freeloaders") or []):
        return "Freeloaders"
    if record["partition"] == "taco-groups":
        return f"Group {'ABC'[taco_group(client_ids(record['summary']['clients']).index(client))]}"
    return "Honest"


def _group_means(record: dict[str, Any]) -> list[tuple[int, dict[str, float]]]:
    """Per round with alphas: the mean alpha of each group's clients that reported in it."""
    out = []
    for point in record["curve"]:
        by_group: dict[str, list[float]] = defaultdict(list)
        for client, alpha in (point.get("alpha") or {}).items():
            by_group[_group(record, client)].append(alpha)
        if by_group:
            out.append((point["round"], {g: statistics.fmean(v) for g, v in by_group.items()}))
    return out


def alpha_table(records: Runs) -> Table | None:
    """Table II: per column and group, the mean over rounds (from ``ALPHA_FROM_ROUND``, seeds pooled) of the group's
    mean alpha, ± its standard deviation over those rounds."""
    with_alpha = [r for r in records if any("alpha" in p for p in r["curve"])]
    if not with_alpha:
        return None
    columns, rows, grid = _grid(with_alpha)

    def series(runs: Runs, group: str) -> list[float]:
        return [m[group] for r in runs for k, m in _group_means(r) if k >= ALPHA_FROM_ROUND and group in m]

    groups = {c: [g for g in GROUPS if any(series(runs, g) for runs in grid[c].values())] for c in columns}
    header = [_row_header(with_alpha)] + [f"{c} alpha {g}" for c in columns for g in groups[c]]
    body = []
    for row in rows:
        cells = [series(grid[c].get(row, []), g) for c in columns for g in groups[c]]
        body.append([row] + [f"{statistics.fmean(x):.2f}±{statistics.pstdev(x):.2f}" if x else "-" for x in cells])
    return header, body


def alpha_rounds_csv(records: Runs, path: Path) -> None:
    """The group means round by round (seeds pooled): what Table II averages."""
    columns, rows, grid = _grid([r for r in records if any("alpha" in p for p in r["curve"])])
    with path.open("w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["column", "row", "round", *GROUPS])
        for col in columns:
            for row in rows:
                pooled: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
                for r in grid[col].get(row, []):
                    for k, means in _group_means(r):
                        for g, v in means.items():
                            pooled[k][g].append(v)
                for k in sorted(pooled):
                    out.writerow([col, row, k, *(f"{statistics.fmean(pooled[k][g]):.4f}" if pooled[k][g] else ""
                                                 for g in GROUPS)])  # fmt: skip


COLOURS = {"Group A": "tab:blue", "Group B": "tab:green", "Group C": "tab:purple", "Honest": "tab:blue",
           "Freeloaders": "tab:red"}  # fmt: skip


def plot_alphas(record: dict[str, Any], path: Path) -> None:
    """alpha_i per client over rounds, coloured by group, freeloaders dashed, an expelled client's last alpha an x."""
    series: dict[str, tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
    for point in record["curve"]:
        for client, alpha in (point.get("alpha") or {}).items():
            series[client][0].append(point["round"])
            series[client][1].append(alpha)
    excluded = set(record["summary"].get("excluded") or [])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    labelled: set[str] = set()
    for client in sorted(series):
        xs, ys = series[client]
        group = _group(record, client)
        ax.plot(xs, ys, color=COLOURS[group], linestyle="--" if group == "Freeloaders" else "-", linewidth=1,
                alpha=0.8, label=None if group in labelled else group)  # fmt: skip
        labelled.add(group)
        if client in excluded:
            ax.plot(xs[-1], ys[-1], marker="x", color="black", markersize=8)
    if record["algorithm"] == "taco":
        kappa = record.get("params", {}).get("kappa", Taco.contract.setting("kappa").default)
        ax.axhline(kappa, color="grey", linestyle=":", linewidth=1, label=f"kappa {kappa:g}")
    ax.set_xlabel("round")
    ax.set_ylabel("alpha_i (eq. 7) from the round's uploads")
    ax.set_ylim(-0.02, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"{record['algorithm']} · {record['column']} · seed {record['seed']}  (x: expelled)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def per_class(runs: Runs, key: str, fmt: str) -> str:
    """``pi3 4 · pi4 0`` : a per_class figure of summary.json per class, the mean over runs."""
    classes = sorted({c for r in runs for c in r["summary"].get("per_class", {})})
    cells = []
    for c in classes:
        values = [v for r in runs if (v := r["summary"].get("per_class", {}).get(c, {}).get(key)) is not None]
        cells.append(f"{c} {fmt.format(statistics.fmean(values))}" if values else f"{c} -")
    return " · ".join(cells) or "-"


def fleet_table(records: Runs) -> Table | None:
    if not any(r["summary"].get("fleet") for r in records):
        return None
    return _table(
        records,
        [
            ("rounds missed per class", lambda runs, _: per_class(runs, "rounds_missed", "{:.3g}")),
            ("s / 100 local steps per class", lambda runs, _: per_class(runs, "s_per_100_steps", "{:.3g}")),
        ],
    )


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
    columns, algorithms, grid = _grid(records)
    paths = []
    for col in columns:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for algo in algorithms:
            runs = grid[col].get(algo)
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
        "alpha": alpha_table(records),
        "fleet": fleet_table(records),
    }
    titles = {
        "accuracy": "Round-to-accuracy (TACO Table V layout)",
        "time_to_accuracy": "Time-to-accuracy (mean over the seeds that reached the target)",
        "compute": "Client computation time per 100 local updates (TACO Table I layout)",
        "freeloaders": "Freeloader detection (TACO Table VIII: TPR / FPR)",
        "alpha": f"Mean alpha_i per group of clients from round {ALPHA_FROM_ROUND} (TACO Table II layout)",
        "fleet": "Device classes: rounds missed and device seconds per 100 local steps (mean over seeds)",
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
    alpha_runs = [r for r in records if "path" in r and any("alpha" in p for p in r["curve"])]
    if alpha_runs:
        alpha_rounds_csv(records, out_dir / "alpha_per_round.csv")
        parts += ["## alpha per client over rounds", "", "Group means per round: alpha_per_round.csv.", ""]
        for r in alpha_runs:
            plot_alphas(r, out_dir / "runs" / r["path"] / "alpha.png")
            parts.append(f"- [{r['column']} · {r['algorithm']} · seed {r['seed']}](runs/{r['path']}/alpha.png)")
        parts.append("")
    if suite.paper:
        parts += ["## The paper", "", suite.paper, ""]
    text = "\n".join(parts)
    (out_dir / "report.md").write_text(text)
    (out_dir / "records.json").write_text(json.dumps(records) + "\n")
    return text
