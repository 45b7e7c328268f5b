"""The ``bert`` dataset builds Megatron-Core 0.16.1's BERTMaskedWordPieceDataset samples, field
for field, for the same sentence-split corpus, seed, lengths and split; a blend as its
BlendedMegatronDatasetBuilder blends."""

import numpy as np
import pytest

from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError, DataError
from mtl.core.plugins import registry
from mtl.data.demo_corpus import write_demo_corpus
from mtl.data.preprocess import preprocess

pytest.importorskip("nltk")
megatron_bert = pytest.importorskip("megatron.core.datasets.bert_dataset")
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.tokenizers import MegatronTokenizer  # noqa: E402

FIELDS = ("text", "types", "labels", "is_random", "padding_mask", "loss_mask", "truncated")
SEQ_LENGTH, SEED, NUM_SAMPLES = 64, 1234, 120


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, wordpiece_dir):
    """Two sentence-split corpora and one preprocessed without splits."""
    root = tmp_path_factory.mktemp("bert_corpora")
    tokenizer_json = str(wordpiece_dir / "tokenizer.json")
    prefixes = {}
    for name, seed, split in [("a", 11, True), ("b", 12, True), ("unsplit", 11, False)]:
        corpus = write_demo_corpus(str(root / f"{name}.jsonl"), num_docs=150, seed=seed)
        preprocess(corpus, str(root / name), "hf", tokenizer_json, progress=False, split_sentences=split)
        prefixes[name] = str(root / name)
    return prefixes


def megatron_tokenizer(wordpiece_dir):
    tokenizer = MegatronTokenizer.from_pretrained(
        str(wordpiece_dir), metadata_path={"library": "huggingface", "model_type": "bert"})
    # Megatron draws its 10% random tokens from list(tokenizer.inv_vocab); its Hugging Face
    # wrapper fills inv_vocab from a Rust hash map, in another order in every process (so its
    # own samples are not reproducible). Pin id order: its vocab.txt and SentencePiece
    # tokenizers' order, and ours.
    inner = tokenizer._tokenizer
    inner._inv_vocab_dict = dict(sorted(inner.inv_vocab.items()))
    return tokenizer


def megatron_splits(wordpiece_dir, blend, binary_head, full_word, cache, sizes):
    config = megatron_bert.BERTMaskedWordPieceDatasetConfig(
        random_seed=SEED, sequence_length=SEQ_LENGTH, blend=blend, split="90,5,5",
        path_to_cache=str(cache), tokenizer=megatron_tokenizer(wordpiece_dir),
        masking_probability=0.15, short_sequence_probability=0.1, masking_max_ngram=3,
        masking_do_full_word=full_word, masking_do_permutation=False,
        masking_use_longer_ngrams=False, masking_use_geometric_distribution=False,
        classification_head=binary_head)
    return BlendedMegatronDatasetBuilder(megatron_bert.BERTMaskedWordPieceDataset, sizes,
                                         lambda: True, config).build()


def bert_config(paths, tmp_path, wordpiece_dir, binary_head=True, full_word=False, family="bert"):
    config = RunConfig()
    config.data.dataset, config.data.paths, config.data.split = "bert", paths, "90,5,5"
    config.data.tokenizer, config.data.tokenizer_model = "hf", str(wordpiece_dir / "tokenizer.json")
    config.data.cache_dir = str(tmp_path / "cache")
    config.data.masking_do_full_word = full_word
    config.model.seq_length, config.train.seed = SEQ_LENGTH, SEED
    config = config.resolve(world_size=1, tokenizer_vocab_size=300)
    # the bert family and model.binary_head come with mtl-models' bert family; set after
    # resolving so this package's tests run without it
    config.model.family, config.model.binary_head = family, binary_head
    return config


def build(config, wordpiece_dir, split="train", num_samples=NUM_SAMPLES):
    tokenizer = registry("tokenizer").get("hf").build(config.data.tokenizer_model)
    return registry("dataset").get("bert").build(config, tokenizer, split, num_samples)


def assert_same_samples(ours, theirs, count):
    assert len(ours) == len(theirs)
    for i in range(count):
        mine, reference = ours[i], theirs[i]
        for field in FIELDS:
            assert np.array_equal(np.asarray(mine[field]), np.asarray(reference[field])), (i, field)
            assert np.asarray(mine[field]).dtype == np.asarray(reference[field]).dtype, (i, field)


@pytest.mark.parametrize("blended,binary_head,full_word", [
    (False, True, False), (True, True, True), (False, False, True)])
def test_samples_equal_megatron_core(corpora, wordpiece_dir, tmp_path, single_process_group,
                                     blended, binary_head, full_word):
    prefixes = [corpora["a"], corpora["b"]] if blended else [corpora["a"]]
    weights = [0.6, 0.4] if blended else None
    theirs_train, theirs_valid, _ = megatron_splits(
        wordpiece_dir, (prefixes, weights), binary_head, full_word, tmp_path / "megatron", [NUM_SAMPLES, 20, 20])
    paths = [[w, p] for w, p in zip(weights, prefixes)] if blended else prefixes
    config = bert_config(paths, tmp_path, wordpiece_dir, binary_head, full_word)
    train, valid = build(config, wordpiece_dir), build(config, wordpiece_dir, "valid", 20)
    assert_same_samples(train, theirs_train, 50)
    assert_same_samples(valid, theirs_valid, 10)

    samples = [train[i] for i in range(50)]
    masked = np.concatenate([s["text"][s["loss_mask"] == 1].numpy() for s in samples])
    assert 0.7 < np.mean(masked == 4) < 0.9  # [MASK] (id 4) at about 80% of masked positions
    is_random = [s["is_random"] for s in samples]
    assert (0 < np.mean(is_random) < 1) if binary_head else not any(is_random)


def test_bad_inputs_are_one_line_before_any_sample(corpora, wordpiece_dir, bpe_dir, tmp_path):
    unsplit = bert_config([corpora["unsplit"]], tmp_path, wordpiece_dir)
    with pytest.raises(DataError, match=r"unsplit: every document is one sequence.*--split-sentences"):
        build(unsplit, wordpiece_dir)
    # without the binary head single-sentence documents are fine
    assert len(build(bert_config([corpora["unsplit"]], tmp_path, wordpiece_dir, binary_head=False),
                     wordpiece_dir)) >= NUM_SAMPLES

    t5_model = bert_config([corpora["a"]], tmp_path, wordpiece_dir, family="t5")
    with pytest.raises(ConfigError, match=r"data.dataset = 'bert' makes bert samples but "
                                          r"model.family = 't5'.*set data.dataset = 't5'"):
        build(t5_model, wordpiece_dir)
    bert_model = bert_config([corpora["a"]], tmp_path, wordpiece_dir)
    with pytest.raises(ConfigError, match=r"data.dataset = 'gpt' makes gpt samples but "
                                          r"model.family = 'bert'.*set data.dataset = 'bert'"):
        registry("dataset").get("gpt").build(bert_model, None, "train", 10)

    no_mask = bert_config([corpora["a"]], tmp_path, wordpiece_dir)
    no_mask.data.tokenizer_model = str(bpe_dir / "tokenizer.json")  # byte-level BPE: no [CLS]/[SEP]/[MASK]
    with pytest.raises(DataError, match=r"has no \[CLS\], \[SEP\], \[MASK\] token"):
        build(no_mask, wordpiece_dir)

    config = bert_config([corpora["a"]], tmp_path, wordpiece_dir)
    with pytest.raises(DataError, match="needs a vocabulary of named tokens"):
        registry("dataset").get("bert").build(config, registry("tokenizer").get("byte").build(None), "train", 10)
    config.data.mask_prob = 1.5
    with pytest.raises(ConfigError, match="data.mask_prob = 1.5"):
        build(config, wordpiece_dir)
