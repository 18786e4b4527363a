"""The cryptographic primitives of secure aggregation, all from the ``cryptography`` package (none home-made):
X25519 key agreement, HKDF-SHA256 key derivation, AES-256-GCM share encryption, ChaCha20 mask streams.

Every derived key is bound to its context (the run, the round and the two devices' ids), so a key, a share or a
mask of one round is worth nothing in another."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np

from edge_client.secagg.wire import KEY_BYTES, NONCE_BYTES

try:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
except ImportError as exc:  # the optional extra: say how to get it
    raise ImportError(
        "secure aggregation needs the 'cryptography' package: pip install 'edgefl[secure]' "
        "(wheels exist for x86_64 and aarch64, e.g. a Raspberry Pi 4 on 64-bit Raspberry Pi OS)"
    ) from exc


class ShareRejected(ValueError):
    """An encrypted share that does not decrypt for its context (tampered, replayed, or not for this device)."""


@dataclass(frozen=True)
class KeyPair:
    """One X25519 key pair, raw bytes; ``secret`` never leaves the device except as Shamir shares."""

    secret: bytes
    public: bytes

    @classmethod
    def generate(cls) -> KeyPair:
        return cls.from_secret(X25519PrivateKey.generate().private_bytes_raw())

    @classmethod
    def from_secret(cls, secret: bytes) -> KeyPair:
        key = X25519PrivateKey.from_private_bytes(secret)
        return cls(secret, key.public_key().public_bytes_raw())


def agree(secret: bytes, peer_public: bytes, context: bytes, purpose: bytes) -> bytes:
    """A 32-byte key both ends derive alike: HKDF-SHA256 of the X25519 shared secret, bound to ``context`` (run,
    round, the pair's ids in sorted order) and ``purpose`` (b"enc" or b"mask")."""
    shared = X25519PrivateKey.from_private_bytes(secret).exchange(X25519PublicKey.from_public_bytes(peer_public))
    return HKDF(hashes.SHA256(), KEY_BYTES, salt=None, info=b"edgefl-secagg/" + purpose + b"/" + context).derive(shared)


def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """AES-256-GCM of ``plaintext`` under ``key``, authenticated with ``aad``: a random nonce, then the ciphertext."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, aad)


def open_sealed(key: bytes, sealed: bytes, aad: bytes) -> bytes:
    try:
        return AESGCM(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], aad)
    except (InvalidTag, ValueError) as exc:
        raise ShareRejected("a share that does not decrypt for this device and round") from exc


def mask(seed: bytes, size: int) -> np.ndarray:
    """``size`` uniform 32-bit words from the ChaCha20 stream keyed by ``seed`` (each seed masks one vector once, so
    the fixed nonce is never reused with a key)."""
    cipher = Cipher(algorithms.ChaCha20(seed, b"\0" * 16), mode=None).encryptor()
    return np.frombuffer(cipher.update(bytes(4 * size)), "<u4")


def random_seed() -> bytes:
    return os.urandom(KEY_BYTES)


def commitment(seed: bytes, context: bytes) -> str:
    """What a device publishes of its self-mask seed, so that the seed the server rebuilds from shares is checked."""
    return hashlib.sha256(b"edgefl-secagg/commit/" + context + b"/" + seed).hexdigest()
