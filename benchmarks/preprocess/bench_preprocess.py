"""Time `mtl preprocess` against Megatron-LM's tools/preprocess_data.py on the same corpus.

    .venv/bin/python benchmarks/preprocess/bench_preprocess.py \
        --megatron-script /tmp/megatron_tools/preprocess_data.py [--size-mb 50] [--workers 1 2]

Both tools tokenize the same demo-corpus JSONL (written by mtl.data.demo_corpus) with the
same GPT-2 byte-level BPE (vocab.json + merges.txt trained here with `tokenizers`, since
nothing can be downloaded), appending an end-of-document token, with the same worker count.
Each run is a fresh process timed end to end (imports included: that is what a user waits
for). The outputs must be byte-identical; the table and the environment are printed and
written to benchmarks/log/<date>-cpu-preprocessing.md (``--results``).

Megatron's script is not in the megatron-core wheel: fetch tools/preprocess_data.py from
NVIDIA/Megatron-LM yourself; run_megatron_preprocess.py (beside this file) supplies the two
imports the 0.16.1 wheel lacks. Its tokenizer is `HuggingFaceTokenizer` on a folder holding
the same vocab/merges plus a tokenizer_config.json: Megatron's `GPT2BPETokenizer` type cannot
run offline (it resolves the name "gpt2" on the Hugging Face Hub).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
EOD = "<|endoftext|>"


def write_corpus(path: str, size_mb: float) -> None:
    from mtl.data.demo_corpus import write_demo_corpus

    if os.path.exists(path) and abs(os.path.getsize(path) / 1e6 - size_mb) < 0.1 * size_mb:
        return
    sample = write_demo_corpus(path, num_docs=2000, seed=0)
    bytes_per_doc = os.path.getsize(sample) / 2000
    write_demo_corpus(path, num_docs=int(size_mb * 1e6 / bytes_per_doc), seed=0)


def train_gpt2_bpe(corpus: str, out_dir: str, vocab_size: int) -> None:
    """vocab.json + merges.txt (for both tools) + tokenizer_config.json (for Megatron's HF path)."""
    from tokenizers import ByteLevelBPETokenizer

    if os.path.exists(os.path.join(out_dir, "merges.txt")):
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(20000), f)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, special_tokens=[EOD], show_progress=False)
    bpe.save_model(out_dir)
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": EOD, "bos_token": EOD,
              "unk_token": EOD, "add_prefix_space": False, "model_max_length": 1 << 30}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def timed(command: list[str], cwd: str, env: dict) -> tuple[float, int, str]:
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    return time.perf_counter() - start, proc.returncode, proc.stdout + proc.stderr


def digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()[:16]


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            match = re.search(r"model name\s*:\s*(.*)", f.read())
        return match.group(1) if match else platform.processor()
    except OSError:
        return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megatron-script", default="/tmp/megatron_tools/preprocess_data.py")
    parser.add_argument("--size-mb", type=float, default=50.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--work-dir", default="/tmp/mtl_bench_preprocess")
    parser.add_argument("--results", default=os.path.join(
        REPO, "benchmarks", "log", f"{time.strftime('%Y-%m-%d')}-cpu-preprocessing.md"))
    args = parser.parse_args()

    os.makedirs(args.work_dir, exist_ok=True)
    corpus = os.path.join(args.work_dir, "demo.jsonl")
    tokenizer_dir = os.path.join(args.work_dir, "gpt2_bpe")
    write_corpus(corpus, args.size_mb)
    train_gpt2_bpe(corpus, tokenizer_dir, args.vocab_size)
    size_mb = os.path.getsize(corpus) / 1e6
    with open(corpus, "rb") as f:
        num_docs = sum(1 for _ in f)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

    rows, notes = [], []
    for workers in args.workers:
        mtl_prefix = os.path.join(args.work_dir, f"mtl_w{workers}")
        mtl_code = ("import json, sys; from mtl.data.preprocess import preprocess; "
                    f"s = preprocess({corpus!r}, {mtl_prefix!r}, 'gpt2-bpe', {tokenizer_dir!r}, "
                    f"workers={workers}, append_eod=True, progress=False); print(json.dumps(s.__dict__))")
        mtl_wall, mtl_rc, mtl_out = timed([sys.executable, "-c", mtl_code], args.work_dir, env)
        if mtl_rc != 0:
            raise SystemExit(f"mtl preprocess failed:\n{mtl_out}")
        mtl_stats = json.loads(mtl_out.strip().splitlines()[-1])

        meg_prefix = os.path.join(args.work_dir, f"megatron_w{workers}")
        meg_wall, meg_rc, meg_out = timed(
            [sys.executable, os.path.join(HERE, "run_megatron_preprocess.py"), args.megatron_script,
             "--input", corpus, "--output-prefix", meg_prefix, "--json-keys", "text",
             "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_dir,
             "--workers", str(workers), "--append-eod", "--log-interval", "1000000"],
            args.work_dir, env)
        meg_bin, meg_idx = meg_prefix + "_text_document.bin", meg_prefix + "_text_document.idx"
        if not os.path.exists(meg_idx):
            raise SystemExit(f"Megatron's script wrote no output (exit {meg_rc}):\n{meg_out[-3000:]}")
        if meg_rc != 0:
            last = meg_out.strip().splitlines()[-1]
            notes.append(f"Megatron's script exited {meg_rc} after writing its output "
                         f"(workers={workers}): `{last}` (its main() calls "
                         "find_optimal_num_workers(args.performance_dir) unconditionally; "
                         "without --find-optimal-num-workers there are no results to rank)")
        same_bin = digest(mtl_prefix + ".bin") == digest(meg_bin)
        same_idx = digest(mtl_prefix + ".idx") == digest(meg_idx)
        rows.append((workers, mtl_wall, mtl_stats["seconds"], meg_wall, same_bin, same_idx,
                     mtl_stats["tokens"]))
        print(f"workers={workers}: mtl {mtl_wall:.1f}s, megatron {meg_wall:.1f}s, "
              f"bin identical={same_bin}, idx identical={same_idx}", flush=True)

    table = ["| workers | mtl wall s | mtl MB/s | mtl in-process s | Megatron wall s | Megatron MB/s "
             "| speed-up | .bin identical | .idx identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for workers, mtl_wall, mtl_inner, meg_wall, same_bin, same_idx, _ in rows:
        table.append(f"| {workers} | {mtl_wall:.1f} | {size_mb / mtl_wall:.2f} | {mtl_inner:.1f} | "
                     f"{meg_wall:.1f} | {size_mb / meg_wall:.2f} | {meg_wall / mtl_wall:.2f}x | "
                     f"{'yes' if same_bin else 'NO'} | {'yes' if same_idx else 'NO'} |")
    command = "python benchmarks/preprocess/bench_preprocess.py " + " ".join(sys.argv[1:])
    section = [
        f"## Preprocessing: mtl vs Megatron-LM tools/preprocess_data.py ({datetime.date.today()})",
        "",
        f"Command: `{command}`",
        "",
        f"Input: {size_mb:.1f} MB demo-corpus JSONL, {num_docs} documents, {rows[0][6]} tokens; "
        f"GPT-2 byte-level BPE trained here (vocab {args.vocab_size}), `--append-eod`. "
        "Wall time is one fresh process each, imports included.",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores (shared with other jobs; timings are "
        f"noisy), {platform.platform()}. Versions: Python {platform.python_version()}, "
        f"mtl-data {version('mtl-data')}, megatron-core {version('megatron-core')}, "
        f"tokenizers {version('tokenizers')}, transformers {version('transformers')}, "
        f"numpy {version('numpy')}.",
        "",
        *table,
        "",
        "Megatron ran through `benchmarks/preprocess/run_megatron_preprocess.py` (aliases the "
        "two imports the 0.16.1 wheel lacks) with `--tokenizer-type HuggingFaceTokenizer` on the "
        "same vocab/merges (its `GPT2BPETokenizer` type resolves \"gpt2\" on the Hub, impossible "
        "offline). Process layout: at workers=1 mtl tokenizes in its main process while "
        "Megatron runs a pool of one plus the main process (two busy processes); at workers=N "
        "both run N tokenizing processes plus the main one.",
        *[f"- {note}" for note in notes],
        "",
    ]
    text = "\n".join(section)
    print("\n" + text)
    with open(args.results, "a", encoding="utf-8") as f:
        f.write(("\n" if os.path.exists(args.results) and os.path.getsize(args.results) else "")
                + text)


if __name__ == "__main__":
    main()
