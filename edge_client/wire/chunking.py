"""Chunked transfer: big frames travel as ~1 MiB chunk frames and are reassembled with integrity checks.

Chunks are faster through mosquitto than one big message, stay clear of paho's keepalive timeout on slow links and
make a retry resend one chunk, not the model. The receiver is the defence line: memory is taken as chunks arrive,
never for a size a frame merely announces; each sender may hold at most its budget (the server gives a device the
size of one legitimate update of the round, so a device flooding announcements or pieces only ever evicts its own
partial messages); the total is bounded too; stale partial messages expire; duplicates that a broker redelivers
after a crash are dropped.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from edge_client.wire.messages import Chunk, Message
from edge_client.wire.protocol import (
    MAX_HEADER_BYTES,
    ChunkError,
    DuplicateMessage,
    MessageTooLarge,
    decode,
    encode,
    read_header,
)

DEFAULT_CHUNK_SIZE = 1 << 20
log = logging.getLogger(__name__)


def split(payload: bytes | bytearray, chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[bytes | bytearray]:
    """Return ``[payload]`` if it fits in ``chunk_size``, else chunk frames carrying at most ``chunk_size`` bytes each.

    The chunks' ``of`` is the payload's own msg id, so de-duplication works the same for whole and chunked messages.
    """
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size expected an int > 0, got {chunk_size!r}")
    if len(payload) <= chunk_size:
        return [payload]
    header, _ = read_header(payload)
    if header["t"] == "chunk":
        raise ValueError("split: payload is already a chunk frame")
    digest = hashlib.sha256(payload).hexdigest()
    view, size = memoryview(payload), len(payload)
    count = -(-size // chunk_size)
    return [
        encode(Chunk(header["id"], i, count, size, chunk_size, digest, view[i * chunk_size : (i + 1) * chunk_size]))
        for i in range(count)
    ]


@dataclass
class _Partial:
    first: Chunk  # header fields every later chunk must repeat
    pieces: dict[int, memoryview | bytes]  # index -> the piece as received (a view of its frame: no copy)
    held: int  # bytes of the pieces
    started: float


class Reassembler:
    """Turns frames from many senders back into messages; one instance per receiving endpoint (thread-safe)."""

    def __init__(
        self,
        *,
        max_message_bytes: int = 256 * 2**20,
        max_pending_per_sender: int = 4,
        max_pending_bytes: int = 1 << 30,
        ttl_s: float = 600.0,
        remember: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        budget: Callable[[str], int | None] | None = None,
    ) -> None:
        """``budget(sender)``: the bytes of partial messages ``sender`` may hold (None: no limit of its own)."""
        self.max_message_bytes = max_message_bytes
        self.max_pending_per_sender = max_pending_per_sender
        self.max_pending_bytes = max_pending_bytes
        self.ttl_s = ttl_s
        self.remember = remember
        self._clock = clock
        self._pending: OrderedDict[tuple[str, str], _Partial] = OrderedDict()  # oldest first
        self._pending_bytes = 0
        self.budget = budget
        self._delivered: OrderedDict[tuple[str, str], None] = OrderedDict()  # LRU of delivered (sender, msg id)
        self._lock = threading.Lock()

    def pending(self) -> int:
        """Number of partial messages held."""
        return len(self._pending)

    def feed(self, sender: str, payload: bytes | bytearray | memoryview) -> Message | None:
        """Decode one frame; return a whole message when one is complete, else None. Raises ProtocolError."""
        with self._lock:
            self._expire(self._clock())
            size = memoryview(payload).nbytes
            msg = decode(payload, max_bytes=self.max_message_bytes + MAX_HEADER_BYTES)
            if not isinstance(msg, Chunk):
                if size > self.max_message_bytes:
                    raise MessageTooLarge(f"{msg.TYPE}: expected <= {self.max_message_bytes} bytes, got {size}")
                return self._deliver(sender, msg)
            return self._add(sender, msg)

    def _deliver(self, sender: str, msg: Message) -> Message:
        key = (sender, msg.msg_id)
        if key in self._delivered:
            self._delivered.move_to_end(key)
            raise DuplicateMessage(f"{msg.TYPE} {msg.msg_id} from {sender!r} was already delivered", msg.msg_id)
        self._remember(key)
        return msg

    def _remember(self, key: tuple[str, str]) -> None:
        self._delivered[key] = None
        while len(self._delivered) > self.remember:
            self._delivered.popitem(last=False)

    def _add(self, sender: str, c: Chunk) -> Message | None:
        key = (sender, c.of)
        if key in self._delivered:  # the first chunk stands for the repeated message, the others for nothing more
            raise DuplicateMessage(f"chunk {c.index} of {c.of} from {sender!r}: message was already delivered",
                                   c.of if c.index == 0 else "")  # fmt: skip
        evicted: list[str] = []
        p = self._pending.get(key) or self._start(sender, key, c, evicted)
        for name in ("count", "size", "chunk_size", "sha256"):
            if getattr(c, name) != getattr(p.first, name):
                raise ChunkError(
                    f"chunk {c.index} of {c.of}: {name} expected {getattr(p.first, name)!r}, got {getattr(c, name)!r}"
                )
        if c.index in p.pieces:
            if p.pieces[c.index] == c.data:
                return None  # QoS 1 redelivery of the same piece
            raise ChunkError(f"chunk {c.index} of {c.of}: repeated with different bytes")
        self._make_room(sender, key, len(c.data), evicted)
        p.pieces[c.index] = c.data
        p.held += len(c.data)
        self._pending_bytes += len(c.data)
        if len(p.pieces) < c.count:
            if evicted:  # the new piece is kept; tell the caller what was lost to make room
                raise ChunkError(f"sender {sender!r} over its pending limits: dropped partial messages {evicted}")
            return None
        self._drop(key)
        whole = b"".join(p.pieces[i] for i in range(c.count))  # the one copy of the message
        if hashlib.sha256(whole).hexdigest() != c.sha256:
            raise ChunkError(f"message {c.of} from {sender!r}: sha256 of the {c.size} reassembled bytes does not match")
        msg = decode(whole, max_bytes=self.max_message_bytes)
        if isinstance(msg, Chunk) or msg.msg_id != c.of:
            raise ChunkError(f"message {c.of} from {sender!r}: reassembled a {msg.TYPE} with id {msg.msg_id}")
        return self._deliver(sender, msg)

    def _limit(self, sender: str) -> int:
        budget = self.budget(sender) if self.budget is not None else None
        return min(self.max_message_bytes, self.max_pending_bytes, budget if budget is not None else 1 << 62)

    def _start(self, sender: str, key: tuple[str, str], c: Chunk, evicted: list[str]) -> _Partial:
        """Register a new partial message; nothing is allocated for the size it announces."""
        limit = self._limit(sender)
        if c.size > limit:
            raise ChunkError(f"chunk of {c.of} from {sender!r}: announces {c.size} bytes, this sender may send {limit}")
        mine = [k for k in self._pending if k[0] == sender]
        if len(mine) >= self.max_pending_per_sender:
            self._drop(mine[0])
            evicted.append(mine[0][1])
            log.warning("dropped partial message %s from %r: more than %d at once", mine[0][1], sender,
                        self.max_pending_per_sender)  # fmt: skip
        p = _Partial(c, {}, 0, self._clock())
        self._pending[key] = p
        return p

    def _make_room(self, sender: str, key: tuple[str, str], size: int, evicted: list[str]) -> None:
        """Room for ``size`` more bytes of ``key``: evict this sender's other partial messages, oldest first, while
        it is over its budget or the total is over its bound; refuse the piece when that is not enough."""
        limit = self._limit(sender)
        mine = [k for k in self._pending if k[0] == sender and k != key]
        held = sum(self._pending[k].held for k in self._pending if k[0] == sender)
        while mine and (held + size > limit or self._pending_bytes + size > self.max_pending_bytes):
            k = mine.pop(0)
            held -= self._pending[k].held
            self._drop(k)
            evicted.append(k[1])
            log.warning("dropped partial message %s from %r to make room for %s", k[1], sender, key[1])
        if held + size > limit:
            self._drop(key)
            raise ChunkError(f"sender {sender!r} would hold {held + size} bytes of partial messages, over its {limit}")
        if self._pending_bytes + size > self.max_pending_bytes:  # held by other senders: refuse, evict nobody else
            raise ChunkError(f"chunk of {key[1]} from {sender!r}: {self._pending_bytes} bytes already pending, no room")

    def _drop(self, key: tuple[str, str]) -> None:
        p = self._pending.pop(key, None)
        if p is not None:
            self._pending_bytes -= p.held

    def _expire(self, now: float) -> None:
        while self._pending:
            key, p = next(iter(self._pending.items()))
            if now - p.started <= self.ttl_s:
                break
            log.warning(
                "dropping partial message %s from %r: %d/%d chunks after %.0f s",
                key[1],
                key[0],
                len(p.pieces),
                p.first.count,
                now - p.started,
            )
            self._drop(key)
