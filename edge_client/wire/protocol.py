"""Wire protocol framing: encode/decode, strict validation and its errors (the messages are edge_client.wire.messages).

A frame is a msgpack header map followed by the raw little-endian float32 bytes of its arrays, so encoding is one buffer
fill and decoding is zero-copy (``np.frombuffer`` views into the payload). A vector may instead travel compressed
(``edge_client.wire.codecs``: an update's arrays, a round model's difference): its entry's dtype slot then holds the
codec's wire descriptor and its raw parts follow in its place; decoding reads the parts zero-copy and writes one float32
vector. Everything a peer sends is untrusted: decode bounds the header parse and checks version, type, every field (as
its message declares it) and every array before any message object exists, and raises a specific :class:`ProtocolError`
subclass whose ``reason`` feeds metrics. Entries of a device's free-form maps outside their declaration are dropped
instead, and listed on the message (:func:`dropped_entries`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import msgpack
import numpy as np

from edge_client.wire import codecs
from edge_client.wire.messages import DTYPE, MSG_ID, SCHEMAS, Chunk, Message
from edge_client.wire.schema import FreeMap, Record, Schema, is_int, short

log = logging.getLogger(__name__)

# 2: assignments carry settings (the contract's), momentum, weight decay and the run id; 3: updates carry overhead_s,
# TACO's global_delta is w_{t-1} - w_t unscaled (the accumulated correction), device maps are declared and bounded;
# 4: an assignment is the strategy's plan and the round's facts, two maps of their own declared fields, and TACO's
# alpha_i is a per-round value of its contract (plan.settings) instead of a field of its own; assignments carry secure
# aggregation's terms, and its stages' seven message types (edge_client.secagg)
PROTOCOL_VERSION = 4
MAX_HEADER_BYTES = 65536
_U8 = "|u1"  # chunk payload bytes


class ProtocolError(ValueError):
    """A frame that must be rejected; ``reason`` is a short code for metrics counters."""

    reason: str = "protocol"
    #: what the refused frame said it was, once its header had been read (``decode``): a refused update still tells
    #: the server that its sender's one update of that round will not come
    of_type: str | None = None
    of_round: int | None = None


class MalformedMessage(ProtocolError):
    reason = "malformed"


class UnsupportedVersion(ProtocolError):
    reason = "version"


class UnknownMessageType(ProtocolError):
    reason = "type"


class MissingField(ProtocolError):
    reason = "missing_field"


class InvalidField(ProtocolError):
    reason = "invalid_field"


class ShapeMismatch(ProtocolError):
    reason = "shape"


class NonFiniteValues(ProtocolError):
    reason = "non_finite"


class MessageTooLarge(ProtocolError):
    reason = "too_large"


class ChunkError(ProtocolError):
    reason = "chunk"


class OutOfRound(ProtocolError):
    reason = "out_of_round"


class DuplicateMessage(ProtocolError):
    reason = "duplicate"

    def __init__(self, text: str, msg_id: str = "") -> None:
        super().__init__(text)
        #: the repeated message's id when the repeat stands for the whole message (a whole frame, or a chunked
        #: message's first chunk): the server answers a repeat as it answered the first (server/delivery.py)
        self.msg_id = msg_id


class CompressedPayloadError(ProtocolError):
    """A compressed vector that does not decode; its ``reason`` is the codec's own (``codecs.REASONS``)."""

    reason = "codec_payload"

    def __init__(self, where: str, exc: codecs.CodecError) -> None:
        super().__init__(f"{where}: {exc}")
        self.reason = exc.reason


def _check_fields(
    schema: Schema, f: dict[str, Any], dropped: list[tuple[str, str]] | None, t: str = "", path: str = ""
) -> None:
    """Check header fields ``f`` against ``schema`` (of message type ``t``; ``path`` the record ``f`` is in, as
    ``"plan."``); a free-form map that drops entries is replaced in ``f`` by the entries that hold, and each dropped
    one is appended to ``dropped`` as ``(reason, text)``."""
    t = t or schema.cls.TYPE  # type: ignore[attr-defined]
    spec = schema.fields
    for key in f:
        if key not in spec:
            name = path + key if isinstance(key, str) else key
            raise InvalidField(f"{t}: unknown field {short(name)} (expected one of {sorted(spec)})")
    for key, (_, wire) in spec.items():
        if key not in f:
            if key in schema.required:
                raise MissingField(f"{t}: missing field {path + key!r}")
            continue
        check, value = wire.check, f[key]
        if not check.ok(value):
            raise InvalidField(f"{t}: field {path + key!r} expected {check.expected}, got {short(value)}")
        if isinstance(check, Record):
            _check_fields(check.schema, value, dropped, t, f"{path}{key}.")
        elif isinstance(check, FreeMap):
            f[key], problems = check.clean(key, value)
            if problems and not check.drop:
                raise InvalidField(f"{t}: field {problems[0][1]}")
            if dropped is not None:
                dropped += [(f"dropped_{why}", f"{t}: {what}") for why, what in problems]


def _header_fields(schema: Schema, obj: Any) -> dict[str, Any]:
    """``obj``'s declared fields by wire key, a record's as a map of its own."""
    return {
        key: _header_fields(wire.check.schema, getattr(obj, attr)) if isinstance(wire.check, Record)
        else _coerce(getattr(obj, attr))
        for key, (attr, wire) in schema.fields.items()
    }  # fmt: skip


def _attributes(schema: Schema, f: dict[str, Any]) -> dict[str, Any]:
    """Checked header fields ``f`` as the keyword arguments of ``schema``'s class, a record built as its own."""
    return {
        attr: wire.check.schema.cls(**_attributes(wire.check.schema, f[key])) if isinstance(wire.check, Record)
        else f[key]
        for key, (attr, wire) in schema.fields.items()
        if key in f
    }  # fmt: skip


class DroppedEntry(ProtocolError):
    """An entry of a device's free-form map that decoding dropped (``reason`` ``dropped_<why>``); the message that
    carried it went on without it."""

    reason = "dropped"

    def __init__(self, reason: str, text: str) -> None:
        super().__init__(text)
        self.reason = reason


def dropped_entries(msg: Message | Chunk) -> list[DroppedEntry]:
    """What decoding dropped from ``msg``'s free-form maps, to be logged and counted by reason."""
    return [DroppedEntry(reason, text) for reason, text in getattr(msg, "dropped", ())]


def _check_chunk(f: dict[str, Any], nbytes: int) -> None:
    """Self-consistency of one chunk frame (the reassembler also checks it against its siblings)."""
    i, n, size, cs = f["i"], f["n"], f["size"], f["cs"]
    if cs <= 0 or size <= 0:
        raise ChunkError(f"chunk: chunk_size and size must be > 0, got chunk_size={cs} size={size}")
    if n != -(-size // cs):
        raise ChunkError(f"chunk: count expected ceil({size}/{cs}) = {-(-size // cs)}, got {n}")
    if not 0 <= i < n:
        raise ChunkError(f"chunk: index expected 0 <= index < {n}, got {i}")
    want = cs if i < n - 1 else size - (n - 1) * cs
    if nbytes != want:
        raise ChunkError(f"chunk: piece {i} of {n} expected {want} bytes, got {nbytes}")


# ---------------------------------------------------------------------------------------------------------- encode
def _np_scalar(o: Any) -> Any:
    """msgpack `default`: numpy scalars (np.float32, np.int64, ...) in metrics dicts become Python scalars."""
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"cannot serialise {type(o).__name__}")


def _coerce(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else v


def _as_f4(t: str, name: str, arr: Any, vector: bool) -> np.ndarray:
    if not isinstance(arr, np.ndarray) or arr.dtype.kind != "f":
        got = arr.dtype if isinstance(arr, np.ndarray) else type(arr).__name__
        raise InvalidField(f"{t}: array {name!r} expected a float numpy array, got {got}")
    if vector and arr.ndim != 1:
        raise InvalidField(f"{t}: array {name!r} expected 1-D, got shape {arr.shape}")
    return np.ascontiguousarray(arr, DTYPE)  # no copy when already contiguous little-endian float32


def encode(msg: Message | Chunk) -> bytes | bytearray:
    """Serialise ``msg`` into one frame.

    Returns a ``bytearray`` (paho publishes it as is) built at its final size: header, then each array copied once
    from a byte memoryview. Fields are validated like on decode, so a bad message fails at the sender; array
    finiteness is left to the receiver (it must check anyway).
    """
    t = getattr(msg, "TYPE", None)
    schema = SCHEMAS.get(t) if isinstance(t, str) else None
    if schema is None or not isinstance(msg, schema.cls):
        raise UnknownMessageType(f"encode: expected one of {sorted(SCHEMAS)}, got {type(msg).__name__}")
    f = _header_fields(schema, msg)
    dropped: list[tuple[str, str]] = []
    _check_fields(schema, f, dropped)
    for reason, text in dropped:  # the sender's own bug (a sensor's NaN): the message goes without the entry
        log.warning("not sending %s (%s)", text, reason)
    if not MSG_ID.ok(msg.msg_id):
        raise InvalidField(f"{t}: msg_id expected {MSG_ID.expected}, got {short(msg.msg_id)}")
    blobs: list[tuple[str, str, list[int], list[memoryview]]] = []
    if schema.blob:
        data = memoryview(msg.data).cast("B")  # type: ignore[union-attr]
        if t == "chunk":
            _check_chunk(f, data.nbytes)
        blobs.append(("data", _U8, [data.nbytes], [data]))
    elif schema.carries_arrays:
        vector = schema.vector
        named = [(vector, getattr(msg, vector), True)] if vector is not None else []
        extra = msg.arrays if schema.named else {}  # type: ignore[union-attr]
        if not isinstance(extra, dict) or not all(isinstance(k, str) and k for k in extra):
            raise InvalidField(f"{t}: field 'arrays' expected a map with non-empty str keys, got {short(extra)}")
        named += [(f"x:{k}", v, False) for k, v in extra.items()]
        for name, arr, is_vector in named:
            if isinstance(arr, codecs.Encoded):  # its parts, raw, in wire order
                blobs.append((name, arr.wire, [arr.size], [memoryview(p).cast("B") for p in arr.parts]))
                continue
            a = _as_f4(t, name, arr, is_vector)
            blobs.append((name, DTYPE, list(a.shape), [memoryview(a.reshape(-1)).cast("B")]))
    header = {"v": PROTOCOL_VERSION, "t": t, "id": msg.msg_id, "f": f, "a": [[n, d, s] for n, d, s, _ in blobs]}
    try:
        head = msgpack.packb(header, use_bin_type=True, default=_np_scalar)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidField(f"{t}: a field cannot be serialised: {e}") from e
    if len(head) > MAX_HEADER_BYTES:
        raise MessageTooLarge(f"{t}: header expected <= {MAX_HEADER_BYTES} bytes, got {len(head)}")
    # join sizes the result once and copies each part once; unlike bytearray(n) it does not zero-fill first (1.6x).
    return bytearray().join([head, *(part for *_, parts in blobs for part in parts)])


# ---------------------------------------------------------------------------------------------------------- decode
_UNPACK_ERRORS = (ValueError, TypeError, msgpack.UnpackException, RecursionError, OverflowError)


def _parse(payload: bytes | bytearray | memoryview) -> tuple[Any, int]:
    view = memoryview(payload).cast("B")[:MAX_HEADER_BYTES]  # zero-copy; the header must fit in this prefix
    u = msgpack.Unpacker(
        max_buffer_size=MAX_HEADER_BYTES,
        raw=False,
        strict_map_key=True,
        max_str_len=MAX_HEADER_BYTES,
        max_bin_len=MAX_HEADER_BYTES,
        max_array_len=MAX_HEADER_BYTES,
        max_map_len=MAX_HEADER_BYTES // 2,
        max_ext_len=0,  # no ext types (timestamps, custom objects) anywhere
    )
    try:
        u.feed(view)
        header = u.unpack()
    except msgpack.OutOfData:
        if view.nbytes >= MAX_HEADER_BYTES:
            raise MalformedMessage(f"header: expected <= {MAX_HEADER_BYTES} bytes of msgpack, got more") from None
        raise MalformedMessage(f"header: truncated msgpack ({view.nbytes} bytes)") from None
    except _UNPACK_ERRORS as e:
        raise MalformedMessage(f"header: not valid msgpack ({type(e).__name__}: {short(str(e))})") from None
    return header, u.tell()


def read_header(
    payload: bytes | bytearray | memoryview, dropped: list[tuple[str, str]] | None = None
) -> tuple[dict[str, Any], int]:
    """Parse and fully validate a frame's header; return it and the offset where the raw array bytes begin.

    Everything but array finiteness is checked, including that the arrays account for exactly the remaining bytes.
    The free-form maps in the returned header hold only the entries that hold; ``dropped`` gets the others.
    """
    header, offset = _parse(payload)
    size = memoryview(payload).nbytes
    if not isinstance(header, dict):
        raise MalformedMessage(f"header: expected a map, got {type(header).__name__}")
    extra = set(header) - {"v", "t", "id", "f", "a"}
    if extra:
        raise MalformedMessage(f"header: unknown keys {sorted(map(str, extra))}")
    if "v" not in header:
        raise MalformedMessage("header: missing key 'v' (protocol version)")
    if header["v"] != PROTOCOL_VERSION or not is_int(header["v"]):
        raise UnsupportedVersion(f"header: version expected {PROTOCOL_VERSION}, got {short(header['v'])}")
    t = header.get("t")
    schema = SCHEMAS.get(t) if isinstance(t, str) else None
    if schema is None:
        raise UnknownMessageType(f"header: type expected one of {sorted(SCHEMAS)}, got {short(t)}")
    for key in ("id", "f"):
        if key not in header:
            raise MalformedMessage(f"{t}: header missing key {key!r}")
    if not MSG_ID.ok(header["id"]):
        raise InvalidField(f"{t}: id expected {MSG_ID.expected}, got {short(header['id'])}")
    f = header["f"]
    if not isinstance(f, dict):
        raise MalformedMessage(f"{t}: header 'f' expected a map, got {type(f).__name__}")
    _check_fields(schema, f, dropped)
    arrays = header.setdefault("a", [])
    if not isinstance(arrays, list):
        raise MalformedMessage(f"{t}: header 'a' expected a list, got {type(arrays).__name__}")
    total, seen = 0, set()
    vector = schema.vector
    for entry in arrays:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
            raise MalformedMessage(f"{t}: array entry expected [name, dtype, shape], got {short(entry)}")
        name, dtype, shape = entry
        is_named = schema.named and name[:2] == "x:"
        allowed = name == "data" if schema.blob else name == vector or is_named
        if not allowed or name in seen or name == "x:":
            raise InvalidField(f"{t}: unexpected or repeated array {short(name)}")
        seen.add(name)
        want = _U8 if schema.blob else DTYPE
        may_compress = schema.vector_compressed if name == vector else is_named and schema.named_compressed
        compressed = may_compress and codecs.is_wire(dtype)
        if dtype != want and not compressed:
            raise InvalidField(f"{t}: array {name!r} dtype expected {want!r} or a codec, got {short(dtype)}")
        if not (isinstance(shape, list) and len(shape) <= 32 and all(is_int(s) and s >= 0 for s in shape)):
            raise ShapeMismatch(f"{t}: array {name!r} shape expected <= 32 ints >= 0, got {short(shape)}")
        if (name in (vector, "data") or compressed) and len(shape) != 1:
            raise ShapeMismatch(f"{t}: array {name!r} expected 1-D, got shape {shape}")
        if compressed:
            try:
                nbytes = bound = codecs.layout(dtype, shape[0]).nbytes
            except codecs.CodecError as exc:
                raise CompressedPayloadError(f"{t}: array {name!r}", exc) from None
        else:
            itemsize = 1 if schema.blob else 4
            nbytes = math.prod(shape) * itemsize
            # zeros count as 1: an empty array with a huge other dimension would make numpy's reshape fail in decode
            bound = math.prod(max(s, 1) for s in shape) * itemsize
        if bound > size:
            raise ShapeMismatch(f"{t}: array {name!r} shape {short(shape)} is larger than the {size}-byte frame")
        total += nbytes
    need = vector or ("data" if schema.blob else None)
    if need is not None and need not in seen:
        raise MissingField(f"{t}: missing field {need!r}")
    if offset + total != size:
        raise ShapeMismatch(f"{t}: arrays {sorted(seen)} expected {total} bytes after the header, got {size - offset}")
    if t == "chunk":
        _check_chunk(f, total)
    return header, offset


def decode(payload: bytes | bytearray | memoryview, *, max_bytes: int = 256 * 2**20) -> Message | Chunk:
    """Validate and decode one frame. Arrays (and chunk data) are views into ``payload``: no copy."""
    n = memoryview(payload).nbytes
    if n > max_bytes:
        raise MessageTooLarge(f"payload: expected <= {max_bytes} bytes, got {n}")
    if not isinstance(payload, (bytes, bytearray)):
        payload = memoryview(payload).cast("B")
    dropped: list[tuple[str, str]] = []
    header, pos = read_header(payload, dropped)
    t, f = header["t"], header["f"]
    try:
        schema = SCHEMAS[t]
        kwargs = _attributes(schema, f)
        kwargs["msg_id"] = header["id"]
        if dropped:  # only a type whose maps drop entries has any (schema_of makes sure it has the field)
            kwargs["dropped"] = dropped
        compressed = {name: dtype for name, dtype, _ in header["a"] if not schema.blob and dtype != DTYPE}
        expanded = sum(4 * shape[0] for name, _, shape in header["a"] if name in compressed)
        if expanded > max_bytes:  # a few top-k entries may claim a vector of any length: bound what decoding allocates
            raise MessageTooLarge(f"{t}: compressed arrays expand to {expanded} bytes, expected <= {max_bytes}")
        extra: dict[str, np.ndarray] = {}
        for name, dtype, shape in header["a"]:
            if schema.blob:
                count = math.prod(shape)
                kwargs["data"] = memoryview(payload)[pos : pos + count]
                pos += count
                continue
            if name in compressed:
                try:
                    arr = codecs.decode_wire(dtype, shape[0], payload, pos)  # finite by construction, or refused
                except codecs.CodecError as exc:
                    raise CompressedPayloadError(f"{t}: array {name!r}", exc) from None
                pos += codecs.layout(dtype, shape[0]).nbytes
            else:
                count = math.prod(shape)
                arr = np.frombuffer(payload, DTYPE, count, pos).reshape(shape)
                pos += 4 * count
                if not math.isfinite(float(arr.sum(dtype=np.float64))):  # float64 cannot overflow here: NaN/Inf only
                    bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
                    raise NonFiniteValues(f"{t}: array {name!r} has {bad} non-finite values (NaN/Inf) of {arr.size}")
            if name[:2] == "x:":
                extra[name[2:]] = arr
            else:
                kwargs[name] = arr
        if schema.named:
            kwargs["arrays"] = extra
        if schema.vector_compressed and schema.named_compressed:  # an update: which codec each array came in
            kwargs["codecs"] = {name.removeprefix("x:"): dtype for name, dtype in compressed.items()}
        return schema.cls(**kwargs)  # type: ignore[no-any-return]
    except ProtocolError as exc:  # the header was valid: say what the frame claimed to be
        exc.of_type, exc.of_round = t, f.get("round") if is_int(f.get("round")) else None
        raise
