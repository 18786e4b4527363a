"""The metrics endpoint's address (server/metrics_endpoint.py): the dashboard's rule, a token off loopback. The
endpoint served, and scraped by a real Prometheus: tests/integration/test_metrics_export.py."""

from __future__ import annotations

import pytest

from server.config import ConfigError
from server.metrics_endpoint import TOKEN_ENV, metrics_address


def test_metrics_address_follows_the_dashboards_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="--metrics expects HOST:PORT"):
        metrics_address("9477")
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert metrics_address("127.0.0.1:9477").token is None
    random = metrics_address("0.0.0.0:9477").token
    assert random and random != metrics_address("0.0.0.0:9477").token
    monkeypatch.setenv(TOKEN_ENV, "fixed-for-prometheus")
    assert metrics_address("0.0.0.0:9477").token == "fixed-for-prometheus"
    assert metrics_address("[::1]:9477").token is None
