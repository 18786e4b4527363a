"""The wire messages: one dataclass per message type, each field declared with its wire key, type and bound.

Everything else is derived from these declarations (``edge_client.wire.schema``): the checks
``edge_client.wire.protocol`` applies to every frame, the type table (``SCHEMAS``), and the table of every field a
device can send in docs/reliability.md (:func:`device_fields_table`). A field without a declaration never travels in a
header.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, get_args

import numpy as np

from edge_client.secagg.shamir import SHARE_BYTES
from edge_client.secagg.wire import KEY_BYTES, MAX_NEIGHBOURS, SEALED_BYTES, SECURE_TERMS
from edge_client.wire import codecs
from edge_client.wire.plan import Plan
from edge_client.wire.schema import (
    FLAG,
    MAPPING,
    Check,
    FreeMap,
    Schema,
    binary,
    blob,
    integer,
    is_int,
    named_arrays,
    names,
    number,
    on_wire,
    record,
    rows,
    schema_of,
    text,
    vector,
)
from edge_client.wire.topics import CLIENT_ID_RE

DTYPE = "<f4"  # the only array dtype on the wire

MSG_ID = text(r"[A-Za-z0-9_.:-]{1,64}")  # the header's "id" of every message
NONNEG = integer(0)
CID = text(CLIENT_ID_RE.pattern.removeprefix("^").removesuffix("$"))
RUN = text(r"[A-Za-z0-9_.:-]{0,64}")
SHA256 = text(r"[0-9a-f]{64}")
DETAIL = text(max_len=2000)
REASON = text(r"[a-z_]{1,32}")
SHORT_TEXT = text(max_len=200)


def _is_codec(v: Any) -> bool:
    try:
        codecs.parse(v)
    except ValueError:
        return False
    return True


CODEC = Check("str", f"a codec: {codecs.SPEC_HELP}", f"a codec: {codecs.SPEC_HELP}", _is_codec)

#: The model a device states in its hello: its layout's fingerprint and (the first ``MAX_LAYOUT`` of) its parameters,
#: or the error that kept it from building the server's model. Registration compares it with the server's.
MAX_LAYOUT = 1000


def _model_statement(v: Any) -> bool:
    if not isinstance(v, dict) or not set(v) <= {"digest", "layout", "error"}:
        return False
    digest, layout, error = v.get("digest", "0" * 64), v.get("layout", []), v.get("error", "")
    return (
        SHA256.ok(digest)
        and isinstance(error, str)
        and len(error) <= 1000
        and isinstance(layout, list)
        and len(layout) <= MAX_LAYOUT
        and all(_parameter(p) for p in layout)
    )


def _parameter(p: Any) -> bool:
    """``[name, shape, dtype]`` of one parameter (``edge_client.learning.models.parameter_layout``)."""
    return (
        isinstance(p, list)
        and len(p) == 3
        and isinstance(p[0], str)
        and len(p[0]) <= 256
        and isinstance(p[1], list)
        and len(p[1]) <= 16
        and all(is_int(s) and s >= 0 for s in p[1])
        and isinstance(p[2], str)
        and len(p[2]) <= 32
    )


MODEL_STATEMENT = Check(
    "map",
    f"{{digest: 64 hex, layout: <= {MAX_LAYOUT} [name <= 256 chars, shape <= 16 ints >= 0, dtype <= 32 chars]}} "
    "or {error: str <= 1000 chars}",
    "a map {digest, layout} or {error} (edge_client.loop.runtime's model statement)",
    _model_statement,
)


def _dropped() -> Any:
    """What decoding dropped from the message's free-form maps, ``(reason, text)`` per entry (the server counts them:
    ``edge_client.wire.protocol.dropped_entries``); never on the wire."""
    return field(default_factory=list, compare=False, repr=False)


def new_msg_id() -> str:
    """Random 32-hex-char id; receivers de-duplicate on it (brokers redeliver after a crash)."""
    return uuid.uuid4().hex


SENDER = "the sender's own id (its topic), else invalid_field"
THIS_RUN = "the server's run, else out_of_round"


@dataclass
class Hello:
    client_id: str = on_wire(CID, note=SENDER)
    num_samples: int = on_wire(NONNEG, note="<= clients.max_samples, else num_samples (not registered)")
    device: dict[str, Any] = on_wire(FreeMap(max_bytes=4096), factory=dict, note="facts shown and stored per device")
    # The device's own model for the server's spec (checked at registration), and the size of the split it holds
    # out for federated evaluation.
    model: dict[str, Any] = on_wire(MODEL_STATEMENT, factory=dict, note="must be the server's model, else model")
    eval_samples: int = on_wire(NONNEG, default=0, note="<= clients.max_samples, else num_samples (not registered)")
    msg_id: str = field(default_factory=new_msg_id)
    dropped: list[tuple[str, str]] = _dropped()
    TYPE: ClassVar[str] = "hello"


@dataclass(frozen=True)
class RoundFacts:
    """The round's facts, as the server states them to one device beside its plan: which round and model (the
    ``GlobalModel`` named by ``sha256``), its deadline, the codec this device uploads with, whether it uploads at all
    (FedUmf's train-only devices do not), the run, and the run's algorithm, model spec, task and seed. Set once by the
    orchestrator, never changed on the way; the defaults serve code that trains without a server (a benchmark)."""

    round: int = on_wire(NONNEG, default=0)
    model_version: int = on_wire(NONNEG, default=0)
    sha256: str = on_wire(SHA256, default="")  # the GlobalModel this round starts from (model_digest)
    deadline_s: float = on_wire(number(positive=True), default=0.0)
    codec: str = on_wire(CODEC, default="fp32")  # the codec this device uploads with (edge_client.wire.codecs)
    upload: bool = on_wire(FLAG, default=True)
    run_id: str = on_wire(RUN, key="run", default="")
    algorithm: str = on_wire(text(max_len=64), default="")
    model: dict[str, Any] = on_wire(MAPPING, factory=dict)  # the run's model spec
    task: dict[str, Any] = on_wire(
        MAPPING, factory=dict
    )  # the run's [task] spec (edge_client.learning.tasks.build_task)
    seed: int = on_wire(NONNEG, default=0)
    # secure aggregation's terms for this device (docs/secure-aggregation.md); empty: the round uploads in the clear
    secure: dict[str, Any] = on_wire(SECURE_TERMS, factory=dict)
    EVERY_FIELD_REQUIRED: ClassVar[bool] = True


@dataclass
class Assignment:
    """Server -> one client: the plan its strategy wants (``edge_client.wire.plan.Plan``) and the round's facts.

    Both travel as they are (``plan`` and ``facts`` are maps of their own declared fields) and the device trains the
    plan with the facts beside it. On the wire an assignment carries no model: the plan's start model and the arrays
    every client of the round shares travel once per round in the :class:`GlobalModel` named by ``facts.sha256``;
    ``arrays`` holds only this client's own, and ``global_arrays`` names the shared ones its plan uses. The device's
    model cache puts them into the plan before training.
    """

    plan: Plan = on_wire(record(Plan))
    facts: RoundFacts = on_wire(record(RoundFacts), factory=RoundFacts)
    arrays: dict[str, np.ndarray] = named_arrays("the plan's arrays for this client alone (float32)")
    global_arrays: list[str] = on_wire(names(), key="globals", factory=list)  # the GlobalModel's arrays it uses
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "assignment"
    EVERY_FIELD_REQUIRED: ClassVar[bool] = True  # the defaults serve the code that builds one, not the wire


@dataclass
class Update:
    """Client -> server; ``delta = w_start - w_end`` (descent-positive)."""

    round: int = on_wire(NONNEG, note="the round in progress, else out_of_round")
    model_version: int = on_wire(NONNEG, note="the round's model version, else model_version")
    client_id: str = on_wire(CID, note=SENDER)
    num_samples: int = on_wire(
        NONNEG, note="the samples it registered with, else num_samples; its weight capped at clients.max_weight_share"
    )
    local_steps: int = on_wire(NONNEG, note="the steps it was assigned, else steps")
    compute_s: float = on_wire(number(0.0), note="clamped to [0, 86400] s (server.deadlines) where predictions use it")
    cpu_s: float = on_wire(number(0.0))
    train_loss: float = on_wire(number(finite=False))  # a diverged client may still report its NaN loss
    delta: np.ndarray = vector(
        "the model's length, finite (else non_finite), norm <= train.max_update_norm and <= train.max_norm_ratio x the "
        "previous round's median norm per step x its steps (else norm)",
        compressed=True,
    )
    # the device's telemetry of the round (edge_client.loop.device snapshots before and after training, upload times)
    metrics: dict[str, Any] = on_wire(
        FreeMap(max_bytes=8192, nested=True), factory=dict, note="stored in metrics.jsonl and the dashboard"
    )
    # the values the algorithm's contract returns
    extras: dict[str, Any] = on_wire(
        FreeMap(max_bytes=2048, numbers=True, finite=False, drop=False),
        factory=dict,
        note="the contract's values: names, finiteness and ranges checked at admission, else invalid_field",
    )
    arrays: dict[str, np.ndarray] = named_arrays(
        "the contract's arrays: model-sized, finite, norm-bounded (contract), else shape / non_finite / norm",
        compressed=True,
    )
    # of compute_s, the per-round work outside the local steps (FedVeca's gradient pass)
    overhead_s: float = on_wire(number(0.0), default=0.0, note="at most compute_s where rows and predictions use it")
    run_id: str = on_wire(RUN, key="run", default="", note=THIS_RUN)
    codecs: dict[str, str] = field(default_factory=dict, compare=False)  # decode: wire codec of compressed arrays
    msg_id: str = field(default_factory=new_msg_id)
    dropped: list[tuple[str, str]] = _dropped()
    TYPE: ClassVar[str] = "update"


@dataclass
class Failure:
    """Client -> server: this device could not serve its assignment (``reason`` a short code, ``detail`` the error).

    The server logs and counts it and stops waiting for that client this round; the device keeps serving.
    """

    round: int = on_wire(NONNEG)
    client_id: str = on_wire(CID, note=SENDER)
    reason: str = on_wire(REASON)
    detail: str = on_wire(DETAIL, default="")
    run_id: str = on_wire(RUN, key="run", default="")
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "failure"


@dataclass
class Presence:
    client_id: str = on_wire(CID, note=SENDER)
    online: bool = on_wire(FLAG)
    role: str = on_wire(text(choices=("client", "server")), default="client")
    reason: str = on_wire(SHORT_TEXT, default="")
    # The server's: the run's model spec and its fingerprint, so a device can say at registration what its model is.
    model: dict[str, Any] = on_wire(MAPPING, factory=dict, note="not read from a device")
    fingerprint: str = on_wire(text(r"(|[0-9a-f]{64})"), default="")
    run_id: str = on_wire(RUN, key="run", default="")  # the server's: the run it serves (a device learns it here)
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "presence"


@dataclass
class Stop:
    reason: str = on_wire(SHORT_TEXT)
    run_id: str = on_wire(RUN, key="run", default="")
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

    of: str = on_wire(MSG_ID)
    accepted: bool = on_wire(FLAG)
    round: int = on_wire(NONNEG, default=0)
    reason: str = on_wire(text(r"[a-z_]{0,32}"), default="")  # empty when accepted
    detail: str = on_wire(DETAIL, default="")
    run_id: str = on_wire(RUN, key="run", default="")
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "ack"


@dataclass
class Resync:
    """Client -> server: this device may have lost its assignment (its process started, or it connected without its
    broker session); the server sends the round's assignment again if the device has one and has not answered it,
    unless it went out after ``since`` (the hello that opened the device's current connection: what the server sent
    after it reached the device anyway) or is ``run_id``'s round ``round`` (the newest the device served).
    """

    client_id: str = on_wire(CID, note=SENDER)
    since: str = on_wire(RUN, default="")  # a msg id, or empty when the device has not said hello
    round: int = on_wire(NONNEG, default=0)
    run_id: str = on_wire(RUN, key="run", default="")
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "resync"


@dataclass
class Chunk:
    """One frame of a message larger than the chunk size; ``data`` is a zero-copy view when decoded. Its short wire
    names are docs/architecture.md's."""

    of: str = on_wire(MSG_ID)
    index: int = on_wire(integer(), key="i", note="0 <= i < n, else chunk")
    count: int = on_wire(integer(), key="n", note="ceil(size / cs), else chunk")
    size: int = on_wire(integer(), note="> 0; <= what the sender may have in flight, else chunk")
    chunk_size: int = on_wire(integer(), key="cs", note="> 0, else chunk")
    sha256: str = on_wire(SHA256, note="the whole message's, checked on reassembly, else chunk")
    data: memoryview | bytes = blob("cs bytes (the last piece: the rest), else chunk")
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "chunk"


@dataclass
class ModelFile:
    """The exported ONNX model (retained on the job's model topic) that devices fetch for inference."""

    round: int = on_wire(NONNEG)
    sha256: str = on_wire(SHA256)
    meta: dict[str, Any] = on_wire(MAPPING)  # the export's sidecar: model spec, input shape, classes, round
    data: memoryview | bytes = blob("the ONNX file")
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

    round: int = on_wire(NONNEG)
    model_version: int = on_wire(NONNEG)
    sha256: str = on_wire(SHA256)
    weights: np.ndarray = vector("the model (or its difference from diff_base)", compressed=True)
    arrays: dict[str, np.ndarray] = named_arrays("the contract's arrays every client of the round shares")
    run_id: str = on_wire(RUN, key="run", default="")
    # sha256 of the model ``weights`` is the difference from; "" when ``weights`` is the model
    diff_base: str = on_wire(text(r"(?:[0-9a-f]{64})?"), default="")
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "global_model"


@dataclass
class ModelRequest:
    """Device -> server: the model ``sha256`` its assignment of ``round`` names did not arrive; send it to me."""

    round: int = on_wire(NONNEG, note="a round it was assigned, else out_of_round")
    client_id: str = on_wire(CID, note=SENDER)
    sha256: str = on_wire(SHA256, note="the round's model, else out_of_round")
    run_id: str = on_wire(RUN, key="run", default="")
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

    round: int = on_wire(NONNEG, note="a round it was told to train without uploading, else out_of_round")
    client_id: str = on_wire(CID, note=SENDER)
    local_steps: int = on_wire(integer(1), note="the steps it was told, else steps")
    compute_s: float = on_wire(number(0.0))
    cpu_s: float = on_wire(number(0.0))
    run_id: str = on_wire(RUN, key="run", default="", note=THIS_RUN)
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "compute"


@dataclass
class Evaluate:
    """Server -> one client: evaluate these weights (the global model after ``round``) on your held-out split."""

    round: int = on_wire(NONNEG)
    model_version: int = on_wire(NONNEG)
    weights: np.ndarray = vector("the model to evaluate")
    model: dict[str, Any] = on_wire(MAPPING, factory=dict)
    task: dict[str, Any] = on_wire(MAPPING, factory=dict)
    deadline_s: float = on_wire(number(positive=True), default=0.0)
    run_id: str = on_wire(RUN, key="run", default="")
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "evaluate"


@dataclass
class Evaluation:
    """Client -> server: the task's loss and metrics on ``num_samples`` held-out samples, and the device's evaluation
    time (wall ``eval_s`` and process CPU ``cpu_s``, device clocks), apart from training compute."""

    round: int = on_wire(NONNEG, note="the evaluation in progress, else out_of_round")
    client_id: str = on_wire(CID, note=SENDER)
    num_samples: int = on_wire(NONNEG, note="the held-out samples it registered, else num_samples")
    # a diverged model's loss is reported as it is (and refused at admission)
    loss: float = on_wire(
        number(finite=False), note="finite (else non_finite), in the task's range (else metric_range)"
    )
    metrics: dict[str, Any] = on_wire(
        FreeMap(max_bytes=2048, numbers=True, finite=False, drop=False),
        factory=dict,
        note="the task's metric names (else invalid_field), finite (else non_finite), in their ranges "
        "(else metric_range)",
    )
    eval_s: float = on_wire(number(0.0), default=0.0)
    cpu_s: float = on_wire(number(0.0), default=0.0)
    run_id: str = on_wire(RUN, key="run", default="", note=THIS_RUN)
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "evaluation"


@dataclass
class Refusal:
    """Server -> one client: it is not registered (``reason`` a short code, ``detail`` why: e.g. which model parameter
    differs from the server's). The device stops and says so."""

    client_id: str = on_wire(CID)
    reason: str = on_wire(REASON)
    detail: str = on_wire(DETAIL, default="")
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "refusal"


# ---- secure aggregation (issue 26, docs/secure-aggregation.md): a round's stages, relayed by the server ----------
SECURE_ROUND = "a round this device was assigned securely, else out_of_round"
ENCRYPTED_SHARES = rows(MAX_NEIGHBOURS, CID, binary(SEALED_BYTES))


@dataclass
class SecAggKeys:
    """Device -> server, stage 1: the round's two public keys (share encryption, mask agreement)."""

    round: int = on_wire(NONNEG, note=SECURE_ROUND)
    client_id: str = on_wire(CID, note=SENDER)
    enc_key: bytes = on_wire(binary(KEY_BYTES), note="one advert per device and round, else duplicate")
    mask_key: bytes = on_wire(binary(KEY_BYTES))
    run_id: str = on_wire(RUN, key="run", default="", note=THIS_RUN)
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "secagg_keys"


@dataclass
class SecAggRoster:
    """Server -> one device: its neighbours' public keys ``[id, enc_key, mask_key]`` and the sharing threshold."""

    round: int = on_wire(NONNEG)
    threshold: int = on_wire(integer(1, MAX_NEIGHBOURS + 1))
    neighbours: list[list[Any]] = on_wire(rows(MAX_NEIGHBOURS, CID, binary(KEY_BYTES), binary(KEY_BYTES)))
    run_id: str = on_wire(RUN, key="run", default="")
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "secagg_roster"


@dataclass
class SecAggShares:
    """Device -> server, stage 2: its commitment to its self-mask seed, and ``[holder, sealed]`` for each neighbour
    (its two Shamir shares, AES-GCM encrypted for that neighbour alone)."""

    round: int = on_wire(NONNEG, note=SECURE_ROUND)
    client_id: str = on_wire(CID, note=SENDER)
    commitment: str = on_wire(SHA256)
    shares: list[list[Any]] = on_wire(
        ENCRYPTED_SHARES, note="holders: exactly its roster's neighbours, else secagg_shares"
    )
    run_id: str = on_wire(RUN, key="run", default="", note=THIS_RUN)
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "secagg_shares"


@dataclass
class SecAggRelay:
    """Server -> one device: ``[owner, sealed]``, the shares its neighbours encrypted for it; it masks with them."""

    round: int = on_wire(NONNEG)
    shares: list[list[Any]] = on_wire(ENCRYPTED_SHARES)
    run_id: str = on_wire(RUN, key="run", default="")
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "secagg_relay"


@dataclass
class MaskedInput:
    """Device -> server, stage 3: its clipped, weighted, quantised update plus its masks (``data``: little-endian
    uint32 ring elements, one per parameter of each array its contract sums, ``Contract.summed``: the delta, and
    SCAFFOLD's ``delta_c`` or STEM's ``v`` after it), with the round's scalars an ``Update`` carries."""

    round: int = on_wire(NONNEG, note=SECURE_ROUND)
    model_version: int = on_wire(NONNEG, note="the round's model version, else model_version")
    client_id: str = on_wire(CID, note=SENDER)
    local_steps: int = on_wire(NONNEG, note="the steps it was assigned, else steps")
    compute_s: float = on_wire(number(0.0))
    cpu_s: float = on_wire(number(0.0))
    train_loss: float = on_wire(number(finite=False))
    data: memoryview | bytes = blob(
        "4 bytes per model parameter and array the algorithm sums (any values: masked), else secagg_message"
    )
    metrics: dict[str, Any] = on_wire(
        FreeMap(max_bytes=8192, nested=True), factory=dict, note="stored in metrics.jsonl and the dashboard"
    )
    run_id: str = on_wire(RUN, key="run", default="", note=THIS_RUN)
    msg_id: str = field(default_factory=new_msg_id)
    dropped: list[tuple[str, str]] = _dropped()
    TYPE: ClassVar[str] = "masked_input"


@dataclass
class SecAggUnmask:
    """Server -> one device, stage 4: which of its neighbours (and itself) sent a masked input and which dropped."""

    round: int = on_wire(NONNEG)
    survivors: list[str] = on_wire(names(MAX_NEIGHBOURS + 1))
    dropped: list[str] = on_wire(names(MAX_NEIGHBOURS))
    run_id: str = on_wire(RUN, key="run", default="")
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "secagg_unmask"


@dataclass
class SecAggReveal:
    """Device -> server, stage 4: ``[owner, is_seed, share]``: its share of a survivor's self-mask seed or of a
    dropped device's mask key."""

    round: int = on_wire(NONNEG, note=SECURE_ROUND)
    client_id: str = on_wire(CID, note=SENDER)
    shares: list[list[Any]] = on_wire(
        rows(MAX_NEIGHBOURS + 1, CID, FLAG, binary(SHARE_BYTES)),
        note="owners it holds shares of, each as the server asked, else secagg_reveal; a wrong share fails its "
        "secret's check and is outvoted, else the round is dropped",
    )
    run_id: str = on_wire(RUN, key="run", default="", note=THIS_RUN)
    msg_id: str = field(default_factory=new_msg_id)
    TYPE: ClassVar[str] = "secagg_reveal"


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
    | SecAggKeys
    | SecAggRoster
    | SecAggShares
    | SecAggRelay
    | MaskedInput
    | SecAggUnmask
    | SecAggReveal
)
#: Every message type on the wire (chunks too) by its type name, with what the framing needs of it.
SCHEMAS: dict[str, Schema] = {c.TYPE: schema_of(c) for c in (*get_args(Message), Chunk)}
#: What a device may send (the server refuses the other types from a device).
FROM_DEVICES = (
    Hello,
    Presence,
    Update,
    Failure,
    ModelRequest,
    ComputeReport,
    Evaluation,
    Resync,
    Chunk,
    SecAggKeys,
    SecAggShares,
    MaskedInput,
    SecAggReveal,
)


def device_fields_table() -> str:
    """The table of every field a device can send, its bound and what happens outside it (docs/reliability.md holds
    exactly this between its ``device-fields`` markers: a test keeps them equal)."""
    rows = [("every message", "id", MSG_ID.wire, MSG_ID.bound, "refused: `invalid_field`", "")]
    for cls in FROM_DEVICES:
        schema = SCHEMAS[cls.TYPE]
        for key, (_, wire) in schema.fields.items():
            check = wire.check
            if isinstance(check, FreeMap) and check.drop:
                outside = "the entry is dropped, counted as `dropped_<why>`; not a map: refused, `invalid_field`"
            else:
                outside = "refused: `invalid_field`"
            outside += "; absent: refused, `missing_field`" if key in schema.required else ""
            rows.append((cls.TYPE, key, check.wire, check.bound or "any", outside, wire.note))
        for name, array in schema.arrays.items():
            if array.kind == "blob":
                rows.append((cls.TYPE, name, "bytes", "one 1-D blob", "refused: `chunk`", array.doc))
                continue
            wire_type = "float32 array" + (" or a codec's wire form" if array.compressed else "")
            if array.kind == "vector":
                outside = "refused: `invalid_field` (dtype), `shape`, `non_finite`; absent: `missing_field`"
                rows.append((cls.TYPE, name, wire_type, "1-D, finite", outside, array.doc))
            else:
                outside = "refused: `invalid_field` (dtype, name), `shape`, `non_finite`"
                rows.append((cls.TYPE, f"x:<name> ({name})", wire_type, "finite", outside, array.doc))
    lines = [
        "| message | field | wire type | bound | outside the bound | then checked on use |",
        "|---|---|---|---|---|---|",
    ]
    for message, key, wire_type, bound, outside, then in rows:
        cells = [f"`{message}`" if message != "every message" else message, f"`{key}`", wire_type, bound, outside]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in [*cells, then]) + " |")
    return "\n".join(lines)
