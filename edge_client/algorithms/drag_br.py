"""DRAG-BR (Byzantine-robust DRAG) client half (ALGORITHMS.md 2.8 (a)): identical to FedAvg.

Honest clients run U plain SGD steps and upload ``delta = w_0 - w_U`` (the server converts to DRAG's increment
``g_m = -delta_m``); all robustness lives in the server half (root-data reference, eq. 14).
"""

from __future__ import annotations

from edge_client.algorithms.fedavg import FedAvgClient


class DragBRClient(FedAvgClient):
    name = "drag-br"
