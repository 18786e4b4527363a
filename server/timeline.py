"""timeline.png: one row per client and, for every round, the time it spent downloading, on its per-round overhead
(``overhead_s``: the work outside the local steps, such as FedVeca's gradient pass), computing its steps, uploading
and idle, with each round's deadline drawn; where a fleet's time goes, and which device classes hold the rounds up.

Over a broker the bars are on the server's wall clock: a client's bar starts when its assignment was published and
ends when its update arrived (download and upload split at the client's own timestamp before training, see
``server.deadlines``). In-process they are on the parallel clock (``server.fleet_summary``): each reporting client
starts once the server has assigned, and its phases are its device's times. A selected client that did not report is
drawn as missed up to the end of the round; a client that trained without uploading (FedUmf) has a hatched compute bar
from the round's start (it never says when it started). A buffered run (``server.buffered``) has no rounds: each
device's bars are its own sequence of download, compute and upload, from when each assignment went out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

COLOURS = {"download": "tab:blue", "overhead": "tab:brown", "compute": "tab:orange", "upload": "tab:green",
           "idle": "0.88", "missed": "tab:red"}  # fmt: skip
#: A deadline at least this long is no deadline (in-process runs wait for every client).
NO_DEADLINE_S = 1e8
#: At most this many rows: thousands (a sampled differential-privacy population) would make a plot nobody can read,
#: hundreds of inches tall and minutes to draw. The devices that took part in the most rounds are drawn.
MAX_ROWS = 60


def _round_start(row: dict[str, Any], parallel: bool) -> tuple[float, float]:
    """When the round began and how long it lasted, on the clock the timeline uses."""
    if parallel:
        return row["parallel_elapsed_s"] - row["parallel_round_s"], row["parallel_round_s"]
    return row["elapsed_s"] - row["round_s"], row["round_s"]


def _device_sequence(row: dict[str, Any]) -> dict[str, list[tuple[str, float, float]]]:
    """A buffered aggregation step (``server.buffered``): each update's own download, compute and upload from when its
    assignment went out (``started_s``, on the run's clock), with no round boundary to fill up to."""
    out: dict[str, list[tuple[str, float, float]]] = {}
    for u in row["updates"]:
        t, overhead = u["started_s"], u.get("overhead_s", 0.0)
        phases = (("download", u["download_s"]), ("overhead", overhead), ("compute", u["compute_s"] - overhead),
                  ("upload", u["upload_s"]))  # fmt: skip
        for phase, seconds in phases:
            if phase != "overhead" or seconds > 0:
                out.setdefault(u["client"], []).append((phase, t, seconds))
            t += seconds
    return out


def _segments(row: dict[str, Any], parallel: bool) -> dict[str, list[tuple[str, float, float]]]:
    """Per client: (phase, start, length) on the timeline's clock for one round."""
    if "updates" in row:
        return _device_sequence(row)
    start, length = _round_start(row, parallel)
    out: dict[str, list[tuple[str, float, float]]] = {}
    for cid, c in row["clients"].items():
        t = start + (row["assign_cpu_s"] if parallel else c.get("sent_s", 0.0))
        overhead = c.get("overhead_s", 0.0)
        segs = []
        phases = (("download", c.get("download_s", 0.0)), ("overhead", overhead),
                  ("compute", c.get("compute_s", 0.0) - overhead), ("upload", c.get("upload_s", 0.0)))  # fmt: skip
        for phase, seconds in phases:
            if phase != "overhead" or seconds > 0:
                segs.append((phase, t, seconds))
            t += seconds
        end = start + length
        if end > t:
            segs.append(("idle", t, end - t))
        out[cid] = segs
    assigned = row["assign_cpu_s"] if parallel else row["assign_s"]
    for cid in row["missing"]:
        out[cid] = [("missed", start + assigned, max(0.0, length - assigned))]
    return out


def drawn_devices(rows: list[dict[str, Any]], known: Mapping[str, str] | None) -> tuple[list[str], dict[str, str]]:
    """The rows of the timeline in order (by device class, then id; at most ``MAX_ROWS``, those in the most rounds)
    and every device's class."""
    classes: dict[str, str] = dict(known or {})
    rounds: Counter[str] = Counter()
    for row in rows:
        for cid, c in row["clients"].items():
            classes.setdefault(cid, c.get("device_class", ""))
        others = [*row["missing"], *(r["client"] for r in row.get("train_only", []))]
        for cid in others:
            classes.setdefault(cid, "")
        rounds.update({*row["clients"], *others})
    drawn = sorted(classes, key=lambda c: (-rounds[c], classes[c], c))[:MAX_ROWS]
    return sorted(drawn, key=lambda c: (classes[c], c)), classes


def plot_timeline(rows: list[dict[str, Any]], path: Path, title: str, known: Mapping[str, str] | None = None) -> None:
    """Write the timeline of ``rows`` (metrics.jsonl) to ``path``; ``known``: each client's device class."""
    parallel = "parallel_elapsed_s" in rows[0]
    order, classes = drawn_devices(rows, known)
    if len(order) < len(classes):
        title = f"{title}\n{len(order)} of {len(classes)} devices drawn: those in the most rounds"
    y = {cid: i for i, cid in enumerate(order)}
    starts = {row["round"]: _round_start(row, parallel) for row in rows}
    begin, end = min(s for s, _ in starts.values()), max(start + length for start, length in starts.values())
    height = 1.9 + 0.3 * len(order)
    fig, ax = plt.subplots(figsize=(12, height))
    used: set[str] = set()
    deadlines = [starts[r["round"]][0] + r["deadline_s"] for r in rows
                 if r["deadline_s"] < NO_DEADLINE_S and "updates" not in r]  # fmt: skip
    begin = min([begin, *(u["started_s"] for r in rows for u in r.get("updates", ()))])
    for row in rows:
        for cid, segs in _segments(row, parallel).items():
            if cid not in y:
                continue
            for phase, t, seconds in segs:
                ax.broken_barh([(t, seconds)], (y[cid] - 0.4, 0.8), facecolors=COLOURS[phase], linewidth=0)
                used.add(phase)
        for r in row.get("train_only", []):
            if r["client"] not in y:
                continue
            begun = starts.get(r["round"], _round_start(row, parallel))[0]
            ax.broken_barh([(begun, r["compute_s"])], (y[r["client"]] - 0.4, 0.8), facecolors="none",
                           edgecolors=COLOURS["compute"], hatch="///", linewidth=0.5)  # fmt: skip
            used.add("train_only")
    shown = [d for d in deadlines if d <= end]
    ax.vlines(shown, -0.5, len(order) - 0.5, colors="darkred", linestyles="dashed", linewidth=0.8)
    ax.set_xlim(begin, end + 0.01 * (end - begin))
    ax.set_yticks(range(len(order)), [f"{c} ({classes[c]})" if classes[c] else c for c in order], fontsize=8)
    ax.set_ylim(len(order) - 0.5, -0.5)
    clock = "parallel clock (s): each round as long as its slowest device" if parallel else "wall clock (s)"
    if "updates" in rows[0]:  # buffered: no rounds, each device's own sequence
        clock = f"{'event' if parallel else 'wall'} clock (s): each device's own sequence"
    ax.set_xlabel(clock)
    handles: list[Any] = [Patch(color=COLOURS[k], label=k) for k in COLOURS if k in used]
    if "train_only" in used:
        handles.append(
            Patch(facecolor="none", edgecolor=COLOURS["compute"], hatch="///", label="trained, not uploaded")
        )
    if deadlines:
        label = deadline_label(len(deadlines), len(shown))
        handles.append(Line2D([], [], color="darkred", linestyle="dashed", label=label))
    elif "updates" not in rows[0]:
        handles.append(Line2D([], [], color="none", label="no deadline (in-process: every client is waited for)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout(rect=(0, 0.35 / height, 1, 1))  # room for the legend below the axis label
    fig.savefig(path, dpi=110)
    plt.close(fig)


def deadline_label(total: int, drawn: int) -> str:
    """The legend of the dashed deadline lines, saying plainly why some are missing: a round that ended early has its
    deadline after the run's end, outside the plot."""
    if drawn == total:
        return "round deadline"
    return (
        f"round deadline ({drawn} of {total} drawn; the other rounds ended early, their deadlines fall after the run)"
    )
