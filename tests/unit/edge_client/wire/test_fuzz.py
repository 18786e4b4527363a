"""Decoder fuzzing: whatever a peer sends, `decode` and `Reassembler.feed` accept it or raise a specific error.

Every input is either a valid message (a bit flip may land in a float, a string or an int and still give one; then
it must survive a round trip: re-encoding it and decoding that gives the same frame again, with array bytes of the
same length) or raises a :class:`ProtocolError` subclass whose ``reason`` is one of the specific codes — never the
base class's generic "protocol", never a bare ValueError, KeyError, struct.error or msgpack exception. Inputs: valid
frames of every message type truncated at every offset, bit-flipped, with header length fields set huge and header
values of wrong types, random bytes, and chunk frames fed to a Reassembler in hostile orders; updates whose vectors
travel compressed (every codec of edge_client/wire/codecs.py), with their parts corrupted and their counts, indices and
scales made malformed. The deadline turns a pathologically slow input (a hang in the making) into a failure. Run
with ``--hypothesis-show-statistics`` to see how many inputs ended in which reason.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from edge_client.wire import codecs as C
from edge_client.wire import messages as M
from edge_client.wire import protocol as P
from edge_client.wire.chunking import Reassembler, split
from edge_client.wire.messages import RoundFacts
from edge_client.wire.plan import Plan

EXAMPLES = 500  # per test: eight tests, about 4,000 hostile inputs (plus every prefix of eleven frames)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=timedelta(seconds=2),  # a decode takes microseconds; seconds mean something loops or allocates wildly
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SPECIFIC = {c.reason for c in vars(P).values() if isinstance(c, type) and issubclass(c, P.ProtocolError)} - {"protocol"}
SPECIFIC |= set(C.REASONS)  # a compressed vector that does not decode is refused with its codec's reason
HUGE = [2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1]

# ------------------------------------------------------------------------------------------- valid messages
ids = st.text("abz019_.-", max_size=8).map(lambda s: "c" + s)  # CLIENT_ID_RE, cheaper to draw than from_regex
text = st.text(max_size=8)
finite = st.floats(allow_nan=False, allow_infinity=False)
scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | finite | text
json_like = scalars | st.lists(scalars, max_size=3) | st.dictionaries(text, scalars, max_size=3)
maps = st.dictionaries(text, json_like, max_size=3)
# an update's contract values: numbers by name (the free-form maps above lose at encode what they may not carry)
numbers = st.integers(-(2**53), 2**53) | st.floats()
values = st.dictionaries(st.text("abz_", min_size=1, max_size=8), numbers, max_size=3)
nonneg = st.integers(0, 2**31)
vectors = st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=8).map(
    lambda v: np.array(v, dtype=np.float32)
)
extra_arrays = st.dictionaries(st.text(min_size=1, max_size=4), vectors, max_size=2)
digests = st.binary(min_size=32, max_size=32).map(bytes.hex)
run_ids = st.text("abz019_.:-", max_size=12)

hellos = st.builds(M.Hello, ids, nonneg, maps)
assignments = st.builds(
    M.Assignment,
    plan=st.builds(
        Plan,
        steps=st.integers(1, 10**6),
        lr=st.floats(1e-9, 10.0),
        batch_size=st.integers(1, 4096),
        settings=maps,  # the contract's settings and per-round values (TACO's alpha_i among them)
        momentum=st.floats(0.0, 0.99),
        weight_decay=st.floats(0.0, 1.0),
    ),
    facts=st.builds(
        M.RoundFacts,
        round=nonneg,
        model_version=nonneg,
        sha256=digests,
        deadline_s=st.floats(1e-3, 1e6),
        upload=st.booleans(),
        run_id=run_ids,
        algorithm=text,
        model=maps,
        seed=nonneg,
    ),
    arrays=extra_arrays,
    global_arrays=st.lists(st.text(min_size=1, max_size=4), max_size=3, unique=True),
)
updates = st.builds(
    M.Update,
    round=nonneg,
    model_version=nonneg,
    client_id=ids,
    num_samples=nonneg,
    local_steps=nonneg,
    compute_s=st.floats(0.0, 1e6),
    cpu_s=st.floats(0.0, 1e6),
    train_loss=st.floats(),  # NaN is allowed: a diverged client reports it
    delta=vectors,
    metrics=maps,
    extras=values,
    arrays=extra_arrays,
    run_id=run_ids,
)
codec_specs = st.sampled_from(["fp16", "int8", "int8:3", "topk:0.2", "topk:0.5+int8:2"]).map(C.parse)


@st.composite
def compressed_updates(draw: st.DrawFn) -> M.Update:
    """An update whose delta and extra arrays travel compressed, each with its own codec."""
    update = draw(updates)
    spec = draw(codec_specs)
    gen = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    update.delta = C.encode(update.delta, spec, gen)
    update.arrays = {k: C.encode(v, draw(codec_specs), gen) for k, v in update.arrays.items()}
    return update


failures = st.builds(M.Failure, nonneg, ids, st.text("abz_", min_size=1, max_size=8), text, run_ids)
presences = st.builds(M.Presence, ids, st.booleans(), st.sampled_from(["client", "server"]), text)
stops = st.builds(M.Stop, text, run_ids)
reports = st.builds(M.ComputeReport, nonneg, ids, st.integers(1, 2**31), st.floats(0.0, 1e6), st.floats(0.0, 1e6),
                    run_ids)  # fmt: skip
models = st.builds(M.ModelFile, nonneg, digests, maps, st.binary(max_size=64))
global_models = st.builds(M.GlobalModel, nonneg, nonneg, digests, vectors, extra_arrays, run_ids)
model_requests = st.builds(M.ModelRequest, nonneg, ids, digests, run_ids)


@st.composite
def chunks(draw: st.DrawFn) -> M.Chunk:
    """One frame of a chunked Update or round model (split() makes them, so count, size and digest are consistent)."""
    payload = P.encode(draw(updates | global_models))
    frames = split(payload, draw(st.integers(1, max(1, len(payload) - 1))))
    return P.decode(draw(st.sampled_from(frames)))  # type: ignore[return-value]


messages = st.one_of(
    hellos,
    assignments,
    updates,
    compressed_updates(),
    failures,
    presences,
    stops,
    models,
    global_models,
    model_requests,
    reports,
    chunks(),
)
frames = messages.map(lambda m: bytes(P.encode(m)))


# ------------------------------------------------------------------------------------------------ the property
def check(payload: bytes | bytearray) -> M.Message | M.Chunk | None:
    """Decode ``payload``: a valid message survives a round trip, anything else is a specific ProtocolError."""
    try:
        msg = P.decode(payload)
    except P.ProtocolError as exc:
        assert type(exc) is not P.ProtocolError and exc.reason in SPECIFIC, repr(exc)
        assert str(exc), "an error without a message"
        event(f"rejected: {exc.reason}")
        return None
    event(f"accepted: {msg.TYPE}")
    again = P.encode(msg)
    assert bytes(P.encode(P.decode(again))) == bytes(again)  # what was accepted is a message encode stands by
    codecs = getattr(msg, "codecs", {})
    if codecs:  # decoded vectors are float32 now, each the length its header announced
        header = P.read_header(payload)[0]
        assert all(np.isfinite(v).all() for v in [msg.delta, *msg.arrays.values()])  # type: ignore[union-attr]
        assert set(codecs.values()) == {d for _, d, _ in header["a"] if d != M.DTYPE}
        return msg
    # the header may shrink (msgpack float32 -> float64, non-minimal ints) but the raw array bytes are the same
    assert len(again) - P.read_header(again)[1] == len(payload) - P.read_header(payload)[1]
    return msg


def check_rejected(payload: bytes | bytearray, reasons: set[str]) -> None:
    """``payload`` must be refused with one of ``reasons``."""
    with pytest.raises(P.ProtocolError) as info:
        P.decode(payload)
    assert info.value.reason in reasons, repr(info.value)
    event(f"rejected: {info.value.reason}")


def edited(payload: bytes, fn: Callable[[dict[str, Any]], Any]) -> bytes:
    """Re-pack a valid frame's header after ``fn`` edits it, keeping the array bytes (bypasses encode's checks)."""
    header, offset = P.read_header(payload)
    header = copy.deepcopy(header)
    fn(header)
    return msgpack.packb(header, use_bin_type=True) + payload[offset:]


# ---------------------------------------------------------------------------------------------------- inputs
@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes(data: bytes) -> None:
    check(data)


@FUZZ
@given(frames, st.data())
def test_truncated_frames_are_rejected(payload: bytes, data: st.DataObject) -> None:
    """A strict prefix never decodes: the header says how many array bytes follow. Cut anywhere, header or arrays."""
    cut = data.draw(st.integers(0, len(payload) - 1))
    check_rejected(payload[:cut], {"malformed", "shape"})


def test_every_truncation_of_each_message_type() -> None:
    """Exhaustively: every prefix of one frame of each type (the random cuts above sample far more frames)."""
    rng = np.random.default_rng(0)
    vec = rng.standard_normal(8).astype(np.float32)
    examples = [
        M.Hello("pi-01", 600, {"machine": "aarch64"}),
        M.Assignment(
            Plan(5, 0.1, 32, settings={"gamma": 0.5, "alpha_i": 0.5}, momentum=0.5, weight_decay=5e-4),
            RoundFacts(round=1, deadline_s=30.0, algorithm="taco", model={"name": "mlp"}, run_id="r1", sha256="0" * 64),
            arrays={"c": vec},
            global_arrays=["c_global"],
        ),
        M.Update(1, 0, "pi-01", 600, 5, 1.0, 2.0, 0.7, vec, {"t": 1}, {"b": 0.1}, {"dc": vec}, run_id="r1"),
        M.Failure(1, "pi-01", "train_error", "out of memory", run_id="r1"),
        M.ComputeReport(1, "pi-01", 50, 1.25, 1.1, run_id="r1"),
        M.Presence("pi-01", True),
        M.Stop("done"),
        M.ModelFile(3, "0" * 64, {"round": 3}, b"onnx" * 8),
        M.GlobalModel(3, 2, M.model_digest(vec, {"c": vec}), vec, {"c": vec}, run_id="r1"),
        M.ModelRequest(3, "pi-01", "0" * 64, run_id="r1"),
    ]
    payloads = [bytes(P.encode(m)) for m in examples] + [bytes(f) for f in split(P.encode(examples[2]), 40)[:2]]
    assert {P.decode(p).TYPE for p in payloads} == {m.TYPE for m in examples} | {"chunk"}
    cuts = 0
    for payload in payloads:
        for cut in range(len(payload)):
            with pytest.raises((P.MalformedMessage, P.ShapeMismatch)):
                P.decode(payload[:cut])
            cuts += 1
    assert cuts > 1000


@FUZZ
@given(frames, st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 7)), min_size=1, max_size=8))
def test_bit_flips(payload: bytes, flips: list[tuple[int, int]]) -> None:
    buf = bytearray(payload)
    for pos, bit in flips:
        buf[pos % len(buf)] ^= 1 << bit
    check(buf)


def _set_huge(header: dict[str, Any], where: str, value: int) -> None:
    """Put ``value`` into a length-like slot of the header: an array dimension or an integer field."""
    if where == "dim" and header["a"]:
        header["a"][-1][2] = [*header["a"][-1][2], value]  # an extra dimension makes a 1-D vector N-D: fine
        header["a"][-1][2][0] = value
    else:
        ints = [k for k, v in header["f"].items() if isinstance(v, int) and not isinstance(v, bool)] or ["num_samples"]
        header["f"][ints[value % len(ints)]] = value


@FUZZ
@given(frames, st.sampled_from(["dim", "field"]), st.sampled_from(HUGE) | st.integers(2**20, 2**64 - 1))
def test_huge_length_fields_in_the_header(payload: bytes, where: str, value: int) -> None:
    """Shapes, chunk sizes, counts and indices claiming gigabytes: rejected before anything is allocated."""
    check(edited(payload, lambda h: _set_huge(h, where, value)))


@FUZZ
@given(frames, st.sampled_from([b"\xdb", b"\xc6", b"\xdd", b"\xdf"]), st.sampled_from(HUGE[:4]), st.data())
def test_huge_msgpack_length_prefixes(payload: bytes, marker: bytes, length: int, data: st.DataObject) -> None:
    """A str32/bin32/array32/map32 length prefix of up to 4 GiB spliced into the header: the parse is bounded."""
    offset = P.read_header(payload)[1]
    pos = data.draw(st.integers(0, offset))
    prefix = marker + (length & 0xFFFFFFFF).to_bytes(4, "big")
    check_rejected(payload[:pos] + prefix + payload[pos:], SPECIFIC)


def _paths(header: dict[str, Any]) -> list[tuple[Any, Any]]:
    """(container, key) of every value in the header: top level, each field, each array entry and its parts."""
    out: list[tuple[Any, Any]] = [(header, k) for k in header]
    out += [(header["f"], k) for k in header["f"]]
    for entry in header["a"]:
        out += [(entry, i) for i in range(3)]
        out += [(entry[2], i) for i in range(len(entry[2]))]
    return out


@FUZZ
@given(frames, st.data(), json_like | st.binary(max_size=8))
def test_header_values_of_wrong_types(payload: bytes, data: st.DataObject, value: Any) -> None:
    """Any header value replaced by any msgpack value (a string for a shape, a map for a version, bytes for an id)."""

    def replace(header: dict[str, Any]) -> None:
        container, key = data.draw(st.sampled_from(_paths(header)))
        container[key] = value

    check(edited(payload, replace))


@FUZZ
@given(
    updates | global_models,
    st.integers(8, 96),
    st.lists(
        st.tuples(st.sampled_from(["flip", "cut", "repeat", "drop", "swap"]), st.integers(0, 2**16), st.integers(0, 7)),
        max_size=6,
    ),
)
def test_hostile_chunk_streams(
    update: M.Update | M.GlobalModel, chunk_size: int, ops: list[tuple[str, int, int]]
) -> None:
    """Chunk frames flipped, truncated, repeated, dropped and reordered: the Reassembler rejects each bad frame
    specifically and delivers the message at most once, exactly as sent (sha256 over the whole frame)."""
    original = bytes(P.encode(update))
    stream = [bytes(f) for f in split(original, min(chunk_size, len(original) - 1))]
    for op, n, bit in ops:
        i = n % len(stream)
        if op == "flip" and stream[i]:  # a frame cut to nothing has no bit left to flip
            frame = bytearray(stream[i])
            frame[n % len(frame)] ^= 1 << bit
            stream[i] = bytes(frame)
        elif op == "cut" and stream[i]:
            stream[i] = stream[i][: n % len(stream[i])]
        elif op == "repeat":
            stream.insert(n % (len(stream) + 1), stream[i])
        elif op == "drop" and len(stream) > 1:
            del stream[i]
        elif op == "swap":
            j = (n // 7) % len(stream)
            stream[i], stream[j] = stream[j], stream[i]
    receiver = Reassembler(max_message_bytes=1 << 20)
    delivered = []
    for frame in stream:
        try:
            msg = receiver.feed("pi-01", frame)
        except P.ProtocolError as exc:
            assert type(exc) is not P.ProtocolError and exc.reason in SPECIFIC, repr(exc)
            event(f"rejected: {exc.reason}")
            continue
        if msg is not None:
            delivered.append(bytes(P.encode(msg)))
    assert delivered in ([], [original])
    event(f"delivered: {len(delivered)}")


# -------------------------------------------------------------------------------- malformed compressed payloads
D = 40  # entries of the vector below: top-k 0.1 keeps 4, int8 has one block


def compressed(spec: str) -> tuple[bytes, int]:
    """A valid update frame whose delta is ``spec``-coded, and the offset where the delta's parts begin."""
    x = np.linspace(-1.0, 1.0, D, dtype=np.float32)
    delta = C.encode(x, C.parse(spec), np.random.default_rng(0))
    payload = bytes(P.encode(M.Update(1, 0, "pi-01", 10, 1, 0.0, 0.0, 0.0, delta)))
    return payload, P.read_header(payload)[1]


def overwrite(spec: str, at: int, dtype: str, values: list[Any]) -> bytes:
    """``spec``'s frame with the values at byte ``at`` of its parts replaced (the header untouched)."""
    payload, offset = compressed(spec)
    raw = np.array(values, dtype=dtype).tobytes()
    return payload[: offset + at] + raw + payload[offset + at + len(raw) :]


def reshaped(spec: str, wire: str | None = None, shape: list[int] | None = None) -> bytes:
    """``spec``'s frame with the delta's header entry claiming another descriptor or shape."""

    def edit(header: dict[str, Any]) -> None:
        entry = header["a"][0]
        entry[1], entry[2] = wire or entry[1], shape or entry[2]

    return edited(compressed(spec)[0], edit)


F16_INF, F16_NAN = 0x7C00, 0x7E00
MALFORMED = [  # (what, frame, reason): top-k parts are indices (4 x u4) then values; int8 parts are scales, then q
    ("top-k index out of range", overwrite("topk:0.1", 12, "<u4", [D]), "codec_index"),
    ("top-k index far out of range", overwrite("topk:0.1+int8", 0, "<u4", [2**32 - 1]), "codec_index"),
    ("top-k indices repeated", overwrite("topk:0.1", 0, "<u4", [5, 5]), "codec_index"),
    ("top-k indices descending", overwrite("topk:0.1", 0, "<u4", [30, 20, 10, 0]), "codec_index"),
    ("more top-k entries than the vector has", reshaped("topk:0.1", wire=f"topk:{D + 1}"), "codec_count"),
    ("no top-k entries", reshaped("topk:0.1", wire="topk:0"), "codec_count"),
    ("an int8 block of no entries", reshaped("int8", wire="int8:0"), "codec_count"),
    ("a block size beyond the limit", reshaped("int8", wire="int8:9999999"), "codec_count"),
    ("int8 scale NaN", overwrite("int8", 0, "<f4", [np.nan]), "codec_scale"),
    ("int8 scale Inf", overwrite("int8", 0, "<f4", [np.inf]), "codec_scale"),
    ("int8 scale negative", overwrite("int8", 0, "<f4", [-1.0]), "codec_scale"),
    ("int8 scale too large for a finite value", overwrite("int8", 0, "<f4", [3e37]), "codec_scale"),
    ("top-k int8 scale NaN", overwrite("topk:0.1+int8", 16, "<f4", [np.nan]), "codec_scale"),
    ("float16 Inf", overwrite("fp16", 6, "<u2", [F16_INF]), "non_finite"),
    ("float16 NaN", overwrite("fp16", 0, "<u2", [F16_NAN]), "non_finite"),
    ("top-k value NaN", overwrite("topk:0.1", 16, "<f4", [np.nan]), "non_finite"),
    ("a count the bytes do not match", reshaped("topk:0.1", wire="topk:3"), "shape"),
    ("int8 claiming more entries than bytes", reshaped("int8", shape=[D + 8]), "shape"),
    ("a few entries claiming 2^40", reshaped("topk:0.1", shape=[2**40]), "too_large"),
    ("a compressed array of two dimensions", reshaped("int8", shape=[4, 10]), "shape"),
    ("an unknown codec", reshaped("int8", wire="int9:256"), "invalid_field"),
]


@pytest.mark.parametrize("what, frame, reason", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_compressed_payloads_are_refused_with_their_own_reasons(what: str, frame: bytes, reason: str) -> None:
    assert P.decode(compressed("topk:0.1+int8")[0])  # the frames they are made from are valid
    with pytest.raises(P.ProtocolError) as info:
        P.decode(frame)
    assert info.value.reason == reason, repr(info.value)


def test_every_codec_reason_is_exercised() -> None:
    assert {reason for *_, reason in MALFORMED} >= set(C.REASONS) - {"codec_payload"}


@FUZZ
@given(st.sampled_from(["fp16", "int8", "topk:0.1", "topk:0.1+int8"]), st.data())
def test_corrupted_compressed_parts(spec: str, data: st.DataObject) -> None:
    """Bytes of the compressed parts overwritten at random: decoded as some vector, or refused specifically."""
    payload, offset = compressed(spec)
    body = bytearray(payload[offset:])
    for _ in range(data.draw(st.integers(1, 6))):
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    check(payload[:offset] + bytes(body))
