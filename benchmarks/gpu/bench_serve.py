"""mtl-serve's engine beside Hugging Face transformers' ``generate`` on the same weights (issue 41).

    python3 benchmarks/gpu/bench_serve.py --out $OUT/serve.md

The reference model (``llama_reference.toml``, random init) is built once in bf16; its weights
are exported with mtl's HF converter and loaded by ``transformers.LlamaForCausalLM`` (sdpa
attention, static KV cache, which transformers compiles for decoding where it supports it).
For each concurrency C (``--concurrency 1 16 64``) both serve C requests of ``--prompt-len``
random prompt tokens and ``--output-len`` output tokens (end-of-text ignored):

- mtl: all C requests are added to the engine at once (continuous batching, paged KV cache,
  chunked prefill of ``--max-step-tokens``), each detokenized as it goes (stream deltas, as
  the server sends them, with a byte-level BPE tokenizer as wide as the model's vocabulary:
  ``synthetic_bpe.py``); times per request from the step loop.
- HF: one static batch of C; time to first token is a ``max_new_tokens=1`` call, time per
  output token the rest of a full call over ``output_len - 1``.

Rows: output tokens/s (all requests' output tokens over the wall time), mean time to first
token, mean time per output token after the first. Before each timed run both systems run the
same workload once untimed: every decode bucket (batch size, table width) the timed run meets
is compiled and captured by then (``--compile``, on by default on CUDA), and HF compiles its
static-cache decode. A failure of HF (building, agreement or a run) is printed and the table
still comes out; if mtl's compiled decode fails, the run goes on with eager decode steps and
those rows say ``mtl-serve (eager)``.

    python3 benchmarks/gpu/bench_serve.py --check-only     # a tiny model on the CPU, < 60 s"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch._dynamo

from mtl.core.config_io import load_config
from mtl.core.model_protocol import build_model
from mtl.core.plugins import registry
from mtl.models.param_layout import parameter_entries
from mtl.parallel.topology import Topology
from mtl.serve.engine import Engine, EngineConfig
from mtl.serve.loading import LoadedModel
from mtl.serve.sampling import SamplingParams
from synthetic_bpe import synthetic_bpe

HERE = Path(__file__).resolve().parent


# --check-only: the reference config shrunk to a model a CPU runs in seconds
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=256",
        "train.device=cpu", "train.precision=fp32"]


def build_mtl(config_path: str, device: torch.device, dtype: torch.dtype, overrides: list[str]) -> LoadedModel:
    cfg = load_config(config_path, ["train.compile=false", "train.cuda_graphs=false", *overrides])
    tokenizer = registry("tokenizer").get(cfg.data.tokenizer).build(cfg.data.tokenizer_model)
    cfg = cfg.resolve(world_size=1, tokenizer_vocab_size=tokenizer.vocab_size)
    family, backend = registry("model family").get(cfg.model.family), registry("backend").get(cfg.model.backend)
    model = build_model(family, cfg, Topology.single(), backend).to(device=device, dtype=dtype).eval()
    return LoadedModel(model, tokenizer, cfg, Topology.single(), None)


def build_hf(loaded: LoadedModel, folder: Path, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from mtl.models.convert_hf import HFConverter

    entries = parameter_entries(loaded.model, loaded.topology)
    state = {e.global_name: e.view(e.param.data).float().cpu() for e in entries}
    HFConverter().from_mtl(loaded.config.model, state, folder, architecture="llama")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_mtl(engine: Engine, prompts: list[list[int]], output_len: int) -> dict:
    # text included, as a server streams it: detokenizing is incremental, a few ids per token
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    sync(engine.device)
    start = time.perf_counter()
    first, last = {}, {}
    ids = [engine.add(p, params) for p in prompts]
    while engine.has_work:
        outputs = engine.step()
        sync(engine.device)
        now = time.perf_counter()
        for out in outputs:
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
    wall = time.perf_counter() - start
    ttft = sum(first[i] - start for i in ids) / len(ids)
    tpot = sum((last[i] - first[i]) / (output_len - 1) for i in ids) / len(ids)
    return {"tokens_per_s": len(prompts) * output_len / wall, "ttft_ms": 1e3 * ttft, "tpot_ms": 1e3 * tpot}


@torch.no_grad()
def run_hf(model, prompts: list[list[int]], output_len: int, device: torch.device) -> dict:
    ids = torch.tensor(prompts, device=device)
    options = dict(do_sample=False, cache_implementation="static", pad_token_id=0)

    def timed(new_tokens: int) -> tuple[float, int]:
        sync(device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **options)
        sync(device)
        return time.perf_counter() - start, out.shape[1] - ids.shape[1]

    timed(output_len)  # warm-up: compiles the static-cache decode where transformers does
    first, _ = timed(1)
    whole, produced = timed(output_len)
    return {"tokens_per_s": len(prompts) * produced / whole, "ttft_ms": 1e3 * first,
            "tpot_ms": 1e3 * (whole - first) / max(produced - 1, 1)}


@torch.no_grad()
def agreement(engine: Engine, hf, vocab: int, device: torch.device, length: int = 16) -> str:
    """How many of 16 greedy tokens the two produce alike from one prompt: the same weights give
    the same tokens up to bf16 rounding near ties."""
    prompt = torch.randint(0, vocab, (32,), generator=torch.Generator().manual_seed(2)).tolist()
    [outs] = engine.generate([prompt], [SamplingParams(max_tokens=length, temperature=0, ignore_eos=True,
                                                       detokenize=False)])
    ours = [t for out in outs for t in out.new_ids]
    theirs = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=length, min_new_tokens=length,
                         do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), length)
    return f"{same}/{length} leading tokens"


def attempt(what: str, fn, *args):
    """fn(*args), or None after printing why it failed: a peer's failure is a line of the report,
    not the end of the run."""
    try:
        return fn(*args)
    except Exception as exc:
        print(f"{what}: failed: {str(exc).splitlines()[-1] if str(exc) else repr(exc)}", flush=True)
        return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(HERE / "llama_reference.toml"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-step-tokens", type=int, default=2048)
    parser.add_argument("--kv-memory", default=None,
                        help="default: 0.6 of free GPU memory (HF needs the rest), 64MiB on CPU")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="mtl's decode steps compiled with CUDA graphs (default: on for CUDA)")
    parser.add_argument("--check-only", action="store_true",
                        help="smoke test: a 2-layer model on the CPU, concurrency 1 and 4, 16 + 8 tokens")
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = parser.parse_args(argv)
    if args.check_only:
        args.device, args.concurrency, args.prompt_len, args.output_len = "cpu", [1, 4], 16, 8
        torch.set_num_threads(1)  # a tiny model: threads would only fight over shared cores
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    loaded = build_mtl(args.config, device, dtype, TINY if args.check_only else [])
    vocab = loaded.config.model.vocab_size
    loaded.tokenizer = synthetic_bpe(vocab)  # decodes every id the model may sample (see synthetic_bpe.py)
    kv_memory = args.kv_memory or ("0.6" if device.type == "cuda" else "64MiB")
    def make_engine(compile: bool | None) -> Engine:
        return Engine(loaded, EngineConfig(max_batch=max(args.concurrency), max_step_tokens=args.max_step_tokens,
                                           kv_memory=kv_memory, max_waiting=max(args.concurrency), compile=compile),
                      device)

    engine = make_engine(args.compile)
    hf = None if args.skip_hf else attempt("hf-generate: building", build_hf, loaded,
                                            Path(tempfile.mkdtemp(prefix="bench_serve_hf_")), device, dtype)
    if hf is not None:
        agree = attempt("hf-generate: agreement", agreement, engine, hf, vocab, device)
        print(json.dumps({"greedy_tokens_agree": agree}), flush=True)
    rows = []
    for concurrency in args.concurrency:
        prompts = torch.randint(0, vocab, (concurrency, args.prompt_len), generator=torch.Generator().manual_seed(1))
        prompts = prompts.tolist()
        # warm-up: compiles and captures every bucket of the timed run
        if attempt("mtl-serve: warm-up", run_mtl, engine, prompts, args.output_len) is None:
            if not engine.runner.decode.compiled:
                raise SystemExit("mtl-serve failed eagerly; see above")
            print("mtl-serve: going on with eager decode steps (as --no-compile)", flush=True)
            engine = None
            torch._dynamo.reset()  # the compiled step's references to the old pool go with it
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the new pool is sized from the memory the driver sees free
            engine = make_engine(False)
            run_mtl(engine, prompts, args.output_len)
        system = "mtl-serve" if engine.runner.decode.compiled else "mtl-serve (eager)"
        rows.append({"system": system, "concurrency": concurrency, **run_mtl(engine, prompts, args.output_len)})
        print(json.dumps(rows[-1]), flush=True)
        timed = attempt(f"hf-generate at {concurrency}", run_hf, hf, prompts, args.output_len, device) if hf else None
        if timed is not None:
            rows.append({"system": "hf-generate", "concurrency": concurrency, **timed})
            print(json.dumps(rows[-1]), flush=True)
    table = ["| system | concurrent requests | output tokens/s | TTFT ms | ms per output token |",
             "|---|---|---|---|---|"]
    table += [f"| {r['system']} | {r['concurrency']} | {r['tokens_per_s']:.0f} | {r['ttft_ms']:.1f} "
              f"| {r['tpot_ms']:.2f} |" for r in rows]
    compiled = engine.runner.decode.compiled
    text = (f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, {args.config}"
            f"{' (tiny, --check-only)' if args.check_only else ''}, prompt {args.prompt_len}, output "
            f"{args.output_len} tokens, mtl decode {'compiled' if compiled else 'eager'}\n\n" + "\n".join(table) + "\n")
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
