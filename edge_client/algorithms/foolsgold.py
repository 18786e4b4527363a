"""FoolsGold client half (ALGORITHMS.md 2.3): FedAvg's client; all of it happens on the server."""

from __future__ import annotations

from edge_client.algorithms.contract import Contract, Setting
from edge_client.algorithms.fedavg import FedAvgClient

CONTRACT = Contract(
    "foolsgold",
    "FedAvg with each update weighted by its clipped cosine to the mean update (TACO's FoolsGold)",
    settings=(
        Setting("clip_negative", bool, True, "rho_i = max(0, cos) (2.3 (f)3)"),
        Setting("reference", str, "current_mean", "the direction updates are compared with (2.3 (f)1)",
                choices=("current_mean", "prev_global")),
        Setting("extra_1_over_N", bool, False, "multiply the step by 1/|S_t| (the printed extra 1/N, [LITERAL])"),
        Setting("fixed_point_iters", int, 1, "evaluations of rho, each against the previous rho-weighted aggregate",
                low=1),
    ),
    needs="per_device",
    needs_why="the pairwise similarities of devices' updates",
    dp_refusal=(
        "its weights come from the pairwise similarities of the devices' "
        "own updates, a per-device statistic the noise does not cover"
    ),
    buffered=False,
    buffered_why=(
        "each update is weighted by its cosine to the mean of the round's updates (or the last global step): it needs "
        "the whole round's updates of one model version in hand"
    ),
)  # fmt: skip


class FoolsGoldClient(FedAvgClient):
    contract = CONTRACT
