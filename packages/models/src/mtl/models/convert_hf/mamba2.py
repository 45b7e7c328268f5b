"""Hugging Face ``Mamba2ForCausalLM`` <-> the ``hybrid`` family with a pattern of only ``M`` layers.

HF packs the in-projection's rows part-major, ``[z (I), x (I), B (G·N), C (G·N), dt (H)]``, and the
convolution's channels ``[x, B, C]``; ours are group-major (``mtl.models.mamba.mixer``): per group
``[z_g, x_g, B_g, C_g, dt_g]``. The conversion permutes rows, nothing else: a round trip gives the
same bytes.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from mtl.core.errors import ConfigError
from mtl.models.convert_hf.common import Read


def to_group_major(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """Part-major rows (each part ``[groups * w_i, ...]``) -> group-major ``[groups * sum(w), ...]``."""
    per_group = [part.reshape(groups, -1, *part.shape[1:]) for part in parts]
    fused = torch.cat(per_group, dim=1)
    return fused.reshape(-1, *fused.shape[2:])


def to_part_major(fused: torch.Tensor, widths: list[int], groups: int) -> list[torch.Tensor]:
    """The inverse of ``to_group_major``: the parts, each ``[groups * w_i, ...]``."""
    per_group = fused.reshape(groups, sum(widths), *fused.shape[1:])
    return [p.reshape(-1, *fused.shape[1:]) for p in torch.split(per_group, widths, dim=1)]


def mixer_widths(m) -> tuple[list[int], list[int]]:
    """Per group: the in-projection's parts (z, x, B, C, dt) and the convolution's (x, B, C).
    ``m``: our model section (a dict or a ``ModelConfig``)."""
    get = m.get if isinstance(m, dict) else lambda key: getattr(m, key)
    heads_per_group = get("mamba_num_heads") // get("mamba_num_groups")
    x_width, state = heads_per_group * get("mamba_head_dim"), get("mamba_state_dim")
    return [x_width, x_width, state, state, heads_per_group], [x_width, state, state]


def check_mamba_conversion(hf: dict[str, Any], source: str, activation: str) -> None:
    """What mtl's Mamba-2 mixer does not build, refused in one line naming the config.json key."""
    if hf.get("use_bias", False):
        raise ConfigError(f"{source}: use_bias = true; mtl's Mamba-2 projections have no bias")
    if not hf.get("use_conv_bias", True):
        raise ConfigError(f"{source}: use_conv_bias = false; mtl's Mamba-2 convolution has a bias")
    if activation != "silu":
        raise ConfigError(f"{source}: the Mamba-2 activation is {activation!r}; mtl's convolution uses silu")
    limit = hf.get("time_step_limit", [0.0, float("inf")])
    if [_json_float(v) for v in limit] != [0.0, float("inf")]:
        raise ConfigError(f"{source}: time_step_limit = {limit}; mtl floors dt only (model.mamba_dt_min), with no "
                          "ceiling: it converts (0.0, inf)")


def mamba_sizes_section(hf: dict[str, Any], *, heads_key: str, head_dim_key: str, state_key: str,
                        chunk_default: int) -> dict[str, Any]:
    """The ``[model]`` keys of the Mamba-2 sizes, the norms and the head, from an HF config whose
    size keys are named as given (Mamba2Config and NemotronHConfig differ)."""
    return {
        "mamba_num_heads": hf[heads_key],
        "mamba_head_dim": hf[head_dim_key],
        "mamba_num_groups": hf["n_groups"],
        "mamba_state_dim": hf[state_key],
        "mamba_conv_kernel": hf["conv_kernel"],
        "mamba_chunk_size": hf.get("chunk_size", chunk_default),
        "normalization": "rmsnorm",
        "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def mamba_sizes_config(m, *, heads_key: str, head_dim_key: str, state_key: str) -> dict[str, Any]:
    """The inverse of ``mamba_sizes_section``: config.json's keys."""
    return {
        heads_key: m.mamba_num_heads,
        head_dim_key: m.mamba_head_dim,
        "n_groups": m.mamba_num_groups,
        state_key: m.mamba_state_dim,
        "expand": m.mamba_num_heads * m.mamba_head_dim // m.hidden_size,
        "conv_kernel": m.mamba_conv_kernel,
        "chunk_size": m.mamba_chunk_size,
        "layer_norm_epsilon": m.norm_eps,
        "use_bias": False,
        "use_conv_bias": True,
        "tie_word_embeddings": m.tie_embeddings,
    }


def mamba2_model_section(hf: dict[str, Any], source: str) -> dict[str, Any]:
    check_mamba_conversion(hf, source, hf.get("hidden_act", "silu"))
    layers = hf["num_hidden_layers"]
    return {
        "family": "hybrid",
        "hybrid_pattern": "M" * layers,
        "num_layers": layers,
        "hidden_size": hf["hidden_size"],
        "vocab_size": hf["vocab_size"],
        **mamba_sizes_section(hf, heads_key="num_heads", head_dim_key="head_dim", state_key="state_size",
                              chunk_default=256),
    }


def _json_float(value) -> float:
    """A float of config.json; transformers writes infinity as ``{"__float__": "Infinity"}``."""
    return float(value["__float__"]) if isinstance(value, dict) and "__float__" in value else float(value)


MIXER_VECTORS = ("dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")


def mixer_to_mtl(section: dict[str, Any], hf_prefix: str, ours: str, read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    """One HF mixer (``hf_prefix`` ``...mixer.``) as ours (``ours`` ``layers.{i}.mixer.``)."""
    proj_widths, conv_widths = mixer_widths(section)
    groups = section["mamba_num_groups"]
    in_proj = read(hf_prefix + "in_proj.weight")
    sizes = [w * groups for w in proj_widths]
    yield ours + "in_proj.weight", to_group_major(list(torch.split(in_proj, sizes)), groups)
    del in_proj
    conv_sizes = [w * groups for w in conv_widths]
    for hf_name, our_name in (("conv1d.weight", "conv_weight"), ("conv1d.bias", "conv_bias")):
        yield ours + our_name, to_group_major(list(torch.split(read(hf_prefix + hf_name), conv_sizes)), groups)
    for name in MIXER_VECTORS:
        yield ours + name, read(hf_prefix + name)


def mixer_from_mtl(m, hf_prefix: str, ours: str, read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    proj_widths, conv_widths = mixer_widths(m)
    groups = m.mamba_num_groups
    yield hf_prefix + "in_proj.weight", torch.cat(to_part_major(read(ours + "in_proj.weight"), proj_widths, groups))
    for hf_name, our_name in (("conv1d.weight", "conv_weight"), ("conv1d.bias", "conv_bias")):
        yield hf_prefix + hf_name, torch.cat(to_part_major(read(ours + our_name), conv_widths, groups))
    for name in MIXER_VECTORS:
        yield hf_prefix + name, read(ours + name)


def mamba2_to_mtl(section: dict[str, Any], read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    yield "embedding.word_embeddings.weight", read("backbone.embeddings.weight")
    for i in range(section["num_layers"]):
        yield f"layers.{i}.norm.weight", read(f"backbone.layers.{i}.norm.weight")
        yield from mixer_to_mtl(section, f"backbone.layers.{i}.mixer.", f"layers.{i}.mixer.", read)
    yield "final_norm.weight", read("backbone.norm_f.weight")
    if not section["tie_embeddings"]:
        yield "output_layer.weight", read("lm_head.weight")


def mamba2_from_mtl(m, read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    yield "backbone.embeddings.weight", read("embedding.word_embeddings.weight")
    for i in range(m.num_layers):
        yield f"backbone.layers.{i}.norm.weight", read(f"layers.{i}.norm.weight")
        yield from mixer_from_mtl(m, f"backbone.layers.{i}.mixer.", f"layers.{i}.mixer.", read)
    yield "backbone.norm_f.weight", read("final_norm.weight")
    if not m.tie_embeddings:
        yield "lm_head.weight", read("output_layer.weight")


def check_mamba2_exportable(m) -> None:
    if set(m.hybrid_pattern.replace("|", "")) != {"M"}:
        raise ConfigError(f"model.hybrid_pattern = {m.hybrid_pattern!r}: Mamba2ForCausalLM holds Mamba-2 layers "
                          "only; a pattern with attention, MLP or MoE layers exports as nemotron_h")
    if m.mamba_dt_min:
        raise ConfigError(f"model.mamba_dt_min = {m.mamba_dt_min}: Mamba2ForCausalLM does not floor dt "
                          "(export as nemotron_h, which does, or train with 0)")
    if (m.mamba_num_heads * m.mamba_head_dim) % m.hidden_size:
        raise ConfigError(f"model.mamba_num_heads * mamba_head_dim = {m.mamba_num_heads * m.mamba_head_dim} is not a "
                          f"multiple of hidden_size = {m.hidden_size}: Mamba2Config needs a whole expand factor")


def mamba2_config(m, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "num_hidden_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "vocab_size": m.vocab_size,
        **mamba_sizes_config(m, heads_key="num_heads", head_dim_key="head_dim", state_key="state_size"),
        "hidden_act": "silu",
        "residual_in_fp32": True,
        "dtype": str(dtype).removeprefix("torch."),
    }
