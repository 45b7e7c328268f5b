"""``train.cuda_graphs``: the captured layers give the numbers the eager layers give.

On a GPU: a few steps of a tiny GPT on real text (the demo corpus, byte tokenizer) with every
backend installed here, graphs on against off, compiled and not, with an evaluation in between
(it runs the layers eagerly) and, for the FP8 backend, the weight cache refreshed in place after
every optimizer step (against no cache); every training layer call is counted as a replay. A
weight replaced after the capture is an error. On any machine: the settings it cannot run with
are refused before any work, naming the key, and the saved config of a run with graphs
resolves for inference and export on a CPU.

bf16 layers replay the eager kernels exactly. FP8 ones match eager to 2.4e-5 in the first loss
(measured on an H100: cuBLASLt's FP8 GEMMs under capture are not bit-equal), and Adam's first
steps, which move each weight by about lr whatever its gradient's size, turn that into ~1e-3
later; the FP8 bound says so."""

import importlib.util

import pytest
import torch

from mtl.core.config_io import load_config
from mtl.core.errors import ConfigError
from mtl.data.demo_corpus import write_demo_corpus
from mtl.data.preprocess import preprocess
from mtl.train.testing import TINY

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GPU_TINY = [o for o in TINY if not o.startswith(("train.device", "train.iters", "model.hidden_size", "data.dataset",
                                                 "model.seq_length", "train.eval_interval", "train.lr="))] + [
    "train.device='cuda'", "train.iters=5", "model.hidden_size=64", "model.seq_length=32",
    "train.precision='bf16'", "train.eval_interval=2", "train.eval_iters=1", "train.lr=1e-2",
]

# name: (overrides, module it needs, relative bound on the first loss, on later ones)
BACKENDS = {
    "local": ([], None, 1e-5, 1e-5),
    "fp8-current": (["model.backend='fp8'", "train.fp8='current'"], "mtl.quant", 1e-4, 1e-2),
    "te": (["model.backend='te'"], "transformer_engine", 1e-5, 1e-5),
    "te-fp8-current": (["model.backend='te'", "train.fp8='current'"], "transformer_engine", 1e-4, 1e-2),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    work = tmp_path_factory.mktemp("corpus")
    write_demo_corpus(str(work / "demo.jsonl"), num_docs=200, seed=0)
    preprocess(str(work / "demo.jsonl"), str(work / "demo"), "byte", append_eod=True, progress=False)
    return ["data.dataset='gpt'", f"data.paths=['{work / 'demo'}']", f"data.cache_dir='{work / 'cache'}'"]


def _train(overrides: list[str]):
    from mtl.train.loop import train  # noqa: PLC0415

    return train(load_config(None, overrides), progress=False)


@pytest.fixture
def replays(monkeypatch):
    """How many layer calls ran as graph replays."""
    from mtl.models.gpt.cuda_graphs import GraphedLayer  # noqa: PLC0415

    calls = []
    original = GraphedLayer.replay

    def counting(self, *args):
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(GraphedLayer, "replay", counting)
    return calls


@needs_cuda
@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_captured_layers_train_as_the_eager_layers(corpus, replays, monkeypatch, backend, compile_):
    overrides, needs, first_bound, later_bound = BACKENDS[backend]
    if needs is not None and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} is not installed")
    if "fp8" in backend and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need sm89+")
    base = [*GPU_TINY, *corpus, *overrides, f"train.compile={str(compile_).lower()}"]
    eager = _train(base).losses
    assert not replays
    graphed = _train([*base, "train.cuda_graphs=true"]).losses
    # every training layer call replayed: 4 layers x 4 micro-batches x 5 steps (evaluation runs eagerly)
    assert len(replays) == 4 * 4 * 5
    assert sorted(graphed) == sorted(eager) == [1, 2, 3, 4, 5]
    for step in eager:
        bound = first_bound if step == 1 else later_bound
        assert graphed[step] == pytest.approx(eager[step], rel=bound, abs=0), (backend, step, graphed, eager)
    if backend == "fp8-current":
        # the FP8 weight cache, refreshed in place before the replays, against no cache (every
        # replay quantizes the weight itself): the same kernels under capture, so equal
        from mtl.quant.weight_cache import weight_caching

        with weight_caching(False):
            uncached = _train([*base, "train.cuda_graphs=true"]).losses
        assert uncached == pytest.approx(graphed, rel=1e-6, abs=0), (uncached, graphed)


@needs_cuda
def test_a_weight_moved_after_the_capture_is_an_error_not_a_replay(corpus):
    result = _train([*GPU_TINY, *corpus, "train.cuda_graphs=true", "train.iters=1"])
    model = getattr(result.run.chunks[0], "module", result.run.chunks[0])
    weight = model.layers["2"].self_attention.linear_proj.weight
    weight.data = weight.data.clone()  # a new tensor: the graphs still read the old one
    from mtl.train.cuda_graphs import capture_or_check  # noqa: PLC0415

    with pytest.raises(RuntimeError, match=r"layers\.2\.self_attention\.linear_proj\.weight moved"):
        capture_or_check(result.config, result.run.chunks, torch.device("cuda"))


@pytest.mark.parametrize("setting, named", [
    ("parallel.pp=2", "parallel.pp = 2"),
    ("train.recompute='full'", "train.recompute = 'full'"),
    ("model.hidden_dropout=0.1", "model.hidden_dropout = 0.1"),
    ("model.num_experts=4", "model.num_experts = 4"),
    ("train.precision='bf16'", "train.params_dtype = 'fp32' with precision 'bf16'"),
])
def test_settings_it_cannot_capture_are_refused_up_front(setting, named):
    overrides = [*TINY, "train.cuda_graphs=true", setting]
    if setting.startswith("train.precision"):
        overrides.append("train.params_dtype='fp32'")
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides).resolve(world_size=2 if "pp" in setting else 1, tokenizer_vocab_size=257)
    message = str(info.value)
    assert f"train.cuda_graphs = true does not work with {named}" in message and "train.cuda_graphs = false" in message


def test_data_parallelism_is_refused_until_verified():
    with pytest.raises(ConfigError, match=r"train.cuda_graphs = true does not work with data parallelism \(parallel.dp = 2"):
        load_config(None, [*TINY, "train.cuda_graphs=true"]).resolve(world_size=2, tokenizer_vocab_size=257)


@needs_cuda
def test_a_checkpoint_trained_with_graphs_loads_for_inference_on_a_cpu(corpus, tmp_path):
    from mtl.train.inference import load_for_inference  # noqa: PLC0415

    _train([*GPU_TINY, *corpus, "train.cuda_graphs=true", "train.iters=1", f"ckpt.save='{tmp_path}'"])
    model, _, config = load_for_inference(tmp_path, "cpu")
    assert config.train.cuda_graphs is False and next(model.parameters()).device.type == "cpu"


def test_a_graphs_run_config_resolves_for_cpu_inference_and_export():
    from mtl.core.config import RunConfig  # noqa: PLC0415
    from mtl.train.inference import single_process_config  # noqa: PLC0415

    saved = load_config(None, [*TINY, "train.cuda_graphs=true", "train.device='auto'"]).to_dict()
    assert saved["train"]["cuda_graphs"] is True
    config = single_process_config(saved).resolve(tokenizer_vocab_size=257)
    assert isinstance(config, RunConfig) and config.train.cuda_graphs is False


def test_a_cpu_run_is_refused_before_any_work():
    with pytest.raises(ConfigError, match="train.cuda_graphs = true needs a CUDA device"):
        load_config(None, [*TINY, "train.cuda_graphs=true"]).resolve(tokenizer_vocab_size=257)


def test_a_graphed_call_replays_training_forwards_of_the_captured_shape_only():
    """``GraphedLayer`` stands in the block's layer calls (``layer_calls.py``): it replays the
    graphs in a training forward of the captured shape and calls the layer as before otherwise."""
    from mtl.models.gpt.cuda_graphs import GraphedLayer  # noqa: PLC0415

    layer = torch.nn.Linear(4, 4)
    eager, replayed = [], []

    def call(hidden, *rest):
        eager.append(len(rest))
        return hidden

    def graphs(*tensors):
        replayed.append(len(tensors))
        return tensors[0]

    graphed = GraphedLayer("0", layer, call, graphs, torch.zeros(3, 2, 4))
    hidden, rotary = torch.ones(3, 2, 4), (torch.ones(2, 3, 1, 2), torch.zeros(2, 3, 1, 2))
    graphed(hidden, None, None)
    graphed(hidden, hidden, rotary, None)  # a deferred step's call: pending and the rotary tables
    assert replayed == [1, 4] and not eager
    graphed(hidden, None, object())  # generation (a KV cache)
    graphed(torch.ones(5, 2, 4), None, None)  # another shape
    with torch.no_grad():
        graphed(hidden, None, None)
    layer.eval()
    graphed(hidden, hidden, rotary, None)
    assert replayed == [1, 4] and eager == [2, 2, 2, 3]
