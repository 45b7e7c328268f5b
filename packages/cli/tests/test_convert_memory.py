"""``mtl convert`` holds about one tensor at a time, not the model: the peak resident memory of a
conversion of a 182 MB model (two 65.5 MB vocabulary tables) above that of a tiny one.

Measured on CPU (glibc): 61 MB for the import (at --tp 2) and 31 MB for the export above a
tiny conversion in the same process; 125 MB both ways above a tiny conversion in a process of
its own (1.9 x the largest tensor: the tensor in hand plus one chunk buffer). The model once is
182 MB."""

import json
import subprocess
import sys

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

MEASURE = """
import resource, sys
from mtl.cli.main import cli
peaks = []
for args in (sys.argv[1:8], sys.argv[8:]):  # the tiny conversion, then the large one
    cli.main(args, standalone_mode=False)
    peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB -> bytes on Linux
print("PEAKS", *peaks)
"""


def write_llama(path, vocab, hidden, layers, ffn, heads) -> tuple[int, int]:
    """A random Llama checkpoint written tensor by tensor; (total bytes, largest tensor's bytes)."""
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
                       p + "mlp.down_proj.weight": (hidden, ffn)})
        shapes.update({p + f"self_attn.{n}_proj.weight": (hidden, hidden) for n in "qkvo"})
    tensors = {name: torch.randn(*shape, generator=g) for name, shape in shapes.items()}
    safetensors_torch.save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": ffn,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "eos_token_id": 0}
    (path / "config.json").write_text(json.dumps(config))
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    return sum(sizes), max(sizes)


def peaks(*args) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", MEASURE, *map(str, args)], capture_output=True, text=True, check=True)
    line = next(line for line in out.stdout.splitlines() if line.startswith("PEAKS"))
    small, large = map(int, line.split()[1:])
    return small, large


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss units and glibc arenas are Linux's")
def test_conversion_peak_memory_is_about_one_tensor(tmp_path):
    write_llama(tmp_path / "tiny", 256, 64, 1, 128, 4)
    model_bytes, largest = write_llama(tmp_path / "big", 32000, 512, 4, 1408, 8)
    assert 150e6 < model_bytes < 200e6 and largest == 32000 * 512 * 4
    base, peak = peaks("convert", "--from", "hf", "--to", "mtl", tmp_path / "tiny", tmp_path / "tiny_mtl",
                       "convert", "--from", "hf", "--to", "mtl", tmp_path / "big", tmp_path / "big_mtl", "--tp", "2")
    import_extra = peak - base
    base, peak = peaks("convert", "--from", "mtl", "--to", "hf", tmp_path / "tiny_mtl", tmp_path / "tiny_back",
                       "convert", "--from", "mtl", "--to", "hf", tmp_path / "big_mtl", tmp_path / "big_back")
    export_extra = peak - base
    print(f"model {model_bytes / 1e6:.0f} MB, largest tensor {largest / 1e6:.1f} MB; peak RSS above a tiny "
          f"conversion: import {import_extra / 1e6:.0f} MB, export {export_extra / 1e6:.0f} MB")
    # generous: never the model once, let alone twice
    assert import_extra < min(3 * largest, model_bytes), import_extra
    assert export_extra < min(3 * largest, model_bytes), export_extra
