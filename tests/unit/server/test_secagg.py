"""Secure aggregation's protocol as a library, with hand-made keys and no broker: Shamir sharing, the masks
cancelling in the sum, a wrong share refused, dropouts recovered up to n - t and not beyond."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_client.secagg import crypto, shamir
from edge_client.secagg.device import DeviceRound, Keys, ProtocolBreach
from edge_client.secagg.graph import neighbours
from edge_client.secagg.ring import Ring, clip
from server.secagg.unmask import Ledger, Unrecoverable, rebuild, unmask

SIZE = 257


def test_share_and_rebuild() -> None:
    secret = bytes(range(32))
    shares = shamir.split(secret, 3, [1, 2, 3, 4, 5])
    assert shamir.combine({x: shares[x] for x in (1, 3, 5)}) == secret
    assert shamir.combine({x: shares[x] for x in (2, 4, 5)}) == secret
    two = {x: shares[x] for x in (1, 2)}  # below the threshold: some other value (or none of 32 bytes)
    with pytest.raises(ValueError):
        assert shamir.combine(two) != secret
        raise ValueError
    with pytest.raises(ValueError, match="threshold"):
        shamir.split(secret, 6, [1, 2, 3, 4, 5])


def test_a_wrong_share_is_refused_and_outvoted() -> None:
    secret = crypto.random_seed()
    commit = crypto.commitment(secret, b"ctx")
    shares = shamir.split(secret, 3, [1, 2, 3, 4])
    shares[2] = bytes(shamir.SHARE_BYTES - 1) + b"\x07"
    check = lambda s: crypto.commitment(s, b"ctx") == commit  # noqa: E731
    assert rebuild(shares, 3, check, "seed") == secret  # 3 right shares of 4: the wrong one is outvoted
    with pytest.raises(Unrecoverable, match="wrong shares"):
        rebuild({x: shares[x] for x in (1, 2, 3)}, 3, check, "seed")
    with pytest.raises(Unrecoverable, match="2 shares revealed, 3 needed"):
        rebuild({x: shares[x] for x in (1, 3)}, 3, check, "seed")


def test_a_tampered_or_misdirected_encrypted_share_does_not_decrypt() -> None:
    a, b, c = (DeviceRound(cid, "run", 1) for cid in "abc")
    roster = {d.client_id: d.keys() for d in (a, b, c)}
    for d in (a, b, c):
        d.roster = {k: v for k, v in roster.items() if k != d.client_id}
    _, sealed = a.share({k: v for k, v in roster.items() if k != "a"}, 2)
    tampered = bytearray(sealed["b"])
    tampered[-1] ^= 1
    with pytest.raises(crypto.ShareRejected):
        b.receive({"a": bytes(tampered)})
    with pytest.raises(crypto.ShareRejected):
        c.receive({"a": sealed["b"]})  # b's share, replayed to c
    b.receive({"a": sealed["b"]})
    assert set(b.held) == {"a"}


def run_round(
    n: int, threshold: int, degree: int = 0, drop_before: int = 0, drop_after: int = 0
) -> tuple[np.ndarray, np.ndarray, Ring]:
    """One secure round among ``n`` devices in memory: the unmasked sum, and the plain sum of the survivors'
    quantised inputs. ``drop_before``: devices gone after sharing keys; ``drop_after``: gone after masking."""
    rng = np.random.default_rng(n * 100 + threshold)
    ids = [f"d{i:02d}" for i in range(n)]
    ring = Ring(32, clip=1.0, devices=n)
    devices = {u: DeviceRound(u, "run", 3) for u in ids}
    graph = neighbours(ids, degree, seed=5)
    keys = {u: d.keys() for u, d in devices.items()}
    commits, outbox = {}, {}
    for u, d in devices.items():
        commits[u], outbox[u] = d.share({v: keys[v] for v in graph[u]}, threshold)
    relayed = {u: set(outbox[u]) for u in ids}
    for v, d in devices.items():
        d.receive({u: outbox[u][v] for u in ids if v in outbox[u]})
    masked_ids = ids[drop_before:]
    inputs = {u: ring.quantise(rng.normal(size=SIZE), 1.0 / n) for u in masked_ids}
    masked = {u: devices[u].masked(inputs[u], ring) for u in masked_ids}
    total = np.zeros(SIZE, np.uint32)
    for y in masked.values():
        total = ring.add(total, y)
    survivors, dropped = set(masked_ids), set(ids[:drop_before])
    reveals = {v: devices[v].reveal(sorted(survivors), sorted(dropped)) for v in masked_ids[drop_after:]}
    ledger = Ledger(devices[ids[0]].context, threshold, keys, graph, commits, relayed)
    plain = np.zeros(SIZE, np.uint32)
    for q in inputs.values():
        plain = ring.add(plain, q)
    return unmask(total, ring, ledger, survivors, dropped, reveals), plain, ring


def test_masks_cancel_and_each_input_looks_random() -> None:
    result, plain, ring = run_round(4, 3)
    np.testing.assert_array_equal(result, plain)
    a = DeviceRound("a", "run", 1)
    x = ring.quantise(np.linspace(-1, 1, 4096), 1.0)
    a.share({"b": DeviceRound("b", "run", 1).keys()}, 1)
    y = a.masked(x, ring).astype(np.float64)
    assert abs(np.corrcoef(y, x.astype(np.float64))[0, 1]) < 0.1  # with no mask this is 1


def test_sparse_graph_and_dropouts_before_and_after_masking() -> None:
    result, plain, _ = run_round(8, 2, degree=4, drop_before=1, drop_after=1)  # each keeps >= 2 of its 4
    np.testing.assert_array_equal(result, plain)


@pytest.mark.parametrize("n, t", [(4, 2), (5, 3)])
def test_dropouts_after_masking_up_to_n_minus_t(n: int, t: int) -> None:
    result, plain, _ = run_round(n, t, drop_after=n - t)
    np.testing.assert_array_equal(result, plain)
    with pytest.raises(Unrecoverable, match="needed"):
        run_round(n, t, drop_after=n - t + 1)


def test_a_device_never_reveals_both_secrets_nor_below_the_threshold() -> None:
    d = DeviceRound("a", "run", 1)
    d.share({"b": DeviceRound("b", "run", 1).keys(), "c": DeviceRound("c", "run", 1).keys()}, 2)
    with pytest.raises(ProtocolBreach, match="both"):
        d.reveal(["b", "c"], ["b"])
    with pytest.raises(ProtocolBreach, match="threshold"):
        d.reveal(["b"], ["c"])
    d.reveal(["a", "b"], ["c"])
    with pytest.raises(ProtocolBreach, match="second time"):
        d.reveal(["a", "b"], ["c"])


def test_the_ring_cannot_wrap_for_clipped_weighted_inputs() -> None:
    n = 50
    ring = Ring(32, clip=2.0, devices=n)
    worst = np.full(8, 2.0 / np.sqrt(8))  # every device at the clip norm, all coordinates alike
    total = np.zeros(8, np.uint32)
    for _ in range(n):
        total = ring.add(total, ring.quantise(worst * 10, 1.0 / n))  # clipped first
    np.testing.assert_allclose(ring.decode(total), worst, atol=n / ring.scale)
    np.testing.assert_allclose(np.linalg.norm(clip(worst * 10, 2.0)), 2.0)
    with pytest.raises(ValueError, match="bits"):
        Ring(40, 1.0, 10)


def test_the_neighbour_graph_is_symmetric_and_of_the_degree() -> None:
    ids = [f"d{i}" for i in range(20)]
    graph = neighbours(ids, 6, seed=1)
    assert all(len(vs) == 6 for vs in graph.values())
    assert all(u in graph[v] for u, vs in graph.items() for v in vs)
    assert neighbours(ids[:4], 6, seed=1)["d0"] == ["d1", "d2", "d3"]
    assert isinstance(Keys(b"", b""), Keys)


# ------------------------------------------------------------------------------------------------- the messages
def test_the_stages_messages_round_trip_and_their_bounds_are_checked() -> None:
    from edge_client.secagg.wire import SEALED_BYTES
    from edge_client.wire import messages as M
    from edge_client.wire.protocol import InvalidField, decode, encode

    a, b = DeviceRound("a", "run", 2), DeviceRound("b", "run", 2)
    roster = M.SecAggRoster(2, 2, [["b", b.keys().enc, b.keys().mask]], "run")
    assert decode(encode(roster)) == roster
    commit, sealed = a.share({"b": b.keys()}, 2)
    shares = M.SecAggShares(2, "a", commit, [[v, s] for v, s in sealed.items()], "run")
    assert decode(encode(shares)) == shares and len(sealed["b"]) == SEALED_BYTES
    masked = M.MaskedInput(2, 1, "a", 5, 0.1, 0.1, 0.3, np.arange(7, dtype="<u4").tobytes(), run_id="run")
    assert bytes(decode(encode(masked)).data) == np.arange(7, dtype="<u4").tobytes()
    terms = {"weight": 0.5, "clip": 1.0, "bits": 32, "devices": 4}
    secure = M.schema_of(M.RoundFacts).fields["secure"][1].check  # the round facts of an assignment
    assert secure.ok(terms) and secure.ok({})
    assert not any(secure.ok({**terms, k: v}) for k, v in [("weight", 1.5), ("bits", 64), ("clip", 0), ("x", 1)])
    for bad in (
        M.SecAggShares(2, "a", commit, [["b", sealed["b"][:-1]]], "run"),  # a sealed pair one byte short
        M.SecAggShares(2, "a", commit, [["b", sealed["b"]], ["b", sealed["b"]]], "run"),  # one holder twice
        M.SecAggKeys(2, "a", b"k" * 31, b"k" * 32, "run"),
        M.SecAggReveal(2, "a", [["b", 1, bytes(66)]], "run"),  # an int is not a bool
    ):
        with pytest.raises(InvalidField):
            encode(bad)


# ------------------------------------------------------------------------------------------- config and contracts
def test_secure_aggregation_is_refused_at_load_for_an_algorithm_that_needs_per_device_values() -> None:
    from edge_client.algorithms import CONTRACTS
    from edge_client.algorithms.contract import Array, Contract, secure_refusal
    from server.config import ConfigError, from_dict

    on = {"secure_aggregation": True, "clip_norm": 5.0}
    assert from_dict({"privacy": on}).privacy.secure_aggregation
    accepted = {n for n, c in CONTRACTS.items() if not secure_refusal(c)}
    assert accepted == {"fedavg", "fedprox", "fedacg", "fedumf", "fednova", "scaffold", "stem"}
    assert from_dict({"privacy": on, "train": {"algorithm": "scaffold"}}).train.algorithm == "scaffold"
    assert CONTRACTS["scaffold"].summed == (("delta", "weighted"), ("delta_c", "plain"))
    assert CONTRACTS["fednova"].summed == (("delta", "per_step"),)
    with pytest.raises(ValueError, match="how it is summed"):  # a sum the contract does not say how to take
        Contract("x", "an algorithm", returns=(Array("a", "an array"),), needs="sums")
    for algorithm, why in [("taco", "per-device values"), ("foolsgold", "per-device"), ("scaffold-taco", "alpha_i")]:
        with pytest.raises(ConfigError, match=f"privacy.secure_aggregation.*{algorithm}.*{why}.*use fedavg"):
            from_dict({"privacy": on, "train": {"algorithm": algorithm}})
    for key, value in [("clip_norm", 0.0), ("threshold", 2.5), ("neighbours", 3), ("quantisation_bits", 64)]:
        with pytest.raises(ConfigError, match=f"privacy.{key} must be"):
            from_dict({"privacy": {**on, key: value}})
    assert from_dict({"train": {"algorithm": "taco"}}).privacy.secure_aggregation is False  # off: no refusal


# ------------------------------------------------------------------------------------------------- whole rounds
def expected_sum(
    ring: Ring, summed: tuple[tuple[str, str], ...], vectors: dict[str, np.ndarray], terms: dict[str, Any], steps: int
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """By hand: what one device masks (its arrays clipped jointly unless DP's noise is in them, each times its weight,
    in the ring, one after the other) and each array weighted as a float."""
    x = np.concatenate([vectors[name].astype(np.float64) for name, _ in summed])
    x = x if ring.noise else clip(x, ring.clip)
    weights = [1 / terms["devices"] if how == "plain" else terms["weight"] / (steps if how == "per_step" else 1)
               for _, how in summed]  # fmt: skip
    pieces = [(part * w, name) for (name, _), part, w in zip(summed, np.split(x, len(summed)), weights, strict=True)]
    return np.concatenate([ring.encode(v) for v, _ in pieces]), {name: v for v, name in pieces}


def as_update(cid: str, vectors: dict[str, np.ndarray], steps: int, samples: int) -> Any:
    """An update carrying ``vectors`` (``delta`` and the contract's arrays) as float32."""
    from edgefl_testkit.messages import make_update

    arrays = {k: v.astype(np.float32) for k, v in vectors.items() if k != "delta"}
    return make_update(cid, vectors["delta"], num_samples=samples, local_steps=steps, arrays=arrays)


@pytest.mark.parametrize(
    "algorithm, dp", [("fedavg", False), ("fednova", False), ("fedavg", True), ("scaffold", False), ("stem", False)]
)
def test_in_process_the_unmasked_sum_is_the_sum_of_the_clipped_quantised_updates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithm: str, dp: bool
) -> None:
    """The real runtime and server over the in-process bus: each device's delta, arrays and steps as trained (recorded
    by its training function), its weight as assigned (``begin``'s terms) and the ring sum the server unmasked
    (recorded as ``unmask`` returns it). FedNova's devices divide by their own steps (unequal here: tau_i from their
    data size); with central DP the devices' noise shares are in their deltas (added in training, before masking);
    SCAFFOLD's and STEM's devices mask their delta_c or v beside the delta, clipped jointly (SCAFFOLD's clip binds:
    its devices adopt the clipped delta_c they masked, so c stays the mean of their c_i)."""
    import server.experiments.inprocess as inprocess
    import server.secagg.stages as stages
    from edge_client.algorithms import CONTRACTS
    from edge_client.loop.trainer import train_local
    from edgefl_testkit.federation import make_config
    from server.datasets import load_dataset
    from server.dp.mechanism import noise_share_std
    from server.experiments.simulate import client_ids, prepare_shards
    from server.strategies import ServerContext, TrainSettings, make_strategy

    trained: dict[int, dict[str, tuple[dict[str, np.ndarray], int, int]]] = {}  # vectors, steps, samples
    c_seen: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # SCAFFOLD in round 2: the c it was sent, its own c_i
    sums: list[np.ndarray] = []
    terms: list[dict[str, dict[str, Any]]] = []
    begin = stages.SecureRounds.begin

    def recording(role: str, cid: str):
        def train(*args):
            result = train_local(*args)
            vectors = {"delta": result.delta.copy(), **{k: v.copy() for k, v in result.arrays.items()}}
            trained.setdefault(args[6].round, {})[cid] = (vectors, result.local_steps, len(args[2]))
            if algorithm == "scaffold" and args[6].round == 2:  # c_i as committed after round 1
                c_seen[cid] = (args[4].arrays["c"].copy(), args[5].c_i.copy())
            return result

        return train

    def unmasked(*args, **kwargs):
        sums.append(unmask(*args, **kwargs))
        return sums[-1]

    def begun(self, *args):
        terms.append(begin(self, *args))
        return terms[-1]

    monkeypatch.setattr(inprocess, "behaviour", recording)
    monkeypatch.setattr(stages, "unmask", unmasked)
    monkeypatch.setattr(stages.SecureRounds, "begin", begun)
    clip_norm = 0.1 if algorithm == "scaffold" else 2.0
    privacy = {"secure_aggregation": True, "clip_norm": clip_norm, "threshold": 2}
    if dp:  # central DP with its noise added by the devices in shares (docs/privacy.md): in the deltas recorded
        privacy |= {"mode": "central", "noise_multiplier": 0.5}
    train = {"local_steps": 5, "algorithm": algorithm}
    params = {"epochs": 0.178} if algorithm == "fednova" else {}  # tau_i = floor(0.178 D_i / 32): 2 or 1
    config = make_config(tmp_path, "secagg-inproc", 4, 2, train=train, algorithm_params=params, privacy=privacy)
    bundle = load_dataset("digits", seed=0)
    shards, _ = prepare_shards(bundle, client_ids(4), "iid", 0, tmp_path / "shards")  # 360, 359, 359, 359 samples
    summary = inprocess.run_inprocess(config, shards, bundle, tmp_path / "out")
    assert summary["secure_rounds"] == 2 and summary["dropped_rounds"] == []
    summed = CONTRACTS[algorithm].summed
    ring = Ring(32, clip_norm, 4, noise_share_std(0.5 * clip_norm, 4) if dp else 0.0)
    for round_, total in enumerate(sums, start=1):
        assert total.size == len(summed) * trained[round_]["client-00"][0]["delta"].size
        expected = np.zeros_like(total)
        plain = np.zeros(total.size)
        for cid, (vectors, steps, _) in trained[round_].items():
            q, weighted = expected_sum(ring, summed, vectors, terms[round_ - 1][cid], steps)
            expected = ring.add(expected, q)
            plain += np.concatenate(list(weighted.values()))
        np.testing.assert_array_equal(total, expected)  # exactly, in the ring
        np.testing.assert_allclose(ring.decode(total), plain, atol=3 / ring.scale)  # within the rounding
    if algorithm in ("fednova", "scaffold", "stem"):  # the server half's aggregate: from the secure means as from the
        # clipped updates
        names = [name for name, _ in summed]
        rows = terms[1].values()
        weight = {name: sum(1 / 4 if how == "plain" else t["weight"] for t in rows) for name, how in summed}
        parts = zip(names, np.split(ring.decode(sums[1]), len(names)), strict=True)
        means = {name: part / weight[name] for name, part in parts}  # all four survived
        plain, secure = [], []
        for cid, (vectors, s, n) in trained[2].items():
            x = clip(np.concatenate([vectors[name].astype(np.float64) for name in names]), clip_norm)
            plain.append(as_update(cid, dict(zip(names, np.split(x, len(names)), strict=True)), s, n))
            per_step = s if dict(summed)["delta"] == "per_step" else 1
            secure.append(as_update(cid, {**means, "delta": means["delta"] * per_step}, s, n))
        if algorithm == "fednova":
            assert sorted(u.local_steps for u in plain) == [1, 1, 1, 2]
        size = means["delta"].size
        halves = [make_strategy(algorithm, TrainSettings(5, 0.1, 32), params) for _ in range(2)]
        steps = []
        for strategy, updates in zip(halves, (plain, secure), strict=True):
            strategy.setup(ServerContext(model_spec={}, num_params=size))
            steps.append(strategy.aggregate(2, np.zeros(size, np.float32), updates))
        np.testing.assert_allclose(steps[1], steps[0], rtol=1e-5, atol=1e-6)
        if algorithm == "scaffold":
            np.testing.assert_allclose(halves[1].c, halves[0].c, rtol=1e-5, atol=1e-6)
    if algorithm == "scaffold":  # the clip bound, and each device adopted what it masked: c is the mean of the c_i
        joint = [np.linalg.norm(np.concatenate([v["delta"], v["delta_c"]])) for v, _, _ in trained[1].values()]
        assert max(joint) > 2 * clip_norm
        c = next(iter(c_seen.values()))[0]
        np.testing.assert_allclose(np.mean([c_i for _, c_i in c_seen.values()], axis=0), c, atol=1e-6)


def test_stage_messages_that_do_not_fit_their_stage_are_refused_by_reason() -> None:
    from edge_client.algorithms.scaffold import CONTRACT as SCAFFOLD
    from edge_client.wire import messages as M
    from edge_client.wire.plan import Plan
    from edge_client.wire.protocol import DuplicateMessage, InvalidField, OutOfRound
    from edge_client.wire.topics import Topics
    from server.config import PrivacySection
    from server.secagg import StageRefused
    from server.secagg.stages import SecureRounds

    class Link:  # what the stages use of a link: publish, and the bytes that came in
        def publish(self, topic: str, payload: bytes, **_: Any) -> int:
            return len(payload)

        def take_bytes_in(self, topic: str) -> int:
            return 0

    rounds = SecureRounds(PrivacySection(True, 2, 0, 1.0), Link(), Topics("t"), 4, lambda cid: None, SCAFFOLD)  # type: ignore[arg-type]
    plans = {c: Plan(1, 0.1, 8) for c in "abc"}
    terms = rounds.begin(1, "run", 0, {"a": 10, "b": 10, "c": 20}, "samples", 1.0, plans)
    assert [terms[c]["weight"] for c in "abc"] == [0.25, 0.25, 0.5]
    devices = {c: DeviceRound(c, "run", 1) for c in "abc"}
    keys = {c: d.keys() for c, d in devices.items()}
    for c in "ab":
        rounds.take(c, M.SecAggKeys(1, c, keys[c].enc, keys[c].mask, "run"))
    for sender, msg, refused in [
        ("a", M.SecAggKeys(1, "a", keys["a"].enc, keys["a"].mask, "run"), DuplicateMessage),
        ("c", M.SecAggKeys(1, "c", keys["b"].enc, keys["c"].mask, "run"), StageRefused),  # b's key again
        ("c", M.SecAggKeys(2, "c", keys["c"].enc, keys["c"].mask, "run"), OutOfRound),  # another round
        ("c", M.SecAggKeys(1, "a", keys["c"].enc, keys["c"].mask, "run"), InvalidField),  # another id
        ("c", M.SecAggShares(1, "c", "0" * 64, [], "run"), OutOfRound),  # the keys stage is on
    ]:
        with pytest.raises(refused):
            rounds.take(sender, msg)
    rounds.take("c", M.SecAggKeys(1, "c", keys["c"].enc, keys["c"].mask, "run"))
    r = rounds.current
    assert r is not None
    rounds._send_rosters(r)
    r.stage = "shares"
    commit, sealed = devices["a"].share({v: keys[v] for v in r.graph["a"]}, r.threshold)
    with pytest.raises(StageRefused, match="neighbours"):
        rounds.take("a", M.SecAggShares(1, "a", commit, [["b", sealed["b"]]], "run"))  # c's share missing
    rounds.take("a", M.SecAggShares(1, "a", commit, [[v, s] for v, s in sealed.items()], "run"))
    r.stage = "masked"
    with pytest.raises(StageRefused, match="12 bytes, expected 32"):  # SCAFFOLD: delta and delta_c, 4 parameters
        rounds.take("a", M.MaskedInput(1, 0, "a", 1, 0.0, 0.0, 0.0, bytes(12), run_id="run"))
    with pytest.raises(OutOfRound, match="sharing"):
        rounds.take("b", M.MaskedInput(1, 0, "b", 1, 0.0, 0.0, 0.0, bytes(32), run_id="run"))  # b never shared
    rounds.take("a", M.MaskedInput(1, 0, "a", 1, 0.0, 0.0, 0.0, bytes(32), run_id="run"))
    r.asked["a"], r.stage = ({"a"}, {"b"}), "unmask"
    with pytest.raises(StageRefused, match="not asked"):
        rounds.take("a", M.SecAggReveal(1, "a", [["c", True, bytes(66)]], "run"))


def test_a_plain_update_in_a_secure_run_is_refused_and_the_round_goes_on(tmp_path: Path) -> None:
    """A device answering a secure assignment with a plain update (bypassing the masking) beside two honest runtimes
    on the in-process bus: the update is refused (``secagg_message``), never folded, and each round aggregates the
    two honest devices securely."""
    from edge_client.learning.data import load_local_data
    from edge_client.loop.runtime import EdgeClient
    from edge_client.wire.protocol import encode
    from edge_client.wire.topics import Topics
    from edgefl_testkit.fakes import FakeDevice, device_topics, zero_update
    from server.assembly import make_orchestrator
    from server.config import from_dict
    from server.datasets import load_dataset
    from server.experiments.inprocess import NO_DEADLINE_S, LocalBus, LocalLink
    from server.experiments.simulate import client_ids, prepare_shards

    config = from_dict({
        "run": {"rounds": 2, "out": str(tmp_path), "job": "plain"},
        "clients": {"count": 3, "round_deadline_s": NO_DEADLINE_S, "register_timeout_s": 30.0},
        "data": {"dataset": "digits"},
        "train": {"algorithm": "fedavg", "local_steps": 2, "batch_size": 16},
        "model": {"name": "mlp", "in_features": 64, "num_classes": 10, "hidden": [8]},
        "privacy": {"secure_aggregation": True, "clip_norm": 2.0, "threshold": 2},
    })  # fmt: skip
    bundle = load_dataset("digits")
    shards, _ = prepare_shards(bundle, client_ids(2), "iid", 0, tmp_path / "shards")
    bus, topics = LocalBus(), Topics("plain")
    plain = FakeDevice(None, topics, "plain", 100, lambda a: [encode(zero_update(a, "plain", 100))])  # type: ignore[arg-type]
    plain.link = bus.connect(device_topics(topics, "plain"), plain.hello)
    bus.add_client(plain)
    for cid, shard in zip(client_ids(2), shards, strict=True):
        bus.add_client(EdgeClient(cid, load_local_data(shard), None, job="plain", link_factory=bus.connect))
    summary = make_orchestrator(
        config, bundle, tmp_path, link=LocalLink(bus, [topics.all_up], drives_clients=True)
    ).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(plain.assignments) == 2 and all(a.facts.secure for a in plain.assignments)
    assert summary["rejected"] == {"secagg_message": 2} and summary["secure_rounds"] == 2
    for row in rows:
        assert set(row["clients"]) == {"client-00", "client-01"} and row["secure"]["masked"] == 2
        assert row["failed"] == {"plain": "rejected: secagg_message"}
