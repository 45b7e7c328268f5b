"""What the HF converters share: tensor sources read one tensor at a time, the two-pass
stream of converted tensors, and the group-major QKV fusion of our attention.

Our global layout (``mtl.models.param_layout``): fused QKV ``[groups * (q_per_group + 2) * d,
h]`` ordered ``[g0: q heads, k, v][g1: ...]``; SwiGLU fc1 ``[2, ffn, h]`` (gate, up); the word
embedding (and an untied output layer) ``[vocab, h]``, the true vocabulary only (the model's
TP padding is invisible to its global tensors).

A conversion is written once, as a generator of ``(name, tensor)`` pulling its inputs through
``read(name)``. Run over a source's ``meta`` tensors it costs nothing and gives every output's
name, shape and dtype before any data is read (to check them against the model, or to write a
safetensors header); run over ``get`` it produces the data, one tensor (or one q/k/v or
gate/up group) alive at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Protocol

import torch

from mtl.core.errors import CheckpointError, ConfigError

Read = Callable[[str], torch.Tensor]
Convert = Callable[[Read], Iterator[tuple[str, torch.Tensor]]]


class TensorSource(Protocol):
    """Named tensors read one at a time (an HF safetensors directory, an mtl checkpoint)."""

    def names(self) -> list[str]: ...

    def meta(self, name: str) -> torch.Tensor:
        """A ``device="meta"`` tensor with the stored shape and dtype (no data is read)."""

    def get(self, name: str) -> torch.Tensor: ...


class DictSource:
    """A ``TensorSource`` over tensors already in memory."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], description: str = "the state"):
        self.tensors, self.description = tensors, description

    def names(self) -> list[str]:
        return list(self.tensors)

    def meta(self, name: str) -> torch.Tensor:
        return self.get(name).to("meta")

    def get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"{self.description} has no tensor {name}")
        return self.tensors[name]


def as_source(state) -> TensorSource:
    return state if hasattr(state, "meta") and hasattr(state, "get") and hasattr(state, "names") else DictSource(state)


@dataclass
class TensorStream:
    """Converted tensors: ``metas`` (name -> meta tensor, in output order) known up front, and
    iteration yielding ``(name, tensor)`` with data in the same order."""

    metas: dict[str, torch.Tensor]
    convert: Convert
    read: Read

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.convert(self.read):
            expected = self.metas[name]
            if tuple(tensor.shape) != tuple(expected.shape) or tensor.dtype != expected.dtype:
                raise CheckpointError(
                    f"{name}: stored data has shape {tuple(tensor.shape)} {tensor.dtype} but its header says "
                    f"{tuple(expected.shape)} {expected.dtype}; the source file is corrupt"
                )
            yield name, tensor
            del tensor  # the consumer holds the only reference: freed once it is done with it


def stream(convert: Convert, source: TensorSource, *, ignored: Callable[[str], bool] = lambda name: False,
           description: str = "the source") -> TensorStream:
    """The two passes over ``convert``: the meta pass now (which also checks that every source
    tensor found a place, except ``ignored`` ones), the data pass when iterated."""
    used: set[str] = set()

    def read_meta(name: str) -> torch.Tensor:
        used.add(name)
        return source.meta(name)

    metas = {}
    for name, tensor in convert(read_meta):
        if name in metas:
            raise CheckpointError(f"the converter produced {name} twice")
        metas[name] = tensor
    leftover = sorted(n for n in source.names() if n not in used and not ignored(n))
    if leftover:
        raise CheckpointError(
            f"{description}: {len(leftover)} tensors have no place in the converted model, e.g. {leftover[:4]}; "
            "the checkpoint uses a feature this converter does not support"
        )
    return TensorStream(metas, convert, source.get)


def fuse_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_groups: int) -> torch.Tensor:
    """q ``[heads * d, ...]``, k and v ``[groups * d, ...]`` (head-major rows, as HF keeps them)
    -> group-major ``[groups * (q_per_group + 2) * d, ...]``. Works for weights and biases."""
    rest = query.shape[1:]
    q = query.reshape(num_groups, -1, *rest)  # [groups, q_per_group * d, ...]
    k = key.reshape(num_groups, -1, *rest)  # [groups, d, ...]
    v = value.reshape(num_groups, -1, *rest)
    return torch.cat((q, k, v), dim=1).reshape(-1, *rest)


def split_qkv(fused: torch.Tensor, num_heads: int, num_groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """The inverse of ``fuse_qkv``: (q ``[heads * d, ...]``, k, v ``[groups * d, ...]``)."""
    rest = fused.shape[1:]
    q_width = num_heads // num_groups * head_dim
    grouped = fused.reshape(num_groups, q_width + 2 * head_dim, *rest)
    q, k, v = grouped.split((q_width, head_dim, head_dim), dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def check_resolved(model_config) -> None:
    if model_config.head_dim is None or model_config.vocab_size is None:
        raise ConfigError("from_mtl needs the resolved model config (RunConfig.resolve fills head_dim, vocab_size)")
