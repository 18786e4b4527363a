"""One model per round: the global model goes out once for every device, each assignment only names it.

A round's assignments all start from the same model and share the arrays their contract declares ``scope="global"``
(SCAFFOLD's c, STEM's v_bar, TACO's Delta_t, FedACG's look-ahead model, which strategies set as the plan's weights).
Those travel once, as one ``GlobalModel`` named by its sha256, published frame by frame on the job's round-model
topics (``Topics.round_model_frame(i)``, retained, so a broker that keeps retained messages can hand a device that
connects mid-round the whole model); a version is published once however many rounds start from it. Each assignment
carries its plan as the strategy made it (``edge_client.wire.plan.Plan``, never copied), the round's facts naming the
model by version and digest, the shared arrays' names it uses and the arrays meant for that client alone. Nothing
depends on the retained copy (an ejabberd cluster does not share it across nodes, docs/scaling.md): a device that did
not get the model asks (``ModelRequest``) and is sent it on its own topic, once per round, and once more if it lost its
assignment, never more than ``RESENDS_PER_ROUND`` times whatever it asks (``server.rate_limits``). The server's egress
is counted here, per round.

With ``train.downlink_codec = "int8"`` (``server.downlink``) the broadcast carries the int8-coded difference from the
previous version instead, and the model it names is the one devices rebuild from it: a device that holds the previous
version applies the difference and checks the digest; one that does not, or whose check fails, asks, and is sent the
full model on its own topic. The broadcast is counted once in the round's egress.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection

import numpy as np

from edge_client.algorithms.contract import Contract
from edge_client.wire import chunking
from edge_client.wire.messages import Assignment, GlobalModel, ModelRequest, RoundFacts, model_digest
from edge_client.wire.plan import Plan
from edge_client.wire.protocol import DuplicateMessage, InvalidField, OutOfRound, encode
from edge_client.wire.topics import Topics
from edge_client.wire.transport import Link
from server.downlink import Downlink
from server.rate_limits import RESENDS_PER_ROUND, RateLimited

log = logging.getLogger("edgefl.server")


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a is b or (a.shape == b.shape and bool(np.array_equal(a, b)))


#: Per client: the names of the round model's shared arrays its plan uses, and its plan's arrays for it alone.
Shares = dict[str, tuple[list[str], dict[str, np.ndarray]]]


def split_round(
    contract: Contract, round_: int, version: int, weights: np.ndarray, plans: dict[str, Plan], run_id: str = ""
) -> tuple[GlobalModel, Shares]:
    """The round's ``GlobalModel`` (the plans' start model: ``weights`` unless a plan names its own, and their arrays
    of scope "global"), and per client what its assignment carries of its plan's arrays (``Shares``).

    Raises ValueError when the strategy gave clients of one round different start models or shared arrays.
    """
    shared_names = {a.name for a in contract.sends if a.scope == "global"}
    start = next(iter(plans.values())).weights
    start = weights if start is None else start
    shared: dict[str, np.ndarray] = {}
    shares: Shares = {}
    for cid, plan in plans.items():
        if not _same(weights if plan.weights is None else plan.weights, start):
            raise ValueError(f"{contract.name}: clients of round {round_} start from different models")
        uses = sorted(shared_names & plan.arrays.keys())
        for name in uses:
            if not _same(shared.setdefault(name, plan.arrays[name]), plan.arrays[name]):
                raise ValueError(f"{contract.name}: array {name!r} of scope 'global' differs between clients")
        shares[cid] = uses, {k: v for k, v in plan.arrays.items() if k not in shared_names}
    return GlobalModel(round_, version, model_digest(start, shared), start, shared, run_id=run_id), shares


class Distribution:
    """Publishes each round's model once and the assignments that name it; answers devices that missed it."""

    def __init__(self, link: Link, topics: Topics, contract: Contract, downlink: Downlink | None = None) -> None:
        self.link = link
        self.topics = topics
        self.contract = contract
        self.downlink = downlink or Downlink("fp32", 0)  # fp32: the broadcast is the model itself
        self.current: GlobalModel | None = None  # the model of the round in progress (as devices hold it)
        self.message: GlobalModel | None = None  # what broadcasts it (the model, or its difference from the last)
        self.bytes_out = 0  # since the last take_bytes_out()
        self._payload: tuple[str, bytes | bytearray] = ("", b"")  # a message's id and its frame, encoded once
        self._published = ""  # sha256 of the model last broadcast by this server
        self._frames = 0  # frames of the last broadcast, retained: cleared at the end
        self._answered: set[str] = set()  # clients sent the current model on request, and not lost since
        self._sends: Counter[str] = Counter()  # models sent to each client on request this round
        self.requested_bytes: dict[str, int] = {}  # per client: bytes of models sent on request this round
        self.model_bytes = 0  # this round's broadcast (0: its version went out before) beside each assignment
        self.broadcast = ""  # what it carried: "model", "difference" (from the last version) or "" (nothing new)
        self._shares: Shares = {}  # what each assignment of the round carries of its plan's arrays

    def split(self, round_: int, version: int, weights: np.ndarray, plans: dict[str, Plan], run_id: str) -> str:
        """``split_round``, the model kept as ``current`` (what a device that missed it is sent) and its broadcast as
        ``message``; the sha256 of the model as devices hold it, what the round's facts name."""
        start, self._shares = split_round(self.contract, round_, version, weights, plans, run_id)
        self.current, self.message = self.downlink.publish(start)
        return self.current.sha256

    def publish(self, round_: int, version: int, weights: np.ndarray, plans: dict[str, Plan], run_id: str) -> str:
        """Publish the round's model (``split``; unless this version went out already); its sha256 as devices hold
        it ("" without plans)."""
        self._answered.clear()
        self._sends.clear()
        self.requested_bytes.clear()
        if not plans:
            return ""
        sha256 = self.split(round_, version, weights, plans, run_id)
        assert self.message is not None
        new = sha256 != self._published
        self.model_bytes = self._broadcast(self.message) if new else 0
        self.broadcast = ("difference" if self.message.diff_base else "model") if new else ""
        return sha256

    def send(self, plans: dict[str, Plan], facts: dict[str, RoundFacts]) -> dict[str, tuple[Assignment, int]]:
        """Every client's assignment, after ``publish``: its plan as the strategy made it and its round's facts, with
        its own arrays and the names of the shared ones; per client the assignment as sent and its bytes."""
        sent = {}
        for cid, plan in plans.items():
            uses, own = self._shares[cid]
            a = Assignment(plan, facts[cid], arrays=own, global_arrays=uses)
            sent[cid] = a, self._publish(self.topics.down(cid), encode(a))
        return sent

    def _broadcast(self, model: GlobalModel) -> int:
        """Frame ``i`` retained on its own topic: one topic would keep only the last chunk of a chunked model."""
        payload, self._published = self.model_message(model), model.sha256
        size = self.link.chunk_size()
        frames = chunking.split(payload, size) if size else [payload]
        for i, frame in enumerate(frames):
            self._publish(self.topics.round_model_frame(i), frame, retain=True, chunked=False)
        self._clear(len(frames))  # a shorter message (a difference) leaves no older frames retained behind it
        self._frames = len(frames)
        what = f"difference from {model.diff_base[:12]}" if model.diff_base else "model"
        log.info("round %d: %s %s broadcast once: %d bytes in %d frames", model.round, what, model.sha256[:12],
                 len(payload), len(frames))  # fmt: skip
        return len(payload)

    def model_message(self, model: GlobalModel) -> bytes | bytearray:
        """The encoded message, built once (the broadcast; the full model for every answer to a request)."""
        if self._payload[0] != model.msg_id:
            self._payload = (model.msg_id, encode(model))
        return self._payload[1]

    def answer(self, sender: str, request: ModelRequest, told: Collection[str]) -> None:
        """Send the round's model to ``sender`` alone if its assignment names it: once, and once more after it lost
        its assignment, at most ``RESENDS_PER_ROUND`` times a round."""
        if request.client_id != sender:
            raise InvalidField(f"model request on the topic of {sender!r} claims client id {request.client_id!r}")
        model = self.current
        if model is None or sender not in told or request.sha256 != model.sha256:
            raise OutOfRound(f"{sender} asks for model {request.sha256[:12]} (round {request.round}), which is not "
                             "the model of its assignment in the round in progress")  # fmt: skip
        if sender in self._answered:
            raise DuplicateMessage(f"{sender} was sent the model of round {model.round} once already")
        if self._sends[sender] >= RESENDS_PER_ROUND:
            raise RateLimited(f"{sender} was sent the model of round {model.round} {self._sends[sender]} times "
                              "already; no more this round")  # fmt: skip
        self._answered.add(sender)
        self._sends[sender] += 1
        sent = self._publish(self.topics.down(sender), self.model_message(model))
        self.requested_bytes[sender] = self.requested_bytes.get(sender, 0) + sent
        log.warning("round %d: %s did not get the model broadcast; sent it %d bytes on its own topic",
                    model.round, sender, sent)  # fmt: skip

    def lost(self, sender: str) -> None:
        """``sender`` was sent its assignment again (``server.delivery``): it may ask for the model once more."""
        self._answered.discard(sender)

    def clear(self) -> None:
        """Remove the retained frames at the end of a run: no device needs that model any more."""
        self._clear(0)
        self._frames = 0

    def _clear(self, first: int) -> None:
        for i in range(first, self._frames):
            self._publish(self.topics.round_model_frame(i), b"", retain=True, chunked=False)

    def take_bytes_out(self) -> int:
        """Bytes the server published through this module since the last call (one round's egress)."""
        out, self.bytes_out = self.bytes_out, 0
        return out

    def _publish(self, topic: str, payload: bytes | bytearray, *, retain: bool = False, chunked: bool = True) -> int:
        sent = self.link.publish(topic, payload, retain=retain, chunked=chunked)
        self.bytes_out += sent
        return sent
