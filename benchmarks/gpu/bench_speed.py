"""mtl beside a plain-PyTorch peer of the same model, in one call, in one table (issue 11).

    bash scripts/gpu/setup.sh
    python3 benchmarks/gpu/bench_speed.py --out $OUT/speed.md [--profile mtl-compile]

Rows, each in a fresh Python process (its own peak memory, its own empty torch.compile
cache) with a time limit; a row that fails prints ``failed: <its error's last line>`` and the
table goes on:

- ``matmul``: a bf16 8192³ matmul, the MFU peak of this device (TFLOP/s), measured first;
- ``peer-eager`` / ``peer-compile``: ``peer_model.py`` (Llama-style, SDPA, F.rms_norm, RoPE,
  SwiGLU, fused AdamW, bf16 autocast over fp32 parameters, grad accumulation), eager and with
  ``torch.compile`` on each block; ``peer-compile-fa4`` (not a default row) the compiled peer with
  ``bench.sdpa=fa4`` (below);
- ``mtl-<variant>``: ``mtl.train.loop.train`` on the config with the variant's ``--set``
  overrides (``--variants eager compile`` by default: ``train.compile=false`` / ``true``;
  custom: ``NAME:KEY=VALUE;KEY=VALUE``; the pseudo-key ``bench.fused_loss=false`` runs
  mtl's LM head and loss unfused, as presets ``eager-unfused`` / ``compile-unfused`` do;
  ``bench.wgrad_fusion=false`` adds each micro-batch's bf16 weight gradient into ``main_grad``
  in the DataParallel hook instead of in the GEMM, as preset ``compile-nowgradfusion`` does;
  ``bench.inductor.NAME=VALUE`` sets ``torch._inductor.config.NAME`` (a Python literal), e.g.
  ``bench.inductor.coordinate_descent_tuning=True``; ``bench.compile_mode=MODE`` compiles the
  regions with ``torch.compile(mode=MODE)``, e.g. ``reduce-overhead`` for CUDA graphs;
  ``bench.env.NAME=VALUE`` sets an environment variable in the row's process, e.g.
  ``bench.env.MTL_FP8_WEIGHT_CACHE=0``; ``bench.te_wgrad=all|leaves|none`` picks which TE
  modules accumulate their weight gradients into ``main_grad`` (mtl-te: all); ``bench.sdpa=flash2|fa4``
  picks SDPA's kernel (``_sdpa_kernel``); ``bench.swiglu=autograd`` runs the dense MLP's SwiGLU backward as
  autograd writes it (before ``mtl.models.swiglu``);
  ``bench.te_fusion=all|qkv|none`` and ``bench.te_norm=te|local`` pick which leaves the te
  backend fuses and whose norm it builds (``_te_layout``)).

Every system runs the same resolved config (``--config``, default the reference model
``llama_reference.toml``, plus ``--set``): same shapes, micro-batch, global batch. s/iter is
the median over the iterations after the first ``--skip``; TFLOP/s/GPU is Megatron's formula
(``mtl.train.metrics.iteration_flops`` of that config: the family's count) over s/iter; MFU against the
``matmul`` row; peak memory is ``torch.cuda.max_memory_allocated`` of the row's process.

``--profile SYSTEM...`` adds a torch.profiler breakdown of two steps of each system named (top-80
kernels by CUDA time and time per category) to ``--profile-out``. ``--tiny`` (with
``--device cpu``) is a minute-long run of a small model for checking the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "llama_reference.toml"
PRESET_VARIANTS = {
    "eager": ["train.compile=false"],
    "compile": ["train.compile=true"],
    # the LM head and loss unfused (logits, then vocab_parallel_cross_entropy), to measure the fusion
    "eager-unfused": ["train.compile=false", "bench.fused_loss=false"],
    "compile-unfused": ["train.compile=true", "bench.fused_loss=false"],
    "compile-nowgradfusion": ["train.compile=true", "bench.wgrad_fusion=false"],
}
PEER_SYSTEMS = ("peer-eager", "peer-compile", "peer-compile-fa4")
# A small model for a CPU check of the script: every code path, a minute in all.
TINY = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=64",
    "model.vocab_size=257", "train.micro_batch_size=2", "train.global_batch_size=4",
]


# ---- the parent: one subprocess per row --------------------------------------------------------
def parse_variant(spec: str) -> tuple[str, list[str]]:
    if ":" in spec:
        name, sets = spec.split(":", 1)
        return name, [s.strip() for s in sets.split(";") if s.strip()]
    if spec not in PRESET_VARIANTS:
        raise SystemExit(f"--variants {spec!r}: not a preset ({', '.join(PRESET_VARIANTS)}); "
                         "write NAME:KEY=VALUE;KEY=VALUE for your own")
    return spec, PRESET_VARIANTS[spec]


def run_row(spec: dict, timeout: float, log_dir: Path) -> dict:
    """Run one row in a fresh process; its result dict, or {"error": last line}."""
    name = spec["name"]
    with tempfile.TemporaryDirectory(prefix=f"bench_{name}_") as tmp:
        result_file = Path(tmp) / "result.json"
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"),
                   TRITON_CACHE_DIR=str(Path(tmp) / "triton"), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec),
               "--worker-out", str(result_file)]
        log_path = log_dir / f"{name}.log"
        began = time.monotonic()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the row and its compile workers
                proc.wait()
                return {"error": f"timed out after {timeout:.0f} s (log: {log_path})"}
        wall = time.monotonic() - began
        if rc != 0 or not result_file.exists():
            lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
            return {"error": f"{lines[-1] if lines else f'exit code {rc}'} (exit {rc}, log: {log_path})"}
        result = json.loads(result_file.read_text())
        result["wall_s"] = wall
        return result


def fmt_row(name: str, r: dict, peak: float | None) -> str:
    if "error" in r:
        return f"| {name} | failed: {r['error'].replace('|', '/')} | | | | | |"
    s = r["s_per_iter"]
    tflops = r["flops_per_iter"] / s / r.get("world_size", 1) / 1e12
    mfu = f"{100 * tflops / peak:.1f}%" if peak else "—"
    mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "—"
    tf = f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.3g}"
    return f"| {name} | {s:.3f} | {r['tokens_per_iter'] / s:,.0f} | {tf} | {mfu} | {mem} | {r['n_timed']} |"


def write_table(path: Path | None, header: list[str], rows: list[str], notes: list[str]) -> str:
    text = "\n".join([*header, "", "| system | s/iter | tokens/s | TFLOP/s/GPU | MFU | peak mem GiB | timed iters |",
                      "|---|---|---|---|---|---|---|", *rows, "", *notes]).rstrip() + "\n"
    if path is not None:
        path.write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="mtl TOML config (default: the reference model)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override for every system (repeatable)")
    parser.add_argument("--variants", nargs="+", default=["eager", "compile"],
                        help="mtl rows: presets eager/compile, or NAME:KEY=VALUE;KEY=VALUE")
    parser.add_argument("--systems", nargs="+", default=None,
                        help="rows to run (default: peer-eager peer-compile and every mtl-<variant>)")
    parser.add_argument("--iters", type=int, default=10, help="iterations per system")
    parser.add_argument("--skip", type=int, default=3, help="warm-up iterations left out of the median")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: the config's train.device)")
    parser.add_argument("--tiny", action="store_true", help="a small model, for checking the script (with --device cpu)")
    parser.add_argument("--matmul-size", type=int, default=None, help="n of the n³ bf16 matmul (default 8192; --tiny 512)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="use this MFU peak, skip the matmul row")
    parser.add_argument("--row-timeout", type=float, default=300.0, help="seconds per row")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole call: a row gets at most what is left, and rows that "
                             "would start after it are listed as skipped (e.g. 520 inside a 600 s device call)")
    parser.add_argument("--out", default=None, help="write the markdown table here (rewritten after every row)")
    parser.add_argument("--log-dir", default=None, help="per-row logs (default: next to --out, else a temp dir)")
    parser.add_argument("--profile", nargs="+", default=[], metavar="SYSTEM",
                        help="also profile 2 steps of these systems (peer-eager, peer-compile, mtl-<variant>)")
    parser.add_argument("--profile-out", default=None, help="markdown file of the profile (default: <out>.profile.md)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker), Path(args.worker_out))
        return

    sets = [*(TINY if args.tiny else []), *args.sets]
    if args.device:
        sets.append(f"train.device='{args.device}'")
    variants = dict(parse_variant(v) for v in args.variants)
    systems = args.systems or ["peer-eager", "peer-compile", *(f"mtl-{v}" for v in variants)]
    for s in systems + args.profile:
        if s not in PEER_SYSTEMS and not (s.startswith("mtl-") and s[4:] in variants):
            raise SystemExit(f"unknown system {s!r}: have {', '.join([*PEER_SYSTEMS, *(f'mtl-{v}' for v in variants)])}")
    iters = max(args.iters, args.skip + 1)
    out = Path(args.out) if args.out else None
    log_dir = Path(args.log_dir) if args.log_dir else (
        out.with_suffix(".logs") if out else Path(tempfile.mkdtemp(prefix="bench_speed_logs_")))
    log_dir.mkdir(parents=True, exist_ok=True)
    matmul_n = args.matmul_size or (512 if args.tiny else 8192)
    started = time.monotonic()

    def limit() -> float:
        """This row's time limit: the per-row one, or what the budget has left (<= 0: skip)."""
        if args.budget is None:
            return args.row_timeout
        return min(args.row_timeout, args.budget - (time.monotonic() - started))

    def spec_for(system: str, **extra) -> dict:
        if system.startswith("mtl-"):
            spec = dict(name=system, kind="mtl", config=args.config, sets=[*sets, *variants[system[4:]]])
        else:
            spec = dict(name=system, kind="peer", compile=system.startswith("peer-compile"), config=args.config,
                        sets=[*sets, *(["bench.sdpa=fa4"] if system.endswith("-fa4") else [])])
        return {**spec, "iters": iters, "skip": args.skip, **extra}

    header = [f"# Training speed: mtl and a plain-PyTorch peer ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
              "", f"Command: `python3 {' '.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}`",
              f"Config: `{args.config}`" + (f" with `--set {' '.join(sets)}`" if sets else ""),
              f"Variants: " + "; ".join(f"mtl-{k} = `{' '.join(v) or '(none)'}`" for k, v in variants.items())]
    notes: list[str] = []
    done: dict[str, str] = {}  # system -> its table row; the table lists them in ``systems`` order

    def table_rows() -> list[str]:
        return [done[name] for name in systems if name in done]

    peak = args.peak_tflops
    if peak is None:
        m = run_row(dict(name="matmul", kind="matmul", n=matmul_n, device=args.device, config=args.config,
                         sets=sets), limit(), log_dir)
        if "error" in m:
            notes.append(f"- matmul peak: failed: {m['error']}")
        else:
            peak = m["tflops"]
            header.append(f"Device: {m['device']}; torch {m['torch']}"
                          + (f", CUDA {m['cuda']}" if m.get("cuda") else "") + f"; Python {platform.python_version()}")
            header.append(f"MFU peak: bf16 {matmul_n}³ matmul measured in this call: {peak:.4g} TFLOP/s")
    else:
        header.append(f"MFU peak: given, {peak:.4g} TFLOP/s")
    write_table(out, header, table_rows(), notes)
    flops_noted = False
    # Run the pair the acceptance compares first (compiled peer, then mtl), the eager peer last,
    # so that a --budget that runs out costs the least useful row.
    order = sorted(systems, key=lambda n: {"peer-compile": 0, "peer-eager": 2}.get(n, 1))
    for name in order:
        if limit() < 10:
            done[name] = f"| {name} | skipped: --budget {args.budget:.0f} s spent | | | | | |"
            write_table(out, header, table_rows(), notes)
            continue
        r = run_row(spec_for(name), limit(), log_dir)
        done[name] = fmt_row(name, r, peak)
        if "error" not in r and not flops_noted:
            header.append(f"FLOPs per iteration (Megatron's formula, mtl.models.gpt.flops): {r['flops_per_iter'] / 1e12:.4g} TFLOP; "
                          f"{r['tokens_per_iter']:,} tokens per iteration; s/iter: median of iterations "
                          f"{args.skip + 1}-{iters}")
            flops_noted = True
        if "error" not in r and r.get("note"):
            notes.append(f"- {name}: {r['note']}")
        print(f"{name}: " + (f"failed: {r['error']}" if "error" in r else f"{r['s_per_iter']:.3f} s/iter "
                             f"(iters {', '.join(f'{x:.3f}' for x in r['iter_s'])}), wall {r['wall_s']:.0f} s"),
              flush=True)
        write_table(out, header, table_rows(), notes)
    for system in args.profile:
        profile_out = Path(args.profile_out or (out.with_suffix(".profile.md") if out else log_dir / "profile.md"))
        if len(args.profile) > 1:  # one file per profiled system
            profile_out = profile_out.with_name(f"{profile_out.stem}.{system}{profile_out.suffix}")
        if limit() < 10:
            r = {"error": f"skipped: --budget {args.budget:.0f} s spent"}
        else:
            r = run_row(spec_for(system, profile_out=str(profile_out), name=f"profile-{system}"), limit(), log_dir)
        notes.append(f"- profile of {system}: " + (
            str(profile_out) if "error" not in r else r["error"] if r["error"].startswith("skipped") else f"failed: {r['error']}"))
    print(write_table(out, header, table_rows(), notes))


# ---- the workers: one system each, in a fresh process --------------------------------------------
def _resolved(config_path: str, sets: list[str]):
    from mtl.core.config_io import load_config
    from mtl.train.setup import build_tokenizer

    cfg = load_config(config_path, sets)
    return cfg.resolve(1, build_tokenizer(cfg).vocab_size)


def _timed(step, iters: int) -> tuple[list[float], list]:
    import torch

    times, outputs = [], []
    for _ in range(iters):
        began = time.perf_counter()
        outputs.append(step())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
        print(f"iteration {len(times)}: {times[-1]:.3f} s", flush=True)
    return times, outputs


def _peak_mem_gib():
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    return None


def _summary(cfg, times: list[float], skip: int) -> dict:
    from mtl.train.metrics import iteration_flops

    steady = times[skip:] or times
    return dict(s_per_iter=statistics.median(steady), iter_s=times, n_timed=len(steady),
                flops_per_iter=iteration_flops(cfg), world_size=cfg.parallel.world_size,
                tokens_per_iter=cfg.train.global_batch_size * cfg.model.seq_length, peak_mem_gib=_peak_mem_gib())


def worker_matmul(spec: dict) -> dict:
    import torch

    device = spec.get("device") or _resolved(spec["config"], spec["sets"]).train.device
    n = spec["n"]
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(5):
        a @ b
    sync()
    reps = 100 if device.startswith("cuda") else 3
    began = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    seconds = (time.perf_counter() - began) / reps
    name = torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return dict(tflops=2 * n**3 / seconds / 1e12, device=name, torch=torch.__version__, cuda=torch.version.cuda)


def worker_peer(spec: dict) -> dict:
    import torch

    from peer_model import PeerTrainer

    cfg = _resolved(spec["config"], _bench_keys(spec["sets"]))
    device = torch.device(cfg.train.device)
    trainer = PeerTrainer(cfg, device, compile_blocks=spec["compile"])
    if spec.get("profile_out"):
        return _profile(trainer.step, spec, f"{spec['name']} (peer_model.py)")
    times, losses = _timed(trainer.step, spec["iters"])
    n_params = sum(p.numel() for p in trainer.model.parameters())
    return dict(_summary(cfg, times, spec["skip"]),
                note=f"{n_params / 1e6:,.1f} M parameters; loss {losses[0]:.3f} -> {losses[-1]:.3f}")


def _bench_keys(sets: list[str]) -> list[str]:
    """Apply and drop the ``bench.*`` pseudo-keys (not mtl config keys) of a variant."""
    rest = []
    for item in sets:
        key, _, value = item.partition("=")
        if key.strip() == "bench.fused_loss":
            if value.strip().lower() in ("false", "0", "no"):
                import mtl.models.gpt.model as gpt_model

                gpt_model.supports_fused_cross_entropy = lambda layer: False  # the unfused head + loss
        elif key.strip() == "bench.wgrad_fusion":
            if value.strip().lower() in ("false", "0", "no"):
                import mtl.train.setup as setup

                setup.enable_wgrad_fusion = lambda module: 0  # bf16 grads added into main_grad by the hook
        elif key.strip() == "bench.te_wgrad":
            # which TE modules accumulate into main_grad: all, leaves (only LayerNormLinear /
            # LayerNormMLP; a plain te.Linear then stays in the compiled graph: mtl-te's bf16 default), none
            choice = value.strip().strip("'\"")
            if choice not in ("all", "leaves", "none"):
                raise SystemExit(f"bench.te_wgrad = {choice!r}: one of all, leaves, none")
            import mtl.te.modules as te_modules

            def claims_nothing(self):
                return []

            plain = (te_modules.TEColumnParallelLinear, te_modules.TERowParallelLinear)
            every = (*plain, te_modules.TENormColumnParallelLinear, te_modules.TENormMLP)
            for cls in {"all": (), "leaves": plain, "none": every}[choice]:
                cls.main_grad_accumulation_params = claims_nothing
            if choice == "all":  # the plain linears too, FP8 or not
                for cls in plain:
                    cls.main_grad_accumulation_params = te_modules._MainGradAccumulation.main_grad_accumulation_params
        elif key.strip() in ("bench.te_fusion", "bench.te_norm"):
            _te_layout(key.strip(), value.strip().strip("'\""))
        elif key.strip().startswith("bench.inductor."):
            import ast

            import torch._inductor.config as inductor_config

            name = key.strip()[len("bench.inductor."):]
            if not hasattr(inductor_config, name):
                raise SystemExit(f"{key!r}: torch._inductor.config has no {name!r}")
            setattr(inductor_config, name, ast.literal_eval(value.strip()))
        elif key.strip().startswith("bench.env."):  # e.g. bench.env.MTL_FP8_WEIGHT_CACHE=0
            os.environ[key.strip()[len("bench.env."):]] = value.strip().strip("'\"")
        elif key.strip() == "bench.compile_mode":
            import torch

            # mtl's compile_regions, each region compiled with this torch.compile mode (torch.compile
            # takes a mode or options, not both: mtl's inductor options are dropped)
            mode, plain_compile = value.strip().strip("'\""), torch.nn.Module.compile

            def compile_in_mode(module, *args, options=None, **kwargs):
                return plain_compile(module, *args, mode=mode, **kwargs)

            torch.nn.Module.compile = compile_in_mode
        elif key.strip() == "bench.swiglu":
            # autograd: SwiGLU as it was before mtl.models.swiglu (autograd's backward through
            # the chunk, which inductor writes as one pointwise concatenation)
            if value.strip().strip("'\"") != "autograd":
                raise SystemExit(f"bench.swiglu = {value!r}: only autograd")
            import torch

            import mtl.models.gpt.mlp as mlp_module

            def autograd_swiglu(fc1_out):
                gate, up = fc1_out.chunk(2, dim=-1)
                return torch.nn.functional.silu(gate) * up

            mlp_module.swiglu = autograd_swiglu
        elif key.strip() == "bench.sdpa":
            _sdpa_kernel(value.strip().strip("'\""))
        elif key.strip().startswith("bench."):
            raise SystemExit(f"unknown bench key {key!r} (have bench.fused_loss, bench.wgrad_fusion, bench.te_wgrad, "
                             "bench.te_fusion, bench.te_norm, bench.sdpa, bench.swiglu, "
                             "bench.inductor.<torch._inductor.config name>, bench.compile_mode, bench.env.<NAME>)")
        else:
            rest.append(item)
    return rest


def _sdpa_kernel(choice: str) -> None:
    """``bench.sdpa``: which kernel ``F.scaled_dot_product_attention`` runs on the GPU instead of
    SDPA's own choice (cuDNN on Hopper): ``flash2``, PyTorch's built-in FlashAttention-2, or ``fa4``,
    FlashAttention-4 as ``train.attention_kernel = 'fa4'`` sets it up (``fa4_install.sh``), for the
    peer, which has no config (an mtl row sets the key itself)."""
    import torch

    if choice not in ("flash2", "fa4"):
        raise SystemExit(f"bench.sdpa = {choice!r}: one of flash2, fa4")
    if choice == "fa4":  # what train.attention_kernel = 'fa4' does (the peer has no such key)
        from mtl.parallel.backend_local.fa4 import activate_fa4

        activate_fa4(torch.device("cuda"))
    else:  # SDPA's priority on Hopper puts cuDNN first; leave it flash
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)


def _te_layout(key: str, choice: str) -> None:
    """Which leaves the te backend builds, to measure TE's fusions against inductor's:
    ``bench.te_fusion=all`` (mtl-te: LayerNormLinear for QKV, LayerNormMLP for the MLP),
    ``qkv`` (LayerNormLinear for QKV and fc1, mtl's SwiGLU between fc1 and a ``te.Linear`` fc2,
    as Megatron-Core's TE layer spec), ``none`` (the norm, then ``te.Linear``s: every norm and
    activation outside TE); ``bench.te_norm=local`` builds the separate norms with the local
    backend's factory (compiled by inductor) instead of ``te.RMSNorm``."""
    import dataclasses

    import mtl.core.plugins as plugins
    import mtl.te.plugin as te_plugin

    te = te_plugin.TE_BACKEND
    if key == "bench.te_fusion":
        layouts = {"all": te,
                   "qkv": dataclasses.replace(te, norm_mlp=None),
                   "none": dataclasses.replace(te, norm_mlp=None, norm_column_linear=None)}
        if choice not in layouts:
            raise SystemExit(f"bench.te_fusion = {choice!r}: one of {', '.join(layouts)}")
        te = layouts[choice]
    elif choice == "local":
        from mtl.parallel.backend_local import factories as local_factories

        te = dataclasses.replace(te, norm=local_factories.norm)
    elif choice != "te":
        raise SystemExit(f"bench.te_norm = {choice!r}: te or local")
    te_plugin.TE_BACKEND = te  # the hook returns the module's record when the registry is built
    plugins._registries.clear()


def worker_mtl(spec: dict) -> dict:
    from mtl.core.config_io import load_config
    from mtl.train.loop import train

    spec = dict(spec, sets=_bench_keys(spec["sets"]))
    if spec.get("profile_out"):
        from profile_step import mtl_step

        step, _ = mtl_step(spec["config"], spec["sets"])
        return _profile(step, spec, f"{spec['name']} (mtl.train.step.queue_train_step, as the loop)")
    with tempfile.TemporaryDirectory(prefix="bench_mtl_") as logs:
        cfg = load_config(spec["config"], [
            *spec["sets"], f"train.iters={spec['iters']}", f"logging.dir='{logs}'", "logging.interval=1",
            "logging.callbacks=['jsonl']", "logging.tensorboard=false", "train.eval_interval=0",
        ])
        result = train(cfg, progress=False)
        rows = [json.loads(line) for line in (Path(logs) / "metrics.jsonl").read_text().splitlines()
                if '"iter_s"' in line]
    times = [row["iter_s"] for row in rows]
    if len(times) != spec["iters"]:
        raise RuntimeError(f"mtl logged {len(times)} iterations of {spec['iters']}")
    n_params = sum(p.numel() for chunk in result.run.chunks for p in chunk.parameters())
    losses = list(result.losses.values())
    return dict(_summary(result.config, times, spec["skip"]),
                note=f"{n_params / 1e6:,.1f} M parameters; loss {losses[0]:.3f} -> {losses[-1]:.3f}")


def _profile(step, spec: dict, title: str) -> dict:
    from profile_step import kernel_table, profile_steps

    prof = profile_steps(step, warmup=2, steps=2)
    Path(spec["profile_out"]).write_text(kernel_table(prof, steps=2, rows=80, title=title))
    return dict(profile=spec["profile_out"])


def worker(spec: dict, out: Path) -> None:
    sys.path.insert(0, str(HERE))  # peer_model, profile_step
    kind = spec["kind"]
    result = {"matmul": worker_matmul, "peer": worker_peer, "mtl": worker_mtl}[kind](spec)
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
