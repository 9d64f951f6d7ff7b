"""The layers import one way (docs/architecture.md): core <- tiers <- harness, and kernels/ (Triton kernels) beside
core, used by the rungs. Checked on the source, every import statement, inside functions too."""
import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

# What each package may import of the project (itself included).
ALLOWED = {
    "core": {"core"},
    "kernels": {"kernels"},
    "tiers": {"core", "kernels", "tiers"},
    "harness": {"core", "kernels", "tiers", "harness"},
}
# The project's packages imported inside a function, each with its reason: Triton's kernels import Triton, which
# may be absent (the rung's availability says so) and takes seconds to import where it is not used.
LAZY_OK = {"kernels"}


def imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported module, inside a function, line) for every import of `path`."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, in_function, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.extend([(child.module, in_function, child.lineno)])
            visit(child, nested)

    visit(tree, False)
    return found


def project_imports(package: str) -> list[tuple[str, str, bool, int]]:
    """(file, imported project package, inside a function, line)."""
    out = []
    for path in sorted((REPO / package).rglob("*.py")):
        for module, in_function, line in imports(path):
            top = module.split(".")[0]
            if top in ALLOWED:
                out.append((str(path.relative_to(REPO)), top, in_function, line))
    return out


@pytest.mark.quick
def test_no_package_imports_upward():
    upward = [f"{f}:{line} imports {top}" for package in ALLOWED for f, top, _, line in project_imports(package)
              if top not in ALLOWED[package]]
    assert not upward, "\n".join(upward)


@pytest.mark.quick
def test_no_project_import_is_hidden_in_a_function():
    hidden = [f"{f}:{line} imports {top} inside a function" for package in ALLOWED
              for f, top, in_function, line in project_imports(package) if in_function and top not in LAZY_OK]
    assert not hidden, "\n".join(hidden)


@pytest.mark.quick
def test_the_check_sees_an_upward_import(tmp_path):
    """The checker itself fails on what it is for: a core module importing the harness, in a function."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from harness.record import bound\n    return bound\n")
    assert imports(bad) == [("harness.record", True, 2)]


@pytest.mark.quick
def test_every_package_is_installed():
    """`pip install -e .` maps each package of the layers (run from any directory, `import core` must work)."""
    import tomllib

    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in include} == set(ALLOWED)


@pytest.mark.quick
def test_the_architecture_names_every_module():
    """docs/architecture.md names each module of the packages, bench/ and kernels/triton: a new module without its
    line there fails here."""
    text = (REPO / "docs" / "architecture.md").read_text()
    modules = [p for d in ("core", "harness", "tiers", "tiers/exports", "kernels/triton", "bench")
               for p in sorted((REPO / d).glob("*.py")) if p.name != "__init__.py"]
    assert modules and "`bench/`" in text
    missing = [str(p.relative_to(REPO)) for p in modules if f"`{p.stem}" not in text and f"{p.stem}`" not in text
               and f"/{p.stem}" not in text]
    assert not missing, f"not named in docs/architecture.md: {missing}"


# harness/'s rooms, lowest first: each module imports only from its own room and the rooms below it
# (docs/architecture.md, "harness/, by room"). A new module gets its room here, or the test below fails.
ROOMS = {
    "child": {"contract", "worker", "profile", "timing", "layerbench", "reference"},
    "run": {"plan", "prepare", "executor", "measure", "watch", "context", "rundir", "sampler", "contention",
            "failures", "record", "census", "status", "refusal", "host_noise"},
    "results": {"load", "derive", "columns", "tables", "report", "plots", "census_plot", "compare"},
    "commands": {"__main__", "cli", "ladder", "accuracy", "mutations", "listing", "micro", "census_report",
                 "layers_report"},
}
ROOM_ORDER = list(ROOMS)


def room_of(module: str) -> str | None:
    return next((room for room, members in ROOMS.items() if module in members), None)


def harness_imports() -> list[tuple[str, str, int]]:
    """(importing module, imported harness module, line) for every import between harness modules."""
    out = []
    for path in sorted((REPO / "harness").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.startswith("harness."):
                    out.append((path.stem, node.module.split(".")[1], node.lineno))
                elif node.module == "harness":
                    out.extend((path.stem, a.name, node.lineno) for a in node.names)
            elif isinstance(node, ast.Import):
                out.extend((path.stem, a.name.split(".")[1], node.lineno) for a in node.names
                           if a.name.startswith("harness."))
    return out


@pytest.mark.quick
def test_every_harness_module_has_a_room():
    modules = {p.stem for p in (REPO / "harness").glob("*.py")} - {"__init__"}
    assert not (missing := sorted(m for m in modules if room_of(m) is None)), f"give these a room in ROOMS: {missing}"
    assert not (gone := sorted(set().union(*ROOMS.values()) - modules)), f"ROOMS names modules that are gone: {gone}"


@pytest.mark.quick
def test_harness_rooms_import_only_downward():
    upward = [f"harness/{m}.py:{line} ({room_of(m)}) imports {dep} ({room_of(dep)})"
              for m, dep, line in harness_imports() if m != dep
              and ROOM_ORDER.index(room_of(dep)) > ROOM_ORDER.index(room_of(m))]
    assert not upward, "\n".join(upward)
