"""The sizes and bounds of secure aggregation's messages, without the ``cryptography`` package (the message
declarations import this; a device without the ``secure`` extra still speaks the protocol's other messages)."""

from __future__ import annotations

import math
from typing import Any

from edge_client.secagg.shamir import SHARE_BYTES
from edge_client.wire.schema import Check, is_int

KEY_BYTES = 32  # an X25519 public key, a seed, an AES-256 / ChaCha20 key
NONCE_BYTES = 12  # AES-GCM's
TAG_BYTES = 16  # AES-GCM's
SEALED_BYTES = NONCE_BYTES + 2 * SHARE_BYTES + TAG_BYTES  # one holder's encrypted pair of shares
#: The most neighbours a device shares with: its messages' rows must fit a frame header (64 KiB). A larger round uses
#: SecAgg+'s graph (``[privacy] neighbours``).
MAX_NEIGHBOURS = 200
RING_BITS = (16, 32)  # the quantisation bits a ring may have (edge_client.secagg.ring)


def _secure(v: Any) -> bool:
    if not isinstance(v, dict):
        return False
    if not v:
        return True
    if set(v) != {"weight", "clip", "bits", "devices"}:
        return False
    weight, clip, bits, devices = v["weight"], v["clip"], v["bits"], v["devices"]
    number = (int, float)
    return (
        isinstance(weight, number) and not isinstance(weight, bool) and 0.0 <= weight <= 1.0
        and isinstance(clip, number) and not isinstance(clip, bool) and math.isfinite(clip) and clip > 0
        and is_int(bits) and RING_BITS[0] <= bits <= RING_BITS[1]
        and is_int(devices) and 1 <= devices < 2 ** (bits - 2)
    )  # fmt: skip


#: An assignment's secure-aggregation terms (empty: the round is not secure): the weight the device multiplies its
#: clipped update by, the clip norm, the ring's bits and the round's device count (the ring's scale).
SECURE_TERMS = Check(
    "map",
    f"{{}} or {{weight in [0, 1], clip > 0 finite, bits in [{RING_BITS[0]}, {RING_BITS[1]}], "
    "devices in [1, 2^(bits-2))}",
    "an empty map or {weight, clip, bits, devices} in their bounds",
    _secure,
)
