"""The fleet leaderboard: which algorithm reaches the target soonest on a fleet, one table per column of a bench.

Rows are ranked by the mean time to the column's target on the column's clock: the parallel clock in-process (each
round as long as its slowest device, ``server.fleet_summary``; a buffered row, ``@buffered``, on the discrete-event
clock of ``server.buffered.clock``, each device's updates at its own speed, its rounds being aggregation steps of
``train.buffer_size`` updates), this machine's wall clock over a broker (each client a process under its class's cgroup
quota). A row whose seeds did not all reach the target ranks after those that did,
by final accuracy. Every figure is a mean over the row's seeds with its spread (population standard deviation).
Bytes are what each device's own link carried until the target (its ``bytes_down`` and ``bytes_up`` of the rounds up
to the one that reached it, summed, over the fleet's devices): not the server's egress.

The plot beside it has one panel per column: accuracy against that column's clock, one line per row (the mean over
its seeds, cut to the shortest run). For a column whose fleet has devices that throttle, the timeline of each row with
the deadline steps policy (seed 0) is copied beside it: the throttled devices' longer compute, then their fewer steps.
"""

from __future__ import annotations

import shutil
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from server.experiments.tables import markdown, per_class

Runs = list[dict[str, Any]]
BASELINE = "fedavg"
CLOCKS = {"inprocess": ("parallel_elapsed_s", "parallel clock"), "broker": ("elapsed_s", "wall clock, this machine")}
COLUMNS = ("time to target (s)", "x FedAvg", "rounds to target", "final accuracy (%)",
           "MB per device to target (its link, down + up)", "rounds missed per class", "seeds")  # fmt: skip


def _clock(record: dict[str, Any]) -> str:
    return CLOCKS[record.get("mode", "inprocess")][0]


def _target_point(record: dict[str, Any]) -> int | None:
    """Index of the first round at or above the record's target, None when it never got there."""
    return next((i for i, p in enumerate(record["curve"]) if p["accuracy"] >= record["target"]), None)


def time_to_target(record: dict[str, Any]) -> float | None:
    i = _target_point(record)
    return None if i is None else record["curve"][i][_clock(record)]


def rounds_to_target(record: dict[str, Any]) -> int | None:
    i = _target_point(record)
    return None if i is None else record["curve"][i]["round"]


def device_bytes_to_target(record: dict[str, Any]) -> float | None:
    """Bytes each device's link carried until the target, the mean over the fleet's devices."""
    i = _target_point(record)
    if i is None:
        return None
    total = sum(sum((p.get("device_bytes") or {}).values()) for p in record["curve"][: i + 1])
    return total / max(1, record["summary"]["clients"])


def _spread(values: list[float | None], fmt: str, scale: float = 1.0) -> str:
    """``mean ± std`` of the values that are there, ``(k/n)`` when only k of n are; ``x`` when none is."""
    hit = [v * scale for v in values if v is not None]
    if not hit:
        return "x"
    text = fmt.format(statistics.fmean(hit))
    if len(hit) > 1:
        text += " ± " + fmt.format(statistics.pstdev(hit))
    return text if len(hit) == len(values) else f"{text} ({len(hit)}/{len(values)})"


def _mean_if_all(values: list[float | None]) -> float | None:
    return None if not values or None in values else statistics.fmean(v for v in values if v is not None)


def columns(records: Runs) -> dict[str, dict[str, Runs]]:
    """Each column's runs by row, in the order they ran."""
    out: dict[str, dict[str, Runs]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        out[r["column"]][r["algorithm"]].append(r)
    return out


def ranked(rows: dict[str, Runs]) -> list[str]:
    """Rows soonest to the target first; those that did not always reach it after, by final accuracy."""

    def key(row: str) -> tuple[float, float]:
        t = _mean_if_all([time_to_target(r) for r in rows[row]])
        return (t if t is not None else float("inf"), -statistics.fmean(r["summary"]["final_accuracy"]
                                                                       for r in rows[row]))  # fmt: skip

    return sorted(rows, key=key)


def column_table(rows: dict[str, Runs]) -> tuple[list[str], list[list[str]]]:
    base = _mean_if_all([time_to_target(r) for r in rows.get(BASELINE, [])])
    body = []
    for rank, row in enumerate(ranked(rows), 1):
        runs = rows[row]
        times = [time_to_target(r) for r in runs]
        mean = _mean_if_all(times)
        body.append([
            str(rank), row,
            _spread(times, "{:.1f}"),
            f"{mean / base:.2f}x" if mean is not None and base else "-",
            _spread([rounds_to_target(r) for r in runs], "{:.1f}"),
            _spread([r["summary"]["final_accuracy"] for r in runs], "{:.2f}", 100.0),
            _spread([device_bytes_to_target(r) for r in runs], "{:.2f}", 1e-6),
            per_class(runs, "rounds_missed", "{:.3g}"),
            ",".join(str(r["seed"]) for r in runs),
        ])  # fmt: skip
    return ["#", "row", *COLUMNS], body


def _mean_curve(runs: Runs) -> tuple[list[float], list[float]]:
    length = min(len(r["curve"]) for r in runs)
    xs = [statistics.fmean(r["curve"][i][_clock(r)] for r in runs) for i in range(length)]
    ys = [statistics.fmean(r["curve"][i]["accuracy"] for r in runs) for i in range(length)]
    return xs, ys


def plot(records: Runs, path: Path) -> Path:
    """Accuracy against each column's clock, one line per row (mean over its seeds), one panel per column."""
    cols = columns(records)
    fig, axes = plt.subplots(1, len(cols), figsize=(7.5 * len(cols), 5.5), squeeze=False)
    colours = plt.get_cmap("tab20")
    for ax, (col, rows) in zip(axes[0], cols.items(), strict=True):
        first = next(iter(rows.values()))[0]
        lowest = first["target"] - 0.2
        for i, row in enumerate(ranked(rows)):
            xs, ys = _mean_curve(rows[row])
            style = "--" if "@" in row else "-"  # a row in a configuration of its own
            ax.plot(xs, ys, style, color=colours(2 * i % 20 + i // 10 % 2), linewidth=1.4, label=row)
            lowest = min(lowest, ys[-1] - 0.05)
        ax.axhline(first["target"], color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(f"{CLOCKS[first.get('mode', 'inprocess')][1]} (s)")
        ax.set_ylabel("test accuracy")
        ax.set_ylim(max(0.0, lowest), 1.0)  # the early rounds below it would squeeze the part that ranks the rows
        ax.grid(alpha=0.3)
        ax.set_title(f"{col} (target {first['target'] * 100:g}%)", fontsize=10)
        ax.legend(loc="lower right", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _throttles(record: dict[str, Any]) -> bool:
    profiles = (record["summary"].get("fleet") or {}).get("profiles", {})
    return any(p.get("throttle_from_round") for p in profiles.values())


def copy_timelines(records: Runs, runs_dir: Path, path: Path) -> dict[str, list[Path]]:
    """Per column with throttling devices: its deadline-policy rows' timelines (seed 0), copied beside ``path``."""
    out: dict[str, list[Path]] = defaultdict(list)
    for r in records:
        source = runs_dir / "runs" / r["path"] / "timeline.png"
        if _throttles(r) and r.get("steps_policy") == "deadline" and r["seed"] == 0 and source.exists():
            safe = "".join(c if c.isalnum() else "-" for c in f"{r['column']}-{r['algorithm']}").strip("-")
            target = path.with_name(f"{path.stem}-timeline-{safe}.png")
            shutil.copyfile(source, target)
            out[r["column"]].append(target)
    return out


def document(
    records: Runs, *, title: str, facts: list[str], description: str, plot_name: str,
    timelines: dict[str, list[Path]] | None = None,
) -> str:  # fmt: skip
    """The leaderboard's Markdown: the facts of the run (machine, command, date, seeds), then a table per column."""
    parts = [f"# {title}", "", *(f"- {f}" for f in facts), "", description, ""]
    for col, rows in columns(records).items():
        first = next(iter(rows.values()))[0]
        clock = CLOCKS[first.get("mode", "inprocess")][1]
        parts += [f"## {col}: target {first['target'] * 100:g}%, {clock}", "", markdown(column_table(rows)), ""]
        for png in (timelines or {}).get(col, []):
            parts += [f"![timeline of {png.stem}: throttled devices' compute, then the steps they are told]"
                      f"({png.name})", ""]  # fmt: skip
    parts += [f"![accuracy against each column's clock, one line per row]({plot_name})", ""]
    return "\n".join(parts)


def write(
    records: Runs, path: Path, runs_dir: Path, *, title: str, facts: list[str], description: str
) -> tuple[Path, Path]:
    """``path`` (Markdown), its plot beside it (same name, ``.png``) and the throttling columns' timelines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    png = plot(records, path.with_suffix(".png"))
    timelines = copy_timelines(records, runs_dir, path)
    text = document(records, title=title, facts=facts, description=description, plot_name=png.name,
                    timelines=timelines)  # fmt: skip
    path.write_text(text)
    return path, png
