"""The buffered loop (``train.mode = "buffered"``): no round waits for the slowest device.

Up to ``train.concurrency`` devices train at once (0: every online one). The ``round`` of an assignment, and of the
update that answers it, is the aggregation step in progress when it went out (so a device's rounds never go back, as
its runtime expects, and a fleet profile that throttles from round R does so from step R); its ``model_version`` the
version the device was sent. A device has one assignment in progress at a time. Its update passes admission against
that assignment (``server.admission``: run, round, version, steps, samples, norms, codec, contract), then its
staleness ``s`` (versions made since the one it trained on) is checked against ``train.max_staleness`` (refused as
``staleness``, counted) and it is folded into the buffer scaled by ``w(s)`` (``server.buffered.staleness``). Once
``train.buffer_size`` updates are in, the strategy's step, times ``train.server_lr``, makes the next version: one
aggregation step, one metrics row (``round`` is the step; ``updates`` lists each update with the step it was assigned
in, its version, staleness and weight), one checkpoint. A device is sent its next assignment, with the newest version,
as soon as its update was answered (accepted or refused), or when it failed, or asked for an assignment it does not
hold (``Resync`` after a lost session: it is given the newest model rather than its old one); the devices idle longest
go first. A device that goes offline keeps its assignment (its broker session may still bring the update, weighted or
refused by its staleness) but no longer counts towards the concurrency. Each new version is broadcast once
(``server.distribution``, ``train.downlink_codec``); a repeated update is answered again, never folded twice
(``server.delivery``).

A run resumed from its checkpoint after step S starts at step S + 1, and no update in the checkpoint's model is
aggregated again: each of them answers an assignment of a step <= S, and the new process only admits updates
answering an assignment it has in progress, of a step > S (the older ones are refused as ``out_of_round`` and their
devices sent new assignments). An update of a step after S that the dead process had taken is not in the checkpoint's
model: it is lost, or admitted once if its device sends it again while an assignment of that step and version is in
progress.

Built from the synchronous orchestrator's parts (``server.orchestrator``): its roster, its recorder, its admission,
distribution and policies; ``BufferedDispatch`` is ``server.dispatch`` with what differs for updates, failures,
resyncs and the sender budget.

The clock: over a broker, every time is the server's wall clock. In-process, devices run one after another, so the
updates are held on the discrete-event clock (``server.buffered.clock``) and released in the order a fleet of those
profiles would deliver them; ``parallel_elapsed_s`` and the timeline are on that clock.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from edge_client.wire.messages import Failure, Hello, Message, Resync, Update
from edge_client.wire.protocol import MAX_HEADER_BYTES, InvalidField, OutOfRound, ProtocolError
from server.admission import RoundState
from server.buffered.clock import EventClock
from server.buffered.staleness import server_step, staleness_of, staleness_weight, weighted
from server.checkpoint import pack_state
from server.dispatch import Dispatch
from server.evaluation import EvaluationWorker
from server.fleet_summary import device_class
from server.orchestrator import Orchestrator
from server.recorder import Produced
from server.strategies.base import assignment_summary

log = logging.getLogger("edgefl.server")
REMEMBER_HELLOS = 8  # per device: a Resync names the hello of its current connection, one of its newest
#: The summed fields of a device's updates in a step's ``clients`` entry.
SUMMED = ("download_s", "upload_s", "compute_s", "overhead_s", "cpu_s", "local_steps", "bytes_up", "bytes_down")


class BufferedDispatch(Dispatch):
    """``server.dispatch`` for the buffered loop: an update is admitted against its device's own assignment in
    progress and its staleness; a refused update, a failure or a lost assignment frees the device for the newest
    model; in-process, updates wait on the event clock."""

    loop: BufferedOrchestrator

    def handle(self, topic: str, msg: Message) -> None:
        sender = self.topics.sender_of(topic)
        if isinstance(msg, Hello) and sender is not None:  # what goes out after it reaches the device
            self.loop.heard(sender, msg.msg_id)
        super().handle(topic, msg)

    def sender_budget(self, topic: str) -> int:
        """One update of the model's size, for a device with an assignment in progress."""
        if self.topics.sender_of(topic) not in self.loop.outstanding:
            return 0
        return MAX_HEADER_BYTES + 4 * self.loop.num_params * (1 + len(self.loop.strategy.contract.returns))

    def accept(self, topic: str, sender: str, update: Update) -> None:
        loop, record = self.loop, self.roster.known(sender)
        state = loop.outstanding.get(sender)
        try:
            if record is None and sender in self.roster.clients:
                raise OutOfRound(f"{sender} was refused at registration ({self.roster.clients[sender].refused})")
            if state is None or state.round != update.round:
                raise OutOfRound(
                    f"update from {sender} for an assignment of step {update.round}, which is not its assignment in "
                    f"progress ({state.round if state else 'none'}); discarded"
                )
            registered = record.num_samples if record else None
            norm = loop.admission.check(sender, update, state, registered, self.roster.run_id)
            t = loop.config.train
            staleness = staleness_of(sender, update.model_version, loop.version, t.max_staleness)
        except ProtocolError as exc:
            self._update_refused(sender, update.round, exc)
            raise
        self.times.arrived(sender)
        bytes_up = loop.held_bytes.pop(sender, None)
        self.codecs.observe(sender, update.metrics)
        loop.admitted(update, norm, staleness, self.link.take_bytes_in(topic) if bytes_up is None else bytes_up)

    def _update_refused(self, sender: str, round_: int, exc: ProtocolError) -> None:
        """Its refused update ends the device's assignment: it is sent the newest model next."""
        state = self.loop.outstanding.get(sender)
        if state is not None and state.round == round_:
            self.loop.release(sender, f"rejected: {exc.reason}")

    def _failed(self, sender: str, failure: Failure) -> None:
        if failure.client_id != sender:
            raise InvalidField(f"failure on the topic of {sender!r} claims client id {failure.client_id!r}")
        state = self.loop.outstanding.get(sender)
        log.warning("%s could not serve its assignment of step %d (%s: %s)", sender, failure.round, failure.reason,
                    failure.detail)  # fmt: skip
        if state is not None and state.round == failure.round:
            self.loop.release(sender, failure.reason)

    def _resync(self, sender: str, resync: Resync) -> None:
        """A device that lost its assignment is given the newest model, not its old assignment again. It has not
        lost one that went out after the hello of its current connection (``resync.since``): that one reaches it."""
        if resync.client_id != sender:
            raise InvalidField(f"resync on the topic of {sender!r} claims client id {resync.client_id!r}")
        loop = self.loop
        state = loop.outstanding.get(sender)
        if state is None or (resync.run_id, resync.round) == (self.roster.run_id, state.round):
            return
        hello_at = loop.hellos.get(sender, {}).get(resync.since)
        if hello_at is not None and loop.sent_at.get(sender, 0.0) > hello_at:
            return
        log.info("%s lost its assignment of step %d; it is sent the newest model", sender, state.round)
        loop.release(sender)

    def pump(self, timeout: float) -> None:
        """Over a broker: the next message. In-process: an update is held on the event clock; once the bus is idle
        (every device training has placed its own), the earliest is handled."""
        clock = self.loop.clock
        if clock is None:
            super().pump(timeout)
            return
        received = self.link.receive(0.0)
        if received is not None:
            if not self._hold(*received):
                self.handle(*received)
            return
        if not len(clock):  # the bus is idle and nothing is on the clock: no device can make progress
            raise RuntimeError(
                f"in-process: no device has work and the buffer holds {len(self.loop.entries)} of "
                f"{self.loop.config.train.buffer_size} updates (failed: {self.loop.failed})"
            )
        self.handle(*clock.pop().payload)

    def _hold(self, topic: str, msg: Message) -> bool:
        """In-process: put an update of an assignment in progress on the event clock (False: handle it now)."""
        loop, clock = self.loop, self.loop.clock
        assert clock is not None
        sender = self.topics.sender_of(topic)
        state = loop.outstanding.get(sender or "")
        if not isinstance(msg, Update) or sender is None or state is None or state.round != msg.round:
            return False
        if sender not in clock.waiting():
            return False  # a repeat of one already placed: answered as a repeat
        loop.held_bytes[sender] = up = self.link.take_bytes_in(topic)
        link = self.times.links.get(sender)
        down_s, up_s = link.transfer_s(loop.told[sender]["bytes_down"], up) if link else (0.0, 0.0)
        clock.place(sender, down_s, msg.compute_s, up_s, payload=(topic, msg))
        return True


class BufferedOrchestrator(Orchestrator):
    """The buffered loop of the module docstring, over the synchronous orchestrator's roster, recorder, admission,
    distribution and policies."""

    dispatch_class = BufferedDispatch

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.outstanding: dict[str, RoundState] = {}  # device -> its assignment in progress (round: the step then)
        self.told: dict[str, dict[str, Any]] = {}  # device -> what its newest assignment said, with its bytes down
        self.started_at: dict[str, float] = {}  # device -> when its assignment went out, on the run's clock
        self.sent_at: dict[str, float] = {}  # device -> when its assignment in progress went out (monotonic)
        self.hellos: dict[str, OrderedDict[str, float]] = {}  # device -> its newest hellos' ids, when they came
        self.idle_since: dict[str, int] = {}  # device -> when its last assignment ended: the idle longest go first
        self.step_norms: dict[str, float] = {}  # device -> |delta| / steps of its newest admitted update
        self.entries: list[dict[str, Any]] = []  # the buffer: one row per admitted update
        self.failed: dict[str, str] = {}  # this step's devices that could not serve, by reason
        self.held_bytes: dict[str, int] = {}  # in-process: the upload bytes of an update held on the clock
        self.step = 0  # the aggregation step in progress
        self._ended = 0
        self._broadcast_bytes = 0  # the newest version's broadcast (the model, or its difference)
        self._start = 0.0
        self.weights: np.ndarray | None = None
        super().__init__(*args, **kwargs)
        self.dispatch: BufferedDispatch
        self.clock = EventClock() if self.times.modelled else None  # in-process: the event clock

    # -- the run's clock ---------------------------------------------------------------------------------------------
    def _now(self) -> float:
        return self.clock.now if self.clock is not None else time.monotonic() - self._start

    # -- assignments -------------------------------------------------------------------------------------------------
    def _window(self) -> None:
        """``current`` as the dispatch reads it: the devices with an assignment in progress (model requests, the
        bookkeeping of a device refused at registration); the admission of updates goes by each device's own."""
        state = RoundState(self.step, self.version, set(self.outstanding))
        state.assigned_steps = {cid: s.assigned_steps[cid] for cid, s in self.outstanding.items()}
        state.failed = self.failed
        self.current = state

    def _fill(self) -> None:
        """Send every idle online device its next assignment, the idle longest first, up to the concurrency."""
        limit = self.config.train.concurrency or len(self.clients)
        busy = sum(1 for cid in self.outstanding if self.roster.is_online(cid))
        idle = sorted((c for c in self.available() if c not in self.outstanding),
                      key=lambda c: (self.idle_since.get(c, -1), c))  # fmt: skip
        for cid in idle[: max(0, limit - busy)]:
            self._assign_one(cid)
        self._window()

    def _assign_one(self, cid: str) -> None:
        assert self.weights is not None
        step = self.step
        plan = self.strategy.assign(step, cid)
        plan.steps = steps = self.steps_policy.steps(cid, plan.steps)
        sha256 = self.distribution.publish(step, self.version, self.weights, {cid: plan}, self.run_id)  # once a version
        state = RoundState(step, self.version, {cid}, assigned_steps={cid: steps},
                           deadline_s=self.config.clients.round_deadline_s)  # fmt: skip
        facts = self.assignments.facts(self.strategy, state, cid, sha256, self.run_id)
        size = self.distribution.send({cid: plan}, {cid: facts})[cid][1]
        if self.distribution.model_bytes:  # this version's broadcast, which every device it goes to downloads
            self._broadcast_bytes = self.distribution.model_bytes
        self.outstanding[cid] = state
        self.times.sent(cid)
        self.sent_at[cid] = time.monotonic()
        self.started_at[cid] = self._now()
        if self.clock is not None:
            self.clock.started(cid)
        down = size + self._broadcast_bytes
        self.told[cid] = {**assignment_summary(plan, facts), **self.codecs.describe(cid), "bytes_down": down}
        log.info("step %d: %s trains %d steps from model version %d", step, cid, steps, self.version)

    def release(self, cid: str, why: str = "") -> None:
        """``cid``'s assignment in progress ended (its update was answered, it failed, or it lost it)."""
        if self.outstanding.pop(cid, None) is not None:
            self._ended += 1
            self.idle_since[cid] = self._ended
            if why:
                self.failed[cid] = why
        if self.clock is not None:
            self.clock.forget(cid)
        self._window()

    def heard(self, cid: str, hello_id: str) -> None:
        """A hello of ``cid``: an assignment that goes out after it reaches the device on that connection."""
        hellos = self.hellos.setdefault(cid, OrderedDict())
        hellos[hello_id] = time.monotonic()
        while len(hellos) > REMEMBER_HELLOS:
            hellos.popitem(last=False)

    def admitted(self, update: Update, norm: float, staleness: int, bytes_up: int) -> None:
        """Fold an admitted update into the buffer, its delta scaled by its staleness weight; its device is free."""
        t, cid = self.config.train, update.client_id
        weight = staleness_weight(t.staleness_weight, staleness, t.staleness_exponent)
        assert self.folding is not None
        kept = self.strategy.fold(self.folding, weighted(update, weight), norm * weight)
        self.step_norms[cid] = norm / update.local_steps
        bytes_down = self.told.get(cid, {}).get("bytes_down", 0) + self.distribution.requested_bytes.pop(cid, 0)
        phases = self.times.record(update.round, update, bytes_down, bytes_up)
        record = self.clients.get(cid)
        self.entries.append({
            "client": cid, "update_id": update.msg_id, "assigned_in": update.round,
            "model_version": update.model_version, "staleness": staleness, "weight": weight,
            "started_s": self.started_at.get(cid, 0.0), "arrived_s": self._now(),
            "device_class": device_class(record.device if record else {}), "download_s": phases["download_s"],
            "upload_s": phases["upload_s"], "compute_s": kept.compute_s,
            "overhead_s": min(kept.overhead_s, kept.compute_s), "cpu_s": kept.cpu_s, "local_steps": kept.local_steps,
            "num_samples": kept.num_samples, "train_loss": kept.train_loss, "bytes_up": bytes_up,
            "bytes_down": bytes_down, "device": update.metrics,
        })  # fmt: skip
        self.release(cid)
        log.info("step %d: %s reported %d steps on version %d (staleness %d, weight %.3f); buffer %d/%d",
                 self.step, cid, update.local_steps, update.model_version, staleness, weight, len(self.entries),
                 t.buffer_size)  # fmt: skip

    # -- the loop -----------------------------------------------------------------------------------------------------
    def _train(self, weights: np.ndarray, elapsed_s: float, evaluations: EvaluationWorker | None) -> np.ndarray:
        """The aggregation steps: keep every idle device training, aggregate each ``buffer_size`` updates, record."""
        t = self.config.train
        self._start = time.monotonic() - elapsed_s
        rows = self.recorder.metrics.rows
        if self.clock is not None and rows:
            self.clock.now = rows[-1].get("parallel_elapsed_s", 0.0)
        self.weights = weights
        self.times.round_started()
        for step in range(self.last_round + 1, self.config.run.rounds + 1):
            self.step = step
            self.folding = self.strategy.begin(step, self.weights)  # devices train on: an update may come any time
            self.entries, self.failed = [], {}
            if self.on_round is not None:
                self.on_round(step)
            self.dispatch.limits.new_round()
            t0, clock0 = time.monotonic(), self._now()
            self.live.round_started(step, t0 - self._start, self.told)  # each device's newest instructions
            while len(self.entries) < t.buffer_size:
                if not self.available():
                    self.wait_for_clients(1)
                self._fill()
                self.dispatch.pump(1.0)
            folding, self.folding = self.folding, None
            t_agg, c_agg = time.monotonic(), time.thread_time()
            before = self.weights
            new, dropped = self._aggregate(step, before, folding)
            self.weights = server_step(before, new, t.server_lr) if dropped is None else before
            self.version += dropped is None
            # the next relative norm bound: the median over devices of each one's newest norm per step, as a round's
            # is over its devices (the last K updates are mostly the fastest devices')
            self.admission.close(RoundState(step, self.version, set(), step_norms=dict(self.step_norms)))
            aggregate_cpu_s = time.thread_time() - c_agg
            if self.clock is not None:
                self.clock.advance(aggregate_cpu_s)  # the devices waiting for the new version wait for this
            done = time.monotonic()
            timing = {"elapsed_s": done - self._start, "round_s": done - t0, "assign_s": 0.0,
                      "aggregate_s": done - t_agg, "assign_cpu_s": 0.0, "aggregate_cpu_s": aggregate_cpu_s}  # fmt: skip
            row = self._row(step, timing, clock0, dropped)
            evaluation = (
                evaluations.submit(self.weights, self.strategy.outputs(self.weights))
                if evaluations is not None and self.federated.due(step) else None
            )  # fmt: skip
            for cid in [c for c, record in self.clients.items() if record.refused]:
                self.release(cid)  # forgotten with its assignment: assigned afresh if it returns
            self.roster.forget_refused()
            if self.recorder.produced(Produced(row, self.weights, self.version, pack_state(self.strategy), evaluation)):
                break
        self.current = None
        self.recorder.finish()
        return self.weights

    def _row(self, step: int, timing: dict[str, float], clock0: float, dropped: str | None) -> dict[str, Any]:
        """The aggregation step's metrics row; ``clients`` sums each device's updates of the step, so the run's
        compute, traffic and per-class figures read as they do for rounds."""
        clients: dict[str, dict[str, Any]] = {}
        for e in self.entries:
            c = clients.setdefault(e["client"], {"device_class": e["device_class"], "num_samples": e["num_samples"],
                                                 "updates": 0, **dict.fromkeys(SUMMED, 0)})  # fmt: skip
            c["updates"] += 1
            for key in SUMMED:
                c[key] += e[key]
            c["train_loss"], c["device"] = e["train_loss"], e["device"]
        row: dict[str, Any] = {
            "round": step,
            "mode": "buffered",
            "model_version": self.version,
            **timing,
            "clients_selected": len(self.outstanding) + len(clients),
            "clients_reported": len(clients),
            "missing": [],
            "failed": dict(self.failed),
            "slowest_compute_s": max((e["compute_s"] for e in self.entries), default=0.0),
            "deadline_s": self.config.clients.round_deadline_s,
            "predictions": {},
            "bytes_out": self.distribution.take_bytes_out(),
            "broadcast": self.distribution.broadcast,
            "updates": [{k: v for k, v in e.items() if k != "device"} for e in self.entries],
            "staleness": [e["staleness"] for e in self.entries],
            "clients": clients,
            "train_only": [],
            "instructions": {},
            "rejected": self.recorder.rejected_since(),
            "excluded": sorted(self.strategy.excluded()),
            "algorithm": self.strategy.round_metrics(),
        }
        if self.clock is not None:  # the event clock: when a fleet of these profiles would have made this version
            row["parallel_elapsed_s"] = self.clock.now
            row["parallel_round_s"] = self.clock.now - clock0
        if dropped:
            row["dropped"] = dropped
        return row
