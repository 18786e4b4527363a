"""The device side of compression (edge_client/loop/compression.py) inside a real EdgeClient: uploads coded as the
assignment says, top-k error feedback carrying exactly what was not sent, its residual surviving a restart, and the
round model's broadcast difference applied to the model held, or the full model asked for, never a model that does not
hash to its digest."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.algorithms.base import ClientAlgorithm
from edge_client.algorithms.fedavg import CONTRACT as FEDAVG
from edge_client.learning.data import ArrayDataset, BatchSampler
from edge_client.learning.flat import FlatModel
from edge_client.learning.models import build_model, num_params
from edge_client.loop.models_cache import ModelCache
from edge_client.loop.runtime import EdgeClient
from edge_client.loop.trainer import TrainResult
from edge_client.wire import codecs as C
from edge_client.wire.messages import (
    Assignment,
    Failure,
    GlobalModel,
    Hello,
    Message,
    ModelRequest,
    Presence,
    Resync,
    RoundFacts,
    Update,
)
from edge_client.wire.plan import Plan
from edge_client.wire.protocol import encode
from edge_client.wire.topics import Topics
from edgefl_testkit.messages import round_assignment
from server.distribution import Distribution
from server.downlink import Downlink
from server.experiments.inprocess import LocalBus, LocalLink

JOB, CID = "comp", "pi-01"
SPEC = {"name": "mlp", "in_features": 8, "num_classes": 3, "hidden": [16]}
SIZE = num_params(build_model(SPEC))  # 195
TOPICS = Topics(JOB)


class Scripted:
    """A TrainFn returning the next of the given deltas: the upload path sees exactly these vectors."""

    def __init__(self, deltas: list[np.ndarray]) -> None:
        self.deltas = list(deltas)
        self.started_from: list[np.ndarray] = []

    def __call__(
        self,
        flat: FlatModel,
        weights: np.ndarray,
        data: ArrayDataset,
        s: BatchSampler,
        plan: Plan,
        a: ClientAlgorithm,
        facts: RoundFacts,
    ) -> TrainResult:
        self.started_from.append(np.array(weights))
        return TrainResult(self.deltas.pop(0), plan.steps, 0.01, 0.01, 0.5)


class Device:
    """One EdgeClient on an in-process bus, and the server's end of that bus, sending rounds as the server does
    (``server.distribution``: the round's model broadcast, with ``downlink`` its codec, then the assignment)."""

    def __init__(self, state_dir: Path, train: Scripted, downlink: str = "fp32") -> None:
        self.bus = LocalBus()
        self.server = LocalLink(self.bus, [TOPICS.all_up]).start()
        self.distribution = Distribution(self.server, TOPICS, FEDAVG, Downlink(downlink, seed=0))
        self.requests: list[ModelRequest] = []  # the device asked for the full model
        rng = np.random.default_rng(0)
        data = ArrayDataset(rng.normal(size=(20, 8)).astype(np.float32), rng.integers(0, 3, size=20))
        self.client = EdgeClient(
            CID, data, None, job=JOB, state_dir=state_dir, link_factory=self.bus.connect, train=train
        )
        self.bus.add_client(self.client)
        self.run = ""  # a device says hello once the server has announced itself (serve does, with the run)

    def receive(self) -> Message:
        got = self.server.receive(0)
        assert got is not None
        return got[1]

    def announce(self, run_id: str) -> None:
        """The server's presence naming ``run_id``: a device serves assignments of the run it was told is current."""
        online = Presence(client_id="server", online=True, role="server", model=dict(SPEC), run_id=run_id)
        self.server.publish(TOPICS.server, encode(online), retain=True)
        assert self.bus.run_next_client()
        while (got := self.server.receive(0)) is not None:  # its hello, or a resync
            assert isinstance(got[1], Hello | Resync), got[1]
        self.run = run_id

    def serve(self, a: Assignment) -> Message:
        """Send ``a`` with its model, let the device handle it, answer its request for the model if it asks; return
        what it answered (its update or failure)."""
        f = a.facts
        if f.run_id != self.run:
            self.announce(f.run_id)
        sha = self.distribution.publish(f.round, f.model_version, a.plan.weights, {CID: a.plan}, f.run_id)
        self.distribution.send({CID: a.plan}, {CID: replace(f, sha256=sha)})
        return self.answer()

    def answer(self) -> Message:
        """Run the device until it sends its update or failure, sending it the full model when it asks."""
        while True:
            assert self.bus.run_next_client()
            msg = self.receive()
            if not isinstance(msg, ModelRequest):
                return msg
            self.requests.append(msg)
            self.distribution.answer(CID, msg, {CID})


def assignment(round_: int, codec: str = "fp32", run: str = "run-a", **fields: Any) -> Assignment:
    weights = fields.pop("weights", np.zeros(SIZE, np.float32))
    return round_assignment(round_, weights, SPEC, steps=2, codec=codec, run_id=run, **fields)


def deltas(n: int, seed: int = 5) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SIZE).astype(np.float32) for _ in range(n)]


def test_uploads_travel_with_the_codec_the_assignment_names(tmp_path: Path) -> None:
    sent = deltas(3)
    device = Device(tmp_path, Scripted(sent))
    for round_, codec in enumerate(["fp32", "int8", "fp16"], start=1):
        update = device.serve(assignment(round_, codec))
        assert isinstance(update, Update)
        if codec == "fp32":
            assert update.codecs == {} and np.array_equal(update.delta, sent[0])
        else:
            assert update.codecs == {"delta": C.parse(codec).wire(SIZE)}
            assert not np.array_equal(update.delta, sent[round_ - 1])  # lossy ...
            assert np.allclose(update.delta, sent[round_ - 1], atol=np.abs(sent[round_ - 1]).max() / 100)  # ... close
    assert not (tmp_path / JOB / "uplink.npz").exists()  # no top-k, no residual to keep


def test_error_feedback_carries_exactly_what_was_not_sent_and_survives_a_restart(tmp_path: Path) -> None:
    d1, d2, d3 = deltas(3)
    codec = "topk:0.05"  # 10 of 195 entries
    k = C.parse(codec).count(SIZE)
    device = Device(tmp_path, Scripted([d1]))
    u1 = device.serve(assignment(1, codec))
    assert isinstance(u1, Update) and np.count_nonzero(u1.delta) == k
    kept = np.flatnonzero(u1.delta)
    assert np.array_equal(u1.delta[kept], d1[kept])  # the k largest entries, exactly
    residual = device.client.uplink.residuals["delta"]
    assert np.array_equal(residual, np.where(u1.delta != 0, 0, d1))  # exactly what was not sent
    assert (tmp_path / JOB / "uplink.npz").exists()

    restarted = Device(tmp_path, Scripted([d2, d3]))  # a new process on the same state directory
    assert np.array_equal(restarted.client.uplink.residuals["delta"], residual)
    u2 = restarted.serve(assignment(2, codec))
    assert isinstance(u2, Update)
    carried = d2 + residual  # what round 2 had to send
    r2 = restarted.client.uplink.residuals["delta"]
    assert np.array_equal(u2.delta + r2, carried) and np.count_nonzero(u2.delta) == k
    assert np.abs(u2.delta[u2.delta != 0]).min() >= np.sort(np.abs(carried))[-k]
    # nothing is lost: what arrived plus what is still kept is everything the device computed
    np.testing.assert_allclose(u1.delta + u2.delta + r2, d1 + d2, atol=1e-6)

    u3 = restarted.serve(assignment(3, "fp32"))  # a device moved to fp32 sends the residual with its update
    assert isinstance(u3, Update) and np.array_equal(u3.delta, d3 + r2)
    assert restarted.client.uplink.residuals == {}
    assert Device(tmp_path, Scripted([])).client.uplink.residuals == {}  # and the emptied state was saved


def test_a_new_run_starts_without_the_old_runs_residual(tmp_path: Path) -> None:
    d1, d2 = deltas(2)
    device = Device(tmp_path, Scripted([d1, d2]))
    device.serve(assignment(1, "topk:0.05", run="run-a"))
    update = device.serve(assignment(1, "fp32", run="run-b"))
    assert isinstance(update, Update) and np.array_equal(update.delta, d2)


def test_a_diverged_round_is_reported_not_sent_lossily(tmp_path: Path) -> None:
    bad = deltas(1)[0]
    bad[3] = np.nan
    device = Device(tmp_path, Scripted([bad]))
    answer = device.serve(assignment(1, "int8"))
    assert isinstance(answer, Failure) and answer.reason == "encode" and "non-finite" in answer.detail


# ------------------------------------------------------------------------------------------------ model difference
def test_a_device_rebuilds_the_model_from_the_broadcast_difference_or_asks_for_it(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    m1 = rng.standard_normal(SIZE).astype(np.float32)
    w2 = m1 + rng.standard_normal(SIZE).astype(np.float32) * np.float32(0.01)
    w3 = w2 + rng.standard_normal(SIZE).astype(np.float32) * np.float32(0.01)
    train = Scripted(deltas(3))
    device = Device(tmp_path, train, downlink="int8")
    assert isinstance(device.serve(assignment(1, weights=m1)), Update)
    assert device.distribution.broadcast == "model" and np.array_equal(train.started_from[0], m1)
    assert isinstance(device.serve(assignment(2, weights=w2)), Update)
    assert device.distribution.broadcast == "difference" and device.requests == []
    published = device.distribution.current
    assert published is not None and np.array_equal(train.started_from[1], published.weights)  # bit for bit
    assert not np.array_equal(published.weights, w2)  # lossy: the model devices rebuild, not the server's
    # a device without the difference's base (a restarted process keeps no models) asks at once for the full model
    device.client.models = ModelCache()
    assert isinstance(device.serve(assignment(3, weights=w3)), Update)
    published = device.distribution.current
    assert published is not None and [r.sha256 for r in device.requests] == [published.sha256]
    assert device.distribution.broadcast == "difference" and np.array_equal(train.started_from[2], published.weights)


def test_a_model_that_does_not_hash_to_its_digest_is_never_trained_on(tmp_path: Path) -> None:
    m1 = np.ones(SIZE, np.float32)
    train = Scripted(deltas(2))
    device = Device(tmp_path, train, downlink="int8")
    assert isinstance(device.serve(assignment(1, weights=m1)), Update)
    held = device.distribution.current
    assert held is not None
    diff, _ = C.encode_model_diff(m1, m1 * 2, C.parse("int8"), np.random.default_rng(0))
    wrong = "0" * 64  # a difference announced to rebuild a model it does not rebuild: the device asks instead
    bad = GlobalModel(2, 1, wrong, C.decode(diff), diff_base=held.sha256, run_id="run-a")
    device.server.publish(TOPICS.round_model_frame(0), encode(bad), retain=True)
    device.server.publish(TOPICS.down(CID), encode(assignment(2, weights=None, sha256=wrong)))
    assert device.bus.run_next_client()
    request = device.receive()
    assert isinstance(request, ModelRequest) and request.sha256 == wrong
    # the full model it is sent does not hash to the digest either: a failure, and nothing trained
    device.server.publish(TOPICS.down(CID), encode(GlobalModel(2, 1, wrong, m1 * 2, run_id="run-a")))
    assert device.bus.run_next_client()
    failure = device.receive()
    assert isinstance(failure, Failure) and failure.reason == "model_hash"
    assert len(train.started_from) == 1
