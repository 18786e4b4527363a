"""The in-process bus (server/experiments/inprocess.py): routing by topic filter, retained messages, garbage refused
as the MQTT link refuses it. The in-process mode against the broker mode: tests/integration/test_inprocess.py."""

from __future__ import annotations

from edge_client.wire.messages import Presence
from edge_client.wire.protocol import encode
from server.experiments.inprocess import LocalBus, LocalLink


def test_local_bus_routes_by_topic_filter_and_replays_retained_messages() -> None:
    bus = LocalBus()
    server = LocalLink(bus, ["edgefl/j/c/+/up"]).start()
    device = LocalLink(bus, ["edgefl/j/c/d1/down", "edgefl/j/server"]).start()
    online = encode(Presence(client_id="server", online=True, role="server"))
    server.publish("edgefl/j/server", online, retain=True)
    late = LocalLink(bus, ["edgefl/j/server"]).start()  # joins after the retained publish: still gets it
    device.publish("edgefl/j/c/d1/up", encode(Presence(client_id="d1", online=True)))
    topic, msg = server.receive(0)
    assert topic == "edgefl/j/c/d1/up" and isinstance(msg, Presence) and msg.client_id == "d1"
    assert server.receive(0) is None  # nothing else reached the server: its own publish is not echoed
    assert device.receive(0)[0] == "edgefl/j/server"
    assert late.receive(0)[0] == "edgefl/j/server"


def test_local_link_rejects_garbage_like_the_mqtt_link() -> None:
    bus = LocalBus()
    server = LocalLink(bus, ["edgefl/j/c/+/up"]).start()
    LocalLink(bus, []).start().publish("edgefl/j/c/d1/up", b"\x00not msgpack")
    assert server.receive(0) is None
    assert sum(server.rejections.values()) == 1
