"""A pre-norm ``bert`` model equals Megatron-Core 0.16.1's ``BertModel`` (local spec, tied
decoder, binary head) on the same weights: MLM and binary logits within 1e-5, a padded sample
included. Megatron runs in a subprocess (its model-parallel state is global), one gloo rank on
CPU, with the CUDA calls it makes stubbed as ``megatron_checkpoint_writer.py`` does."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (the test extra)")

from mtl.core.config import RunConfig  # noqa: E402
from mtl.core.plugins import registry  # noqa: E402
from mtl.models.bert import build_encoder  # noqa: E402
from mtl.models.param_layout import load_global_state  # noqa: E402
from mtl.parallel.topology import Topology  # noqa: E402

SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48)
VOCAB, SEQ = 128, 16
# Megatron's names -> ours (the rest are the same)
RENAMES = [("encoder.final_layernorm", "final_norm"), ("encoder.layers", "layers"), ("input_layernorm", "input_norm"),
           ("pre_mlp_layernorm", "pre_mlp_norm"), ("lm_head.layer_norm", "lm_head.norm"),
           ("tokentype_embeddings", "token_type_embeddings")]


def megatron_reference(out: str) -> None:
    """Build Megatron's BertModel from seed 5, run it, save its weights and outputs to ``out``."""
    import contextlib
    import os

    import torch.distributed as dist

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29533"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(5)
    config = TransformerConfig(
        **SHAPE, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5,
        add_bias_linear=True, bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False,
    )
    model = BertModel(config, num_tokentypes=2, transformer_layer_spec=bert_layer_local_spec, vocab_size=VOCAB,
                      max_sequence_length=SEQ, share_embeddings_and_output_weights=True, add_binary_head=True).eval()
    with torch.no_grad():  # Megatron zero-initialises biases and norms: make every tensor count
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    ids, types, mask = inputs()
    with torch.no_grad():
        logits, binary = model(ids, mask, tokentype_ids=types)
    weights = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    torch.save({"weights": weights, "logits": logits, "binary": binary}, out)
    dist.destroy_process_group()


def inputs():
    generator = torch.Generator().manual_seed(9)
    ids = torch.randint(5, VOCAB, (2, SEQ), generator=generator)
    types = (torch.arange(SEQ) >= 7).long().expand(2, SEQ).contiguous()
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, 10:] = 0
    return ids, types, mask


def ours(name: str) -> str:
    for theirs, mine in RENAMES:
        name = name.replace(theirs, mine)
    return name


def test_pre_norm_bert_equals_megatron_core(tmp_path):
    out = tmp_path / "megatron.pt"
    subprocess.run([sys.executable, __file__, str(out)], check=True, capture_output=True)
    reference = torch.load(out)
    config = RunConfig()
    for key, value in dict(SHAPE, family="bert", norm_position="pre", type_vocab_size=2, binary_head=True,
                           normalization="layernorm", norm_eps=1e-5, activation="gelu", position_embedding="learned",
                           bias=True, seq_length=SEQ).items():
        setattr(config.model, key, value)
    config = config.resolve(1, VOCAB)
    model = build_encoder(config, Topology.single(), registry("backend").get("local")).eval()
    load_global_state(model, Topology.single(), {ours(k): v for k, v in reference["weights"].items()})
    ids, types, mask = inputs()
    with torch.no_grad():
        logits = model(ids, token_type_ids=types, padding_mask=mask)
        hidden = model.final_norm(model.encode(ids, token_type_ids=types, padding_mask=mask))
        binary = model.binary_head(model.pooler(hidden))
    real = mask.bool()  # Megatron also masks a padded query's row; its output is never used
    torch.testing.assert_close(logits[real], reference["logits"][real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(binary, reference["binary"], rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    megatron_reference(sys.argv[1])
