"""The generation engine (utils/generation/engine.py) over the network: KV cache against full
recompute, EOS, batching against one by one, the CPU decode weights, seeded sampling,
filters, bad requests, bf16, incremental detokenization."""
from __future__ import annotations

import pytest
import torch

import utils.generation.engine as E
import utils.generation.pack as pack_module
from tests.test_model import V, build
from utils.generation.detok import TextDecoder, TextStream
from utils.generation.engine import Engine

def _greedy_without_cache(m, prompt, n, eos=None):
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n):
            t = int(m(torch.tensor([ids]))[0][0, -1].argmax())
            if t == eos:
                break
            out.append(t)
            ids.append(t)
    return out


def test_kv_cache_generation_equals_full_recompute():
    m = build(seed=2)
    prompt = [1, 5, 9, 33, 2, 7]
    want = _greedy_without_cache(m, prompt, 20)
    assert Engine(m).generate([prompt], 20, temperature=0) == [want]
    assert list(Engine(m).stream(prompt, 20, temperature=0)) == want
    # beyond max_seq_len the RoPE table grows instead of failing
    long = Engine(m).generate([prompt], 70, temperature=0)[0]
    assert len(long) == 70 and long[:20] == want


def test_eos_stops_and_is_not_returned():
    m = build(seed=2)
    prompt = [1, 5, 9, 33]
    free = _greedy_without_cache(m, prompt, 12)
    eos = free[4]
    cut = free[:free.index(eos)]
    assert Engine(m).generate([prompt], 12, temperature=0, eos_id=eos) == [cut]
    assert list(Engine(m).stream(prompt, 12, temperature=0, eos_id=[eos, 96])) == cut
    assert Engine(m).generate([prompt], 0) == [[]]


def test_batched_generation_equals_one_by_one():
    m = build(seed=4)
    prompts = [[1, 8, 20, 30, 40, 50, 60], [1, 3], [1, 70, 71, 72], [9]]
    singles = [Engine(m).generate([p], 15, temperature=0)[0] for p in prompts]
    assert Engine(m).generate(prompts, 15, temperature=0) == singles
    # an EOS in one row ends that row only
    eos = singles[1][3]
    batched = Engine(m).generate(prompts, 15, temperature=0, eos_id=eos)
    for got, single in zip(batched, singles):
        assert got == (single[:single.index(eos)] if eos in single else single)


@pytest.mark.parametrize("tie,act", [(True, "swiglu"), (False, "geglu")])
def test_cpu_decode_pack_follows_the_weights(monkeypatch, tie, act):
    """fp32 generation on CPU multiplies by a transposed copy of the weights kept between
    calls: it must agree with the Linear path, be rebuilt after any in-place change of the
    weights, and not outlive a call made in training mode."""
    m = build(seed=7, tie_embeddings=tie, activation=act)
    eng = Engine(m)
    prompts = [[1, 5, 9, 11], [1, 2]]
    gen = lambda n=12: eng.generate(prompts, n, temperature=1.0, seed=3)  # noqa: E731 (tied greedy repeats)
    packed = gen()
    pack = eng._pack
    assert pack is not None and len(pack.layers) == 2
    assert gen() == packed and eng._pack is pack      # reused
    with monkeypatch.context() as mp:
        mp.setattr(pack_module, "DECODE_PACK_MAX_BYTES", 0)                          # over the cap
        assert gen() == packed and eng._pack is None  # Linear path
    eng.generate(prompts, 1)
    other = build(seed=8, tie_embeddings=tie, activation=act)
    want = Engine(other).generate(prompts, 12, temperature=1.0, seed=3)
    assert want != packed                                   # the swap below must show
    m.load_state_dict(other.state_dict())                   # in place, like an optimizer step
    assert gen() == want
    m.train()
    assert gen(3) == [w[:3] for w in want]
    assert eng._pack is None and m.training                 # training: weights move on


def test_seeded_sampling_is_reproducible_and_leaves_global_rng_alone():
    m = build(seed=5)
    prompts = [[1, 2, 3], [1, 4]]
    state = torch.get_rng_state()
    a = Engine(m).generate(prompts, 25, temperature=1.0, top_k=20, top_p=0.9, seed=123)
    assert torch.equal(state, torch.get_rng_state())
    b = Engine(m).generate(prompts, 25, temperature=1.0, top_k=20, top_p=0.9, seed=123)
    c = Engine(m).generate(prompts, 25, temperature=1.0, top_k=20, top_p=0.9, seed=124)
    assert a == b and a != c
    assert list(Engine(m).stream(prompts[0], 25, temperature=1.0, seed=7)) == \
        Engine(m).generate([prompts[0]], 25, temperature=1.0, seed=7)[0]


def test_top_k_and_top_p_filters():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    inf = float("-inf")
    assert E.top_k_filter(logits, 2).tolist() == [[inf, 4.0, 3.0, inf, inf]]
    assert torch.equal(E.top_k_filter(logits, 0), logits)
    assert torch.equal(E.top_p_filter(logits, 1.0), logits)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    lp = p.log()
    # 0.5 < 0.6 so the second token is needed; 0.8 >= 0.6 so the rest go
    assert torch.isinf(E.top_p_filter(lp, 0.6)).tolist() == [[False, False, True, True]]
    assert torch.isinf(E.top_p_filter(lp, 0.5)).tolist() == [[False, True, True, True]]
    assert torch.isinf(E.top_p_filter(lp, 0.01)).tolist() == [[False, True, True, True]]
    # shuffled order is filtered by probability, not position
    assert torch.isinf(E.top_p_filter(lp[:, [3, 1, 0, 2]], 0.6)).tolist() == [[True, False, False, True]]
    # sampling never picks a filtered token
    g = torch.Generator().manual_seed(0)
    picks = set(E.sample_next(logits.repeat(200, 1), 1.0, top_k=2, generator=g).tolist())
    assert picks == {1, 2}
    assert E.sample_next(logits, 0.0).tolist() == [1]


def test_generation_rejects_bad_requests():
    m = build()
    with pytest.raises(ValueError, match="empty"):
        Engine(m).generate([[]], 3)
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(m).generate([[V]], 3)
    with pytest.raises(ValueError, match="top_p"):
        Engine(m).generate([[1]], 3, top_p=0.0)



@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_logits_that_overflow_are_a_named_error_not_a_token(temperature):
    """Finite weights near float32's limit (3e38) overflow to inf, then NaN logits: greedy
    argmax would pick a NaN's index and sampling failed inside torch.multinomial; the engine
    raises NonFiniteLogits saying what happened (infer, benchmark and serve name the model)."""
    m = build()
    with torch.no_grad():
        m.norm.weight.fill_(3e38)
    with pytest.raises(E.NonFiniteLogits, match="not finite .* overflows"):
        Engine(m).generate([[1, 5, 9]], 3, temperature=temperature)

def test_bf16_generation_on_cpu():
    m = build(seed=6).to(torch.bfloat16)
    out = Engine(m).generate([[1, 2, 3], [4]], 8, temperature=0)
    assert [len(o) for o in out] == [8, 8]
    assert m.rope(4, torch.device("cpu"))[0].dtype == torch.float32


def test_generation_leaves_the_global_thread_count_alone():
    """Small steps run on one thread (step_threads), restored between steps: the caller's
    code between streamed tokens, and everything after, sees its own thread count."""
    m = build(seed=1)
    before = torch.get_num_threads()
    seen = []
    for _ in Engine(m).stream([1, 2, 3], 5, temperature=0):
        seen.append(torch.get_num_threads())
    assert seen and set(seen) == {before} and torch.get_num_threads() == before
    eng = Engine(m, threads=1)
    assert eng.step_threads(10_000, 10 ** 9) == 1 and Engine(m).step_threads(1, 10) == 1
    assert Engine(m).step_threads(10_000, 10 ** 9) is None


def test_text_decoder_never_cuts_a_character(samples):
    """Byte-fallback pieces of a multi-byte character come out whole: no piece holds U+FFFD,
    some pushes hold text back, and the pieces join to the full decode."""
    from tests.conftest import SPM_MODEL
    from utils.data.tok import encode_plain, load_tokenizer_from
    tok = load_tokenizer_from(str(SPM_MODEL))
    text = "Plain words, then 日本語 and an emoji 😀🧪 and café."
    ids = encode_plain(tok, [text])[0]
    dec = TextDecoder(tok)
    pieces = [dec.push(t) for t in ids]
    pieces.append(dec.finish())
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)
    assert pieces.count("") >= 3          # the emoji's byte tokens wait for the last one
    assert dec.finish() == ""


def test_text_decoder_keeps_shown_text_when_the_reply_ends_inside_a_character(samples):
    """A reply cut (max_tokens) after a newline byte token and two of an emoji's four byte
    tokens: the full decode renders the three byte tokens as one U+FFFD each, rewriting the
    newline already shown. The pieces keep the newline and add the unfinished bytes' own text;
    they repeated the whole reply after a newline before."""
    from tests.conftest import SPM_MODEL
    from utils.data.tok import load_tokenizer_from
    tok = load_tokenizer_from(str(SPM_MODEL))
    ids = tok.convert_tokens_to_ids(["\u2581Hi", "<0x0A>", "<0xF0>", "<0x9F>"])
    assert tok.decode(ids) == "Hi\ufffd\ufffd\ufffd"          # what the rewrite looks like
    for prefix in ([], tok.convert_tokens_to_ids(["\u2581Well"])):
        dec = TextDecoder(tok, prefix)
        pieces = [dec.push(t) for t in ids]
        assert pieces == ["Hi" if not prefix else " Hi", "\n", "", ""]
        assert dec.finish() == "\ufffd\ufffd"
        assert dec.finish() == "" and dec.shown == "".join(pieces) + "\ufffd\ufffd"


def test_a_temperature_too_small_for_float32_is_greedy_and_fails_no_other_row():
    """temperature 1e-300 (or 5e-324) made logits / T infinite and the softmax NaN: the engine
    step raised, ending every sequence of the batch with an error. Below GREEDY_BELOW it is
    the greedy limit, and the rows beside it keep their own lone-run tokens."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 30
    for t in (1e-300, 5e-324, 1e-21):
        assert torch.equal(E.sample_next(logits, t, generator=g), logits.argmax(dim=-1))
    m = build(seed=3)
    tiny = ([1, 2, 3], E.SamplingParams(12, 1e-300, seed=5))
    other = ([4, 5], E.SamplingParams(12, 0.9, top_p=0.9, seed=6))
    b = Engine(m).batcher(2, 64)
    rows = [b.add(E.Sequence(p, params)) for p, params in (tiny, other)]
    while b.has_work():
        assert not [e for e in b.step() if e.finish == "error"]
    assert (rows[0].tokens, rows[0].finish) == _lone(m, ([1, 2, 3], E.SamplingParams(12, 0.0)))
    assert (rows[1].tokens, rows[1].finish) == _lone(m, other)


# --------------------------------------------------------------------------- continuous batching
def _lone(m, seq_args):
    """What one sequence gives alone in its own one-slot batcher."""
    prompt, params = seq_args
    b = Engine(m).batcher(1, 64)
    s = b.add(E.Sequence(prompt, params))
    while b.has_work():
        b.step()
    return s.tokens, s.finish


@pytest.mark.parametrize("threads", [None, 2])
def test_continuous_batching_rows_join_and_leave_and_equal_their_lone_runs(threads):
    """10 sequences on 3 slots, added at different steps, greedy and seeded sampling with
    their own settings and lengths: each gives exactly its lone run's tokens; sequences wait
    for a slot instead of failing; finished ones free their slot for the queue. Steps of 2 or
    more rows take the head's oneDNN copy; with 2 threads the decode weights are in panels."""
    m = build(seed=4)
    P = E.SamplingParams
    jobs = [([1, 5, 9, 11][: 1 + i % 4] + [i + 2], P(5 + (i * 3) % 11, temperature=0.0 if i % 3 == 0 else 0.9,
                                                  top_k=(0, 20)[i % 2], top_p=(1.0, 0.8)[i % 2], seed=50 + i,
                                                  stop_ids=frozenset({7})))
            for i in range(10)]
    eng = Engine(m, threads=threads)
    b = eng.batcher(3, 64)
    seqs, joined_late, max_running = [], 0, 0
    with torch.no_grad():
        for step in range(400):
            if step % 2 == 0 and len(seqs) < len(jobs):      # one new request every other step
                seqs.append(b.add(E.Sequence(*jobs[len(seqs)])))
                joined_late += bool(b.running)
            b.step()
            max_running = max(max_running, len(b.running))
            assert len(b.running) <= 3 and [s.slot for s in b.running] == list(range(len(b.running)))
            if len(seqs) == len(jobs) and not b.has_work():
                break
    assert not b.has_work() and joined_late >= 5 and max_running == 3
    pack = eng.decode_pack()
    assert pack.head_rows is not None and (pack.layers[0].qkv.dim() == 3) == (threads == 2)
    for s, job in zip(seqs, jobs):
        assert (s.tokens, s.finish) == _lone(m, job)
        assert s.finish in ("stop", "length") and 7 not in s.tokens


def test_cancel_frees_the_slot_at_the_next_step():
    m = build(seed=4)
    b = Engine(m).batcher(1, 64)
    a = b.add(E.Sequence([1, 2], E.SamplingParams(40, temperature=0)))
    w = b.add(E.Sequence([1, 3], E.SamplingParams(3, temperature=0)))
    b.step()
    assert b.running == [a] and list(b.waiting) == [w]           # w waits for the only slot
    a.cancelled = True
    events = b.step()
    assert a.finish == "cancelled" and a.slot is None and w in b.running
    assert [e.finish for e in events if e.seq is a] == ["cancelled"]
    with pytest.raises(ValueError, match="slot holds 64"):
        b.add(E.Sequence(list(range(1, 65)), E.SamplingParams(3)))


def test_stop_strings_never_reach_the_text_even_across_tokens(samples):
    from tests.conftest import SPM_MODEL
    from utils.data.tok import encode_plain, load_tokenizer_from
    tok = load_tokenizer_from(str(SPM_MODEL))
    text = "The quick brown fox jumps over the lazy dog."
    ids = encode_plain(tok, [text])[0]
    for stop in ("k bro", "fox", "lazy dog.", "o", "dog. and more"):
        ts = TextStream(tok, [stop, "@@"])
        out, hit = "", False
        for t in ids:
            piece, hit = ts.push(t)
            out += piece
            assert stop not in out
            if hit:
                break
        if not hit:
            out += ts.finish()
        want = text[:text.find(stop)] if stop in text else text
        assert (out, hit) == (want, stop in text), stop


def test_text_made_by_the_caller_equals_the_engine_s_own(samples):
    """``Sequence(text_by_caller=True)`` (serve): the events carry no text, and the caller's
    pushes of their tokens (and ``finish()`` at the end) give the engine's own pieces, event by
    event, over sampled byte-fallback tokens (characters held back, replies cut inside one),
    prompt continuations, a lead, EOS and max_tokens. With a stop string the engine keeps the
    text: it decides when the sequence ends."""
    from tests.conftest import SPM_MODEL
    from utils.data.tok import load_tokenizer_from
    tok = load_tokenizer_from(str(SPM_MODEL))
    m = build(seed=3, vocab_size=600)          # ids 3..258 are the byte tokens: broken characters
    P = E.SamplingParams

    def run(by_caller: bool) -> dict:
        b, pieces = Engine(m).batcher(3, 64), {}

        def sink(e):
            own = e.seq.caller_text
            if own is None:
                piece = e.text
            else:
                assert e.text == ""
                piece = own.push(e.token)[0] if e.token is not None else ""
                piece += own.finish() if e.finish not in (None, "cancelled", "error") else ""
            pieces.setdefault(e.seq.tag, []).append(piece)
        for i in range(8):
            b.add(E.Sequence([1, 300 + i, 140 + 7 * i], P(6 + 5 * i, temperature=1.0, seed=i, stop_ids=frozenset({2})),
                             tok=tok, sink=sink, tag=i, continues=i % 2 == 0, lead=" " if i % 3 == 0 else "",
                             text_by_caller=by_caller))
        with torch.no_grad():
            while b.has_work():
                b.step()
        return pieces
    own, caller = run(False), run(True)
    assert caller == own and len(own) == 8
    assert sum(p == "" for ps in own.values() for p in ps[:-1]) >= 3      # characters were held back
    assert any("\ufffd" in "".join(ps) for ps in own.values())          # and some never completed
    with_stop = E.Sequence([1, 5], P(4, stop=("ab",)), tok=tok, text_by_caller=True)
    assert with_stop.text is not None and with_stop.caller_text is None


@pytest.mark.cuda
def test_int8_on_cuda_generates_within_int8_rounding_of_fp32():
    """``quantize_int8`` on CUDA: torchao's Int8WeightOnlyConfig where torchao imports (pinned in
    requirements-gpu.txt), else the per-channel int8 modules dequantized per product; either
    way the logits stay within int8 rounding of the fp32 model's, and the engine decodes."""
    import copy
    from utils.quant import quantize_int8
    m = build(seed=9).cuda()
    idx = torch.randint(0, V, (2, 16), device="cuda")
    with torch.no_grad():
        ref = m(idx)[0]
        q = copy.deepcopy(m)
        line = quantize_int8(q).line()
        got = q(idx)[0]
    assert (got.float() - ref).abs().max() < 0.05 * ref.abs().max(), line
    assert len(Engine(q).generate([[1, 2, 3]], 8, temperature=0)[0]) == 8
    try:
        import torchao  # noqa: F401
    except ImportError:
        assert "dequantized per product" in line, line
    else:
        assert "torchao" in line, line


def test_int8_generation_uses_the_fused_weights_and_batches_exactly():
    """A quantize_int8 model decodes with its fused int8 matrices (views of the modules'
    weights, no copy), agrees with a full recompute through the modules, and each row of a
    batch equals its lone run (seeded sampling)."""
    from utils.quant import quantize_int8
    m = build(seed=4)
    quantize_int8(m)
    eng = Engine(m)
    prompt = [1, 5, 9, 33, 2, 7]
    assert eng.generate([prompt], 20, temperature=0) == [_greedy_without_cache(m, prompt, 20)]
    pack, attn = eng._pack, m.layers[0].attn
    assert pack.key == ("int8",) and pack.layers[0].qkv.qweight.data_ptr() == attn.wq.qweight.data_ptr()
    assert attn.wk.qweight.data_ptr() == attn.wq.qweight.data_ptr() + attn.wq.qweight.numel()
    prompts = [[1, 8, 20, 30], [1, 3], [1, 70, 71, 72, 73, 74], [9]]
    singles = [Engine(m).generate([p], 15, temperature=0.9, seed=20 + r)[0] for r, p in enumerate(prompts)]
    assert eng.generate(prompts, 15, temperature=0.9, seed=20) == singles


def test_text_decoder_decodes_a_window_not_the_whole_text(samples):
    """Random ids (byte-fallback ones included), with and without a prefix: the pieces join to
    the full decode, and no push decodes more than a few tokens (a whole-text decode per
    token is quadratic: 25 s for a 4,000-token reply)."""
    import random
    from tests.conftest import SPM_MODEL
    from utils.data.tok import load_tokenizer_from
    tok = load_tokenizer_from(str(SPM_MODEL))
    sizes = []

    class Counting:
        def decode(self, ids, **kw):
            sizes.append(len(ids))
            return tok.decode(ids, **kw)
    rng = random.Random(0)
    for prefix in ([], [rng.randrange(3, len(tok))]):
        ids = [rng.randrange(3, len(tok)) for _ in range(600)]
        dec = TextDecoder(Counting(), prefix)
        pieces = [dec.push(t) for t in ids]
        assert max(sizes) <= 12, max(sizes)
        assert "".join(pieces) + dec.finish() == dec.text()
        sizes.clear()


# --------------------------------------------------------------------------- CPU products, threads
def test_greedy_is_torch_argmax_ties_and_nan_included():
    """utils/generation/cpu.py greedy (NumPy's argmax on CPU fp32) picks what torch.argmax picks:
    the first of tied maxima, a NaN as the maximum; other dtypes go to torch."""
    from utils.generation.cpu import greedy
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g)
    logits[1, [10, 500, 900]] = 50.0                         # a tie: the first wins
    logits[2, 7] = float("nan")
    logits[3] = 0.0                                          # all equal
    logits[4, -1] = float("inf")
    want = logits.argmax(dim=-1).tolist()
    assert greedy(logits) == want and want[1:5] == [10, 7, 0, 999]
    assert greedy(logits.to(torch.bfloat16)) == logits.to(torch.bfloat16).argmax(dim=-1).tolist()


def test_rows_product_and_panels_equal_the_plain_product():
    from utils.generation import cpu
    if not cpu.onednn_linear_available():
        pytest.skip("this PyTorch build has no oneDNN linear on CPU (the engine then uses MKL's product)")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1000, 64, generator=g)                   # (out, in) as a Linear's weight
    rows = cpu.RowsProduct(w)
    assert rows.bytes == w.numel() * 4
    for n in (2, 3, 8, 13):
        x = torch.randn(n, 64, generator=g)
        torch.testing.assert_close(rows(x), x @ w.t(), rtol=1e-5, atol=1e-5)
    wt = w.t().contiguous()                                  # (in, out)
    x = torch.randn(3, 64, generator=g)
    for p in (1, 2, 4, 3):                                   # 3 does not divide 1000: the plain matrix
        packed = cpu.panels(wt, p)
        assert packed.dim() == (3 if p in (2, 4) else 2)
        torch.testing.assert_close(cpu.panel_mm(x, packed), x @ wt, rtol=1e-5, atol=1e-5)


def test_int8_product_takes_rows_of_any_layout():
    """``int8_mm`` on rows that are not contiguous (the kernel's input must be) equals it on
    their contiguous copy."""
    from utils.quant import Int8Weight, int8_mm
    g = torch.Generator().manual_seed(3)
    w = Int8Weight.quantize(torch.randn(96, 64, generator=g))
    xs = torch.randn(64, 4, generator=g).t()
    assert not xs.is_contiguous()
    assert torch.equal(int8_mm(xs, w), int8_mm(xs.contiguous(), w))


def test_step_threads_rule():
    """One thread for a small model's small step, all of torch's for big ones; a given count
    always wins; the fp32 decode weights come in as many panels as a one-token step's threads."""
    m = build(seed=1)
    eng = Engine(m)
    assert eng.step_threads(1, 10 ** 6) == 1 and eng.step_threads(8, 1 << 25) == 1
    assert eng.step_threads(9, 1 << 25) is None            # > 2^28 multiply-adds
    assert eng.step_threads(1, 1 << 26) is None            # a 64M-weight model: every step
    assert Engine(m, threads=3).step_threads(1, 10) == 3
    assert eng.pack_panels() == 1 and Engine(m, threads=2).pack_panels() == 2
    assert eng.decode_pack().layers[0].qkv.dim() == 2
    assert Engine(m, threads=2, product="torch").decode_pack().layers[0].qkv.dim() == 3


def test_blas_product_equals_torch_on_one_thread_and_defers_on_more():
    """The fp32 pack's products through NumPy's BLAS (utils/generation/cpu.py ``BlasProduct``):
    the plain product to rounding for 1 and several rows, whole or in panels; NumPy's BLAS is
    held to one thread; a step on more threads is torch's own product; an engine on either
    kernel (and on the timed choice) makes the same greedy tokens, on one thread and on two."""
    from threadpoolctl import threadpool_info
    from utils.generation import cpu
    blas = cpu.BlasProduct()
    assert blas.available
    assert {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"} == {1}
    g = torch.Generator().manual_seed(2)
    wt = torch.randn(64, 1000, generator=g)                  # (in, out)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for p in (1, 2):
            for n in (1, 3):
                x = torch.randn(n, 64, generator=g)
                torch.testing.assert_close(blas(x, cpu.panels(wt, p)), x @ wt, rtol=1e-5, atol=1e-5)
        torch.set_num_threads(2)
        x = torch.randn(1, 64, generator=g)
        assert torch.equal(blas(x, cpu.panels(wt, 2)), cpu.panel_mm(x, cpu.panels(wt, 2)))
    finally:
        torch.set_num_threads(prev)
    big = torch.ones(512, 512)
    assert cpu.fastest({"mm": lambda: big @ big, "nothing": lambda: None}, 1) == "nothing"
    m = build(seed=3)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    for threads in (1, 2):
        runs = {p: Engine(m, threads=threads, product=p) for p in ("torch", "blas", "auto")}
        outs = {p: e.generate(prompts, 12, temperature=0) for p, e in runs.items()}
        assert isinstance(runs["blas"].decode_pack().mm, cpu.BlasProduct)
        assert runs["torch"].decode_pack().mm is cpu.panel_mm
        assert outs["torch"] == outs["blas"] == outs["auto"], threads


# --------------------------------------------------------------------------- the engine thread
def test_engine_loop_runs_calls_and_every_model_on_one_thread():
    """utils/generation/loop.py: ``call`` runs on the loop's thread and hands back results and
    exceptions; two models' lanes are stepped by that same thread, each sequence equal to its
    lone run; a step that fails ends its own model's sequences with an error, not the other's."""
    import threading
    from utils.generation.loop import EngineLoop
    loop = EngineLoop(name="test-engine").start()
    try:
        assert loop.call(threading.get_ident) == loop._thread.ident != threading.get_ident()
        with pytest.raises(ZeroDivisionError):
            loop.call(lambda: 1 / 0)
        models = [loop.call(build, seed=s) for s in (2, 3)]
        lanes = [loop.add(Engine(m), slots=2, capacity=64) for m in models]
        threads, done = set(), threading.Event()
        finished, want = [], [4]

        def sink(e):
            threads.add(threading.get_ident())
            if e.finish is not None:
                finished.append(e.seq)
                if len(finished) == want[0]:
                    done.set()
        seqs = [lane.submit(E.Sequence([1, 5, 9 + i], E.SamplingParams(12, temperature=0), sink=sink))
                for lane in lanes for i in range(2)]
        assert done.wait(60)
        assert threads == {loop._thread.ident}
        for seq, m in zip(seqs, [models[0]] * 2 + [models[1]] * 2):
            assert seq.tokens == Engine(m).generate([seq.prompt], 12, temperature=0)[0]
        assert [lane.active for lane in lanes] == [0, 0]

        def broken():
            raise RuntimeError("out of memory (simulated)")
        lanes[0].batcher.step = broken
        finished.clear()
        done.clear()
        want[0] = 2
        bad = lanes[0].submit(E.Sequence([1, 2], E.SamplingParams(5, temperature=0), sink=sink))
        good = lanes[1].submit(E.Sequence([1, 2], E.SamplingParams(5, temperature=0), sink=sink))
        assert done.wait(60)
        assert (bad.finish, good.finish) == ("error", "length") and "simulated" in bad.error
    finally:
        loop.stop()
    assert not loop._thread.is_alive()
    with pytest.raises(RuntimeError, match="not running"):
        loop.call(int)


def test_prompt_logprobs_equal_the_full_forward_in_chunks_and_need_logprobs():
    """SamplingParams.prompt_logprobs: each prompt token after the first with its
    log-probability given the tokens before it and k alternatives, equal to the full forward
    pass's, computed ``rows`` positions at a time (chunk edges crossed here), without changing
    what is generated; asking for it without logprobs is refused."""
    m = build(seed=2).eval()
    torch.manual_seed(0)
    prompt = torch.randint(0, V, (11,)).tolist()
    eng = Engine(m)
    b = eng.batcher(1, 32)
    b.prompt_rows = 4                                           # 4 positions per block: 3 blocks
    seq = b.add(E.Sequence(prompt, E.SamplingParams(5, 0.0, logprobs=3, prompt_logprobs=True)))
    list(eng.run(b))
    with torch.no_grad():
        lp = m(torch.tensor([prompt]))[0][0].float().log_softmax(-1)
    assert len(seq.prompt_logprobs) == len(prompt) - 1
    for j, (t, got, top) in enumerate(seq.prompt_logprobs):
        assert t == prompt[j + 1] and abs(got - float(lp[j, t])) < 1e-4
        assert [a for a, _ in top] == lp[j].topk(3).indices.tolist()
    assert seq.tokens == eng.generate([prompt], 5, temperature=0)[0]
    with pytest.raises(ValueError, match="prompt_logprobs needs logprobs"):
        eng.batcher(1, 32).add(E.Sequence(prompt, E.SamplingParams(1, 0.0, prompt_logprobs=True)))


# --------------------------------------------------------------------------- the engine process
def tiny_opener(worker, seed: int):
    """An opener for RemoteLoop (run in the engine process, imported there by name)."""
    worker.log(f"opening seed {seed}")
    return Engine(build(seed=seed)), None, 2, 64, {"seed": seed}


def failing_opener(worker, path: str):
    from utils.training.checkpoint import CheckpointError
    raise CheckpointError(path, "is not a checkpoint (simulated)")


def slow_opener(worker, seconds: float):
    import time
    time.sleep(seconds)


def test_a_remote_loop_serves_sequences_from_its_own_process_as_a_lane_would():
    """utils/generation/remote.py: a model opened in the engine process (its log lines and
    info come back), sequences submitted from two threads at once each equal their lone run
    in this process, ``active`` drops to 0, an opener's error comes back as its own type, and
    ``stop`` ends the process."""
    import threading
    from utils.generation.remote import RemoteLoop
    from utils.training.checkpoint import CheckpointError
    logs = []
    loop = RemoteLoop(log=logs.append).start()
    try:
        lane, info = loop.open(tiny_opener, 2)
        assert info == {"seed": 2} and logs == ["opening seed 2"] and (lane.slots, lane.capacity) == (2, 64)
        assert loop._proc.pid != __import__("os").getpid()
        done, finished = threading.Event(), []

        def sink(e):
            if e.finish is not None:
                finished.append(e.seq)
                if len(finished) == 5:
                    done.set()
        seqs = [E.Sequence([1, 5, 9 + i], E.SamplingParams(12, temperature=0.9 if i % 2 else 0, seed=i),
                           sink=sink) for i in range(5)]
        threads = [threading.Thread(target=lane.submit, args=(s,)) for s in seqs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert done.wait(60)
        lone = Engine(build(seed=2))
        for i, seq in enumerate(seqs):
            assert seq.tokens == lone.generate([seq.prompt], 12, temperature=0.9 if i % 2 else 0, seed=i)[0]
            assert seq.finish == "length"
        assert lane.active == 0
        with pytest.raises(ValueError, match="outside the vocabulary"):
            lane.submit(E.Sequence([1, V + 5], E.SamplingParams(3, temperature=0)))
        with pytest.raises(CheckpointError, match="simulated") as caught:
            loop.open(failing_opener, "x.pt")
        assert "(in the engine process)" in caught.value.__notes__[0]
    finally:
        loop.stop()
    assert loop._proc.poll() == 0


def test_a_remote_loop_stopped_while_a_model_opens_ends_its_process_at_once():
    """Ctrl-C while a model loads: ``stop`` does not wait for the load (it took the engine
    thread's 10 s join, and the server as long to exit); the waiting ``open`` raises."""
    import threading
    import time
    from utils.generation.remote import RemoteLoop
    loop = RemoteLoop().start()
    raised = []

    def opening():
        try:
            loop.open(slow_opener, 60)
        except RuntimeError as e:
            raised.append(e)
    t = threading.Thread(target=opening)
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    loop.stop()
    t.join(30)
    assert time.monotonic() - t0 < 10 and loop._proc.poll() is not None
    assert len(raised) == 1, raised


def test_a_failure_of_the_engine_loop_itself_is_logged_and_handed_to_on_crash():
    """A failure outside a step (here the batcher refusing a sequence put past the lane's
    check) would leave every request waiting for ever: the loop logs it with its traceback and
    calls ``on_crash`` (serve's engine process exits, and the server with it)."""
    import threading
    from utils.generation.loop import EngineLoop
    logs, crashed = [], threading.Event()
    loop = EngineLoop(log=logs.append, name="test-engine", on_crash=crashed.set).start()
    try:
        lane = loop.add(Engine(build(seed=2)), slots=1, capacity=8)
        with loop._cond:
            lane.inbox.append(E.Sequence(list(range(1, 20)), E.SamplingParams(3, temperature=0)))
            loop._cond.notify()
        assert crashed.wait(60)
        assert len(logs) == 1 and logs[0].startswith("the engine loop failed:\nTraceback") and "ValueError" in logs[0]
    finally:
        loop.stop()


def test_a_step_failing_in_a_prefill_still_delivers_what_finished_before_it_and_counts_right():
    """A step decodes first, then prefills: when a prefill raises (out of memory on a long
    prompt), a sequence that finished in that step's decode has already left the batch. Its
    finishing event still reaches its sink (the request used to hang, counted as active for
    ever), then the exception propagates. A prefill that fails before the sequence takes its
    slot (the KV cache's first allocation) leaves it waiting, not lost: in an EngineLoop it
    ends with an error (it used to vanish: a request that never ended),
    and the lane's active count has dropped when a finishing event reaches its sink (a
    client's next request must not find its own finished one still counted)."""
    import threading
    from utils.generation.loop import EngineLoop
    m = build(seed=2).eval()
    b = Engine(m).batcher(2, 64)
    heard = []
    short = b.add(E.Sequence([1, 5, 9], E.SamplingParams(2, temperature=0), sink=heard.append, tag="short"))
    b.step()                                                    # its prefill: token 1
    b.add(E.Sequence([1, 2], E.SamplingParams(3, temperature=0), sink=heard.append, tag="late"))
    real = b._prefill
    b._prefill = lambda seq: (_ for _ in ()).throw(RuntimeError("out of memory (simulated)")) \
        if seq.tag == "late" else real(seq)
    with pytest.raises(RuntimeError, match="simulated"):
        b.step()                                                # decode: token 2, "short" done; then the prefill
    assert short.finish == "length" and heard[-1].seq is short and heard[-1].finish == "length"
    assert short not in b.running

    loop = EngineLoop(name="test-engine").start()
    try:
        lane = loop.add(Engine(m), slots=2, capacity=64)
        counted, done = [], threading.Event()

        def sink(e):
            if e.finish is not None:
                counted.append((e.seq.tag, e.finish, lane.active))
                done.set()
        fine = lane.batcher._prefill
        lane.batcher._prefill = lambda seq: (_ for _ in ()).throw(RuntimeError("out of memory (simulated)")) \
            if seq.tag == "late" else fine(seq)
        lane.submit(E.Sequence([1, 5, 9], E.SamplingParams(3, temperature=0), sink=sink, tag="ok"))
        assert done.wait(60)
        done.clear()
        lane.submit(E.Sequence([1, 2], E.SamplingParams(3, temperature=0), sink=sink, tag="late"))
        assert done.wait(60)
        assert counted == [("ok", "length", 0), ("late", "error", 0)], counted
    finally:
        loop.stop()
