"""The recorder the dashboard reads: what live.json holds after each hook, and that it never stops a run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edge_client.wire.messages import Hello, Presence, Update
from edge_client.wire.transport import LinkConfig
from server.config import from_dict
from server.datasets import load_dataset
from server.evaluation import Evaluator
from server.live_state import LIVE_FILE, LiveState
from server.orchestrator import Orchestrator


def _read(out: Path) -> dict:
    return json.loads((out / LIVE_FILE).read_text())


def test_nothing_is_written_before_start(tmp_path: Path) -> None:
    live = LiveState(tmp_path, {"algorithm": "fedavg"})
    live.registered("c0", {"machine": "aarch64"})
    assert not (tmp_path / LIVE_FILE).exists()


def test_hooks_end_up_in_live_json(tmp_path: Path) -> None:
    live = LiveState(tmp_path, {"algorithm": "fedveca", "dataset": "digits", "rounds": 5, "target": 0.9})
    live.start()
    live.registered("c0", {"machine": "aarch64", "cpu_count": 4})
    live.registered("c1", {})
    live.heard("c0")
    live.heard(None)  # a message on a topic of no client: nobody to attribute it to
    live.presence("c1", False)
    live.presence("ghost", False)  # a presence before any hello registers nobody
    live.rejected("c0", "norm")
    live.rejected("c0", "norm")
    live.rejected(None, "topic")
    told = {"c0": {"local_steps": 17, "settings": {"alpha_i": 0.5}, "lr": 0.1, "batch_size": 8, "bytes_down": 99,
                   "params": {}}}  # fmt: skip
    live.round_started(3, 12.5, told)
    live.close()

    state = _read(tmp_path)
    assert state["run"]["algorithm"] == "fedveca" and state["run"]["round"] == 3 and state["run"]["finished"]
    # the dashboard's elapsed time continues metrics.jsonl's elapsed_s: 12.5 s had passed when round 3 began
    assert abs(state["run"]["round_started_at"] - state["run"]["elapsed_origin_at"] - 12.5) < 1e-6
    c0, c1 = state["clients"]["c0"], state["clients"]["c1"]
    assert c0["online"] and c0["device"]["cpu_count"] == 4 and c0["last_seen"] is not None
    assert c0["rejected"] == {"norm": 2}
    assert c0["told"] == {"round": 3, "local_steps": 17, "alpha": 0.5, "lr": 0.1, "batch_size": 8}
    assert c1["online"] is False and c1["told"] is None and c1["last_seen"] is None
    assert "ghost" not in state["clients"]
    assert state["unattributed_rejections"] == {"topic": 1}


def test_unwritable_directory_does_not_raise(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    live = LiveState(blocker / "run", {})  # the run directory cannot be created under a file
    live.start()
    live.registered("c0", {})
    live.close()  # logs a warning each time; training would go on


def test_orchestrator_records_what_it_handles(tmp_path: Path) -> None:
    """The hooks in the orchestrator (constructed, not connected): a hello registers, a bad update counts against its
    sender, a last will turns the client offline."""
    digits = load_dataset("digits", seed=0)
    config = from_dict({"run": {"out": str(tmp_path)}, "data": {"dataset": "digits"}, "train": {"algorithm": "fedavg"}})
    link = LinkConfig("mqtt://127.0.0.1:1")
    orch = Orchestrator(config, link, Evaluator(digits.model, digits.test), digits.model, tmp_path)
    orch.live.start()
    orch.dispatch.handle(orch.topics.up("c0"), Hello(client_id="c0", num_samples=10, device={"machine": "armv7l"}))
    stale = Update(round=9, model_version=0, client_id="c0", num_samples=10, local_steps=1, compute_s=0.1, cpu_s=0.1,
                   train_loss=1.0, delta=np.zeros(4, dtype=np.float32))  # fmt: skip
    orch.dispatch.handle(orch.topics.up("c0"), stale)  # no round in progress
    orch.dispatch.handle(orch.topics.up("c0"), Presence(client_id="c0", online=False, reason="connection lost"))
    orch.live.close()
    state = _read(tmp_path)
    assert state["run"]["algorithm"] == "fedavg" and state["run"]["dataset"] == "digits"
    c0 = state["clients"]["c0"]
    assert c0["device"] == {"machine": "armv7l"} and c0["online"] is False
    assert c0["rejected"] == {"out_of_round": 1}


def _strict(text: str) -> dict:
    """JSON as a browser's JSON.parse reads it: NaN and Infinity are errors."""

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_hello_with_bytes_and_nan_in_its_device_facts_does_not_stop_live_json(tmp_path: Path) -> None:
    """Issue 23: bytes in a hello's facts killed the writer thread (live.json stayed at round 0); NaN reached the page
    as a bare NaN. Through the orchestrator's real handler: the facts are stored JSON-safe and the state advances."""
    digits = load_dataset("digits", seed=0)
    config = from_dict({"run": {"out": str(tmp_path)}, "data": {"dataset": "digits"}, "train": {"algorithm": "fedavg"}})
    orch = Orchestrator(config, LinkConfig("mqtt://127.0.0.1:1"), Evaluator(digits.model, digits.test), digits.model,
                        tmp_path)  # fmt: skip
    orch.live.start()
    facts = {"machine": "aarch64", "blob": b"\x00\xff", "temp": float("nan"), "big": float("inf"), "x" * 999: 1,
             "nested": {"a": [1, b"\x01", float("-inf")]}, **{f"k{i}": i for i in range(100)}}  # fmt: skip
    orch.dispatch.handle(orch.topics.up("c0"), Hello(client_id="c0", num_samples=10, device=facts))
    orch.live.round_started(1, 0.0, {})
    orch.live.close()
    state = _strict((tmp_path / LIVE_FILE).read_text())
    assert state["run"]["round"] == 1
    device = state["clients"]["c0"]["device"]
    assert device["machine"] == "aarch64" and device["nested"] == {"a": [1, None, None]}
    assert not {"blob", "temp", "big"} & set(device) and len(device) <= 32 and all(len(k) <= 256 for k in device)


def test_the_writer_logs_a_failed_write_and_carries_on(tmp_path: Path, monkeypatch, caplog) -> None:
    from server import live_state

    calls = []

    def fails_once(value: object) -> str:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return json.dumps(value)

    monkeypatch.setattr(live_state, "strict_json", fails_once)
    live = LiveState(tmp_path, {"algorithm": "fedavg"})
    live.start()  # its first write fails
    live.round_started(2, 0.0, {})
    live.close()
    assert _read(tmp_path)["run"]["round"] == 2 and "could not serialise the live state" in caplog.text


def test_state_that_is_not_strict_json_is_written_without_the_offending_values(tmp_path: Path) -> None:
    live = LiveState(tmp_path, {"algorithm": "fedavg", "target": float("nan")})  # a value no hook would let in
    live.start()
    live.close()
    state = _strict((tmp_path / LIVE_FILE).read_text())
    assert state["run"]["algorithm"] == "fedavg" and "target" not in state["run"] and state["run"]["finished"]
