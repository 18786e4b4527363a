"""The example's device data: windows of a noisy vibration signal (x: (N, 1, 64) float32) and their dominant frequency
in cycles per window (y, 1 to 8), one .npz per device. Run from this directory: ``python make_data.py``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

LENGTH = 64
DEVICES = ("sensor-a", "sensor-b", "sensor-c")


def windows(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    freq = rng.uniform(1.0, 8.0, n)
    phase = rng.uniform(0.0, 2 * np.pi, n)
    t = np.arange(LENGTH) / LENGTH
    x = np.sin(2 * np.pi * freq[:, None] * t[None, :] + phase[:, None]) + rng.normal(0.0, 0.2, (n, LENGTH))
    return x[:, None, :].astype(np.float32), freq.astype(np.float32)


def main(out: Path = Path(__file__).parent / "data", per_device: int = 240) -> None:
    out.mkdir(exist_ok=True)
    for i, device in enumerate(DEVICES):
        x, y = windows(per_device, np.random.default_rng(i))
        np.savez_compressed(out / f"{device}.npz", x=x, y=y)
        print(f"wrote {out / device}.npz: x {x.shape}, y {y.shape} (frequencies {y.min():.1f}-{y.max():.1f})")


if __name__ == "__main__":
    main()
