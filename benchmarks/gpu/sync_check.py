"""On a GPU: does a training step wait on the host anywhere before it is fully queued?

    python3 benchmarks/gpu/sync_check.py [--set KEY=VALUE ...]

Runs a small Llama-style model (bf16 weights, fp32 main weights, the trainer's own
``MicroBatches`` and ``queue_train_step``) for two warm-up steps, then one step under
``torch.cuda.set_sync_debug_mode("warn")``: every synchronising CUDA call (a ``.item()``, a
pageable copy, ``nonzero``...) inside "take the batches + queue the step" is printed with where
it came from. Then ``PendingStep.result()``, the one read per step, outside the check. The
CPU test ``test_step_host_reads.py`` catches Python-level reads only; this catches the rest.
"""

from __future__ import annotations

import argparse
import traceback
import warnings

import torch

SMALL = ["model.num_layers=2", "model.hidden_size=256", "model.num_attention_heads=4", "model.seq_length=512",
         "model.vocab_size=50304", "model.normalization='rmsnorm'", "model.activation='swiglu'",
         "model.position_embedding='rope'", "model.tie_embeddings=false", "data.dataset='mock'",
         "data.tokenizer='byte'", "train.micro_batch_size=2", "train.global_batch_size=8", "train.iters=10",
         "train.precision='bf16'", "train.device='cuda'", "train.clip_grad=1.0", "logging.callbacks=[]"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args()
    from mtl.core.config_io import load_config
    from mtl.train.batches import MicroBatches
    from mtl.train.precision import LossScaler
    from mtl.train.setup import setup
    from mtl.train.step import queue_train_step

    run = setup(load_config(None, [*SMALL, *args.sets]))
    cfg, t = run.config, run.config.train
    scaler = LossScaler.for_config(t)
    batches = MicroBatches(run.datasets["train"], cfg, run.topology, run.device, 0)

    def queue():
        micro = batches.take(t.num_micro_batches)
        return queue_train_step(cfg, run.topology, run.chunks, run.optimizer, [iter(micro) for _ in run.chunks],
                                scaler, t.lr, run.device)

    for _ in range(2):
        queue().result()
    on_cuda = run.device.type == "cuda"  # on CPU (checking this script) nothing is watched
    if on_cuda:
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
        if on_cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            pending = queue()
        finally:
            if on_cuda:
                torch.cuda.set_sync_debug_mode("default")
    result = pending.result()
    device = torch.cuda.get_device_name(0) if on_cuda else "cpu (nothing watched)"
    print(f"torch {torch.__version__}, {device}; step loss {result.loss:.4f}, "
          f"grad norm {result.grad_norm:.4f}")
    print(f"synchronising CUDA calls while taking the batches and queueing the step: {len(found)}")
    for i, text in enumerate(found[:10], 1):
        print(f"--- {i}: {text}")


if __name__ == "__main__":
    main()
