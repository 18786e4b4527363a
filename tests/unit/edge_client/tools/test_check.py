"""`edge-client check`'s items that need no broker (edge_client/tools/check.py): the data file's. The command against a
real mosquitto: tests/integration/test_check.py."""

from __future__ import annotations

from pathlib import Path

from edge_client.tools import check


def test_unreadable_data_file_fails_the_data_item(tmp_path: Path) -> None:
    corrupt = tmp_path / "data.npz"
    corrupt.write_bytes(b"not a zip archive")
    item = check.check_data(str(corrupt))
    assert item.ok is False and str(corrupt) in item.detail
    assert check.check_data(str(tmp_path / "absent.npz")).ok is False
    assert check.check_data(None).ok is None  # no --data: not checked, not failed
    assert check.report(iter([item]), "c0", "j", out=lambda _: None) == 1


def test_csv_data_is_checked_with_its_label_column(tmp_path: Path) -> None:
    csv = tmp_path / "readings.csv"
    csv.write_text("a,b,target\n1,2,0\n3,4,1\n5,6,1\n")
    assert check.check_data(str(csv), "target").detail.endswith("3 samples, 2 classes, samples of 2")
    missing = check.check_data(str(csv))  # the runtime would refuse it without --label-column: so does the check
    assert missing.ok is False and "--label-column" in missing.detail
