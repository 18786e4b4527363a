"""The device's view of the run (edge_client/loop/session.py) and the server's answers (server/delivery.py), driven
message by message: which stop and assignment a device obeys, when it sends an update again, when it asks for its
assignment, and what the server answers to a repeat or a resync."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from edge_client.loop.session import RESEND_FIRST_S, Session
from edge_client.wire.messages import (
    Ack,
    Assignment,
    Chunk,
    Hello,
    Message,
    Presence,
    Resync,
    Stop,
    Update,
    model_digest,
)
from edge_client.wire.protocol import InvalidField, decode, encode
from edge_client.wire.topics import Topics
from edgefl_testkit.messages import make_update, round_assignment
from server.admission import RoundState
from server.delivery import Delivery


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def assignment(run_id: str, round_: int, deadline_s: float = 60.0) -> Assignment:
    """As the server sends it: naming its round's model (``server.distribution``)."""
    weights = np.zeros(3, np.float32)
    return round_assignment(round_, weights, {}, run_id=run_id, deadline_s=deadline_s, model_version=round_,
                            sha256=model_digest(weights, {}))  # fmt: skip


def online(run_id: str) -> Presence:
    return Presence("server", True, role="server", run_id=run_id)


def update(run_id: str, round_: int) -> Update:
    return make_update("c0", np.zeros(3), round=round_, run_id=run_id)


# -------------------------------------------------------------------------------------------------- the device side
def test_a_stop_ends_only_the_run_the_device_takes_part_in(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="edge_client")
    s = Session()
    assert not s.stop(Stop("training finished", run_id="old"))  # replayed from the session of a device that was away
    assert "ignoring the server's stop of run old (training finished): this device has not joined it" in caplog.text
    s.server(online("new"))
    assert s.admit(assignment("new", 1))
    assert not s.stop(Stop("training finished", run_id="old"))
    assert s.stop(Stop("training finished", run_id="new"))
    assert not s.admit(assignment("new", 2))  # the run it left: a late assignment of it is ignored
    assert "that run has ended" in caplog.text


def test_an_assignment_waits_until_the_device_knows_the_current_run() -> None:
    s = Session()
    early, newer = assignment("old", 4), assignment("cur", 1)
    assert not s.admit(early) and not s.admit(newer)  # session messages arrive before the retained presence
    assert s.server(online("cur")) is newer  # only the newest waits; it is then judged like any other
    assert s.admit(newer) and not s.admit(assignment("old", 5))


def test_an_unacknowledged_update_is_sent_again_until_the_server_answers_or_the_deadline_passes() -> None:
    clock = Clock()
    s = Session(clock)
    s.server(online("r"))
    assert s.admit(assignment("r", 1, deadline_s=200.0))
    u = update("r", 1)
    s.sent(u, b"frame", 200.0)
    assert s.due() is None  # just sent
    s.connected(session_present=False, hello="h1")
    assert s.due() == b"frame"  # after a reconnect at once
    assert s.due() is None
    clock.now += RESEND_FIRST_S
    assert s.due() == b"frame"  # on the timer
    assert s.server(online("r")) is None and s.due() == b"frame"  # the server announced itself again
    s.acked(Ack(of=u.msg_id, accepted=True, round=1, run_id="r"))
    clock.now += 1000
    assert s.pending is None and s.due() is None
    s.sent(update("r", 1), b"again", 200.0)
    clock.now += 300  # past the round's deadline: nothing more is sent
    assert s.due() is None and s.pending is None


def test_the_device_asks_for_its_assignment_when_it_lost_its_session_until_the_server_answered() -> None:
    s = Session()
    s.connected(session_present=True, hello="h1")
    assert s.ask()  # a new process has no assignment, whatever the broker kept
    assert not s.ask()  # once per trigger
    s.sending("q1", "resync")
    s.acked(Ack(of="q1", accepted=True, run_id="r"))
    s.connected(session_present=True, hello="h2")
    assert not s.ask()  # answered, and the broker kept the session
    s.connected(session_present=False, hello="h3")
    assert s.ask() and s.since == "h3"


def test_acks_of_messages_this_process_did_not_send_are_not_news() -> None:
    s = Session()
    s.acked(Ack(of="someone-elses", accepted=True, run_id="old"))  # replayed from an earlier process's session
    assert s.told is None


# -------------------------------------------------------------------------------------------------- the server side
class Recorder:
    """A link that keeps what is published (decoded), by topic."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Message]] = []

    def publish(self, topic: str, payload: bytes | bytearray, retain: bool = False) -> int:
        msg = decode(payload)
        assert not isinstance(msg, Chunk)
        self.sent.append((topic, msg))
        return len(payload)


def delivery() -> tuple[Delivery, Recorder, Topics]:
    link, topics = Recorder(), Topics("job")
    return Delivery(link, topics), link, topics  # type: ignore[arg-type]


def test_a_repeat_is_answered_with_the_first_verdict() -> None:
    d, link, topics = delivery()
    u = update("r", 1)
    d.answer("c0", u, "r", None, InvalidField("delta: wrong length"))
    assert d.repeat("c0", u.msg_id) and not d.repeat("c0", "unknown") and not d.repeat("c1", u.msg_id)
    (t1, first), (t2, again) = link.sent
    assert t1 == t2 == topics.down("c0")
    assert isinstance(first, Ack) and isinstance(again, Ack)
    assert (first.of, first.accepted, first.reason, first.round) == (u.msg_id, False, "invalid_field", 1)
    assert (again.of, again.accepted, again.reason, again.detail) == (first.of, False, first.reason, first.detail)
    assert again.msg_id != first.msg_id  # a new message, or the device's transport would drop it as a repeat


def test_a_lost_assignment_is_sent_again_only_when_the_device_cannot_have_it() -> None:
    d, link, _ = delivery()
    state = RoundState(round=2, model_version=2, selected={"c0"})
    hello = Hello(client_id="c0", num_samples=4, device={})
    d.answer("c0", hello, "r", state, None)  # the hello that opened the device's connection
    a = assignment("r", 2)
    d.assigned(2, "c0", a)  # went out after that hello: the device has it on that connection
    resent = lambda: [m for _, m in link.sent if isinstance(m, Assignment)]  # noqa: E731
    d.resend("c0", Resync("c0", since=hello.msg_id, round=1, run_id="r"), "r", state)
    assert not resent()
    d.resend("c0", Resync("c0", since="", round=2, run_id="r"), "r", state)  # it served this very round
    assert not resent()
    d.resend("c0", Resync("c0", since="", round=1, run_id="r"), "r", state)  # its hello never arrived: lost
    assert len(resent()) == 1 and encode(resent()[0]) == encode(a)
    later = Hello(client_id="c0", num_samples=4, device={})
    d.answer("c0", later, "r", state, None)  # a new connection after the assignment went out
    d.resend("c0", Resync("c0", since=later.msg_id, round=1, run_id="r"), "r", state)
    assert len(resent()) == 2
    state.received["c0"] = update("r", 2)
    d.resend("c0", Resync("c0", since="", round=1, run_id="r"), "r", state)  # it reported already
    assert len(resent()) == 2
