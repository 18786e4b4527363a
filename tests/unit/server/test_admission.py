"""The adversarial matrix, in-process: for every algorithm and every field its clients send (delta, each array and
value of its contract, the sample count, the step count), a NaN, an Inf, a huge value, a wrong shape, a wrong dtype,
a lying sample count and more steps than assigned are each refused with their own reason; the round goes on with the
honest updates and the model stays finite.

The same server, the same honest device runtime and the same encoded frames as over MQTT, on the in-process bus
(``server.experiments.inprocess``): one hostile device answers its first assignment with every corruption at once.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from edge_client.algorithms import CONTRACTS
from edge_client.learning.data import load_local_data
from edge_client.loop.runtime import EdgeClient
from edge_client.wire.messages import Assignment, Update, new_msg_id
from edge_client.wire.protocol import encode
from edge_client.wire.topics import Topics
from edgefl_testkit.fakes import FakeDevice, device_topics, hostile_frames, zero_update
from server.assembly import make_orchestrator, split_clients
from server.config import from_dict
from server.datasets import load_dataset
from server.experiments.inprocess import NO_DEADLINE_S, LocalBus, LocalLink
from server.experiments.simulate import client_ids, prepare_shards

HOSTILE, HOSTILE_SAMPLES = "hostile", 100


def run_with_hostile(algorithm: str, tmp_path: Path) -> tuple[dict, list[dict], list[tuple[str, str, bytes]]]:
    """Two honest clients and one hostile device, two rounds; the summary, the metrics rows and what was sent."""
    config = from_dict({
        "run": {"rounds": 2, "out": str(tmp_path), "job": "adv"},
        "clients": {"count": 3, "round_deadline_s": NO_DEADLINE_S, "register_timeout_s": 30.0},
        "data": {"dataset": "digits"},
        "train": {"algorithm": algorithm, "local_steps": 4, "batch_size": 16, "lr": 0.05},
        "model": {"name": "mlp", "in_features": 64, "num_classes": 10, "hidden": [16]},
    })  # fmt: skip
    bundle, root = split_clients(config, load_dataset("digits"))
    honest = client_ids(2)
    shards, _ = prepare_shards(bundle, honest, "iid", 0, tmp_path / "shards")
    bus, topics, contract = LocalBus(), Topics("adv"), CONTRACTS[algorithm]
    sent: list[tuple[str, str, bytes]] = []

    def respond(a: Assignment) -> list[bytes | bytearray]:
        clean = zero_update(a, HOSTILE, HOSTILE_SAMPLES, contract)
        if a.facts.round > 1:
            return [encode(clean)]
        sent.extend(hostile_frames(clean, contract, HOSTILE_SAMPLES))
        return [frame for *_, frame in sent]

    hostile = FakeDevice(None, topics, HOSTILE, HOSTILE_SAMPLES, respond)  # type: ignore[arg-type]
    hostile.link = bus.connect(device_topics(topics, HOSTILE), hostile.hello)
    bus.add_client(hostile)  # first on the bus: its frames are judged while the round still waits for the others
    for cid, shard in zip(honest, shards, strict=True):
        bus.add_client(EdgeClient(cid, load_local_data(shard), None, job="adv", link_factory=bus.connect))
    link = LocalLink(bus, [topics.all_up], drives_clients=True)
    summary = make_orchestrator(config, bundle, tmp_path, link=link, root=root).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, rows, sent


@pytest.mark.parametrize("algorithm", sorted(CONTRACTS))
def test_every_corrupted_field_is_refused_by_reason(algorithm: str, tmp_path: Path) -> None:
    summary, rows, sent = run_with_hostile(algorithm, tmp_path)
    expected = Counter(reason for _, reason, _ in sent)
    assert summary["rejected"] == dict(expected), [what for what, _, _ in sent]
    fields = {what.split()[0] for what, _, _ in sent}
    contract = CONTRACTS[algorithm]
    assert fields >= {"delta", *(a.name for a in contract.returns), *(v.name for v in contract.returns_values)}
    first, second = rows
    assert first["clients_reported"] == 2 and set(first["clients"]) == {"client-00", "client-01"}
    assert HOSTILE in first["failed"] and "dropped" not in first
    assert second["clients_reported"] == 3  # a hostile device is not shut out: its valid update counts again
    assert summary["rounds"] == 2 and np.isfinite(summary["final_accuracy"])
    with np.load(tmp_path / "checkpoint.npz") as saved:
        assert np.all(np.isfinite(saved["weights"]))


def test_a_device_registering_with_an_absurd_sample_count_is_refused(tmp_path: Path) -> None:
    """Data-size weights come from the registration: a claim above clients.max_samples is refused there."""
    config = from_dict({
        "run": {"rounds": 2, "out": str(tmp_path), "job": "liar"},
        "clients": {"count": 2, "round_deadline_s": NO_DEADLINE_S, "max_samples": 100_000},
        "data": {"dataset": "digits"},
        "train": {"algorithm": "fedavg", "local_steps": 2, "batch_size": 16},
        "model": {"name": "mlp", "in_features": 64, "num_classes": 10, "hidden": [8]},
    })  # fmt: skip
    bundle = load_dataset("digits")
    shards, _ = prepare_shards(bundle, client_ids(2), "iid", 0, tmp_path / "shards")
    bus, topics = LocalBus(), Topics("liar")
    liar = FakeDevice(None, topics, "liar", 2**31, lambda a: [encode(zero_update(a, "liar", 2**31))])  # type: ignore[arg-type]
    liar.link = bus.connect(device_topics(topics, "liar"), liar.hello)
    bus.add_client(liar)
    for cid, shard in zip(client_ids(2), shards, strict=True):
        bus.add_client(EdgeClient(cid, load_local_data(shard), None, job="liar", link_factory=bus.connect))
    summary = make_orchestrator(
        config, bundle, tmp_path, link=LocalLink(bus, [topics.all_up], drives_clients=True)
    ).run()
    assert liar.assignments == [] and summary["clients"] == 2
    assert summary["rejected"].get("num_samples", 0) >= 1


class Interrupted(Exception):
    pass


def test_rejections_survive_a_resume(tmp_path: Path) -> None:
    """summary.json's ``rejected`` counts the rounds before a server restart too (they are in metrics.jsonl)."""
    config = from_dict({
        "run": {"rounds": 3, "out": str(tmp_path), "job": "resume"},
        "clients": {"count": 2, "round_deadline_s": NO_DEADLINE_S},
        "data": {"dataset": "digits"},
        "train": {"algorithm": "fedavg", "local_steps": 2, "batch_size": 16},
        "model": {"name": "mlp", "in_features": 64, "num_classes": 10, "hidden": [8]},
    })  # fmt: skip
    bundle = load_dataset("digits")
    shards, _ = prepare_shards(bundle, client_ids(1), "iid", 0, tmp_path / "shards")

    def server(observer: object | None = None):
        bus, topics = LocalBus(), Topics("resume")

        def respond(a: Assignment) -> list[bytes | bytearray]:
            clean = zero_update(a, "odd", HOSTILE_SAMPLES)
            lying = Update(**{**vars(clean), "num_samples": 7, "msg_id": new_msg_id()})
            return [encode(lying), encode(clean)] if a.facts.round == 1 else [encode(clean)]

        odd = FakeDevice(None, topics, "odd", HOSTILE_SAMPLES, respond)  # type: ignore[arg-type]
        odd.link = bus.connect(device_topics(topics, "odd"), odd.hello)
        bus.add_client(odd)
        bus.add_client(
            EdgeClient("client-00", load_local_data(shards[0]), None, job="resume", link_factory=bus.connect)
        )
        link = LocalLink(bus, [topics.all_up], drives_clients=True)
        return make_orchestrator(config, bundle, tmp_path, link=link, observer=observer)

    class StopAfterRound2:
        def waiting(self, text: str) -> None:
            pass

        def round_done(self, row: dict) -> None:
            if row["round"] == 2:
                raise Interrupted  # as if the server process died after checkpointing round 2

    with pytest.raises(Interrupted):
        server(StopAfterRound2()).run()
    summary = server().run()  # resumes at round 3
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3] and rows[0]["rejected"] == {"num_samples": 1}
    assert summary["rejected"] == {"num_samples": 1}
