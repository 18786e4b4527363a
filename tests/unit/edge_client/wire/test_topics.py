"""Topic scheme and client-id rules (ids are topic levels and broker usernames)."""

from __future__ import annotations

import pytest

from edge_client.wire.topics import CLIENT_ID_RE, Topics, validate_client_id


@pytest.mark.parametrize("cid", ["a", "pi-01", "Pi_4.lab-7", "server", "0", "a" * 64])
def test_valid_client_ids(cid: str) -> None:
    assert validate_client_id(cid) == cid
    assert CLIENT_ID_RE.fullmatch(cid)


@pytest.mark.parametrize("cid", ["", "-pi", ".pi", "_pi", "a/b", "a+b", "a#", "a b", "é", "a" * 65, "pi\n", None, 3])
def test_invalid_client_ids(cid: object) -> None:
    with pytest.raises(ValueError, match="client id") as info:
        validate_client_id(cid)  # type: ignore[arg-type]
    assert CLIENT_ID_RE.pattern in str(info.value)


def test_topics() -> None:
    t = Topics()
    assert t.root == "edgefl/default"
    assert t.up("pi-01") == "edgefl/default/c/pi-01/up"
    assert t.down("pi-01") == "edgefl/default/c/pi-01/down"
    assert t.broadcast == "edgefl/default/broadcast"
    assert t.server == "edgefl/default/server"
    assert t.all_up == "edgefl/default/c/+/up"
    assert Topics("lab.2").up("x") == "edgefl/lab.2/c/x/up"
    with pytest.raises(ValueError):
        t.up("a/b")
    with pytest.raises(ValueError, match="job"):
        Topics("a/b")
    with pytest.raises(AttributeError):
        t.job = "other"  # type: ignore[misc]


def test_sender_of() -> None:
    t = Topics("job1")
    assert t.sender_of("edgefl/job1/c/pi-01/up") == "pi-01"
    assert t.sender_of("edgefl/job1/c/pi-01/down") is None  # a down topic never carries a client's message
    for topic in [
        "edgefl/job2/c/pi-01/up",
        "edgefl/job1/c/pi-01/sideways",
        "edgefl/job1/c/+/up",
        "edgefl/job1/c/pi-01/up/extra",
        "edgefl/job1/broadcast",
        "edgefl/job1/server",
        "other/job1/c/pi-01/up",
        "",
    ]:
        assert t.sender_of(topic) is None, topic
