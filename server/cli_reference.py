"""docs/cli.md's reference, generated from the ``--help`` of ``edge-server``, ``edge-client`` and every subcommand.

The text is each parser's own ``format_help()`` at a fixed width of 120 columns, so the page says what the commands
say; tests/unit/server/test_docs_reference.py keeps the committed page equal to this output.

Regenerate: ``python -m server.cli_reference`` prints the part to paste between the markers of docs/cli.md.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

from edge_client import cli as client_cli
from server import cli as server_cli

WIDTH = 120  # columns argparse wraps help at (it reads $COLUMNS)


@contextmanager
def _columns(width: int) -> Iterator[None]:
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parser, then each of its subcommands' parsers depth first, in the order they were added."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for sub in action.choices.values():  # aliases map to the same parser: once each
                if id(sub) not in seen:
                    seen.add(id(sub))
                    yield from _parsers(sub)


def cli_reference() -> str:
    """One section per command and subcommand: its name as a heading and its ``--help`` as a text block."""
    parts = []
    with _columns(WIDTH):
        for build in (server_cli.build_parser, client_cli.build_parser):
            for parser in _parsers(build()):
                help_text = parser.format_help().rstrip()
                parts.append(f"### `{parser.prog}`\n\n```text\n{help_text}\n```")
    return "\n\n".join(parts)


if __name__ == "__main__":
    print(cli_reference())
