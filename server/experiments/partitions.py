"""Client data-partition schemes (ALGORITHMS.md section 5), selected by a ``--partition`` string.

Forms (case-insensitive):

* ``iid`` -- a random equal split (FedUmf/FedVeca "IID").
* ``dirichlet:PHI`` -- per class ``q_k ~ Dir_N(PHI)``, the whole draw repeated until every client has ``min_size``
  samples (5.1). ``dirichlet:PHI:balanced`` adds NIID-Bench's balancing step: a client already holding more than
  n/N samples gets none of the next class (NIID-Bench's code always does this).
* ``taco-groups`` -- TACO's label-diversity groups A/B/C (10% / 20% / 50% of the labels per client) (5.2).
* ``fedveca-case:N`` -- FedVeca's Case 1 (IID), 2 (one label group per client) or 3 (half IID, half Case 2) (5.6).
* ``drag-q:Q`` -- DRAG: label l goes to client ``l mod M`` with probability Q, else to a random other client;
  FLTrust groups when clients > classes (5.4, ambiguity 17).
* ``shards:K`` -- FedUmf / McMahan shards: sort by label, cut into ``K * M`` equal shards, K random shards per client
  (``shards:2`` is FedUmf's "at most two classes") (5.5).
* ``unbalanced:SIGMA`` -- IID labels, client sizes ``~ LogNormal(0, SIGMA)`` normalised to the data size (5.5 appendix).
* ``natural`` -- LEAF's split: every client gets whole groups (shakespeare: speakers), so it needs per-sample
  ``groups``.

Every scheme returns one sorted index array per client; together they hold every index exactly once, and the result
depends only on the arguments (one ``numpy.random.default_rng(seed)`` per call). "Label l" means the l-th distinct
label value in sorted order (the label itself for the usual 0..C-1 labels).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

__all__ = ["PARTITION_FORMS", "partition", "taco_group"]

PARTITION_FORMS = (
    "'taco-groups', 'fedveca-case:N' (N = 1, 2, 3), 'drag-q:Q' (0 <= Q <= 1), 'shards:K' (K >= 1), "
    "'unbalanced:SIGMA' (SIGMA > 0), 'natural' (data sets with groups, e.g. shakespeare), 'iid' or 'dirichlet:PHI' "
    "(e.g. dirichlet:0.5), with NIID-Bench's balancing step 'dirichlet:PHI:balanced'"
)
#: Dirichlet draws (one per class and try) before giving up: 200,000 tries for 2 classes (UCI Adult's Dir(0.1) over
#: 20 clients passes about 1 try in 700), 40,000 for 10; about 10 s at most
_DIRICHLET_DRAWS = 400_000
_REDRAW_TRIES = 1000
_TACO_FRACTIONS = (0.1, 0.2, 0.5)  # groups A, B, C


def taco_group(client: int) -> int:
    """The ``taco-groups`` group (0, 1, 2 = A, B, C) of the client at this index: round-robin (``_taco_groups``)."""
    return client % len(_TACO_FRACTIONS)


def _unknown(scheme: str) -> ValueError:
    return ValueError(f"unknown partition {scheme!r}: use {PARTITION_FORMS}")


def _out_of_range(scheme: str, what: str) -> ValueError:
    return ValueError(f"partition {scheme!r}: {what}; valid forms: {PARTITION_FORMS}")


def _parse_scheme(scheme: str) -> tuple[str, float | int | None]:
    """(kind, parameter) for a scheme string; ValueError naming the valid forms when it is not one."""
    text = str(scheme).strip().lower()
    if text in ("iid", "taco-groups", "natural"):
        return text, None
    kind, sep, value = text.partition(":")
    if not sep or kind not in ("dirichlet", "fedveca-case", "drag-q", "shards", "unbalanced"):
        raise _unknown(scheme)
    value, _, option = value.partition(":") if kind == "dirichlet" else (value, "", "")
    if option not in ("", "balanced"):
        raise _unknown(scheme)
    if kind in ("fedveca-case", "shards"):
        try:
            number = int(value)
        except ValueError:
            raise _unknown(scheme) from None
        if kind == "fedveca-case" and number not in (1, 2, 3):
            raise _out_of_range(scheme, f"N must be 1, 2 or 3 (fedveca-case:N), got {number}")
        if kind == "shards" and number < 1:
            raise _out_of_range(scheme, f"K must be a positive integer (shards:K), got {number}")
        return kind, number
    try:
        x = float(value)
    except ValueError:
        raise _unknown(scheme) from None
    if kind == "dirichlet" and (not math.isfinite(x) or x <= 0):
        raise ValueError(f"partition {scheme!r}: PHI must be a positive number (e.g. dirichlet:0.5)")
    if kind == "dirichlet" and option:
        return "dirichlet-balanced", x
    if kind == "drag-q" and not 0 <= x <= 1:  # also rejects nan
        raise _out_of_range(scheme, f"Q must be a probability in [0, 1] (drag-q:Q), got {value}")
    if kind == "unbalanced" and (not math.isfinite(x) or x <= 0):
        raise _out_of_range(scheme, f"SIGMA must be a positive number (unbalanced:SIGMA), got {value}")
    return kind, x


def partition(
    labels: np.ndarray,
    num_clients: int,
    scheme: str,
    seed: int,
    *,
    min_size: int = 10,
    groups: np.ndarray | None = None,
    dataset: str = "this data set",
) -> list[np.ndarray]:
    """Split sample indices among clients by ``scheme`` (see the module docstring for the forms).

    Every index lands in exactly one part (each part sorted); the result depends only on the arguments.
    ``min_size`` applies to ``dirichlet`` and ``unbalanced`` (each client gets at least that many samples). The
    other non-IID schemes raise ValueError if some client would end up with no sample.
    ``groups`` (one id per sample) is what ``natural`` splits by; ``dataset`` names the data in its errors.
    """
    labels = np.asarray(labels)
    n = len(labels)
    kind, param = _parse_scheme(scheme)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_clients > n:
        raise ValueError(f"cannot split {n} samples among {num_clients} clients")
    rng = np.random.default_rng(seed)
    if kind == "iid":
        return [np.sort(p) for p in np.array_split(rng.permutation(n), num_clients)]
    if kind == "natural":
        return _natural(groups, n, num_clients, rng, dataset)
    if kind in ("dirichlet", "dirichlet-balanced"):
        balance = kind == "dirichlet-balanced"
        return _dirichlet(labels, num_clients, float(param), rng, scheme, min_size, balance)  # type: ignore[arg-type]
    if kind == "unbalanced":
        return _unbalanced(n, num_clients, float(param), rng, scheme, min_size)  # type: ignore[arg-type]
    schemes: dict[str, Callable[[], list[np.ndarray]]] = {
        "taco-groups": lambda: _taco_groups(labels, num_clients, rng),
        "fedveca-case": lambda: _fedveca_case(labels, num_clients, int(param), rng),  # type: ignore[arg-type]
        "drag-q": lambda: _drag_q(labels, num_clients, float(param), rng),  # type: ignore[arg-type]
        "shards": lambda: _shards(labels, num_clients, int(param), rng),  # type: ignore[arg-type]
    }
    parts = schemes[kind]()
    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise ValueError(
            f"partition {scheme!r}: {len(empty)} of {num_clients} clients get no sample ({n} samples, "
            f"{len(np.unique(labels))} labels); use fewer clients or another scheme"
        )
    return parts


def _natural(
    groups: np.ndarray | None, n: int, num_clients: int, rng: np.random.Generator, dataset: str
) -> list[np.ndarray]:
    """LEAF's natural split: the groups (e.g. speakers) in random order, dealt to the clients in (nearly) equal
    numbers of whole groups; with as many clients as groups, each client is one group, as in LEAF."""
    if groups is None:
        raise ValueError(
            f"partition 'natural' needs samples grouped by writer/speaker, and {dataset} has no groups: "
            "use a data set with groups (e.g. shakespeare) or another scheme"
        )
    groups = np.asarray(groups)
    if len(groups) != n:
        raise ValueError(f"partition 'natural': {len(groups)} group ids for {n} samples")
    ids, member = np.unique(groups, return_inverse=True)
    if num_clients > len(ids):
        raise ValueError(
            f"partition 'natural': {dataset} has {len(ids)} groups, fewer than the {num_clients} clients; "
            "use at most that many clients"
        )
    client_of_group = np.empty(len(ids), dtype=np.int64)
    for client, chunk in enumerate(np.array_split(rng.permutation(len(ids)), num_clients)):
        client_of_group[chunk] = client
    return _collect(client_of_group[member.reshape(-1)], num_clients)


def _label_ranks(labels: np.ndarray) -> tuple[np.ndarray, int]:
    """Each sample's label as its rank among the distinct labels (0..C-1), and C."""
    classes, ranks = np.unique(labels, return_inverse=True)
    return ranks.reshape(-1), len(classes)


def _collect(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Sorted index arrays from a per-sample client id."""
    order = np.argsort(owner, kind="stable")
    cuts = np.searchsorted(owner[order], np.arange(1, num_clients))
    return [np.sort(p) for p in np.split(order, cuts)]


def _split_evenly(idx: np.ndarray, holders: list[int], owner: np.ndarray, rng: np.random.Generator) -> None:
    """Shuffle ``idx`` and give the holders (nearly) equal pieces, recorded in ``owner``."""
    for client, chunk in zip(holders, np.array_split(rng.permutation(idx), len(holders)), strict=True):
        owner[chunk] = client


def _dirichlet(
    labels: np.ndarray,
    num_clients: int,
    phi: float,
    rng: np.random.Generator,
    scheme: str,
    min_size: int,
    balance: bool,
) -> list[np.ndarray]:
    """5.1 NIID-Bench: per class split by ``q_k ~ Dir(phi)``, redrawn until every client has min_size.

    A try draws only the proportions and counts the sizes; the (once shuffled) indices are dealt out for the accepted
    draw only, so rare acceptances (Adult's Dir(0.1)) cost milliseconds per try. ``balance``: NIID-Bench's step that
    zeroes the proportion of a client already holding more than ``n / num_clients`` samples (unless that zeroes all).
    """
    n = len(labels)
    if n // num_clients < min_size:
        raise ValueError(
            f"dirichlet partition: {n} samples cannot give each of {num_clients} clients {min_size} samples"
        )
    by_class = [rng.permutation(np.flatnonzero(labels == k)) for k in np.unique(labels)]
    tries = max(1, _DIRICHLET_DRAWS // len(by_class))
    for _ in range(tries):
        sizes = np.zeros(num_clients, dtype=np.int64)
        cuts = []
        for idx in by_class:
            q = rng.dirichlet(np.full(num_clients, phi))
            if balance:
                capped = q * (sizes < n / num_clients)
                q = capped if capped.sum() > 0 else q
            cut = (np.cumsum(q / q.sum()) * len(idx)).astype(np.int64)[:-1]
            sizes += np.diff(cut, prepend=0, append=len(idx))
            cuts.append(cut)
        if sizes.min() >= min_size:
            owner = np.empty(n, dtype=np.int64)
            for idx, cut in zip(by_class, cuts, strict=True):
                for client, chunk in enumerate(np.split(idx, cut)):
                    owner[chunk] = client
            return _collect(owner, num_clients)
    raise ValueError(
        f"dirichlet partition {scheme!r}: no split giving every one of {num_clients} clients >= {min_size} samples "
        f"after {tries} tries; use a larger PHI or fewer clients"
    )


def _taco_groups(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """5.2 TACO groups A/B/C: each client holds 10% / 20% / 50% of the labels (1 / 2 / 5 of 10).

    [RECOMMENDED] resolution of what the paper leaves open: clients are put into groups A, B, C round-robin by index
    (client 0 -> A, 1 -> B, 2 -> C, 3 -> A, ...), so every first n clients are as even as possible: 20 clients -> 7/7/6,
    and the 12 honest clients of TACO's freeloader experiments (freeloaders are the last ids) -> 4/4/4, as 5.2
    recommends; the label count is
    ``max(1, round(fraction * C))``; each client draws its label set uniformly without replacement, all sets redrawn
    until every label is held by some client; each label's shuffled samples are split evenly among its holders.
    """
    ranks, c = _label_ranks(labels)
    groups = [taco_group(i) for i in range(num_clients)]
    counts = [max(1, math.floor(f * c + 0.5)) for f in _TACO_FRACTIONS]
    per_client = [counts[g] for g in groups]
    if sum(per_client) < c:
        raise ValueError(
            f"taco-groups: {num_clients} clients holding {sum(per_client)} label slots cannot cover all {c} labels; "
            "use more clients"
        )
    for _ in range(_REDRAW_TRIES):
        label_sets = [rng.choice(c, size=k, replace=False) for k in per_client]
        if len(np.unique(np.concatenate(label_sets))) == c:
            break
    else:
        raise ValueError(f"taco-groups: no draw covered all {c} labels after {_REDRAW_TRIES} tries; use more clients")
    owner = np.empty(len(labels), dtype=np.int64)
    for label in range(c):
        holders = [i for i, s in enumerate(label_sets) if label in s]
        _split_evenly(np.flatnonzero(ranks == label), holders, owner, rng)
    return _collect(owner, num_clients)


def _case2_owner(
    ranks: np.ndarray, idx: np.ndarray, clients: list[int], num_labels: int, owner: np.ndarray, rng: np.random.Generator
) -> None:
    """FedVeca Case 2 on samples ``idx`` whose labels are 0..num_labels-1 in ``ranks``, over the given clients.

    ``len(clients) <= num_labels``: the j-th client gets every label l with ``l mod len(clients) == j``;
    otherwise the j-th client is assigned label ``j mod num_labels`` and each label is split evenly among its clients.
    """
    m = len(clients)
    if m <= num_labels:
        owner[idx] = np.asarray(clients)[ranks[idx] % m]
        return
    for label in range(num_labels):
        holders = [clients[j] for j in range(m) if j % num_labels == label]
        _split_evenly(idx[ranks[idx] == label], holders, owner, rng)


def _fedveca_case(
    labels: np.ndarray, num_clients: int, case: int, rng: np.random.Generator, split: int | None = None
) -> list[np.ndarray]:
    """5.6 FedVeca Cases 1-3.

    Case 1: every sample goes to a uniformly random client.
    Case 2 [RECOMMENDED, INFERRED]: with N <= C clients, client i gets all samples of the labels ``l mod N == i``;
    with N > C, client i holds label ``i mod C`` and each label is split evenly among its clients.
    Case 3 [RECOMMENDED, INFERRED]: the first ``split`` clients (default ``ceil(N/2)``; 3 of 5) get the first half of
    the labels (``ceil(C/2)``; 0-4 of 10) with every sample to a uniformly random one of them; the remaining clients
    get the other labels by the Case-2 rule on labels counted from the split (N = 5: client 4 {5,7,9}, client 5 {6,8}).
    ``split`` is only reachable from Python (the scheme string uses the default).
    """
    ranks, c = _label_ranks(labels)
    n = len(labels)
    if case == 1:
        return _collect(rng.integers(0, num_clients, n), num_clients)
    owner = np.empty(n, dtype=np.int64)
    if case == 2:
        _case2_owner(ranks, np.arange(n), list(range(num_clients)), c, owner, rng)
        return _collect(owner, num_clients)
    split = math.ceil(num_clients / 2) if split is None else split
    half = math.ceil(c / 2)
    if num_clients < 2 or c < 2 or not 1 <= split < num_clients:
        raise ValueError(
            f"fedveca-case:3 needs at least 2 clients and 2 labels and 1 <= split < clients "
            f"(got {num_clients} clients, {c} labels, split {split})"
        )
    first = np.flatnonzero(ranks < half)
    owner[first] = rng.integers(0, split, len(first))
    second = np.flatnonzero(ranks >= half)
    shifted = ranks - half
    _case2_owner(shifted, second, list(range(split, num_clients)), c - half, owner, rng)
    return _collect(owner, num_clients)


def _drag_q(labels: np.ndarray, num_clients: int, q: float, rng: np.random.Generator) -> list[np.ndarray]:
    """5.4 DRAG: a sample with label l goes to client ``l mod M`` with probability q, else a random other client.

    [RECOMMENDED] (ambiguity 17): with more clients than labels (M > C) the FLTrust group rule is used instead --
    groups ``G_j = {m : m mod C = j}``; the sample goes to group l with probability q, else a uniformly random other
    group, and inside the group to a uniformly random client. ``q = 1/M`` is IID-like, ``q = 1`` label-exclusive.
    """
    ranks, c = _label_ranks(labels)
    n = len(labels)
    units = num_clients if num_clients <= c else c  # clients, or FLTrust groups
    home = ranks % units
    if units > 1:
        other = rng.integers(0, units - 1, n)
        other += other >= home
        target = np.where(rng.random(n) < q, home, other)
    else:
        target = home
    if num_clients <= c:
        return _collect(target, num_clients)
    group_size = np.array([len(range(j, num_clients, c)) for j in range(c)])
    member = np.floor(rng.random(n) * group_size[target]).astype(np.int64)
    return _collect(target + member * c, num_clients)


def _shards(labels: np.ndarray, num_clients: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """5.5 FedUmf [RECOMMENDED, INFERRED from McMahan et al.]: sort the indices by label (random order inside a label),
    cut them into ``K * M`` (nearly) equal shards, give each client K random shards. ``shards:2`` is FedUmf's
    "at most two classes" (on balanced labels whose class sizes are multiples of the shard size, e.g. MNIST-like
    6000 samples per class with 100 clients); a shard can straddle two labels otherwise.
    """
    n = len(labels)
    if k * num_clients > n:
        raise ValueError(f"shards:{k}: {n} samples cannot be cut into {k} shards for each of {num_clients} clients")
    shuffled = rng.permutation(n)
    by_label = shuffled[np.argsort(labels[shuffled], kind="stable")]
    shards = np.array_split(by_label, k * num_clients)
    order = rng.permutation(k * num_clients)
    return [np.sort(np.concatenate([shards[s] for s in order[i * k : (i + 1) * k]])) for i in range(num_clients)]


def _unbalanced(
    n: int, num_clients: int, sigma: float, rng: np.random.Generator, scheme: str, min_size: int
) -> list[np.ndarray]:
    """5.5 FedUmf appendix "unbalance": client sizes ``~ LogNormal(0, SIGMA)`` normalised to the data size (integer
    sizes by largest remainder), redrawn until every client has ``min_size`` samples; samples are assigned IID.
    """
    if n < num_clients * min_size:
        raise ValueError(
            f"unbalanced partition: {n} samples cannot give each of {num_clients} clients min_size={min_size} samples"
        )
    for _ in range(_REDRAW_TRIES):
        share = rng.lognormal(0.0, sigma, num_clients)
        exact = share / share.sum() * n
        sizes = np.floor(exact).astype(np.int64)
        sizes[np.argsort(sizes - exact, kind="stable")[: n - int(sizes.sum())]] += 1
        if sizes.min() >= min_size:
            return [np.sort(p) for p in np.split(rng.permutation(n), np.cumsum(sizes)[:-1])]
    raise _out_of_range(
        scheme,
        f"no size draw gave every one of {num_clients} clients >= {min_size} samples after {_REDRAW_TRIES} tries; "
        "use a smaller SIGMA or fewer clients",
    )
