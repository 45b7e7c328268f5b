"""What both HF converters share: reading/writing a checkpoint directory, the group-major
QKV fusion of our attention, and vocabulary padding.

Our global layout (``mtl.models.param_layout``): fused QKV ``[groups * (q_per_group + 2) * d,
h]`` ordered ``[g0: q heads, k, v][g1: ...]``; SwiGLU fc1 ``[2, ffn, h]`` (gate, up); the word
embedding (and an untied output layer) ``[padded_vocab, h]`` whose rows past the true
vocabulary are zero on import and dropped on export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mtl.core.config_io import config_from_dict
from mtl.core.errors import CheckpointError, ConfigError

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_hf_checkpoint(hf_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json as a dict, every tensor by HF name) of a ``save_pretrained`` directory,
    single-file or sharded (``model.safetensors.index.json``)."""
    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} does not exist: point to a Hugging Face model directory")
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from exc
    if (hf_dir / SAFETENSORS).is_file():
        return hf_config, load_file(str(hf_dir / SAFETENSORS))
    index_path = hf_dir / SAFETENSORS_INDEX
    if index_path.is_file():
        shard_files = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        tensors: dict[str, torch.Tensor] = {}
        for shard in shard_files:
            tensors.update(load_file(str(hf_dir / shard)))
        return hf_config, tensors
    raise CheckpointError(
        f"{hf_dir} has neither {SAFETENSORS} nor {SAFETENSORS_INDEX}; re-save the model with "
        "save_pretrained(..., safe_serialization=True) (PyTorch .bin files are not read)"
    )


def write_hf_checkpoint(dst_dir: str | Path, hf_config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    dst_dir = Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    (dst_dir / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    cpu_tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    save_file(cpu_tensors, str(dst_dir / SAFETENSORS), metadata={"format": "pt"})


def take(tensors: dict[str, torch.Tensor], name: str, source: str) -> torch.Tensor:
    """``tensors.pop(name)``, or a CheckpointError naming the missing tensor and the checkpoint."""
    if name not in tensors:
        raise CheckpointError(f"{source}: tensor {name} is missing (is it a checkpoint of another architecture?)")
    return tensors.pop(name)


def require_consumed(tensors: dict[str, torch.Tensor], source: str) -> None:
    """Every HF tensor must have found a place: leftovers mean a feature we would drop."""
    if tensors:
        raise CheckpointError(
            f"{source}: {len(tensors)} tensors have no place in the mtl model, e.g. {sorted(tensors)[:4]}; "
            "the checkpoint uses a feature this converter does not support"
        )


def fuse_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_groups: int) -> torch.Tensor:
    """q ``[heads * d, ...]``, k and v ``[groups * d, ...]`` (head-major rows, as HF keeps them)
    -> group-major ``[groups * (q_per_group + 2) * d, ...]``. Works for weights and biases."""
    rest = query.shape[1:]
    q = query.reshape(num_groups, -1, *rest)  # [groups, q_per_group * d, ...]
    k = key.reshape(num_groups, -1, *rest)  # [groups, d, ...]
    v = value.reshape(num_groups, -1, *rest)
    return torch.cat((q, k, v), dim=1).reshape(-1, *rest)


def split_qkv(fused: torch.Tensor, num_heads: int, num_groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """The inverse of ``fuse_qkv``: (q ``[heads * d, ...]``, k, v ``[groups * d, ...]``)."""
    rest = fused.shape[1:]
    q_width = num_heads // num_groups * head_dim
    grouped = fused.reshape(num_groups, q_width + 2 * head_dim, *rest)
    q, k, v = grouped.split((q_width, head_dim, head_dim), dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def padded_vocab_size(model_section: dict[str, Any], tp: int) -> int:
    """The padded vocabulary the resolved config gives this model section at ``tp``."""
    config = config_from_dict({"model": model_section, "parallel": {"tp": tp}}, source="converted HF config")
    return config.resolve(world_size=tp).model.padded_vocab_size


def pad_vocab_rows(table: torch.Tensor, padded_vocab: int) -> torch.Tensor:
    """[vocab, h] -> [padded_vocab, h], the new rows zero (never sampled: generate drops them)."""
    vocab = table.shape[0]
    if vocab > padded_vocab:
        raise ConfigError(f"vocabulary {vocab} is larger than the padded size {padded_vocab}")
    padding = table.new_zeros(padded_vocab - vocab, *table.shape[1:])
    return torch.cat((table, padding), dim=0)


def check_resolved(model_config) -> None:
    if model_config.padded_vocab_size is None or model_config.head_dim is None:
        raise ConfigError("from_mtl needs the resolved model config (RunConfig.resolve fills padded_vocab_size, head_dim)")
