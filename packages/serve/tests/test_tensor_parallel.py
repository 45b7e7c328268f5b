"""TP=2 over gloo: rank 0 plans, samples and broadcasts each step, rank 1 follows; the tokens
equal one process's, greedy and seeded."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtl.parallel.testing import run_distributed
from mtl.serve.engine import Engine, EngineConfig
from mtl.serve.loading import load_checkpoint
from mtl.serve.sampling import SamplingParams

PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a"]
PARAMS = [SamplingParams(max_tokens=10, temperature=0), SamplingParams(max_tokens=10, temperature=0.8, seed=7),
          SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)]


def engine_tokens(checkpoint: str, tp: int) -> list[list[int]] | None:
    """Every prompt's tokens (rank 0); the other ranks follow and return None."""
    cpu = torch.device("cpu")
    engine = Engine(load_checkpoint(checkpoint, device=cpu, tp=tp),
                    EngineConfig(kv_memory="8MiB", block_size=4, max_step_tokens=8), cpu)
    if tp > 1 and dist.get_rank() != 0:
        engine.runner.follow()
        return None
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    outputs = engine.generate(prompts, PARAMS)
    engine.runner.stop_followers()
    return [[t for out in outs for t in out.new_ids] for outs in outputs]


def test_tp2_tokens_equal_one_process(checkpoint):
    single = engine_tokens(checkpoint["dir"], 1)
    rank0, rank1 = run_distributed(engine_tokens, 2, (checkpoint["dir"], 2))
    assert rank1 is None
    assert rank0 == single
    assert all(len(tokens) > 0 for tokens in single)
