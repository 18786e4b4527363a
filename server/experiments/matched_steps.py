"""Baselines at another algorithm's total SGD steps: ``[bench] match_steps = "fedveca"`` (FedVeca sec. IV-A1).

FedVeca's paper compares at matched work, not at a fixed step count: "we first run FedVeca algorithm and then record
the total number of local iterations tau_all run by all nodes in all K rounds", then FedAvg and FedNova get a fixed
``tau_(k,i) = floor(E_avg D_i / B)`` every round with ``E_avg = tau_all / K x B / D``. With ``match_steps`` the bench
runs the named algorithm of a cell (variant, partition, seed) first and gives every other algorithm of that cell:

- an algorithm with an ``epochs`` setting (FedNova): ``epochs = E_avg``, the paper's per-client rule;
- every algorithm: ``train.local_steps = round(tau_mean)``, ``tau_mean`` the source's steps per client and round
  (``tau_all / (K N)`` with every client in every round). FedAvg's contract has no per-client rule, so every
  client runs this mean.

``E_avg`` is written ``tau_mean N B / D``: the paper's ``tau_all / K x B / D`` when all N clients train every round,
and still the mean per client that trained under partial participation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from edge_client.algorithms import contract_of
from server.config import ConfigError
from server.experiments.suites import RunSpec


def source_record(records: list[dict[str, Any]], spec: RunSpec, source: str) -> dict[str, Any]:
    """The finished run of ``source`` in the same cell as ``spec``; a missing one names the key and the fix."""
    cell = (spec.variant, spec.partition, spec.seed, source)
    for record in records:
        if (record["variant"], record["partition"], record["seed"], record["algorithm"]) == cell:
            return record
    raise ConfigError(
        f"bench.match_steps = {source!r}: {spec.algorithm} in {spec.column}, seed {spec.seed} is given {source}'s "
        f"total local steps, but {source} did not run there; keep {source} in bench.algorithms (or --algorithms)"
    )


def matched(spec: RunSpec, source: dict[str, Any]) -> tuple[RunSpec, dict[str, Any]]:
    """``spec`` given ``source``'s total local steps, and the derivation (recorded beside the run)."""
    tau_all = sum(p["local_steps"] for p in source["curve"])
    trained = sum(p["trained"] for p in source["curve"])
    samples = source["client_samples"]
    if not tau_all or not trained:
        raise ConfigError(f"bench.match_steps: the {source['algorithm']} run {source['path']} ran no local steps")
    tau_mean = tau_all / trained
    config = spec.config
    train = dataclasses.replace(config.train, local_steps=max(1, round(tau_mean)))
    derived: dict[str, Any] = {
        "source": source["algorithm"],
        "source_local_steps": tau_all,
        "tau_mean": tau_mean,
        "local_steps": train.local_steps,
    }
    algorithm = dict(config.algorithm)
    if any(s.name == "epochs" for s in contract_of(spec.algorithm).all_settings):
        epochs = tau_mean * len(samples) * config.train.batch_size / sum(samples.values())
        algorithm[spec.algorithm] = {**algorithm.get(spec.algorithm, {}), "epochs": epochs}
        derived["epochs"] = epochs
    config = dataclasses.replace(config, train=train, algorithm=algorithm).validate()
    return dataclasses.replace(spec, config=config), derived
