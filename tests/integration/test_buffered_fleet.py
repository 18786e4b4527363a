"""Buffered aggregation over a real mosquitto with real `edge-client` processes (issue 28).

Which device can deliver next is set by stopping and continuing client processes (SIGSTOP/SIGCONT) at the start of
given aggregation steps, so every staleness below follows from the order of events, not from timing."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from edgefl_testkit.basics import poll
from edgefl_testkit.federation import Hooks, checkpointed_round, restart_client

pytestmark = pytest.mark.integration


def steps(actions: dict[int, Callable[[], None]]) -> Callable[[int], None]:
    """The loop's ``on_round``: an action at the start of aggregation step N, before any device is assigned in it."""
    return lambda step: actions.get(step, lambda: None)()


def test_a_fast_device_goes_on_while_slow_ones_train_and_stale_updates_are_weighted_or_refused(federation) -> None:
    """K = 1, max_staleness = 3. client-01 and client-02 are stopped before their first assignment (version 0).
    Step 3: only client-01 runs: its update is 2 versions stale, weight 1/sqrt(3). Step 6: only client-02 runs: 5
    versions stale, refused and counted; it is then sent version 5 at once and its next update makes step 6. Step 7:
    only client-00 runs again."""
    orch, procs = federation(
        "buffered", clients=3, rounds=7,
        train={"mode": "buffered", "buffer_size": 1, "max_staleness": 3, "local_steps": 5},
    )  # fmt: skip

    def signal_to(cid: str, sig: int) -> Callable[[], None]:
        return lambda: os.kill(procs[cid].pid, sig)

    def both(*actions: Callable[[], None]) -> Callable[[], None]:
        return lambda: [a() for a in actions]  # type: ignore[func-returns-value]

    stop, cont = signal.SIGSTOP, signal.SIGCONT
    orch.on_round = steps({
        1: both(signal_to("client-01", stop), signal_to("client-02", stop)),
        3: both(signal_to("client-00", stop), signal_to("client-01", cont)),
        4: both(signal_to("client-01", stop), signal_to("client-00", cont)),
        6: both(signal_to("client-00", stop), signal_to("client-02", cont)),
        7: both(signal_to("client-02", stop), signal_to("client-00", cont)),
    })  # fmt: skip
    hooks = Hooks().attach(orch)
    summary = orch.run()
    rows = hooks.rows
    assert [r["round"] for r in rows] == list(range(1, 8))
    by_step = {r["round"]: r["updates"] for r in rows}
    for row in rows:  # every update's staleness and weight are what the formula says
        for u in row["updates"]:
            assert u["staleness"] == row["model_version"] - 1 - u["model_version"]
            assert u["weight"] == pytest.approx(1 / math.sqrt(1 + u["staleness"]))
    assert [(u["client"], u["model_version"], u["staleness"]) for u in by_step[3]] == [("client-01", 0, 2)]
    assert [(u["client"], u["model_version"], u["staleness"]) for u in by_step[6]] == [("client-02", 5, 0)]
    done = Counter(u["client"] for r in rows for u in r["updates"])
    assert done == {"client-00": 5, "client-01": 1, "client-02": 1}  # the fast one went on meanwhile
    assert rows[5]["rejected"] == {"staleness": 1} and summary["rejected"]["staleness"] == 1
    assert (orch.out_dir / "timeline.png").stat().st_size > 0


@pytest.mark.slow
def test_a_device_offline_for_several_steps_comes_back_and_is_sent_the_newest_model(federation, broker) -> None:
    """client-01 is SIGKILLed before step 2 and restarted (same id, data and state dir) before step 5, when the others
    stop: nothing waited for it meanwhile, and once back it is sent the newest model (its lost assignment is not sent
    again) and makes at least one of steps 5-7; its updates are weighted as the formula says."""
    orch, procs = federation("buffered-offline", clients=3, rounds=7, train={"mode": "buffered", "buffer_size": 1,
                                                                             "local_steps": 5})  # fmt: skip
    restarted: list[subprocess.Popen] = []

    def kill() -> None:
        procs["client-01"].kill()
        procs["client-01"].wait()

    def restart() -> None:  # the others stop: each can still deliver the one update it may have sent already
        for cid in ("client-00", "client-02"):
            os.kill(procs[cid].pid, signal.SIGSTOP)
        log = orch.out_dir / "clients" / "client-01.restarted.log"
        restarted.append(restart_client(procs["client-01"], broker.devices["client-01"].password, log))
        orch.wait_for_clients(3)  # its hello: from here on it is assigned the newest version

    orch.on_round = steps({2: kill, 5: restart})
    hooks = Hooks().attach(orch)
    try:
        orch.run()
        assert restarted[0].wait(timeout=30) == 0
    finally:
        for proc in restarted:
            proc.kill() if proc.poll() is None else None
    rows = hooks.rows
    assert [r["round"] for r in rows] == list(range(1, 8))
    back = [(u, r) for r in rows for u in r["updates"] if u["client"] == "client-01" and u["assigned_in"] >= 5]
    assert back, "client-01 contributed nothing after its restart"
    for u, row in back:  # trained on the version current when it was assigned, after its return
        assert u["model_version"] >= 4
        assert u["staleness"] == row["model_version"] - 1 - u["model_version"]
        assert u["weight"] == pytest.approx(1 / math.sqrt(1 + u["staleness"]))
    assert all(r["clients_reported"] == 1 for r in rows[1:4])  # steps 2-4 went on without it


def _aggregated(metrics: Path, steps: int | None = None) -> list[str]:
    """The message id of every update aggregated in the first ``steps`` steps (None: all), in order."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [u["update_id"] for r in rows[:steps] for u in r["updates"]]


@pytest.mark.slow
def test_the_server_killed_mid_run_resumes_without_aggregating_an_update_twice(federation, broker, tmp_path) -> None:
    """`edge-server run` buffered, SIGKILLed once 3 steps are checkpointed and restarted on the same directory: the
    run ends with every step recorded once and no update aggregated twice."""
    job, rounds = "buffered-resume", 20  # killed after 3 steps of a few hundredths of a second: far from its end
    orch, clients = federation(job, clients=3, rounds=rounds, once=False, train={"mode": "buffered", "buffer_size": 2})
    out = orch.out_dir
    toml = tmp_path / "run.toml"
    toml.write_text(
        f'[run]\nrounds = {rounds}\nout = "{out}"\njob = "{job}"\ntarget_accuracy = 0.5\n'
        '[clients]\ncount = 3\nregister_timeout_s = 60.0\n[data]\ndataset = "digits"\n'
        '[train]\nmode = "buffered"\nbuffer_size = 2\nlocal_steps = 20\nbatch_size = 32\nlr = 0.1\n'
        f'[broker]\nurl = "{broker.url}"\nusername = "{broker.server.username}"\n'
    )
    cmd = [sys.executable, "-m", "server.cli", "run", "--config", str(toml)]
    env = {**os.environ, "EDGEFL_PASSWORD": broker.server.password}
    with (tmp_path / "first.log").open("w") as log:
        first = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        poll(lambda: first.poll() is not None or checkpointed_round(out) >= 3, 120, "three checkpointed steps")
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        first.kill()
        first.wait()
    checkpointed = checkpointed_round(out)  # a row after it may be written already: the resumed run replaces it
    before = _aggregated(out / "metrics.jsonl", checkpointed)
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert second.returncode == 0, second.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, rounds + 1))
    aggregated = _aggregated(out / "metrics.jsonl")
    assert len(aggregated) == len(set(aggregated)) == 2 * rounds  # no update twice
    assert aggregated[: len(before)] == before
    for proc in clients.values():  # they serve runs until stopped (once=False): no need for the fixture's grace
        proc.terminate()
