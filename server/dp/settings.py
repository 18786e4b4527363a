"""``[privacy]`` checked at load: every refusal names the key and the fix (docs/privacy.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge_client.algorithms import CONTRACTS, contract_of
from server.secagg.settings import secure_refusal_of

MODES = ("off", "central", "local")


@dataclass
class PrivacySection:
    """Differential privacy (docs/privacy.md); other privacy features add their keys here."""

    mode: str = "off"  # "central": the server noises the sum; "local": each device noises its own update
    clip_norm: float = 0.0  # C: the L2 norm each device clips its update to (all its uploaded arrays together)
    noise_multiplier: float = 0.0  # z: noise std z * C; 0: derived from target_epsilon before the run starts
    target_epsilon: float = 0.0  # the budget: the run stops before a round would spend more (0: no budget)
    delta: float = 0.0  # 0: 1 / clients.count^1.1
    adaptive_clipping: bool = False  # C follows the target_quantile of update norms (Andrew et al. 2021)
    target_quantile: float = 0.5  # adaptive clipping: the fraction of devices whose update norm should be within C
    clip_learning_rate: float = 0.2  # eta_C of the geometric update C <- C exp(-eta_C (b - target_quantile))
    # secure aggregation (docs/secure-aggregation.md): the server learns only each round's sum; with DP on, the devices
    # add the noise in shares
    secure_aggregation: bool = False
    # the shares that rebuild a device's secrets: a fraction in (0, 1] of its holders (its neighbours and itself,
    # rounded up, at least 2), or a count >= 2; up to holders - threshold devices may drop after masking
    threshold: float = 0.6
    neighbours: int = 0  # SecAgg+'s graph degree (even); 0: every other device of the round (the original SecAgg)
    quantisation_bits: int = 32  # the ring: integers modulo 2^bits (16-32)
    stage_deadline_s: float = 30.0  # the longest each stage but the training one waits (keys, masking, unmasking)


def default_delta(devices: int) -> float:
    """``1 / n^1.1``: below ``1/n``, so the guarantee cannot be met by publishing one device's data outright."""
    return 1.0 / devices**1.1


def dp_algorithms() -> list[str]:
    """The algorithms whose contract accepts DP."""
    return [name for name, c in CONTRACTS.items() if not c.dp_refusal]


def privacy_refusal(p: PrivacySection, n: int, name: str, params: dict[str, Any], steps_policy: str) -> str | None:
    """Why ``[privacy]`` is refused (a combination that makes no sense, or an algorithm that refuses DP), naming the
    key and the fix; None when it is accepted. ``RunConfig.validate`` raises it as a ConfigError."""
    if p.secure_aggregation:  # its own keys, and whether the algorithm's server half can work from a sum
        refused = secure_refusal_of(p, name)
        if refused:
            return refused
    if p.mode == "off":
        clip = () if p.secure_aggregation else ("clip_norm",)  # secure aggregation clips without DP too
        given = [k for k in (*clip, "noise_multiplier", "target_epsilon", "delta") if getattr(p, k)]
        if given or p.adaptive_clipping:
            key = given[0] if given else "adaptive_clipping"
            return f"privacy.{key} is set but privacy.mode = 'off'; set privacy.mode = 'central' or 'local'"
        return
    checks = [
        ("privacy.mode", p.mode in MODES, "'off', 'central' or 'local'"),
        ("privacy.clip_norm", p.clip_norm > 0, "a number > 0: noise needs each device's update bounded by clipping"),
        ("privacy.noise_multiplier", p.noise_multiplier >= 0, "a number >= 0 (0: derived from target_epsilon)"),
        ("privacy.target_epsilon", p.target_epsilon >= 0, "a number >= 0 (0: no budget)"),
        (
            "privacy.noise_multiplier",
            p.noise_multiplier > 0 or p.target_epsilon > 0,
            "a number > 0, or set privacy.target_epsilon and the multiplier is derived from it",
        ),
        ("privacy.delta", 0 <= p.delta < 1 / n, f"in [0, 1/clients.count = {1 / n:.3g}) (0: 1/clients.count^1.1)"),
        ("privacy.target_quantile", 0 < p.target_quantile < 1, "a fraction in (0, 1)"),
        ("privacy.clip_learning_rate", p.clip_learning_rate > 0, "a number > 0"),
        (
            "privacy.adaptive_clipping",
            not (p.adaptive_clipping and (p.mode == "local" or p.secure_aggregation)),
            "false with mode = 'local' or secure_aggregation (the server must see each device's clipped count)",
        ),
    ]
    for key, ok, expected in checks:
        if not ok:
            return f"{key} must be {expected}; got {getattr(p, key.split('.')[1])!r}"
    contract = contract_of(name)
    if contract.dp_refusal:
        return (
            f"train.algorithm = {name!r} refuses privacy.mode = {p.mode!r}: {contract.dp_refusal}; "
            f"choose one of {dp_algorithms()} or set privacy.mode = 'off'"
        )
    resolved = contract.resolve(params)
    for key, value in contract.dp_requires:
        if resolved[key] != value:
            return (
                f"[algorithm.{name}] {key} = {resolved[key]!r} is refused with [privacy]: it makes one device's weight "
                f"or steps depend on its data; set {key} = {value!r}"
            )
    if contract.unequal_steps and steps_policy != "fixed":
        return (
            f"train.steps_policy = {steps_policy!r} is refused for {name} with [privacy]: the server's "
            "scale (the mean steps of the devices that reported) would depend on who reported; set 'fixed'"
        )
    return None


def dp_markdown() -> str:
    """The table of docs/privacy.md: whether each algorithm accepts DP, and what it needs or why not (a test keeps
    the document equal to this)."""
    lines = ["| algorithm | differential privacy | needs / why not |", "|---|---|---|"]
    for name, c in CONTRACTS.items():
        needs = ", ".join(f"`{k} = {v!r}`" for k, v in c.dp_requires) or "-"
        lines.append(f"| `{name}` | {'refused' if c.dp_refusal else 'accepted'} | {c.dp_refusal or needs} |")
    return "\n".join(lines)
