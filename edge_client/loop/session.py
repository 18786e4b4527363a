"""The run a device serves, kept apart from the training it does: which run is current, what waits until the device
knows it, which report the server has not answered yet, and whether to ask for the round's assignment again.

The device learns the current run from the server, never from its own memory: from the server's presence (retained,
and published again on every server (re)connect) and from the server's ack to a message this process sent (acks of
an earlier process, replayed from the broker session, are not taken for news). Messages kept in the broker session
arrive right after CONNACK, before the retained presence: an assignment that arrives before the device knows the
current run waits for it, then is served or ignored with a log line. A stop ends the device's run only when it is for
the run this process takes part in (the server of that run acknowledged it, or it served one of that run's
assignments), so an old stop kept in the session of a device that was offline when its run ended is logged and
ignored.

An update (or a failure report) stays pending until the server's ack: it is sent again after every reconnect, when the
server announces itself again, and on a timer (10 s, doubling up to 60 s) until the round's deadline. The server
answers a repeat with the verdict it gave the first and never aggregates twice. A device whose process just started,
or whose broker session was lost, asks for the round's assignment (``Resync``) on connecting and again whenever the
server announces itself, until the server answered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from edge_client.wire.messages import Ack, Assignment, Failure, Presence, Stop, Update

log = logging.getLogger(__name__)

RESEND_FIRST_S = 10.0  # the first timed re-send of an unanswered report; then doubling
RESEND_MAX_S = 60.0
REMEMBER = 64  # ids of the messages this process sent, to tell their acks from replayed ones


@dataclass
class Pending:
    """A report the server has not answered: its identity, its frame as sent, and when to send it again."""

    what: str  # "update" or "failure"
    run_id: str
    round: int
    msg_id: str
    payload: bytes | bytearray
    until: float  # the round's deadline, on this device's monotonic clock
    next_at: float
    interval: float


class Session:
    """One device process's view of the run (see the module docstring). ``connected`` runs on the link's network
    thread; everything else on the device's main thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.told: str | None = None  # the run the server says is current (None: not told yet)
        self.joined: str | None = None  # the run this process takes part in
        self.left: str | None = None  # the run this process left on its stop
        self.held: Assignment | None = None  # arrived before the device knew the current run
        self.pending: Pending | None = None
        self._assigned_at = clock()  # when the assignment being served arrived: its deadline counts from there
        self._sent: OrderedDict[str, str] = OrderedDict()  # msg id -> its type, of what this process sent
        self._lock = threading.Lock()
        self._want_assignment = True  # a process starts without one
        self.since = ""  # the hello that opened the current connection (what the server sent after it, we have)
        self._ask_now = False
        self._resend_now = False
        self._connections = 0  # broker connections of this process so far
        #: (connection, run) of the last registration the server accepted: a device says hello on every connect and
        #: every server announcement, and logs only a registration that is news
        self._registration: tuple[int, str] | None = None

    # -- triggers ------------------------------------------------------------------------------------------------
    def connected(self, session_present: bool, hello: str) -> None:
        """Every (re)connect, where ``hello`` is the id of the hello it sends first: re-send what is unanswered, and
        ask for the assignment if the session (or the process) is new."""
        self.sending(hello, "hello")
        with self._lock:
            self._connections += 1
            self.since = hello
            self._want_assignment |= not session_present
            self._ask_now = self._want_assignment
            self._resend_now = True

    def server(self, presence: Presence) -> Assignment | None:
        """The server's presence: online, it names the current run and may have lost what we sent it; returns an
        assignment that waited for the run to be known (judge it with ``admit``)."""
        if not presence.online:
            return None
        with self._lock:
            self._ask_now = self._want_assignment
            self._resend_now = True
        return self._tell(presence.run_id)

    def sending(self, msg_id: str, what: str) -> None:
        """This process sends message ``msg_id`` (a ``what``) to the server: its ack will be news."""
        self._sent[msg_id] = what
        while len(self._sent) > REMEMBER:
            self._sent.popitem(last=False)

    # -- answers and control messages ----------------------------------------------------------------------------
    def acked(self, ack: Ack) -> Assignment | None:
        """The server's answer to something this process sent; returns an assignment that waited for the run."""
        what = self._sent.get(ack.of)
        if what is None:
            log.debug("ignoring an ack of message %s, which this process did not send", ack.of)
            return None
        released = self._tell(ack.run_id)
        p = self.pending
        if p is not None and ack.of == p.msg_id:
            self.pending = None
            if ack.accepted:
                log.info("round %d: the server accepted the %s", p.round, p.what)
            else:
                log.warning("round %d: the server refused the %s (%s): %s", p.round, p.what, ack.reason, ack.detail)
        elif what == "hello":
            if ack.accepted:
                self._registered(ack)
            else:
                log.warning("the server refused this device's registration (%s): %s", ack.reason, ack.detail)
        elif what == "resync":
            with self._lock:
                self._want_assignment = False  # the server has answered: it sent the assignment first, if one was due
        if ack.accepted and ack.run_id != self.left:
            self.joined = ack.run_id
        return released

    def _registered(self, ack: Ack) -> None:
        """Log a registration once, and a new one with its reason; a repeat (the hello that answers the server's
        announcement, of the same run on the same connection) only at debug level."""
        now, before = (self._connections, ack.run_id), self._registration
        self._registration = now
        if before is None:
            log.info("registered with the server (run %s, round %d)", ack.run_id, ack.round)
        elif now[0] != before[0]:
            log.info("registered with the server again after reconnecting (run %s, round %d)", ack.run_id, ack.round)
        elif now != before:
            log.info("registered with the server again for its new run %s (was %s, round %d)",
                     ack.run_id, before[1], ack.round)  # fmt: skip
        else:
            log.debug("the server confirmed this device's registration (run %s): it had announced itself", ack.run_id)

    def _tell(self, run_id: str) -> Assignment | None:
        if run_id != self.told:
            if self.told is not None:
                log.info("the server's run is now %s (it was %s)", run_id, self.told)
            self.told = run_id
            if self.joined not in (None, run_id):
                self.joined = None
            if self.pending is not None and self.pending.run_id != run_id:
                log.warning("round %d of run %s: dropping the unanswered %s: the server's run is now %s",
                            self.pending.round, self.pending.run_id, self.pending.what, run_id)  # fmt: skip
                self.pending = None
        held, self.held = self.held, None
        return held

    def admit(self, a: Assignment) -> bool:
        """Whether to serve ``a`` now: an assignment of the current run. Before the device knows the run it waits
        (the newest one only); of another run, or of the run this device left, it is logged and ignored."""
        facts = a.facts
        if self.told is None:
            if self.held is not None:
                held = self.held.facts
                log.info("round %d of run %s: replaced by a newer assignment", held.round, held.run_id)
            log.info("round %d of run %s: held until the server says which run is current", facts.round, facts.run_id)
            self.held = a
            return False
        if facts.run_id != self.told or facts.run_id == self.left:
            why = f"the server's current run is {self.told}" if facts.run_id != self.told else "that run has ended"
            log.warning("ignoring an assignment of run %s (round %d): %s", facts.run_id, facts.round, why)
            return False
        self.joined, self._assigned_at = facts.run_id, self.clock()
        with self._lock:
            self._want_assignment = False
        p = self.pending
        if p is not None and facts.round >= p.round:  # the server moved on: that round is closed
            log.info("round %d: no answer to the %s before round %d began", p.round, p.what, facts.round)
            self.pending = None
        return True

    def stop(self, s: Stop) -> bool:
        """True when ``s`` ends the run this process takes part in; a stop of any other run is logged and ignored."""
        if self.joined is None or s.run_id != self.joined:
            now = f"this device is in run {self.joined}" if self.joined else "this device has not joined it"
            log.warning("ignoring the server's stop of run %s (%s): %s", s.run_id, s.reason, now)
            return False
        log.info("run %s ended: %s", s.run_id, s.reason)
        self.left, self.joined, self.pending, self.held = self.joined, None, None, None
        return True

    # -- what the main loop sends ----------------------------------------------------------------------------------
    def sent(self, report: Update | Failure, payload: bytes | bytearray, deadline_s: float) -> None:
        """``report`` goes to the server now: pending until its ack, re-sent until the round's deadline."""
        now = self.clock()
        self.sending(report.msg_id, report.TYPE)
        with self._lock:
            self._resend_now = False  # a trigger before this send is answered by this send
        self.pending = Pending(report.TYPE, report.run_id, report.round, report.msg_id, payload,
                               self._assigned_at + deadline_s, now + RESEND_FIRST_S, RESEND_FIRST_S)  # fmt: skip

    def due(self) -> bytes | bytearray | None:
        """The pending report's frame when it is to be sent again: after a reconnect, on the server's return, or by
        its timer; None otherwise (and once the round's deadline passed without an answer)."""
        with self._lock:
            resend, self._resend_now = self._resend_now, False
        p, now = self.pending, self.clock()
        if p is None:
            return None
        if now > p.until:
            log.warning("round %d: no answer to the %s by the round's deadline; not sending it again", p.round, p.what)
            self.pending = None
            return None
        if not resend and now < p.next_at:
            return None
        if not resend:
            p.interval = min(2 * p.interval, RESEND_MAX_S)
        p.next_at = now + p.interval
        log.info("round %d: sending the %s again (no answer from the server yet)", p.round, p.what)
        return p.payload

    def ask(self) -> bool:
        """Whether to ask the server for the round's assignment now (``Resync``)."""
        with self._lock:
            due, self._ask_now = self._ask_now and self._want_assignment, False
        return due
