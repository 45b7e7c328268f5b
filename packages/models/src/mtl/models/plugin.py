"""Registers the ``gpt``, ``bert``, ``t5`` and ``hybrid`` model families through the ``mtl_model_families`` hook
(entry point ``gpt_family``)."""

from __future__ import annotations

from mtl.core.hookspecs import hookimpl
from mtl.core.registrations import ModelFamily
from mtl.models.bert.family import BERT_FAMILY
from mtl.models.convert_hf import HFConverter
from mtl.models.convert_megatron import MegatronConverter
from mtl.models.gpt.family import gpt_like_family
from mtl.models.gpt.layer_spec import layer_spec
from mtl.models.hybrid.family import hybrid_family
from mtl.models.t5.family import T5_FAMILY

GPT_FAMILY = gpt_like_family(
    "gpt",
    layer_spec,
    converters={"hf": HFConverter(), "megatron": MegatronConverter()},
    description="GPT-2 and Llama style decoders (RoPE/learned positions, RMSNorm/LayerNorm, SwiGLU/GELU, GQA)",
)


HYBRID_FAMILY = hybrid_family()


@hookimpl
def mtl_model_families() -> list[ModelFamily]:
    return [GPT_FAMILY, BERT_FAMILY, T5_FAMILY, HYBRID_FAMILY]
