"""Shamir secret sharing over the prime field GF(2^521 - 1): a 32-byte secret split into shares any ``t`` of which
rebuild it and fewer reveal nothing. The field is ours (the issue's rule: primitives from ``cryptography``, this
bookkeeping here); a Mersenne prime above 2^256 takes any 32-byte secret as one field element."""

from __future__ import annotations

import secrets
from collections.abc import Mapping

PRIME = 2**521 - 1
SHARE_BYTES = (PRIME.bit_length() + 7) // 8  # 66: one share's value on the wire


def split(secret: bytes, threshold: int, xs: list[int]) -> dict[int, bytes]:
    """Shares of ``secret`` (at most 65 bytes) at the points ``xs`` (distinct, 1..PRIME-1): a random polynomial of
    degree ``threshold - 1`` whose value at 0 is the secret."""
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold {threshold} must be in [1, {len(xs)}] (the number of shares)")
    if len(set(xs)) != len(xs) or not all(0 < x < PRIME for x in xs):
        raise ValueError("share points must be distinct and in [1, PRIME)")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    if coefficients[0] >= PRIME:
        raise ValueError("the secret does not fit the field")
    return {x: _evaluate(coefficients, x).to_bytes(SHARE_BYTES, "big") for x in xs}


def _evaluate(coefficients: list[int], x: int) -> int:
    acc = 0
    for c in reversed(coefficients):  # Horner
        acc = (acc * x + c) % PRIME
    return acc


def combine(shares: Mapping[int, bytes], size: int = 32) -> bytes:
    """The secret (``size`` bytes) interpolated at 0 from ``shares`` (point -> share). With fewer than the threshold,
    or a wrong share, the result is some other value: callers check it (a public key, a commitment)."""
    points = [(x, int.from_bytes(y, "big")) for x, y in shares.items()]
    if not points or any(y >= PRIME or not 0 < x < PRIME for x, y in points):
        raise ValueError("shares must be field elements at points in [1, PRIME)")
    secret = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                num = num * -xj % PRIME
                den = den * (xi - xj) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    if secret >= 1 << (8 * size):
        raise ValueError(f"the shares rebuild no {size}-byte secret (a wrong or missing share)")
    return secret.to_bytes(size, "big")
