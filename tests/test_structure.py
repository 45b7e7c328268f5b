"""The house rules a reader can check (issue 34): no source file over 400 lines, no function
over 80 lines in mtl.train and mtl.models.gpt, and no import circle inside any package (every
import counted, a function-local one too: a deferred import still ties the two files)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(ROOT.glob("packages/*/src/mtl/**/*.py"))
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
SHORT_FUNCTIONS = ("packages/train/src/mtl/train/", "packages/models/src/mtl/models/gpt/")


def module_name(path: Path) -> str:
    parts = path.relative_to(path.parents[len(path.relative_to(ROOT).parts) - 4]).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_source_file_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"split these files (over {MAX_FILE_LINES} lines): {long}"


def test_no_function_over_80_lines_in_train_and_gpt():
    long = []
    for path in SOURCES:
        if not str(path.relative_to(ROOT)).startswith(SHORT_FUNCTIONS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def imports_of(path: Path, package: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports (``from a import b`` counts ``a.b`` where
    that is a module, else ``a``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        for name in names:
            if name in known:
                found.add(name)
    return found


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.parametrize("package", sorted(p.name for p in ROOT.glob("packages/*") if (p / "src").is_dir()))
def test_no_import_circle_inside_a_package(package):
    files = {module_name(p): p for p in ROOT.glob(f"packages/{package}/src/mtl/**/*.py")}
    # a package's __init__ re-exporting its children is not a circle: count imports between files
    graph = {name: {m for m in imports_of(path, package, set(files)) if m != name and not name.startswith(m + ".")}
             for name, path in files.items()}
    assert cycle_in(graph) is None, f"import circle in packages/{package}: {' -> '.join(cycle_in(graph))}"
