"""build_module holds a module class to the layer-spec contract: a keyword it does not accept
is one line naming the change; a renamed keyword reaches a class that takes the old name."""

import warnings

import pytest

from mtl.core import contract_changes
from mtl.core.contract_changes import ContractDeprecationWarning, RenamedKeyword
from mtl.core.errors import PluginError
from mtl.core.spec import ModuleSpec, build_module


class LayerWrittenLastRelease:
    """A plugin's layer written before the spec grew ``fuse_input_norm``."""

    def __init__(self, hidden_dropout, layer_number, topology=None, submodules=None):
        self.hidden_dropout, self.layer_number, self.submodules = hidden_dropout, layer_number, submodules


class LayerTakingAnything:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


def test_keyword_the_class_does_not_take_is_one_line_naming_class_keyword_and_source():
    spec = ModuleSpec(LayerWrittenLastRelease, {"hidden_dropout": 0.0, "fuse_input_norm": True})
    with pytest.raises(PluginError) as raised:
        build_module(spec, layer_number=1, sequence_parallel=False)
    message = str(raised.value)
    assert "\n" not in message
    assert "LayerWrittenLastRelease" in message
    assert "'fuse_input_norm' (from the spec's params)" in message
    assert "'sequence_parallel' (from build_module's keywords)" in message
    assert "layer-spec contract of mtl-models" in message
    assert "docs/plugin-guide.md" in message
    assert "hidden_dropout" not in message and "layer_number" not in message


def test_submodules_the_class_does_not_take_are_named_as_such():
    spec = ModuleSpec(lambda hidden_size: hidden_size, {"hidden_size": 4}, submodules=("norm",))
    with pytest.raises(PluginError, match="'submodules' \\(from the spec's submodules\\)"):
        build_module(spec)


def test_accepted_keywords_and_var_keyword_classes_build_unchanged():
    layer = build_module(ModuleSpec(LayerWrittenLastRelease, {"hidden_dropout": 0.1}, submodules="subs"), layer_number=3)
    assert (layer.hidden_dropout, layer.layer_number, layer.submodules) == (0.1, 3, "subs")
    anything = build_module(ModuleSpec(LayerTakingAnything, {"fuse_input_norm": True}), layer_number=2)
    assert anything.kwargs == {"fuse_input_norm": True, "layer_number": 2}


def test_a_class_with_the_old_keyword_name_is_built_with_a_deprecation_warning(monkeypatch):
    renamed = RenamedKeyword(old="hidden_dropout", new="residual_dropout", renamed_in="mtl-models 9.1.0", removed_in="9.2.0")
    monkeypatch.setitem(contract_changes.RENAMED_KEYWORDS, "residual_dropout", renamed)
    spec = ModuleSpec(LayerWrittenLastRelease, {"residual_dropout": 0.25})
    with pytest.warns(ContractDeprecationWarning) as caught:
        layer = build_module(spec, layer_number=5)
    assert (layer.hidden_dropout, layer.layer_number) == (0.25, 5)
    assert issubclass(ContractDeprecationWarning, DeprecationWarning)
    message = str(caught[0].message)
    assert "'hidden_dropout'" in message and "'residual_dropout'" in message and "9.1.0" in message
    assert caught[0].filename == __file__  # points at the build_module call


def test_a_class_taking_the_new_name_gets_it_without_a_warning(monkeypatch):
    renamed = RenamedKeyword(old="dropout", new="hidden_dropout", renamed_in="mtl-models 9.1.0", removed_in="9.2.0")
    monkeypatch.setitem(contract_changes.RENAMED_KEYWORDS, "hidden_dropout", renamed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer = build_module(ModuleSpec(LayerWrittenLastRelease, {"hidden_dropout": 0.5}), layer_number=0)
    assert layer.hidden_dropout == 0.5


def test_a_spec_still_passing_the_old_name_reaches_a_class_taking_the_new_one(monkeypatch):
    renamed = RenamedKeyword(old="dropout", new="hidden_dropout", renamed_in="mtl-models 9.1.0", removed_in="9.2.0")
    monkeypatch.setitem(contract_changes.RENAMED_KEYWORDS, "hidden_dropout", renamed)
    with pytest.warns(ContractDeprecationWarning, match="rename it in the spec's params"):
        layer = build_module(ModuleSpec(LayerWrittenLastRelease, {"dropout": 0.5}), layer_number=0)
    assert layer.hidden_dropout == 0.5
