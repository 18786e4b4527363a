"""What a run leaves behind: metrics.jsonl (one line per round), summary.json and report.png."""

from __future__ import annotations

import json
from collections import Counter
from itertools import accumulate
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

from server.strict_json import strict_json
from server.target import Target

matplotlib.use("Agg")
import matplotlib.pyplot as plt


class MetricsLog:
    """Appends one JSON object per round and flushes it, so a crashed run keeps every finished round."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []

    def resume(self, last_round: int) -> None:
        """Keep the rows of rounds up to the checkpointed ``last_round`` (a row written after it has no checkpoint and
        is re-run) and continue appending after them."""
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        self.rows = [row for row in map(json.loads, filter(None, lines)) if row["round"] <= last_round]
        self.path.write_text("".join(strict_json(row) + "\n" for row in self.rows))

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        with self.path.open("a") as fh:
            fh.write(strict_json(row) + "\n")


def round_bytes(row: dict[str, Any]) -> tuple[int, int]:
    """Bytes of one round through the server's link: up, the updates admitted (as received); down, the server's
    egress (``bytes_out``: the round's model broadcast once, every assignment, every model a device asked for)."""
    up = sum(c.get("bytes_up", 0) for c in row.get("clients", {}).values())
    return up, row.get("bytes_out", 0)


def device_bytes(row: dict[str, Any]) -> int:
    """Bytes of one round through the reporting devices' links, summed over them: each one's update up and its
    ``bytes_down`` (its assignment, the broadcast model or difference, any model it asked for). About the number of
    devices times the server's figure, since each device receives the broadcast the server sends once."""
    return sum(c.get("bytes_up", 0) + c.get("bytes_down", 0) for c in row.get("clients", {}).values())


def summarize(rows: list[dict[str, Any]], target: Target, **extra: Any) -> dict[str, Any]:
    """Round-, time- and bytes-to-target figures on the target's metric (``final_<metric>``, ``best_<metric>``); for
    classification's accuracy also ``target_accuracy``.

    ``client_compute_to_target_s`` sums, over the rounds up to the first that reached the target, the compute time of
    that round's slowest client: TACO's time-to-accuracy metric (network time excluded). ``client_eval_total_s`` sums
    each evaluation's slowest device evaluation (device clocks), apart from training compute. ``bytes_to_target`` sums
    every byte through the server's link (updates in, egress out) in the rounds up to the target;
    ``device_bytes_to_target`` every byte through the reporting devices' links (``device_bytes``);
    ``codec_mix`` counts the assignments per codec.
    """
    m = target.metric
    evaluated = [r for r in rows if target.of(r) is not None]
    reached = next((r for r in evaluated if target.reached(target.of(r))), None)
    compute_to = bytes_to = device_bytes_to = None
    traffic = [round_bytes(r) for r in rows]
    if reached is not None:
        compute_to = sum(r["slowest_compute_s"] for r in rows if r["round"] <= reached["round"])
        bytes_to = sum(up + down for r, (up, down) in zip(rows, traffic, strict=True) if r["round"] <= reached["round"])
        device_bytes_to = sum(device_bytes(r) for r in rows if r["round"] <= reached["round"])
    codec_mix = Counter(i["codec"] for r in rows for i in r.get("instructions", {}).values() if "codec" in i)
    last, last_eval = (rows[-1] if rows else {}), (evaluated[-1] if evaluated else {})
    best = None
    for r in evaluated:
        best = target.of(r) if target.better(target.of(r), best) else best
    accuracy = {"target_accuracy": target.value} if m == "accuracy" else {}
    return {
        f"final_{m}": target.of(last_eval) if last_eval else None,
        # TACO's output z_T (Alg. 2 line 14, eq. 15), evaluated in the same row as w_T (the tables' figure)
        **({f"final_{m}_z": last_eval[f"{m}_z"]} if f"{m}_z" in last_eval else {}),
        "final_loss": target.of(last_eval, "loss") if last_eval else None,
        f"best_{m}": best,
        **({"final_client_eval": _without_devices(last_eval["client_eval"])} if "client_eval" in last_eval else {}),
        "rounds": len(rows),
        "wall_clock_s": last.get("elapsed_s"),
        **target.describe(),
        **accuracy,
        "rounds_to_target": reached["round"] if reached else None,
        "time_to_target_s": reached["elapsed_s"] if reached else None,
        "client_compute_to_target_s": compute_to,
        "client_compute_total_s": sum(r["slowest_compute_s"] for r in rows),
        "bytes_up": sum(up for up, _ in traffic),
        "bytes_down": sum(down for _, down in traffic),
        "bytes_to_target": bytes_to,
        "device_bytes_to_target": device_bytes_to,
        "codec_mix": dict(sorted(codec_mix.items())),
        "client_eval_total_s": sum(r["client_eval"]["slowest_eval_s"] for r in rows if "client_eval" in r),
        **extra,
    }


def _without_devices(client_eval: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in client_eval.items() if k != "devices"}


def _map(value: Any) -> dict[str, Any]:
    """A device-reported entry that should be a map (its telemetry is free-form within its declared bounds)."""
    return value if isinstance(value, dict) else {}


def client_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per client over the run: rounds reported, mean compute and CPU seconds, traffic, what the device reported
    (peak resident memory, hottest temperature, lowest CPU frequency, Raspberry Pi throttling flags), and its
    evaluations of the global model with their mean time (device clock, apart from training compute)."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        for cid, c in row["clients"].items():
            s = out.setdefault(cid, _blank())
            s["rounds"] += 1
            for key in ("compute_s", "cpu_s", "bytes_up", "bytes_down"):
                s[key] += c.get(key, 0)
            dev = _map(_map(c.get("device")).get("round"))
            for key, src, pick in (
                ("peak_rss_mb", ("peak_rss_mb",), max),
                ("max_temperature_c", ("temperature_c_before", "temperature_c_after"), max),
                ("min_cpu_freq_mhz", ("cpu_freq_mhz_before", "cpu_freq_mhz_after"), min),
            ):
                values = [v for v in (dev.get(k) for k in src) if v is not None]
                if s[key] is not None:
                    values.append(s[key])
                s[key] = pick(values) if values else None
            s["throttled_flags"] = sorted({*s["throttled_flags"], *(dev.get("throttled_flags") or [])})
        for cid, e in row.get("client_eval", {}).get("devices", {}).items():
            s = out.setdefault(cid, _blank())
            s["evaluations"] += 1
            s["eval_s"] += e["eval_s"]
    for s in out.values():
        s["mean_compute_s"] = s.pop("compute_s") / max(1, s["rounds"])
        s["mean_cpu_s"] = s.pop("cpu_s") / max(1, s["rounds"])
        eval_s = s.pop("eval_s")
        s["mean_eval_s"] = eval_s / s["evaluations"] if s["evaluations"] else None  # device clock
    return out


def _blank() -> dict[str, Any]:
    return {"rounds": 0, "compute_s": 0.0, "cpu_s": 0.0, "bytes_up": 0, "bytes_down": 0, "peak_rss_mb": None,
            "max_temperature_c": None, "min_cpu_freq_mhz": None, "throttled_flags": [], "evaluations": 0,
            "eval_s": 0.0}  # fmt: skip


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    path.write_text(strict_json(summary, indent=2) + "\n")


def plot_report(rows: list[dict[str, Any]], target: Target, path: Path, title: str) -> None:
    """The target's metric against rounds, wall-clock time (server clock) and megabytes through the server's link (up
    and down, as sent: what ``bytes_to_target`` counts), with the target drawn in."""
    evaluated = [r for r in rows if target.of(r) is not None]
    rounds = [r["round"] for r in evaluated]
    acc = [target.of(r) for r in evaluated]
    elapsed = [r["elapsed_s"] for r in evaluated]
    moved_by_round = dict(zip([r["round"] for r in rows], accumulate(sum(round_bytes(r)) for r in rows), strict=True))
    moved = [moved_by_round[r["round"]] / 1e6 for r in evaluated]
    reached = next((i for i, a in enumerate(acc) if target.reached(a)), None)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
    panels = (
        (axes[0], rounds, "round", "{:.0f}"),
        (axes[1], elapsed, "wall-clock time (s, server clock)", "{:.1f} s"),
        (axes[2], moved, "MB through the server's link (updates in, its egress out)", "{:.2f} MB"),
    )
    for ax, xs, label, fmt in panels:
        ax.plot(xs, acc, marker="o", markersize=3)
        if target.value is not None:
            ax.axhline(target.value, color="grey", linestyle="--", linewidth=1, label=f"target {target.value:g}")
        if reached is not None:
            ax.axvline(
                xs[reached],
                color="tab:green",
                linestyle=":",
                linewidth=1,
                label="reached at " + fmt.format(xs[reached]),
            )
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
        if target.value is not None:  # else nothing is labelled
            ax.legend(loc="best")
    axes[0].xaxis.get_major_locator().set_params(integer=True)
    if any("epsilon" in r for r in rows):  # differential privacy: the budget each accuracy cost, above its round
        spent = ([r["round"] for r in rows], [r["epsilon"] for r in rows])
        top = axes[0].secondary_xaxis(
            "top", functions=(lambda x: np.interp(x, *spent), lambda e: np.interp(e, spent[1], spent[0]))
        )
        top.set_xlabel(f"epsilon spent (delta {rows[-1]['delta']:.2g})", color="tab:red")
        ticks = sorted({spent[1][int(i)] for i in np.linspace(0, len(rows) - 1, min(6, len(rows)))})
        top.set_xticks(ticks, [f"{e:.3g}" for e in ticks])
    axes[0].set_ylabel(f"{target.metric} ({'test set' if target.source == 'server' else 'devices, held out'})")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
