"""On a CUDA machine: HF GPT-2/Llama vs the converted mtl model (fp32 logits, greedy tokens,
cached vs uncached generation), then a bf16 training step with full recompute.

    python3 packages/models/scripts/cuda_parity.py
"""

import tempfile

import torch
import transformers

from mtl.core.config_io import config_from_dict
from mtl.core.plugins import registry
from mtl.models.convert_hf import HFConverter
from mtl.models.generate import generate
from mtl.models.gpt import build_gpt
from mtl.models.param_layout import load_global_state
from mtl.parallel.topology import Topology

VOCAB = 1000


def hf_model(arch: str):
    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1,
        )
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, activation_function="gelu",
        initializer_range=0.1,
    )
    return transformers.GPT2LMHeadModel(config)


def main() -> None:
    topology, backend = Topology.single(), registry("backend").get("local")
    prompt = [1, 2, 3, 4]
    for arch in ("llama", "gpt2"):
        directory = tempfile.mkdtemp()
        reference = hf_model(arch)
        reference.save_pretrained(directory)
        reference = reference.cuda().eval()
        section, state = HFConverter().to_mtl(directory)
        config = config_from_dict({"model": section, "train": {"recompute": "full"}}).resolve(1)
        model = build_gpt(config, topology, backend)
        load_global_state(model, topology, state)
        model = model.cuda().eval()
        ids = torch.randint(0, VOCAB, (2, 64), device="cuda")
        with torch.no_grad():
            expected, ours = reference(ids).logits, model(ids)[..., :VOCAB]
        print(arch, "fp32 max relative error", ((ours - expected).abs().max() / expected.abs().max()).item())
        greedy = generate(model, prompt, 16, temperature=0)
        hf_greedy = reference.generate(
            torch.tensor([prompt], device="cuda"), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt):].tolist()
        print(arch, "greedy equals HF", greedy == hf_greedy, "cache equals no cache",
              generate(model, prompt, 16, temperature=0, use_cache=False) == greedy)
        model = model.to(torch.bfloat16).train()
        loss = model(ids, labels=ids)
        loss.mean().backward()
        finite = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        print(arch, "bf16 loss dtype", loss.dtype, "mean", loss.mean().item(), "finite grads", finite)
        print(arch, "bf16 sampled", generate(model, prompt, 8, temperature=0.7, top_k=20, seed=1))


if __name__ == "__main__":
    main()
