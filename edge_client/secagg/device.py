"""One device's part in one secure round, stage by stage (the messages around it are ``edge_client.wire.messages``').

1. ``keys``: two fresh X25519 key pairs, one to encrypt shares with, one to agree masks with; their public halves go
   to the server.
2. ``share``: given its neighbours' public keys, the device draws its self-mask seed ``b``, splits ``b`` and its mask
   secret key into Shamir shares (threshold ``t``), one for each neighbour and one it keeps (so that a round whose
   devices all share survives ``n - t`` of them dropping after masking), and encrypts each neighbour's pair for that
   neighbour alone.
3. ``masked``: its quantised update plus the stream of ``b`` plus, for every neighbour whose shares it received, the
   pairwise stream both agreed (added by the smaller id, subtracted by the larger: they cancel in the sum).
4. ``reveal``: told which devices sent a masked input and which dropped, it reveals its share of ``b`` for the former
   and of the mask secret key for the latter, never both for one device (that would unmask it), and nothing at all
   when fewer than ``t`` devices are left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edge_client.secagg import crypto, shamir
from edge_client.secagg.graph import share_points
from edge_client.secagg.ring import Ring


class ProtocolBreach(ValueError):
    """What the server asked would break the protocol's guarantee (or is not for this round): refused."""


def context_of(run_id: str, round_: int) -> bytes:
    return f"{run_id}/{round_}".encode()


def pair_context(context: bytes, u: str, v: str) -> bytes:
    a, b = sorted((u, v))
    return context + f"/{a}/{b}".encode()


def pairwise_seed(secret: bytes, peer_public: bytes, context: bytes, u: str, v: str) -> bytes:
    return crypto.agree(secret, peer_public, pair_context(context, u, v), b"mask")


def share_aad(context: bytes, owner: str, holder: str) -> bytes:
    return context + f"/share/{owner}/{holder}".encode()


def pair_sign(u: str, v: str) -> int:
    """+1 when ``u`` adds the pair's mask, -1 when it subtracts it."""
    return 1 if u < v else -1


@dataclass
class Keys:
    """A device's two public keys for the round, as the server relays them."""

    enc: bytes
    mask: bytes


@dataclass
class DeviceRound:
    client_id: str
    run_id: str
    round: int
    enc: crypto.KeyPair = field(default_factory=crypto.KeyPair.generate)
    masking: crypto.KeyPair = field(default_factory=crypto.KeyPair.generate)
    seed: bytes = field(default_factory=crypto.random_seed)  # the self mask's
    roster: dict[str, Keys] = field(default_factory=dict)  # neighbour -> its public keys
    threshold: int = 0
    held: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)  # owner -> (mask key share, seed share)
    revealed: bool = False

    @property
    def context(self) -> bytes:
        return context_of(self.run_id, self.round)

    def keys(self) -> Keys:
        return Keys(self.enc.public, self.masking.public)

    def share(self, roster: dict[str, Keys], threshold: int) -> tuple[str, dict[str, bytes]]:
        """The commitment to ``b`` and each neighbour's encrypted pair of shares (its own pair it keeps)."""
        if self.client_id in roster or not 1 <= threshold <= len(roster) + 1:
            raise ProtocolBreach(f"threshold {threshold} for {len(roster)} neighbours and itself")
        self.roster, self.threshold = dict(roster), threshold
        points = share_points([*roster, self.client_id])
        xs = sorted(points.values())
        mask_shares = shamir.split(self.masking.secret, threshold, xs)
        seed_shares = shamir.split(self.seed, threshold, xs)
        own = points[self.client_id]
        self.held[self.client_id] = (mask_shares[own], seed_shares[own])
        sealed = {}
        for v in sorted(roster):
            x = points[v]
            key = crypto.agree(self.enc.secret, roster[v].enc, pair_context(self.context, self.client_id, v), b"enc")
            sealed[v] = crypto.seal(key, mask_shares[x] + seed_shares[x], share_aad(self.context, self.client_id, v))
        return crypto.commitment(self.seed, self.context), sealed

    def receive(self, sealed: dict[str, bytes]) -> None:
        """Decrypt the shares neighbours sent this device; one that does not decrypt raises ``ShareRejected``."""
        for owner, blob in sealed.items():
            if owner not in self.roster:
                raise ProtocolBreach(f"a share from {owner}, not a neighbour of {self.client_id}")
            key = crypto.agree(
                self.enc.secret, self.roster[owner].enc, pair_context(self.context, owner, self.client_id), b"enc"
            )
            plain = crypto.open_sealed(key, blob, share_aad(self.context, owner, self.client_id))
            if len(plain) != 2 * shamir.SHARE_BYTES:
                raise crypto.ShareRejected(f"a share from {owner} of {len(plain)} bytes")
            self.held[owner] = (plain[: shamir.SHARE_BYTES], plain[shamir.SHARE_BYTES :])

    def masked(self, quantised: np.ndarray, ring: Ring) -> np.ndarray:
        """``quantised`` (ring elements) masked: plus the self mask, plus or minus each pairwise mask."""
        y = ring.add(quantised.astype(np.uint32), crypto.mask(self.seed, quantised.size))
        for v in sorted(set(self.held) - {self.client_id}):
            stream = crypto.mask(
                pairwise_seed(self.masking.secret, self.roster[v].mask, self.context, self.client_id, v),
                quantised.size,
            )
            y = ring.add(y, stream) if pair_sign(self.client_id, v) > 0 else ring.sub(y, stream)
        return y

    def reveal(self, survivors: list[str], dropped: list[str]) -> list[tuple[str, bool, bytes]]:
        """``(owner, is_seed, share)`` for each owner whose shares this device holds: the seed's for a survivor, the
        mask key's for a dropped one. Refused when a device is named both ways, when fewer than the threshold survive,
        or a second time in the round."""
        both = set(survivors) & set(dropped)
        if both:
            raise ProtocolBreach(f"asked to reveal both secrets of {sorted(both)}")
        if len(survivors) < self.threshold:
            raise ProtocolBreach(f"{len(survivors)} survivors, fewer than the threshold {self.threshold}")
        if self.revealed:
            raise ProtocolBreach("asked to reveal a second time in one round")
        self.revealed = True
        out = [(u, True, self.held[u][1]) for u in sorted(survivors) if u in self.held]
        return out + [(u, False, self.held[u][0]) for u in sorted(dropped) if u in self.held]
