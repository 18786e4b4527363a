"""`edge-server`'s command line (server/cli.py) refusing flags before anything starts. The commands run as processes:
tests/integration/test_cli.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.cli import main as server_main


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--site", "shop-1"], "--site 'shop-1': expected NAME:ID,ID"),
        (["--site", "shop-1:a", "--site", "shop-1:b"], "once per site"),
        (["--bridge", "mqtts://central:8883"], "--bridge-username NAME and --bridge-password-file FILE"),
    ],
)
def test_broker_site_and_bridge_flags_are_checked_before_anything_starts(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EDGEFL_BRIDGE_PASSWORD", raising=False)
    assert server_main(["broker", "--dir", str(tmp_path / "b"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
