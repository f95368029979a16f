"""Prompt-lookup speculative decoding (utils/generation/speculative.py): its drafts, greedy
tokens identical to plain decoding (fp32 and int8, EOS and length limits inside an accepted
draft), several tokens per forward pass where the text repeats, sampled rows and batches of
several rows decoding as before, and the request option's checks."""
from __future__ import annotations

import pytest
import torch

from tests.test_model import build
from utils.generation.engine import Engine, SamplingParams, Sequence
from utils.generation.speculative import NgramIndex
from utils.quant import quantize_int8


def test_the_draft_follows_the_first_occurrence_of_the_longest_suffix():
    idx = NgramIndex(max_n=3, min_n=1)
    ids = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]
    # suffix (2, 6, 7) never occurred; (6, 7) first ended at index 3: the tokens after it
    assert idx.draft(ids, 3) == [8, 9, 1]
    assert idx.draft(ids + [8], 2) == [9, 1]            # (6, 7, 8) now: after its first occurrence
    run = NgramIndex()
    assert run.draft([4, 4, 4, 4], 5) == [4]              # (4, 4, 4) first ended at 3: one token follows
    assert run.draft([4, 4, 4, 4, 4, 4, 4], 5) == [4, 4, 4, 4]
    assert NgramIndex().draft([1, 2, 3], 4) == []          # nothing repeats: no draft
    assert NgramIndex().draft([7], 4) == []
    pauses = []
    for accepted in (0, 0, 0, 0, 0, 0, 2, 0):      # failed drafts pause drafting longer each time
        idx.verified(accepted)
        pauses.append(idx.pause)
    assert pauses == [1, 2, 4, 8, 16, 16, 0, 1]


def _run(engine, prompt, n, slots=1, **params):
    """(tokens, tokens of each step) of one greedy sequence in a batcher of ``slots`` slots."""
    b = engine.batcher(slots, 64)
    seq = b.add(Sequence(prompt, SamplingParams(n, **{"temperature": 0.0, **params})))
    steps = [sum(e.token is not None for e in events if e.seq is seq) for events in engine.run(b)]
    return seq.tokens, steps


PROMPTS = [[1, 40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42, 43, 44],   # repeats itself
           [1, 5, 9, 33, 2, 7, 11],                                    # does not
           [1, 12, 13, 14, 12, 13, 15, 12, 13, 14, 16, 17, 12, 13]]


@pytest.mark.parametrize("int8", [False, True])
def test_greedy_tokens_equal_plain_decoding_with_several_tokens_per_pass(int8):
    m = build(seed=2)
    if int8:
        quantize_int8(m)
    took_several = False
    for prompt in PROMPTS:
        plain, plain_steps = _run(Engine(m), prompt, 40)
        assert set(plain_steps) == {1}
        for k in (1, 3, 8):
            got, steps = _run(Engine(m, prompt_lookup=k), prompt, 40)
            assert got == plain, (prompt, k)
            assert max(steps) <= k + 1
            took_several |= max(steps) > 1
        # the request's own value wins over the engine's: 0 turns it off
        assert _run(Engine(m, prompt_lookup=4), prompt, 40, prompt_lookup=0) == (plain, plain_steps)
        assert _run(Engine(m), prompt, 40, prompt_lookup=4)[0] == plain
    assert took_several          # drafts were accepted: fewer passes than tokens


def test_eos_and_the_length_limit_inside_an_accepted_draft_end_the_row_as_plain_decoding_does():
    m = build(seed=2)
    prompt = PROMPTS[0]
    free, _ = _run(Engine(m), prompt, 40)
    eos = free[5]
    cut = free[:free.index(eos)]
    spec = Engine(m, prompt_lookup=8)
    assert spec.generate([prompt], 40, temperature=0, eos_id=eos) == [cut]
    for n in (1, 2, 7, 13):
        got, steps = _run(spec, prompt, n)
        assert got == free[:n] and sum(steps) == n
    # a cache slot of capacity positions: the draft never writes past it
    for engine in (Engine(m), spec):
        b = engine.batcher(1, len(prompt) + 6)
        seq = b.add(Sequence(prompt, SamplingParams(40, temperature=0)))
        list(engine.run(b))
        assert seq.tokens == free[:7] and seq.finish == "length"     # the prefill's token + 6 positions


def test_sampled_rows_and_batches_of_several_rows_decode_one_token_per_step():
    m = build(seed=2)
    prompt = PROMPTS[0]
    sampled, steps = _run(Engine(m, prompt_lookup=8), prompt, 30, temperature=0.9, seed=5)
    assert set(steps) == {1}
    assert sampled == _run(Engine(m), prompt, 30, temperature=0.9, seed=5)[0]
    spec = Engine(m, prompt_lookup=8)
    alone = [_run(Engine(m), p, 20)[0] for p in PROMPTS]
    assert spec.generate(PROMPTS, 20, temperature=0) == alone


def test_a_negative_prompt_lookup_is_refused():
    with pytest.raises(ValueError, match="prompt_lookup must be >= 0"):
        Engine(build()).batcher(1, 16).add(Sequence([1, 2], SamplingParams(4, prompt_lookup=-1)))


def test_the_verify_pass_writes_the_cache_as_one_token_steps_do():
    """The k+1 positions a verify pass writes hold the keys and values plain steps write."""
    m = build(seed=3)
    prompt = PROMPTS[0]
    caches = []
    for k in (0, 8):
        e = Engine(m, prompt_lookup=k)
        b = e.batcher(1, 64)
        seq = b.add(Sequence(prompt, SamplingParams(20, temperature=0)))
        while b.has_work() and len(seq.tokens) < 12:
            b.step()
        caches.append((seq.pos, [kv[0][0, :, :seq.pos].clone() for kv in b.kv]))
    (p0, k0), (p1, k1) = caches
    n = min(p0, p1)
    for a, b in zip(k0, k1):
        torch.testing.assert_close(a[:, :n], b[:, :n], rtol=1e-5, atol=1e-6)
