import torch

from mtl.core.config import RunConfig
from mtl.core.plugins import registry


def build(seed, split="train", num_samples=None):
    config = RunConfig()
    config.model.seq_length, config.train.seed, config.data.mock_num_samples = 12, seed, 30
    config = config.resolve(world_size=1, tokenizer_vocab_size=257)
    tokenizer = registry("tokenizer").get("byte").build(None)
    return registry("dataset").get("mock").build(config, tokenizer, split, num_samples)


def test_mock_samples_are_deterministic_and_well_formed():
    ds, again = build(1), build(1)
    assert len(ds) == 30 and len(build(1, num_samples=5)) == 5
    for i in (0, 7, 29):
        sample = ds[i]
        assert torch.equal(sample["tokens"], again[i]["tokens"])
        assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
        assert sample["tokens"].dtype == torch.int64 and sample["tokens"].shape == (12,)
        assert 0 <= int(sample["tokens"].min()) and int(sample["tokens"].max()) < 257
        assert torch.equal(sample["loss_mask"], torch.ones(12))
    # order of access does not matter; seeds and splits give different streams
    assert torch.equal(build(1)[29]["tokens"], ds[29]["tokens"])
    assert not torch.equal(build(2)[0]["tokens"], ds[0]["tokens"])
    assert not torch.equal(build(1, "valid")[0]["tokens"], ds[0]["tokens"])
