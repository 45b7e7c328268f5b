"""``mtl generate CHECKPOINT --prompt TEXT``."""

from __future__ import annotations

import click


@click.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--prompt", required=True)
@click.option("--max-new-tokens", default=64, show_default=True, type=int)
@click.option("--temperature", default=1.0, show_default=True, type=float, help="0 is greedy.")
@click.option("--top-k", default=0, show_default=True, type=int, help="0 keeps every token.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--device", default="cpu", show_default=True)
def generate(checkpoint, prompt, max_new_tokens, temperature, top_k, seed, device):
    """Continue PROMPT with a model loaded from CHECKPOINT (KV-cached decoding)."""
    from mtl.cli.text_generation import generate_text

    click.echo(generate_text(checkpoint, prompt, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_k=top_k, seed=seed, device=device))
