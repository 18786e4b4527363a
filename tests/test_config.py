"""Run configuration: defaults, TOML files, command-line overrides, and errors that name the key and the fix."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from server.config import INF_OFF, ConfigError, RunConfig, float_keys, from_dict, load_config, override


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_defaults_load_and_validate() -> None:
    config = load_config(None)
    assert config == RunConfig()
    for section in ("run", "clients", "data", "train", "broker"):
        for f in dataclasses.fields(getattr(config, section)):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            assert getattr(getattr(config, section), f.name) == default, f"{section}.{f.name}"
    assert config.train.algorithm == "fedavg"
    assert config.broker.url == ""  # edgefl starts its own broker
    assert config.model == {} and config.algorithm == {}
    assert config.min_clients == config.clients.count


def test_toml_file_round_trip(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[run]
rounds = 7
target_accuracy = 0.9
stop_at_target = true
seed = 3
out = "runs/x"
job = "exp1"

[clients]
count = 4
min_clients = 2
fraction = 0.5
round_deadline_s = 12.5

[data]
dataset = "digits"
partition = "dirichlet:0.3"

[model]
name = "mlp"
in_features = 64
num_classes = 10
hidden = [32, 16]

[train]
local_steps = 11
batch_size = 16
lr = 0.05

[broker]
url = "mqtt://127.0.0.1:1883"
devices = ["pi-1", "pi-2"]
""",
    )
    config = load_config(path)
    assert (config.run.rounds, config.run.target_accuracy, config.run.stop_at_target) == (7, 0.9, True)
    assert (config.run.seed, config.run.out, config.run.job) == (3, "runs/x", "exp1")
    assert (config.clients.count, config.clients.min_clients, config.clients.fraction) == (4, 2, 0.5)
    assert config.clients.round_deadline_s == 12.5
    assert config.min_clients == 2
    assert (config.data.dataset, config.data.partition) == ("digits", "dirichlet:0.3")
    assert config.model == {"name": "mlp", "in_features": 64, "num_classes": 10, "hidden": [32, 16]}
    assert (config.train.local_steps, config.train.batch_size, config.train.lr) == (11, 16, 0.05)
    assert config.broker.url == "mqtt://127.0.0.1:1883"
    assert config.broker.devices == ["pi-1", "pi-2"]
    # keys not in the file keep their defaults
    assert config.clients.register_timeout_s == RunConfig().clients.register_timeout_s
    assert config.train.algorithm == "fedavg"


def test_unknown_section_names_it_and_lists_valid_sections(tmp_path: Path) -> None:
    path = write(tmp_path, "[trainn]\nlr = 0.1\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    msg = str(exc.value)
    assert str(path) in msg
    assert "[trainn]" in msg
    for section in ("run", "clients", "data", "model", "train", "algorithm", "broker"):
        assert section in msg


def test_unknown_key_names_it_and_lists_valid_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "[train]\nlearning_rate = 0.1\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    msg = str(exc.value)
    assert "train.learning_rate" in msg
    for key in ("algorithm", "batch_size", "local_steps", "lr"):
        assert key in msg.split("valid keys")[1]


@pytest.mark.parametrize(
    ("section", "key", "value", "type_name"),
    [
        ("train", "lr", "0.1", "float"),  # a string where a float belongs
        ("run", "rounds", True, "int"),  # a bool is not an int, although Python says it is
        ("run", "stop_at_target", 1, "bool"),
        ("data", "dataset", 5, "str"),
        ("clients", "fraction", True, "float"),
    ],
)
def test_wrong_type_names_key_and_expected_type(section: str, key: str, value: object, type_name: str) -> None:
    with pytest.raises(ConfigError) as exc:
        from_dict({section: {key: value}})
    msg = str(exc.value)
    assert f"{section}.{key}" in msg
    assert f"type {type_name}" in msg
    assert repr(value) in msg


def test_wrong_type_in_file_names_the_file_and_key(tmp_path: Path) -> None:
    path = write(tmp_path, '[train]\nlr = "fast"\n')
    with pytest.raises(ConfigError, match=r"train\.lr must be of type float") as exc:
        load_config(path)
    assert str(path) in str(exc.value)


def test_devices_must_be_a_list_of_strings() -> None:
    with pytest.raises(ConfigError, match=r"broker\.devices must be a list of strings"):
        from_dict({"broker": {"devices": ["pi-1", 2]}})


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("run", "rounds", 0, ">= 1"),
        ("clients", "fraction", 1.5, "(0, 1]"),
        ("clients", "fraction", 0.0, "(0, 1]"),
        ("train", "lr", -1.0, "> 0"),
        ("run", "target_accuracy", 1.2, "(0, 1]"),
        ("clients", "min_clients", -1, ">= 0"),
        ("train", "local_steps", 0, ">= 1"),
        ("train", "momentum", 1.0, "[0, 1)"),  # FedUmf's optimiser is every algorithm's now
        ("broker", "chunk_size", 100, ">= 1024"),
        ("broker", "max_packet_size", 100, ">= 4096"),
        ("eval", "holdout", 1.0, "[0, 1)"),
        ("eval", "every", 0, ">= 1"),
    ],
)
def test_out_of_range_names_key_range_and_value(section: str, key: str, value: object, expected: str) -> None:
    with pytest.raises(ConfigError) as exc:
        from_dict({section: {key: value}})
    msg = str(exc.value)
    assert msg.startswith(f"{section}.{key} must be")
    assert expected in msg
    assert repr(value) in msg


def test_int_lr_minus_one_is_out_of_range_not_a_type_error() -> None:
    # -1 is an int: accepted as the float -1.0, then refused by the range check
    with pytest.raises(ConfigError, match=r"train\.lr must be a number > 0; got -1\.0"):
        from_dict({"train": {"lr": -1}})


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[run\nrounds = 3\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    msg = str(exc.value)
    assert str(path) in msg and "not valid TOML" in msg


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert str(path) in str(exc.value) and "does not exist" in str(exc.value)


def test_int_is_accepted_for_a_float_key(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[train]\nlr = 1\n[clients]\nround_deadline_s = 30\n"))
    assert config.train.lr == 1.0 and type(config.train.lr) is float
    assert config.clients.round_deadline_s == 30.0 and type(config.clients.round_deadline_s) is float


def test_override_applies_section_key_flags_and_skips_none(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[train]\nlr = 0.2\nlocal_steps = 9\n"))
    out = override(config, train__lr=0.01, run__rounds=3, clients__count=None, data__dataset="digits", train__lr_x=None)
    assert out.train.lr == 0.01  # the flag wins over the file
    assert out.train.local_steps == 9  # the file wins over the default
    assert out.run.rounds == 3
    assert out.clients.count == RunConfig().clients.count  # None: not given
    assert out.data.dataset == "digits"


def test_override_validates_names_and_ranges() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'train\.nope'"):
        override(RunConfig(), train__nope=1)
    with pytest.raises(ConfigError, match=r"run\.rounds must be an integer >= 1; got 0"):
        override(RunConfig(), run__rounds=0)
    with pytest.raises(ConfigError, match=r"train\.lr must be of type float"):
        override(RunConfig(), train__lr="x")


def test_algorithm_params_reach_run_config(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[train]\nalgorithm = "fedavg"\n[algorithm.fedavg]\nweighting = "samples"\n[algorithm.fedprox]\nzeta = 0.01\n',
    )
    config = load_config(path)
    assert config.algorithm_params() == {"weighting": "samples"}
    config.train.algorithm = "fedprox"
    assert config.algorithm_params() == {"zeta": 0.01}
    config.train.algorithm = "fedumf"  # no table of its own
    assert config.algorithm_params() == {}


def test_algorithm_params_returns_a_copy() -> None:
    config = from_dict({"algorithm": {"fedavg": {"weighting": "samples"}}})
    config.algorithm_params()["weighting"] = "uniform"
    assert config.algorithm_params() == {"weighting": "samples"}


def test_algorithm_section_must_hold_tables() -> None:
    with pytest.raises(ConfigError, match=r"\[algorithm\.fedavg\] must be a table"):
        from_dict({"algorithm": {"fedavg": 3}})


def test_min_clients_zero_means_clients_count() -> None:
    assert from_dict({"clients": {"count": 6}}).min_clients == 6
    assert from_dict({"clients": {"count": 6, "min_clients": 0}}).min_clients == 6
    assert from_dict({"clients": {"count": 6, "min_clients": 4}}).min_clients == 4


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"clients": {"deadline_factor": -1.0}}, "clients.deadline_factor must be a number >= 0"),
        ({"clients": {"deadline_factor": 2.0, "deadline_floor_s": 200.0}}, r"clients.deadline_floor_s must be .*<= "),
        ({"clients": {"deadline_margin_s": -1.0}}, "clients.deadline_margin_s must be seconds >= 0"),
        ({"train": {"max_update_norm": 0.0}}, r"train.max_update_norm must be a number > 0 \(inf disables"),
        ({"train": {"store_ram_mb": -1}}, r"train.store_ram_mb must be MiB >= 0 \(0: every stored update"),
    ],
)
def test_fault_settings_are_validated_with_the_key_and_the_fix(values: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_dict(values)


def test_a_floor_above_the_fixed_deadline_is_fine_without_a_derived_deadline() -> None:
    config = from_dict({"clients": {"round_deadline_s": 4.0}})  # the floor (10 s) only bounds derived deadlines
    assert config.clients.deadline_factor == 0.0 and config.train.max_update_norm == 1e4


FLOAT_KEYS = [key for key, _, _ in float_keys(RunConfig())]  # derived: a float key added later is covered too


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_key_refuses_non_finite_values_naming_the_key(tmp_path: Path, key: str, value: float) -> None:
    """From a TOML file as a user writes it: ``inf`` is refused at load, naming the key, unless the key's field says
    what ``inf`` means (then it is accepted); ``nan`` and ``-inf`` never are."""
    section, name = key.split(".")
    path = tmp_path / "run.toml"
    path.write_text(f"[{section}]\n{name} = {value}\n")  # TOML's inf, -inf, nan
    inf_off = {k: f.metadata.get(INF_OFF) for k, _, f in float_keys(RunConfig())}[key]
    if inf_off and value == math.inf:
        assert getattr(getattr(load_config(path), section), name) == math.inf
        return
    with pytest.raises(ConfigError, match=rf"{key} must be a finite number.*got {value!r}: set a finite number"):
        load_config(path)


def test_the_issues_infinite_settings_are_refused_at_load() -> None:
    for key in ("train.lr", "train.weight_decay", "eval.deadline_s", "train.round_budget_s"):
        section, name = key.split(".")
        with pytest.raises(ConfigError, match=rf"^{key} must be a finite number; got inf"):
            from_dict({section: {name: math.inf}})
    assert {"train.max_update_norm", "train.max_norm_ratio"} <= {
        k for k, _, f in float_keys(RunConfig()) if f.metadata.get(INF_OFF)
    }


@pytest.mark.parametrize(
    ("key", "value"), [("threads", 2), ("freeloaders", 0.2), ("attackers", 0.3), ("attack_sigma", 2.0)]
)
def test_simulation_keys_moved_from_clients_still_load_with_a_warning_naming_the_new_key(
    tmp_path: Path, key: str, value: object
) -> None:
    """One release reads them where they were: the warning says the new key and where to move it."""
    path = write(tmp_path, f"[clients]\ncount = 4\n{key} = {value}\n")
    with pytest.warns(FutureWarning, match=rf"clients\.{key} is now simulation\.{key}: move it to \[simulation\]"):
        config = load_config(path)
    assert getattr(config.simulation, key) == value and config.clients.count == 4
    assert config == from_dict({"clients": {"count": 4}, "simulation": {key: value}})  # the same run either way


def test_a_key_given_under_its_old_and_new_name_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"clients\.threads and simulation\.threads are both given.*keep only"):
        from_dict({"clients": {"threads": 2}, "simulation": {"threads": 3}})


def test_simulation_section_is_validated_naming_its_keys() -> None:
    with pytest.raises(ConfigError, match=r"simulation\.freeloaders must be a fraction in \[0, 1\]; got 1\.5"):
        from_dict({"simulation": {"freeloaders": 1.5}})
    with pytest.raises(ConfigError, match=r"simulation\.threads must be an integer >= 1"):
        override(RunConfig(), simulation__threads=0)
    with pytest.raises(ConfigError, match=r"unknown key 'simulation\.count'"):
        from_dict({"simulation": {"count": 3}})  # live keys stay in [clients]
