"""JSONL / plain text -> tokenized ``P.bin``/``P.idx`` (one sequence per document).

The main process reads the input in chunks of lines; a pool of workers parses and tokenizes
each chunk and returns its tokens as one numpy array, so the writer does no per-token
Python work. Chunks come back in input order (ordered ``imap``). The output is written
under temporary names and renamed at the end: a failure leaves no half-written dataset.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
from tqdm import tqdm

from mtl.core.errors import DataError
from mtl.core.plugins import registry
from mtl.data.indexed_dataset import IndexedDatasetBuilder, data_file_paths, optimal_dtype

CHUNK_LINES = 512  # lines per task: large enough that pickling/IPC cost is amortised


@dataclass(frozen=True)
class PreprocessStats:
    docs: int
    tokens: int
    seconds: float
    docs_per_s: float
    mb_per_s: float  # input megabytes (10^6 bytes) per second


@dataclass(frozen=True)
class _Job:
    """What each worker needs to tokenize: picklable by reference."""

    build_tokenizer: Callable[[str | None], Any]
    tokenizer_model: str | None
    input_path: str
    is_json: bool
    json_key: str
    append_eod: bool
    dtype: str


_worker_state: dict[str, Any] = {}


def _init_worker(job: _Job) -> None:
    _worker_state["job"] = job
    _worker_state["tokenizer"] = job.build_tokenizer(job.tokenizer_model)


def _document_text(line: bytes, line_no: int, job: _Job) -> str | None:
    """The document of one input line, or None for a blank line."""
    if not line.strip():
        return None
    if not job.is_json:
        try:
            return line.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as exc:
            raise DataError(f"{job.input_path} line {line_no}: not UTF-8 text ({exc}); convert "
                            "the file to UTF-8") from None
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{job.input_path} line {line_no}: not valid JSON ({exc}); fix or "
                        "remove the line") from None
    if not isinstance(record, dict) or job.json_key not in record:
        present = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{job.input_path} line {line_no}: no key {job.json_key!r} "
                        f"(present: {present}); pass the right --json-key")
    text = record[job.json_key]
    if not isinstance(text, str):
        raise DataError(f"{job.input_path} line {line_no}: {job.json_key!r} is a "
                        f"{type(text).__name__}, expected a string")
    return text


def _tokenize_chunk(chunk: tuple[int, list[bytes]]) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens of all documents concatenated, tokens per document, input bytes)."""
    first_line_no, lines = chunk
    job: _Job = _worker_state["job"]
    tokenizer = _worker_state["tokenizer"]
    texts = [_document_text(line, first_line_no + i, job) for i, line in enumerate(lines)]
    texts = [t for t in texts if t is not None]
    encode_batch = getattr(tokenizer, "encode_batch", None)
    docs = encode_batch(texts) if encode_batch else [tokenizer.encode(t) for t in texts]
    if job.append_eod:
        # as Megatron: an empty document stays empty, it gets no lone eod
        docs = [doc + [tokenizer.eod] if doc else doc for doc in docs]
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int32, count=len(docs))
    tokens = np.fromiter(itertools.chain.from_iterable(docs), dtype=job.dtype,
                         count=int(lengths.sum(dtype=np.int64)))
    return tokens, lengths, sum(len(line) for line in lines)


def _line_chunks(path: str) -> Iterator[tuple[int, list[bytes]]]:
    with open(path, "rb") as f:
        line_no = 1
        while True:
            lines = list(itertools.islice(f, CHUNK_LINES))
            if not lines:
                return
            yield line_no, lines
            line_no += len(lines)


def preprocess(
    input_path: str,
    output_prefix: str,
    tokenizer_name: str,
    tokenizer_model: str | None = None,
    json_key: str = "text",
    workers: int = 1,
    append_eod: bool = False,
    progress: bool = True,
    overwrite: bool = True,
) -> PreprocessStats:
    """Tokenize ``input_path`` into ``output_prefix.bin/.idx``.

    ``.jsonl``/``.json`` files hold one JSON object per line with the text under
    ``json_key``; any other file is plain text, one document per line. Blank lines are
    skipped. ``workers`` > 1 tokenizes in that many processes. ``overwrite=False`` refuses,
    before any tokenizing, a prefix whose ``.bin`` or ``.idx`` exists already (``mtl
    preprocess`` without ``--overwrite``: another corpus's dataset is not replaced by mistake)."""
    input_path = os.fspath(input_path)
    if not os.path.isfile(input_path):
        raise DataError(f"input file {input_path} does not exist")
    if workers < 1:
        raise DataError(f"workers = {workers} must be at least 1")
    existing = [path for path in data_file_paths(os.fspath(output_prefix)) if os.path.exists(path)]
    if existing and not overwrite:
        raise DataError(f"output prefix {output_prefix} already holds {', '.join(existing)}: pass --overwrite "
                        f"(overwrite=True) to replace it, or choose another --output-prefix")
    spec = registry("tokenizer").get(tokenizer_name)
    tokenizer = spec.build(tokenizer_model)  # fail here, before any worker starts
    dtype = np.dtype(optimal_dtype(tokenizer.vocab_size))
    job = _Job(spec.build, tokenizer_model, input_path,
               input_path.endswith((".jsonl", ".json")), json_key, append_eod, dtype.str)

    output_prefix = os.fspath(output_prefix)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    bin_path, idx_path = data_file_paths(output_prefix)
    tmp_bin, tmp_idx = f"{bin_path}.tmp{os.getpid()}", f"{idx_path}.tmp{os.getpid()}"
    start = time.perf_counter()
    docs = tokens = 0
    pool = None
    try:
        builder = IndexedDatasetBuilder(tmp_bin, dtype)
        if workers == 1:
            _init_worker(job)
            results = map(_tokenize_chunk, _line_chunks(input_path))
        else:
            pool = multiprocessing.get_context().Pool(workers, _init_worker, (job,))
            results = pool.imap(_tokenize_chunk, _line_chunks(input_path))
        with tqdm(total=os.path.getsize(input_path), unit="B", unit_scale=True,
                  desc=f"preprocess {os.path.basename(input_path)}", disable=not progress) as bar:
            for chunk_tokens, chunk_lengths, chunk_bytes in results:
                builder.add_documents(chunk_tokens, chunk_lengths)
                docs += len(chunk_lengths)
                tokens += chunk_tokens.size
                bar.update(chunk_bytes)
        builder.finalize(tmp_idx)
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
    except BaseException:
        for path in (tmp_bin, tmp_idx):
            if os.path.exists(path):
                os.remove(path)
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        _worker_state.clear()
    seconds = time.perf_counter() - start
    size = os.path.getsize(input_path)
    return PreprocessStats(docs, tokens, seconds, docs / max(seconds, 1e-9),
                           size / 1e6 / max(seconds, 1e-9))
