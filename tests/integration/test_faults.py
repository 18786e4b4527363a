"""Faults (issue 7): crashes, stragglers, a broker or server killed mid-run, client restarts and absurd updates.

Real `edge-client` processes (and, for the server restart, a real `edge-server` process) against a real mosquitto.
Every strategy's state through a checkpoint, in-process: tests/unit/server/test_checkpoint.py; the device loop's
stale assignments: tests/unit/edge_client/loop/test_runtime.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_client.algorithms.scaffold import ScaffoldClient
from edge_client.wire.messages import Assignment
from edge_client.wire.protocol import encode
from edge_client.wire.transport import LinkConfig
from edgefl_testkit.basics import poll
from edgefl_testkit.fakes import FakeDevice, zero_update
from edgefl_testkit.federation import (
    Hooks,
    checkpointed_round,
    make_config,
    reported,
    restart_client,
    start_federation,
)
from edgefl_testkit.messages import make_update
from server.broker import Broker, BrokerSettings
from server.config import ConfigError
from server.experiments.simulate import client_ids, stop_clients
from server.orchestrator import Orchestrator


# ------------------------------------------------------------------------------------------- real processes
def assert_c_is_the_mean_of_the_c_i(orch: Orchestrator, state_dir: Path) -> None:
    """SCAFFOLD's invariant c = mean_i c_i over the clients aggregated so far (every registered one with
    ``c_mean_over = "registered"``), each c_i settled as its next assignment would settle it (pending c_i^new
    committed only if the server aggregated that round)."""
    strategy: Any = orch.strategy  # a Scaffold
    over = orch.clients if strategy.params["c_mean_over"] == "registered" else strategy.aggregated
    settled = []
    for cid in sorted(over):
        client = ScaffoldClient()
        with np.load(state_dir / f"{cid}.state" / orch.config.run.job / "scaffold.npz") as saved:
            client.load_state_dict({k: saved[k] for k in saved.files})
        client.settle(orch.strategy.aggregated.get(cid, 0))  # type: ignore[attr-defined]
        settled.append(client.c_i)
    c = orch.strategy.c  # type: ignore[attr-defined]
    assert np.abs(c).max() > 1e-3
    np.testing.assert_allclose(c, np.mean(settled, axis=0), rtol=0, atol=1e-5)


@pytest.mark.integration
def test_killed_client_rejoins_with_its_state_and_a_straggler_late_update_is_discarded(
    federation, broker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SCAFFOLD, derived deadlines. After round 1 client-01 is SIGKILLed and client-02 SIGSTOPped; after round 2
    (closed by its deadline) client-02 is SIGCONTed, so its update for round 2 arrives late, and client-01 is
    restarted with the same id and state dir."""
    caplog.set_level("INFO", logger="edgefl.server")
    orch, procs = federation(
        "rejoin", clients=3, rounds=4, train={"algorithm": "scaffold"},
        round_deadline_s=60.0, deadline_factor=2.0, deadline_margin_s=1.0, deadline_floor_s=4.0,
    )  # fmt: skip
    state_file = orch.out_dir / "clients" / "client-01.state" / "rejoin" / "scaffold.npz"
    saved: dict[str, np.ndarray] = {}
    restarted: dict[str, subprocess.Popen] = {}

    def kill_and_freeze() -> None:
        with np.load(state_file) as f:  # round 1's c_i^new, pending until round 2's assignment commits it
            assert int(f["pending_round"]) == 1 and not f["c_i"].any()
            saved["c_i"] = f["pending_c_i"]
        procs["client-01"].kill()
        procs["client-01"].wait()
        os.kill(procs["client-02"].pid, signal.SIGSTOP)

    def thaw_restart_and_wait_for_the_rejoin() -> None:
        os.kill(procs["client-02"].pid, signal.SIGCONT)
        log = orch.out_dir / "clients" / "client-01.restarted.log"
        restarted["client-01"] = restart_client(procs["client-01"], broker.devices["client-01"].password, log)
        orch.wait_for_clients(3)  # the restarted client-01 said hello again

    hooks = Hooks({1: kill_and_freeze, 2: thaw_restart_and_wait_for_the_rejoin}).attach(orch)
    try:
        summary = orch.run()
        assert restarted["client-01"].wait(timeout=30) == 0
    finally:
        for proc in restarted.values():
            proc.kill() if proc.poll() is None else None
    rows = hooks.rows
    assert summary["rounds"] == 4
    # deadlines: round 1 the fixed one (nobody measured yet); then 2 x the longest prediction of a selected client
    # (its own last seconds per step x its steps + its transfers; the killed and the frozen client keep theirs) + 1 s
    assert rows[0]["deadline_s"] == 60.0
    for row in rows[1:]:
        predicted = [p["predicted_s"] for p in row["predictions"].values()]
        assert len(predicted) == row["clients_selected"] == 3
        assert row["deadline_s"] == pytest.approx(min(60.0, max(4.0, 2.0 * max(predicted) + 1.0)))
    # round 2 closed at its deadline without the killed client and the frozen one
    assert rows[1]["missing"] == ["client-01", "client-02"] and sorted(rows[1]["clients"]) == ["client-00"]
    # the late update for round 2 was discarded, logged and counted, never aggregated into round 3
    late = [r.getMessage() for r in caplog.records if "for round 2 arrived during" in r.getMessage()]
    # ... and so was the one client-01 trained after its restart on round 2's assignment, kept in its MQTT session
    assert sorted(m.split("update from ")[1].split()[0] for m in late) == ["client-01", "client-02"], late
    assert rows[2]["rejected"] == {"out_of_round": 2}
    assert reported(caplog, 2, "client-02") == 0 and reported(caplog, 3, "client-02") == 1
    # the restarted client-01 restored its c_i, was selected again and its updates on the current model accepted
    log = (orch.out_dir / "clients" / "client-01.restarted.log").read_text()
    assert f"restored scaffold state from {state_file}" in log
    assert np.any(saved["c_i"])
    assert "client-01" in rows[2]["clients"] and "client-01" in rows[3]["clients"]
    with np.load(state_file) as f:
        assert not np.array_equal(f["c_i"], saved["c_i"])  # it kept training from the restored c_i
    # the two rejected round-2 updates' c_i^new were discarded, not committed: c is still the mean of the c_i
    assert orch.strategy.aggregated == {"client-00": 4, "client-01": 4, "client-02": 4}  # type: ignore[attr-defined]
    assert_c_is_the_mean_of_the_c_i(orch, orch.out_dir / "clients")


def run_beside_c9(
    orch: Any, broker: Any, job: str, respond: Callable[[Assignment], list[bytes | bytearray]]
) -> tuple[dict[str, Any], FakeDevice]:
    """Run ``orch`` with a fake device c9 (its own login) answering with ``respond``; the summary and the device."""
    device = FakeDevice.over_mqtt(broker.url, "c9", broker.devices["c9"].password, job, "c9", 10, respond).start()
    try:
        summary = orch.run()
    finally:
        device.stop()
    assert device.error is None, device.error
    return summary, device


@pytest.mark.integration
def test_a_slow_device_that_missed_a_round_gets_a_deadline_it_meets(federation, broker) -> None:
    """The shut-out case. A slow device (c9: 3 s a round) beside two fast client processes misses round 2 (its link
    was down). A deadline sized by the clients that reported (the fast ones) would shut it out for good; its own
    round-1 speed, kept through the miss, gives round 3 a deadline it meets, and its update is aggregated."""
    slow_s = 3.0
    orch, _ = federation("shutout", clients=2, rounds=3, min_clients=3, round_deadline_s=60.0, deadline_factor=1.5,
                         deadline_margin_s=1.0, deadline_floor_s=0.5)  # fmt: skip

    def slow(a: Assignment) -> list[bytes | bytearray]:
        if a.facts.round == 2:
            return []  # missed: its link was down
        time.sleep(slow_s)  # the device's own compute, not a synchronisation
        return [encode(replace(zero_update(a, "c9", 10), compute_s=slow_s))]

    summary, _ = run_beside_c9(orch, broker, "shutout", slow)
    rows = [json.loads(line) for line in (orch.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["rounds"] == 3 and [r["missing"] for r in rows] == [[], ["c9"], []]
    assert "c9" in rows[0]["clients"] and "c9" in rows[2]["clients"]  # aggregated again in round 3
    steps = rows[0]["clients"]["c9"]["local_steps"]
    c9 = rows[2]["predictions"]["c9"]  # still its round-1 measurement
    assert c9["s_per_step"] == pytest.approx(slow_s / steps) and c9["predicted_s"] >= slow_s
    longest = max(p["predicted_s"] for p in rows[2]["predictions"].values())
    assert rows[2]["deadline_s"] == pytest.approx(1.5 * longest + 1.0) and rows[2]["deadline_s"] > slow_s
    # what the fast clients alone would have allowed (the old derived deadline) is shorter than c9's round
    assert max(0.5, 1.5 * rows[1]["slowest_compute_s"] + 1.0) < slow_s
    assert summary["rounds_missed"] == {"c9": 1}


@pytest.mark.integration
def test_absurd_updates_are_rejected_by_reason_and_the_round_goes_on(federation, broker) -> None:
    """A device (c9, its own login) answers each round with one bad update of another kind. Each is rejected with its
    reason and counted in its round; the round does not wait for c9 after its one update was refused (a second, good
    update could race the round's close, so the device sends one a round) and aggregates the other clients."""
    kinds = ["norm", "non_finite", "model_version", "shape"]
    # min_clients 3: the run waits for both processes beside c9 (on a loaded machine the second one could otherwise
    # register after the run ended and wait, with --once, for a run to end until the fixture killed it 20 s later)
    orch, _ = federation("absurd", clients=2, rounds=len(kinds), min_clients=3)

    def absurd(msg: Assignment) -> list[bytes | bytearray]:
        assert msg.plan.weights is not None
        n, f = msg.plan.weights.size, msg.facts
        ok = {"round": f.round, "model_version": f.model_version, "run_id": f.run_id, "num_samples": 10}
        bad = {
            "norm": make_update("c9", np.full(n, 1e6), **ok),
            "non_finite": make_update("c9", np.full(n, np.nan), **ok),
            "model_version": make_update("c9", np.zeros(n), **{**ok, "model_version": f.model_version + 7}),
            "shape": make_update("c9", np.zeros(n + 1), **ok),
        }
        return [encode(bad[kinds[f.round - 1]])]

    summary, device = run_beside_c9(orch, broker, "absurd", absurd)
    rows = [json.loads(line) for line in (orch.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["rounds"] == len(kinds) and [a.facts.round for a in device.assignments] == [1, 2, 3, 4]
    for row, kind in zip(rows, kinds, strict=True):
        assert row["rejected"] == {kind: 1} and row["failed"] == {"c9": f"rejected: {kind}"}, row
        assert "c9" not in row["clients"] and row["missing"] == ["c9"]
        assert row["clients"] and len(row["clients"]) == row["clients_selected"] - 1  # every other selected one
    assert summary["rejected"] == dict.fromkeys(kinds, 1)


@pytest.mark.integration
def test_server_killed_mid_run_resumes_from_its_checkpoint(federation, broker, tmp_path: Path) -> None:
    """`edge-server run` (TACO: alphas and strikes in the checkpoint) SIGKILLed after round 2, restarted with the same
    output directory; the clients stay up and re-register when the server's presence comes back."""
    job, rounds = "resume", 5
    orch, _ = federation(job, clients=3, rounds=rounds, train={"algorithm": "taco"})
    out = orch.out_dir
    toml = tmp_path / "run.toml"
    toml.write_text(
        f'[run]\nrounds = {rounds}\nout = "{out}"\njob = "{job}"\ntarget_accuracy = 0.5\n'
        '[clients]\ncount = 3\nregister_timeout_s = 60.0\n[data]\ndataset = "digits"\n'
        '[train]\nalgorithm = "taco"\nlocal_steps = 20\nbatch_size = 32\nlr = 0.1\n'
        f'[broker]\nurl = "{broker.url}"\nusername = "{broker.server.username}"\n'
    )
    cmd = [sys.executable, "-m", "server.cli", "run", "--config", str(toml)]
    env = {**os.environ, "EDGEFL_PASSWORD": broker.server.password}
    metrics = out / "metrics.jsonl"
    with (tmp_path / "first.log").open("w") as log:
        first = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        poll(lambda: first.poll() is not None or checkpointed_round(out) >= 2, 120, "two checkpointed rounds")
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        first.kill()
        first.wait()
    with np.load(out / "checkpoint.npz") as saved:
        k = int(saved["round"])
        alphas = json.loads(str(saved["strategy"]))["state"]["alpha"]
    assert 2 <= k < rounds and alphas
    # the same directory with another configuration is refused, naming the key
    with pytest.raises(ConfigError, match=r"train\.lr = 0\.1; this configuration has 0\.2"):
        other = make_config(tmp_path, job, 3, rounds, train={"algorithm": "taco", "lr": 0.2})
        Orchestrator(other, orch.link.config, orch.evaluator, orch.model_spec, out).run()
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert second.returncode == 0, second.stderr[-3000:]
    resumed_from = re.search(r"resuming run (\w+) from round (\d+)", (out / "server.log").read_text())
    assert resumed_from is not None and int(resumed_from[2]) == k
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, rounds + 1))
    assert all(r["clients_reported"] == 3 for r in rows[k:])  # every client came back after the restart
    assert json.loads((out / "summary.json").read_text())["rounds"] == rounds
    with np.load(out / "checkpoint.npz") as saved:
        assert bool(saved["finished"]) and int(saved["round"]) == rounds


# ------------------------------------------------------------------------------------ the broker itself dies
def federation_on(broker: Broker, tmp_path: Path, job: str, clients: int, rounds: int, **settings: Any) -> tuple:
    """Like conftest's ``federation``, on a broker of the test's own (one it may kill): server and client processes."""
    link = LinkConfig(broker.url, broker.server.username, broker.server.password)
    return start_federation(tmp_path, link, lambda cid: (broker.url, broker.devices[cid].password), job, clients,
                            rounds, **settings)  # fmt: skip


@pytest.mark.integration
def test_broker_sigkilled_mid_round_and_restarted(
    need_mosquitto: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SCAFFOLD, 3 clients, 4 rounds. client-02 is SIGSTOPped after round 1 so that round 2 is surely in progress;
    once the server accepted round 2's first update and mosquitto saved a snapshot holding every session, the broker
    is SIGKILLed, restarted on the same port and client-02 resumed. Everyone reconnects on their own to the sessions
    they had, the run finishes and no update is aggregated twice."""
    caplog.set_level("INFO", logger="edgefl.server")
    ids = client_ids(3)
    broker = Broker(tmp_path / "broker", BrokerSettings(devices=ids, autosave_interval=1)).start()
    snapshot = broker.workdir / "mosquitto.db"
    procs: dict[str, subprocess.Popen] = {}
    round_1_done: list[float] = []

    def freeze_client_02() -> None:
        round_1_done.append(time.time())
        os.kill(procs["client-02"].pid, signal.SIGSTOP)

    try:
        orch, procs = federation_on(
            broker, tmp_path, "bkill", 3, 4, train={"algorithm": "scaffold"}, round_deadline_s=10.0
        )
        hooks = Hooks({1: freeze_client_02}).attach(orch)
        outcome: dict[str, Any] = {}

        def serve() -> None:
            try:
                outcome["summary"] = orch.run()
            except BaseException as exc:  # the test thread asserts on it
                outcome["error"] = exc

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        round_2 = lambda: (s := orch.current) is not None and s.round == 2 and bool(s.received)  # noqa: E731
        poll(lambda: round_2() or not server.is_alive(), 60, "the first accepted update of round 2")
        # a snapshot taken after round 1 holds all four sessions (autosave every second)
        poll(lambda: snapshot.exists() and snapshot.stat().st_mtime > round_1_done[0], 10, "a broker snapshot")
        broker.kill()
        before_kill = sorted(orch.current.received) if orch.current else []
        broker.start()
        os.kill(procs["client-02"].pid, signal.SIGCONT)
        server.join(timeout=120)
        assert not server.is_alive() and "error" not in outcome, outcome
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        codes = stop_clients(procs, timeout=20)
        broker.stop()
    rows = hooks.rows
    assert outcome["summary"]["rounds"] == 4 and [r["round"] for r in rows] == [1, 2, 3, 4]
    assert before_kill and set(before_kill) <= set(rows[1]["clients"])  # accepted before the kill: aggregated
    # exactly once: never two accepted updates from one client in one round; a redelivered one is rejected
    for row in rows:
        assert row["clients_reported"] <= row["clients_selected"] and set(row["rejected"]) <= {"duplicate"}, row
        for cid in ids:
            assert reported(caplog, row["round"], cid) == (cid in row["clients"]), (row["round"], cid)
    # the server and every client reconnected, to the sessions they had: all three reported after the kill
    assert all(sorted(r["clients"]) == ids for r in rows[2:]), [sorted(r["clients"]) for r in rows]
    for cid in ids:
        log = (orch.out_dir / "clients" / f"{cid}.log").read_text()
        assert "(session present: False)" in log and "(session present: True)" in log, log
    assert codes == dict.fromkeys(ids, 0)  # every client got the server's stop through the new broker
    assert_c_is_the_mean_of_the_c_i(orch, orch.out_dir / "clients")
