"""Shared fixtures: one real mosquitto per test session and connected paho clients.

A missing mosquitto skips the broker tests on a developer machine but FAILS under CI, so a CI image without the
broker cannot pass silently.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from paho.mqtt.client import CallbackAPIVersion, Client
from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge_client.algorithms.base import ClientAlgorithm
from edge_client.codecs import parse as parse_codec
from edge_client.data import ArrayDataset, BatchSampler
from edge_client.flat import FlatModel
from edge_client.messages import Assignment, Update
from edge_client.trainer import TrainResult, train_local
from edge_client.transport import LinkConfig
from server.admission import Admission, RoundState
from server.assembly import make_orchestrator, split_clients
from server.broker import Broker, BrokerSettings, MosquittoNotInstalled, find_mosquitto
from server.config import RunConfig, TrainSection, from_dict
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
from server.strategies import Strategy

CONNECT_TIMEOUT = 10.0
DEVICES = [f"c{i}" for i in range(10)]
MqttClientFactory = Callable[..., Client]
CHANCE = 0.1  # ten classes in digits


SESSION_MARK = "EDGEFL_TEST_SESSION"  # in the environment of every process the suite starts


def pytest_configure(config: pytest.Config) -> None:
    os.environ[SESSION_MARK] = uuid.uuid4().hex  # inherited by every process a test starts (env={**os.environ, ...})


def _left_behind() -> list[psutil.Process]:
    """Processes still carrying this session's mark: started by a test and never stopped (orphans included)."""
    mark = os.environ[SESSION_MARK]
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid not in mine and proc.environ().get(SESSION_MARK) == mark:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:300]}"
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return str(proc.pid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a test left a process behind (a broker, a client, a server): it would outlive the suite on a
    developer's machine and take CPU from every later test. Those still running get 10 s to exit, then are killed."""
    _, alive = psutil.wait_procs(_left_behind(), timeout=10)
    if not alive:
        return
    lines = [_describe(p) for p in alive]
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write("\n")
        reporter.write_sep("=", f"{len(lines)} process(es) left running by tests (killed now)", red=True)
        for line in lines:
            reporter.write_line(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def poll(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait until ``check()`` holds, or fail saying ``what`` did not happen within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def require_mosquitto() -> None:
    """Skip (developer machine) or fail (CI) when there is no mosquitto."""
    try:
        find_mosquitto()
    except MosquittoNotInstalled as exc:
        if in_ci():
            pytest.fail(str(exc))
        pytest.skip(str(exc))


def connect_client(
    broker: Broker,
    username: str | None,
    password: str | None,
    client_id: str | None = None,
    *,
    clean_start: bool = True,
    session_expiry: int = 0,
    setup: Callable[[Client], None] | None = None,
) -> Client:
    """Connect a paho client (API v2, MQTT 5, loop_start) and wait for CONNACK.

    Raises ConnectionRefusedError with the CONNACK reason (e.g. "Not authorized") so tests can assert on it. The
    CONNACK properties are kept in `client.user_data_get()["connack"]`. `setup(client)` runs before CONNECT, to set
    callbacks that must not miss messages a resumed session delivers right after CONNACK.
    """
    cid = client_id if client_id is not None else (username or "")
    client = Client(CallbackAPIVersion.VERSION2, client_id=cid, protocol=MQTTProtocolVersion.MQTTv5)
    state: dict[str, object] = {}
    done = threading.Event()
    client.user_data_set(state)

    def on_connect(_c: Client, userdata: dict, _flags: object, reason_code: object, properties: object) -> None:
        userdata["reason"], userdata["connack"] = reason_code, properties
        done.set()

    def on_connect_fail(_c: Client, userdata: dict) -> None:
        userdata["reason"] = "TCP connection failed"
        done.set()

    client.on_connect = on_connect
    client.on_connect_fail = on_connect_fail
    if setup is not None:
        setup(client)
    if username is not None:
        client.username_pw_set(username, password)
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = session_expiry
    client.connect(broker.settings.host, broker.port, keepalive=30, clean_start=clean_start, properties=props)
    client.loop_start()
    ok = done.wait(CONNECT_TIMEOUT)
    reason = state.get("reason")
    if not ok or getattr(reason, "is_failure", True):
        client.loop_stop()  # else paho keeps reconnecting in the background
        client.disconnect()
        raise ConnectionRefusedError(f"{username!r} refused: {reason if ok else 'no CONNACK in time'}")
    return client


def throwaway_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed EC certificate for 127.0.0.1 and its key, valid one day: the CA file of its own TLS listener."""
    openssl = shutil.which("openssl")
    if openssl is None:
        if in_ci():
            pytest.fail("openssl is needed to make a test certificate (bash scripts/setup.sh installs it)")
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = directory / "server.crt", directory / "server.key"
    new_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key)]
    subject = ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(
        [openssl, "req", "-x509", *new_key, "-days", "1", "-out", str(cert), *subject], check=True, capture_output=True
    )
    return cert, key


@pytest.fixture
def need_mosquitto() -> None:
    """For tests that start brokers of their own."""
    require_mosquitto()


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A real mosquitto with the server user and devices c0..c9, anonymous access off."""
    require_mosquitto()
    settings = BrokerSettings(devices=list(DEVICES), allow_anonymous=False)
    b = Broker(tmp_path_factory.mktemp("broker"), settings).start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def mqtt_client_factory(broker: Broker) -> Iterator[MqttClientFactory]:
    """`make(username, password, client_id=None, *, broker=, clean_start=, session_expiry=, setup=)` -> Client.

    Every client made is disconnected at teardown.
    """
    clients: list[Client] = []

    def make(
        username: str | None,
        password: str | None,
        client_id: str | None = None,
        *,
        broker: Broker = broker,
        clean_start: bool = True,
        session_expiry: int = 0,
        setup: Callable[[Client], None] | None = None,
    ) -> Client:
        client = connect_client(
            broker, username, password, client_id, clean_start=clean_start, session_expiry=session_expiry, setup=setup
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.disconnect()
        client.loop_stop()


# ------------------------------------------------------------------ federations of real client processes
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


@pytest.fixture
def federation(broker: Broker, tmp_path: Path) -> Iterator[Callable[..., tuple[Orchestrator, dict]]]:
    """``build(job, clients=3, rounds=3, ...)``: client processes on the session broker and the server for them."""
    started: list[dict[str, subprocess.Popen]] = []

    def on_session_broker(cid: str) -> tuple[str, str]:
        return broker.url, (broker.devices.get(cid) or broker.add_device(cid)).password

    def build(job: str, clients: int = 3, rounds: int = 3, **settings: Any) -> tuple[Orchestrator, dict]:
        link = LinkConfig(broker.url, broker.server.username, broker.server.password)
        orch, procs = start_federation(tmp_path, link, on_session_broker, job, clients, rounds, **settings)
        started.append(procs)
        return orch, procs

    yield build
    for procs in started:
        end_federation(procs)


# ------------------------------------------------------------------------------------------------- benchmarks
def run_benchmark_quick(name: str, out: Path, timeout: float = 600) -> tuple[dict[str, Any], str]:
    """Run ``python -m benchmarks.<name> --quick --out OUT`` from the repository root; its JSON and Markdown."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / f"{name}.json").read_text()), (out / f"{name}.md").read_text()


# ----------------------------------------------------------------------------------------- hand-made updates
def spill_files(directory: Path) -> dict[str, int]:
    """The files this process holds open, unnamed, in ``directory`` (on Linux an O_TMPFILE reads as ``#inode``), with
    their sizes."""
    prefix, found = f"{directory}/", {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith(prefix) and link.endswith(" (deleted)"):
                found[link] = os.fstat(int(fd)).st_size
        except FileNotFoundError:  # closed since the listing (the listing's own descriptor, for one)
            continue
    return found


def make_update(client_id: str, delta: Any, *, num_samples: int = 10, local_steps: int = 5, **fields: Any) -> Update:
    """A valid round-1 update for feeding server halves by hand; ``fields`` override any other Update field."""
    base: dict[str, Any] = {"round": 1, "model_version": 0, "compute_s": 0.0, "cpu_s": 0.0, "train_loss": 0.0}
    return Update(
        client_id=client_id,
        delta=np.asarray(delta, dtype=np.float32),
        num_samples=num_samples,
        local_steps=local_steps,
        **{**base, **fields},
    )


def train_assignment(
    flat: FlatModel, dataset: ArrayDataset, sampler: BatchSampler, assignment: Assignment, algorithm: ClientAlgorithm
) -> TrainResult:
    """Train on ``assignment`` from its plan's weights as a device does: its plan checked against the contract first."""
    plan = assignment.plan
    assert plan.weights is not None, "the plan needs the weights to start from"
    algorithm.contract.check_plan(plan, flat.size)
    return train_local(flat, plan.weights, dataset, sampler, plan, algorithm, assignment.facts)


def admit(
    strategy: Strategy,
    update: Update,
    *,
    registered: int | None = None,
    assigned_steps: int | None = None,
    codec: str = "fp32",
) -> float:
    """Judge ``update`` as the orchestrator's admission does in the round it names (its client selected, told
    ``assigned_steps`` and ``codec``, registered with ``registered`` samples; both default to what the update claims);
    raises the ProtocolError that rejects it, or returns the norm of its delta that the orchestrator hands on."""
    cid = update.client_id
    steps = update.local_steps if assigned_steps is None else assigned_steps
    state = RoundState(update.round, update.model_version, {cid}, assigned_steps={cid: steps})
    state.codecs[cid] = parse_codec(codec)
    gate = Admission(strategy.contract, strategy.params, strategy.ctx.num_params, TrainSection.max_update_norm)
    return gate.check(cid, update, state, update.num_samples if registered is None else registered, update.run_id)
