"""Reading and writing ``save_pretrained`` safetensors directories one tensor at a time.

The format is an 8-byte little-endian header length, a JSON header (``name -> {dtype, shape,
data_offsets}`` relative to the end of the header, plus ``__metadata__``), then the raw
little-endian bytes. We read a tensor with one ``readinto`` of its byte range (no memory map,
so the process holds only what it asked for) and write each shard's header first (the meta
pass of a conversion gives every shape) and then each tensor as it is produced.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, Iterable

import torch

from mtl.core.errors import CheckpointError

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # transformers' default shard size ("5GB")

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data section, header dict) of one safetensors file."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from exc
    return 8 + length, header


class SafetensorsReader:
    """A ``TensorSource`` over a single-file or sharded (index.json) safetensors directory."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        if (self.dir / SAFETENSORS).is_file():
            files = [SAFETENSORS]
        elif (self.dir / SAFETENSORS_INDEX).is_file():
            try:
                weight_map = json.loads((self.dir / SAFETENSORS_INDEX).read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise CheckpointError(f"{self.dir / SAFETENSORS_INDEX} has no readable weight_map ({exc})") from exc
            files = sorted(set(weight_map.values()))
        else:
            raise CheckpointError(
                f"{self.dir} has neither {SAFETENSORS} nor {SAFETENSORS_INDEX}; re-save the model with "
                "save_pretrained(..., safe_serialization=True) (PyTorch .bin files are not read)"
            )
        self.entries: dict[str, tuple[Path, int, dict[str, Any]]] = {}  # name -> (file, data start, entry)
        for file in files:
            path = self.dir / file
            if not path.is_file():
                raise CheckpointError(f"{self.dir / SAFETENSORS_INDEX} names {file}, which does not exist")
            start, header = _read_header(path)
            for name, entry in header.items():
                if name != "__metadata__":
                    self.entries[name] = (path, start, entry)

    def names(self) -> list[str]:
        return list(self.entries)

    def _entry(self, name: str) -> tuple[Path, int, dict[str, Any]]:
        if name not in self.entries:
            raise CheckpointError(
                f"{self.dir}: tensor {name} is missing (is it a checkpoint of another architecture?)"
            )
        return self.entries[name]

    def _dtype(self, name: str, entry: dict[str, Any]) -> torch.dtype:
        if entry["dtype"] not in DTYPES:
            raise CheckpointError(f"{self.dir}: tensor {name} has dtype {entry['dtype']}, which mtl does not read")
        return DTYPES[entry["dtype"]]

    def meta(self, name: str) -> torch.Tensor:
        _, _, entry = self._entry(name)
        return torch.empty(entry["shape"], dtype=self._dtype(name, entry), device="meta")

    def get(self, name: str) -> torch.Tensor:
        path, start, entry = self._entry(name)
        dtype = self._dtype(name, entry)
        begin, end = entry["data_offsets"]
        if end - begin != math.prod(entry["shape"]) * dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {name} has {end - begin} bytes for shape {entry['shape']} {dtype}")
        data = torch.empty(end - begin, dtype=torch.uint8)
        with open(path, "rb") as f:
            f.seek(start + begin)
            if f.readinto(data.numpy()) != end - begin:
                raise CheckpointError(f"{path}: tensor {name} is truncated (the file is incomplete)")
        return data.view(dtype).reshape(entry["shape"])


def _header_bytes(entries: dict[str, Any]) -> bytes:
    header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(header)) + header


def _nbytes(meta: torch.Tensor) -> int:
    return meta.numel() * meta.dtype.itemsize


def plan_shards(metas: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Names in order, cut into shards of at most ``max_shard_bytes`` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, meta in metas.items():
        if shards[-1] and size + _nbytes(meta) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += _nbytes(meta)
    return shards


def write_safetensors(dst_dir: str | Path, metas: dict[str, torch.Tensor],
                      tensors: Iterable[tuple[str, torch.Tensor]],
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write ``tensors`` (in the order of ``metas``) as ``model.safetensors``, or as
    ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` when they exceed
    one shard; model files already in ``dst_dir`` are replaced. Returns the file names."""
    dst_dir = Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*dst_dir.glob("model-*-of-*.safetensors"), dst_dir / SAFETENSORS, dst_dir / SAFETENSORS_INDEX]:
        stale.unlink(missing_ok=True)
    shards = plan_shards(metas, max_shard_bytes)
    files = [SAFETENSORS] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    produced = iter(tensors)
    for file, names in zip(files, shards):
        entries, offset = {}, 0
        for name in names:
            meta = metas[name]
            entries[name] = {"dtype": DTYPE_NAMES[meta.dtype], "shape": list(meta.shape),
                             "data_offsets": [offset, offset + _nbytes(meta)]}
            offset += _nbytes(meta)
        with open(dst_dir / file, "wb") as f:
            f.write(_header_bytes(entries))
            for expected in names:
                name, tensor = next(produced)
                if name != expected:
                    raise CheckpointError(f"writing {file}: got tensor {name} where {expected} was planned")
                # [*shape] -> raw little-endian bytes, without an extra copy when already contiguous
                f.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    if len(files) > 1:
        weight_map = {name: file for file, names in zip(files, shards) for name in names}
        total = sum(_nbytes(m) for m in metas.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (dst_dir / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files
