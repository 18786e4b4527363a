"""A device's free-form maps through the real orchestrator, in-process: what JSON cannot hold never reaches a file.

Two real edge clients train on the in-process bus; the first one's hellos and updates are rewritten on their way to
the server as a buggy or hostile device would pack them (a msgpack bin and a NaN in its device facts and its metrics).
Before the schema declared these maps, the bin was admitted and writing metrics.jsonl raised ``TypeError``, ending
the run (and in the facts, it killed the writer of the dashboard's live.json).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from edge_client.wire.protocol import read_header
from edge_client.wire.topics import Topics
from edgefl_testkit.federation import make_config
from server.datasets import load_dataset
from server.experiments.inprocess import LocalBus, run_inprocess
from server.experiments.simulate import client_ids, prepare_shards

HOSTILE = {"note": b"\x00", "nan": float("nan")}


def _strict(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise AssertionError(f"{constant} in what the run wrote")

    return json.loads(text, parse_constant=refuse)


def test_bytes_and_nan_in_device_facts_and_metrics_are_dropped_the_update_aggregated_the_files_strict_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(tmp_path, "devicemaps", 2, 2, train={"local_steps": 2}, simulation={"threads": 1})
    bundle = load_dataset("digits", seed=0)
    out = Path(config.run.out)
    ids = client_ids(2)
    shards, _ = prepare_shards(bundle, ids, "iid", 0, out / "shards")
    hostile_topic = Topics(config.run.job).up(ids[0])
    deliver = LocalBus.deliver
    tampered: list[str] = []

    def tamper(self: LocalBus, sender: Any, topic: str, payload: bytes, retain: bool) -> None:
        if topic == hostile_topic and any(link.subscribed(topic) for link in self.links):  # the server hears it
            header, offset = read_header(payload)
            if header["t"] in ("update", "hello"):
                header["f"]["metrics" if header["t"] == "update" else "device"].update(HOSTILE)
                payload = msgpack.packb(header, use_bin_type=True) + payload[offset:]
                tampered.append(header["t"])
        deliver(self, sender, topic, payload, retain)

    monkeypatch.setattr(LocalBus, "deliver", tamper)
    summary = run_inprocess(config, shards, bundle, out)

    assert tampered.count("update") == 2 and "hello" in tampered  # one rewritten update per round
    rows = [_strict(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    for row in rows:
        assert sorted(row["clients"]) == ids  # the device's update was aggregated, without the entries
        device = row["clients"][ids[0]]["device"]
        assert "threads" in device and "before" in device and not set(HOSTILE) & set(device)
        assert set(row["rejected"]) == {"dropped_type", "dropped_non_finite"}  # counted, never a refusal
    assert rows[1]["rejected"] == {"dropped_type": 1, "dropped_non_finite": 1}  # round 2: its update (hellos: round 1)
    written = _strict((out / "summary.json").read_text())
    assert written["rounds"] == summary["rounds"] == 2
    hellos = tampered.count("hello")
    assert written["rejected"] == {"dropped_type": 2 + hellos, "dropped_non_finite": 2 + hellos}
    live = _strict((out / "live.json").read_text())  # its writer lived to the end of the run
    assert live["run"]["finished"] and live["clients"][ids[0]]["device"]["hostname"]
    assert not set(HOSTILE) & set(live["clients"][ids[0]]["device"])
