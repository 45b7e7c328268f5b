"""The engine against `mtl.models.generate` (one prompt at a time, contiguous KV cache): the same
tokens, greedy and seeded, for dense and MoE models, whatever shares the step; chunked prefill;
stop strings; top-p; log-probabilities; blocks back in the pool after a finish or an abort."""

from __future__ import annotations

import math

import pytest
import torch

from mtl.core.errors import MtlError
from mtl.models.generate import generate
from mtl.serve.engine import Engine, EngineConfig, QueueFull, RequestError
from mtl.serve.kv_cache import BlockManager, parse_kv_memory
from mtl.serve.sampling import SamplingParams

PROMPTS = ["Hello", "a", "The quick brown fox jumps over the lazy dog", "xyz" * 6, "0123456789"]
CPU = torch.device("cpu")


def engine_for(loaded, **config) -> Engine:
    return Engine(loaded, EngineConfig(**{"kv_memory": "2MiB", "block_size": 4, **config}), CPU)


def new_ids(outputs) -> list[int]:
    return [t for out in outputs for t in out.new_ids]


@pytest.mark.parametrize("model", [
    {},  # Llama style: RoPE, RMSNorm, SwiGLU, grouped-query attention
    {"position_embedding": "learned", "normalization": "layernorm", "activation": "gelu", "bias": True},
    {"num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 16},  # MoE (dropless)
], ids=["llama", "gpt2", "moe"])
def test_tokens_equal_generate_greedy_and_seeded(make_model, model):
    loaded = make_model(**model)
    tok = loaded.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    # a small step budget: the long prompts are read in chunks while the short ones decode
    engine = engine_for(loaded, max_step_tokens=6)
    for params in (SamplingParams(max_tokens=12, temperature=0),
                   SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=5)):
        outputs = engine.generate(prompts, [params] * len(prompts))
        for prompt, outs in zip(prompts, outputs):
            expected = generate(loaded.model, prompt, 12, temperature=params.temperature, top_k=params.top_k,
                                eod=tok.eod, seed=params.seed or 0)
            assert new_ids(outs) == expected
            assert "".join(o.text for o in outs) == tok.decode(expected)
    assert engine.blocks.blocks_in_use == 0 and engine.stats()["running"] == 0


def test_abort_frees_blocks_at_once_and_others_continue(make_model):
    loaded = make_model()
    engine = engine_for(loaded)
    prompt = loaded.tokenizer.encode("Hello there")
    keep = engine.add(prompt, SamplingParams(max_tokens=20, temperature=0))
    drop = engine.add(prompt * 3, SamplingParams(max_tokens=20, temperature=0))
    for _ in range(5):
        engine.step()
    held = len(engine.blocks.tables[drop])
    assert held >= math.ceil((len(prompt) * 3 + 4) / 4)
    before = engine.blocks.blocks_in_use
    engine.abort(drop)
    assert engine.blocks.blocks_in_use == before - held
    rest = []
    while engine.has_work:
        rest += engine.step()
    assert {o.request_id for o in rest} == {keep}
    assert engine.blocks.blocks_in_use == 0
    expected = generate(loaded.model, prompt, 20, temperature=0, eod=loaded.tokenizer.eod)
    assert new_ids(rest) == expected[5:]


def test_a_request_without_max_tokens_grows_its_reservation_and_is_preempted_not_others(make_model):
    """A chat without max_tokens may run to the end of the context (64) but reserves only what
    it holds: a bounded request joins it in the first step; when the pool runs dry it is
    preempted, read again once blocks come back, and its seeded tokens are unchanged."""
    loaded = make_model()
    tok = loaded.tokenizer
    engine = engine_for(loaded, kv_memory=str(21 * 1024))  # 20 blocks of 4 tokens; one context is 16
    assert engine.blocks.num_blocks == 20
    unbounded = SamplingParams(max_tokens=None, temperature=0.9, seed=5, ignore_eos=True)
    bounded = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    short, long = tok.encode("Hello"), tok.encode("The quick brown fox")
    outputs = {engine.add(short, unbounded): [], engine.add(long, bounded): []}
    steps = 0
    while engine.has_work:
        for out in engine.step():
            outputs[out.request_id].append(out)
        steps += 1
        if steps == 1:  # 3 + 15 blocks reserved (its tokens and a block ahead): both run; a context would leave 4
            assert engine.stats()["running"] == 2
    assert engine.scheduler.preemptions >= 1
    chat, plain = outputs.values()
    assert new_ids(chat) == generate(loaded.model, short, 64 - len(short), temperature=0.9, seed=5)
    assert "".join(o.text for o in chat) == tok.decode(new_ids(chat))
    assert chat[-1].finish_reason == "length"
    assert new_ids(plain) == generate(loaded.model, long, 40, temperature=0)
    assert engine.blocks.blocks_in_use == 0 and engine.blocks.unreserved == 20


def test_stop_strings_top_p_and_logprobs(make_model):
    loaded = make_model()
    tok = loaded.tokenizer
    engine = engine_for(loaded)
    prompt = tok.encode("Hello")
    greedy = generate(loaded.model, prompt, 10, temperature=0, eod=tok.eod)
    text = tok.decode(greedy)
    stop = text[3:5]
    [outs] = engine.generate([prompt], [SamplingParams(max_tokens=10, temperature=0, stop=(stop,), logprobs=3)])
    assert "".join(o.text for o in outs) == text[: text.index(stop)]
    assert outs[-1].finish_reason == "stop"
    with torch.no_grad():
        logits = loaded.model(torch.tensor([prompt]))[0, -1, : loaded.config.model.vocab_size].float()
    first = outs[0].logprobs[0]
    assert first.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[greedy[0]]), abs=1e-5)
    assert list(first.top)[0] == greedy[0] and len(first.top) == 3
    # top_p this small keeps only the most likely token: sampling is then greedy
    [nucleus] = engine.generate([prompt], [SamplingParams(max_tokens=10, temperature=1.0, top_p=1e-6, seed=1)])
    assert new_ids(nucleus) == greedy


def test_requests_are_checked_before_they_queue(make_model):
    loaded = make_model()
    engine = engine_for(loaded, max_waiting=1)
    with pytest.raises(RequestError) as err:
        engine.add([1] * 64, SamplingParams())
    assert err.value.param == "prompt" and "context of 64" in str(err.value)
    with pytest.raises(RequestError) as err:
        engine.add([1] * 10, SamplingParams(max_tokens=60))
    assert err.value.param == "max_tokens"
    with pytest.raises(RequestError) as err:
        engine.add([1], SamplingParams(top_p=0))
    assert err.value.param == "top_p"
    engine.add([1], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFull):
        engine.add([1], SamplingParams(max_tokens=2))


def test_block_manager_and_kv_memory(make_model):
    blocks = BlockManager(num_blocks=6, block_size=4)
    assert blocks.can_reserve(24) and not blocks.can_reserve(25)
    blocks.reserve(0, 10)  # 3 blocks reserved, none held yet
    assert blocks.blocks_in_use == 0 and blocks.unreserved == 3
    assert len(blocks.grow(0, 5)) == 2 and blocks.blocks_in_use == 2
    assert blocks.slots(0, 3, 6) == [blocks.tables[0][0] * 4 + 3, blocks.tables[0][1] * 4, blocks.tables[0][1] * 4 + 1]
    with pytest.raises(RuntimeError):
        blocks.grow(0, 13)
    blocks.free(0)
    assert blocks.blocks_in_use == 0 and blocks.unreserved == 6
    assert parse_kv_memory("0.9") == ("fraction", 0.9)
    assert parse_kv_memory("64MiB") == ("bytes", 64 * 2**20)
    assert parse_kv_memory("2GB") == ("bytes", 2e9)
    with pytest.raises(MtlError, match="--kv-memory 'lots'"):
        parse_kv_memory("lots")
    with pytest.raises(MtlError, match="give a size"):
        engine_for(make_model(), kv_memory="0.5")


def test_compiled_decode_step_gives_generate_tokens(make_model):
    """Decode steps through torch.compile (inductor here; on CUDA the same graph is replayed as a
    CUDA graph) give `mtl.models.generate`'s tokens. One request inside one block meets a single
    (batch, table width) bucket: one compilation, the slow part of this test on a CPU."""
    import torch._inductor.config
    from torch._dynamo.utils import counters

    loaded = make_model()
    engine = engine_for(loaded, block_size=16, compile=True)
    assert engine.runner.decode.compiled
    prompt = loaded.tokenizer.encode("Hello")
    graphs = counters["stats"]["unique_graphs"]
    # no worker pool to start on shared cores; config.patch, not monkeypatch: undoing a monkeypatch
    # of an inductor config entry hides it ("compile_threads does not exist"), failing later compiles
    with torch._inductor.config.patch(compile_threads=1):
        [outs] = engine.generate([prompt], [SamplingParams(max_tokens=10, temperature=0)])
    assert new_ids(outs) == generate(loaded.model, prompt, 10, temperature=0, eod=loaded.tokenizer.eod, seed=0)
    assert counters["stats"]["unique_graphs"] == graphs + 1  # the decode steps ran the compiled graph


def test_decode_buckets_pad_to_powers_of_two(make_model):
    """A decode step pads its batch and table width to buckets; padding rows write only the
    scratch block, past the blocks the manager hands out."""
    from mtl.serve.decode import bucket, decode_buckets

    assert [bucket(n) for n in (1, 2, 3, 5, 16, 17, 64)] == [1, 2, 4, 8, 16, 32, 64]
    assert decode_buckets(max_batch=5, max_blocks=6) == [(b, w) for b in (1, 2, 4, 8) for w in (1, 2, 4, 6)]
    engine = engine_for(make_model())
    assert engine.runner.pool.keys[0].shape[0] == (engine.blocks.num_blocks + 1) * 4
    assert engine.runner.decode.scratch_block == engine.blocks.num_blocks


def test_decode_warm_up_touches_only_the_scratch_block(make_model):
    """`mtl serve --compile` runs every decode bucket once before serving: on the scratch block
    alone, so the cache slots requests own stay as they were and no block leaves the pool."""
    from mtl.serve.decode import decode_buckets

    engine = engine_for(make_model(), max_batch=5)
    pool, scratch = engine.runner.pool, engine.runner.decode.scratch_block * 4
    for cache in (*pool.keys, *pool.values):
        cache.normal_()
        cache[scratch:] = 0
    before = [cache[:scratch].clone() for cache in (*pool.keys, *pool.values)]
    ran = engine.runner.decode.warm_up(5)
    assert ran == len(decode_buckets(5, engine.blocks.blocks_for(engine.context_length))) == 4 * 5
    assert all(torch.equal(cache[:scratch], old) for cache, old in zip((*pool.keys, *pool.values), before))
    assert pool.keys[0][scratch:].abs().sum() > 0  # the warm-up's keys went there
    assert engine.blocks.blocks_in_use == 0


def test_a_preempted_request_takes_no_place_in_the_queue(make_model):
    """The server promised a request a place when it took it; a preemption must not use that
    place, or the request would end later with no tokens instead of an early 429."""
    loaded = make_model()
    tok = loaded.tokenizer
    engine = engine_for(loaded, kv_memory=str(21 * 1024), max_waiting=1)  # 20 blocks of 4 tokens
    chat = SamplingParams(max_tokens=None, temperature=0.9, seed=5, ignore_eos=True)
    outputs = {engine.add(tok.encode("Hello"), chat): []}
    engine.step()
    outputs[engine.add(tok.encode("The quick"), chat)] = []
    while not engine.scheduler.preemptions:  # two chats growing towards 16 blocks each: one is preempted
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert engine.stats()["waiting"] == 1 and not engine.scheduler.queue_full()
    late = engine.add(tok.encode("a"), SamplingParams(max_tokens=3, temperature=0))
    outputs[late] = []
    while engine.has_work:
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert new_ids(outputs[late]) == generate(loaded.model, tok.encode("a"), 3, temperature=0, eod=tok.eod)
    for rid in list(outputs)[:2]:
        assert outputs[rid][-1].finish_reason == "length" and len(new_ids(outputs[rid])) > 40


def test_a_request_read_again_after_a_preemption_decodes_a_block_before_it_grows():
    """A chat preempted with 8 tokens (2 blocks of 4) is read again only when 3 blocks are free:
    admitted into exactly 2, its next decode (token 9) would need a third and preempt it again,
    a re-read per token while blocks come back one at a time. The scheduler alone, with the
    engine's bookkeeping of a step (blocks grown to what is read, a token sampled per step)."""
    from mtl.serve.scheduler import Scheduler, Sequence

    blocks = BlockManager(num_blocks=5, block_size=4)
    scheduler = Scheduler(blocks, max_batch=4, max_step_tokens=64, max_waiting=4)
    chat = Sequence(1, [1] * 5, SamplingParams(max_tokens=None), 59, torch.Generator(), None, output_ids=[2, 3, 4])
    blocks.reserve(0, 12)  # a bounded request holds 3 blocks: 2 are free
    scheduler.running.append(chat)  # it ran, and is preempted
    scheduler._preempt(chat)
    assert chat.prefill_len == 8 and scheduler.schedule() == []  # 2 free blocks: it waits
    blocks.free(0)
    assert scheduler.schedule() == [(chat, 8)] and blocks.unreserved == 2
    blocks.reserve(2, 8)  # another request takes the 2 blocks left
    steps = [(chat, 8)]
    for _ in range(4):  # tokens 9 to 12 fit its 3 blocks: no preemption
        for seq, count in steps:
            blocks.grow(seq.id, seq.cached + count)
            seq.cached += count
            seq.output_ids.append(0)
        steps = scheduler.schedule()
        assert steps == [(chat, 1)]
    assert scheduler.preemptions == 1
