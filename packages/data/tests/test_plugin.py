from mtl.core.plugins import installed_distributions, registry
from mtl.core.registrations import DatasetSpec, TokenizerSpec


def test_mtl_data_registers_its_tokenizers_and_datasets_through_the_entry_point():
    tokenizers, datasets = registry("tokenizer"), registry("dataset")
    assert {"byte", "hf", "gpt2-bpe", "sentencepiece", "tiktoken"} <= set(tokenizers.names())
    assert {"gpt", "bert", "t5", "classification", "mock"} <= set(datasets.names())
    assert tokenizers.entries()["gpt2-bpe"].distribution == "mtl-data"
    assert isinstance(tokenizers.get("tiktoken"), TokenizerSpec)
    assert tokenizers.get("tiktoken").needs_model_file and not tokenizers.get("byte").needs_model_file
    assert isinstance(datasets.get("mock"), DatasetSpec)
    rows = {dist: kinds for dist, _, kinds in installed_distributions()}
    assert rows["mtl-data"]["dataset"] == ["bert", "classification", "gpt", "mock", "t5"]
