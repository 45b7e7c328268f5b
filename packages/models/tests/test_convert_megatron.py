"""Megatron-Core torch_dist checkpoints -> mtl: the converted model's logits equal Megatron's.

``megatron_checkpoint_writer.py`` (run as a subprocess: Megatron's save spawns processes)
builds a tiny Megatron-Core GPTModel (Llama style, GPT-2 style, or MoE with a gated shared
expert) at a TP/PP layout, runs it on fixed tokens and saves it; we convert, build mtl's
model at tp=1 and compare logits on the true vocabulary. The MoE checkpoints cover both of
Megatron's expert layouts: grouped and stacked over layers (every layer MoE, tp=2), and one
key per layer and per expert with the gated fc1 halves apart (``singleton_local_shards``). Megatron-Core saves its local spec's norms under the Transformer-Engine names
(``self_attention.linear_qkv.layer_norm_weight``); the local names (``input_layernorm``) are
tested by re-saving a real checkpoint's tensors renamed.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (the test extra)")
import torch.distributed.checkpoint as dcp  # noqa: E402

from mtl.core.config_io import config_from_dict  # noqa: E402
from mtl.core.errors import CheckpointError, ConfigError  # noqa: E402
from mtl.core.plugins import registry  # noqa: E402
from mtl.models.convert_megatron import MegatronConverter  # noqa: E402
from mtl.models.convert_megatron.dcp_reader import MegatronCheckpoint  # noqa: E402
from mtl.models.param_layout import global_layout, load_global_state  # noqa: E402
from mtl.parallel.topology import Topology  # noqa: E402

WRITER = Path(__file__).with_name("megatron_checkpoint_writer.py")
_spec = importlib.util.spec_from_file_location("megatron_checkpoint_writer", WRITER)
writer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(writer)  # tests import by path (pytest's importlib mode); it imports no megatron here
VOCAB = 257
# what a bare checkpoint (no Megatron-LM args) cannot tell; the writer's model
BARE_OPTIONS = dict(
    num_attention_heads=8, num_query_groups=2, normalization="RMSNorm", norm_eps=1e-6,
    activation="swiglu", position_embedding="rope", rope_theta=500000,
)
LAYOUTS = {
    "tp1": {"tp": 1},
    "tp2": {"tp": 2},
    "pp2_bare": {"pp": 2, "bare": True},
    # LayerNorm with biases, GELU, learned positions, all linear biases, tied output
    "gpt2_tp2": {"tp": 2, "style": "gpt2"},
    # experts in layers 1 and 3, one key per expert; its args record --vocab-size 257
    "moe_singleton": {"style": "moe", "singleton": True},
    "moe_all_tp2": {"tp": 2, "style": "moe_all"},  # experts in every layer, stacked
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Every layout's checkpoint, written in one spawn of two processes on first use (each
    spawn costs Megatron-Core's import per process): {layout: out_dir}."""
    root = tmp_path_factory.mktemp("megatron_written")
    outs = {layout: root / layout for layout in LAYOUTS}
    jobs = [{"out": str(outs[layout]), **options} for layout, options in LAYOUTS.items()]
    (root / "jobs.json").write_text(json.dumps(jobs))
    done = []

    def get(layout: str) -> Path:
        if not done:
            result = subprocess.run(
                [sys.executable, str(WRITER), "--write", str(root / "jobs.json"), "--world-size", "2",
                 "--port", str(writer.free_port())], capture_output=True, text=True, timeout=600,
            )
            assert result.returncode == 0, result.stderr[-4000:]
            done.append(True)
        return outs[layout]

    return get


def mtl_logits(section: dict, state: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    config = config_from_dict({"model": section, "train": {"precision": "fp32"}}, source="test").resolve(world_size=1)
    model = registry("model family").get("gpt").build(config, Topology.single(), registry("backend").get("local"))
    state = dict(state)
    layout = global_layout(model, Topology.single())
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        # Before the lead's "padding is invisible" change the global tensors keep the padded
        # vocabulary rows; give them zeros then (they only add logit columns past the vocabulary).
        if name in state and layout[name][1][0] > state[name].shape[0]:
            rows = layout[name][1][0]
            state[name] = torch.cat((state[name], state[name].new_zeros(rows - state[name].shape[0], state[name].shape[1])))
    load_global_state(model, Topology.single(), state)
    model.eval()
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_equal_megatron(written, layout):
    out = written(layout)
    options = BARE_OPTIONS if LAYOUTS[layout].get("bare") else {}
    section, state = MegatronConverter().to_mtl(out / "ckpt", vocab_size=VOCAB, **options)
    reference = torch.load(out / "reference.pt")
    assert section["vocab_size"] == reference["vocab_size"] == VOCAB
    assert state["embedding.word_embeddings.weight"].shape == (VOCAB, 64)
    gated = not layout.startswith("gpt2")
    if layout.startswith("moe"):
        assert section["moe_layers"] == ([1, 3] if layout == "moe_singleton" else [0, 1, 2, 3])
        assert state["layers.3.mlp.experts.linear_fc1.weight"].shape == (4, 2, 48, 64)
        assert state["layers.3.mlp.shared_experts.linear_fc1.weight"].shape == (2, 80, 64)
        assert (section["num_experts"], section["moe_top_k"], section["moe_norm_topk_prob"]) == (4, 2, True)
    else:
        assert state["layers.3.mlp.linear_fc1.weight"].shape == ((2, 96, 64) if gated else (96, 64))
    assert ("output_layer.weight" in state) == gated == (not section["tie_embeddings"])
    logits = mtl_logits(section, state, reference["tokens"])
    expected = reference["logits"][..., :VOCAB]
    diff = (logits[..., :VOCAB] - expected).abs().max().item()
    print(f"{layout}: max |logit diff| = {diff:.2e} (logits up to {expected.abs().max():.1f})")
    assert diff <= 1e-5


def _resave(src: Path, dst: Path, rename) -> None:
    """``src``'s tensors re-saved as a DCP checkpoint under ``rename(key)`` (None drops one)."""
    checkpoint = MegatronCheckpoint(src)
    tensors = {}
    for key in checkpoint.tensors:
        new = rename(key)
        if new is not None:
            tensors[new] = checkpoint.read(key)
    dst.mkdir()
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(dst)), no_dist=True)
    for name in ("common.pt", "metadata.json"):
        shutil.copy(src / name, dst / name)


def test_local_norm_names_and_per_layer_keys(written, tmp_path):
    """``input_layernorm``/``pre_mlp_layernorm`` instead of the TE names, and the layers
    stored one tensor each (``decoder.layers.{i}.``) instead of stacked."""
    out = written("tp1")
    te_to_local = {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    }

    def rename(key):
        for te, local in te_to_local.items():
            key = key.replace(te, local)
        return key

    _resave(out / "ckpt", tmp_path / "local", rename)
    checkpoint = MegatronCheckpoint(tmp_path / "local")
    assert "decoder.layers.input_layernorm.weight" in checkpoint.tensors
    section, state = MegatronConverter().to_mtl(tmp_path / "local", vocab_size=VOCAB)

    per_layer = tmp_path / "per_layer"
    per_layer.mkdir()
    tensors = {}
    for key in checkpoint.tensors:
        t = checkpoint.read(key)
        if key.startswith("decoder.layers."):
            tensors.update({key.replace("layers.", f"layers.{i}.", 1): t[i] for i in range(t.shape[0])})
        else:
            tensors[key] = t
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(per_layer)), no_dist=True)
    _, state_per_layer = MegatronConverter().to_mtl(per_layer, vocab_size=VOCAB, **BARE_OPTIONS)

    reference = torch.load(out / "reference.pt")
    expected = reference["logits"][..., :VOCAB]
    for s in (state, state_per_layer):
        assert (mtl_logits(section, s, reference["tokens"])[..., :VOCAB] - expected).abs().max() <= 1e-5


def test_stream_metas_match_tensors(written):
    section, tensors = MegatronConverter().stream_to_mtl(written("tp2") / "ckpt", vocab_size=VOCAB)
    metas = dict(tensors.metas)
    seen = []
    for name, tensor in tensors:
        assert tensor.dtype == torch.float32 and tensor.shape == metas[name].shape, name
        assert tensor.untyped_storage().nbytes() == tensor.numel() * 4, f"{name} is a view of a larger tensor"
        seen.append(name)
    assert seen == list(metas) and len(seen) == 2 + 1 + 4 * 6


def test_bare_checkpoint_names_each_missing_option(written):
    with pytest.raises(ConfigError) as error:
        MegatronConverter().to_mtl(written("pp2_bare") / "ckpt", vocab_size=VOCAB, num_attention_heads=8)
    for option in ("num_query_groups", "normalization", "norm_eps", "activation", "position_embedding"):
        assert option in str(error.value)
    assert "num_attention_heads" not in str(error.value).split("needs:")[1]


def test_without_vocab_size_keeps_stored_rows_and_warns(written, caplog):
    with caplog.at_level(logging.WARNING):
        section, state = MegatronConverter().to_mtl(written("tp1") / "ckpt")
    assert section["vocab_size"] == 384 == state["output_layer.weight"].shape[0]
    assert "true vocabulary" in caplog.text
    with pytest.raises(ConfigError, match="stores 384 vocabulary rows"):
        MegatronConverter().to_mtl(written("tp1") / "ckpt", vocab_size=1000)


def test_refusals(written, tmp_path):
    out = written("tp1")
    _resave(out / "ckpt", tmp_path / "bias", lambda k: k.replace("mlp.linear_fc2.weight", "mlp.router.expert_bias"))
    with pytest.raises(ConfigError, match=r"decoder.layers.mlp.router.expert_bias .*aux-loss-free expert bias"):
        MegatronConverter().to_mtl(tmp_path / "bias", vocab_size=VOCAB)
    _resave(out / "ckpt", tmp_path / "extra", lambda k: k.replace("decoder.final_layernorm", "decoder.extra_norm"))
    with pytest.raises(CheckpointError, match="decoder.extra_norm.weight"):
        MegatronConverter().to_mtl(tmp_path / "extra", vocab_size=VOCAB)
    with pytest.raises(CheckpointError, match="no latest_checkpointed_iteration.txt and no .metadata"):
        MegatronConverter().to_mtl(tmp_path, vocab_size=VOCAB)


def test_save_directory_and_iterations(written, tmp_path, caplog):
    """Megatron-LM's save directory (what --load takes): the tracker's iteration, or another;
    the true vocabulary from the args where they record it (``--vocab-size``)."""
    save = tmp_path / "save"
    shutil.copytree(written("moe_singleton") / "ckpt", save / "iter_0000002")
    shutil.copytree(written("tp1") / "ckpt", save / "iter_0000001")
    with pytest.raises(CheckpointError, match="no latest_checkpointed_iteration.txt.*iter_0000002: pass --iteration"):
        MegatronConverter().to_mtl(save)
    (save / "latest_checkpointed_iteration.txt").write_text("2\n")
    with caplog.at_level(logging.WARNING):
        section, _ = MegatronConverter().to_mtl(save)
    assert section["num_experts"] == 4 and section["vocab_size"] == VOCAB and "true vocabulary" not in caplog.text
    section, _ = MegatronConverter().to_mtl(save, iteration=1, tokenizer_vocab_size=300)
    assert "num_experts" not in section and section["vocab_size"] == 300  # the tokenizer's, lacking args.vocab_size
    with pytest.raises(CheckpointError, match=r"iter_0000003 does not exist \(iteration 3\).*iter_0000001, iter_0000002"):
        MegatronConverter().to_mtl(save, iteration=3)
    with pytest.raises(CheckpointError, match="is one checkpoint"):
        MegatronConverter().to_mtl(save / "iter_0000001", iteration=1)


def test_registered_as_gpt_converter():
    assert isinstance(registry("model family").get("gpt").converters["megatron"], MegatronConverter)
