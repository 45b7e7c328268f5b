"""``train.compile_cpp_wrapper``: the compiled layers are launched from inductor's C++ wrapper (its
generated modules have no Python ``call``), and the run gives the losses the Python wrapper gives,
bitwise (the same kernels). Settings it cannot serve are refused before any work, naming the key."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from mtl.core.config_io import load_config
from mtl.core.errors import ConfigError
from mtl.train.testing import TINY


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()  # later tests count the layer's compiled graphs
    torch._inductor.config.cpp_wrapper = False  # process-wide (mtl.train.compile.set_cpp_wrapper)


def _losses_and_wrappers(tmp_path, cpp_wrapper: bool):
    from mtl.train.loop import train

    torch._dynamo.reset()  # compile afresh, as a new process would
    cfg = load_config(None, [*TINY, "train.compile=true", "train.iters=2", f"logging.dir='{tmp_path / str(cpp_wrapper)}'",
                             f"train.compile_cpp_wrapper={str(cpp_wrapper).lower()}"])
    result, modules = run_and_get_code(lambda: train(cfg, progress=False))
    return list(result.losses.values()), ["def call(" in code for code in modules]


def test_cpp_wrapper_launches_from_cpp_with_the_same_losses(tmp_path):
    python_losses, python_calls = _losses_and_wrappers(tmp_path, False)
    cpp_losses, cpp_calls = _losses_and_wrappers(tmp_path, True)
    assert python_calls and all(python_calls)  # generated Python wrappers
    assert cpp_calls and not any(cpp_calls)  # none: every compiled module's wrapper is C++
    assert cpp_losses == python_losses


def test_cpp_wrapper_needs_compile():
    cfg = load_config(None, [*TINY, "train.compile=false", "train.compile_cpp_wrapper=true"])
    with pytest.raises(ConfigError, match=r"train.compile_cpp_wrapper = true needs train.compile = true"):
        cfg.resolve(tokenizer_vocab_size=257)


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
                    reason="torch < 2.13's C++ wrapper calls the layers' collectives")
def test_cpp_wrapper_refuses_layer_collectives_under_torch_2_13():
    cfg = load_config(None, [*TINY, "train.compile=true", "train.compile_cpp_wrapper=true", "parallel.tp=2"])
    with pytest.raises(ConfigError, match=r"train.compile_cpp_wrapper = true with parallel.tp = 2 needs torch < 2.13"):
        cfg.resolve(world_size=2, tokenizer_vocab_size=257)
