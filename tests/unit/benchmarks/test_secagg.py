"""The secure-aggregation benchmarks' bookkeeping: what a run's rows add up to, and how an emulated run is labelled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import secagg, secagg_rounds

MACHINE = {"cpu": "cpu", "cores": 2, "mem_gb": 1, "arch": "aarch64", "python": "3", "numpy": "2", "torch": "2"}


def _row(secure: bool) -> dict:
    clients = {c: {"bytes_up": 1000, "bytes_down": 500, "device": {"secagg": {"keys_s": 0.1, "mask_s": 0.2}}}
               for c in ("a", "b")}  # fmt: skip
    row = {"round": 1, "round_s": 2.0, "accuracy": 0.5, "clients": clients}
    if secure:
        stages = {"keys": 0.1, "shares": 0.2, "masked": 0.3, "unmask": 0.4}
        row["secure"] = {"stage_s": stages, "bytes_down": {"keys": 100, "shares": 300}, "bytes_up": {"keys": 50}}
    return row


def test_a_devices_bytes_down_include_its_share_of_the_stage_messages(tmp_path: Path) -> None:
    """Each device's link carries its assignment and model (its row) and the stage messages the server sent it."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_row(True)) + "\n")
    run = secagg_rounds.summarise(tmp_path, {"secure_rounds": 1})
    assert run["bytes_down_per_device"] == 500 + (100 + 300) / 2 and run["bytes_up_per_device"] == 1000
    assert list(run["stage_s"]) == ["keys", "shares", "masked", "unmask"]
    assert run["device_secagg_s"] == pytest.approx(0.3)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_row(False)) + "\n")
    plain = secagg_rounds.summarise(tmp_path, {})
    assert plain["bytes_down_per_device"] == 500 and plain["stage_s"] == {} and plain["secure_rounds"] == 0


def test_an_emulated_run_says_so_in_its_heading_and_clock() -> None:
    row = {"devices": 10, "neighbours": 9, "threshold": 6, "keys_s": 0.1, "share_s": 0.1, "mask_s": 0.1,
           "reveal_s": 0.0, "device_s": 0.3, "bytes_up": 1, "bytes_down": 1, "plain_up": 1, "bytes_ratio": 2.0,
           "unmask_s": 0.1}  # fmt: skip
    data = {"quick": True, "emulated": True, "machine": MACHINE, "params": 5, "ten_steps_s": 1.0, "rows": [row]}
    md = secagg.render(data)
    assert "emulated Cortex-A72" in md and "emulator's wall clock, not a Pi's" in md and "--quick --emulated" in md
    assert "emulat" not in secagg.render({**data, "emulated": False})
