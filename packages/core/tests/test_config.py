import pytest

from mtl.core.config import RunConfig, pipeline_layer_split, ParallelConfig
from mtl.core.config_io import config_diff, format_config, load_config, parse_override_value
from mtl.core.errors import ConfigError


def write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_toml_and_overrides(tmp_path):
    path = write(tmp_path, "[model]\nnum_layers = 2\nhidden_size = 64\n[train]\nlr = 1\n")
    cfg = load_config(path, ["model.num_layers=4", "data.paths=[[0.7, 'a'], [0.3, 'b']]", "data.tokenizer=hf"])
    assert cfg.model.num_layers == 4
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.data.paths == [[0.7, "a"], [0.3, "b"]]
    assert cfg.data.tokenizer == "hf"  # not valid TOML, falls back to a bare string


def test_override_values_parse_as_toml():
    assert parse_override_value("3") == 3
    assert parse_override_value("1e-3") == 1e-3
    assert parse_override_value("true") is True
    assert parse_override_value("cosine") == "cosine"


def test_unknown_key_names_key_and_suggests(tmp_path):
    path = write(tmp_path, "[model]\nnum_layer = 2\n")
    with pytest.raises(ConfigError, match=r"model.num_layer.*did you mean 'num_layers'"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"unknown section \[trian\].*'train'"):
        load_config(None, ["trian.lr=1"])


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"model.num_layers = 'two' should be int"):
        load_config(None, ["model.num_layers=two"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_derived_values_computed_once():
    cfg = load_config(None, ["model.hidden_size=2048", "model.num_attention_heads=16",
                             "model.num_query_groups=4", "parallel.tp=2",
                             "train.micro_batch_size=2", "train.global_batch_size=16"])
    r = cfg.resolve(world_size=8, tokenizer_vocab_size=50257)
    assert r.model.head_dim == 128
    assert r.model.ffn_hidden_size == 5440  # Megatron: int(4*2048*2/3/64)*64
    assert r.model.padded_vocab_size == 50432  # multiple of 128*tp
    assert r.parallel.dp == 4
    assert r.train.num_micro_batches == 2
    assert cfg.model.head_dim is None  # resolve returns a copy


def test_gelu_ffn_is_4h():
    r = load_config(None, ["model.activation=gelu"]).resolve(1, 100)
    assert r.model.ffn_hidden_size == 4 * r.model.hidden_size


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["parallel.tp=3"], 3, "must divide model.num_attention_heads"),
        (["parallel.pp=3", "parallel.pipeline_split='even'"], 3, "num_layers = 2 is not divisible by pp\\*vpp"),
        (["parallel.pp=3", "parallel.pipeline_split='flops'"], 3, "num_layers = 2 cannot fill pp\\*vpp = 3\\*1 = 3"),
        (["parallel.tp=2"], 3, "world size 3 is not divisible by tp\\*pp\\*cp"),
        (["train.global_batch_size=6"], 4, "global_batch_size = 6 is not divisible"),
        (["parallel.vpp=2"], 1, "vpp = 2 needs parallel.pp > 1"),
        (["model.normalization=batchnorm"], 1, "model.normalization = 'batchnorm' is not one of"),
        (["model.num_attention_heads=3"], 1, "hidden_size = 64 is not divisible"),
        (["parallel.cp=2", "model.seq_length=6"], 2, "divisible by 2\\*cp"),
    ],
)
def test_invalid_layouts_rejected_with_arithmetic(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides).resolve(world_size=world, tokenizer_vocab_size=257)


def test_overlap_param_gather_needs_distributed_optimizer():
    with pytest.raises(ConfigError, match=r"parallel.overlap_param_gather = true needs parallel.distributed_optimizer = true"):
        load_config(None, ["parallel.overlap_param_gather=true"]).resolve(world_size=2, tokenizer_vocab_size=257)
    r = load_config(None, ["parallel.overlap_param_gather=true", "parallel.distributed_optimizer=true"]).resolve(2, 257)
    assert r.parallel.overlap_param_gather and r.parallel.distributed_optimizer
    assert load_config(None, []).resolve(1, 257).parallel.overlap_param_gather is False


@pytest.mark.parametrize("overrides, world, expected", [
    (["parallel.cp=2", "train.compile=true"], 2, "all_gather"),  # compiles with the layer; same k/v held
    (["parallel.cp=2", "train.compile=false"], 2, "p2p"),
    (["parallel.cp=4", "train.compile=true"], 4, "p2p"),  # the ring holds 2 of 4 blocks, the gather all 4
    (["parallel.cp=2", "train.compile=true", "parallel.cp_comm_type='p2p'"], 2, "p2p"),  # a choice is kept
    ([], 1, "p2p"),
])
def test_cp_comm_type_derived_from_compile_and_cp(overrides, world, expected):
    cfg = load_config(None, ["train.device='cpu'", "model.num_attention_heads=4", *overrides]).resolve(world, 257)
    assert cfg.parallel.cp_comm_type == expected


@pytest.mark.parametrize("key", ["parallel.overlap_layer_comm", "train.compile_cpp_wrapper"])
def test_a_removed_key_is_named_as_removed_with_why(tmp_path, key):
    """A config written for an older mtl fails on one line that says the key went, why, and
    what to do, from a file as from --set (not "unknown key")."""
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=rf"run.toml: {key} was removed in mtl-core 0.2.0: .*; delete the key$"):
        load_config(write(tmp_path, f"[{section}]\n{name} = false\n"))
    with pytest.raises(ConfigError, match=rf"--set: {key} was removed in mtl-core 0.2.0: .*benchmarks/log"):
        load_config(None, [f"{key}=true"])


def test_cp_comm_type_choice_checked():
    with pytest.raises(ConfigError, match=r"parallel.cp_comm_type = 'ring' is not one of p2p, all_gather"):
        load_config(None, ["parallel.cp_comm_type='ring'"]).resolve(1, 257)


def test_pipeline_split_with_first_and_last_stage():
    p = ParallelConfig(pp=4, first_stage_layers=1, last_stage_layers=3)
    assert pipeline_layer_split(12, p) == [1, 4, 4, 3]
    with pytest.raises(ConfigError, match="does not split evenly"):
        pipeline_layer_split(11, p)


def test_virtual_stage_layers_from_the_command_line():
    """``--set parallel.virtual_stage_layers=[...]`` sizes every virtual stage, in model order."""
    layout = ["model.num_layers=24", "parallel.pp=2", "parallel.vpp=2", "parallel.virtual_stage_layers=[7, 6, 6, 5]"]
    cfg = load_config(None, layout).resolve(2, 257)
    assert pipeline_layer_split(24, cfg.parallel) == [7, 6, 6, 5]
    bad = {
        "[7, 6, 6]": r"has 3 entries; it needs pp\*vpp = 2\*2 = 4",
        "[7, 6, 6, 6]": r"sums to 25 layers; model.num_layers = 24",
        "[12, 0, 6, 6]": r"every entry must be a whole number of layers, at least 1",
        "[7.5, 5.5, 6, 5]": r"every entry must be a whole number",
    }
    for counts, message in bad.items():
        with pytest.raises(ConfigError, match=r"parallel.virtual_stage_layers = .*" + message):
            load_config(None, [*layout[:3], f"parallel.virtual_stage_layers={counts}"]).resolve(2, 257)
    with pytest.raises(ConfigError, match="unset parallel.first_stage_layers/last_stage_layers"):
        load_config(None, [*layout, "parallel.first_stage_layers=7"]).resolve(2, 257)
    with pytest.raises(ConfigError, match=r"needs parallel.pp > 1"):
        load_config(None, ["model.num_layers=4", "parallel.virtual_stage_layers=[4]"]).resolve(1, 257)
    with pytest.raises(ConfigError, match=r"should be list"):
        load_config(None, [*layout[:3], "parallel.virtual_stage_layers=7"])
    with pytest.raises(ConfigError, match=r"set parallel.pipeline_split = 'flops', or give the counts in "
                                          r"parallel.virtual_stage_layers"):
        load_config(None, ["model.num_layers=10", "parallel.pp=2", "parallel.vpp=2",
                           "parallel.pipeline_split='even'"]).resolve(2, 257)


def test_pipeline_split_by_flops_is_checked_before_the_model_is_counted():
    """``parallel.pipeline_split = 'flops'``: what conflicts with it is named; at pp = 1 there is
    nothing to split, and the even split's divisibility is not asked for."""
    flops = ["parallel.pp=2", "parallel.pipeline_split='flops'"]
    with pytest.raises(ConfigError, match=r"pipeline_split = 'flops' sizes every stage: unset "
                                          r"parallel.first_stage_layers/last_stage_layers"):
        load_config(None, ["model.num_layers=4", *flops, "parallel.first_stage_layers=3"]).resolve(2, 257)
    with pytest.raises(ConfigError, match=r"model.num_layers = 3 cannot fill pp\*vpp = 2\*2 = 4 pipeline stages"):
        load_config(None, ["model.num_layers=3", *flops, "parallel.vpp=2"]).resolve(2, 257)
    with pytest.raises(ConfigError, match=r"parallel.pipeline_split = 'halves' is not one of even, flops"):
        load_config(None, ["parallel.pipeline_split='halves'"]).resolve(1, 257)
    single = load_config(None, ["model.num_layers=3", "parallel.pipeline_split='flops'"]).resolve(1, 257)
    assert single.parallel.virtual_stage_layers is None


def test_pipeline_split_defaults_to_flops_where_the_family_counts_them():
    """Unset, ``parallel.pipeline_split`` sizes the stages by FLOPs where the model family gives
    its per-layer counts (here a head worth 2 layers: 6 layers as 4 + 2), and evenly where it
    does not, or where layer counts are given; a resolved config resolves again to itself."""
    from mtl.core.hookspecs import hookimpl
    from mtl.core.plugins import register_plugin, unregister_plugin
    from mtl.core.registrations import ModelFamily

    def layers(cfg):
        return [1.0] * cfg.model.num_layers

    counted = ModelFamily(name="counted", build=lambda *a, **k: None, layer_flops_per_iteration=layers,
                          flops_per_iteration=lambda cfg: sum(layers(cfg)) + 2.0)
    uncounted = ModelFamily(name="uncounted", build=lambda *a, **k: None)

    class Plugin:
        @hookimpl
        def mtl_model_families(self):
            return [counted, uncounted]

    def resolve(*sets):
        return load_config(None, ["model.num_layers=6", "parallel.pp=2", *sets]).resolve(2, 257).parallel

    plugin = Plugin()
    register_plugin(plugin)
    try:
        resolved = load_config(None, ["model.num_layers=6", "parallel.pp=2", "model.family='counted'"]).resolve(2, 257)
        assert (resolved.parallel.pipeline_split, resolved.parallel.virtual_stage_layers) == ("flops", [4, 2])
        assert resolved.resolve(2, 257).parallel.virtual_stage_layers == [4, 2]
        with pytest.raises(ConfigError, match=r"virtual_stage_layers = \[3, 3\] is not the split "
                                              r"parallel.pipeline_split = 'flops' derives \(\[4, 2\]\)"):
            resolve("model.family='counted'", "parallel.pipeline_split='flops'", "parallel.virtual_stage_layers=[3, 3]")
        even = resolve("model.family='uncounted'")
        assert (even.pipeline_split, even.virtual_stage_layers) == ("even", None)
        given = resolve("model.family='counted'", "parallel.first_stage_layers=2")
        assert (given.pipeline_split, pipeline_layer_split(6, given)) == ("even", [2, 4])
    finally:
        unregister_plugin(plugin)


def test_diff_and_format_round_trip(tmp_path):
    a = RunConfig().resolve(1, 257)
    b = load_config(None, ["model.num_layers=4"]).resolve(1, 257)
    assert config_diff(a, b) == ["model.num_layers: 2 -> 4"]
    text = format_config(b)
    reread = load_config(write(tmp_path, text.replace("resolved", "x")))
    assert config_diff(reread.resolve(1, 257), b) == []


def test_ckpt_load_iteration_unset_by_default_and_never_negative():
    """``ckpt.load_iteration`` picks a committed iteration to resume from; unset means the latest."""
    assert load_config(None, []).resolve(1, 257).ckpt.load_iteration is None
    assert load_config(None, ["ckpt.load_iteration=60"]).resolve(1, 257).ckpt.load_iteration == 60
    with pytest.raises(ConfigError, match=r"ckpt.load_iteration = -1 must not be negative"):
        load_config(None, ["ckpt.load_iteration=-1"]).resolve(1, 257)


def test_short_run_clamps_the_warmup_to_its_length():
    """``--set train.iters=5`` on a config with 10 warmup steps runs: with train.lr_decay_iters
    unset (derived: the run's length) the warmup is clamped to it, with one INFO line."""
    import logging

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger, handler = logging.getLogger("mtl.core.config_derive"), Keep(level=logging.INFO)
    logger.addHandler(handler)
    try:
        t = load_config(None, ["train.warmup_iters=10", "train.iters=5"]).resolve(1, 257).train
    finally:
        logger.removeHandler(handler)
    assert (t.warmup_iters, t.lr_decay_iters) == (5, 5)
    notes = [r for r in records if "train.warmup_iters = 10" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelname == "INFO", [r.getMessage() for r in records]
    assert load_config(None, ["train.warmup_iters=3", "train.iters=5"]).resolve(1, 257).train.warmup_iters == 3


def test_warmup_longer_than_a_given_decay_is_refused():
    """Both set by the user: they meant them, so a warmup past the decay is an error, not a clamp."""
    with pytest.raises(ConfigError, match=r"train.warmup_iters = 10 exceeds train.lr_decay_iters = 5: lower "
                                          r"train.warmup_iters, raise train.lr_decay_iters, or unset it"):
        load_config(None, ["train.warmup_iters=10", "train.lr_decay_iters=5", "train.iters=5"]).resolve(1, 257)
    resolved = load_config(None, ["train.warmup_iters=10", "train.iters=5"]).resolve(1, 257)
    assert resolved.resolve(1, 257).train.warmup_iters == 5  # a resolved config resolves to itself
