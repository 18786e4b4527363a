"""`python -m benchmarks`' reading of its fragments (benchmarks/__main__.py): the targets of each table. The
benchmarks run in quick mode: tests/integration/benchmarks/test_runner.py."""

from __future__ import annotations

from benchmarks.__main__ import targets


def test_targets_are_read_from_fragment_tables() -> None:
    md = "\n".join(
        [
            "## x",
            "| figure | measured | target | result |",
            "|---|---|---|---|",
            "| encode | 2.1 GB/s | >= 1 GB/s | PASS |",
            "| ratio | 1.3x | <= 1.25x | **MISS** |",
            "",
            "| other table | value |",
            "|---|---|",
            "| no verdict here | 3 |",
        ]
    )
    assert targets(md) == [
        ("encode", "measured: 2.1 GB/s; target: >= 1 GB/s", "PASS"),
        ("ratio", "measured: 1.3x; target: <= 1.25x", "MISS"),
    ]
