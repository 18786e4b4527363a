"""A data set's training split as simulated clients' shards: partitioned by a scheme (``partitions.py``), summarised
as per-client label counts for the console, written as one .npz per client for the client processes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge_client.learning.data import ArrayDataset
from server.datasets import DatasetBundle
from server.experiments.partitions import partition

__all__ = ["format_histograms", "label_histograms", "partition", "partition_bundle", "write_shards"]


def partition_bundle(bundle: DatasetBundle, num_clients: int, scheme: str, seed: int) -> list[np.ndarray]:
    """Partition a bundle's training set by its partition labels (default ``train.y``) and groups."""
    labels = bundle.train.y if bundle.partition_labels is None else bundle.partition_labels
    return partition(labels, num_clients, scheme, seed, groups=bundle.groups, dataset=bundle.name)


def label_histograms(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """(num_clients, num_classes) label counts per client."""
    labels = np.asarray(labels)
    return np.stack([np.bincount(labels[p], minlength=num_classes)[:num_classes] for p in parts]).astype(np.int64)


def format_histograms(hist: np.ndarray, client_ids: list[str]) -> str:
    """A compact text table (one row per client, one column per class, then the total) for the console."""
    hist = np.asarray(hist)
    if len(client_ids) != len(hist):
        raise ValueError(f"{len(hist)} histogram rows but {len(client_ids)} client ids")
    name_w = max([len("client"), *(len(c) for c in client_ids)])
    width = max(len(str(int(hist.max(initial=0)))), len(str(hist.shape[1] - 1)), 1)
    total_w = max(len("total"), len(str(int(hist.sum(axis=1).max(initial=0)))))
    lines = [
        " ".join(["client".ljust(name_w), *(str(k).rjust(width) for k in range(hist.shape[1])), "total".rjust(total_w)])
    ]
    for cid, row in zip(client_ids, hist, strict=True):
        cells = [str(int(v)).rjust(width) for v in row]
        lines.append(" ".join([cid.ljust(name_w), *cells, str(int(row.sum())).rjust(total_w)]))
    return "\n".join(lines)


def write_shards(train: ArrayDataset, parts: list[np.ndarray], out_dir: Path, client_ids: list[str]) -> list[Path]:
    """Write ``out_dir/<client_id>.npz`` (x, y; uncompressed for speed) per client, readable by load_local_data."""
    if len(parts) != len(client_ids):
        raise ValueError(f"{len(parts)} parts but {len(client_ids)} client ids")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for cid, idx in zip(client_ids, parts, strict=True):
        if not cid or cid.startswith(".") or "/" in cid or "\\" in cid:
            raise ValueError(f"client id {cid!r} cannot be used as a file name")
        path = out_dir / f"{cid}.npz"
        np.savez(path, x=train.x[idx], y=train.y[idx])
        paths.append(path)
    return paths
