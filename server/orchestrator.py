"""The round loop over MQTT: register clients, select, assign, collect until a timer deadline, aggregate, evaluate.

Each round's model goes out once for every device (``server.distribution``); assignments only name it. Round t's model
is evaluated on the server's test set on a thread of its own while the clients train round t+1
(``server.evaluation.EvaluationWorker``): its metrics row, stamped with the time the model was produced, is written
with its checkpoint once that evaluation is done, so rows stay one per round and in order, and the round's time does
not include the evaluation. With ``run.stop_at_target`` the run therefore stops after the round that was training when
the target was seen. The devices' evaluation on their held-out splits (``server.federated_eval``) is collected right
after the aggregation, before round t+1 starts; a round evaluated by the devices alone is written at once.

The deadline is a real timer (the receive loop wakes at least once a second), so a client that died cannot stall a
round; a client whose last will says it went offline, or that reports it cannot serve its assignment, is not waited
for. Every update passes ``server.admission`` (the round's bookkeeping and the algorithm's contract) before it can
reach the strategy; what is refused is logged with the client id and counted by reason, and the round goes on. A
sender may hold at most the bytes of one legitimate update of this round in partial chunked messages and in the
link's queue, so a flood from one device cannot crowd out another's upload. Of what devices upload faster than the
loop takes it, the link holds 32 MiB in memory and the rest waits in a file in the run directory
(``edge_client.transport.Spool``), so the server's memory does not grow with the number of devices that upload at
once. An admitted update is folded into the strategy's running sums at once and only its scalars are kept, so the
server does not hold a round's updates; its sample weight is capped relative to the round's selected devices
(``clients.max_weight_share``, ``server.weight_share``). A device refused at registration while it serves a round (a
hello with another model) stays known, refused and offline, until that round closes, so no lookup of the round loses
it. An aggregate that is still not finite drops the round (the model stays as it
was, the strategy's state is restored): a run never ends because of what a client sent.

The deadline is ``clients.round_deadline_s``, or derived from what each selected client is predicted to need
(``clients.deadline_factor``, ``server.deadlines``); the steps each client is told may be fitted to a round budget
(``train.steps_policy``, ``server.steps_policy``). Each round's deadline and every prediction are recorded in its
metrics row. After every round the model and the strategy's state are checkpointed (``server.checkpoint``), so a
restarted server resumes.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from edge_client.data import ArrayDataset
from edge_client.messages import (
    ComputeReport,
    Evaluate,
    Evaluation,
    Failure,
    Hello,
    Message,
    ModelFile,
    ModelRequest,
    Presence,
    Refusal,
    Resync,
    RoundFacts,
    Stop,
    Update,
)
from edge_client.models import build_model, fingerprint, get_flat, layout_difference, parameter_layout
from edge_client.protocol import (
    MAX_HEADER_BYTES,
    DuplicateMessage,
    InvalidField,
    MessageTooLarge,
    OutOfRound,
    ProtocolError,
    dropped_entries,
    encode,
)
from edge_client.tasks import build_task
from edge_client.topics import Topics
from edge_client.transport import Link, LinkConfig, MqttLink
from server.admission import Admission, RoundState, WrongSampleCount
from server.checkpoint import Checkpoint, pack_state, unpack_state
from server.codec_policy import CodecPolicy
from server.compute_reports import ComputeReports
from server.config import RunConfig
from server.deadlines import DeviceTimes, round_deadline
from server.delivery import Delivery
from server.distribution import Distribution
from server.downlink import Downlink
from server.evaluation import EvaluationWorker, Evaluator, TestResult
from server.federated_eval import EvalRound, FederatedEvaluation
from server.fleet_summary import device_class, fleet_summary, parallel_round_s
from server.live_state import LiveState
from server.onnx_export import BackgroundExporter, export_onnx, read_sidecar
from server.rate_limits import RateLimited, RateLimits
from server.report import MetricsLog, client_summary, plot_report, summarize, write_summary
from server.steps_policy import StepsPolicy
from server.strategies import ServerContext, Strategy, TrainSettings, make_strategy
from server.strategies.base import Round, assignment_summary
from server.target import eval_mode, run_target
from server.timeline import plot_timeline
from server.weight_share import capped_counts

log = logging.getLogger("edgefl.server")
PRESENCE_REPLY_S = 10.0  # the least time between two presences sent to one device that registers without its model


class RoundObserver(Protocol):
    """Where the orchestrator reports progress (the console display, or nothing)."""

    def waiting(self, text: str) -> None: ...

    def round_done(self, row: dict[str, Any]) -> None: ...


class _Silent:
    def waiting(self, text: str) -> None:
        pass

    def round_done(self, row: dict[str, Any]) -> None:
        pass


@dataclass
class ClientRecord:
    client_id: str
    num_samples: int
    device: dict[str, Any] = field(default_factory=dict)
    online: bool = True
    eval_samples: int = 0  # the held-out split it evaluates on
    refused: str = ""  # why its last hello was refused: kept, offline, until the round it is part of closes


class ModelMismatch(InvalidField):
    """A device whose model's parameter layout is not the server's: refused at registration."""

    reason = "model"


@dataclass
class Produced:
    """A round's model as the round produced it, waiting for its evaluation: the metrics row so far, and what its
    checkpoint holds (the strategy's state packed right after the aggregation, before the next round changes it)."""

    row: dict[str, Any]
    weights: np.ndarray
    version: int
    state: dict[str, np.ndarray]
    evaluation: Future[TestResult] | None  # None: no test-set evaluation this round


class Orchestrator:
    def __init__(
        self,
        config: RunConfig,
        link_config: LinkConfig,
        evaluator: Evaluator | None,
        model_spec: dict[str, Any],
        out_dir: Path,
        *,
        observer: RoundObserver | None = None,
        summary_extra: dict[str, Any] | None = None,
        root: ArrayDataset | None = None,
        link: Link | None = None,
        times: DeviceTimes | None = None,
    ) -> None:
        self.config = config
        self.model_spec = model_spec
        self.evaluator = evaluator
        self.out_dir = out_dir
        self.observer = observer or _Silent()
        self.summary_extra = summary_extra or {}
        self.topics = Topics(config.run.job)
        self.strategy: Strategy = make_strategy(
            config.train.algorithm, train_settings(config), config.algorithm_params(), config.run.seed,
            rounds=config.run.rounds,
        )  # fmt: skip
        self.root = root
        self.clients: dict[str, ClientRecord] = {}
        self.client_samples: dict[str, int] = {}  # shared with the strategy's context
        self.current: RoundState | None = None
        self.folding: Round | None = None  # the current round's aggregation, fed as updates are admitted
        self.checkpoint = Checkpoint(out_dir, config, model_spec)
        self.run_id = ""
        self.layout = parameter_layout(build_model(model_spec))
        self.fingerprint = fingerprint(self.layout)
        self.num_params = sum(math.prod(shape) for _, shape, _ in self.layout)
        # What the model is for and who measures it (evaluator None: the server holds no test set).
        self.task = build_task(config.task)
        self.eval_mode = eval_mode(config, evaluator is not None)
        self.target = run_target(config, self.task, self.eval_mode)
        self.federated = FederatedEvaluation(self.task, config.eval, config.run.rounds, config.clients.max_weight_share)
        self.admission = Admission(
            self.strategy.contract, self.strategy.params, self.num_params, config.train.max_update_norm,
            config.train.max_norm_ratio,
        )  # fmt: skip
        self._presence_sent: dict[str, float] = {}  # when each device was last sent the presence on its own topic
        self.unreported_rejections: Counter[str] = Counter()  # refused after the last round's row was written
        self.times = times or DeviceTimes()  # each client's measured speed and transfers: deadlines and steps
        self.steps_policy = StepsPolicy(config.train, self.strategy.contract, self.times)
        self.reports = ComputeReports()  # what clients told to train without uploading spent
        self.on_ready: Callable[[], None] | None = None  # once the clients to wait for registered, before round 1
        self.on_round: Callable[[int], None] | None = None  # before each round's assignments (a simulated fleet's)
        t = config.train  # compression: each device's upload codec (the round model's codec: self.distribution)
        self.codecs = CodecPolicy(t.codec, t.codec_policy, t.upload_budget_s, t.codec_ladder, self.strategy.contract,
                                  self.num_params)  # fmt: skip
        self.live = LiveState(out_dir, self._live_facts())  # live.json, for the dashboard
        offline = encode(Presence(client_id="server", online=False, role="server", reason="connection lost"))
        self.link: Link = link or MqttLink(
            link_config,
            f"edgefl-server-{config.run.job}",
            [self.topics.all_up],
            will=(self.topics.server, offline, True),
            on_connect=self._announce,
            spool_dir=out_dir,  # the updates that arrive at once wait there, not in memory
        )
        self.link.limit_senders(self._sender_budget)
        self.distribution = Distribution(
            self.link, self.topics, self.strategy.contract, Downlink(t.downlink_codec, config.run.seed)
        )
        self.delivery = Delivery(self.link, self.topics)  # acks, repeated answers, assignments sent again
        self.limits = RateLimits()  # per device and control message kind (server.rate_limits)
        self.link.on_refused(self._refused)

    def _live_facts(self) -> dict[str, Any]:
        """The run facts the dashboard heads its page with."""
        run = self.config.run
        dataset = self.summary_extra.get("dataset", self.config.data.dataset)
        return {
            "algorithm": self.strategy.name,
            "dataset": dataset,
            "partition": self.config.data.partition,
            "job": run.job,
            "rounds": run.rounds,
            "target": self.target.value,
        }

    # -- messages ----------------------------------------------------------------------------------------------------
    def _announce(self) -> None:
        """Online, retained, with the run id and the model: on every (re)connect, so the last will's retained 'offline'
        never outlives a reconnect and devices learn the current run (and send again what this server may have lost)
        and the model to say at registration they hold."""
        self.link.publish(self.topics.server, encode(self._online()), retain=True)

    def _online(self) -> Presence:
        return Presence(
            "server", True, "server", model=self.model_spec, fingerprint=self.fingerprint, run_id=self.run_id
        )

    def _sender_budget(self, topic: str) -> int:
        """Bytes of chunked messages ``topic``'s sender may have in flight: one update of this round, if it owes one."""
        sender, state = self.topics.sender_of(topic), self.current
        if sender is None or state is None or sender not in state.selected or sender in state.received:
            return 0
        arrays = 1 + len(self.strategy.contract.returns)
        return MAX_HEADER_BYTES + 4 * self.num_params * arrays

    def _handle(self, topic: str, msg: Message) -> None:
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
        try:
            if sender is None:
                raise InvalidField(f"message on unexpected topic {topic!r}")
            if isinstance(msg, Hello):
                self._register(sender, msg)
            elif isinstance(msg, Presence):
                self._presence(sender, msg)
            elif isinstance(msg, Update):
                self._accept(topic, sender, msg)
            elif isinstance(msg, Failure):
                self._failed(sender, msg)
            elif isinstance(msg, ModelRequest):
                self.distribution.answer(sender, msg, self.current.assigned_steps if self.current else ())
            elif isinstance(msg, ComputeReport):
                entry = self.reports.take(sender, msg, self.run_id)
                self.times.record_compute(msg.round, sender, msg.compute_s, msg.local_steps)
                log.info("round %d: %s trained %d steps without uploading, compute %.3f s", entry["round"], sender,
                         msg.local_steps, msg.compute_s)  # fmt: skip
            elif isinstance(msg, Evaluation):
                record = self._known(sender)
                self.federated.check(sender, msg, record.eval_samples if record else 0, self.run_id)
            elif isinstance(msg, Resync):
                self._resync(sender, msg)
            else:
                raise InvalidField(f"clients may not send {type(msg).__name__.lower()} messages")
        except ProtocolError as exc:
            self.link.reject(topic, exc)
            self.live.rejected(sender, exc.reason)
            error = exc
        if sender is not None:
            self.delivery.answer(sender, msg, self.run_id, self.current, error)

    def _register(self, sender: str, hello: Hello) -> None:
        if hello.client_id != sender:
            raise InvalidField(f"hello on the topic of {sender!r} claims client id {hello.client_id!r}")
        limit = self.config.clients.max_samples
        for what, count in (("training", hello.num_samples), ("held-out", hello.eval_samples)):
            if count > limit:
                raise WrongSampleCount(
                    f"{sender} registers with {count} {what} samples, more than clients.max_samples ({limit}); "
                    "not registered"
                )
        self._check_model(sender, hello)
        known = self.clients.get(sender)
        self.clients[sender] = ClientRecord(sender, hello.num_samples, hello.device, True, hello.eval_samples)
        self.client_samples[sender] = hello.num_samples
        self.live.registered(sender, hello.device)
        if known is None or not known.online:
            log.info(
                "client %s registered: %d samples, %s",
                sender,
                hello.num_samples,
                {k: hello.device.get(k) for k in ("hostname", "machine", "cpu_count", "device_class")},
            )

    def _check_model(self, sender: str, hello: Hello) -> None:
        """Refuse a device whose model is not the server's, and tell it which parameter differs."""
        stated = hello.model
        if not stated:  # it has not seen the server's presence (e.g. retained on another cluster node): send it, at
            # most every PRESENCE_REPLY_S per device (a device that answers every presence with a bare hello is no loop)
            now = time.monotonic()
            if now - self._presence_sent.get(sender, -PRESENCE_REPLY_S) >= PRESENCE_REPLY_S:
                self._presence_sent[sender] = now
                log.info("client %s registers without stating its model; sending it the server's presence", sender)
                self.link.publish(self.topics.down(sender), encode(self._online()))
            return
        if stated.get("digest") == self.fingerprint:
            return
        if "error" in stated:
            detail = f"the device cannot build the model {self.model_spec}: {str(stated['error'])[:1000]}"
        else:
            detail = f"its model differs from the server's: {layout_difference(self.layout, stated.get('layout'))}"
        refusal = Refusal(sender, "model", detail[:2000])
        self.link.publish(self.topics.down(sender), encode(refusal))
        self._refuse(sender, "model")
        raise ModelMismatch(f"{sender} refused at registration: {detail}")

    def _refuse(self, sender: str, reason: str) -> None:
        """Forget a refused device, or, while a round it was told to serve is open, keep it known but refused and
        offline (not waited for, its update refused) so that every lookup of the round still finds it."""
        state, record = self.current, self.clients.get(sender)
        if record is None:
            return
        if state is None or sender not in state.assigned_steps:
            self.clients.pop(sender)
            self.client_samples.pop(sender, None)
            return
        record.online, record.refused = False, reason
        if sender not in state.received:
            state.failed.setdefault(sender, f"refused: {reason}")
        self.live.presence(sender, False)

    def _known(self, sender: str) -> ClientRecord | None:
        """The record of a registered device that was not refused since."""
        record = self.clients.get(sender)
        return None if record is None or record.refused else record

    def _forget_refused(self) -> None:
        """Once the round they were part of closed, the refused devices are forgotten."""
        for cid in [c for c, record in self.clients.items() if record.refused]:
            del self.clients[cid]
            self.client_samples.pop(cid, None)

    def _presence(self, sender: str, presence: Presence) -> None:
        if presence.client_id != sender:
            raise InvalidField(f"presence on the topic of {sender!r} claims client id {presence.client_id!r}")
        record = self._known(sender)  # a refused device stays offline whatever it says
        if record is not None and record.online != presence.online:
            record.online = presence.online
            self.live.presence(sender, presence.online)
            log.info("client %s is %s (%s)", sender, "online" if presence.online else "offline", presence.reason)

    def _accept(self, topic: str, sender: str, update: Update) -> None:
        state, record = self.current, self._known(sender)
        try:
            if record is None and sender in self.clients:
                raise OutOfRound(f"{sender} was refused at registration ({self.clients[sender].refused}) this round")
            registered = record.num_samples if record else None
            norm = self.admission.check(sender, update, state, registered, self.run_id)
        except ProtocolError as exc:
            self._update_refused(sender, update.round, exc)
            raise
        assert state is not None and self.folding is not None  # admission refuses updates outside a round
        self.times.arrived(sender)
        state.received[sender] = self.strategy.fold(self.folding, update, norm)  # folded now; its vectors are not kept
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

    def _refused(self, stream: str, exc: ProtocolError) -> None:
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
        state = self.current
        if state is not None and round_ == state.round and sender in state.selected and sender not in state.received:
            state.failed.setdefault(sender, f"rejected: {exc.reason}")

    def _failed(self, sender: str, failure: Failure) -> None:
        if failure.client_id != sender:
            raise InvalidField(f"failure on the topic of {sender!r} claims client id {failure.client_id!r}")
        state = self.current
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
        if self.delivery.resend(sender, resync, self.run_id, self.current):
            self.distribution.lost(sender)  # it may have lost the round's model with its assignment

    def _pump(self, timeout: float) -> None:
        received = self.link.receive(timeout)
        if received is not None:
            self._handle(*received)

    # -- phases ------------------------------------------------------------------------------------------------------
    def online(self) -> list[str]:
        return sorted(c for c, rec in self.clients.items() if rec.online)

    def _is_online(self, cid: str) -> bool:
        """Whether ``cid`` is registered and online (a refused or forgotten device is not)."""
        record = self.clients.get(cid)
        return record is not None and record.online

    def wait_for_clients(self, count: int) -> None:
        deadline = time.monotonic() + self.config.clients.register_timeout_s
        while len(self.online()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(self.online())} of {count} clients registered within "
                    f"{self.config.clients.register_timeout_s:.0f} s ({self.online()}); start more clients or lower "
                    "clients.min_clients"
                )
            self.observer.waiting(f"waiting for clients: {len(self.online())}/{count} registered")
            self._pump(0.5)

    def available(self) -> list[str]:
        """Online clients the strategy has not excluded."""
        excluded = self.strategy.excluded()
        return [c for c in self.online() if c not in excluded]

    def _assign(self, round_: int, version: int, weights: np.ndarray) -> tuple[dict[str, Any], dict[str, Any]]:
        """Select, fit the steps, set the deadline from the predictions, then tell every chosen client its assignment;
        ``self.current`` is the round from here on. What each client was told, and each selected one's prediction."""
        available = self.available()
        selected = self.strategy.select(round_, available)
        train_only = self.strategy.train_only(round_, available, selected)
        plans = {cid: self.strategy.assign(round_, cid) for cid in [*selected, *train_only]}
        for cid, plan in plans.items():
            plan.steps = self.steps_policy.steps(cid, plan.steps)
        predictions = {cid: self.times.predict(cid, plans[cid].steps) for cid in selected}
        deadline_s = round_deadline(self.config.clients, predictions)
        state = self.current = RoundState(round_, version, set(selected), deadline_s=deadline_s)
        self.limits.new_round()
        self.reports.told(round_, {cid: plans[cid].steps for cid in train_only})
        self.times.round_started()
        sha256 = self.distribution.publish(round_, version, weights, plans, self.run_id)  # the model, once
        facts = {}
        for cid, plan in plans.items():
            state.codecs[cid] = self.codecs.codec_for(cid)
            facts[cid] = RoundFacts(
                round=round_, model_version=version, sha256=sha256, deadline_s=deadline_s, codec=str(state.codecs[cid]),
                upload=cid in state.selected, run_id=self.run_id, algorithm=self.strategy.name, model=self.model_spec,
                task=self.config.task, seed=self.config.run.seed,
            )  # fmt: skip
            state.assigned_steps[cid] = plan.steps
            self.link.take_bytes_in(self.topics.up(cid))  # bytes_up counts what arrives from here on
        told: dict[str, Any] = {}
        for cid, (assignment, size) in self.distribution.send(plans, facts).items():
            self.times.sent(cid)
            self.delivery.assigned(round_, cid, assignment)  # naming the model, which a device may then ask for
            told[cid] = {**assignment_summary(plans[cid], facts[cid]), **self.codecs.describe(cid), "bytes_down": size}
        return told, {cid: p and p.row() for cid, p in predictions.items()}

    def _collect(self, state: RoundState) -> None:
        deadline = time.monotonic() + state.deadline_s
        while True:
            waiting = [
                c for c in state.selected if c not in state.received and c not in state.failed and self._is_online(c)
            ]
            remaining = deadline - time.monotonic()
            if not waiting or remaining <= 0:
                break
            self._pump(min(remaining, 1.0))
        for cid in sorted(state.selected - set(state.received) - set(state.failed)):
            why = "went offline" if not self._is_online(cid) else f"missed the {state.deadline_s:.1f} s deadline"
            log.warning("round %d: %s %s; aggregating without it", state.round, cid, why)

    def run(self) -> dict[str, Any]:
        """Train for the configured rounds (or until the target, if asked) and write the run's outputs."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(self.config.run.seed)
        weights = get_flat(build_model(self.model_spec))
        self.strategy.setup(
            ServerContext(
                self.model_spec,
                self.num_params,
                self.client_samples,
                self.root,
                self.config.run.seed,
                self.task,
                run_dir=self.out_dir,
                store_ram_bytes=self.config.train.store_ram_mb << 20,
            )
        )
        weights, metrics = self._resume(weights)
        self.link.start()
        self._announce()  # an injected link (in-process) has no connect hook of ours
        exporter = BackgroundExporter(
            self.model_spec, self.out_dir / "model.onnx", on_done=self._publish_model, task=self.task.name
        )
        # the server's test set, evaluated beside the next round (none: the devices evaluate)
        evaluations = EvaluationWorker(self.evaluator) if self.evaluator and self.eval_mode != "clients" else None
        self.live.start()
        try:
            self.wait_for_clients(self.config.min_clients)
            if self.on_ready is not None:
                self.on_ready()
            weights = self._train(weights, metrics, exporter, evaluations)
        finally:
            if evaluations is not None:
                evaluations.close()
            exporter.close()  # its last export is published before the link goes down
            self._shutdown()
            self.live.close()
        export_onnx(
            self.model_spec, weights, self.out_dir / "model-final.onnx", round=len(metrics.rows), task=self.task.name
        )
        rejected = sum((Counter(r["rejected"]) for r in metrics.rows), Counter()) + self.unreported_rejections
        classes = {cid: device_class(record.device) for cid, record in self.clients.items()}
        summary = summarize(
            metrics.rows,
            self.target,
            algorithm=self.strategy.name,
            run_id=self.run_id,
            num_params=int(self.num_params),
            clients=len(self.clients),
            rejected=dict(rejected),
            dropped_rounds=[r["round"] for r in metrics.rows if r.get("dropped")],
            excluded=sorted(self.strategy.excluded()),
            **self.summary_extra,
            per_client=client_summary(metrics.rows),
            **fleet_summary(metrics.rows, classes, self.target),
        )
        last = metrics.rows[-1] if metrics.rows else {}
        summary.update({f"final_{k}": v for k, v in last.items() if k.startswith(f"{self.target.metric}_")})
        write_summary(self.out_dir / "summary.json", summary)
        if metrics.rows:
            title = f"{self.strategy.name} · {self.summary_extra.get('dataset', '')} · {len(self.clients)} clients"
            plot_report(metrics.rows, self.target, self.out_dir / "report.png", title)
            plot_timeline(metrics.rows, self.out_dir / "timeline.png", title, classes)
        return summary

    def _resume(self, weights: np.ndarray) -> tuple[np.ndarray, MetricsLog]:
        """The starting model and metrics log: fresh, or restored from an unfinished run's checkpoint in ``out_dir``
        (after ``strategy.setup``, whose initial state the checkpoint then overwrites)."""
        metrics = MetricsLog(self.out_dir / "metrics.jsonl")
        self.version, self.last_round = 0, 0
        resumed = self.checkpoint.load(self.strategy, self.num_params)
        if resumed is None:
            self.run_id = uuid.uuid4().hex[:12]
            metrics.path.write_text("")
            return weights, metrics
        self.version, self.last_round, self.run_id = resumed.model_version, resumed.round, resumed.run_id
        metrics.resume(self.last_round)
        self.times.replay(metrics.rows)
        log.warning(
            "resuming run %s from round %d (checkpoint %s, model version %d): rounds %d-%d to go",
            self.run_id,
            self.last_round,
            self.checkpoint.path,
            self.version,
            self.last_round + 1,
            self.config.run.rounds,
        )
        return resumed.weights, metrics

    def _aggregate(self, round_: int, weights: np.ndarray, folding: Round) -> tuple[np.ndarray, str | None]:
        """The next model, or the current one and why the round was dropped (the strategy's state is restored)."""
        before = pack_state(self.strategy)
        try:
            new = self.strategy.finish(folding)
            if np.all(np.isfinite(new)):
                return new, None
            reason = "non_finite_aggregate"
            log.error("round %d: the aggregate is not finite; round dropped, the model stays as it was", round_)
        except Exception:  # a run never ends because of what clients sent: drop the round, keep the model
            reason = "aggregation_error"
            log.exception("round %d: aggregation failed; round dropped, the model stays as it was", round_)
        unpack_state(self.strategy, before)
        return weights, reason

    def _train(
        self,
        weights: np.ndarray,
        metrics: MetricsLog,
        exporter: BackgroundExporter,
        evaluations: EvaluationWorker | None,
    ) -> np.ndarray:
        start = time.monotonic() - (metrics.rows[-1]["elapsed_s"] if metrics.rows else 0.0)
        version = self.version
        self.best: float | None = None
        for r in metrics.rows:
            self.best = self.target.of(r) if self.target.better(self.target.of(r), self.best) else self.best
        rejected_before: Counter[str] = Counter()  # what arrives before or between rounds counts in the next one
        produced: Produced | None = None  # the previous round's model, under evaluation
        for round_ in range(self.last_round + 1, self.config.run.rounds + 1):
            if not self.available():
                self.wait_for_clients(len(self.online()) + 1)
            if self.on_round is not None:
                self.on_round(round_)
            t0, c0 = time.monotonic(), time.thread_time()  # CPU seconds of this thread: the parallel clock's
            told, predictions = self._assign(round_, version, weights)
            state = self.current
            assign_s, assign_cpu_s = time.monotonic() - t0, time.thread_time() - c0
            self.live.round_started(round_, t0 - start, told)
            assert state is not None
            self.folding = self.strategy.begin(round_, weights)  # updates are folded as they are admitted
            registered = {c: self.clients[c].num_samples for c in state.selected}
            self.folding.sample_weights = capped_counts(registered, self.config.clients.max_weight_share)
            self._collect(state)
            self.admission.close(state)
            self.current, folding, self.folding = None, self.folding, None
            updates = [state.received[c] for c in sorted(state.received)]  # without their vectors
            t_agg, c_agg = time.monotonic(), time.thread_time()
            dropped = None
            if updates and folding is not None:
                weights, dropped = self._aggregate(round_, weights, folding)
                version += dropped is None
            done = time.monotonic()  # the model is produced: time-to-target is stamped here
            aggregate_cpu_s = time.thread_time() - c_agg
            row = {
                "round": round_,
                "elapsed_s": done - start,
                "round_s": done - t0,
                "assign_s": assign_s,
                "aggregate_s": done - t_agg,
                "assign_cpu_s": assign_cpu_s,  # the server's work the devices wait for, on the parallel clock
                "aggregate_cpu_s": aggregate_cpu_s,
                "clients_selected": len(state.selected),
                "clients_reported": len(updates),
                "missing": sorted(state.selected - set(state.received)),
                "failed": dict(state.failed),
                "slowest_compute_s": max((u.compute_s for u in updates), default=0.0),
                "deadline_s": state.deadline_s,
                "predictions": predictions,
                "bytes_out": self.distribution.take_bytes_out(),  # the server's egress this round
                "broadcast": self.distribution.broadcast,  # the round's model went out as a model or a difference
                "clients": {u.client_id: self._client_row(u, state, told) for u in updates},
                "train_only": self.reports.drain(),
                "instructions": told,
                "rejected": dict(self.link.rejections - rejected_before),  # by reason
                "excluded": sorted(self.strategy.excluded()),
                "algorithm": self.strategy.round_metrics(),
            }
            if dropped:
                row["dropped"] = dropped
            rejected_before = Counter(self.link.rejections)  # the devices' evaluation counts in the next row
            due = self.federated.due(round_)
            # The server's test set on the evaluation thread, while the devices evaluate and then train round t+1.
            evaluation = (
                evaluations.submit(weights, self.strategy.outputs(weights))
                if evaluations is not None and due and self.eval_mode != "clients"
                else None
            )
            if due and self.eval_mode != "server":
                t_clients = time.monotonic()
                client_eval = self._evaluate_on_devices(round_, version, weights, state.selected)
                row["client_eval_wait_s"] = time.monotonic() - t_clients  # server clock: request, evaluation, reports
                if client_eval is not None:
                    row["client_eval"] = client_eval
            self._forget_refused()
            previous, produced = produced, Produced(row, weights, version, pack_state(self.strategy), evaluation)
            if previous is not None and self._record(previous, metrics, exporter):
                break
            if evaluation is None:  # nothing to wait for: recorded now
                current, produced = produced, None
                if self._record(current, metrics, exporter):
                    break
        if produced is not None:
            self._record(produced, metrics, exporter)
        self.checkpoint.mark_finished()
        self.unreported_rejections = self.link.rejections - rejected_before
        return weights

    def _record(self, p: Produced, metrics: MetricsLog, exporter: BackgroundExporter) -> bool:
        """Once a round's evaluation is done: its metrics row, its checkpoint, the export of a new best model and the
        progress line. True when the run should stop at the target."""
        e = p.evaluation.result() if p.evaluation is not None else None
        row = {**p.row, "eval_s": e.eval_s if e else 0.0, **(e.tested if e else {})}
        for name, result in (e.outputs if e else {}).items():
            row.update({f"{metric}_{name}": value for metric, value in result.items()})
        if self.times.modelled:  # in-process: the round as long as its slowest device (server.fleet_summary)
            row["parallel_round_s"] = parallel_round_s(row)
            row["parallel_elapsed_s"] = row["parallel_round_s"] + (
                metrics.rows[-1]["parallel_elapsed_s"] if metrics.rows else 0.0
            )
        metrics.append(row)
        self.checkpoint.save(p.weights, row["round"], p.version, p.state, self.run_id)
        value = self.target.of(row)
        if self.target.better(value, self.best):  # model.onnx is always the best global model so far
            self.best = value
            exporter.submit(p.weights, row["round"])
        self.observer.round_done(row)
        if self.config.run.stop_at_target and self.target.reached(value):
            log.info("target %s %s reached in round %d; stopping", self.target.metric, self.target.value, row["round"])
            return True
        return False

    def _evaluate_on_devices(
        self, round_: int, version: int, weights: np.ndarray, selected: set[str]
    ) -> dict[str, Any] | None:
        """Ask the devices to evaluate ``weights`` on their held-out splits; their combined report (None if none).
        The request carries the weights: devices evaluate the model they trained from only when it is current."""
        holdout = {c: rec.eval_samples for c, rec in self.clients.items()}
        asked = self.federated.devices(self.available(), selected, holdout)
        request = Evaluate(
            round_, version, weights, self.model_spec, self.config.task, self.config.eval.deadline_s, self.run_id
        )
        frame = encode(request)
        for cid in asked:
            self.link.publish(self.topics.down(cid), frame)
        state = EvalRound(round_, set(asked))
        self.federated.collect(state, self._pump, self._is_online)
        return self.federated.result(state)

    def _client_row(self, u: Update, state: RoundState, told: dict[str, Any]) -> dict[str, Any]:
        """One admitted update's line in the round's row (``u`` as folded: its sample count is the weight it had)."""
        # every byte the device's link carried down: its assignment, the round's broadcast (the model or its
        # difference, counted once in the server's bytes_out) and any model it asked for on its own topic
        d = self.distribution
        bytes_down = told[u.client_id]["bytes_down"] + d.model_bytes + d.requested_bytes.get(u.client_id, 0)
        bytes_up = state.bytes_up.get(u.client_id, 0)
        record = self.clients.get(u.client_id)
        registered = record.num_samples if record else u.num_samples
        capped = {"weight_samples": u.num_samples} if u.num_samples != registered else {}
        return {
            "device_class": device_class(record.device if record else {}),
            **self.times.record(state.round, u, bytes_down, bytes_up),
            "compute_s": u.compute_s,
            "overhead_s": min(u.overhead_s, u.compute_s),  # of compute_s: the work outside the local steps
            "cpu_s": u.cpu_s,
            "local_steps": u.local_steps,
            "num_samples": registered,
            **capped,
            "train_loss": u.train_loss,
            "bytes_up": bytes_up,
            "bytes_down": bytes_down,
            "device": u.metrics,
        }

    def _publish_model(self, path: Path, round_: int) -> None:
        """Retain the newest exported model on the job's model topic, where devices fetch it."""
        meta = read_sidecar(path) or {}
        data = path.read_bytes()
        message = ModelFile(round=round_, sha256=hashlib.sha256(data).hexdigest(), meta=meta, data=data)
        try:
            self.link.publish(self.topics.model, encode(message), retain=True, chunked=False)
        except MessageTooLarge as exc:
            log.error("model.onnx of round %d not published for devices (%s); copy it to them instead", round_, exc)

    def _shutdown(self) -> None:
        try:
            self.distribution.clear()
            self.link.publish(self.topics.broadcast, encode(Stop(reason="training finished", run_id=self.run_id)))
            offline = Presence(client_id="server", online=False, role="server", reason="stopped", run_id=self.run_id)
            self.link.publish(self.topics.server, encode(offline), retain=True)
            self.link.wait_published(timeout=5.0)
        finally:
            self.link.stop()


def train_settings(config: RunConfig) -> TrainSettings:
    """The run-wide training settings every strategy starts from."""
    t = config.train
    return TrainSettings(t.local_steps, t.lr, t.batch_size, config.clients.fraction, t.momentum, t.weight_decay)
