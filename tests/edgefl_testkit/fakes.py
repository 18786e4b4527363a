"""Protocol-level fake devices for tests: they speak edgefl's wire protocol over a real link (MQTT or in-process) but
decide themselves what to answer, so a test can play a late, lazy, broken or hostile device.

``FakeDevice`` is the one loop every such test uses: it says hello when the server announces itself, answers each
assignment with the frames ``respond(assignment)`` returns, and ends on the server's stop. ``hostile_frames`` crafts
the corrupted updates of the adversarial tests (also as frames no honest encoder would produce, e.g. a wrong dtype).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import msgpack
import numpy as np

from edge_client.algorithms import contract_of
from edge_client.algorithms.contract import Contract
from edge_client.loop.models_cache import ModelCache
from edge_client.wire.messages import (
    Assignment,
    GlobalModel,
    Hello,
    Message,
    ModelRequest,
    Presence,
    Stop,
    Update,
    new_msg_id,
)
from edge_client.wire.protocol import PROTOCOL_VERSION, encode
from edge_client.wire.topics import Topics
from edge_client.wire.transport import Link, LinkConfig, MqttLink
from server.distribution import split_round

Respond = Callable[[Assignment], Iterable[bytes | bytearray]]


def zero_update(a: Assignment, client_id: str, num_samples: int, contract: Contract | None = None) -> Update:
    """A well-formed update that changes nothing: zero delta and the contract's arrays and values as zeros."""
    size = a.plan.weights.size if a.plan.weights is not None else 0
    arrays = {x.name: np.zeros(size, np.float32) for x in contract.returns} if contract else {}
    extras = {v.name: 0.0 for v in contract.returns_values} if contract else {}
    f = a.facts
    return Update(
        f.round, f.model_version, client_id, num_samples, a.plan.steps, 0.01, 0.01, 0.0,
        np.zeros(size, np.float32), extras=extras, arrays=arrays, run_id=f.run_id,
    )  # fmt: skip


def as_sent(a: Assignment) -> list[Message]:
    """``a`` (its plan's weights set) as a server sends it: the round's model, then the assignment that names it."""
    f = a.facts
    model, shares = split_round(contract_of(f.algorithm), f.round, f.model_version, a.plan.weights, {"c": a.plan})
    uses, own = shares["c"]
    named = Assignment(a.plan, replace(f, sha256=model.sha256), arrays=own, global_arrays=uses, msg_id=a.msg_id)
    return [model, named]


def raw_update(update: Update, dtypes: dict[str, str] | None = None) -> bytes:
    """``update`` as a frame built by hand: arrays in the given wire dtypes (``{"delta": "<f8"}``), which the
    encoder would never produce; fields exactly as they are, unchecked."""
    dtypes = dtypes or {}
    fields = {
        "round": update.round, "model_version": update.model_version, "client_id": update.client_id,
        "num_samples": update.num_samples, "local_steps": update.local_steps, "compute_s": update.compute_s,
        "cpu_s": update.cpu_s, "train_loss": update.train_loss, "metrics": update.metrics, "extras": update.extras,
        "run": update.run_id,
    }  # fmt: skip
    named = [("delta", update.delta), *((f"x:{k}", v) for k, v in update.arrays.items())]
    arrays = [(n, dtypes.get(n.removeprefix("x:"), "<f4"), v) for n, v in named]
    header = {"v": PROTOCOL_VERSION, "t": "update", "id": new_msg_id(), "f": fields,
              "a": [[n, d, list(np.shape(v))] for n, d, v in arrays]}  # fmt: skip
    body = b"".join(np.ascontiguousarray(v, dtype=d).tobytes() for _, d, v in arrays)
    return msgpack.packb(header, use_bin_type=True) + body


#: Each corruption of one field of an honest update, and the reason the server must give for refusing it.
def hostile_frames(honest: Update, contract: Contract, registered: int) -> list[tuple[str, str, bytes | bytearray]]:
    """``(what, expected reason, frame)`` for every field a client of ``contract`` sends."""
    out: list[tuple[str, str, bytes | bytearray]] = []

    def variant(what: str, reason: str, dtypes: dict[str, str] | None = None, **changes: Any) -> None:
        u = Update(**{**vars(honest), **changes, "msg_id": new_msg_id()})
        out.append((what, reason, raw_update(u, dtypes) if dtypes else encode(u)))

    size = honest.delta.size
    vectors = {"delta": honest.delta, **honest.arrays}
    for name in vectors:

        def put(value: np.ndarray, name: str = name) -> dict[str, Any]:
            if name == "delta":
                return {"delta": value}
            return {"arrays": {**honest.arrays, name: value}}

        nan, inf, huge = (np.zeros(size, np.float32) for _ in range(3))
        nan[0], inf[-1], huge[0] = np.nan, np.inf, 3e38
        variant(f"{name} NaN", "non_finite", **put(nan))
        variant(f"{name} Inf", "non_finite", **put(inf))
        variant(f"{name} huge", "norm", **put(huge))
        variant(f"{name} wrong shape", "shape", **put(np.zeros(size + 1, np.float32)))
        variant(f"{name} wrong dtype", "invalid_field", dtypes={name: "<f8"}, **put(np.zeros(size, np.float64)))
    for v in contract.returns_values:
        label = f"{v.name} (value)"
        variant(f"{label} NaN", "invalid_field", extras={**honest.extras, v.name: float("nan")})
        variant(f"{label} huge", "invalid_field", extras={**honest.extras, v.name: 1e300})
        variant(f"{label} missing", "missing_field", extras={k: x for k, x in honest.extras.items() if k != v.name})
    variant("lying num_samples", "num_samples", num_samples=registered * 1000 + 1)
    variant("more steps than assigned", "steps", local_steps=honest.local_steps + 1)
    return out


def device_topics(topics: Topics, client_id: str) -> list[str]:
    """What a device subscribes to: its own topic, the job-wide ones and the round model's frames."""
    return [topics.down(client_id), topics.broadcast, topics.server, topics.round_model_frames]


class FakeDevice:
    """A device's protocol loop on its own thread; ``respond`` decides what each assignment is answered with.

    Like a device, it keeps the round models it receives and answers an assignment with its model put back (asking
    the server for a model it did not get).
    """

    def __init__(self, link: Link, topics: Topics, client_id: str, num_samples: int, respond: Respond) -> None:
        self.link, self.topics, self.client_id, self.num_samples = link, topics, client_id, num_samples
        self.respond = respond
        self.assignments: list[Assignment] = []
        self.models = ModelCache()
        self._waiting: Assignment | None = None
        self.stopped_by_server = threading.Event()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fake-{client_id}", daemon=True)

    @classmethod
    def over_mqtt(
        cls, url: str, username: str, password: str, job: str, client_id: str, num_samples: int, respond: Respond,
    ) -> FakeDevice:  # fmt: skip
        topics = Topics(job)
        link = MqttLink(
            LinkConfig(url, username, password),
            f"fake-{client_id}-{uuid.uuid4().hex[:8]}",
            device_topics(topics, client_id),
        )
        return cls(link, topics, client_id, num_samples, respond)

    def hello(self) -> None:
        self.link.publish(self.topics.up(self.client_id), encode(Hello(self.client_id, self.num_samples)))

    def handle(self, msg: Message) -> bool:
        """One message from the server; False on its stop (also the in-process bus's entry point)."""
        if isinstance(msg, Presence) and msg.role == "server" and msg.online:
            self.hello()
        elif isinstance(msg, GlobalModel):
            self.models.add(msg)
            if self._waiting is not None and self._waiting.facts.sha256 == msg.sha256:
                self._answer(self._waiting)
        elif isinstance(msg, Assignment):
            if msg.facts.sha256 in self.models:
                self._answer(msg)
            else:
                self._waiting = msg
                f = msg.facts
                request = ModelRequest(f.round, self.client_id, f.sha256, run_id=f.run_id)
                self.link.publish(self.topics.up(self.client_id), encode(request))
        elif isinstance(msg, Stop):
            self.stopped_by_server.set()
            return False
        return True

    def _answer(self, assignment: Assignment) -> None:
        self._waiting = None
        self.models.complete(assignment)
        self.assignments.append(assignment)
        for frame in self.respond(assignment):
            self.link.publish(self.topics.up(self.client_id), frame)

    def _run(self) -> None:
        try:
            self.link.start()
            while not self._stop.is_set():
                got = self.link.receive(0.2)
                if got is not None and not self.handle(got[1]):
                    return
        except BaseException as exc:  # surfaced by the test through ``error``
            self.error = exc
        finally:
            self.link.stop()

    def start(self) -> FakeDevice:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
