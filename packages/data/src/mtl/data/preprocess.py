"""JSONL / plain text -> tokenized ``P.bin``/``P.idx``: one sequence per document, or with
``split_sentences`` one per sentence, the document boundaries kept in the index as Megatron's
``preprocess_data.py --split-sentences`` keeps them (what BERT's sentence pairs need).

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
from mtl.data.sentence_split import build_sentence_splitter

CHUNK_LINES = 512  # lines per task: large enough that pickling/IPC cost is amortised


@dataclass(frozen=True)
class PreprocessStats:
    docs: int
    tokens: int
    seconds: float
    docs_per_s: float
    mb_per_s: float  # input megabytes (10^6 bytes) per second
    sequences: int = 0  # sequences written: sentences with split_sentences, else = docs
    splitter: str | None = None  # which sentence splitter ran, None without split_sentences


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
    split_sentences: bool = False
    lang: str = "english"


_worker_state: dict[str, Any] = {}


def _init_worker(job: _Job) -> None:
    _worker_state["job"] = job
    _worker_state["tokenizer"] = job.build_tokenizer(job.tokenizer_model)
    if job.split_sentences:
        _worker_state["splitter"] = build_sentence_splitter(job.lang)


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


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    encode_batch = getattr(tokenizer, "encode_batch", None)
    return encode_batch(texts) if encode_batch else [tokenizer.encode(t) for t in texts]


def _split_documents(texts: list[str], tokenizer, splitter, append_eod: bool
                     ) -> tuple[list[list[int]], list[int]]:
    """(token ids of every kept sentence, sentences per document), as Megatron's encoder:
    sentences that tokenize to nothing are dropped, eod joins the last sentence, and a
    document left with no tokens stays in the index with no sentences."""
    sentences_of = [splitter.split(text) for text in texts]
    ids = iter(_encode(tokenizer, [s for sentences in sentences_of for s in sentences]))
    kept: list[list[int]] = []
    per_document: list[int] = []
    for sentences in sentences_of:
        document = [sentence_ids for sentence_ids in itertools.islice(ids, len(sentences))
                    if sentence_ids]
        if document and append_eod:
            document[-1] = document[-1] + [tokenizer.eod]
        kept += document
        per_document.append(len(document))
    return kept, per_document


def _tokenize_chunk(chunk: tuple[int, list[bytes]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(tokens of all sequences concatenated, tokens per sequence, sequences per document,
    input bytes); a sequence is a document, or a sentence with split_sentences."""
    first_line_no, lines = chunk
    job: _Job = _worker_state["job"]
    tokenizer = _worker_state["tokenizer"]
    texts = [_document_text(line, first_line_no + i, job) for i, line in enumerate(lines)]
    texts = [t for t in texts if t is not None]
    if job.split_sentences:
        sequences, per_document = _split_documents(texts, tokenizer, _worker_state["splitter"],
                                                   job.append_eod)
    else:
        sequences = _encode(tokenizer, texts)
        if job.append_eod:
            # as Megatron: an empty document stays empty, it gets no lone eod
            sequences = [doc + [tokenizer.eod] if doc else doc for doc in sequences]
        per_document = [1] * len(sequences)
    lengths = np.fromiter((len(d) for d in sequences), dtype=np.int32, count=len(sequences))
    tokens = np.fromiter(itertools.chain.from_iterable(sequences), dtype=job.dtype,
                         count=int(lengths.sum(dtype=np.int64)))
    return tokens, lengths, np.asarray(per_document, dtype=np.int64), sum(len(line) for line in lines)


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
    split_sentences: bool = False,
    lang: str = "english",
) -> PreprocessStats:
    """Tokenize ``input_path`` into ``output_prefix.bin/.idx``.

    ``.jsonl``/``.json`` files hold one JSON object per line with the text under
    ``json_key``; any other file is plain text, one document per line. Blank lines are
    skipped. ``workers`` > 1 tokenizes in that many processes. ``overwrite=False`` refuses,
    before any tokenizing, a prefix whose ``.bin`` or ``.idx`` exists already (``mtl
    preprocess`` without ``--overwrite``: another corpus's dataset is not replaced by mistake).
    ``split_sentences`` writes one sequence per sentence (NLTK Punkt for ``lang``), documents
    as runs of sentences in the index, as Megatron's ``--split-sentences``."""
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
    splitter = build_sentence_splitter(lang) if split_sentences else None
    dtype = np.dtype(optimal_dtype(tokenizer.vocab_size))
    job = _Job(spec.build, tokenizer_model, input_path,
               input_path.endswith((".jsonl", ".json")), json_key, append_eod, dtype.str,
               split_sentences, lang)

    output_prefix = os.fspath(output_prefix)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    bin_path, idx_path = data_file_paths(output_prefix)
    tmp_bin, tmp_idx = f"{bin_path}.tmp{os.getpid()}", f"{idx_path}.tmp{os.getpid()}"
    start = time.perf_counter()
    docs = tokens = sequences = 0
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
            for chunk_tokens, chunk_lengths, chunk_documents, chunk_bytes in results:
                builder.add_documents(chunk_tokens, chunk_lengths, chunk_documents)
                docs += len(chunk_documents)
                sequences += len(chunk_lengths)
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
                           size / 1e6 / max(seconds, 1e-9), sequences,
                           splitter.description if splitter else None)
