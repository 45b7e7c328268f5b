"""The ``hf`` converter of the ``hybrid`` family: ``Mamba2ForCausalLM`` (a pattern of ``M`` only),
through the same streaming machinery as gpt's converter (``mtl.models.convert_hf``): tensors read
and written one at a time, safetensors sharded past ``max_shard_bytes``."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import torch

from mtl.core.errors import ConfigError
from mtl.models.convert_hf import HFArchitecture, read_hf_config
from mtl.models.convert_hf import mamba2
from mtl.models.convert_hf.common import TensorSource, TensorStream, as_source, stream
from mtl.models.convert_hf.safetensors_io import DEFAULT_MAX_SHARD_BYTES, SafetensorsReader, write_safetensors

ARCHITECTURES = {
    arch.model_type: arch
    for arch in (
        HFArchitecture("mamba2", mamba2.mamba2_model_section, mamba2.mamba2_to_mtl,
                       lambda section: (lambda name: False), mamba2.check_mamba2_exportable,
                       mamba2.mamba2_from_mtl, mamba2.mamba2_config),
    )
}


class HybridHFConverter:
    architectures = tuple(ARCHITECTURES)

    def stream_to_mtl(self, hf_dir: str | Path) -> tuple[dict[str, Any], TensorStream]:
        hf_config = read_hf_config(hf_dir)
        source = str(Path(hf_dir) / "config.json")
        model_type = hf_config.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ConfigError(f"{source}: model_type = {model_type!r} is not a hybrid architecture mtl converts; "
                              f"supported: {', '.join(ARCHITECTURES)} (gpt-style ones convert with model.family 'gpt')")
        arch = ARCHITECTURES[model_type]
        section = arch.section(hf_config, source)
        tensors = stream(partial(arch.to_mtl, section), SafetensorsReader(hf_dir), ignored=arch.ignored(section),
                         description=str(hf_dir))
        return section, tensors

    def to_mtl(self, hf_dir: str | Path, **options) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """(model section, every tensor in memory); global tensors do not depend on ``tp``."""
        section, tensors = self.stream_to_mtl(hf_dir)
        return section, dict(tensors)

    def from_mtl(self, model_config, state: dict[str, torch.Tensor] | TensorSource, dst_dir: str | Path, *,
                 architecture: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
        """Write ``dst_dir/config.json`` and the safetensors files; returns the latter's names."""
        model_type = architecture or "mamba2"
        if model_type not in ARCHITECTURES:
            raise ConfigError(f"Hugging Face architecture {model_type!r} is not a hybrid one mtl writes; use one of "
                              f"{', '.join(ARCHITECTURES)}")
        arch = ARCHITECTURES[model_type]
        arch.check_exportable(model_config)
        tensors = stream(partial(arch.from_mtl, model_config), as_source(state), description="the mtl state")
        dtype = tensors.metas[next(iter(tensors.metas))].dtype  # the word embedding's
        dst_dir = Path(dst_dir)
        files = write_safetensors(dst_dir, tensors.metas, tensors, max_shard_bytes)
        (dst_dir / "config.json").write_text(json.dumps(arch.config(model_config, dtype), indent=2, sort_keys=True) + "\n")
        return files
