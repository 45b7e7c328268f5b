"""Runs a few training steps of a tiny GPT under a given layout and returns what the
equivalence tests compare: the losses, and every parameter's gradient as global shards."""

from __future__ import annotations

import torch

from mtl.core.config_io import load_config
from mtl.models.param_layout import global_layout
from mtl.train.loop import train

TINY = [
    "model.num_layers=4", "model.hidden_size=32", "model.num_attention_heads=4",
    "model.num_query_groups=2", "model.seq_length=16", "model.vocab_size=512",
    "model.make_vocab_size_divisible_by=128", "data.dataset='mock'", "data.tokenizer='byte'",
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.iters=3", "train.lr=1e-3",
    "train.warmup_iters=0", "train.eval_interval=0", "train.clip_grad=1.0", "train.seed=7",
    "train.device='cpu'", "logging.callbacks=[]",
]


def run_tiny(overrides: list[str]) -> dict:
    cfg = load_config(None, [*TINY, *overrides])
    result = train(cfg, progress=False)
    run = result.run
    shards = {}
    for chunk in run.chunks:
        module = getattr(chunk, "module", chunk)
        params = dict(module.named_parameters())
        for name, (local, global_shape, offset) in global_layout(module, run.topology).items():
            grad = params[name].grad
            grad_view = grad.view(local.shape) if grad is not None else None
            shards[name] = (None if grad_view is None else grad_view.detach().clone(),
                            tuple(global_shape), tuple(offset), bool(getattr(params[name], "shared_embedding", False)))
    return {"losses": result.losses, "shards": shards, "last_stage": run.topology.is_last_stage}


def assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Global gradient tensors from every rank's shards (replicas must agree)."""
    full: dict[str, torch.Tensor] = {}
    for result in per_rank:
        for name, (grad, shape, offset, _) in result["shards"].items():
            if grad is None:
                continue
            target = full.setdefault(name, torch.full(shape, float("nan")))
            box = tuple(slice(o, o + n) for o, n in zip(offset, grad.shape))
            target[box] = grad.view(target[box].shape)
    return full
