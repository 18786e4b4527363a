"""A run's fleet figures: compute and missed rounds per device class, and the parallel clock of in-process runs.

A client's class is what its hello names (``edge-client run --device-class``; simulated fleets set it), else its
machine and core count. The parallel clock is for in-process runs, where clients train one after another: each round
lasts as long as its slowest reporting device (its download, compute and upload, each on that device's clock: compute
divided by its profile's share, transfers at its link rates) plus the server work the devices wait for: assigning and
aggregating, as that work's CPU seconds on the server's thread (``assign_cpu_s``, ``aggregate_cpu_s``), not its wall
time, which on a shared machine counts whatever else runs. The server's test-set evaluation (``eval_s``) is not added:
it runs beside the next round. It is what a fleet of those devices would take; ``wall_clock_s`` stays the real time of
this machine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from server.target import Target

_CLASS_RE = re.compile(r"[A-Za-z0-9_.:+-]{1,32}")


def device_class(device: Mapping[str, Any]) -> str:
    """The class a hello names, else e.g. ``x86_64, 2 cores`` from what the device says it is (untrusted: checked)."""
    named = device.get("device_class")
    if isinstance(named, str) and _CLASS_RE.fullmatch(named):
        return named
    machine, cores = device.get("machine"), device.get("cpu_count")
    machine = machine if isinstance(machine, str) and _CLASS_RE.fullmatch(machine) else "unknown"
    return f"{machine}, {cores} cores" if isinstance(cores, int) and not isinstance(cores, bool) else machine


def parallel_round_s(row: Mapping[str, Any]) -> float:
    """The round on the parallel clock: the server's assigning, then its slowest reporting device's download +
    compute + upload, then the server's aggregating (CPU seconds; evaluation runs beside the next round)."""
    devices = [c["download_s"] + c["compute_s"] + c["upload_s"] for c in row["clients"].values()]
    return row["assign_cpu_s"] + max(devices, default=0.0) + row["aggregate_cpu_s"]


def fleet_summary(rows: list[dict[str, Any]], classes: Mapping[str, str], target: Target) -> dict[str, Any]:
    """For summary.json: compute (uploaded and train-only) and rounds missed per class and per client, and the
    parallel clock with the time to ``target`` on it when the run kept one."""
    per_class: dict[str, dict[str, Any]] = {}
    missed: dict[str, int] = {}

    def entry(cid: str, fallback: str = "unknown") -> dict[str, Any]:
        name = classes.get(cid, fallback)
        return per_class.setdefault(name, {"clients": 0, "rounds_reported": 0, "rounds_missed": 0, "compute_s": 0.0,
                                           "train_only_compute_s": 0.0, "local_steps": 0})  # fmt: skip

    for cid in classes:
        entry(cid)["clients"] += 1
    for row in rows:
        for cid, c in row["clients"].items():
            e = entry(cid, c.get("device_class", "unknown"))
            e["rounds_reported"] += 1
            e["compute_s"] += c["compute_s"]
            e["local_steps"] += c["local_steps"]
        for r in row.get("train_only", []):
            e = entry(r["client"])
            e["train_only_compute_s"] += r["compute_s"]
            e["local_steps"] += r["local_steps"]
        for cid in row["missing"]:
            entry(cid)["rounds_missed"] += 1
            missed[cid] = missed.get(cid, 0) + 1
    for e in per_class.values():
        total = e["compute_s"] + e["train_only_compute_s"]
        e["s_per_100_steps"] = 100.0 * total / e["local_steps"] if e["local_steps"] else None
    out: dict[str, Any] = {
        "fleet_compute_s": sum(e["compute_s"] + e["train_only_compute_s"] for e in per_class.values()),
        "per_class": dict(sorted(per_class.items())),
        "rounds_missed": dict(sorted(missed.items())),
    }
    if rows and "parallel_elapsed_s" in rows[-1]:
        reached = next((r for r in rows if target.reached(target.of(r))), None)
        out["parallel_clock_s"] = rows[-1]["parallel_elapsed_s"]
        out["parallel_clock_to_target_s"] = reached["parallel_elapsed_s"] if reached else None
    return out
