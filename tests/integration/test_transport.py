"""MqttLink against a real mosquitto (the session `broker` fixture): chunking, validation, sizes, sessions.

No sleeps: a link's subscriptions are confirmed through paho's SUBACK callback before anything is published, and a
message "not arriving" is proved by ordering (the same sender then publishes a sentinel on the same topic with QoS 1,
which MQTT delivers after it).
"""

from __future__ import annotations

import dataclasses
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from edge_client.wire import chunking
from edge_client.wire.messages import (
    Assignment,
    Failure,
    GlobalModel,
    Hello,
    Message,
    ModelRequest,
    Presence,
    RoundFacts,
    Stop,
    Update,
    model_digest,
)
from edge_client.wire.plan import Plan
from edge_client.wire.protocol import MessageTooLarge, encode
from edge_client.wire.topics import Topics
from edge_client.wire.transport import PUBLISH_OVERHEAD, LinkConfig, MqttLink
from server.broker import Broker, Credentials

TIMEOUT = 30.0
LinkFactory = Callable[..., MqttLink]


def new_topics() -> Topics:
    return Topics(f"t{uuid.uuid4().hex[:12]}")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def make_update(client_id: str, n: int, *, round_: int = 1, fill: float | None = None) -> Update:
    rng = np.random.default_rng(n)
    delta = rng.standard_normal(n, dtype=np.float32) if fill is None else np.full(n, fill, dtype=np.float32)
    return Update(
        round=round_,
        model_version=0,
        client_id=client_id,
        num_samples=100,
        local_steps=5,
        compute_s=0.5,
        cpu_s=0.4,
        train_loss=1.25,
        delta=delta,
        metrics={"cpu_percent": 12.5},
        extras={"tau": 5},
        arrays={"control": np.arange(3, dtype=np.float32)},
    )


def assert_same(got: Message, want: Message) -> None:
    """Field-by-field equality, with np.array_equal for arrays (dataclass == cannot compare arrays)."""
    assert type(got) is type(want)
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), f.name
        elif f.name == "arrays":
            assert a.keys() == b.keys(), f.name
            for key in b:
                assert np.array_equal(a[key], b[key]), f"arrays[{key}]"
        else:
            assert a == b, f.name


def receive(link: MqttLink, timeout: float = TIMEOUT) -> tuple[str, Message]:
    got = link.receive(timeout)
    assert got is not None, f"nothing arrived within {timeout} s (rejections: {dict(link.rejections)})"
    return got


@pytest.fixture
def links(broker: Broker) -> Iterator[LinkFactory]:
    """`make(creds, subscriptions, client_id=None, *, start=True, **LinkConfig fields)` -> MqttLink.

    A started link has its subscriptions confirmed (SUBACK) when returned. Every link is stopped at teardown.
    """
    made: list[MqttLink] = []

    def make(
        creds: Credentials,
        subscriptions: list[str],
        client_id: str | None = None,
        *,
        start: bool = True,
        **config: Any,
    ) -> MqttLink:
        link = MqttLink(
            LinkConfig(broker.url, creds.username, creds.password, **config),
            client_id or new_id(creds.username),
            subscriptions,
        )
        made.append(link)
        if start:
            start_subscribed(link)
        return link

    yield make
    for link in made:
        link.stop()


def start_subscribed(link: MqttLink) -> MqttLink:
    """Start ``link``: start() returns once the broker acknowledged its subscriptions (SUBACK)."""
    return link.start()


# ------------------------------------------------------------------------------------------------------ delivery
def test_multi_chunk_update_arrives_whole_and_equal(broker: Broker, links: LinkFactory) -> None:
    topics = new_topics()
    receiver = links(broker.server, [topics.all_up])
    sender = links(broker.devices["c0"], [topics.down("c0")], chunk_size=1 << 20)
    update = make_update("c0", 3_000_000)
    payload = encode(update)
    frames = chunking.split(payload, sender.chunk_size())
    assert sender.chunk_size() == 1 << 20 and len(frames) == -(-len(payload) // (1 << 20)) >= 12

    sent = sender.publish(topics.up("c0"), payload)

    topic, msg = receive(receiver)
    assert topic == topics.up("c0")
    assert_same(msg, update)
    assert msg.delta.size == 3_000_000 and np.array_equal(msg.delta, update.delta)
    assert sent == sender.bytes_out == sum(len(f) for f in frames) > len(payload)  # chunk headers on top
    assert receiver.bytes_in == sent
    assert not receiver.rejections
    assert sender.wait_published(TIMEOUT)


def test_every_production_message_type_round_trips(broker: Broker, links: LinkFactory) -> None:
    topics = new_topics()
    server = links(broker.server, [topics.all_up])
    device = links(
        broker.devices["c1"], [topics.down("c1"), topics.broadcast, topics.server, topics.round_model_frames]
    )

    upward: list[Message] = [
        Hello(client_id="c1", num_samples=1797, device={"hostname": "pi", "cpu_count": 4, "temp_c": 51.5}),
        make_update("c1", 1000),
        Failure(round=3, client_id="c1", reason="train_error", detail="out of memory", run_id="run-1"),
        ModelRequest(round=3, client_id="c1", sha256="ab" * 32, run_id="run-1"),
        Presence(client_id="c1", online=False, reason="connection lost"),
    ]
    for msg in upward:
        device.publish(topics.up("c1"), encode(msg))
    for msg in upward:
        topic, got = receive(server)
        assert topic == topics.up("c1")
        assert_same(got, msg)

    assignment = Assignment(
        Plan(20, 0.05, 32, settings={"zeta": 0.01, "alpha_i": 0.5}, momentum=0.5, weight_decay=5e-4),
        RoundFacts(
            round=3, model_version=2, sha256="ab" * 32, deadline_s=60.0, upload=False, run_id="run-1",
            algorithm="fedavg", model={"name": "mlp", "in_features": 64, "num_classes": 10}, seed=7,
        ),
        arrays={"c": np.ones(4, dtype=np.float32)},
        global_arrays=["c_global"],
    )  # fmt: skip
    weights, shared = np.linspace(-1, 1, 5000, dtype=np.float32), {"c_global": np.ones(5000, dtype=np.float32)}
    model = GlobalModel(3, 2, model_digest(weights, shared), weights, shared, run_id="run-1")
    downward: list[tuple[str, Message]] = [
        (topics.round_model, model),  # sent on frame 0's topic, received as the round model's stream
        (topics.down("c1"), assignment),
        (topics.down("c1"), Stop(reason="you are done")),
        (topics.broadcast, Stop(reason="training finished", run_id="run-1")),
        (topics.server, Presence(client_id="server", online=True, role="server")),
    ]
    for topic, msg in downward:
        server.publish(topics.round_model_frame(0) if topic == topics.round_model else topic, encode(msg))
    for topic, msg in downward:
        got_topic, got = receive(device)
        assert got_topic == topic
        assert_same(got, msg)
    assert not server.rejections and not device.rejections


def test_redelivered_payload_is_returned_once(broker: Broker, links: LinkFactory) -> None:
    topics = new_topics()
    receiver = links(broker.server, [topics.all_up])
    sender = links(broker.devices["c2"], [topics.down("c2")])
    payload = encode(make_update("c2", 100))
    sender.publish(topics.up("c2"), payload)
    sender.publish(topics.up("c2"), payload)  # what a QoS 1 redelivery looks like to the receiver
    sentinel = Hello(client_id="c2", num_samples=1)
    sender.publish(topics.up("c2"), encode(sentinel))

    _, first = receive(receiver)
    assert isinstance(first, Update)
    _, second = receive(receiver)
    assert_same(second, sentinel)  # the copy in between was skipped
    assert receiver.rejections == {"duplicate": 1}


def test_redelivered_chunked_message_is_returned_once(broker: Broker, links: LinkFactory) -> None:
    topics = new_topics()
    receiver = links(broker.server, [topics.all_up])
    sender = links(broker.devices["c2"], [topics.down("c2")], chunk_size=4096)
    payload = encode(make_update("c2", 5000))
    frames = len(chunking.split(payload, sender.chunk_size()))
    assert frames > 1
    sender.publish(topics.up("c2"), payload)
    sender.publish(topics.up("c2"), payload)
    sentinel = Hello(client_id="c2", num_samples=1)
    sender.publish(topics.up("c2"), encode(sentinel))

    _, first = receive(receiver)
    assert isinstance(first, Update)
    _, second = receive(receiver)
    assert_same(second, sentinel)
    assert receiver.rejections == {"duplicate": frames}  # one per chunk frame of the repeated message


def test_garbage_is_rejected_and_next_message_arrives(broker: Broker, links: LinkFactory) -> None:
    topics = new_topics()
    receiver = links(broker.server, [topics.all_up])
    sender = links(broker.devices["c3"], [topics.down("c3")])
    sender.publish(topics.up("c3"), b"\x00\xffthis is not msgpack")
    hello = Hello(client_id="c3", num_samples=10)
    sender.publish(topics.up("c3"), encode(hello))

    _, got = receive(receiver)
    assert_same(got, hello)
    assert receiver.rejections == {"malformed": 1}


# ------------------------------------------------------------------------------------------------------ sizes
def test_chunk_size_shrinks_to_the_broker_limit(broker: Broker, links: LinkFactory) -> None:
    topics = new_topics()
    limit = broker.settings.max_packet_size
    receiver = links(broker.server, [topics.all_up])
    sender = links(broker.devices["c4"], [topics.down("c4")], chunk_size=2 * limit)
    assert sender.max_packet_size == limit  # learnt from the CONNACK
    assert sender.chunk_size() < limit < sender.config.chunk_size
    update = make_update("c4", (limit + limit // 4) // 4)  # more than one broker packet of floats
    payload = encode(update)
    assert len(payload) > limit
    frames = chunking.split(payload, sender.chunk_size())
    assert len(frames) == 2 and all(len(f) + len(topics.up("c4")) + PUBLISH_OVERHEAD <= limit for f in frames)

    sender.publish(topics.up("c4"), payload)

    _, got = receive(receiver)
    assert_same(got, update)
    assert not receiver.rejections


def test_a_configured_limit_below_the_advertised_one_wins(broker: Broker, links: LinkFactory) -> None:
    """`LinkConfig.max_packet_size` (for brokers that advertise none, e.g. ejabberd): the smaller limit applies."""
    topics = new_topics()
    limit = broker.settings.max_packet_size // 8
    receiver = links(broker.server, [topics.all_up])
    sender = links(broker.devices["c4"], [topics.down("c4")], chunk_size=limit, max_packet_size=limit)
    assert sender.max_packet_size == limit < broker.settings.max_packet_size
    assert sender.chunk_size() < limit
    update = make_update("c4", limit // 2)  # two packets' worth of floats
    with pytest.raises(MessageTooLarge):
        sender.publish(topics.up("c4"), encode(update), chunked=False)
    sender.publish(topics.up("c4"), encode(update))
    _, got = receive(receiver)
    assert_same(got, update)


def test_frame_over_the_limit_raises_before_anything_is_sent(broker: Broker, links: LinkFactory) -> None:
    """Frames count their topic too: with a 2 KiB limit, no frame on a 2 KiB topic fits, so nothing may go out."""
    topics = new_topics()
    long_topic = f"{topics.root}/{'x' * 2100}"
    receiver = links(broker.server, [long_topic])
    sender = links(broker.server, [topics.broadcast])
    real_limit = sender.max_packet_size
    sender.max_packet_size = 2048  # a broker with a small limit
    payload = encode(make_update("c5", 1000))
    assert len(chunking.split(payload, sender.chunk_size())) > 1

    with pytest.raises(MessageTooLarge, match="maximum packet size of 2048"):
        sender.publish(long_topic, payload)
    assert sender.bytes_out == 0

    sender.max_packet_size = real_limit
    sentinel = encode(Stop(reason="sentinel"))
    sender.publish(long_topic, sentinel)
    _, got = receive(receiver)
    assert isinstance(got, Stop) and got.reason == "sentinel"
    assert receiver.take_bytes_in(long_topic) == len(sentinel)  # not a single chunk frame came before it
    assert not receiver.rejections


def test_limit_smaller_than_any_frame_raises_message_too_large(broker: Broker, links: LinkFactory) -> None:
    topics = new_topics()
    sender = links(broker.devices["c5"], [topics.down("c5")])
    sender.max_packet_size = 64  # smaller than any frame: not even a Stop fits
    with pytest.raises(MessageTooLarge):
        sender.publish(topics.up("c5"), encode(Presence(client_id="c5", online=True)))
    assert sender.bytes_out == 0


def test_message_whose_later_frame_cannot_fit_sends_nothing(broker: Broker, links: LinkFactory) -> None:
    """Chunk index 128 needs one more msgpack byte than index 127: size the topic so that only frames >= 128 fail."""
    topics = new_topics()
    limit = 1188  # chunk_size() = 1188 - 64 - 1024 = 100 bytes
    payload = encode(make_update("c6", 4000))
    frames = chunking.split(payload, limit - PUBLISH_OVERHEAD - 1024)
    assert len(frames) > 129 and len(frames[128]) == len(frames[0]) + 1
    topic = topics.root + "/" + "y" * (limit - PUBLISH_OVERHEAD - len(frames[0]) - len(topics.root) - 1)
    assert len(frames[0]) + len(topic) + PUBLISH_OVERHEAD == limit  # frame 0 fits exactly, frame 128 does not

    receiver = links(broker.server, [topic])
    sender = links(broker.server, [topics.broadcast])
    real_limit = sender.max_packet_size
    sender.max_packet_size = limit
    with pytest.raises(MessageTooLarge):
        sender.publish(topic, payload)
    sender.max_packet_size = real_limit
    sentinel = encode(Stop(reason="sentinel"))
    sender.publish(topic, sentinel)
    _, got = receive(receiver)
    assert isinstance(got, Stop)
    assert receiver.take_bytes_in(topic) == len(sentinel)


# ------------------------------------------------------------------------------------------------------ connection
def test_wrong_password_fails_on_the_connack(broker: Broker) -> None:
    config = LinkConfig(broker.url, "c7", "not-the-password", connect_timeout_s=600.0)
    link = MqttLink(config, new_id("c7"), [])
    with pytest.raises(ConnectionError) as info:
        link.start()
    text = str(info.value)
    # the CONNACK's refusal, not the 600 s "no answer" fallback, ended start()
    assert "broker refused the connection" in text and "no answer" not in text
    assert "check the username and password" in text and "'c7'" in text
    assert not link.connected


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_publish_only_link_connects(broker: Broker) -> None:
    creds = broker.devices["c7"]
    link = MqttLink(LinkConfig(broker.url, creds.username, creds.password, connect_timeout_s=3.0), new_id("c7"), [])
    try:
        link.start()
        assert link.connected
    finally:
        link.stop()


def test_tcp_nodelay_is_set_after_connect(broker: Broker, links: LinkFactory) -> None:
    link = links(broker.devices["c7"], [new_topics().down("c7")])
    sock = link._client.socket()
    assert isinstance(sock, socket.socket)
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_take_bytes_in_counts_per_topic_and_resets(broker: Broker, links: LinkFactory) -> None:
    topics = new_topics()
    receiver = links(broker.server, [topics.all_up])
    c0 = links(broker.devices["c0"], [topics.down("c0")], chunk_size=4096)
    c1 = links(broker.devices["c1"], [topics.down("c1")])
    big = encode(make_update("c0", 3000))  # chunked: the count is every frame's bytes
    small = encode(Hello(client_id="c1", num_samples=5))
    sent_big = c0.publish(topics.up("c0"), big)
    assert sent_big > len(big)
    c1.publish(topics.up("c1"), small)

    for _ in range(2):
        receive(receiver)
    assert receiver.take_bytes_in(topics.up("c0")) == sent_big
    assert receiver.take_bytes_in(topics.up("c0")) == 0
    assert receiver.take_bytes_in(topics.up("c1")) == len(small)
    assert receiver.take_bytes_in(topics.up("c1")) == 0

    again = encode(Hello(client_id="c1", num_samples=6))
    c1.publish(topics.up("c1"), again)
    receive(receiver)
    assert receiver.take_bytes_in(topics.up("c1")) == len(again)


def wait_for_log(broker: Broker, offset: int, line: str) -> None:
    """Poll mosquitto's log (flushed per line) for ``line`` after byte ``offset``."""
    deadline = time.monotonic() + TIMEOUT
    while line not in broker.log_path.read_bytes()[offset:].decode(errors="replace"):
        assert time.monotonic() < deadline, f"mosquitto never logged {line!r}"
        time.sleep(0.01)  # poll interval, not a synchronisation delay


def test_persistent_session_receives_what_was_sent_while_offline(broker: Broker, links: LinkFactory) -> None:
    topics = new_topics()
    client_id = new_id("persist")
    first = links(broker.server, [topics.all_up], client_id)
    offset = broker.log_path.stat().st_size
    first.stop()
    wait_for_log(broker, offset, f"Client {client_id} disconnected")  # the broker holds the session, offline

    sender = links(broker.devices["c8"], [topics.down("c8")])
    hello = Hello(client_id="c8", num_samples=42)
    sender.publish(topics.up("c8"), encode(hello))
    assert sender.wait_published(TIMEOUT)  # the broker has it: queued for the offline session

    again = links(broker.server, [topics.all_up], client_id, start=False)
    assert again.config.session_expiry_s > 0
    again.start()
    topic, got = receive(again)
    assert topic == topics.up("c8")
    assert_same(got, hello)
    assert first.bytes_in == 0
