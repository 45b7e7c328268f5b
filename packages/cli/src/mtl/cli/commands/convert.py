"""``mtl convert --from NAME --to mtl SRC DST [--tp N --pp M]`` and ``--from mtl --to NAME``:
NAME is any converter a model family registers (``hf`` and ``megatron`` for the built-in
``gpt`` family)."""

from __future__ import annotations

import re

import click

from mtl.core.errors import ConfigError

SIZE_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}


def parse_size(text: str) -> int:
    """``--max-shard-size`` as bytes: ``5GB``, ``500MB``, ``2GiB`` or a plain number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in SIZE_UNITS:
        raise ConfigError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).upper()])


def hf_architectures() -> list[str]:
    """The Hugging Face ``model_type``s the installed families' ``hf`` converters export to
    (each converter's ``architectures``), in registration order."""
    from mtl.core.plugins import registry  # noqa: PLC0415 (plugins load only when help is shown)

    families = registry("model family")
    names: list[str] = []
    for family in families.names():
        converter = families.get(family).converters.get("hf")
        names += [a for a in getattr(converter, "architectures", ()) if a not in names]
    return names


class _HFArchitectureOption(click.Option):
    """``--hf-architecture``, whose help lists the architectures the installed converters
    support, looked up only when the help is shown."""

    def get_help_record(self, ctx):
        try:
            supported = ", ".join(hf_architectures()) or "none installed"
        except Exception:  # noqa: BLE001 (a broken plugin must not break --help)
            supported = "see `mtl plugins`"
        self.help = f"--to hf: one of {supported} [default: the one converted from, else by the config]."
        return super().get_help_record(ctx)


@click.command()
@click.option("--from", "src_format", required=True, metavar="NAME",
              help="mtl, or a converter of an installed model family (e.g. hf, megatron); see `mtl plugins`.")
@click.option("--to", "dst_format", required=True, metavar="NAME", help="mtl, or a converter that exports (e.g. hf, megatron).")
@click.option("--family", default=None,
              help="Model family whose converter to use [default: the one that has it / the checkpoint's].")
@click.option("--tp", default=1, show_default=True, type=click.IntRange(min=1),
              help="--to mtl: the tensor-parallel size the checkpoint is stored (and chunked) for; "
                   "--to megatron: the TP size recorded in its args (it sets the vocabulary padding).")
@click.option("--pp", default=1, show_default=True, type=click.IntRange(min=1),
              help="--to mtl / megatron: the pipeline-parallel size recorded in its config / args.")
@click.option("--vocab-size", default=None, type=click.IntRange(min=1),
              help="--to mtl: the true vocabulary of a source that pads it (megatron) [default: its args.vocab_size, "
                   "else the tokenizer's].")
@click.option("--iteration", default=None, type=click.IntRange(min=1),
              help="--from megatron: the iteration of the save directory to read [default: "
                   "latest_checkpointed_iteration.txt's]; --to megatron: the iteration to write it as "
                   "[default: the checkpoint's, or 'release' for iteration 0].")
@click.option("--tokenizer", "tokenizer_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="--to mtl: a folder of tokenizer files (tokenizer.json, vocab.json + merges.txt or "
                   "tokenizer.model) to carry along (megatron: and take the true vocabulary from) [default: SRC's].")
@click.option("--te/--local", "te", default=False, show_default=True,
              help="--to megatron: tensor names of Megatron-Core's Transformer-Engine layer spec, or of its local one.")
@click.option("--hf-architecture", cls=_HFArchitectureOption, default=None,
              help="--to hf: the Hugging Face model_type to write [default: the one converted from, else by the config].")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="--to hf: largest safetensors file; more get an index.json.")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
def convert(src_format, dst_format, family, tp, pp, vocab_size, iteration, tokenizer_dir, te, hf_architecture,
            max_shard_size, src, dst):
    """Convert a checkpoint between formats, one tensor at a time (tokenizer files are carried along)."""
    from mtl.cli.conversion import converter_formats, from_mtl, to_mtl

    formats = sorted(converter_formats())
    for flag, name in (("--from", src_format), ("--to", dst_format)):
        if name != "mtl" and name not in formats:
            raise ConfigError(f"{flag} {name}: no such format; choose mtl or one of the installed converters: "
                              f"{', '.join(formats) or 'none'}")
    if dst_format == "mtl" and src_format != "mtl":
        if te:
            raise ConfigError("--te applies to --to megatron")
        if iteration is not None and src_format != "megatron":
            raise ConfigError(f"--iteration applies to --from megatron (or --to megatron), not --from {src_format}")
        options = {k: v for k, v in (("vocab_size", vocab_size), ("iteration", iteration)) if v is not None}
        result = to_mtl(src, dst, src_format=src_format, family=family, tp=tp, pp=pp, tokenizer_dir=tokenizer_dir,
                        **options)
        click.echo(f"converted {src} ({src_format}) -> {dst} (mtl, tp={tp} pp={pp}, {result.tensors} tensors)")
    elif src_format == "mtl" and dst_format != "mtl":
        if dst_format == "megatron":
            if vocab_size is not None or tokenizer_dir is not None:
                raise ConfigError("--vocab-size and --tokenizer apply to an import; the export keeps the checkpoint's")
            options = {"tp": tp, "pp": pp, "spec": "te" if te else "local", "iteration": iteration}
        elif (tp, pp, vocab_size, iteration, tokenizer_dir, te) != (1, 1, None, None, None, False):
            raise ConfigError("--tp, --pp, --vocab-size, --iteration, --tokenizer and --te apply to --to mtl or "
                              "--to megatron; an export to hf reads any layout as it is")
        else:
            options = {"max_shard_bytes": parse_size(max_shard_size)} if dst_format == "hf" else {}
        if hf_architecture is not None:
            options["architecture"] = hf_architecture
        files = from_mtl(src, dst, dst_format=dst_format, family=family, **options)
        click.echo(f"converted {src} (mtl) -> {dst} ({dst_format}, {len(files)} file(s))")
    else:
        raise ConfigError(f"cannot convert from {src_format} to {dst_format}: one side must be mtl and the other not "
                          f"(e.g. {src_format} -> mtl, or mtl -> {dst_format})")
