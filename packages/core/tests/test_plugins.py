import pytest
import torch

from mtl.core import plugins
from mtl.core.errors import NotInstalledError, PluginError
from mtl.core.hookspecs import hookimpl
from mtl.core.registrations import Backend, TokenizerSpec
from mtl.core.spec import ModuleSpec, build_module


def _backend(name):
    return Backend(name, column_linear=torch.nn.Linear, row_linear=torch.nn.Linear,
                   norm=torch.nn.LayerNorm, core_attention=torch.nn.Identity)


class PluginA:
    @hookimpl
    def mtl_backends(self):
        return [_backend("alpha")]


class PluginB:
    @hookimpl
    def mtl_backends(self):
        return [_backend("alpha")]


def test_registered_plugin_is_found():
    plugin = PluginA()
    plugins.register_plugin(plugin, name="plugin-a")
    try:
        assert plugins.registry("backend").get("alpha").name == "alpha"
    finally:
        plugins.unregister_plugin(plugin)
    assert "alpha" not in plugins.registry("backend")


def test_duplicate_names_refused_naming_both():
    a, b = PluginA(), PluginB()
    plugins.register_plugin(a, name="plugin-a")
    plugins.register_plugin(b, name="plugin-b")
    try:
        with pytest.raises(PluginError, match="registered twice: by plugin-a and by plugin-b"):
            plugins.registry("backend")
    finally:
        plugins.unregister_plugin(a)
        plugins.unregister_plugin(b)


def test_missing_name_lists_installed_and_install_hint(monkeypatch):
    assert plugins.KNOWN_PROVIDERS["backend"]["te"] == "mtl-te"
    # a name no distribution registers (mtl-te itself may be installed here)
    monkeypatch.setitem(plugins.KNOWN_PROVIDERS["backend"], "absent-te", "mtl-absent-te")
    with pytest.raises(NotInstalledError, match=r"backend 'absent-te' is not installed .*pip install mtl-absent-te"):
        plugins.registry("backend").get("absent-te")
    with pytest.raises(NotInstalledError, match=r"tokenizer 'nonesuch' is not installed \(installed:"):
        plugins.registry("tokenizer").get("nonesuch")


def test_unknown_kind():
    with pytest.raises(PluginError, match="unknown registry kind"):
        plugins.registry("gizmo")


def test_build_module_merges_params():
    spec = ModuleSpec(torch.nn.Linear, params={"in_features": 3, "out_features": 2, "bias": False})
    layer = build_module(spec, out_features=5)
    assert tuple(layer.weight.shape) == (5, 3) and layer.bias is None
    assert isinstance(build_module(torch.nn.Identity), torch.nn.Identity)


def test_tokenizer_record_is_frozen():
    spec = TokenizerSpec("x", build=lambda path: None)
    with pytest.raises(Exception):
        spec.name = "y"


class EagerFp8Plugin:
    """A backend whose FP8 modules do not compile (``fp8_compiles=False``, as mtl-te's)."""

    @hookimpl
    def mtl_backends(self):
        backend = _backend("eager-fp8")
        return [Backend(**{**backend.__dict__, "fp8_recipes": ("current",), "fp8_compiles": False})]


@pytest.mark.parametrize("given, fp8, graphs, expected", [
    (None, "current", False, False),  # derived: off for this backend's FP8
    (None, "none", False, True),  # derived: on (a CUDA run), FP8 off
    (True, "current", False, True),  # given: kept
    (None, "current", True, True),  # captured layers: the graph breaks cost the host nothing
])
def test_compile_default_off_for_a_backend_whose_fp8_does_not_compile(given, fp8, graphs, expected):
    from mtl.core.config_io import load_config

    plugin = EagerFp8Plugin()
    plugins.register_plugin(plugin, name="eager-fp8")
    try:
        overrides = ["model.backend='eager-fp8'", f"train.fp8='{fp8}'", "train.device='cuda'",
                     f"train.cuda_graphs={str(graphs).lower()}"]
        if given is not None:
            overrides.append(f"train.compile={str(given).lower()}")
        assert load_config(None, overrides).resolve(tokenizer_vocab_size=257).train.compile is expected
    finally:
        plugins.unregister_plugin(plugin)
