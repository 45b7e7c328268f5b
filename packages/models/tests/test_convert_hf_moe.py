"""HF Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints made locally: converted logits within
1e-4 of transformers', greedy generation equal, and HF -> mtl -> HF bit-exact."""

import json

import pytest
import torch
from safetensors.torch import load_file

from mtl.core.config_io import config_from_dict
from mtl.core.errors import ConfigError
from mtl.models.convert_hf import HFConverter
from mtl.models.generate import generate
from mtl.models.gpt import build_gpt
from mtl.models.param_layout import gather_global_state, load_global_state

transformers = pytest.importorskip("transformers")

VOCAB = 100
BASE = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rope_theta": 500.0,
    "bos_token_id": 0, "eos_token_id": 0, "initializer_range": 0.2, "router_aux_loss_coef": 0.02,
}
QWEN_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "use_sliding_window": False}
# name -> (config class, model class, fields)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        **BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    # layer 1 sparse (decoder_sparse_step 2), layers 0 and 2 dense; top-k weights not renormalised
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        **BASE, **QWEN_MOE, "shared_expert_intermediate_size": 24, "decoder_sparse_step": 2, "norm_topk_prob": False}),
    # every layer sparse but layer 2 (mlp_only_layers); top-k renormalised; QK-norm
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        **BASE, **QWEN_MOE, "head_dim": 16, "mlp_only_layers": [2], "norm_topk_prob": True}),
}
MOE_LAYERS = {"mixtral": [0, 1, 2], "qwen2_moe": [1], "qwen3_moe": [0, 1]}


def save_hf(path, family: str, **overrides):
    config_class, model_class, fields = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**fields, **overrides})
    torch.manual_seed(sorted(FAMILIES).index(family))
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # HF starts routers at zero and norms at one: make every tensor matter
        for name, param in model.named_parameters():
            if name.endswith("gate.weight") and "proj" not in name:  # routers and the shared-expert gate
                param.normal_(0.0, 0.5)
            elif "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(path)
    return model


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
    m = model.config.model
    assert m.moe_layers == MOE_LAYERS[family] and m.num_experts == 4 and m.moe_top_k == 2
    assert m.moe_aux_loss_coeff == pytest.approx(2 * 0.02)  # HF's loss is top_k times ours
    assert state["layers.1.mlp.experts.linear_fc1.weight"].shape == (4, 2, m.moe_ffn_hidden_size, 32)

    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model(ids).logits  # [b, s, V]
        ours = model(ids)[..., :VOCAB]
    assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max()

    prompt = [5, 17, 42, 8]
    with torch.no_grad():
        hf_tokens = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt):].tolist()
    assert generate(model, prompt, max_new_tokens=10, temperature=0) == hf_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_exact(tmp_path, backend, single, family):
    hf_model = save_hf(tmp_path / "hf", family)
    section, state = HFConverter().to_mtl(tmp_path / "hf")
    model = mtl_model(section, state, backend, single)
    # the architecture follows from the model (shared expert: qwen2_moe, QK-norm: qwen3_moe, else mixtral)
    HFConverter().from_mtl(model.config.model, gather_global_state(model, single), tmp_path / "back")
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["model_type"] == family and written["router_aux_loss_coef"] == pytest.approx(0.02)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(reloaded) is type(hf_model)
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf_model(ids).logits)


def test_exports_that_do_not_fit_are_refused(tmp_path):
    save_hf(tmp_path / "hf", "qwen2_moe")
    section, state = HFConverter().to_mtl(tmp_path / "hf")
    m = config_from_dict({"model": section}).resolve(1).model
    with pytest.raises(ConfigError, match="q/k/v biases alone export as Qwen2"):
        HFConverter().from_mtl(m, state, tmp_path / "x", architecture="mixtral")
    with pytest.raises(ConfigError, match="Qwen3MoeForCausalLM export needs model.qk_norm = true"):
        HFConverter().from_mtl(m, state, tmp_path / "x", architecture="qwen3_moe")
    dense = config_from_dict({"model": {**section, "num_experts": 0, "moe_layers": None,
                                        "moe_shared_expert_ffn_hidden_size": 0, "moe_shared_expert_gate": False}})
    with pytest.raises(ConfigError, match="needs model.num_experts > 0"):
        HFConverter().from_mtl(dense.resolve(1).model, {}, tmp_path / "x", architecture="qwen2_moe")
    save_hf(tmp_path / "hf3", "qwen3_moe")
    section3, state3 = HFConverter().to_mtl(tmp_path / "hf3")
    no_qk_norm = config_from_dict({"model": {**section3, "qk_norm": False}}).resolve(1).model
    with pytest.raises(ConfigError, match=r"every layer is MoE in Mixtral \(model.moe_layers = \[0, 1\]\)"):
        HFConverter().from_mtl(no_qk_norm, state3, tmp_path / "x", architecture="mixtral")
    save_hf(tmp_path / "window", "mixtral", sliding_window=16)
    with pytest.raises(ConfigError, match="sliding_window = 16"):
        HFConverter().to_mtl(tmp_path / "window")
