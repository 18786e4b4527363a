"""Fixtures only the integration tests use: brokers of their own and paho clients on the session broker."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from paho.mqtt.client import Client

from edgefl_testkit.mqtt import MqttClientFactory, connect_client, require_mosquitto
from server.broker import Broker


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
