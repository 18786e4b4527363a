"""A real mosquitto for tests: skip or fail without one, connect paho clients, make a throwaway TLS certificate.

A missing mosquitto skips the broker tests on a developer machine but FAILS under CI, so a CI image without the
broker cannot pass silently.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from paho.mqtt.client import CallbackAPIVersion, Client
from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edgefl_testkit.basics import in_ci
from server.broker import Broker, MosquittoNotInstalled, find_mosquitto

CONNECT_TIMEOUT = 10.0
DEVICES = [f"c{i}" for i in range(10)]
MqttClientFactory = Callable[..., Client]


def require_mosquitto() -> None:
    """Skip (developer machine) or fail (CI) when there is no mosquitto."""
    try:
        find_mosquitto()
    except MosquittoNotInstalled as exc:
        if in_ci():
            pytest.fail(str(exc))
        pytest.skip(str(exc))


def connect_client(
    broker: Broker,
    username: str | None,
    password: str | None,
    client_id: str | None = None,
    *,
    clean_start: bool = True,
    session_expiry: int = 0,
    setup: Callable[[Client], None] | None = None,
) -> Client:
    """Connect a paho client (API v2, MQTT 5, loop_start) and wait for CONNACK.

    Raises ConnectionRefusedError with the CONNACK reason (e.g. "Not authorized") so tests can assert on it. The
    CONNACK properties are kept in `client.user_data_get()["connack"]`. `setup(client)` runs before CONNECT, to set
    callbacks that must not miss messages a resumed session delivers right after CONNACK.
    """
    cid = client_id if client_id is not None else (username or "")
    client = Client(CallbackAPIVersion.VERSION2, client_id=cid, protocol=MQTTProtocolVersion.MQTTv5)
    state: dict[str, object] = {}
    done = threading.Event()
    client.user_data_set(state)

    def on_connect(_c: Client, userdata: dict, _flags: object, reason_code: object, properties: object) -> None:
        userdata["reason"], userdata["connack"] = reason_code, properties
        done.set()

    def on_connect_fail(_c: Client, userdata: dict) -> None:
        userdata["reason"] = "TCP connection failed"
        done.set()

    client.on_connect = on_connect
    client.on_connect_fail = on_connect_fail
    if setup is not None:
        setup(client)
    if username is not None:
        client.username_pw_set(username, password)
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = session_expiry
    client.connect(broker.settings.host, broker.port, keepalive=30, clean_start=clean_start, properties=props)
    client.loop_start()
    ok = done.wait(CONNECT_TIMEOUT)
    reason = state.get("reason")
    if not ok or getattr(reason, "is_failure", True):
        client.loop_stop()  # else paho keeps reconnecting in the background
        client.disconnect()
        raise ConnectionRefusedError(f"{username!r} refused: {reason if ok else 'no CONNACK in time'}")
    return client


def throwaway_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed EC certificate for 127.0.0.1 and its key, valid one day: the CA file of its own TLS listener."""
    openssl = shutil.which("openssl")
    if openssl is None:
        if in_ci():
            pytest.fail("openssl is needed to make a test certificate (bash scripts/setup.sh installs it)")
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = directory / "server.crt", directory / "server.key"
    new_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key)]
    subject = ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(
        [openssl, "req", "-x509", *new_key, "-days", "1", "-out", str(cert), *subject], check=True, capture_output=True
    )
    return cert, key
