"""The client half of an aggregation algorithm: hooks around the local SGD loop.

Corrections are applied analytically to the gradients (one vector operation per step), never by adding a regulariser
to the loss and back-propagating it. The trainer owns the loop; an algorithm only says what differs from FedAvg.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import nn

from edge_client.protocol import Assignment


class ClientAlgorithm:
    """FedAvg's client half is the empty behaviour: plain SGD, upload ``delta`` only."""

    name = "fedavg"

    def begin_round(self, model: nn.Module, assignment: Assignment) -> None:
        """Called after the global weights are loaded, before the first local step."""

    def correct(self, model: nn.Module, step: int) -> None:
        """Called after backward, before the optimiser step: adjust ``p.grad`` in place."""

    def end_round(
        self, model: nn.Module, assignment: Assignment, delta: np.ndarray
    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """Scalars and vectors to upload beside ``delta``."""
        return {}, {}
