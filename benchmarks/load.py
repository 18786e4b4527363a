"""Benchmark 6: load test of one mosquitto and the real server with many protocol-level clients (issue 7, "Load").

The REAL ``server.orchestrator.Orchestrator`` (FedAvg) runs in this process against a mosquitto started by
``server.broker.Broker`` (one login per device, the edgefl ACL). The clients do not train: each is a real
``edge_client.transport.MqttLink`` with its own credentials, run by a few worker processes (one thread per link),
that says hello, takes every assignment and answers it with a real encoded ``Update`` through the same chunked
publish path devices use. The update of client ``i`` in round ``r`` is

    delta_i,r = float32(SCALE * c_i * r) * BASE,   c_i = 1 + i / N,   BASE[j] = 1 + (j mod 16) / 16

so FedAvg's result is known in closed form: ``w_r = w_{r-1} - mean_i delta_i,r``. After every round the observer
reads the server's checkpoint and checks it against that, element by element, with a tolerance 25 times smaller
than any one client's contribution: an update lost, counted twice or corrupted fails the round. It also records
what the server's metrics row says (clients reported, rejections by reason, bytes), the server's and the broker's
peak resident memory during the round (psutil, sampled every 20 ms) and each worker process's peak.

    python -m benchmarks.load [--clients 200] [--rounds 20] [--params 1000000] [--workers 4] [--quick] [--out DIR]

Full: 200 clients, 20 rounds, an MLP of about 1M parameters. Quick (CI): 20 clients, 3 rounds, about 100k.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import machine, machine_line, write_results

NAME = "load"
SCALE = 1e-3  # keeps 20 rounds of made-up updates far from float32 trouble
IN_FEATURES, NUM_CLASSES = 64, 10  # an MLP on digits-sized inputs: its hidden width sets the size
TEST_IMAGES = 16  # the evaluator's test set: evaluation must cost next to nothing here
REL_TOL = 1e-4  # of the round's mean update; one client's share is ~1/N of it (N <= 2000 keeps 5x margin)
MEMORY_SLACK = 1.25  # late rounds' peak may exceed the early rounds' by this factor (plus MEMORY_SLACK_MB)
MEMORY_SLACK_MB = 100.0
JOB = "load"


def model_spec(params: int) -> dict[str, Any]:
    """An MLP with one hidden layer whose flat size is the nearest to ``params`` (75 h + 10 values)."""
    hidden = max(1, round((params - NUM_CLASSES) / (IN_FEATURES + 1 + NUM_CLASSES)))
    return {"name": "mlp", "in_features": IN_FEATURES, "num_classes": NUM_CLASSES, "hidden": [hidden]}


def base_vector(size: int) -> np.ndarray:
    return (1.0 + (np.arange(size) % 16) / 16.0).astype(np.float32)


def coefficient(index: int, clients: int) -> float:
    return 1.0 + index / clients


def delta_for(base: np.ndarray, index: int, clients: int, round_: int) -> np.ndarray:
    return base * np.float32(SCALE * coefficient(index, clients) * round_)


def client_index(cid: str) -> int:
    return int(cid.removeprefix("d"))


# ------------------------------------------------------------------------------------------------ client workers
def _serve_link(
    cid: str, password: str, url: str, clients: int, base: np.ndarray, stats: dict[str, Any], lock: threading.Lock
) -> None:
    """One device at protocol level: hello, then answer each assignment with the deterministic update until stop."""
    from edge_client.protocol import Assignment, Hello, Presence, Stop, Update, encode
    from edge_client.topics import Topics
    from edge_client.transport import LinkConfig, MqttLink

    topics = Topics(JOB)
    index = client_index(cid)
    link: MqttLink

    def hello() -> None:
        link.publish(topics.up(cid), encode(Hello(client_id=cid, num_samples=1, device={"hostname": "load"})))

    link = MqttLink(
        LinkConfig(url, cid, password),
        f"edgefl-{JOB}-{cid}",
        [topics.down(cid), topics.broadcast, topics.server],
        will=(topics.up(cid), encode(Presence(client_id=cid, online=False, reason="connection lost")), False),
        on_connect=hello,
    )
    link.start()
    try:
        while True:
            received = link.receive(timeout=1.0)
            if received is None:
                continue
            msg = received[1]
            if isinstance(msg, Stop):
                break
            if isinstance(msg, Presence) and msg.role == "server" and msg.online:
                hello()
            elif isinstance(msg, Assignment):
                if msg.weights.size != base.size:
                    raise ValueError(f"{cid}: assignment carries {msg.weights.size} weights, expected {base.size}")
                update = Update(
                    round=msg.round,
                    model_version=msg.model_version,
                    client_id=cid,
                    num_samples=1,
                    local_steps=msg.local_steps,
                    compute_s=0.0,
                    cpu_s=0.0,
                    train_loss=0.0,
                    delta=delta_for(base, index, clients, msg.round),
                    run_id=msg.run_id,
                )
                link.publish(topics.up(cid), encode(update))
                if not link.wait_published(timeout=msg.deadline_s):
                    raise TimeoutError(f"{cid}: round {msg.round} update not acknowledged in {msg.deadline_s} s")
                with lock:
                    stats["updates_sent"] += 1
        link.wait_published(timeout=10.0)
    except Exception as exc:  # reported to the parent: a dead client must not pass unnoticed
        with lock:
            stats["errors"].append(f"{cid}: {type(exc).__name__}: {exc}")
    finally:
        link.stop()


def worker(logins: list[tuple[str, str]], url: str, clients: int, params: int, results: Any) -> None:
    """A worker process holding many links (one thread each); reports its counters and peak RSS when all stop."""
    logging.basicConfig(level=logging.WARNING, format=f"worker {os.getpid()} %(levelname)s %(name)s: %(message)s")
    stats: dict[str, Any] = {"pid": os.getpid(), "links": len(logins), "updates_sent": 0, "errors": []}
    lock = threading.Lock()
    base = base_vector(params)  # read-only, shared by the links of this process
    threads = [
        threading.Thread(target=_serve_link, args=(cid, pw, url, clients, base, stats, lock), daemon=True)
        for cid, pw in logins
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    results.put(stats)


# ------------------------------------------------------------------------------------------------ server side
class PeakSampler:
    """Peak RSS of the server (this process) and of the broker since the last ``take()``, sampled on a thread."""

    def __init__(self, broker_pid: int, interval: float = 0.02) -> None:
        import psutil

        self._procs = {"server": psutil.Process(), "broker": psutil.Process(broker_pid)}
        self._peak = dict.fromkeys(self._procs, 0)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            for key, proc in self._procs.items():
                rss = proc.memory_info().rss
                with self._lock:
                    self._peak[key] = max(self._peak[key], rss)

    def take(self) -> dict[str, float]:
        """Peak MB per process since the previous call (the current value seeds the next interval)."""
        with self._lock:
            out = {k: v / 2**20 for k, v in self._peak.items()}
            self._peak = {k: p.memory_info().rss for k, p in self._procs.items()}
        return out

    def __enter__(self) -> PeakSampler:
        self.take()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class Checker:
    """Observer of the orchestrator: after each round compare the checkpointed weights with the closed form."""

    def __init__(self, out_dir: Path, w0: np.ndarray, clients: int, sampler: PeakSampler) -> None:
        self.out_dir = out_dir
        self.previous = w0.astype(np.float64)
        self.base = base_vector(w0.size).astype(np.float64)
        self.clients = clients
        self.sampler = sampler
        self.rounds: list[dict[str, Any]] = []

    def waiting(self, text: str) -> None:
        pass

    def round_done(self, row: dict[str, Any]) -> None:
        r = row["round"]
        with np.load(self.out_dir / "checkpoint.npz") as ck:
            weights = ck["weights"].astype(np.float64)
        scale = np.mean([np.float32(SCALE * coefficient(i, self.clients) * r) for i in range(self.clients)])
        mean_update = scale * self.base
        expected = self.previous - mean_update
        tol = REL_TOL * np.abs(mean_update) + 1e-6 * np.abs(self.previous)
        error = np.abs(weights - expected)
        one_client = SCALE * r * self.base.min() / self.clients  # the smallest any single update moves an element
        self.previous = weights
        peaks = self.sampler.take()
        self.rounds.append(
            {
                "round": r,
                "round_s": row["round_s"],
                "aggregate_s": row["aggregate_s"],
                "eval_s": row["eval_s"],
                "clients_selected": row["clients_selected"],
                "clients_reported": row["clients_reported"],
                "missing": row["missing"],
                "rejected": row["rejected"],
                "aggregate_exact": bool(np.all(error <= tol)),
                "aggregate_max_error": float(error.max()),
                "aggregate_tolerance_max": float(tol.max()),
                "one_client_contribution_min": float(one_client),
                "bytes_up": sum(c["bytes_up"] for c in row["clients"].values()),
                "bytes_down": sum(i["bytes_down"] for i in row["instructions"].values()),
                "server_peak_rss_mb": peaks["server"],
                "broker_peak_rss_mb": peaks["broker"],
            }
        )
        print(
            f"round {r:3d}: {row['round_s']:.2f} s, {row['clients_reported']}/{row['clients_selected']} reported, "
            f"rejected {row['rejected'] or 'none'}, "
            f"aggregate {'exact' if self.rounds[-1]['aggregate_exact'] else 'WRONG'}, "
            f"server peak {peaks['server']:.0f} MB, broker peak {peaks['broker']:.0f} MB",
            file=sys.stderr,
            flush=True,
        )


def memory_verdict(rounds: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Early rounds (2.., the first quarter; round 1 warms up) against the last quarter: peak must not keep growing."""
    peaks = [r[key] for r in rounds]
    k = max(1, len(peaks) // 4)
    early = peaks[1 : 1 + k] if len(peaks) > k + 1 else peaks[:k]
    late = peaks[-k:]
    bound = MEMORY_SLACK * max(early) + MEMORY_SLACK_MB
    steady = peaks[1:] if len(peaks) > 2 else peaks
    slope = float(np.polyfit(np.arange(len(steady)), steady, 1)[0]) if len(steady) > 1 else 0.0
    return {
        "early_max_mb": max(early),
        "late_max_mb": max(late),
        "bound_mb": bound,
        "bounded": max(late) <= bound,
        "slope_mb_per_round": slope,  # least squares over rounds 2..R: what a leak would show as
    }


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(clients: int, rounds: int, params: int, workers: int, quick: bool, out: Path | None) -> dict[str, Any]:
    import torch

    from edge_client.data import ArrayDataset
    from edge_client.models import build_model, get_flat
    from edge_client.transport import LinkConfig
    from server.broker import Broker, BrokerSettings
    from server.config import from_dict
    from server.evaluation import Evaluator
    from server.orchestrator import Orchestrator

    spec = model_spec(params)
    ids = [f"d{i}" for i in range(clients)]
    workers = max(1, min(workers, clients))
    rng = np.random.default_rng(0)
    test = ArrayDataset(
        x=rng.standard_normal((TEST_IMAGES, IN_FEATURES)).astype(np.float32),
        y=rng.integers(0, NUM_CLASSES, TEST_IMAGES).astype(np.int64),
    )
    load_before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edgefl-load-")))
        broker = stack.enter_context(Broker(tmp / "broker", BrokerSettings(devices=ids)))
        config = from_dict(
            {
                "run": {"rounds": rounds, "out": str(tmp / "run"), "job": JOB, "target_accuracy": 1.0},
                "clients": {"count": clients, "register_timeout_s": 300.0, "round_deadline_s": 600.0},
                "train": {"algorithm": "fedavg", "local_steps": 1, "batch_size": 1, "lr": 0.1},
            }
        )
        torch.manual_seed(config.run.seed)  # what Orchestrator.run does before it builds the initial model
        w0 = get_flat(build_model(spec))
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        logins = [(cid, broker.devices[cid].password) for cid in ids]
        procs = [
            ctx.Process(target=worker, args=(logins[k::workers], broker.url, clients, w0.size, results), daemon=True)
            for k in range(workers)
        ]
        for p in procs:
            p.start()
        sampler = stack.enter_context(PeakSampler(broker.process.pid))  # type: ignore[union-attr]
        checker = Checker(tmp / "run", w0, clients, sampler)
        orch = Orchestrator(
            config,
            LinkConfig(broker.url, broker.server.username, broker.server.password),
            Evaluator(spec, test),
            spec,
            tmp / "run",
            observer=checker,
        )
        t0 = time.perf_counter()
        summary = orch.run()
        wall = time.perf_counter() - t0
        worker_stats = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        broker_log = broker.log_path.read_text(errors="replace")
    per_round = checker.rounds
    times = [r["round_s"] for r in per_round]
    data: dict[str, Any] = {
        "name": NAME,
        "quick": quick,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {
            "clients": clients,
            "rounds": rounds,
            "params_requested": params,
            "params": int(w0.size),
            "model": spec,
            "workers": workers,
            "update_bytes": int(w0.nbytes),
            "test_images": TEST_IMAGES,
            "broker": {"max_inflight_messages": 20, "max_queued_messages": 10000, "max_packet_size": 16 * 2**20},
        },
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "wall_s": wall,
        "per_round": per_round,
        "round_s": {"median": statistics.median(times), "p95": _pct(times, 0.95), "max": max(times)},
        "bytes_per_round": {
            "up": statistics.median(r["bytes_up"] for r in per_round),
            "down": statistics.median(r["bytes_down"] for r in per_round),
        },
        "rejected_total": summary.get("rejected", {}),
        "workers_report": worker_stats,
        "client_errors": [e for w in worker_stats for e in w["errors"]],
        "updates_sent": sum(w["updates_sent"] for w in worker_stats),
        "broker_dropped_messages": "Outgoing messages are being dropped" in broker_log,
        "server_memory": memory_verdict(per_round, "server_peak_rss_mb"),
        "broker_memory": memory_verdict(per_round, "broker_peak_rss_mb"),
    }
    data["checks"] = {
        "all_rounds_ran": len(per_round) == rounds,
        "no_update_lost": all(r["clients_reported"] == clients and not r["missing"] for r in per_round)
        and data["updates_sent"] == clients * rounds,
        "no_duplicate_accepted": all(r["clients_reported"] <= clients for r in per_round)
        and not any(r["rejected"].get("duplicate") for r in per_round),
        "aggregate_exact": all(r["aggregate_exact"] for r in per_round),
        "server_memory_bounded": data["server_memory"]["bounded"],
        "no_client_errors": not data["client_errors"],
    }
    write_results(NAME, data, render(data), out)
    return data


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def render(data: dict[str, Any]) -> str:
    cfg, checks, rt = data["config"], data["checks"], data["round_s"]
    sm, bm = data["server_memory"], data["broker_memory"]
    cmd = "python -m benchmarks.load" + (
        " --quick"
        if data["quick"]
        else f" --clients {cfg['clients']} --rounds {cfg['rounds']} "
        f"--params {cfg['params_requested']} --workers {cfg['workers']}"
    )
    rounds = data["per_round"]
    worst_err = max(r["aggregate_max_error"] / r["one_client_contribution_min"] for r in rounds)
    lines = [
        "## 6. Load: many protocol-level clients through one mosquitto",
        "",
        f"Command: `{cmd}` (mode: {'quick' if data['quick'] else 'full'})",
        "",
        machine_line(data["machine"]),
        "",
        f"Load average (1/5/15 min) before {'/'.join(f'{x:.1f}' for x in data['loadavg_before'])}, after "
        f"{'/'.join(f'{x:.1f}' for x in data['loadavg_after'])}.",
        "",
        f"Setup: the real orchestrator (FedAvg) and a mosquitto from `server.broker.Broker` (one login per device, the "
        f"ACL; max_inflight_messages {cfg['broker']['max_inflight_messages']}, max_queued_messages "
        f"{cfg['broker']['max_queued_messages']}, max_packet_size {cfg['broker']['max_packet_size']}); "
        f"{cfg['clients']} `MqttLink` clients in {cfg['workers']} worker processes, no training; model "
        f"{cfg['model']} = {cfg['params']} parameters, {cfg['update_bytes']} bytes per update and per assignment; "
        f"{cfg['rounds']} rounds; evaluation on {cfg['test_images']} made-up images.",
        "",
        "| figure | measured | target | result |",
        "|---|---|---|---|",
        f"| updates accepted per round | min {min(r['clients_reported'] for r in rounds)}, max "
        f"{max(r['clients_reported'] for r in rounds)} of {cfg['clients']}; {data['updates_sent']} sent | every "
        f"client, every round | {_verdict(checks['no_update_lost'] and checks['all_rounds_ran'])} |",
        f"| duplicates accepted | rejections {data['rejected_total'] or 'none'} | none | "
        f"{_verdict(checks['no_duplicate_accepted'])} |",
        f"| aggregate vs closed form | worst error {worst_err:.3f} of one client's smallest contribution | "
        f"every element within tolerance | {_verdict(checks['aggregate_exact'])} |",
        f"| server peak RSS, late rounds vs early | {sm['late_max_mb']:.0f} MB vs {sm['early_max_mb']:.0f} MB "
        f"(trend {sm['slope_mb_per_round']:+.1f} MB/round) | "
        f"<= {MEMORY_SLACK} x early + {MEMORY_SLACK_MB:.0f} MB = {sm['bound_mb']:.0f} MB | "
        f"{_verdict(checks['server_memory_bounded'])} |",
        f"| client errors | {len(data['client_errors'])} | 0 | {_verdict(checks['no_client_errors'])} |",
        "",
        f"Round time: median {rt['median']:.2f} s, p95 {rt['p95']:.2f} s, max {rt['max']:.2f} s; total "
        f"{data['wall_s']:.1f} s. Per round {data['bytes_per_round']['down'] / 2**20:.0f} MiB down and "
        f"{data['bytes_per_round']['up'] / 2**20:.0f} MiB up (medians). Broker peak RSS: early "
        f"{bm['early_max_mb']:.0f} MB, late {bm['late_max_mb']:.0f} MB; broker dropped messages: "
        f"{'YES' if data['broker_dropped_messages'] else 'no'}. Worker processes' peak RSS: "
        + ", ".join(f"{w['peak_rss_mb']:.0f} MB ({w['links']} links)" for w in data["workers_report"])
        + ".",
        "",
        "| round | round s | aggregate s | eval s | reported | rejected | MiB down | MiB up | server peak MB | "
        "broker peak MB | aggregate |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rounds:
        lines.append(
            f"| {r['round']} | {r['round_s']:.2f} | {r['aggregate_s']:.3f} | {r['eval_s']:.3f} | "
            f"{r['clients_reported']}/{r['clients_selected']} | {r['rejected'] or '-'} | {r['bytes_down'] / 2**20:.0f} "
            f"| {r['bytes_up'] / 2**20:.0f} | {r['server_peak_rss_mb']:.0f} | {r['broker_peak_rss_mb']:.0f} | "
            f"{'exact' if r['aggregate_exact'] else 'WRONG'} |"
        )
    if data["client_errors"]:
        lines += ["", "Client errors (first 10):", "", *(f"- {e}" for e in data["client_errors"][:10])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 clients, 3 rounds, ~100k parameters (CI)")
    parser.add_argument("--clients", type=int, default=None, help="protocol-level clients (default 200, quick 20)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 20, quick 3)")
    parser.add_argument("--params", type=int, default=None, help="model size (default 1000000, quick 100000)")
    parser.add_argument("--workers", type=int, default=4, help="client worker processes (default 4)")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default: benchmarks/results)")
    args = parser.parse_args(argv)
    clients = args.clients or (20 if args.quick else 200)
    rounds = args.rounds or (3 if args.quick else 20)
    params = args.params or (100_000 if args.quick else 1_000_000)
    for flag, value, low in (("--clients", clients, 1), ("--rounds", rounds, 2), ("--params", params, 100)):
        if value < low:
            parser.error(f"{flag} must be >= {low}, got {value}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    data = run(clients, rounds, params, args.workers, args.quick, args.out)
    failed = [k for k, ok in data["checks"].items() if not ok]
    print(
        f"load: {clients} clients x {rounds} rounds x {data['config']['params']} params: round median "
        f"{data['round_s']['median']:.2f} s, p95 {data['round_s']['p95']:.2f} s; "
        + (f"FAILED {failed}" if failed else "all checks passed"),
        file=sys.stderr,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
