"""sharded, reshardable checkpoints on tensorstore/zarr"""

__version__ = "0.1.0"
