"""The ``classification`` dataset: each sample is what HF's fast BERT tokenizer makes of the
line (``[CLS] a [SEP] b [SEP]``, token types, padding, longest-first truncation to
``model.seq_length``); the lines are split by ``data.split``; training epochs are reshuffled;
a label outside ``model.num_labels`` is one error naming the file and line."""

import json

import pytest
import torch

from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError, DataError
from mtl.data.classification_dataset import build_classification_dataset, pair_lengths
from mtl.data.tokenizers.huggingface import build_hf_tokenizer

transformers = pytest.importorskip("transformers")
SEQ = 16


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def hf_bert_tokenizer(path):
    """The file's tokenizer as a BERT fast tokenizer (with BERT's [CLS] a [SEP] b [SEP] post-processor)."""
    from tokenizers import Tokenizer
    from tokenizers.processors import BertProcessing

    model = Tokenizer.from_file(path)
    model.post_processor = BertProcessing(("[SEP]", model.token_to_id("[SEP]")), ("[CLS]", model.token_to_id("[CLS]")))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, cls_token="[CLS]", sep_token="[SEP]",
                                                pad_token="[PAD]", unk_token="[UNK]")


def config_for(paths, wordpiece_dir, num_labels=3, split="80,20,0"):
    config = RunConfig()
    config.model.family, config.model.num_labels, config.model.seq_length = "bert", num_labels, SEQ
    config.data.dataset, config.data.tokenizer, config.data.split = "classification", "hf", split
    config.data.tokenizer_model, config.data.paths = str(wordpiece_dir / "tokenizer.json"), [str(p) for p in paths]
    return config


def test_samples_match_hf_tokenizer(tmp_path, wordpiece_dir, corpus_texts):
    words = " ".join(corpus_texts).split()
    records = [{"text": " ".join(words[i:i + 1 + i % 13]), "label": i % 3} for i in range(0, 20)]
    records += [{"text": " ".join(words[i:i + 1 + i % 11]), "text_pair": " ".join(words[i + 3:i + 2 + i % 17]),
                 "label": i % 3} for i in range(20, 40)]
    config = config_for([write_jsonl(tmp_path / "a.jsonl", records[:25]), write_jsonl(tmp_path / "b.jsonl", records[25:])],
                        wordpiece_dir, split="100,0,0")
    tokenizer = build_hf_tokenizer(config.data.tokenizer_model)
    dataset = build_classification_dataset(config, tokenizer, "train", None)
    # the train split's order is shuffled per epoch: each sample is compared with its line
    # train order is shuffled per epoch; read back each example through the permutation
    hf = hf_bert_tokenizer(config.data.tokenizer_model)
    seen = set()
    for idx in range(len(dataset)):
        row = dataset._example_index(idx)
        seen.add(row)
        record = records[row]
        expected = hf(record["text"], record.get("text_pair"), truncation=True, padding="max_length", max_length=SEQ,
                      return_token_type_ids=True)
        sample = dataset[idx]
        assert sample["text"].tolist() == expected["input_ids"], record
        assert sample["types"].tolist() == expected["token_type_ids"], record
        assert sample["padding_mask"].tolist() == expected["attention_mask"], record
        assert int(sample["label"]) == record["label"]
    assert seen == set(range(len(records)))  # an epoch visits every line once
    assert any(sum(dataset[i]["padding_mask"]) == SEQ for i in range(len(dataset)))  # truncation happened


def test_pair_lengths_longest_first():
    assert pair_lengths(3, 4, 10) == (3, 4)
    assert pair_lengths(3, 20, 10) == (3, 7) and pair_lengths(20, 3, 10) == (7, 3)
    assert pair_lengths(8, 8, 11) == (5, 6) and pair_lengths(9, 8, 11) == (6, 5)


def test_splits_and_epochs(tmp_path, wordpiece_dir):
    records = [{"text": f"line {i}", "label": i % 2} for i in range(10)]
    config = config_for([write_jsonl(tmp_path / "d.jsonl", records)], wordpiece_dir, num_labels=2)
    tokenizer = build_hf_tokenizer(config.data.tokenizer_model)
    train = build_classification_dataset(config, tokenizer, "train", 24)
    valid = build_classification_dataset(config, tokenizer, "valid", 4)
    assert len(train) == 24 and [int(valid[i]["label"]) for i in range(4)] == [0, 1, 0, 1]
    epochs = [[train._example_index(e * 8 + i) for i in range(8)] for e in range(3)]
    assert all(sorted(e) == list(range(8)) for e in epochs) and epochs[0] != epochs[1]
    with pytest.raises(DataError, match="leaves the test split"):
        build_classification_dataset(config, tokenizer, "test", 4)


def test_an_evaluation_that_does_not_score_the_split_once_says_so(tmp_path, wordpiece_dir, caplog):
    records = [{"text": f"line {i}", "label": i % 2} for i in range(10)]  # 8 train, 2 valid lines
    config = config_for([write_jsonl(tmp_path / "d.jsonl", records)], wordpiece_dir, num_labels=2)
    tokenizer = build_hf_tokenizer(config.data.tokenizer_model)
    config.train.eval_iters, config.train.global_batch_size = 1, 2
    with caplog.at_level("WARNING", logger="mtl"):
        build_classification_dataset(config, tokenizer, "valid", 2)
    assert not [r for r in caplog.records if "an evaluation scores" in r.getMessage()]
    config.train.eval_iters = 3
    with caplog.at_level("WARNING", logger="mtl"):
        build_classification_dataset(config, tokenizer, "valid", 6)
    (line,) = [r.getMessage() for r in caplog.records if "an evaluation scores" in r.getMessage()]
    assert "= 6 samples of the valid split's 2 lines, 4 of them twice" in line


@pytest.mark.parametrize("line,message", [
    ({"text": "a b", "label": 3}, r"bad.jsonl:2: label 3 is not a class of model.num_labels = 3"),
    ({"text": "a b", "label": True}, r"bad.jsonl:2: label True"),
    ({"text": 5, "label": 0}, r"bad.jsonl:2: \"text\" must be a string"),
    ({"text": "a", "text_pair": 1, "label": 0}, r"bad.jsonl:2: \"text_pair\""),
])
def test_bad_lines_are_named(tmp_path, wordpiece_dir, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine", "label": 0}, line])
    config = config_for([path], wordpiece_dir)
    with pytest.raises(DataError, match=message):
        build_classification_dataset(config, build_hf_tokenizer(config.data.tokenizer_model), "train", 4)


def test_needs_num_labels(tmp_path, wordpiece_dir):
    config = config_for([write_jsonl(tmp_path / "d.jsonl", [{"text": "x", "label": 0}])], wordpiece_dir, num_labels=0)
    with pytest.raises(ConfigError, match="set model.num_labels"):
        build_classification_dataset(config, build_hf_tokenizer(config.data.tokenizer_model), "train", 4)
    config.model.family = "gpt"
    with pytest.raises(ConfigError, match="set data.dataset = 'gpt'"):
        build_classification_dataset(config, build_hf_tokenizer(config.data.tokenizer_model), "train", 4)
