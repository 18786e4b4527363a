"""Federated evaluation: the devices evaluate the global model on their held-out splits and the server combines their
reports, weighted by samples (``[eval] mode = "clients"`` or ``"both"``); no device weighs more than
``clients.max_weight_share`` of the reports combined (``server.weight_share``).

After a round's aggregate, every ``[eval] every``-th round (and the last), the server sends an ``Evaluate`` with the
new weights to the devices that registered a held-out split (all online ones, or only the round's selected), waits
for their ``Evaluation`` reports until ``[eval] deadline_s``, and writes the combined loss and metrics, each device's
report and its evaluation time (device clock, apart from training compute) into the round's ``client_eval`` row.

Nothing a device reports is trusted: a report is refused (and logged, counted by reason) when it is of another run or
round, from a device not asked, a repeat, claims another sample count than the held-out split the device registered,
or carries a loss or metric that is not finite, not one of the task's metrics or outside the range the task declares
for it (``metric_range``: an accuracy of 1e6, a negative loss).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edge_client.learning.tasks import Task, combine_reports
from edge_client.wire.messages import Evaluate, Evaluation
from edge_client.wire.protocol import DuplicateMessage, InvalidField, NonFiniteValues, OutOfRound, ProtocolError, encode
from server.admission import WrongSampleCount
from server.config import EvalSection
from server.roster import Roster
from server.weight_share import capped_counts

log = logging.getLogger("edgefl.server")


class OutOfRange(InvalidField):
    """A loss or metric outside the range its task declares."""

    reason = "metric_range"


@dataclass
class EvalRound:
    """One evaluation request in progress: who was asked, what came back, who said it cannot."""

    round: int
    asked: set[str]
    received: dict[str, Evaluation] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


class FederatedEvaluation:
    """Who evaluates, the admission of their reports and the combined result, for one run's task."""

    def __init__(self, task: Task, settings: EvalSection, rounds: int, max_weight_share: float) -> None:
        self.task, self.settings, self.rounds = task, settings, rounds
        self.max_weight_share = max_weight_share
        self.current: EvalRound | None = None

    def due(self, round_: int) -> bool:
        """Every ``every``-th round, and the last one, so the final model is always evaluated."""
        return round_ % self.settings.every == 0 or round_ == self.rounds

    def devices(self, candidates: list[str], selected: set[str], holdout: dict[str, int]) -> list[str]:
        """The devices to ask: online candidates with a held-out split (only the round's selected, if so set)."""
        pool = [c for c in candidates if self.settings.devices == "all" or c in selected]
        chosen = [c for c in pool if holdout.get(c, 0) > 0]
        if pool and not chosen:
            log.warning(
                "no device to evaluate on: none of %s registered a held-out split (start edge-client run with "
                "--holdout 0.1)", ", ".join(pool),
            )  # fmt: skip
        return chosen

    def evaluate(self, request: Evaluate, candidates: list[str], selected: set[str], roster: Roster,
                 pump: Callable[[float], None]) -> dict[str, Any]:  # fmt: skip
        """Ask the devices (``devices``) to evaluate the request's weights on their held-out splits and combine their
        reports: the round's ``client_eval`` (none if no report came) and ``client_eval_wait_s`` (server clock:
        request, evaluation, reports). The request carries the weights: devices evaluate the model they trained from
        only when it is current."""
        t0 = time.monotonic()
        asked = self.devices(candidates, selected, {c: record.eval_samples for c, record in roster.clients.items()})
        frame = encode(request)
        for cid in asked:
            roster.link.publish(roster.topics.down(cid), frame)
        state = EvalRound(request.round, set(asked))
        self.collect(state, pump, roster.is_online)
        combined = self.result(state)
        return {
            "client_eval_wait_s": time.monotonic() - t0,
            **({"client_eval": combined} if combined is not None else {}),
        }

    def collect(self, state: EvalRound, pump: Callable[[float], None], online: Callable[[str], bool]) -> None:
        """Receive until every asked device reported, failed or went offline, or the deadline passed."""
        deadline = time.monotonic() + self.settings.deadline_s
        self.current = state
        try:
            while (remaining := deadline - time.monotonic()) > 0 and any(
                c not in state.received and c not in state.failed and online(c) for c in state.asked
            ):
                pump(min(remaining, 1.0))
        finally:
            self.current = None

    def check(self, sender: str, report: Evaluation, registered: int, run_id: str) -> None:
        """Admit ``report`` into the evaluation in progress, or raise the ProtocolError that refuses it."""
        state = self.current
        if report.client_id != sender:
            raise InvalidField(f"evaluation on the topic of {sender!r} claims client id {report.client_id!r}")
        if report.run_id != run_id or state is None or report.round != state.round or sender not in state.asked:
            now = f"round {state.round}" if state else "no evaluation"
            raise OutOfRound(f"evaluation from {sender} for round {report.round} of run {report.run_id!r} during {now}")
        if sender in state.received:
            raise DuplicateMessage(f"second evaluation from {sender} for round {state.round}")
        try:
            self._judge(sender, report, registered)
        except ProtocolError as exc:  # its one report is refused: not waited for
            state.failed.setdefault(sender, f"rejected: {exc.reason}")
            raise
        state.received[sender] = report

    def _judge(self, sender: str, report: Evaluation, registered: int) -> None:
        """Raise the ProtocolError that refuses the content of ``sender``'s report."""
        if report.num_samples != registered:
            raise WrongSampleCount(
                f"{sender} evaluated on {report.num_samples} samples; it registered {registered} held out"
            )
        values = {"loss": report.loss, **report.metrics}
        unknown = sorted(set(report.metrics) - set(self.task.higher_is_better))
        if unknown:
            raise InvalidField(f"{sender}: metrics {unknown} are not metrics of the {self.task.name} task")
        for name, value in values.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise NonFiniteValues(f"{sender}: evaluation {name} = {value!r} is not a finite number")
            if why := self.task.out_of_range(name, value):
                raise OutOfRange(f"{sender}: evaluation {why}")

    def failed(self, sender: str, round_: int, reason: str) -> bool:
        """Note that ``sender`` cannot evaluate this round; False when no such request is in progress."""
        state = self.current
        if state is None or round_ != state.round or sender not in state.asked or sender in state.received:
            return False
        state.failed[sender] = reason
        return True

    def result(self, state: EvalRound) -> dict[str, Any] | None:
        """The round's ``client_eval``: combined loss and metrics, samples, and each device's report; None when no
        device reported."""
        reports = state.received
        for cid in sorted(state.asked - set(reports)):
            why = state.failed.get(cid, f"no report within {self.settings.deadline_s:g} s")
            log.warning("round %d: %s did not evaluate (%s); combining without it", state.round, cid, why)
        if not reports:
            return None
        weights = capped_counts({cid: r.num_samples for cid, r in reports.items()}, self.max_weight_share)
        combined = combine_reports(
            self.task, [(weights[cid], {"loss": r.loss, **r.metrics}) for cid, r in reports.items()]
        )
        return {
            **combined,
            "num_samples": sum(r.num_samples for r in reports.values()),
            "slowest_eval_s": max(r.eval_s for r in reports.values()),
            "missing": sorted(state.asked - set(reports)),
            "devices": {
                cid: {"num_samples": r.num_samples, "loss": r.loss, **r.metrics, "eval_s": r.eval_s, "cpu_s": r.cpu_s}
                | ({"weight_samples": weights[cid]} if weights[cid] != r.num_samples else {})  # capped
                for cid, r in sorted(reports.items())
            },
        }
