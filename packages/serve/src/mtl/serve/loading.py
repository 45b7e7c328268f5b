"""A checkpoint of any training layout loaded for inference at tensor-parallel size ``tp``.

mtl-serve may not import mtl-train, so this reads the checkpoint with mtl-ckpt directly: the
saved config with the parallel section replaced by ``tp`` (the stored tensors are global, any
layout reads them), the model built by its family, and a load template of every parameter's
slice on this rank (``mtl.models.param_layout``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mtl.ckpt import latest_iteration, load as ckpt_load, read_metadata
from mtl.ckpt.directory import committed_iterations
from mtl.ckpt.sharded import ShardedTensor
from mtl.core.config import RunConfig
from mtl.core.config_io import config_from_dict
from mtl.core.errors import CheckpointError, ConfigError
from mtl.core.model_protocol import build_model
from mtl.core.plugins import registry
from mtl.models.param_layout import parameter_entries
from mtl.serve.materialize import materialize, parameters_on_meta
from mtl.parallel.topology import Topology

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    config: RunConfig
    topology: Topology
    tokenizer_path: str | None  # the tokenizer's file or folder (its chat template lives beside it)


def inference_config(saved: dict, tp: int) -> RunConfig:
    """The saved run's config at tensor-parallel size ``tp`` and no other parallelism."""
    data = {section: dict(values) for section, values in saved.items()}
    data["parallel"] = {"tp": tp}
    data["model"]["padded_vocab_size"] = None  # depends on tp; the stored tables hold the true vocabulary
    data["train"]["cuda_graphs"] = False  # a training capture; the engine runs layers as they are
    data["train"]["attention_kernel"] = "sdpa"
    data["train"]["compile"] = False
    return config_from_dict(data)


def _iteration(ckpt_dir: Path, iteration: int | None) -> int:
    if not ckpt_dir.exists():
        raise CheckpointError(f"checkpoint directory {ckpt_dir} does not exist")
    if iteration is None:
        return latest_iteration(ckpt_dir)
    held = committed_iterations(str(ckpt_dir))
    if iteration not in held:
        raise CheckpointError(f"{ckpt_dir} holds no committed iteration {iteration} "
                              f"(it holds: {', '.join(map(str, held[-10:])) or 'none'})")
    return iteration


def _tokenizer_path(ckpt_dir: Path, cfg: RunConfig, metadata: dict, tokenizer: str | None,
                    tokenizer_model: str | None) -> str | None:
    if tokenizer is not None:
        cfg.data.tokenizer, cfg.data.tokenizer_model = tokenizer, tokenizer_model
        return tokenizer_model
    if metadata.get("has_tokenizer") is False:
        raise ConfigError(
            f"{ckpt_dir} has no tokenizer (converted without tokenizer files); pass --tokenizer NAME "
            f"[--tokenizer-model PATH] (tokenizers: {', '.join(registry('tokenizer').names())})")
    path = cfg.data.tokenizer_model
    if path is not None and (ckpt_dir / path).exists():  # files converted with the checkpoint live inside it
        path = str(ckpt_dir / path)
    cfg.data.tokenizer_model = path
    return path


def load_checkpoint(checkpoint: str | Path, *, device: torch.device, tp: int = 1, dtype: torch.dtype | None = None,
                    tokenizer: str | None = None, tokenizer_model: str | None = None,
                    iteration: int | None = None) -> LoadedModel:
    """This rank's part of the model (under ``torch.distributed`` with world size ``tp`` when
    tp > 1), in eval mode on ``device``, its weights in ``dtype`` (None: fp32, as built)
    straight from the checkpoint (``materialize.py``)."""
    ckpt_dir = Path(checkpoint)
    iteration = _iteration(ckpt_dir, iteration)
    metadata = read_metadata(ckpt_dir, iteration)
    cfg = inference_config(metadata["config"], tp)
    tokenizer_path = _tokenizer_path(ckpt_dir, cfg, metadata, tokenizer, tokenizer_model)
    built_tokenizer = registry("tokenizer").get(cfg.data.tokenizer).build(cfg.data.tokenizer_model)
    cfg = cfg.resolve(world_size=tp, tokenizer_vocab_size=built_tokenizer.vocab_size)
    topology = Topology.build(tp=tp)
    backend = registry("backend").get(cfg.model.backend)
    family = registry("model family").get(cfg.model.family)
    with parameters_on_meta():  # no fp32 copy, no random init: the checkpoint fills the weights
        model = build_model(family, cfg, topology, backend)
    materialize(model, device, dtype)
    template = {f"model.{e.global_name}": ShardedTensor(f"model.{e.global_name}", e.view(e.param.data),
                                                        e.global_shape, e.global_offset)
                for e in parameter_entries(model, topology)}
    ckpt_load(template, str(ckpt_dir), iteration)  # each stored tensor cast to the weights' dtype
    model.eval()
    return LoadedModel(model, built_tokenizer, cfg, topology, tokenizer_path)
