"""The gpt family's FLOP and activation counts (``mtl.models.gpt.flops``), Megatron's formulas."""

from mtl.core.config_io import load_config
from mtl.core.flops import memory_per_gpu_bytes
from mtl.core.plugins import registry
from mtl.models.gpt import flops
from mtl.parallel.param_layout import param_layout


REFERENCE = [
    "model.num_layers=24", "model.hidden_size=2048", "model.num_attention_heads=16",
    "model.seq_length=2048", "model.tie_embeddings=false", "train.micro_batch_size=4",
    "train.global_batch_size=32", "train.precision=bf16",
]


def reference_llama(*overrides):
    return load_config(None, [*REFERENCE, *overrides]).resolve(world_size=1, tokenizer_vocab_size=50304)


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


def test_activation_bytes_per_layer_is_megatrons_count_without_the_attention_scores():
    """GPT-2's shape (gelu, 4h MLP, full heads) with hidden dropout: Megatron's 34*s*b*h, its
    s x s term dropped (fused attention keeps none); at tp = 2 with sequence parallelism, half."""
    s, b, h = 2048, 4, 2048
    gpt2 = ("model.activation='gelu'", "model.hidden_dropout=0.1", "model.ffn_hidden_size=8192")
    assert flops.activation_bytes_per_layer(reference_llama(*gpt2)) == s * b * h * 34
    two = load_config(None, [*REFERENCE, *gpt2, "parallel.tp=2", "parallel.sequence_parallel=true"]).resolve(2, 50304)
    assert flops.activation_bytes_per_layer(two) == s * b * h * 34 / 2
    llama = reference_llama()  # swiglu, no dropout: 8 whole + q, k, v, out 8 + 3 ffn-wide halves of 2
    ffn = llama.model.ffn_hidden_size / h
    assert flops.activation_bytes_per_layer(llama) == s * b * h * (8 + 8 + 6 * ffn)
    assert flops.activation_bytes_per_layer(reference_llama("train.recompute='full'")) == 2 * s * b * h
    assert flops.activation_bytes_per_layer(reference_llama("train.precision='fp32'")) == 2 * s * b * h * (16 + 6 * ffn)


def test_eight_b_row_estimate_is_near_its_measured_peak():
    """The 8B Llama-3 row of issue 39 (tp2 x dp2 with sequence parallelism, ZeRO-1, bf16, seq
    8192, micro-batch 1, no recompute) peaked at 66.9 GiB on 4 H200s; the old estimate said 229
    GiB. Weights, grads and optimizer state of 8.03e9 parameters over tp = 2, plus 32 layers."""
    cfg = load_config(None, [
        "model.num_layers=32", "model.hidden_size=4096", "model.num_attention_heads=32",
        "model.num_query_groups=8", "model.ffn_hidden_size=14336", "model.seq_length=8192",
        "model.bias=false", "model.tie_embeddings=false", "train.micro_batch_size=1", "train.global_batch_size=16",
        "train.precision='bf16'", "parallel.tp=2", "parallel.sequence_parallel=true",
        "parallel.distributed_optimizer=true",
    ]).resolve(world_size=4, tokenizer_vocab_size=128256)
    memory = memory_per_gpu_bytes(cfg, 8.03e9, flops.activation_bytes_per_layer(cfg))
    assert abs(memory["total"] / 2**30 - 66.9) / 66.9 < 0.10, memory["total"] / 2**30


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
