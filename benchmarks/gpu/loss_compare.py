"""Loss curves on real tokens: train.compile on and off, and the precision layout (bf16
weights, fp32 main weights and main_grad) against the old one (fp32 weights under bf16
autocast), same model, data and seed (issue 11); with ``--runs`` also the fp8 and te backends
(issue 7).

    python3 benchmarks/gpu/loss_compare.py [--iters 200] [--global-batch 8] [--out losses.md] [--runs ...]

The tokens are the project's generated English-like corpus (``mtl.data.demo_corpus``),
byte-tokenized by ``mtl preprocess``'s pipeline. The model is the reference model
(``llama_reference.toml``) with the byte tokenizer's vocabulary. Prints the loss at every
``--every`` steps for each run and the largest relative difference of each run from the
first, over the mean of the last 20 steps and step by step.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
RUNS = {  # --runs NAME ...: the first chosen run is the one the others are compared with
    "compile": ("compile, bf16 weights + fp32 main", ["train.compile=true"]),
    "eager": ("eager, bf16 weights + fp32 main", ["train.compile=false"]),
    "autocast": ("compile, fp32 weights under autocast", ["train.compile=true", "train.params_dtype=fp32"]),
    # torch's fused AdamW + main -> model copy instead of mtl's one-pass Triton AdamW (ENV below)
    "torch-adamw": ("compile, torch's fused AdamW", ["train.compile=true"]),
    # issue 7: the backends (mtl-quant must be installed for fp8, mtl-te and TE for te)
    "fp8-current": ("fp8 current scaling, compiled", ["model.backend='fp8'", "train.fp8='current'", "train.compile=true"]),
    "fp8-rowwise": ("fp8 row-wise, compiled", ["model.backend='fp8'", "train.fp8='rowwise'", "train.compile=true"]),
    "te": ("te bf16", ["model.backend='te'", "train.compile=false"]),
    "te-fp8": ("te FP8 delayed", ["model.backend='te'", "train.fp8='delayed'", "train.compile=false"]),
}

ENV = {"torch-adamw": {"MTL_TORCH_ADAMW": "1"}}  # environment of a run, restored after it


def prepare_tokens(work: Path, num_docs: int) -> str:
    from mtl.data.demo_corpus import write_demo_corpus
    from mtl.data.preprocess import preprocess

    corpus = work / "corpus.jsonl"
    write_demo_corpus(str(corpus), num_docs=num_docs)
    prefix = work / "corpus_text_document"
    stats = preprocess(str(corpus), str(prefix), "byte", append_eod=True, workers=8, progress=False)
    print(f"corpus: {stats.docs:,} documents, {stats.tokens:,} byte tokens", flush=True)
    return str(prefix)


def run(name: str, overrides: list[str], prefix: str, args, work: Path) -> dict[int, float]:
    from mtl.core.config_io import load_config
    from mtl.train.loop import train

    cfg = load_config(str(HERE / "llama_reference.toml"), [
        "data.dataset='gpt'", "data.tokenizer='byte'", f"data.paths=[{json.dumps(prefix)}]", "data.split='98,1,1'",
        f"train.iters={args.iters}", f"train.global_batch_size={args.global_batch}", "train.warmup_iters=20",
        "train.lr_schedule='cosine'", f"logging.dir={json.dumps(str(work / name.replace(' ', '_')))}",
        "logging.callbacks=[]", "logging.tensorboard=false", *overrides,
    ])
    began = time.time()
    losses = train(cfg, progress=False).losses
    print(f"{name}: {time.time() - began:.0f} s, loss {losses[1]:.4f} -> {losses[args.iters]:.4f}", flush=True)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--out", default=None)
    parser.add_argument("--set", dest="sets", action="append", default=[], help="extra override for every run")
    parser.add_argument("--runs", nargs="+", default=["compile", "eager", "autocast"], choices=list(RUNS),
                        help="which runs, the first the reference (default: compile eager autocast)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="loss_compare_") as tmp:
        work = Path(tmp)
        prefix = prepare_tokens(work, args.docs)
        curves = {}
        for key in args.runs:
            name, overrides = RUNS[key]
            try:
                with mock.patch.dict(os.environ, ENV.get(key, {})):
                    curves[name] = run(name, [*overrides, *args.sets], prefix, args, work)
            except Exception as exc:  # report it; compare the runs that finished
                print(f"{name}: failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
    steps = [1, *range(args.every, args.iters + 1, args.every)]
    names = list(curves)
    lines = ["| step | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {s} | " + " | ".join(f"{curves[n][s]:.4f}" for n in names) + " |" for s in steps]
    first = curves[names[0]]
    tail = list(range(args.iters - 19, args.iters + 1))
    for name in names[1:]:
        per_step = max(abs(curves[name][s] - first[s]) / first[s] for s in first)
        tail_mean = abs(sum(curves[name][s] for s in tail) - sum(first[s] for s in tail)) / sum(first[s] for s in tail)
        lines.append(f"\n{name} vs {names[0]}: last-20-step mean differs by {tail_mean:.2e} relative; "
                     f"largest single-step difference {per_step:.2e}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
