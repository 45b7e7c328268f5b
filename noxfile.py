"""Each package's tests in a fresh environment holding only its declared dependencies.

    nox -s "tests(package='core')"      # one package
    nox                       # all of them (slow: one environment each)
"""

import nox

TORCH = "torch==2.13.0"  # the CPU build on this machine's disk; an unpinned torch pulls CUDA
# Each package with the mtl packages it depends on, in install order.
PACKAGES = {
    "core": [],
    "parallel": ["core"],
    "data": ["core"],
    "ckpt": ["core"],
    "models": ["core", "parallel"],
    "train": ["core", "parallel", "models", "data", "ckpt"],
    "cli": ["core", "parallel", "models", "data", "ckpt", "train"],
    "quant": ["core", "parallel"],
    "te": ["core", "parallel"],
}
WITH_TEST_EXTRA = {"parallel", "models", "data", "ckpt", "train", "cli", "quant", "te"}
# Local distributions a package's tests use beyond its own dependencies (not on PyPI).
TEST_LOCAL = {
    "ckpt": ["packages/parallel"],  # the multi-rank save/load tests start gloo groups
    "cli": ["examples/plugins/mtl-example-plugin"],  # `mtl plugins` lists a third-party plugin
    # the backend suite (mtl.train.backend_suite) trains the tiny model
    "quant": [f"packages/{p}" for p in ("models", "data", "ckpt", "train")],
    "te": [f"packages/{p}" for p in ("models", "data", "ckpt", "train")],
}

nox.options.default_venv_backend = "venv"


@nox.session(python="3.11")
@nox.parametrize("package", list(PACKAGES))
def tests(session, package):
    session.install(TORCH, "pytest", "pytest-timeout")
    for dep in PACKAGES[package]:
        session.install("-e", f"packages/{dep}")
    for path in TEST_LOCAL.get(package, []):
        session.install("-e", path)
    extra = "[test]" if package in WITH_TEST_EXTRA else ""
    session.install("-e", f"packages/{package}{extra}")
    session.run("pytest", "-q", "-c", "pytest.ini", "--rootdir", ".", f"packages/{package}/tests")
