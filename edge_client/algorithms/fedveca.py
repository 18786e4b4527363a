"""FedVeca client half (ALGORITHMS.md 2.11 (a)): plain SGD for tau steps plus the local estimates beta and delta.

The streaming O(d) form of Algorithm 2 (ALGORITHMS.md 2.11 (a), (f)2): ``h = grad F_i(w_k)`` over
``full_grad_batches`` mini-batches (0: the full local training set) is computed *before* the loop (it depends only on
``w_k``), so lines 15-18's maxima over the stored iterates become running maxima updated at every step, and the memory
does not depend on tau.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from edge_client.algorithms.base import ClientAlgorithm, LocalContext
from edge_client.algorithms.contract import Array, Contract, Setting, Value

EPS = 1e-12
#: Default of ``fedveca.full_grad_batches``: 4 mini-batches measured as accurate as the full pass on the fleet and the
#: paper's setting (docs/algorithms.md, FedVeca), at a fraction of its cost (the pass is 60-150 step-equivalents).
FULL_GRAD_BATCHES = 4

CONTRACT = Contract(
    "fedveca",
    "FedNova-style averaging; per-client local steps adapted from local smoothness estimates",
    settings=(
        Setting("alpha_k", float, 0.95, "alpha_k of eq. 15", low=0.0, high=1.0, low_open=True, high_open=True),
        Setting("tau_max", int, 50, "largest local steps a client is given", low=1),
        Setting("tau_min_reset", int, 2, "the steps given when eq. 15 yields tau <= 1 (at most tau_max)", low=1),
        Setting("tau_init", int, 0, "local steps of the first two rounds (0: floor(1 / (1 - alpha_k)))", low=0),
        Setting("tau_floor", int, 1, "fewest steps eq. 15 may give a client (1: the paper's rule alone; at most "
                "tau_max)", low=1),
        Setting("full_grad_batches", int, FULL_GRAD_BATCHES, "mini-batches of the local gradient at w_k for beta "
                "and P (0: a full pass over the local data, as printed)", low=0, device=True),
    ),
    sends_values=(Value("P", "||grad F(w_{k-1})||^2 (0 in the first round)", example=1.0),),
    returns=(
        # grad feeds ||grad F||^2 and the smoothness estimate L: differences of noisy estimates would inflate L
        Array("grad", "grad F_i(w_k) over full_grad_batches mini-batches (0: the whole local data)", codec="half"),
        Array("G", "(1/tau) sum of the local mini-batch gradients", codec="feedback"),  # the model step, like delta
    ),
    returns_values=(  # bounded far above honest estimates (units of 1 to 10^3 on the shipped models)
        Value("beta", "local smoothness estimate (Alg. 2 lines 15-16)", high=1e9),
        Value("delta", "local gradient divergence estimate (Alg. 2 lines 17-18)", high=1e9),
    ),
    unequal_steps=True,
    adaptive_steps=True,
    needs="per_device",
    needs_why="each device's smoothness and divergence estimates beta_i, delta_i choose its tau_i",
    dp_refusal=(
        "its step counts come from each device's own beta and delta estimates "
        "and gradient, per-device releases the noise does not cover"
    ),
    buffered=False,
    buffered_why=(
        "its server picks every device's next tau from the round's gradient statistics (beta, delta of all updates of "
        "one model version): updates of several versions have no common gradient to compare"
    ),
)  # fmt: skip


def gradient_sample(ctx: LocalContext) -> tuple[np.ndarray, np.ndarray]:
    """The samples of ``h``: ``full_grad_batches`` batches of the client's stream, or all of its data when that is
    0 or the batches would cover it anyway."""
    batches, data = int(ctx.setting("full_grad_batches")), ctx.dataset
    if batches == 0 or batches * ctx.sampler.batch_size >= len(data):
        return data.x, data.y
    idx = np.concatenate([ctx.sampler.next() for _ in range(batches)])
    return data.x[idx], data.y[idx]


class FedVecaClient(ClientAlgorithm):
    """Uploads ``grad = grad F_i(w_k)`` (d), ``G = (1/tau) sum_lam g_lam`` (d), and the scalars beta, delta.

    Per step ``lam`` (``correct``, before the optimiser step; ``flat.params`` is ``w^lam``, ``flat.grad`` is
    ``g_lam``, the mini-batch gradient at ``w^lam``)::

        beta = max(beta, ||h - g|| / ||w_k - w^lam||)     for lam >= 1   (Alg. 2 l.15-16; lam = 0 is 0/0, (f)3)
        S   += g                                                          (S = sum_{s<=lam} g_s)
        dnum = max(dnum, ||S||^2 / (lam + 1))             for lam >= 1   (Alg. 2 l.17-18 without 1/P, (f)5)

    and ``delta = dnum / P`` at the end, ``P = ||grad F(w_{k-1})||^2`` sent by the server in ``params["P"]`` (the
    algorithm's version with the *previous* global gradient, (f)4; max commutes with the positive factor 1/P). Rounds
    without ``P`` (k = 0) upload ``delta = 0``; tau = 1 gives ``beta = delta = 0`` ((f)3, (f)5). A term with
    ``||w_k - w^lam|| < 1e-12`` is skipped (C5). ``tau = plan.steps`` (the trainer runs exactly that many).

    ``h`` is taken over ``full_grad_batches`` mini-batches drawn from the client's batch stream ((f)1; 0, or as many
    batches as the local data holds, is the full pass of Alg. 2 line 9): the pass costs 60-150 step-equivalents a
    round on the shipped CNN, and a 4-batch estimate left accuracy and tau unchanged (docs/algorithms.md, FedVeca).

    Memory: three d-vectors of its own (``h``, ``S``, one scratch vector) allocated once and reused every round, beside
    the trainer's ``w_k`` (``ctx.start``), ``w`` and ``g``: five d-vectors in all, independent of tau. ``beta`` mixes
    ``h`` with mini-batch ``g`` as printed ((f)3). The options ``beta_use_fullbatch`` and ``delta_reference`` of
    (f)3/(f)4 are not implemented (the [RECOMMENDED] defaults). The gradient pass leaves BatchNorm running statistics
    unchanged (C6). No state survives a round.
    """

    contract = CONTRACT

    def __init__(self) -> None:
        self._h: torch.Tensor | None = None  # grad F_i(w_k), full local data set
        self._s: torch.Tensor | None = None  # running sum of the mini-batch gradients
        self._scratch: torch.Tensor | None = None  # h - g, then w_k - w
        self._beta = 0.0
        self._dnum = 0.0

    def _buffers(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three d-vectors, allocated on first use (or when the model changes) and reused afterwards."""
        if self._h is None or self._h.numel() != size:
            self._h = torch.empty(size, dtype=torch.float32)
            self._s = torch.empty(size, dtype=torch.float32)
            self._scratch = torch.empty(size, dtype=torch.float32)
        assert self._s is not None and self._scratch is not None
        return self._h, self._s, self._scratch

    def begin_round(self, ctx: LocalContext) -> None:
        h, s, _ = self._buffers(ctx.flat.size)
        module = ctx.flat.module
        saved = [b.clone() for b in module.buffers()]  # BN running statistics (C6); empty for BN-free models
        # Alg. 2 line 9, moved before the loop ((f)2); batches of 256 keep the activations small (1024 cost ~100 MiB
        # of peak memory on the TACO CNN, benchmarks/memory) and are no slower
        x, y = gradient_sample(ctx)
        ctx.flat.full_gradient(x, y, out=h, batch_size=256)
        with torch.no_grad():
            for buf, old in zip(module.buffers(), saved, strict=True):
                buf.copy_(old)
        s.zero_()
        self._beta = 0.0
        self._dnum = 0.0

    def correct(self, ctx: LocalContext, step: int, xb: torch.Tensor, yb: torch.Tensor) -> None:
        h, s, scratch = self._buffers(ctx.flat.size)
        g = ctx.flat.grad
        if step >= 1:
            dist = float(torch.linalg.vector_norm(torch.sub(ctx.start, ctx.flat.params, out=scratch)))
            if dist >= EPS:
                diff = float(torch.linalg.vector_norm(torch.sub(h, g, out=scratch)))
                self._beta = max(self._beta, diff / dist)
        s.add_(g)
        if step >= 1:
            self._dnum = max(self._dnum, float(torch.dot(s, s)) / (step + 1))

    def end_round(self, ctx: LocalContext, delta: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        h, s, _ = self._buffers(ctx.flat.size)
        tau = max(1, ctx.plan.steps)
        p = float(ctx.setting("P"))
        extras = {"beta": self._beta, "delta": self._dnum / p if p > 0 else 0.0}
        arrays = {"grad": h.numpy().copy(), "G": (s / tau).numpy()}  # copies: the buffers are reused next round
        return extras, arrays
