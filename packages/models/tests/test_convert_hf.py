"""HF GPT-2 and Llama checkpoints: converted logits, greedy generation and the round trip."""

import json

import pytest
import torch
from safetensors.torch import load_file

from mtl.core.config import RunConfig
from mtl.core.config_io import config_from_dict
from mtl.core.errors import CheckpointError, ConfigError
from mtl.models.convert_hf import HFConverter
from mtl.models.generate import generate
from mtl.models.gpt import build_gpt
from mtl.models.param_layout import load_global_state

transformers = pytest.importorskip("transformers")

VOCAB = 100  # not a multiple of 128: the converter pads and un-pads


def save_gpt2(path, **overrides):
    config = transformers.GPT2Config(
        **{"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 32,
           "activation_function": "gelu", "bos_token_id": 0, "eos_token_id": 0, "initializer_range": 0.3,
           **overrides},
    )
    torch.manual_seed(1)
    model = transformers.GPT2LMHeadModel(config).eval()
    _randomize_norms(model)
    model.save_pretrained(path)
    return model


def save_llama(path, **overrides):
    fields = {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rope_theta": 500.0,
        "bos_token_id": 0, "eos_token_id": 0, "initializer_range": 0.2,
    }
    fields.update(overrides)
    torch.manual_seed(2)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    _randomize_norms(model)
    model.save_pretrained(path)
    return model


def _randomize_norms(model):
    """HF initialises norms to exactly one and biases to zero; perturb them so a swapped or
    dropped tensor changes the output."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))


def mtl_model(section, state, backend, single):
    config = config_from_dict({"model": section}).resolve(1)
    model = build_gpt(config, single, backend).eval()
    load_global_state(model, single, state)
    return model


@pytest.mark.parametrize("arch", ["gpt2", "llama", "llama_tied_biased"])
def test_converted_logits_and_greedy_generation_match_hf(tmp_path, backend, single, arch):
    if arch == "gpt2":
        hf_model = save_gpt2(tmp_path)
    elif arch == "llama":
        hf_model = save_llama(tmp_path)
    else:
        hf_model = save_llama(tmp_path, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
    section, state = HFConverter().to_mtl(tmp_path)
    model = mtl_model(section, state, backend, single)

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model(ids).logits  # [b, s, V]
        ours = model(ids)[..., :VOCAB]  # [b, s, V_padded] -> the true vocabulary
    assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max()

    prompt = [5, 17, 42, 8]
    with torch.no_grad():
        hf_tokens = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt):].tolist()
    assert generate(model, prompt, max_new_tokens=10, temperature=0) == hf_tokens


@pytest.mark.parametrize("save", [save_gpt2, save_llama])
def test_round_trip_is_bit_exact(tmp_path, save):
    save(tmp_path / "hf")
    section, state = HFConverter().to_mtl(tmp_path / "hf", tp=2)
    resolved = config_from_dict({"model": section, "parallel": {"tp": 2}}).resolve(2).model
    assert state["embedding.word_embeddings.weight"].shape[0] == resolved.padded_vocab_size == 256
    assert state["embedding.word_embeddings.weight"][VOCAB:].abs().sum() == 0  # padding rows are zero
    HFConverter().from_mtl(resolved, state, tmp_path / "back")

    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert reloaded.config.vocab_size == VOCAB


def test_exported_config_reloads_in_transformers(tmp_path):
    hf_model = save_llama(tmp_path / "hf")
    section, state = HFConverter().to_mtl(tmp_path / "hf")
    HFConverter().from_mtl(config_from_dict({"model": section}).resolve(1).model, state, tmp_path / "back")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf_model(ids).logits)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_key_value_heads"] == 2


def test_tanh_gelu_is_imported_with_a_warning(tmp_path, backend, single, caplog):
    hf_model = save_gpt2(tmp_path, activation_function="gelu_new")
    section, state = HFConverter().to_mtl(tmp_path)
    assert "tanh-approximated GELU" in caplog.text
    ids = torch.randint(0, VOCAB, (1, 10))
    with torch.no_grad():
        expected, ours = hf_model(ids).logits, mtl_model(section, state, backend, single)(ids)[..., :VOCAB]
    assert (ours - expected).abs().max() <= 1e-2 * expected.abs().max()


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="config.json does not exist"):
        HFConverter().to_mtl(tmp_path)
    save_llama(tmp_path, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ConfigError, match="rope type 'linear'"):
        HFConverter().to_mtl(tmp_path)
    bad = RunConfig()
    bad.model.activation, bad.model.position_embedding = "gelu", "rope"
    with pytest.raises(ConfigError, match="no Hugging Face architecture"):
        HFConverter().from_mtl(bad.resolve(1, VOCAB).model, {}, tmp_path / "out")
