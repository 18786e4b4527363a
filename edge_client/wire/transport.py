"""MQTT link shared by the device runtime and the server.

Everything paho-mqtt gets wrong by default is set here once (RESEARCH.md section 1): VERSION2 callbacks and MQTT v5,
QoS 1 with a persistent session (clean_start=False plus a session expiry), TCP_NODELAY (paho never sets it), a
keepalive long enough for slow uploads, automatic reconnect, and a size check against the broker's maximum packet
size before publishing (an oversized publish makes paho reconnect and resend it forever). Payloads larger than the
chunk size travel as chunk frames; the receiving side reassembles, de-duplicates and validates them on the caller's
thread, never on paho's network thread.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import ssl
import tempfile
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol
from urllib.parse import urlsplit

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from edge_client.wire import chunking
from edge_client.wire.messages import Message
from edge_client.wire.protocol import MessageTooLarge, ProtocolError
from edge_client.wire.topics import stream_of

log = logging.getLogger(__name__)

#: Bytes an MQTT PUBLISH adds around topic and payload (fixed header, length fields, packet id, properties).
PUBLISH_OVERHEAD = 64
#: What a sender may have queued beyond its chunked-message budget: hellos, presence, failure reports, chunk headers.
SMALL_QUEUE_BYTES = 4 << 20
#: Bytes of queued frames an inbox with a spool holds in memory; the frames that arrive beyond them wait in the spool.
MEMORY_QUEUE_BYTES = 32 << 20


@dataclass
class LinkConfig:
    """How to reach the broker. ``url`` is ``mqtt://host:port`` or ``mqtts://host:port`` (TLS)."""

    url: str
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    tls_insecure: bool = False
    keepalive: int = 60
    session_expiry_s: int = 3600
    chunk_size: int = chunking.DEFAULT_CHUNK_SIZE
    max_message_bytes: int = 256 * 2**20
    max_queued: int = 10000
    connect_timeout_s: float = 30.0
    # The broker's maximum packet size when it advertises none in CONNACK (ejabberd's mod_mqtt does not, and drops
    # the connection on a larger packet): the size check and the chunk size then use it. The smaller of the two
    # wins when both are known; None: only what the broker advertises.
    max_packet_size: int | None = None

    def endpoint(self) -> tuple[str, int, bool]:
        parts = urlsplit(self.url)
        if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
            raise ValueError(f"broker URL {self.url!r} must look like mqtt://HOST:PORT or mqtts://HOST:PORT")
        tls = parts.scheme == "mqtts"
        return parts.hostname, parts.port or (8883 if tls else 1883), tls


def speaks_tls(host: str, port: int, timeout_s: float = 3.0) -> bool:
    """Whether the listener at host:port completes a TLS handshake (any certificate: this only asks which scheme)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw, context.wrap_socket(raw):
            return True
    except OSError:  # ssl.SSLError included: a plain listener, or nothing there
        return False


def scheme_mismatch(config: LinkConfig) -> str | None:
    """Why a broker may never answer: the URL's scheme and the listener disagree about TLS (None: they agree)."""
    host, port, tls = config.endpoint()
    if not tls and speaks_tls(host, port):
        return f"the listener at {host}:{port} speaks TLS: use mqtts://{host}:{port} with --ca-file"
    if tls and not speaks_tls(host, port):
        return f"the listener at {host}:{port} does not complete a TLS handshake: use mqtt:// or the broker's TLS port"
    return None


class LoginRefused(ConnectionError):
    """The broker refused this login (bad username or password, or not authorised): retrying cannot help."""


class Link(Protocol):
    """What the server and the device runtime need from a connection: MQTT (``MqttLink``) or in-process."""

    rejections: Counter[str]
    #: whether the broker kept this connection's session (its queued messages) at the latest (re)connect
    session_present: bool

    def start(self) -> Link: ...

    def stop(self) -> None: ...

    def publish(self, topic: str, payload: bytes | bytearray, *, retain: bool = False, chunked: bool = True) -> int: ...

    def wait_published(self, timeout: float) -> bool: ...

    def chunk_size(self) -> int: ...

    def receive(self, timeout: float) -> tuple[str, Message] | None: ...

    def take_bytes_in(self, topic: str) -> int: ...

    def reject(self, topic: str, exc: ProtocolError) -> None: ...

    def limit_senders(self, budget: Callable[[str], int]) -> None: ...

    def on_refused(self, hook: Callable[[str, ProtocolError], None]) -> None: ...


class QueueFull(ProtocolError):
    """A frame dropped on arrival because its sender, or the link as a whole, has too much waiting already."""

    reason = "inbox_full"
    flood = True  # a flood of these must not flood the log: see ``sparse``


def sparse(count: int) -> bool:
    """Whether the ``count``-th occurrence of something a flood repeats is logged: the 1st, 2nd, 4th, 8th ..."""
    return count & (count - 1) == 0


class FairQueue:
    """Frames waiting for the caller, served in turn across lanes (one per sender): the head of the first lane, which
    then goes to the back if it has more. So one sender's backlog delays another's message by one frame per busy
    sender, not by the whole backlog (25,000 queued hellos of one device once held an honest update for 8 s)."""

    def __init__(self) -> None:
        self._lanes: OrderedDict[str, deque[tuple[str, bytes | tuple[int, int]]]] = OrderedDict()
        self._ready = threading.Condition()

    def put(self, lane: str, item: tuple[str, bytes | tuple[int, int]]) -> None:
        with self._ready:
            self._lanes.setdefault(lane, deque()).append(item)
            self._ready.notify()

    def get(self, timeout: float) -> tuple[str, bytes | tuple[int, int]]:
        """The next item in turn; raises ``queue.Empty`` when none comes within ``timeout`` seconds."""
        with self._ready:
            if not self._ready.wait_for(lambda: self._lanes, timeout=max(timeout, 0.0)):
                raise queue.Empty
            lane, items = next(iter(self._lanes.items()))
            item = items.popleft()
            if items:
                self._lanes.move_to_end(lane)
            else:
                del self._lanes[lane]
            return item

    def empty(self) -> bool:
        return not self._lanes


class Spool:
    """Queued frames kept out of memory: appended to an unnamed file in ``directory`` (nothing is left behind, even
    after a crash; the kernel writes its pages out and drops them when memory is short) and read back in turn. The
    file is emptied whenever none of its frames waits, and never grows past ``max_bytes``."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._file: IO[bytes] | None = None
        self._end = 0  # where the next frame goes
        self._waiting = 0  # frames written and not read back yet

    def put(self, payload: bytes) -> tuple[int, int] | None:
        """Write ``payload``; its offset and size, or None when the file is full or cannot be written."""
        if self._end + len(payload) > self.max_bytes:
            return None
        try:
            if self._file is None:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._file = tempfile.TemporaryFile(prefix="edgefl-inbox-", dir=self.directory)  # noqa: SIM115
            os.pwrite(self._file.fileno(), payload, self._end)
        except OSError as exc:
            log.warning("cannot spool a %d-byte frame to %s (%s); it waits in memory", len(payload), self.directory,
                        exc)  # fmt: skip
            return None
        where = (self._end, len(payload))
        self._end += len(payload)
        self._waiting += 1
        return where

    def take(self, where: tuple[int, int]) -> bytes:
        """Read back the frame ``put`` wrote at ``where`` (each is taken once)."""
        assert self._file is not None
        data = os.pread(self._file.fileno(), where[1], where[0])
        self._waiting -= 1
        if not self._waiting:
            self._file.truncate(0)
            self._end = 0
        return data


class Inbox:
    """The receiving half every link shares: raw frames in, reassembled and validated messages out, on the caller's
    thread; rejections are counted by reason and bytes by topic.

    The queue between the network thread and the caller is bounded in bytes: in all (``max_queued_bytes``) and, once
    ``limit_senders`` gives a budget per topic, per sender (its budget plus a little for small messages), so one
    flooding sender can neither exhaust memory nor crowd out the others; from then on the queue is also served
    round-robin across senders (``FairQueue``), so what one sender has queued never delays another's message. What is
    dropped is counted as ``inbox_full``. With ``spool_dir``, at most ``MEMORY_QUEUE_BYTES`` of the queue are held in
    memory and the rest wait in a ``Spool`` there: what many devices upload at once, faster than the caller takes it,
    then costs the process no memory per device.
    """

    def __init__(self, max_message_bytes: int, max_queued_bytes: int = 1 << 30, spool_dir: Path | None = None) -> None:
        self.rejections: Counter[str] = Counter()
        self.bytes_in = 0
        self.max_queued_bytes = max_queued_bytes
        self._bytes_by_topic: Counter[str] = Counter()
        # a frame, or where it waits in the spool (offset, size)
        self._inbox = FairQueue()  # one lane (FIFO) until ``limit_senders``, then one per topic
        self._queued: Counter[str] = Counter()  # bytes waiting per topic
        self._queued_total = 0
        self._in_memory = 0  # bytes of the queued frames held in memory
        self._spool = Spool(spool_dir, max_queued_bytes) if spool_dir is not None else None
        self._queue_lock = threading.Lock()
        self._budget: Callable[[str], int] | None = None
        self._refused: Callable[[str, ProtocolError], None] | None = None
        self._reassembler = chunking.Reassembler(max_message_bytes=max_message_bytes)

    def limit_senders(self, budget: Callable[[str], int]) -> None:
        """``budget(topic)``: the bytes of chunked messages that topic's sender may have in flight right now."""
        self._budget = budget
        self._reassembler.budget = budget

    def on_refused(self, hook: Callable[[str, ProtocolError], None]) -> None:
        """``hook(stream, error)`` for each frame refused in decoding, after it was counted: the caller may owe its
        sender something (the answer again to a repeat whose answer it did not get) or stop waiting for it (an
        update refused as it arrived: ``error.of_type``)."""
        self._refused = hook

    def _offer(self, topic: str, payload: bytes) -> None:
        """Queue a frame from the network (any thread), or drop it when its sender or the link is over its bound."""
        n = len(payload)
        with self._queue_lock:
            mine = self._queued[topic] + n
            cap = self._budget(topic) + SMALL_QUEUE_BYTES if self._budget is not None else self.max_queued_bytes
            if mine > cap or self._queued_total + n > self.max_queued_bytes:
                self.rejections[QueueFull.reason] += 1
                dropped = self.rejections[QueueFull.reason]
                if sparse(dropped):
                    log.warning("dropped a %d-byte frame on %s: %d bytes of it queued, %d in all (%d dropped so far)",
                                n, topic, self._queued[topic], self._queued_total, dropped)  # fmt: skip
                return
            self._queued[topic] = mine
            self._queued_total += n
            spooled = self._spool.put(payload) if self._spool and self._in_memory + n > MEMORY_QUEUE_BYTES else None
            self._in_memory += 0 if spooled else n
        self._inbox.put(topic if self._budget is not None else "", (topic, spooled or payload))

    def receive(self, timeout: float) -> tuple[str, Message] | None:
        """The next valid message and its topic, or None when ``timeout`` passes without one.

        Malformed, duplicated or otherwise invalid frames are logged, counted in ``rejections`` and skipped.
        """
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                topic, item = self._inbox.get(remaining)
            except queue.Empty:
                return None
            with self._queue_lock:
                if isinstance(item, tuple):  # where it waits in the spool
                    assert self._spool is not None
                    payload = self._spool.take(item)
                else:
                    payload = item
                    self._in_memory -= len(payload)
                self._queued[topic] -= len(payload)
                self._queued_total -= len(payload)
                if not self._queued[topic]:
                    del self._queued[topic]
            stream = stream_of(topic)  # the round model's frames come on one topic each
            self.bytes_in += len(payload)
            self._bytes_by_topic[stream] += len(payload)
            if not payload and stream != topic:  # the publisher cleared a retained frame of a multi-topic stream
                continue
            try:
                msg = self._reassembler.feed(stream, payload)
            except ProtocolError as exc:
                self.reject(topic, exc)
                if self._refused is not None:
                    self._refused(stream, exc)
                continue
            if msg is not None:
                return stream, msg

    def take_bytes_in(self, topic: str) -> int:
        """Bytes received on ``topic`` (a stream) since the last call (what one client sent in one round)."""
        return self._bytes_by_topic.pop(topic, 0)

    def reject(self, topic: str, exc: ProtocolError) -> None:
        """Count and log a message that failed validation (also used by callers for semantic checks); what a flood
        repeats (``exc.flood``) is logged sparsely."""
        with self._queue_lock:
            self.rejections[exc.reason] += 1
            count = self.rejections[exc.reason]
        if not getattr(exc, "flood", False) or sparse(count):
            log.warning("rejected message on %s: %s: %s (%d %s so far)", topic, type(exc).__name__, exc, count,
                        exc.reason)  # fmt: skip


class MqttLink(Inbox):
    """One MQTT connection: publish (chunked, size-checked, QoS 1) and receive validated messages."""

    def __init__(
        self,
        config: LinkConfig,
        mqtt_client_id: str,
        subscriptions: Iterable[str],
        *,
        will: tuple[str, bytes, bool] | None = None,
        on_connect: Callable[[], None] | None = None,
        retained_once: Iterable[str] = (),
        spool_dir: Path | None = None,
    ) -> None:
        """``retained_once``: subscriptions whose retained messages the broker sends only when the subscription is new
        (MQTT 5 retain handling 1), so a reconnect with its session kept does not fetch them again. ``spool_dir``: see
        ``Inbox`` (the server's; a device receives little at once)."""
        super().__init__(config.max_message_bytes, spool_dir=spool_dir)
        self.config = config
        self.subscriptions = list(subscriptions)
        self.retained_once = set(retained_once)
        self.bytes_out = 0
        self.max_packet_size: int | None = None
        self.session_present = False
        self._on_connect_hook = on_connect
        self._connected = threading.Event()
        self._connect_error: str | None = None
        self._login_refused = False
        self._lock = threading.Condition()
        self._pending: set[int] = set()
        self._acked_early: set[int] = set()
        #: publishes the broker acknowledged with a failure (MQTT 5 PUBACK >= 0x80, e.g. an ACL's "Not authorized"),
        #: by reason; such a message was dropped by the broker, although it counts as published
        self.refused_publishes: Counter[str] = Counter()

        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=mqtt_client_id, protocol=MQTTProtocolVersion.MQTTv5)
        client.max_queued_messages_set(config.max_queued)
        client.reconnect_delay_set(min_delay=1, max_delay=30)
        if config.username:
            client.username_pw_set(config.username, config.password)
        _, _, tls = config.endpoint()
        if tls:
            client.tls_set(ca_certs=config.ca_file, cert_reqs=ssl.CERT_REQUIRED)
            client.tls_insecure_set(config.tls_insecure)
        if will:
            client.will_set(will[0], will[1], qos=1, retain=will[2])
        client.on_connect = self._handle_connect
        client.on_subscribe = self._handle_subscribe
        client.on_disconnect = self._handle_disconnect
        client.on_message = self._handle_message
        client.on_publish = self._handle_publish
        self._client = client

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> MqttLink:
        """Connect and wait for the first CONNACK and SUBACK; later reconnects happen on their own."""
        host, port, _ = self.config.endpoint()
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self.config.session_expiry_s
        self._client.connect_async(host, port, keepalive=self.config.keepalive, clean_start=False, properties=props)
        self._client.loop_start()
        deadline = time.monotonic() + self.config.connect_timeout_s
        while not self._connected.wait(0.05):
            if self._connect_error or time.monotonic() > deadline:
                self.stop()
                error = LoginRefused if self._login_refused else ConnectionError
                raise error(
                    f"could not connect to {self.config.url} as {self.config.username!r}: "
                    + (self._connect_error or self._silence())
                )
        return self

    def _silence(self) -> str:
        """What a broker that never answered says: nothing, unless its listener and the URL disagree about TLS."""
        mismatch = scheme_mismatch(self.config)
        return f"no answer within {self.config.connect_timeout_s:.0f} s" + (f"; {mismatch}" if mismatch else "")

    def stop(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    # -- paho callbacks (network thread: keep them short) ------------------------------------------------------
    def _handle_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            self._connect_error = f"broker refused the connection: {reason_code}"
            self._login_refused = reason_code.value in (0x86, 0x87)  # bad user name or password / not authorized
            if self._login_refused:
                self._connect_error += " (check the username and password)"
            log.warning("%s", self._connect_error)
            return
        sock = client.socket()
        if isinstance(sock, socket.socket):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        advertised = getattr(properties, "MaximumPacketSize", None) if properties else None
        self.max_packet_size = min((n for n in (advertised, self.config.max_packet_size) if n), default=None)
        self._connect_error = None
        self.session_present = bool(flags.session_present)
        # Subscribe first, then the hook (the server's presence, a device's hello), then paho resends what was in
        # flight: one connection, so the broker has the subscriptions before anyone can answer what we send.
        if self.subscriptions:  # ready once the broker confirmed the subscriptions (SUBACK)
            client.subscribe(
                [(t, SubscribeOptions(qos=1, retainHandling=int(t in self.retained_once))) for t in self.subscriptions]
            )
        else:
            self._connected.set()
        log.info("connected to %s (session present: %s)", self.config.url, flags.session_present)
        if self._on_connect_hook:
            self._on_connect_hook()

    def _handle_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        refused = [str(rc) for rc in reason_codes if rc.is_failure]
        if refused:
            log.warning("broker refused subscriptions %s: %s", self.subscriptions, refused)
        self._connected.set()

    def _handle_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self._connected.clear()
        if reason_code.is_failure:
            log.warning("disconnected from %s: %s; reconnecting", self.config.url, reason_code)

    def _handle_message(self, client, userdata, msg) -> None:
        self._offer(msg.topic, msg.payload)

    def _handle_publish(self, client, userdata, mid, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.warning("the broker refused publish %d: %s", mid, reason_code)
        with self._lock:
            if reason_code.is_failure:
                self.refused_publishes[str(reason_code)] += 1
            if mid in self._pending:
                self._pending.discard(mid)
            else:  # paho may acknowledge before publish() has returned the mid to us
                self._acked_early.add(mid)
            self._lock.notify_all()

    # -- publishing ------------------------------------------------------------------------------------------------
    def chunk_size(self) -> int:
        """The configured chunk size, shrunk to fit the broker's maximum packet size when that is smaller.

        Zero when the broker's limit leaves no room for a chunk frame's header.
        """
        size = self.config.chunk_size
        if self.max_packet_size:
            size = min(size, self.max_packet_size - PUBLISH_OVERHEAD - 1024)
        return max(size, 0)

    def publish(self, topic: str, payload: bytes | bytearray, *, retain: bool = False, chunked: bool = True) -> int:
        """Queue ``payload`` for delivery with QoS 1 and return the bytes put on the wire.

        Delivery survives reconnects (paho keeps the message and resends it); ``wait_published`` waits for the
        broker's acknowledgements.
        """
        chunk_size = self.chunk_size()
        # A retained message must stay whole: retained chunks on one topic would overwrite each other.
        frames = chunking.split(payload, chunk_size) if chunk_size and chunked else [payload]
        limit = self.max_packet_size
        overhead = len(topic.encode()) + PUBLISH_OVERHEAD
        largest = max(len(frame) for frame in frames) + overhead
        if limit and largest > limit:  # checked for every frame before any is sent: no half-sent messages
            raise MessageTooLarge(
                f"a frame of {largest} bytes exceeds the broker's maximum packet size of {limit} bytes; "
                "lower the chunk size or raise max_packet_size in the broker"
            )
        sent = 0
        for frame in frames:
            info = self._client.publish(topic, frame, qos=1, retain=retain)
            if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
                raise ConnectionError(f"publish to {topic} failed: {mqtt.error_string(info.rc)}")
            with self._lock:
                if info.mid in self._acked_early:
                    self._acked_early.discard(info.mid)
                else:
                    self._pending.add(info.mid)
            sent += len(frame)
        self.bytes_out += sent
        return sent

    def wait_published(self, timeout: float) -> bool:
        """True once the broker acknowledged everything published so far."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(remaining)
        return True
