"""A device that cannot serve a round says so and keeps serving; a restarted device remembers the newest round it
served; DRAG-BR sizes its root data set from what the data allows (in-process, the same code as over MQTT)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from edge_client.learning.data import ArrayDataset, load_local_data
from edge_client.loop.runtime import EdgeClient
from edge_client.loop.trainer import train_local
from edge_client.wire.messages import Assignment, Failure, Presence
from edge_client.wire.topics import Topics
from edgefl_testkit.fakes import as_sent
from edgefl_testkit.messages import round_assignment
from server.assembly import make_orchestrator, split_clients
from server.config import from_dict
from server.datasets import load_dataset
from server.experiments.inprocess import LocalBus, LocalLink
from server.experiments.simulate import client_ids, prepare_shards

SPEC = {"name": "mlp", "in_features": 64, "num_classes": 10, "hidden": [8]}


def config(tmp_path: Path, rounds: int, **train: object):
    return from_dict({
        "run": {"rounds": rounds, "out": str(tmp_path), "job": "res"},
        "clients": {"count": 2, "round_deadline_s": 60.0, "register_timeout_s": 30.0},
        "data": {"dataset": "digits"},
        "train": {"local_steps": 3, "batch_size": 16, "lr": 0.05, **train},
        "model": SPEC,
    })  # fmt: skip


def test_training_error_is_reported_and_the_client_keeps_serving(tmp_path: Path) -> None:
    cfg = config(tmp_path, rounds=3)
    bundle = load_dataset("digits")
    shards, _ = prepare_shards(bundle, client_ids(2), "iid", 0, tmp_path / "shards")
    bus = LocalBus()
    failures: list[Failure] = []
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # its second round: as if the device ran out of memory
            raise MemoryError("simulated: cannot allocate the activations")
        return train_local(*args, **kwargs)

    for cid, shard in zip(client_ids(2), shards, strict=True):
        train = flaky if cid == "client-01" else train_local
        bus.add_client(EdgeClient(cid, load_local_data(shard), None, job="res", link_factory=bus.connect, train=train))
    spy = LocalLink(bus, [Topics("res").up("client-01")])
    spy.start()
    summary = make_orchestrator(cfg, bundle, tmp_path, link=LocalLink(bus, [Topics("res").all_up],
                                                                      drives_clients=True)).run()  # fmt: skip
    while (got := spy.receive(0)) is not None:
        if isinstance(got[1], Failure):
            failures.append(got[1])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [f.reason for f in failures] == ["train_error"] and "cannot allocate" in failures[0].detail
    assert failures[0].round == 2 and failures[0].run_id == summary["run_id"]
    assert rows[1]["failed"] == {"client-01": "train_error"} and rows[1]["clients_reported"] == 1
    assert rows[2]["clients_reported"] == 2 and summary["rounds"] == 3  # it kept serving


def assignment(run_id: str, round_: int, size: int) -> Assignment:
    return round_assignment(round_, np.zeros(size, np.float32), SPEC, run_id=run_id, deadline_s=10.0, upload=False)


def test_restarted_client_remembers_the_newest_round_it_served(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    data = ArrayDataset(rng.normal(size=(16, 64)).astype(np.float32), rng.integers(0, 10, 16))
    trained: list[int] = []

    def counting(flat, weights, dataset, sampler, plan, algorithm, facts):
        trained.append(facts.round)
        return train_local(flat, weights, dataset, sampler, plan, algorithm, facts)

    def device() -> EdgeClient:
        bus = LocalBus()
        return EdgeClient("c0", data, None, state_dir=tmp_path, link_factory=bus.connect, train=counting)

    def told(client: EdgeClient, run_id: str) -> EdgeClient:  # the server's presence: the current run
        client.handle(Presence("server", True, role="server", run_id=run_id))
        return client

    def handle(client: EdgeClient, a: Assignment) -> None:
        for msg in as_sent(a):
            client.handle(msg)

    first = told(device(), "run-a")
    size = first._model_for(SPEC).size
    third = assignment("run-a", 3, size)
    handle(first, third)
    assert trained == [3] and first.served == ("run-a", 3, third.msg_id)
    again = told(device(), "run-a")  # the process restarted: the state directory says round 3 of run-a was served
    assert again.served == ("run-a", 3, third.msg_id)
    handle(again, third)  # replayed from the broker session: stale
    handle(again, assignment("run-a", 1, size))  # older than the two rounds a resumed server may re-run
    assert trained == [3]
    handle(again, assignment("run-a", 3, size))  # a new assignment for round 3: the server resumed and re-runs it
    handle(again, assignment("run-a", 4, size))
    handle(told(again, "run-b"), assignment("run-b", 1, size))  # a new run starts again at round 1
    assert trained == [3, 3, 4, 1] and again.served[:2] == ("run-b", 1)


@pytest.mark.parametrize(("dataset", "expected"), [("digits", 144), ("mnist", 3000)])
def test_drag_br_root_set_defaults_to_what_the_data_allows(
    dataset: str, expected: int, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = from_dict({"data": {"dataset": dataset}, "train": {"algorithm": "drag-br"}})
    bundle = load_dataset(dataset)
    with caplog.at_level(logging.INFO, logger="edgefl.server"):
        clients, root = split_clients(cfg, bundle)
    assert root is not None and len(root) == expected and len(clients.train) == len(bundle.train) - expected
    assert f"root data set of {expected} of the {len(bundle.train)} training samples" in caplog.text
