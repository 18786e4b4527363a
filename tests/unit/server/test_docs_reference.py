"""The generated references in docs/ are what the code says: the configuration table and the CLI's --help."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from server.cli_reference import cli_reference
from server.config import RunConfig
from server.config_reference import config_table, field_comments

DOCS = Path(__file__).resolve().parents[3] / "docs"


def _between(doc: str, name: str) -> str:
    begin, end = f"<!-- {name}:begin -->\n", f"\n<!-- {name}:end -->"
    assert doc.count(begin) == 1 and doc.count(end) == 1, f"the markers of {name}"
    return doc[doc.index(begin) + len(begin) : doc.index(end)]


def test_docs_configuration_holds_the_generated_table_of_every_key() -> None:
    """Regenerate with: python -m server.config_reference, pasted between the markers of docs/configuration.md."""
    table = config_table()
    assert _between((DOCS / "configuration.md").read_text(), "config-keys") == table
    config = RunConfig()
    for section in dataclasses.fields(RunConfig):  # every key of every section has its row, with a description
        instance = getattr(config, section.name)
        if not dataclasses.is_dataclass(instance):
            assert f"| `[{section.name}" in table
            continue
        for f in dataclasses.fields(instance):
            row = next(r for r in table.splitlines() if r.startswith(f"| `[{section.name}]` | `{f.name}` |"))
            assert not row.endswith("|  |"), f"{section.name}.{f.name} has no comment in server/config.py"
    for key, _, expected in config.bounds():  # every bound validate() enforces is shown beside its key
        section, name = key.split(".")
        assert f"| `[{section}]` | `{name}` |" in table and expected.split(" (")[0].replace("|", "\\|") in table


def test_field_comments_reads_the_block_above_and_the_comment_beside_a_field() -> None:
    @dataclasses.dataclass
    class Section:
        # above, line one
        # and line two
        a: int = 1  # beside
        b: str = ""
        c: float = 0.0  # only beside

    assert field_comments(Section) == {"a": "above, line one and line two beside", "b": "", "c": "only beside"}


def test_docs_cli_holds_the_help_of_every_command() -> None:
    """Regenerate with: python -m server.cli_reference, pasted between the markers of docs/cli.md."""
    reference = cli_reference()
    assert _between((DOCS / "cli.md").read_text(), "cli-help") == reference
    for command in ("edge-server simulate", "edge-server run", "edge-server fleet calibrate", "edge-client check"):
        assert f"### `{command}`\n\n```text\nusage: {command} " in reference
