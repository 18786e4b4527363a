"""Benchmark 6: load test of one mosquitto and the real server with many protocol-level clients (issue 16, "Load"),
and with ``--secure`` the broker half of secure aggregation's cost (issue 26).

The REAL ``server.orchestrator.Orchestrator`` (FedAvg) runs in a process of its own against a mosquitto started by
``server.broker.Broker`` (one login per device, the edgefl ACL). The clients do not train: each is a real
``edge_client.wire.transport.MqttLink`` with its own credentials, run by a few worker processes (one thread per link),
that says hello, keeps each round's model from the broadcast (verified against its sha256; asking the server for one
it missed) and answers every assignment with a real encoded ``Update`` through the chunked publish path devices use.
The update of client ``i`` in round ``r`` is

    delta_i,r = float32(SCALE * c_i * r) * BASE,   c_i = 1 + i / N,   BASE[j] = 1 + (j mod 16) / 16

so FedAvg's result is known in closed form: ``w_r = w_{r-1} - mean_i delta_i,r``. After every round the observer
reads the server's checkpoint and checks it against that, element by element, with a tolerance 25 times smaller
than any one client's contribution: an update lost, counted twice or corrupted fails the round. It also records
what the server's metrics row says (clients reported, rejections by reason, the server's egress ``bytes_out``), the
server's and the broker's peak resident memory during the round (psutil, sampled every 20 ms) and each worker
process's peak.

The federation runs at a quarter, half and all of ``--clients`` (250, 500 and 1000 for ``--clients 1000``), or at the
sizes ``--sizes`` lists, each size with a fresh broker and a fresh server process, so the server's peak memory of each
size is its own. The file descriptor limit (RLIMIT_NOFILE) is raised to what the largest size needs, when the hard
limit allows, before the broker starts (it inherits it).

``--secure`` runs each size twice, plain and then with ``[privacy] secure_aggregation = true`` (each with its fresh
broker and server), so the two are measured side by side on the same machine state; it writes ``load-secure.json``
and ``.md`` (the plain mode's ``load.*`` stay as they were). In the secure run each client runs the real device half,
``edge_client.secagg.client.SecureClient``, wired as ``edge_client.loop.runtime`` wires it: keys on the assignment,
the deterministic update clipped, weighted and quantised as if trained, shares, masked input and reveal on the
server's stage messages. The clip norm is ``CLIP_MARGIN`` times the longest update of the run, so nothing is clipped
and the closed form still holds; the aggregate's tolerance adds the ring's quantisation error (``quantisation_error``,
from the round's ``Ring``), still far below one client's contribution, so a masked input lost, doubled or whose masks
do not cancel still fails the round. Stage deadlines are ``STAGE_DEADLINE_S``: a stage waits only until every device
answered, so a long deadline costs nothing, and a slow stage on this shared machine is measured, not dropped. The
clients do not train: a secure round's time here is the protocol, the transport and the server, not a device's
training.

    python -m benchmarks.load [--clients 1000 | --sizes 250,500,1000] [--rounds 10] [--params 100000] [--workers 4]
                              [--chunk-size 131072] [--secure [--neighbours 0]] [--quick] [--out DIR]

Quick (CI): 20 clients (5, 10, 20), 3 rounds, about 100k parameters.
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
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks.common import machine, machine_line, write_results
from edge_client.secagg.ring import Ring

if TYPE_CHECKING:  # needs the cryptography package: imported by a secure run only
    from edge_client.secagg.client import SecureClient

NAME = "load"
SCALE = 1e-3  # keeps 20 rounds of made-up updates far from float32 trouble
IN_FEATURES, NUM_CLASSES = 64, 10  # an MLP on digits-sized inputs: its hidden width sets the size
TEST_IMAGES = 16  # the evaluator's test set: evaluation must cost next to nothing here
REL_TOL = 1e-4  # of the round's mean update; one client's share is ~1/N of it (N <= 2000 keeps 5x margin)
TOLERANCE_SHARE = 0.5  # the most of one client's contribution to an element the tolerance on it may be
MEMORY_SLACK = 1.25  # late rounds' peak may exceed the early rounds' by this factor (plus MEMORY_SLACK_MB)
MEMORY_SLACK_MB = 100.0
JOB = "load"
SECURE_NAME = "load-secure"  # --secure's results: the plain load table is not overwritten
CLIP_MARGIN = 2.0  # --secure: the clip norm over the run's longest update (nothing is clipped)
STAGE_DEADLINE_S = 600.0  # --secure: measure a slow stage rather than drop its round (a stage ends when all answered)


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


def clip_norm_for(params: int, clients: int, rounds: int) -> float:
    """``CLIP_MARGIN`` times the longest update of the run (the last client's in the last round)."""
    longest = delta_for(base_vector(params), clients - 1, clients, rounds)
    return CLIP_MARGIN * float(np.linalg.norm(longest.astype(np.float64)))


def privacy_for(params: int, clients: int, rounds: int, neighbours: int) -> dict[str, Any]:
    """``[privacy]`` of a secure run: threshold and quantisation bits are the defaults."""
    return {"secure_aggregation": True, "clip_norm": clip_norm_for(params, clients, rounds),
            "neighbours": neighbours, "stage_deadline_s": STAGE_DEADLINE_S}  # fmt: skip


def round_ring(privacy: dict[str, Any], clients: int) -> Ring:
    """The ring of a round of ``clients`` devices under ``privacy``, as ``server.secagg.stages`` builds it."""
    from server.dp.settings import PrivacySection

    p = PrivacySection(**privacy)
    return Ring(p.quantisation_bits, p.clip_norm, clients)


def quantisation_error(ring: Ring) -> float:
    """The most the unmasked mean of a round's updates differs from their float mean, per element: each device's
    rounding to the ring's step (at most half of ``1 / scale``), over ``devices`` of them, divided by weights that
    sum to 1 (``Ring.decode``)."""
    return ring.devices / 2 / ring.scale


# ------------------------------------------------------------------------------------------------ client workers
def _serve_link(
    cid: str,
    password: str,
    url: str,
    clients: int,
    base: np.ndarray,
    chunk_size: int,
    stats: dict[str, Any],
    lock: threading.Lock,
) -> None:
    """One device at protocol level: hello, keep the round models it is sent (asking the server for one it missed, as
    ``edge_client.loop.runtime`` does), answer each assignment with the deterministic update until stop. A secure
    assignment is answered as the runtime does: ``SecureClient`` advertises keys, keeps the update as ring elements
    and answers the server's stage messages."""
    from edge_client.algorithms import contract_of
    from edge_client.loop.models_cache import ModelCache
    from edge_client.wire.messages import (
        Assignment,
        Failure,
        GlobalModel,
        Hello,
        Message,
        ModelRequest,
        Presence,
        SecAggRelay,
        SecAggRoster,
        SecAggUnmask,
        Stop,
        Update,
    )
    from edge_client.wire.protocol import encode
    from edge_client.wire.topics import Topics
    from edge_client.wire.transport import LinkConfig, MqttLink

    topics = Topics(JOB)
    index = client_index(cid)
    models = ModelCache(keep=1)
    waiting: list[Assignment] = []
    secure: SecureClient | None = None  # once a round is secure (it needs the cryptography package)
    link: MqttLink

    def send(msg: Message) -> int:
        return link.publish(topics.up(cid), encode(msg))

    def hello() -> None:
        send(Hello(client_id=cid, num_samples=1, device={"hostname": "load"}))

    def acknowledged(round_: int, deadline_s: float) -> None:
        """The round's upload (update or masked input) reached the broker; counted."""
        if not link.wait_published(timeout=deadline_s):
            raise TimeoutError(f"{cid}: round {round_} upload not acknowledged in {deadline_s} s")
        with lock:
            stats["updates_sent"] += 1

    def fail(round_: int, run_id: str, reason: str, exc: BaseException, deadline_s: float) -> None:
        """The runtime's failure report (the server stops waiting for this device), and an error for the parent."""
        send(Failure(round_, cid, reason, str(exc)[:2000], run_id=run_id))
        with lock:
            stats["errors"].append(f"{cid}: round {round_}: {reason}: {exc}")

    def served() -> None:
        facts = secure.facts if secure is not None else None  # the round whose masked input and reveal were sent
        assert facts is not None
        acknowledged(facts.round, facts.deadline_s)

    def start_secure(assignment: Assignment, delta: np.ndarray) -> None:
        """As ``edge_client.loop.runtime`` serves a secure assignment: keys now, the update once trained."""
        nonlocal secure
        a = assignment.facts
        if secure is None:
            from edge_client.secagg.client import SecureClient

            secure = SecureClient(cid, send, fail, served)
        secure.start(a)
        scalars = {"local_steps": assignment.plan.steps, "compute_s": 0.0, "cpu_s": 0.0, "train_loss": 0.0,
                   "metrics": {}}  # fmt: skip
        secure.trained({"delta": delta}, contract_of(a.algorithm).summed, 0.0, scalars)

    def answer(assignment: Assignment) -> None:
        a = assignment.facts
        if a.sha256 not in models:
            waiting[:] = [assignment]
            send(ModelRequest(a.round, cid, a.sha256, run_id=a.run_id))
            with lock:
                stats["model_requests"] += 1
            return
        waiting.clear()
        models.complete(assignment)
        size = assignment.plan.weights.size  # type: ignore[union-attr]
        if size != base.size:
            raise ValueError(f"{cid}: the round's model has {size} weights, expected {base.size}")
        delta = delta_for(base, index, clients, a.round)
        if a.secure and a.upload:  # the masked input follows the server's stage messages
            start_secure(assignment, delta)
            return
        update = Update(
            round=a.round,
            model_version=a.model_version,
            client_id=cid,
            num_samples=1,
            local_steps=assignment.plan.steps,
            compute_s=0.0,
            cpu_s=0.0,
            train_loss=0.0,
            delta=delta,
            run_id=a.run_id,
        )
        send(update)
        acknowledged(a.round, a.deadline_s)

    link = MqttLink(
        LinkConfig(url, cid, password, chunk_size=chunk_size),
        f"edgefl-{JOB}-{cid}",
        [topics.down(cid), topics.broadcast, topics.server, topics.round_model_frames],
        will=(topics.up(cid), encode(Presence(client_id=cid, online=False, reason="connection lost")), False),
        on_connect=hello,
        retained_once=[topics.round_model_frames],
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
            elif isinstance(msg, GlobalModel):
                if not models.add(msg):
                    raise ValueError(f"{cid}: round {msg.round}'s model does not hash to its digest")
                with lock:
                    stats["models_received"] += 1
                if waiting and waiting[0].facts.sha256 == msg.sha256:
                    answer(waiting[0])
            elif isinstance(msg, Assignment):
                answer(msg)
            elif isinstance(msg, (SecAggRoster, SecAggRelay, SecAggUnmask)) and secure is not None:
                secure.handle(msg)
        link.wait_published(timeout=10.0)
    except Exception as exc:  # reported to the parent: a dead client must not pass unnoticed
        with lock:
            stats["errors"].append(f"{cid}: {type(exc).__name__}: {exc}")
    finally:
        with lock:
            stats["bytes_in"] += link.bytes_in
        link.stop()


def worker(logins: list[tuple[str, str]], url: str, clients: int, params: int, chunk_size: int, results: Any) -> None:
    """A worker process holding many links (one thread each); reports its counters and peak RSS when all stop."""
    logging.basicConfig(level=logging.WARNING, format=f"worker {os.getpid()} %(levelname)s %(name)s: %(message)s")
    stats: dict[str, Any] = {"pid": os.getpid(), "links": len(logins), "updates_sent": 0, "model_requests": 0,
                             "models_received": 0, "bytes_in": 0, "errors": []}  # fmt: skip
    lock = threading.Lock()
    base = base_vector(params)  # read-only, shared by the links of this process
    threads = [
        threading.Thread(target=_serve_link, args=(cid, pw, url, clients, base, chunk_size, stats, lock), daemon=True)
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
    """Observer of the orchestrator: after each round compare the checkpointed weights with the closed form (within
    the ring's quantisation error when ``ring``, the secure rounds' ring, is given)."""

    def __init__(
        self, out_dir: Path, w0: np.ndarray, clients: int, sampler: PeakSampler, ring: Ring | None = None
    ) -> None:
        self.out_dir = out_dir
        self.previous = w0.astype(np.float64)
        self.base = base_vector(w0.size).astype(np.float64)
        self.clients = clients
        self.sampler = sampler
        self.quantisation = 0.0 if ring is None else quantisation_error(ring)
        self.rounds: list[dict[str, Any]] = []

    def waiting(self, text: str) -> None:
        pass

    def round_done(self, row: dict[str, Any]) -> None:
        r = row["round"]
        with np.load(self.out_dir / "checkpoint.npz") as ck:  # written with this row
            weights = ck["weights"].astype(np.float64)
        scale = np.mean([np.float32(SCALE * coefficient(i, self.clients) * r) for i in range(self.clients)])
        mean_update = scale * self.base
        expected = self.previous - mean_update
        tol = REL_TOL * np.abs(mean_update) + 1e-6 * np.abs(self.previous) + self.quantisation
        error = np.abs(weights - expected)
        one_client = SCALE * r * self.base / self.clients  # the least one update moves each element (c_i >= 1)
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
                "one_client_contribution_min": float(one_client.min()),
                "tolerance_share": float(np.max(tol / one_client)),  # of one client's contribution, worst element
                "bytes_up": sum(c["bytes_up"] for c in row["clients"].values()),
                "bytes_out": row["bytes_out"],
                "assignment_bytes": sum(i["bytes_down"] for i in row["instructions"].values()),
                # the server's link: the broadcast, the assignments and a secure round's stage messages
                "egress_bytes": row["bytes_out"] + sum(row.get("secure", {}).get("bytes_down", {}).values()),
                "server_peak_rss_mb": peaks["server"],
                "broker_peak_rss_mb": peaks["broker"],
                "dropped": row.get("dropped"),
                "secure": row.get("secure"),  # server.secagg.stages' row: stages' seconds and bytes, who dropped
                "device_secagg_s": device_stage_seconds(row),
            }
        )
        print(
            f"{self.clients} clients{' secure' if 'secure' in row else ''}, round {r:3d}: {row['round_s']:.2f} s, "
            f"{row['clients_reported']}/"
            f"{row['clients_selected']} reported, rejected {row['rejected'] or 'none'}, "
            f"aggregate {'exact' if self.rounds[-1]['aggregate_exact'] else 'WRONG'}, "
            f"out {row['bytes_out'] / 2**20:.1f} MiB, server peak {peaks['server']:.0f} MB, "
            f"broker peak {peaks['broker']:.0f} MB",
            file=sys.stderr,
            flush=True,
        )


def device_stage_seconds(row: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The devices' own seconds per secure stage (their clocks, the masked inputs' ``secagg`` telemetry): median and
    max over the round's devices; empty for a plain round."""
    costs = [c["device"]["secagg"] for c in row["clients"].values() if "secagg" in c.get("device", {})]
    stages = list(dict.fromkeys(k for c in costs for k in c))  # in the order the device runs them
    return {k: {"median": statistics.median(c[k] for c in costs if k in c), "max": max(c.get(k, 0.0) for c in costs)}
            for k in stages}  # fmt: skip


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


def sizes_for(clients: int) -> list[int]:
    """A quarter, half and all of ``clients`` (distinct, at least 1)."""
    return sorted({max(1, clients // 4), max(1, clients // 2), clients})


def raise_fd_limit(needed: int) -> dict[str, int]:
    """Raise RLIMIT_NOFILE's soft limit to ``needed`` (up to the hard limit); the limits before and after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = soft if soft >= needed else min(needed, hard) if hard != resource.RLIM_INFINITY else needed
    if target != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return {"soft_before": soft, "soft": target, "hard": hard, "needed": needed}


def fds_needed(clients: int) -> int:
    """Descriptors the broker needs (one socket per device plus the server and its own files), with room to spare;
    each worker process needs about 3 per link (socket and paho's wake-up pair), the workers share the clients."""
    return 2 * clients + 256


def run_size(
    clients: int, rounds: int, params: int, workers: int, chunk_size: int, privacy: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One federation of ``clients`` devices through a fresh broker, the server in this process; ``privacy``: the
    run's ``[privacy]`` section (``privacy_for``: secure aggregation), None for plain rounds."""
    import torch

    from edge_client.learning.data import ArrayDataset
    from edge_client.learning.models import build_model, get_flat
    from edge_client.wire.messages import GlobalModel, model_digest
    from edge_client.wire.protocol import encode
    from edge_client.wire.transport import LinkConfig
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
                "clients": {"count": clients, "register_timeout_s": 600.0, "round_deadline_s": 600.0},
                "train": {"algorithm": "fedavg", "local_steps": 1, "batch_size": 1, "lr": 0.1},
                **({"privacy": privacy} if privacy else {}),
            }
        )
        torch.manual_seed(config.run.seed)  # what Orchestrator.run does before it builds the initial model
        w0 = get_flat(build_model(spec))
        model_bytes = len(encode(GlobalModel(0, 0, model_digest(w0, {}), w0)))
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        logins = [(cid, broker.devices[cid].password) for cid in ids]
        procs = [
            ctx.Process(
                target=worker, args=(logins[k::workers], broker.url, clients, w0.size, chunk_size, results), daemon=True
            )
            for k in range(workers)
        ]
        for p in procs:
            p.start()
        sampler = stack.enter_context(PeakSampler(broker.process.pid))  # type: ignore[union-attr]
        checker = Checker(tmp / "run", w0, clients, sampler, round_ring(privacy, clients) if privacy else None)
        orch = Orchestrator(
            config,
            LinkConfig(broker.url, broker.server.username, broker.server.password, chunk_size=chunk_size),
            Evaluator(spec, test),
            spec,
            tmp / "run",
            observer=checker,
        )
        t0 = time.perf_counter()
        summary = orch.run()
        wall = time.perf_counter() - t0
        worker_stats = [results.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        broker_log = broker.log_path.read_text(errors="replace")
    per_round = checker.rounds
    times = [r["round_s"] for r in per_round]
    data: dict[str, Any] = {
        "clients": clients,
        "secure": bool(privacy),
        "privacy": privacy or {},
        "params": int(w0.size),
        "update_bytes": int(w0.nbytes),
        "model_message_bytes": model_bytes,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "wall_s": wall,
        "per_round": per_round,
        "round_s": {"median": statistics.median(times), "p95": _pct(times, 0.95), "max": max(times)},
        "bytes_per_round": {
            "up": statistics.median(r["bytes_up"] for r in per_round),
            "out": statistics.median(r["bytes_out"] for r in per_round),
            "out_max": max(r["bytes_out"] for r in per_round),
            "assignments": statistics.median(r["assignment_bytes"] for r in per_round),
            "egress": statistics.median(r["egress_bytes"] for r in per_round),
        },
        "rejected_total": summary.get("rejected", {}),
        "workers_report": worker_stats,
        "client_errors": [e for w in worker_stats for e in w["errors"]],
        "updates_sent": sum(w["updates_sent"] for w in worker_stats),
        "model_requests": sum(w["model_requests"] for w in worker_stats),
        "models_received": sum(w["models_received"] for w in worker_stats),
        "broker_dropped_messages": "Outgoing messages are being dropped" in broker_log,
        "server_peak_rss_mb": max(r["server_peak_rss_mb"] for r in per_round),
        "broker_peak_rss_mb": max(r["broker_peak_rss_mb"] for r in per_round),
        "server_memory": memory_verdict(per_round, "server_peak_rss_mb"),
    }
    # one model per round: the broadcast (plus one per device that had to ask) and the small assignments
    allowed_out = (1 + data["model_requests"]) * model_bytes * 1.01 + 4096 * clients
    data["checks"] = {
        "all_rounds_ran": len(per_round) == rounds,
        "no_update_lost": all(r["clients_reported"] == clients and not r["missing"] for r in per_round)
        and data["updates_sent"] == clients * rounds,
        "no_duplicate_accepted": all(r["clients_reported"] <= clients for r in per_round)
        and not any(r["rejected"].get("duplicate") for r in per_round),
        "aggregate_exact": all(r["aggregate_exact"] for r in per_round),
        # else "exact" could not tell an update lost or doubled (secure: the ring's rounding grows with the fleet)
        "tolerance_below_one_client": all(r["tolerance_share"] <= TOLERANCE_SHARE for r in per_round),
        "one_model_per_round": all(r["bytes_out"] <= allowed_out for r in per_round),
        "server_memory_bounded": data["server_memory"]["bounded"],
        "no_client_errors": not data["client_errors"],
    }
    if privacy:
        data["secure_summary"] = secure_summary(per_round)
        data["checks"]["every_round_secure"] = all(
            r["secure"] is not None
            and not r["dropped"]
            and r["secure"]["masked"] == clients
            and not r["secure"]["dropped_before_masking"]
            and not r["secure"]["dropped_after_masking"]
            for r in per_round
        )
    return data


def secure_summary(per_round: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds of a secure run's stages: seconds (server clock), bytes up (the devices' links) and
    down (the server's link) per stage, and the devices' own seconds per stage (their clocks)."""
    from server.secagg.stages import STAGES  # needs the cryptography package, as a secure run does

    rows = [r["secure"] for r in per_round if r["secure"]]

    def median_of(key: str) -> dict[str, float]:
        stages = [s for s in STAGES if any(s in x[key] for x in rows)]
        return {s: statistics.median(x[key].get(s, 0) for x in rows) for s in stages}

    devices = [r["device_secagg_s"] for r in per_round if r["device_secagg_s"]]
    device_stages = list(dict.fromkeys(k for d in devices for k in d))
    return {
        "threshold": max((x["threshold"] for x in rows), default=0),
        "neighbours": max((x["neighbours"] for x in rows), default=0),
        "stage_s": median_of("stage_s"),
        "bytes_up": median_of("bytes_up"),
        "bytes_down": median_of("bytes_down"),
        "device_s": {k: statistics.median(d[k]["median"] for d in devices if k in d) for k in device_stages},
        "device_s_max": {k: max(d[k]["max"] for d in devices if k in d) for k in device_stages},
    }


def _size_process(args: tuple[Any, ...], results: Any) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        results.put(run_size(*args))
    except BaseException as exc:  # the parent reports it
        results.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def _run_in_process(clients: int, *args: Any) -> dict[str, Any]:
    """``run_size(clients, *args)`` with its server in a process of its own (its peak memory is its own)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_size_process, args=((clients, *args), results))
    proc.start()
    result = results.get()  # the child ends only after this is read (its queue feeder flushes first)
    proc.join()
    if "error" in result:
        raise RuntimeError(f"the run with {clients} clients failed: {result['error']}")
    return result


def run(
    sizes: list[int],
    rounds: int,
    params: int,
    workers: int,
    chunk_size: int,
    quick: bool,
    out: Path | None,
    secure: bool = False,
    neighbours: int = 0,
    sizes_given: bool = False,
) -> dict[str, Any]:
    """Every size, one after another; with ``secure`` each size plain and then with secure aggregation (SecAgg+'s
    graph of degree ``neighbours``, 0: complete), written as ``load-secure``. ``sizes_given``: from ``--sizes``."""
    fd = raise_fd_limit(fds_needed(max(sizes)))
    runs, secure_runs = [], []
    for n in sizes:
        runs.append(_run_in_process(n, rounds, params, workers, chunk_size))
        if secure:
            privacy = privacy_for(params, n, rounds, neighbours)
            secure_runs.append(_run_in_process(n, rounds, params, workers, chunk_size, privacy))
    data: dict[str, Any] = {
        "name": SECURE_NAME if secure else NAME,
        "quick": quick,
        "secure": secure,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {
            "clients": max(sizes),
            "sizes": sizes,
            "sizes_given": sizes_given,
            "rounds": rounds,
            "params_requested": params,
            "params": runs[0]["params"],
            "model": model_spec(params),
            "workers": workers,
            "chunk_size": chunk_size,
            "update_bytes": runs[0]["update_bytes"],
            "test_images": TEST_IMAGES,
            "broker": {"max_inflight_messages": 20, "max_queued_messages": 10000, "max_packet_size": 16 * 2**20},
            **(
                {"neighbours": neighbours, "clip_margin": CLIP_MARGIN, "stage_deadline_s": STAGE_DEADLINE_S}
                if secure
                else {}
            ),
        },
        "fd_limit": fd,
        "runs": runs,
        **({"secure_runs": secure_runs} if secure else {}),
    }
    small, large = runs[0], runs[-1]
    flat_bound = MEMORY_SLACK * small["server_peak_rss_mb"] + MEMORY_SLACK_MB
    data["server_memory_across_sizes"] = {
        "smallest_mb": small["server_peak_rss_mb"],
        "largest_mb": large["server_peak_rss_mb"],
        "bound_mb": flat_bound,
        "flat": large["server_peak_rss_mb"] <= flat_bound,
        "mb_per_100_clients": (large["server_peak_rss_mb"] - small["server_peak_rss_mb"])
        / max(1, large["clients"] - small["clients"])
        * 100,
    }
    every = runs + secure_runs
    data["checks"] = {k: all(r["checks"][k] for r in every if k in r["checks"]) for r0 in every for k in r0["checks"]}
    data["checks"]["server_memory_flat_across_sizes"] = data["server_memory_across_sizes"]["flat"]
    write_results(data["name"], data, render_secure(data) if secure else render(data), out)
    return data


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def command(data: dict[str, Any]) -> str:
    """The command line that produced ``data``."""
    cfg = data["config"]
    sizes = [f"--sizes {','.join(map(str, cfg['sizes']))}"] if cfg.get("sizes_given") else []
    flags = ["--quick", *sizes] if data["quick"] else [
        *(sizes or [f"--clients {cfg['clients']}"]), f"--rounds {cfg['rounds']}", f"--params {cfg['params_requested']}",
        f"--workers {cfg['workers']}", f"--chunk-size {cfg['chunk_size']}",
    ]  # fmt: skip
    if data.get("secure"):
        flags.append(f"--secure --neighbours {cfg['neighbours']}")
    return " ".join(["python -m benchmarks.load", *flags])


def render(data: dict[str, Any]) -> str:
    cfg, checks, runs = data["config"], data["checks"], data["runs"]
    mem = data["server_memory_across_sizes"]
    fd = data["fd_limit"]
    cmd = command(data)
    worst_err = max(
        r["aggregate_max_error"] / r["one_client_contribution_min"] for run in runs for r in run["per_round"]
    )
    sizes = ", ".join(str(n) for n in cfg["sizes"])
    lines = [
        "## 6. Load: many protocol-level clients through one mosquitto",
        "",
        f"Command: `{cmd}` (mode: {'quick' if data['quick'] else 'full'})",
        "",
        machine_line(data["machine"]),
        "",
        "Load average (1/5/15 min) before / after each size: "
        + "; ".join(
            f"{r['clients']} clients {'/'.join(f'{x:.1f}' for x in r['loadavg_before'])} -> "
            f"{'/'.join(f'{x:.1f}' for x in r['loadavg_after'])}"
            for r in runs
        )
        + ". Times are wall clock (`time.monotonic` in the server process) on this shared machine.",
        "",
        f"Setup: the real orchestrator (FedAvg) in a process of its own and a fresh mosquitto from "
        f"`server.broker.Broker` for each size (one login per device, the ACL; max_inflight_messages "
        f"{cfg['broker']['max_inflight_messages']}, max_queued_messages {cfg['broker']['max_queued_messages']}, "
        f"max_packet_size {cfg['broker']['max_packet_size']}); {sizes} `MqttLink` clients in {cfg['workers']} worker "
        f"processes, no training; model {cfg['model']} = {cfg['params']} parameters, {cfg['update_bytes']} bytes "
        f"per update; chunk size {cfg['chunk_size']} bytes on both sides (every update and the broadcast travel as "
        f"chunk frames); {cfg['rounds']} rounds; evaluation on {cfg['test_images']} made-up images. File descriptors: "
        f"RLIMIT_NOFILE soft {fd['soft_before']} -> {fd['soft']} (hard {fd['hard']}; {fd['needed']} wanted for the "
        "largest size).",
        "",
        "| clients | server peak RSS MB | broker peak RSS MB | round s median / p95 / max | server egress per round "
        "MiB (model message; assignments) | updates in per round MiB | updates accepted | devices that asked for the "
        "model | aggregate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        rt, b = r["round_s"], r["bytes_per_round"]
        reported = [x["clients_reported"] for x in r["per_round"]]
        lines.append(
            f"| {r['clients']} | {r['server_peak_rss_mb']:.0f} | {r['broker_peak_rss_mb']:.0f} | "
            f"{rt['median']:.2f} / {rt['p95']:.2f} / {rt['max']:.2f} | {_mib(b['out'])} "
            f"({_mib(r['model_message_bytes'])}; {_mib(b['assignments'])}) | {_mib(b['up'])} | "
            f"{min(reported)}-{max(reported)} of {r['clients']} every round, {r['updates_sent']} sent | "
            f"{r['model_requests']} | {'exact every round' if r['checks']['aggregate_exact'] else 'WRONG'} |"
        )
    lines += [
        "",
        "| figure | measured | target | result |",
        "|---|---|---|---|",
        f"| updates accepted | every round of every size: {all(r['checks']['no_update_lost'] for r in runs)} | "
        f"every client, every round | {_verdict(checks['no_update_lost'] and checks['all_rounds_ran'])} |",
        f"| duplicates accepted | rejections {[r['rejected_total'] or 'none' for r in runs]} | none | "
        f"{_verdict(checks['no_duplicate_accepted'])} |",
        f"| aggregate vs closed form | worst error {worst_err:.3f} of one client's smallest contribution | "
        f"every element within tolerance | {_verdict(checks['aggregate_exact'])} |",
        f"| server egress per round | max {max(_mib(r['bytes_per_round']['out_max']) for r in runs)} MiB; model "
        f"message {_mib(runs[-1]['model_message_bytes'])} MiB | one model (plus one per device that asked) and "
        f"about 0.5 kB per assignment | {_verdict(checks['one_model_per_round'])} |",
        f"| server peak RSS, {runs[-1]['clients']} vs {runs[0]['clients']} clients | {mem['largest_mb']:.0f} MB vs "
        f"{mem['smallest_mb']:.0f} MB ({mem['mb_per_100_clients']:+.1f} MB per 100 clients) | <= {MEMORY_SLACK} x "
        f"smallest + {MEMORY_SLACK_MB:.0f} MB = {mem['bound_mb']:.0f} MB | "
        f"{_verdict(checks['server_memory_flat_across_sizes'])} |",
        "| server peak RSS within each run, late rounds vs early | "
        + "; ".join(
            f"{r['clients']}: {r['server_memory']['late_max_mb']:.0f} vs {r['server_memory']['early_max_mb']:.0f} MB"
            for r in runs
        )
        + f" | <= {MEMORY_SLACK} x early + {MEMORY_SLACK_MB:.0f} MB | {_verdict(checks['server_memory_bounded'])} |",
        f"| client errors | {sum(len(r['client_errors']) for r in runs)} | 0 | "
        f"{_verdict(checks['no_client_errors'])} |",
        "",
        "Broker dropped messages: "
        + ", ".join(f"{r['clients']}: {'YES' if r['broker_dropped_messages'] else 'no'}" for r in runs)
        + ". Worker processes' peak RSS (largest size): "
        + ", ".join(f"{w['peak_rss_mb']:.0f} MB ({w['links']} links)" for w in runs[-1]["workers_report"])
        + ".",
    ]
    for r in runs:
        lines += [
            "",
            f"{r['clients']} clients, per round:",
            "",
            "| round | round s | aggregate s | eval s (beside the next round) | reported | rejected | MiB out | "
            "MiB up | server peak MB | broker peak MB | aggregate |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for x in r["per_round"]:
            lines.append(
                f"| {x['round']} | {x['round_s']:.2f} | {x['aggregate_s']:.3f} | {x['eval_s']:.3f} | "
                f"{x['clients_reported']}/{x['clients_selected']} | {x['rejected'] or '-'} | {_mib(x['bytes_out'])} "
                f"| {_mib(x['bytes_up'])} | {x['server_peak_rss_mb']:.0f} | {x['broker_peak_rss_mb']:.0f} | "
                f"{'exact' if x['aggregate_exact'] else 'WRONG'} |"
            )
        lines += _client_errors(r)
    return "\n".join(lines) + "\n"


def _client_errors(run: dict[str, Any]) -> list[str]:
    """Markdown lines listing a run's first client errors (none: no lines)."""
    errors = run["client_errors"][:10]
    return ["", "Client errors (first 10):", "", *(f"- {e}" for e in errors)] if errors else []


def _ratio(secure: float, plain: float) -> str:
    return f"{secure / plain:.2f}x" if plain else "-"


def _stages(values: dict[str, float], fmt: str) -> str:
    return " / ".join(f"{k} {format(v, fmt)}" for k, v in values.items()) or "-"


def render_secure(data: dict[str, Any]) -> str:
    """``--secure``'s table: each size plain and secure side by side, then the secure rounds' stages."""
    cfg, checks, fd = data["config"], data["checks"], data["fd_limit"]
    pairs = list(zip(data["runs"], data["secure_runs"], strict=True))
    secure_rounds = [r for _, run in pairs for r in run["per_round"]]
    worst_error = max(r["aggregate_max_error"] / r["one_client_contribution_min"] for r in secure_rounds)
    worst_tol = max(r["tolerance_share"] for r in secure_rounds)
    lines = [
        "## Load with secure aggregation: plain and secure rounds side by side through one mosquitto",
        "",
        f"Command: `{command(data)}` (mode: {'quick' if data['quick'] else 'full'}, secure)",
        "",
        machine_line(data["machine"]),
        "",
        "Load average (1/5/15 min) before each run: "
        + "; ".join(
            f"{r['clients']} {'secure' if r['secure'] else 'plain'} {'/'.join(f'{x:.1f}' for x in r['loadavg_before'])}"
            for pair in pairs
            for r in pair
        )
        + ". Times are wall clock (`time.monotonic` in the server process) on this shared machine, except the "
        "devices' own stage seconds (`time.perf_counter` in the client worker processes).",
        "",
        f"Setup: for each size, a plain run and then a secure one (`[privacy] secure_aggregation = true`), each with "
        f"the real orchestrator (FedAvg) in a process of its own and a fresh mosquitto from `server.broker.Broker`; "
        f"`MqttLink` clients in {cfg['workers']} worker processes that do not train: each answers its assignment with "
        f"a made-up update (a secure client runs the real `edge_client.secagg.client.SecureClient`: keys, shares, "
        f"masked input, reveal), so a round's time is the protocol, the transport and the server, not training. Model "
        f"{cfg['model']} = {cfg['params']} parameters, {cfg['update_bytes']} bytes per fp32 update; chunk size "
        f"{cfg['chunk_size']} bytes; {cfg['rounds']} rounds per run. Secure: `neighbours = {cfg['neighbours']}` "
        f"({'0: the complete graph' if not cfg['neighbours'] else 'SecAgg+; the complete graph when not fewer devices'}"
        f"), the default threshold and 32-bit ring, `clip_norm` {cfg['clip_margin']} x the longest update of the run "
        f"(nothing clipped), stage deadlines {cfg['stage_deadline_s']:.0f} s. RLIMIT_NOFILE soft {fd['soft']} "
        f"(hard {fd['hard']}).",
        "",
        "| devices | round s median, plain / secure (ratio) | bytes up per device and round, plain / secure (ratio; "
        "the devices' links) | server egress per round MiB, plain / secure (ratio; the server's link) | server peak "
        "RSS MB, plain / secure | aggregate |",
        "|---|---|---|---|---|---|",
    ]
    for plain, sec in pairs:
        n = plain["clients"]
        up = [r["bytes_per_round"]["up"] / n for r in (plain, sec)]
        out = [r["bytes_per_round"]["egress"] for r in (plain, sec)]
        t = [r["round_s"]["median"] for r in (plain, sec)]
        exact = plain["checks"]["aggregate_exact"] and sec["checks"]["aggregate_exact"]
        lines.append(
            f"| {n} | {t[0]:.2f} / {t[1]:.2f} ({_ratio(t[1], t[0])}) | {up[0]:,.0f} / {up[1]:,.0f} "
            f"({_ratio(up[1], up[0])}) | {_mib(out[0])} / {_mib(out[1])} ({_ratio(out[1], out[0])}) | "
            f"{plain['server_peak_rss_mb']:.0f} / {sec['server_peak_rss_mb']:.0f} | "
            f"{'within tolerance every round' if exact else 'WRONG'} |"
        )
    lines += [
        "",
        "Secure rounds, medians over the rounds: each stage's seconds (server clock), bytes up per device (the "
        "devices' links) and bytes down (the server's link, all devices), and a device's own seconds (its clock; "
        "median over devices, and the largest of any device in any round):",
        "",
        "| devices | neighbours | t | stage s | stage bytes up per device | stage bytes down, all devices | device s "
        "median | device s max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for _, sec in pairs:
        x, n = sec["secure_summary"], sec["clients"]
        lines.append(
            f"| {n} | {x['neighbours']} | {x['threshold']} | {_stages(x['stage_s'], '.3f')} | "
            f"{_stages({k: v / n for k, v in x['bytes_up'].items()}, ',.0f')} | {_stages(x['bytes_down'], ',.0f')} | "
            f"{_stages(x['device_s'], '.4f')} | {_stages(x['device_s_max'], '.4f')} |"
        )
    lines += [
        "",
        "| check | result |",
        "|---|---|",
        *(f"| {k} | {_verdict(ok)} |" for k, ok in checks.items()),
        "",
        f"Secure aggregate against the closed form: worst error {worst_error:.2g} of one client's smallest "
        f"contribution to an element; the tolerance, at most {worst_tol:.2g} of one client's contribution to its "
        f"element (limit {TOLERANCE_SHARE}), includes the ring's quantisation error (`devices / 2 / scale` of the "
        "round's ring).",
    ]
    for _, sec in pairs:
        lines += [
            "",
            f"{sec['clients']} devices, secure, per round:",
            "",
            "| round | round s | stage s (server clock) | reported | dropped | bytes up per device | egress MiB | "
            "aggregate |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in sec["per_round"]:
            x = r["secure"] or {}
            gone = x.get("dropped_before_masking", []) + x.get("dropped_after_masking", [])
            lines.append(
                f"| {r['round']} | {r['round_s']:.2f} | {_stages(x.get('stage_s', {}), '.3f')} | "
                f"{r['clients_reported']}/{r['clients_selected']} | {r['dropped'] or gone or '-'} | "
                f"{r['bytes_up'] / sec['clients']:,.0f} | {_mib(r['egress_bytes'])} | "
                f"{'within tolerance' if r['aggregate_exact'] else 'WRONG'} |"
            )
        lines += _client_errors(sec)
    return "\n".join(lines) + "\n"


def _sizes(text: str) -> list[int]:
    """``--sizes 10,50,100``: distinct federation sizes, in increasing order."""
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes like 10,50,100, got {text!r}") from None
    if not sizes or sizes[0] < 2:
        raise argparse.ArgumentTypeError(f"expected sizes >= 2 like 10,50,100, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 clients (5, 10, 20), 3 rounds, ~100k parameters (CI)")
    parser.add_argument(
        "--clients", type=int, default=None, help="largest size; also run at 1/4 and 1/2 (default 1000)"
    )
    parser.add_argument("--sizes", type=_sizes, default=None, help="the sizes to run, e.g. 10,50,100 (not --clients)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per size (default 10, quick 3)")
    parser.add_argument("--params", type=int, default=100_000, help="model size (default 100000)")
    parser.add_argument("--workers", type=int, default=4, help="client worker processes (default 4)")
    parser.add_argument("--chunk-size", type=int, default=128 << 10, help="chunk size of every link (default 128 KiB)")
    parser.add_argument(
        "--secure",
        action="store_true",
        help=f"each size plain, then with secure aggregation; writes {SECURE_NAME}.json and .md",
    )
    parser.add_argument(
        "--neighbours", type=int, default=0, help="--secure: SecAgg+'s graph degree (even; default 0: complete graph)"
    )
    parser.add_argument("--out", type=Path, default=None, help="results directory (default: benchmarks/results)")
    args = parser.parse_args(argv)
    if args.sizes and args.clients:
        parser.error("--sizes and --clients are exclusive: --sizes lists every size, --clients derives three")
    clients = args.clients or (20 if args.quick else 1000)
    sizes = args.sizes or sizes_for(clients)
    rounds = args.rounds or (3 if args.quick else 10)
    checks = (("--clients", clients, 4), ("--rounds", rounds, 2), ("--params", args.params, 100),
              ("--chunk-size", args.chunk_size, 4096))  # fmt: skip
    for flag, value, low in checks:
        if value < low:
            parser.error(f"{flag} must be >= {low}, got {value}")
    if args.secure:  # the run's own check of [privacy], before any broker starts
        from server.dp.settings import PrivacySection
        from server.secagg.settings import secure_refusal_of

        refused = secure_refusal_of(PrivacySection(**privacy_for(args.params, sizes[-1], rounds, args.neighbours)),
                                    "fedavg")  # fmt: skip
        if refused:
            parser.error(refused)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    data = run(sizes, rounds, args.params, args.workers, args.chunk_size, args.quick, args.out, args.secure,
               args.neighbours, sizes_given=args.sizes is not None)  # fmt: skip
    failed = [k for k, ok in data["checks"].items() if not ok]
    every = data["runs"] + data.get("secure_runs", [])
    print(
        f"{data['name']}: {sizes} clients x {rounds} rounds x {data['config']['params']} params: server peak "
        + ", ".join(f"{r['server_peak_rss_mb']:.0f} MB" for r in every)
        + "; round median "
        + ", ".join(f"{r['round_s']['median']:.2f} s{' secure' if r['secure'] else ''}" for r in every)
        + "; "
        + (f"MISSED {failed}" if failed else "all checks passed"),
        file=sys.stderr,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
