"""HF GPT-2, Llama (plain, tied, biased, Llama 3 RoPE scaling), Mistral and Qwen2 checkpoints,
and the mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE: converted logits and greedy
generation against transformers, and the round trip."""

import json

import pytest
import torch
from safetensors.torch import load_file

from mtl.core.config import RunConfig
from mtl.core.config_io import config_from_dict
from mtl.core.errors import CheckpointError, ConfigError
from mtl.models.convert_hf import HFConverter
from mtl.models.convert_hf.safetensors_io import SafetensorsReader
from mtl.models.generate import generate
from mtl.models.gpt import build_gpt
from mtl.models.gpt.rope import RotaryEmbedding
from mtl.models.param_layout import gather_global_state, load_global_state

transformers = pytest.importorskip("transformers")

VOCAB = 100  # not a multiple of 128: the model pads its tables, the global tensors do not
LLAMA_FIELDS = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rope_theta": 500.0,
    "bos_token_id": 0, "eos_token_id": 0, "initializer_range": 0.2,
}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500.0}
MOE_FIELDS = {**LLAMA_FIELDS, "num_hidden_layers": 3, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}
QWEN_MOE_FIELDS = {**MOE_FIELDS, "num_experts": 4, "moe_intermediate_size": 16, "use_sliding_window": False}
MOE_FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**MOE_FIELDS, "num_local_experts": 4, "sliding_window": None}),
    # layer 1 sparse (decoder_sparse_step 2), layers 0 and 2 dense; top-k weights not renormalised
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        **QWEN_MOE_FIELDS, "shared_expert_intermediate_size": 24, "decoder_sparse_step": 2, "norm_topk_prob": False}),
    # every layer sparse but layer 2 (mlp_only_layers); top-k renormalised; QK-norm
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        **QWEN_MOE_FIELDS, "head_dim": 16, "mlp_only_layers": [2], "norm_topk_prob": True}),
}
MOE_LAYERS = {"mixtral": [0, 1, 2], "qwen2_moe": [1], "qwen3_moe": [0, 1]}
# name -> (transformers config class, model class, config fields)
FAMILIES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {
        "vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 32,
        "activation_function": "gelu", "bos_token_id": 0, "eos_token_id": 0, "initializer_range": 0.3}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA_FIELDS),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", {**LLAMA_FIELDS, "tie_word_embeddings": True}),
    "llama_tied_biased": ("LlamaConfig", "LlamaForCausalLM", {
        **LLAMA_FIELDS, "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    # head_dim 8: of the 4 frequencies one is kept, one blended and two scaled
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", {
        **LLAMA_FIELDS, "max_position_embeddings": 256, "rope_parameters": LLAMA3_ROPE}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**LLAMA_FIELDS, "sliding_window": None}),
    "mistral_window_covers_all": ("MistralConfig", "MistralForCausalLM", {**LLAMA_FIELDS, "sliding_window": 64}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**LLAMA_FIELDS, "use_sliding_window": False}),
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", {
        **LLAMA_FIELDS, "use_sliding_window": False, "tie_word_embeddings": True}),
    **MOE_FAMILIES,
}


def save_hf(path, family: str, max_shard_size=None, **overrides):
    config_class, model_class, fields = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**fields, **overrides})
    torch.manual_seed(sorted(FAMILIES).index(family))
    model = getattr(transformers, model_class)(config).eval()
    _randomize_norms(model)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model


def reload_matches(directory, hf_model):
    """transformers loads the export in ``directory``; its logits equal ``hf_model``'s exactly."""
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf_model(ids).logits)
    return reloaded


def _randomize_norms(model):
    """HF initialises norms to exactly one, biases to zero and MoE routers (Qwen) to zero;
    perturb them so a swapped or dropped tensor changes the output and routing is decisive."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight") and "proj" not in name:  # routers and Qwen2-MoE's shared-expert gate
                param.normal_(0.0, 0.5)
            elif "norm" in name or "ln_" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))


def mtl_model(section, state, backend, single):
    config = config_from_dict({"model": section}).resolve(1)
    model = build_gpt(config, single, backend).eval()
    load_global_state(model, single, state)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_logits_and_greedy_generation_match_hf(tmp_path, backend, single, family):
    hf_model = save_hf(tmp_path, family)
    section, state = HFConverter().to_mtl(tmp_path)
    model = mtl_model(section, state, backend, single)
    assert state["embedding.word_embeddings.weight"].shape == (VOCAB, 32)  # no padding rows

    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
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


@pytest.mark.parametrize("family", ["gpt2", "llama", "llama_tied", "llama3_rope", "mistral", "qwen2", "qwen2_tied",
                                    *MOE_FAMILIES])
def test_round_trip_is_bit_exact(tmp_path, backend, single, family):
    """HF -> mtl -> (a model, gathered back) -> HF gives every tensor back unchanged, the same
    architecture, and a config transformers reads to the same logits."""
    hf_model = save_hf(tmp_path / "hf", family)
    section, state = HFConverter().to_mtl(tmp_path / "hf")
    model = mtl_model(section, state, backend, single)
    resolved = model.config.model
    HFConverter().from_mtl(resolved, gather_global_state(model, single), tmp_path / "back",
                           architecture=hf_model.config.model_type)

    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    reloaded = reload_matches(tmp_path / "back", hf_model)
    assert type(reloaded) is type(hf_model) and reloaded.config.vocab_size == VOCAB


def test_default_export_architecture_follows_the_biases(tmp_path):
    save_hf(tmp_path / "hf", "qwen2")
    section, state = HFConverter().to_mtl(tmp_path / "hf")
    assert section["qkv_bias"] and not section["bias"]
    HFConverter().from_mtl(config_from_dict({"model": section}).resolve(1).model, state, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    with pytest.raises(ConfigError, match="q/k/v biases alone export as Qwen2"):
        HFConverter().from_mtl(config_from_dict({"model": section}).resolve(1).model, state, tmp_path / "x",
                               architecture="llama")


def test_sharded_checkpoints_both_ways(tmp_path):
    """A sharded HF checkpoint (index.json) imports; an export past max_shard_bytes is sharded."""
    hf_model = save_hf(tmp_path / "hf", "llama", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    section, state = HFConverter().to_mtl(tmp_path / "hf")
    files = HFConverter().from_mtl(config_from_dict({"model": section}).resolve(1).model, state,
                                   tmp_path / "back", max_shard_bytes=20_000)
    assert len(files) > 1
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(files)
    reload_matches(tmp_path / "back", hf_model)
    reader = SafetensorsReader(tmp_path / "back")
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(reader.get(name), tensor), name


def test_llama3_rope_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(**{**LLAMA_FIELDS, "head_dim": 64, "max_position_embeddings": 256,
                                            "rope_parameters": LLAMA3_ROPE})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    m = config_from_dict({"model": {"hidden_size": 256, "num_attention_heads": 4, "head_dim": 64, "rope_theta": 500.0,
                                    "rope_scaling": "llama3", "rope_scaling_factor": 4.0,
                                    "rope_original_max_position_embeddings": 64, "vocab_size": VOCAB}}).resolve(1).model
    ours = RotaryEmbedding.from_config(m).inv_freq
    assert torch.allclose(ours, expected.float(), rtol=1e-6, atol=0)
    plain = RotaryEmbedding.from_config(config_from_dict({"model": {"hidden_size": 256, "num_attention_heads": 4,
                                                                    "head_dim": 64, "vocab_size": VOCAB}}).resolve(1).model)
    assert not torch.equal(plain.inv_freq, ours)


def test_unsupported_features_are_refused_by_name(tmp_path):
    with pytest.raises(CheckpointError, match="config.json does not exist"):
        HFConverter().to_mtl(tmp_path)
    cases = [
        ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope type 'linear'"),
        ("mistral", {"sliding_window": 16}, "sliding_window = 16 is smaller than max_position_embeddings = 64"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, "use_sliding_window"),
        ("llama", {"attention_bias": True, "mlp_bias": False}, "attention_bias = True and mlp_bias = False"),
    ]
    for i, (family, overrides, message) in enumerate(cases):
        save_hf(tmp_path / str(i), family, **overrides)
        with pytest.raises(ConfigError, match=message):
            HFConverter().to_mtl(tmp_path / str(i))
    bad = RunConfig()
    bad.model.activation, bad.model.position_embedding = "gelu", "rope"
    with pytest.raises(ConfigError, match="no Hugging Face architecture"):
        HFConverter().from_mtl(bad.resolve(1, VOCAB).model, {}, tmp_path / "out")


def test_a_tensor_without_a_place_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_hf(tmp_path, "llama")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    del tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="tensor model.norm.weight is missing"):
        HFConverter().to_mtl(tmp_path)
    tensors["model.norm.weight"] = torch.ones(32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="self_attn.extra.weight"):
        HFConverter().to_mtl(tmp_path)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_config_keys(tmp_path, family):
    """Which layers are sparse, the expert width, and HF's aux-loss coefficient (its loss is top_k
    times ours, and one loss over all MoE layers' tokens where ours is one per layer); back in
    config.json as they came, and the architecture follows from the model."""
    save_hf(tmp_path / "hf", family)
    section, state = HFConverter().to_mtl(tmp_path / "hf")
    m = config_from_dict({"model": section}).resolve(1).model
    assert m.moe_layers == MOE_LAYERS[family] and m.num_experts == 4 and m.moe_top_k == 2
    assert m.moe_aux_loss_coeff == pytest.approx(2 * 0.02 / len(MOE_LAYERS[family]))
    assert state["layers.1.mlp.experts.linear_fc1.weight"].shape == (4, 2, m.moe_ffn_hidden_size, 32)
    HFConverter().from_mtl(m, state, tmp_path / "back")
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["model_type"] == family and written["router_aux_loss_coef"] == pytest.approx(0.02)


@pytest.mark.parametrize("architecture", ["gpt2", "llama", "mistral", "qwen2"])
def test_a_model_with_experts_is_not_exported_as_a_dense_architecture(tmp_path, architecture):
    save_hf(tmp_path / "hf", "mixtral")
    section, state = HFConverter().to_mtl(tmp_path / "hf")
    m = config_from_dict({"model": section}).resolve(1).model
    with pytest.raises(ConfigError, match=rf"{architecture}' has dense MLPs only.*model.num_experts = 4"):
        HFConverter().from_mtl(m, state, tmp_path / "out", architecture=architecture)
    assert not (tmp_path / "out").exists()  # refused before anything is written


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_converted_aux_loss_weighs_like_hf(tmp_path, backend, single, family):
    """The converted coefficient gives the summed per-layer aux losses about the size of HF's
    one pooled loss (equal for identical layers; with the coefficient times the number of MoE
    layers it was that many times HF's)."""
    hf_model = save_hf(tmp_path, family, output_router_logits=True)
    section, state = HFConverter().to_mtl(tmp_path)
    model = mtl_model(section, state, backend, single).train()
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf_aux = hf_model.config.router_aux_loss_coef * hf_model(ids).aux_loss.item()
        model(ids)
    ours = sum(m.stats.sums["aux_loss"].item() for m in model.modules() if hasattr(m, "stats"))
    assert 0.7 < ours / hf_aux < 1.4, (ours, hf_aux)


def test_qwen2_moe_without_qkv_biases_round_trips(tmp_path, backend, single):
    """config.json's qkv_bias = false imports as model.qkv_bias = false and exports back so."""
    hf_model = save_hf(tmp_path / "hf", "qwen2_moe", qkv_bias=False)
    section, state = HFConverter().to_mtl(tmp_path / "hf")
    model = mtl_model(section, state, backend, single)
    assert not model.config.model.qkv_bias
    HFConverter().from_mtl(model.config.model, gather_global_state(model, single), tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["qkv_bias"] is False
    reload_matches(tmp_path / "back", hf_model)


def test_moe_exports_that_do_not_fit_are_refused(tmp_path):
    save_hf(tmp_path / "qwen2_moe", "qwen2_moe")
    section, state = HFConverter().to_mtl(tmp_path / "qwen2_moe")
    m = config_from_dict({"model": section}).resolve(1).model
    with pytest.raises(ConfigError, match="q/k/v biases alone export as Qwen2"):
        HFConverter().from_mtl(m, state, tmp_path / "x", architecture="mixtral")
    with pytest.raises(ConfigError, match="Qwen3MoeForCausalLM export needs model.qk_norm = true"):
        HFConverter().from_mtl(m, state, tmp_path / "x", architecture="qwen3_moe")
    dense = {**section, "num_experts": 0, "moe_layers": None, "moe_shared_expert_ffn_hidden_size": 0,
             "moe_shared_expert_gate": False}
    with pytest.raises(ConfigError, match="needs model.num_experts > 0"):
        HFConverter().from_mtl(config_from_dict({"model": dense}).resolve(1).model, {}, tmp_path / "x",
                               architecture="qwen2_moe")
    save_hf(tmp_path / "qwen3_moe", "qwen3_moe")
    section, state = HFConverter().to_mtl(tmp_path / "qwen3_moe")
    no_qk_norm = config_from_dict({"model": {**section, "qk_norm": False}}).resolve(1).model
    with pytest.raises(ConfigError, match=r"every layer is MoE in Mixtral \(model.moe_layers = \[0, 1\]\)"):
        HFConverter().from_mtl(no_qk_norm, state, tmp_path / "x", architecture="mixtral")
    shared = config_from_dict({"model": {**section, "qk_norm": False, "moe_layers": None,
                                         "moe_shared_expert_ffn_hidden_size": 24}}).resolve(1).model
    with pytest.raises(ConfigError, match="moe_shared_expert_ffn_hidden_size = 24, but Mixtral has no shared expert"):
        HFConverter().from_mtl(shared, state, tmp_path / "x", architecture="mixtral")
    shared = config_from_dict({"model": {**section, "moe_shared_expert_ffn_hidden_size": 24}}).resolve(1).model
    with pytest.raises(ConfigError, match="moe_shared_expert_ffn_hidden_size = 24, but Qwen3-MoE has no shared expert"):
        HFConverter().from_mtl(shared, state, tmp_path / "x", architecture="qwen3_moe")
    save_hf(tmp_path / "window", "mixtral", sliding_window=16)
    with pytest.raises(ConfigError, match="sliding_window = 16"):
        HFConverter().to_mtl(tmp_path / "window")
