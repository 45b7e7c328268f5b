"""``train.compile_cpp_wrapper``: the compiled layers are launched from inductor's C++ wrapper (its
generated modules have no Python ``call``), and the run gives the losses the Python wrapper gives
(the same kernels: bitwise on the CPU; on a GPU up to the attention backward's atomics). Settings
it cannot serve are refused before any work, naming the key."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from mtl.core.config_io import load_config
from mtl.core.errors import ConfigError
from mtl.core.torch_release import torch_release
from mtl.train.testing import TINY


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()  # later tests count the layer's compiled graphs
    torch._inductor.config.cpp_wrapper = False  # process-wide (mtl.train.compile.set_cpp_wrapper)


# on a GPU: bf16 weights with fp32 main_grad, the Triton kernels of mtl's triton_ops in the layers
CUDA_RUN = ["train.device='cuda'", "model.hidden_size=128", "train.precision='bf16'"]


def _losses_and_wrappers(tmp_path, cpp_wrapper: bool, overrides=()):
    from mtl.train.loop import train

    torch._dynamo.reset()  # compile afresh, as a new process would
    cfg = load_config(None, [*TINY, "train.compile=true", "train.iters=2", f"logging.dir='{tmp_path / str(cpp_wrapper)}'",
                             f"train.compile_cpp_wrapper={str(cpp_wrapper).lower()}", *overrides])
    result, modules = run_and_get_code(lambda: train(cfg, progress=False))
    return list(result.losses.values()), ["def call(" in code for code in modules]


@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def test_cpp_wrapper_launches_from_cpp_with_the_same_losses(tmp_path, device):
    # on CUDA the backward, compiled at the first backward, must follow the setting too (as a
    # per-compile option it did not: "CudaKernelParamCache not populated")
    overrides = CUDA_RUN if device == "cuda" else []
    python_losses, python_calls = _losses_and_wrappers(tmp_path, False, overrides)
    cpp_losses, cpp_calls = _losses_and_wrappers(tmp_path, True, overrides)
    assert python_calls and all(python_calls)  # generated Python wrappers
    assert cpp_calls and not any(cpp_calls)  # none: every compiled module's wrapper is C++
    if device == "cpu":
        assert cpp_losses == python_losses
    else:  # the same kernels, but cuDNN's attention backward is not bitwise repeatable on the GPU
        torch.testing.assert_close(cpp_losses, python_losses, rtol=1e-3, atol=0)


def test_cpp_wrapper_needs_compile():
    cfg = load_config(None, [*TINY, "train.compile=false", "train.compile_cpp_wrapper=true"])
    with pytest.raises(ConfigError, match=r"train.compile_cpp_wrapper = true needs train.compile = true"):
        cfg.resolve(tokenizer_vocab_size=257)


@pytest.mark.skipif(torch_release() < (2, 13),
                    reason="torch < 2.13's C++ wrapper calls the layers' collectives")
def test_cpp_wrapper_refuses_layer_collectives_under_torch_2_13():
    cfg = load_config(None, [*TINY, "train.compile=true", "train.compile_cpp_wrapper=true", "parallel.tp=2"])
    with pytest.raises(ConfigError, match=r"train.compile_cpp_wrapper = true with parallel.tp = 2 needs torch < 2.13"):
        cfg.resolve(world_size=2, tokenizer_vocab_size=257)
