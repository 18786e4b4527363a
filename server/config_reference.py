"""The table of every configuration key in docs/configuration.md, generated from the config dataclasses.

Each row comes from one place: the section and key from ``RunConfig``'s dataclasses, the type from the field's
annotation, the default from a default instance, the bound from ``RunConfig.bounds()`` (what ``validate`` refuses),
and the description from the comments beside and above the field in server/config.py. A section or key added
there appears here; tests/unit/server/test_docs_reference.py keeps the committed table equal to this output.

Regenerate: ``python -m server.config_reference`` prints the table to paste between the markers.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import textwrap
import tokenize
import types
import typing
from typing import Any

from server.config import INF_OFF, RunConfig


def _type_name(hint: Any) -> str:
    """A field's annotation as a reader of TOML names it."""
    if isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint):
        inner = next(t for t in typing.get_args(hint) if t is not type(None))
        return f"{_type_name(inner)} (optional)"
    origin = typing.get_origin(hint)
    if origin is list:
        return f"list of {_type_name(typing.get_args(hint)[0])}s"
    if origin is dict:
        return "tables" if typing.get_origin(typing.get_args(hint)[1]) is dict else "table"
    return {str: "string", int: "integer", float: "float", bool: "boolean"}.get(hint, getattr(hint, "__name__", "?"))


def _toml(value: Any) -> str:
    """A default as it would be written in the TOML file (``None``: not set)."""
    if value is None:
        return "(not set)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict) and not value:
        return "(none)"
    return json.dumps(value) if isinstance(value, str | list | dict) else repr(value)


def field_comments(cls: type) -> dict[str, str]:
    """Each dataclass field's comments in its source: the block right above it and the one on its own line(s)."""
    lines, _ = inspect.getsourcelines(cls)
    source = textwrap.dedent("".join(lines))  # a class defined inside a function is indented
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, alone on its line)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            alone = not tok.line[: tok.start[1]].strip()
            comments[tok.start[0]] = (tok.string.lstrip("#").strip(), alone)
    node = ast.parse(source).body[0]
    out: dict[str, str] = {}
    assert isinstance(node, ast.ClassDef)
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above: list[str] = []
        line = stmt.lineno - 1
        while line in comments and comments[line][1]:
            above.insert(0, comments[line][0])
            line -= 1
        beside = [comments[n][0] for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1) if n in comments]
        out[stmt.target.id] = " ".join(above + beside)
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_table() -> str:
    """The Markdown table of every key of every section, in the order of ``RunConfig``'s fields."""
    config = RunConfig()
    bounds = {key: expected for key, _, expected in config.bounds()}
    top = field_comments(RunConfig)
    rows = ["| section | key | type | default | bound | what it does |", "|---|---|---|---|---|---|"]
    for section in dataclasses.fields(RunConfig):
        instance = getattr(config, section.name)
        if not dataclasses.is_dataclass(instance):
            hint = typing.get_type_hints(RunConfig)[section.name]
            name = f"[{section.name}.NAME]" if _type_name(hint) == "tables" else f"[{section.name}]"
            rows.append(f"| `{name}` | any | {_type_name(hint)} |  |  | {_cell(top.get(section.name, ''))} |")
            continue
        hints = typing.get_type_hints(type(instance))
        about = field_comments(type(instance))
        for f in dataclasses.fields(instance):
            key = f"{section.name}.{f.name}"
            bound = bounds.get(key, "")
            if f.metadata.get(INF_OFF) and "inf" not in bound:
                bound = f"{bound} (inf {f.metadata[INF_OFF]})".strip()
            cells = [
                f"`[{section.name}]`",
                f"`{f.name}`",
                _type_name(hints[f.name]),
                f"`{_toml(getattr(instance, f.name))}`",
                _cell(bound),
                _cell(about.get(f.name, "")),
            ]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(config_table())
