"""The ``bert`` family record: the encoder, its FLOPs, its HF converter, and how the trainer
turns a micro-batch into the model's inputs and its outputs into the loss."""

from __future__ import annotations

from mtl.core.registrations import ModelFamily
from mtl.models.bert import flops
from mtl.models.bert.checks import check_encoder_config
from mtl.models.bert.loss import encoder_forward_inputs, encoder_loss
from mtl.models.bert.model import build_encoder
from mtl.models.convert_hf.bert import bert_converter
from mtl.models.gpt.flops import activation_bytes_per_layer

BERT_FAMILY = ModelFamily(
    name="bert",
    build=build_encoder,
    converters={"hf": bert_converter()},
    description="BERT / RoBERTa encoders (post- or pre-norm, token types, MLM + optional binary head)",
    flops_per_iteration=flops.flops_per_iteration,
    layer_flops_per_iteration=flops.layer_flops_per_iteration,
    activation_bytes_per_layer=activation_bytes_per_layer,
    forward_inputs=encoder_forward_inputs,
    loss=encoder_loss,
    check_config=check_encoder_config,
)
