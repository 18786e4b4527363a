"""Server halves of the aggregation algorithms, one file each, selected by name (``--algorithm``)."""

from __future__ import annotations

from typing import Any

from server.strategies.base import Instructions, ServerContext, Strategy, TrainSettings
from server.strategies.fedavg import FedAvg

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (FedAvg,)}

__all__ = ["STRATEGIES", "Instructions", "ServerContext", "Strategy", "TrainSettings", "make_strategy"]


def make_strategy(name: str, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> Strategy:
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {sorted(STRATEGIES)}") from None
    return cls(settings, params, seed)
