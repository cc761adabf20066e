"""The README's option tables and the command line agree: every flag a command accepts is
documented, and every flag the `convert` table lists exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from zerosafe_app.cli import _parser

README = (Path(__file__).parents[1] / "README.md").read_text()


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


def test_every_flag_is_in_the_readme_tables() -> None:
    tables = "\n".join(line for line in README.splitlines() if line.startswith("|"))
    missing = {
        f"{name} {flag}"
        for name, p in _commands().items()
        for flag in _flags(p)
        if not re.search(rf"`{re.escape(flag)}[ `]", tables)
    }
    assert not missing, f"flags missing from the README's option tables: {sorted(missing)}"


def test_every_flag_in_the_convert_table_exists() -> None:
    start = README.index("| option | default | meaning |")
    table = README[start : README.index("\n\n", start)]
    listed = set(re.findall(r"`(--[a-z0-9-]+)", table))
    assert listed <= _flags(_commands()["convert"]), listed - _flags(_commands()["convert"])
    assert "--check-lowp" in listed
