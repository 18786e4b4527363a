"""The wire messages: one dataclass per message type, what each field holds and (in its declaration) its bound.

``edge_client.protocol`` frames them (msgpack header + raw arrays) and checks every field a peer sends against these
declarations before any message object exists.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

DTYPE = "<f4"  # the only array dtype on the wire


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
