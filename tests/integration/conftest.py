"""The integration tests' fixtures: one real mosquitto per test session (`broker`), federations of client processes
on it (`federation`), paho clients on it, and brokers of their own. Only tests in this folder can ask for them."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from paho.mqtt.client import Client

from edge_client.wire.transport import LinkConfig
from edgefl_testkit.federation import end_federation, start_federation
from edgefl_testkit.mqtt import DEVICES, MqttClientFactory, connect_client, require_mosquitto
from server.broker import Broker, BrokerSettings
from server.orchestrator import Orchestrator


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A real mosquitto with the server user and devices c0..c9, anonymous access off."""
    require_mosquitto()
    settings = BrokerSettings(devices=list(DEVICES), allow_anonymous=False)
    b = Broker(tmp_path_factory.mktemp("broker"), settings).start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def federation(broker: Broker, tmp_path: Path) -> Iterator[Callable[..., tuple[Orchestrator, dict]]]:
    """``build(job, clients=3, rounds=3, ...)``: client processes on the session broker and the server for them."""
    started: list[dict[str, subprocess.Popen]] = []

    def on_session_broker(cid: str) -> tuple[str, str]:
        return broker.url, (broker.devices.get(cid) or broker.add_device(cid)).password

    def build(job: str, clients: int = 3, rounds: int = 3, **settings: Any) -> tuple[Orchestrator, dict]:
        link = LinkConfig(broker.url, broker.server.username, broker.server.password)
        orch, procs = start_federation(tmp_path, link, on_session_broker, job, clients, rounds, **settings)
        started.append(procs)
        return orch, procs

    yield build
    for procs in started:
        end_federation(procs)


@pytest.fixture
def need_mosquitto() -> None:
    """For tests that start brokers of their own."""
    require_mosquitto()


@pytest.fixture
def mqtt_client_factory(broker: Broker) -> Iterator[MqttClientFactory]:
    """`make(username, password, client_id=None, *, broker=, clean_start=, session_expiry=, setup=)` -> Client.

    Every client made is disconnected at teardown.
    """
    clients: list[Client] = []

    def make(
        username: str | None,
        password: str | None,
        client_id: str | None = None,
        *,
        broker: Broker = broker,
        clean_start: bool = True,
        session_expiry: int = 0,
        setup: Callable[[Client], None] | None = None,
    ) -> Client:
        client = connect_client(
            broker, username, password, client_id, clean_start=clean_start, session_expiry=session_expiry, setup=setup
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.disconnect()
        client.loop_stop()
