"""Secure aggregation (Bonawitz et al., CCS 2017; SecAgg+'s neighbour graph, Bell et al., CCS 2020): the server
learns the sum of the round's updates and nothing about any one device's.

The device half, importable without the server: Shamir sharing over a prime field (``shamir``), the primitives taken
from the ``cryptography`` package (``crypto``: X25519, HKDF, AES-GCM, ChaCha20 mask streams), the fixed-point ring
(``ring``), and one device's protocol state for one round (``device``). ``cryptography`` is the optional extra
``secure`` of the device package; importing ``edge_client.secagg.crypto`` without it says how to install it.
"""
