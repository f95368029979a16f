"""The prefix cache (utils/generation/prefix_cache.py) in the engine: a prefill over cached KV
gives the full prefill's logits and every sequence its uncached tokens (greedy and seeded,
rows joining and leaving), a finished sequence's output is reused by the next turn, LRU
eviction within the budget never strands a block, changed weights empty the store, scored
prompts and Infini-attention models go without it. Through the server: tests/test_serve.py
(prefix cache cases); infer's chat: tests/test_inference.py."""
from __future__ import annotations

import pytest
import torch

import utils.generation.engine as E
from tests.test_infini import build as build_infini
from tests.test_model import V, build
from utils.generation.engine import Engine
from utils.generation.prefix_cache import PrefixCache

B = 8                                                   # tokens per block in these tests


def _prompts(seed: int = 0) -> list[list[int]]:
    """Prompts sharing a 40-token start at several lengths (block edges and between)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(2, V, (n,), generator=g).tolist()  # noqa: E731
    base = [1] + rand(47)
    return [base[:k] + rand(r) for k, r in ((17, 5), (24, 1), (40, 9), (40, 0), (48, 3), (9, 20))]


def _cached(m, budget: int = 1 << 20) -> Engine:
    eng = Engine(m)
    assert eng.use_prefix_cache(budget, B) is None
    return eng


def _last_logits(eng: Engine, prompt: list[int]) -> tuple[torch.Tensor, int]:
    """The logits a prefill of ``prompt`` samples its first token from, and the tokens it reused."""
    b = eng.batcher(1, 128)
    seq = b.add(E.Sequence(prompt, E.SamplingParams(1, 0.0)))
    got = {}
    real = b._sample
    b._sample = lambda seqs, logits: got.setdefault("x", logits.clone()) is None or real(seqs, logits)
    with torch.no_grad():
        b.step()
    return got["x"][0], seq.cached


def test_a_prefill_over_cached_blocks_gives_the_full_prefill_logits():
    """The rest of a prompt attends over the cached keys with a causal mask aligned to its own
    positions (SDPA's is_causal would align it to the first key): its logits equal a full
    forward pass's to float rounding, and whole blocks (never the last token) are reused."""
    m = build(seed=3, max_seq_len=128)
    eng = _cached(m)
    reused = []
    for p in _prompts():
        logits, n = _last_logits(eng, p)
        with torch.no_grad():
            full = m(torch.tensor([p]))[0][0, -1]
        assert (logits - full).abs().max() < 1e-5, (len(p), n)
        assert n % B == 0 and n <= len(p) - 1
        reused.append(n)
    assert reused == [0, 16, 24, 32, 40, 8]            # (40, 0): 40 tokens, its last block recomputed
    s = eng.prefix_cache.stats()
    assert s["hit_tokens"] == sum(reused) and s["queried_tokens"] == sum(map(len, _prompts()))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batched_rows_with_the_cache_equal_their_uncached_lone_runs(temperature):
    """Sequences that share prefixes join a 3-slot batcher at different steps: each gives the
    tokens of its lone run without the cache (greedy, and seeded sampling with top-k/top-p),
    and the later ones did reuse blocks."""
    m = build(seed=4, max_seq_len=128)
    prompts = _prompts(1) * 2
    params = [E.SamplingParams(6 + i % 5, temperature, top_k=20, top_p=0.9, seed=40 + i,
                               stop_ids=frozenset({7})) for i in range(len(prompts))]
    eng = _cached(m)
    b = eng.batcher(3, 128)
    seqs = []
    with torch.no_grad():
        for step in range(200):
            if step % 2 == 0 and len(seqs) < len(prompts):
                seqs.append(b.add(E.Sequence(prompts[len(seqs)], params[len(seqs)])))
            b.step()
            if len(seqs) == len(prompts) and not b.has_work():
                break
    assert not b.has_work()
    plain = Engine(m)
    for s, p, sp in zip(seqs, prompts, params):
        lone = plain.batcher(1, 128)
        want = lone.add(E.Sequence(p, sp))
        list(plain.run(lone))
        assert (s.tokens, s.finish) == (want.tokens, want.finish)
    assert sum(s.cached for s in seqs[len(prompts) // 2:]) >= 100     # the repeats found their blocks


def test_the_next_turn_reuses_the_previous_answer():
    """A finished sequence's prompt + output is stored, so a prompt that continues it (the next
    chat turn) reuses blocks past the old prompt, and still gets its uncached tokens."""
    m = build(seed=5, max_seq_len=128)
    eng, plain = _cached(m), Engine(m)
    turn = _prompts(2)[2]
    for _ in range(3):
        out = eng.generate([turn], 12, temperature=0)[0]
        assert out == plain.generate([turn], 12, temperature=0)[0]
        before = eng.prefix_cache.hit_tokens
        turn = turn + out + [3, 4, 5]
        _, n = _last_logits(eng, turn)
        assert n == (len(turn) - 4) // B * B               # up to the last full block the slot held
        assert eng.prefix_cache.hit_tokens - before == n


def test_lru_eviction_keeps_the_budget_and_never_strands_a_block():
    m = build(seed=6, max_seq_len=128)
    eng = Engine(m)
    probe = PrefixCache(1 << 20, B)
    probe.bind(m)
    eng.use_prefix_cache(5 * probe.block_bytes + probe.block_bytes // 2, B)      # room for 5 blocks
    store = eng.prefix_cache
    g = torch.Generator().manual_seed(0)
    a, b, c = ([1] + torch.randint(2, V, (31,), generator=g).tolist() for _ in range(3))
    eng.generate([a], 1, temperature=0)                 # a: 4 blocks
    eng.generate([b[:17]], 1, temperature=0)            # b: 2 blocks, one of a's evicted (its last)
    s = store.stats()
    assert (s["blocks_used"], s["blocks_capacity"], s["evicted_blocks"]) == (5, 5, 1)
    assert s["bytes_used"] == 5 * store.block_bytes <= s["bytes_budget"]
    assert _last_logits(eng, a)[1] == 3 * B             # a's first three blocks are left
    eng.generate([c], 1, temperature=0)                 # c: 4 blocks; b (least recent) goes first
    assert _last_logits(eng, b[:17])[1] == 0
    assert _last_logits(eng, c)[1] == 3 * B
    ids = {blk.id for blk in store.blocks.values()}
    assert all(key[0] == 0 or key[0] in ids for key in store.blocks)   # every parent is still there
    assert len(store.blocks) <= 5
    long = [1] + torch.randint(2, V, (70,), generator=g).tolist()
    eng.generate([long], 1, temperature=0)              # longer than the budget: its first 5 blocks
    assert store.stats()["blocks_used"] == 5 and _last_logits(eng, long)[1] == 5 * B


def test_changed_weights_empty_the_store_so_no_prefix_crosses_models():
    """The same prompt after load_state_dict of another model's weights: nothing reused, and
    the other model's own tokens (a stale prefix would give the first model's KV)."""
    m, other = build(seed=7, max_seq_len=128), build(seed=8, max_seq_len=128)
    prompt = _prompts(3)[4]
    run = lambda e: e.generate([prompt], 10, temperature=1.0, seed=11)[0]   # noqa: E731 (greedy: one token)
    want = run(Engine(other))
    eng = _cached(m)
    assert run(eng) != want and eng.prefix_cache.stats()["blocks_used"] > 0
    with torch.no_grad():
        m.load_state_dict(other.state_dict())
    hits = eng.prefix_cache.hit_tokens
    assert run(eng) == want and eng.prefix_cache.hit_tokens == hits
    assert run(eng) == want and eng.prefix_cache.hit_tokens > hits


def test_scored_prompts_are_prefilled_whole_and_infini_models_have_no_cache():
    """prompt_logprobs needs every prompt position's hidden state: such a sequence reuses
    nothing (and scores as without the cache) while a plain one with the same prompt does.
    An Infini-attention model keeps no per-position KV: its engine says why and runs without."""
    m = build(seed=9, max_seq_len=128)
    eng = _cached(m)
    prompt = _prompts(4)[2]
    eng.generate([prompt], 1)
    b = eng.batcher(2, 128)
    scored = b.add(E.Sequence(prompt, E.SamplingParams(3, 0.0, logprobs=2, prompt_logprobs=True)))
    plain = b.add(E.Sequence(prompt, E.SamplingParams(3, 0.0)))
    list(eng.run(b))
    assert scored.cached == 0 and plain.cached == 48 and scored.tokens == plain.tokens
    ref = Engine(m).batcher(1, 128)
    want = ref.add(E.Sequence(prompt, E.SamplingParams(3, 0.0, logprobs=2, prompt_logprobs=True)))
    list(Engine(m).run(ref))
    assert scored.prompt_logprobs == want.prompt_logprobs
    inf = Engine(build_infini(seed=1))
    assert "Infini-attention" in inf.use_prefix_cache(1 << 20, B) and inf.prefix_cache is None
    assert Engine(m).use_prefix_cache(0) is not None    # a budget of 0: off
