"""The import table of docs/architecture.md: a package imports only the mtl packages in its row."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "core": set(),
    "parallel": {"core"},
    "models": {"core", "parallel"},
    "data": {"core"},
    "ckpt": {"core"},
    "train": {"core", "parallel", "models", "data", "ckpt"},
    "serve": {"core", "parallel", "models", "data", "ckpt"},
    "cli": {"core", "parallel", "models", "data", "ckpt", "train", "serve"},
    "te": {"core", "parallel"},
    "quant": {"core", "parallel"},
}


def mtl_imports(path: Path) -> set[str]:
    """The mtl packages a file imports (``mtl.x`` of every import statement, lazy ones too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "mtl" and len(parts) > 1:
                found.add(parts[1])
    return found


def package_sources():
    for package_dir in sorted((ROOT / "packages").iterdir()):
        src = package_dir / "src" / "mtl" / package_dir.name
        if src.is_dir():
            yield package_dir.name, sorted(src.rglob("*.py"))


@pytest.mark.parametrize("package,files", list(package_sources()), ids=lambda v: v if isinstance(v, str) else "")
def test_package_imports_follow_the_table(package, files):
    assert package in ALLOWED, f"packages/{package} is not in the import table; add it to docs/architecture.md"
    assert files, f"packages/{package} has no source files"
    bad = []
    for path in files:
        for imported in mtl_imports(path) - ALLOWED[package] - {package}:
            bad.append(f"{path.relative_to(ROOT)} imports mtl.{imported}")
    assert not bad, "imports outside the table:\n" + "\n".join(bad)


def test_no_package_ships_a_namespace_init():
    offenders = list(ROOT.glob("packages/*/src/mtl/__init__.py"))
    assert not offenders, f"mtl is a PEP 420 namespace; remove {offenders}"


def test_checker_sees_lazy_imports(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text("def f():\n    from mtl.train.loop import run\n    import mtl.ckpt\n")
    assert mtl_imports(sample) == {"train", "ckpt"}
