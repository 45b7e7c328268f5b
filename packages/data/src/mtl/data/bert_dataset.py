"""BERT samples: two segments of sentences, 15% of tokens masked 80/10/10, as Megatron-Core.

Each sample is ``[CLS] A [SEP] B [SEP]`` padded to ``seq_length``: A and B are the sample's
sentences cut at a random pivot, swapped with probability 1/2 for the binary (sentence order)
head (``is_random``), trimmed one token at a time from a random end of the longer segment to
the target length. A masked token becomes [MASK] 80% of the time, a random vocabulary id 10%,
itself 10%. The fields, names and dtypes are Megatron-Core's BERTMaskedWordPieceDataset's:

    text          int64[s]  token ids (padding: 0)
    types         int64[s]  segment of each token: 0 for [CLS] A [SEP], 1 for B [SEP]
    labels        int64[s]  the original token at masked positions, -1 elsewhere (pad id -> 0)
    is_random     int       1 where A and B were swapped
    padding_mask  int64[s]  1 on tokens; on padding the pad id (0 for [PAD] = 0, as Megatron)
    loss_mask     int64[s]  1 at masked positions
    truncated     int       1 where the segments were trimmed
"""

from __future__ import annotations

import numpy as np
import torch

from mtl.core.errors import DataError
from mtl.data.dataset_family import check_family
from mtl.data.masked_dataset import MaskedDataset, build_masked_split, masking_settings
from mtl.data.masked_vocabulary import masked_vocabulary, require_roles
from mtl.data.masking import create_masked_lm_predictions


class BertDataset(MaskedDataset):
    kind = "bert"

    def __init__(self, *args, binary_head: bool, **kwargs):
        self.binary_head = binary_head
        super().__init__(*args, **kwargs)

    def _replacement(self, rng: np.random.RandomState) -> int | None:
        """80%: [MASK]; 10%: a random id (Megatron's lookup, in id order); 10%: unchanged."""
        if rng.random() < 0.8:
            return self.vocabulary.mask
        if rng.random() >= 0.5:
            return int(rng.randint(0, self.vocabulary.size))
        return None

    def _segments(self, sentences: list[np.ndarray], target_length: int,
                  rng: np.random.RandomState) -> tuple[list[int], list[int], bool, bool]:
        """(A, B, is_random, truncated)."""
        pivot, is_random = len(sentences), False
        if self.binary_head:
            pivot = int(rng.randint(low=1, high=len(sentences))) if len(sentences) >= 3 else 1
            is_random = rng.random() < 0.5
        a = [int(t) for sentence in sentences[:pivot] for t in sentence]
        b = [int(t) for sentence in sentences[pivot:] for t in sentence]
        if is_random:
            a, b = b, a
        truncated = len(a) + len(b) > target_length
        while len(a) + len(b) > target_length:
            longer = a if len(a) > len(b) else b
            del longer[0 if rng.random() < 0.5 else -1]
        return a, b, is_random, truncated

    def __getitem__(self, idx: int) -> dict:
        sentences, target_length, rng = self.sample_sentences(idx)
        a, b, is_random, truncated = self._segments(sentences, target_length, rng)
        v, s = self.vocabulary, self.seq_length
        tokens = [v.cls, *a, v.sep] + ([*b, v.sep] if b else [])
        types = [0] * (len(a) + 2) + ([1] * (len(b) + 1) if b else [])
        masked = create_masked_lm_predictions(tokens, target_length, rng, self.settings, v,
                                              self._replacement)
        pads = s - len(tokens)
        text = np.pad(np.asarray(masked.tokens, np.int64), (0, pads), constant_values=v.pad)
        # Megatron pads the segment ids with the pad id and writes the pad id into the padding
        # mask at padding positions, which is right only for a pad id of 0 (BERT's): with RoBERTa's
        # pad id 1 its padding would count as real tokens and as segment 1. Zeros here give the
        # same samples where the pad id is 0, and the right mask and segments where it is not.
        types_array = np.pad(np.asarray(types, np.int64), (0, pads), constant_values=0)
        padding_mask = np.ones(s, np.int64)
        padding_mask[text == v.pad] = 0
        labels = np.full(s, -1, np.int64)
        labels[masked.positions] = masked.labels
        loss_mask = np.zeros(s, np.int64)
        loss_mask[masked.positions] = 1
        text[text == v.pad] = 0  # padding must be an id the embedding holds
        labels[labels == v.pad] = 0
        return {"text": torch.from_numpy(text), "types": torch.from_numpy(types_array),
                "labels": torch.from_numpy(labels), "is_random": int(is_random),
                "padding_mask": torch.from_numpy(padding_mask), "loss_mask": torch.from_numpy(loss_mask),
                "truncated": int(truncated)}


def _check_sentence_pairs(indexed, document_range: tuple[int, int]) -> None:
    first, end = document_range
    sentences_per_document = np.diff(indexed.document_indices[first: end + 1])
    if sentences_per_document.size and sentences_per_document.max() < 2:
        raise DataError(f"{indexed.prefix}: every document is one sequence, but model.binary_head "
                        "needs sentence pairs; preprocess the corpus again with `mtl preprocess "
                        "--split-sentences` (or set model.binary_head = false)")


def build_bert_dataset(config, tokenizer, split: str, num_samples: int | None = None):
    """The registered ``bert`` dataset over ``data.paths`` (one prefix or a weighted blend)."""
    check_family(config, "bert")
    settings = masking_settings(config.data)
    vocabulary = masked_vocabulary(tokenizer, config.data.tokenizer, "bert")
    require_roles(vocabulary, ("cls", "sep", "mask"), config.data.tokenizer_model, "bert")
    binary_head = bool(getattr(config.model, "binary_head", False))
    seq_length = config.model.seq_length

    def component(indexed, document_range, samples, split_name, cache_dir):
        if binary_head:
            _check_sentence_pairs(indexed, document_range)
        # the index packs sentences to seq_length less [CLS] and two [SEP]; pairs need two
        return BertDataset(indexed, document_range, samples, seq_length, seq_length - 3,
                           2 if binary_head else 1, config.train.seed, settings, vocabulary,
                           cache_dir, split_name, binary_head=binary_head)

    return build_masked_split(config, split, num_samples, component)
