"""A sample that cannot be read fails the step that needs it, not the step before.

The loop reads step N+1's micro-batches while the device runs step N. If that read fails,
step N must still finish as it did before the read-ahead: logged and, at a checkpoint
interval, saved; the error then stops the run before step N+1, unchanged.
"""

import pytest

from mtl.ckpt import latest_iteration
from mtl.core.config_io import load_config
from mtl.data.mock_dataset import MockGPTDataset
from mtl.train.loop import train
from mtl.train.testing import TINY

SAMPLES_PER_STEP = 8  # TINY's global batch


def test_a_read_error_stops_before_the_step_that_needs_the_data(tmp_path, monkeypatch):
    read = MockGPTDataset.__getitem__

    def failing(self, idx):
        if idx >= 2 * SAMPLES_PER_STEP:  # step 3's samples
            raise OSError(f"sample {idx}: unreadable")
        return read(self, idx)

    monkeypatch.setattr(MockGPTDataset, "__getitem__", failing)
    cfg = load_config(None, [*TINY, "train.iters=4", f"ckpt.save='{tmp_path}'", "ckpt.interval=2"])
    with pytest.raises(OSError, match="sample 16: unreadable"):
        train(cfg, progress=False)
    assert latest_iteration(str(tmp_path)) == 2  # step 2 finished and saved before the error
