"""``mtl demo``: the whole path on a CPU in a few minutes — generate a corpus, preprocess
it, train a small GPT, save a checkpoint, and print a sample of generated text."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import click

from mtl.core.config_io import load_config


@click.command()
@click.option("--workdir", default="demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override a value of the embedded demo config.")
@click.option("--prompt", default="The weather in the morning", show_default=True)
def demo(workdir, overrides, prompt):
    """Preprocess the generated corpus, train a tiny GPT on CPU, save, and generate."""
    from mtl.cli.text_generation import generate_text
    from mtl.data.demo_corpus import write_demo_corpus
    from mtl.data.preprocess import preprocess
    from mtl.train.loop import train

    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.jsonl"
    click.secho(f"1/4 writing the demo corpus to {corpus}", bold=True)
    write_demo_corpus(corpus)
    prefix = work / "corpus_text_document"
    click.secho(f"2/4 preprocessing -> {prefix}.bin/.idx", bold=True)
    stats = preprocess(str(corpus), str(prefix), "byte", append_eod=True, workers=2, progress=True)
    click.echo(f"    {stats.docs:,} docs, {stats.tokens:,} tokens, {stats.mb_per_s:.1f} MB/s")
    config_path = files("mtl.cli").joinpath("demo.toml")
    # json.dumps quotes a path as a TOML basic string (quotes and backslashes escaped)
    defaults = [f"data.paths=[{json.dumps(str(prefix))}]", f"ckpt.save={json.dumps(str(work / 'checkpoints'))}",
                f"logging.dir={json.dumps(str(work / 'logs'))}"]
    cfg = load_config(str(config_path), [*defaults, *overrides])
    click.secho(f"3/4 training ({cfg.train.iters} iterations); metrics in {cfg.logging.dir}/metrics.jsonl", bold=True)
    result = train(cfg)
    if result.losses:
        first, last = result.losses[min(result.losses)], result.losses[max(result.losses)]
        click.echo(f"    loss {first:.3f} -> {last:.3f}")
    else:  # a second `mtl demo`: the checkpoint already holds every iteration
        click.echo(f"    already trained: {cfg.ckpt.save} holds iteration {result.final_iteration}")
    click.secho("4/4 sampling from the checkpoint (temperature 0.7, top-k 20):", bold=True)
    # stay within the trained context (a model with learned positions has no position beyond it)
    max_new_tokens = max(1, min(120, cfg.model.seq_length - len(prompt.encode("utf-8"))))
    click.echo(generate_text(str(work / "checkpoints"), prompt, max_new_tokens=max_new_tokens,
                             temperature=0.7, top_k=20))
