"""EdgeClient, the Python API, against a real mosquitto; the test plays the server over its own MqttLink."""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from torch import nn

from edge_client.algorithms.fedavg import CONTRACT as FEDAVG
from edge_client.algorithms.fedavg import FedAvgClient
from edge_client.learning.data import ArrayDataset, BatchSampler
from edge_client.learning.flat import FlatModel
from edge_client.learning.models import build_model, get_flat, num_params
from edge_client.loop.runtime import EdgeClient
from edge_client.wire.messages import (
    Ack,
    Assignment,
    Failure,
    GlobalModel,
    Hello,
    Message,
    ModelRequest,
    Presence,
    Resync,
    Stop,
    Update,
    model_digest,
)
from edge_client.wire.protocol import encode
from edge_client.wire.topics import Topics
from edge_client.wire.transport import LinkConfig, MqttLink
from edgefl_testkit.algorithms import train_assignment
from edgefl_testkit.messages import round_assignment
from server.broker import Broker
from server.distribution import Distribution

TIMEOUT = 30.0
CID = "c3"
SPEC = {"name": "mlp", "in_features": 8, "num_classes": 3, "hidden": [16]}
OTHER_SPEC = {"name": "mlp", "in_features": 8, "num_classes": 3, "hidden": [4]}


def make_dataset(n: int = 40) -> ArrayDataset:
    rng = np.random.default_rng(11)
    return ArrayDataset(rng.normal(size=(n, 8)).astype(np.float32), rng.integers(0, 3, size=n))


def assignment(round_: int, local_steps: int, weights: np.ndarray, spec: dict[str, Any] = SPEC) -> Assignment:
    return round_assignment(round_, weights, spec, steps=local_steps, lr=0.05, batch_size=8, seed=2)


class FakeServer:
    """The server's side of the protocol, on one MqttLink with the server's login."""

    def __init__(self, broker: Broker, job: str) -> None:
        self.topics = Topics(job)
        config = LinkConfig(broker.url, broker.server.username, broker.server.password, connect_timeout_s=TIMEOUT)
        self.link = MqttLink(config, f"test-server-{job}", [self.topics.all_up])
        self.link.start()
        # The SUBSCRIBE went out before this PUBLISH on the same connection, so once the broker acknowledges the
        # publish it has also processed the subscription: no hello can be missed. Retained with the run's model, as
        # the server announces itself: a device registers once it has seen it.
        online = Presence(client_id="server", online=True, role="server", model=dict(SPEC))
        self.link.publish(self.topics.server, encode(online), retain=True)
        assert self.link.wait_published(TIMEOUT)
        self.distribution = Distribution(self.link, self.topics, FEDAVG)  # the server's own way of sending rounds

    def assign(self, a: Assignment) -> None:
        """``a`` as the server sends it: its model broadcast once per version, then the assignment naming it."""
        f = a.facts
        sha = self.distribution.publish(f.round, f.model_version, a.plan.weights, {CID: a.plan}, f.run_id)
        self.distribution.send({CID: a.plan}, {CID: dataclasses.replace(f, sha256=sha)})
        assert self.link.wait_published(TIMEOUT)

    def named(self, a: Assignment, **facts: Any) -> Assignment:
        """``a`` naming its round's model (its facts changed by ``facts``), which the server holds, to answer a device
        that asks for it, but does not broadcast."""
        f = a.facts
        sha = self.distribution.split(f.round, f.model_version, a.plan.weights, {CID: a.plan}, f.run_id)
        return Assignment(a.plan, dataclasses.replace(f, sha256=sha, **facts))

    def send(self, msg: Message, topic: str | None = None) -> None:
        self.link.publish(topic or self.topics.down(CID), encode(msg))
        assert self.link.wait_published(TIMEOUT)

    def expect(self, kind: type, skip: tuple[type, ...] = ()) -> Any:
        """The next message of type ``kind`` from CID; messages of the ``skip`` types are passed over. Every hello is
        and resync is answered as the server answers it (an ack naming the run, here the empty run id of these
        assignments)."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            received = self.link.receive(timeout=max(0.0, deadline - time.monotonic()))
            assert received is not None, f"no {kind.__name__} within {TIMEOUT} s"
            topic, msg = received
            assert topic == self.topics.up(CID)
            if isinstance(msg, (Hello, Resync)):
                self.send(Ack(of=msg.msg_id, accepted=True))
                if isinstance(msg, Resync) and kind is not Resync:
                    continue  # the device asks for its assignment on starting: nothing is owed here
            if isinstance(msg, kind):
                return msg
            assert isinstance(msg, skip), f"expected {kind.__name__}, got {msg!r}"

    def stop(self) -> None:
        self.distribution.clear()
        self.link.wait_published(TIMEOUT)
        self.link.stop()


class ClientThread:
    """EdgeClient.run on a thread; exceptions are kept for the test to assert on."""

    def __init__(self, client: EdgeClient, max_rounds: int | None, once: bool = False) -> None:
        self.client = client
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(max_rounds, once), daemon=True)
        self.thread.start()

    def _run(self, max_rounds: int | None, once: bool) -> None:
        try:
            self.client.run(max_rounds=max_rounds, once=once)
        except BaseException as exc:
            self.errors.append(exc)

    def join(self) -> None:
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive(), "EdgeClient.run did not return"
        assert self.errors == []


@pytest.fixture
def job() -> str:
    return f"rt-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def server(broker: Broker, job: str) -> Iterator[FakeServer]:
    srv = FakeServer(broker, job)
    try:
        yield srv
    finally:
        srv.link.publish(srv.topics.broadcast, encode(Stop(reason="test teardown")))  # a failed test's client ends
        srv.link.wait_published(TIMEOUT)
        srv.stop()


def make_client(broker: Broker, job: str, dataset: ArrayDataset, **kwargs: Any) -> EdgeClient:
    config = LinkConfig(broker.url, CID, broker.devices[CID].password, connect_timeout_s=TIMEOUT)
    return EdgeClient(CID, dataset, config, job=job, **kwargs)


def test_two_rounds_with_a_custom_model_factory(broker: Broker, job: str, server: FakeServer) -> None:
    seen: list[dict[str, Any]] = []

    def factory(spec: dict[str, Any]) -> nn.Module:
        seen.append(dict(spec))
        return build_model(spec)

    dataset = make_dataset()
    runner = ClientThread(make_client(broker, job, dataset, model_factory=factory), max_rounds=2)

    hello = server.expect(Hello)
    assert hello.client_id == CID
    assert hello.num_samples == len(dataset)
    assert hello.device["hostname"] == socket.gethostname()
    assert hello.device["machine"]
    assert isinstance(hello.device["cpu_count"], int) and hello.device["cpu_count"] >= 1

    weights = get_flat(build_model(SPEC))
    first = assignment(1, 7, weights)
    server.assign(first)
    update1 = server.expect(Update, skip=(Hello,))
    server.assign(assignment(2, 3, weights - update1.delta))
    update2 = server.expect(Update, skip=(Hello,))

    runner.join()  # max_rounds=2: run() returns after the second update
    assert runner.client.rounds_done == 2
    done = server.expect(Presence, skip=(Hello,))
    assert (done.online, done.reason) == (False, "done")

    n = num_params(build_model(SPEC))
    for update, round_, steps in ((update1, 1, 7), (update2, 2, 3)):
        assert update.round == round_ and update.model_version == round_ - 1
        assert update.client_id == CID
        assert update.local_steps == steps
        assert update.num_samples == len(dataset)
        assert update.delta.shape == (n,)
        assert np.all(np.isfinite(update.delta)) and np.abs(update.delta).max() > 0
        assert update.compute_s >= 0 and update.cpu_s >= 0 and np.isfinite(update.train_loss)
        for when in ("before", "after"):
            assert {"cpu_percent", "rss_mb"} <= set(update.metrics[when])
        assert update.metrics["bytes_down"] > 0
    # the first update carries no upload figures yet; the second reports the first upload
    assert update1.metrics["last_upload"] == {}
    assert update2.metrics["last_upload"]["bytes"] > 0

    assert seen == [SPEC]  # the factory got the spec from the wire, once: the model is reused for the same spec

    # round 1's delta is what the trainer gives for that assignment, this client's data and sampler
    expected = train_assignment(
        FlatModel(build_model(SPEC)), dataset, BatchSampler(len(dataset), 8, 2, CID), first, FedAvgClient()
    )
    np.testing.assert_allclose(update1.delta, expected.delta, rtol=1e-5, atol=1e-6)


def test_stop_on_broadcast_ends_run_once(
    broker: Broker, job: str, server: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    """``once``: the stop of the run the device registered with ends run(); a stop of another run is ignored."""
    caplog.set_level(logging.INFO, logger="edge_client")
    runner = ClientThread(make_client(broker, job, make_dataset()), max_rounds=None, once=True)
    server.expect(Hello)  # connected and subscribed (the hello follows the SUBSCRIBE on the client's connection)
    server.send(Stop(reason="some other run ended", run_id="another-run"), topic=server.topics.broadcast)
    server.send(Stop(reason="training finished"), topic=server.topics.broadcast)
    runner.join()
    assert runner.client.rounds_done == 0
    done = server.expect(Presence, skip=(Hello,))
    assert (done.client_id, done.online, done.reason) == (CID, False, "done")
    assert "ignoring the server's stop of run another-run (some other run ended)" in caplog.text
    assert "left run ; exiting (--once)" in caplog.text


def test_assignment_with_mismatched_model_is_reported_and_skipped(
    broker: Broker, job: str, server: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="edge_client.loop.runtime")
    runner = ClientThread(make_client(broker, job, make_dataset()), max_rounds=1)
    server.expect(Hello)

    good = get_flat(build_model(SPEC))
    wrong = get_flat(build_model(OTHER_SPEC))
    assert wrong.size != good.size
    server.assign(assignment(1, 5, wrong, spec=SPEC))  # SPEC's model, OTHER_SPEC's weights
    server.assign(assignment(2, 4, good, spec=SPEC))

    # MQTT keeps one publisher's QoS 1 order and the client serves one assignment at a time: round 1's answer
    # arrives before round 2's. It is a failure report (the server stops waiting), not an update.
    failure = server.expect(Failure, skip=(Hello,))
    assert (failure.round, failure.client_id, failure.reason) == (1, CID, "assignment")
    assert "parameters" in failure.detail
    update = server.expect(Update, skip=(Hello,))
    assert update.round == 2 and update.local_steps == 4
    runner.join()  # max_rounds=1: the skipped round did not count
    assert runner.client.rounds_done == 1
    done = server.expect(Presence, skip=(Hello,))
    assert done.reason == "done"
    assert any("round 1" in r.getMessage() and "cannot serve" in r.getMessage() for r in caplog.records)


def test_a_model_held_is_not_fetched_again(broker: Broker, job: str, server: FakeServer) -> None:
    """Two rounds from the same model version (a dropped round): it is broadcast once, the device trains both rounds
    from it, and its second round downloads only the assignment."""
    dataset = make_dataset()
    runner = ClientThread(make_client(broker, job, dataset), max_rounds=2)
    server.expect(Hello)
    spec = {**SPEC, "hidden": [256]}  # 12 kB of weights: far more than an assignment
    weights = get_flat(build_model(spec))
    server.assign(assignment(1, 3, weights, spec))
    update1 = server.expect(Update, skip=(Hello,))
    out_before = server.link.bytes_out
    server.assign(assignment(2, 3, weights, spec))
    update2 = server.expect(Update, skip=(Hello,))
    runner.join()
    sent = server.link.bytes_out - out_before
    assert sent < weights.nbytes / 10  # round 2: the assignment alone, no model
    assert update1.metrics["bytes_down"] > weights.nbytes  # round 1: the model came with it
    assert sent <= update2.metrics["bytes_down"] < weights.nbytes / 10  # the assignment (and an ack the server sent)
    sampler, flat = BatchSampler(len(dataset), 8, 2, CID), FlatModel(build_model(spec))  # what round 2 trains on
    for a, update in ((assignment(1, 3, weights, spec), update1), (assignment(2, 3, weights, spec), update2)):
        expected = train_assignment(flat, dataset, sampler, a, FedAvgClient())
        np.testing.assert_allclose(update.delta, expected.delta, rtol=1e-5, atol=1e-6)


def test_a_device_that_missed_the_model_asks_the_server_for_it(broker: Broker, job: str, server: FakeServer) -> None:
    """The assignment arrives but the broadcast did not: the device asks once and trains on the model the server
    sends to it alone, byte for byte what the broadcast would have carried."""
    dataset = make_dataset()
    runner = ClientThread(make_client(broker, job, dataset, model_wait_s=0.2), max_rounds=1)
    server.expect(Hello)
    weights = get_flat(build_model(SPEC))
    a = assignment(1, 4, weights)
    server.send(server.named(a))  # the model is never broadcast
    request = server.expect(ModelRequest, skip=(Hello,))
    assert (request.client_id, request.round, request.sha256) == (CID, 1, model_digest(weights, {}))
    server.distribution.answer(CID, request, told={CID})
    update = server.expect(Update, skip=(Hello,))
    runner.join()
    expected = train_assignment(
        FlatModel(build_model(SPEC)), dataset, BatchSampler(len(dataset), 8, 2, CID), a, FedAvgClient()
    )
    np.testing.assert_allclose(update.delta, expected.delta, rtol=1e-5, atol=1e-6)


def test_a_model_that_does_not_match_its_digest_is_reported_not_trained(
    broker: Broker, job: str, server: FakeServer
) -> None:
    runner = ClientThread(make_client(broker, job, make_dataset(), model_wait_s=60.0), max_rounds=1)
    server.expect(Hello)
    weights = get_flat(build_model(SPEC))
    slim = server.named(assignment(1, 4, weights))
    server.send(slim)
    garbage = weights.copy()
    garbage[7] += 1.0  # one value off: the bytes no longer hash to the digest the assignment names
    server.send(GlobalModel(1, 0, slim.facts.sha256, garbage), topic=server.topics.round_model_frame(0))
    failure = server.expect(Failure, skip=(Hello,))
    assert (failure.round, failure.reason) == (1, "model_hash")
    server.assign(assignment(2, 4, weights))  # the device keeps serving
    assert server.expect(Update, skip=(Hello,)).round == 2
    runner.join()


def test_a_model_that_never_comes_is_reported_at_the_deadline(broker: Broker, job: str, server: FakeServer) -> None:
    runner = ClientThread(make_client(broker, job, make_dataset(), model_wait_s=0.1), max_rounds=1)
    server.expect(Hello)
    weights = get_flat(build_model(SPEC))
    server.send(server.named(assignment(1, 4, weights), deadline_s=1.0))
    server.expect(ModelRequest, skip=(Hello,))  # asked, never answered
    failure = server.expect(Failure, skip=(Hello,))
    assert (failure.round, failure.reason) == (1, "model_unavailable")
    server.assign(assignment(2, 4, weights))
    assert server.expect(Update, skip=(Hello,)).round == 2
    runner.join()
