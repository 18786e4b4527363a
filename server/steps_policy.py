"""The steps policy: how many local steps each client is told, chosen apart from the aggregation algorithm.

``train.steps_policy = "fixed"``: what the algorithm says (``train.local_steps``, FedNova's ``floor(E D_i / B)``,
FedVeca's tau). ``"deadline"``: the most steps the client can finish within ``train.round_budget_s`` at its own last
measured speed (the budget minus its transfers and its per-round overhead, over its seconds per step, each clamped to
a physical range; ``server.deadlines``), at least
``train.tau_min`` and at most ``train.tau_max`` (0: ``train.local_steps``); with an algorithm that chooses each
client's steps itself (its contract's ``adaptive_steps``: FedVeca's tau) never more than what it chose. A client that
has not been measured yet is told what the algorithm says, within the same bounds.

It is offered only with algorithms whose contract says they tolerate unequal steps (``unequal_steps``: the aggregation
normalises each update by the steps its client ran, as FedNova and FedVeca do; the configuration refuses the others).
Averaging raw updates of unequal step counts, as FedAvg does, minimises a different objective, weighted towards the
clients that ran more steps: objective inconsistency (Wang et al., "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS 2020, the FedNova paper).
"""

from __future__ import annotations

import math

from edge_client.algorithms.contract import Contract
from server.config import TrainSection
from server.deadlines import MIN_S_PER_STEP, DeviceTimes


class StepsPolicy:
    """The steps each client is told this round, given what the algorithm proposed."""

    def __init__(self, train: TrainSection, contract: Contract, times: DeviceTimes) -> None:
        self.deadline = train.steps_policy == "deadline"
        self.budget_s = train.round_budget_s
        self.tau_min = train.tau_min
        self.tau_max = train.tau_max or train.local_steps
        self.adaptive = contract.adaptive_steps
        self.times = times

    def steps(self, client_id: str, proposed: int) -> int:
        if not self.deadline:
            return proposed
        cap = min(self.tau_max, proposed) if self.adaptive else self.tau_max
        floor = min(self.tau_min, proposed) if self.adaptive else self.tau_min
        e = self.times.estimates.get(client_id)
        if e is None:  # not measured yet: what the algorithm says
            return max(floor, min(cap, proposed))
        # compared before the floor: a budget of inf or a tiny s_per_step gives a quotient no int holds
        fit = (self.budget_s - e.transfer_s - e.overhead_s) / max(e.s_per_step, MIN_S_PER_STEP) + 1e-9
        return max(floor, cap if not fit < cap else math.floor(fit))
