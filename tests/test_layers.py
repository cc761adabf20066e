"""The engine stays a plain library: no Prefect in its import graph."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import SAMPLE_CKPT

PROBE = """
import sys
{code}
bad = sorted(m for m in sys.modules if m == "prefect" or m.startswith("prefect."))
print("PREFECT:" + ",".join(bad))
"""


def _modules_after(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(code=code)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_import_zerosafe_does_not_import_prefect() -> None:
    assert (
        _modules_after(
            "import zerosafe, zerosafe.pipeline, zerosafe.verify.output, zerosafe_app.cli"
        )
        == "PREFECT:"
    )


def test_inspect_and_verify_commands_do_not_import_prefect(tmp_path) -> None:
    code = f"""
from zerosafe_app.cli import main
assert main(["inspect", {str(SAMPLE_CKPT)!r}]) == 0
assert main(["convert", "--via", "local", "-q", {str(SAMPLE_CKPT)!r}, {str(tmp_path / "o")!r}]) == 0
assert main(["verify", {str(tmp_path / "o")!r}]) == 0
"""
    assert _modules_after(code) == "PREFECT:"


def test_engine_never_imports_the_app_layer() -> None:
    """`zerosafe` is the engine; `zerosafe_app` (command, flows, tasks) sits on top of it."""
    import ast

    from tests.conftest import REPO

    offenders = []
    for path in sorted((REPO / "zerosafe").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in ("zerosafe_app", "prefect", "flows", "tasks"):
                    offenders.append(f"{path.relative_to(REPO)}: {name}")
    assert offenders == []


def test_no_generic_top_level_packages_are_installed() -> None:
    """The wheel installs `zerosafe` and `zerosafe_app` only: a user's own `import tasks` or
    `import flows` must never pick up ours."""
    import tomllib

    from tests.conftest import REPO

    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted({name.split(".")[0] for name in include}) == ["zerosafe", "zerosafe_app"]
