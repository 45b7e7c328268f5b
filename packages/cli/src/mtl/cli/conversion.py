"""Checkpoint conversion around a model family's converters: the family maps tensors and
config keys; this module does the file I/O, one tensor at a time, and carries tokenizer files.

Import (``--from NAME --to mtl``): the converter's tensors (a lazy ``TensorStream`` where the
converter has ``stream_to_mtl``, else its dict, emptied as it is written) go one by one into a
``StreamingCheckpointWriter``, each chunked as the target layout (``--tp``/``--pp``) shards it,
and the stored config says that layout. Export (``--from mtl --to NAME``): the converter reads
the checkpoint's global tensors, whatever layout saved them, one at a time (``CheckpointSource``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import contextlib
import inspect
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

from mtl.ckpt import latest_iteration, read_metadata, storage
from mtl.ckpt.directory import iteration_dir, read_manifest
from mtl.ckpt.storage import dtype_from_name
from mtl.ckpt.stream_writer import StreamingCheckpointWriter
from mtl.core.config import RunConfig
from mtl.core.config_io import config_from_dict
from mtl.core.errors import CheckpointError, ConfigError
from mtl.core.model_protocol import build_model
from mtl.core.plugins import registry
from mtl.models.param_layout import parameter_entries
from mtl.parallel.topology import Topology
from mtl.train.checkpointing import software_versions
from mtl.train.inference import single_process_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model")
HF_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
MODEL_PREFIX = "model."


def converter_formats() -> dict[str, list[str]]:
    """Converter name -> the model families that register one under that name."""
    formats: dict[str, list[str]] = {}
    families = registry("model family")
    for family in families.names():
        for name in families.get(family).converters:
            formats.setdefault(name, []).append(family)
    return formats


def _family_for(fmt: str, family: str | None, src_dir: Path | None = None) -> str:
    """The family whose ``fmt`` converter reads ``src_dir``: ``family`` if given; else the only
    one with such a converter, or among several the one whose converter ``accepts(src_dir)``
    (the hf converters of gpt and bert tell their architectures apart by config.json)."""
    formats = converter_formats()
    if fmt not in formats:
        known = ", ".join(sorted(formats)) or "none"
        raise ConfigError(f"no model family registers a '{fmt}' converter (installed converters: {known})")
    if family is None:
        candidates = formats[fmt]
        if len(candidates) > 1 and src_dir is not None:
            candidates = [name for name in candidates
                          if getattr(_converter(name, fmt), "accepts", lambda src: True)(src_dir)] or candidates
        if len(candidates) > 1:
            raise ConfigError(f"model families {', '.join(candidates)} all have a '{fmt}' converter; pick one with --family")
        return candidates[0]
    if family not in formats[fmt]:
        raise ConfigError(f"model family '{family}' has no '{fmt}' converter (families with one: {', '.join(formats[fmt])})")
    return family


def _converter(family: str, fmt: str):
    converters = registry("model family").get(family).converters
    if fmt not in converters:
        raise ConfigError(f"model family '{family}' has no '{fmt}' converter (it has: {', '.join(converters) or 'none'})")
    return converters[fmt]


def _detect_tokenizer(directory: Path) -> tuple[str, str] | None:
    """(our tokenizer name, its file inside the converted checkpoint) for the HF tokenizer
    files in ``directory``, or None when it has none."""
    if (directory / "tokenizer.json").exists():
        return "hf", "tokenizer/tokenizer.json"
    if (directory / "vocab.json").exists() and (directory / "merges.txt").exists():
        return "gpt2-bpe", "tokenizer"
    if (directory / "tokenizer.model").exists():
        return "sentencepiece", "tokenizer/tokenizer.model"
    return None


def _hf_config(src_dir: Path) -> dict:
    """config.json of an HF checkpoint, or {} for a source that has none (another format)."""
    path = src_dir / "config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not readable JSON: {exc}") from exc


def target_layout(cfg: RunConfig, family: str) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Global name -> (global shape, chunk shape): the chunk is TP rank 0's box at
    ``cfg.parallel.tp``, so every rank of a run at that layout reads whole chunks. Built on
    the meta device: no memory, no process group."""
    topology = Topology(tp=cfg.parallel.tp, rank=0)
    with torch.device("meta"):
        model = build_model(registry("model family").get(family), cfg, topology, registry("backend").get(cfg.model.backend))
    return {e.global_name: (e.global_shape, tuple(max(1, n) for n in e.view(e.param).shape))
            for e in parameter_entries(model, topology)}


def _check_fits(metas: dict[str, torch.Tensor], layout: dict, src: str) -> None:
    missing, unexpected = sorted(set(layout) - set(metas)), sorted(set(metas) - set(layout))
    if missing or unexpected:
        raise CheckpointError(
            f"{src}: the converted tensors do not fit the model its config describes: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for name, (global_shape, _) in layout.items():
        if tuple(metas[name].shape) != tuple(global_shape):
            raise CheckpointError(f"{src}: {name} converts to shape {tuple(metas[name].shape)}, the model's is {tuple(global_shape)}")


class _EchoWarnings(logging.Handler):
    """A converter's logged warnings (e.g. an unknown true vocabulary) as ``warning:`` lines."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"warning: {record.getMessage()}", err=True)


@contextlib.contextmanager
def _converter_warnings_shown():
    logger, handler = logging.getLogger("mtl.models"), _EchoWarnings(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _converted_tensors(converter, src_dir: Path, options: dict[str, Any]):
    """(model section, name -> meta tensor, iterator of (name, tensor)) from any converter."""
    if hasattr(converter, "stream_to_mtl"):
        section, tensors = converter.stream_to_mtl(src_dir, **options)
        return section, tensors.metas, iter(tensors)
    section, state = converter.to_mtl(src_dir, **options)
    metas = {name: tensor.to("meta") for name, tensor in state.items()}

    def drain():  # hand each tensor over and drop our reference, so it is freed once written
        for name in list(state):
            yield name, state.pop(name)

    return section, metas, drain()


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:  # not glibc: nothing to tune
        return None


_GLIBC = _glibc()
_M_ARENA_MAX = -8  # mallopt parameter (malloc.h)


def keep_memory_to_one_tensor() -> None:
    """Make freed tensor buffers go back to the OS. tensorstore's I/O threads allocate chunk
    buffers in per-thread glibc arenas that keep what they free, so a conversion's resident
    memory would grow by a few tensors' worth above what it holds; one arena (set before those
    threads start) and a trim after each tensor keep it at about the tensor in hand."""
    if _GLIBC is not None:
        _GLIBC.mallopt(_M_ARENA_MAX, 1)


def release_freed_memory() -> None:
    if _GLIBC is not None:
        _GLIBC.malloc_trim(0)


@dataclass
class ImportResult:
    config: RunConfig
    tensors: int
    has_tokenizer: bool


def _tokenizer_folder(src_dir: Path, tokenizer_dir: str | None) -> Path:
    """Where the source's tokenizer files are: ``--tokenizer``'s folder, else ``src_dir``'s
    ``tokenizer/`` (an export to Megatron puts them there), else ``src_dir``."""
    if tokenizer_dir is not None:
        if _detect_tokenizer(Path(tokenizer_dir)) is None:
            raise ConfigError(f"--tokenizer {tokenizer_dir}: no tokenizer files there ({', '.join(TOKENIZER_FILES)})")
        return Path(tokenizer_dir)
    nested = src_dir / "tokenizer"
    return nested if nested.is_dir() and _detect_tokenizer(nested) is not None else src_dir


def _tokenizer_vocab_size(folder: Path, tokenizer: tuple[str, str]) -> int:
    """The vocabulary of the tokenizer files in ``folder`` (``tokenizer``: _detect_tokenizer's)."""
    relative = tokenizer[1].removeprefix("tokenizer").lstrip("/")
    return registry("tokenizer").get(tokenizer[0]).build(str(folder / relative)).vocab_size


def to_mtl(src: str, dst: str, *, src_format: str = "hf", family: str | None = None, tp: int = 1, pp: int = 1,
           tokenizer_dir: str | None = None, **options) -> ImportResult:
    """Convert ``src`` (a ``src_format`` checkpoint) into an mtl checkpoint at ``dst`` stored for
    the ``tp`` x ``pp`` layout. ``options`` (e.g. ``vocab_size``) go to the converter; one that
    takes ``tokenizer_vocab_size`` also gets the tokenizer's vocabulary (the true vocabulary of
    a format that pads it)."""
    keep_memory_to_one_tensor()
    src_dir, dst_dir = Path(src), Path(dst)
    if not src_dir.exists():
        raise CheckpointError(f"{src_dir} does not exist: give the {src_format} checkpoint directory to convert")
    family = _family_for(src_format, family, src_dir)
    converter = _converter(family, src_format)
    tokenizer_folder = _tokenizer_folder(src_dir, tokenizer_dir)
    tokenizer = _detect_tokenizer(tokenizer_folder)
    takes = inspect.signature(getattr(converter, "stream_to_mtl", converter.to_mtl)).parameters
    if tokenizer is not None and "tokenizer_vocab_size" in takes:
        options["tokenizer_vocab_size"] = _tokenizer_vocab_size(tokenizer_folder, tokenizer)
    with _converter_warnings_shown():
        section, metas, tensors = _converted_tensors(converter, src_dir, options)
    data = {"tokenizer": tokenizer[0], "tokenizer_model": tokenizer[1]} if tokenizer else {}
    cfg = config_from_dict({"model": {**section, "family": family}, "parallel": {"tp": tp, "pp": pp}, "data": data},
                           source=f"the config converted from {src_dir}")
    cfg = cfg.resolve(world_size=tp * pp)
    layout = target_layout(cfg, family)
    _check_fits(metas, layout, str(src_dir))
    if tokenizer is None:
        click.echo(
            f"warning: {src_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); the checkpoint records "
            "none, so `mtl generate` on it needs --tokenizer NAME [--tokenizer-model PATH]", err=True)
    hf_config = _hf_config(src_dir)
    metadata = {"iteration": 0, "consumed_samples": 0, "model_only": True, "config": cfg.to_dict(),
                "versions": software_versions(), "world_size": tp * pp, "converted_from": str(src_dir),
                "source_format": src_format, "has_tokenizer": tokenizer is not None,
                "hf_token_ids": {key: hf_config[key] for key in HF_TOKEN_ID_KEYS if key in hf_config}}
    if src_format == "hf" and "model_type" in hf_config:
        metadata["hf_architecture"] = hf_config["model_type"]  # exported back as the same architecture
    writer = StreamingCheckpointWriter(str(dst_dir), 0, metadata)
    count = 0
    for name, tensor in tensors:
        writer.write(MODEL_PREFIX + name, tensor, layout[name][1])
        del tensor  # the only reference: one converted tensor (or q/k/v group) alive at a time
        release_freed_memory()
        count += 1
    if tokenizer is not None:
        (dst_dir / "tokenizer").mkdir(exist_ok=True)
        for name in TOKENIZER_FILES:
            if (tokenizer_folder / name).exists():
                shutil.copy2(tokenizer_folder / name, dst_dir / "tokenizer" / name)
    writer.commit()
    return ImportResult(cfg, count, tokenizer is not None)


def hf_to_mtl(src: str, dst: str, family: str = "gpt", *, tp: int = 1, pp: int = 1) -> RunConfig:
    return to_mtl(src, dst, src_format="hf", family=family, tp=tp, pp=pp).config


class CheckpointSource:
    """A ``TensorSource`` over the model tensors of a committed mtl checkpoint, read one at a
    time (and verified) whatever layout saved them."""

    def __init__(self, ckpt_dir: str | Path, iteration: int | None = None):
        self.dir = str(ckpt_dir)
        self.iteration = latest_iteration(self.dir) if iteration is None else iteration
        self.entries = {key.removeprefix(MODEL_PREFIX): entry
                        for key, entry in read_manifest(self.dir, self.iteration)["tensors"].items()
                        if key.startswith(MODEL_PREFIX)}

    def names(self) -> list[str]:
        return list(self.entries)

    def _entry(self, name: str) -> dict[str, Any]:
        if name not in self.entries:
            raise CheckpointError(f"{self.dir} (iteration {self.iteration}) has no tensor {MODEL_PREFIX}{name}")
        return self.entries[name]

    def meta(self, name: str) -> torch.Tensor:
        entry = self._entry(name)
        return torch.empty(entry["global_shape"], dtype=dtype_from_name(entry["dtype"]), device="meta")

    def get(self, name: str) -> torch.Tensor:
        """The whole global tensor, each stored shard checked against its sha256; read with
        tensorstore into one buffer (``mtl.ckpt.load`` would hold three copies at its peak)."""
        entry, key = self._entry(name), MODEL_PREFIX + name
        release_freed_memory()  # what the previous tensor's read and write left behind
        array = storage.open_array(os.path.join(iteration_dir(self.dir, self.iteration), entry["path"]), key)
        shape = tuple(entry["global_shape"])
        words = storage.read_region(array, (0,) * len(shape), shape, key)
        for shard in entry["shards"]:
            box = words[tuple(slice(o, o + n) for o, n in zip(shard["offset"], shard["shape"]))]
            if storage.checksum(box) != shard["sha256"]:
                raise CheckpointError(
                    f"{self.dir}: tensor '{key}' shard at offset {shard['offset']} fails its checksum; the "
                    "checkpoint is corrupt — export another iteration"
                )
        words = np.ascontiguousarray(words)
        if words.dtype == np.uint16:  # bfloat16 stored as raw words; torch views int16 words
            words = words.view(np.int16)
        tensor = torch.from_numpy(words)
        logical = dtype_from_name(entry["dtype"])
        return tensor if tensor.dtype == logical else tensor.view(logical)  # raw words -> logical dtype


def _checkpoint_eod(ckpt_dir: Path, cfg: RunConfig, metadata: dict) -> int | None:
    """The end-of-document id of the checkpoint's tokenizer, where it has one."""
    if metadata.get("has_tokenizer") is False:
        return None
    from mtl.train.inference import resolve_tokenizer_path

    model_path = resolve_tokenizer_path(ckpt_dir, cfg.data.tokenizer_model)
    return registry("tokenizer").get(cfg.data.tokenizer).build(model_path).eod


def from_mtl(src: str, dst: str, *, dst_format: str = "hf", family: str | None = None, **options) -> list[str]:
    """Export the mtl checkpoint ``src`` (saved at any layout) to ``dst`` through the family's
    ``dst_format`` converter; returns the files it wrote. For ``hf``, ``options`` may name the
    ``architecture`` (default: the one converted from, else the config's) and ``max_shard_bytes``."""
    keep_memory_to_one_tensor()
    src_dir, dst_dir = Path(src), Path(dst)
    if not src_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {src_dir} does not exist")
    source = CheckpointSource(src_dir)
    metadata = read_metadata(str(src_dir), source.iteration)
    cfg = single_process_config(metadata["config"]).resolve(world_size=1)
    converter = _converter(family or cfg.model.family, dst_format)
    if not hasattr(converter, "from_mtl"):
        raise ConfigError(f"the '{dst_format}' converter of model family '{family or cfg.model.family}' only "
                          f"imports; it cannot write {dst_format} checkpoints")
    if dst_format == "hf" and options.get("architecture") is None:
        options["architecture"] = metadata.get("hf_architecture")
    if dst_format == "megatron" and options.get("iteration") is None:
        options["iteration"] = source.iteration or "release"  # Megatron-LM refuses iteration 0
    options = {k: v for k, v in options.items() if v is not None}
    dst_dir.mkdir(parents=True, exist_ok=True)
    files = converter.from_mtl(cfg.model, source, dst_dir, **options)
    if dst_format == "megatron":
        if (src_dir / "tokenizer").is_dir():
            shutil.copytree(src_dir / "tokenizer", dst_dir / "tokenizer", dirs_exist_ok=True)
        if any(key.startswith("optimizer.") for key in read_manifest(str(src_dir), source.iteration)["tensors"]):
            click.echo(f"note: {src_dir} holds optimizer state; the Megatron export is weights only (resume it in "
                       "Megatron-LM with --no-load-optim, or from the release folder, which skips it)", err=True)
    if dst_format == "hf":
        _write_token_ids(dst_dir, src_dir, cfg, metadata)
        if (src_dir / "tokenizer").is_dir():
            for path in (src_dir / "tokenizer").iterdir():
                shutil.copy2(path, dst_dir / path.name)
    return list(files or [])


def _write_token_ids(dst_dir: Path, src_dir: Path, cfg: RunConfig, metadata: dict) -> None:
    """Special-token ids: those of the HF checkpoint this one was converted from, else the
    tokenizer's end-of-document token (the exporters write none, and transformers' defaults,
    e.g. GPT-2's 50256, can lie outside a smaller vocabulary)."""
    token_ids = metadata.get("hf_token_ids")
    if not token_ids:
        eod = _checkpoint_eod(src_dir, cfg, metadata)
        token_ids = {} if eod is None else {"bos_token_id": eod, "eos_token_id": eod}
    config_path = dst_dir / "config.json"
    hf_config = json.loads(config_path.read_text())
    hf_config.update(token_ids)
    config_path.write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")


def mtl_to_hf(src: str, dst: str, family: str | None = None, **options) -> list[str]:
    return from_mtl(src, dst, dst_format="hf", family=family, **options)
