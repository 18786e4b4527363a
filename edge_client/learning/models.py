"""Models trained on the device and helpers that move their weights as one flat float32 vector.

The wire format and every algorithm work on flat vectors of *trainable* parameters (ALGORITHMS.md C6), so the
flattening order (``model.parameters()``) is the single contract between client and server.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_client.learning.factories import FACTORY_KEY, SERVER, AllowedCode, build_with_factory

__all__ = [
    "MLP",
    "MODELS",
    "CharLSTM",
    "FedVecaCNN",
    "SquaredSVM",
    "TacoCNN",
    "build_model",
    "fingerprint",
    "get_flat",
    "layout_difference",
    "num_params",
    "parameter_layout",
    "set_flat",
]


class TacoCNN(nn.Module):
    """NIID-Bench SimpleCNN, the CNN of the TACO paper (two 5x5 convs, three FC layers, ReLU)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        # conv5 (-4) -> pool2 (//2) -> conv5 (-4) -> pool2 (//2): 28 -> 4, 32 -> 5; the smallest valid side is 16.
        side = ((image_size - 4) // 2 - 4) // 2
        if side < 1:
            raise ValueError(f"image_size={image_size} is too small for the 'cnn' model (needs >= 16); use 'mlp'")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(16 * side * side, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class MLP(nn.Module):
    """Fully connected network for tabular or small flattened inputs (e.g. digits 8x8, adult)."""

    def __init__(self, in_features: int, num_classes: int, hidden: Sequence[int] = (200, 200)) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, int(h)), nn.ReLU()]
            width = int(h)
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class FedVecaCNN(nn.Module):
    """FedVeca's CNN (ALGORITHMS.md 4.4): two 5x5 convs with 32 filters ('same' padding), each followed by a 2x2
    max-pool, then FC -> 256 -> classes, ReLU; 1568 = 32 * 7 * 7 inputs to the first FC layer for 28x28 images."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        side = image_size // 2 // 2
        if side < 1:
            raise ValueError(f"image_size={image_size} is too small for the 'fedveca-cnn' model (needs >= 4)")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Linear(32 * side * side, 256), nn.ReLU(), nn.Linear(256, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class SquaredSVM(nn.Module):
    """FedVeca's squared-SVM: a linear score ``f(x) = w.x + b`` (one output column) trained with the squared hinge
    loss. Labels are {0, 1} on the wire (0 = even digit in ``mnist-parity``) and map to targets +1 / -1 in the loss,
    so the predicted label is 0 where ``f >= 0`` and 1 where ``f < 0``."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @staticmethod
    def loss(scores: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``mean(max(0, 1 - t * f)^2)`` with ``t = +1`` for label 0 and ``-1`` for label 1."""
        target = 1.0 - 2.0 * y.to(scores.dtype)
        return torch.clamp(1.0 - target * scores.reshape(-1), min=0.0).square().mean()


class CharLSTM(nn.Module):
    """LEAF's Shakespeare model: an 8-dim character embedding, a 2-layer LSTM with 256 units, and a linear layer on the
    last time step that predicts the next character over the 80-symbol vocabulary.

    The input is a (N, seq_len) float tensor of character indices (``ArrayDataset`` stores x as float32); it is cast
    to integer indices here. ``seq_len`` only fixes the exported ONNX input shape: the LSTM accepts any length.
    """

    def __init__(
        self, vocab_size: int = 80, embed_dim: int = 8, hidden_size: int = 256, num_layers: int = 2, seq_len: int = 80
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden_size, num_layers=num_layers, batch_first=True)
        self.head = nn.Linear(hidden_size, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x.long()))
        return self.head(out[:, -1])


MODELS: dict[str, type[nn.Module]] = {
    "cnn": TacoCNN,
    "mlp": MLP,
    "fedveca-cnn": FedVecaCNN,
    "svm": SquaredSVM,
    "char-lstm": CharLSTM,
}


#: Spec keys every model accepts: inputs become ``(x - input_mean) / input_std`` before the model sees them.
STANDARDIZE_KEYS = ("input_mean", "input_std")


def _standardizer(name: str, mean: Any, std: Any) -> Any:
    """A forward pre-hook standardising the input, so training, evaluation and the ONNX export (which traces the hook)
    all take the raw ``[0, 1]`` images a device stores; a scalar or one value per channel (dimension 1)."""

    def values(key: str, v: Any) -> torch.Tensor:
        items = v if isinstance(v, Sequence) and not isinstance(v, str) else [v]
        ok = len(items) > 0 and all(isinstance(f, (int, float)) and not isinstance(f, bool) for f in items)
        t = torch.tensor([float(f) for f in items] if ok else [math.nan])
        if not bool(torch.isfinite(t).all()) or (key == "input_std" and not bool((t > 0).all())):
            want = "numbers > 0" if key == "input_std" else "finite numbers"
            raise ValueError(f"model {name!r}: key {key!r} must be a number or a list of {want}, got {v!r}")
        return t

    m, s = values("input_mean", mean), values("input_std", std)
    per_channel = max(m.numel(), s.numel()) > 1  # decided here: a tensor test inside the hook would break tracing

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        shape = (1, -1) + (1,) * (x.dim() - 2) if per_channel else ()
        return ((x - m.reshape(shape)) / s.reshape(shape), *args[1:])

    return hook


#: Spec key of a user's model: one sample's input shape without the batch axis, for the ONNX export.
INPUT_SHAPE_KEY = "input_shape"


def build_model(spec: Mapping[str, Any], allowed: AllowedCode = SERVER) -> nn.Module:
    """Build a model from a config/wire spec with errors that name the bad key: a built-in ``{"name": ..., **kwargs}``
    or a user's ``{"factory": "package.module:callable", **kwargs}`` (imported only where ``allowed``)."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"model spec must be a mapping with a 'name' or 'factory' key, got {type(spec).__name__}")
    kwargs = dict(spec)
    standardize = {k: kwargs.pop(k) for k in STANDARDIZE_KEYS if k in kwargs}
    if FACTORY_KEY in kwargs:
        name = str(kwargs[FACTORY_KEY])
        model = _user_model(kwargs, allowed)
    else:
        name = kwargs.pop("name", None)
        model = _builtin_model(name, kwargs)
    if standardize:
        model.register_forward_pre_hook(
            _standardizer(name, standardize.get("input_mean", 0.0), standardize.get("input_std", 1.0))
        )
    return model


def _user_model(kwargs: dict[str, Any], allowed: AllowedCode) -> nn.Module:
    kwargs.pop(INPUT_SHAPE_KEY, None)  # the export's, not the factory's
    return build_with_factory("model", kwargs, allowed, nn.Module, "a torch.nn.Module")


def _builtin_model(name: Any, kwargs: dict[str, Any]) -> nn.Module:
    if name not in MODELS:
        raise ValueError(
            f"model 'name' = {name!r} is not known; valid names: {', '.join(sorted(MODELS))} "
            "(or 'factory' = \"package.module:callable\" for your own model)"
        )
    cls = MODELS[name]
    params = {k: p for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise ValueError(f"model {name!r}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(params)}")
    missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in kwargs]
    if missing:
        raise ValueError(f"model {name!r}: missing key(s) {', '.join(missing)}; valid keys: {', '.join(params)}")
    for key, value in kwargs.items():
        if key == "hidden":
            ok = isinstance(value, Sequence) and not isinstance(value, str)
            ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
        else:
            ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        if not ok:
            want = "a list of positive integers" if key == "hidden" else "a positive integer"
            raise ValueError(f"model {name!r}: key {key!r} must be {want}, got {value!r}")
    return cls(**kwargs)


def parameter_layout(model: nn.Module) -> list[list[Any]]:
    """``[name, shape, dtype]`` of every trainable parameter in wire order: what a flat vector means."""
    return [
        [name, list(p.shape), str(p.dtype).removeprefix("torch.")]
        for name, p in model.named_parameters()
        if p.requires_grad
    ]


def fingerprint(layout: list[list[Any]]) -> str:
    """sha256 of a parameter layout: equal on server and device exactly when their flat vectors mean the same."""
    return hashlib.sha256(json.dumps(layout, separators=(",", ":")).encode()).hexdigest()


def layout_difference(expected: list[list[Any]], got: Any) -> str:
    """The first parameter where ``got`` (a device's layout, untrusted) differs from ``expected`` (the server's)."""
    if not isinstance(got, list):
        return "the device sent no parameter layout"
    for i, want in enumerate(expected):
        if i >= len(got):
            return f"parameter {want[0]!r} {want[1]} {want[2]} is missing on the device (it has {len(got)} parameters)"
        have = got[i]
        if have != want:
            return f"parameter #{i} is {_describe(have)} on the device, {want[0]!r} {want[1]} {want[2]} on the server"
    if len(got) > len(expected):
        return f"the device has {len(got) - len(expected)} more parameter(s), the first {_describe(got[len(expected)])}"
    return "the layouts are equal but the fingerprints differ"


def _describe(entry: Any) -> str:
    ok = isinstance(entry, list) and len(entry) == 3
    return f"{entry[0]!r} {entry[1]} {entry[2]}" if ok else repr(entry)[:80]


def num_params(model: nn.Module) -> int:
    """Number of trainable parameters, i.e. the length of the flat vector on the wire."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def get_flat(model: nn.Module) -> np.ndarray:
    """A float32 1-D copy of the trainable parameters, in ``model.parameters()`` order."""
    params = _trainable(model)
    if not params:
        return np.zeros(0, dtype=np.float32)
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).to(torch.float32).cpu() for p in params])
    return flat.numpy()  # torch.cat already made fresh memory


def set_flat(model: nn.Module, flat: np.ndarray) -> None:
    """Copy a flat vector (as produced by :func:`get_flat`) into the trainable parameters in place."""
    flat = np.asarray(flat)
    expected = num_params(model)
    if flat.ndim != 1 or flat.size != expected:
        raise ValueError(f"flat weight vector has wrong length: expected {expected}, got shape {flat.shape}")
    with warnings.catch_warnings():
        # Decoded wire arrays are read-only views of the payload; they are only read here, never written.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        src = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32))
    offset = 0
    with torch.no_grad():
        for p in _trainable(model):
            n = p.numel()
            p.copy_(src[offset : offset + n].view_as(p))
            offset += n
