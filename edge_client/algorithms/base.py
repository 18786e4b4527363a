"""The client half of an aggregation algorithm: hooks around the local SGD loop.

Corrections are applied analytically to the flat gradient vector (one or two vector operations per step), never by
adding a regulariser to the loss and back-propagating it. The trainer owns the loop; an algorithm says only what
differs from FedAvg. Sign convention (ALGORITHMS.md C1): the upload is ``delta = w_t - w_end``, descent-positive.
What the server sends and what comes back is declared once in the algorithm's :class:`Contract`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from edge_client.algorithms.contract import Contract, ContractError
from edge_client.learning.data import ArrayDataset, BatchSampler
from edge_client.learning.flat import FlatModel
from edge_client.wire.messages import RoundFacts
from edge_client.wire.plan import Plan


@dataclass
class LocalContext:
    """Everything a client half may read or adjust during one round.

    ``flat.params`` is the current iterate ``w_{i,k}`` and ``flat.grad`` the mini-batch gradient ``g_{i,k}`` (a
    correction adds into it); ``start`` is the global model ``w_t`` as received (a copy, never modified); ``plan``
    what the server's half wants of this round, ``facts`` the round's (its number, model version, whether this device
    uploads).
    """

    flat: FlatModel
    start: torch.Tensor
    plan: Plan
    facts: RoundFacts
    dataset: ArrayDataset
    sampler: BatchSampler

    def setting(self, name: str) -> Any:
        """A setting or per-round value the server sent (checked against the contract when the plan was made)."""
        return self.plan.settings[name]

    def has_array(self, name: str) -> bool:
        return name in self.plan.arrays

    def array(self, name: str) -> torch.Tensor:
        """A vector sent with the assignment (a torch view of the wire array, read-only)."""
        try:
            arr = self.plan.arrays[name]
        except KeyError:
            raise ContractError(f"the plan carries no array {name!r}") from None
        return torch.from_numpy(np.array(arr, dtype=np.float32, copy=not arr.flags.writeable))


class ClientAlgorithm:
    """FedAvg's client half is the empty behaviour: plain SGD, upload ``delta`` only."""

    contract: ClassVar[Contract]

    @property
    def name(self) -> str:
        return self.contract.name

    def begin_round(self, ctx: LocalContext) -> None:
        """After the global weights are loaded, before the first local step (may move the start point)."""

    def correct(self, ctx: LocalContext, step: int, xb: torch.Tensor, yb: torch.Tensor) -> None:
        """After backward, before the optimiser step: adjust ``ctx.flat.grad`` in place."""

    def end_round(self, ctx: LocalContext, delta: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """Values and vectors to upload beside ``delta``; also the place to update state kept across rounds."""
        return {}, {}

    def uploaded(self, arrays: dict[str, np.ndarray]) -> None:
        """The arrays its contract declares ``codec="commit"``, as the server decodes them from this round's upload
        (lossy when the upload was compressed): the algorithm adopts them where it keeps state derived from them."""

    def state_dict(self) -> dict[str, np.ndarray]:
        """State that must survive a client restart (SCAFFOLD's c_i, FedUmf's stored update)."""
        return {}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Restore what ``state_dict`` returned."""
