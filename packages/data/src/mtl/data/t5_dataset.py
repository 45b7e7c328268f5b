"""T5 samples: span corruption with sentinel tokens, as Megatron-Core's T5MaskedWordPieceDataset.

A sample's sentences are joined and cut to its target length; spans are chosen by the n-gram
masking of ``mtl.data.masking`` (geometric span lengths up to 10 whole words by default).
Each span is replaced by the next sentinel in the encoder input, and the decoder predicts
every sentinel followed by the span it stands for:

    encoder  a b <extra_id_0> e f <extra_id_1> i          (padded to model.seq_length)
    decoder  [BOS] <extra_id_0> c d <extra_id_1> g h      (padded to data.decoder_seq_length)
    labels         <extra_id_0> c d <extra_id_1> g h [EOS]

Fields, names and dtypes are Megatron-Core's: ``text_enc``, ``text_dec``, ``labels`` (-1 on
padding), ``loss_mask``, ``enc_mask`` and ``dec_mask`` (1 on tokens, 0 on padding), all int64[s],
and ``truncated`` (int). Padding ids are written as 0.
"""

from __future__ import annotations

import numpy as np
import torch

from mtl.core.errors import ConfigError, DataError
from mtl.data.dataset_family import check_family
from mtl.data.masked_dataset import MaskedDataset, build_masked_split, masking_settings
from mtl.data.masked_vocabulary import masked_vocabulary, require_roles
from mtl.data.masking import create_masked_lm_predictions


class T5Dataset(MaskedDataset):
    kind = "t5"

    def __init__(self, *args, decoder_seq_length: int, **kwargs):
        self.decoder_seq_length = decoder_seq_length
        super().__init__(*args, **kwargs)

    def _mask_id(self, rng: np.random.RandomState) -> int | None:
        # masked tokens never reach a T5 sample (their spans become sentinels); Megatron
        # writes [MASK] over them all the same, drawing nothing
        return self.vocabulary.mask

    def _corrupt(self, tokens: list[int], spans) -> tuple[list[int], list[int], list[int]]:
        """(encoder input, decoder input, decoder output) of one sample."""
        v = self.vocabulary
        if len(spans) > len(v.sentinels):
            raise DataError(f"a t5 sample masks {len(spans)} spans but the vocabulary has "
                            f"{len(v.sentinels)} sentinels (<extra_id_0> ...); add more sentinel "
                            "tokens or lower data.mask_prob")
        encoder, decoder_in, decoder_out = [], [v.bos], []
        start = 0
        for sentinel, (positions, labels) in zip(v.sentinels, spans):
            encoder += tokens[start: positions[0]] + [sentinel]
            decoder_in += [sentinel, *labels]
            decoder_out += [sentinel, *labels]
            start = positions[-1] + 1
        encoder += tokens[start:]
        decoder_out.append(v.eos)
        return encoder, decoder_in, decoder_out

    def __getitem__(self, idx: int) -> dict:
        sentences, target_length, rng = self.sample_sentences(idx)
        tokens = [int(t) for sentence in sentences for t in sentence]
        truncated = len(tokens) > target_length
        tokens = tokens[:target_length]
        masked = create_masked_lm_predictions(tokens, target_length, rng, self.settings,
                                              self.vocabulary, self._mask_id)
        encoder, decoder_in, decoder_out = self._corrupt(masked.tokens, masked.spans)
        if len(decoder_in) > self.decoder_seq_length:
            raise DataError(f"t5 sample {idx} needs {len(decoder_in)} decoder tokens but "
                            f"data.decoder_seq_length = {self.decoder_seq_length}; raise it")
        pad = self.vocabulary.pad
        text_enc = np.pad(np.asarray(encoder, np.int64), (0, self.seq_length - len(encoder)),
                          constant_values=pad)
        text_dec = np.pad(np.asarray(decoder_in, np.int64), (0, self.decoder_seq_length - len(decoder_in)),
                          constant_values=pad)
        enc_mask = (text_enc != pad).astype(np.int64)
        dec_mask = (text_dec != pad).astype(np.int64)
        labels = np.pad(np.asarray(decoder_out, np.int64), (0, self.decoder_seq_length - len(decoder_out)),
                        constant_values=-1)
        loss_mask = np.zeros(self.decoder_seq_length, np.int64)
        loss_mask[: len(decoder_in)] = 1
        for array in (text_enc, text_dec, labels):
            array[array == pad] = 0  # padding must be an id the embedding holds
        return {"text_enc": torch.from_numpy(text_enc), "text_dec": torch.from_numpy(text_dec),
                "labels": torch.from_numpy(labels), "loss_mask": torch.from_numpy(loss_mask),
                "truncated": int(truncated), "enc_mask": torch.from_numpy(enc_mask),
                "dec_mask": torch.from_numpy(dec_mask)}


def build_t5_dataset(config, tokenizer, split: str, num_samples: int | None = None):
    """The registered ``t5`` dataset over ``data.paths`` (one prefix or a weighted blend)."""
    check_family(config, "t5")
    settings = masking_settings(config.data)
    vocabulary = masked_vocabulary(tokenizer, config.data.tokenizer, "t5")
    require_roles(vocabulary, ("bos", "eos"), config.data.tokenizer_model, "t5")
    if not vocabulary.sentinels:
        raise DataError(f"data.dataset = 't5': the vocabulary {config.data.tokenizer_model} has no "
                        "sentinel tokens <extra_id_0>, <extra_id_1>, ...; add them to the "
                        "tokenizer's special tokens (SentencePiece: user_defined_symbols)")
    if config.data.decoder_seq_length < 2:
        raise ConfigError(f"data.decoder_seq_length = {config.data.decoder_seq_length} leaves no room "
                        "for [BOS] and one sentinel; set it to at least 2 (Megatron's examples: 128)")
    seq_length = config.model.seq_length

    def component(indexed, document_range, samples, split_name, cache_dir):
        # the index packs sentences to seq_length less the two tokens Megatron reserves
        return T5Dataset(indexed, document_range, samples, seq_length, seq_length - 2, 1,
                         config.train.seed, settings, vocabulary, cache_dir, split_name,
                         decoder_seq_length=config.data.decoder_seq_length)

    return build_masked_split(config, split, num_samples, component)
