"""Compute reports: clients told to train without uploading (FedUmf's unselected ones) say what they spent, so the
fleet's compute counts it (without them FedUmf's is undercounted by about 1 - C).

No round waits for such a client, so its report may arrive after its round closed: one is accepted once per (round,
client) for any of the last ``KEEP_ROUNDS`` rounds in which that client was told to train without uploading, with at
least one and at most the steps it was told, from this run; anything else is refused with the usual reason codes.
An accepted report is counted in the metrics row of the round in which it arrived (``train_only``).
"""

from __future__ import annotations

from typing import Any

from edge_client.wire.messages import ComputeReport
from edge_client.wire.protocol import DuplicateMessage, InvalidField, OutOfRound
from server.admission import WrongSteps

KEEP_ROUNDS = 4


class ComputeReports:
    """Who was told to train without uploading in the last rounds, and the reports accepted since the last row."""

    def __init__(self) -> None:
        self._told: dict[int, dict[str, int]] = {}  # round -> client -> steps it was told; reported ones removed
        self._reported: dict[int, set[str]] = {}
        self._pending: list[dict[str, Any]] = []

    def told(self, round_: int, steps: dict[str, int]) -> None:
        """This round's train-only clients and their steps; rounds older than ``KEEP_ROUNDS`` are forgotten."""
        self._told[round_], self._reported[round_] = dict(steps), set()
        for old in [r for r in self._told if r <= round_ - KEEP_ROUNDS]:
            del self._told[old], self._reported[old]

    def take(self, sender: str, report: ComputeReport, run_id: str) -> dict[str, Any]:
        """Accept ``report`` (its row entry) or raise the ProtocolError that refuses it."""
        if report.client_id != sender:
            raise InvalidField(f"compute report on the topic of {sender!r} claims client id {report.client_id!r}")
        if report.run_id != run_id:
            raise OutOfRound(f"compute report from {sender} belongs to run {report.run_id!r}, not {run_id!r}")
        told = self._told.get(report.round, {})
        if sender in self._reported.get(report.round, set()):
            raise DuplicateMessage(f"second compute report from {sender} for round {report.round}")
        if sender not in told:
            raise OutOfRound(f"{sender} was not told to train without uploading in round {report.round} (or it is "
                             f"more than {KEEP_ROUNDS} rounds ago)")  # fmt: skip
        if not 1 <= report.local_steps <= told[sender]:
            raise WrongSteps(f"{sender} reports {report.local_steps} local steps; it was told {told[sender]}")
        self._reported[report.round].add(sender)
        entry = {"client": sender, "round": report.round, "local_steps": report.local_steps,
                 "compute_s": report.compute_s, "cpu_s": report.cpu_s}  # fmt: skip
        self._pending.append(entry)
        return entry

    def drain(self) -> list[dict[str, Any]]:
        """The reports accepted since the last call (for this round's metrics row)."""
        out, self._pending = self._pending, []
        return out
