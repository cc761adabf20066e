"""The option tables and the command line agree: every flag a command accepts is in the full
tables of docs/cli.md, and every flag a `convert` table lists (docs/cli.md's and the README's
short one) exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from zerosafe_app.cli import _parser

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
CLI_DOC = (ROOT / "docs" / "cli.md").read_text()
CONVERT_TABLE = "| option | default | meaning |"


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags(p: argparse.ArgumentParser) -> set[str]:
    return {
        o
        for a in p._actions
        if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
        for o in a.option_strings
        if o.startswith("--")
    }


def _convert_tables(text: str) -> list[str]:
    tables = []
    start = text.find(CONVERT_TABLE)
    while start != -1:
        end = text.find("\n\n", start)
        tables.append(text[start : end if end != -1 else len(text)])
        start = text.find(CONVERT_TABLE, start + 1)
    return tables


def test_every_flag_is_in_the_full_option_tables() -> None:
    tables = "\n".join(line for line in CLI_DOC.splitlines() if line.startswith("|"))
    missing = {
        f"{name} {flag}"
        for name, p in _commands().items()
        for flag in _flags(p)
        if not re.search(rf"`{re.escape(flag)}[ `]", tables)
    }
    assert not missing, f"flags missing from docs/cli.md's option tables: {sorted(missing)}"


def test_every_flag_in_the_convert_tables_exists() -> None:
    full = _convert_tables(CLI_DOC)
    short = _convert_tables(README)
    assert len(full) == 1, "docs/cli.md has one full `convert` table"
    assert len(short) == 1, "the README has one short `convert` table"
    convert = _flags(_commands()["convert"])
    for where, table in (("docs/cli.md", full[0]), ("README.md", short[0])):
        listed = set(re.findall(r"`(--[a-z0-9-]+)", table))
        assert listed <= convert, f"{where}: not flags of convert: {sorted(listed - convert)}"
    assert "--check-lowp" in full[0]
