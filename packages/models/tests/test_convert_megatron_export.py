"""mtl -> Megatron-Core torch_dist: Megatron-Core itself loads the export and computes mtl's logits.

Three tiny random mtl models (Llama style with GQA, untied; GPT-2 style, tied, with biases and
learned positions; MoE with a gated shared expert, QK-norm and a dense first layer) are
exported at tp=1 and tp=2 with the local spec's and Transformer Engine's tensor names. One
spawned pair of gloo processes (``megatron_checkpoint_writer.py --load``) builds a GPTModel
from each export's saved args at that tp, ``dist_checkpointing.load``s it and runs the
forward; its logits equal mtl's within 1e-5 (fp32). Without Transformer Engine on CPU, the
TE-named exports load through the local modules' sharded state dict renamed to TE's keys,
asking for TE's ``_extra_state`` objects as well (see the loader's docstring); on two GPUs
with Transformer Engine, ``MTL_MEGATRON_REAL_TE=1`` loads them into Megatron-Core's TE spec
itself (NCCL, one GPU per rank). The round trip mtl -> Megatron -> mtl is bit-exact.
"""

from __future__ import annotations

import dataclasses

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (the test extra)")

from mtl.core.config_io import config_from_dict  # noqa: E402
from mtl.core.errors import CheckpointError, ConfigError  # noqa: E402
from mtl.core.plugins import registry  # noqa: E402
from mtl.models.convert_megatron import MegatronConverter  # noqa: E402
from mtl.models.param_layout import gather_global_state  # noqa: E402
from mtl.parallel.topology import Topology  # noqa: E402

WRITER = Path(__file__).with_name("megatron_checkpoint_writer.py")
_spec = importlib.util.spec_from_file_location("megatron_checkpoint_writer", WRITER)
writer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(writer)  # for free_port (pytest's importlib mode imports tests by path)
VOCAB = 300
LLAMA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
             vocab_size=VOCAB, seq_length=16, normalization="rmsnorm", activation="swiglu", position_embedding="rope",
             rope_theta=10000.0, tie_embeddings=False, norm_eps=1e-6, init_std=0.1)
MODELS = {
    "llama": LLAMA,
    "gpt2": dict(LLAMA, num_query_groups=4, normalization="layernorm", activation="gelu", position_embedding="learned",
                 bias=True, tie_embeddings=True),
    "moe": dict(LLAMA, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=24, moe_shared_expert_ffn_hidden_size=40,
                moe_shared_expert_gate=True, moe_layers=[1], qk_norm=True, moe_aux_loss_coeff=0.0),
}
# (model, tp, spec) exported and loaded by Megatron-Core
EXPORTS = [("llama", 1, "local"), ("llama", 2, "te"), ("gpt2", 1, "te"), ("gpt2", 2, "local"),
           ("moe", 1, "te"), ("moe", 2, "local")]


def build(model: str, **overrides):
    section = {**MODELS[model], **overrides}
    cfg = config_from_dict({"model": section, "train": {"precision": "fp32"}}, source="test").resolve(world_size=1)
    torch.manual_seed(sorted(MODELS).index(model))
    net = registry("model family").get("gpt").build(cfg, Topology.single(), registry("backend").get("local"))
    with torch.no_grad():  # norms start at one and biases at zero: move them so a wrong mapping shows
        for name, param in net.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return cfg, net.eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{(model, tp, spec): (export dir, mtl state, Megatron's result)}, every load in one spawn."""
    root = tmp_path_factory.mktemp("megatron_export")
    results, jobs = {}, []
    for model, tp, spec in EXPORTS:
        cfg, net = build(model)
        state = gather_global_state(net, Topology.single())
        out = root / f"{model}_tp{tp}_{spec}"
        MegatronConverter().from_mtl(cfg.model, state, out, tp=tp, spec=spec, iteration=5)
        jobs.append({"ckpt": str(out / "iter_0000005"), "tp": tp, "te": spec == "te", "out": str(out / "megatron.pt")})
        results[model, tp, spec] = (out, state, net)
    (root / "jobs.json").write_text(json.dumps(jobs))
    real_te = ["--real-te"] if os.environ.get("MTL_MEGATRON_REAL_TE") == "1" else []  # 2 GPUs with TE
    result = subprocess.run([sys.executable, str(WRITER), "--load", str(root / "jobs.json"), "--world-size", "2",
                             "--port", str(writer.free_port()), *real_te], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return results


@pytest.mark.parametrize("export", EXPORTS, ids=lambda e: f"{e[0]}-tp{e[1]}-{e[2]}")
def test_megatron_loads_the_export_with_mtl_logits(exported, export):
    out, _, net = exported[export]
    megatron = torch.load(out / "megatron.pt")
    with torch.no_grad():
        ours = net(megatron["tokens"])[..., :VOCAB]
    diff = (megatron["logits"][..., :VOCAB] - ours).abs().max().item()
    print(f"{export}: max |logit diff| = {diff:.2e} (logits up to {ours.abs().max():.1f})")
    assert diff <= 1e-5
    if not megatron["real_te"]:  # TE names onto the local modules: TE's attention extra state asked for too
        assert (megatron["extra_states"] > 0) == (export[2] == "te")


def test_layout_on_disk(exported):
    out, _, _ = exported["moe", 2, "local"]
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "5"
    folder = out / "iter_0000005"
    assert {p.name for p in folder.iterdir()} == {".metadata", "__0_0.distcp", "common.pt", "metadata.json"}
    args = torch.load(folder / "common.pt", weights_only=False)["args"]
    assert (args.padded_vocab_size, args.vocab_size, args.tensor_model_parallel_size) == (512, VOCAB, 2)
    assert args.moe_layer_freq == [0, 1] and args.num_experts == 4 and args.swiglu
    dense, _, _ = exported["llama", 1, "local"]
    from mtl.models.convert_megatron.dcp_reader import MegatronCheckpoint

    stored = MegatronCheckpoint(dense / "iter_0000005").tensors
    assert tuple(stored["decoder.layers.mlp.linear_fc1.weight"].size) == (2, 96, 32)  # stacked, gate rows then up
    moe = MegatronCheckpoint(folder).tensors
    assert tuple(moe["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"].size) == (4, 48, 32)
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in moe  # the local spec's pre-MLP norm name
    te = MegatronCheckpoint(exported["moe", 1, "te"][0] / "iter_0000005").tensors
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in te


@pytest.mark.parametrize("export", [("llama", 2, "te"), ("gpt2", 1, "te"), ("moe", 2, "local")], ids=str)
def test_round_trip_is_bit_exact(exported, export):
    out, state, _ = exported[export]
    section, back = MegatronConverter().to_mtl(out)
    assert section["vocab_size"] == VOCAB  # from the args: the padding stays invisible
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name
    for key in ("num_experts", "moe_layers", "qk_norm", "tie_embeddings", "bias", "num_query_groups"):
        assert section.get(key, MODELS[export[0]].get(key, section.get(key))) == MODELS[export[0]].get(key, section.get(key))


def test_refusals(tmp_path):
    cfg, net = build("llama")
    state = gather_global_state(net, Topology.single())
    with pytest.raises(ConfigError, match="--tp 3"):
        MegatronConverter().from_mtl(cfg.model, state, tmp_path / "a", tp=3)
    with pytest.raises(ConfigError, match="iteration = 0"):
        MegatronConverter().from_mtl(cfg.model, state, tmp_path / "b", iteration=0)
    with pytest.raises(ConfigError, match="spec 'apex'"):
        MegatronConverter().from_mtl(cfg.model, state, tmp_path / "c", spec="apex")
    # Nemotron-H's MLP and position-free attention (allowed by the config) have no Megatron export
    for key, value in (("activation", "relu2"), ("position_embedding", "none")):
        with pytest.raises(ConfigError, match=f"model.{key} = '{value}'"):
            MegatronConverter().from_mtl(dataclasses.replace(cfg.model, **{key: value}), state, tmp_path / "e")
    # DeepSeek-V3 / Nemotron-H routing, not written to Megatron's args yet
    routing = (("moe_router_expert_bias", True), ("moe_router_scaling_factor", 2.5), ("moe_router_num_groups", 2))
    for key, value in routing:
        with pytest.raises(ConfigError, match=f"model.{key} = {value}: the Megatron export does not write"):
            MegatronConverter().from_mtl(dataclasses.replace(cfg.model, num_experts=4, **{key: value}), state,
                                         tmp_path / "f")
    MegatronConverter().from_mtl(cfg.model, state, tmp_path / "d")
    assert (tmp_path / "d" / "latest_checkpointed_iteration.txt").read_text() == "release"
    with pytest.raises(CheckpointError, match="not empty"):
        MegatronConverter().from_mtl(cfg.model, state, tmp_path / "d")
    with pytest.raises(CheckpointError, match="iter_0000007 does not exist.*release"):
        MegatronConverter().to_mtl(tmp_path / "d", iteration=7)
    assert Path(tmp_path / "d" / "release" / ".metadata").is_file()


def test_round_trip_of_a_gated_mlp_with_biases(tmp_path):
    """Llama with every linear biased: the gated fc1 bias is [2 * ffn] in Megatron, [2, ffn] here."""
    cfg, net = build("llama", bias=True)
    state = gather_global_state(net, Topology.single())
    MegatronConverter().from_mtl(cfg.model, state, tmp_path / "out", iteration=1)
    section, back = MegatronConverter().to_mtl(tmp_path / "out")
    assert section["bias"] and back["layers.0.mlp.linear_fc1.bias"].shape == (2, 48)
    assert sorted(back) == sorted(state) and all(torch.equal(back[n], t) for n, t in state.items())
