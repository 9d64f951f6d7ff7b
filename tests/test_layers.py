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
    bad.write_text("def f():\n    from harness.run.record import bound\n    return bound\n")
    assert imports(bad) == [("harness.run.record", True, 2)]


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
    folders = ("core", "harness", "harness/child", "harness/run", "harness/results", "tiers", "tiers/exports",
               "kernels/triton", "bench")
    modules = [p for d in folders for p in sorted((REPO / d).glob("*.py")) if p.name != "__init__.py"]
    assert modules and "`bench/`" in text
    missing = [str(p.relative_to(REPO)) for p in modules if f"`{p.stem}" not in text and f"{p.stem}`" not in text
               and f"/{p.stem}" not in text]
    assert not missing, f"not named in docs/architecture.md: {missing}"


@pytest.mark.quick
def test_every_results_readme_fits_a_page():
    """A results README is one page: what ran, the table, what it says; the detail goes to each check's own README."""
    readmes = sorted((REPO / "results").rglob("README.md"))
    assert readmes
    long = {str(p.relative_to(REPO)): n for p in readmes if (n := len(p.read_text().splitlines())) > 100}
    assert not long, f"results READMEs over 100 lines: {long}"


# harness/'s rooms, lowest first, each a folder (the commands: the modules at harness/'s top): each module imports only
# from its own room and the rooms below it (docs/architecture.md, "harness/, by room").
ROOM_ORDER = ["child", "run", "results", "commands"]


def room_of(path: Path) -> str:
    return "commands" if path.parent.name == "harness" else path.parent.name


def imported_room(module: str) -> str:
    """The room of `harness.<room>.<module>`, `harness.<room>` or `harness.<command>`."""
    part = module.split(".")[1]
    return part if part in ROOM_ORDER else "commands"


def harness_imports() -> list[tuple[Path, str, int]]:
    """(importing file, imported room, line) for every import between harness modules."""
    out = []
    for path in sorted((REPO / "harness").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.startswith("harness."):
                    out.append((path, imported_room(node.module), node.lineno))
                elif node.module == "harness":
                    out.extend((path, imported_room(f"harness.{a.name}"), node.lineno) for a in node.names)
            elif isinstance(node, ast.Import):
                out.extend((path, imported_room(a.name), node.lineno) for a in node.names
                           if a.name.startswith("harness."))
    return out


@pytest.mark.quick
def test_every_harness_module_is_in_a_room():
    """harness/ holds the commands and one folder per room, nothing deeper."""
    strays = [str(p.relative_to(REPO)) for p in (REPO / "harness").rglob("*.py")
              if room_of(p) not in ROOM_ORDER or len(p.relative_to(REPO / "harness").parts) > 2]
    assert not strays, f"not in a room ({', '.join(ROOM_ORDER[:-1])}) nor a command: {strays}"


@pytest.mark.quick
def test_harness_rooms_import_only_downward():
    upward = [f"{p.relative_to(REPO)}:{line} ({room_of(p)}) imports from {dep}" for p, dep, line in harness_imports()
              if ROOM_ORDER.index(dep) > ROOM_ORDER.index(room_of(p))]
    assert not upward, "\n".join(upward)
