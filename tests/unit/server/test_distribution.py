"""One model per round (issue 16): how a round's assignments are split into one model and small assignments, what the
server answers a device that asks for the model, and a federation's egress per round."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edge_client.algorithms.scaffold import CONTRACT as SCAFFOLD
from edge_client.wire.messages import Assignment, ModelRequest, RoundFacts, model_digest
from edge_client.wire.plan import Plan
from edge_client.wire.protocol import DuplicateMessage, InvalidField, OutOfRound
from edge_client.wire.topics import Topics
from edgefl_testkit.federation import make_config
from server.datasets import load_dataset
from server.distribution import Distribution, split_round
from server.experiments.inprocess import LocalBus, LocalLink, run_inprocess
from server.experiments.simulate import client_ids, prepare_shards

W = np.linspace(-1, 1, 50, dtype=np.float32)
C = np.full(50, 0.25, np.float32)


def _plan(weights: np.ndarray | None = None, **arrays: np.ndarray) -> Plan:
    return Plan(2, 0.1, 8, arrays=arrays, weights=weights)


def _send(dist: Distribution, round_: int, version: int, plans: dict[str, Plan]) -> dict[str, tuple[Assignment, int]]:
    """The orchestrator's two steps: the round's model, then the assignments naming it with the round's facts."""
    sha = dist.publish(round_, version, W, plans, "")
    facts = RoundFacts(round=round_, model_version=version, sha256=sha, deadline_s=10.0, algorithm="scaffold",
                       model={"name": "mlp"})  # fmt: skip
    return dist.send(plans, dict.fromkeys(plans, facts))


def test_a_round_becomes_one_model_with_the_global_arrays_and_assignments_with_their_own() -> None:
    model, shares = split_round(SCAFFOLD, 4, 3, W, {"a": _plan(c=C.copy(), own=W[:3]), "b": _plan(c=C)})
    assert (model.round, model.model_version, model.sha256) == (4, 3, model_digest(W, {"c": C}))
    assert model.weights is W and list(model.arrays) == ["c"]
    for cid, (uses, _) in shares.items():
        assert uses == ["c"], cid
    assert list(shares["a"][1]) == ["own"] and shares["b"][1] == {}
    # what travels: no weights, the model named by the facts, the shared arrays by name, the client's own arrays
    bus, topics = LocalBus(), Topics("split")
    device = LocalLink(bus, [topics.down("a")]).start()
    sent = _send(Distribution(LocalLink(bus, []).start(), topics, SCAFFOLD), 4, 3, {"a": _plan(c=C, own=W[:3])})
    (_, got), none = device.receive(0), device.receive(0)
    assert isinstance(got, Assignment) and none is None and sent["a"][0].msg_id == got.msg_id
    assert got.plan.weights is None and got.facts.sha256 == model_digest(W, {"c": C}) and got.global_arrays == ["c"]
    assert list(got.arrays) == ["own"]


@pytest.mark.parametrize(
    ("other", "message"),
    [(_plan(W + 1, c=C), "different models"), (_plan(c=C + 1), "array 'c' of scope 'global' differs")],
)
def test_clients_of_one_round_must_share_the_model_and_the_global_arrays(other: Plan, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_round(SCAFFOLD, 4, 3, W, {"a": _plan(c=C), "b": other})


def test_the_model_is_broadcast_once_per_version_and_sent_on_request_once_per_round() -> None:
    bus, topics = LocalBus(), Topics("dist")
    server = LocalLink(bus, [topics.all_up]).start()
    device = LocalLink(bus, [topics.down("a"), topics.round_model_frames]).start()
    dist = Distribution(server, topics, SCAFFOLD)
    _send(dist, 4, 3, {"a": _plan(c=C), "b": _plan(c=C)})
    first = dist.take_bytes_out()
    received = [msg for _, msg in iter(lambda: device.receive(0), None)]
    assert [type(m).__name__ for m in received] == ["GlobalModel", "Assignment"]
    model_bytes = len(dist.model_message(dist.current))  # type: ignore[arg-type]
    assert model_bytes < first < model_bytes + 2 * 1024  # one model, two small assignments
    _send(dist, 5, 3, {"a": _plan(c=C), "b": _plan(c=C)})  # a dropped round: the same version again
    assert dist.take_bytes_out() < 2 * 1024
    assert [type(m).__name__ for _, m in iter(lambda: device.receive(0), None)] == ["Assignment"]

    sha = received[0].sha256
    dist.answer("a", ModelRequest(5, "a", sha), told={"a", "b"})
    assert dist.take_bytes_out() == model_bytes
    assert dist.requested_bytes == {"a": model_bytes}  # counted in a's bytes_down (server.orchestrator)
    (_, again), none = device.receive(0), device.receive(0)
    assert again.sha256 == sha and none is None
    with pytest.raises(DuplicateMessage):
        dist.answer("a", ModelRequest(5, "a", sha), told={"a", "b"})
    with pytest.raises(InvalidField):  # a device asking in another's name
        dist.answer("b", ModelRequest(5, "a", sha), told={"a", "b"})
    with pytest.raises(OutOfRound):  # not assigned this round
        dist.answer("c", ModelRequest(5, "c", sha), told={"a", "b"})
    with pytest.raises(OutOfRound):  # another model than this round's
        dist.answer("b", ModelRequest(5, "b", "0" * 64), told={"a", "b"})
    assert dist.take_bytes_out() == 0
    dist.lost("a")  # the server sent "a" its assignment again (server.delivery): it may have lost the model too
    dist.answer("a", ModelRequest(5, "a", sha), told={"a", "b"})
    assert dist.take_bytes_out() == model_bytes


def test_a_federation_sends_one_model_per_round(tmp_path: Path) -> None:
    """Four real clients in-process (SCAFFOLD: the model and c go out once): each round's bytes_out is one model
    message plus four assignments, not one model per client."""
    config = make_config(
        tmp_path, "egress", 4, 2, train={"algorithm": "scaffold", "local_steps": 2}, simulation={"threads": 1}
    )
    bundle = load_dataset("digits", seed=0)
    out = Path(config.run.out)
    shards, _ = prepare_shards(bundle, client_ids(4), "iid", 0, out / "shards")
    run_inprocess(config, shards, bundle, out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    for r in rows:
        assignments = sum(told["bytes_down"] for told in r["instructions"].values())
        model = r["bytes_out"] - assignments
        assert assignments < 4 * 2048 < model  # the model message is far larger than the assignments
        for cid, c in r["clients"].items():
            # every byte its link carried down: its assignment and the round's model (broadcast once to all)
            assert c["bytes_down"] == r["instructions"][cid]["bytes_down"] + model
            assert c["device"]["bytes_down"] > model, cid  # what the device received: the model and its assignment
