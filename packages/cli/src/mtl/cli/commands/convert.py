"""``mtl convert --from NAME --to mtl SRC DST [--tp N --pp M]`` and ``--from mtl --to NAME``:
NAME is any converter a model family registers (``hf`` for the built-in ``gpt`` family)."""

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
              help="mtl, or a converter of an installed model family (e.g. hf); see `mtl plugins`.")
@click.option("--to", "dst_format", required=True, metavar="NAME", help="mtl, or a converter that exports (e.g. hf).")
@click.option("--family", default=None,
              help="Model family whose converter to use [default: the one that has it / the checkpoint's].")
@click.option("--tp", default=1, show_default=True, type=click.IntRange(min=1),
              help="--to mtl: the tensor-parallel size the checkpoint is stored (and chunked) for.")
@click.option("--pp", default=1, show_default=True, type=click.IntRange(min=1),
              help="--to mtl: the pipeline-parallel size recorded in its config.")
@click.option("--vocab-size", default=None, type=click.IntRange(min=1),
              help="--to mtl: the true vocabulary, for sources that do not record it (e.g. megatron).")
@click.option("--hf-architecture", cls=_HFArchitectureOption, default=None,
              help="--to hf: the Hugging Face model_type to write [default: the one converted from, else by the config].")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="--to hf: largest safetensors file; more get an index.json.")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
def convert(src_format, dst_format, family, tp, pp, vocab_size, hf_architecture, max_shard_size, src, dst):
    """Convert a checkpoint between formats, one tensor at a time (tokenizer files are carried along)."""
    from mtl.cli.conversion import converter_formats, from_mtl, to_mtl

    formats = sorted(converter_formats())
    for flag, name in (("--from", src_format), ("--to", dst_format)):
        if name != "mtl" and name not in formats:
            raise ConfigError(f"{flag} {name}: no such format; choose mtl or one of the installed converters: "
                              f"{', '.join(formats) or 'none'}")
    if dst_format == "mtl" and src_format != "mtl":
        options = {"vocab_size": vocab_size} if vocab_size is not None else {}
        result = to_mtl(src, dst, src_format=src_format, family=family, tp=tp, pp=pp, **options)
        click.echo(f"converted {src} ({src_format}) -> {dst} (mtl, tp={tp} pp={pp}, {result.tensors} tensors)")
    elif src_format == "mtl" and dst_format != "mtl":
        if (tp, pp, vocab_size) != (1, 1, None):
            raise ConfigError("--tp, --pp and --vocab-size apply to --to mtl; an export reads any layout as it is")
        options = {"max_shard_bytes": parse_size(max_shard_size)} if dst_format == "hf" else {}
        if hf_architecture is not None:
            options["architecture"] = hf_architecture
        files = from_mtl(src, dst, dst_format=dst_format, family=family, **options)
        click.echo(f"converted {src} (mtl) -> {dst} ({dst_format}, {len(files)} file(s))")
    else:
        raise ConfigError(f"cannot convert from {src_format} to {dst_format}: one side must be mtl and the other not "
                          f"(e.g. {src_format} -> mtl, or mtl -> {dst_format})")
