"""A device's secure rounds over its link: the stages of ``edge_client.secagg.device`` driven by the server's
messages, on the device's own topics (the server relays; devices never talk to each other).

An assignment with secure terms starts the round: the device advertises its keys before it trains, then keeps its
clipped, weighted, quantised update; the roster makes it send its encrypted shares, the relay its masked input, the
unmask request its shares of the others' secrets. Anything that breaks the protocol (a share that does not decrypt, a
request to reveal both secrets of one device) ends the device's part in the round with a failure report; the server
goes on without it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from edge_client.secagg import parts
from edge_client.secagg.crypto import ShareRejected
from edge_client.secagg.device import DeviceRound, Keys, ProtocolBreach
from edge_client.secagg.parts import Summed
from edge_client.secagg.ring import Ring
from edge_client.wire.messages import (
    MaskedInput,
    Message,
    RoundFacts,
    SecAggKeys,
    SecAggRelay,
    SecAggReveal,
    SecAggRoster,
    SecAggShares,
    SecAggUnmask,
)

log = logging.getLogger(__name__)

#: Server messages of a secure round.
FROM_SERVER = (SecAggRoster, SecAggRelay, SecAggUnmask)
#: ``fail(round, run_id, reason, error, deadline_s)``: the runtime's failure report.
Fail = Callable[[int, str, str, BaseException, float], None]


class SecureClient:
    def __init__(
        self, client_id: str, publish: Callable[[Message], int], fail: Fail, served: Callable[[], None]
    ) -> None:
        """``served``: called once the device's part in a round is over, its reveal sent (the runtime counts its
        rounds served): a device told to stop after its last round must still reveal its shares in it, or no mask
        of that round can be removed and the round is lost for every device."""
        self.client_id = client_id
        self.publish = publish
        self.fail = fail
        self.served = served
        self.round: DeviceRound | None = None
        self.facts: RoundFacts | None = None  # the round's facts: its secure terms
        self.quantised: np.ndarray | None = None  # the round's summed arrays as one vector of ring elements
        self.noise = 0.0  # the std of the DP noise share in them (the ring's headroom)
        self.scalars: dict[str, Any] = {}
        self.costs: dict[str, float] = {}  # the device's own seconds per stage (its clock), sent with the input

    def start(self, a: RoundFacts) -> None:
        """Fresh keys for round ``a.round``, advertised at once (before training)."""
        t0 = time.perf_counter()
        self.round = DeviceRound(self.client_id, a.run_id, a.round)
        self.facts, self.quantised, self.scalars = a, None, {}
        keys = self.round.keys()
        self.costs = {"keys_s": time.perf_counter() - t0}
        self.publish(SecAggKeys(a.round, self.client_id, keys.enc, keys.mask, a.run_id))

    def trained(
        self, vectors: dict[str, np.ndarray], summed: Summed, noise: float, scalars: dict[str, Any]
    ) -> dict[str, np.ndarray]:
        """Keep the round's update as ring elements: the arrays the contract sums (``summed``, from ``vectors``:
        ``delta`` and the returned arrays) clipped jointly, each times its weight, quantised, as one vector
        (``edge_client.secagg.parts``); ``noise``: the std of differential privacy's share already in them (0:
        none); ``scalars``: the ``MaskedInput`` fields an ``Update`` would carry (steps, times, loss, telemetry).
        Returns each array as the sum will hold it, for an algorithm that adopts what it uploaded (SCAFFOLD)."""
        a = self.facts
        assert a is not None and a.secure
        t0 = time.perf_counter()
        self.scalars = scalars
        self.quantised, sent = parts.quantise(self._ring(a, noise), summed, vectors, a.secure, scalars["local_steps"])
        self.noise = noise
        self.costs["quantise_s"] = time.perf_counter() - t0
        return sent

    @staticmethod
    def _ring(a: RoundFacts, noise: float) -> Ring:
        return Ring(a.secure["bits"], a.secure["clip"], a.secure["devices"], noise)

    def handle(self, msg: SecAggRoster | SecAggRelay | SecAggUnmask) -> None:
        r, a = self.round, self.facts
        if r is None or a is None or msg.round != r.round or msg.run_id != r.run_id:
            log.warning("ignoring a %s for round %d: not this device's secure round", msg.TYPE, msg.round)
            return
        try:
            if isinstance(msg, SecAggRoster):
                t0 = time.perf_counter()
                roster = {row[0]: Keys(row[1], row[2]) for row in msg.neighbours}
                commitment, sealed = r.share(roster, msg.threshold)
                self.costs["share_s"] = time.perf_counter() - t0
                rows = [[holder, blob] for holder, blob in sealed.items()]
                self.publish(SecAggShares(r.round, self.client_id, commitment, rows, r.run_id))
            elif isinstance(msg, SecAggRelay):
                self._masked_input(r, a, msg)
            else:
                shares = r.reveal(msg.survivors, msg.dropped)
                self.publish(SecAggReveal(r.round, self.client_id, [list(s) for s in shares], r.run_id))
                self.round = None  # its part in the round is over
                self.served()
        except (ProtocolBreach, ShareRejected, ValueError) as exc:
            self.round = None
            self.fail(a.round, a.run_id, "secagg", exc, a.deadline_s)

    def _masked_input(self, r: DeviceRound, a: RoundFacts, relay: SecAggRelay) -> None:
        if self.quantised is None:
            raise ProtocolBreach("the relay came before the round's update")
        t0 = time.perf_counter()
        r.receive({owner: sealed for owner, sealed in relay.shares})
        y = r.masked(self.quantised, self._ring(a, self.noise))
        self.costs["mask_s"] = time.perf_counter() - t0
        metrics = {**self.scalars.pop("metrics", {}), "secagg": dict(self.costs)}
        data = np.ascontiguousarray(y, "<u4").tobytes()
        self.publish(
            MaskedInput(
                r.round, a.model_version, self.client_id, data=data, metrics=metrics, run_id=r.run_id, **self.scalars
            )
        )
        self.quantised = None
