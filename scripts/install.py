"""Install any subset of the mtl packages, editable, with the mtl packages each one needs.

    python scripts/install.py core quant              # into the running interpreter's environment
    python scripts/install.py --test models           # plus the [test] extra and pytest
    python scripts/install.py --venv /tmp/venv cli    # into a venv (created if missing)

A package is named by its folder (`quant`, `mtl-example-family`) or its distribution
(`mtl-quant`). The mtl packages are not on any index, so pip cannot find a sibling by name:
this script reads every pyproject.toml in the repository, follows each requested package's
`mtl-*` dependencies (and, with --test, those of its [test] extra) to the bottom, and hands
pip one command with every needed package as an editable path, so pip resolves each sibling
to its folder here and everything else from the configured index.

torch is pinned in the same command to MTL_TORCH_VERSION (default 2.13.0, as scripts/setup.sh
does): an unpinned torch would pull a multi-GB CUDA build. MTL_TORCH_VERSION=installed keeps
the torch the environment already has.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser under its PyPI name
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("packages", "examples/plugins")
# The repository's pytest.ini sets `timeout`, which needs pytest-timeout.
TEST_RUNNER = ("pytest", "pytest-timeout")
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")


def read_projects() -> dict[str, dict]:
    """Distribution name -> {path, dependencies, extras} for every package in the repository."""
    projects = {}
    for folder in PACKAGE_DIRS:
        for pyproject in sorted((ROOT / folder).glob("*/pyproject.toml")):
            project = tomllib.loads(pyproject.read_text())["project"]
            projects[normalize(project["name"])] = {
                "path": pyproject.parent,
                "dependencies": project.get("dependencies", []),
                "extras": project.get("optional-dependencies", {}),
            }
    return projects


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_requirement(requirement: str) -> tuple[str, set[str]]:
    """'mtl-ckpt[inspect]' -> ('mtl-ckpt', {'inspect'})."""
    match = REQUIREMENT.match(requirement)
    extras = {e.strip() for e in (match.group(2) or "").split(",") if e.strip()}
    return normalize(match.group(1)), extras


def resolve_name(name: str, projects: dict[str, dict]) -> str:
    for candidate in (normalize(name), normalize(f"mtl-{name}")):
        if candidate in projects:
            return candidate
    known = ", ".join(sorted(p["path"].name for p in projects.values()))
    sys.exit(f"install.py: no package '{name}' in this repository (known: {known})")


def closure(requested: list[str], projects: dict[str, dict], with_test: bool) -> dict[str, set[str]]:
    """Every mtl distribution the requested ones need -> the extras to install it with."""
    needed: dict[str, set[str]] = {}
    stack = [(name, {"test"} if with_test and "test" in projects[name]["extras"] else set()) for name in requested]
    while stack:
        name, extras = stack.pop()
        if name in needed and extras <= needed[name]:
            continue
        needed.setdefault(name, set()).update(extras)
        project = projects[name]
        requirements = list(project["dependencies"])
        for extra in extras:
            requirements += project["extras"].get(extra, [])
        for requirement in requirements:
            dep, dep_extras = parse_requirement(requirement)
            if dep in projects:
                stack.append((dep, dep_extras))
    return needed


def pip_command(python: str, needed: dict[str, set[str]], projects: dict[str, dict], with_test: bool) -> list[str]:
    command = [python, "-m", "pip", "install", "--disable-pip-version-check"]
    torch = os.environ.get("MTL_TORCH_VERSION", "2.13.0")
    if torch != "installed":
        command.append(f"torch=={torch}")
    for name in sorted(needed):
        extras = f"[{','.join(sorted(needed[name]))}]" if needed[name] else ""
        command += ["-e", f"{projects[name]['path']}{extras}"]
    if with_test:
        command += TEST_RUNNER
    return command


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packages", nargs="+", help="folder or distribution names: core quant models ...")
    parser.add_argument("--test", action="store_true", help="also install each named package's [test] extra and pytest")
    parser.add_argument("--venv", type=Path, help="install into this venv (created if missing) instead of the running one")
    parser.add_argument("--dry-run", action="store_true", help="print the pip command, run nothing")
    args = parser.parse_args()

    projects = read_projects()
    requested = [resolve_name(name, projects) for name in args.packages]
    needed = closure(requested, projects, args.test)
    python = sys.executable
    if args.venv is not None:
        if not (args.venv / "bin" / "python").exists() and not args.dry_run:
            venv.create(args.venv, with_pip=True)
        python = str(args.venv / "bin" / "python")
    command = pip_command(python, needed, projects, args.test)
    print("installing", " ".join(sorted(needed)), flush=True)
    if args.dry_run:
        print(" ".join(command))
        return
    sys.exit(subprocess.call(command))


if __name__ == "__main__":
    main()
