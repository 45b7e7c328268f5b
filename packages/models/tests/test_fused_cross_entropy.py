"""GPTModel's loss through the fused LM head + cross-entropy equals the unfused path
(``output_layer.fused_cross_entropy = False``): per-token loss and every parameter's gradient,
GPT-2 style (tied embedding) and Llama style (untied), at tp=1, tp=2 and tp=2 + sequence
parallelism, with the byte tokenizer's 257 words (padded to 384 / 512 rows)."""

import torch

from mtl.core.config import RunConfig
from mtl.core.plugins import registry
from mtl.models.gpt import build_gpt
from mtl.models.param_layout import gather_global_state
from mtl.parallel.sequence_parallel_grads import allreduce_sequence_parallel_grads
from mtl.parallel.tensor_parallel.linear_cross_entropy import supports_fused_cross_entropy
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology

VOCAB = 257
SEED = 3


STYLES = {  # as conftest's (which spawned ranks cannot import)
    "gpt2": dict(normalization="layernorm", activation="gelu", position_embedding="learned", bias=True,
                 tie_embeddings=True),
    "llama": dict(normalization="rmsnorm", activation="swiglu", position_embedding="rope", bias=False,
                  tie_embeddings=False, num_query_groups=2, qk_norm=True),
}


def tiny_config(style: str, tp: int, sequence_parallel: bool) -> RunConfig:
    config = RunConfig()
    for key, value in dict(STYLES[style], num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16).items():
        setattr(config.model, key, value)
    config.parallel.tp, config.parallel.sequence_parallel = tp, sequence_parallel
    config.train.seed = SEED
    return config.resolve(tp, VOCAB)


def batch():
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels[0, :3] = torch.tensor([0, 256, 255])
    mask = (torch.rand(2, 16, generator=g) > 0.2).float()  # the trainer's loss mask
    return ids, labels, mask


def run(config, fused: bool, autocast: bool = False):
    topology = Topology.build(tp=config.parallel.tp)
    model = build_gpt(config, topology, registry("backend").get("local"))
    if not fused:
        model.output_layer.fused_cross_entropy = False
    assert supports_fused_cross_entropy(model.output_layer) == fused
    ids, labels, mask = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(ids, labels=labels)
    assert loss.shape == (2, 16) and loss.dtype == torch.float32
    ((loss * mask).sum() / mask.sum()).backward()
    allreduce_sequence_parallel_grads(model.parameters(), topology.tp_group)  # what DataParallel does
    return loss.detach(), gather_global_state(model, topology, grads=True)


def compare(a, b, rtol, atol, what):
    torch.testing.assert_close(a[0], b[0], rtol=rtol, atol=atol, msg=lambda m: f"{what} loss: {m}")
    assert a[1].keys() == b[1].keys()
    for name, ref in b[1].items():
        torch.testing.assert_close(a[1][name], ref, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{what} {n}: {m}")


def configs(tp: int):
    out = {}
    for style in ("gpt2", "llama"):
        for sp in ((False, True) if tp > 1 else (False,)):
            out[(style, sp)] = tiny_config(style, tp, sp)
    return out


def fused_vs_unfused(tp: int):
    torch.set_num_threads(1)
    for (style, sp), config in configs(tp).items():
        fused, unfused = run(config, True), run(config, False)
        compare(fused, unfused, 1e-5, 1e-6, f"tp={tp} {style} sp={sp}")
    return {key: run(config, True) for key, config in configs(tp).items()}


def test_fused_equals_unfused_at_tp1_and_under_bf16_autocast():
    results = fused_vs_unfused(1)
    assert set(results) == {("gpt2", False), ("llama", False)}
    for style in ("gpt2", "llama"):
        config = configs(1)[(style, False)]
        compare(run(config, True, autocast=True), run(config, False, autocast=True), 1e-2, 1e-3, f"bf16 {style}")


def test_fused_at_tp2_and_sequence_parallel_equals_unfused_and_tp1():
    single = fused_vs_unfused(1)
    rank0, rank1 = run_distributed(fused_vs_unfused, 2, (2,))
    for (style, sp), result in rank0.items():
        compare(result, single[(style, False)], 1e-5, 1e-6, f"tp=2 {style} sp={sp} vs tp=1")
        compare(rank1[(style, sp)], result, 0, 0, "rank 1 vs rank 0")
