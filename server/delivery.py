"""What the server owes each device besides the round loop: an answer to every message it sends, the same answer to a
repeat, and the round's assignment again when the device lost it.

Acknowledgements go end to end, not only to the broker: a broker that crashes before its snapshot loses what it had
acknowledged, so a device keeps its update until the server itself answers (``edge_client.loop.session``). The server
answers every hello, update, failure report and resync with an ``Ack`` (accepted, or refused with the reason code
counted in the metrics and its text), remembers the newest answers per device by message id, and answers a repeat
with the same verdict without processing it again: an update is never aggregated twice, and a lost ack costs one more
upload, not a round. A device that asks (``Resync``) gets its assignment of the current round again when it has not
answered it, and the assignment went out before the hello that opened the device's current connection (what went out
after that hello reached the device on that connection) and is not the newest one the device served; at most
``RESENDS_PER_ROUND`` times a round (``server.rate_limits``), whatever it asks.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import Any

from edge_client.wire.messages import Ack, Assignment, Failure, Hello, Message, Resync, Update
from edge_client.wire.protocol import ProtocolError, encode
from edge_client.wire.topics import Topics
from edge_client.wire.transport import Link
from server.admission import RoundState
from server.rate_limits import RESENDS_PER_ROUND, RateLimited

log = logging.getLogger("edgefl.server")

ANSWERED = (Hello, Update, Failure, Resync)  # what a device sends and waits to hear about
REMEMBER = 16  # answers kept per device: a device repeats only its newest messages


class Delivery:
    """Acks, repeated answers and re-sent assignments, on the orchestrator's link and topics."""

    def __init__(self, link: Link, topics: Topics) -> None:
        self.link = link
        self.topics = topics
        self._answers: dict[str, OrderedDict[str, Ack]] = {}  # device -> msg id -> the answer it was given
        self._heard: dict[str, OrderedDict[str, int]] = {}  # device -> hello msg id -> when it was answered
        self._assignments: dict[str, tuple[Assignment, int]] = {}  # this round's, by device, and when it went out
        self._resent: Counter[str] = Counter()  # this round's assignments sent again, by device
        self._round = 0
        self._tick = 0  # orders hellos and assignments: the orchestrator handles one thing at a time

    def answer(self, sender: str, msg: Message, run_id: str, state: RoundState | None, error: ProtocolError | None
               ) -> None:  # fmt: skip
        """Tell ``sender`` what became of ``msg`` (``error``: why it was refused) and remember it for a repeat."""
        if not isinstance(msg, ANSWERED):
            return
        round_ = msg.round if isinstance(msg, (Update, Failure)) else state.round if state else 0
        ack = Ack(of=msg.msg_id, accepted=error is None, round=round_, run_id=run_id)
        if error is not None:
            ack.reason, ack.detail = error.reason, str(error)[:2000]
        self._tick += 1
        _remember(self._answers.setdefault(sender, OrderedDict()), msg.msg_id, ack)
        if isinstance(msg, Hello) and error is None:
            _remember(self._heard.setdefault(sender, OrderedDict()), msg.msg_id, self._tick)
        self._send(sender, ack)

    def repeat(self, sender: str, msg_id: str) -> bool:
        """Answer a message ``sender`` already sent as it was answered then; False if it is not one we answered."""
        ack = self._answers.get(sender, {}).get(msg_id)
        if ack is None:
            return False
        log.info("%s sent message %s again (round %d): answered again, %s", sender, msg_id, ack.round,
                 "accepted" if ack.accepted else f"refused ({ack.reason})")  # fmt: skip
        self._send(sender, Ack(ack.of, ack.accepted, ack.round, ack.reason, ack.detail, ack.run_id))
        return True

    def _send(self, sender: str, ack: Ack) -> None:
        self.link.publish(self.topics.down(sender), encode(ack))

    def assigned(self, round_: int, client_id: str, assignment: Assignment) -> None:
        """Keep this round's assignment of ``client_id`` (with its message id) to send it again if it is lost."""
        if round_ != self._round:
            self._assignments, self._resent, self._round = {}, Counter(), round_
        self._tick += 1
        self._assignments[client_id] = (assignment, self._tick)

    def resend(self, sender: str, resync: Resync, run_id: str, state: RoundState | None) -> bool:
        """Send ``sender`` its assignment of the current round again, if it has one it has neither reported nor
        failed, and the device cannot have it: it went out before the device's current connection said hello (or
        that hello never arrived), and it is not the round the device says it served. True when it was sent; raises
        ``RateLimited`` when it was sent again ``RESENDS_PER_ROUND`` times this round already."""
        owed = state is not None and state.round == self._round and sender in self._assignments
        if not owed or sender in state.received or sender in state.failed:  # type: ignore[union-attr]
            return False
        assignment, sent_at = self._assignments[sender]
        hello_at = self._heard.get(sender, {}).get(resync.since)
        if (hello_at is not None and sent_at > hello_at) or (resync.run_id, resync.round) == (run_id, self._round):
            return False
        if self._resent[sender] >= RESENDS_PER_ROUND:
            raise RateLimited(f"round {self._round}: {sender} was sent its assignment again {self._resent[sender]} "
                              "times already; no more this round")  # fmt: skip
        self._resent[sender] += 1
        log.info("round %d: %s lost its assignment (it holds round %d of run %s); sending it again",
                 self._round, sender, resync.round, resync.run_id or "none")  # fmt: skip
        self.link.publish(self.topics.down(sender), encode(assignment))
        return True


def _remember(answers: OrderedDict[str, Any], key: str, value: Any) -> None:
    """Keep ``value`` under ``key``, and only the newest ``REMEMBER`` entries."""
    answers[key] = value
    while len(answers) > REMEMBER:
        answers.popitem(last=False)
