"""Checkpoint conversion around a model family's converter: the family maps tensors and
config keys; this module does the file I/O (mtl.ckpt) and carries tokenizer files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from mtl.ckpt import read_metadata
from mtl.ckpt import save as ckpt_save
from mtl.core.config import RunConfig
from mtl.core.config_io import config_from_dict
from mtl.core.errors import CheckpointError, ConfigError
from mtl.core.plugins import registry
from mtl.models.param_layout import global_layout
from mtl.parallel.topology import Topology
from mtl.train.checkpointing import model_sharded_state, software_versions
from mtl.train.inference import load_for_inference

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


def _converter(family: str, fmt: str):
    converters = registry("model family").get(family).converters
    if fmt not in converters:
        raise ConfigError(f"model family '{family}' has no '{fmt}' converter (it has: {', '.join(converters) or 'none'})")
    return converters[fmt]


def _detect_tokenizer(directory: Path) -> tuple[str, str | None]:
    """Which of our tokenizers reads the HF tokenizer files in ``directory``."""
    if (directory / "tokenizer.json").exists():
        return "hf", "tokenizer/tokenizer.json"
    if (directory / "vocab.json").exists() and (directory / "merges.txt").exists():
        return "gpt2-bpe", "tokenizer"
    if (directory / "tokenizer.model").exists():
        return "sentencepiece", "tokenizer/tokenizer.model"
    return "byte", None


HF_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _hf_token_ids(src_dir: Path) -> dict:
    """The special-token ids of an HF config.json: our model config has no place for them,
    so the checkpoint's metadata carries them back to the exported config.json."""
    try:
        hf_config = json.loads((src_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{src_dir / 'config.json'} is not readable JSON: {exc}") from exc
    return {key: hf_config[key] for key in HF_TOKEN_ID_KEYS if key in hf_config}


def hf_to_mtl(src: str, dst: str, family: str = "gpt") -> RunConfig:
    src_dir, dst_dir = Path(src), Path(dst)
    if not (src_dir / "config.json").exists():
        raise CheckpointError(f"{src_dir} is not a Hugging Face checkpoint (no config.json)")
    model_section, state = _converter(family, "hf").to_mtl(src_dir)
    tokenizer, tokenizer_model = _detect_tokenizer(src_dir)
    cfg = config_from_dict({"model": {**model_section, "family": family},
                            "data": {"tokenizer": tokenizer, "tokenizer_model": tokenizer_model}})
    cfg = cfg.resolve(world_size=1)
    with torch.device("cpu"):
        model = registry("model family").get(family).build(cfg, Topology.single(), registry("backend").get("local"))
    layout = global_layout(model, Topology.single())
    missing = sorted(set(layout) - set(state))
    if missing:
        raise CheckpointError(f"the converter produced no tensor for {missing[:5]} (of {len(missing)})")
    with torch.no_grad():
        for name, (local, global_shape, _) in layout.items():
            tensor = state[name]
            if tuple(tensor.shape) != tuple(global_shape):
                raise CheckpointError(f"{name}: converted shape {tuple(tensor.shape)} != model shape {tuple(global_shape)}")
            local.copy_(tensor.view(local.shape))
    dst_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_model is not None:
        (dst_dir / "tokenizer").mkdir(exist_ok=True)
        for name in TOKENIZER_FILES:
            if (src_dir / name).exists():
                shutil.copy2(src_dir / name, dst_dir / "tokenizer" / name)
    metadata = {"iteration": 0, "consumed_samples": 0, "model_only": True, "config": cfg.to_dict(),
                "versions": software_versions(), "world_size": 1, "converted_from": str(src_dir),
                "hf_token_ids": _hf_token_ids(src_dir)}
    ckpt_save(model_sharded_state([model], Topology.single()), dst_dir, 0, metadata)
    return cfg


def mtl_to_hf(src: str, dst: str, family: str | None = None) -> None:
    """Export an mtl checkpoint as ``config.json`` + ``model.safetensors`` (+ tokenizer files).
    ``family`` defaults to the one the checkpoint's config names."""
    src_dir, dst_dir = Path(src), Path(dst)
    model, tokenizer, cfg = load_for_inference(src_dir)
    state = {name: local.detach().clone().view(global_shape)
             for name, (local, global_shape, _) in global_layout(model, Topology.single()).items()}
    dst_dir.mkdir(parents=True, exist_ok=True)
    _converter(family or cfg.model.family, "hf").from_mtl(cfg.model, state, dst_dir)
    # Special-token ids: those of the HF checkpoint this one was converted from, else the
    # tokenizer's end-of-document token (the exporters write none, and transformers'
    # defaults, e.g. GPT-2's 50256, can lie outside a smaller vocabulary).
    token_ids = read_metadata(str(src_dir)).get("hf_token_ids") or {
        "bos_token_id": tokenizer.eod, "eos_token_id": tokenizer.eod}
    config_path = dst_dir / "config.json"
    hf_config = json.loads(config_path.read_text())
    hf_config.update(token_ids)
    config_path.write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if (src_dir / "tokenizer").is_dir():
        for path in (src_dir / "tokenizer").iterdir():
            shutil.copy2(path, dst_dir / path.name)
