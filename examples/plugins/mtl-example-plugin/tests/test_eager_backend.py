"""The proof that a third party can extend mtl: this distribution, installed on its own,
is found through its entry point, its 'eager' backend trains a GPT to the same losses as the
built-in 'local' backend, and its attention equals PyTorch's fused kernel."""

from __future__ import annotations

import importlib.metadata
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from mtl.core.config_io import load_config
from mtl.core.errors import ConfigError
from mtl.core.plugins import installed_distributions, registry
from mtl.train.loop import train
from mtl.train.testing import TINY
from mtl_example_plugin.attention import EagerAttention

DIST = "mtl-example-plugin"


def test_distribution_is_installed_with_an_mtl_entry_point():
    dist = importlib.metadata.distribution(DIST)
    eps = [ep for ep in dist.entry_points if ep.group == "mtl"]
    assert eps, f"{DIST} declares no entry point in group 'mtl'"
    assert {ep.value for ep in eps} == {"mtl_example_plugin.plugin"}


def test_eager_backend_is_registered_by_the_plugin_distribution():
    backends = registry("backend")
    assert "eager" in backends
    assert backends.entries()["eager"].distribution == DIST
    assert backends.get("eager").core_attention is EagerAttention
    rows = {dist: kinds for dist, _version, kinds in installed_distributions()}
    assert "eager" in rows[DIST]["backend"]


def _losses(backend: str) -> dict[int, float]:
    result = train(load_config(None, [*TINY, f"model.backend='{backend}'"]), progress=False)
    return result.losses


def test_eager_trains_like_local():
    eager, local = _losses("eager"), _losses("local")
    assert sorted(eager) == sorted(local) == [1, 2, 3]
    for step in eager:
        assert math.isfinite(eager[step])
        assert eager[step] == pytest.approx(local[step], rel=1e-5), f"step {step}: eager {eager[step]} local {local[step]}"
    # three steps of a tiny model need not lower the loss; it must at least stay a number
    assert eager[3] < eager[1] or math.isfinite(eager[3])


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])
def test_eager_attention_equals_sdpa(heads, groups):
    torch.manual_seed(1)
    b, s, d = 2, 9, 8
    q = torch.randn(b, s, heads, d)
    k, v = torch.randn(b, s, groups, d), torch.randn(b, s, groups, d)
    attention = EagerAttention(num_heads=heads, num_query_groups=groups, head_dim=d, causal=True)
    out = attention(q, k, v)
    rep = heads // groups
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(rep, dim=2).transpose(1, 2),
        v.repeat_interleave(rep, dim=2).transpose(1, 2),
        is_causal=True,
    ).transpose(1, 2)
    assert out.shape == (b, s, heads, d)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_eager_attention_with_kv_cache_matches_local_backend():
    """Decoding: 3 new queries over 7 cached keys, causal mask aligned to the end."""
    from mtl.parallel.backend_local import CoreAttention

    torch.manual_seed(2)
    q, k, v = torch.randn(1, 3, 4, 8), torch.randn(1, 7, 2, 8), torch.randn(1, 7, 2, 8)
    kwargs = dict(num_heads=4, num_query_groups=2, head_dim=8, causal=True, dropout=0.0, topology=None)
    torch.testing.assert_close(EagerAttention(**kwargs)(q, k, v), CoreAttention(**kwargs)(q, k, v), atol=1e-5, rtol=1e-5)


def test_unsupported_settings_are_refused_by_name():
    base = dict(num_heads=4, num_query_groups=2, head_dim=8, causal=True)
    with pytest.raises(ConfigError, match="parallel.cp"):
        EagerAttention(**base, topology=SimpleNamespace(tp=1, cp=2))
    with pytest.raises(ConfigError, match=r"model.attention_dropout.*parallel.tp"):
        EagerAttention(**base, dropout=0.1, topology=SimpleNamespace(tp=2, cp=1))
    with pytest.raises(ConfigError, match="model.num_query_groups"):
        EagerAttention(num_heads=4, num_query_groups=3, head_dim=8)
    # what it does support builds: dropout without TP, TP without dropout
    EagerAttention(**base, dropout=0.1, topology=SimpleNamespace(tp=1, cp=1))
    EagerAttention(**base, dropout=0.0, topology=SimpleNamespace(tp=2, cp=1))



def _train_losses(overrides: list[str]) -> dict[int, float]:
    """Runs on every spawned rank (module level, so run_distributed can find it)."""
    return train(load_config(None, [*TINY, *overrides]), progress=False).losses


def test_eager_at_tp2_trains_like_one_process():
    """Each TP rank attends over its own heads with the eager attention; the losses match."""
    from mtl.parallel.testing import run_distributed

    one = _losses("eager")
    per_rank = run_distributed(_train_losses, 2, args=(["model.backend='eager'", "parallel.tp=2"],))
    for losses in per_rank:
        assert sorted(losses) == [1, 2, 3]
        for step in losses:
            assert losses[step] == pytest.approx(one[step], rel=1e-5), f"step {step}: tp2 {losses[step]} tp1 {one[step]}"
