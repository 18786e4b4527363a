"""DRAG client half (ALGORITHMS.md 2.8 (a)): identical to FedAvg, U plain SGD steps, upload ``delta = w_0 - w_U``.

DRAG's upload is the increment ``g_m = theta_m^{t,U} - theta^t``; the wire carries the descent-positive ``delta``
(C1) and the server converts ``g_m = -delta_m``. Nothing is kept across rounds.
"""

from __future__ import annotations

from edge_client.algorithms.fedavg import FedAvgClient


class DragClient(FedAvgClient):
    name = "drag"
