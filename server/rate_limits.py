"""Fair service: how often one device may make the server work or send, declared once here.

A device's control messages (``hello``, ``resync``, ``model_request``, ``evaluation``) each cost the server a decode, a
handler and often an answer; an honest device sends a few of each per round. Each kind has a token bucket per device
(``LIMITS``: ``burst`` messages at once, refilled at ``per_s`` a second, and refilled whole when a round starts, so a
round that lasts milliseconds in-process still has room for what an honest device sends in it). A message over its
limit is dropped before it is handled or answered, counted as ``rate_limited`` in the round's ``rejected`` and logged
sparsely (the 1st, 2nd, 4th, 8th ... drop). Updates need no bucket: admission takes one per device and round.

Whatever a device asks, the server sends it the round's model on its own topic, and its assignment again, at most
``RESENDS_PER_ROUND`` times a round (``server.distribution``, ``server.delivery``): before, each resync re-armed the
model send, and a device alternating resync and model request got a whole model for every pair (x544 in egress).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from edge_client.wire.protocol import ProtocolError


@dataclass(frozen=True)
class Limit:
    """A token bucket's size and refill rate."""

    burst: int
    per_s: float


#: The control messages a device may send, by wire type, and how often. An honest device sends a hello when it
#: connects and whenever the server announces itself, a resync when it connects without its session, a model request
#: when it missed a broadcast, an evaluation when asked: well inside these.
LIMITS: dict[str, Limit] = {
    "hello": Limit(burst=10, per_s=0.2),
    "resync": Limit(burst=10, per_s=0.2),
    "model_request": Limit(burst=10, per_s=0.2),
    "evaluation": Limit(burst=10, per_s=0.2),
}
#: Times a round the server sends one device the round's model on its own topic, or its assignment again.
RESENDS_PER_ROUND = 2


class RateLimited(ProtocolError):
    """A message dropped, or a send refused, because its device is over its limit."""

    reason = "rate_limited"
    flood = True  # logged sparsely (edge_client.wire.transport.Inbox.reject)


class RateLimits:
    """One token bucket per device and message kind of ``LIMITS``; other kinds pass."""

    def __init__(self, limits: dict[str, Limit] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = LIMITS if limits is None else limits
        self.clock = clock
        self._buckets: dict[tuple[str, str], tuple[float, float]] = {}  # (device, kind) -> (tokens, when)

    def check(self, sender: str, kind: str) -> None:
        """Take a token for ``sender``'s message of ``kind``; raises ``RateLimited`` when there is none."""
        limit = self.limits.get(kind)
        if limit is None:
            return
        now = self.clock()
        tokens, when = self._buckets.get((sender, kind), (float(limit.burst), now))
        tokens = min(float(limit.burst), tokens + (now - when) * limit.per_s)
        if tokens < 1.0:
            self._buckets[(sender, kind)] = (tokens, now)
            raise RateLimited(f"{sender} sends {kind} messages faster than {limit.burst} at once and "
                              f"{limit.per_s:g} a second; dropped")  # fmt: skip
        self._buckets[(sender, kind)] = (tokens - 1.0, now)

    def new_round(self) -> None:
        """Every bucket full again: a round's honest messages always fit."""
        self._buckets.clear()
