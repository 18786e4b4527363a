import numpy as np
import pytest
import torch

from edge_client.models import MLP, MODELS, TacoCNN, build_model, get_flat, num_params, set_flat


@pytest.mark.parametrize(("channels", "size"), [(1, 28), (3, 32), (1, 16)])
def test_cnn_output_shape(channels, size):
    model = TacoCNN(channels, 7, size)
    assert model(torch.zeros(5, channels, size, size)).shape == (5, 7)


def test_cnn_flat_features_match_niid_bench():
    assert TacoCNN(1, 10, 28).classifier[0].in_features == 16 * 4 * 4
    assert TacoCNN(3, 10, 32).classifier[0].in_features == 16 * 5 * 5


def test_mlp_flattens_and_shapes():
    model = MLP(64, 10, hidden=(32, 16, 8))
    assert model(torch.zeros(4, 64)).shape == (4, 10)
    assert MLP(4, 3)(torch.zeros(2, 1, 2, 2)).shape == (2, 3)
    assert len([m for m in model.modules() if isinstance(m, torch.nn.Linear)]) == 4


def test_num_params_taco_cnn_hand_count():
    expected = 6 * 1 * 25 + 6 + 16 * 6 * 25 + 16 + 256 * 120 + 120 + 120 * 84 + 84 + 84 * 10 + 10
    assert num_params(TacoCNN(1, 10, 28)) == expected


def test_num_params_ignores_frozen():
    model = MLP(4, 2, hidden=(3,))
    model.net[1].weight.requires_grad_(False)
    assert num_params(model) == 3 + 3 * 2 + 2
    assert get_flat(model).shape == (num_params(model),)


def test_build_model():
    assert set(MODELS) == {"cnn", "mlp"}
    assert isinstance(build_model({"name": "cnn", "in_channels": 1, "num_classes": 10, "image_size": 28}), TacoCNN)
    mlp = build_model({"name": "mlp", "in_features": 64, "num_classes": 10, "hidden": [32, 16, 8]})
    assert mlp(torch.zeros(2, 64)).shape == (2, 10)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"name": "resnet"}, ["'name'", "cnn", "mlp"]),
        ({"num_classes": 10}, ["'name'", "cnn", "mlp"]),
        ({"name": "cnn", "channels": 1}, ["channels", "in_channels", "image_size"]),
        ({"name": "mlp", "num_classes": 10}, ["in_features"]),
        ({"name": "cnn", "num_classes": "ten"}, ["num_classes"]),
        ({"name": "mlp", "in_features": 4, "num_classes": 2, "hidden": [0]}, ["hidden"]),
        ({"name": "cnn", "image_size": 8}, ["image_size", "mlp"]),
    ],
)
def test_build_model_errors_name_the_key(spec, words):
    with pytest.raises(ValueError) as info:
        build_model(spec)
    for word in words:
        assert word in str(info.value)


def test_deterministic_init():
    torch.manual_seed(3)
    a = get_flat(TacoCNN())
    torch.manual_seed(3)
    b = get_flat(TacoCNN())
    np.testing.assert_array_equal(a, b)


def test_flat_round_trip_changes_outputs():
    torch.manual_seed(0)
    model = TacoCNN()
    x = torch.randn(3, 1, 28, 28)
    before = model(x).detach().clone()
    flat = get_flat(model)
    assert flat.dtype == np.float32 and flat.shape == (num_params(model),)
    flat[0] = 123.0  # a copy: the model must not change
    assert get_flat(model)[0] != 123.0

    new = np.random.default_rng(0).normal(size=flat.size).astype(np.float32)
    set_flat(model, new)
    np.testing.assert_array_equal(get_flat(model), new)
    assert not torch.allclose(model(x), before)
    np.testing.assert_array_equal(get_flat(model)[: 6 * 25], model.features[0].weight.detach().numpy().ravel())


def test_set_flat_wrong_length():
    model = MLP(4, 2)
    with pytest.raises(ValueError, match=rf"expected {num_params(model)}.*got"):
        set_flat(model, np.zeros(num_params(model) - 1, np.float32))
