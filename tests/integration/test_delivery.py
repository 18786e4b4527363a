"""Run-scoped control messages and updates acknowledged end to end (issue 12), with real `edge-client` processes on a
real mosquitto: a device that missed the end of one run takes part in the next, and a broker SIGKILLed before any
snapshot costs a reconnect, never a round."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from edge_client.wire.transport import LinkConfig
from edgefl_testkit.basics import poll
from edgefl_testkit.federation import Hooks, reported, restart_client, start_federation
from server.assembly import make_orchestrator, split_clients
from server.broker import Broker, BrokerSettings
from server.datasets import load_dataset
from server.experiments.simulate import client_ids, stop_clients
from server.orchestrator import Orchestrator


class Serving:
    """``orch.run()`` on a thread, its summary or error kept for the test."""

    def __init__(self, orch: Orchestrator) -> None:
        self.outcome: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, args=(orch,), daemon=True)
        self.thread.start()

    def _run(self, orch: Orchestrator) -> None:
        try:
            self.outcome["summary"] = orch.run()
        except BaseException as exc:  # the test thread asserts on it
            self.outcome["error"] = exc

    def join(self, timeout: float) -> dict[str, Any]:
        self.thread.join(timeout)
        assert not self.thread.is_alive() and "error" not in self.outcome, self.outcome
        return self.outcome["summary"]


def next_run(orch: Orchestrator, link: LinkConfig, name: str) -> Orchestrator:
    """A new run of ``orch``'s job for the same devices: the same config, its own output directory."""
    config = copy.deepcopy(orch.config)
    config.run.out = str(Path(config.run.out) / name)
    bundle, root = split_clients(config, load_dataset(config.data.dataset, seed=0))
    return make_orchestrator(config, bundle, Path(config.run.out), link_config=link, root=root)


def terminate(procs: dict[str, subprocess.Popen]) -> dict[str, int]:
    """SIGTERM every device still running (as ``systemctl stop`` would); their exit statuses."""
    for proc in procs.values():
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
    return stop_clients(procs, timeout=20)


@pytest.mark.integration
def test_a_device_offline_when_its_run_ended_takes_part_in_the_next_run(need_mosquitto: None, tmp_path: Path) -> None:
    """One broker, two runs of one job, devices that serve run after run. client-02 is SIGKILLed after round 1 of
    run A, so run A's stop waits in its broker session; it is restarted while run B waits for its three devices. It
    logs the old stop as ignored, registers, and run B (which needs all three) aggregates its updates."""
    ids = client_ids(3)
    broker = Broker(tmp_path / "broker", BrokerSettings(devices=ids)).start()
    link = LinkConfig(broker.url, broker.server.username, broker.server.password)
    procs: dict[str, subprocess.Popen] = {}
    try:
        run_a, procs = start_federation(tmp_path, link, lambda cid: (broker.url, broker.devices[cid].password),
                                        "tworuns", 3, 2, once=False, min_clients=3, round_deadline_s=30.0)  # fmt: skip
        Hooks({1: procs["client-02"].kill}).attach(run_a)  # killed once round 1 is aggregated
        summary_a = Serving(run_a).join(180)
        assert procs["client-02"].wait(timeout=30) == -signal.SIGKILL
        assert all(procs[cid].poll() is None for cid in ids[:2])  # the others wait for the next run

        run_b = next_run(run_a, link, "run-b")
        run_b.observer = hooks = Hooks()
        serving = Serving(run_b)
        poll(lambda: {"client-00", "client-01"} <= set(run_b.online()), 60, "run B's two waiting devices")
        log = run_a.out_dir / "clients" / "client-02.restarted.log"
        procs["client-02"] = restart_client(procs["client-02"], broker.devices["client-02"].password, log)
        summary_b = serving.join(180)
    finally:
        codes = terminate(procs)
        broker.stop()
    assert summary_a["run_id"] != summary_b["run_id"]
    assert summary_b["rounds"] == 2 and all(sorted(r["clients"]) == ids for r in hooks.rows), hooks.rows
    text = log.read_text()
    assert f"ignoring the server's stop of run {summary_a['run_id']}" in text, text
    for cid in ids[:2]:  # the devices that stayed left run A and served run B in the same process
        text = (run_a.out_dir / "clients" / f"{cid}.log").read_text()
        assert f"left run {summary_a['run_id']}; waiting for the next run" in text, text
    assert codes == dict.fromkeys(ids, 0)  # SIGTERM: a clean exit, which systemd does not restart


@pytest.mark.integration
def test_broker_sigkilled_without_a_snapshot_costs_no_round(
    need_mosquitto: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """3 devices, 3 rounds, a broker that never saves a snapshot in the test's time (autosave every hour): every
    SIGKILL loses every session. The broker is killed right after the devices registered, and in rounds 2 and 3 right
    after the server accepted the round's first update. Every round aggregates all three devices, each once, and no
    round closes at its deadline (300 s, far beyond the test's own timeouts)."""
    caplog.set_level("INFO", logger="edgefl.server")
    ids = client_ids(3)
    broker = Broker(tmp_path / "broker", BrokerSettings(devices=ids, autosave_interval=3600)).start()
    link = LinkConfig(broker.url, broker.server.username, broker.server.password)
    procs: dict[str, subprocess.Popen] = {}
    kills: list[str] = []

    def crash(when: str) -> None:
        broker.kill()
        kills.append(when)
        broker.start()

    try:
        orch, procs = start_federation(tmp_path, link, lambda cid: (broker.url, broker.devices[cid].password),
                                       "nosnap", 3, 3, round_deadline_s=300.0)  # fmt: skip
        orch.observer = hooks = Hooks()
        accept = orch.dispatch.accept

        def accepting(topic: str, sender: str, update: Any) -> None:  # on the orchestrator's thread: no race
            accept(topic, sender, update)
            state = orch.current
            if state is not None and state.round in (2, 3) and len(state.received) == 1:
                crash(f"round {state.round}")  # right after the round's first accepted update

        orch.dispatch.accept = accepting  # type: ignore[method-assign]  # this instance only
        serving = Serving(orch)
        poll(lambda: orch.current is not None, 120, "round 1 to start (every device registered)")
        crash("after registration")
        summary = serving.join(240)
    finally:
        codes = stop_clients(procs, timeout=5)  # one that missed the run's stop (its session lost) is terminated
        broker.stop()
    assert kills == ["after registration", "round 2", "round 3"]
    assert summary["rounds"] == 3
    for row in hooks.rows:
        assert sorted(row["clients"]) == ids and set(row["rejected"]) <= {"duplicate"}, row
        for cid in ids:
            assert reported(caplog, row["round"], cid) == 1, (row["round"], cid)
    for cid in ids:
        text = (orch.out_dir / "clients" / f"{cid}.log").read_text()
        assert "(session present: False)" in text, text  # every session was lost at least once
    assert codes == dict.fromkeys(ids, 0)
