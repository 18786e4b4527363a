"""The round loop over MQTT: select, assign, collect until a timer deadline, aggregate, record.

Each round's model goes out once for every device (``server.distribution``); assignments only name it. Devices
register with the roster (``server.roster``); every message they send is handled by ``server.dispatch``, which admits
each update and folds it into the strategy's round as it arrives; each round is recorded by ``server.recorder``, whose
metrics row waits for the test-set evaluation that runs beside the next round. The devices' evaluation on their
held-out splits (``server.federated_eval``) is collected right after the aggregation, before round t+1 starts.

The deadline is a real timer (the receive loop wakes at least once a second), so a client that died cannot stall a
round; a client whose last will says it went offline, or that reports it cannot serve its assignment, is not waited
for. An update's sample weight is capped relative to the round's selected devices (``clients.max_weight_share``,
``server.weight_share``). An aggregate that is still not finite drops the round (the model stays as it was, the
strategy's state is restored): a run never ends because of what a client sent.

The deadline is ``clients.round_deadline_s``, or derived from what each selected client is predicted to need
(``clients.deadline_factor``, ``server.deadlines``); the steps each client is told may be fitted to a round budget
(``train.steps_policy``, ``server.steps_policy``). Each round's deadline and every prediction are recorded in its
metrics row. After every round the model and the strategy's state are checkpointed (``server.checkpoint``), so a
restarted server resumes.
"""

from __future__ import annotations

import logging
import math
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from edge_client.data import ArrayDataset
from edge_client.messages import Evaluate, RoundFacts, Stop
from edge_client.models import build_model, get_flat
from edge_client.protocol import encode
from edge_client.tasks import build_task
from edge_client.topics import Topics
from edge_client.transport import Link, LinkConfig, MqttLink
from server.admission import Admission, RoundState
from server.checkpoint import Checkpoint, pack_state, unpack_state
from server.codec_policy import CodecPolicy
from server.config import RunConfig
from server.deadlines import DeviceTimes, round_deadline
from server.dispatch import Dispatch
from server.distribution import Distribution
from server.downlink import Downlink
from server.dp.mechanism import Privacy
from server.evaluation import EvaluationWorker, Evaluator
from server.federated_eval import EvalRound, FederatedEvaluation
from server.live_state import LiveState, run_facts
from server.recorder import Produced, Recorder, RoundObserver
from server.roster import Roster, server_offline
from server.steps_policy import StepsPolicy
from server.strategies import ServerContext, Strategy, TrainSettings, make_strategy
from server.strategies.base import Round, assignment_summary
from server.target import eval_mode, run_target
from server.weight_share import capped_counts

if TYPE_CHECKING:  # imported when a run turns secure aggregation on: it needs the cryptography package
    from server.secagg.stages import SecureRounds

log = logging.getLogger("edgefl.server")


class Orchestrator:
    """The synchronous round loop; the roster, dispatch and recorder it wires here are what any loop is built from."""

    dispatch_class: type[Dispatch] = Dispatch  # another loop handles some messages its own way (server.buffered)

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
        self.summary_extra = summary_extra or {}
        self.topics = Topics(config.run.job)
        self.privacy = Privacy(config)  # [privacy]: the mechanism around the strategy and the budget (server.dp)
        self.strategy: Strategy = self.privacy.wrap(make_strategy(
            config.train.algorithm, train_settings(config), config.algorithm_params(), config.run.seed,
            rounds=config.run.rounds,
        ))  # fmt: skip
        self.root = root
        self.current: RoundState | None = None
        self.folding: Round | None = None  # the current round's aggregation, fed as updates are admitted
        self.checkpoint = Checkpoint(out_dir, config, model_spec)
        # What the model is for and who measures it (evaluator None: the server holds no test set).
        self.task = build_task(config.task)
        self.eval_mode = eval_mode(config, evaluator is not None)
        self.target = run_target(config, self.task, self.eval_mode)
        self.federated = FederatedEvaluation(self.task, config.eval, config.run.rounds, config.clients.max_weight_share)
        self.times = times or DeviceTimes()  # each client's measured speed and transfers: deadlines and steps
        self.steps_policy = StepsPolicy(config.train, self.strategy.contract, self.times)
        self.on_ready: Callable[[], None] | None = None  # once the clients to wait for registered, before round 1
        self.on_round: Callable[[int], None] | None = None  # before each round's assignments (a simulated fleet's)
        self.live = LiveState(out_dir, self._live_facts())  # live.json, for the dashboard
        self.link: Link = link or MqttLink(
            link_config,
            f"edgefl-server-{config.run.job}",
            [self.topics.all_up],
            will=(self.topics.server, encode(server_offline("connection lost")), True),
            on_connect=self._announce,
            spool_dir=out_dir,  # the updates that arrive at once wait there, not in memory
        )
        self.roster = Roster(self.link, self.topics, model_spec, self.live, config.clients.max_samples)
        self.clients, self.client_samples = self.roster.clients, self.roster.client_samples
        self.num_params = sum(math.prod(shape) for _, shape, _ in self.roster.layout)
        self.admission = Admission(
            self.strategy.contract, self.strategy.params, self.num_params, config.train.max_update_norm,
            config.train.max_norm_ratio,
        )  # fmt: skip
        t = config.train  # compression: each device's upload codec (the round model's codec: self.distribution)
        self.codecs = CodecPolicy(t.codec, t.codec_policy, t.upload_budget_s, t.codec_ladder, self.strategy.contract,
                                  self.num_params)  # fmt: skip
        self.distribution = Distribution(
            self.link, self.topics, self.strategy.contract, Downlink(t.downlink_codec, config.run.seed)
        )
        self.secure: SecureRounds | None = None  # [privacy] secure_aggregation: the stages in place of updates
        if config.privacy.secure_aggregation:
            from server.secagg.stages import SecureRounds  # needs the cryptography package

            self.secure = SecureRounds(
                config.privacy, self.link, self.topics, self.num_params, self.times.arrived, self.strategy.contract
            )
        self.dispatch = self.dispatch_class(
            self, self.link, self.topics, self.roster, self.live, distribution=self.distribution, times=self.times,
            federated=self.federated, codecs=self.codecs,
        )  # fmt: skip
        self.recorder = Recorder(
            out_dir, self.target, stop_at_target=config.run.stop_at_target, roster=self.roster, link=self.link,
            topics=self.topics, checkpoint=self.checkpoint, distribution=self.distribution, times=self.times,
            reports=self.dispatch.reports, task_name=self.task.name, observer=observer, privacy=self.privacy,
        )  # fmt: skip

    @property
    def observer(self) -> RoundObserver:
        """Where progress goes: the recorder reports each round, the loop its waits."""
        return self.recorder.observer

    @observer.setter
    def observer(self, observer: RoundObserver) -> None:
        self.recorder.observer = observer

    @property
    def run_id(self) -> str:
        return self.roster.run_id

    def _live_facts(self) -> dict[str, Any]:
        """The run facts the dashboard heads its page with."""
        dataset = self.summary_extra.get("dataset", self.config.data.dataset)
        return {**run_facts(self.config, dataset, self.target.value), "algorithm": self.strategy.name}

    def _announce(self) -> None:
        """The link's connect hook: the server's presence, retained (``Roster.announce``)."""
        self.roster.announce()

    # -- the run -----------------------------------------------------------------------------------------------------
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
        weights, elapsed_s = self._resume(weights)
        self.link.start()
        self._announce()  # an injected link (in-process) has no connect hook of ours
        # the server's test set, evaluated beside the next round (none: the devices evaluate)
        evaluations = EvaluationWorker(self.evaluator) if self.evaluator and self.eval_mode != "clients" else None
        self.live.start()
        try:
            self.wait_for_clients(self.config.min_clients)
            if self.on_ready is not None:
                self.on_ready()
            weights = self._train(weights, elapsed_s, evaluations)
        finally:
            if evaluations is not None:
                evaluations.close()
            self.recorder.close()  # its last export is published before the link goes down
            self._shutdown()
            self.live.close()
        extra = dict(self.summary_extra)
        if self.secure is not None:  # the rounds aggregated securely
            rows = self.recorder.metrics.rows
            extra["secure_rounds"] = sum(1 for r in rows if "secure" in r and not r.get("dropped"))
        return self.recorder.summarize(weights, self.strategy, self.num_params, extra)

    def _resume(self, weights: np.ndarray) -> tuple[np.ndarray, float]:
        """The starting model and the run's elapsed seconds: fresh, or restored from an unfinished run's checkpoint in
        ``out_dir`` (after ``strategy.setup``, whose initial state the checkpoint then overwrites)."""
        self.version, self.last_round = 0, 0
        resumed = self.checkpoint.load(self.strategy, self.num_params)
        if resumed is None:
            self.roster.run_id = uuid.uuid4().hex[:12]
            return weights, self.recorder.begin(None)
        self.version, self.last_round, self.roster.run_id = resumed.model_version, resumed.round, resumed.run_id
        elapsed_s = self.recorder.begin(self.last_round)
        log.warning(
            "resuming run %s from round %d (checkpoint %s, model version %d): rounds %d-%d to go",
            self.run_id,
            self.last_round,
            self.checkpoint.path,
            self.version,
            self.last_round + 1,
            self.config.run.rounds,
        )
        return resumed.weights, elapsed_s

    def _train(self, weights: np.ndarray, elapsed_s: float, evaluations: EvaluationWorker | None) -> np.ndarray:
        """The rounds: select and assign, collect, aggregate, record."""
        start = time.monotonic() - elapsed_s
        version = self.version
        for round_ in range(self.last_round + 1, self.config.run.rounds + 1):
            if self.privacy.exhausted(round_):  # it would spend more than [privacy] target_epsilon
                break
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
            secure = self._collect(state)
            self.admission.close(state)
            self.current, folding, self.folding = None, self.folding, None
            t_agg, c_agg = time.monotonic(), time.thread_time()
            dropped = None
            if state.received and folding is not None:
                weights, dropped = self._aggregate(round_, weights, folding)
                version += dropped is None
            done = time.monotonic()  # the model is produced: time-to-target is stamped here
            timing = {
                "elapsed_s": done - start,
                "round_s": done - t0,
                "assign_s": assign_s,
                "aggregate_s": done - t_agg,
                "assign_cpu_s": assign_cpu_s,  # the server's work the devices wait for, on the parallel clock
                "aggregate_cpu_s": time.thread_time() - c_agg,
            }
            row = self.recorder.row(round_, timing, state, predictions, told, self.strategy, dropped)
            row.update(secure)
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
            self.roster.forget_refused()
            if self.recorder.produced(Produced(row, weights, version, pack_state(self.strategy), evaluation)):
                break
        self.recorder.finish()
        return weights

    # -- select ------------------------------------------------------------------------------------------------------
    def online(self) -> list[str]:
        return self.roster.online()

    def available(self) -> list[str]:
        """Online clients the strategy has not excluded."""
        excluded = self.strategy.excluded()
        return [c for c in self.online() if c not in excluded]

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
            self.dispatch.pump(0.5)

    # -- assign ------------------------------------------------------------------------------------------------------
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
        self.dispatch.limits.new_round()
        self.dispatch.reports.told(round_, {cid: plans[cid].steps for cid in train_only})
        self.times.round_started()
        secure = {}
        if self.secure is not None:  # each selected device's secure terms (its weight, the clip norm, the ring)
            registered = {c: self.clients[c].num_samples for c in selected}
            weighting = self.strategy.params.get("weighting", "samples")
            secure = self.secure.begin(round_, self.run_id, version, registered, weighting,
                                       self.config.clients.max_weight_share, plans)  # fmt: skip
        sha256 = self.distribution.publish(round_, version, weights, plans, self.run_id)  # the model, once
        facts = {}
        for cid, plan in plans.items():
            state.codecs[cid] = self.codecs.codec_for(cid)
            facts[cid] = RoundFacts(
                round=round_, model_version=version, sha256=sha256, deadline_s=deadline_s, codec=str(state.codecs[cid]),
                upload=cid in state.selected, run_id=self.run_id, algorithm=self.strategy.name, model=self.model_spec,
                task=self.config.task, seed=self.config.run.seed, secure=secure.get(cid, {}),
            )  # fmt: skip
            state.assigned_steps[cid] = plan.steps
            self.link.take_bytes_in(self.topics.up(cid))  # bytes_up counts what arrives from here on
        told: dict[str, Any] = {}
        for cid, (assignment, size) in self.distribution.send(plans, facts).items():
            self.times.sent(cid)
            self.dispatch.delivery.assigned(round_, cid, assignment)  # naming the model, which a device may ask for
            told[cid] = {**assignment_summary(plans[cid], facts[cid]), **self.codecs.describe(cid), "bytes_down": size}
        return told, {cid: p and p.row() for cid, p in predictions.items()}

    # -- collect -----------------------------------------------------------------------------------------------------
    def _collect(self, state: RoundState) -> dict[str, Any]:
        """Wait for the round's updates; a secure round's stages instead (its ``secure`` row, and ``dropped``)."""
        if self.secure is not None:
            outcome = self.secure.collect(state, self.dispatch.pump, self.roster.is_online)
            assert self.folding is not None
            for cid, update in outcome.updates.items():  # the unmasked mean, with each survivor's own scalars
                state.received[cid] = self.strategy.fold(self.folding, update)
                state.bytes_up[cid] = outcome.bytes_up.get(cid, 0)
            return {"secure": outcome.row, **({"dropped": outcome.dropped} if outcome.dropped else {})}
        deadline = time.monotonic() + state.deadline_s
        while True:
            owed = state.selected - set(state.received) - set(state.failed)
            waiting = [c for c in owed if self.roster.is_online(c)]
            remaining = deadline - time.monotonic()
            if not waiting or remaining <= 0:
                break
            self.dispatch.pump(min(remaining, 1.0))
        for cid in sorted(state.selected - set(state.received) - set(state.failed)):
            why = "went offline" if not self.roster.is_online(cid) else f"missed the {state.deadline_s:.1f} s deadline"
            log.warning("round %d: %s %s; aggregating without it", state.round, cid, why)
        return {}

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
        self.federated.collect(state, self.dispatch.pump, self.roster.is_online)
        return self.federated.result(state)

    # -- aggregate ---------------------------------------------------------------------------------------------------
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

    def _shutdown(self) -> None:
        stopped = sys.exc_info()[1]  # called from a finally: Ctrl-C, kill or an error on its way out
        reason = "training finished" if stopped is None else f"interrupted ({stopped or type(stopped).__name__})"
        try:
            self.distribution.clear()
            self.link.publish(self.topics.broadcast, encode(Stop(reason=reason[:200], run_id=self.run_id)))
            self.link.publish(self.topics.server, encode(server_offline("stopped", self.run_id)), retain=True)
            self.link.wait_published(timeout=5.0)
        finally:
            self.link.stop()


def train_settings(config: RunConfig) -> TrainSettings:
    """The run-wide training settings every strategy starts from."""
    t = config.train
    return TrainSettings(t.local_steps, t.lr, t.batch_size, config.clients.fraction, t.momentum, t.weight_decay)
