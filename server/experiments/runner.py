"""`edge-server bench`: run a suite's grid of algorithms x partitions x seeds and write the papers' kind of tables.

Every algorithm of a column trains on the identical partition with the identical seeds; only the algorithm differs.
Runs go one after another, in-process by default (clients one after another, compute times free of contention) or
over a broker with one process per client (``--mode broker``, what devices do). A finished run is not run again when
the bench is restarted with the same output directory, so a long suite can be resumed. A variant may run in its own
mode (one mosquitto is started when the first broker-mode run needs it); rows chosen by a ranking (``best:N``) run
once every other run is done.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from edge_client.wire.transport import LinkConfig
from server.assembly import split_clients
from server.datasets import DatasetBundle, load_dataset
from server.experiments.inprocess import run_inprocess
from server.experiments.matched_steps import matched, source_record
from server.experiments.simulate import ClientLogin, client_ids, prepare_shards, run_processes
from server.experiments.suites import RunSpec, Suite
from server.experiments.tables import write_report

log = logging.getLogger("edgefl.bench")

BrokerLogins = tuple[LinkConfig, dict[str, ClientLogin]]


class _Brokers:
    """One mosquitto for the whole bench, started when the first broker-mode run needs it (each run has its own job,
    so topics never mix)."""

    def __init__(self, out_dir: Path, clients: int, stack: contextlib.ExitStack) -> None:
        self.out_dir, self.clients, self.stack = out_dir, clients, stack
        self.logins: BrokerLogins | None = None

    def for_mode(self, mode: str) -> BrokerLogins | None:
        if mode != "broker":
            return None
        if self.logins is None:
            from server.broker import Broker, BrokerSettings

            ids = client_ids(self.clients)
            broker = self.stack.enter_context(Broker(self.out_dir / "broker", BrokerSettings(devices=ids)).start())
            logins = {cid: ClientLogin(cid, broker.devices[cid].password) for cid in ids}
            self.logins = LinkConfig(broker.url, broker.server.username, broker.server.password), logins
        return self.logins


def run_one(spec: RunSpec, bundle: DatasetBundle, out_dir: Path, broker: BrokerLogins | None) -> dict[str, Any]:
    """Train one cell of the grid into ``out_dir`` and return its record (summary plus per-round curve)."""
    config = dataclasses.replace(spec.config, run=dataclasses.replace(spec.config.run, out=str(out_dir)))
    bundle, root = split_clients(config, bundle)  # drag-br's root samples are held by no client
    ids = client_ids(config.clients.count)
    shards, _ = prepare_shards(bundle, ids, config.data.partition, config.run.seed, out_dir / "shards")
    extra = {"bench_column": spec.column, "variant": spec.variant, "bench_row": spec.algorithm}
    if broker is None:
        summary = run_inprocess(config, shards, bundle, out_dir, root=root, extra=extra)
    else:
        link, logins = broker
        summary = run_processes(config, shards, link, logins, bundle, out_dir, root=root, extra=extra)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line]
    lazy = set(summary.get("freeloaders") or [])  # their "compute" is not training: keep it out of Table I
    shutil.move(out_dir / "shards" / "label_histograms.txt", out_dir / "label_histograms.txt")
    shutil.rmtree(out_dir / "shards", ignore_errors=True)  # the partition is reproducible from the seed
    return {
        "variant": spec.variant,
        "partition": spec.partition,
        "column": spec.column,
        "algorithm": spec.algorithm,
        "seed": spec.seed,
        "path": spec.path,
        "mode": spec.mode,
        "steps_policy": config.train.steps_policy,
        "params": config.algorithm_params(),
        "client_samples": {cid: c["num_samples"] for r in rows for cid, c in r["clients"].items()},
        "summary": summary,
        "curve": [
            {
                "round": r["round"],
                "accuracy": r["accuracy"],
                "elapsed_s": r["elapsed_s"],
                "parallel_elapsed_s": r.get("parallel_elapsed_s"),
                "slowest_compute_s": r["slowest_compute_s"],
                "device_bytes": _device_bytes(r),
                **_fleet_compute(r, lazy),
                **round_alphas(r),
            }
            for r in rows
        ],
    }


def round_alphas(row: dict[str, Any]) -> dict[str, Any]:
    """TACO's alpha_i (eq. 7) of the clients that reported this round, for the algorithms that compute it (a
    per-client dict; STEM's ``alpha`` is its scalar alpha_t, not this)."""
    alpha = row["algorithm"].get("alpha")
    if not isinstance(alpha, dict):
        return {}
    return {"alpha": {cid: alpha[cid] for cid in row["clients"] if cid in alpha}}


def _device_bytes(row: dict[str, Any]) -> dict[str, int]:
    """Per client that reported: the bytes its own link carried this round, down (``bytes_down``: what the device
    received) and up (its update)."""
    return {cid: c["bytes_down"] + c["bytes_up"] for cid, c in row["clients"].items()}


def _fleet_compute(row: dict[str, Any], lazy: set[str]) -> dict[str, float]:
    """A round's compute and local steps over honest clients, those that trained without uploading included."""
    done = [c for cid, c in row["clients"].items() if cid not in lazy]
    done += [r for r in row.get("train_only", []) if r["client"] not in lazy]
    return {
        "compute_s": sum(c["compute_s"] for c in done),
        "local_steps": sum(c["local_steps"] for c in done),
        "trained": len(done),
    }


def rank(records: list[dict[str, Any]], column: str) -> list[str]:
    """The rows of ``column`` (first seed of each), soonest to their target first (parallel clock in-process, wall
    clock over a broker); those that never reached it after, by final accuracy."""

    def key(r: dict[str, Any]) -> tuple[float, float]:
        clock = "parallel_elapsed_s" if r["mode"] == "inprocess" else "elapsed_s"
        t = next((p[clock] for p in r["curve"] if p["accuracy"] >= r["target"]), None)
        return (t if t is not None else float("inf"), -r["summary"]["final_accuracy"])

    first: dict[str, dict[str, Any]] = {}
    for r in records:
        if r["column"] == column:
            first.setdefault(r["algorithm"], r)
    return sorted(first, key=lambda row: key(first[row]))


def run_suite(suite: Suite, out_dir: Path, mode: str | None = None, console: Console | None = None) -> list[dict]:
    """Run (or resume) every cell of the suite, then write the tables and plots; returns the run records. ``mode``
    (``bench --mode``) overrides the suite's and its variants'. Runs that depend on the ranking (``best:N``) come
    after all others."""
    console = console or Console(stderr=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = suite.runs(mode=mode)
    if suite.match_steps:  # in each cell, the run whose total local steps the others are given goes first
        cells = list(dict.fromkeys((s.variant, s.partition, s.seed) for s in specs))
        specs.sort(key=lambda s: (cells.index((s.variant, s.partition, s.seed)), s.algorithm != suite.match_steps))
    records: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    ]
    with contextlib.ExitStack() as stack, Progress(*columns, console=console) as progress:
        brokers = _Brokers(out_dir, max(s.config.clients.count for s in specs), stack)
        task = progress.add_task(f"bench {suite.name}", total=len(specs))
        datasets: dict[tuple[str, int], DatasetBundle] = {}
        _run_specs(specs, out_dir, brokers, datasets, records, progress, task, suite.match_steps)
        if suite.ranked():
            ranking = rank(list(records.values()), suite.ranking_column())
            progress.console.print(f"ranking of {suite.ranking_column()}: {', '.join(ranking)}")
            more = [s for s in suite.runs(ranking, mode) if s.path not in records]
            progress.update(task, total=len(specs) + len(more))
            _run_specs(more, out_dir, brokers, datasets, records, progress, task, suite.match_steps)
    done = list(records.values())
    write_report(suite, done, out_dir, mode=mode or suite.mode, duration_s=time.monotonic() - started)
    return done


def _run_specs(
    specs: list[RunSpec],
    out_dir: Path,
    brokers: _Brokers,
    datasets: dict[tuple[str, int], DatasetBundle],
    records: dict[str, dict[str, Any]],
    progress: Progress,
    task: TaskID,
    match_steps: str = "",
) -> None:
    """Run each spec not finished before (its record.json kept), adding every record to ``records`` by path, with
    the target its column has in the suite now (the tables read it from the curves, so it may change after the runs);
    with ``match_steps``, every other algorithm is given that one's total local steps in its cell."""
    total = progress.tasks[task].total
    for spec in specs:
        i = len(records) + 1
        run_dir = out_dir / "runs" / spec.path
        done_file = run_dir / "record.json"
        if done_file.exists():
            records[spec.path] = {**json.loads(done_file.read_text()), "target": spec.config.run.target_accuracy}
            progress.console.print(f"run {i}/{total} {spec.path}: done before, kept")
            progress.advance(task)
            continue
        derived = None
        if match_steps and spec.algorithm != match_steps:
            spec, derived = matched(spec, source_record(list(records.values()), spec, match_steps))
        progress.update(task, description=f"{spec.algorithm} · {spec.column} · seed {spec.seed}")
        key = (spec.config.data.dataset, spec.seed)
        if key not in datasets:
            datasets[key] = load_dataset(
                spec.config.data.dataset, seed=spec.seed, label_column=spec.config.data.label_column
            )
        t0 = time.monotonic()
        record = run_one(spec, datasets[key], run_dir, brokers.for_mode(spec.mode))
        record["duration_s"] = time.monotonic() - t0
        if derived:
            record["matched_steps"] = derived
        done_file.write_text(json.dumps(record) + "\n")
        records[spec.path] = {**record, "target": spec.config.run.target_accuracy}  # the suite's, now: it may change
        s = record["summary"]
        reached = f"target in round {s['rounds_to_target']}" if s["rounds_to_target"] else "target not reached"
        progress.console.print(
            f"run {i}/{total} {spec.algorithm:<16} {spec.column:<22} seed {spec.seed} ({spec.mode}): "
            f"accuracy {s['final_accuracy']:.4f} after {s['rounds']} rounds, {reached}, "
            f"{time.monotonic() - t0:.0f} s"
        )
        progress.advance(task)
