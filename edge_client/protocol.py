"""Wire protocol: typed messages, encode/decode and strict validation.

A frame is a msgpack header map followed by the raw little-endian float32 bytes of its arrays, so encoding is one buffer
fill and decoding is zero-copy (``np.frombuffer`` views into the payload). A vector may instead travel compressed
(``edge_client.codecs``: an update's arrays, a round model's difference): its entry's dtype slot then holds the codec's
wire descriptor and its raw parts follow in its place; decoding reads the parts zero-copy and writes one float32 vector.
Everything a peer sends is untrusted: decode bounds the header parse and checks version, type, every field and every
array before any message object exists, and raises a specific :class:`ProtocolError` subclass whose ``reason`` feeds
metrics.
"""

from __future__ import annotations

import hashlib
import math
import re
import uuid
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

import msgpack
import numpy as np

from edge_client import codecs
from edge_client.topics import CLIENT_ID_RE

PROTOCOL_VERSION = 2  # 2: assignments carry settings (the contract's), momentum, weight decay and the run id
DTYPE = "<f4"  # the only array dtype on the wire
MAX_HEADER_BYTES = 65536
_U8 = "|u1"  # chunk payload bytes
_MSG_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_RUN_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{0,64}")
_REASON_RE = re.compile(r"[a-z_]{1,32}")
_FINGERPRINT_RE = re.compile(r"(|[0-9a-f]{64})")
_ACK_REASON_RE = re.compile(r"[a-z_]{0,32}")  # empty when accepted


class ProtocolError(ValueError):
    """A frame that must be rejected; ``reason`` is a short code for metrics counters."""

    reason: str = "protocol"


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


def new_msg_id() -> str:
    """Random 32-hex-char id; receivers de-duplicate on it (brokers redeliver after a crash)."""
    return uuid.uuid4().hex


@dataclass
class Hello:
    client_id: str
    num_samples: int
    device: dict[str, Any] = field(default_factory=dict)
    # The device's own model for the server's spec, {"digest": fingerprint, "layout": [[name, shape, dtype], ...]}
    # (checked at registration), and the size of the split it holds out for federated evaluation.
    model: dict[str, Any] = field(default_factory=dict)
    eval_samples: int = 0
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "hello"


@dataclass
class Assignment:
    """Server -> one client: everything that client needs for this round.

    A strategy fills what the algorithm decides (steps tau, learning rate, TACO's alpha_i, the contract's settings
    and arrays, a model to start from other than the global one); the orchestrator fills the round's facts.
    On the wire an assignment carries no model: ``weights`` and the arrays every client of the round shares travel
    once per round in the :class:`GlobalModel` named by ``model_sha256``; ``arrays`` holds only this client's own,
    and ``global_arrays`` names the shared ones this client uses. The device puts them back before training.
    """

    local_steps: int
    lr: float
    batch_size: int
    alpha: float | None = None  # TACO's alpha_i, in every algorithm that uses it (its contract says so)
    settings: dict[str, Any] = field(default_factory=dict)  # the contract's device settings and per-round values
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    weights: np.ndarray | None = None  # not on the wire: the GlobalModel's weights (or the strategy's own start model)
    momentum: float = 0.0
    weight_decay: float = 0.0
    round: int = 0
    model_version: int = 0
    deadline_s: float = 0.0
    algorithm: str = ""
    model: dict[str, Any] = field(default_factory=dict)
    upload: bool = True
    seed: int = 0
    run_id: str = ""
    model_sha256: str = ""  # the GlobalModel this round starts from (model_digest of its weights and arrays)
    global_arrays: list[str] = field(default_factory=list)  # the GlobalModel's arrays this client uses
    codec: str = "fp32"  # the codec this device uploads with (edge_client.codecs)
    task: dict[str, Any] = field(default_factory=dict)  # the run's [task] spec (edge_client.tasks.build_task)
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "assignment"


@dataclass
class Update:
    """Client -> server; ``delta = w_start - w_end`` (descent-positive)."""

    round: int
    model_version: int
    client_id: str
    num_samples: int
    local_steps: int
    compute_s: float
    cpu_s: float
    train_loss: float
    delta: np.ndarray
    metrics: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)  # the values the algorithm's contract returns
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    overhead_s: float = 0.0  # of compute_s, the per-round work outside the local steps (FedVeca's gradient pass)
    run_id: str = ""
    codecs: dict[str, str] = field(default_factory=dict, compare=False)  # decode: wire codec of compressed arrays
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "update"


@dataclass
class Failure:
    """Client -> server: this device could not serve its assignment (``reason`` a short code, ``detail`` the error).

    The server logs and counts it and stops waiting for that client this round; the device keeps serving.
    """

    round: int
    client_id: str
    reason: str
    detail: str = ""
    run_id: str = ""
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "failure"


@dataclass
class Presence:
    client_id: str
    online: bool
    role: str = "client"
    reason: str = ""
    # The server's: the run's model spec and its fingerprint, so a device can say at registration what its model is.
    model: dict[str, Any] = field(default_factory=dict)
    fingerprint: str = ""
    run_id: str = ""  # the server's: the run it serves (a device learns the current run from it)
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "presence"


@dataclass
class Stop:
    reason: str
    run_id: str = ""
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "stop"


# -- acknowledgements and resync (issue 12) -------------------------------------------------------------------------
@dataclass
class Ack:
    """Server -> one client: what became of one message it sent (hello, update, failure, resync), by message id.

    ``accepted`` False carries the refusal's reason code (the one counted in the metrics) and its text. A repeated
    message is answered again with the same verdict and never processed twice, so a device re-sends an update until
    it has an ack. Every ack names the server's run: how a device learns it without a retained presence.
    """

    of: str
    accepted: bool
    round: int = 0
    reason: str = ""
    detail: str = ""
    run_id: str = ""
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "ack"


@dataclass
class Resync:
    """Client -> server: this device may have lost its assignment (its process started, or it connected without its
    broker session); the server sends the round's assignment again if the device has one and has not answered it,
    unless it went out after ``since`` (the hello that opened the device's current connection: what the server sent
    after it reached the device anyway) or is ``run_id``'s round ``round`` (the newest the device served).
    """

    client_id: str
    since: str = ""
    round: int = 0
    run_id: str = ""
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "resync"


@dataclass
class Chunk:
    """One frame of a message larger than the chunk size; ``data`` is a zero-copy view when decoded."""

    of: str
    index: int
    count: int
    size: int
    chunk_size: int
    sha256: str
    data: memoryview | bytes
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "chunk"


@dataclass
class ModelFile:
    """The exported ONNX model (retained on the job's model topic) that devices fetch for inference."""

    round: int
    sha256: str
    meta: dict[str, Any]  # the export's sidecar: model spec, input shape, classes, round
    data: memoryview | bytes
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "model"


# ---- one model per round (issue 16): the round's model once for every device, and a device's request for it ----
@dataclass
class GlobalModel:
    """Server -> every device, once per model version: the weights a round starts from and the arrays every client
    of the round shares (contract arrays of scope "global"), named by ``sha256 = model_digest(weights, arrays)``.

    Published on the job's round-model topics (retained where the broker keeps it); a device that missed it asks with
    :class:`ModelRequest` and gets it on its own ``down`` topic.

    With ``train.downlink_codec = "int8"`` the broadcast carries, when ``diff_base`` names the previous model, the
    int8-coded difference from it as ``weights`` (decoded on receipt): a device holding that model adds it and checks
    the result against ``sha256``; one that cannot asks, and is sent the full model.
    """

    round: int
    model_version: int
    sha256: str
    weights: np.ndarray
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    run_id: str = ""
    diff_base: str = ""  # sha256 of the model ``weights`` is the difference from; "" when ``weights`` is the model
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "global_model"


@dataclass
class ModelRequest:
    """Device -> server: the model ``sha256`` its assignment of ``round`` names did not arrive; send it to me."""

    round: int
    client_id: str
    sha256: str
    run_id: str = ""
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "model_request"


def model_digest(weights: np.ndarray, arrays: dict[str, np.ndarray]) -> str:
    """sha256 of a model's float32 bytes and its named arrays (sorted by name): what assignments name it by."""
    h = hashlib.sha256(np.ascontiguousarray(weights, DTYPE).data)
    for name in sorted(arrays):
        h.update(name.encode() + b"\0")
        h.update(np.ascontiguousarray(arrays[name], DTYPE).data)
    return h.hexdigest()


@dataclass
class ComputeReport:
    """Client -> server: it trained ``local_steps`` steps for ``round`` without uploading (FedUmf's unselected
    clients), so the fleet's compute counts them; its wall and CPU seconds as ``Update`` reports them."""

    round: int
    client_id: str
    local_steps: int
    compute_s: float
    cpu_s: float
    run_id: str = ""
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "compute"


@dataclass
class Evaluate:
    """Server -> one client: evaluate these weights (the global model after ``round``) on your held-out split."""

    round: int
    model_version: int
    weights: np.ndarray
    model: dict[str, Any] = field(default_factory=dict)
    task: dict[str, Any] = field(default_factory=dict)
    deadline_s: float = 0.0
    run_id: str = ""
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "evaluate"


@dataclass
class Evaluation:
    """Client -> server: the task's loss and metrics on ``num_samples`` held-out samples, and the device's evaluation
    time (wall ``eval_s`` and process CPU ``cpu_s``, device clocks), apart from training compute."""

    round: int
    client_id: str
    num_samples: int
    loss: float
    metrics: dict[str, Any] = field(default_factory=dict)
    eval_s: float = 0.0
    cpu_s: float = 0.0
    run_id: str = ""
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "evaluation"


@dataclass
class Refusal:
    """Server -> one client: it is not registered (``reason`` a short code, ``detail`` why: e.g. which model parameter
    differs from the server's). The device stops and says so."""

    client_id: str
    reason: str
    detail: str = ""
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "refusal"


Message = (
    Hello
    | Assignment
    | Update
    | Failure
    | Presence
    | Stop
    | ModelFile
    | GlobalModel
    | ModelRequest
    | Evaluate
    | Evaluation
    | Refusal
    | Ack
    | Resync
    | ComputeReport
)


# ---------------------------------------------------------------------------------------------------------- checks
# A check returns None when the value is acceptable, else a text "expected ..." for the error message.
Check = Callable[[Any], str | None]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # bool is an int subclass: never accept it as a number


def _int(lo: int | None = None) -> Check:
    def check(v: Any) -> str | None:
        if not _is_int(v) or (lo is not None and v < lo):
            return "an int" + ("" if lo is None else f" >= {lo}")
        return None

    return check


def _float(lo: float | None = None, *, positive: bool = False, finite: bool = True, optional: bool = False) -> Check:
    def check(v: Any) -> str | None:
        expected = "a" + (" finite" if finite else "") + " float" + (" > 0" if positive else "")
        expected += f" >= {lo}" if lo is not None else ""
        expected += " or None" if optional else ""
        if v is None and optional:
            return None
        if not (_is_int(v) or isinstance(v, float)):
            return expected
        if (
            (finite and isinstance(v, float) and not math.isfinite(v))
            or (positive and not v > 0)
            or (lo is not None and not v >= lo)
        ):
            return expected
        return None

    return check


def _str(pattern: re.Pattern[str] | None = None, choices: tuple[str, ...] | None = None) -> Check:
    def check(v: Any) -> str | None:
        ok = isinstance(v, str) and (pattern is None or pattern.fullmatch(v) is not None)
        ok = ok and (choices is None or v in choices)
        if ok:
            return None
        return "a str" + (f" matching {pattern.pattern}" if pattern else "") + (f" in {choices}" if choices else "")

    return check


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else "a bool"


def _dict(v: Any) -> str | None:
    return None if isinstance(v, dict) and all(isinstance(k, str) for k in v) else "a map with str keys"


def _names(v: Any) -> str | None:
    ok = isinstance(v, list) and len(v) <= 32 and all(isinstance(n, str) and 0 < len(n) <= 64 for n in v)
    return None if ok and len(set(v)) == len(v) else "a list of at most 32 distinct names of 1-64 characters"


def _codec(v: Any) -> str | None:
    try:
        codecs.parse(v)
    except ValueError:
        return f"a codec: {codecs.SPEC_HELP}"
    return None


def _text(limit: int) -> Check:
    def check(v: Any) -> str | None:
        return None if isinstance(v, str) and len(v) <= limit else f"a str of at most {limit} characters"

    return check


_NONNEG = _int(0)
_CID = _str(CLIENT_ID_RE)
_TEXT = _str()
_INT = _int()
_RUN = _str(_RUN_ID_RE)
_SHA256 = _str(_SHA256_RE)
_SHA_OR_EMPTY = _str(re.compile(r"(?:[0-9a-f]{64})?"))

# Wire field name -> (attribute name, check). Chunk uses the short names of docs/architecture.md.
_SPECS: dict[str, dict[str, tuple[str, Check]]] = {
    "hello": {
        "client_id": ("client_id", _CID),
        "num_samples": ("num_samples", _NONNEG),
        "device": ("device", _dict),
        "model": ("model", _dict),
        "eval_samples": ("eval_samples", _NONNEG),
    },
    "assignment": {
        "round": ("round", _NONNEG),
        "model_version": ("model_version", _NONNEG),
        "local_steps": ("local_steps", _int(1)),
        "lr": ("lr", _float(positive=True)),
        "batch_size": ("batch_size", _int(1)),
        "deadline_s": ("deadline_s", _float(positive=True)),
        "algorithm": ("algorithm", _TEXT),
        "model": ("model", _dict),
        "alpha": ("alpha", _float(optional=True)),
        "settings": ("settings", _dict),
        "momentum": ("momentum", _float(0.0)),
        "weight_decay": ("weight_decay", _float(0.0)),
        "upload": ("upload", _bool),
        "seed": ("seed", _NONNEG),
        "run": ("run_id", _RUN),
        "sha256": ("model_sha256", _SHA256),
        "globals": ("global_arrays", _names),
        "codec": ("codec", _codec),
        "task": ("task", _dict),
    },
    "update": {
        "round": ("round", _NONNEG),
        "model_version": ("model_version", _NONNEG),
        "client_id": ("client_id", _CID),
        "num_samples": ("num_samples", _NONNEG),
        "local_steps": ("local_steps", _NONNEG),
        "compute_s": ("compute_s", _float(0.0)),
        "cpu_s": ("cpu_s", _float(0.0)),
        "overhead_s": ("overhead_s", _float(0.0)),
        "train_loss": ("train_loss", _float(finite=False)),  # a diverged client may still report its NaN loss
        "metrics": ("metrics", _dict),
        "extras": ("extras", _dict),
        "run": ("run_id", _RUN),
    },
    "failure": {
        "round": ("round", _NONNEG),
        "client_id": ("client_id", _CID),
        "reason": ("reason", _str(_REASON_RE)),
        "detail": ("detail", _text(2000)),
        "run": ("run_id", _RUN),
    },
    "presence": {
        "client_id": ("client_id", _CID),
        "online": ("online", _bool),
        "role": ("role", _str(choices=("client", "server"))),
        "reason": ("reason", _TEXT),
        "model": ("model", _dict),
        "fingerprint": ("fingerprint", _str(_FINGERPRINT_RE)),
        "run": ("run_id", _RUN),
    },
    "stop": {"reason": ("reason", _TEXT), "run": ("run_id", _RUN)},
    "ack": {
        "of": ("of", _str(_MSG_ID_RE)),
        "accepted": ("accepted", _bool),
        "round": ("round", _NONNEG),
        "reason": ("reason", _str(_ACK_REASON_RE)),
        "detail": ("detail", _text(2000)),
        "run": ("run_id", _RUN),
    },
    "resync": {
        "client_id": ("client_id", _CID),
        "since": ("since", _str(_RUN_ID_RE)),  # a msg id, or empty when the device has not said hello
        "round": ("round", _NONNEG),
        "run": ("run_id", _RUN),
    },
    "compute": {
        "round": ("round", _NONNEG),
        "client_id": ("client_id", _CID),
        "local_steps": ("local_steps", _int(1)),
        "compute_s": ("compute_s", _float(0.0)),
        "cpu_s": ("cpu_s", _float(0.0)),
        "run": ("run_id", _RUN),
    },
    "model": {"round": ("round", _NONNEG), "sha256": ("sha256", _SHA256), "meta": ("meta", _dict)},
    "evaluate": {
        "round": ("round", _NONNEG),
        "model_version": ("model_version", _NONNEG),
        "model": ("model", _dict),
        "task": ("task", _dict),
        "deadline_s": ("deadline_s", _float(positive=True)),
        "run": ("run_id", _RUN),
    },
    "evaluation": {
        "round": ("round", _NONNEG),
        "client_id": ("client_id", _CID),
        "num_samples": ("num_samples", _NONNEG),
        "loss": ("loss", _float(finite=False)),  # a diverged model's loss is reported as it is
        "metrics": ("metrics", _dict),
        "eval_s": ("eval_s", _float(0.0)),
        "cpu_s": ("cpu_s", _float(0.0)),
        "run": ("run_id", _RUN),
    },
    "refusal": {
        "client_id": ("client_id", _CID),
        "reason": ("reason", _str(_REASON_RE)),
        "detail": ("detail", _text(2000)),
    },
    "chunk": {
        "of": ("of", _str(_MSG_ID_RE)),
        "i": ("index", _INT),
        "n": ("count", _INT),
        "size": ("size", _INT),
        "cs": ("chunk_size", _INT),
        "sha256": ("sha256", _SHA256),
    },
    "global_model": {
        "round": ("round", _NONNEG),
        "model_version": ("model_version", _NONNEG),
        "sha256": ("sha256", _SHA256),
        "run": ("run_id", _RUN),
        "diff_base": ("diff_base", _SHA_OR_EMPTY),
    },
    "model_request": {
        "round": ("round", _NONNEG),
        "client_id": ("client_id", _CID),
        "sha256": ("sha256", _SHA256),
        "run": ("run_id", _RUN),
    },
}
_CLASSES: dict[str, type] = {
    c.TYPE: c
    for c in (
        Hello,
        Assignment,
        Update,
        Failure,
        Presence,
        Stop,
        ModelFile,
        Chunk,
        GlobalModel,
        ModelRequest,
        Evaluate,
        Evaluation,
        Refusal,
        Ack,
        Resync,
        ComputeReport,
    )
}
_BYTES = ("chunk", "model")  # types that carry one raw byte blob named "data" instead of float32 vectors
_ARRAYS = ("assignment", "update", "global_model", "evaluate")  # types that carry float32 arrays
_VECTOR = {"update": "delta", "global_model": "weights", "evaluate": "weights"}  # the required 1-D float32 vector
_EXTRA_ARRAYS = ("assignment", "update", "global_model")  # types that carry named "x:<name>" arrays (the contract's)
_REQUIRED = {  # fields without a default must be on the wire; the others fall back to their defaults
    t: {f.name for f in fields(c) if f.default is MISSING and f.default_factory is MISSING} for t, c in _CLASSES.items()
}
# An assignment's defaults only serve the strategy that starts one; on the wire every field must be there.
_REQUIRED["assignment"] = {attr for attr, _ in _SPECS["assignment"].values()}


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _check_fields(t: str, f: dict[str, Any]) -> None:
    spec = _SPECS[t]
    for key in f:
        if key not in spec:
            raise InvalidField(f"{t}: unknown field {_short(key)} (expected one of {sorted(spec)})")
    for key, (attr, check) in spec.items():
        if key not in f:
            if attr in _REQUIRED[t]:
                raise MissingField(f"{t}: missing field {key!r}")
            continue
        expected = check(f[key])
        if expected is not None:
            raise InvalidField(f"{t}: field {key!r} expected {expected}, got {_short(f[key])}")


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
    if t not in _SPECS:
        raise UnknownMessageType(f"encode: expected one of {sorted(_SPECS)}, got {type(msg).__name__}")
    f = {key: _coerce(getattr(msg, attr)) for key, (attr, _) in _SPECS[t].items()}
    _check_fields(t, f)
    if not isinstance(msg.msg_id, str) or not _MSG_ID_RE.fullmatch(msg.msg_id):
        raise InvalidField(f"{t}: msg_id expected a str matching {_MSG_ID_RE.pattern}, got {_short(msg.msg_id)}")
    blobs: list[tuple[str, str, list[int], list[memoryview]]] = []
    if t in _BYTES:
        data = memoryview(msg.data).cast("B")  # type: ignore[union-attr]
        if t == "chunk":
            _check_chunk(f, data.nbytes)
        blobs.append(("data", _U8, [data.nbytes], [data]))
    elif t in _ARRAYS:
        named = [(_VECTOR[t], getattr(msg, _VECTOR[t]), True)] if t in _VECTOR else []
        extra = msg.arrays if t in _EXTRA_ARRAYS else {}  # type: ignore[union-attr]
        if not isinstance(extra, dict) or not all(isinstance(k, str) and k for k in extra):
            raise InvalidField(f"{t}: field 'arrays' expected a map with non-empty str keys, got {_short(extra)}")
        named += [(f"x:{k}", v, False) for k, v in extra.items()]
        for name, arr, vector in named:
            if isinstance(arr, codecs.Encoded):  # its parts, raw, in wire order
                blobs.append((name, arr.wire, [arr.size], [memoryview(p).cast("B") for p in arr.parts]))
                continue
            a = _as_f4(t, name, arr, vector)
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
        raise MalformedMessage(f"header: not valid msgpack ({type(e).__name__}: {_short(str(e))})") from None
    return header, u.tell()


def read_header(payload: bytes | bytearray | memoryview) -> tuple[dict[str, Any], int]:
    """Parse and fully validate a frame's header; return it and the offset where the raw array bytes begin.

    Everything but array finiteness is checked, including that the arrays account for exactly the remaining bytes.
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
    if header["v"] != PROTOCOL_VERSION or not _is_int(header["v"]):
        raise UnsupportedVersion(f"header: version expected {PROTOCOL_VERSION}, got {_short(header['v'])}")
    t = header.get("t")
    if not isinstance(t, str) or t not in _SPECS:
        raise UnknownMessageType(f"header: type expected one of {sorted(_SPECS)}, got {_short(t)}")
    for key in ("id", "f"):
        if key not in header:
            raise MalformedMessage(f"{t}: header missing key {key!r}")
    if not isinstance(header["id"], str) or not _MSG_ID_RE.fullmatch(header["id"]):
        raise InvalidField(f"{t}: id expected a str matching {_MSG_ID_RE.pattern}, got {_short(header['id'])}")
    f = header["f"]
    if not isinstance(f, dict):
        raise MalformedMessage(f"{t}: header 'f' expected a map, got {type(f).__name__}")
    _check_fields(t, f)
    arrays = header.setdefault("a", [])
    if not isinstance(arrays, list):
        raise MalformedMessage(f"{t}: header 'a' expected a list, got {type(arrays).__name__}")
    total, seen = 0, set()
    vector = _VECTOR.get(t)
    for entry in arrays:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
            raise MalformedMessage(f"{t}: array entry expected [name, dtype, shape], got {_short(entry)}")
        name, dtype, shape = entry
        allowed = (
            name == "data"
            if t in _BYTES
            else t in _ARRAYS and (name == vector or (t in _EXTRA_ARRAYS and name[:2] == "x:"))
        )
        if not allowed or name in seen or name == "x:":
            raise InvalidField(f"{t}: unexpected or repeated array {_short(name)}")
        seen.add(name)
        want = _U8 if t in _BYTES else DTYPE
        compressed = (t == "update" or (t == "global_model" and name == vector)) and codecs.is_wire(dtype)
        if dtype != want and not compressed:
            raise InvalidField(f"{t}: array {name!r} dtype expected {want!r} or a codec, got {_short(dtype)}")
        if not (isinstance(shape, list) and len(shape) <= 32 and all(_is_int(s) and s >= 0 for s in shape)):
            raise ShapeMismatch(f"{t}: array {name!r} shape expected <= 32 ints >= 0, got {_short(shape)}")
        if (name in (vector, "data") or compressed) and len(shape) != 1:
            raise ShapeMismatch(f"{t}: array {name!r} expected 1-D, got shape {shape}")
        if compressed:
            try:
                nbytes = bound = codecs.layout(dtype, shape[0]).nbytes
            except codecs.CodecError as exc:
                raise CompressedPayloadError(f"{t}: array {name!r}", exc) from None
        else:
            itemsize = 1 if t in _BYTES else 4
            nbytes = math.prod(shape) * itemsize
            # zeros count as 1: an empty array with a huge other dimension would make numpy's reshape fail in decode
            bound = math.prod(max(s, 1) for s in shape) * itemsize
        if bound > size:
            raise ShapeMismatch(f"{t}: array {name!r} shape {_short(shape)} is larger than the {size}-byte frame")
        total += nbytes
    need = vector or ("data" if t in _BYTES else None)
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
    header, pos = read_header(payload)
    t, f = header["t"], header["f"]
    kwargs = {attr: f[key] for key, (attr, _) in _SPECS[t].items() if key in f}
    kwargs["msg_id"] = header["id"]
    compressed = {name: dtype for name, dtype, _ in header["a"] if t in _VECTOR and dtype != DTYPE}
    expanded = sum(4 * shape[0] for name, _, shape in header["a"] if name in compressed)
    if expanded > max_bytes:  # a few top-k entries may claim a vector of any length: bound what decoding allocates
        raise MessageTooLarge(f"{t}: compressed arrays expand to {expanded} bytes, expected <= {max_bytes}")
    extra: dict[str, np.ndarray] = {}
    for name, dtype, shape in header["a"]:
        if t in _BYTES:
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
    if t in _EXTRA_ARRAYS:
        kwargs["arrays"] = extra
    if t == "update":
        kwargs["codecs"] = {name.removeprefix("x:"): dtype for name, dtype in compressed.items()}
    return _CLASSES[t](**kwargs)
