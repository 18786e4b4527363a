"""DRAG client half (ALGORITHMS.md 2.8 (a)): identical to FedAvg, U plain SGD steps, upload ``delta = w_0 - w_U``.

DRAG's upload is the increment ``g_m = theta_m^{t,U} - theta^t``; the wire carries the descent-positive ``delta``
(C1) and the server converts ``g_m = -delta_m``. Nothing is kept across rounds. Defaults ``c = 0.1``,
``alpha = 1.0``: the paper's CIFAR-10 full-participation values (2.8 (d); EMNIST uses ``c = 0.25``; partial
participation uses ``alpha = 0.6`` (EMNIST) / ``0.2`` (CIFAR-10)).
"""

from __future__ import annotations

from edge_client.algorithms.contract import Contract, Setting
from edge_client.algorithms.fedavg import FedAvgClient

#: eq. 10 as printed (arccos(x) ~ pi/2 (1 - x)); the paper's alternative arccos(x) ~ pi/2 - x; the exact angle.
ANGLE_APPROX = Setting(
    "angle_approx", str, "linear_pi_over_2", "how eq. 10 approximates the angle between an update and the reference",
    choices=("linear_pi_over_2", "linear_unit", "exact_arccos"),
)  # fmt: skip
DRAG_C = Setting("c", float, 0.1, "c of eq. 10: the largest degree of divergence is 2c", low=0.0, high=1.0)

CONTRACT = Contract(
    "drag",
    "FedAvg clients; the server drags each update toward a momentum reference direction (DRAG)",
    settings=(
        DRAG_C,
        Setting("alpha", float, 1.0, "momentum of the reference r <- (1 - alpha) r + alpha Delta (eq. 6)",
                low=0.0, high=1.0),
        ANGLE_APPROX,
    ),
    needs="per_device",
    needs_why="each update's divergence from the reference direction",
    dp_refusal=(
        "it scales each device's update by its own divergence from the reference "
        "direction, a per-device statistic the noise does not cover"
    ),
    buffered=False,
    buffered_why=(
        "each update is dragged toward a reference direction built from the round's updates of one model version; a "
        "stale update's direction is relative to another model"
    ),
)  # fmt: skip


class DragClient(FedAvgClient):
    contract = CONTRACT
