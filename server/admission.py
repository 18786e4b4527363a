"""Admission: every update is judged against the round it was assigned for and its algorithm's contract before any
strategy sees it.

Nothing a device sends is trusted. An update is refused, with a reason code of its own, when it is late, of another run
or for another round (``out_of_round``), from a client not selected (``out_of_round``), a repeat (``duplicate``),
trained on a model version the round never sent (``model_version``), claims more local steps than it was told or none
(``steps``), claims another sample count than its client registered with (``num_samples``: data-size weights come from
the registration, never from an update), or carries a ``delta`` or any other array that is mis-shaped (``shape``), not
finite (``non_finite``) or above its norm bound (``norm``: for ``delta`` the fixed ``train.max_update_norm`` and, from
the second round on, ``train.max_norm_ratio`` x the median norm per local step of the previous round's admitted deltas
x the update's steps, whichever is lower; ``max_norm_<array>`` for the contract's arrays), a value its contract does
not declare, lacks or bounds (``invalid_field``/``missing_field``), or an array compressed otherwise than its device
was told and its contract allows (``codec``: float32 is always accepted). Arrays are judged as decoded: a compressed
payload that does not decode never gets this far."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_client.algorithms.contract import Contract, checked_norm
from edge_client.wire.codecs import FP32, CodecSpec
from edge_client.wire.messages import Update
from edge_client.wire.protocol import (
    DuplicateMessage,
    InvalidField,
    MissingField,
    NonFiniteValues,
    OutOfRound,
    ProtocolError,
    ShapeMismatch,
)


class UnknownModelVersion(OutOfRound):
    """An update trained on a model version the round never sent."""

    reason = "model_version"


class AbsurdNorm(InvalidField):
    """An array whose norm is far larger than any honest one."""

    reason = "norm"


class WrongSteps(InvalidField):
    """More local steps than the client was told, or none."""

    reason = "steps"


class WrongSampleCount(InvalidField):
    """An update claiming another sample count than its client registered with."""

    reason = "num_samples"


class WrongCodec(InvalidField):
    """An array compressed with another codec than its device was told, or one its algorithm's contract forbids."""

    reason = "codec"


_BY_REASON: dict[str, type[ProtocolError]] = {
    c.reason: c for c in (InvalidField, MissingField, ShapeMismatch, NonFiniteValues, AbsurdNorm, WrongCodec)
}


@dataclass
class RoundState:
    """What admission needs to judge an update for the round in progress, and what it admitted."""

    round: int
    model_version: int
    selected: set[str]
    received: dict[str, Update] = field(default_factory=dict)
    bytes_up: dict[str, int] = field(default_factory=dict)
    assigned_steps: dict[str, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # client -> the reason it reported for not serving
    deadline_s: float = 0.0
    codecs: dict[str, CodecSpec] = field(default_factory=dict)  # client -> the upload codec it was told (else fp32)
    step_norms: dict[str, float] = field(default_factory=dict)  # client -> |delta| / local steps of its admitted update


class Admission:
    """The gate between the link and the strategy, for one run's contract, settings and model size."""

    def __init__(
        self,
        contract: Contract,
        params: Mapping[str, Any],
        num_params: int,
        max_update_norm: float,
        max_norm_ratio: float = math.inf,
    ) -> None:
        self.contract = contract
        self.params = params
        self.num_params = num_params
        self.max_update_norm = max_update_norm
        self.max_norm_ratio = max_norm_ratio
        # the median |delta| per local step of the last round that admitted a moving update (None: no such round yet)
        self.reference: float | None = None

    def norm_bound(self, steps: int) -> tuple[float, str]:
        """The bound on the norm of a delta of ``steps`` local steps, and the setting it comes from: relative to the
        previous round, a multiple of what the honest majority moved, never above the fixed outer limit."""
        if self.reference is not None and math.isfinite(self.max_norm_ratio):
            relative = self.max_norm_ratio * self.reference * steps
            if relative < self.max_update_norm:
                return relative, (
                    f"train.max_norm_ratio {self.max_norm_ratio:g} x {self.reference:.4g}, the previous round's median "
                    f"norm per step, x {steps} steps"
                )
        return self.max_update_norm, "train.max_update_norm"

    def close(self, state: RoundState) -> None:
        """Take the round's admitted norms as the next round's reference (kept when none moved: zero deltas say
        nothing of an honest step's size)."""
        moved = [n for n in state.step_norms.values() if n > 0]
        if moved:
            self.reference = float(np.median(moved))

    def check(
        self, sender: str, update: Update, state: RoundState | None, registered: int | None, run_id: str
    ) -> float:
        """Raise the ProtocolError that rejects ``update``, or return the norm of its ``delta`` when it may reach the
        strategy (measured here anyway, so the strategies that need it do not read the delta once more) and note it in
        ``state`` for the next round's relative bound."""
        if update.client_id != sender:
            raise InvalidField(f"update on the topic of {sender!r} claims client id {update.client_id!r}")
        if update.run_id != run_id:
            raise OutOfRound(f"update from {sender} belongs to run {update.run_id!r}, not to this run {run_id!r}")
        if state is None or update.round != state.round:
            now = state.round if state else "no round"
            raise OutOfRound(f"update from {sender} for round {update.round} arrived during round {now}; discarded")
        if sender not in state.selected:
            raise OutOfRound(f"{sender} was not selected for round {state.round}")
        if sender in state.received:
            raise DuplicateMessage(f"second update from {sender} for round {state.round}")
        if update.model_version != state.model_version:
            raise UnknownModelVersion(
                f"{sender} trained on model version {update.model_version}, round {state.round} sent version "
                f"{state.model_version}"
            )
        assigned = state.assigned_steps[sender]
        if not 1 <= update.local_steps <= assigned:
            raise WrongSteps(f"{sender} claims {update.local_steps} local steps; it was told {assigned}")
        if update.num_samples != registered:
            raise WrongSampleCount(f"{sender} claims {update.num_samples} samples; it registered with {registered}")
        bound, setting = self.norm_bound(update.local_steps)
        norm, problems = checked_norm("delta", update.delta, self.num_params, bound)
        if problems and problems[0][0] == "norm":
            problems = [("norm", f"{problems[0][1]} ({setting})")]
        problems += self.contract.check_returned(self.params, update.extras, update.arrays, self.num_params)
        problems += self.codec_problems(sender, update, state.codecs.get(sender, FP32))
        if problems:
            reason, text = problems[0]
            raise _BY_REASON[reason](f"{sender}: {text}")
        state.step_norms[sender] = norm / update.local_steps
        return norm

    def codec_problems(self, sender: str, update: Update, told: CodecSpec) -> list[tuple[str, str]]:
        """Arrays that arrived compressed otherwise than ``told`` and their declared rule make them."""
        problems = []
        for name, wire in update.codecs.items():
            rule = self.contract.codec_rule(name)
            want = told.for_rule(rule).wire(self.num_params)
            if wire != want:
                text = f"{name!r} arrived as {wire}; told {told} and declared codec={rule!r}, it must be {want} or <f4"
                problems.append(("codec", text))
        return problems
