"""Sequence-classification samples (GLUE-style fine-tuning) from JSONL files.

Each line of each ``data.paths`` file is ``{"text": str, "label": int}`` with an optional
``"text_pair": str``. A sample is what HF's BERT tokenizer makes of it with
``truncation=True, padding="max_length", max_length=seq_length``: ``[CLS] a [SEP]`` (``+ b
[SEP]``), token types 0 for the first segment and 1 for the second, ``[PAD]`` to
``model.seq_length``, truncated longest-first. Fields: ``text``, ``types``, ``padding_mask``
(1: a real token) ``[s]`` and ``label`` (a 0-d int).

The lines of all files, in order, are cut into train/valid/test ranges by ``data.split`` (as
Megatron cuts documents). Every line is read, checked (a label outside ``model.num_labels``
is one error naming the file, line and value) and tokenized when the dataset is built, before
any compute. Training walks its range epoch after epoch, each epoch in its own seeded order;
valid and test walk theirs in file order.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from mtl.core.errors import ConfigError, DataError
from mtl.core.log import get_logger
from mtl.data.blended_dataset import parse_split, split_document_ranges
from mtl.data.dataset_family import check_family
from mtl.data.masked_vocabulary import NO_PAD_ID, masked_vocabulary, require_roles

SPLITS = ("train", "valid", "test")
log = get_logger(__name__)


def read_examples(paths: list[str], num_labels: int) -> list[tuple[str, str | None, int]]:
    """(text, text_pair or None, label) per line of every file; a DataError names the file and
    line of anything malformed."""
    examples = []
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"data.paths: {path} does not exist; data.dataset = 'classification' reads JSONL files")
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    examples.append(_example(_parse(line, path, number), path, number, num_labels))
    if not examples:
        raise DataError(f"data.paths = {paths} hold no examples (one JSON object per line)")
    return examples


def _parse(line: str, path: str, number: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{number}: not a JSON object ({exc.msg}); write one object per line") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}:{number}: {type(record).__name__} where a JSON object was expected")
    return record


def _example(record: dict, path: str, number: int, num_labels: int) -> tuple[str, str | None, int]:
    text, pair, label = record.get("text"), record.get("text_pair"), record.get("label")
    if not isinstance(text, str):
        raise DataError(f"{path}:{number}: \"text\" must be a string (have {text!r})")
    if pair is not None and not isinstance(pair, str):
        raise DataError(f"{path}:{number}: \"text_pair\" must be a string or absent (have {pair!r})")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < num_labels:
        raise DataError(f"{path}:{number}: label {label!r} is not a class of model.num_labels = {num_labels} "
                        f"(an integer 0..{num_labels - 1}); fix the line or raise model.num_labels")
    return text, pair or None, label  # an empty text_pair is no pair, as HF's tokenizers read it


def pair_lengths(first: int, second: int, budget: int) -> tuple[int, int]:
    """How many tokens of each segment stay: HF tokenizers' longest-first truncation (the longer
    segment is cut first; where both must be cut each keeps about half, the second the odd token)."""
    if first + second <= budget:
        return first, second
    shorter, longer = min(first, second), max(first, second)
    longer = max(shorter, budget - shorter)
    if shorter + longer > budget:
        shorter, longer = budget // 2, budget // 2 + budget % 2
    return (longer, shorter) if first > second else (shorter, longer)


class ClassificationDataset(torch.utils.data.Dataset):
    """``num_samples`` samples over ``examples`` (tokenized id lists with labels)."""

    def __init__(self, encoded: list[tuple[list[int], list[int] | None, int]], seq_length: int, cls: int, sep: int,
                 pad: int, num_samples: int, seed: int, split: str):
        count = len(encoded)
        self.text = np.full((count, seq_length), pad, dtype=np.int64)
        self.types = np.zeros((count, seq_length), dtype=np.int64)
        self.padding_mask = np.zeros((count, seq_length), dtype=np.int64)
        self.labels = np.array([label for _, _, label in encoded], dtype=np.int64)
        for row, (first, second, _) in enumerate(encoded):
            specials = 3 if second is not None else 2
            keep_a, keep_b = pair_lengths(len(first), len(second or []), seq_length - specials)
            tokens = [cls, *first[:keep_a], sep]
            if second is not None:
                tokens += [*second[:keep_b], sep]
                self.types[row, keep_a + 2:len(tokens)] = 1
            self.text[row, :len(tokens)] = tokens
            self.padding_mask[row, :len(tokens)] = 1
        self.num_samples, self.count = num_samples, count
        self.seed, self.split_id, self.shuffled = seed, SPLITS.index(split), split == "train"
        self._order: tuple[int, np.ndarray | None] = (-1, None)  # (epoch, its permutation)

    def __len__(self) -> int:
        return self.num_samples

    def _example_index(self, idx: int) -> int:
        epoch, position = divmod(idx, self.count)
        if not self.shuffled:
            return position
        # one permutation per epoch, a function of (seed, epoch) alone, so any sample is found
        # directly; the current epoch's is kept (samples are read in order, epoch after epoch)
        if self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, self.split_id, epoch]).permutation(self.count))
        return int(self._order[1][position])

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range ({self.num_samples} samples)")
        row = self._example_index(idx)
        return {"text": torch.from_numpy(self.text[row]), "types": torch.from_numpy(self.types[row]),
                "padding_mask": torch.from_numpy(self.padding_mask[row]),
                "label": torch.tensor(self.labels[row])}


def build_classification_dataset(config, tokenizer, split: str, num_samples: int | None = None):
    """The registered ``classification`` dataset: ``split``'s range of the lines of ``data.paths``."""
    if split not in SPLITS:
        raise ConfigError(f"dataset split {split!r} is not one of {', '.join(SPLITS)}")
    check_family(config, "classification")
    num_labels = config.model.num_labels
    vocabulary = masked_vocabulary(tokenizer, config.data.tokenizer, "classification")
    require_roles(vocabulary, ("cls", "sep"), config.data.tokenizer_model, "classification")
    if vocabulary.pad == NO_PAD_ID:
        raise DataError(f"data.dataset = 'classification': the vocabulary {config.data.tokenizer_model} has no "
                        "padding token of its own ([PAD]); add one to the tokenizer's special tokens")
    examples = read_examples([str(p) for p in config.data.paths], num_labels)
    first, end = split_document_ranges(len(examples), parse_split(config.data.split))[SPLITS.index(split)]
    if first == end:
        raise DataError(f"data.split = {config.data.split!r} leaves the {split} split none of the "
                        f"{len(examples)} examples of data.paths; raise its share")
    chosen = examples[first:end]
    firsts = tokenizer.encode_batch([text for text, _, _ in chosen])
    pairs = [pair for _, pair, _ in chosen]
    seconds = iter(tokenizer.encode_batch([p for p in pairs if p is not None]))
    encoded = [(a, next(seconds) if pair is not None else None, label)
               for a, pair, (_, _, label) in zip(firsts, pairs, chosen)]
    samples = len(encoded) if num_samples is None else num_samples
    if split != "train":
        _say_what_an_evaluation_scores(config, split, len(encoded))
    return ClassificationDataset(encoded, config.model.seq_length, vocabulary.cls, vocabulary.sep, vocabulary.pad,
                                 samples, config.train.seed, split)


def _say_what_an_evaluation_scores(config, split: str, lines: int) -> None:
    """An evaluation reads ``train.eval_iters`` global batches from the split's start: one line
    when that is not each of the split's lines exactly once (a GLUE-style dev accuracy)."""
    t = config.train
    scored = t.eval_iters * t.global_batch_size
    if scored == lines:
        return
    what = f"only its first {scored}" if scored < lines else f"{scored - lines} of them twice"
    log.warning("data.dataset = 'classification': an evaluation scores train.eval_iters x train.global_batch_size "
                "= %d samples of the %s split's %d lines, %s; for an accuracy over each line once, make the "
                "split a multiple of the global batch and train.eval_iters = lines / global batch",
                scored, split, lines, what)

