"""Demo corpus -> preprocess -> GPT dataset -> sampler -> DataLoader, as `mtl train` chains them."""

import json

import torch

from mtl.core.config import RunConfig
from mtl.core.plugins import registry
from mtl.data.demo_corpus import write_demo_corpus
from mtl.data.preprocess import preprocess
from mtl.data.sampler import MicroBatchSampler


def test_corpus_to_micro_batches(tmp_path):
    corpus = write_demo_corpus(str(tmp_path / "demo.jsonl"), num_docs=120, seed=0)
    preprocess(corpus, str(tmp_path / "demo"), "byte", append_eod=True, workers=2, progress=False)
    config = RunConfig()
    config.data.paths, config.data.split = [str(tmp_path / "demo")], "90,10,0"
    config.model.seq_length = 32
    config = config.resolve(world_size=1, tokenizer_vocab_size=257)
    tokenizer = registry("tokenizer").get("byte").build(None)
    train = registry("dataset").get("gpt").build(config, tokenizer, "train", 64)

    sampler = MicroBatchSampler(len(train), 0, micro_batch_size=4, dp_rank=1, dp_size=2)
    loader = torch.utils.data.DataLoader(train, batch_sampler=sampler)
    batches = list(loader)
    assert len(batches) == len(train) // 8
    assert batches[0]["tokens"].shape == batches[0]["labels"].shape == (4, 32)
    assert batches[0]["loss_mask"].dtype == torch.float32
    # rank 1 of 2 reads samples 4..7 of the first global batch
    assert torch.equal(batches[0]["tokens"][0], train[4]["tokens"])

    # every window is pieces of training documents separated by eod (256)
    documents = [json.loads(line)["text"].encode() for line in open(corpus, encoding="utf-8")]
    train_documents = documents[:108]  # 90% of 120
    for i in range(0, len(train), 7):
        window = train[i]["tokens"].tolist() + train[i]["labels"].tolist()[-1:]
        segments = bytes(b if b != 256 else 0 for b in window).split(b"\x00")
        for segment in segments:
            assert any(segment in doc for doc in train_documents)
        if len(segments) > 2:  # a middle segment is a whole document
            assert segments[1] in train_documents
