"""Benchmark 5: round overhead of a simulated federation (issue 5).

Runs the real ``edge-server simulate`` code path in this process (``server.cli.main(["simulate", ...])``: a
mosquitto, the server's orchestrator and N ``edge-client`` processes talking through the broker), reads the run's
``metrics.jsonl`` and computes, per round,

    overhead = round_s - slowest_compute_s,   fraction = overhead / round_s

where a round runs from its first assignment to its new model (round t's evaluation runs beside round t+1's training
and is not part of it). Target: fraction < 5 %. Round 1 is warm-up (client models are built, first messages, lazy
imports) and is excluded from the median and max.

To say where the overhead goes, the orchestrator's methods are wrapped with wall-clock timers (the project's code is
not changed): when each assignment was published and each update accepted, how long assigning, collecting and
checkpointing took, and when the background ONNX exporter ran. The clients' own ``device.before.time`` /
``device.after.time`` (taken just before and after ``train_local``) place their computation on the same clock, and each
update's ``metrics["last_upload"]`` carries the previous round's serialise and upload times.

    python -m benchmarks.round_overhead [--quick] [--out DIR]

Full: 10 clients, MNIST, the TACO CNN, 50 local steps of batch 64, 10 rounds. Quick: 3 clients, digits, 2 rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import machine, machine_line, median_time, write_results

NAME = "round_overhead"
TARGET_FRACTION = 0.05


class Timeline:
    """Server-side wall-clock stamps (``time.time()``, the clock the clients' device snapshots use)."""

    def __init__(self) -> None:
        self.rounds: dict[int, dict[str, Any]] = {}
        self.exports: list[tuple[float, float]] = []
        self.evaluator: Any = None
        self.model_spec: dict[str, Any] | None = None

    def round(self, r: int) -> dict[str, Any]:
        return self.rounds.setdefault(r, {"published": {}, "arrived": {}})


@contextlib.contextmanager
def instrumented(timeline: Timeline) -> Iterator[None]:
    """Wrap the orchestrator's phases with timers for the duration of the block (the code itself is unchanged)."""
    import server.onnx_export as onnx_export
    from server.checkpoint import Checkpoint
    from server.dispatch import Dispatch
    from server.orchestrator import Orchestrator

    orig = {name: getattr(Orchestrator, name) for name in ("_assign", "_collect", "_train")}
    orig_accept = Dispatch.accept
    orig_save = Checkpoint.save
    orig_export = onnx_export.export_onnx

    def _assign(self: Orchestrator, round_: int, *args: Any) -> Any:
        rec = timeline.round(round_)
        publish = self.link.publish

        def timed_publish(topic: str, payload: Any, *args: Any, **kwargs: Any) -> Any:
            out = publish(topic, payload, *args, **kwargs)
            parts = topic.split("/")
            if len(parts) == 5 and parts[4] == "down":
                rec["published"][parts[3]] = time.time()
            return out

        rec["assign_start"] = time.time()
        self.link.publish = timed_publish  # instance attribute shadows the method for this call only
        try:
            return orig["_assign"](self, round_, *args)
        finally:
            del self.link.publish
            rec["assign_end"] = time.time()

    def _collect(self: Orchestrator, state: Any, *args: Any) -> Any:
        try:
            return orig["_collect"](self, state, *args)
        finally:
            timeline.round(state.round)["collect_end"] = time.time()

    def accept(self: Dispatch, topic: str, sender: str, update: Any) -> Any:
        now = time.time()
        out = orig_accept(self, topic, sender, update)  # raises for a rejected update: not recorded
        timeline.round(update.round)["arrived"][sender] = now
        return out

    def save(self: Checkpoint, weights: Any, round_: int, *args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        try:
            return orig_save(self, weights, round_, *args, **kwargs)
        finally:
            timeline.round(round_)["checkpoint_s"] = time.time() - t0

    def _train(self: Orchestrator, *args: Any, **kwargs: Any) -> Any:
        timeline.evaluator = self.evaluator  # reused after the run for a clean evaluation timing
        timeline.model_spec = self.model_spec
        return orig["_train"](self, *args, **kwargs)

    def export_onnx(*args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        try:
            return orig_export(*args, **kwargs)
        finally:
            timeline.exports.append((t0, time.time()))

    patched = {"_assign": _assign, "_collect": _collect, "_train": _train}
    for name, fn in patched.items():
        setattr(Orchestrator, name, fn)
    Dispatch.accept = accept  # type: ignore[method-assign]
    Checkpoint.save = save  # type: ignore[method-assign]
    onnx_export.export_onnx = export_onnx
    try:
        yield
    finally:
        for name, fn in orig.items():
            setattr(Orchestrator, name, fn)
        Dispatch.accept = orig_accept  # type: ignore[method-assign]
        Checkpoint.save = orig_save  # type: ignore[method-assign]
        onnx_export.export_onnx = orig_export


def simulate_argv(quick: bool, rounds: int, out_dir: Path) -> list[str]:
    """The `edge-server simulate` arguments: its defaults (10 clients, MNIST, CNN, tau 50, batch 64) unless quick."""
    argv = ["simulate", "--rounds", str(rounds), "--out", str(out_dir)]
    if quick:
        argv += ["--clients", "3", "--dataset", "digits"]
    return argv


def run_simulation(argv: list[str], timeline: Timeline) -> list[dict[str, Any]]:
    from server.cli import main as edge_server

    with instrumented(timeline):
        code = edge_server(argv)
    if code != 0:
        raise RuntimeError(f"edge-server {' '.join(argv)} exited with {code}")
    out_dir = Path(argv[argv.index("--out") + 1])
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _t(client: dict[str, Any], which: str) -> float | None:
    return (client.get("device", {}).get(which) or {}).get("time")


def analyse_round(row: dict[str, Any], nxt: dict[str, Any] | None, tl: dict[str, Any]) -> dict[str, Any]:
    """One round's overhead and where it went (seconds)."""
    clients = row["clients"]
    round_s, slowest = row["round_s"], row["slowest_compute_s"]
    overhead = round_s - slowest
    out: dict[str, Any] = {
        "round": row["round"],
        "clients": len(clients),
        "round_s": round_s,
        "slowest_compute_s": slowest,
        "overhead_s": overhead,
        "fraction": overhead / round_s if round_s > 0 else None,
        "aggregate_s": row.get("aggregate_s"),
        "eval_s": row.get("eval_s"),
        "bytes_down": max((c["device"].get("bytes_down") or 0 for c in clients.values()), default=0),
        "bytes_up": max((c.get("bytes_up") or 0 for c in clients.values()), default=0),
        "checkpoint_s": tl.get("checkpoint_s"),
    }
    # the clients' serialise / upload times of this round travel with their next update
    later = [c["device"].get("last_upload") or {} for c in (nxt or {}).get("clients", {}).values()]
    later = [u for u in later if "serialize_s" in u]
    out["serialize_s_max"] = max((u["serialize_s"] for u in later), default=None)
    out["upload_s_max"] = max((u["upload_s"] for u in later), default=None)
    out["upload_s_median"] = statistics.median(u["upload_s"] for u in later) if later else None

    published, arrived = tl.get("published", {}), tl.get("arrived", {})
    a0, a1, c1 = tl.get("assign_start"), tl.get("assign_end"), tl.get("collect_end")
    if a0 is None or a1 is None or c1 is None or not arrived:
        return out
    out["assign_s"] = a1 - a0
    per: dict[str, dict[str, float]] = {}
    for cid, c in clients.items():
        before, after, pub, arr = _t(c, "before"), _t(c, "after"), published.get(cid), arrived.get(cid)
        if None in (before, after, pub, arr):
            continue
        per[cid] = {
            "start_lag_s": before - pub,  # broker delivery, decode, the client's turn on a CPU
            "train_extra_s": (after - before) - c["compute_s"],  # weights load, device snapshots
            "tail_s": arr - after,  # build + encode + publish the update, broker, server receive + decode
            "compute_s": c["compute_s"],
            "arrival_s": arr - a0,
            "finish_s": after - a0,
        }
    out["per_client"] = per
    if not per:
        return out
    last = max(per, key=lambda k: per[k]["arrival_s"])
    first = min(per, key=lambda k: per[k]["arrival_s"])
    L = per[last]
    out["critical_client"] = last
    out["crit_start_lag_s"] = L["start_lag_s"]  # the last arriver began training this long after its assignment
    out["crit_train_extra_s"] = L["train_extra_s"]
    out["crit_tail_s"] = L["tail_s"]
    # <= 0 when the last to arrive was not the slowest in compute (it started later instead)
    out["crit_compute_minus_slowest_s"] = L["compute_s"] - slowest
    out["collect_exit_s"] = c1 - (a0 + L["arrival_s"])  # last update accepted -> collect loop returned
    out["first_arrival_minus_compute_s"] = per[first]["arrival_s"] - per[first]["compute_s"]
    out["finish_spread_s"] = max(p["finish_s"] for p in per.values()) - min(p["finish_s"] for p in per.values())
    out["start_lag_max_s"] = max(p["start_lag_s"] for p in per.values())
    out["tail_max_s"] = max(p["tail_s"] for p in per.values())
    known = (
        out["assign_s"]
        + (published.get(last, a1) - a1)
        + L["start_lag_s"]
        + L["train_extra_s"]
        + out["crit_compute_minus_slowest_s"]
        + L["tail_s"]
        + out["collect_exit_s"]
        + (row.get("aggregate_s") or 0.0)
    )
    out["crit_publish_offset_s"] = published.get(last, a1) - a1
    out["unaccounted_s"] = overhead - known
    return out


def _gaps(rows: list[dict[str, Any]], tl: Timeline) -> dict[int, float]:
    """Server time between the end of round r (its model produced) and the start of round r+1's assignments: the
    previous round's row and checkpoint are written there, once its evaluation is done."""
    out: dict[int, float] = {}
    for row in rows:
        r = row["round"]
        cur, nxt = tl.rounds.get(r, {}), tl.rounds.get(r + 1, {})
        if "collect_end" in cur and "assign_start" in nxt:
            end = cur["collect_end"] + (row.get("aggregate_s") or 0.0)
            out[r] = nxt["assign_start"] - end
    return out


def _export_overlap(tl: Timeline) -> list[dict[str, float]]:
    """Each background ONNX export and how much of it ran while a round's clients were training."""
    spans = [(v["assign_start"], v["collect_end"]) for v in tl.rounds.values() if "collect_end" in v]
    out = []
    for t0, t1 in tl.exports:
        inside = sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in spans)
        out.append({"duration_s": t1 - t0, "during_round_s": inside})
    return out


def _med(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _max(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


COMPONENTS = [
    ("assign_s", "assign: broadcast the model once + publish every assignment (server)"),
    ("crit_start_lag_s", "last arriver: assignment published -> its training started (delivery, decode, CPU turn)"),
    ("crit_train_extra_s", "last arriver: weights load + device snapshots around train_local"),
    ("crit_compute_minus_slowest_s", "last arriver's compute minus the slowest compute (<= 0)"),
    ("crit_tail_s", "last arriver: training ended -> update accepted (build, encode, upload, broker, decode)"),
    ("collect_exit_s", "last update accepted -> collect loop returned"),
    ("aggregate_s", "aggregate (strategy.aggregate)"),
    ("unaccounted_s", "rest (publish offset of the last arriver, timer granularity)"),
]

NEXT_STEPS = {
    "crit_start_lag_s": (
        "the last client starts training late: profile the client's path from assignment to `train_local` "
        "(broker delivery of ten assignments, decode, device.snapshot with psutil)"
    ),
    "crit_tail_s": "profile the client's update path (device.summarise, encode, publish, wait_published)",
    "assign_s": "profile `Distribution.send` (server/distribution.py): the broadcast's encode and frames",
    "crit_train_extra_s": "look at `FlatModel.load` and device.snapshot() around train_local",
    "collect_exit_s": "the collect loop's wake-up after the last update: check MqttLink.receive's timeout handling",
    "aggregate_s": "profile strategy.aggregate",
    "crit_compute_minus_slowest_s": "",
    "unaccounted_s": "add timers around the publish order of the assignments",
}


def analyse(rows: list[dict[str, Any]], tl: Timeline) -> dict[str, Any]:
    by_round = {r["round"]: r for r in rows}
    per_round = [analyse_round(r, by_round.get(r["round"] + 1), tl.rounds.get(r["round"], {})) for r in rows]
    gaps = _gaps(rows, tl)
    for pr in per_round:
        pr["between_rounds_s"] = gaps.get(pr["round"])
    steady = [p for p in per_round if p["round"] > 1] or per_round
    summary = {
        "rounds_used": [p["round"] for p in steady],
        "fraction_median": _med([p["fraction"] for p in steady]),
        "fraction_max": _max([p["fraction"] for p in steady]),
        "round_s_median": _med([p["round_s"] for p in steady]),
        "slowest_compute_s_median": _med([p["slowest_compute_s"] for p in steady]),
        "overhead_s_median": _med([p["overhead_s"] for p in steady]),
        "components_median": {k: _med([p.get(k) for p in steady]) for k, _ in COMPONENTS},
        "eval_s_median": _med([p.get("eval_s") for p in steady]),
        "serialize_s_max": _max([p.get("serialize_s_max") for p in steady]),
        "upload_s_max": _max([p.get("upload_s_max") for p in steady]),
        "upload_s_median": _med([p.get("upload_s_median") for p in steady]),
        "first_arrival_minus_compute_s_median": _med([p.get("first_arrival_minus_compute_s") for p in steady]),
        "start_lag_max_s_median": _med([p.get("start_lag_max_s") for p in steady]),
        "tail_max_s_median": _med([p.get("tail_max_s") for p in steady]),
        "finish_spread_s_median": _med([p.get("finish_spread_s") for p in steady]),
        "between_rounds_s_median": _med([p.get("between_rounds_s") for p in steady]),
        "checkpoint_s_median": _med([p.get("checkpoint_s") for p in steady]),
        "onnx_exports": _export_overlap(tl),
    }
    return {"per_round": per_round, "summary": summary}


def clean_eval(tl: Timeline, repeats: int) -> dict[str, float] | None:
    """The test-set evaluation alone, after the clients have exited, with the server's torch threads (default) and
    with one thread, interleaved; median seconds per evaluation."""
    evaluator = tl.evaluator
    if evaluator is None or tl.model_spec is None:
        return None
    import numpy as np
    import torch

    from edge_client.learning.models import build_model, get_flat

    torch.manual_seed(0)
    weights = get_flat(build_model(tl.model_spec)).astype(np.float32)
    default = torch.get_num_threads()
    times: dict[str, list[float]] = {f"threads_{default}": [], "threads_1": []}
    try:
        evaluator(weights)  # warm-up
        for _ in range(max(1, repeats)):
            for key, n in ((f"threads_{default}", default), ("threads_1", 1)):
                torch.set_num_threads(n)
                times[key].append(median_time(lambda: evaluator(weights), 1))
    finally:
        torch.set_num_threads(default)
    return {
        "default": statistics.median(times[f"threads_{default}"]),
        "default_threads": default,
        "one_thread": statistics.median(times["threads_1"]),
    }


def _f(v: float | None, fmt: str = "{:.3f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def _load(v: Any) -> str:
    return "/".join(f"{x:.1f}" for x in v) if v else "n/a"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def render(data: dict[str, Any]) -> str:
    s, cfg = data["summary"], data["config"]
    comp = s["components_median"]
    ce = data["clean_eval_s"] or {}
    med_ok = s["fraction_median"] is not None and s["fraction_median"] < TARGET_FRACTION
    max_ok = s["fraction_max"] is not None and s["fraction_max"] < TARGET_FRACTION
    rounds_used = s["rounds_used"]
    excl = "round 1 (warm-up) excluded" if rounds_used and rounds_used[0] > 1 else "no warm-up round to exclude"
    lines = [
        "## 5. Round overhead",
        "",
        f"Command: `python -m benchmarks.round_overhead{' --quick' if data['quick'] else ''}` "
        f"(runs `edge-server {' '.join(data['argv'][:-2])}` in-process; mode: {'quick' if data['quick'] else 'full'})",
        "",
        machine_line(data["machine"]),
        "",
        f"Load average (1/5/15 min) before the run {_load(data['loadavg_before'])}, after it "
        f"{_load(data['loadavg_after'])}: other work on the machine slows every figure here.",
        "",
        f"Setup: {cfg['clients']} `edge-client` processes (1 torch thread each) on {data['machine']['cores']} cores, "
        f"{cfg['dataset']}, model {cfg['model']}, {cfg['algorithm']}, {cfg['local_steps']} local steps of batch "
        f"{cfg['batch_size']}, {cfg['rounds']} rounds, {cfg['test_images']} test images; {excl}. "
        "overhead = round_s - slowest_compute_s (the slowest client's compute includes the contention of "
        f"{cfg['clients']} processes sharing the cores).",
        "",
        "| figure | measured | target | result |",
        "|---|---|---|---|",
        f"| overhead fraction of a round, median over rounds {rounds_used[0]}-{rounds_used[-1]} | "
        f"{_pct(s['fraction_median'])} | < {TARGET_FRACTION:.0%} | {'PASS' if med_ok else 'MISS'} |",
        f"| overhead fraction, worst round ({rounds_used[0]}-{rounds_used[-1]}) | {_pct(s['fraction_max'])} | "
        f"< {TARGET_FRACTION:.0%} | {'PASS' if max_ok else 'MISS'} |",
        "",
        f"Median round {_f(s['round_s_median'])} s, slowest client compute {_f(s['slowest_compute_s_median'])} s, "
        f"overhead {_f(s['overhead_s_median'])} s.",
        "",
        "Per round:",
        "",
        "| round | round s | slowest compute s | overhead s | fraction | assign s | aggregate s | eval s (beside) | "
        "last arriver: start lag s | tail s | between rounds s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in data["per_round"]:
        lines.append(
            f"| {p['round']}{' (warm-up)' if p['round'] == 1 and len(data['per_round']) > 1 else ''} | "
            f"{_f(p['round_s'])} | {_f(p['slowest_compute_s'])} | {_f(p['overhead_s'])} | {_pct(p['fraction'])} | "
            f"{_f(p.get('assign_s'))} | {_f(p.get('aggregate_s'), '{:.4f}')} | {_f(p.get('eval_s'))} | "
            f"{_f(p.get('crit_start_lag_s'))} | {_f(p.get('crit_tail_s'))} | {_f(p.get('between_rounds_s'))} |"
        )
    overhead = s["overhead_s_median"] or 0.0
    lines += [
        "",
        "Where the overhead goes (median over the same rounds; the critical path runs through the client whose "
        "update arrived last):",
        "",
        "| component | median s | share of overhead |",
        "|---|---|---|",
    ]
    for key, text in COMPONENTS:
        v = comp.get(key)
        share = _pct(v / overhead) if v is not None and overhead > 0 else "n/a"
        lines.append(f"| {text} | {_f(v)} | {share} |")
    exports = s["onnx_exports"]
    lines += [
        "",
        "Other measurements:",
        "",
        f"- clients' serialise time (max over clients and rounds): {_f(s['serialize_s_max'], '{:.4f}')} s; upload "
        f"(publish until acknowledged) median {_f(s['upload_s_median'], '{:.4f}')} s, max "
        f"{_f(s['upload_s_max'], '{:.4f}')} s; {data['bytes_down']} bytes down and {data['bytes_up']} bytes up per "
        "client and round",
        f"- first update's arrival after assignment, minus its compute: {_f(s['first_arrival_minus_compute_s_median'])}"
        " s (median): the communication cost of a client that did not wait for a CPU",
        f"- latest client start (assignment published -> training began), median over rounds: "
        f"{_f(s['start_lag_max_s_median'])} s; latest tail (training ended -> accepted): "
        f"{_f(s['tail_max_s_median'])} s; spread of the clients' finishing times: "
        f"{_f(s['finish_spread_s_median'])} s",
        f"- test-set evaluation alone after the run (clients stopped, {cfg['test_images']} images, median of "
        f"{data['eval_repeats']}, interleaved): {_f(ce.get('default'))} s with the server's "
        f"{ce.get('default_threads')} torch threads, {_f(ce.get('one_thread'))} s with 1 thread; in the run, on its "
        f"own thread beside the next round's training (not in any round's time): {_f(s['eval_s_median'])} s",
        f"- between rounds (the previous round's metrics row once its evaluation is done: checkpoint, metrics line, "
        f"progress; not in round_s, clients idle): median {_f(s['between_rounds_s_median'])} s, of which checkpoint "
        f"{_f(s['checkpoint_s_median'], '{:.4f}')} s",
        f"- background ONNX exports: {len(exports)}, median {_f(_med([e['duration_s'] for e in exports]))} s each, "
        f"{_f(sum(e['during_round_s'] for e in exports))} s in total while clients were training (that CPU time "
        "competes with the clients and so sits inside their compute, not in the overhead)",
    ]
    if not (med_ok and max_ok):
        lines += ["", *cause_lines(data)]
    return "\n".join(lines) + "\n"


def cause_lines(data: dict[str, Any]) -> list[str]:
    s = data["summary"]
    comp = {k: v for k, v in s["components_median"].items() if v is not None and v > 0}
    ranked = sorted(comp, key=lambda k: -comp[k])
    overhead = s["overhead_s_median"] or 0.0
    texts = dict(COMPONENTS)
    out = ["**Cause (measured).**"]
    for key in ranked[:3]:
        share = comp[key] / overhead if overhead > 0 else 0.0
        out.append(f"- {texts[key]}: {comp[key]:.3f} s, {100 * share:.0f}% of the median overhead")
    cores = data["machine"].get("cores") or 1
    load = max(data.get("loadavg_before") or [0.0])
    if load > cores:
        out.append(
            f"- the machine was shared while this ran (load average up to {load:.1f} on {cores} cores): rerun when it "
            "is idle before reading the miss as the code's"
        )
    out += ["", "**Next step.**"]
    for key in [k for k in ranked if overhead > 0 and comp[k] / overhead >= 0.10] or ranked[:1]:
        if NEXT_STEPS.get(key):
            out.append(f"- {NEXT_STEPS[key]}")
    if data["summary"]["onnx_exports"]:
        out.append(
            "- then: the background ONNX export (one per improving round) runs while the clients train and so "
            "lengthens their compute; export every k rounds and at the end"
        )
    return out


def run(quick: bool, out: Path | None, rounds: int | None = None, keep_run: Path | None = None) -> dict[str, Any]:
    from server.config import load_config
    from server.datasets import load_dataset

    rounds = rounds or (2 if quick else 10)
    with contextlib.ExitStack() as stack:
        run_dir = keep_run or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edgefl-ro-")))
        argv = simulate_argv(quick, rounds, run_dir / "run")
        tl = Timeline()
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        rows = run_simulation(argv, tl)
        wall = time.perf_counter() - t0
        eval_repeats = 1 if quick else 5
        clean = clean_eval(tl, eval_repeats)
        load_after = os.getloadavg()
    config = load_config(None)
    dataset = "digits" if quick else config.data.dataset
    bundle = load_dataset(dataset, seed=config.run.seed)
    analysis = analyse(rows, tl)
    data = {
        "name": NAME,
        "quick": quick,
        "argv": argv,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {
            "clients": 3 if quick else config.clients.count,
            "dataset": dataset,
            "model": getattr(tl, "model_spec", bundle.model),
            "algorithm": config.train.algorithm,
            "local_steps": config.train.local_steps,
            "batch_size": config.train.batch_size,
            "rounds": rounds,
            "test_images": len(bundle.test),
            "threads_per_client": config.simulation.threads,
        },
        "target": {"fraction_lt": TARGET_FRACTION, "judged_on": "median and max over rounds >= 2"},
        "wall_s": wall,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "clean_eval_s": clean,
        "eval_repeats": eval_repeats,
        "bytes_down": _max([p["bytes_down"] for p in analysis["per_round"]]),
        "bytes_up": _max([p["bytes_up"] for p in analysis["per_round"]]),
        **analysis,
    }
    data["pass"] = {
        "fraction_median": data["summary"]["fraction_median"] is not None
        and data["summary"]["fraction_median"] < TARGET_FRACTION,
        "fraction_max": data["summary"]["fraction_max"] is not None
        and data["summary"]["fraction_max"] < TARGET_FRACTION,
    }
    write_results(NAME, data, render(data), out)
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.round_overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 clients, digits, 2 rounds (CI)")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default: benchmarks/results)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds to run (default: 10, quick: 2)")
    parser.add_argument("--keep-run", type=Path, default=None, help="keep the simulation's run directory here")
    args = parser.parse_args(argv)
    data = run(args.quick, args.out, args.rounds, args.keep_run)
    s = data["summary"]
    print(
        f"round overhead: median {_pct(s['fraction_median'])}, max {_pct(s['fraction_max'])} of the round "
        f"(rounds {s['rounds_used']}); target < {TARGET_FRACTION:.0%}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
