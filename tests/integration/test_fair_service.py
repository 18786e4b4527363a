"""Fair service (issue 23) over a real mosquitto: no device can flood the server, its egress or the broker. The token
buckets and the server's fair inbox, in-process: tests/unit/server/test_rate_limits.py.

- Over a real mosquitto, a device alternating resync and model request (the issue's x544 amplification), with an
  offline session of its own as a sink: the server sends it the model at most ``RESENDS_PER_ROUND`` times a round,
  and the sink receives no more than that.
- The generated mosquitto config bounds what it queues for an offline session in bytes, not only in messages.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from paho.mqtt.client import Client

from edge_client.wire.messages import Assignment, ModelRequest, Resync
from edge_client.wire.protocol import encode
from edge_client.wire.topics import Topics
from edge_client.wire.transport import LinkConfig
from edgefl_testkit.fakes import FakeDevice, zero_update
from edgefl_testkit.federation import make_config
from edgefl_testkit.mqtt import connect_client
from server.assembly import make_orchestrator
from server.broker import Broker, BrokerSettings
from server.datasets import load_dataset
from server.rate_limits import RESENDS_PER_ROUND

PAIRS = 400  # resync + model request pairs, as in the issue
SENTINEL = b"sentinel"


# ------------------------------------------------------------------------------- amplification, real mosquitto
def _flooder(job: str, client_id: str, publish_up: Callable[[bytes | bytearray], None]) -> Callable[..., Any]:
    """Answers each assignment with the issue's flood, then a zero update (so the round closes)."""

    def respond(a: Assignment) -> list[bytes | bytearray]:
        for _ in range(PAIRS):
            publish_up(encode(Resync(client_id, since=uuid.uuid4().hex, round=0)))
            f = a.facts
            publish_up(encode(ModelRequest(f.round, client_id, f.sha256, run_id=f.run_id)))
        return [encode(zero_update(a, client_id, 10))]

    return respond


class Sink:
    """A session of a device's own login, subscribed to its down topic and then offline: what the broker keeps for it
    is what it receives once it reconnects (``drain``)."""

    def __init__(self, broker: Broker, username: str, password: str, topic: str) -> None:
        self.broker, self.login, self.topic = broker, (username, password), topic
        self.client_id = f"sink-{uuid.uuid4().hex[:8]}"
        self.received: list[bytes] = []
        self._done = threading.Event()
        client = self._connect(600)
        subscribed = threading.Event()
        client.on_subscribe = lambda *_: subscribed.set()
        client.subscribe(topic, qos=1)
        assert subscribed.wait(10)
        client.disconnect()
        client.loop_stop()

    def _connect(self, expiry: int) -> Client:
        def setup(client: Client) -> None:
            def on_message(_c: Client, _u: object, msg: Any) -> None:
                if msg.payload == SENTINEL:
                    self._done.set()
                else:
                    self.received.append(msg.payload)

            client.on_message = on_message

        return connect_client(self.broker, *self.login, self.client_id, clean_start=False, session_expiry=expiry,
                              setup=setup)  # fmt: skip

    def drain(self) -> int:
        """Reconnect, take what was kept, and return its bytes (everything kept comes before a sentinel sent now)."""
        client = self._connect(0)
        server = connect_client(self.broker, self.broker.server.username, self.broker.server.password)
        try:
            server.publish(self.topic, SENTINEL, qos=1).wait_for_publish(10)
            assert self._done.wait(30), "the session did not deliver what it kept"
        finally:
            for c in (client, server):
                c.disconnect()
                c.loop_stop()
        return sum(len(p) for p in self.received)


@pytest.mark.integration
def test_resync_and_model_request_pairs_get_the_model_at_most_twice_a_round(broker: Broker, tmp_path: Path) -> None:
    job = f"amp{uuid.uuid4().hex[:6]}"
    config = make_config(tmp_path, job, 2, 2, min_clients=2, round_deadline_s=60.0)
    topics = Topics(job)
    link = LinkConfig(broker.url, broker.server.username, broker.server.password)
    orch = make_orchestrator(config, load_dataset("digits", seed=0), Path(config.run.out), link_config=link)
    hostile, honest = f"amp-{uuid.uuid4().hex[:6]}", f"ok-{uuid.uuid4().hex[:6]}"
    creds = {cid: broker.add_device(cid) for cid in (hostile, honest)}
    sink = Sink(broker, hostile, creds[hostile].password, topics.down(hostile))  # an offline session of its own
    sent: Counter[int] = Counter()  # bytes the server published on the hostile device's topic, by round
    publish = orch.link.publish

    def counting(topic: str, payload: bytes | bytearray, **kw: Any) -> int:
        n = publish(topic, payload, **kw)
        if topic == topics.down(hostile):
            sent[orch.current.round if orch.current else 0] += n
        return n

    orch.link.publish = counting  # type: ignore[method-assign]
    devices = []
    for cid in (hostile, honest):
        device = FakeDevice.over_mqtt(broker.url, cid, creds[cid].password, job, cid, 10, lambda a, c=cid: [
            encode(zero_update(a, c, 10))])  # fmt: skip
        devices.append(device)
    flood = devices[0]
    flood.respond = _flooder(job, hostile, lambda f: flood.link.publish(topics.up(hostile), f))
    for device in devices:
        device.start()
    try:
        summary = orch.run()
    finally:
        for device in devices:
            device.stop()
    rows = [json.loads(line) for line in (Path(config.run.out) / "metrics.jsonl").read_text().splitlines()]
    model = orch.distribution.model_message(orch.distribution.current)  # type: ignore[arg-type]
    assignment = max(r["instructions"][hostile]["bytes_down"] for r in rows)
    bound = (1 + RESENDS_PER_ROUND) * assignment + RESENDS_PER_ROUND * len(model) + 64 * 1024  # + acks
    print(f"model {len(model)} bytes; server egress on {hostile}'s topic by round {dict(sent)}; bound {bound}; "
          f"refused {summary['rejected']}")  # fmt: skip
    assert all(r["clients_reported"] == 2 for r in rows)  # the round went on: both updates aggregated
    assert summary["rejected"].get("rate_limited", 0) > 0
    assert sent and all(n <= bound for n in sent.values()), sent
    assert sum(sent.values()) < 2 * PAIRS * len(model) / 50  # the amplification was x544
    kept = sink.drain()  # what the broker kept for the offline session: what the server sent, no more
    assert kept <= sum(sent.values()) + 2 * assignment, (kept, dict(sent))


# ----------------------------------------------------------------------------------- queued bytes, real mosquitto
def test_the_broker_bounds_an_offline_sessions_queue_in_bytes(need_mosquitto: None, tmp_path: Path) -> None:
    """50 messages of 256 KiB to a device whose session is offline: the broker keeps about max_queued_bytes of them
    (1 MiB here), well under the count limit, and drops the rest."""
    cap, size = 1 << 20, 256 << 10
    settings = BrokerSettings(devices=["d0"], max_queued_bytes=cap)
    assert f"max_queued_bytes {cap}\n" in Broker(tmp_path / "text", settings).config_text()
    with Broker(tmp_path / "b", settings) as broker:
        topic = Topics("job").down("d0")
        sink = Sink(broker, "d0", broker.devices["d0"].password, topic)
        server = connect_client(broker, broker.server.username, broker.server.password)
        try:
            for _ in range(50):
                server.publish(topic, bytes(size), qos=1).wait_for_publish(10)
        finally:
            server.disconnect()
            server.loop_stop()
        kept = sink.drain()
    print(f"offline session: {len(sink.received)} of 50 messages of {size} bytes kept, {kept} bytes (cap {cap})")
    assert 0 < kept <= cap + size
