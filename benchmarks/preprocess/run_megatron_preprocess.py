"""Run Megatron-LM's ``tools/preprocess_data.py`` against the installed megatron-core wheel.

    python run_megatron_preprocess.py /tmp/megatron_tools/preprocess_data.py --input ... (its args)

The script (fetched separately, not part of this repository) imports two things that the
megatron-core 0.16.1 wheel does not ship under those names:

- ``megatron.training.arguments._add_tokenizer_args``: ``megatron.training`` lives only in
  the Megatron-LM repository. We provide the tokenizer flags that the wheel's
  ``build_tokenizer`` reads, with the repository's defaults.
- ``megatron.core.tokenizers.utils.build_tokenizer``: in 0.16.1 the same function lives at
  ``megatron.core.tokenizers.text.utils.build_tokenizer``; we alias it.

The modules are put in ``sys.modules`` before the script runs; its worker processes are
forked, so they inherit them. Nothing in the script itself is changed.
"""

from __future__ import annotations

import argparse
import runpy
import sys
import types


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--vocab-size", type=int, default=None)
    group.add_argument("--vocab-file", type=str, default=None)
    group.add_argument("--merge-file", type=str, default=None)
    group.add_argument("--vocab-extra-ids", type=int, default=0)
    group.add_argument("--tokenizer-type", type=str, default=None)
    group.add_argument("--tokenizer-model", type=str, default=None)
    group.add_argument("--tokenizer-metadata", type=str, default=None)
    group.add_argument("--tokenizer-special-tokens", type=str, nargs="+", default=None)
    group.add_argument("--tokenizer-sentencepiece-legacy", action="store_true", default=False)
    group.add_argument("--tokenizer-hf-use-fast", action="store_true", default=False)
    group.add_argument("--tokenizer-hf-include-special-tokens", action="store_true", default=False)
    group.add_argument("--trust-remote-code", action="store_true", default=False)
    group.add_argument("--tiktoken-pattern", type=str, default=None)
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    return parser


def install_shims() -> None:
    from megatron.core.tokenizers.text.utils import build_tokenizer as wheel_build_tokenizer

    training = types.ModuleType("megatron.training")
    arguments = types.ModuleType("megatron.training.arguments")
    arguments._add_tokenizer_args = add_tokenizer_args
    training.arguments = arguments
    utils = types.ModuleType("megatron.core.tokenizers.utils")
    utils.build_tokenizer = wheel_build_tokenizer
    sys.modules.update({
        "megatron.training": training,
        "megatron.training.arguments": arguments,
        "megatron.core.tokenizers.utils": utils,
        "megatron.core.tokenizers.utils.build_tokenizer": wheel_build_tokenizer,
    })


if __name__ == "__main__":
    script = sys.argv[1]
    sys.argv = [script] + sys.argv[2:]
    install_shims()
    runpy.run_path(script, run_name="__main__")
