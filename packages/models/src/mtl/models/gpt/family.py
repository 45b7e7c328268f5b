"""``gpt_like_family``: the ``ModelFamily`` record of a family built on ``GPTModel``.

A gpt-like variant (another layer shape on the same embedding, stack, head and loss) supplies
only its ``layer_spec``: ``build`` is ``build_gpt``, which ``model_protocol.build_model`` hands
the record's ``layer_spec``, and the record gets gpt's FLOP and activation formulas unless the
variant brings its own.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from mtl.core.registrations import ModelFamily
from mtl.models.family_keys import refuse_encoder_keys
from mtl.models.gpt import flops
from mtl.models.gpt.model import LayerSpec, build_gpt


def gpt_like_family(
    name: str,
    layer_spec: LayerSpec,
    *,
    description: str = "",
    converters: Mapping[str, Any] | None = None,
    flops_per_iteration: Callable[[Any], float] = flops.flops_per_iteration,
    layer_flops_per_iteration: Callable[[Any], list[float]] | None = None,
    activation_bytes_per_layer: Callable[[Any], float] = flops.activation_bytes_per_layer,
    check_config: Callable[[Any], None] | None = refuse_encoder_keys,
) -> ModelFamily:
    if layer_flops_per_iteration is None and flops_per_iteration is flops.flops_per_iteration:
        # gpt's per-layer split only where the total is gpt's too: a variant's own count has its own
        layer_flops_per_iteration = flops.layer_flops_per_iteration
    return ModelFamily(
        name=name,
        build=build_gpt,
        converters=dict(converters or {}),
        description=description,
        layer_spec=layer_spec,
        flops_per_iteration=flops_per_iteration,
        layer_flops_per_iteration=layer_flops_per_iteration,
        activation_bytes_per_layer=activation_bytes_per_layer,
        check_config=check_config,  # a decoder ignores the encoder's keys: refused when set
    )
