"""The ``t5`` family record: the encoder-decoder, how the trainer feeds it Megatron's T5 sample
fields, and the settings it refuses (what it does not run yet among them)."""

from __future__ import annotations

import torch

from mtl.core.errors import ConfigError
from mtl.core.registrations import ModelFamily
from mtl.models.convert_hf.t5 import t5_converter
from mtl.models.family_keys import T5_ACTIVATIONS, refuse_other_families_keys
from mtl.models.t5 import flops
from mtl.models.t5.generate import t5_generate
from mtl.models.t5.model import build_t5
from mtl.models.t5.stage_payload import pipeline_tensor_shape

FIELDS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask")


def t5_forward_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """T5MaskedWordPieceDataset's fields -> the forward's keywords (the trainer's masked mean of
    the per-token loss over ``loss_mask`` is T5's loss)."""
    missing = [name for name in FIELDS if name not in batch]
    if missing:
        raise ConfigError(f"model.family = 't5' reads the t5 dataset's fields, and the samples lack "
                          f"{', '.join(missing)} (they have {', '.join(sorted(batch))}); set data.dataset = 't5'")
    return {"input_ids": batch["text_enc"], "decoder_input_ids": batch["text_dec"], "labels": batch["labels"],
            "padding_mask": batch["enc_mask"], "decoder_padding_mask": batch["dec_mask"]}


def check_t5_config(cfg) -> None:
    m, p, t, d = cfg.model, cfg.parallel, cfg.train, cfg.data
    refuse_other_families_keys(cfg, "t5")
    refused = [
        (m.activation not in T5_ACTIVATIONS, f"model.activation = '{m.activation}'", "'relu' or 'gated-gelu'"),
        (m.normalization != "rmsnorm", f"model.normalization = '{m.normalization}'", "'rmsnorm' (T5's layer norm)"),
        (m.bias, "model.bias = true", "false (T5 has no biases)"),
        (m.num_query_groups != m.num_attention_heads, f"model.num_query_groups = {m.num_query_groups}",
         f"{m.num_attention_heads} = model.num_attention_heads (T5's attention is multi-head)"),
        (m.num_experts > 0, f"model.num_experts = {m.num_experts}", "0"),
        (m.qkv_bias, "model.qkv_bias = true", "false (T5 has no biases)"),
        (m.qk_norm, "model.qk_norm = true", "false (T5 has none)"),
        (m.attention_dropout != 0, f"model.attention_dropout = {m.attention_dropout}",
         "0 (T5 has one dropout rate: model.hidden_dropout)"),
        # the decoder's sequence is split over TP too (the encoder's is checked for every family)
        (p.sequence_parallel and d.decoder_seq_length % p.tp,
         f"parallel.sequence_parallel = true with data.decoder_seq_length = {d.decoder_seq_length}",
         f"a decoder_seq_length divisible by parallel.tp = {p.tp}, or sequence_parallel = false"),
        # not built: interleaved stages (untested for t5), context parallelism (issue 35 asks it of
        # bert only), CUDA graphs
        (p.vpp > 1, f"parallel.vpp = {p.vpp}", "1 (interleaved t5 pipeline stages are not tested yet)"),
        (p.cp > 1, f"parallel.cp = {p.cp}", "1"),
        (t.cuda_graphs, "train.cuda_graphs = true", "false"),
    ]
    for bad, setting, fix in refused:
        if bad:
            raise ConfigError(f"model.family = 't5' cannot run with {setting}: set it to {fix}")


T5_FAMILY = ModelFamily(
    name="t5",
    build=build_t5,
    description="T5 encoder-decoders (relative position bias, ReLU or gated-GELU MLP, tied+rescaled or untied head)",
    forward_inputs=t5_forward_inputs,
    check_config=check_t5_config,
    converters={"hf": t5_converter()},
    flops_per_iteration=flops.flops_per_iteration,  # TFLOP/s and MFU; no per-layer split: stages split evenly
    pipeline_layers=lambda model: model.num_layers + model.num_decoder_layers,  # encoder's, then decoder's
    pipeline_tensor_shape=pipeline_tensor_shape,
    generate=t5_generate,
)
