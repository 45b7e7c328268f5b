"""The gpt family's FLOP and activation counts (``mtl.models.gpt.flops``), Megatron's formulas."""

from mtl.core.config_io import load_config
from mtl.core.plugins import registry
from mtl.models.gpt import flops
from mtl.parallel.param_layout import param_layout


def reference_llama(*overrides):
    return load_config(None, [
        "model.num_layers=24", "model.hidden_size=2048", "model.num_attention_heads=16",
        "model.seq_length=2048", "model.tie_embeddings=false", "train.micro_batch_size=4",
        "train.global_batch_size=32", "train.precision=bf16", *overrides,
    ]).resolve(world_size=1, tokenizer_vocab_size=50304)


def test_flops_match_megatron_count_for_reference_model():
    # Megatron's formula (causal attention halved, gated MLP 3/2) for this model: see
    # ../shared/GPU.md, which reports about 552-554 TFLOP per iteration.
    cfg = reference_llama()
    m = cfg.model
    h, s, L, V, B = m.hidden_size, m.seq_length, m.num_layers, m.padded_vocab_size, 32
    megatron = 12 * B * s * L * h * h * (
        (1 + m.num_query_groups / m.num_attention_heads + s / h / 2)
        + m.ffn_hidden_size / h * 1.5
        + V / (2 * L * h)
    )
    assert abs(flops.flops_per_iteration(cfg) - megatron) / megatron < 1e-9
    assert 550e12 < flops.flops_per_iteration(cfg) < 556e12


def test_activation_bytes_per_layer_is_megatrons_formula():
    cfg = reference_llama()
    s, b, h, a = 2048, 4, 2048, 16
    assert flops.activation_bytes_per_layer(cfg) == s * b * h * (34 + 5 * a * s / h)
    assert flops.activation_bytes_per_layer(reference_llama("train.recompute='full'")) == 2 * s * b * h
    assert flops.activation_bytes_per_layer(reference_llama("train.precision='fp32'")) == 2 * s * b * h * (34 + 5 * a * s / h)


def test_the_gpt_family_record_carries_its_formulas():
    family = registry("model family").get("gpt")
    cfg = reference_llama()
    assert family.flops_per_iteration(cfg) == flops.flops_per_iteration(cfg)
    assert family.activation_bytes_per_layer(cfg) == flops.activation_bytes_per_layer(cfg)


def test_moe_counts_the_active_parameters_of_the_built_model():
    """An MoE model's GEMM FLOPs = 6 x tokens x its active matmul weights (router, top-k of the
    experts, shared expert, attention, LM head; not the embedding), plus the attention scores,
    counted here from the model built on the meta device, not from the formula's terms."""
    import torch

    from mtl.models.gpt import build_gpt
    from mtl.parallel.backend_plugin import LOCAL_BACKEND
    from mtl.parallel.topology import Topology

    cfg = reference_llama("model.num_layers=4", "model.num_experts=8", "model.moe_top_k=2",
                          "model.moe_shared_expert_ffn_hidden_size=1024", "model.moe_layer_freq=2")
    m = cfg.model
    with torch.device("meta"):
        model = build_gpt(cfg, Topology.single(), LOCAL_BACKEND)
    active = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.startswith("embedding"):
            continue  # norms and biases are not GEMMs; an embedding is a lookup
        share = m.moe_top_k / m.num_experts if param_layout(p).expert_split_dim is not None else 1.0
        active += p.numel() * share
    tokens = 32 * m.seq_length
    scores = 2 * m.num_attention_heads * m.head_dim * m.seq_length * m.num_layers  # causal-halved QK^T and PV
    assert abs(flops.flops_per_iteration(cfg) - 3 * tokens * (2 * active + scores)) / flops.flops_per_iteration(cfg) < 1e-12
    assert len(m.moe_layers) == 2  # moe_layer_freq = 2: half the layers are MoE
