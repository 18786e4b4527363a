"""The broker against a real mosquitto: authentication, the ACL, settings, restarts. No mocks, no sleeps.

A forbidden message "not arriving" is proved by ordering: the same sender then sends a permitted sentinel on the
same connection with the same QoS, and MQTT delivers in order, so once the sentinel is in, the forbidden one is not.
"""

from __future__ import annotations

import json
import os
import queue
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from paho.mqtt.client import CallbackAPIVersion, Client
from paho.mqtt.enums import MQTTProtocolVersion

from edgefl_testkit.mqtt import throwaway_certificate
from server.broker import Broker, BrokerSettings, Credentials, MosquittoNotInstalled, find_mosquitto

MqttClientFactory = Callable[..., Client]
JOB = "j1"
TIMEOUT = 10.0
REFUSED = r"Not authorized|Bad user name or password"


def up(cid: str) -> str:
    return f"edgefl/{JOB}/c/{cid}/up"


def down(cid: str) -> str:
    return f"edgefl/{JOB}/c/{cid}/down"


class Inbox:
    """Collects a client's messages in a queue; subscribe() waits for the SUBACK.

    Pass `inbox.attach` as the factory's `setup` when messages may arrive right at CONNACK (a resumed session).
    """

    def __init__(self, client: Client | None = None) -> None:
        self.messages: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.subacks: queue.Queue[tuple[int, list]] = queue.Queue()
        if client is not None:
            self.attach(client)

    def attach(self, client: Client) -> None:
        self.client = client
        client.on_message = lambda _c, _u, m: self.messages.put((m.topic, m.payload))
        client.on_subscribe = lambda _c, _u, mid, codes, _p: self.subacks.put((mid, codes))

    def subscribe(self, topic: str) -> list:
        """Subscribe at QoS 1; return the SUBACK reason codes."""
        _, mid = self.client.subscribe(topic, qos=1)
        got_mid, codes = self.subacks.get(timeout=TIMEOUT)
        assert got_mid == mid
        return codes

    def until(self, payload: bytes) -> list[tuple[str, bytes]]:
        """Everything received up to and including `payload`; fails after TIMEOUT."""
        seen: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + TIMEOUT
        while not seen or seen[-1][1] != payload:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"{payload!r} not received; got {seen}"
            try:
                seen.append(self.messages.get(timeout=remaining))
            except queue.Empty:
                pytest.fail(f"{payload!r} not received; got {seen}")
        return seen


def publish(client: Client, topic: str, payload: bytes, retain: bool = False) -> None:
    client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(TIMEOUT)


def test_starts_on_free_port_and_accepts_server(broker: Broker, mqtt_client_factory: MqttClientFactory) -> None:
    assert broker.url == f"mqtt://127.0.0.1:{broker.port}"
    assert broker.port != 1883
    client = mqtt_client_factory(broker.server.username, broker.server.password)
    assert client.is_connected()
    assert stat.S_IMODE(broker.workdir.stat().st_mode) == 0o700
    for path in (broker.conf_path, broker.passwd_path, broker.acl_path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert broker.server.password not in broker.passwd_path.read_text()  # hashed


def test_wrong_password_refused(broker: Broker, mqtt_client_factory: MqttClientFactory) -> None:
    with pytest.raises(ConnectionRefusedError, match=REFUSED):
        mqtt_client_factory(broker.server.username, "wrong")
    with pytest.raises(ConnectionRefusedError, match=REFUSED):
        mqtt_client_factory("c1", broker.devices["c2"].password)


def test_anonymous_refused(broker: Broker, mqtt_client_factory: MqttClientFactory) -> None:
    with pytest.raises(ConnectionRefusedError, match=REFUSED):
        mqtt_client_factory(None, None, client_id="anon")


def test_device_writes_only_its_own_up_topic(broker: Broker, mqtt_client_factory: MqttClientFactory) -> None:
    server = Inbox(mqtt_client_factory(broker.server.username, broker.server.password))
    assert not server.subscribe("edgefl/+/c/+/up")[0].is_failure
    c1 = mqtt_client_factory("c1", broker.devices["c1"].password)

    publish(c1, up("c1"), b"hello")
    assert server.until(b"hello") == [(up("c1"), b"hello")]

    publish(c1, up("c2"), b"forged")  # denied: mosquitto drops it (the PUBACK still comes)
    publish(c1, up("c1"), b"sentinel")
    assert server.until(b"sentinel") == [(up("c1"), b"sentinel")]


def test_device_reads_only_its_own_down_topic(broker: Broker, mqtt_client_factory: MqttClientFactory) -> None:
    server = mqtt_client_factory(broker.server.username, broker.server.password)
    c1 = Inbox(mqtt_client_factory("c1", broker.devices["c1"].password))
    # mosquitto 2.0 grants these subscriptions and checks read access on every message it would deliver
    c1.subscribe(down("c2"))
    c1.subscribe("edgefl/#")
    assert not c1.subscribe(down("c1"))[0].is_failure

    publish(server, down("c2"), b"for c2 only")
    publish(server, down("c1"), b"sentinel")
    # edgefl/# may also bring retained server presence and models of other tests' jobs, which devices may read
    received = c1.until(b"sentinel")
    assert [(t, p) for t, p in received if t.endswith("/down")] == [(down("c1"), b"sentinel")]


def test_device_reads_broadcast_and_server_presence(broker: Broker, mqtt_client_factory: MqttClientFactory) -> None:
    server = mqtt_client_factory(broker.server.username, broker.server.password)
    publish(server, f"edgefl/{JOB}/server", b"online", retain=True)
    c3 = Inbox(mqtt_client_factory("c3", broker.devices["c3"].password))
    c3.subscribe(f"edgefl/{JOB}/server")
    assert c3.until(b"online") == [(f"edgefl/{JOB}/server", b"online")]
    c3.subscribe(f"edgefl/{JOB}/broadcast")
    publish(server, f"edgefl/{JOB}/broadcast", b"stop")
    assert c3.until(b"stop") == [(f"edgefl/{JOB}/broadcast", b"stop")]
    publish(server, f"edgefl/{JOB}/server", b"", retain=True)  # clear the retained message for other tests


def test_device_reads_the_round_model_but_cannot_publish_one(
    broker: Broker, mqtt_client_factory: MqttClientFactory
) -> None:
    """The round model's frames reach every device; a device publishing on them reaches nobody."""
    server = mqtt_client_factory(broker.server.username, broker.server.password)
    frame = f"edgefl/{JOB}/model/global/0"
    c1 = Inbox(mqtt_client_factory("c1", broker.devices["c1"].password))
    c2 = mqtt_client_factory("c2", broker.devices["c2"].password)
    assert not c1.subscribe(f"edgefl/{JOB}/model/global/+")[0].is_failure
    publish(c2, frame, b"forged model")  # denied: mosquitto drops it
    publish(server, frame, b"model")
    assert c1.until(b"model") == [(frame, b"model")]


def test_max_packet_size_configured(broker: Broker, mqtt_client_factory: MqttClientFactory) -> None:
    """Oversized messages are refused by the broker; the sender-side check (transport) relies on CONNACK."""
    assert f"max_packet_size {broker.settings.max_packet_size}\n" in broker.conf_path.read_text()
    client = mqtt_client_factory("c4", broker.devices["c4"].password)
    assert client.user_data_get()["connack"].MaximumPacketSize == broker.settings.max_packet_size


def test_add_device_while_running(broker: Broker, mqtt_client_factory: MqttClientFactory) -> None:
    creds = broker.add_device("late-1")
    assert broker.add_device("late-1") is creds
    client = mqtt_client_factory(creds.username, creds.password)
    assert client.is_connected()


def test_restart_same_port_keeps_sessions(tmp_path: Path, mqtt_client_factory: MqttClientFactory) -> None:
    b = Broker(tmp_path / "b", BrokerSettings(devices=["d1"])).start()
    try:
        port, url = b.port, b.url
        d1 = mqtt_client_factory("d1", b.devices["d1"].password, broker=b, clean_start=False, session_expiry=3600)
        Inbox(d1).subscribe("edgefl/j1/c/d1/down")
        d1.disconnect()
        d1.loop_stop()
        server = mqtt_client_factory(b.server.username, b.server.password, broker=b)
        publish(server, "edgefl/j1/c/d1/down", b"queued")

        b.stop()
        assert not b.running and (tmp_path / "b" / "mosquitto.db").exists()
        b.start()
        assert (b.port, b.url) == (port, url)
        inbox = Inbox()  # attached before CONNECT: the queued message comes right after CONNACK
        mqtt_client_factory(
            "d1", b.devices["d1"].password, broker=b, clean_start=False, session_expiry=3600, setup=inbox.attach
        )  # the session survived: no new subscribe
        assert inbox.until(b"queued") == [("edgefl/j1/c/d1/down", b"queued")]

        b.kill()
        assert not b.running
        b.start()
        assert b.port == port
        assert mqtt_client_factory(b.server.username, b.server.password, broker=b).is_connected()
    finally:
        b.stop()


def test_start_failure_reports_log(broker: Broker, tmp_path: Path) -> None:
    """An invalid config makes mosquitto exit at once; start() says so with the log (`broker`: skip if missing)."""
    b = Broker(tmp_path / "b", BrokerSettings(max_packet_size=-5))
    with pytest.raises(RuntimeError, match="mosquitto exited"):
        b.start()
    assert not b.running


def test_write_credentials(broker: Broker, tmp_path: Path) -> None:
    path = tmp_path / "creds.json"
    broker.write_credentials(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = json.loads(path.read_text())
    assert data["url"] == broker.url
    assert data["server"] == {"username": broker.server.username, "password": broker.server.password}
    assert data["devices"]["c9"]["password"] == broker.devices["c9"].password


def test_missing_mosquitto_hint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EDGEFL_MOSQUITTO", str(tmp_path / "no-such-mosquitto"))
    with pytest.raises(MosquittoNotInstalled, match=r"sudo apt-get install -y mosquitto mosquitto-clients") as exc:
        find_mosquitto()
    assert "EDGEFL_MOSQUITTO" in str(exc.value)
    with pytest.raises(MosquittoNotInstalled):
        Broker(tmp_path / "b").start()
    assert not os.path.exists(tmp_path / "b")  # nothing written before the binary is known


def test_relative_workdir_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, need_mosquitto: None) -> None:
    """`edge-server simulate --out runs/x` passes a relative directory; mosquitto must still find its files."""
    monkeypatch.chdir(tmp_path)
    broker = Broker(Path("relative-broker"), BrokerSettings()).start()
    try:
        assert broker.running
        assert broker.conf_path.is_absolute() and broker.conf_path.exists()
    finally:
        broker.stop()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10", "broker.lan"])
def test_network_listener_without_tls_is_refused(host: str, tmp_path: Path) -> None:
    """Passwords never cross a network in clear text: only loopback may go without TLS; the error names the fix."""
    with pytest.raises(ValueError, match=r"without TLS.*BrokerSettings\.certfile and BrokerSettings\.keyfile.*127"):
        Broker(tmp_path / "b", BrokerSettings(host=host))
    assert not (tmp_path / "b").exists()
    with pytest.raises(ValueError, match="go together"):
        Broker(tmp_path / "b", BrokerSettings(certfile="server.crt"))
    for loopback in ("127.0.0.1", "::1", "localhost"):
        assert Broker(tmp_path / "b", BrokerSettings(host=loopback, port=1)).url.startswith("mqtt://")


def _first_answer(broker: Broker, creds: Any, ca: Path | None) -> str:
    """Connect with or without TLS; return the CONNACK reason or "disconnected" if the broker hung up first."""
    client = Client(CallbackAPIVersion.VERSION2, client_id=creds.username, protocol=MQTTProtocolVersion.MQTTv5)
    if ca is not None:
        client.tls_set(ca_certs=str(ca))
    client.username_pw_set(creds.username, creds.password)
    answers: queue.Queue[str] = queue.Queue()
    client.on_connect = lambda _c, _u, _f, reason, _p: answers.put(str(reason))
    client.on_disconnect = lambda *_: answers.put("disconnected")
    client.reconnect_delay_set(60, 60)  # one attempt is the whole test
    client.connect(broker.settings.host, broker.port)
    client.loop_start()
    try:
        return answers.get(timeout=TIMEOUT)
    finally:
        client.disconnect()
        client.loop_stop()


def test_tls_listener_takes_passwords_over_tls_only(tmp_path: Path, need_mosquitto: None) -> None:
    """With certfile/keyfile the broker speaks TLS: a TLS client with a password gets in, plain MQTT does not."""
    cert, key = throwaway_certificate(tmp_path)
    b = Broker(tmp_path / "b", BrokerSettings(devices=["d1"], certfile=str(cert), keyfile=str(key))).start()
    try:
        assert b.url == f"mqtts://127.0.0.1:{b.port}"
        assert f"certfile {cert}\nkeyfile {key}\n" in b.conf_path.read_text()
        assert _first_answer(b, b.devices["d1"], cert) == "Success"
        assert _first_answer(b, Credentials("d1", "wrong"), cert) in ("Not authorized", "Bad user name or password")
        assert _first_answer(b, b.devices["d1"], None) == "disconnected"  # plain MQTT on the TLS port
    finally:
        b.stop()
