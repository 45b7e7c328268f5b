"""Text in, text out: tokenizer + checkpointed model + mtl.models' KV-cache generation."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from mtl.core.errors import ConfigError
from mtl.core.plugins import registry
from mtl.models.generate import generate
from mtl.train.inference import load_for_inference


@dataclass(frozen=True)
class Generation:
    text: str  # the prompt followed by the continuation
    prompt_ids: list[int]
    new_ids: list[int]


def parse_device(device: str) -> torch.device:
    """``--device`` as a torch device that exists on this machine, else a ConfigError."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"--device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device!r}: CUDA is not available here; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {device!r}: only {torch.cuda.device_count()} CUDA device(s)")
    return dev


def continuation_text(tokenizer, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text the new tokens add after the prompt. Decoding them on their own loses what
    depends on context (word-level tokenizers join tokens with spaces, a byte-level token may
    finish a character the prompt began), so decode prompt + continuation and drop the
    decoded prompt when it is a prefix."""
    whole = tokenizer.decode(list(prompt_ids) + list(new_ids))
    head = tokenizer.decode(list(prompt_ids))
    if whole.startswith(head):
        return whole[len(head):]
    return tokenizer.decode(list(new_ids))


def check_tokenizer_covers_model(tokenizer, tokenizer_name: str, model_vocab_size: int) -> None:
    """Refuse, before generating, a tokenizer that cannot decode every id the model may sample
    (otherwise the run ends in the tokenizer's decode, after the whole generation)."""
    if tokenizer.vocab_size >= model_vocab_size:
        return
    raise ConfigError(
        f"the model's vocabulary has {model_vocab_size} tokens but tokenizer '{tokenizer_name}' has "
        f"{tokenizer.vocab_size}, so it cannot decode what the model generates; pass the tokenizer the model "
        f"was trained with: --tokenizer NAME --tokenizer-model PATH (at least {model_vocab_size} tokens)")


_ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")


def checkpoint_and_iteration(checkpoint: str, iteration: int | None) -> tuple[str, int | None, str | None]:
    """(checkpoint directory, iteration, hint). An ``iter_NNNNNNN`` directory given where the
    checkpoint directory belongs is read as its parent at that iteration, with a hint saying so."""
    path = Path(checkpoint)
    match = _ITERATION_DIR.match(path.name)
    if match is None or (path / "latest").exists():
        return checkpoint, iteration, None
    named = int(match.group(1))
    if iteration is not None and iteration != named:
        raise ConfigError(f"{checkpoint} is iteration {named} but --iteration {iteration} was given; "
                          f"pass the checkpoint directory {path.parent} with --iteration N")
    hint = (f"note: {checkpoint} is one iteration of the checkpoint directory {path.parent}: reading it as "
            f"`mtl generate {path.parent} --iteration {named}`")
    return str(path.parent), named, hint


def generate_from_checkpoint(checkpoint: str, prompt: str, *, max_new_tokens: int = 64, temperature: float = 1.0,
                             top_k: int = 0, seed: int = 0, device: str = "cpu", tokenizer: str | None = None,
                             tokenizer_model: str | None = None, iteration: int | None = None) -> Generation:
    if tokenizer_model is not None and tokenizer is None:
        raise ConfigError("--tokenizer-model needs --tokenizer NAME (which tokenizer reads the file)")
    dev = parse_device(device)
    model, tokenizer, cfg = load_for_inference(checkpoint, device=dev, tokenizer=tokenizer,
                                               tokenizer_model=tokenizer_model, iteration=iteration)
    check_tokenizer_covers_model(tokenizer, cfg.data.tokenizer, cfg.model.vocab_size)
    prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:
        raise ConfigError(f"--prompt {prompt!r} encodes to no tokens; give a non-empty prompt")
    family_generate = registry("model family").get(cfg.model.family).generate
    if family_generate is not None:  # an answer to the prompt (t5): printed alone
        new_ids = family_generate(model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k,
                                  eod=tokenizer.eod, seed=seed)
        return Generation(tokenizer.decode(new_ids), list(prompt_ids), list(new_ids))
    new_ids = generate(model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k,
                       eod=tokenizer.eod, seed=seed)
    return Generation(prompt + continuation_text(tokenizer, prompt_ids, new_ids), list(prompt_ids), list(new_ids))


def generate_text(checkpoint: str, prompt: str, **kwargs) -> str:
    return generate_from_checkpoint(checkpoint, prompt, **kwargs).text
