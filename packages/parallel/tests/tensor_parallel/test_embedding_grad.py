"""The word embedding's gradient accumulated into the fp32 ``main_grad`` (embedding_grad.py).

The op against a float64 scatter-add (repeated ids in random order, an id repeated hundreds
of times, tokens another TP rank owns, a main_grad already holding earlier micro-batches),
bitwise reproducible; the Triton kernel under Triton's interpreter on CPU
(``MTL_TEST_TRITON_INTERPRET=1 TRITON_INTERPRET=1 PYTHONPATH=<triton>``); the embedding at
tp=2 equal, bit for bit, to tp=1; and a tiny GPT built as the trainer builds it (bf16 weights,
fp32 gradient buffers) with the embedding fused, unfused, and tied to the output layer.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from mtl.parallel.tensor_parallel import VocabParallelEmbedding, embedding_grad
from mtl.parallel.tensor_parallel.embedding_grad import accumulate_embedding_grad, embedding
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def case(device: str, seed: int = 0, vocab: int = 50257, hidden: int = 48, tokens: int = 700):
    """main_grad [vocab, hidden] fp32 holding earlier values; ids [tokens] in random order with
    repeats, one id hundreds of times, the last and first rows, and skipped tokens (-1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (tokens,), generator=g)  # few distinct ids: many repeats
    ids[torch.randperm(tokens, generator=g)[:300]] = 50256  # one id 300 times (e.g. end-of-text), scattered
    ids[:2] = torch.tensor([0, vocab - 1])
    ids[torch.randperm(tokens, generator=g)[:50]] = -1  # owned by another tensor-parallel rank
    grad = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    main_grad = torch.randn(vocab, hidden, generator=g)
    return main_grad.to(device), grad.to(device), ids.to(device)


def reference(main_grad, grad, ids) -> torch.Tensor:
    keep = ids >= 0
    return main_grad.double().index_add(0, ids[keep], grad[keep].double())


@pytest.mark.parametrize("device", DEVICES)
def test_op_equals_the_float64_scatter_add_and_is_reproducible(device):
    main_grad, grad, ids = case(device)
    ref = reference(main_grad, grad, ids)
    first, second = main_grad.clone(), main_grad.clone()
    accumulate_embedding_grad(first, grad, ids)
    accumulate_embedding_grad(second, grad, ids)
    assert torch.equal(first, second)  # bitwise, run to run
    torch.testing.assert_close(first.double(), ref, rtol=0, atol=1e-5)  # fp32 sums of 300 rows
    untouched = torch.ones(main_grad.shape[0], dtype=torch.bool, device=device)
    untouched[ids[ids >= 0]] = False
    assert torch.equal(first[untouched], main_grad[untouched])  # rows of absent ids: not written


@pytest.mark.parametrize("device", DEVICES)
def test_micro_batches_accumulate(device):
    """Two micro-batches into a main_grad that already holds values: their fp32 sum."""
    main_grad, grad, ids = case(device)
    _, grad2, ids2 = case(device, seed=1)
    expected = reference(reference(main_grad, grad, ids).float(), grad2, ids2)
    accumulate_embedding_grad(main_grad, grad, ids)
    accumulate_embedding_grad(main_grad, grad2, ids2)
    torch.testing.assert_close(main_grad.double(), expected, rtol=0, atol=1e-5)


def test_the_op_compiles_without_a_graph_break():
    main_grad, grad, ids = case("cpu")
    expected = main_grad.clone()
    accumulate_embedding_grad(expected, grad, ids)
    compiled = torch.compile(lambda m, g, i: accumulate_embedding_grad(m, g, i), backend="aot_eager", fullgraph=True)
    compiled(main_grad, grad, ids)
    assert torch.equal(main_grad, expected)


@pytest.mark.skipif(os.environ.get("MTL_TEST_TRITON_INTERPRET") != "1",
                    reason="the Triton kernel on CPU: MTL_TEST_TRITON_INTERPRET=1 TRITON_INTERPRET=1 with triton importable")
def test_triton_kernel_under_the_interpreter():
    """The CUDA path's kernel, run by Triton's interpreter on CPU tensors: the float64 result,
    and bit for bit the CPU formula (both sum each id's rows in token order, then add once)."""
    assert embedding_grad.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
    for seed, hidden in ((0, 48), (1, 1100)):  # 1100: two column blocks, the last one partial
        main_grad, grad, ids = case("cpu", seed=seed, vocab=50257, hidden=hidden, tokens=400)
        kernel, formula = main_grad.clone(), main_grad.clone()
        embedding_grad._accumulate_triton(kernel, grad, ids)
        embedding_grad._accumulate_torch(formula, grad, ids)
        torch.testing.assert_close(kernel.double(), reference(main_grad, grad, ids), rtol=0, atol=1e-5)
        assert torch.equal(kernel, formula)
    one = torch.zeros(3, 4)
    embedding_grad._accumulate_triton(one, torch.ones(1, 4, dtype=torch.bfloat16), torch.tensor([2]))
    assert one[2].tolist() == [1.0] * 4 and one[:2].abs().sum() == 0


def test_embedding_function_forward_and_backward():
    torch.manual_seed(0)
    weight = torch.randn(50, 8).to(torch.bfloat16).requires_grad_()
    main_grad = torch.zeros(50, 8)
    ids = torch.randint(0, 50, (6, 3))
    skip = torch.zeros(6, 3, dtype=torch.bool)
    skip[0] = True
    out = embedding(ids, weight, main_grad, skip)
    assert torch.equal(out, F.embedding(ids, weight))
    dy = torch.randn(6, 3, 8).to(torch.bfloat16)
    out.backward(dy)
    assert weight.grad is not None  # the placeholder that fires DataParallel's hook
    keep = ~skip
    expected = torch.zeros(50, 8, dtype=torch.float64).index_add_(0, ids[keep], dy[keep].double())
    torch.testing.assert_close(main_grad.double(), expected, rtol=0, atol=1e-6)


V, H, B, S = 50, 16, 2, 40


def fused_embedding_grad(tp: int, sequence_parallel: bool) -> torch.Tensor:
    """This rank's main_grad after two backward passes of a fused VocabParallelEmbedding."""
    topo = Topology.build(tp=tp) if tp > 1 else Topology.single()
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, H, generator=g).to(torch.bfloat16)
    emb = VocabParallelEmbedding(V, H, topology=topo, sequence_parallel=sequence_parallel,
                                 params_dtype=torch.bfloat16)
    emb.load_full(table)
    emb.weight.main_grad = torch.zeros(emb.weight.shape)
    emb.weight.wgrad_fused = True  # as enable_wgrad_fusion leaves it
    emb.enable_main_grad_accumulation()
    for _ in range(2):
        tokens = torch.randint(0, V, (B, S), generator=g)
        tokens[0, :4] = torch.tensor([0, V // 2 - 1, V // 2, V - 1])  # both ranks' edges
        dy = torch.randn(S, B, H, generator=g).to(torch.bfloat16)
        out = emb(tokens)  # [s(/tp), b, h]
        out.backward(dy.chunk(tp, dim=0)[topo.tp_rank] if emb.sequence_parallel else dy)
    return emb.weight.main_grad


def tp2_shards():
    return [fused_embedding_grad(2, sp) for sp in (False, True)]


def test_tp2_main_grad_is_bitwise_the_tp1_shard():
    """Each rank skips the tokens it does not own and sums the rest in the same order as one
    process: its shard of main_grad equals tp=1's rows bit for bit, with and without SP."""
    full = fused_embedding_grad(1, False)
    g = torch.Generator().manual_seed(0)
    torch.randn(V, H, generator=g)
    expected = torch.zeros(V, H, dtype=torch.float64)
    for _ in range(2):
        tokens = torch.randint(0, V, (B, S), generator=g)
        tokens[0, :4] = torch.tensor([0, V // 2 - 1, V // 2, V - 1])
        dy = torch.randn(S, B, H, generator=g).to(torch.bfloat16)
        expected.index_add_(0, tokens.t().reshape(-1), dy.reshape(-1, H).double())
    torch.testing.assert_close(full.double(), expected, rtol=0, atol=1e-5)
    for rank, shards in enumerate(run_distributed(tp2_shards, world_size=2)):
        for shard in shards:
            assert torch.equal(shard, full.chunk(2)[rank])


# ---- a tiny GPT built as the trainer builds it --------------------------------------------

def build_trainer_model(monkeypatch, tied: bool, fuse_embedding: bool = True):
    """The model and its DataParallel wrapper from mtl.train.setup with bf16 weights and fp32
    gradient buffers, the GPT-2 tokenizer's 50257 tokens (padded to 50304 rows); returns them
    with the count enable_wgrad_fusion reported."""
    setup = pytest.importorskip("mtl.train.setup")
    from mtl.core.config_io import load_config
    from mtl.train.testing import TINY

    if not fuse_embedding:  # the embedding outside the contract: its gradient takes the hook's path
        monkeypatch.setattr(VocabParallelEmbedding, "main_grad_accumulation_params", lambda self: [])
    counts = []
    original = setup.enable_wgrad_fusion
    monkeypatch.setattr(setup, "enable_wgrad_fusion", lambda model: counts.append(original(model)) or counts[-1])
    cfg = load_config(None, [*TINY, "train.precision='bf16'", f"model.tie_embeddings={str(tied).lower()}"])
    cfg = cfg.resolve(1, 50257)
    assert cfg.train.params_dtype == "bf16" and cfg.model.padded_vocab_size == 50304
    topology = Topology.single()
    torch.manual_seed(0)
    chunks = setup.build_model_chunks(cfg, topology, torch.device("cpu"))
    (model,) = setup.wrap_data_parallel(cfg, topology, chunks)
    monkeypatch.undo()
    return model, counts


def micro_batches():
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(2):
        tokens = torch.randint(0, 50257, (2, 17), generator=g)
        tokens[:, ::3] = torch.randint(0, 5, (2, 6), generator=g)  # frequent tokens repeat
        tokens[0, 0] = 50256
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


def run_two_micro_batches(model) -> torch.Tensor:
    model.zero_grad()
    first, last = micro_batches()
    with model.no_sync():
        model(first[0], labels=first[1]).float().mean().backward()
    model(last[0], labels=last[1]).float().mean().backward()
    model.finish_grad_sync()
    return model.module.embedding.word_embeddings.weight


def test_trainer_model_embedding_fused_equals_unfused(monkeypatch):
    fused_model, counts = build_trainer_model(monkeypatch, tied=False)
    # 4 layers x 4 linears, the output layer and the word embedding
    assert counts == [18]
    assert fused_model.module.embedding.word_embeddings.accumulates_main_grad
    fused = run_two_micro_batches(fused_model)
    assert fused.wgrad_fused and fused.grad is None
    plain_model, counts = build_trainer_model(monkeypatch, tied=False, fuse_embedding=False)
    assert counts == [17]
    plain = run_two_micro_batches(plain_model)
    assert not getattr(plain, "wgrad_fused", False)
    assert torch.equal(fused.detach(), plain.detach())  # the same initial weights
    scale = plain.main_grad.abs().max()
    assert scale > 0
    # the same sums; the unfused one rounds each micro-batch's gradient to bf16
    torch.testing.assert_close(fused.main_grad, plain.main_grad, rtol=0, atol=1e-2 * scale)
    touched = plain.main_grad.abs().sum(1) > 0
    assert torch.equal(touched, fused.main_grad.abs().sum(1) > 0)  # the rows of the tokens seen
    assert fused.main_grad[50257:].abs().sum() == 0  # padding rows


def test_trainer_model_with_tied_embedding_keeps_the_hooks_path_and_is_right(monkeypatch):
    model, counts = build_trainer_model(monkeypatch, tied=True)
    emb = model.module.embedding.word_embeddings
    assert model.module.output_layer.weight is emb.weight
    assert counts == [16]  # the linears only: neither the table's lookup nor the LM head fuse it
    assert not emb.accumulates_main_grad and not getattr(emb.weight, "wgrad_fused", False)
    weight = run_two_micro_batches(model)
    assert weight.grad is None

    # the fp32 model's autograd gradient from the same (bf16) weights, summed over both micro-batches
    from mtl.core.config_io import load_config
    from mtl.train.setup import build_model_chunks
    from mtl.train.testing import TINY

    cfg = load_config(None, [*TINY, "train.precision='bf16'", "train.params_dtype='fp32'"]).resolve(1, 50257)
    (ref,) = build_model_chunks(cfg, Topology.single(), torch.device("cpu"))
    ref.load_state_dict({k: v.float() for k, v in model.module.state_dict().items()})
    for tokens, labels in micro_batches():
        ref(tokens, labels=labels).float().mean().backward()
    expected = ref.embedding.word_embeddings.weight.grad
    scale = expected.abs().max()
    torch.testing.assert_close(weight.main_grad, expected, rtol=0, atol=2e-2 * scale)
    # the lookup's share of the tied gradient (dropping it would fail the check above)
    outputs = []
    ref.embedding.word_embeddings.register_forward_hook(lambda module, args, out: outputs.append(out) and None)
    ref.zero_grad()
    lookup = torch.zeros_like(expected)
    for tokens, labels in micro_batches():
        ref(tokens, labels=labels).float().mean().backward(inputs=[outputs[-1]])
        lookup.index_add_(0, tokens.t().reshape(-1), outputs[-1].grad.reshape(-1, expected.shape[1]))
    assert lookup.abs().max() > 0.1 * scale
