"""The server announces itself on every (re)connect: after its connection was dropped (the broker then publishes its
retained last will, "offline"), the reconnected server's retained presence says "online" again, so devices that
connect later still register."""

from __future__ import annotations

import queue
import time
import uuid
from pathlib import Path

import pytest
from paho.mqtt.client import Client

from edge_client.wire.messages import Presence
from edge_client.wire.protocol import decode
from edge_client.wire.topics import Topics
from edge_client.wire.transport import LinkConfig
from edgefl_testkit.federation import make_config
from edgefl_testkit.mqtt import MqttClientFactory
from server.assembly import make_orchestrator
from server.broker import Broker
from server.datasets import load_dataset

pytestmark = pytest.mark.integration


def test_server_presence_is_online_again_after_a_dropped_connection(
    broker: Broker, mqtt_client_factory: MqttClientFactory, tmp_path: Path
) -> None:
    job = f"p{uuid.uuid4().hex[:8]}"
    config = make_config(tmp_path, job, clients=1, rounds=1)
    link = LinkConfig(broker.url, broker.server.username, broker.server.password)
    orch = make_orchestrator(config, load_dataset("digits"), tmp_path / job, link_config=link)
    seen: queue.Queue[bool] = queue.Queue()

    def watch(client: Client) -> None:
        client.on_message = lambda _c, _u, msg: seen.put(decode(msg.payload).online)

    observer = mqtt_client_factory("c0", broker.devices["c0"].password, setup=watch)
    observer.subscribe(Topics(job).server, qos=1)
    orch.link.start()
    try:
        assert seen.get(timeout=10) is True  # announced on connect
        # another connection with the server's client id takes the session over: the broker drops the server's
        # connection and publishes its last will; then the intruder leaves and paho reconnects the server
        intruder = mqtt_client_factory(broker.server.username, broker.server.password, f"edgefl-server-{job}")
        assert seen.get(timeout=10) is False
        intruder.disconnect()
        deadline = time.monotonic() + 30
        while (online := seen.get(timeout=max(0.1, deadline - time.monotonic()))) is False:
            pass
        assert online is True
        retained = decode(_retained(mqtt_client_factory, broker, job))  # what a device connecting now is told
        assert isinstance(retained, Presence) and retained.role == "server" and retained.online
    finally:
        orch.link.stop()


def _retained(factory: MqttClientFactory, broker: Broker, job: str) -> bytes:
    """The retained presence a device connecting now receives."""
    got: queue.Queue[bytes] = queue.Queue()
    client = factory("c1", broker.devices["c1"].password, setup=lambda c: setattr(
        c, "on_message", lambda _c, _u, msg: got.put(msg.payload)))  # fmt: skip
    client.subscribe(Topics(job).server, qos=1)
    return got.get(timeout=10)
