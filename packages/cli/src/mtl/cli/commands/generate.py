"""``mtl generate CHECKPOINT --prompt TEXT``."""

from __future__ import annotations

import click


@click.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--prompt", required=True)
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
def generate(checkpoint, prompt, max_new_tokens, temperature, top_k, seed, device, show_ids, tokenizer,
             tokenizer_model, iteration):
    """Continue PROMPT with a model loaded from CHECKPOINT (KV-cached decoding); an
    encoder-decoder (t5) answers it instead, and only the answer is printed.

    CHECKPOINT is a checkpoint directory (ckpt.save of a run, or `mtl convert` output); its
    latest iteration is read unless --iteration names another."""
    from mtl.cli.text_generation import checkpoint_and_iteration, generate_from_checkpoint

    checkpoint, iteration, hint = checkpoint_and_iteration(checkpoint, iteration)
    if hint:
        click.echo(hint, err=True)
    result = generate_from_checkpoint(checkpoint, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_k=top_k, seed=seed, device=device, tokenizer=tokenizer,
                                      tokenizer_model=tokenizer_model, iteration=iteration)
    click.echo(result.text)
    if show_ids:
        click.echo(f"prompt ids: {' '.join(map(str, result.prompt_ids))}")
        click.echo(f"new ids: {' '.join(map(str, result.new_ids))}")
