"""How fast is this device: seconds per 100 local updates per (model, algorithm), and ONNX inference latency.

The measurement runs the real training path (``trainer.train_local`` on a ``FlatModel`` with the algorithm's client
half) on synthetic data shaped for the model, and reads the trainer's own timer (the local optimisation loop only,
the algorithm's ``begin_round`` / ``end_round`` included). The algorithms are interleaved within each repeat (their
order rotates from repeat to repeat), so thermal throttling or background load affects all of them alike; the result
is the median over repeats, and the ratio to FedAvg of the same model in the same run (TACO Table I).

Each algorithm keeps one client-half instance for the whole benchmark, and an untimed warm-up round runs first, so
the timed rounds are steady-state rounds (SCAFFOLD's ``c_i`` is set, TACO knows the previous global model). The plan
of each round comes from the algorithm's contract: its default settings, the example of every per-round value, TACO's
``alpha_init`` as alpha, and zeros for every array the server would send, so a newly registered algorithm needs no
code here.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODELS", "benchmark", "format_table", "make_plan"]

#: the models the project ships: TACO's CNN on MNIST and on 32x32 RGB images, the MLP on digits
DEFAULT_MODELS: dict[str, dict[str, Any]] = {
    "cnn-mnist": {"name": "cnn", "in_channels": 1, "num_classes": 10, "image_size": 28},
    "cnn-cifar": {"name": "cnn", "in_channels": 3, "num_classes": 10, "image_size": 32},
    "mlp-digits": {"name": "mlp", "in_features": 64, "num_classes": 10},
}

LR = 0.01


def make_plan(algorithm: str, size: int, *, steps: int, batch_size: int) -> Any:
    """A plausible plan for ``algorithm``, from its contract alone (no server involved)."""
    from edge_client.algorithms import contract_of
    from edge_client.wire.plan import Plan

    contract = contract_of(algorithm)
    arrays = {a.name: np.zeros(size, dtype=np.float32) for a in contract.sends}
    return Plan(steps, LR, batch_size, contract.example_sent(), arrays)


def facts_of(version: int) -> Any:
    """The facts of the round that starts from model ``version`` (a benchmark's rounds follow one another)."""
    from edge_client.wire.messages import RoundFacts

    return RoundFacts(round=version + 1, model_version=version)


def _num_classes(spec: Mapping[str, Any], model: Any, shape: tuple[int, ...]) -> int:
    if isinstance(spec.get("num_classes"), int):
        return int(spec["num_classes"])
    import torch

    with torch.no_grad():
        return int(model(torch.zeros((1, *shape))).shape[1])


class _Runner:
    """One (model, algorithm) pair: its client half, model and synthetic data."""

    def __init__(self, label: str, spec: Mapping[str, Any], algorithm: str, batch_size: int, seed: int) -> None:
        from edge_client.algorithms import client_algorithm
        from edge_client.learning.data import ArrayDataset, BatchSampler
        from edge_client.learning.flat import FlatModel
        from edge_client.learning.models import build_model
        from edge_client.learning.predictor import sample_shape_for

        self.label, self.spec, self.algorithm_name = label, dict(spec), algorithm
        self.algorithm = client_algorithm(algorithm)
        module = build_model(self.spec)
        self.shape = sample_shape_for(self.spec)
        classes = _num_classes(self.spec, module, self.shape)
        self.flat = FlatModel(module)
        self.weights = self.flat.numpy()
        rng = np.random.default_rng(seed)
        n = max(4 * batch_size, 256)
        x = rng.standard_normal((n, *self.shape), dtype=np.float32)
        self.dataset = ArrayDataset(x, rng.integers(0, classes, n))
        self.sampler = BatchSampler(n, batch_size, seed, f"bench-{algorithm}")
        self.batch_size = batch_size
        self.version = 0

    def run(self, steps: int) -> Any:
        """One round of ``steps`` local steps from the current weights."""
        from edge_client.loop.trainer import train_local

        plan = make_plan(self.algorithm_name, self.flat.size, steps=steps, batch_size=self.batch_size)
        facts = facts_of(self.version)
        result = train_local(self.flat, self.weights, self.dataset, self.sampler, plan, self.algorithm, facts)
        self.version += 1
        return result


def _label(spec: Mapping[str, Any]) -> str:
    for label, known in DEFAULT_MODELS.items():
        if dict(spec) == known:
            return label
    if spec.get("name") == "cnn":
        return f"cnn-{spec.get('in_channels', 1)}x{spec.get('image_size', 28)}"
    return f"{spec.get('name')}-{spec.get('in_features', '')}".rstrip("-")


def _inference_latency(spec: Mapping[str, Any], weights: np.ndarray, threads: int, repeats: int) -> dict[str, Any]:
    from edge_client.learning.predictor import Predictor, export_onnx, sample_shape_for

    shape = sample_shape_for(spec)
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="edgefl-bench-") as tmp:
        path = export_onnx(spec, weights, Path(tmp) / "model.onnx", sample_shape=shape)
        predictor = Predictor(path, intra_op_num_threads=threads)
        for batch in (1, 64):
            x = rng.standard_normal((batch, *shape), dtype=np.float32)
            out[f"batch_{batch}"] = predictor.latency(x, repeats=repeats)
    return out


def benchmark(
    model_specs: Sequence[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]] | None = None,
    algorithms: Sequence[str] | None = None,
    steps: int = 100,
    batch_size: int = 64,
    repeats: int = 3,
    threads: int = 1,
    *,
    inference: bool = True,
    inference_repeats: int = 50,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Seconds per 100 local updates of each (model, algorithm) pair on this device, plus inference latency.

    ``model_specs``: model specs, or ``{label: spec}`` (default :data:`DEFAULT_MODELS`); ``algorithms``: names in
    ``CLIENT_ALGORITHMS`` (default: every registered one, FedAvg first). Returns one record per pair::

        {"model": label, "spec": {...}, "algorithm": "scaffold", "steps": 100, "batch_size": 64, "repeats": 3,
         "threads": 1, "s_per_100": 0.41, "cpu_s_per_100": 0.40, "runs_s_per_100": [...], "ratio_to_fedavg": 1.07,
         "arrays": ["c"], "inference": {"batch_1": {...}, "batch_64": {...}},
         "device": {<device.summarise of the snapshots around the training measurements>}}

    ``ratio_to_fedavg`` is None when FedAvg is not among ``algorithms``; ``inference`` (ONNX via onnxruntime, same
    for every algorithm of a model) is on the model's first record only, None elsewhere or when disabled.
    """
    import torch

    from edge_client.algorithms import CLIENT_ALGORITHMS
    from edge_client.loop.trainer import prepare_process

    if steps < 1 or repeats < 1 or batch_size < 1 or threads < 1:
        raise ValueError("steps, batch_size, repeats and threads must all be >= 1")
    if inference and importlib.util.find_spec("onnx") is None:  # a device installs onnxruntime, not onnx
        log.warning(
            "ONNX inference latency not measured: exporting the model needs the onnx package (pip install onnx)"
        )
        inference = False
    if model_specs is None:
        model_specs = DEFAULT_MODELS
    labelled: list[tuple[str, dict[str, Any]]] = []
    pairs = model_specs.items() if isinstance(model_specs, Mapping) else ((_label(s), s) for s in model_specs)
    for label, spec in pairs:
        taken = {name for name, _ in labelled}
        unique = str(label) if str(label) not in taken else f"{label}#{len(labelled) + 1}"
        labelled.append((unique, dict(spec)))
    if algorithms is None:
        algorithms = sorted(CLIENT_ALGORITHMS, key=lambda name: (name != "fedavg", name))
    unknown = [a for a in algorithms if a not in CLIENT_ALGORITHMS]
    if unknown:
        raise ValueError(f"unknown algorithm(s) {unknown}; this client supports {sorted(CLIENT_ALGORITHMS)}")
    algorithms = list(dict.fromkeys(algorithms))

    from edge_client.loop import device

    old_threads = torch.get_num_threads()
    prepare_process(threads)
    before = device.snapshot()
    try:
        runners = {
            (label, alg): _Runner(label, spec, alg, batch_size, seed) for label, spec in labelled for alg in algorithms
        }
        for runner in runners.values():  # untimed: reaches steady state, warms up
            runner.run(min(steps, 5))
        wall: dict[tuple[str, str], list[float]] = {key: [] for key in runners}
        cpu: dict[tuple[str, str], list[float]] = {key: [] for key in runners}
        for r in range(repeats):
            for label, _ in labelled:
                shift = r % len(algorithms)
                for alg in algorithms[shift:] + algorithms[:shift]:  # rotate: no algorithm always runs first
                    result = runners[label, alg].run(steps)
                    wall[label, alg].append(result.compute_s * 100.0 / steps)
                    cpu[label, alg].append(result.cpu_s * 100.0 / steps)

        machine = device.summarise(before, device.snapshot())
        results: list[dict[str, Any]] = []
        for label, spec in labelled:
            base = float(np.median(wall[label, "fedavg"])) if "fedavg" in algorithms else None
            latency = None
            if inference:
                latency = _inference_latency(spec, runners[label, algorithms[0]].weights, threads, inference_repeats)
            for i, alg in enumerate(algorithms):
                runner = runners[label, alg]
                median = float(np.median(wall[label, alg]))
                results.append(
                    {
                        "model": label,
                        "spec": spec,
                        "algorithm": alg,
                        "steps": steps,
                        "batch_size": batch_size,
                        "repeats": repeats,
                        "threads": threads,
                        "s_per_100": median,
                        "cpu_s_per_100": float(np.median(cpu[label, alg])),
                        "runs_s_per_100": list(wall[label, alg]),
                        "ratio_to_fedavg": (1.0 if alg == "fedavg" else median / base) if base else None,
                        "arrays": sorted(a.name for a in runner.algorithm.contract.sends),
                        "inference": latency if i == 0 else None,
                        "device": machine,
                    }
                )
        return results
    finally:
        torch.set_num_threads(old_threads)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_table(results: Sequence[Mapping[str, Any]]) -> str:
    """A plain-text table like TACO's Table I: seconds per 100 local updates and the percentage over FedAvg.

    One row per algorithm, one column per model; inference latencies follow, one line per model.
    """
    models = list(dict.fromkeys(r["model"] for r in results))
    algorithms = list(dict.fromkeys(r["algorithm"] for r in results))
    cell = {(r["model"], r["algorithm"]): r for r in results}

    def text(r: Mapping[str, Any] | None) -> str:
        if r is None:
            return "-"
        ratio = r.get("ratio_to_fedavg")
        over = "" if ratio is None else f" ({(ratio - 1.0) * 100.0:+.1f}%)"
        return f"{_fmt(r.get('s_per_100'), '.3f')}{over}"

    header = ["algorithm", *models]
    rows = [[alg, *(text(cell.get((m, alg))) for m in models)] for alg in algorithms]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    line = "  ".join

    def render(row: list[str]) -> str:
        return line(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths, strict=True)))

    first = results[0] if results else {}
    out = [
        f"seconds per 100 local updates (median of {first.get('repeats', '?')}; batch {first.get('batch_size', '?')},"
        f" {first.get('threads', '?')} thread(s)); in brackets: over FedAvg",
        render(header),
        render(["-" * w for w in widths]),
        *(render(row) for row in rows),
    ]
    latencies = [r for r in results if r.get("inference")]
    if latencies:
        out.append("")
        out.append("ONNX inference (onnxruntime), median / p90 ms per batch")
        for r in latencies:
            parts = []
            for key, lat in r["inference"].items():
                parts.append(f"{key.replace('_', ' ')}: {_fmt(lat['median_ms'], '.3f')} / {_fmt(lat['p90_ms'], '.3f')}")
            out.append(f"  {r['model']}: " + ", ".join(parts))
    machine = first.get("device")
    if machine:
        flags = machine.get("throttled_flags")
        out.append("")
        out.append(
            f"device: cpu {_fmt(machine.get('cpu_freq_mhz_before'), '.0f')} -> "
            f"{_fmt(machine.get('cpu_freq_mhz_after'), '.0f')} MHz, "
            f"{_fmt(machine.get('temperature_c_before'), '.1f')} -> {_fmt(machine.get('temperature_c_after'), '.1f')} C"
            f", throttled: {', '.join(flags) if flags else ('none' if flags is not None else 'unknown')}, "
            f"peak RSS {_fmt(machine.get('peak_rss_mb'), '.0f')} MiB"
        )
    return "\n".join(out)
