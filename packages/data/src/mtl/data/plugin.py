"""mtl-data's registrations: its tokenizers and datasets, through the same hooks as any plugin."""

from __future__ import annotations

from mtl.core.hookspecs import hookimpl
from mtl.core.registrations import DatasetSpec, TokenizerSpec
from mtl.data.bert_dataset import build_bert_dataset
from mtl.data.blended_dataset import build_gpt_dataset
from mtl.data.classification_dataset import build_classification_dataset
from mtl.data.mock_dataset import build_mock_dataset
from mtl.data.t5_dataset import build_t5_dataset
from mtl.data.tokenizers.byte import build_byte_tokenizer
from mtl.data.tokenizers.gpt2_bpe import build_gpt2_bpe_tokenizer
from mtl.data.tokenizers.huggingface import build_hf_tokenizer
from mtl.data.tokenizers.sentencepiece_model import build_sentencepiece_tokenizer
from mtl.data.tokenizers.tiktoken_bpe import build_tiktoken_tokenizer


@hookimpl
def mtl_tokenizers() -> list[TokenizerSpec]:
    return [
        TokenizerSpec("byte", build_byte_tokenizer, False, "UTF-8 bytes + eod 256 (vocab 257)"),
        TokenizerSpec("hf", build_hf_tokenizer, True, "Hugging Face tokenizer.json"),
        TokenizerSpec("gpt2-bpe", build_gpt2_bpe_tokenizer, True, "GPT-2 vocab.json + merges.txt"),
        TokenizerSpec("sentencepiece", build_sentencepiece_tokenizer, True, "SentencePiece .model"),
        TokenizerSpec("tiktoken", build_tiktoken_tokenizer, True, "tiktoken BPE ranks file"),
    ]


@hookimpl
def mtl_datasets() -> list[DatasetSpec]:
    return [
        DatasetSpec("gpt", build_gpt_dataset, "Megatron-style GPT samples over .bin/.idx, blended"),
        DatasetSpec("bert", build_bert_dataset,
                    "Megatron-Core's BERT samples (masked LM, sentence pairs) over sentence-split .bin/.idx"),
        DatasetSpec("t5", build_t5_dataset,
                    "Megatron-Core's T5 samples (span corruption with sentinels) over .bin/.idx"),
        DatasetSpec("classification", build_classification_dataset,
                    "sequence classification (bert with model.num_labels) from JSONL lines of text, text_pair, label"),
        DatasetSpec("mock", build_mock_dataset, "deterministic random tokens"),
    ]
