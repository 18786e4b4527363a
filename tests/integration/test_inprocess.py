"""The in-process execution mode against the broker mode: same code, same seed, one thread per client, same result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge_client.messages import Presence
from edge_client.protocol import encode
from edgefl_testkit.federation import make_config, run_simulated
from server.broker import Broker
from server.datasets import load_dataset
from server.experiments.inprocess import LocalBus, LocalLink


def _accuracies(out: Path) -> list[float]:
    return [json.loads(line)["accuracy"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.integration
@pytest.mark.parametrize("algorithm", ["scaffold", "fedveca"])
def test_inprocess_equals_broker_mode_after_three_rounds(broker: Broker, tmp_path: Path, algorithm: str) -> None:
    """SCAFFOLD carries client state between rounds, FedVeca adapts every client's tau: both must agree exactly."""
    bundle = load_dataset("digits", seed=0)
    results = {}
    for mode in ("broker", "inprocess"):
        config = make_config(
            tmp_path, f"eq-{algorithm}-{mode}", 3, 3, train={"algorithm": algorithm}, simulation={"threads": 1}
        )
        summary, _, _ = run_simulated(mode, config, bundle, broker)
        assert summary["mode"] == mode and summary["rounds"] == 3
        results[mode] = _accuracies(Path(config.run.out))
    assert results["inprocess"] == pytest.approx(results["broker"], abs=1e-4)
    assert results["inprocess"][-1] > 0.3  # it trained: ten classes, chance is 0.1


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
