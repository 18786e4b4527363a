"""``[privacy]``'s secure-aggregation keys checked at load (the section itself is ``server.dp.settings``'s): every
refusal names the key and the fix."""

from __future__ import annotations

from typing import Protocol

from edge_client.algorithms import CONTRACTS, contract_of
from edge_client.algorithms.contract import secure_refusal
from edge_client.secagg.wire import MAX_NEIGHBOURS, RING_BITS


class SecureKeys(Protocol):
    """The keys of ``[privacy]`` (``server.dp.settings.PrivacySection``) secure aggregation reads."""

    clip_norm: float
    threshold: float
    neighbours: int
    quantisation_bits: int
    stage_deadline_s: float


def secure_algorithms() -> list[str]:
    """The algorithms whose server half works from a sum (``Contract.needs``)."""
    return [name for name, c in CONTRACTS.items() if not secure_refusal(c)]


def secure_refusal_of(p: SecureKeys, algorithm: str) -> str | None:
    """Why ``[privacy] secure_aggregation = true`` is refused with these keys and ``algorithm``; None if accepted."""
    t = p.threshold
    checks = [
        ("privacy.clip_norm", p.clip_norm > 0, "a number > 0 with secure aggregation (each device clips to it)"),
        (
            "privacy.threshold",
            0 < t <= 1 or (t >= 2 and t == int(t)),
            "a fraction in (0, 1] of each device's share holders, or a whole count >= 2",
        ),
        (
            "privacy.neighbours",
            p.neighbours == 0 or (2 <= p.neighbours <= MAX_NEIGHBOURS and p.neighbours % 2 == 0),
            f"0 (every other device) or an even degree in [2, {MAX_NEIGHBOURS}]",
        ),
        (
            "privacy.quantisation_bits",
            RING_BITS[0] <= p.quantisation_bits <= RING_BITS[1],
            f"an integer in [{RING_BITS[0]}, {RING_BITS[1]}]",
        ),
        ("privacy.stage_deadline_s", p.stage_deadline_s > 0, "seconds > 0"),
    ]
    for key, ok, expected in checks:
        if not ok:
            return f"{key} must be {expected}; got {getattr(p, key.split('.')[1])!r}"
    why = secure_refusal(contract_of(algorithm))
    if why:
        return (
            f"privacy.secure_aggregation = true with train.algorithm = {algorithm!r}: {why}; use "
            f"{', '.join(secure_algorithms())}, or turn secure aggregation off"
        )
    return None
