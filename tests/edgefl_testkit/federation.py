"""Federations of real client processes, and configs for runs built by hand."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_client.wire.transport import LinkConfig
from server.assembly import make_orchestrator, split_clients
from server.broker import Broker
from server.config import RunConfig, from_dict
from server.datasets import DatasetBundle, load_dataset
from server.experiments.inprocess import run_inprocess
from server.experiments.simulate import (
    ClientLogin,
    client_ids,
    prepare_shards,
    run_processes,
    start_clients,
    stop_clients,
)
from server.orchestrator import Orchestrator


class Hooks:
    """Observer that keeps every metrics row; ``attach`` also runs a test's action after a given round, on the
    orchestrator's own thread: once round N's model is produced, before round N+1's assignments go out (its row comes
    later, when its evaluation is done)."""

    def __init__(self, actions: dict[int, Callable[[], None]] | None = None) -> None:
        self.actions = actions or {}
        self.rows: list[dict[str, Any]] = []

    def attach(self, orch: Orchestrator) -> Hooks:
        orch.observer = self
        assign = orch._assign

        def hooked(round_: int, *args: Any) -> Any:
            if round_ - 1 in self.actions:
                self.actions[round_ - 1]()
            return assign(round_, *args)

        orch._assign = hooked  # type: ignore[method-assign]  # this instance only
        return self

    def waiting(self, text: str) -> None:
        pass

    def round_done(self, row: dict[str, Any]) -> None:
        self.rows.append(row)


def make_config(
    tmp_path: Path,
    job: str,
    clients: int,
    rounds: int,
    train: dict[str, Any] | None = None,
    algorithm_params: dict[str, Any] | None = None,
    partition: str = "iid",
    dataset: str = "digits",
    model: dict[str, Any] | None = None,
    privacy: dict[str, Any] | None = None,
    simulation: dict[str, Any] | None = None,
    **clients_section: Any,
) -> RunConfig:
    train = {"local_steps": 20, "batch_size": 32, "lr": 0.1, **(train or {})}
    return from_dict(
        {
            **({"model": model} if model else {}),
            "run": {"rounds": rounds, "out": str(tmp_path / job), "job": job, "target_accuracy": 0.5},
            # register_timeout_s is a ceiling: a loaded machine takes over a minute to start 20 client processes
            "clients": {"count": clients, "register_timeout_s": 180.0, **clients_section},
            "simulation": simulation or {},
            "data": {"dataset": dataset, "partition": partition},
            "train": train,
            "algorithm": {train.get("algorithm", "fedavg"): algorithm_params or {}},
            **({"privacy": privacy} if privacy else {}),
        }
    )


#: A client's broker URL and password, by client id: where a federation's clients log in.
ClientBroker = Callable[[str], tuple[str, str]]


def run_simulated(
    mode: str, config: RunConfig, bundle: DatasetBundle, broker: Broker
) -> tuple[dict[str, Any], list[str], list[Path]]:
    """Run ``config`` as ``edge-server simulate`` does, with client processes on ``broker`` (mode "broker") or on the
    in-process bus ("inprocess"); the summary, the client ids and their shards."""
    ids, out = client_ids(config.clients.count), Path(config.run.out)
    shards, _ = prepare_shards(bundle, ids, config.data.partition, config.run.seed, out / "shards")
    if mode == "broker":
        logins = {c: ClientLogin(c, (broker.devices.get(c) or broker.add_device(c)).password) for c in ids}
        link = LinkConfig(broker.url, broker.server.username, broker.server.password)
        return run_processes(config, shards, link, logins, bundle, out), ids, shards
    return run_inprocess(config, shards, bundle, out), ids, shards


def start_federation(
    tmp_path: Path,
    link: LinkConfig,
    client_broker: ClientBroker,
    job: str,
    clients: int = 3,
    rounds: int = 3,
    dataset: str = "digits",
    once: bool = True,
    **settings: Any,
) -> tuple[Orchestrator, dict[str, subprocess.Popen]]:
    """Start client processes client-00.. (each on the broker ``client_broker`` names) and build the server on ``link``.

    ``settings``: ``train={...}``, ``algorithm_params={...}``, ``simulation={...}`` and keys of the [clients]
    section; ``dataset``: a built-in name or a path (`load_dataset`), e.g. an npz subset a test wrote; ``once``: the
    clients exit when the run ends (else they wait for the next run, as devices do).
    """
    config = make_config(tmp_path, job, clients, rounds, dataset=dataset, **settings)
    config.broker.max_packet_size = link.max_packet_size or 0
    bundle = load_dataset(dataset, seed=0)
    out = Path(config.run.out)
    bundle, root = split_clients(config, bundle)
    shards, _ = prepare_shards(bundle, client_ids(clients), config.data.partition, 0, out / "shards")
    urls, logins = {}, {}
    for cid in client_ids(clients):  # each device logs in as itself: the ACL allows nothing else
        urls[cid], password = client_broker(cid)
        logins[cid] = ClientLogin(cid, password)
    procs = start_clients(config, urls, logins, shards, out, once=once)
    return make_orchestrator(config, bundle, out, link_config=link, root=root), procs


def end_federation(procs: dict[str, subprocess.Popen]) -> dict[str, int]:
    """Stop the client processes (a test may have stopped one: let it die normally); their exit codes."""
    for proc in procs.values():
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
    return stop_clients(procs, timeout=20)


def run_to_end(orch: Orchestrator, procs: dict[str, subprocess.Popen]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run the server to its last round and stop the clients; the summary and the metrics rows.

    Every client must have exited with 0, i.e. on the server's stop message, which crossed whatever brokers lie between.
    """
    try:
        summary = orch.run()
    finally:
        codes = end_federation(procs)
    assert codes == dict.fromkeys(procs, 0), f"client exit codes {codes}: not every client stopped on the stop message"
    return summary, [json.loads(line) for line in (orch.out_dir / "metrics.jsonl").read_text().splitlines()]


def restart_client(proc: subprocess.Popen, password: str, log: Path) -> subprocess.Popen:
    """The same `edge-client run` command (same id, data and --state-dir) as a new process."""
    env = {**os.environ, "EDGEFL_PASSWORD": password, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with log.open("w") as fh:
        return subprocess.Popen(proc.args, stdout=fh, stderr=subprocess.STDOUT, env=env)


def checkpointed_round(out: Path) -> int:
    """The last round in ``out/checkpoint.npz`` (replaced atomically, so never half-written), 0 before the first.

    Waiting on metrics.jsonl instead would race: its row is written just before the round's checkpoint.
    """
    try:
        with np.load(out / "checkpoint.npz") as saved:
            return int(saved["round"])
    except FileNotFoundError:
        return 0


def reported(caplog: pytest.LogCaptureFixture, round_: int, cid: str) -> int:
    """How many updates of ``cid`` the server accepted for ``round_`` (one log line per accepted update)."""
    return sum(r.getMessage().startswith(f"round {round_}: {cid} reported") for r in caplog.records)
