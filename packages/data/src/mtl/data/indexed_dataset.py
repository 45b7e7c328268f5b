"""Megatron-Core's ``.bin/.idx`` token storage: a memory-mapped reader and a streaming writer.

The ``.bin`` file is every sequence's tokens back to back. The ``.idx`` file is, in order
(little-endian):

    magic     9 bytes  b"MMIDIDX\\x00\\x00"
    version   uint64   1
    dtype     uint8    code of the token dtype (DTYPE_CODES)
    S         uint64   number of sequences
    D         uint64   number of document-index entries (documents + 1)
    lengths   int32[S] tokens per sequence
    pointers  int64[S] byte offset of each sequence in .bin
    documents int64[D] sequence index where each document starts; the last is S

A document is one or more consecutive sequences (several when sentences were split).
"""

from __future__ import annotations

import os
import struct
from typing import Sequence

import numpy as np

from mtl.core.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, S, D
DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}


def dtype_code(dtype: np.dtype | type) -> int:
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    raise DataError(f"token dtype {np.dtype(dtype)} cannot be stored in a .bin/.idx dataset "
                    f"(allowed: {', '.join(str(np.dtype(t)) for t in DTYPE_CODES.values())})")


def optimal_dtype(vocab_size: int) -> type:
    """uint16 when every id fits with room to spare (Megatron's 65500 cut-off), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_paths(prefix: str) -> tuple[str, str]:
    return f"{prefix}.bin", f"{prefix}.idx"


class IndexedDatasetBuilder:
    """Appends documents to ``bin_path``; ``finalize(idx_path)`` writes the index.

    Sequence lengths are kept in memory (4 bytes per sequence); tokens go straight to disk."""

    def __init__(self, bin_path: str, dtype: np.dtype | type = np.int32):
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # refuse unstorable dtypes before writing anything
        self._bin = open(bin_path, "wb")
        self._length_chunks: list[np.ndarray] = []
        self._document_chunks: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self._num_sequences = 0

    def add_document(self, tokens: Sequence[int] | np.ndarray,
                     lengths: Sequence[int] | None = None) -> None:
        """One document; ``lengths`` splits it into sequences (default: one sequence)."""
        array = np.asarray(tokens, dtype=self.dtype)
        lengths_array = np.asarray([array.size] if lengths is None else lengths, dtype=np.int32)
        if int(lengths_array.sum()) != array.size:
            raise DataError(f"{self.bin_path}: sequence lengths sum to {int(lengths_array.sum())} "
                            f"but the document has {array.size} tokens")
        self._bin.write(array.tobytes(order="C"))
        self._append_index(lengths_array, np.asarray([lengths_array.size], dtype=np.int64))

    def add_documents(self, tokens: np.ndarray, sequence_lengths: np.ndarray,
                      sequences_per_document: np.ndarray | None = None) -> None:
        """Many documents at once: ``tokens`` is the concatenation of their sequences, and
        document k is the next ``sequences_per_document[k]`` sequences (default: one each)."""
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        sequence_lengths = np.asarray(sequence_lengths, dtype=np.int32)
        if int(sequence_lengths.sum(dtype=np.int64)) != tokens.size:
            raise DataError(f"{self.bin_path}: sequence lengths sum to "
                            f"{int(sequence_lengths.sum())} but {tokens.size} tokens were given")
        if sequences_per_document is None:
            sequences_per_document = np.ones(sequence_lengths.size, dtype=np.int64)
        sequences_per_document = np.asarray(sequences_per_document, dtype=np.int64)
        if int(sequences_per_document.sum()) != sequence_lengths.size:
            raise DataError(f"{self.bin_path}: the documents hold {int(sequences_per_document.sum())} "
                            f"sequences but {sequence_lengths.size} sequence lengths were given")
        tokens.tofile(self._bin)
        self._append_index(sequence_lengths, sequences_per_document)

    def _append_index(self, sequence_lengths: np.ndarray, sequences_per_document: np.ndarray) -> None:
        self._length_chunks.append(sequence_lengths)
        # document boundaries in sequence space: previous total + running sum
        self._document_chunks.append(self._num_sequences + np.cumsum(sequences_per_document))
        self._num_sequences += int(sequence_lengths.size)

    def add_index(self, prefix: str) -> None:
        """Append every document of an existing dataset (tokens copied as they are)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise DataError(f"{prefix}: dtype {other.dtype} differs from the builder's {self.dtype}")
        with open(data_file_paths(prefix)[0], "rb") as f:
            while chunk := f.read(1 << 24):
                self._bin.write(chunk)
        self._append_index(other.sequence_lengths.astype(np.int32),
                           np.diff(other.document_indices).astype(np.int64))

    def finalize(self, idx_path: str) -> None:
        self._bin.close()
        lengths = (np.concatenate(self._length_chunks) if self._length_chunks
                   else np.zeros(0, dtype=np.int32)).astype(np.int32)
        documents = np.concatenate(self._document_chunks).astype(np.int64)
        pointers = np.zeros(lengths.size, dtype=np.int64)
        # byte offset of sequence i = itemsize * tokens before it
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        with open(idx_path, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", dtype_code(self.dtype)))
            f.write(struct.pack("<Q", lengths.size))
            f.write(struct.pack("<Q", documents.size))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(documents.tobytes(order="C"))


class IndexedDataset:
    """Read-only view of ``prefix.bin``/``prefix.idx``; sequences come back as numpy arrays."""

    def __init__(self, prefix: str):
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = data_file_paths(self.prefix)
        self._read_index()
        self._open_bin()

    def _read_index(self) -> None:
        path = self.idx_path
        if not os.path.isfile(path):
            raise DataError(f"index file {path} does not exist; run `mtl preprocess` to create "
                            f"{self.prefix}.bin/.idx or fix data.paths")
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE:
            raise DataError(f"index file {path} is truncated ({size} bytes, the header alone "
                            f"is {HEADER_SIZE}); preprocess the data again")
        if header[: len(MAGIC)] != MAGIC:
            raise DataError(f"{path} is not a Megatron .idx file (magic {header[:len(MAGIC)]!r}, "
                            f"expected {MAGIC!r})")
        version, code, num_sequences, num_documents = struct.unpack("<QBQQ", header[len(MAGIC):])
        if version != VERSION:
            raise DataError(f"{path}: index version {version} is not supported (only {VERSION})")
        if code not in DTYPE_CODES:
            raise DataError(f"{path}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER_SIZE + num_sequences * (4 + 8) + num_documents * 8
        # Multimodal Megatron indices append one int8 mode per sequence; accept and ignore it.
        if size not in (expected, expected + num_sequences):
            raise DataError(f"index file {path} has {size} bytes but its header promises "
                            f"{expected} ({num_sequences} sequences, {num_documents} documents): "
                            "it is truncated or corrupt; preprocess the data again")
        index = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(index, np.int32, num_sequences, offset)
        offset += 4 * num_sequences
        self.sequence_pointers = np.frombuffer(index, np.int64, num_sequences, offset)
        offset += 8 * num_sequences
        self.document_indices = np.frombuffer(index, np.int64, num_documents, offset)
        docs = self.document_indices
        if num_documents == 0 or docs[0] != 0 or docs[-1] != num_sequences or np.any(np.diff(docs) < 0):
            raise DataError(f"index file {path}: document indices are not a non-decreasing run "
                            f"from 0 to {num_sequences}; the file is corrupt")

    def _open_bin(self) -> None:
        if not os.path.isfile(self.bin_path):
            raise DataError(f"data file {self.bin_path} does not exist (its index {self.idx_path} "
                            "does); copy both files or preprocess again")
        size = os.path.getsize(self.bin_path)
        tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        if size != tokens * self.dtype.itemsize:
            raise DataError(f"data file {self.bin_path} has {size} bytes but {self.idx_path} "
                            f"describes {tokens} tokens of {self.dtype} "
                            f"({tokens * self.dtype.itemsize} bytes); the pair does not match")
        if len(self.sequence_lengths):
            ends = self.sequence_pointers + self.sequence_lengths.astype(np.int64) * self.dtype.itemsize
            if self.sequence_pointers.min() < 0 or ends.max() > size:
                raise DataError(f"{self.idx_path}: sequence pointers reach outside "
                                f"{self.bin_path}; the index is corrupt")
        # a plain ndarray over the mapped file, so slices are ndarrays, not memmaps
        self._bin = (np.frombuffer(np.memmap(self.bin_path, dtype=np.uint8, mode="r"), self.dtype)
                     if size else np.zeros(0, dtype=self.dtype))

    def __getstate__(self) -> dict:
        # DataLoader workers started with 'spawn' pickle the dataset: send the prefix and map
        # the files again on the other side instead of copying every token.
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset .. offset+length`` of sequence ``idx`` (a view into the mmap)."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {self.prefix} ({n} sequences)")
        seq_length = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_length - offset
        if offset < 0 or length < 0 or offset + length > seq_length:
            raise IndexError(f"tokens {offset}..{offset + length} out of range for sequence {idx} "
                             f"of {self.prefix} (length {seq_length})")
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        return self._bin[start: start + length]

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))
