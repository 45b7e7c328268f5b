"""A training step on a GPU never waits on the host before it is fully queued.

A small Llama-style model (bf16 weights, fp32 main weights, the trainer's own ``MicroBatches``
and ``queue_train_step``) runs two warm-up steps, then one under
``torch.cuda.set_sync_debug_mode("warn")``: every synchronising CUDA call (a ``.item()``, a
pageable copy, ``nonzero``...) while taking the batches and queueing the step is recorded with
where it came from. ``PendingStep.result()``, the one read per step, runs outside the check.
The CPU test ``test_step_host_reads.py`` catches Python-level reads only; this catches the rest.

    python -m pytest -m gpu tests/gpu/test_host_sync.py
"""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SMALL = ["model.num_layers=2", "model.hidden_size=256", "model.num_attention_heads=4", "model.seq_length=512",
         "model.vocab_size=50304", "model.normalization='rmsnorm'", "model.activation='swiglu'",
         "model.position_embedding='rope'", "model.tie_embeddings=false", "data.dataset='mock'",
         "data.tokenizer='byte'", "train.micro_batch_size=2", "train.global_batch_size=8", "train.iters=10",
         "train.precision='bf16'", "train.device='cuda'", "train.clip_grad=1.0", "logging.callbacks=[]"]


def synchronising_calls_while_queueing(overrides: list[str]) -> list[str]:
    """Each synchronising CUDA call of one step's batches + queueing, with its stack."""
    from mtl.core.config_io import load_config
    from mtl.train.batches import MicroBatches
    from mtl.train.precision import LossScaler
    from mtl.train.setup import setup
    from mtl.train.step import queue_train_step

    run = setup(load_config(None, [*SMALL, *overrides]))
    cfg, t = run.config, run.config.train
    scaler = LossScaler.for_config(t)
    batches = MicroBatches(run.datasets["train"], cfg, run.topology, run.device, 0)

    def queue():
        micro = batches.take(t.num_micro_batches)
        return queue_train_step(cfg, run.topology, run.chunks, run.optimizer, [iter(micro) for _ in run.chunks],
                                scaler, t.lr, run.device)

    for _ in range(2):
        queue().result()
    torch.cuda.synchronize()
    found: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "prototype feature" in str(message):  # the mode's own notice when it is switched on
            return
        stack = [f for f in traceback.format_stack()[:-1] if "warnings" not in f][-6:]
        found.append(f"{message}\n" + "".join(stack))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            pending = queue()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    result = pending.result()
    assert torch.isfinite(torch.tensor(result.loss)), f"the checked step's loss is {result.loss}"
    return found


def test_no_synchronising_call_while_a_step_is_queued():
    """At the GPU defaults (``train.compile`` on)."""
    found = synchronising_calls_while_queueing([])
    assert not found, f"{len(found)} synchronising CUDA call(s):\n" + "\n---\n".join(found[:10])
