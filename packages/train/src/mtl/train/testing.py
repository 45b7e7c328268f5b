"""Test support: run a few training steps of a tiny GPT under a given layout and return
what the equivalence tests compare, the losses and every parameter's gradient at full shape.

Used by this package's tests on CPU (gloo) and by the GPU checks (NCCL), so it lives in
the package rather than beside the tests."""

from __future__ import annotations

from typing import Callable

import torch

from mtl.core import plugins
from mtl.core.config_io import load_config
from mtl.core.hookspecs import hookimpl
from mtl.core.registrations import TrainCallback
from mtl.models.param_layout import gather_global_state
from mtl.train.loop import train

# The byte tokenizer's 257 tokens, as users run it: padded to 384 rows at tp=1 and 512 at
# tp=2, so the equivalence checks prove that the padding never changes the numbers.
TINY = [
    "model.num_layers=4", "model.hidden_size=32", "model.num_attention_heads=4",
    "model.num_query_groups=2", "model.seq_length=16", "data.dataset='mock'", "data.tokenizer='byte'",
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.iters=3", "train.lr=1e-3",
    "train.warmup_iters=0", "train.eval_interval=0", "train.clip_grad=1.0", "train.seed=7",
    "train.device='cpu'", "logging.callbacks=[]",
]


# The layouts the equivalence checks cover: name -> (world size, config overrides).
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pp=2", "parallel.pipeline_split='even'"]),  # 2 + 2 (by FLOPs, the default: 3 + 1)
    "pp2_vpp2": (2, ["parallel.pp=2", "parallel.vpp=2"]),
    # stages sized by FLOPs (the default, said here so that it stays tested if that changes): the
    # LM head (1.04 layers' work here) takes a layer off its stage, the 4 layers as 3 + 1
    "pp2_flops": (2, ["parallel.pp=2", "parallel.pipeline_split='flops'"]),
    "dp2": (2, []),
    "dp2_distopt": (2, ["parallel.distributed_optimizer=true"]),
    "cp2": (2, ["parallel.cp=2", "parallel.cp_comm_type='p2p'"]),  # the ring (compiled, the default is all_gather)
    "cp2_allgather": (2, ["parallel.cp=2", "parallel.cp_comm_type='all_gather'"]),
    "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    "tp2_dp2": (4, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    # the norms' gradients summed over TP after the reduce-scatter, on each rank's shard
    "tp2_dp2_distopt": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.distributed_optimizer=true"]),
    "dp2_pp2": (4, ["parallel.pp=2"]),
    "dp4_distopt": (4, ["parallel.distributed_optimizer=true"]),
}
# Sharded data parallelism (parallel.sharding, dp_replicate: packages/train/tests/test_sharding.py);
# ZeRO-2 and ZeRO-3 each with every other layout they touch.
SHARDED_LAYOUTS = {
    "dp2_zero2": (2, ["parallel.sharding='gradients'"]),
    "dp2_zero3": (2, ["parallel.sharding='parameters'"]),
    "dp4_zero3": (4, ["parallel.sharding='parameters'"]),
    "tp2_dp2_zero3": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.sharding='parameters'"]),
    "dp2_pp2_zero3": (4, ["parallel.pp=2", "parallel.sharding='parameters'"]),
    "dp4_hybrid_zero3": (4, ["parallel.sharding='parameters'", "parallel.dp_replicate=2"]),
}
# Layouts only GPUs run (tests/gpu/test_equivalence_nccl.py, the CUDA tests): async TP's fused
# ops are CUDA ops over NCCL symmetric memory.
GPU_LAYOUTS = {
    "tp2_sp_async_tp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.async_tp=true",
                            "train.compile=true"]),
}
# A 2-layer MoE (4 experts, top-2, dropless, aux and z-losses on) and its expert-parallel
# layouts (packages/train/tests/test_expert_parallel.py; tests/gpu/test_equivalence_nccl.py).
# lr_decay_iters: every run follows the 6-step schedule, so a 3-step run is its first half.
MOE_TINY = ["model.num_layers=2", "model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=16",
            "model.moe_aux_loss_coeff=0.01", "model.moe_z_loss_coeff=0.001", "model.bias=false",
            "train.lr_decay_iters=6"]
MOE_LAYOUTS = {
    "ep2": (2, ["parallel.ep=2"]),
    "ep2_tp2_sp": (4, ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "ep2_pp2": (4, ["parallel.ep=2", "parallel.pp=2"]),
}
# Eight processes (issue 40; tests/gpu/test_eight_processes.py: NCCL on an 8-GPU machine, gloo
# on the CPU by hand). TINY with 8 heads and 8 query groups, so that tp=8 splits them, and a global
# batch of 16, so that dp=8 takes one micro-batch of 2 per rank.
EIGHT_TINY = ["model.num_attention_heads=8", "model.num_query_groups=8", "train.global_batch_size=16"]
EIGHT_LAYOUTS = {
    "tp8": (8, ["parallel.tp=8", "parallel.sequence_parallel=true"]),
    "tp4_pp2": (8, ["parallel.tp=4", "parallel.sequence_parallel=true", "parallel.pp=2"]),
    "tp2_pp2_dp2": (8, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2"]),
    "dp8_zero1": (8, ["parallel.sharding='optimizer'"]),
    "dp8_zero2": (8, ["parallel.sharding='gradients'"]),
    "dp8_zero3": (8, ["parallel.sharding='parameters'"]),
    "dp8_hybrid_zero3": (8, ["parallel.sharding='parameters'", "parallel.dp_replicate=2"]),
    "cp2_tp2_dp2": (8, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
}
# MOE_TINY's 4 experts over 4 ranks, each expert held by 2 (expert data parallelism 2).
EIGHT_MOE_LAYOUTS = {"ep4_dp2": (8, ["parallel.ep=4", "train.global_batch_size=16"])}
# fp32: the layouts sum the same numbers in a different order, nothing more.
LOSS_RTOL = 1e-5
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4


def write_sized_wordpiece(directory, texts: list[str], vocab_size: int, roles: dict[str, str],
                          extra_specials: tuple[str, ...] = ()):
    """A lowercase WordPiece ``tokenizer.json`` for ``texts``, its vocabulary filled with unused
    pieces up to ``vocab_size`` (a real model's size: BERT's 30522, T5's 32128), and a
    ``tokenizer_config.json`` naming its special tokens (``roles``: e.g. {"mask_token": "[MASK]"})
    as a Hugging Face folder names them. ``extra_specials``: more special tokens (T5's sentinels).

    The vocabulary is built, not trained: the special tokens, every character seen (alone and
    as a ``##`` continuation) and the 400 most frequent words, ties in alphabetical order. The
    tokenizers library's trainer breaks ties in hash order, which differs from process to
    process, so every run of a test would see other token ids. Returns the tokenizer.json path."""
    import json
    from collections import Counter
    from pathlib import Path

    from tokenizers.implementations import BertWordPieceTokenizer

    directory = Path(directory)
    specials = list(dict.fromkeys([*roles.values(), *extra_specials]))
    splitter = BertWordPieceTokenizer(vocab={piece: i for i, piece in enumerate(specials)}, lowercase=True,
                                      unk_token=roles.get("unk_token", "[UNK]"))
    normalize, pre_tokenize = splitter.normalizer.normalize_str, splitter.pre_tokenizer.pre_tokenize_str
    words = Counter(word for text in texts for word, _ in pre_tokenize(normalize(text)))
    characters = sorted({ch for word in words for ch in word})
    frequent = [w for w, _ in sorted(words.items(), key=lambda item: (-item[1], item[0])) if len(w) > 1][:400]
    pieces = list(dict.fromkeys([*specials, *characters, *(f"##{ch}" for ch in characters), *frequent]))
    pieces += [f"[unused{i}]" for i in range(vocab_size - len(pieces))]
    tokenizer = BertWordPieceTokenizer(vocab={piece: i for i, piece in enumerate(pieces)}, lowercase=True,
                                       unk_token=roles.get("unk_token", "[UNK]"))
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "BertTokenizer", **roles}
    if extra_specials:
        config["additional_special_tokens"] = list(extra_specials)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"


def run_tiny(overrides: list[str], with_grads: bool = True) -> dict:
    cfg = load_config(None, [*TINY, *overrides])
    result = train(cfg, progress=False)
    run = result.run
    grads: dict[str, torch.Tensor] = {}
    if with_grads:
        if getattr(run.chunks[0], "use_distributed_optimizer", False):
            complete_sharded_grads(run.chunks)
        for chunk in run.chunks:  # TP-gathered; each pipeline stage reports its own layers
            gathered = gather_global_state(getattr(chunk, "module", chunk), run.topology, grads=True)
            grads.update({name: grad.cpu() for name, grad in gathered.items()})
    return {"losses": result.losses, "grads": grads, "last_stage": run.topology.is_last_stage}


def complete_sharded_grads(ddp_chunks: list) -> None:
    """Under the distributed optimizer a rank holds the reduced gradient only on its shard of
    each bucket (what its optimizer updates; under ZeRO-2/3 nothing else): put every rank's
    shards together over the bucket's shard group, one all-reduce per bucket, so that the
    gradients compared are the ones the optimizers used, whole on every rank as without it."""
    import torch.distributed as dist

    for chunk in ddp_chunks:
        for buf in chunk.buffers_by_dtype:
            group = buf.reduce_group
            for bucket in buf.buckets:
                lo, hi = bucket.shard_range(group.rank)
                whole = torch.zeros(bucket.numel, dtype=buf.dtype, device=buf.device)
                whole[lo:hi] = bucket.grad_shard
                if group.group is not None:
                    dist.all_reduce(whole, group=group.group)
                if not bucket.shards_grads:
                    bucket.grad_view.copy_(whole)
                    continue
                for slot in bucket.slots:  # ZeRO-2/3 keep no whole gradient: give each parameter one
                    grad = whole[slot.start - bucket.start: slot.end - bucket.start].view_as(slot.param)
                    if buf.uses_main_grad:
                        slot.param.main_grad = grad
                    else:
                        slot.param.grad = grad


def run_grouped(runs: dict[str, tuple[int, list[str]]], fn: Callable | None = None, args: tuple = (),
                backend: str = "gloo") -> dict[str, list]:
    """Named runs, ``name -> (world size, overrides)``, those of one world size one after another
    in one spawn, in the order given (starting processes and importing torch costs more than a
    tiny run). ``fn(list of overrides, *args)`` returns one result per run (default: ``run_tiny``
    each). Returns name -> one result per rank; a run that raises fails its whole spawn."""
    from mtl.parallel.testing import run_distributed

    by_world: dict[int, list[tuple[str, list[str]]]] = {}
    for name, (world, overrides) in runs.items():
        by_world.setdefault(world, []).append((name, overrides))
    results = {}
    for world, named in by_world.items():
        per_rank = run_distributed(fn or _run_each, world, args=([o for _, o in named], *args), backend=backend)
        results.update({name: [rank[i] for rank in per_rank] for i, (name, _) in enumerate(named)})
    return results


def run_layouts(layouts: list[str], extra: list[str] = (), backend: str = "gloo",
                model: list[str] = ()) -> dict[str, list[dict]]:
    """``run_grouped`` over layouts of ``LAYOUTS`` (or the other tables); ``model``: overrides
    every layout shares, ``extra``: overrides after the layout's."""
    table = {**LAYOUTS, **SHARDED_LAYOUTS, **GPU_LAYOUTS, **MOE_LAYOUTS, **EIGHT_LAYOUTS, **EIGHT_MOE_LAYOUTS}
    return run_grouped({name: (table[name][0], [*model, *table[name][1], *extra]) for name in layouts},
                       backend=backend)


def _run_each(runs: list[list[str]]) -> list[dict]:
    out = []
    for overrides in runs:
        try:
            out.append(run_tiny(overrides))
        except Exception as exc:  # name the run: the spawn reports this rank's traceback
            raise RuntimeError(f"run_tiny({overrides}) failed") from exc
    return out


def run_layout(layout: str, extra: list[str] = (), backend: str = "gloo") -> list[dict]:
    """Run one of ``LAYOUTS`` (or ``GPU_LAYOUTS``) on its world size."""
    from mtl.parallel.testing import run_distributed

    world, overrides = {**LAYOUTS, **SHARDED_LAYOUTS, **GPU_LAYOUTS}[layout]
    return run_distributed(run_tiny, world, args=([*overrides, *extra],), backend=backend)


def compare_with_reference(layout: str, results: list[dict], reference: dict) -> dict[str, float]:
    """Assert that a layout's losses and (where the run gathered them) full-shape gradients
    equal the one-process reference within the tolerances above; returns the largest
    differences seen. ``layout`` names the run in messages."""
    losses = next(r["losses"] for r in results if r["last_stage"])
    ref_losses = reference["losses"]
    assert list(losses) == list(ref_losses), f"{layout}: steps {list(losses)} vs {list(ref_losses)}"
    loss_diff = max(abs(losses[s] - ref_losses[s]) / max(1.0, abs(ref_losses[s])) for s in ref_losses)
    assert loss_diff < LOSS_RTOL, f"{layout}: losses {losses} vs one process {ref_losses}"
    grad_diff = 0.0
    if any(r.get("grads") for r in results):
        grads, ref_grads = assemble(results), assemble([reference])
        assert set(grads) == set(ref_grads), f"{layout}: parameters differ: {set(grads) ^ set(ref_grads)}"
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, atol=GRAD_ATOL, rtol=GRAD_RTOL,
                                       msg=lambda m, name=name: f"{layout} {name}: {m}")
            grad_diff = max(grad_diff, (grads[name] - ref).abs().max().item())
    return {"loss_rel_diff": loss_diff, "grad_abs_diff": grad_diff}


def assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """The union of every rank's full-shape gradients; ranks holding the same parameter
    (data/context-parallel replicas, tied embedding copies) must agree."""
    full: dict[str, torch.Tensor] = {}
    for result in per_rank:
        for name, grad in result["grads"].items():
            if name in full:
                torch.testing.assert_close(grad, full[name], atol=1e-6, rtol=1e-5,
                                           msg=lambda m, name=name: f"replicas of {name} differ: {m}")
            full[name] = grad
    return full


class _StepSink:
    """The train callback ``StepWatcher`` registers: ``on_step`` only."""

    def __init__(self, on_step: Callable[[int, dict], None]):
        self.on_step = on_step

    def on_eval(self, step: int, metrics: dict) -> None:
        """Evaluations are not watched."""

    def close(self) -> None:
        """Nothing to release."""


class StepWatcher:
    """``with StepWatcher("name", on_step):`` registers, as a plugin would, a train callback
    ``name`` that calls ``on_step(step, metrics)`` at every logged step; a run that lists it in
    ``logging.callbacks`` lets a test look (or act, e.g. send a signal) inside the loop."""

    def __init__(self, name: str, on_step: Callable[[int, dict], None]):
        self.name, self.on_step = name, on_step

    @hookimpl
    def mtl_train_callbacks(self):
        return [TrainCallback(self.name, lambda config: _StepSink(self.on_step))]

    def __enter__(self) -> "StepWatcher":
        plugins.register_plugin(self, name=f"step-watcher-{self.name}")
        return self

    def __exit__(self, *exc) -> None:
        plugins.unregister_plugin(self)
