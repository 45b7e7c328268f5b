"""The checks of the optional features (the backend, async TP, CUDA graphs, the attention kernel),
on the derived config: each refused, before any work, where it cannot run with the rest, naming
the setting in the way and the key to change. What only a model family knows (which model keys
it reads) it says through ``ModelFamily.check_config``; what only a backend knows (whether Transformer
Engine is installed, which settings it cannot run) it says itself, through ``Backend.check_config``
and ``Backend.check_available`` (``mtl.core.registrations``)."""

from __future__ import annotations

from typing import Any

from mtl.core.config_sections import ModelConfig, ParallelConfig, TrainConfig
from mtl.core.device_probe import runs_on_cpu
from mtl.core.errors import ConfigError


def check_features(cfg: Any) -> None:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    _check_family(cfg)
    _check_backend(cfg)
    check_async_tp(m, p, t)
    check_cuda_graphs(m, p, t)
    check_attention_kernel(m, p, t)


def _check_family(cfg: Any) -> None:
    """The selected model family accepts the settings (its ``check_config``); an unknown family
    is named when the model is built."""
    from mtl.core.plugins import registry  # noqa: PLC0415 (plugins imports the hookspecs, not config)

    families = registry("model family")
    if cfg.model.family in families:
        family = families.get(cfg.model.family)
        if family.check_config is not None:
            family.check_config(cfg)


def _check_backend(cfg: Any) -> None:
    """The selected backend accepts the settings (its ``check_config``), can run here and
    implements the FP8 recipe asked for. Only a backend that is registered is asked (a missing
    one is named when the model is built)."""
    from mtl.core.plugins import registry  # noqa: PLC0415 (plugins imports the hookspecs, not config)

    m, t = cfg.model, cfg.train
    if t.fp8 != "none" and t.fp8_amax_history_len < 1:
        raise ConfigError(f"train.fp8_amax_history_len = {t.fp8_amax_history_len} must be at least 1")
    backends = registry("backend")
    if m.backend not in backends:
        return
    backend = backends.get(m.backend)
    if backend.check_config is not None:  # first: a setting it refuses is named even where it is not installed
        backend.check_config(cfg)
    if backend.check_available is not None:
        backend.check_available()
    if t.fp8 != "none" and t.fp8 not in backend.fp8_recipes:
        others = [f"'{name}' ({', '.join(backends.get(name).fp8_recipes)})" for name in backends.names()
                  if t.fp8 in backends.get(name).fp8_recipes]
        offer = f"; backends that do: {', '.join(others)}" if others else ""
        raise ConfigError(
            f"train.fp8 = '{t.fp8}' is not a recipe of model.backend = '{m.backend}' (it has: "
            f"{', '.join(backend.fp8_recipes) or 'no FP8'}){offer}; set train.fp8 = 'none' or change model.backend"
        )


def check_async_tp(m: ModelConfig, p: ParallelConfig, t: TrainConfig) -> None:
    """After train.compile is final. Async TP is an inductor pass over a compiled layer's
    sequence-parallel collectives and the CUDA ops that replace them: anywhere else the key would
    do nothing or fail at the first step, so it is refused here, naming what to change."""
    if not p.async_tp:
        return
    conflicts = [  # the device first: on a CPU the rest would not make it work
        (runs_on_cpu(t.device), "a CPU run", "a CUDA device (the fused ops are CUDA ops over NCCL symmetric memory)"),
        (p.tp < 2 or not p.sequence_parallel,
         f"parallel.tp = {p.tp}, sequence_parallel = {str(p.sequence_parallel).lower()}",
         "parallel.tp > 1 with parallel.sequence_parallel = true (it fuses the sequence-parallel all-gathers and "
         "reduce-scatters with their matmuls)"),
        (not t.compile, "train.compile = false", "train.compile = true (an inductor pass does the fusing)"),
        (m.backend != "local", f"model.backend = '{m.backend}'",
         "'local' (its linears are the matmuls inductor sees; other backends' are not run with it yet)"),
    ]
    for conflict, setting, fix in conflicts:
        if conflict:
            raise ConfigError(f"parallel.async_tp = true does not work with {setting}: use {fix}, "
                              "or set parallel.async_tp = false")


def check_cuda_graphs(m: ModelConfig, p: ParallelConfig, t: TrainConfig) -> None:
    """``train.cuda_graphs`` replays each layer's captured kernels with no Python in between,
    so whatever needs the host between them, or a second copy of a layer's activations, is
    refused here, before any work, with the key to change."""
    if not t.cuda_graphs:
        return
    conflicts = [
        # data parallelism looks sound on paper (the hooks run after each layer's backward
        # replay) but has not run with captured layers: refused until a multi-GPU test has
        (p.dp is not None and p.dp > 1, f"data parallelism (parallel.dp = {p.dp}, from the world size)",
         "1 process (captured layers are verified on one GPU only so far)"),
        (p.tp > 1, f"parallel.tp = {p.tp}", "1"),
        (p.pp > 1, f"parallel.pp = {p.pp}", "1 (a pipeline keeps several micro-batches of a layer in flight)"),
        (p.cp > 1, f"parallel.cp = {p.cp}", "1"),
        (p.overlap_param_gather, "parallel.overlap_param_gather = true", "false (its waits run before each layer)"),
        (p.sharding == "parameters", "parallel.sharding = 'parameters'",
         "'optimizer' (its gathers and frees run between the layers)"),
        (m.num_experts > 0, f"model.num_experts = {m.num_experts}", "0 (routing sizes the experts' work on the host)"),
        (t.recompute != "none", f"train.recompute = '{t.recompute}'", "'none'"),
        (m.hidden_dropout > 0, f"model.hidden_dropout = {m.hidden_dropout}", "0"),
        (m.attention_dropout > 0, f"model.attention_dropout = {m.attention_dropout}", "0"),
        (t.fp8 == "delayed", "train.fp8 = 'delayed'", "'current' (the amax history is kept on the host's schedule)"),
        (t.params_dtype != t.precision, f"train.params_dtype = '{t.params_dtype}' with precision '{t.precision}'",
         f"'{t.precision}' (autocast's weight cache cannot be captured)"),
    ]
    for conflict, setting, fix in conflicts:
        if conflict:
            raise ConfigError(f"train.cuda_graphs = true does not work with {setting}: set it to {fix}, "
                              "or train.cuda_graphs = false")
    if runs_on_cpu(t.device):
        raise ConfigError("train.cuda_graphs = true needs a CUDA device (this run uses the CPU); "
                          "set train.cuda_graphs = false")


def check_attention_kernel(m: ModelConfig, p: ParallelConfig, t: TrainConfig) -> None:
    """``train.attention_kernel = "fa4"`` swaps SDPA's kernel in mtl's own core attention
    (mtl.parallel.backend_local.fa4); what it cannot serve is refused here, before any work."""
    if t.attention_kernel != "fa4":
        return
    conflicts = [
        (m.backend == "te", "model.backend = 'te' (Transformer Engine runs its own attention)", "model.backend = 'local'"),
        (m.attention_dropout > 0, f"model.attention_dropout = {m.attention_dropout} (FA4 has no dropout)",
         "model.attention_dropout = 0"),
        # the ring's blocks would reach FA4 through aten's flash ops too, but no run has checked them
        (p.cp > 1, f"parallel.cp = {p.cp} (context parallelism is verified on cuDNN and FA2 only)", "parallel.cp = 1"),
        (runs_on_cpu(t.device), "a CPU run", "a CUDA device (train.device = 'cuda')"),
    ]
    for conflict, setting, fix in conflicts:
        if conflict:
            raise ConfigError(f"train.attention_kernel = 'fa4' does not work with {setting}: use {fix}, "
                              "or train.attention_kernel = 'sdpa'")
