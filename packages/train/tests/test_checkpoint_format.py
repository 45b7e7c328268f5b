"""Training saves and resumes through the checkpoint format that ``ckpt.format`` names, as a
third-party plugin would register it; an unknown format, or async save with a format other
than zarr, is refused by name before anything is written."""

import pytest

from mtl.ckpt import load as zarr_load
from mtl.ckpt import save as zarr_save
from mtl.core import plugins
from mtl.core.config_io import load_config
from mtl.core.errors import ConfigError, NotInstalledError
from mtl.core.hookspecs import hookimpl
from mtl.core.registrations import CheckpointFormat
from mtl.train.loop import train
from mtl.train.testing import TINY

BASE = [o for o in TINY if not o.startswith("train.iters")]


class RecordingFormat:
    """zarr underneath, recording every call the trainer makes."""

    def __init__(self):
        self.calls = []

    def save(self, state, ckpt_dir, iteration, metadata=None, process_group=None):
        self.calls.append(("save", iteration))
        return zarr_save(state, ckpt_dir, iteration, metadata, process_group)

    def load(self, template, ckpt_dir, iteration=None, strict=True, verify=True):
        self.calls.append(("load", iteration))
        return zarr_load(template, ckpt_dir, iteration, strict, verify)

    @hookimpl
    def mtl_checkpoint_formats(self):
        return [CheckpointFormat("recording", save=self.save, load=self.load)]


@pytest.fixture
def recording():
    fmt = RecordingFormat()
    plugins.register_plugin(fmt, name="recording-format")
    yield fmt
    plugins.unregister_plugin(fmt)


def test_save_and_resume_go_through_the_named_format(recording, tmp_path):
    ckpt = f"ckpt.save='{tmp_path}'"
    train(load_config(None, [*BASE, "train.iters=2", "ckpt.format='recording'", ckpt]), progress=False)
    resumed = train(load_config(None, [*BASE, "train.iters=3", "ckpt.format='recording'", ckpt,
                                       f"ckpt.load='{tmp_path}'"]), progress=False)
    assert recording.calls == [("save", 2), ("load", 2), ("save", 3)]
    assert sorted(resumed.losses) == [3]


def test_unknown_format_is_named(tmp_path):
    with pytest.raises(NotInstalledError, match=r"checkpoint format 'nope' is not installed \(installed:.*zarr"):
        train(load_config(None, [*BASE, "train.iters=1", "ckpt.format='nope'", f"ckpt.save='{tmp_path}'"]), progress=False)
    assert not any(tmp_path.iterdir())


def test_async_save_needs_zarr(recording, tmp_path):
    with pytest.raises(ConfigError, match="ckpt.async_save = true is available for ckpt.format = 'zarr' only"):
        train(load_config(None, [*BASE, "ckpt.format='recording'", "ckpt.async_save=true", f"ckpt.save='{tmp_path}'"]),
              progress=False)
    assert not any(tmp_path.iterdir())
