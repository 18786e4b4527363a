"""FedNova client half (ALGORITHMS.md 2.10 (a)): FedAvg's plain SGD for the ``tau_i`` steps the server assigns.

With plain SGD, ``G_i = (1/tau_i) sum_lambda g_lambda = delta_i / (eta tau_i)`` exactly, so the client uploads only
``delta`` (the wire's descent-positive difference) and the server normalises it with the steps the update reports
(``Update.local_steps``); ``D_i`` is what the client declared when it registered. Nothing is kept across rounds.
"""

from __future__ import annotations

from edge_client.algorithms.contract import Contract, Setting
from edge_client.algorithms.fedavg import FedAvgClient

CONTRACT = Contract(
    "fednova",
    "each client runs floor(E*D_i/B) local steps; the server averages step-normalised updates",
    settings=(
        Setting("epochs", float, 1.0, "E: local epochs, tau_i = floor(E D_i / B)", low=0.0, low_open=True),
        Setting("local_steps_mode", str, "epochs", "tau_i from the client's data size, or train.local_steps for all",
                choices=("epochs", "fixed")),
    ),
    unequal_steps=True,
    needs="mean_per_step",
    dp_refusal="", dp_requires=(("local_steps_mode", "fixed"),),  # tau_i from D_i: a per-device release
    buffered=True,
    buffered_why=(
        "each update is normalised by the steps its device ran before it is averaged, so devices of any speed and any "
        "steps policy mix, and the server keeps no state between aggregations"
    ),
)  # fmt: skip


class FedNovaClient(FedAvgClient):
    contract = CONTRACT
