"""Fair service (issue 23) in-process: control messages over their token bucket (``server.rate_limits``) are dropped
unhandled and counted, through the orchestrator's real dispatch; the server's inbox serves senders in turn. The same
over a real mosquitto: tests/integration/test_fair_service.py."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from edge_client.wire.messages import Ack, Hello
from edge_client.wire.protocol import encode
from edge_client.wire.topics import Topics
from edgefl_testkit.federation import make_config
from server.assembly import make_orchestrator
from server.datasets import load_dataset
from server.experiments.inprocess import LocalBus, LocalLink
from server.orchestrator import Orchestrator
from server.rate_limits import LIMITS, Limit, RateLimited, RateLimits


def test_a_bucket_allows_its_burst_then_its_rate_and_is_full_again_each_round() -> None:
    now = [0.0]
    limits = RateLimits({"hello": Limit(burst=3, per_s=0.5)}, clock=lambda: now[0])
    for _ in range(3):
        limits.check("d", "hello")
    with pytest.raises(RateLimited):
        limits.check("d", "hello")
    limits.check("e", "hello")  # per device
    limits.check("d", "update")  # kinds without a limit pass
    now[0] = 2.0  # one token back
    limits.check("d", "hello")
    with pytest.raises(RateLimited):
        limits.check("d", "hello")
    limits.new_round()
    for _ in range(3):
        limits.check("d", "hello")


def _orchestrator(tmp_path: Path, bus: LocalBus) -> Orchestrator:
    config = make_config(tmp_path, f"fair{uuid.uuid4().hex[:6]}", 1, 1)
    link = LocalLink(bus, [Topics(config.run.job).all_up])
    orch = make_orchestrator(config, load_dataset("digits", seed=0), tmp_path / "run", link=link)
    orch.dispatch.limits.clock = lambda: 0.0  # no refill during the test: the counts are exact
    return orch


def test_a_hello_flood_is_dropped_unhandled_and_counted(tmp_path: Path) -> None:
    """Through the orchestrator's dispatch: of 200 hellos, the burst is handled and answered; the rest are dropped
    before any work (no ack, no registration), counted as rate_limited; another device is not affected."""
    bus = LocalBus()
    orch = _orchestrator(tmp_path, bus)
    device = LocalLink(bus, [orch.topics.down("d0")]).start()
    burst = LIMITS["hello"].burst
    for _ in range(200):
        orch.dispatch.handle(orch.topics.up("d0"), Hello(client_id="d0", num_samples=10))
    orch.dispatch.handle(orch.topics.up("d1"), Hello(client_id="d1", num_samples=10))
    assert orch.link.rejections["rate_limited"] == 200 - burst
    acks = []
    while (got := device.receive(0)) is not None:
        acks += [got[1]] if isinstance(got[1], Ack) else []
    assert len(acks) == burst  # one answer per hello handled
    assert set(orch.clients) == {"d0", "d1"}
    assert orch.live._state["clients"]["d0"]["rejected"] == {"rate_limited": 200 - burst}


def test_one_senders_backlog_does_not_delay_anothers_update(tmp_path: Path) -> None:
    """Issue 23: 25,000 small hellos fit in one sender's 4 MiB allowance and were all handled before a later message
    of another device. Through the orchestrator's own link and dispatch: the other device's hello is handled second."""
    orch = _orchestrator(tmp_path, LocalBus())
    flood = encode(Hello(client_id="flood", num_samples=1))
    for _ in range(25_000):
        orch.link.put(orch.topics.up("flood"), flood)  # type: ignore[attr-defined]  # as the network thread does
    orch.link.put(orch.topics.up("d1"), encode(Hello(client_id="d1", num_samples=10)))  # type: ignore[attr-defined]
    handled = 0
    while "d1" not in orch.clients and handled < 100:
        orch.dispatch.pump(0)
        handled += 1
    assert handled == 2 and set(orch.clients) == {"flood", "d1"}
    assert orch.link.rejections["inbox_full"] == 0  # all 25,000 fit: serving in turn, not dropping, let d1 through
