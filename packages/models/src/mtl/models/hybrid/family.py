"""The ``hybrid`` family's ``ModelFamily`` record: gpt's model (embedding, stack, head, loss,
pipeline stages, KV cache) with the hybrid layer spec, the SSM parameters drawn by their own
rules, and FLOPs and activation memory counted per layer symbol."""

from __future__ import annotations

from typing import Any, Mapping

from mtl.core.config import RunConfig
from mtl.core.registrations import Backend, ModelFamily
from mtl.models.gpt.model import GPTModel, LayerSpec, build_gpt
from mtl.models.hybrid import flops, memory
from mtl.models.hybrid.hf_converter import hybrid_hf_converter
from mtl.models.family_keys import refuse_non_hybrid_keys
from mtl.models.hybrid.layer_spec import layer_spec as hybrid_layer_spec
from mtl.models.mamba.initialization import initialize_ssm_parameters


def build_hybrid(
    config: RunConfig,
    topology,
    backend: Backend,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    layer_range: tuple[int, int] | None = None,
    layer_spec: LayerSpec = hybrid_layer_spec,
) -> GPTModel:
    """A hybrid model (or one pipeline stage), initialised from ``config.train.seed`` for every layout."""
    model = build_gpt(config, topology, backend, pre_process=pre_process, post_process=post_process,
                      layer_range=layer_range, layer_spec=layer_spec)
    initialize_ssm_parameters(model, config.train.seed, topology)
    return model


def hybrid_family(converters: Mapping[str, Any] | None = None) -> ModelFamily:
    """The record; ``converters`` default to Hugging Face's (``hf_converter.py``)."""
    return ModelFamily(
        name="hybrid",
        build=build_hybrid,
        converters=dict(converters if converters is not None else {"hf": hybrid_hf_converter()}),
        description="Mamba-2 / attention / MLP / MoE layers by model.hybrid_pattern (Megatron hybrid, Nemotron-H)",
        layer_spec=hybrid_layer_spec,
        flops_per_iteration=flops.flops_per_iteration,
        layer_flops_per_iteration=flops.layer_flops_per_iteration,
        activation_bytes_per_layer=memory.activation_bytes_per_layer,
        check_config=refuse_non_hybrid_keys,
    )
