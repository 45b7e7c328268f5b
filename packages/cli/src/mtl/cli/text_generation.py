"""Text in, text out: tokenizer + checkpointed model + mtl.models' KV-cache generation."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path


from mtl.core.device import parse_device
from mtl.core.errors import ConfigError, NotInstalledError
from mtl.core.plugins import registry
from mtl.models.generate import generate
from mtl.train.inference import load_for_inference


@dataclass(frozen=True)
class Generation:
    text: str  # the prompt followed by the continuation
    prompt_ids: list[int]
    new_ids: list[int]


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


# What a line of `mtl generate --input` may set for its own prompt; its other keys are copied to
# its output line (ids, metadata).
_LINE_SAMPLING = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop")


def read_prompt_lines(path: str) -> list[dict]:
    """The JSON objects of a JSONL file, each with a non-empty string ``prompt``."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"--input {path}: cannot read it ({exc.strerror})") from exc
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc.msg}); each line is {{\"prompt\": \"...\"}}") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise ConfigError(f"{path}:{number}: each line needs a non-empty string \"prompt\"")
        records.append({**record, "_line": number})
    if not records:
        raise ConfigError(f"--input {path} holds no prompts (one JSON object per line: {{\"prompt\": \"...\"}})")
    return records


def generate_batch(checkpoint: str, input_path: str, output_path: str, *, max_new_tokens: int = 64,
                   temperature: float = 1.0, top_k: int = 0, seed: int = 0, device: str = "cpu",
                   tokenizer: str | None = None, tokenizer_model: str | None = None, iteration: int | None = None,
                   max_batch: int = 64, kv_memory: str | None = None) -> int:
    """Every prompt of a JSONL file through mtl-serve's engine (continuous batching over a paged
    KV cache), in the file's order to ``output_path``; each request samples as `mtl generate`
    does for that prompt alone. Returns how many prompts."""
    from tqdm import tqdm

    try:
        from mtl.serve.build import build_engine
        from mtl.serve.engine import RequestError
        from mtl.serve.sampling import SamplingParams
    except ImportError as exc:
        raise NotInstalledError("mtl generate --input runs mtl-serve's engine: pip install mtl-serve") from exc

    records = read_prompt_lines(input_path)
    engine = build_engine(checkpoint, device=parse_device(device), dtype=None, kv_memory=kv_memory,
                          max_batch=max_batch, tokenizer=tokenizer, tokenizer_model=tokenizer_model,
                          iteration=iteration)
    defaults = {"max_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "seed": seed}
    prompts, params = [], []
    for record in records:
        chosen = {**defaults, **{k: record[k] for k in _LINE_SAMPLING if k in record}}
        if isinstance(chosen.get("stop"), str):
            chosen["stop"] = [chosen["stop"]]
        chosen["stop"] = tuple(chosen.get("stop") or ())
        prompt_ids = engine.tokenizer.encode(record["prompt"])
        try:
            engine.check(prompt_ids, SamplingParams(**chosen))
        except (RequestError, TypeError) as exc:
            raise ConfigError(f"{input_path}:{record['_line']}: {exc}") from None
        prompts.append(prompt_ids)
        params.append(SamplingParams(**chosen))
    with tqdm(total=len(records), unit="prompt", desc="generate") as bar:
        results = engine.generate(prompts, params, progress=bar.update)
    with open(output_path, "w", encoding="utf-8") as out:
        for record, outputs in zip(records, results):
            extra = {k: v for k, v in record.items() if k not in _LINE_SAMPLING and k != "_line"}
            out.write(json.dumps({**extra, "text": "".join(o.text for o in outputs),
                                  "token_ids": [t for o in outputs for t in o.new_ids],
                                  "finish_reason": outputs[-1].finish_reason}) + "\n")
    return len(records)
