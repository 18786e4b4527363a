"""The privacy budget, from Google's ``dp-accounting`` (we write no accountant of our own).

Central mode (DP-FedAvg, McMahan et al. 2018): each round is the Gaussian mechanism of noise multiplier ``z`` on a
Poisson sample of the devices at rate ``q``; ``t`` rounds are that event composed ``t`` times. Local mode: every round
a device takes part in releases its own update through the Gaussian mechanism, with no amplification by sampling (the
server knows who was sampled), counted as if it took part in all ``t`` rounds. Renyi DP accounting (Mironov 2017;
Mironov, Talwar, Zhang 2019), integer orders: the fractional ones below 2 fail to converge for some parameters.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import dp_accounting

ORDERS = (*range(2, 128), 128, 192, 256, 512, 1024)


def event(noise_multiplier: float, sampling_rate: float, rounds: int, local: bool = False) -> dp_accounting.DpEvent:
    """``rounds`` rounds of the mechanism as one ``DpEvent``."""
    import dp_accounting  # imported when a run uses DP: the library takes seconds to import on a loaded machine

    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    one = gaussian if local or sampling_rate >= 1.0 else dp_accounting.PoissonSampledDpEvent(sampling_rate, gaussian)
    return dp_accounting.SelfComposedDpEvent(one, rounds)


def epsilon(noise_multiplier: float, sampling_rate: float, rounds: int, delta: float, local: bool = False) -> float:
    """Epsilon spent after ``rounds`` rounds at ``delta`` (0 before the first; inf without noise)."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    from dp_accounting import rdp

    accountant = rdp.RdpAccountant(list(ORDERS))
    accountant.compose(event(noise_multiplier, sampling_rate, rounds, local))
    return float(accountant.get_epsilon(delta))


def calibrate(target_epsilon: float, sampling_rate: float, rounds: int, delta: float, local: bool = False) -> float:
    """The smallest noise multiplier whose ``rounds`` rounds spend at most ``target_epsilon`` (Brent's method, the
    library's ``calibrate_dp_mechanism``)."""
    import dp_accounting
    from dp_accounting import rdp

    return float(
        dp_accounting.calibrate_dp_mechanism(
            lambda: rdp.RdpAccountant(list(ORDERS)),
            lambda z: event(z, sampling_rate, rounds, local),
            target_epsilon,
            delta,
            dp_accounting.LowerEndpointAndGuess(1e-3, 1.0),
            tol=1e-4,
        )
    )
