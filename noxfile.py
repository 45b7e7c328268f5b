"""Each package's tests in a fresh environment holding only its declared dependencies.

    nox -s "tests(package='core')"      # one package
    nox                       # all of them (slow: one environment each)

The environment is filled by scripts/install.py, the same command a user runs: the package
with its [test] extra, the mtl packages it declares (transitively, editable from this
repository) and torch pinned to MTL_TORCH_VERSION (default 2.13.0, the CPU build on this
machine's disk; an unpinned torch pulls CUDA).
"""

from pathlib import Path

import nox

PACKAGES = sorted(path.parent.name for path in Path("packages").glob("*/pyproject.toml"))

nox.options.default_venv_backend = "venv"


@nox.session(python="3.11")
@nox.parametrize("package", PACKAGES)
def tests(session, package):
    session.run_install("python", "scripts/install.py", "--test", package)
    session.run("pytest", "-q", "-c", "pytest.ini", "--rootdir", ".", f"packages/{package}/tests")
