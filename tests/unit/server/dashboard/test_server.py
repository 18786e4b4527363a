"""The dashboard's address (server/dashboard/server.py): a token off loopback only. Requests to a served
dashboard: tests/integration/test_dashboard.py."""

from __future__ import annotations

import pytest

from server.config import ConfigError
from server.dashboard.server import Address


def test_address_needs_a_token_off_loopback_only() -> None:
    assert Address.parse("127.0.0.1:8050") == Address("127.0.0.1", 8050, None)
    assert Address.parse("localhost:0").token is None
    assert Address.parse("[::1]:8050") == Address("::1", 8050, None)
    wide = Address.parse("0.0.0.0:8050")
    assert wide.token and len(wide.token) >= 24 and wide.token != Address.parse("0.0.0.0:8050").token
    for bad in ("8050", "host:", ":8050", "127.0.0.1:http", "127.0.0.1:70000"):
        with pytest.raises(ConfigError, match="--dashboard expects HOST:PORT"):
            Address.parse(bad)
