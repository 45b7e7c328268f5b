"""Modules' extra state (``nn.Module.get_extra_state``) in checkpoints.

Some backends keep state outside parameters and buffers: Transformer Engine's FP8 modules
hold their amax histories and scales in ``fp8_meta`` and hand them out through
``get_extra_state`` / ``set_extra_state``. A run resumed without them starts its delayed-
scaling histories afresh, and its losses drift from the uninterrupted run's.

The state is opaque (whatever the module returns), so it cannot be resharded. Each rank
saves its own, like its RNG states. The module states of a rank are
``torch.save``'d together as one row of a ``[world_size, n]`` uint8 array: an 8-byte
length, the bytes, then zero padding to ``n``, the longest row over the ranks (one
all-reduce). The row is restored, on a resume or a weights-only load, where the layout is
the same: world size, tp, pp, vpp, cp, ep (``layout_change.EXTRA_STATE_LAYOUT_KEYS``) and
the layers of each pipeline stage (a chunk names its modules by their place in it).
Elsewhere the modules keep their fresh state, and one log line says so. Loading uses
``torch.load(weights_only=True)``: an extra state must be tensors, numbers and plain
containers (mtl-te saves TE's delayed-scaling state that way, not as TE's own pickle); one
that is not starts fresh, with the reason."""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
from torch import nn

from mtl.ckpt.sharded import ShardedTensor
from mtl.parallel.topology import Topology

KEY = "extra_state"
METADATA_KEY = "extra_state_bytes"  # n: the row length every rank's template needs
_HEADER = 8  # bytes of the little-endian payload length at the start of a row


def modules_with_extra_state(models: list[nn.Module]) -> dict[str, nn.Module]:
    """``"<chunk index>.<module name>"`` -> module, for every module that overrides ``get_extra_state``."""
    found = {}
    for index, model in enumerate(models):
        for name, module in model.named_modules():
            if type(module).get_extra_state is not nn.Module.get_extra_state:
                found[f"{index}.{name}"] = module
    return found


def per_rank_row(key: str, row: torch.Tensor, topology: Topology) -> ShardedTensor:
    """``row`` [1, n] as this rank's row of a ``[world_size, n]`` array, written by this rank
    alone (per-rank state: RNG states, extra state)."""
    return ShardedTensor(key, row, (topology.world_size, row.shape[1]), (topology.rank, 0), replica_id=0)


def _row_length(payload: int, device: torch.device) -> int:
    """The longest row over all ranks (0: no rank has extra state)."""
    length = torch.tensor([payload + _HEADER if payload else 0], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(length, op=dist.ReduceOp.MAX)
    return int(length.item())


def save_state(models: list[nn.Module], topology: Topology, device: torch.device) -> tuple[dict[str, ShardedTensor], int]:
    """(this rank's row as a ShardedTensor, n), or ({}, 0) where no rank has extra state. A
    collective: every rank calls it at the same save."""
    states = {name: module.get_extra_state() for name, module in modules_with_extra_state(models).items()}
    payload = b""
    if states:
        buffer = io.BytesIO()
        torch.save(states, buffer)
        payload = buffer.getvalue()
    n = _row_length(len(payload), device)
    if n == 0:
        return {}, 0
    row = torch.zeros(1, n, dtype=torch.uint8)
    if payload:
        row[0, :_HEADER] = torch.frombuffer(bytearray(len(payload).to_bytes(_HEADER, "little")), dtype=torch.uint8)
        row[0, _HEADER:_HEADER + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return {KEY: per_rank_row(KEY, row, topology)}, n


def load_template(topology: Topology, n: int) -> dict[str, ShardedTensor]:
    """An empty row of ``n`` bytes for this rank, which ``load`` fills."""
    return {KEY: per_rank_row(KEY, torch.zeros(1, n, dtype=torch.uint8), topology)}


def restore(models: list[nn.Module], row: torch.Tensor) -> tuple[list[str], str]:
    """``set_extra_state`` on each module from this rank's loaded row; returns the names of the
    modules with extra state that it did not restore (they keep their fresh state) and why."""
    raw = row.reshape(-1).numpy().tobytes()
    size = int.from_bytes(raw[:_HEADER], "little")
    try:
        states = torch.load(io.BytesIO(raw[_HEADER:_HEADER + size]), weights_only=True) if size else {}
    except Exception as exc:  # noqa: BLE001 - a state that is not tensors and plain containers
        return list(modules_with_extra_state(models)), (
            f"the saved state is not readable with torch.load(weights_only=True) "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    missing = []
    for name, module in modules_with_extra_state(models).items():
        if name in states:
            module.set_extra_state(states[name])
        else:
            missing.append(name)
    return missing, "the checkpoint holds none for them"
