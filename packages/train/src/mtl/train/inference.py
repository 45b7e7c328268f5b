"""Loading a trained or converted model from a checkpoint into one process (for generation)."""

from __future__ import annotations

from pathlib import Path

import torch

from mtl.ckpt import latest_iteration, load as ckpt_load, read_metadata
from mtl.ckpt.directory import committed_iterations
from mtl.core.config import RunConfig
from mtl.core.config_io import config_from_dict
from mtl.core.errors import CheckpointError, ConfigError
from mtl.core.model_protocol import build_model
from mtl.core.plugins import registry
from mtl.parallel.topology import Topology
from mtl.train.checkpointing import model_sharded_state


def single_process_config(saved: dict) -> RunConfig:
    """The saved run's config with every parallel degree set to one."""
    data = {section: dict(values) for section, values in saved.items()}
    data["parallel"] = {}
    # Resolved model values are kept (they describe the stored tensors) except the padded
    # vocabulary, which depends on tp; the stored tables have the true vocabulary's rows at any tp.
    data["model"]["padded_vocab_size"] = None
    # captured layers are a training setting (CUDA, one GPU): loading for inference or export
    # runs the layers as they are, on any device
    data["train"]["cuda_graphs"] = False
    # so is FA4 (CUDA only, and no masks for decoding with a KV cache): SDPA serves any device
    data["train"]["attention_kernel"] = "sdpa"
    return config_from_dict(data)


def resolve_tokenizer_path(ckpt_dir: Path, tokenizer_model: str | None) -> str | None:
    """Tokenizer files converted with a checkpoint live inside it; relative paths point there."""
    if tokenizer_model is None:
        return None
    candidate = ckpt_dir / tokenizer_model
    return str(candidate) if candidate.exists() else tokenizer_model


def load_for_inference(ckpt_dir: str | Path, device: str | torch.device = "cpu", *,
                       tokenizer: str | None = None, tokenizer_model: str | None = None,
                       iteration: int | None = None):
    """(model, tokenizer, config) from an mtl checkpoint saved at any layout, on one process.
    ``tokenizer``/``tokenizer_model`` replace the checkpoint's tokenizer (needed when it has none);
    ``iteration`` picks a committed iteration other than the latest."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.exists():
        raise CheckpointError(f"checkpoint directory {ckpt_dir} does not exist")
    if iteration is None:
        iteration = latest_iteration(ckpt_dir)
    elif iteration not in committed_iterations(str(ckpt_dir)):
        held = committed_iterations(str(ckpt_dir))
        raise CheckpointError(f"{ckpt_dir} holds no committed iteration {iteration} "
                              f"(it holds: {', '.join(map(str, held[-10:])) or 'none'})")
    metadata = read_metadata(ckpt_dir, iteration)
    cfg = single_process_config(metadata["config"])
    if tokenizer is not None:
        cfg.data.tokenizer, cfg.data.tokenizer_model = tokenizer, tokenizer_model
    elif metadata.get("has_tokenizer") is False:
        raise ConfigError(
            f"{ckpt_dir} has no tokenizer (converted from {metadata.get('converted_from', 'a source')} without "
            "tokenizer files); pass --tokenizer NAME [--tokenizer-model PATH], e.g. --tokenizer hf "
            "--tokenizer-model path/to/tokenizer.json (tokenizers: "
            f"{', '.join(registry('tokenizer').names())})"
        )
    else:
        cfg.data.tokenizer_model = resolve_tokenizer_path(ckpt_dir, cfg.data.tokenizer_model)
    built_tokenizer = registry("tokenizer").get(cfg.data.tokenizer).build(cfg.data.tokenizer_model)
    cfg = cfg.resolve(world_size=1, tokenizer_vocab_size=built_tokenizer.vocab_size)
    topology = Topology.single()
    backend = registry("backend").get(cfg.model.backend)
    family = registry("model family").get(cfg.model.family)
    model = build_model(family, cfg, topology, backend).to(device)
    template = model_sharded_state([model], topology)
    ckpt_load(template, ckpt_dir, iteration)
    model.eval()
    return model, built_tokenizer, cfg
