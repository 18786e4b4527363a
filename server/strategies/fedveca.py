"""FedVeca server half (ALGORITHMS.md 2.11 (b)): vectorised averaging with adaptive per-client local steps.

Each round k the server forms ``grad F(w_k) = sum_i p_i h_i`` (eq. 8) and ``w_{k+1} = w_k - eta tau_k sum_i p_i G_i``
(eq. 5) with ``p_i = D_i / D`` and ``tau_k = sum_i p_i tau_(k,i)`` over the steps the clients actually ran, estimates
the smoothness L (Alg. 1 lines 11-16, diagnostic) and picks every client's next tau from its beta and delta (eq. 15).

Streaming: ``h_i`` and ``G_i`` are folded on arrival into two running sums weighted by ``D_i`` with one normaliser;
``tau_k``, the A values and the next taus are sums and maps of scalars over the updates that arrived, taken in
``finish``. Two model-sized vectors per round besides the state (``grad F(w_{k-1})``), whatever the number of clients.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from edge_client.algorithms.contract import ContractError
from edge_client.algorithms.fedveca import CONTRACT
from edge_client.wire.messages import Update
from edge_client.wire.plan import Plan
from server.strategies.base import Round, Strategy, TrainSettings
from server.strategies.common import EPS, aggregation_weights, fold_weight

log = logging.getLogger("edgefl.server")


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


#: The robust minimum of eq. 15 is taken over the A values at least median / ROBUST_MIN_RATIO. On the fleet (MNIST
#: Dir(0.3), TACO's CNN, 10 devices, 58 rounds measured) the median honest A sat 1.3-10.2x above the smallest (median
#: 2.4x), so honest rounds keep the paper's minimum, while one device reporting a tiny A (beta = delta = 0) can no
#: longer pull it to 0, holding every other client at tau_min_reset and earning itself tau_max (docs/algorithms.md).
ROBUST_MIN_RATIO = 20.0


def robust_min(values: list[float]) -> float:
    """The smallest of ``values`` (finite, >= 0) at least their median / ``ROBUST_MIN_RATIO``; 0 when the median is."""
    return min(a for a in values if a >= float(np.median(values)) / ROBUST_MIN_RATIO)


def _a_value(lr: float, beta: float, delta: float) -> float:
    """``A = eta beta^2 delta``; overflows to inf (never raises, unlike float ``**``) so (f)7 can keep the old tau."""
    b = float(beta)
    return lr * b * b * float(delta)


class FedVeca(Strategy):
    """FedVeca (ALGORITHMS.md 2.11) with the [RECOMMENDED] resolutions of (f); deviations are marked below.

    Round numbering: the orchestrator numbers rounds from 1; k counts the aggregations done so far (k = round - 1
    whenever every round produced updates). Counting aggregations rather than using ``round - 1`` keeps the protocol
    consistent if a round aggregates nothing: adaptation then starts with the first round whose clients really
    received ``P`` (otherwise every client would report delta = 0, hence A = 0, and (f)7 would give all of them
    tau_max).

    * tau: rounds k = 0 and 1 use ``tau_init`` (line 24, (f)10); from k = 1 on, after aggregating,
      ``A_i = eta beta_i^2 delta_i``, ``m`` = the robust minimum over the finite A_i (``robust_min``: beyond the
      paper, which takes the plain minimum), ``x_i = A_i / (A_i - alpha_k m)`` (eq. 15),
      ``tau = floor(x_i + 1e-9)`` -> ``tau_min_reset`` if ``tau <= 1`` (lines 19-21) -> at least ``tau_floor`` ->
      ``min(tau, tau_max)`` ((f)6).
      Degenerate A ((f)7): a non-finite or negative A_i (a negative one cannot come from a correct client) keeps the
      client's previous tau; with ``m = 0`` clients with ``A_i = 0`` get ``tau_max`` and the others ``x = 1`` -> reset.
      Clients that did not report keep their tau; a client the server has never seen gets ``tau_init``.
    * ``tau_init = 0`` means ``min(tau_max, floor(1/(1-alpha_k) + 1e-9))`` (= 20 for alpha_k = 0.95); an explicit
      value is also capped at ``tau_max``. ``settings.local_steps`` is not used.
    * L ((f)8, (f)9): ``L_0 = ||grad F(w_0)|| / ||w_0||`` (skipped if ``||w_0|| < 1e-12``), ``L_{k-1} = ||grad
      F(w_{k-1}) - grad F(w_{k-2})|| / ||w_{k-1} - w_{k-2}||`` (skipped if the step is below 1e-12), ``L`` = running
      max, folded in at round k as printed (so L is None at k = 0). Each L_j is computed as soon as its inputs exist
      (at round j) and held until round j + 1, so only ``grad F(w_{k-1})`` and the scalar ``||w_k - w_{k-1}||`` are
      kept, not ``w_{k-1}, w_{k-2}, grad F(w_{k-2})``. L is only a diagnostic (``eta tau_k L``, Fig. 4); alpha_k stays
      fixed, with a warning when it leaves the admissible range ``alpha_k < 2L/m``; ``enforce_alpha_range`` is not
      implemented.
    * Downlink: ``local_steps = tau_(k,i)`` and the value ``P = ||grad F(w_{k-1})||^2`` (0 in round k = 0), the scalar
      form of Alg. 1 line 9 ((f)13); the client needs only that norm for delta ((f)4).
    """

    contract = CONTRACT

    def __init__(self, settings: TrainSettings, params: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(settings, params, seed)
        self.alpha_k: float = self.params["alpha_k"]
        self.tau_max: int = self.params["tau_max"]
        self.tau_min_reset: int = self.params["tau_min_reset"]
        self.tau_floor: int = self.params["tau_floor"]
        for key in ("tau_min_reset", "tau_floor"):
            if self.params[key] > self.tau_max:
                raise ContractError(f"fedveca.{key} = {self.params[key]}: expected at most fedveca.tau_max "
                                    f"({self.tau_max})")  # fmt: skip
        rule = math.floor(1.0 / (1.0 - self.alpha_k) + 1e-9)
        self.tau_init: int = min(self.tau_max, self.params["tau_init"] or rule)
        self.k = 0  # aggregations done = the FedVeca round index of the next aggregation
        self.tau: dict[str, int] = {}  # tau_(k,i) each client is told next
        self.L: float | None = None  # running max of L_0 .. L_{k-1}
        self.L_pending: float | None = None  # L_{k-1}, folded into L at round k
        self.P = 0.0  # ||grad F(w_{k-1})||^2 for the clients of round k
        self.prev_grad: np.ndarray | None = None  # grad F(w_{k-1})
        self.step_norm: float | None = None  # ||w_k - w_{k-1}||
        self._metrics: dict[str, Any] = {}
        self._alpha_warned = False

    # -- downlink ----------------------------------------------------------------------------------------------------
    def assign(self, round_: int, client_id: str) -> Plan:
        plan = super().assign(round_, client_id)
        plan.steps = self.tau.get(client_id, self.tau_init)
        plan.settings["P"] = self.P
        return plan

    # -- aggregation -------------------------------------------------------------------------------------------------
    def add(self, rnd: Round, update: Update) -> None:
        weight = fold_weight(update, "samples")  # p_i = D_i / D over the updates received
        rnd.add("grad", update.arrays["grad"], weight)
        rnd.add("G", update.arrays["G"], weight)

    def close(self, rnd: Round) -> np.ndarray:
        k, lr, weights, updates = self.k, self.settings.lr, rnd.weights, rnd.reports
        p = aggregation_weights(updates, "samples")
        grad_f = rnd.mean("grad")  # eq. (8)
        tau_k = float(sum(pi * u.local_steps for pi, u in zip(p, updates, strict=True)))  # steps actually run
        d_k = rnd.mean("G")
        new = (weights - np.float32(lr * tau_k) * d_k).astype(np.float32, copy=False)  # eq. (5)

        # L: fold in L_{k-1} (lines 11-16), then prepare L_k for the next round.
        if self.L_pending is not None:
            self.L = self.L_pending if self.L is None else max(self.L, self.L_pending)
        norm_grad = float(np.linalg.norm(grad_f.astype(np.float64)))
        if k == 0 or self.prev_grad is None:
            norm_w = float(np.linalg.norm(weights.astype(np.float64)))
            pending = norm_grad / norm_w if norm_w >= EPS else None  # L_0, guard (f)9
        else:
            num = float(np.linalg.norm(grad_f.astype(np.float64) - self.prev_grad.astype(np.float64)))
            step = self.step_norm
            pending = num / step if step is not None and step >= EPS else None
        self.L_pending = _finite_or_none(pending)
        self.prev_grad = grad_f
        self.step_norm = float(np.linalg.norm(new.astype(np.float64) - weights.astype(np.float64)))
        self.P = norm_grad**2  # used by the clients of round k + 1

        a_values: dict[str, float] = {}
        for u in updates:  # k = 0: tau_(1,i) = tau_(0,i) (line 24); k >= 1: kept unless eq. (15) gives a value
            self.tau.setdefault(u.client_id, self.tau_init)
        if k >= 1:
            a_values = {u.client_id: _a_value(lr, u.extras["beta"], u.extras["delta"]) for u in updates}
            self.tau.update(self.next_tau(a_values))
        tau_next = float(sum(pi * self.tau.get(u.client_id, self.tau_init) for pi, u in zip(p, updates, strict=True)))
        self._check_alpha(a_values)
        self._metrics = {
            "k": k,
            "tau": dict(sorted(self.tau.items())),
            "tau_k": tau_k,
            "tau_next": tau_next,  # line 18, after reset and clamp ((f)6)
            "L": self.L,
            "eta_tau_L": None if self.L is None else lr * tau_k * self.L,
            "A": {cid: _finite_or_none(a) for cid, a in a_values.items()},
        }
        self.k += 1
        return new

    def next_tau(self, a_values: dict[str, float]) -> dict[str, int]:
        """Eq. (15) over the robust minimum, floor(x + 1e-9), reset to ``tau_min_reset``, at least ``tau_floor``,
        clamp ``tau_max``; degenerate A per (f)7.

        An A below the robust minimum ``m`` is taken as ``m`` (that client gets the smallest client's
        ``floor(1 / (1 - alpha_k))``), so reporting a tiny A earns a device no more steps than the smallest honest one.
        """
        valid = {cid: a for cid, a in a_values.items() if math.isfinite(a) and a >= 0.0}
        if not valid:
            return {}
        m = robust_min(list(valid.values()))
        out: dict[str, int] = {}
        for cid, a in valid.items():
            a = max(a, m)
            if a == 0.0:  # m = 0 (the median A is 0) and this client's bound (29) sets no upper limit
                out[cid] = self.tau_max
                continue
            tau = math.floor(a / (a - self.alpha_k * m) + 1e-9)
            if tau <= 1:
                tau = self.tau_min_reset
            out[cid] = min(max(tau, self.tau_floor), self.tau_max)
        return out

    def _check_alpha(self, a_values: dict[str, float]) -> None:
        """(f)8: keep alpha_k fixed; warn (once) when it leaves (0, 2L/min A) while 2L/min A < 1."""
        finite = [a for a in a_values.values() if math.isfinite(a) and a > 0.0]
        if self.L is None or not finite:
            return
        bound = 2.0 * self.L / min(finite)
        if bound < 1.0 and self.alpha_k >= bound:
            first, self._alpha_warned = not self._alpha_warned, True
            (log.warning if first else log.debug)(
                "fedveca round k=%d: alpha_k=%g is outside (0, 2L/min A = %.4g); kept fixed as in the paper%s",
                self.k,
                self.alpha_k,
                bound,
                " (further occurrences are logged at debug level)" if first else "",
            )

    # -- reporting and checkpoints -----------------------------------------------------------------------------------
    def round_metrics(self) -> dict[str, Any]:
        return dict(self._metrics)

    def state_dict(self) -> dict[str, Any]:
        """Scalars and dicts (JSON in the checkpoint) and ``prev_grad`` (grad F(w_{k-1}), d floats: an npz array)."""
        return {
            "k": self.k,
            "tau": dict(self.tau),
            "L": self.L,
            "L_pending": self.L_pending,
            "P": self.P,
            "prev_grad": None if self.prev_grad is None else self.prev_grad.copy(),
            "step_norm": self.step_norm,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.k = int(state["k"])
        self.tau = {str(c): int(t) for c, t in state["tau"].items()}
        self.L = state["L"]
        self.L_pending = state["L_pending"]
        self.P = float(state["P"])
        grad = state["prev_grad"]
        self.prev_grad = None if grad is None else np.asarray(grad, dtype=np.float32)
        self.step_norm = state["step_norm"]
