"""The recorder the dashboard reads: what live.json holds after each hook, and that it never stops a run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edge_client.messages import Hello, Presence, Update
from edge_client.transport import LinkConfig
from server.config import from_dict
from server.evaluation import Evaluator
from server.experiments.datasets import load_dataset
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
    told = {"c0": {"local_steps": 17, "alpha": 0.5, "lr": 0.1, "batch_size": 8, "bytes_down": 99, "params": {}}}
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
    orch._handle(orch.topics.up("c0"), Hello(client_id="c0", num_samples=10, device={"machine": "armv7l"}))
    stale = Update(round=9, model_version=0, client_id="c0", num_samples=10, local_steps=1, compute_s=0.1, cpu_s=0.1,
                   train_loss=1.0, delta=np.zeros(4, dtype=np.float32))  # fmt: skip
    orch._handle(orch.topics.up("c0"), stale)  # no round in progress
    orch._handle(orch.topics.up("c0"), Presence(client_id="c0", online=False, reason="connection lost"))
    orch.live.close()
    state = _read(tmp_path)
    assert state["run"]["algorithm"] == "fedavg" and state["run"]["dataset"] == "digits"
    c0 = state["clients"]["c0"]
    assert c0["device"] == {"machine": "armv7l"} and c0["online"] is False
    assert c0["rejected"] == {"out_of_round": 1}
