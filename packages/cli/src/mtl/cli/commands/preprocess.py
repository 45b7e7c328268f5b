"""``mtl preprocess``: JSONL/text to Megatron-compatible ``.bin/.idx``."""

from __future__ import annotations

import click


@click.command()
@click.option("--input", "input_path", required=True, type=click.Path(), help="JSONL (or text) corpus.")
@click.option("--output-prefix", required=True, help="Writes PREFIX.bin and PREFIX.idx.")
@click.option("--tokenizer", default="byte", show_default=True, help="Tokenizer registry name.")
@click.option("--tokenizer-model", default=None, help="Tokenizer file or directory, if it needs one.")
@click.option("--json-key", default="text", show_default=True)
@click.option("--workers", default=1, show_default=True, type=int)
@click.option("--append-eod", is_flag=True, help="End every document with the EOD token.")
@click.option("--overwrite", is_flag=True, help="Replace an existing PREFIX.bin/.idx (refused otherwise).")
@click.option("--split-sentences", is_flag=True,
              help="One sequence per sentence (NLTK Punkt), documents kept as runs of sentences "
                   "in the index, as Megatron's --split-sentences (BERT's sentence pairs need it).")
def preprocess(input_path, output_prefix, tokenizer, tokenizer_model, json_key, workers, append_eod, overwrite,
               split_sentences):
    """Tokenize a corpus into an indexed dataset."""
    from mtl.data.preprocess import preprocess as run

    stats = run(input_path, output_prefix, tokenizer, tokenizer_model=tokenizer_model,
                json_key=json_key, workers=workers, append_eod=append_eod, progress=True, overwrite=overwrite,
                split_sentences=split_sentences)
    if stats.splitter:
        click.echo(f"{stats.sequences:,} sentences split by {stats.splitter}")
    click.echo(f"{stats.docs:,} docs, {stats.tokens:,} tokens in {stats.seconds:.2f} s: "
               f"{stats.docs_per_s:,.0f} docs/s, {stats.mb_per_s:.2f} MB/s -> {output_prefix}.bin/.idx")
