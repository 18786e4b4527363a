"""The server half of secure aggregation: the round's stages over MQTT (``stages``) and the unmasking of the sum
(``unmask``). The protocol itself, shared with devices, is ``edge_client.secagg``; the ``cryptography`` package is
imported only when a run turns secure aggregation on."""

from __future__ import annotations

from edge_client.wire.messages import MaskedInput, SecAggKeys, SecAggReveal, SecAggShares
from edge_client.wire.protocol import InvalidField

#: What a device sends in a secure round's stages (``SecureRounds.take`` checks it).
FROM_DEVICES = (SecAggKeys, SecAggShares, MaskedInput, SecAggReveal)


class StageRefused(InvalidField):
    """A message that does not fit what a secure round asked of its sender (a plain update among them)."""

    reason = "secagg_message"
