"""The synchronous round loop over MQTT; ``_round`` reads top to bottom as its five steps:

1. select: the strategy picks among the online devices it has not excluded (waiting for one if none is);
2. assign: each device's plan (``server.assignments``), the deadline from what each is predicted to need
   (``server.deadlines``), the round's model broadcast once (``server.distribution``), the assignments naming it;
3. collect: ``server.dispatch`` handles every message, admitting each update and folding it into the strategy's round
   as it arrives, until no selected device owes one or the timer deadline passed (a dead device cannot stall a round);
   a secure round runs its stages instead (``server.secagg``);
4. aggregate: the strategy's next model; one that is not finite drops the round (model and strategy state stay as they
   were): a run never ends because of what a device sent;
5. record: the metrics row (``server.recorder``) and, when due, the evaluation: the devices' held-out splits before the
   next round (``server.federated_eval``), the server's test set beside it; then the row and the checkpoint
   (``server.checkpoint``, from which a restarted server resumes). The roster (``server.roster``) registers devices.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from edge_client.learning.data import ArrayDataset
from edge_client.learning.models import build_model, get_flat
from edge_client.learning.tasks import build_task
from edge_client.wire.messages import Evaluate
from edge_client.wire.topics import Topics
from edge_client.wire.transport import Link, LinkConfig
from server.admission import Admission, RoundState
from server.assignments import Assignments
from server.checkpoint import Checkpoint, pack_state, unpack_state
from server.codec_policy import CodecPolicy
from server.config import RunConfig
from server.deadlines import DeviceTimes
from server.dispatch import Dispatch
from server.distribution import Distribution
from server.downlink import Downlink
from server.dp.mechanism import Privacy
from server.evaluation import EvaluationWorker, Evaluator, TestResult
from server.federated_eval import FederatedEvaluation
from server.live_state import LiveState, run_facts
from server.recorder import Produced, Recorder, RoundObserver
from server.roster import Roster, server_link
from server.steps_policy import StepsPolicy
from server.strategies import ServerContext, Strategy, build_strategy
from server.strategies.base import Round
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
        self.strategy: Strategy = self.privacy.wrap(build_strategy(config))
        self.root = root
        self.version, self.last_round = 0, 0  # the model version and the last completed round (a resumed run's)
        self.current: RoundState | None = None
        self.folding: Round | None = None  # the current round's aggregation, fed as updates are admitted
        self.checkpoint = Checkpoint(out_dir, config, model_spec)
        self.task = build_task(config.task)  # what the model is for; who measures it (no evaluator: no test set)
        self.eval_mode = eval_mode(config, evaluator is not None)
        self.target = run_target(config, self.task, self.eval_mode)
        self.federated = FederatedEvaluation(self.task, config.eval, config.run.rounds, config.clients.max_weight_share)
        self.times = times or DeviceTimes()  # each client's measured speed and transfers: deadlines and steps
        self.steps_policy = StepsPolicy(config.train, self.strategy.contract, self.times)
        self.on_ready: Callable[[], None] | None = None  # once the clients to wait for registered, before round 1
        self.on_round: Callable[[int], None] | None = None  # before each round's assignments (a simulated fleet's)
        facts = run_facts(config, self.summary_extra.get("dataset", config.data.dataset), self.target.value)
        self.live = LiveState(out_dir, {**facts, "algorithm": self.strategy.name})  # live.json, for the dashboard
        self.link: Link = link or server_link(link_config, self.topics, out_dir, lambda: self.roster.announce())
        self.roster = Roster(self.link, self.topics, model_spec, self.live, config.clients.max_samples)
        self.clients, self.client_samples = self.roster.clients, self.roster.client_samples
        self.num_params = sum(math.prod(shape) for _, shape, _ in self.roster.layout)
        t = config.train  # compression: each device's upload codec (the round model's codec: self.distribution)
        self.admission = Admission(self.strategy.contract, self.strategy.params, self.num_params, t.max_update_norm,
                                   t.max_norm_ratio)  # fmt: skip
        self.codecs = CodecPolicy(t.codec, t.codec_policy, t.upload_budget_s, t.codec_ladder, self.strategy.contract,
                                  self.num_params)  # fmt: skip
        self.distribution = Distribution(self.link, self.topics, self.strategy.contract,
                                         Downlink(t.downlink_codec, config.run.seed))  # fmt: skip
        self.secure: SecureRounds | None = None  # [privacy] secure_aggregation: the stages in place of updates
        if config.privacy.secure_aggregation:
            from server.secagg.stages import SecureRounds  # needs the cryptography package

            self.secure = SecureRounds(config.privacy, self.link, self.topics, self.num_params, self.times.arrived,
                                       self.strategy.contract)  # fmt: skip
        self.dispatch = self.dispatch_class(
            self, self.link, self.topics, self.roster, self.live, distribution=self.distribution, times=self.times,
            federated=self.federated, codecs=self.codecs,
        )  # fmt: skip
        self.assignments = Assignments(
            config, model_spec, self.link, self.topics, distribution=self.distribution, codecs=self.codecs,
            steps_policy=self.steps_policy, times=self.times, delivery=self.dispatch.delivery,
        )  # fmt: skip
        self.recorder = Recorder(
            out_dir, self.target, stop_at_target=config.run.stop_at_target, roster=self.roster, link=self.link,
            topics=self.topics, checkpoint=self.checkpoint, distribution=self.distribution, times=self.times,
            reports=self.dispatch.reports, task_name=self.task.name, observer=observer, privacy=self.privacy,
            secure=self.secure is not None,
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

    # -- the run -----------------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train for the configured rounds (or until the target, if asked) and write the run's outputs."""
        weights, elapsed_s = self._prepare()
        # the server's test set, evaluated beside the next round (none: the devices evaluate)
        evaluations = EvaluationWorker(self.evaluator) if self.evaluator and self.eval_mode != "clients" else None
        self.live.start()
        try:
            self.wait_for_clients(self.config.min_clients)
            if self.on_ready is not None:
                self.on_ready()
            weights = self._train(weights, elapsed_s, evaluations)
        finally:
            self._close(evaluations)
        return self.recorder.summarize(weights, self.strategy, self.num_params, self.summary_extra)

    def _prepare(self) -> tuple[np.ndarray, float]:
        """Set the strategy up, take the starting model (fresh, or an unfinished run's from its checkpoint), bring the
        link up and say the server's presence. The starting model and the run's elapsed seconds."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(self.config.run.seed)
        weights = get_flat(build_model(self.model_spec))
        run, ram_bytes = self.config.run, self.config.train.store_ram_mb << 20
        self.strategy.setup(ServerContext(self.model_spec, self.num_params, self.client_samples, self.root, run.seed,
                                          self.task, run_dir=self.out_dir, store_ram_bytes=ram_bytes))  # fmt: skip
        start = self.checkpoint.start(self.strategy, weights)  # after setup: a checkpoint overwrites its state
        self.version, self.last_round, self.roster.run_id = start.model_version, start.round, start.run_id
        elapsed_s = self.recorder.begin(start.round or None)  # round 0: a fresh run
        self.link.start()
        self.roster.announce()  # an injected link has no connect hook
        return start.weights, elapsed_s

    def _close(self, evaluations: EvaluationWorker | None) -> None:
        """However the run ends (called from a finally): the last export published, the devices told, the link down."""
        stopped = sys.exc_info()[1]  # Ctrl-C, kill or an error on its way out
        if evaluations is not None:
            evaluations.close()
        self.recorder.close()  # its last export is published before the link goes down
        try:
            self.distribution.clear()
            self.roster.goodbye(stopped)
        finally:
            self.link.stop()
        self.live.close()

    def _train(self, weights: np.ndarray, elapsed_s: float, evaluations: EvaluationWorker | None) -> np.ndarray:
        """The rounds, until the last one, the target (if asked) or the privacy budget; the final model."""
        start = time.monotonic() - elapsed_s
        for round_ in range(self.last_round + 1, self.config.run.rounds + 1):
            if self.privacy.exhausted(round_):  # it would spend more than [privacy] target_epsilon
                break
            produced = self._round(round_, weights, start, evaluations)
            weights = produced.weights
            if self.recorder.produced(produced):
                break
        self.recorder.finish()
        return weights

    def _round(self, round_: int, weights: np.ndarray, start: float, evaluations: EvaluationWorker | None) -> Produced:
        """Select and assign, collect, aggregate, record: the round's model, its row waiting for its evaluation."""
        if not self.available():
            self.wait_for_clients(len(self.online()) + 1)
        if self.on_round is not None:
            self.on_round(round_)
        t0, c0 = time.monotonic(), time.thread_time()  # CPU seconds of this thread: the parallel clock's
        told, predictions = self._assign(round_, self.version, weights)
        state, assign_s, assign_cpu_s = self.current, time.monotonic() - t0, time.thread_time() - c0
        assert state is not None
        self.live.round_started(round_, t0 - start, told)
        folding, secure = self._collect(state, weights)
        t_agg, c_agg = time.monotonic(), time.thread_time()
        dropped = None
        if state.received and folding is not None:
            weights, dropped = self._aggregate(round_, weights, folding)
            self.version += dropped is None
        done = time.monotonic()  # the model is produced: time-to-target is stamped here
        timing = {"elapsed_s": done - start, "round_s": done - t0, "assign_s": assign_s, "aggregate_s": done - t_agg,
                  "assign_cpu_s": assign_cpu_s,  # the server's work the devices wait for, on the parallel clock
                  "aggregate_cpu_s": time.thread_time() - c_agg}  # fmt: skip
        row = {**self.recorder.row(round_, timing, state, predictions, told, self.strategy, dropped), **secure}
        evaluation = self._evaluate(round_, weights, state.selected, row, evaluations)
        self.roster.forget_refused()
        return Produced(row, weights, self.version, pack_state(self.strategy), evaluation)

    # -- select ------------------------------------------------------------------------------------------------------
    def online(self) -> list[str]:
        return self.roster.online()

    def available(self) -> list[str]:
        """Online clients the strategy has not excluded."""
        excluded = self.strategy.excluded()
        return [c for c in self.online() if c not in excluded]

    def wait_for_clients(self, count: int) -> None:
        """Until ``count`` devices are online (``Roster.wait_for``), within ``clients.register_timeout_s``."""
        self.roster.wait_for(count, self.config.clients.register_timeout_s, self.dispatch.pump, self.observer.waiting)

    # -- assign ------------------------------------------------------------------------------------------------------
    def _assign(self, round_: int, version: int, weights: np.ndarray) -> tuple[dict[str, Any], dict[str, Any]]:
        """Select and open the round (``self.current`` from here on), then tell every chosen device its assignment
        (``server.assignments``: its plan, the deadline, the round's facts). What each device was told, and each
        selected one's prediction."""
        available = self.available()
        selected = self.strategy.select(round_, available)
        train_only = self.strategy.train_only(round_, available, selected)
        state = self.current = RoundState(round_, version, set(selected))
        self.dispatch.limits.new_round()
        weighting = self.strategy.params.get("weighting", "samples")  # the secure terms: weight, clip norm, ring
        secure = None if self.secure is None else partial(self.secure.begin, round_, self.run_id, version,
            self.roster.samples(selected), weighting, self.config.clients.max_weight_share)  # fmt: skip
        told, predictions = self.assignments.send(self.strategy, state, weights, selected, train_only, self.run_id,
                                                  secure)  # fmt: skip
        self.dispatch.reports.told(round_, {cid: state.assigned_steps[cid] for cid in train_only})
        return told, predictions

    # -- collect -----------------------------------------------------------------------------------------------------
    def _collect(self, state: RoundState, weights: np.ndarray) -> tuple[Round | None, dict[str, Any]]:
        """Fold each update into the round's aggregation as it is admitted (a secure round: its stages), then close the
        round. The aggregation, and a secure round's ``secure`` row (and ``dropped``)."""
        self.folding = self.strategy.begin(state.round, weights)
        self.folding.sample_weights = capped_counts(self.roster.samples(state.selected),
                                                    self.config.clients.max_weight_share)  # fmt: skip
        secure = self._secure_stages(state) if self.secure is not None else self._wait(state)
        self.admission.close(state)
        self.current, folding, self.folding = None, self.folding, None
        return folding, secure

    def _wait(self, state: RoundState) -> dict[str, Any]:
        """Pump messages until every selected device reported, failed or went offline, or the timer deadline."""
        deadline = time.monotonic() + state.deadline_s
        while (left := deadline - time.monotonic()) > 0 and any(
            self.roster.is_online(c) for c in state.selected - set(state.received) - set(state.failed)
        ):
            self.dispatch.pump(min(left, 1.0))
        for cid in sorted(state.selected - set(state.received) - set(state.failed)):
            why = "went offline" if not self.roster.is_online(cid) else f"missed the {state.deadline_s:.1f} s deadline"
            log.warning("round %d: %s %s; aggregating without it", state.round, cid, why)
        return {}

    def _secure_stages(self, state: RoundState) -> dict[str, Any]:
        """A secure round's stages in place of updates: the unmasked mean, with each survivor's own scalars."""
        assert self.secure is not None and self.folding is not None
        outcome = self.secure.collect(state, self.dispatch.pump, self.roster.is_online)
        for cid, update in outcome.updates.items():
            state.received[cid] = self.strategy.fold(self.folding, update)
            state.bytes_up[cid] = outcome.bytes_up.get(cid, 0)
        return {"secure": outcome.row, **({"dropped": outcome.dropped} if outcome.dropped else {})}

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

    # -- record ------------------------------------------------------------------------------------------------------
    def _evaluate(self, round_: int, weights: np.ndarray, selected: set[str], row: dict[str, Any],
                  evaluations: EvaluationWorker | None) -> Future[TestResult] | None:  # fmt: skip
        """When due: the server's test set on the evaluation thread (its future), while the devices evaluate on their
        held-out splits (into ``row``) and then train round t+1."""
        if not self.federated.due(round_):
            return None
        evaluation = evaluations.submit(weights, self.strategy.outputs(weights)) if evaluations is not None else None
        if self.eval_mode != "server":
            request = Evaluate(round_, self.version, weights, self.model_spec, self.config.task,
                               self.config.eval.deadline_s, self.run_id)  # fmt: skip
            row.update(self.federated.evaluate(request, self.available(), selected, self.roster, self.dispatch.pump))
        return evaluation
