"""Hugging Face <-> mtl conversion for the ``gpt`` family: GPT-2, Llama (incl. tied embeddings
and Llama 3 RoPE scaling), Mistral and Qwen2 checkpoints, and the mixtures of experts Mixtral,
Qwen2-MoE and Qwen3-MoE, one tensor at a time.

``HFConverter().stream_to_mtl(hf_dir) -> (model_section, TensorStream)``: our ``[model]``
config keys, and every parameter as a full global tensor in ``mtl.models.param_layout``'s
layout (true vocabulary rows), produced lazily from the safetensors files.
``to_mtl(hf_dir)`` is the same collected into a dict. ``from_mtl(model_config, state, dst_dir,
architecture=None)`` writes ``config.json`` + safetensors (sharded with an index past
``max_shard_bytes``) that ``transformers`` loads, reading ``state`` (a dict or any
``TensorSource``) one tensor at a time. The checkpoint I/O on the mtl side is the caller's
(mtl-cli), since mtl-models may not import mtl-ckpt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from mtl.core.errors import CheckpointError, ConfigError
from mtl.models.convert_hf import gpt2, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3_moe
from mtl.models.convert_hf.common import Read, TensorSource, TensorStream, as_source, stream
from mtl.models.convert_hf.safetensors_io import DEFAULT_MAX_SHARD_BYTES, SafetensorsReader, write_safetensors


@dataclass(frozen=True)
class HFArchitecture:
    """One HF ``model_type``: its config.json dialect and tensor mapping, both ways."""

    model_type: str
    section: Callable[[dict[str, Any], str], dict[str, Any]]  # (config.json, source) -> [model] keys
    to_mtl: Callable[[dict[str, Any], Read], Iterator[tuple[str, torch.Tensor]]]  # (section, read)
    ignored: Callable[[dict[str, Any]], Callable[[str], Any]]  # section -> HF names to drop
    check_exportable: Callable[[Any], None]  # resolved model config -> raises ConfigError
    from_mtl: Callable[[Any, Read], Iterator[tuple[str, torch.Tensor]]]  # (model config, read)
    config: Callable[[Any, torch.dtype], dict[str, Any]]


ARCHITECTURES = {
    arch.model_type: arch
    for arch in (
        HFArchitecture("gpt2", gpt2.gpt2_model_section, gpt2.gpt2_to_mtl, lambda s: gpt2.IGNORED.match,
                       gpt2.check_gpt2_exportable, gpt2.gpt2_from_mtl, gpt2.gpt2_config),
        HFArchitecture("llama", llama.llama_model_section, llama.llama_to_mtl, llama.llama_ignored,
                       llama.check_llama_exportable, llama.llama_from_mtl, llama.llama_config),
        HFArchitecture("mistral", mistral.mistral_model_section, llama.llama_to_mtl, llama.llama_ignored,
                       mistral.check_mistral_exportable, llama.llama_from_mtl, mistral.mistral_config),
        HFArchitecture("qwen2", qwen2.qwen2_model_section, llama.llama_to_mtl, llama.llama_ignored,
                       qwen2.check_qwen2_exportable, llama.llama_from_mtl, qwen2.qwen2_config),
        HFArchitecture("mixtral", mixtral.mixtral_model_section, mixtral.mixtral_to_mtl, llama.llama_ignored,
                       mixtral.check_mixtral_exportable, mixtral.mixtral_from_mtl, mixtral.mixtral_config),
        HFArchitecture("qwen2_moe", qwen2_moe.qwen2_moe_model_section, qwen2_moe.qwen_moe_to_mtl, llama.llama_ignored,
                       qwen2_moe.check_qwen2_moe_exportable, qwen2_moe.qwen_moe_from_mtl, qwen2_moe.qwen2_moe_config),
        HFArchitecture("qwen3_moe", qwen3_moe.qwen3_moe_model_section, qwen2_moe.qwen_moe_to_mtl, llama.llama_ignored,
                       qwen3_moe.check_qwen3_moe_exportable, qwen2_moe.qwen_moe_from_mtl, qwen3_moe.qwen3_moe_config),
    )
}


# The architectures whose layers hold experts; the others export dense models only.
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    config_path = Path(hf_dir) / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} does not exist: point to a Hugging Face model directory")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from exc


def default_architecture(m) -> str:
    """GPT-2 for learned positions + LayerNorm + GELU; for RoPE + RMSNorm + SwiGLU, Qwen2 when
    only q/k/v have biases, else Llama; with experts, Qwen2-MoE for a shared expert, Qwen3-MoE
    for QK-norm, else Mixtral."""
    style = (m.position_embedding, m.normalization, m.activation)
    if style == ("learned", "layernorm", "gelu"):
        return "gpt2"
    if style == ("rope", "rmsnorm", "swiglu") and getattr(m, "num_experts", 0):
        if m.moe_shared_expert_ffn_hidden_size:
            return "qwen2_moe"
        return "qwen3_moe" if m.qk_norm else "mixtral"
    if style == ("rope", "rmsnorm", "swiglu"):
        return "qwen2" if m.qkv_bias and not m.bias else "llama"
    raise ConfigError(
        f"no Hugging Face architecture for model.position_embedding/normalization/activation = {style}; "
        "GPT-2 needs (learned, layernorm, gelu), Llama/Mistral/Qwen2 need (rope, rmsnorm, swiglu)"
    )


class HFConverter:
    """The ``hf`` converter of the ``gpt`` model family; another family passes its own
    ``by_type`` (``model_type`` -> ``HFArchitecture``), which of them hold experts, and how it
    picks an architecture to export to (the hybrid family's, ``mtl.models.hybrid.hf_converter``)."""

    def __init__(self, by_type: dict[str, HFArchitecture] | None = None,
                 moe_types: tuple[str, ...] = MOE_ARCHITECTURES,
                 default: Callable[[Any], str] = default_architecture):
        self.by_type = by_type if by_type is not None else ARCHITECTURES
        self.architectures = tuple(self.by_type)
        self.moe_types, self.default = moe_types, default

    def accepts(self, hf_dir: str | Path) -> bool:
        """Whether ``hf_dir``'s config.json names one of this converter's architectures."""
        return read_hf_config(hf_dir).get("model_type") in self.by_type

    def stream_to_mtl(self, hf_dir: str | Path) -> tuple[dict[str, Any], TensorStream]:
        hf_config = read_hf_config(hf_dir)
        source = str(Path(hf_dir) / "config.json")
        model_type = hf_config.get("model_type")
        if model_type not in self.by_type:
            raise ConfigError(
                f"{source}: model_type = {model_type!r} is not convertible; supported: {', '.join(self.by_type)}"
            )
        arch = self.by_type[model_type]
        section = arch.section(hf_config, source)
        reader = SafetensorsReader(hf_dir)
        convert = partial(arch.to_mtl, section)
        if model_type == "gpt2" and "wte.weight" in reader.entries:  # saved from GPT2Model, no prefix
            convert = partial(gpt2.gpt2_to_mtl, section, prefix="")
        return section, stream(convert, reader, ignored=arch.ignored(section), description=str(hf_dir))

    def to_mtl(self, hf_dir: str | Path, **options) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """(model section, every tensor in memory). ``options`` such as ``tp`` change nothing:
        global tensors do not depend on the layout."""
        section, tensors = self.stream_to_mtl(hf_dir)
        return section, dict(tensors)

    def from_mtl(self, model_config, state: dict[str, torch.Tensor] | TensorSource, dst_dir: str | Path, *,
                 architecture: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
        """Write ``dst_dir/config.json`` and the safetensors files; returns the latter's names."""
        model_type = architecture or self.default(model_config)
        if model_type not in self.by_type:
            raise ConfigError(f"Hugging Face architecture {model_type!r} is not supported; use one of {', '.join(self.by_type)}")
        arch = self.by_type[model_type]
        if self.moe_types and getattr(model_config, "num_experts", 0) and model_type not in self.moe_types:
            raise ConfigError(
                f"Hugging Face architecture {model_type!r} has dense MLPs only, and this model has experts "
                f"(model.num_experts = {model_config.num_experts}): export it as one of {', '.join(self.moe_types)}"
            )
        arch.check_exportable(model_config)
        tensors = stream(partial(arch.from_mtl, model_config), as_source(state), description="the mtl state")
        dtype = tensors.metas[next(iter(tensors.metas))].dtype  # the word embedding's
        hf_config = arch.config(model_config, dtype)
        dst_dir = Path(dst_dir)
        dst_dir.mkdir(parents=True, exist_ok=True)
        files = write_safetensors(dst_dir, tensors.metas, tensors, max_shard_bytes)
        (dst_dir / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        return files


__all__ = ["ARCHITECTURES", "HFConverter", "TensorSource", "TensorStream", "default_architecture", "read_hf_config"]
