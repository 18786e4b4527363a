"""The partition schemes of ALGORITHMS.md section 5 (server/partitions.py), on synthetic labels."""

import numpy as np
import pytest

from server.experiments.partitions import partition
from server.experiments.shards import partition as reexported

LABELS = np.repeat(np.arange(10), 600)  # MNIST-like: 10 balanced classes, 6000 samples
SCHEMES = [
    "iid",
    "dirichlet:0.5",
    "dirichlet:0.5:balanced",
    "taco-groups",
    "fedveca-case:1",
    "fedveca-case:2",
    "fedveca-case:3",
    "drag-q:0.5",
    "drag-q:1",
    "shards:2",
    "unbalanced:0.3",
]


def _labels_per_client(parts, labels=LABELS):
    return [set(np.unique(labels[p]).tolist()) for p in parts]


def _check_cover(parts, n):
    stream = np.concatenate(parts)
    assert len(stream) == n and np.array_equal(np.sort(stream), np.arange(n))
    assert all(np.array_equal(p, np.sort(p)) for p in parts)


@pytest.mark.parametrize("clients", [5, 20])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_covers_and_is_deterministic(scheme, clients):
    parts = partition(LABELS, clients, scheme, seed=3)
    assert len(parts) == clients and all(len(p) > 0 for p in parts)
    _check_cover(parts, len(LABELS))
    again = partition(LABELS, clients, scheme, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    assert reexported is partition


@pytest.mark.parametrize("scheme", ["iid", "dirichlet:0.5", "taco-groups", "fedveca-case:1", "drag-q:0.5", "shards:2"])
def test_seed_changes_split(scheme):
    a, b = partition(LABELS, 10, scheme, seed=0), partition(LABELS, 10, scheme, seed=1)
    assert not all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _grown_past_share(parts, labels=LABELS):
    """(client, class) pairs where a client already holding more than n/N samples got samples of the next class."""
    hist = np.stack([np.bincount(labels[p], minlength=10) for p in parts])
    before = np.cumsum(hist, axis=1) - hist  # samples held before each class (classes are split in order)
    return [
        (c, k) for c in range(len(parts)) for k in range(10) if before[c, k] >= len(labels) / len(parts) and hist[c, k]
    ]


def test_dirichlet_balanced_gives_no_more_to_a_client_past_its_share():
    for seed in range(3):
        assert _grown_past_share(partition(LABELS, 20, "dirichlet:0.1:balanced", seed=seed)) == []
    assert any(_grown_past_share(partition(LABELS, 20, "dirichlet:0.1", seed=s)) for s in range(3))  # not a no-op


def test_drag_q1_label_exclusive_when_clients_le_classes():
    for m in (3, 5, 10):
        parts = partition(LABELS, m, "drag-q:1.0", seed=0)
        for client, held in enumerate(_labels_per_client(parts)):
            assert held == {label for label in range(10) if label % m == client}


def test_drag_q_probability():
    parts = partition(LABELS, 5, "drag-q:0.6", seed=0)
    hist = np.stack([np.bincount(LABELS[p], minlength=10) for p in parts])
    home = hist[np.arange(10) % 5, np.arange(10)] / 600
    assert np.all(np.abs(home - 0.6) < 0.08)
    others = np.delete(hist, [0], axis=0)[:, 0] / 600  # label 0's non-home clients share 0.4 evenly
    assert np.all(np.abs(others - 0.1) < 0.05)
    iid_like = np.stack([np.bincount(LABELS[p], minlength=10) for p in partition(LABELS, 5, "drag-q:0.2", seed=0)])
    assert np.all(np.abs(iid_like / 600 - 0.2) < 0.06)


def test_drag_fltrust_groups_when_clients_gt_classes():
    parts = partition(LABELS, 20, "drag-q:1", seed=0)
    for client, held in enumerate(_labels_per_client(parts)):
        assert held == {client % 10}
    sizes = np.array([len(p) for p in parts])
    assert np.all(np.abs(sizes - 300) < 60)  # label l split at random between clients l and l + 10
    mixed = partition(LABELS, 20, "drag-q:0.5", seed=0)
    hist = np.stack([np.bincount(LABELS[p], minlength=10) for p in mixed])
    group_home = (hist[:10] + hist[10:])[np.arange(10), np.arange(10)] / 600
    assert np.all(np.abs(group_home - 0.5) < 0.08)


@pytest.mark.parametrize("clients", [10, 20])  # class size 600 a multiple of the shard size
@pytest.mark.parametrize("k", [1, 2, 3])
def test_shards_at_most_k_classes(clients, k):
    parts = partition(LABELS, clients, f"shards:{k}", seed=0)
    assert all(len(held) <= k for held in _labels_per_client(parts))
    assert {len(p) for p in parts} == {len(LABELS) // clients}


def test_shards_mnist_scale_fedumf():
    labels = np.repeat(np.arange(10), 6000)
    parts = partition(labels, 100, "shards:2", seed=0)
    _check_cover(parts, len(labels))
    assert all(len(p) == 600 for p in parts)
    assert max(len(h) for h in _labels_per_client(parts, labels)) == 2


@pytest.mark.parametrize(("clients", "groups"), [(20, (7, 7, 6)), (12, (4, 4, 4)), (10, (4, 3, 3))])
def test_taco_groups_label_diversity(clients, groups):
    for seed in range(3):
        parts = partition(LABELS, clients, "taco-groups", seed=seed)
        diversity = [len(h) for h in _labels_per_client(parts)]
        assert (diversity.count(1), diversity.count(2), diversity.count(5)) == groups
        assert set().union(*_labels_per_client(parts)) == set(range(10))
        for label in range(10):  # each label split evenly among its holders
            counts = [c for c in (np.count_nonzero(LABELS[p] == label) for p in parts) if c]
            assert max(counts) - min(counts) <= 1


def test_taco_groups_too_few_clients():
    with pytest.raises(ValueError, match="cover"):
        partition(LABELS, 2, "taco-groups", seed=0)


def test_fedveca_case1_iid():
    parts = partition(LABELS, 5, "fedveca-case:1", seed=0)
    hist = np.stack([np.bincount(LABELS[p], minlength=10) for p in parts]) / 600
    assert np.all(np.abs(hist - 0.2) < 0.07)
    assert len({len(p) for p in parts}) > 1  # uniformly random client per sample, not an equal split


def test_fedveca_case2():
    parts = partition(LABELS, 5, "fedveca-case:2", seed=0)
    assert _labels_per_client(parts) == [{0, 5}, {1, 6}, {2, 7}, {3, 8}, {4, 9}]
    parts = partition(LABELS, 10, "fedveca-case:2", seed=0)
    assert _labels_per_client(parts) == [{i} for i in range(10)]
    parts = partition(LABELS, 20, "fedveca-case:2", seed=0)
    assert _labels_per_client(parts) == [{i % 10} for i in range(20)]
    assert {len(p) for p in parts} == {300}


def test_fedveca_case3():
    parts = partition(LABELS, 5, "fedveca-case:3", seed=0)
    held = _labels_per_client(parts)
    assert held[:3] == [{0, 1, 2, 3, 4}] * 3
    assert held[3:] == [{5, 7, 9}, {6, 8}]
    hist = np.stack([np.bincount(LABELS[p], minlength=10) for p in parts[:3]]) / 600
    assert np.all(np.abs(hist[:, :5] - 1 / 3) < 0.08)
    parts = partition(LABELS, 8, "fedveca-case:3", seed=0)
    held = _labels_per_client(parts)
    assert all(h == {0, 1, 2, 3, 4} for h in held[:4])
    assert held[4:] == [{5, 9}, {6}, {7}, {8}]
    with pytest.raises(ValueError, match="2 clients"):
        partition(LABELS, 1, "fedveca-case:3", seed=0)


@pytest.mark.parametrize(("clients", "sigma"), [(10, 0.3), (50, 1.0)])
def test_unbalanced_sizes(clients, sigma):
    parts = partition(LABELS, clients, f"unbalanced:{sigma}", seed=0, min_size=20)
    sizes = np.array([len(p) for p in parts])
    assert sizes.sum() == len(LABELS) and sizes.min() >= 20 and len(set(sizes.tolist())) > 1
    assert np.std(np.log(sizes)) == pytest.approx(sigma, rel=0.5)
    big = max(parts, key=len)
    assert len(np.unique(LABELS[big])) == 10  # labels are IID


def test_unbalanced_min_size_unreachable():
    with pytest.raises(ValueError, match="min"):
        partition(LABELS, 10, "unbalanced:0.3", seed=0, min_size=700)
    with pytest.raises(ValueError, match="SIGMA"):
        partition(LABELS, 100, "unbalanced:5", seed=0, min_size=50)


def test_empty_client_rejected():
    with pytest.raises(ValueError, match="no sample"):
        partition(np.repeat(np.arange(2), 2), 4, "drag-q:1", seed=0)  # 2 labels, 4 clients, 4 samples: some empty


FORMS = r"'taco-groups', 'fedveca-case:N'.*'drag-q:Q'.*'shards:K'.*'unbalanced:SIGMA'.*'iid' or 'dirichlet:PHI'"


@pytest.mark.parametrize(
    "scheme",
    [
        "random",
        "",
        "taco",
        "taco-groups:3",
        "fedveca-case",
        "fedveca-case:",
        "fedveca-case:x",
        "fedveca-case:1.5",
        "drag-q",
        "drag-q:abc",
        "shards",
        "shards:two",
        "unbalanced",
        "unbalanced:x",
        "iid:1",
        "dirichlet:0.5:balance",
        "dirichlet:0.5:balanced:1",
    ],
)
def test_bad_scheme_names_valid_forms(scheme):
    with pytest.raises(ValueError, match=r"unknown partition .*" + FORMS):
        partition(LABELS, 2, scheme, seed=0)


@pytest.mark.parametrize(
    ("scheme", "what"),
    [
        ("fedveca-case:0", "N must be 1, 2 or 3"),
        ("fedveca-case:4", "N must be 1, 2 or 3"),
        ("drag-q:1.5", "Q must be a probability"),
        ("drag-q:-0.1", "Q must be a probability"),
        ("drag-q:nan", "Q must be a probability"),
        ("shards:0", "K must be a positive integer"),
        ("unbalanced:0", "SIGMA must be a positive"),
        ("unbalanced:inf", "SIGMA must be a positive"),
    ],
)
def test_bad_parameter_names_valid_forms(scheme, what):
    with pytest.raises(ValueError, match=what + r".*valid forms: " + FORMS):
        partition(LABELS, 2, scheme, seed=0)


def test_too_many_shards():
    with pytest.raises(ValueError, match="shards"):
        partition(np.arange(10), 4, "shards:3", seed=0)


def test_natural_keeps_groups_whole():
    groups = np.repeat(np.arange(12), np.arange(1, 13))  # 12 speakers of different sizes
    parts = partition(np.zeros(len(groups), np.int64), 5, "natural", seed=0, groups=groups)
    _check_cover(parts, len(groups))
    owners = [{int(g) for g in groups[p]} for p in parts]
    assert sum(len(o) for o in owners) == 12  # no speaker is split between clients
    assert sorted(len(o) for o in owners) == [2, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="13 clients"):
        partition(np.zeros(len(groups), np.int64), 13, "natural", seed=0, groups=groups)


def test_natural_without_groups_names_the_data_set():
    with pytest.raises(ValueError, match=r"natural.*mnist has no groups.*shakespeare"):
        partition(np.zeros(100, np.int64), 2, "natural", seed=0, dataset="mnist")
