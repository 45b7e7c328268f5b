"""Loading builds the weights in the serving dtype: the peak resident memory of loading a
checkpoint in bfloat16 stays near the bfloat16 model, where building in fp32 and casting
after would need the fp32 model (twice as much) first. Measured in a fresh process (glibc
told to return large blocks at once, the peak reset after a warm-up load)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch import nn

from mtl.serve.materialize import materialize, parameters_on_meta

PEAK = textwrap.dedent("""
    import gc, sys, torch
    from mtl.serve.loading import load_checkpoint

    def status(key):
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))

    ckpt = sys.argv[1]
    del_model = load_checkpoint(ckpt, device=torch.device("cpu"), dtype=torch.bfloat16)  # imports, caches
    del del_model
    gc.collect()
    before = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    loaded = load_checkpoint(ckpt, device=torch.device("cpu"), dtype=torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    print(status("VmHWM") - before, weights)
""")


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory, train_checkpoint):
    """8 layers of width 384 (14M parameters): weights large beside the process's noise."""
    return train_checkpoint(tmp_path_factory.mktemp("wide"), """\
[model]
num_layers = 8
hidden_size = 384
num_attention_heads = 6
seq_length = 16

[data]
dataset = "mock"
tokenizer = "byte"
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc peak-RSS reset")
def test_loading_in_bfloat16_peaks_near_the_bfloat16_weights(wide_checkpoint):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run([sys.executable, "-c", PEAK, wide_checkpoint], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    peak, weights = map(int, result.stdout.split())
    assert weights > 25e6
    assert peak < 1.5 * weights, (peak / 2**20, weights / 2**20)  # fp32 first would be >= 2x


def test_loaded_weights_equal_building_in_fp32_then_loading(wide_checkpoint, monkeypatch):
    """The same tensors as the training way (fp32 build with init, then the load), the tied
    embedding still one parameter, the padded vocabulary rows zero, rotary tables intact; in
    bfloat16, the same tensors rounded."""
    from mtl.serve import loading

    built = loading.load_checkpoint(wide_checkpoint, device=torch.device("cpu")).model
    assert built.output_layer.weight is built.embedding.word_embeddings.weight
    half = loading.load_checkpoint(wide_checkpoint, device=torch.device("cpu"), dtype=torch.bfloat16).model
    monkeypatch.setattr(loading, "parameters_on_meta", contextlib.nullcontext)  # the fp32-then-load way
    reference = loading.load_checkpoint(wide_checkpoint, device=torch.device("cpu")).model
    ours, theirs = built.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert all(torch.equal(a, b) for a, b in zip(built.buffers(), reference.buffers()))
    # bfloat16: every parameter is the reference's, rounded (a weight the load missed stays zero)
    params = dict(reference.named_parameters())
    assert params.keys() == dict(half.named_parameters()).keys()
    for name, param in half.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(param, params[name].to(torch.bfloat16)), name


class TaggedParameter(nn.Parameter):
    """A Parameter subclass, as some layers register."""


def test_parameters_on_meta_acts_on_its_own_thread_only():
    """Two loads overlapping (A enters, B enters, A leaves, B leaves) while a third thread builds
    a module: only the loading threads' parameters go to meta, and none once both are out;
    nested use and a Parameter subclass with its attributes survive the trip."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    built = {}

    def load_a():
        with parameters_on_meta():
            a_in.set()
            b_in.wait(5)
            built["a"] = nn.Linear(2, 2)
        a_out.set()

    def load_b():
        a_in.wait(5)
        with parameters_on_meta():
            b_in.set()
            a_out.wait(5)
            with parameters_on_meta():  # nested: on meta inside, and still after it
                built["nested"] = nn.Linear(2, 2)
            module = nn.Module()
            tagged = TaggedParameter(torch.ones(3))
            tagged.tensor_model_parallel = True
            module.register_parameter("w", tagged)
            built["b"] = module

    def other():
        b_in.wait(5)
        built["other"] = nn.Linear(2, 2)

    threads = [threading.Thread(target=f) for f in (load_a, load_b, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert built["a"].weight.is_meta and built["b"].w.is_meta and built["nested"].weight.is_meta
    assert not built["other"].weight.is_meta
    assert not nn.Linear(2, 2).weight.is_meta  # nothing left installed that moves parameters
    assert type(built["b"].w) is TaggedParameter and built["b"].w.tensor_model_parallel
    real = materialize(built["b"], torch.device("cpu"), torch.bfloat16).w
    assert type(real) is TaggedParameter and real.tensor_model_parallel and real.dtype == torch.bfloat16


def test_parameters_without_gradient_keep_their_dtype():
    """As training's weights cast: an MoE router's expert bias (no gradient) stays fp32 in a
    bf16 model, the weights become bf16."""
    with parameters_on_meta():
        module = nn.Linear(4, 4)
        module.register_parameter("expert_bias", nn.Parameter(torch.zeros(4), requires_grad=False))
    materialize(module, torch.device("cpu"), torch.bfloat16)
    assert module.weight.dtype == torch.bfloat16 and module.expert_bias.dtype == torch.float32
