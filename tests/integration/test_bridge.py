"""Bridged site brokers: clients on two site mosquittos, the server on a central one, TLS between sites and centre.

All real: three mosquitto processes, the bridges are mosquitto's own, the clients are `edge-client` processes. A
forbidden message "not arriving" is proved by ordering, as in tests/integration/test_broker.py: the same sender then
sends a permitted sentinel on the same connection with the same QoS, and MQTT delivers in order.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import pytest
from paho.mqtt.client import Client

from edge_client.tools.fetch import fetch_model
from edge_client.wire.messages import Hello
from edge_client.wire.protocol import encode
from edge_client.wire.topics import Topics
from edge_client.wire.transport import LinkConfig, MqttLink
from edgefl_testkit.basics import CHANCE
from edgefl_testkit.federation import run_to_end, start_federation
from edgefl_testkit.mqtt import connect_client, throwaway_certificate
from server.acl import acl_rules, site_rules
from server.bridge import BridgeSettings
from server.broker import Broker, BrokerSettings

pytestmark = pytest.mark.integration

SITES = {"site-a": ["client-00", "client-01"], "site-b": ["client-02"]}
JOB = "bridged"
TIMEOUT = 10.0


class Federation:
    """A central broker speaking TLS only, and one site broker per site bridged to it with the site's login."""

    def __init__(self, tmp_path: Path) -> None:
        self.ca, key = throwaway_certificate(tmp_path)
        central = BrokerSettings(certfile=str(self.ca), keyfile=str(key), sites=SITES)
        self.central = Broker(tmp_path / "central", central)
        self.sites: dict[str, Broker] = {}
        for name, devices in SITES.items():
            login = self.central.sites[name]
            bridge = BridgeSettings(self.central.url, login.username, login.password, str(self.ca))
            self.sites[name] = Broker(tmp_path / name, BrokerSettings(devices=devices, bridge=bridge))

    def start(self) -> Federation:
        for broker in (self.central, *self.sites.values()):
            broker.start()
        return self

    def stop(self) -> None:
        for broker in (*self.sites.values(), self.central):
            broker.stop()

    def site_of(self, cid: str) -> Broker:
        return next(self.sites[name] for name, devices in SITES.items() if cid in devices)

    def client_broker(self, cid: str) -> tuple[str, str]:
        site = self.site_of(cid)
        return site.url, site.devices[cid].password

    def server_link(self) -> LinkConfig:
        server = self.central.server
        return LinkConfig(self.central.url, server.username, server.password, ca_file=str(self.ca))

    def central_client(self, username: str, password: str, client_id: str) -> Client:
        """A paho client on the central broker over TLS, with received messages in ``userdata["inbox"]``."""
        inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()

        def setup(client: Client) -> None:
            client.tls_set(ca_certs=str(self.ca))
            client.on_message = lambda _c, _u, msg: inbox.put((msg.topic, msg.payload))

        client = connect_client(self.central, username, password, client_id, setup=setup)
        client.user_data_get()["inbox"] = inbox
        return client


@pytest.fixture
def federation_of_sites(tmp_path: Path, need_mosquitto: None) -> Iterator[Federation]:
    fed = Federation(tmp_path).start()
    try:
        yield fed
    finally:
        fed.stop()


def test_clients_on_two_bridged_sites_train_with_the_server_on_the_central_broker(
    federation_of_sites: Federation, tmp_path: Path
) -> None:
    fed = federation_of_sites
    orch, procs = start_federation(tmp_path, fed.server_link(), fed.client_broker, JOB, clients=3, rounds=3)
    summary, rows = run_to_end(orch, procs)
    assert summary["final_accuracy"] > CHANCE + 0.5, summary
    assert [r["round"] for r in rows] == [1, 2, 3]
    for row in rows:  # both sites' clients report every round
        assert sorted(row["clients"]) == [c for devices in SITES.values() for c in devices]
        assert all(c["bytes_up"] > 0 and c["bytes_down"] > 0 for c in row["clients"].values())

    # Devices logged in at their sites only; the centre saw the server and the two bridges, over TLS.
    central_log = fed.central.log_path.read_text()
    assert "u'client-" not in central_log
    for name, site in fed.sites.items():
        assert "New bridge connected from 127.0.0.1" in central_log and f"as {name} (p2, c0" in central_log
        site_log = site.log_path.read_text()
        assert all(f"u'{cid}'" in site_log for cid in SITES[name])
    # The model retained at the centre crossed the bridge and stayed retained: a device fetches it at its site.
    site_b = fed.sites["site-b"]
    device = LinkConfig(site_b.url, "client-02", site_b.devices["client-02"].password)
    meta = fetch_model(device, "client-02", tmp_path / "fetched.onnx", job=JOB, timeout=TIMEOUT)
    assert (tmp_path / "fetched.onnx").read_bytes() == (orch.out_dir / "model.onnx").read_bytes()
    assert meta["round"] == max(rows, key=lambda r: r["accuracy"])["round"]


def test_a_site_login_carries_only_its_own_devices(federation_of_sites: Federation) -> None:
    """The central ACL: site-a's login can neither speak for nor listen to site-b's devices, nor skip the ACL."""
    fed = federation_of_sites
    assert fed.central.acl_path.read_text() == "\n".join(
        [acl_rules("edgefl-server"), *(site_rules(name, devices) for name, devices in SITES.items())]
    )
    for site in fed.sites.values():  # the same per-device ACL at the site
        assert site.acl_path.read_text() == acl_rules("edgefl-server")
    with pytest.raises(RuntimeError, match="does not reload its bridge"):
        fed.sites["site-b"].add_device("client-09")  # it would not be bridged
    server = fed.central.server
    watcher = fed.central_client(server.username, server.password, "watcher")
    site_a = fed.central_client("site-a", fed.central.sites["site-a"].password, "site-a-probe")
    try:
        granted: queue.Queue[list[bool]] = queue.Queue()
        for client in (watcher, site_a):
            client.on_subscribe = lambda _c, _u, _mid, codes, _p: granted.put([c.is_failure for c in codes])
        watcher.subscribe([(f"edgefl/{JOB}/c/+/up", 1), (f"edgefl/{JOB}/broadcast", 1)])
        assert granted.get(timeout=TIMEOUT) == [False, False]
        # mosquitto 2.0 grants both and checks read access on every message it would deliver
        site_a.subscribe([(f"edgefl/{JOB}/c/client-02/down", 1), (f"edgefl/{JOB}/c/client-00/down", 1)])
        granted.get(timeout=TIMEOUT)
        watcher.publish(f"edgefl/{JOB}/c/client-02/down", b"for client-02", qos=1).wait_for_publish(TIMEOUT)
        watcher.publish(f"edgefl/{JOB}/c/client-00/down", b"sentinel", qos=1).wait_for_publish(TIMEOUT)
        heard = site_a.user_data_get()["inbox"]
        assert heard.get(timeout=TIMEOUT) == (f"edgefl/{JOB}/c/client-00/down", b"sentinel")
        assert heard.empty(), "site-a read an assignment for a device of site-b"

        site_a.publish(f"edgefl/{JOB}/c/client-02/up", b"forged", qos=1).wait_for_publish(TIMEOUT)
        site_a.publish(f"edgefl/{JOB}/broadcast", b"forged stop", qos=1).wait_for_publish(TIMEOUT)
        site_a.publish(f"edgefl/{JOB}/c/client-00/up", b"sentinel", qos=1).wait_for_publish(TIMEOUT)
        inbox = watcher.user_data_get()["inbox"]
        assert inbox.get(timeout=TIMEOUT) == (f"edgefl/{JOB}/c/client-00/up", b"sentinel")
        assert inbox.empty(), "a message site-a may not send reached the server"
    finally:
        for client in (watcher, site_a):
            client.disconnect()
            client.loop_stop()


def test_messages_wait_while_a_site_or_the_centre_is_down(federation_of_sites: Federation) -> None:
    """Persistent sessions at both ends of the bridge: an update sent while the centre is down and an assignment sent
    while the site is down both arrive once the broker is back (mosquitto restarted with its persistence file)."""
    fed = federation_of_sites
    site, topics = fed.sites["site-a"], Topics(JOB)

    def server() -> MqttLink:
        return MqttLink(fed.server_link(), "outage-server", [topics.all_up]).start()

    def device() -> MqttLink:
        login = LinkConfig(site.url, "client-00", site.devices["client-00"].password)
        return MqttLink(login, "outage-client-00", [topics.down("client-00")]).start()

    def hello(mark: int) -> bytes:
        return encode(Hello(client_id="client-00", num_samples=mark))

    centre, dev = server(), device()
    dev.publish(topics.up("client-00"), hello(1))
    assert centre.receive(TIMEOUT) is not None  # the bridge is up

    centre.stop()
    fed.central.stop()
    dev.publish(topics.up("client-00"), hello(2))
    assert dev.wait_published(TIMEOUT), "the site accepted the update while the centre was down"
    fed.central.start()
    centre = server()
    received = centre.receive(60)  # the bridge reconnects within its restart_timeout (1-30 s)
    assert received is not None and received[1].num_samples == 2

    dev.stop()
    site.stop()
    centre.publish(topics.down("client-00"), hello(3))
    assert centre.wait_published(TIMEOUT)
    site.start()
    dev = device()
    try:
        received = dev.receive(60)
        assert received is not None and received[1].num_samples == 3, "the centre kept the site's session"
    finally:
        dev.stop()
        centre.stop()


@pytest.mark.parametrize("url", ["mqtt://192.0.2.10:1883", "mqtt://central.example:1883"])
def test_a_bridge_off_this_machine_without_tls_is_refused(url: str, tmp_path: Path) -> None:
    bridge = BridgeSettings(url, "site-a", "secret")
    with pytest.raises(ValueError, match=r"without TLS.*mqtts://"):
        Broker(tmp_path / "site", BrokerSettings(devices=["d1"], bridge=bridge))
