"""Chunked transfer: split, out-of-order reassembly, integrity, limits, expiry and de-duplication."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import numpy as np
import pytest

from edge_client.wire import messages as M
from edge_client.wire import protocol as P
from edge_client.wire.chunking import DEFAULT_CHUNK_SIZE, Reassembler, split

MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _update(n_floats: int, **kw: Any) -> M.Update:
    rng = np.random.default_rng(0)
    args: dict[str, Any] = dict(
        round=1, model_version=1, client_id="pi-01", num_samples=10, local_steps=2, compute_s=0.1, cpu_s=0.1,
        train_loss=0.5, delta=rng.standard_normal(n_floats).astype(np.float32),
    )  # fmt: skip
    args.update(kw)
    return M.Update(**args)


def _frames(n_bytes: int = int(3.5 * MIB), chunk: int = MIB, **kw: Any) -> tuple[M.Update, list[bytes]]:
    msg = _update(n_bytes // 4, **kw)
    return msg, [bytes(f) for f in split(P.encode(msg), chunk)]


def _chunk(frame: bytes) -> M.Chunk:
    c = P.decode(frame)
    assert isinstance(c, M.Chunk)
    return c


def test_small_payload_is_not_split() -> None:
    payload = P.encode(_update(10))
    assert split(payload)[0] is payload and len(split(payload)) == 1
    assert DEFAULT_CHUNK_SIZE == MIB


def test_split_and_shuffled_reassembly() -> None:
    msg, frames = _frames()
    assert len(frames) == 4
    assert all(len(f) <= MIB + 512 for f in frames)
    chunks = [_chunk(f) for f in frames]
    assert {c.of for c in chunks} == {msg.msg_id} and [c.index for c in chunks] == [0, 1, 2, 3]
    assert isinstance(chunks[0].data, memoryview) and len(chunks[-1].data) == chunks[0].size - 3 * MIB
    random.Random(1).shuffle(frames)
    r = Reassembler()
    assert [r.feed("pi-01", f) for f in frames[:3]] == [None] * 3
    assert r.pending() == 1
    out = r.feed("pi-01", frames[3])
    assert isinstance(out, M.Update) and out.msg_id == msg.msg_id and r.pending() == 0
    assert np.array_equal(out.delta, msg.delta) and out.client_id == "pi-01"


def test_split_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        split(b"abc", 0)
    with pytest.raises(P.MalformedMessage):
        split(b"\xc1" * 100, 10)
    with pytest.raises(ValueError, match="already a chunk"):
        split(_frames()[1][0], 1000)


def test_duplicate_chunk_ignored_and_conflicting_chunk_rejected() -> None:
    msg, frames = _frames()
    r = Reassembler()
    assert r.feed("pi-01", frames[0]) is None
    assert r.feed("pi-01", frames[0]) is None  # QoS 1 redelivery
    c = _chunk(frames[0])
    changed = bytearray(c.data)
    changed[5] ^= 0xFF
    forged = P.encode(M.Chunk(c.of, 0, c.count, c.size, c.chunk_size, c.sha256, bytes(changed)))
    with pytest.raises(P.ChunkError, match="different bytes"):
        r.feed("pi-01", forged)
    for f in frames[1:]:
        out = r.feed("pi-01", f)
    assert isinstance(out, M.Update) and np.array_equal(out.delta, msg.delta)


def test_corrupted_byte_fails_digest() -> None:
    _, frames = _frames()
    bad = bytearray(frames[2])
    bad[-100] ^= 0x01
    r = Reassembler()
    for f in [*frames[:2], bytes(bad)]:
        assert r.feed("pi-01", f) is None
    with pytest.raises(P.ChunkError, match="sha256"):
        r.feed("pi-01", frames[3])
    assert r.pending() == 0


def test_missing_chunk_stays_pending_then_expires() -> None:
    clock = Clock()
    _, frames = _frames()
    r = Reassembler(ttl_s=60, clock=clock)
    for f in frames[:-1]:
        assert r.feed("pi-01", f) is None
    clock.t = 59
    _, other = _frames(2 * MIB + 8, client_id="pi-02")
    assert r.feed("pi-02", other[0]) is None
    assert r.pending() == 2
    clock.t = 61  # the first is now older than the ttl; the second is not
    assert r.feed("pi-02", other[1]) is None
    assert r.pending() == 1
    clock.t = 200
    assert r.feed("pi-02", P.encode(M.Stop("x"))).reason == "x"
    assert r.pending() == 0


def test_duplicate_whole_and_reassembled_messages() -> None:
    r = Reassembler()
    payload = P.encode(M.Stop("done"))
    assert isinstance(r.feed("server", payload), M.Stop)
    with pytest.raises(P.DuplicateMessage, match="already delivered"):
        r.feed("server", payload)
    assert isinstance(r.feed("other", payload), M.Stop)  # keyed by sender
    _, frames = _frames()
    for f in frames:
        out = r.feed("pi-01", f)
    assert isinstance(out, M.Update)
    for f in (frames[0], P.encode(out)):  # a broker redelivering chunks or the whole after a crash
        with pytest.raises(P.DuplicateMessage):
            r.feed("pi-01", f)
    assert r.pending() == 0


def test_remembered_ids_are_bounded() -> None:
    r = Reassembler(remember=2)
    first = P.encode(M.Stop("a"))
    r.feed("s", first)
    r.feed("s", P.encode(M.Stop("b")))
    r.feed("s", P.encode(M.Stop("c")))
    assert isinstance(r.feed("s", first), M.Stop)  # forgotten: LRU of 2


def _raw(frame: bytes, data: bytes | None = None, **wire: Any) -> bytes:
    """Edit a valid chunk frame's header fields (wire names) without going through encode's checks."""
    header, off = P.read_header(frame)
    header["f"].update(wire)
    body = bytes(frame[off:]) if data is None else data
    header["a"][0][2] = [len(body)]
    return msgpack.packb(header, use_bin_type=True) + body


@pytest.mark.parametrize(
    ("wire", "data", "words"),
    [
        ({"n": 5}, None, "count expected ceil"),
        ({"i": 4}, None, "index expected"),
        ({"cs": 0}, None, "chunk_size"),
        ({"i": 3}, None, "piece 3 of 4 expected"),  # a full-size piece claimed as the short last one
        ({}, b"x" * 10, "expected 1048576 bytes"),
    ],
)
def test_inconsistent_chunk_frames(wire: dict[str, Any], data: bytes | None, words: str) -> None:
    _, frames = _frames()
    with pytest.raises(P.ChunkError, match=words):
        Reassembler().feed("pi-01", _raw(frames[0], data, **wire))
    c = _chunk(frames[0])
    names = {"n": "count", "i": "index", "cs": "chunk_size"}
    kw = {names[k]: v for k, v in wire.items()}
    with pytest.raises(P.ChunkError, match=words):  # encode refuses to build such a frame too
        P.encode(M.Chunk(**{**vars(c), "data": data or bytes(c.data), **kw}))


def test_chunk_disagreeing_with_first_chunk() -> None:
    _, frames = _frames()
    _, others = _frames(int(3.5 * MIB) + 4)  # same message id below, different total size
    r = Reassembler()
    r.feed("pi-01", frames[0])
    c, o = _chunk(frames[0]), _chunk(others[1])
    forged = P.encode(M.Chunk(c.of, 1, o.count, o.size, o.chunk_size, o.sha256, bytes(o.data)))
    with pytest.raises(P.ChunkError, match="size expected"):
        r.feed("pi-01", forged)
    forged = P.encode(M.Chunk(c.of, 1, c.count, c.size, c.chunk_size, "0" * 64, bytes(_chunk(frames[1]).data)))
    with pytest.raises(P.ChunkError, match="sha256 expected"):
        r.feed("pi-01", forged)


def test_oversized_announced_message() -> None:
    _, frames = _frames()
    with pytest.raises(P.ChunkError, match=f"announces {_chunk(frames[0]).size} bytes, this sender may send {3 * MIB}"):
        Reassembler(max_message_bytes=3 * MIB).feed("pi-01", frames[0])
    whole = P.encode(_update(1000))
    with pytest.raises(P.MessageTooLarge):
        Reassembler(max_message_bytes=1000).feed("pi-01", whole)


def test_pending_limit_per_sender_evicts_oldest() -> None:
    r = Reassembler(max_pending_per_sender=2)
    firsts = [_frames(2 * MIB + 8)[1][0] for _ in range(3)]
    r.feed("pi-01", firsts[0])
    r.feed("pi-01", firsts[1])
    r.feed("pi-02", _frames(2 * MIB + 8)[1][0])
    with pytest.raises(P.ChunkError, match=_chunk(firsts[0]).of):
        r.feed("pi-01", firsts[2])
    assert r.pending() == 3  # pi-01: 2 newest, pi-02 untouched


def test_pending_bytes_limit() -> None:
    """Memory is counted as pieces arrive (1 MiB each here), never for the size a first chunk announces."""
    r = Reassembler(max_pending_bytes=5 * MIB)
    (_, a), (_, b), (_, c) = _frames(), _frames(), _frames()
    for f in [*a[:3], *b[:2]]:  # 5 MiB held: at the bound, nothing dropped
        assert r.feed("pi-01", f) is None
    assert r.pending() == 2
    with pytest.raises(P.ChunkError, match=f"dropped partial messages \\['{_chunk(a[0]).of}'\\]"):
        r.feed("pi-01", b[2])  # its own oldest makes room
    assert r.pending() == 1
    for f in c[:2]:
        assert r.feed("pi-02", f) is None
    with pytest.raises(P.ChunkError, match="no room"):
        r.feed("pi-02", c[2])  # others' partial messages are never evicted for it
    assert r.pending() == 2  # pi-01's b and pi-02's first two pieces
