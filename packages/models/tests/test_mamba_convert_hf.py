"""HF ``Mamba2ForCausalLM`` and ``NemotronHForCausalLM`` (random small ones made here, one with MoE
layers: biased sigmoid routing over two expert groups, scaled weights, squared-ReLU experts and a
shared expert) converted to
the hybrid family: logits within 1e-4 relative, greedy generation equal to transformers'
``generate``, the round trip bit for bit; and generation decodes by the one-step recurrence (no
scan per new token)."""

import pytest
import torch
from safetensors.torch import load_file

from mtl.core.config_io import config_from_dict
from mtl.core.errors import ConfigError
from mtl.core.model_protocol import build_model
from mtl.core.plugins import registry
from mtl.models.generate import generate
from mtl.models.hybrid.hf_converter import hybrid_hf_converter
from mtl.models.mamba import dispatch
from mtl.models.mamba import mixer as mixer_module
from mtl.models.param_layout import gather_global_state, load_global_state
from mtl.parallel.topology import Topology

transformers = pytest.importorskip("transformers")

VOCAB = 100
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "n_groups": 2, "conv_kernel": 4, "chunk_size": 8,
          "initializer_range": 0.2, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
ARCHS = {  # name -> (config class, model class, fields)
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", {
        **COMMON, "num_hidden_layers": 2, "num_heads": 4, "head_dim": 16, "expand": 2, "state_size": 8}),
    # Mamba-2, attention (GQA, no positions), Mamba-2, squared-ReLU MLP
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", {
        **COMMON, "num_hidden_layers": 4, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8,
        "layers_block_type": ["linear_attention", "full_attention", "linear_attention", "mlp"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48}),
    # every Nemotron-H layer kind; 8 experts in 2 groups, each token keeps the better group, 2 experts
    "nemotron_h_moe": ("NemotronHConfig", "NemotronHForCausalLM", {
        **COMMON, "num_hidden_layers": 5, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8,
        "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp", "moe"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
        "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 24}),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def converted(request, tmp_path_factory):
    """(the HF model, its directory, our model built from its conversion)."""
    path = tmp_path_factory.mktemp(request.param)
    config_class, model_class, fields = ARCHS[request.param]
    torch.manual_seed(0)
    hf_model = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields)).eval()
    with torch.no_grad():  # HF starts norms at one and D at one: perturb them so a misplaced tensor shows
        for name, param in hf_model.named_parameters():
            if "norm" in name or name.endswith((".D", "conv1d.bias")):
                param.add_(0.1 * torch.randn_like(param))
        for name, buffer in hf_model.named_buffers():  # zeros at init: a bias large enough to change choices
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    hf_model.save_pretrained(path)
    section, state = hybrid_hf_converter().to_mtl(path)
    config = config_from_dict({"model": section}).resolve(1)
    single = Topology.single()
    model = build_model(registry("model family").get("hybrid"), config, single, registry("backend").get("local"))
    load_global_state(model, single, state)
    return hf_model, path, model.eval()


def test_converted_logits_and_greedy_tokens_match_hf(converted):
    hf_model, _, model = converted
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model(ids).logits
        ours = model(ids)[..., :VOCAB]
    assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max()
    prompt = [5, 17, 42, 8, 9, 60, 3, 11, 30]  # longer than a chunk: the prefill scan spans two
    with torch.no_grad():
        hf_tokens = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(model, prompt, max_new_tokens=12, temperature=0) == hf_tokens


def test_round_trip_is_bit_exact(converted, tmp_path):
    hf_model, path, model = converted
    hybrid_hf_converter().from_mtl(model.config.model, gather_global_state(model, model.topology), tmp_path)
    original, exported = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf_model(ids).logits)


@pytest.mark.parametrize("converted", ["nemotron_h"], indirect=True)  # Mamba-2 states beside a KV cache
def test_generation_scans_the_prompt_once_and_decodes_by_recurrence(converted, monkeypatch):
    """256 new tokens: one chunked scan per Mamba layer (the prompt), then one recurrence step per
    token, so each token's cost does not grow with the position; the same tokens as without cache."""
    _, _, model = converted
    scans = []

    def counted_scan(*args, **kwargs):
        scans.append(args[0].shape[1])  # positions scanned
        return dispatch.ssd_scan(*args, **kwargs)

    monkeypatch.setattr(mixer_module, "ssd_scan", counted_scan)
    prompt = [5, 17, 42, 8, 9]
    tokens = generate(model, prompt, max_new_tokens=256, temperature=0)
    assert len(tokens) == 256
    assert scans == [len(prompt)] * model.config.model.hybrid_pattern.count("M")
    scans.clear()
    assert generate(model, prompt, max_new_tokens=12, temperature=0, use_cache=False) == tokens[:12]


@pytest.mark.parametrize("changes, message", [
    ({"moe_latent_size": 8}, "moe_latent_size = 8; mtl does not build the latent projections"),
    ({"num_experts_per_tok": 4}, "n_group = 2: HF ranks expert groups by their best 2 scores"),
])
def test_nemotron_h_moe_configs_mtl_does_not_build_are_refused(changes, message, tmp_path):
    config_class, _, fields = ARCHS["nemotron_h_moe"]
    getattr(transformers, config_class)(**{**fields, **changes}).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=message):
        hybrid_hf_converter().to_mtl(tmp_path)


@pytest.mark.parametrize("changes, message", [
    ({"moe_router": "softmax"}, "model.moe_router = 'softmax': Nemotron-H's MoE layer needs 'sigmoid'"),
    ({"activation": "swiglu"}, "model.activation = 'swiglu': Nemotron-H's MLP and experts are relu2"),
    ({"moe_shared_expert_ffn_hidden_size": 0}, "model.moe_shared_expert_ffn_hidden_size = 0"),
])
def test_nemotron_h_moe_export_refuses_what_hf_does_not_compute(changes, message, tmp_path):
    model = {"family": "hybrid", "hybrid_pattern": "M*E-", "num_layers": 4, "hidden_size": 32, "vocab_size": VOCAB,
             "mamba_head_dim": 16, "mamba_num_groups": 2, "num_experts": 4, "activation": "relu2",
             "position_embedding": "none", "moe_router": "sigmoid", "moe_shared_expert_ffn_hidden_size": 16}
    config = config_from_dict({"model": {**model, **changes}}).resolve(1)
    with pytest.raises(ConfigError, match=message):
        hybrid_hf_converter().from_mtl(config.model, {}, tmp_path)
