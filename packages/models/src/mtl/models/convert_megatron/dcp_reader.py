"""Reading a Megatron-Core ``torch_dist`` checkpoint directory one tensor at a time.

The directory holds ``metadata.json`` (which backend wrote it), ``common.pt`` (everything that
is not a sharded tensor, e.g. Megatron-LM's ``args``) and a PyTorch distributed checkpoint
(``.metadata`` + ``__{rank}_{n}.distcp``). DCP assembles a global tensor from however many
TP/PP shards were saved, so what we read is already the layout-independent tensor; we read
one key per ``dcp.load`` call so that peak memory is about the largest stored tensor.
"""

from __future__ import annotations

import json
import pickle
import types
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mtl.core.errors import CheckpointError

METADATA_JSON = "metadata.json"
COMMON = "common.pt"


class _CachedMetadataReader(FileSystemReader):
    """A FileSystemReader that parses ``.metadata`` once (it can be large: it lists every
    optimizer shard too) instead of once per ``dcp.load``."""

    _metadata = None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class MegatronCheckpoint:
    """A ``torch_dist`` checkpoint: ``shapes`` of its tensors, ``read(key)``, ``common``."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._check_format()
        self._reader = _CachedMetadataReader(str(self.directory))
        try:
            metadata = self._reader.read_metadata()
        except Exception as exc:  # noqa: BLE001 (a missing/corrupt .metadata surfaces as many types)
            raise CheckpointError(f"{self.directory / '.metadata'}: cannot read the DCP metadata: {exc}") from exc
        self.tensors: dict[str, TensorStorageMetadata] = {
            key: entry
            for key, entry in metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)
        }
        self.common = self._read_common()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def read(self, key: str) -> torch.Tensor:
        """The full global tensor ``key`` as fp32 (Megatron stores bf16/fp16 weights too)."""
        entry = self.tensors.get(key)
        if entry is None:
            raise CheckpointError(f"{self.directory}: the checkpoint has no tensor {key}")
        target = {key: torch.empty(entry.size, dtype=entry.properties.dtype)}
        with warnings.catch_warnings():
            # "torch.distributed is ... uninitialized, assuming ... a single process": intended
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(target, storage_reader=self._reader, no_dist=True)
        return target[key].float()

    def _check_format(self) -> None:
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory} is not a directory: point to a Megatron checkpoint iter_NNNNNNN folder")
        if not (self.directory / ".metadata").is_file():
            hint = ""
            iterations = sorted(self.directory.glob("iter_*"))
            if iterations:
                hint = f" (it has iteration folders; pass one of them, e.g. {iterations[-1]})"
            elif list(self.directory.glob("mp_rank_*")):
                hint = " (mp_rank_* folders: a legacy torch-format checkpoint; re-save it with --ckpt-format torch_dist)"
            raise CheckpointError(f"{self.directory} has no .metadata: it is not a torch_dist checkpoint{hint}")
        info_path = self.directory / METADATA_JSON
        if info_path.is_file():
            try:
                backend = json.loads(info_path.read_text()).get("sharded_backend")
            except json.JSONDecodeError as exc:
                raise CheckpointError(f"{info_path} is not valid JSON: {exc}") from exc
            if backend != "torch_dist":
                raise CheckpointError(
                    f"{info_path}: sharded_backend = {backend!r}; only torch_dist checkpoints are read "
                    "(convert zarr ones with Megatron's checkpoint conversion to torch_dist first)"
                )

    def _read_common(self) -> dict[str, Any]:
        path = self.directory / COMMON
        if not path.is_file():
            return {}
        try:
            # Megatron-LM pickles an argparse.Namespace holding its own enums here; classes of
            # packages not installed (megatron itself) become stand-ins: we read plain values only
            common = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_LENIENT_PICKLE)
        except Exception as exc:  # noqa: BLE001 (unpickling errors come in many types)
            raise CheckpointError(f"{path}: cannot unpickle Megatron's common state: {exc}") from exc
        return common if isinstance(common, dict) else {}


class _StandIn:
    """An object of a class that could not be imported while unpickling ``common.pt``."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


class _LenientUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(name, (_StandIn,), {"__module__": module})


_LENIENT_PICKLE = types.SimpleNamespace(
    __name__="pickle", Unpickler=_LenientUnpickler, load=pickle.load, loads=pickle.loads
)
