"""The device loop (edge_client/loop/runtime.py) on the in-process bus: which assignments it serves. Its processes over
a real mosquitto: tests/integration/test_runtime.py and test_faults.py."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.learning.data import ArrayDataset
from edge_client.learning.models import build_model, get_flat
from edge_client.loop.runtime import EdgeClient
from edge_client.wire.messages import Presence, Update
from edge_client.wire.topics import Topics
from edgefl_testkit.fakes import as_sent
from edgefl_testkit.messages import round_assignment
from server.experiments.inprocess import LocalBus, LocalLink

SPEC = {"name": "mlp", "in_features": 4, "num_classes": 3, "hidden": [5]}


def test_a_client_skips_an_assignment_older_than_one_it_served(caplog: pytest.LogCaptureFixture) -> None:
    """A stale assignment (replayed from a persistent session) is skipped with a log line; the same round again or
    the round before (a resumed server re-running them: its checkpoint lags a round behind while the round's
    evaluation runs) is served; another run (a new run id) may start at round 1."""
    bus, topics = LocalBus(), Topics("stale")
    server = LocalLink(bus, [topics.all_up]).start()
    rng = np.random.default_rng(0)
    data = ArrayDataset(rng.normal(size=(12, 4)).astype(np.float32), rng.integers(0, 3, size=12))
    client = EdgeClient("a", data, None, job="stale", link_factory=lambda subs, hook: LocalLink(bus, subs))
    client.link.start()
    weights = get_flat(build_model(SPEC))

    def served(round_: int, run_id: str = "run-1") -> list[int]:
        client.handle(Presence("server", True, role="server", run_id=run_id))  # the server says which run is current
        a = round_assignment(round_, weights, SPEC, run_id=run_id, deadline_s=10.0, steps=2, model_version=round_)
        for msg in as_sent(a):
            client.handle(msg)
        return [m.round for _, m in iter(lambda: server.receive(0), None) if isinstance(m, Update)]

    assert served(4) == [4]
    assert served(2) == []
    assert "round 2: skipping a stale assignment (round 4 of this run already served)" in caplog.text
    assert served(3) == [3]
    assert served(4) == [4]
    assert served(1, run_id="run-2") == [1]
