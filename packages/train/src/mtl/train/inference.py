"""Loading a trained model from a checkpoint into one process (for generation and export)."""

from __future__ import annotations

from pathlib import Path

import torch

from mtl.ckpt import latest_iteration, load as ckpt_load, read_metadata
from mtl.core.config import RunConfig
from mtl.core.config_io import config_from_dict
from mtl.core.errors import CheckpointError
from mtl.core.plugins import registry
from mtl.parallel.topology import Topology
from mtl.train.checkpointing import model_sharded_state


def single_process_config(saved: dict) -> RunConfig:
    """The saved run's config with every parallel degree set to one."""
    data = {section: dict(values) for section, values in saved.items()}
    data["parallel"] = {}
    # Resolved model values are kept (they describe the stored tensors) except the padded
    # vocabulary, which resolve() re-derives for tp=1 and the caller reconciles.
    data["model"]["padded_vocab_size"] = None
    return config_from_dict(data)


def resolve_tokenizer_path(ckpt_dir: Path, tokenizer_model: str | None) -> str | None:
    """Tokenizer files converted with a checkpoint live inside it; relative paths point there."""
    if tokenizer_model is None:
        return None
    candidate = ckpt_dir / tokenizer_model
    return str(candidate) if candidate.exists() else tokenizer_model


def load_for_inference(ckpt_dir: str | Path, device: str | torch.device = "cpu"):
    """(model, tokenizer, config) from an mtl checkpoint, on one process."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.exists():
        raise CheckpointError(f"checkpoint directory {ckpt_dir} does not exist")
    iteration = latest_iteration(ckpt_dir)
    metadata = read_metadata(ckpt_dir, iteration)
    saved = metadata["config"]
    cfg = single_process_config(saved)
    cfg.data.tokenizer_model = resolve_tokenizer_path(ckpt_dir, cfg.data.tokenizer_model)
    tokenizer = registry("tokenizer").get(cfg.data.tokenizer).build(cfg.data.tokenizer_model)
    cfg = cfg.resolve(world_size=1, tokenizer_vocab_size=tokenizer.vocab_size)
    stored_vocab = saved["model"]["padded_vocab_size"]
    if cfg.model.padded_vocab_size != stored_vocab:
        # A run at tp>1 pads further; keep the stored rows so the checkpoint loads as is.
        cfg.model.padded_vocab_size = stored_vocab
    topology = Topology.single()
    backend = registry("backend").get(cfg.model.backend)
    family = registry("model family").get(cfg.model.family)
    model = family.build(cfg, topology, backend).to(device)
    template = model_sharded_state([model], topology)
    ckpt_load(template, ckpt_dir, iteration)
    model.eval()
    return model, tokenizer, cfg
