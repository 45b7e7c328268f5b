"""On CUDA, running out of memory in a step is an error that names a memory snapshot (written
with torch.cuda.memory._dump_snapshot into logging.dir) and the config keys that would lower
memory, not a bare traceback. Needs a GPU: skipped elsewhere."""

import pytest
import torch

from mtl.core.config_io import load_config
from mtl.train.health import OutOfMemory
from mtl.train.loop import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_out_of_memory_names_the_snapshot_and_the_keys(tmp_path):
    # a small model with far too many activations: 256 sequences of 8192 tokens per micro-batch
    cfg = load_config(None, [
        "model.num_layers=2", "model.hidden_size=1024", "model.num_attention_heads=8", "model.seq_length=8192",
        "data.dataset='mock'", "train.micro_batch_size=256", "train.global_batch_size=256", "train.iters=2",
        "train.device='cuda'", "train.eval_interval=0", f"logging.dir='{tmp_path}'", "logging.callbacks=[]",
    ])
    with pytest.raises(OutOfMemory) as info:
        train(cfg, progress=False)
    message = str(info.value)
    assert message.startswith("CUDA out of memory in step 1 on rank 0"), message
    assert f"memory snapshot: {tmp_path / 'oom_snapshot_rank0.pickle'}" in message
    assert (tmp_path / "oom_snapshot_rank0.pickle").stat().st_size > 0
    assert "train.micro_batch_size = 128" in message and 'train.recompute = "selective"' in message
    torch.cuda.empty_cache()
