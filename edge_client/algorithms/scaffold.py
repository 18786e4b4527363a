"""SCAFFOLD client half (ALGORITHMS.md 2.0 lines 10/16, 2.4; option II of the original SCAFFOLD).

Per step ``v = g + alpha (c - c_i)``: the correction is constant within a round, so it is computed once in
``begin_round`` and a step costs one in-place add. After the loop
``c_i <- c_i - c + delta / (K_i eta_l)`` where ``K_i`` is the number of steps this client actually took (2.4 (e):
"if K varies per client use that client's K_i"), and the client uploads ``delta_c = c_i^new - c_i^old`` (2.4 (a)
[RECOMMENDED]: the difference, so the server needs no copy of every ``c_i``).

``c_i^new`` is committed only once the server has aggregated the update that carried its ``delta_c``: the server
says in every assignment which of this client's rounds it last aggregated (the value ``last_aggregated``, 0 = none),
and a pending ``c_i^new`` of another round (the update was rejected, late or lost with a broker) is discarded.
Otherwise ``c`` would drift from the mean of the ``c_i`` by ``delta_c / N`` per lost update. An assignment without
``last_aggregated`` (hand-made, the benchmark) commits at once, as the original algorithm does.

An upload codec may send ``delta_c`` lossily (its contract declares ``codec="commit"``): the client then takes
``c_i^new = c_i^old + delta_c`` as the server decoded it (``uploaded``), so ``c`` is still exactly the mean of the
``c_i``. What a codec left out needs no residual: option II's ``c_i^new - c_i^old = delta / (K_i eta_l) - c`` is
measured against the ``c_i`` the client holds, so the next round's ``delta_c`` carries it. Under secure aggregation
the client likewise adopts the clipped, quantised ``delta_c`` it masked (``edge_client.secagg.parts``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from edge_client.algorithms.base import ClientAlgorithm, LocalContext
from edge_client.algorithms.contract import Array, Contract, Setting, Value, weighting

CONTRACT = Contract(
    "scaffold",
    "control variates: clients step along g + alpha (c - c_i); the server averages deltas and updates c",
    settings=(
        Setting("alpha", float, 1.0, "scale of the correction c - c_i", device=True),
        weighting("uniform"),
        Setting("c_mean_over", str, "contributors", "c is the mean c_i of the clients whose updates were aggregated, "
                "or of every registered client (2.4 (b))", choices=("contributors", "registered")),
    ),
    sends=(Array("c", "the server's control variate c", scope="global"),),
    sends_values=(
        Value("last_aggregated", "the last round whose update from this client went into c (0: none)", integer=True,
              required=False),
    ),
    returns=(Array("delta_c", "c_i^new - c_i^old", codec="commit", summed="plain"),),  # c adds their plain sum
    needs="sums",
    dp_refusal="", dp_requires=(("weighting", "uniform"),),
    buffered=False,
    buffered_why=(
        "the control variate c is updated from the round's c_i differences, each computed against the c of the "
        "device's round: a stale c_i difference added to a newer c has no correction in the algorithm"
    ),
)  # fmt: skip


class ScaffoldClient(ClientAlgorithm):
    """Keeps ``c_i`` (zeros until the first round, 2.4 (d)); it survives restarts through ``state_dict``.

    ``coefficient`` is the correction's scale (TACO's tailored variant overrides it).
    A round in which no step ran leaves ``c_i`` unchanged (``delta / (0 * eta_l)`` is undefined) and uploads
    ``delta_c = 0``. ``pending`` is ``(round, c_i^new)`` until the server's next assignment settles it.
    """

    contract = CONTRACT

    def __init__(self) -> None:
        self.c_i: np.ndarray | None = None  # float32, the model's size
        self._c: np.ndarray | None = None  # the server's c of this round
        self._correction: torch.Tensor | None = None  # alpha * (c - c_i), this round only
        self._steps = 0
        self.pending: tuple[int, np.ndarray] | None = None
        self._old: tuple[int, np.ndarray, bool] | None = None  # (round, c_i^old, commit at once) until uploaded

    def coefficient(self, ctx: LocalContext) -> float:
        return float(ctx.setting("alpha"))

    def settle(self, last_aggregated: int) -> None:
        """Commit the pending ``c_i^new`` if the server aggregated the round it came from, else drop it."""
        if self.pending is not None:
            round_, c_i = self.pending
            if round_ == last_aggregated:
                self.c_i = c_i
            self.pending = None

    def begin_round(self, ctx: LocalContext) -> None:
        last = ctx.plan.settings.get("last_aggregated")
        if last is not None:
            self.settle(int(last))
        c = ctx.array("c")
        if self.c_i is None or self.c_i.shape != (ctx.flat.size,):
            self.c_i = np.zeros(ctx.flat.size, dtype=np.float32)
        self._c = c.numpy()
        alpha = self.coefficient(ctx)
        correction = c.sub(torch.from_numpy(self.c_i)).mul_(alpha)
        self._correction = correction if alpha and bool(correction.any()) else None  # round 0: c = c_i = 0
        self._steps = 0

    def correct(self, ctx: LocalContext, step: int, xb: torch.Tensor, yb: torch.Tensor) -> None:
        self._steps += 1  # the steps actually taken, whatever the assignment said
        if self._correction is not None:
            ctx.flat.grad.add_(self._correction)

    def end_round(self, ctx: LocalContext, delta: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        assert self.c_i is not None and self._c is not None, "end_round before begin_round"
        self._old = None
        if self._steps == 0:
            delta_c = np.zeros_like(self.c_i)
        else:
            # c_i^new - c_i = delta / (K_i eta_l) - c
            delta_c = (delta.astype(np.float32) / np.float32(self._steps * ctx.plan.lr) - self._c).astype(np.float32)
            self._old = (ctx.facts.round, self.c_i, ctx.plan.settings.get("last_aggregated") is None)
            self._set_new(self.c_i + delta_c)
        self._c, self._correction = None, None
        return {}, {"delta_c": delta_c}

    def _set_new(self, c_i: np.ndarray) -> None:
        """``c_i^new``: committed at once (no ``last_aggregated``) or pending until the server settles it."""
        assert self._old is not None
        round_, _, at_once = self._old
        if at_once:
            self.c_i = c_i
        else:
            self.pending = (round_, c_i)

    def uploaded(self, arrays: dict[str, np.ndarray]) -> None:
        if self._old is not None:
            self._set_new((self._old[1] + arrays["delta_c"]).astype(np.float32))

    def state_dict(self) -> dict[str, np.ndarray]:
        state = {} if self.c_i is None else {"c_i": self.c_i.copy()}
        if self.pending is not None:
            state |= {"pending_round": np.array(self.pending[0]), "pending_c_i": self.pending[1].copy()}
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.c_i = np.array(state["c_i"], dtype=np.float32).reshape(-1) if "c_i" in state else None
        self.pending = None
        if "pending_c_i" in state:
            pending = np.array(state["pending_c_i"], dtype=np.float32).reshape(-1)
            self.pending = (int(state["pending_round"]), pending)
