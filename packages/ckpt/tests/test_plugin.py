"""The zarr format is registered through the mtl entry point like a third-party plugin."""

from mtl.ckpt.load import load
from mtl.ckpt.save import save
from mtl.core.plugins import registry


def test_zarr_checkpoint_format_is_registered():
    fmt = registry("checkpoint format").get("zarr")
    assert fmt.name == "zarr" and fmt.save is save and fmt.load is load
