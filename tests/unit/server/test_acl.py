"""The edgefl ACL's rules (server/acl.py) as text. Enforced by a real mosquitto: tests/integration/test_broker.py."""

from __future__ import annotations

import pytest

from server.acl import acl_rules


def test_acl_rules_text() -> None:
    text = acl_rules("srv", job="j1")
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert lines == [
        "pattern write edgefl/j1/c/%u/up",
        "pattern read edgefl/j1/c/%u/down",
        "pattern read edgefl/j1/broadcast",
        "pattern read edgefl/j1/server",
        "pattern read edgefl/j1/model",
        "pattern read edgefl/j1/model/global/+",
        "user srv",
        "topic readwrite edgefl/#",
    ]
    assert "pattern write edgefl/+/c/%u/up" in acl_rules("srv")
    with pytest.raises(ValueError):
        acl_rules("srv", job="a/b")
