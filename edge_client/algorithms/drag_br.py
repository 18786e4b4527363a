"""DRAG-BR (Byzantine-robust DRAG) client half (ALGORITHMS.md 2.8 (a)): identical to FedAvg.

Honest clients run U plain SGD steps and upload ``delta = w_0 - w_U`` (the server converts to DRAG's increment
``g_m = -delta_m``); all robustness lives in the server half (root-data reference, eq. 14). The paper gives no ``c``
for its Byzantine runs; (f)7 reuses the clean CIFAR-10 value (a fully reversed update is mapped to ``(4c - 1) r``, so
neutralising direction-reversal attacks needs ``c >= 1/4``).
"""

from __future__ import annotations

from edge_client.algorithms.contract import Contract, Setting
from edge_client.algorithms.drag import ANGLE_APPROX, DRAG_C
from edge_client.algorithms.fedavg import FedAvgClient

#: N_root of the paper (2.8 (d)), when the training set is large enough to spare it (see ``ROOT_FRACTION``).
PAPER_ROOT_SIZE = 3000

CONTRACT = Contract(
    "drag-br",
    "FedAvg clients; the server re-scales and drags each update toward a reference trained on root data",
    settings=(
        DRAG_C,
        ANGLE_APPROX,
        Setting("root_size", int, 0, f"training samples the server keeps as root data (0: the paper's "
                f"{PAPER_ROOT_SIZE} where the data allows, else a tenth of the training set)", low=0),
    ),
    needs="per_device",
    needs_why="each update's divergence from the root data set's direction",
    dp_refusal=(
        "it scales each device's update by its own divergence from the "
        "root reference, a per-device statistic the noise does not cover"
    ),
    buffered=False,
    buffered_why=(
        "the server trains its root-data reference from the round's model and rescales every update to it; a stale "
        "update started from another model than that reference"
    ),
)  # fmt: skip


class DragBRClient(FedAvgClient):
    contract = CONTRACT
