"""``train.attention_kernel = "fa4"``: FlashAttention-4 behind SDPA gives the numbers cuDNN's
attention gives, compiled, and really runs.

On a Hopper or Blackwell GPU with flash-attn-4 installed (scripts/gpu/fa4_install.sh): a
compiled tiny GPT (bf16, grouped-query attention) trains on real text (the demo corpus, byte
tokenizer) with FA4 and with SDPA's own kernel; the losses agree to bf16's rounding, and the
profiler sees FA4's kernels (not cuDNN's) in the FA4 run's compiled layers. On any machine: the
settings it cannot serve are refused before any work, naming the key, and the saved config of an
FA4 run resolves for inference and export on a CPU (with SDPA).
"""

import importlib.util

import pytest
import torch

from mtl.core.config_io import load_config
from mtl.core.errors import ConfigError
from mtl.train.testing import TINY

GPU_TINY = [o for o in TINY if not o.startswith(("train.device", "model.hidden_size", "model.num_attention_heads",
                                                 "model.seq_length", "data.dataset", "train.iters"))] + [
    "train.device='cuda'", "model.hidden_size=256", "model.num_attention_heads=4", "model.seq_length=128",
    "train.precision='bf16'", "train.compile=true", "train.iters=6",
]


def _fa4_runs_here() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)
            and importlib.util.find_spec("flash_attn") is not None)


@pytest.mark.parametrize("overrides, named", [
    (["train.device='cpu'"], "a CPU run"),
    (["model.attention_dropout=0.1"], "model.attention_dropout = 0.1"),
])
def test_fa4_refuses_what_it_cannot_serve(overrides, named):
    cfg = load_config(None, [*TINY, "train.attention_kernel='fa4'", *overrides])
    with pytest.raises(ConfigError, match=rf"train.attention_kernel = 'fa4' does not work with {named}"):
        cfg.resolve(tokenizer_vocab_size=257)


def test_fa4_refuses_transformer_engines_attention():
    # the te backend's own check (TE installed?) runs first in resolve(); this one alone
    from mtl.core.config import ModelConfig, ParallelConfig, TrainConfig
    from mtl.core.config_feature_checks import check_attention_kernel

    with pytest.raises(ConfigError, match=r"does not work with model.backend = 'te'"):
        check_attention_kernel(ModelConfig(backend="te"), ParallelConfig(), TrainConfig(attention_kernel="fa4"))


def test_fa4_refuses_context_parallelism():
    cfg = load_config(None, [*TINY, "train.attention_kernel='fa4'", "parallel.cp=2"])
    with pytest.raises(ConfigError, match=r"train.attention_kernel = 'fa4' does not work with parallel.cp = 2"):
        cfg.resolve(world_size=2, tokenizer_vocab_size=257)


def test_unknown_attention_kernel_named():
    with pytest.raises(ConfigError, match=r"train.attention_kernel = 'flash' is not one of sdpa, fa4"):
        load_config(None, [*TINY, "train.attention_kernel='flash'"]).resolve(tokenizer_vocab_size=257)


def test_an_fa4_run_config_resolves_for_cpu_inference_and_export():
    from mtl.train.inference import single_process_config

    saved = load_config(None, [*TINY, "train.attention_kernel='fa4'", "train.device='auto'"]).to_dict()
    config = single_process_config(saved).resolve(tokenizer_vocab_size=257)
    assert config.train.attention_kernel == "sdpa"


def test_activation_refuses_a_cpu_device():
    from mtl.parallel.backend_local.fa4 import activate_fa4

    with pytest.raises(ConfigError, match=r"needs a CUDA device; this run uses cpu"):
        activate_fa4(torch.device("cpu"))


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn-4 is installed here")
def test_missing_package_names_the_install():
    from mtl.parallel.backend_local import fa4

    with pytest.raises(ConfigError, match=r"pip install flash-attn-4"):
        fa4._interface()


def _train(tmp_path, name, overrides):
    from mtl.data.demo_corpus import write_demo_corpus
    from mtl.data.preprocess import preprocess
    from mtl.train.loop import train

    corpus = tmp_path / "demo.jsonl"
    if not corpus.exists():
        write_demo_corpus(str(corpus), num_docs=200, seed=0)
        preprocess(str(corpus), str(tmp_path / "demo"), "byte", append_eod=True, progress=False)
    cfg = load_config(None, [*GPU_TINY, "data.dataset='gpt'", f"data.paths=['{tmp_path / 'demo'}']",
                             f"data.cache_dir='{tmp_path / 'cache'}'", f"logging.dir='{tmp_path / name}'", *overrides])
    return list(train(cfg, progress=False).losses.values())


@pytest.mark.skipif(not _fa4_runs_here(), reason="needs a Hopper/Blackwell GPU and flash-attn-4")
def test_fa4_trains_as_sdpa_does_and_runs_its_kernels(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    from mtl.parallel.backend_local.fa4 import deactivate_fa4

    torch._dynamo.reset()
    sdpa = _train(tmp_path, "sdpa", [])
    try:
        torch._dynamo.reset()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fa4 = _train(tmp_path, "fa4", ["train.attention_kernel='fa4'"])
        kernels = [e.key for e in prof.key_averages() if "flash" in e.key.lower() or "sdpa" in e.key.lower()]
    finally:
        deactivate_fa4()
    assert any("flash_attncute" in k for k in kernels), kernels
    assert not any("cudnn" in k for k in kernels), kernels
    assert len(fa4) == len(sdpa) == 6
    # the same model and data; the kernels round differently in bf16 (per-step loss, relative)
    for a, b in zip(sdpa, fa4):
        assert abs(a - b) <= 2e-2 * abs(a), (sdpa, fa4)
    assert fa4[-1] < fa4[0]
