"""Server halves of the aggregation algorithms, one file each, selected by name (``--algorithm``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from server.strategies.base import ServerContext, Strategy, TrainSettings
from server.strategies.drag import Drag
from server.strategies.drag_br import DragBR
from server.strategies.fedacg import FedACG
from server.strategies.fedavg import FedAvg
from server.strategies.fednova import FedNova
from server.strategies.fedprox import FedProx
from server.strategies.fedprox_taco import FedProxTaco
from server.strategies.fedumf import FedUmf
from server.strategies.fedveca import FedVeca
from server.strategies.foolsgold import FoolsGold
from server.strategies.scaffold import Scaffold
from server.strategies.scaffold_taco import ScaffoldTaco
from server.strategies.stem import Stem
from server.strategies.taco import Taco

if TYPE_CHECKING:  # at run time a circle: server.config imports this package's store, which runs this file first
    from server.config import RunConfig

STRATEGIES: dict[str, type[Strategy]] = {
    cls.contract.name: cls
    for cls in (
        FedAvg, FedProx, FoolsGold, Scaffold, Stem, FedACG, Taco, FedProxTaco, ScaffoldTaco,
        Drag, DragBR, FedUmf, FedNova, FedVeca,
    )
}  # fmt: skip

__all__ = ["STRATEGIES", "ServerContext", "Strategy", "TrainSettings", "build_strategy", "make_strategy"]


def make_strategy(
    name: str, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0, rounds: int = 0
) -> Strategy:
    """The strategy ``name``; ``rounds`` (the run's total) fills a ``rounds`` parameter the config left unset."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {sorted(STRATEGIES)}") from None
    params = dict(params or {})
    if rounds and any(s.name == "rounds" for s in cls.contract.settings) and not params.get("rounds"):
        params["rounds"] = rounds
    return cls(settings, params, seed)


def build_strategy(config: RunConfig) -> Strategy:
    """The configured strategy (``train.algorithm``, its ``[algorithm.<name>]`` settings, ``config.train_settings()``);
    building it checks what the contract alone cannot (e.g. FedVeca's tau bounds)."""
    return make_strategy(config.train.algorithm, config.train_settings(), config.algorithm_params(), config.run.seed,
                         rounds=config.run.rounds)  # fmt: skip
