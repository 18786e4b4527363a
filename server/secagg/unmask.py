"""Removing the masks from the sum of a round's masked inputs, from the shares devices revealed.

For every device that sent a masked input its self-mask seed is rebuilt (checked against the commitment it
published) and its stream subtracted; for every device that shared its keys but dropped before masking, its mask
secret key is rebuilt (checked against its public key) and each pairwise stream it left in a survivor's input is
removed. Pairwise masks between survivors cancel in the sum by themselves. A wrong share makes a rebuilt secret fail
its check; the other subsets of the shares are tried (bounded), so a few wrong shares are outvoted when enough right
ones came, and otherwise the round is dropped with the reason.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from edge_client.secagg import crypto, shamir
from edge_client.secagg.device import Keys, pair_sign, pairwise_seed
from edge_client.secagg.graph import share_points
from edge_client.secagg.ring import Ring

MAX_SUBSETS = 256  # subsets of revealed shares tried per secret before giving up on it


class Unrecoverable(ValueError):
    """A secret could not be rebuilt: too few shares, or none of the tried subsets checks out."""

    reason = "secagg_unrecoverable"


@dataclass
class Ledger:
    """What the server recorded of one secure round, stage by stage."""

    context: bytes
    threshold: int
    keys: dict[str, Keys]  # stage 1: every device that advertised keys
    rosters: dict[str, list[str]]  # the neighbours each device was sent (with it, its shares' holders and points)
    commits: dict[str, str]  # stage 2: each sharing device's commitment to its self-mask seed
    relayed: dict[str, set[str]]  # owner -> the devices its shares were relayed to (they mask with it)


def rebuild(shares: dict[int, bytes], threshold: int, check: Callable[[bytes], bool], what: str) -> bytes:
    """A secret from ``threshold`` of ``shares`` that passes ``check``, trying subsets when one does not."""
    if len(shares) < threshold:
        raise Unrecoverable(f"{what}: {len(shares)} shares revealed, {threshold} needed")
    points = sorted(shares)
    for subset in itertools.islice(itertools.combinations(points, threshold), MAX_SUBSETS):
        try:
            secret = shamir.combine({x: shares[x] for x in subset})
        except ValueError:
            continue
        if check(secret):
            return secret
    raise Unrecoverable(f"{what}: no {threshold} of the {len(shares)} revealed shares rebuild it (wrong shares)")


def _commits_to(context: bytes, commit: str, seed: bytes) -> bool:
    return crypto.commitment(seed, context) == commit


def _opens(public: bytes, secret: bytes) -> bool:
    return crypto.KeyPair.from_secret(secret).public == public


def unmask(
    total: np.ndarray,
    ring: Ring,
    ledger: Ledger,
    survivors: set[str],
    dropped: set[str],
    reveals: dict[str, list[tuple[str, bool, bytes]]],
) -> np.ndarray:
    """The sum of the survivors' quantised inputs, from ``total`` (the sum of their masked inputs) and ``reveals``
    (holder -> its ``(owner, is_seed, share)`` list, as checked on receipt)."""
    seeds: dict[str, dict[int, bytes]] = {u: {} for u in survivors}
    secrets: dict[str, dict[int, bytes]] = {u: {} for u in dropped}
    for holder, entries in reveals.items():
        for owner, is_seed, share in entries:
            wanted = seeds if is_seed else secrets
            if owner in wanted and (holder == owner or holder in ledger.relayed.get(owner, ())):
                wanted[owner][share_points([*ledger.rosters[owner], owner])[holder]] = share
    result = total
    for u, shares in sorted(seeds.items()):
        commit = ledger.commits[u]
        seed = rebuild(shares, ledger.threshold, partial(_commits_to, ledger.context, commit), f"{u}'s seed")
        result = ring.sub(result, crypto.mask(seed, total.size))
    for u, shares in sorted(secrets.items()):
        secret = rebuild(shares, ledger.threshold, partial(_opens, ledger.keys[u].mask), f"{u}'s mask key")
        for v in sorted(ledger.relayed.get(u, set()) & survivors):  # v added sign(v, u) * stream(u, v)
            stream = crypto.mask(pairwise_seed(secret, ledger.keys[v].mask, ledger.context, u, v), total.size)
            result = ring.sub(result, stream) if pair_sign(v, u) > 0 else ring.add(result, stream)
    return result
