import numpy as np
import pytest
import torch

from edge_client.learning.flat import FlatModel
from edge_client.learning.models import (
    MLP,
    MODELS,
    CharLSTM,
    FedVecaCNN,
    SquaredSVM,
    TacoCNN,
    build_model,
    get_flat,
    num_params,
    set_flat,
)
from server.datasets import ArrayDataset
from server.evaluation import Evaluator


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
    assert set(MODELS) == {"cnn", "mlp", "fedveca-cnn", "svm", "char-lstm"}
    assert isinstance(build_model({"name": "cnn", "in_channels": 1, "num_classes": 10, "image_size": 28}), TacoCNN)
    mlp = build_model({"name": "mlp", "in_features": 64, "num_classes": 10, "hidden": [32, 16, 8]})
    assert mlp(torch.zeros(2, 64)).shape == (2, 10)


def test_input_standardisation_per_value_and_per_channel():
    base = {"name": "cnn", "in_channels": 3, "num_classes": 10, "image_size": 16}
    torch.manual_seed(0)
    plain = build_model(base)
    x = torch.rand(4, 3, 16, 16)
    mean, std = torch.tensor([0.5, 0.4, 0.3]), torch.tensor([0.2, 0.25, 0.3])
    for m, s in ((0.3, 0.2), (mean, std)):
        torch.manual_seed(0)
        spec = {**base, "input_mean": m.tolist() if torch.is_tensor(m) else m}
        spec["input_std"] = s.tolist() if torch.is_tensor(s) else s
        model = build_model(spec)
        shape = (1, 3, 1, 1) if torch.is_tensor(m) else ()
        expected = plain((x - torch.as_tensor(m).reshape(shape)) / torch.as_tensor(s).reshape(shape))
        assert torch.allclose(model(x), expected, atol=1e-6)
        assert not torch.allclose(model(x), plain(x), atol=1e-3)  # it really changes the input
        assert num_params(model) == num_params(plain)  # no trainable parameters added


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"name": "cnn", "input_std": 0.0}, ["input_std", "> 0"]),
        ({"name": "cnn", "input_mean": "x"}, ["input_mean"]),
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


def test_fedveca_cnn_layers():
    """ALGORITHMS.md 4.4: 'same' 5x5x32 convs, FC 1568 -> 256 -> classes for 28x28; FC input follows the image."""
    model = FedVecaCNN(1, 10, 28)
    assert [m.out_channels for m in model.features if isinstance(m, torch.nn.Conv2d)] == [32, 32]
    assert model.classifier[0].in_features == 1568 and model.classifier[0].out_features == 256
    assert FedVecaCNN(3, 10, 32).classifier[0].in_features == 32 * 8 * 8
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_svm_loss_matches_hand_computation():
    scores = torch.tensor([[2.0], [0.5], [-0.5], [0.2]])
    labels = torch.tensor([0, 0, 1, 1])  # targets +1, +1, -1, -1
    # max(0, 1 - t f)^2: 0, 0.25, 0.25, 1.44
    assert float(SquaredSVM.loss(scores, labels)) == pytest.approx((0 + 0.25 + 0.25 + 1.44) / 4)


def test_evaluator_uses_the_svm_rules():
    """Accuracy by the sign rule (argmax of one column would call everything 0) and the squared-hinge loss."""
    torch.manual_seed(0)
    x = torch.randn(8, 3).numpy()
    y = np.array([0, 1, 1, 0, 1, 0, 0, 1])
    spec = {"name": "svm", "in_features": 3}
    weights = np.array([1.0, -1.0, 0.5, 0.1], np.float32)  # w, then b
    scores = x @ weights[:3] + weights[3]
    predicted = (scores < 0).astype(int)
    hinge = np.maximum(0, 1 - (1 - 2 * y) * scores) ** 2
    result = Evaluator(spec, ArrayDataset(x, y), batch_size=3)(weights)
    accuracy, loss = result["accuracy"], result["loss"]
    assert accuracy == pytest.approx(np.mean(predicted == y))
    assert accuracy != pytest.approx(np.mean(y == 0))
    assert loss == pytest.approx(hinge.mean(), rel=1e-5)


def test_char_lstm_shape():
    model = CharLSTM()
    assert (model.embed.embedding_dim, model.lstm.hidden_size, model.lstm.num_layers) == (8, 256, 2)
    assert model(torch.randint(0, 80, (3, 12)).float()).shape == (3, 80)


def _fixed() -> torch.Generator:
    """Inputs drawn at collection time must not depend on which tests ran before."""
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize(
    ("spec", "x", "y", "lr"),
    [
        (
            {"name": "fedveca-cnn", "in_channels": 1, "num_classes": 2, "image_size": 12},
            torch.rand(8, 1, 12, 12, generator=_fixed()) + (torch.arange(8) % 2).float()[:, None, None, None],
            torch.arange(8) % 2,
            0.02,  # 0.1 overshoots on some draws of the inputs
        ),
        ({"name": "svm", "in_features": 20}, torch.randn(32, 20, generator=_fixed()), (torch.arange(32) % 2), 0.1),
        (
            {"name": "char-lstm", "hidden_size": 32},
            torch.arange(16 * 20).reshape(16, 20).float() % 80,
            torch.arange(16) % 80,
            1.0,
        ),
        (
            {"name": "mlp", "in_features": 108, "num_classes": 2, "hidden": [32, 16, 8]},
            torch.randn(32, 108, generator=_fixed()),
            (torch.arange(32) % 2),
            0.5,
        ),
    ],
)
def test_new_models_train(spec, x, y, lr):
    """A few SGD steps on one batch lower the model's own loss (FlatModel picks the SVM's squared hinge)."""
    torch.manual_seed(0)
    flat = FlatModel(build_model(spec))
    first = float(flat.loss_and_grad(x, y))
    for _ in range(30):
        flat.loss_and_grad(x, y)
        flat.params.add_(flat.grad, alpha=-lr)
    assert float(flat.loss_and_grad(x, y)) < 0.9 * first
