"""A round's assignments: the plan the strategy wants for each device, its steps fitted to the round's budget, and
the round's facts beside it, sent once the round's model went out.

The strategy makes each device's plan (``Strategy.assign``) and ``train.steps_policy`` may fit its steps to the round
(``server.steps_policy``); the plan then travels as it is. The round's facts (round, model version and the sha256 of
the model ``server.distribution`` broadcast once, deadline, the device's upload codec from ``server.codec_policy``,
whether it uploads, its secure-aggregation terms) are a record of their own. Kept apart from the round loop, which
decides who is selected and when the round closes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from edge_client.wire.messages import RoundFacts
from edge_client.wire.plan import Plan
from edge_client.wire.topics import Topics
from edge_client.wire.transport import Link
from server.admission import RoundState
from server.codec_policy import CodecPolicy
from server.config import RunConfig
from server.deadlines import DeviceTimes, round_deadline
from server.delivery import Delivery
from server.distribution import Distribution
from server.steps_policy import StepsPolicy
from server.strategies import Strategy
from server.strategies.base import assignment_summary


class Assignments:
    """Makes and sends a round's assignments; the strategy is the loop's at each call (a test may swap it)."""

    def __init__(
        self,
        config: RunConfig,
        model_spec: dict[str, Any],
        link: Link,
        topics: Topics,
        *,
        distribution: Distribution,
        codecs: CodecPolicy,
        steps_policy: StepsPolicy,
        times: DeviceTimes,
        delivery: Delivery,
    ) -> None:
        self.config = config
        self.model_spec = model_spec
        self.link = link
        self.topics = topics
        self.distribution = distribution
        self.codecs = codecs
        self.steps_policy = steps_policy
        self.times = times
        self.delivery = delivery

    def send(
        self,
        strategy: Strategy,
        state: RoundState,
        weights: np.ndarray,
        selected: list[str],
        train_only: list[str],
        run_id: str,
        secure: Callable[[dict[str, Plan]], dict[str, dict[str, Any]]] | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Plan every device's round (steps fitted), set the round's deadline from what each of ``selected`` (the
        state's, in the strategy's order) is predicted to need (``server.deadlines``), publish the round's model once,
        then send each device its plan and the round's facts (``secure``: each selected device's secure-aggregation
        terms, from the plans, whose DP noise share the ring leaves room for). What each device was told, and each
        selected one's prediction."""
        plans = {cid: strategy.assign(state.round, cid) for cid in [*selected, *train_only]}
        for cid, plan in plans.items():
            plan.steps = self.steps_policy.steps(cid, plan.steps)
        predictions = {cid: self.times.predict(cid, plans[cid].steps) for cid in selected}
        state.deadline_s = round_deadline(self.config.clients, predictions)
        state.assigned_steps.update({cid: plan.steps for cid, plan in plans.items()})
        self.times.round_started()
        terms = {} if secure is None else secure(plans)
        sha256 = self.distribution.publish(state.round, state.model_version, weights, plans, run_id)  # the model, once
        facts = {cid: self.facts(strategy, state, cid, sha256, run_id, terms.get(cid, {})) for cid in plans}
        told: dict[str, Any] = {}
        for cid, (assignment, size) in self.distribution.send(plans, facts).items():
            self.times.sent(cid)
            self.delivery.assigned(state.round, cid, assignment)  # naming the model, which a device may ask for
            told[cid] = {**assignment_summary(plans[cid], facts[cid]), **self.codecs.describe(cid), "bytes_down": size}
        return told, {cid: p and p.row() for cid, p in predictions.items()}

    def facts(self, strategy: Strategy, state: RoundState, cid: str, sha256: str, run_id: str,
              secure: dict[str, Any] | None = None) -> RoundFacts:  # fmt: skip
        """``cid``'s facts of the round (or of a buffered loop's aggregation step), its upload codec noted in
        ``state``; its uplink counted from here on."""
        state.codecs[cid] = self.codecs.codec_for(cid)
        self.link.take_bytes_in(self.topics.up(cid))  # bytes_up counts what arrives from here on
        return RoundFacts(
            round=state.round, model_version=state.model_version, sha256=sha256, deadline_s=state.deadline_s,
            codec=str(state.codecs[cid]), upload=cid in state.selected, run_id=run_id, algorithm=strategy.name,
            model=self.model_spec, task=self.config.task, seed=self.config.run.seed, secure=secure or {},
        )  # fmt: skip
