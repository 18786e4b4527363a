"""Who shares with whom: SecAgg+'s sparse graph (Bell et al., CCS 2020) or the complete graph of the original.

With ``degree`` below the number of devices minus one, each device is joined to ``degree // 2`` devices on either
side of it in a random cyclic order (a Harary graph under a random permutation): each device agrees masks with and
shares its secrets among its neighbours alone, so its cost grows with the degree, not with the fleet."""

from __future__ import annotations

import random


def neighbours(ids: list[str], degree: int, seed: int) -> dict[str, list[str]]:
    """Each device's neighbours (symmetric; sorted). ``degree`` 0 or >= len(ids) - 1: everyone else."""
    ids = sorted(ids)
    n = len(ids)
    if degree <= 0 or degree >= n - 1:
        return {u: [v for v in ids if v != u] for u in ids}
    half = max(1, (degree + 1) // 2)
    order = ids[:]
    random.Random(seed).shuffle(order)
    graph: dict[str, set[str]] = {u: set() for u in ids}
    for i, u in enumerate(order):
        for step in range(1, half + 1):
            v = order[(i + step) % n]
            graph[u].add(v)
            graph[v].add(u)
    return {u: sorted(vs) for u, vs in graph.items()}


def share_points(holders: list[str]) -> dict[str, int]:
    """The Shamir point of each holder of an owner's shares (its neighbours and itself): 1 + its place in the sorted
    list (both ends derive it)."""
    return {v: i + 1 for i, v in enumerate(sorted(holders))}
