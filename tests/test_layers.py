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
        _modules_after("import zerosafe, zerosafe.convert, zerosafe.verify_output, zerosafe.cli")
        == "PREFECT:"
    )


def test_inspect_and_verify_commands_do_not_import_prefect(tmp_path) -> None:
    code = f"""
from zerosafe.cli import main
assert main(["inspect", {str(SAMPLE_CKPT)!r}]) == 0
assert main(["convert", "--no-flow", "-q", {str(SAMPLE_CKPT)!r}, {str(tmp_path / "o")!r}]) == 0
assert main(["verify", {str(tmp_path / "o")!r}]) == 0
"""
    assert _modules_after(code) == "PREFECT:"
