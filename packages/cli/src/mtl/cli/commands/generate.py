"""``mtl generate CHECKPOINT --prompt TEXT``, or a JSONL file of prompts with ``--input/--output``."""

from __future__ import annotations

import click

from mtl.core.errors import ConfigError


@click.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--prompt", default=None, help="One prompt to continue (or --input).")
@click.option("--input", "input_path", default=None, type=click.Path(), metavar="PROMPTS.jsonl",
              help="Prompts, one JSON object a line ({\"prompt\": ...} and optionally max_tokens, temperature, "
                   "top_k, top_p, seed, stop), generated together by mtl-serve's engine.")
@click.option("--output", "output_path", default=None, type=click.Path(), metavar="OUT.jsonl",
              help="With --input: one line per prompt, in order, with text, token_ids and finish_reason.")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(min=0))
@click.option("--temperature", default=1.0, show_default=True, type=click.FloatRange(min=0), help="0 is greedy.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0), help="0 keeps every token.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--device", default="cpu", show_default=True)
@click.option("--show-ids", is_flag=True, help="Also print the prompt's and the generated token ids.")
@click.option("--tokenizer", default=None, metavar="NAME",
              help="Tokenizer to use instead of the checkpoint's (needed when it has none); see `mtl plugins`.")
@click.option("--tokenizer-model", default=None, type=click.Path(), metavar="PATH",
              help="The --tokenizer's file or directory (e.g. a tokenizer.json).")
@click.option("--iteration", default=None, type=click.IntRange(min=0), metavar="N",
              help="A committed iteration of CHECKPOINT other than its latest.")
@click.option("--max-batch", default=None, type=click.IntRange(min=1),
              help="With --input: prompts decoding together [default: 64].")
@click.option("--kv-memory", default=None, metavar="FRACTION|SIZE",
              help="With --input: the KV-cache pool (see `mtl serve --help`).")
def generate(checkpoint, prompt, input_path, output_path, max_new_tokens, temperature, top_k, seed, device, show_ids,
             tokenizer, tokenizer_model, iteration, max_batch, kv_memory):
    """Continue PROMPT with a model loaded from CHECKPOINT (KV-cached decoding; an
    encoder-decoder (t5) answers it instead, and only the answer is printed), or every prompt
    of --input into --output (continuous batching, with a progress bar).

    CHECKPOINT is a checkpoint directory (ckpt.save of a run, or `mtl convert` output); its
    latest iteration is read unless --iteration names another."""
    from mtl.cli.text_generation import checkpoint_and_iteration, generate_batch, generate_from_checkpoint

    if (prompt is None) == (input_path is None):
        raise ConfigError("give either --prompt TEXT or --input PROMPTS.jsonl --output OUT.jsonl")
    if (input_path is None) != (output_path is None):
        raise ConfigError("--input and --output go together (prompts in, generations out)")
    if input_path is None and (max_batch is not None or kv_memory is not None):
        raise ConfigError("--max-batch and --kv-memory size the batch engine of --input; with --prompt leave them out")
    if input_path is not None and show_ids:
        raise ConfigError("--show-ids prints one --prompt's token ids; leave it out with --input")
    checkpoint, iteration, hint = checkpoint_and_iteration(checkpoint, iteration)
    if hint:
        click.echo(hint, err=True)
    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed, device=device,
                   tokenizer=tokenizer, tokenizer_model=tokenizer_model, iteration=iteration)
    if input_path is not None:
        count = generate_batch(checkpoint, input_path, output_path, max_batch=max_batch or 64, kv_memory=kv_memory,
                               **options)
        click.echo(f"wrote {count} generations to {output_path}")
        return
    result = generate_from_checkpoint(checkpoint, prompt, **options)
    click.echo(result.text)
    if show_ids:
        click.echo(f"prompt ids: {' '.join(map(str, result.prompt_ids))}")
        click.echo(f"new ids: {' '.join(map(str, result.new_ids))}")
