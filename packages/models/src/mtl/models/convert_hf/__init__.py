"""Hugging Face <-> mtl conversion for the ``gpt`` family (GPT-2 and Llama checkpoints).

``HFConverter().to_mtl(hf_dir, tp=1) -> (model_section, state)``: our ``[model]`` config keys
and every parameter as a full global tensor in ``mtl.models.param_layout``'s layout (the
vocabulary padded as the config resolves it at ``tp``). ``from_mtl(model_config, state,
dst_dir)`` writes ``config.json`` + ``model.safetensors`` that ``transformers`` loads. The
checkpoint I/O on the mtl side is the caller's (mtl-cli), since mtl-models may not import
mtl-ckpt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mtl.core.errors import ConfigError
from mtl.models.convert_hf.common import read_hf_checkpoint, write_hf_checkpoint
from mtl.models.convert_hf.gpt2 import gpt2_from_mtl, gpt2_to_mtl
from mtl.models.convert_hf.llama import llama_from_mtl, llama_to_mtl

IMPORTERS = {"gpt2": gpt2_to_mtl, "llama": llama_to_mtl}


class HFConverter:
    """The ``hf`` converter of the ``gpt`` model family."""

    def to_mtl(self, hf_dir: str | Path, *, tp: int = 1) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        hf_config, tensors = read_hf_checkpoint(hf_dir)
        source = str(Path(hf_dir) / "config.json")
        model_type = hf_config.get("model_type")
        if model_type not in IMPORTERS:
            raise ConfigError(
                f"{source}: model_type = {model_type!r} is not convertible; supported: {', '.join(IMPORTERS)}"
            )
        return IMPORTERS[model_type](hf_config, tensors, source, tp)

    def from_mtl(self, model_config, state: dict[str, torch.Tensor], dst_dir: str | Path) -> None:
        exporter = _exporter_for(model_config)
        hf_config, tensors = exporter(model_config, state)
        write_hf_checkpoint(dst_dir, hf_config, tensors)


def _exporter_for(m):
    """GPT-2 for learned positions + LayerNorm + GELU, Llama for RoPE + RMSNorm + SwiGLU."""
    style = (m.position_embedding, m.normalization, m.activation)
    if style == ("learned", "layernorm", "gelu"):
        return gpt2_from_mtl
    if style == ("rope", "rmsnorm", "swiglu"):
        return llama_from_mtl
    raise ConfigError(
        f"no Hugging Face architecture for model.position_embedding/normalization/activation = {style}; "
        "GPT-2 needs (learned, layernorm, gelu), Llama needs (rope, rmsnorm, swiglu)"
    )


__all__ = ["HFConverter"]
