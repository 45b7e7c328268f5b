"""The ``t5`` dataset builds Megatron-Core 0.16.1's T5MaskedWordPieceDataset samples, field for
field: SentencePiece on one corpus, a WordPiece tokenizer.json on a blend."""

import os

import numpy as np
import pytest

from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError, DataError
from mtl.core.plugins import registry
from mtl.data.demo_corpus import write_demo_corpus
from mtl.data.preprocess import preprocess

pytest.importorskip("nltk")
megatron_t5 = pytest.importorskip("megatron.core.datasets.t5_dataset")
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.tokenizers import MegatronTokenizer  # noqa: E402

FIELDS = ("text_enc", "text_dec", "labels", "loss_mask", "truncated", "enc_mask", "dec_mask")
SEQ_LENGTH, DECODER_SEQ_LENGTH, SEED, NUM_SAMPLES = 64, 32, 77, 100


def megatron_tokenizer(tokenizer_name, model, sentinels):
    if tokenizer_name == "sentencepiece":
        # Megatron's SentencePiece wrapper names its special tokens only in legacy mode; the
        # cls/sep/mask names are new ids past the vocabulary, so no corpus token is one (as ours: none)
        tokenizer = MegatronTokenizer.from_pretrained(
            str(model), metadata_path={"library": "sentencepiece", "model_type": "t5"}, legacy=True,
            special_tokens={"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
                            "cls_token": "<cls>", "sep_token": "<sep>", "mask_token": "<mask>"})
        inner = tokenizer._tokenizer
        inner.add_special_tokens(sentinels)
        # its inv_vocab is rebuilt from every piece on each lookup (one per token masked):
        # freeze it, the same dict in the same order, to keep this test fast
        frozen = inner.inv_vocab
        inner.__class__ = type("FrozenVocabulary", (type(inner),), {"inv_vocab": property(lambda self: frozen)})
        return tokenizer
    tokenizer = MegatronTokenizer.from_pretrained(
        os.path.dirname(model), metadata_path={"library": "huggingface", "model_type": "t5"},
        additional_special_tokens=sentinels)
    # its wrapper copies the sentinels from transformers' SPECIAL_TOKENS_ATTRIBUTES, which
    # transformers 5 no longer lists as "additional_special_tokens": hand them over directly
    tokenizer._tokenizer.additional_special_tokens = sentinels
    return tokenizer


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, t5_spm_model, t5_wordpiece_dir):
    root = tmp_path_factory.mktemp("t5_corpora")
    models = {"sentencepiece": str(t5_spm_model), "hf": str(t5_wordpiece_dir / "tokenizer.json")}
    prefixes = {}
    for tokenizer_name, split_sentences in [("sentencepiece", True), ("hf", False)]:
        for seed in (21, 22):
            corpus = write_demo_corpus(str(root / f"{tokenizer_name}{seed}.jsonl"), num_docs=120, seed=seed)
            prefix = str(root / f"{tokenizer_name}{seed}")
            preprocess(corpus, prefix, tokenizer_name, models[tokenizer_name], progress=False,
                       split_sentences=split_sentences)
            prefixes.setdefault(tokenizer_name, []).append(prefix)
    return models, prefixes


def t5_config(paths, tmp_path, tokenizer_name, model, family="t5"):
    config = RunConfig()
    config.data.dataset, config.data.paths, config.data.split = "t5", paths, "90,5,5"
    config.data.tokenizer, config.data.tokenizer_model = tokenizer_name, model
    config.data.cache_dir, config.data.decoder_seq_length = str(tmp_path / "cache"), DECODER_SEQ_LENGTH
    config.model.seq_length, config.train.seed = SEQ_LENGTH, SEED
    config = config.resolve(world_size=1, tokenizer_vocab_size=300)
    config.model.family = family  # the t5 family comes with mtl-models; set after resolving
    return config


def build(config, split="train", num_samples=NUM_SAMPLES):
    tokenizer = registry("tokenizer").get(config.data.tokenizer).build(config.data.tokenizer_model)
    return registry("dataset").get("t5").build(config, tokenizer, split, num_samples)


@pytest.mark.parametrize("tokenizer_name,blended", [("sentencepiece", False), ("hf", True)])
def test_samples_equal_megatron_core(corpora, tmp_path, single_process_group, t5_sentinels, tokenizer_name,
                                     blended):
    models, prefixes = corpora
    prefixes = prefixes[tokenizer_name] if blended else prefixes[tokenizer_name][:1]
    weights = [0.3, 0.7] if blended else None
    megatron_config = megatron_t5.T5MaskedWordPieceDatasetConfig(
        random_seed=SEED, sequence_length=SEQ_LENGTH, sequence_length_decoder=DECODER_SEQ_LENGTH,
        blend=(prefixes, weights), split="90,5,5", path_to_cache=str(tmp_path / "megatron"),
        tokenizer=megatron_tokenizer(tokenizer_name, models[tokenizer_name], t5_sentinels),
        masking_probability=0.15, short_sequence_probability=0.1, masking_max_ngram=10,
        masking_do_full_word=True, masking_do_permutation=False, masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=True)
    theirs, _, _ = BlendedMegatronDatasetBuilder(megatron_t5.T5MaskedWordPieceDataset, [NUM_SAMPLES, 10, 10],
                                                 lambda: True, megatron_config).build()
    paths = [[w, p] for w, p in zip(weights, prefixes)] if blended else prefixes
    ours = build(t5_config(paths, tmp_path, tokenizer_name, models[tokenizer_name]))
    assert len(ours) == len(theirs)
    for i in range(50):
        for field in FIELDS:
            mine, reference = np.asarray(ours[i][field]), np.asarray(theirs[i][field])
            assert np.array_equal(mine, reference) and mine.dtype == reference.dtype, (i, field)
    sample = ours[0]
    sentinel_0 = registry("tokenizer").get(tokenizer_name).build(models[tokenizer_name]).token_to_id("<extra_id_0>")
    assert sentinel_0 in sample["text_enc"].tolist() and sample["labels"][0] == sentinel_0


def test_bad_inputs_are_one_line(corpora, tmp_path, wordpiece_dir):
    models, prefixes = corpora
    with pytest.raises(ConfigError, match="data.dataset = 't5' makes t5 samples but model.family = 'bert'"):
        build(t5_config(prefixes["hf"][:1], tmp_path, "hf", models["hf"], family="bert"))
    no_sentinels = t5_config(prefixes["hf"][:1], tmp_path, "hf", str(wordpiece_dir / "tokenizer.json"))
    with pytest.raises(DataError, match=r"has no \[BOS\], \[EOS\] token"):
        build(no_sentinels)
    config = t5_config(prefixes["hf"][:1], tmp_path, "hf", models["hf"])
    config.data.decoder_seq_length = 4
    with pytest.raises(DataError, match=r"needs \d+ decoder tokens but data.decoder_seq_length = 4"):
        dataset = build(config)
        [dataset[i] for i in range(len(dataset))]
