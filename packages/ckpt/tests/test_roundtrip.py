"""Single-process save/load: bit-exact for every dtype, common state, slices and casts."""

import json
import os

import pytest
import torch

from mtl.ckpt import ShardedTensor, latest_iteration, list_keys, load, read_metadata, save
from mtl.core.errors import CheckpointError


def full(key, data):
    return ShardedTensor(key, data, tuple(data.shape), (0,) * data.dim())


def like(key, data, dtype=None):
    return full(key, torch.zeros_like(data, dtype=dtype or data.dtype))


def sample_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "fp32": torch.randn(4, 6, generator=g),
        "bf16": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(3, 5, generator=g).to(torch.float16),
        "i64": torch.randint(-(2**40), 2**40, (7,), generator=g),
        "fp8": torch.randn(2, 4, generator=g).to(torch.float8_e4m3fn),
        "mask": torch.rand(5, generator=g) > 0.5,
        "scalar": torch.tensor(1.25),
    }


@pytest.mark.parametrize("verify", [True, False])
def test_every_dtype_round_trips_bit_exact(tmp_path, verify):
    tensors = sample_tensors()
    # special values must survive as words, not as arithmetic
    tensors["bf16"][0, :3] = torch.tensor([float("nan"), float("inf"), -0.0], dtype=torch.bfloat16)
    save({k: full(k, v) for k, v in tensors.items()}, str(tmp_path), 5, {"note": "x"})
    template = {k: like(k, v) for k, v in tensors.items()}
    load(template, str(tmp_path), verify=verify)
    for k, v in tensors.items():
        got = template[k].data
        assert got.dtype == v.dtype
        word = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}.get(v.dtype)
        if word is not None:
            assert torch.equal(got.view(word), v.view(word)), k
        else:
            assert torch.equal(got, v), k


def test_common_state_metadata_and_listing(tmp_path):
    w = torch.arange(12.0).reshape(3, 4)
    state = {"model": {"w": full("w", w)}, "step": 7, "rng": [1, 2, 3], "cfg": {"lr": 0.5, "name": "gpt"}}
    save(state, str(tmp_path), 7, {"config": {"hidden": 4}})
    assert latest_iteration(str(tmp_path)) == 7
    assert read_metadata(str(tmp_path)) == {"config": {"hidden": 4}}
    assert list_keys(str(tmp_path), 7) == ["w"]
    template = {"model": {"w": like("w", w)}, "step": 0, "rng": [0, 0, 0], "cfg": {"lr": 0.0, "name": ""}}
    loaded, meta = load(template, str(tmp_path))
    assert loaded["step"] == 7 and loaded["rng"] == [1, 2, 3] and loaded["cfg"] == {"lr": 0.5, "name": "gpt"}
    assert loaded["model"]["w"] is template["model"]["w"] and torch.equal(template["model"]["w"].data, w)
    assert meta == {"config": {"hidden": 4}}


@pytest.mark.parametrize("verify", [True, False])
def test_load_reads_only_the_requested_slice_and_casts(tmp_path, verify):
    w = torch.randn(6, 8, dtype=torch.float64)
    save({"w": full("w", w)}, str(tmp_path), 1)
    part = ShardedTensor("w", torch.zeros(2, 3, dtype=torch.float32), (6, 8), (4, 5))
    load({"w": part}, str(tmp_path), verify=verify)
    assert torch.equal(part.data, w[4:6, 5:8].float())


def test_noncontiguous_data_is_saved_by_value(tmp_path):
    w = torch.randn(10, 4)
    view = w.t()[:, 2:9]  # [4, 7], non-contiguous
    save({"a": ShardedTensor("w", view, (4, 7), (0, 0))}, str(tmp_path), 2)
    meta = json.load(open(os.path.join(tmp_path, "iter_0000002", "metadata.json")))
    assert meta["tensors"]["w"]["shards"][0]["shape"] == [4, 7]
    template = ShardedTensor("w", torch.zeros(4, 7).t().contiguous().t(), (4, 7), (0, 0))
    load({"a": template}, str(tmp_path))
    assert torch.equal(template.data, view)


def test_strict_false_keeps_missing_values(tmp_path):
    save({"w": full("w", torch.ones(2))}, str(tmp_path), 1)
    extra = like("extra", torch.full((3,), 5.0))
    extra.data.fill_(5.0)
    state, _ = load({"w": like("w", torch.ones(2)), "extra": extra, "new_step": 9}, str(tmp_path), strict=False)
    assert torch.equal(extra.data, torch.full((3,), 5.0)) and state["new_step"] == 9


def test_strict_common_list_shorter_in_checkpoint(tmp_path):
    save({"w": full("w", torch.ones(2)), "rng": [1, 2]}, str(tmp_path), 1)
    with pytest.raises(CheckpointError, match="'rng' has 2 items in the checkpoint but the template has 3"):
        load({"w": like("w", torch.ones(2)), "rng": [0, 0, 0]}, str(tmp_path))
    state, _ = load({"w": like("w", torch.ones(2)), "rng": [0, 0, 9]}, str(tmp_path), strict=False)
    assert state["rng"] == [1, 2, 9]


def test_keys_with_slashes_and_empty_tensors(tmp_path):
    state = {"a": full("decoder/layer 0%w", torch.arange(3.0)), "e": full("empty", torch.zeros(0, 4))}
    save(state, str(tmp_path), 1)
    assert sorted(os.listdir(tmp_path / "iter_0000001" / "arrays")) == ["decoder%2Flayer%200%25w", "empty", "zarr.json"]
    template = {"a": like("decoder/layer 0%w", torch.arange(3.0)), "e": like("empty", torch.zeros(0, 4))}
    load(template, str(tmp_path))
    assert torch.equal(template["a"].data, torch.arange(3.0)) and template["e"].data.shape == (0, 4)
