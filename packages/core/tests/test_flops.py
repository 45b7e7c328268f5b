from mtl.core.config_io import load_config
from mtl.core.flops import flops_per_iteration, memory_per_gpu_bytes, parameter_count


def reference_llama():
    return load_config(None, [
        "model.num_layers=24", "model.hidden_size=2048", "model.num_attention_heads=16",
        "model.seq_length=2048", "model.tie_embeddings=false", "train.micro_batch_size=4",
        "train.global_batch_size=32", "train.precision=bf16",
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
    assert abs(flops_per_iteration(cfg) - megatron) / megatron < 1e-9
    assert 550e12 < flops_per_iteration(cfg) < 556e12


def test_parameter_count_and_memory_are_consistent():
    cfg = reference_llama()
    counts = parameter_count(cfg)
    assert counts["total"] == sum(v for k, v in counts.items() if k != "total")
    assert 1.40e9 < counts["total"] < 1.42e9
    mem = memory_per_gpu_bytes(cfg)
    assert mem["weights"] == counts["total"] * 6  # fp32 master + bf16 copy
    assert mem["total"] > mem["weights"] + mem["grads"] + mem["optimizer"]
