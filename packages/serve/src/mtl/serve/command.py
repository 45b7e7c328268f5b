"""``mtl serve CHECKPOINT``: the engine and its OpenAI-compatible server.

Under ``torchrun --nproc-per-node N mtl serve CHECKPOINT --tp N`` every rank loads its
tensor-parallel part; rank 0 serves HTTP and runs the engine, the other ranks follow its steps
(``runner.py``). SIGTERM (or Ctrl-C) stops taking requests, lets the running ones finish for
``--shutdown-timeout`` seconds, aborts the rest and exits 0."""

from __future__ import annotations

import contextlib
import os
import signal
from functools import partial
from pathlib import Path

import click

from mtl.core.errors import ConfigError
from mtl.serve.build import CPU_KV_MEMORY, GPU_KV_MEMORY, build_engine, distributed_device, init_tp


@click.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on (0.0.0.0: all).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--tp", default=1, show_default=True, type=click.IntRange(min=1),
              help="Tensor-parallel size; >1 runs under torchrun with that many processes.")
@click.option("--max-batch", default=64, show_default=True, type=click.IntRange(min=1),
              help="Requests decoding together in one step.")
@click.option("--max-step-tokens", default=512, show_default=True, type=click.IntRange(min=1),
              help="Tokens one step computes (decodes first, then chunks of prompts).")
@click.option("--max-waiting", default=256, show_default=True, type=click.IntRange(min=1),
              help="Queued requests beyond which new ones get 429.")
@click.option("--compile/--no-compile", "compile_decode", default=None,
              help="Decode steps through torch.compile at bucketed batch sizes, replayed as CUDA graphs on a GPU "
                   "(default: on for CUDA with --tp 1; the first step of each bucket compiles).")
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(min=1), help="Tokens per KV block.")
@click.option("--kv-memory", default=None, metavar="FRACTION|SIZE",
              help=f"KV-cache pool: a fraction of free GPU memory (default {GPU_KV_MEMORY}) or a size such as "
                   f"256MiB (default on CPU {CPU_KV_MEMORY}).")
@click.option("--api-key", envvar="MTL_API_KEY", default=None,
              help="Answer 401 to /v1 requests without 'Authorization: Bearer KEY' (env MTL_API_KEY).")
@click.option("--served-model-name", default=None, help="The model name clients send (default: the directory's name).")
@click.option("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when available).")
@click.option("--dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              help="Weights and KV cache; auto: bfloat16 on CUDA, the stored precision on CPU.")
@click.option("--tokenizer", default=None, metavar="NAME", help="Tokenizer instead of the checkpoint's.")
@click.option("--tokenizer-model", default=None, type=click.Path(), metavar="PATH")
@click.option("--iteration", default=None, type=click.IntRange(min=0),
              help="A committed iteration other than the latest.")
@click.option("--shutdown-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds running requests get to finish after SIGTERM before they are aborted.")
def serve(checkpoint, host, port, tp, max_batch, max_step_tokens, max_waiting, compile_decode, block_size, kv_memory,
          api_key, served_model_name, device, dtype, tokenizer, tokenizer_model, iteration, shutdown_timeout):
    """Serve CHECKPOINT with an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics), continuous batching over a paged KV cache."""
    if api_key is not None and not api_key.strip():
        raise ConfigError("--api-key (or MTL_API_KEY) is empty; give a key or leave it unset")
    rank = init_tp(tp)
    dev = distributed_device(device, tp)
    engine = build_engine(checkpoint, device=dev, tp=tp, dtype=dtype, kv_memory=kv_memory, max_batch=max_batch,
                          max_step_tokens=max_step_tokens, max_waiting=max_waiting, block_size=block_size,
                          compile=compile_decode, tokenizer=tokenizer, tokenizer_model=tokenizer_model,
                          iteration=iteration)
    if rank != 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 ends the run and tells this rank so
        engine.runner.follow()
        return
    _serve_http(engine, host, port, api_key, served_model_name or Path(checkpoint).resolve().name, shutdown_timeout)


def _serve_http(engine, host: str, port: int, api_key: str | None, model_name: str, shutdown_timeout: float) -> None:
    import uvicorn

    from mtl.serve.chat import ChatTemplate
    from mtl.serve.engine_loop import EngineLoop
    from mtl.serve.metrics import ServeMetrics
    from mtl.serve.server import create_app

    template = ChatTemplate.from_tokenizer_files(engine.loaded.tokenizer_path)
    warm_up = None
    if engine.runner.decode.compiled:
        click.echo("mtl serve: compiling the decode step for every batch bucket (once, before serving; "
                   "/health answers 503 until it is done)", err=True)
        warm_up = partial(engine.runner.decode.warm_up, engine.config.max_batch)
    app = create_app(EngineLoop(engine, ServeMetrics(), warm_up), model_name=model_name, api_key=api_key,
                     chat_template=template)
    click.echo(f"mtl serve: {model_name} on http://{host}:{port} ({engine.blocks.num_blocks} KV blocks of "
               f"{engine.config.block_size} tokens, context {engine.context_length})", err=True)
    config = uvicorn.Config(app, host=host, port=port, log_level=os.environ.get("MTL_SERVE_LOG_LEVEL", "warning"),
                            timeout_graceful_shutdown=shutdown_timeout)
    # uvicorn catches SIGTERM for its graceful shutdown and, once done, raises it again for the
    # handler it found: make that one a no-op so the run ends with status 0, not 143
    signal.signal(signal.SIGTERM, lambda *_: None)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: uvicorn drained the requests, then raised SIGINT again
        uvicorn.Server(config).run()
    click.echo("mtl serve: stopped", err=True)
