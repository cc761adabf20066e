"""The engine stays a plain library: no Prefect in its import graph."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

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


def test_help_inspect_verify_and_a_no_op_import_neither_torch_nor_prefect(tmp_path) -> None:
    """Start-up pays only for what the path needs: torch only where a conversion runs."""
    out = tmp_path / "o"
    done = subprocess.run(
        [sys.executable, "-m", "zerosafe_app.cli", "convert", "-q", "--via", "local",
         str(SAMPLE_CKPT), str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for argv in (
        ["--help"],
        ["convert", "--help"],
        ["inspect", str(SAMPLE_CKPT)],
        ["verify", str(out)],
        ["convert", str(SAMPLE_CKPT), str(out)],  # already complete: nothing to do
    ):
        probe = f"""
import sys
from zerosafe_app.cli import main
try:
    code = main({argv!r})
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "prefect"))
print("CODE", code, "HEAVY", ",".join(heavy[:5]))
"""
        proc = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300
        )
        assert proc.stdout.strip().splitlines()[-1] == "CODE 0 HEAVY", (argv, proc.stdout[-500:])


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


def test_command_line_parsing_stays_out_of_the_engine() -> None:
    """Flags, their parsers and what a command prints live in the app (issue 38): the engine
    takes typed arguments. `pt2st/tree.py` is the one exception: it rebuilds the
    `argparse.Namespace` objects that training scripts pickle into checkpoints."""
    from tests.conftest import REPO

    users = set()
    for path in sorted((REPO / "zerosafe").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
                users.add(path.relative_to(REPO).as_posix())
            elif isinstance(node, ast.ImportFrom) and node.module == "argparse":
                users.add(path.relative_to(REPO).as_posix())
    assert users == {"zerosafe/pt2st/tree.py"}


def test_no_generic_top_level_packages_are_installed() -> None:
    """The wheel installs `zerosafe` and `zerosafe_app` only: a user's own `import tasks` or
    `import flows` must never pick up ours."""
    import tomllib

    from tests.conftest import REPO

    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted({name.split(".")[0] for name in include}) == ["zerosafe", "zerosafe_app"]


# ---------------------------------------------------------------------------------------------
# The import graph: no cycles, no private names across modules

PACKAGES = ("zerosafe", "zerosafe_app")
PRIVATE_IMPORTS_LEFT: set[tuple[str, str, str]] = set()


def _module_files() -> dict[str, Path]:
    from tests.conftest import REPO

    files = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import under `node`, in functions too, but for those under `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]))
            continue
        yield from _imports(child)


def _import_graph() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """Module -> the product modules it imports; and `(module, imported from, name)` for
    each private name imported from another product module."""
    files = _module_files()

    def owner(name: str) -> str | None:  # the module a dotted name is, or is in
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    private = []
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = set()
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {m for m in (owner(a.name) for a in node.names) if m is not None}
                continue
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            if base.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" in files:  # `from package import module`
                    edges.add(f"{base}.{alias.name}")
                    continue
                source = owner(base)
                if source is None:
                    continue
                edges.add(source)
                name = alias.name
                if name.startswith("_") and not name.startswith("__") and source != module:
                    private.append((module, source, name))
        edges.discard(module)
        graph[module] = edges
    return graph, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_import_graph_finds_cycles_and_private_names() -> None:
    """The checks below would see what they look for (a made-up graph)."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    real, _ = _import_graph()
    assert "zerosafe.formats.registry" in real["zerosafe.plan.build"]  # lazy, in a function
    assert "zerosafe.formats.deepspeed.types" in real["zerosafe.formats.deepspeed.reader"]
    assert "zerosafe.plan.model" not in real["zerosafe.formats.deepspeed.save_identity"]


def test_no_import_cycles() -> None:
    """No two product modules import each other, directly or through others, counting imports
    inside functions (they run, only later) and not those under `if TYPE_CHECKING:`."""
    graph, _ = _import_graph()
    cycles = _cycles(graph)
    shown = [
        "cycle of "
        + str(len(c))
        + ":\n"
        + "\n".join(f"  {m} -> {', '.join(sorted(graph[m] & set(c)))}" for m in c)
        for c in cycles
    ]
    assert cycles == [], "\n".join(shown)


def test_no_private_names_across_modules() -> None:
    """A name another module imports is public in the module that owns it."""
    _, private = _import_graph()
    found = [p for p in private if p not in PRIVATE_IMPORTS_LEFT]
    assert found == [], "\n".join(f"{m}: from {s} import {n}" for m, s, n in found)
    assert set(private) == PRIVATE_IMPORTS_LEFT, "made public: drop it from PRIVATE_IMPORTS_LEFT"
