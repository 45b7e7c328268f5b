"""Without Transformer Engine (or without a GPU) the ``te`` backend is still listed, and every
way of reaching it answers with one line naming what to install, never a traceback."""

import subprocess
import sys

import pytest

from mtl.core.config import RunConfig
from mtl.core.errors import NotInstalledError
from mtl.core.plugins import registry
from mtl.te.availability import te_import_error

pytestmark = pytest.mark.skipif(te_import_error() is None, reason="Transformer Engine is installed and usable here")

HINT = "pip install 'mtl-te[te]'"


def test_the_backend_is_registered_with_its_fusions_and_recipes():
    backend = registry("backend").get("te")
    assert backend.norm_column_linear is not None and backend.norm_mlp is not None
    assert backend.fp8_recipes == ("current", "delayed", "blockwise")


def test_selecting_te_is_one_clear_line():
    config = RunConfig()
    config.model.backend = "te"
    with pytest.raises(NotInstalledError) as caught:
        config.resolve(1, 100)
    message = str(caught.value)
    assert HINT in message and "backend 'te' needs Transformer Engine" in message and "\n" not in message
    with pytest.raises(NotInstalledError, match="backend 'te' needs Transformer Engine"):
        registry("backend").get("te").column_linear(8, 8, bias=False, init_std=0.02, topology=None)


def test_importing_the_te_modules_is_one_clear_line():
    code = "import mtl.te.plugin, mtl.te\nimport mtl.te.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("mtl.core.errors.NotInstalledError: backend 'te' needs Transformer Engine") and HINT in last


def test_mtl_train_prints_the_line_without_a_traceback(tmp_path):
    pytest.importorskip("mtl.cli", reason="mtl-cli is not installed (not a dependency of mtl-te)")
    done = subprocess.run(
        [sys.executable, "-m", "mtl.cli", "train", "--dry-run", "--set", "model.backend='te'",
         "--set", "data.dataset='mock'", "--set", "train.device='cpu'"],
        capture_output=True, text=True, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "Traceback" not in output, output
    assert "backend 'te' needs Transformer Engine" in output and HINT in output
