"""One zarr v3 array per tensor, read and written through tensorstore.

Dtypes that zarr-python 3.1 has no name for (bfloat16, the float8 formats) are stored as
their raw little-endian words (``uint16``/``uint8``) and the logical dtype is kept in the
array's attributes under ``mtl_logical_dtype``; every other dtype is stored natively. Chunks
are uncompressed ("bytes" codec): weights compress poorly and writing must be fast.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any
from urllib.parse import quote

import numpy as np
import tensorstore as ts
import torch

from mtl.core.errors import CheckpointError

LOGICAL_DTYPE_ATTR = "mtl_logical_dtype"

# logical torch dtype -> (zarr data_type name, numpy dtype the bytes are viewed as)
_NATIVE = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
# stored as raw words: (same-width integer torch dtype to reinterpret through, zarr name)
_AS_WORDS = {
    torch.bfloat16: (torch.int16, "uint16"),
    torch.float8_e4m3fn: (torch.uint8, "uint8"),
    torch.float8_e5m2: (torch.uint8, "uint8"),
}
_BY_NAME = {str(dt).removeprefix("torch."): dt for dt in [*_NATIVE, *_AS_WORDS]}


def dtype_name(dtype: torch.dtype) -> str:
    """The logical dtype's name as stored in metadata ("bfloat16", "float32", ...)."""
    if dtype not in _NATIVE and dtype not in _AS_WORDS:
        supported = ", ".join(sorted(_BY_NAME))
        raise CheckpointError(f"dtype {dtype} cannot be checkpointed; cast it to one of: {supported}")
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _BY_NAME:
        raise CheckpointError(f"checkpoint names an unknown dtype '{name}'; it was written by a newer mtl-ckpt?")
    return _BY_NAME[name]


def storage_dtype(name: str) -> str:
    """The zarr ``data_type`` the logical dtype ``name`` is stored as."""
    dtype = dtype_from_name(name)
    return _AS_WORDS[dtype][1] if dtype in _AS_WORDS else _NATIVE[dtype]


def to_storage_array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor as the numpy array that goes to disk (raw words for bf16/fp8)."""
    tensor = tensor.detach().contiguous()
    if tensor.dtype in _AS_WORDS:
        word_dtype, zarr_name = _AS_WORDS[tensor.dtype]
        return tensor.view(word_dtype).numpy().view(np.dtype(zarr_name))
    return tensor.numpy()


def from_storage_array(array: np.ndarray, logical: str) -> torch.Tensor:
    """The inverse of ``to_storage_array``: numpy words -> tensor of the logical dtype."""
    dtype = dtype_from_name(logical)
    if not (array.flags.c_contiguous and array.flags.writeable):  # torch wants writable memory
        array = np.array(array, order="C", copy=True)  # keeps 0-d arrays 0-d, unlike ascontiguousarray
    if dtype in _AS_WORDS:
        word_dtype, _ = _AS_WORDS[dtype]
        return torch.from_numpy(array.view(np.int16 if word_dtype == torch.int16 else np.uint8)).view(dtype)
    return torch.from_numpy(array)


def checksum(array: np.ndarray) -> str:
    """sha256 of the array's stored bytes (C order, little-endian), hashed in place: no
    ``tobytes`` copy, and hashlib releases the GIL, so it runs beside tensorstore's I/O threads."""
    array = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False)
    return hashlib.sha256(array.reshape(-1).view(np.uint8).data).hexdigest()


def array_dirname(key: str) -> str:
    """A file-system-safe directory name for a tensor key ('/' and the like percent-encoded)."""
    return quote(key, safe="")


def _spec(path: str) -> dict[str, Any]:
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}


def create_array(path: str, global_shape: tuple, chunk_shape: tuple, logical: str) -> None:
    """Create the empty array (metadata only; chunks come from the ranks that own them)."""
    spec = _spec(path)
    spec["metadata"] = {
        "shape": list(global_shape),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
        "chunk_key_encoding": {"name": "default"},
        "data_type": storage_dtype(logical),
        "fill_value": False if logical == "bool" else 0,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "attributes": {LOGICAL_DTYPE_ATTR: logical},
    }
    ts.open(spec, create=True, delete_existing=True).result()


def open_array(path: str, key: str) -> Any:
    """Open an existing array, naming the tensor and path when it is missing or unreadable."""
    try:
        return ts.open(_spec(path), open=True).result()
    except Exception as exc:  # tensorstore raises ValueError/other for missing or bad metadata
        raise CheckpointError(
            f"array for tensor '{key}' at {path} cannot be opened ({exc}); the checkpoint is incomplete "
            "or corrupt — load another iteration"
        ) from exc


def _region(offset: tuple, shape: tuple) -> tuple:
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def start_write(array: Any, offset: tuple, data: np.ndarray) -> Any:
    """Begin writing ``data`` at ``offset``; returns the future (``.result()`` waits for the
    commit to the file). tensorstore references ``data`` rather than copying it, so the caller
    keeps it unchanged until the future is done; many writes may be in flight at once."""
    target = array if data.ndim == 0 else array[_region(offset, data.shape)]
    return target.write(data, can_reference_source_data_indefinitely=True)


def finish_write(future: Any) -> None:
    """Wait until a write from ``start_write`` is in the file."""
    future.result()


def write_region(array: Any, offset: tuple, data: np.ndarray) -> None:
    finish_write(start_write(array, offset, data))


def _read_failed(key: str, offset: tuple, shape: tuple, exc: Exception) -> CheckpointError:
    return CheckpointError(
        f"reading tensor '{key}' offset {offset} shape {shape} failed ({exc}); the array data is "
        "corrupt or missing — load another iteration"
    )


def start_read(array: Any, offset: tuple, shape: tuple, key: str) -> Any:
    """Begin reading the box ``offset``/``shape``; ``finish_read`` waits for it, so reads of
    the next tensor can run on tensorstore's threads while this one is checked."""
    try:
        return array.read() if not shape else array[_region(offset, shape)].read()
    except Exception as exc:  # a box outside the stored array fails before any I/O
        raise _read_failed(key, offset, shape, exc) from exc


def finish_read(future: Any, offset: tuple, shape: tuple, key: str) -> np.ndarray:
    try:
        return np.asarray(future.result())
    except Exception as exc:
        raise _read_failed(key, offset, shape, exc) from exc


def read_region(array: Any, offset: tuple, shape: tuple, key: str) -> np.ndarray:
    return finish_read(start_read(array, offset, shape, key), offset, shape, key)


def is_array(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "zarr.json"))
