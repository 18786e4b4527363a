"""Dispatch: what the server does with each message a device sends, whichever loop serves the run.

Every message passes the sender's rate limit (``server.rate_limits``), is answered again rather than processed twice
when it is a repeat (``server.delivery``), and has what decoding dropped from its free-form maps counted; then it goes
to the roster (hello, presence), the round in progress (update, failure), the distribution (model request, resync) or
the evaluation and compute bookkeeping. A message refused anywhere is logged with its sender, counted by reason,
answered, and the run goes on.

Every update passes ``server.admission`` (the round's bookkeeping and the algorithm's contract) before it can reach
the strategy, and is folded into the strategy's running sums at once (only its scalars are kept), so the server does
not hold a round's updates. A sender may hold at most the bytes of one legitimate update of this round in partial
chunked messages and in the link's queue, so a flood from one device cannot crowd out another's upload. An update the
link refused as it was decoded ends the wait for it like one refused by admission.

The loop it serves is read at every message through ``Loop``, so a loop (or a test) may open a round or swap its
strategy between two messages.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from edge_client.wire.messages import (
    ComputeReport,
    Evaluation,
    Failure,
    Hello,
    Message,
    ModelRequest,
    Presence,
    Resync,
    Update,
)
from edge_client.wire.protocol import (
    MAX_HEADER_BYTES,
    DuplicateMessage,
    InvalidField,
    OutOfRound,
    ProtocolError,
    dropped_entries,
)
from edge_client.wire.topics import Topics
from edge_client.wire.transport import Link
from server.admission import Admission, RoundState
from server.codec_policy import CodecPolicy
from server.compute_reports import ComputeReports
from server.deadlines import DeviceTimes
from server.delivery import Delivery
from server.distribution import Distribution
from server.federated_eval import FederatedEvaluation
from server.live_state import LiveState
from server.rate_limits import RateLimited, RateLimits
from server.roster import Roster
from server.secagg import FROM_DEVICES as SECURE_MESSAGES
from server.secagg import StageRefused
from server.strategies import Strategy
from server.strategies.base import Round

if TYPE_CHECKING:  # imported when a run turns secure aggregation on: it needs the cryptography package
    from server.secagg.stages import SecureRounds

log = logging.getLogger("edgefl.server")


class Loop(Protocol):
    """What dispatch reads of the loop it serves, at every message."""

    current: RoundState | None  # the round whose updates are admitted (None: between rounds)
    folding: Round | None  # its aggregation, fed as updates are admitted
    strategy: Strategy
    admission: Admission
    num_params: int
    secure: SecureRounds | None  # [privacy] secure_aggregation: its stages take their messages


class Dispatch:
    """Handles each message from a device: checks, routes, answers. Holds the per-device message bookkeeping (rate
    limits, acks and repeats, compute reports) and takes over the link's sender budget and refusal hooks."""

    def __init__(
        self,
        loop: Loop,
        link: Link,
        topics: Topics,
        roster: Roster,
        live: LiveState,
        *,
        distribution: Distribution,
        times: DeviceTimes,
        federated: FederatedEvaluation,
        codecs: CodecPolicy,
    ) -> None:
        self.loop = loop
        self.link = link
        self.topics = topics
        self.roster = roster
        self.live = live
        self.distribution = distribution
        self.times = times
        self.federated = federated
        self.codecs = codecs
        self.limits = RateLimits()  # per device and control message kind (server.rate_limits)
        self.delivery = Delivery(link, topics)  # acks, repeated answers, assignments sent again
        self.reports = ComputeReports()  # what clients told to train without uploading spent
        link.limit_senders(self.sender_budget)
        link.on_refused(self.refused)

    def pump(self, timeout: float) -> None:
        """Handle the next message, waiting up to ``timeout`` seconds for one."""
        received = self.link.receive(timeout)
        if received is not None:
            self.handle(*received)

    def handle(self, topic: str, msg: Message) -> None:
        sender = self.topics.sender_of(topic)
        self.live.heard(sender)
        if sender is not None:
            try:
                self.limits.check(sender, msg.TYPE)
            except RateLimited as exc:  # dropped before any work: not handled, not answered
                self.link.reject(topic, exc)
                self.live.rejected(sender, exc.reason)
                return
        if sender is not None and self.delivery.repeat(sender, msg.msg_id):
            return  # answered again, never processed twice
        for drop in dropped_entries(msg):  # what decoding dropped from its free-form maps: counted, it goes on
            self.link.reject(topic, drop)
            self.live.rejected(sender, drop.reason)
        error: ProtocolError | None = None
        state, run_id = self.loop.current, self.roster.run_id
        try:
            if sender is None:
                raise InvalidField(f"message on unexpected topic {topic!r}")
            if isinstance(msg, Hello):
                self.roster.register(sender, msg, state)
            elif isinstance(msg, Presence):
                self.roster.presence(sender, msg)
            elif isinstance(msg, Update):
                self.accept(topic, sender, msg)
            elif isinstance(msg, Failure):
                self._failed(sender, msg)
            elif isinstance(msg, ModelRequest):
                self.distribution.answer(sender, msg, state.assigned_steps if state else ())
            elif isinstance(msg, ComputeReport):
                entry = self.reports.take(sender, msg, run_id)
                self.times.record_compute(msg.round, sender, msg.compute_s, msg.local_steps)
                log.info("round %d: %s trained %d steps without uploading, compute %.3f s", entry["round"], sender,
                         msg.local_steps, msg.compute_s)  # fmt: skip
            elif isinstance(msg, Evaluation):
                record = self.roster.known(sender)
                self.federated.check(sender, msg, record.eval_samples if record else 0, run_id)
            elif isinstance(msg, Resync):
                self._resync(sender, msg)
            elif self.loop.secure is not None and isinstance(msg, SECURE_MESSAGES):
                self.loop.secure.take(sender, msg)
            else:
                raise InvalidField(f"clients may not send {type(msg).__name__.lower()} messages")
        except ProtocolError as exc:
            self.link.reject(topic, exc)
            self.live.rejected(sender, exc.reason)
            error = exc
        if sender is not None:
            self.delivery.answer(sender, msg, run_id, state, error)

    def sender_budget(self, topic: str) -> int:
        """Bytes of chunked messages ``topic``'s sender may have in flight: one update of this round, if it owes one."""
        sender, state = self.topics.sender_of(topic), self.loop.current
        if sender is None or state is None or sender not in state.selected or sender in state.received:
            return 0
        arrays = 1 + len(self.loop.strategy.contract.returns)
        return MAX_HEADER_BYTES + 4 * self.loop.num_params * arrays

    def accept(self, topic: str, sender: str, update: Update) -> None:
        """Admit ``sender``'s update and fold it into the round's aggregation, or raise why it is refused."""
        loop, record = self.loop, self.roster.known(sender)
        state = loop.current
        try:
            if record is None and sender in self.roster.clients:
                raise OutOfRound(f"{sender} was refused at registration ({self.roster.clients[sender].refused}) "
                                 "this round")  # fmt: skip
            if loop.secure is not None:  # a plain update would bypass the masking: it never reaches the strategy
                raise StageRefused(f"{sender} sent a plain update to a run with secure aggregation")
            registered = record.num_samples if record else None
            norm = loop.admission.check(sender, update, state, registered, self.roster.run_id)
        except ProtocolError as exc:
            self._update_refused(sender, update.round, exc)
            raise
        assert state is not None and loop.folding is not None  # admission refuses updates outside a round
        self.times.arrived(sender)
        state.received[sender] = loop.strategy.fold(loop.folding, update, norm)  # its vectors are not kept
        state.bytes_up[sender] = self.link.take_bytes_in(topic)
        self.codecs.observe(sender, update.metrics)
        log.info(
            "round %d: %s reported %d steps, compute %.3f s, cpu %.3f s, loss %.4f",
            state.round,
            sender,
            update.local_steps,
            update.compute_s,
            update.cpu_s,
            update.train_loss,
        )

    def refused(self, stream: str, exc: ProtocolError) -> None:
        """The link's hook for a frame it refused in decoding (``Inbox.on_refused``)."""
        sender = self.topics.sender_of(stream)
        if sender is None:
            return
        if isinstance(exc, DuplicateMessage) and exc.msg_id:
            self.delivery.repeat(sender, exc.msg_id)
        elif exc.of_type == Update.TYPE and exc.of_round is not None:
            self._update_refused(sender, exc.of_round, exc)

    def _update_refused(self, sender: str, round_: int, exc: ProtocolError) -> None:
        """An update of ``sender`` for ``round_`` refused: when it was the one the round waits for, stop waiting (the
        device sends one update a round; a refused one would otherwise hold the round to its deadline)."""
        state = self.loop.current
        if state is not None and round_ == state.round and sender in state.selected and sender not in state.received:
            state.failed.setdefault(sender, f"rejected: {exc.reason}")

    def _failed(self, sender: str, failure: Failure) -> None:
        if failure.client_id != sender:
            raise InvalidField(f"failure on the topic of {sender!r} claims client id {failure.client_id!r}")
        state = self.loop.current
        if self.federated.failed(sender, failure.round, failure.reason):
            log.warning("round %d: %s cannot evaluate (%s: %s)", failure.round, sender, failure.reason, failure.detail)
            return
        if state is None or failure.round != state.round or sender not in state.selected:
            log.warning("%s could not serve round %d (%s: %s)", sender, failure.round, failure.reason, failure.detail)
            return
        if sender not in state.received:
            state.failed[sender] = failure.reason
            log.warning(
                "round %d: %s cannot serve its assignment (%s: %s); not waiting for it",
                state.round, sender, failure.reason, failure.detail,
            )  # fmt: skip

    def _resync(self, sender: str, resync: Resync) -> None:
        if resync.client_id != sender:
            raise InvalidField(f"resync on the topic of {sender!r} claims client id {resync.client_id!r}")
        if self.delivery.resend(sender, resync, self.roster.run_id, self.loop.current):
            self.distribution.lost(sender)  # it may have lost the round's model with its assignment
