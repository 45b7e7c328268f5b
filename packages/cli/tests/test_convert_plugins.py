"""``mtl convert --from NAME`` reaches any converter a model family registers, with its options."""

import pytest
import torch

from mtl.core.hookspecs import hookimpl
from mtl.core.plugins import register_plugin, unregister_plugin
from mtl.core.registrations import ModelFamily
from mtl.models.gpt import build_gpt

SECTION = {"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "ffn_hidden_size": 32,
           "normalization": "rmsnorm", "activation": "swiglu", "position_embedding": "rope",
           "tie_embeddings": True, "seq_length": 16}


class ToyConverter:
    """Imports a model from nothing but options (as a Megatron converter takes --vocab-size)."""

    calls: list = []

    def to_mtl(self, src_dir, *, vocab_size=None, **model_options):
        self.calls.append((src_dir, vocab_size, model_options))
        g = torch.Generator().manual_seed(0)
        h, ffn = SECTION["hidden_size"], SECTION["ffn_hidden_size"]
        state = {
            "embedding.word_embeddings.weight": torch.randn(vocab_size, h, generator=g),
            "layers.0.input_norm.weight": torch.ones(h),
            "layers.0.self_attention.linear_qkv.weight": torch.randn(3 * h, h, generator=g),
            "layers.0.self_attention.linear_proj.weight": torch.randn(h, h, generator=g),
            "layers.0.pre_mlp_norm.weight": torch.ones(h),
            "layers.0.mlp.linear_fc1.weight": torch.randn(2, ffn, h, generator=g),
            "layers.0.mlp.linear_fc2.weight": torch.randn(h, ffn, generator=g),
            "final_norm.weight": torch.ones(h),
        }
        return {**SECTION, "vocab_size": vocab_size}, state


class ToyFamilyPlugin:
    @hookimpl
    def mtl_model_families(self):
        return [ModelFamily(name="toy", build=build_gpt, converters={"toy-format": ToyConverter()})]


@pytest.fixture
def toy_family():
    plugin = ToyFamilyPlugin()
    register_plugin(plugin, name="test-toy-family")
    ToyConverter.calls.clear()
    yield plugin
    unregister_plugin(plugin)


def test_from_a_registered_converter_with_vocab_size(tmp_path, mtl, ok, clean_error, toy_family):
    from mtl.ckpt import ShardedTensor, load, read_metadata

    (tmp_path / "src").mkdir()
    out = ok(mtl("convert", "--from", "toy-format", "--to", "mtl", tmp_path / "src", tmp_path / "dst",
                 "--vocab-size", 50, "--tp", 2))
    assert ToyConverter.calls == [(tmp_path / "src", 50, {})]
    assert "no tokenizer files" in out
    metadata = read_metadata(str(tmp_path / "dst"))
    assert metadata["config"]["model"]["family"] == "toy" and metadata["config"]["parallel"]["tp"] == 2
    assert metadata["source_format"] == "toy-format" and metadata["has_tokenizer"] is False
    _, expected = ToyConverter().to_mtl(tmp_path, vocab_size=50)
    key = "model.layers.0.mlp.linear_fc1.weight"
    target = ShardedTensor(key, torch.zeros(2, 32, 16), (2, 32, 16), (0, 0, 0))
    load({key: target}, str(tmp_path / "dst"))
    assert torch.equal(target.data, expected["layers.0.mlp.linear_fc1.weight"])
    # the converter only imports
    clean_error(mtl("convert", "--from", "mtl", "--to", "toy-format", tmp_path / "dst", tmp_path / "out"),
                "only imports")
    assert "toy-format" in mtl("convert", "--from", "nope", "--to", "mtl", tmp_path, tmp_path / "x").output
