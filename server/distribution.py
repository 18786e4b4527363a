"""One model per round: the global model goes out once for every device, each assignment only names it.

A round's assignments all start from the same model and share the arrays their contract declares ``scope="global"``
(SCAFFOLD's c, STEM's v_bar, TACO's Delta_t, FedACG's look-ahead model, which strategies set as the assignment's
weights). Those travel once, as one ``GlobalModel`` named by its sha256, published frame by frame on the job's
round-model topics (``Topics.round_model_frame(i)``, retained, so a broker that keeps retained messages can hand a
device that connects mid-round the whole model); a version is published once however many rounds start from it.
Each assignment keeps its instructions, the model's version and digest, the shared arrays' names it uses and the
arrays meant for that client alone. Nothing depends on the retained copy (an ejabberd cluster does not share it
across nodes, docs/scaling.md): a device that did not get the model asks (``ModelRequest``) and is sent it on its
own topic, once per round. The server's egress is counted here, per round.

The model message is built in one place, ``Distribution.model_message``; a downlink codec (issue 18: an int8 model
difference for a device known to hold the previous version) connects there and in ``split_round``, which decides what
each client's own assignment carries.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection

import numpy as np

from edge_client import chunking
from edge_client.contract import Contract
from edge_client.protocol import (
    Assignment,
    DuplicateMessage,
    GlobalModel,
    InvalidField,
    ModelRequest,
    OutOfRound,
    encode,
    model_digest,
)
from edge_client.topics import Topics
from edge_client.transport import Link

log = logging.getLogger("edgefl.server")


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a is b or (a.shape == b.shape and bool(np.array_equal(a, b)))


def split_round(
    contract: Contract, round_: int, version: int, assignments: dict[str, Assignment]
) -> tuple[GlobalModel, dict[str, Assignment]]:
    """The round's ``GlobalModel`` from complete assignments (weights set), and the assignments without it.

    Raises ValueError when the strategy gave clients of one round different start models or shared arrays.
    """
    shared_names = {a.name for a in contract.sends if a.scope == "global"}
    first = next(iter(assignments.values()))
    assert first.weights is not None  # the orchestrator fills in the global model
    weights, shared, uses = first.weights, {}, {}
    for cid, a in assignments.items():
        if a.weights is None or not _same(a.weights, weights):
            raise ValueError(f"{contract.name}: clients of round {round_} start from different models")
        uses[cid] = sorted(shared_names & a.arrays.keys())
        for name in uses[cid]:
            if not _same(shared.setdefault(name, a.arrays[name]), a.arrays[name]):
                raise ValueError(f"{contract.name}: array {name!r} of scope 'global' differs between clients")
    sha = model_digest(weights, shared)
    own = {cid: {k: v for k, v in a.arrays.items() if k not in shared_names} for cid, a in assignments.items()}
    slim = {
        cid: dataclasses.replace(a, weights=None, model_sha256=sha, global_arrays=uses[cid], arrays=own[cid])
        for cid, a in assignments.items()
    }
    return GlobalModel(round_, version, sha, weights, shared, run_id=first.run_id), slim


class Distribution:
    """Publishes each round's model once and the assignments that name it; answers devices that missed it."""

    def __init__(self, link: Link, topics: Topics, contract: Contract) -> None:
        self.link = link
        self.topics = topics
        self.contract = contract
        self.current: GlobalModel | None = None  # the model of the round in progress
        self.bytes_out = 0  # since the last take_bytes_out()
        self._payload: tuple[str, bytes | bytearray] = ("", b"")  # a model's sha256 and its frame, encoded once
        self._published = ""  # sha256 of the model last broadcast by this server
        self._frames = 0  # most retained frames published: cleared at the end
        self._answered: set[str] = set()  # clients sent the current model on request this round

    def split(self, round_: int, version: int, assignments: dict[str, Assignment]) -> dict[str, Assignment]:
        """``split_round``, the model kept as ``current`` (what a device that missed it is sent)."""
        self.current, slim = split_round(self.contract, round_, version, assignments)
        return slim

    def send(self, round_: int, version: int, assignments: dict[str, Assignment]) -> dict[str, tuple[Assignment, int]]:
        """Publish the round's model (unless this version went out already) and every assignment; per client the
        assignment as sent (naming the model) and its bytes."""
        self._answered.clear()
        if not assignments:
            return {}
        slim = self.split(round_, version, assignments)
        assert self.current is not None
        if self.current.sha256 != self._published:
            self._broadcast(self.current)
        return {cid: (a, self._publish(self.topics.down(cid), encode(a))) for cid, a in slim.items()}

    def _broadcast(self, model: GlobalModel) -> None:
        """Frame ``i`` retained on its own topic: one topic would keep only the last chunk of a chunked model."""
        payload, self._published = self.model_message(model), model.sha256
        size = self.link.chunk_size()
        frames = chunking.split(payload, size) if size else [payload]
        for i, frame in enumerate(frames):
            self._publish(self.topics.round_model_frame(i), frame, retain=True, chunked=False)
        self._frames = max(self._frames, len(frames))
        log.info("round %d: model %s broadcast once: %d bytes in %d frames", model.round, model.sha256[:12],
                 len(payload), len(frames))  # fmt: skip

    def model_message(self, model: GlobalModel) -> bytes | bytearray:
        """The encoded model message, built once per version (the broadcast and every answer to a request)."""
        if self._payload[0] != model.sha256:
            self._payload = (model.sha256, encode(model))
        return self._payload[1]

    def answer(self, sender: str, request: ModelRequest, told: Collection[str]) -> None:
        """Send the round's model to ``sender`` alone, once per round, if its assignment names it."""
        if request.client_id != sender:
            raise InvalidField(f"model request on the topic of {sender!r} claims client id {request.client_id!r}")
        model = self.current
        if model is None or sender not in told or request.sha256 != model.sha256:
            raise OutOfRound(f"{sender} asks for model {request.sha256[:12]} (round {request.round}), which is not "
                             "the model of its assignment in the round in progress")  # fmt: skip
        if sender in self._answered:
            raise DuplicateMessage(f"{sender} was sent the model of round {model.round} once already")
        self._answered.add(sender)
        sent = self._publish(self.topics.down(sender), self.model_message(model))
        log.warning("round %d: %s did not get the model broadcast; sent it %d bytes on its own topic",
                    model.round, sender, sent)  # fmt: skip

    def lost(self, sender: str) -> None:
        """``sender`` was sent its assignment again (``server.delivery``): it may ask for the model once more."""
        self._answered.discard(sender)

    def clear(self) -> None:
        """Remove the retained frames at the end of a run: no device needs that model any more."""
        for i in range(self._frames):
            self._publish(self.topics.round_model_frame(i), b"", retain=True, chunked=False)
        self._frames = 0

    def take_bytes_out(self) -> int:
        """Bytes the server published through this module since the last call (one round's egress)."""
        out, self.bytes_out = self.bytes_out, 0
        return out

    def _publish(self, topic: str, payload: bytes | bytearray, *, retain: bool = False, chunked: bool = True) -> int:
        sent = self.link.publish(topic, payload, retain=retain, chunked=chunked)
        self.bytes_out += sent
        return sent
