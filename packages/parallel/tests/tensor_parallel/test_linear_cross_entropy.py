"""The fused LM head + vocab-parallel cross-entropy equals the unfused pair
(``ColumnParallelLinear`` then ``vocab_parallel_cross_entropy``): per-token loss and every
gradient, at tp=1, tp=2 and tp=2 with sequence parallelism, tied to the embedding and not,
with the byte tokenizer's 257 words padded (to 384 at tp=1, 512 at tp=2), in several chunks
and in one, in fp32, under bf16 autocast and with bf16 parameters."""

import pytest
import torch
import torch.distributed as dist

from mtl.parallel.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy
from mtl.parallel.tensor_parallel.linear_cross_entropy import (
    chunk_rows,
    linear_cross_entropy,
    output_layer_cross_entropy,
    supports_fused_cross_entropy,
)
from mtl.parallel.tensor_parallel.sharding import full_from_shards
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology

VOCAB = 257  # the byte tokenizer
S, B, H = 48, 2, 16  # 96 tokens: with chunk_bytes=1, a chunk of 64 and one of 32
FP32 = dict(rtol=1e-5, atol=1e-6)  # fp32: the same sums, in other orders (chunks, ranks)


def padded(tp: int) -> int:
    return -(-VOCAB // (128 * tp)) * 128 * tp


class Head(torch.nn.Module):
    """embedding -> a nonlinearity -> output layer: gradients reach the head's input and,
    tied, one weight from both ends."""

    def __init__(self, topo, tied: bool, sequence_parallel: bool, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.topo = topo
        vp = padded(topo.tp if topo else 1)
        self.embedding = VocabParallelEmbedding(vp, H, topology=topo, sequence_parallel=sequence_parallel,
                                                params_dtype=dtype, device=device)
        self.output_layer = ColumnParallelLinear(H, vp, bias=False, topology=topo, gather_output=False,
                                                 sequence_parallel=sequence_parallel, params_dtype=dtype, device=device)
        if tied:
            self.output_layer.weight = self.embedding.weight

    def load(self, table, head):
        self.embedding.load_full(table)
        if self.output_layer.weight is not self.embedding.weight:
            self.output_layer.load_full(head)

    def forward(self, tokens, labels, fused: bool, chunk_bytes: int, compile: bool = False, save_logits=None):
        hidden = torch.tanh(self.embedding(tokens)) * 3.0  # [s(/tp), b, h]
        if fused:
            return output_layer_cross_entropy(self.output_layer, hidden, labels.t(), vocab_size=VOCAB,
                                              chunk_bytes=chunk_bytes, compile=compile, save_logits=save_logits).t()
        logits = self.output_layer(hidden)
        return vocab_parallel_cross_entropy(logits, labels.t(), self.topo, vocab_size=VOCAB).t()


def data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(padded(2), H, generator=g)  # rows for the largest padding; sliced below
    head = torch.randn(padded(2), H, generator=g) * 0.2
    tokens = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    labels[0, :4] = torch.tensor([0, 255, 256, 128])  # both ranks' edges and the last real word
    weights = torch.rand(B, S, generator=g)
    weights[1, :3] = 0.0  # masked tokens
    return table, head, tokens, labels, weights


def run_head(topo, tied, sequence_parallel, fused, chunk_bytes, dtype=torch.float32, autocast=False, device="cpu",
             compile=False, save_logits=None):
    """Per-token loss and full-shape gradients of the head model (every rank the same)."""
    table, head, tokens, labels, weights = (t.to(device) for t in data())
    tp = topo.tp if topo is not None else 1
    model = Head(topo, tied, sequence_parallel, dtype, device)
    vp = padded(tp)
    model.load(table[:vp].to(dtype), head[:vp].to(dtype))
    fired = []
    model.output_layer.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(tokens, labels, fused, chunk_bytes, compile, save_logits)
    assert loss.shape == (B, S) and loss.dtype == torch.promote_types(dtype, torch.float32)
    (loss * weights).sum().backward()
    assert len(fired) == 1 and torch.equal(fired[0], model.output_layer.weight.grad)  # DDP's hook fires once
    grads = {"output": model.output_layer.weight.grad, "embedding": model.embedding.weight.grad}
    if tp > 1:
        group = topo.tp_group
        for name, g in grads.items():
            shards = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(shards, g.contiguous(), group=group)
            grads[name] = full_from_shards(shards, 0)
    return loss.detach().float().cpu(), {k: v.float()[:VOCAB].cpu() for k, v in grads.items()}, \
        {k: v.float()[VOCAB:].cpu() for k, v in grads.items()}


def compare(a, b, tol):
    loss_a, grads_a, _ = a
    loss_b, grads_b, _ = b
    torch.testing.assert_close(loss_a, loss_b, **tol)
    for name in grads_a:  # absolute tolerance relative to the gradient's scale
        scaled = dict(tol, atol=tol["atol"] * max(1.0, grads_b[name].abs().max().item()))
        torch.testing.assert_close(grads_a[name], grads_b[name], **scaled, msg=lambda m, n=name: f"{n}: {m}")


def test_chunk_rows():
    assert chunk_rows(8192, 50304) == 2048  # the reference model: 4 chunks of 2048 tokens
    assert chunk_rows(100, 384, chunk_bytes=10**9) == 100  # all in one chunk
    assert chunk_rows(100, 384, chunk_bytes=1) == 64  # the smallest chunk is 64 rows
    assert chunk_rows(0, 384) == 1


@pytest.mark.parametrize("tied", [False, True])
def test_fused_equals_unfused_in_one_process(tied):
    ref = run_head(None, tied, False, False, 10**9)
    for chunk_bytes in (1, 10**9):  # chunks of 64 rows (96 tokens: two); and one chunk
        for save_logits in (None, True):  # fp32: recomputed in backward by default; or kept
            out = run_head(None, tied, False, True, chunk_bytes, save_logits=save_logits)
            compare(out, ref, FP32)
            assert all(torch.count_nonzero(g) == 0 for g in out[2].values())  # padding rows: no gradient


def test_fused_in_several_chunks_equals_unfused():
    """More tokens than one chunk holds: 3 chunks of 64 rows + a short one."""
    g = torch.Generator().manual_seed(3)
    n, vocab_padded = 200, 384
    x = torch.randn(n, H, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (torch.randn(vocab_padded, H, generator=g) * 0.5).requires_grad_()
    target = torch.randint(0, VOCAB, (n,), generator=g)
    weights = torch.rand(n, generator=g)
    rows = chunk_rows(n, vocab_padded, chunk_bytes=64 * vocab_padded * 4)
    assert rows == 64
    loss = linear_cross_entropy(x, w, target, vocab_size=VOCAB, chunk_bytes=64 * vocab_padded * 4)
    (loss * weights).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = vocab_parallel_cross_entropy(x2 @ w2.t(), target, None, vocab_size=VOCAB)
    (ref * weights).sum().backward()
    torch.testing.assert_close(loss, ref, **FP32)
    torch.testing.assert_close(x.grad, x2.grad, **FP32)
    torch.testing.assert_close(w.grad, w2.grad, **FP32)
    # and against float64 torch: the loss itself is right, not only equal to the old path
    ref64 = torch.nn.functional.cross_entropy((x.detach().double() @ w.detach().double().t())[:, :VOCAB], target,
                                              reduction="none")
    torch.testing.assert_close(loss.double(), ref64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_autocast_and_bf16_parameters(tied):
    """Under bf16 autocast over fp32 weights the logits GEMM is bf16 in both paths. Logits
    kept, the weight gradient is one GEMM of the bf16 ``dlogits`` with an fp32 result;
    recomputed, it sums per-chunk bf16 products in fp32; the unfused path rounds its one
    product to bf16. All three are near each other, and the kept path's weight gradient is
    at least as near the fp64 one as the unfused path's. With bf16 weights (no autocast) the
    gradients come back in bf16."""
    ref = run_head(None, tied, False, False, 10**9, autocast=True)
    several = run_head(None, tied, False, True, 1, autocast=True)  # logits kept for backward (16-bit)
    compare(several, ref, dict(rtol=2e-2, atol=2e-2))
    torch.testing.assert_close(several[0], ref[0], rtol=1e-5, atol=1e-5)  # the loss: the same arithmetic
    recomputed = run_head(None, tied, False, True, 1, autocast=True, save_logits=False)
    compare(recomputed, several, dict(rtol=2e-2, atol=2e-2))
    torch.testing.assert_close(recomputed[0], several[0], rtol=1e-5, atol=1e-5)
    exact = run_head(None, tied, False, False, 10**9, dtype=torch.float64)
    err = {name: (run[1]["output"].double() - exact[1]["output"]).abs().mean().item()
           for name, run in (("kept", several), ("unfused", ref))}
    assert err["kept"] <= err["unfused"], err
    ref16 = run_head(None, tied, False, False, 10**9, dtype=torch.bfloat16)
    out16 = run_head(None, tied, False, True, 1, dtype=torch.bfloat16)
    compare(out16, ref16, dict(rtol=2e-2, atol=2e-2))
    fp32 = run_head(None, tied, False, False, 10**9)
    compare(out16, fp32, dict(rtol=5e-2, atol=5e-2))  # and both near the fp32 numbers


def tp2_cases(device: str = "cpu"):
    torch.set_num_threads(1)
    topo = Topology.build(tp=2)
    diffs = {}
    for tied in (False, True):
        ref = run_head(None, tied, False, False, 10**9, device=device)  # one process, the unfused path
        for sp in (False, True):
            unfused = run_head(topo, tied, sp, False, 1, device=device)
            for chunk_bytes, save_logits in ((1, False), (1, True), (10**9, None)):
                fused = run_head(topo, tied, sp, True, chunk_bytes, device=device, save_logits=save_logits)
                compare(fused, unfused, FP32)  # the same layout, fused vs not
                compare(fused, ref, FP32)  # and one process
                assert all(torch.count_nonzero(g) == 0 for g in fused[2].values())
                diffs[(tied, sp, chunk_bytes, save_logits)] = (fused[0] - ref[0]).abs().max().item()
    return diffs


def test_fused_at_tp2_and_sequence_parallel_equals_unfused_and_one_process():
    results = run_distributed(tp2_cases, world_size=2)
    assert results[0] == results[1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_fused_at_tp2_on_gpus_with_nccl():
    results = run_distributed(tp2_cases, world_size=2, args=("cuda",), backend="nccl")
    assert results[0] == results[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tied", [False, True])
def test_on_a_gpu_eager_and_compiled_kernels(tied):
    """On CUDA: fp32 (TF32 off) equal to the unfused path; under bf16 autocast close to it;
    the compiled (Triton) chunk kernels give the eager kernels' numbers."""
    from mtl.parallel.tensor_parallel.linear_cross_entropy_kernels import CHUNK_KERNELS

    torch.backends.cuda.matmul.allow_tf32 = False
    for compiled in (False, True):
        ref = run_head(None, tied, False, False, 10**9, device="cuda")
        out = run_head(None, tied, False, True, 1, device="cuda", compile=compiled)
        compare(out, ref, FP32)
        ref = run_head(None, tied, False, False, 10**9, device="cuda", autocast=True)
        out = run_head(None, tied, False, True, 10**9, device="cuda", autocast=True, compile=compiled)
        compare(out, ref, dict(rtol=1e-2, atol=1e-3))
    assert not CHUNK_KERNELS._failed, "torch.compile of the chunk kernels failed"


def padding_only_rank_case():
    """vocab 200 in 512 rows at tp=2: rank 1 holds padding only (no real word)."""
    topo = Topology.build(tp=2)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(30, H, generator=g)
    w = torch.randn(512, H, generator=g) * 0.5
    target = torch.randint(0, 200, (30,), generator=g)
    xr, wr = x.clone().requires_grad_(), w[:200].clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(xr @ wr.t(), target, reduction="none")
    ref.sum().backward()
    xl = x.clone().requires_grad_()
    wl = w.chunk(2)[topo.tp_rank].clone().requires_grad_()
    from mtl.parallel.tensor_parallel import copy_to_tensor_parallel
    loss = linear_cross_entropy(copy_to_tensor_parallel(xl, topo.tp_group), wl, target, group=topo.tp_group,
                                tp_rank=topo.tp_rank, vocab_size=200, chunk_bytes=1)
    loss.sum().backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xl.grad, xr.grad, rtol=1e-5, atol=1e-5)
    if topo.tp_rank == 0:
        torch.testing.assert_close(wl.grad[:200], wr.grad, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(wl.grad[200:] if topo.tp_rank == 0 else wl.grad) == 0
    return "ok"


def test_rank_holding_only_padding():
    assert run_distributed(padding_only_rank_case, world_size=2) == ["ok", "ok"]


def test_which_layers_take_the_fused_path():
    plain = ColumnParallelLinear(H, 128, bias=False)
    assert supports_fused_cross_entropy(plain)
    assert not supports_fused_cross_entropy(ColumnParallelLinear(H, 128, bias=True))

    class Quantized(ColumnParallelLinear):  # e.g. mtl-quant's FP8 layer: its own GEMM
        def local_linear(self, x, weight, bias):
            return super().local_linear(x, weight, bias)

    assert not supports_fused_cross_entropy(Quantized(H, 128, bias=False))
    assert not supports_fused_cross_entropy(torch.nn.Linear(H, 128, bias=False))  # another backend's module
    other = torch.nn.Linear(H, 128, bias=False)
    other.fused_cross_entropy = True  # a backend may declare the contract
    assert supports_fused_cross_entropy(other)
    plain.fused_cross_entropy = False  # and a user may switch it off
    assert not supports_fused_cross_entropy(plain)
    hooked = ColumnParallelLinear(H, 128, bias=False)
    handle = hooked.register_forward_hook(lambda m, a, o: None)  # wants the logits
    assert not supports_fused_cross_entropy(hooked)
    handle.remove()
    assert supports_fused_cross_entropy(hooked)


def test_forward_pre_hooks_run():
    """Data parallelism's overlapped parameter all-gather waits in a forward pre-hook."""
    layer = ColumnParallelLinear(H, 384, bias=False)
    calls = []
    layer.register_forward_pre_hook(lambda m, args: calls.append(args[0].shape))
    hidden = torch.randn(S, B, H)
    labels = torch.randint(0, VOCAB, (S, B))
    output_layer_cross_entropy(layer, hidden, labels, vocab_size=VOCAB)
    assert calls == [(S, B, H)]


def test_no_grad_evaluation():
    layer = ColumnParallelLinear(H, 384, bias=False)
    hidden, labels = torch.randn(S, B, H), torch.randint(0, VOCAB, (S, B))
    with torch.no_grad():
        loss = output_layer_cross_entropy(layer, hidden, labels, vocab_size=VOCAB, chunk_bytes=1)
        ref = vocab_parallel_cross_entropy(layer(hidden), labels, None, vocab_size=VOCAB)
    torch.testing.assert_close(loss, ref, **FP32)


def test_compiled_chunk_kernels_equal_eager():
    """compile=True (what train.compile turns on): the chunk kernels through torch.compile
    (inductor builds them with the machine's C++ compiler on CPU) give the eager numbers."""
    from mtl.parallel.tensor_parallel.linear_cross_entropy_kernels import CHUNK_KERNELS

    g = torch.Generator().manual_seed(5)
    x = torch.randn(100, H, generator=g)
    w = torch.randn(384, H, generator=g) * 0.2
    target = torch.randint(0, VOCAB, (100,), generator=g)
    weights = torch.rand(100, generator=g)
    for save_logits in (False, True):  # recomputed per chunk; kept, dlogits written over them in place
        results = []
        for compiled in (False, True):
            xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
            loss = linear_cross_entropy(xs, ws, target, vocab_size=VOCAB, chunk_bytes=1, compile=compiled,
                                        save_logits=save_logits)
            (loss * weights).sum().backward()
            results.append((loss.detach(), xs.grad, ws.grad))
        assert not CHUNK_KERNELS._failed, "torch.compile of the chunk kernels failed"
        for eager, compiled in zip(*results):
            torch.testing.assert_close(compiled, eager, **FP32)
