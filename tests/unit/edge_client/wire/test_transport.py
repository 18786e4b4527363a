"""The link's inbox (edge_client/wire/transport.py) without a broker. The link over a real mosquitto:
tests/integration/test_transport.py."""

from __future__ import annotations

from edge_client.wire.messages import Hello
from edge_client.wire.protocol import encode
from edge_client.wire.topics import Topics
from edge_client.wire.transport import Inbox


def test_a_link_without_sender_limits_keeps_arrival_order() -> None:
    """A device's link (no ``limit_senders``) stays first in, first out across topics: a round's model frames come
    before the assignment that names them."""
    inbox, topics = Inbox(1 << 30), Topics("job")
    for i in range(3):
        inbox._offer(topics.up(f"s{i % 2}"), encode(Hello(client_id=f"n{i}", num_samples=1)))
    got = [inbox.receive(1.0) for _ in range(3)]
    assert [m[1].client_id for m in got if m is not None] == ["n0", "n1", "n2"]
