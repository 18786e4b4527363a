"""Hostile-device fuzzer: the real orchestrator on a real mosquitto with two honest devices and one hostile device
whose every round hypothesis draws.

test_fuzz.py fuzzes the decoder alone; this drives what comes after it. Each hypothesis example is one federation (a
``RuleBasedStateMachine``): the server, two honest devices that answer every assignment with a zero update and every
evaluation request with a valid report, and a hostile device that registers like them and then, each round, sends any
message a device can put on its topic (every client message, the server's own, chunks, raw bytes) with fields drawn
from adversarial values: extreme, tiny and negative numbers, NaN and Inf (msgpack carries them), bytes, nested maps,
wrong types, missing and unknown fields, other devices' ids, stale and future rounds; each message once, repeated
with the same id, or in a burst. It sends them between rounds, on its assignment and on its evaluation request, then
closes its round with an update or a failure report so that no round has to wait for its deadline. A step of the
state machine is one round; shrinking gives the shortest sequence of rounds that breaks the run.

After every round: the round closed (the run did not end with an exception); every line of ``metrics.jsonl`` is
strict JSON (NaN and Infinity refused); the checkpointed model is finite; both honest updates are in the round's
aggregate; every refusal in the row has a specific reason, and every refusal the server acknowledged to the hostile
device is counted; ``live.json`` is strict JSON and shows the round. After the run: ``summary.json`` is strict JSON,
counts every round and every refusal.

Devices evaluate (``[eval] mode = "clients"``): a round's row is then written as soon as the round closes, so the
state machine can hold the server between rounds (it keeps receiving there), and evaluation reports are fuzzed too.

``EDGEFL_FUZZ_EXAMPLES`` sets the number of federations (default 5, for the suite's time; a release check runs 2000),
each of up to ``ROUNDS`` hostile rounds.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from edge_client.wire.messages import (
    Ack,
    Assignment,
    Chunk,
    ComputeReport,
    Evaluate,
    Evaluation,
    Failure,
    Hello,
    Message,
    ModelRequest,
    Presence,
    Refusal,
    Resync,
    RoundFacts,
    Stop,
    Update,
    new_msg_id,
)
from edge_client.wire.plan import Plan
from edge_client.wire.protocol import encode
from edge_client.wire.transport import LinkConfig
from edgefl_testkit.fakes import FakeDevice, zero_update
from server.broker import Broker
from server.config import from_dict
from server.datasets import load_dataset
from server.orchestrator import Orchestrator

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("EDGEFL_FUZZ_EXAMPLES", "5"))  # federations; the long mode sets thousands
ROUNDS = 10  # the most hostile rounds in one federation
HONEST = ("fuzz-honest-0", "fuzz-honest-1")
HOSTILE = "fuzz-hostile"
SAMPLES, EVAL_SAMPLES = 50, 20  # what every device registers with
ROUND_DEADLINE_S, EVAL_DEADLINE_S = 10.0, 3.0  # ceilings: the devices answer at once
BURST = 40
REASON_RE = re.compile(r"[a-z_]{1,32}")


# ------------------------------------------------------------------------------------------------ strict JSON
def _refuse(constant: str) -> Any:
    raise ValueError(f"not strict JSON: {constant}")


def strict_json(text: str) -> Any:
    """``text`` parsed as JSON that a browser's JSON.parse also reads: NaN, Infinity and -Infinity are refused."""
    return json.loads(text, parse_constant=_refuse)


# ----------------------------------------------------------------------------------- what the hostile device sends
#: Wire names of the fields of each message type the hostile device sends, as it may corrupt them.
CLIENT_FIELDS: dict[str, tuple[str, ...]] = {
    "hello": ("client_id", "num_samples", "device", "model", "eval_samples"),
    "update": ("round", "model_version", "client_id", "num_samples", "local_steps", "compute_s", "cpu_s",
               "train_loss", "metrics", "extras", "run"),
    "failure": ("round", "client_id", "reason", "detail", "run"),
    "presence": ("client_id", "online", "role", "reason", "model", "fingerprint", "run"),
    "model_request": ("round", "client_id", "sha256", "run"),
    "compute": ("round", "client_id", "local_steps", "compute_s", "cpu_s", "run"),
    "evaluation": ("round", "client_id", "num_samples", "loss", "metrics", "eval_s", "cpu_s", "run"),
    "resync": ("client_id", "since", "round", "run"),
}  # fmt: skip
SERVER_FIELDS: dict[str, tuple[str, ...]] = {  # the server's own messages, which a device may not send
    "stop": ("reason", "run"),
    "ack": ("of", "accepted", "round", "reason", "run"),
    "assignment": ("plan", "facts", "globals"),
    "refusal": ("client_id", "reason", "detail"),
    "chunk": ("of", "i", "n", "size", "cs", "sha256"),
}
INTS = {"round", "model_version", "num_samples", "local_steps", "eval_samples", "i", "n", "size", "cs"}
FLOATS = {"compute_s", "cpu_s", "train_loss", "loss", "eval_s", "lr"}
BOOLS = {"online", "accepted"}
MAPS = {"device", "model", "metrics", "extras", "plan", "facts"}  # maps on the wire
UNKNOWN_FIELD = "zz"


class Missing:
    """A field left out of the message."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING = Missing()

#: Keys the server reads from free-form maps (device facts, update metrics, evaluation metrics, the stated model).
KEYS = ("accuracy", "loss", "auc", "mae", "rmse", "round", "before", "time", "last_upload", "bytes", "upload_s",
        "peak_rss_mb", "temperature_c_before", "cpu_freq_mhz_after", "throttled_flags", "device_class", "machine",
        "cpu_count", "hostname", "digest", "layout", "error", "codec")  # fmt: skip
ints = st.sampled_from((0, 1, 2, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**64 - 1, 10**7, 10**15, -1, -(2**63)))
ints |= st.integers(-(2**63), 2**64 - 1)  # what msgpack carries
floats = st.sampled_from((0.0, -0.0, 5e-324, 1e-310, 1e-6, 0.5, 1.0, 1e6, -1e6, 1e15, 1e300, 1.7976931348623157e308,
                          -1e308, math.nan, math.inf, -math.inf)) | st.floats()  # fmt: skip
texts = st.sampled_from(("", "\x00", "é", "x" * 5000, "0" * 64, *HONEST, HOSTILE, "server")) | st.text(max_size=16)
blobs = st.sampled_from((b"", b"\x00", b"\xff" * 64)) | st.binary(max_size=16)
scalars = st.one_of(ints, floats, texts, blobs, st.booleans(), st.none())
keys = st.sampled_from(KEYS) | st.text(max_size=8)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=8,
)
maps = st.dictionaries(keys, values, min_size=1, max_size=6)


def field_value(name: str) -> st.SearchStrategy[Any]:
    """Mostly a value of the field's own wire type, so that the message gets past the decoder; else anything."""
    typed = (
        ints if name in INTS else floats if name in FLOATS else st.booleans() if name in BOOLS
        else maps if name in MAPS else texts
    )  # fmt: skip
    return st.one_of(typed, typed, typed, typed, values)


@dataclass(frozen=True)
class Action:
    """One message of the hostile device: a valid ``kind`` for the round ``round_offset`` away with ``fields`` (wire
    names) replaced, sent ``repeat`` times (with one id or new ones); ``raw`` bytes are sent as they are."""

    kind: str
    fields: dict[str, Any]
    round_offset: int = 0
    delta: str = "zero"  # an update's delta: zero, small, large (under the norm bound), huge, nan, inf, short
    repeat: int = 1
    same_id: bool = False
    raw: bytes = b""


def _action(kind: str) -> st.SearchStrategy[Action]:
    """Messages of ``kind`` that are valid but for one or two fields: mostly a value of the field's type (free-form
    maps five times as often as other fields), sometimes a field missing or one the type does not have."""
    names = CLIENT_FIELDS.get(kind) or SERVER_FIELDS[kind]
    weighted = [n for n in names for _ in range(5 if n in MAPS else 1)]
    typed = st.sampled_from(weighted).flatmap(lambda n: st.tuples(st.just(n), field_value(n)))
    odd = st.sampled_from(names).map(lambda n: (n, MISSING)) | st.tuples(st.just(UNKNOWN_FIELD), values)
    deltas = ("zero",) * 4 + ("small", "large", "huge", "nan", "inf", "short") if kind == "update" else ("zero",)
    return st.builds(
        Action,
        kind=st.just(kind),
        fields=st.lists(st.one_of(typed, typed, typed, odd), min_size=1, max_size=2).map(dict),
        round_offset=st.sampled_from((0,) * 6 + (-1, 1)),
        delta=st.sampled_from(deltas),
        repeat=st.sampled_from((1, 1, 1, 2, 3, BURST)),
        same_id=st.booleans(),
    )


def _actions(*favoured: str) -> st.SearchStrategy[Action]:
    """Any message, ``favoured`` kinds (what the phase's round takes) more often than all other device messages."""
    return st.one_of(
        *(st.sampled_from(favoured).flatmap(_action) for _ in range(6)),
        *(st.sampled_from(sorted(CLIENT_FIELDS)).flatmap(_action) for _ in range(4)),
        st.sampled_from(sorted(SERVER_FIELDS)).flatmap(_action),
        st.builds(Action, kind=st.just("raw"), fields=st.just({}), raw=st.binary(max_size=64)),
    )


@dataclass(frozen=True)
class RoundPlan:
    """What the hostile device sends in one round, and how it ends its part of the round."""

    early: tuple[Action, ...]  # between rounds, before the round's assignment
    train: tuple[Action, ...]  # on its assignment
    evaluation: tuple[Action, ...]  # on its evaluation request
    closes_with: str  # "update" (aggregated) or "failure"
    evaluates_with: str  # "evaluation" or "failure"


plans = st.builds(
    RoundPlan,
    early=st.lists(_actions("hello", "presence", "resync"), max_size=3).map(tuple),
    train=st.lists(_actions("update", "hello"), max_size=4).map(tuple),
    evaluation=st.lists(_actions("evaluation", "hello"), max_size=4).map(tuple),
    closes_with=st.sampled_from(("update", "failure")),
    evaluates_with=st.sampled_from(("evaluation", "failure")),
)


@dataclass(frozen=True)
class Context:
    """What a device knows of the round it answers."""

    round: int
    version: int
    run_id: str
    sha256: str
    size: int
    steps: int


def honest_hello(client_id: str) -> Hello:
    """How every device of the fuzz registers: its training samples and a held-out split."""
    return Hello(client_id, SAMPLES, {"hostname": client_id}, eval_samples=EVAL_SAMPLES)


def honest_report(round_: int, client_id: str, run_id: str) -> Evaluation:
    """A valid evaluation of the round's model on a device's held-out split."""
    return Evaluation(round_, client_id, EVAL_SAMPLES, 0.5, {"accuracy": 0.5}, 0.01, 0.01, run_id)


def _delta(kind: str, size: int) -> np.ndarray:
    fill = {"zero": 0.0, "small": 1e-3, "large": 9e3 / math.sqrt(size), "huge": 3e38, "nan": math.nan,
            "inf": math.inf}  # fmt: skip
    if kind == "short":
        return np.zeros(max(0, size - 1), np.float32)
    return np.full(size, fill[kind], np.float32)


def baseline(a: Action, ctx: Context) -> Message | Chunk:
    """The valid message of ``a.kind`` a device of this round would send (or the server's own message)."""
    r = max(0, ctx.round + a.round_offset)
    match a.kind:
        case "hello":
            return honest_hello(HOSTILE)
        case "update":
            d = _delta(a.delta, ctx.size)
            return Update(r, ctx.version, HOSTILE, SAMPLES, ctx.steps, 0.01, 0.01, 0.5, d, run_id=ctx.run_id)
        case "failure":
            return Failure(r, HOSTILE, "fuzz", "a hostile device's failure report", ctx.run_id)
        case "presence":
            return Presence(HOSTILE, True)
        case "model_request":
            return ModelRequest(r, HOSTILE, ctx.sha256, ctx.run_id)
        case "compute":
            return ComputeReport(r, HOSTILE, 1, 0.01, 0.01, ctx.run_id)
        case "evaluation":
            return honest_report(r, HOSTILE, ctx.run_id)
        case "resync":
            return Resync(HOSTILE, "", max(0, r - 1), ctx.run_id)
        case "stop":
            return Stop("fuzz", ctx.run_id)
        case "ack":
            return Ack(new_msg_id(), True, r, run_id=ctx.run_id)
        case "assignment":
            return Assignment(
                Plan(1, 0.1, 1),
                RoundFacts(
                    round=r,
                    model_version=ctx.version,
                    deadline_s=1.0,
                    algorithm="fedavg",
                    run_id=ctx.run_id,
                    sha256=ctx.sha256,
                ),
            )
        case "refusal":
            return Refusal(HOSTILE, "model", "fuzz")
        case "chunk":
            return Chunk(new_msg_id(), 0, 2, 8, 4, "0" * 64, b"\0" * 4)
    raise AssertionError(a.kind)


def patched(frame: bytes | bytearray, fields: dict[str, Any], msg_id: str) -> bytes:
    """``frame`` with its header's fields replaced or removed (as no encoder would write them) and id ``msg_id``."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(frame)
    header = unpacker.unpack()
    header["id"] = msg_id
    header["f"] = {k: v for k, v in {**header["f"], **fields}.items() if v is not MISSING}
    return msgpack.packb(header, use_bin_type=True) + bytes(frame[unpacker.tell() :])


def frames(a: Action, ctx: Context) -> list[bytes]:
    if a.kind == "raw":
        return [a.raw] * a.repeat
    frame = encode(baseline(a, ctx))
    if a.same_id:
        return [patched(frame, a.fields, new_msg_id())] * a.repeat
    return [patched(frame, a.fields, new_msg_id()) for _ in range(a.repeat)]


# ------------------------------------------------------------------------------------------------------ devices
class HonestDevice(FakeDevice):
    """A device that registers a held-out split, answers each assignment with a zero update and each evaluation
    request with a valid report."""

    def hello(self) -> None:
        self.link.publish(self.topics.up(self.client_id), encode(honest_hello(self.client_id)))

    def handle(self, msg: Message) -> bool:
        if isinstance(msg, Evaluate):
            report = honest_report(msg.round, self.client_id, msg.run_id)
            self.link.publish(self.topics.up(self.client_id), encode(report))
        return super().handle(msg)


class HostileDevice(HonestDevice):
    """Plays its current ``plan``: its train actions and closing message on each assignment, its evaluation actions
    and closing report on each evaluation request. Keeps every ack it gets."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plan = RoundPlan((), (), (), "update", "evaluation")
        self.context = Context(0, 0, "", "0" * 64, 0, 1)
        self.acks: dict[str, Ack] = {}
        self.acked = threading.Condition()

    def send(self, frames: Iterable[bytes | bytearray]) -> None:
        for frame in frames:
            self.link.publish(self.topics.up(self.client_id), frame)

    def play(self, actions: Iterable[Action], ctx: Context) -> None:
        for a in actions:
            self.send(frames(a, ctx))

    def train(self, a: Assignment) -> list[bytes | bytearray]:
        """``FakeDevice``'s ``respond``: the plan's train actions, then the closing update or failure report."""
        f, weights = a.facts, a.plan.weights
        assert weights is not None
        ctx = self.context = Context(f.round, f.model_version, f.run_id, f.sha256, weights.size, a.plan.steps)
        self.play(self.plan.train, ctx)
        if self.plan.closes_with == "update":
            return [encode(zero_update(a, HOSTILE, SAMPLES))]
        return [encode(Failure(f.round, HOSTILE, "fuzz", "closing the round", f.run_id))]

    def handle(self, msg: Message) -> bool:
        if isinstance(msg, Ack):
            with self.acked:
                self.acks[msg.of] = msg
                self.acked.notify_all()
            return True
        if isinstance(msg, Evaluate):
            ctx = Context(msg.round, msg.model_version, msg.run_id, self.context.sha256, msg.weights.size, 1)
            self.play(self.plan.evaluation, ctx)
            closing: Message = (
                honest_report(msg.round, HOSTILE, msg.run_id)
                if self.plan.evaluates_with == "evaluation"
                else Failure(msg.round, HOSTILE, "fuzz", "closing the evaluation", msg.run_id)
            )
            self.send([encode(closing)])
            return True
        return super().handle(msg)

    def register(self, timeout: float = 10.0) -> None:
        """Say an honest hello and wait for the server's answer (so whatever was sent before it has been handled)."""
        msg = honest_hello(HOSTILE)
        self.send([encode(msg)])
        with self.acked:
            self.acked.wait_for(lambda: msg.msg_id in self.acks, timeout)

    def refused(self) -> Counter[str]:
        """Refusals the server acknowledged, by reason: one per message id."""
        with self.acked:
            return Counter(a.reason for a in self.acks.values() if not a.accepted)


# --------------------------------------------------------------------------------------------------- federation
class Aborted(Exception):
    """Ends the server's run from the test (after a failed check): no summary is expected."""


GO, END, ABORT = "go", "end", "abort"


class Federation:
    """The server on its own thread, held between rounds (still receiving) until the test says go, end or abort."""

    def __init__(self, broker: Broker, model: dict[str, Any], out: Path) -> None:
        job = f"fuzz{uuid.uuid4().hex[:8]}"
        self.out = out / job
        config = from_dict(
            {
                "run": {"rounds": 10_000, "out": str(self.out), "job": job},  # ended by the test
                "clients": {"count": 3, "register_timeout_s": 60.0, "round_deadline_s": ROUND_DEADLINE_S},
                "data": {"dataset": "digits"},
                "train": {"local_steps": 2, "batch_size": 8, "lr": 0.1},
                "eval": {"mode": "clients", "deadline_s": EVAL_DEADLINE_S},
            }
        )
        link = LinkConfig(broker.url, broker.server.username, broker.server.password)
        self.orch = Orchestrator(config, link, None, model, self.out)
        self.orch.live.min_interval_s = 0.02  # live.json follows each round closely
        self.orch.observer = self
        self.orch.on_ready = self._hold
        record = self.orch.recorder.record

        def record_then_hold(*args: Any) -> bool:
            return record(*args) or self._hold()

        self.orch.recorder.record = record_then_hold  # type: ignore[method-assign]  # this instance only
        self.rows: queue.Queue[dict[str, Any]] = queue.Queue()
        self.commands: queue.Queue[str] = queue.Queue()
        self.held = threading.Event()
        self.error: BaseException | None = None
        self.summary: dict[str, Any] | None = None
        self.dirty = False  # the hostile device sent something since its last honest hello

        def device(cls: type[HonestDevice], cid: str, respond: Callable[[Assignment], list[bytes]]) -> Any:
            creds = broker.add_device(cid)
            return cls.over_mqtt(broker.url, cid, creds.password, job, cid, SAMPLES, respond)

        def zero(cid: str) -> Callable[[Assignment], list[bytes]]:
            return lambda a: [bytes(encode(zero_update(a, cid, SAMPLES)))]

        self.honest = [device(HonestDevice, cid, zero(cid)) for cid in HONEST]
        self.hostile: HostileDevice = device(HostileDevice, HOSTILE, lambda a: [])
        self.hostile.respond = self.hostile.train
        self.thread = threading.Thread(target=self._run, name=f"fuzz-server-{job}", daemon=True)

    # -- the server's thread
    def _run(self) -> None:
        try:
            self.summary = self.orch.run()
        except BaseException as exc:  # raised again on the test's thread
            self.error = exc

    def waiting(self, text: str) -> None:
        pass

    def round_done(self, row: dict[str, Any]) -> None:
        self.rows.put(row)

    def _hold(self) -> bool:
        """Between rounds: keep receiving until the test says go (False) or end (True)."""
        self.held.set()
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                self.orch.dispatch.pump(0.05)
                continue
            self.held.clear()
            if command == ABORT:
                raise Aborted
            return command == END

    # -- the test's thread
    def start(self, timeout: float = 60.0) -> Federation:
        for d in (*self.honest, self.hostile):
            d.start()
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.held.wait(0.05):  # held before round 1 once the three devices registered
            if not self.thread.is_alive():
                self._raise("the run ended before round 1")
            assert time.monotonic() < deadline, f"the devices did not register within {timeout:.0f} s"
        self.hostile.context = Context(0, 0, self.orch.run_id, "0" * 64, self.orch.num_params, 1)  # until assigned
        return self

    def _raise(self, what: str) -> None:
        if self.error is not None:
            raise self.error  # its own traceback: where the server failed
        raise AssertionError(what)

    def play(self, plan: RoundPlan) -> dict[str, Any]:
        """One round with the hostile device playing ``plan``; the round's metrics row."""
        if plan.early or self.dirty:
            self.hostile.play(plan.early, self.hostile.context)
            self.hostile.register()  # back to its honest registration before the round is assigned
        self.dirty = bool(plan.train or plan.evaluation)
        self.hostile.plan = plan
        self.commands.put(GO)
        deadline = time.monotonic() + ROUND_DEADLINE_S + EVAL_DEADLINE_S + 60.0
        while True:
            try:
                return self.rows.get(timeout=0.05)
            except queue.Empty:
                if not self.thread.is_alive():
                    self._raise("the run ended without closing the round")
                assert time.monotonic() < deadline, "the round did not close"

    def finish(self, command: str) -> None:
        """End the run (``END``: as after its last round) or abort it; stop the devices."""
        try:
            self.commands.put(command)
            self.thread.join(60.0)
            if command == END:
                assert not self.thread.is_alive(), "the run did not end"
                if self.error is not None:
                    raise self.error
        finally:
            for d in (*self.honest, self.hostile):
                d.stop()


# ------------------------------------------------------------------------------------------------------ checks
def check_round(fed: Federation, row: dict[str, Any]) -> None:
    """The invariants after every round."""
    r = row["round"]
    rows = [strict_json(line) for line in (fed.out / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in rows] == list(range(1, r + 1))
    row = rows[-1]
    with np.load(fed.out / "checkpoint.npz") as checkpoint:
        assert int(checkpoint["round"]) == r
        assert np.all(np.isfinite(checkpoint["weights"])), "the model is not finite"
    assert "dropped" not in row, row.get("dropped")
    assert set(HONEST) <= set(row["clients"]), f"honest updates not aggregated: {sorted(row['clients'])}"
    for reason, count in row["rejected"].items():
        assert REASON_RE.fullmatch(reason) and reason != "protocol" and isinstance(count, int) and count > 0, reason
    combined = row.get("client_eval", {})  # the devices' evaluation, weighted by their samples
    assert 0.0 <= combined.get("accuracy", 0.0) <= 1.0 and combined.get("loss", 0.0) >= 0.0, combined
    counted, refused = fed.orch.link.rejections, fed.hostile.refused()
    assert all(counted[reason] >= n for reason, n in refused.items()), f"refused {refused}, counted {counted}"
    live = fed.out / "live.json"
    deadline = time.monotonic() + 5.0
    while True:  # written by its own thread, a moment after the round
        state = strict_json(live.read_text())
        if state["run"]["round"] >= r:
            break
        assert time.monotonic() < deadline, f"live.json still shows round {state['run']['round']}, not {r}"
        time.sleep(0.02)


def check_summary(fed: Federation, rounds: int) -> None:
    """The invariants after the run."""
    summary = strict_json((fed.out / "summary.json").read_text())
    assert summary["rounds"] == rounds
    rows = [strict_json(line) for line in (fed.out / "metrics.jsonl").read_text().splitlines()]
    in_rows = sum((Counter(row["rejected"]) for row in rows), Counter())
    total, counted = Counter(summary["rejected"]), fed.orch.link.rejections  # total: the rows' and the refusals after
    assert in_rows <= total <= counted, f"rows {in_rows}, summary {total}, counted {counted}"
    assert strict_json((fed.out / "live.json").read_text())["run"]["finished"] is True


class HostileFederation(RuleBasedStateMachine):
    """One federation per example; each step is one round of the hostile device's plan."""

    def __init__(self, broker: Broker, model: dict[str, Any], out: Path) -> None:
        super().__init__()
        self.fed = Federation(broker, model, out).start()
        self.rounds = 0
        self.failed = False

    @rule(plan=plans)
    def round(self, plan: RoundPlan) -> None:
        self.failed = True  # until every check of the round passed
        check_round(self.fed, self.fed.play(plan))
        self.rounds += 1
        self.failed = False

    def teardown(self) -> None:
        if self.failed or self.rounds == 0:
            self.fed.finish(ABORT)
            return
        self.fed.finish(END)
        check_summary(self.fed, self.rounds)


@pytest.fixture(scope="module")
def digits_model() -> dict[str, Any]:
    return load_dataset("digits", seed=0).model


def test_hostile_device_cannot_end_steer_or_freeze_a_run(
    broker: Broker, digits_model: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)  # thousands of refusals: each is counted, the test reads the counts
    run_state_machine_as_test(
        lambda: HostileFederation(broker, digits_model, tmp_path),
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=ROUNDS,
            deadline=None,  # a round that does not close fails by its own timeout
            phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],  # no explain: slow
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        ),
    )
