"""The training step queues all its work without reading a tensor on the host.

A host read (``.item()``, ``float(t)``, ``if t:``) of a device tensor waits for everything
queued before it; in the middle of a step it leaves the GPU idle while the host launches
what follows. ``queue_train_step`` must read nothing, so that the trainer reads once per step
(``PendingStep.result()``), after it has also queued the next step's batches. On CPU every
read is still a call to these methods, which the test turns into errors: the tiny model with
bf16 weights and fp32 main weights (the optimizer's fused kernel takes the clip and the skip
as tensors), with and without MoE (routers' metrics are read only at logging steps).
"""

import math

import pytest
import torch

from mtl.core.config_io import load_config
from mtl.train.batches import MicroBatches
from mtl.train.precision import LossScaler
from mtl.train.setup import setup
from mtl.train.step import queue_train_step
from mtl.train.testing import MOE_TINY, TINY

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


@pytest.mark.parametrize("extra", [[], MOE_TINY], ids=["dense", "moe"])
def test_queue_train_step_reads_nothing_on_the_host(extra, monkeypatch):
    config = load_config(None, [*TINY, *extra, "train.precision='bf16'", "train.params_dtype='bf16'"])
    run = setup(config)
    cfg, t = run.config, run.config.train
    scaler = LossScaler.for_config(t)
    batches = MicroBatches(run.datasets["train"], cfg, run.topology, run.device, 0)
    results = []
    for step in range(2):  # the second step also reads the moments the first created
        micro = batches.take(t.num_micro_batches)
        with monkeypatch.context() as patched:
            def host_read(self, *args, **kwargs):
                raise AssertionError("queue_train_step read a tensor on the host")

            for name in HOST_READS:
                patched.setattr(torch.Tensor, name, host_read)
            pending = queue_train_step(cfg, run.topology, run.chunks, run.optimizer,
                                       [iter(micro) for _ in run.chunks], scaler, t.lr, run.device)
        results.append(pending.result())
    assert all(math.isfinite(r.loss) and math.isfinite(r.grad_norm) and not r.skipped for r in results)
    assert run.optimizer.common_state()["step"] == 2
