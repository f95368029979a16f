"""`main.py serve`: a live server on 127.0.0.1 (a free port, started through main.py as a
user would) driven with the official `openai` client and raw HTTP: chat and completions,
plain and streaming, seeds, stop strings, n > 1, logprobs, errors in OpenAI's shape, auth,
HEAD, connection deadlines over raw sockets (idle, slow headers and bodies), disconnects, 32
concurrent streams equal to their lone runs, the prefix cache (reuse counted in /health, answers
as uncached, models apart), SIGTERM, int8 weights, an HF folder served beside checkpoints. Every request loop is bounded in count and time."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

import httpx2 as httpx  # the HTTP client the openai package itself uses
import jsonschema
import openai
import pytest
import torch

from tests.conftest import headless_chromium, needs_browser, offline_env, popen_main, wait_for_line, write_config
from tests.test_sft import TOK_NAME, make_checkpoint, tokenizer
from tests.test_structured import MAX_TOKENS, SCHEMAS
from utils.data.chat import Rules

TIMEOUT = 60


SCRIPT = "Grüße aus 日本🧪 und café!"      # its emoji is four byte-fallback tokens


def make_script_checkpoint(path: Path, text: str = SCRIPT, *, then_eos: bool = False, cycle: bool = True,
                           max_seq_len: int = 512, chat_template: Optional[dict] = None) -> list[int]:
    """A checkpoint whose greedy continuation of any prompt is ``text``'s tokens (returned; they
    must be distinct), then EOS with ``then_eos``, and over again with ``cycle`` (else, past the
    last, every logit is 0): its block adds nothing (zero output projections), each script
    token's embedding is a basis vector and the head row of the token after it points the same
    way (logit 10 against exactly 0); any other token points at the first. Streamed UTF-8 and
    stop strings across tokens are then deterministic to test, on every machine. With
    ``chat_template`` it is an SFT checkpoint that chats by that template."""
    import model as model_lib
    from utils.data.tok import describe, encode_plain
    from utils.training.checkpoint import save_checkpoint
    tok = tokenizer()
    ids = encode_plain(tok, [text])[0] + ([tok.eos_token_id] if then_eos else [])
    assert len(set(ids)) == len(ids) < 63, ids
    margs = model_lib.ModelArgs(vocab_size=len(tok), d_model=64, n_layers=1, n_heads=4, n_kv_heads=2,
                                max_seq_len=max_seq_len, bos_id=tok.bos_token_id, tie_embeddings=False)
    sd = model_lib.create_model(margs).state_dict()
    for k in ("layers.0.attn.wo.weight", "layers.0.mlp.w_down.weight", "tok_embeddings.weight", "lm_head.weight"):
        sd[k].zero_()
    emb, head, other = sd["tok_embeddings.weight"], sd["lm_head.weight"], len(ids)
    emb[:, other] = 1.0
    head[ids[0], other] = 10.0
    for j, t in enumerate(ids):
        emb[t, other], emb[t, j] = 0.0, 1.0
        if cycle or j + 1 < len(ids):
            head[ids[(j + 1) % len(ids)], j] = 10.0
    entry = {"kind": "pretrain", "model": sd, "model_args": margs.to_dict(), "tokenizer": describe(tok, TOK_NAME),
             "step": 0}
    if chat_template is not None:
        entry.update(kind="sft", chat_template=chat_template)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(path, entry)
    return ids


class Server:
    def __init__(self, root: Path, cfg: Path, *args, env=None):
        self.log = root / f"serve-{time.monotonic_ns()}.log"
        self.err = open(self.log, "w")
        self.proc = popen_main("serve", "--config", cfg, "--port", "0", *args, stderr=self.err,
                               env=env or offline_env())
        line = wait_for_line(self.proc, "listening on", timeout=180)[-1]
        self.url = line.split("listening on ")[1].strip()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                                    timeout=TIMEOUT)

    def stderr(self) -> str:
        if not self.err.closed:
            self.err.flush()
        return self.log.read_text()

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=TIMEOUT).json()

    def log_line(self, request_id: str, timeout: float = 30) -> str:
        """The server's log line of one request (a stream's is written as it closes)."""
        deadline = time.monotonic() + timeout
        while True:
            found = [line for line in self.stderr().splitlines() if f" {request_id} " in line]
            if found or time.monotonic() > deadline:
                assert len(found) == 1, (request_id, self.stderr()[-3000:])
                return found[0]
            time.sleep(0.05)

    def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=60)
        finally:
            self.err.close()
        return code


@pytest.fixture(scope="module")
def work(tmp_path_factory, samples):
    root = tmp_path_factory.mktemp("serve")
    cfg = write_config(root, {"tokenizer": {"name": TOK_NAME},        # limits below the defaults:
                              "serve": {"max_batch": 4, "max_messages": 16, "max_prompt_chars": 5000}})
    from utils.data import sft
    ck = root / "checkpoints"
    chat = make_checkpoint(ck / "sft_chat" / "checkpoint_best.pt", kind="sft", seed=3,
                           chat_template=sft.default_template())
    pre = make_checkpoint(ck / "base" / "checkpoint_best.pt", seed=1)
    long = make_checkpoint(ck / "long" / "checkpoint_best.pt", seed=2, max_seq_len=8192)
    script = ck / "script" / "checkpoint_best.pt"
    script_ids = make_script_checkpoint(script)
    return {"root": root, "cfg": cfg, "chat": chat, "pre": pre, "long": long, "script": script,
            "script_ids": script_ids}


@pytest.fixture(scope="module")
def server(work):
    s = Server(work["root"], work["cfg"], "--checkpoint", work["chat"].parent, "--checkpoint", work["pre"],
               "--checkpoint", work["long"], "--checkpoint", work["script"])
    yield s
    assert s.stop() == 130, s.stderr()


def _lone(work, which: str, prompt_ids, n, **kw):
    from utils.generation.engine import Engine
    from utils.run import load_model
    return Engine(load_model(work[which])[0]).generate([prompt_ids], n, **kw)[0]


def _continuation(tok, prompt_ids, new_ids) -> str:
    """A completion's text: what the new ids add to the prompt's text (its leading space kept)."""
    head = tok.decode(prompt_ids[-1:], skip_special_tokens=True)
    return tok.decode(prompt_ids[-1:] + new_ids, skip_special_tokens=True)[len(head):]


# --------------------------------------------------------------------------- the API
def test_models_health_and_chat_in_openai_shape(server):
    c = server.client
    assert [m.id for m in c.models.list().data] == ["sft_chat", "base", "long", "script"]
    assert set(server.health()["models"]) == {"sft_chat", "base", "long", "script"}
    r = c.chat.completions.create(model="sft_chat", messages=[{"role": "user", "content": "Hello?"}],
                                  max_tokens=9, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 9 and r.usage.prompt_tokens > 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    line = server.log_line(r.id)                                                # one line per request
    assert f"model=sft_chat prompt_tokens={r.usage.prompt_tokens} completion_tokens=" \
           f"{r.usage.completion_tokens} " in line
    assert re.search(r" ttft=\d+\.\d{3}s (\d+\.\d tokens/s|n/a) finish=(stop|length) ", line), line


def test_chat_uses_the_checkpoints_template_and_equals_the_engine(server, work):
    """The reply is what the engine gives for the template's prompt ids (greedy), with history:
    the new ids' text after the prompt, without the answer's leading space (the template's lead)."""
    from utils.data import sft
    tok = tokenizer()
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3+3?"}]
    r = server.client.chat.completions.create(model="sft_chat", messages=msgs, max_tokens=12, temperature=0)
    ids = sft.encode_prompt(tok, sft.default_template(), [("What is 2+2?", "4.")], "And 3+3?",
                            tok.bos_token_id, tok.eos_token_id)
    want = _lone(work, "chat", ids, 12, temperature=0, eos_id=tok.eos_token_id)
    continues, lead = sft.answer_decoding(sft.default_template())
    text = _continuation(tok, ids, want)
    assert continues and lead == " "
    assert r.choices[0].message.content == (text[len(lead):] if text.startswith(lead) else text)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
    # max_completion_tokens (chat's name for max_tokens) wins over max_tokens
    short = server.client.chat.completions.create(model="sft_chat", messages=msgs, max_tokens=12,
                                                  max_completion_tokens=4, temperature=0)
    assert short.choices[0].message.content == tok.decode(want[:4], skip_special_tokens=True)


def test_streaming_chat_and_completion_events(server):
    """Raw SSE: the role in the first delta, text deltas, finish_reason in the last choice chunk,
    the usage chunk when asked for, then data: [DONE]."""
    body = {"model": "sft_chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    plain = server.client.chat.completions.create(**{k: v for k, v in body.items()
                                                     if k not in ("stream", "stream_options")})
    assert text == plain.choices[0].message.content
    parts = list(server.client.completions.create(model="base", prompt="The history of", max_tokens=7,
                                                  temperature=0, stream=True))
    assert all(p.object == "text_completion" for p in parts)
    assert parts[-1].choices[0].finish_reason == "length"
    whole = server.client.completions.create(model="base", prompt="The history of", max_tokens=7, temperature=0)
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text


def test_n_choices_stream_and_top_k(server):
    """n > 1 in a chat stream: each index gets the role, its own text and finish_reason, equal
    to the same request without streaming; top_k (an extra field) 1 samples the argmax."""
    c = server.client
    kw = dict(model="sft_chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, n=3,
              temperature=1.0, seed=7)
    whole = c.chat.completions.create(**kw)
    texts, roles, reasons = ["", "", ""], set(), {}
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            roles.add(ch.index) if ch.delta.role == "assistant" else None
            texts[ch.index] += ch.delta.content or ""
            reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
    assert roles == {0, 1, 2} and texts == [ch.message.content for ch in whole.choices]
    assert reasons == {ch.index: ch.finish_reason for ch in whole.choices}
    assert len(set(texts)) > 1
    greedy = c.completions.create(model="base", prompt="The cat", max_tokens=8, temperature=0).choices[0].text
    top1 = c.completions.create(model="base", prompt="The cat", max_tokens=8, temperature=1.0, seed=3,
                                extra_body={"top_k": 1}).choices[0].text
    assert top1 == greedy


def test_streams_never_cut_a_character_nor_leak_a_stop_string(server, work):
    """The script model writes SCRIPT, whose emoji is four byte tokens: a stream's pieces hold
    no broken character and join to the whole text; stop strings (the emoji, others spanning
    tokens) end the text right before them, streamed or not, and never show."""
    tok, ids = tokenizer(), work["script_ids"]
    prompt = [tok.bos_token_id] + tok.encode("Hello", add_special_tokens=False)
    want = _continuation(tok, prompt, ids)
    assert want == " " + SCRIPT
    kw = dict(model="script", prompt="Hello", max_tokens=len(ids), temperature=0)

    def stream(**more):
        parts = list(server.client.completions.create(stream=True, stream_options={"include_usage": True},
                                                      **kw, **more))
        return [p.choices[0].text for p in parts if p.choices], parts[-1].usage
    pieces, usage = stream()
    assert "".join(pieces) == want and usage.completion_tokens == len(ids)
    assert not any("\ufffd" in p for p in pieces) and any("🧪" in p for p in pieces)
    for stop in ("🧪", "aus 日", "ße a", "é!"):
        r = server.client.completions.create(stop=[stop, "zzz"], **kw).choices[0]
        assert (r.text, r.finish_reason) == (want[:want.index(stop)], "stop"), stop
        assert "".join(stream(stop=stop)[0]) == r.text
    r = server.client.completions.create(stop="café!?", **kw).choices[0]      # a prefix of it ends the text
    assert (r.text, r.finish_reason) == (want, "length")


def test_seeds_n_and_logprobs(server, work):
    c = server.client
    kw = dict(model="base", prompt="Once upon a time", max_tokens=10, temperature=1.0, top_p=0.95)
    a = c.completions.create(seed=11, n=3, **kw)
    b = c.completions.create(seed=11, n=3, **kw)
    assert [x.text for x in a.choices] == [x.text for x in b.choices]            # reproducible
    assert len({x.text for x in a.choices}) > 1                                   # choices differ
    assert [x.index for x in a.choices] == [0, 1, 2]
    tok = tokenizer()
    ids = [tok.bos_token_id] + tok.encode("Once upon a time", add_special_tokens=False)
    for i in range(3):                                                             # choice i = seed + i
        want = _lone(work, "pre", ids, 10, temperature=1.0, top_p=0.95, eos_id=tok.eos_token_id, seed=11 + i)
        assert a.choices[i].text == _continuation(tok, ids, want)
    lp = c.completions.create(model="base", prompt="The cat", max_tokens=4, temperature=0, logprobs=3).choices[0]
    assert len(lp.logprobs.tokens) == 4 and all(v <= 0 for v in lp.logprobs.token_logprobs)
    assert all(len(t) == 3 for t in lp.logprobs.top_logprobs)
    # greedy: each chosen token is the most likely one
    assert all(abs(max(t.values()) - v) < 1e-5 for t, v in zip(lp.logprobs.top_logprobs, lp.logprobs.token_logprobs))
    assert "".join(lp.logprobs.tokens) == lp.text
    chat = c.chat.completions.create(model="sft_chat", messages=[{"role": "user", "content": "Hi"}],
                                     max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == 3
    assert all(len(e.top_logprobs) == 2 for e in chat.choices[0].logprobs.content)


def test_echo_with_logprobs_scores_the_prompt_as_lm_evaluation_harness_reads_it(server, work):
    """``echo`` + ``logprobs`` on completions (what lm-evaluation-harness's local-completions
    sends to score a continuation: it sums token_logprobs[ctxlen:-1]): the logprobs cover the
    prompt's tokens too, each given the tokens before it (BOS included, so the first has one),
    equal to the model's own forward pass; text_offset indexes the echoed text; a stream sends
    the prompt with its scores first. It used to return only the generated token's, so every
    scored continuation summed to 0."""
    from utils.run import load_model
    tok = tokenizer()
    context, continuation = "The cat sat on", " the mat"
    text = context + continuation
    ids = [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)
    model = load_model(work["pre"])[0].eval()
    with torch.no_grad():
        lp = model(torch.tensor([ids]))[0][0].float().log_softmax(-1)
    want = [float(lp[j - 1, ids[j]]) for j in range(1, len(ids))]            # each text token given what precedes
    c = server.client
    got = c.completions.create(model="base", prompt=text, max_tokens=1, temperature=0, logprobs=2,
                               echo=True).choices[0]
    L = got.logprobs
    n = len(ids) - 1
    assert got.text.startswith(text) and len(L.tokens) == len(L.token_logprobs) == len(L.text_offset) == n + 1
    assert max(abs(a - b) for a, b in zip(L.token_logprobs[:n], want)) < 1e-4, (L.token_logprobs[:n], want)
    assert all(len(t) == 2 for t in L.top_logprobs)
    assert L.text_offset[0] == 0 and L.text_offset[n] == len(text)
    assert all(a < b for a, b in zip(L.text_offset, L.text_offset[1:]))
    for j in range(1, n):                            # each token's text at its offset in the echo
        assert text[L.text_offset[j]:].startswith(L.tokens[j]), (j, L.tokens[j], L.text_offset[j])
    ctxlen = len(tok.encode(context, add_special_tokens=False))
    assert abs(sum(L.token_logprobs[ctxlen:-1]) - sum(want[ctxlen:])) < 1e-3     # lm-eval's score
    stream = list(c.completions.create(model="base", prompt=text, max_tokens=1, temperature=0, logprobs=2,
                                       echo=True, stream=True))
    first = stream[0].choices[0]
    assert first.text == text and first.logprobs.tokens == L.tokens[:n]
    assert max(abs(a - b) for a, b in zip(first.logprobs.token_logprobs, L.token_logprobs[:n])) < 1e-6
    assert "".join(x.choices[0].text for x in stream if x.choices) == got.text
    plain = c.completions.create(model="base", prompt=text, max_tokens=1, temperature=0, echo=True).choices[0]
    assert plain.text == got.text and plain.logprobs is None


# --------------------------------------------------------------------------- prefix cache
def _reused(server, model: str) -> int:
    """Prompt tokens of ``model`` whose KV came from its prefix cache so far (/health)."""
    return server.health()["models"][model]["prefix_cache"]["hit_tokens"]


def test_prefix_cache_reuses_a_repeated_and_a_longer_prompt_and_answers_as_uncached(server, work):
    """A second identical request and a longer one reuse the first one's KV (the hit counter in
    /health grows by whole blocks), and every answer is the uncached engine's (greedy and
    seeded); the same prompt to another model reuses nothing; an echo request (scored prompt)
    reuses nothing. /health states the budget."""
    from utils.generation.engine import Engine
    from utils.run import load_model
    tok, pre = tokenizer(), Engine(load_model(work["pre"])[0])
    health = server.health()["models"]["base"]["prefix_cache"]
    assert health["bytes_budget"] == 256 << 20 and health["blocks_capacity"] > 0
    assert health["bytes_used"] <= health["bytes_budget"] and health["blocks_used"] <= health["blocks_capacity"]
    for i, kw in enumerate(({"temperature": 0}, {"temperature": 1.0, "top_p": 0.9, "seed": 5})):
        text = f"{i}: Prefix caching keeps the keys and values of a prompt's start for the next request " * 3
        reused = []
        for prompt in (text, text, text + "and the one after it"):
            ids = [tok.bos_token_id] + tok.encode(prompt, add_special_tokens=False)
            before = _reused(server, "base")
            got = server.client.completions.create(model="base", prompt=prompt, max_tokens=8, **kw)
            want = pre.generate([ids], 8, eos_id=tok.eos_token_id, **kw)[0]
            assert got.choices[0].text == _continuation(tok, ids, want)
            reused.append(_reused(server, "base") - before)
        n = len(tok.encode(text, add_special_tokens=False))             # BOS + n tokens
        assert reused[0] == 0 and reused[1] == n // 16 * 16 and reused[2] >= (n - 2) // 16 * 16 > 0, reused
    ids = [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)
    other = _reused(server, "long")
    got = server.client.completions.create(model="long", prompt=text, max_tokens=6, temperature=0)
    assert got.choices[0].text == _continuation(tok, ids, _lone(work, "long", ids, 6, temperature=0,
                                                                eos_id=tok.eos_token_id))
    assert _reused(server, "long") == other                  # base's KV is base's alone
    before = _reused(server, "base")
    server.client.completions.create(model="base", prompt=text, max_tokens=1, temperature=0, logprobs=1, echo=True)
    assert _reused(server, "base") == before


def test_prefix_cache_a_chat_s_next_turn_reuses_the_conversation(server, work):
    """The chat page and every client resend the conversation: the second turn (streamed, as
    the page asks) reuses the first turn's prompt and answer, and answers as uncached."""
    from utils.data import sft
    tok, template = tokenizer(), sft.default_template()
    q1, q2 = "Tell me about the rivers and mountains of a country far away from here.", "And its lakes?"
    first = server.client.chat.completions.create(model="sft_chat", messages=[{"role": "user", "content": q1}],
                                                  max_tokens=12, temperature=0).choices[0].message.content
    msgs = [{"role": "user", "content": q1}, {"role": "assistant", "content": first},
            {"role": "user", "content": q2}]
    before = _reused(server, "sft_chat")
    stream = server.client.chat.completions.create(model="sft_chat", messages=msgs, max_tokens=12,
                                                   temperature=0, stream=True)
    got = "".join(x.choices[0].delta.content or "" for x in stream if x.choices)
    ids1 = sft.encode_prompt(tok, template, [], q1, tok.bos_token_id, tok.eos_token_id)
    ids = sft.encode_prompt(tok, template, [(q1, first)], q2, tok.bos_token_id, tok.eos_token_id)
    want = _lone(work, "chat", ids, 12, temperature=0, eos_id=tok.eos_token_id)
    text = _continuation(tok, ids, want)
    assert got == text[1:] if text.startswith(" ") else text
    assert _reused(server, "sft_chat") - before >= len(ids1) // 16 * 16 > 0


def test_stop_strings_never_leak(server):
    c = server.client
    full = c.completions.create(model="base", prompt="The history of", max_tokens=30, temperature=0).choices[0].text
    assert len(full) > 12
    stop = full[5:9]                         # somewhere inside, likely across a token boundary
    r = c.completions.create(model="base", prompt="The history of", max_tokens=30, temperature=0, stop=[stop, "zzzz"])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(p.choices[0].text for p in c.completions.create(
        model="base", prompt="The history of", max_tokens=30, temperature=0, stop=stop, stream=True) if p.choices)
    assert streamed == r.choices[0].text


# --------------------------------------------------------------------------- errors
def _post(server, path, content, headers=None):
    h = {"Content-Type": "application/json", **(headers or {})}
    return httpx.post(server.url + path, content=content, headers=h, timeout=TIMEOUT)


BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}), 404, "model"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": "hello"}), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [{"role": "user", "content": "x"}] * 17}), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [{"role": "assistant", "content": "x"}]}), 400, "messages[0].role"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [{"role": "tool", "content": "x"}]}), 400, "messages[0].role"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}), 400, "temperature"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [{"role": "user", "content": "x"}], "top_p": 1.5}), 400, "top_p"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}), 400, "max_tokens"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [{"role": "user", "content": "x" * 5001}]}), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [{"role": "user"}]}), 400, "messages[0].content"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}), 400, "stream"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}), 400, "stream_options"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), 400, "top_logprobs"),
    ("/v1/chat/completions", b'{"model": "sft_chat", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, "temperature"),
    ("/v1/chat/completions", b'{"model": "sft_chat", "messages": [{"role": "user", "content": "\\udc00 x"}]}', 400, "messages[0].content"),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("/v1/completions", b'{"model": "base", "prompt": "\xff\xfe"}', 400, None),
    ("/v1/completions", b'{"model": "base", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None),
    ("/v1/completions", json.dumps({"model": "base", "prompt": "x" * 1_200_000}), 413, None),
    ("/v1/completions", json.dumps({"model": "base", "prompt": "x", "n": 1.5}), 400, "n"),
    ("/v1/completions", json.dumps({"model": "base", "prompt": "x", "seed": "1"}), 400, "seed"),
    ("/v1/completions", json.dumps({"model": "base", "prompt": "x", "logprobs": True}), 400, "logprobs"),
    ("/v1/completions", json.dumps({"model": "base", "prompt": "x", "stop": [1]}), 400, "stop"),
    ("/v1/completions", json.dumps({"model": "base", "prompt": "x", "temperature": -0.5}), 400, "temperature"),
    ("/v1/chat/completions", json.dumps({"model": "base", "messages": [{"role": "user", "content": "x"}]}), 400, "model"),
    ("/v1/completions", json.dumps({"model": "base", "prompt": 5}), 400, "prompt"),
    ("/v1/completions", json.dumps({"model": "base", "prompt": "x", "n": 0}), 400, "n"),
    ("/v1/completions", json.dumps({"model": "base", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}), 400, "stop"),
    ("/v1/completions", json.dumps({"model": "base", "prompt": "x", "max_tokens": -1}), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"model": "base", "prompt": "word " * 400}), 400, "prompt"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                                           "tool_calls": [{"id": "1", "type": "function"}]},
        {"role": "user", "content": "y"}]}), 400, "messages[1].tool_calls[0]"),
    ("/v1/completions", json.dumps({"model": "base", "prompt": "x", "logprobs": 1, "top_logprobs": 2}), 400, "top_logprobs"),
    ("/v1/completions", json.dumps({"model": "base", "prompt": "x", "stream": True,
                                    "stream_options": {"include_usage": "yes"}}), 400, "stream_options.include_usage"),
    ("/v1/nothing", b"{}", 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{b[3] or b[2]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_the_official_client_raises_typed_errors(server):
    c = server.client
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.chat.completions.create(model="sft_chat", messages=[{"role": "user", "content": "x"}], temperature=2.5)
    with pytest.raises(openai.BadRequestError, match="/v1/completions"):
        c.chat.completions.create(model="base", messages=[{"role": "user", "content": "x"}])


# --------------------------------------------------------------------------- error bodies, fields, bodies
def _err(r, status: int, param=None, code=None) -> dict:
    """The OpenAI error of response ``r`` (asserted: status, shape, param, code)."""
    assert r.status_code == status, r.text[:2000]
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_error_bodies_quote_client_values_bounded_and_always_encode(server):
    """A lone surrogate (a JSON escape: legal JSON, not encodable as UTF-8) in "model" comes back
    escaped in a 404 JSON body, not a 500; 100 KB values and a long path are quoted cut short."""
    r = _post(server, "/v1/completions", b'{"model":"x\\ud800","prompt":"x","max_tokens":2}')
    assert "\\ud800" in _err(r, 404, "model", "model_not_found")["message"]
    big = "h" * 100_000
    for body, param in [({"model": big, "prompt": "x"}, "model"),
                        ({"model": "base", "prompt": "x", "temperature": big}, "temperature"),
                        ({"model": "base", "prompt": "x", "stream": big}, "stream"),
                        ({"model": "sft_chat", "messages": [{"role": big, "content": "x"}]}, "messages[0].role"),
                        ({"model": "base", "prompt": "x", "best_of": big}, "best_of")]:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = _post(server, path, json.dumps(body))
        _err(r, 404 if param == "model" else 400, param)
        assert len(r.content) < 1000, (param, len(r.content))
    r = httpx.get(server.url + "/v1/" + "p" * 12_000, timeout=TIMEOUT)
    assert len(r.content) < 1000 and "(12004 characters)" in _err(r, 404, None, "404")["message"]
    status, content = _raw_get(server.url, "/v1/" + "p" * 100_000)     # beyond httpx's URL limit
    assert status == 404 and len(content) < 1000 and b"(100004 characters)" in content, (status, content[:300])
    assert "Traceback" not in server.stderr() and "internal error" not in server.stderr()


def _raw_get(url: str, path: str) -> tuple[int, bytes]:
    """GET ``path`` over a raw socket (any length): the status and the body."""
    return _raw_request(url, "GET", path)


def _raw_request(url: str, method: str, path: str) -> tuple[int, bytes]:
    """``method path`` over a raw socket: the status and every byte after the headers until
    the server closes the connection."""
    import socket
    host, port = url.split("//")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        reply = b""
        while part := sock.recv(65536):
            reply += part
    head, _, content = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), content


CHAT_REFUSED = [("functions", [{"name": "f", "parameters": {}}]),        # tools: tests/test_tools.py
                ("function_call", {"name": "f"}),
                ("logit_bias", {"1": 5}), ("modalities", ["audio"]), ("audio", {}), ("prediction", {}),
                ("web_search_options", {}), ("min_p", 0.1), ("repetition_penalty", 1.3),
                ("guided_json", {"type": "object"})]
COMPLETION_REFUSED = [("logit_bias", {"1": 5}), ("best_of", 3), ("suffix", "x"), ("ignore_eos", True),
                      ("mirostat", 2), ("repetition_penalty", True)]


@pytest.mark.parametrize("path,key,value",
                         [("/v1/chat/completions", k, v) for k, v in CHAT_REFUSED]
                         + [("/v1/completions", k, v) for k, v in COMPLETION_REFUSED],
                         ids=[f"chat-{k}" for k, _ in CHAT_REFUSED] + [f"completions-{k}" for k, _ in COMPLETION_REFUSED])
def test_fields_the_server_cannot_honour_are_refused(server, path, key, value):
    """Tools, biased tokens, audio, ... would change what the request means:
    a 400 naming the field (never silently ignored)."""
    base = ({"model": "sft_chat", "messages": [{"role": "user", "content": "x"}]} if "chat" in path
            else {"model": "base", "prompt": "x", "n": 1})
    r = _post(server, path, json.dumps({**base, "max_tokens": 2, key: value}))
    assert "not supported" in _err(r, 400, key, "unsupported_parameter")["message"]


def test_the_off_values_of_refused_fields_are_accepted(server):
    chat = {"model": "sft_chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "tools": [], "tool_choice": "auto", "response_format": {"type": "text"}, "modalities": ["text"],
            "logit_bias": {}, "functions": [], "function_call": "none", "min_p": 0, "repetition_penalty": 1.0,
            "ignore_eos": False, "skip_special_tokens": True, "guided_json": None}
    r = _post(server, "/v1/chat/completions", json.dumps(chat))
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    r = _post(server, "/v1/chat/completions", json.dumps({**chat, "tools": tools, "tool_choice": "none"}))
    assert r.status_code == 200, r.text                          # tools offered, none to be called
    for more in ({"best_of": 1, "suffix": ""}, {"best_of": 2, "n": 2, "suffix": None, "logit_bias": {}}):
        r = _post(server, "/v1/completions", json.dumps({"model": "base", "prompt": "x", "max_tokens": 2, **more}))
        assert r.status_code == 200 and r.json()["object"] == "text_completion", (more, r.text)


# --------------------------------------------------------------------------- structured output
# response_format json_schema / json_object (utils/generation/constrained.py); the schemas and the
# engine-level checks are tests/test_structured.py's
def _schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def _json_chat(server, fmt, stream: bool, seed: int, max_tokens: int = MAX_TOKENS) -> tuple[str, str]:
    kw = dict(model="sft_chat", messages=[{"role": "user", "content": "Describe someone as JSON."}],
              max_tokens=max_tokens, temperature=1.0, seed=seed, response_format=fmt)
    if not stream:
        r = server.client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in server.client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            reason = ch.finish_reason or reason
    return text, reason


def _json_completion(server, fmt, stream: bool, seed: int, max_tokens: int = MAX_TOKENS) -> tuple[str, str]:
    kw = dict(model="base", prompt="The record:", max_tokens=max_tokens, temperature=1.0, seed=seed,
              extra_body={"response_format": fmt})      # the client's completions take it as an extra
    if not stream:
        r = server.client.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in server.client.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.text
            reason = ch.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_reply_is_json_valid_against_its_schema_chat_and_completions_streamed_and_not(server, name):
    """A random model under the grammar's mask: chat and completions, streamed and not, each reply
    parses and validates, and ends by itself ("stop") well within max_tokens; a streamed reply
    is the same text as the plain one of the same seed."""
    for ask in (_json_chat, _json_completion):
        plain, plain_reason = ask(server, _schema_format(name), False, seed=7)
        streamed, streamed_reason = ask(server, _schema_format(name), True, seed=7)
        assert plain_reason == streamed_reason == "stop", (ask.__name__, plain)
        assert streamed == plain
        jsonschema.validate(json.loads(plain), SCHEMAS[name])


def test_json_object_replies_parse_and_a_cut_off_is_length(server):
    """json_object: any JSON object; a max_tokens cut-off before the JSON is complete finishes
    "length" with the text as far as it got (as OpenAI's API does)."""
    r = server.client.chat.completions.create(
        model="sft_chat", messages=[{"role": "user", "content": "Reply in JSON."}], max_tokens=230, n=2,
        temperature=1.0, seed=11, response_format={"type": "json_object"})
    assert [c.finish_reason for c in r.choices] == ["stop", "stop"]
    replies = [json.loads(c.message.content) for c in r.choices]          # each choice its own grammar
    assert all(isinstance(x, dict) for x in replies) and replies[0] != replies[1], replies
    text, reason = _json_completion(server, _schema_format("nested"), False, seed=7, max_tokens=3)
    assert reason == "length" and text.lstrip().startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_unsupported_schema_features_and_bad_formats_get_a_400_naming_them(server):
    c = server.client
    msgs = [{"role": "user", "content": "Hi"}]
    bad = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="sft_chat", messages=msgs, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
    err = e.value.body
    assert e.value.status_code == 400 and err["code"] == "unsupported_schema", err
    assert err["param"] == "response_format.json_schema.schema" and '"not"' in err["message"], err
    for fmt, param in (({"type": "yaml"}, "response_format.type"),
                       ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
                       ({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}},
                        "response_format.json_schema.schema")):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="base", prompt="x", max_tokens=4, extra_body={"response_format": fmt})
        assert e.value.body["param"] == param, e.value.body


def test_mixed_concurrent_requests_each_equal_their_lone_run(server):
    """32 concurrent requests on 4 slots, free and constrained, greedy and sampled: each equals
    the same request sent alone (a constrained neighbour changes no free row's tokens)."""
    reqs = [dict(model="base", prompt=f"Item {i}:", max_tokens=80 if i % 2 else 6 + (i * 5) % 14,
                 temperature=0 if i % 3 == 0 else 0.9, seed=50 + i,
                 extra_body={"response_format": _schema_format("required_fields")} if i % 2 else {})
            for i in range(32)]

    def ask(kw):
        r = server.client.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason

    with cf.ThreadPoolExecutor(32) as ex:
        together = list(ex.map(ask, reqs))
    alone = [ask(kw) for kw in reqs]
    assert together == alone
    for kw, (text, reason) in zip(reqs, together):
        if kw["extra_body"]:
            assert reason == "stop", text
            jsonschema.validate(json.loads(text), SCHEMAS["required_fields"])


# --------------------------------------------------------------------------- /metrics
def scrape(url: str, headers=None) -> dict:
    """GET /metrics parsed: {(name, ((label, value), ...)): value} of every sample."""
    from prometheus_client.parser import text_string_to_metric_families
    r = httpx.get(url + "/metrics", headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    return {(x.name, tuple(sorted(x.labels.items()))): x.value
            for family in text_string_to_metric_families(r.text) for x in family.samples}


def _grew(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_count_the_requests_tokens_and_latencies_exactly(server):
    """/metrics before and after real requests (this module's tests run one at a time): choices
    by finish reason, prompt and generated tokens as the usage counts them, one time to first
    token and one end-to-end latency per request, an inter-token latency per token after each
    choice's first, a refusal by status and code; then nothing running or waiting, and the KV
    cache's slots and bytes as the checkpoints' sizes give them, the prefix caches' as /health."""
    before = scrape(server.url)
    chat = server.client.chat.completions.create(model="sft_chat", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=7, n=2, temperature=0.9, seed=5)
    parts = list(server.client.completions.create(model="base", prompt="Once", max_tokens=6, temperature=0,
                                                  stream=True, stream_options={"include_usage": True}))
    usage = parts[-1].usage
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model="base", prompt="Once", max_tokens=10_000)
    deadline = time.monotonic() + 10                  # a stream is counted as its generator closes
    while _grew(before, after := scrape(server.url), "llm_e2e_request_latency_seconds_count",
                model_name="base") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    reasons = {"sft_chat": [c.finish_reason for c in chat.choices],
               "base": [next(c.finish_reason for p in parts for c in p.choices if c.finish_reason)]}
    for mid, got in reasons.items():
        for why in ("stop", "length"):
            assert _grew(before, after, "llm_request_success_total", model_name=mid, finished_reason=why) \
                   == got.count(why), (mid, why)
    for mid, u, choices in (("sft_chat", chat.usage, 2), ("base", usage, 1)):
        assert _grew(before, after, "llm_prompt_tokens_total", model_name=mid) == u.prompt_tokens
        assert _grew(before, after, "llm_generation_tokens_total", model_name=mid) == u.completion_tokens
        for hist in ("llm_time_to_first_token_seconds", "llm_e2e_request_latency_seconds"):
            assert _grew(before, after, f"{hist}_count", model_name=mid) == 1, hist
        assert _grew(before, after, "llm_inter_token_latency_seconds_count", model_name=mid) \
               == u.completion_tokens - choices
    assert _grew(before, after, "llm_request_errors_total", status="400", code="context_length_exceeded") == 1
    per_slot = 2 * 2 * 2 * 256 * 16 * 4          # layers x (k, v) x kv heads x context x head dim x fp32
    for mid in ("sft_chat", "base"):
        assert after[("llm_num_requests_running", (("model_name", mid),))] == 0
        assert after[("llm_num_requests_waiting", (("model_name", mid),))] == 0
        assert after[("llm_kv_cache_slots_total", (("model_name", mid),))] == 4
        assert after[("llm_kv_cache_bytes_total", (("model_name", mid),))] == 4 * per_slot
    health = server.health()["models"]                 # the prefix caches' stats, as /health shows them
    for mid in ("sft_chat", "base"):
        pc, m = health[mid]["prefix_cache"], (("model_name", mid),)
        assert after[("llm_prefix_cache_queries_total", m)] == pc["queried_tokens"] > 0
        assert after[("llm_prefix_cache_hits_total", m)] == pc["hit_tokens"]
        assert after[("llm_prefix_cache_bytes_used", m)] == pc["bytes_used"]


def test_request_bodies_uncompressed_utf8_json(server):
    """Content-Encoding gzip: 415; UTF-16 (which json.loads on bytes would take): 400 naming a
    NUL byte; bytes that are not UTF-8: 400 naming the byte and its offset; a UTF-8 byte
    order mark is allowed."""
    import codecs
    import gzip
    body = json.dumps({"model": "base", "prompt": "x", "max_tokens": 2})
    r = _post(server, "/v1/completions", gzip.compress(body.encode()), {"Content-Encoding": "gzip"})
    assert "gzip" in _err(r, 415, None, "unsupported_content_encoding")["message"]
    r = _post(server, "/v1/completions", body.encode("utf-16"))
    assert "NUL byte at offset 3" in _err(r, 400, None, "invalid_json")["message"]
    bad = b'{"model": "base", "prompt": "\xff"}'
    at = bad.index(b"\xff")
    r = _post(server, "/v1/completions", bad)
    assert f"byte 0xff at offset {at}" in _err(r, 400, None, "invalid_json")["message"]
    r = _post(server, "/v1/completions", codecs.BOM_UTF8 + body.encode())
    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
    r = _post(server, "/v1/completions", body, {"Content-Encoding": "identity"})
    assert r.status_code == 200, r.text
    # a body too large is not read: the 413 says Connection: close, and the connection closes
    # (what follows it is never taken for a request)
    import socket
    host, port = _host_port(server.url)
    with socket.create_connection((host, port), timeout=TIMEOUT) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 50000000\r\n\r\n".encode() + b'{"prompt": "' + b"x" * 1000)
        reply = b""
        while part := sock.recv(65536):
            reply += part
    head = reply.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    assert head.startswith("http/1.1 413") and "connection: close" in head, head


MALFORMED_HTTP = {
    "bad chunk size": b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "two Content-Lengths": b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    "Content-Length abc": b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Length: abc\r\n\r\n{}",
    "NUL in a header": b"GET /health HTTP/1.1\r\nHost: h\r\nX-A: a\x00b\r\n\r\n",
    "no Host": b"GET /health HTTP/1.1\r\n\r\n",
    "not HTTP": b"HELLO\r\n\r\n",
}


@pytest.mark.parametrize("name", MALFORMED_HTTP)
def test_bytes_that_are_not_http_get_an_openai_shaped_400_and_the_connection_closes(server, name):
    """uvicorn answered these in plain text; every error of this server is OpenAI's shape."""
    import socket
    with socket.create_connection(_host_port(server.url), timeout=TIMEOUT) as sock:
        sock.sendall(MALFORMED_HTTP[name])
        reply = b""
        while part := sock.recv(65536):                  # the server closes the connection
            reply += part
    head, _, content = reply.partition(b"\r\n\r\n")
    head = head.decode("latin-1").lower()
    assert head.startswith("http/1.1 400") and "connection: close" in head and "application/json" in head, reply
    err = json.loads(content)["error"]
    assert err["code"] == "invalid_http" and "not valid HTTP/1.1" in err["message"], err
    assert server.health()["status"] == "ok"
    if name == "bad chunk size":                     # the app was reading that body: it says why it ended
        _wait_for_log(server, "was not valid HTTP/1.1 (e.g. a malformed chunk): answered 400 invalid_http")


def test_headers_over_the_limit_get_431_and_an_unknown_transfer_encoding_501(server):
    """h11's own status for what it refuses, where uvicorn always said 400: a header block over
    its limit (16 KiB) is a 431, a Transfer-Encoding other than chunked a 501; OpenAI's shape,
    and the connection closes."""
    import socket

    def answer(*parts: bytes) -> tuple[str, dict]:
        with socket.create_connection(_host_port(server.url), timeout=TIMEOUT) as sock:
            for part in parts:                       # the last part crosses the limit: all read
                sock.sendall(part)
            reply = b""
            while got := sock.recv(65536):
                reply += got
        head, _, content = reply.partition(b"\r\n\r\n")
        return head.decode("latin-1").lower(), json.loads(content)["error"]

    head, err = answer(b"GET /health HTTP/1.1\r\nHost: h\r\nX-Big: " + b"a" * 16000, b"a" * 1000)
    assert head.startswith("http/1.1 431") and "connection: close" in head, head
    assert err["code"] == "invalid_http" and "headers are larger" in err["message"], err
    head, err = answer(b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip\r\n\r\n")
    assert head.startswith("http/1.1 501") and "connection: close" in head, head
    assert err["code"] == "invalid_http" and "Transfer-Encoding" in err["message"], err
    assert server.health()["status"] == "ok"


def test_a_request_target_in_absolute_form_is_served_as_its_path(server):
    """RFC 9112 3.2.2: a server must accept a target in absolute form (what a client sends to a
    server it takes for its proxy); uvicorn routed the whole URL as a path, a 404."""
    import socket
    host, port = _host_port(server.url)
    with socket.create_connection((host, port), timeout=TIMEOUT) as sock:
        sock.sendall(f"GET HTTP://{host}:{port}/v1/models?x=1 HTTP/1.1\r\nHost: {host}\r\n"
                     f"Connection: close\r\n\r\n".encode())
        reply = b""
        while got := sock.recv(65536):
            reply += got
    head, _, content = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), reply
    assert {m["id"] for m in json.loads(content)["data"]} >= {"sft_chat", "script"}, content


def test_the_asterisk_target_answers_options_about_the_server(server):
    """RFC 9112 3.2.4 / RFC 9110 9.3.7: ``OPTIONS *`` asks about the server as a whole: 200,
    ``Allow`` and ``Content-Length: 0``; any other method with that target is a 400 in OpenAI's
    shape (both were a 404)."""
    import socket
    host, port = _host_port(server.url)
    for method in ("OPTIONS", "GET"):
        with socket.create_connection((host, port), timeout=TIMEOUT) as sock:
            sock.sendall(f"{method} * HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            reply = b""
            while got := sock.recv(65536):
                reply += got
        head, _, content = reply.partition(b"\r\n\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(b":") for line in head.split(b"\r\n")[1:])}
        if method == "OPTIONS":
            assert head.startswith(b"HTTP/1.1 200"), reply
            assert headers[b"allow"] == b"GET, HEAD, POST, OPTIONS" and headers[b"content-length"] == b"0"
            assert content == b""
        else:
            assert head.startswith(b"HTTP/1.1 400"), reply
            error = json.loads(content)["error"]
            assert error["code"] == "invalid_request_target" and "OPTIONS only" in error["message"]


def test_one_model_by_id(server):
    """GET /v1/models/{id}: the model's entry of GET /v1/models; an unknown id is a 404."""
    listed = {m["id"]: m for m in httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()["data"]}
    for mid in ("sft_chat", "script"):
        r = httpx.get(server.url + f"/v1/models/{mid}", timeout=TIMEOUT)
        assert r.status_code == 200 and r.json() == listed[mid], r.text
    m = server.client.models.retrieve("script")
    assert m.id == "script" and m.object == "model" and m.model_extra["context_length"] == 512
    r = httpx.get(server.url + "/v1/models/nope", timeout=TIMEOUT)
    assert "'nope'" in _err(r, 404, "model", "model_not_found")["message"]
    with pytest.raises(openai.NotFoundError):
        server.client.models.retrieve("nope")


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.split("//")[1].rsplit(":", 1)
    return host.strip("[]"), int(port)


def test_a_model_id_with_control_characters_keeps_the_log_one_line_per_request(work, tmp_path):
    """A run folder named with a newline and an escape sequence is a model id: the API gives
    it as it is (JSON escapes it); the server's log showed it raw, which split the promised one
    line per request and reached the operator's terminal."""
    import shutil
    odd = "odd\nid\x1b[31m"
    shutil.copytree(work["pre"].parent, tmp_path / "checkpoints" / odd)
    s = Server(work["root"], work["cfg"], "--checkpoint", tmp_path / "checkpoints" / odd)
    try:
        assert [m.id for m in s.client.models.list().data] == [odd]
        s.client.completions.create(model=odd, prompt="Hi", max_tokens=2)
    finally:
        assert s.stop() == 130
    log = s.stderr()
    assert "\x1b" not in log
    line = next(x for x in log.splitlines() if "prompt_tokens=" in x)
    assert "model=odd\ufffdid\ufffd[31m prompt_tokens=" in line, line


def test_the_chat_page_and_its_files_carry_security_headers(server):
    """The page loads nothing but this server's files and may not be framed by another site
    (it had no such headers: any page could frame it); its files are never type-sniffed."""
    for path in ("/", "/static/chat.js", "/static/style.css"):
        r = httpx.get(server.url + path, timeout=TIMEOUT)
        assert r.status_code == 200, path
        csp = {d.strip().split(" ")[0]: d.strip() for d in r.headers["content-security-policy"].split(";")}
        assert csp["default-src"] == "default-src 'self'" and csp["frame-ancestors"] == "frame-ancestors 'none'"
        assert r.headers["x-content-type-options"] == "nosniff" and r.headers["x-frame-options"] == "DENY"


def test_head_answers_as_get_does_without_a_body(server):
    """HEAD (load balancers, health checkers, link checkers) on the page, its files, /health
    and the model list: 200 with GET's headers (Content-Length included) and no body: the next
    request on the same connection parses, which a stray body would break. A method a path
    does not take is a 405 naming the ones it does (Allow)."""
    import http.client
    conn = http.client.HTTPConnection(*_host_port(server.url), timeout=TIMEOUT)
    try:
        for path in ("/", "/static/chat.js", "/health", "/v1/models", "/v1/models/base"):
            conn.request("HEAD", path)
            head = conn.getresponse()
            assert (head.status, head.read()) == (200, b""), (path, head.status)
            conn.request("GET", path)
            get = conn.getresponse()
            body = get.read()
            assert get.status == 200 and int(get.headers["content-length"]) == len(body) > 0, path
            same = lambda r: sorted((k.lower(), v) for k, v in r.getheaders() if k.lower() != "date")  # noqa: E731
            assert same(head) == same(get), path
        for method, path, allowed in (("POST", "/health", {"GET", "HEAD"}),
                                      ("HEAD", "/v1/completions", {"POST"})):
            conn.request(method, path)
            r = conn.getresponse()
            content = r.read()
            assert r.status == 405 and {m.strip() for m in r.headers["allow"].split(",")} == allowed, \
                (method, path, r.status, r.getheaders())
            if method != "HEAD":
                assert json.loads(content)["error"]["code"] == "405"
    finally:
        conn.close()
    status, content = _raw_request(server.url, "HEAD", "/health")    # the bytes on the wire
    assert status == 200 and content == b"", content[:300]


def test_answers_on_a_kept_alive_connection_do_not_wait_for_a_delayed_ack(server):
    """Every answer after a connection's first (the openai client keeps its connections) used
    to take 40+ ms: Nagle's algorithm was on (asyncio sets TCP_NODELAY only on sockets that name
    IPPROTO_TCP, and serve's listening socket did not), so an answer's body waited for the
    client's delayed ACK of its headers. /health and a one-token completion take ~1-3 ms here;
    the bound is 10x that and still half of Linux's 40 ms minimum delayed ACK."""
    import http.client
    import socket
    import statistics
    import serve
    sock = serve.bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()
    conn = http.client.HTTPConnection(*_host_port(server.url), timeout=TIMEOUT)
    body = json.dumps({"model": "base", "prompt": "The", "max_tokens": 1, "temperature": 0})
    times = {"GET /health": [], "POST /v1/completions": []}
    try:
        for i in range(9):
            for what in times:
                method, path = what.split()
                t0 = time.perf_counter()
                conn.request(method, path, body if method == "POST" else None,
                             {"Content-Type": "application/json"} if method == "POST" else {})
                r = conn.getresponse()
                assert r.status == 200, r.read()[:300]
                r.read()
                if i:                                     # the connection's first answer never waited
                    times[what].append(time.perf_counter() - t0)
    finally:
        conn.close()
    for what, ts in times.items():
        assert min(ts) < 0.02, (what, [round(t * 1000, 1) for t in ts])   # a delayed ACK delays every one


def test_length_errors_name_the_field_at_fault(server):
    """A prompt that alone fills the context names "prompt" (even with max_tokens sent); chat's
    max_completion_tokens too large names that field and the largest value that fits; a stop
    string over 1000 characters says the limit."""
    r = _post(server, "/v1/completions", json.dumps({"model": "base", "prompt": "word " * 400, "max_tokens": 5}))
    assert "shorten the prompt" in _err(r, 400, "prompt", "context_length_exceeded")["message"]
    msgs = [{"role": "user", "content": "How are you today?"}]
    context = server.client.models.retrieve("sft_chat").model_extra["context_length"]
    used = server.client.chat.completions.create(model="sft_chat", messages=msgs, max_tokens=1).usage.prompt_tokens
    for field in ("max_completion_tokens", "max_tokens"):
        r = _post(server, "/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": msgs, field: 1000}))
        msg = _err(r, 400, field, "context_length_exceeded")["message"]
        assert f"lower {field} to at most {context - used}," in msg, msg
    r = _post(server, "/v1/completions", json.dumps({"model": "base", "prompt": "x", "max_tokens": 1, "stop": "s" * 1001}))
    assert "1001 characters; at most 1000" in _err(r, 400, "stop", "invalid_value")["message"]
    r = _post(server, "/v1/completions", json.dumps({"model": "base", "prompt": "x", "max_tokens": 1, "stop": "s" * 1000}))
    assert r.status_code == 200, r.text


def test_a_full_queue_answers_429_with_retry_after_and_a_request_beyond_it_400_on_n():
    """In process (a model whose lane reports its queue): 429 carries Retry-After while the
    queue is full; a request of more sequences than serve.max_queue ever holds is a 400 on "n"
    (retrying it could never succeed)."""
    import asyncio
    from types import SimpleNamespace
    from utils.serve.app import create_app
    from utils.serve.served import ServedModel
    from utils.serve.protocol import Limits
    lane = SimpleNamespace(capacity=64, active=3)
    app = create_app({"m": ServedModel("m", tokenizer(), "pretrain", Rules.ours(tokenizer()), lane, 0, max_queue=4)},
                     Limits(), log=lambda line: None)

    async def post(body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.post("/v1/completions", json=body)
    r = asyncio.run(post({"prompt": "x", "n": 2, "max_tokens": 2}))
    _err(r, 429, None, "rate_limit_exceeded")
    assert r.headers["retry-after"] == "1"
    lane.active = 0
    r = asyncio.run(post({"prompt": ["x", "y"], "n": 3, "max_tokens": 2}))
    assert "6 sequences" in _err(r, 400, "n", "invalid_value")["message"]


def test_chat_logprob_bytes_are_each_token_s_own_bytes():
    """chat logprobs' "bytes": a SentencePiece byte-fallback piece is its one byte (the emoji's
    four pieces join to its UTF-8, where each piece's text is U+FFFD), an ordinary piece its
    UTF-8 text; a byte-level BPE piece is read back through GPT-2's byte alphabet ("Ġ" a space)."""
    import asyncio
    from types import SimpleNamespace
    from tests.test_sft import bpe_tokenizer
    from utils.data import sft
    from utils.serve.job import Job
    from utils.serve.served import ServedModel
    from utils.serve.protocol import Sampling
    lane = SimpleNamespace(capacity=64)
    spm = tokenizer()
    m = ServedModel("m", spm, "sft", Rules.ours(spm, sft.default_template()), lane, 0)
    assert not m.byte_level
    ids = spm.convert_tokens_to_ids
    assert m.token_bytes(ids("<0xF0>")) == b"\xf0"
    assert m.token_bytes(ids("\u2581the")) == b" the" and m.token_bytes(ids("é")) == "é".encode()
    emoji = spm.encode("🧪", add_special_tokens=False)

    async def lp_chat():
        job = Job(m, Sampling(None, 8, 0.0, 1.0, 0, 1, None, (), False, False, logprobs=1),
                  [[1, 5]], ["x"], True, "chatcmpl-1")
        job.logprobs[0] = [(t, -0.5, [(t, -0.5)]) for t in emoji]
        return job.lp_chat(0)["content"]
    content = asyncio.run(lp_chat())
    assert bytes(b for e in content for b in e["bytes"]).endswith("🧪".encode())
    assert [e["top_logprobs"][0]["bytes"] for e in content] == [e["bytes"] for e in content]
    bpe = bpe_tokenizer()
    b = ServedModel("b", bpe, "pretrain", Rules.ours(bpe), lane, 0)
    assert b.byte_level
    assert b.token_bytes(bpe.convert_tokens_to_ids("Ġthe")) == b" the"
    assert b.token_bytes(bpe.convert_tokens_to_ids("Ã")) == b"\xc3"             # half of a character
    text = "Grüße 日本🧪"
    assert b"".join(b.token_bytes(t) for t in bpe.encode(text, add_special_tokens=False)) == text.encode()
    assert b.token_bytes(bpe.eos_token_id) == bpe.eos_token.encode()            # a special token: its text


def _open_upload(url: str, path: str, length: int):
    """A raw connection that sent a POST's headers (Content-Length ``length``, Expect:
    100-continue) and got "100 Continue": the app is now reading the body."""
    import socket
    host, port = url.split("//")[1].rsplit(":", 1)
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=TIMEOUT)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {length}\r\nExpect: 100-continue\r\n\r\n".encode())
    got = b""
    while b"\r\n\r\n" not in got:
        part = sock.recv(4096)
        assert part, got
        got += part
    assert got.startswith(b"HTTP/1.1 100 "), got
    return sock


def _wait_for_log(server, needle: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while needle not in server.stderr():
        assert time.monotonic() < deadline, f"no {needle!r} in the log:\n{server.stderr()[-3000:]}"
        time.sleep(0.02)
    return server.stderr()


def test_a_client_leaving_mid_upload_costs_one_short_log_line(server):
    before = server.stderr().count("a client left")
    sock = _open_upload(server.url, "/v1/completions", 1000)
    sock.sendall(b'{"model": "base", "pro')
    sock.close()
    _wait_for_log(server, "a client left while sending its request")
    assert server.health()["status"] == "ok"                     # the server goes on
    log = server.stderr()
    lines = [line for line in log.splitlines() if "a client left" in line]
    assert len(lines) == before + 1 and len(lines[-1]) < 200, lines
    assert lines[-1] == "serve: a client left while sending its request to /v1/completions; nothing was run"
    assert "Traceback" not in log and "ClientDisconnect" not in log and "internal error" not in log


# --------------------------------------------------------------------------- connection deadlines
IDLE, READ = 0.5, 1.0           # the timed server's serve.idle_timeout and serve.read_timeout
BOUND = 15.0                    # what any one check below waits, at most, for the server to act


@pytest.fixture(scope="module")
def timed(work):
    """A server with short connection deadlines (IDLE and READ seconds)."""
    cfg = write_config(work["root"], {"tokenizer": {"name": TOK_NAME},
                                      "serve": {"idle_timeout": IDLE, "read_timeout": READ}}, name="deadlines.json")
    s = Server(work["root"], cfg, "--checkpoint", work["pre"])
    yield s
    assert s.stop() == 130, s.stderr()


def _connect(url: str):
    import socket
    return socket.create_connection(_host_port(url), timeout=TIMEOUT)


def _until_closed(sock, bound: float = BOUND) -> tuple[bytes, float]:
    """Every byte the server sends until it closes the connection, and the seconds that took;
    fails if it is still open after ``bound`` seconds (socket timeouts, no sleeps)."""
    import socket
    t0, got = time.monotonic(), b""
    while True:
        left = bound - (time.monotonic() - t0)
        assert left > 0, f"the server kept the connection open over {bound} s (got {got[:300]!r})"
        sock.settimeout(left)
        try:
            part = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:          # closed while our last bytes were in flight
            part = b""
        if not part:
            return got, time.monotonic() - t0
        got += part


def _trickle(sock, data: bytes, every: float = 0.05, bound: float = BOUND,
             past_answer: bool = False) -> tuple[bytes, float]:
    """Send ``data`` a byte at a time, the next one when the server has said nothing for
    ``every`` seconds (select() waits for it that long), until it answers (``past_answer``:
    until it closes the connection); then read until it closes it. The bytes it sent and the
    seconds all that took."""
    import select
    t0, got = time.monotonic(), b""
    for b in data:
        assert time.monotonic() - t0 < bound, f"the server took bytes for {bound} s and did not close ({got[:300]!r})"
        if select.select([sock], [], [], every)[0]:
            try:
                part = sock.recv(65536)
            except ConnectionResetError:
                part = b""
            if not part:
                return got, time.monotonic() - t0
            got += part
            if not past_answer:
                break
        try:
            sock.sendall(bytes([b]))
        except (BrokenPipeError, ConnectionResetError):
            break
    more, _ = _until_closed(sock, bound - (time.monotonic() - t0))
    return got + more, time.monotonic() - t0


def _timeout_error(reply: bytes) -> dict:
    """The OpenAI error of a 408 reply (asserted: status, Connection: close, shape, code)."""
    head, _, content = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), reply[:2000]
    assert b"\r\nconnection: close" in head.lower(), head
    err = json.loads(content)["error"]
    assert set(err) == {"message", "type", "param", "code"} and "serve.read_timeout" in err["message"], err
    assert (err["code"], err["type"], err["param"]) == ("request_timeout", "invalid_request_error", None), err
    return err


def test_a_connection_without_a_request_is_closed_after_serve_idle_timeout(timed):
    """A connection that never sends a byte, and one whose last response went out and that
    sends nothing more, are closed after serve.idle_timeout (uvicorn's h11 protocol closed
    neither of the first kind: its keep-alive timer starts after a response)."""
    with _connect(timed.url) as sock:
        got, secs = _until_closed(sock)
    assert got == b"" and IDLE * 0.8 < secs < IDLE + 5, (got, secs)
    with _connect(timed.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        got, secs = _until_closed(sock)
    assert got.startswith(b"HTTP/1.1 200 ") and b'"status":"ok"' in got and secs < IDLE + 5, (got, secs)


def test_a_request_not_arriving_within_serve_read_timeout_gets_408_and_is_closed(timed):
    """From a request's first byte, its headers and body have serve.read_timeout seconds,
    however the bytes trickle in: headers sent a byte at a time, a body that stops, a body
    sent a byte at a time all get a 408 in OpenAI's shape with Connection: close, and the
    connection is closed (uvicorn's h11 protocol waited for ever: any byte cancels its one
    timer); a body nobody reads (its answer went out already) is cut. Each is one log line;
    nothing is generated."""
    post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    cases = [(b"", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"s" * 500),     # headers, trickled
             (post + b'{"model": "base", "pro', b""),                                  # a body that stops
             (post, b'{"model": "base", "prompt": "' + b"p" * 970 + b'"}')]            # a body, trickled
    start = len(timed.stderr())
    for sent, trickled in cases:
        t0 = time.monotonic()
        with _connect(timed.url) as sock:
            sock.sendall(sent)
            got, _ = _trickle(sock, trickled) if trickled else _until_closed(sock)
        secs = time.monotonic() - t0
        err = _timeout_error(got)
        assert READ * 0.8 < secs < READ + 5, (secs, err)
    with _connect(timed.url) as sock:            # GET with a body the app does not read
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        got, secs = _trickle(sock, b"b" * 1000, past_answer=True)
    assert got.startswith(b"HTTP/1.1 200 ") and READ * 0.8 < secs < READ + 5, (got[:300], secs)
    log = _wait_for_log(timed, "still sending its body")[start:]
    assert len(re.findall(r"serve: a request to /v1/completions sent \d+ of its 1000 body bytes in "
                          r"serve\.read_timeout \(1 s\): answered 408", log)) == 2, log
    assert log.count("no complete request headers in serve.read_timeout (1 s): answered 408") == 1, log
    assert log.count("a request to /health was still sending its body after serve.read_timeout (1 s)") == 1, log
    assert "Traceback" not in log and "a client left" not in log and "internal error" not in log, log
    assert timed.health()["models"]["base"]["active"] == 0


def test_idle_and_stalled_connections_do_not_hold_up_requests_and_are_all_closed(timed):
    """200 connections that send nothing and 20 stalled uploads: a completion is still answered
    at once, and the server closes every one of them within its deadline."""
    import selectors
    socks = [_connect(timed.url) for _ in range(200)]
    try:
        for sock in socks[:20]:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        t0 = time.monotonic()
        r = timed.client.completions.create(model="base", prompt="The", max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason and time.monotonic() - t0 < 10
        sel, open_ = selectors.DefaultSelector(), set(socks)
        for sock in socks:
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + BOUND
        while open_ and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
                try:
                    closed = key.fileobj.recv(65536) == b""
                except ConnectionResetError:
                    closed = True
                if closed:
                    sel.unregister(key.fileobj)
                    open_.discard(key.fileobj)
        assert not open_, f"{len(open_)} of {len(socks)} connections still open after {BOUND} s"
    finally:
        for sock in socks:
            sock.close()


def test_connection_deadlines_must_be_positive(work):
    from tests.conftest import run_stage
    cfg = write_config(work["root"], {"tokenizer": {"name": TOK_NAME},
                                      "serve": {"idle_timeout": 0, "read_timeout": -1}}, name="bad_deadlines.json")
    r = run_stage("serve", "--config", cfg, "--port", "0", "--checkpoint", work["pre"], timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "serve.idle_timeout: 0 is out of range (must be > 0)" in r.stderr, r.stderr
    assert "serve.read_timeout: -1 is out of range (must be > 0)" in r.stderr, r.stderr


def test_a_disconnected_stream_frees_its_slot_at_once(server):
    """A client that goes away after its first chunk: its generation (8000 tokens asked, many
    seconds of work) is cancelled and its slot freed within the poll's bound."""
    body = {"model": "long", "prompt": "The", "max_tokens": 8000, "temperature": 1.0, "seed": 5, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    deadline = time.monotonic() + 30
    while server.health()["models"]["long"]["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.health()["models"]["long"]["active"] == 0
    line = server.log_line(json.loads(first[6:])["id"])
    assert " finish=cancelled " in line
    assert int(re.search(r"completion_tokens=(\d+)", line)[1]) < 8000


def test_concurrent_streams_equal_their_lone_runs_and_memory_stays_flat(server):
    """32 concurrent streaming requests (different seeds, lengths, greedy and sampled) on 4
    slots: each complete, none mixed with another: each equals the same request sent alone."""
    reqs = [dict(model="base", prompt=f"Story number {i}:", max_tokens=8 + (i * 7) % 25,
                 temperature=0 if i % 4 == 0 else 0.9, seed=100 + i, top_p=0.9 if i % 3 else 1.0)
            for i in range(32)]

    def stream(kw):
        parts, reason = [], None
        for p in server.client.completions.create(stream=True, **kw):
            for ch in p.choices:
                parts.append(ch.text)
                reason = ch.finish_reason or reason
        return "".join(parts), reason

    def rss() -> int:                                   # the HTTP process and the engine's
        total = 0
        for pid in (server_pid(server), engine_pid(server)):
            status = Path(f"/proc/{pid}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
        return total

    with cf.ThreadPoolExecutor(32) as ex:
        list(ex.map(stream, reqs))                         # warm-up: caches and pools allocated
        marks = [rss()]
        together = list(ex.map(stream, reqs))
        marks.append(rss())
        alone = [stream(kw) for kw in reqs]
        marks.append(rss())
        for _ in range(2):
            assert list(ex.map(stream, reqs)) == alone
            marks.append(rss())
    assert together == alone
    assert all(text and reason in ("stop", "length") for text, reason in together)
    assert max(marks) - marks[0] < 16 * 1024, marks          # KiB: 160 more requests, no growth
    assert server.health()["models"]["base"]["active"] == 0


def test_a_stream_sends_its_first_token_at_once_and_groups_the_next_within_its_interval():
    """A request's wake-ups (utils/serve/job.py Job): the first event from the engine thread
    wakes the event loop at once; later ones within serve.stream_interval wake nothing and
    wait in the inbox, to go out together, in order, with the next wake-up, which a finishing
    event always causes."""
    import asyncio
    from types import SimpleNamespace
    from utils.generation.engine import Event
    from utils.serve.job import Job
    from utils.serve.served import ServedModel
    from utils.serve.protocol import Sampling
    m = ServedModel("m", tokenizer(), "pretrain", Rules.ours(tokenizer()), SimpleNamespace(capacity=64), 0,
                    stream_interval=30.0)
    s = Sampling(None, 8, 0.0, 1.0, 0, 1, None, (), True, False)

    async def drive():
        job = Job(m, s, [[1, 5]], ["x"], False, "cmpl-1")
        seq, got = job.seqs[0], []
        events = [Event(seq, 5, "a"), Event(seq, 6, "b"), Event(seq, 7, "c"), Event(seq, None, finish="length")]

        async def consume():
            while sum(map(len, got)) < len(events):
                got.append(await job.arrived())

        async def until(n):
            for _ in range(400):
                if len(got) >= n:
                    return
                await asyncio.sleep(0.01)

        task = asyncio.create_task(consume())
        from_engine = lambda *es: asyncio.to_thread(lambda: [seq.sink(e) for e in es])  # noqa: E731
        await from_engine(events[0])
        await until(1)
        await from_engine(*events[1:3])
        await asyncio.sleep(0.3)
        assert len(got) == 1                     # no wake-up within the interval
        await from_engine(events[3])
        await asyncio.wait_for(task, 5)
        return got, events
    got, events = asyncio.run(drive())
    assert got == [events[:1], events[1:]]


@pytest.mark.parametrize("interval", [30.0, 0.0])
def test_a_wake_up_s_tokens_go_out_as_one_chunk_per_choice(interval):
    """utils/serve/sse.py event_stream: the events one wake-up brings leave in one write, each choice's
    tokens in one chunk (text joined, one logprobs entry per token), the last write with the
    usage chunk and [DONE]; serve.stream_interval 0: a chunk per token. The first token always
    goes out alone, at once."""
    import asyncio
    from types import SimpleNamespace
    from utils.generation.engine import Event
    from utils.serve.job import Job
    from utils.serve.served import ServedModel
    from utils.serve.sse import event_stream
    from utils.serve.protocol import Sampling
    m = ServedModel("m", tokenizer(), "pretrain", Rules.ours(tokenizer()), SimpleNamespace(capacity=64), 0,
                    stream_interval=interval)
    # a stop string: the engine makes the text and its events bring it, as these do (without
    # one the Job makes it from the tokens: test_generation.py, text made by the caller)
    s = Sampling(None, 8, 0.0, 1.0, 0, 2, None, ("<never>",), True, True, logprobs=1)

    async def drive():
        job = Job(m, s, [[1, 5]], ["x"], False, "cmpl-1")
        a, b = job.seqs
        writes = []

        async def consume():
            async for w in event_stream(job, lambda line: None):
                writes.append(w)
        task = asyncio.create_task(consume())
        from_engine = lambda *es: asyncio.to_thread(lambda: [e.seq.sink(e) for e in es])  # noqa: E731
        await from_engine(Event(a, 5, "The", -0.5, [(5, -0.5)]))
        for _ in range(400):
            if writes:
                break
            await asyncio.sleep(0.01)
        for seq in (a, b):                                   # as the batcher leaves them
            seq.tokens, seq.finish = [5, 6, 7], "length"
        # one wake-up's events: sunk on the loop's own thread, so all are in before the stream
        # runs (from the engine's thread, a loaded machine may run it between two of them,
        # which makes another wake-up and another write, rightly)
        for e in (Event(a, 6, " cat", -0.25, [(6, -0.25)]), Event(b, 8, "A", -1.0, [(8, -1.0)]),
                  Event(a, 7, " sat", -0.125, [(7, -0.125)]), Event(b, 9, " dog", -2.0, [(9, -2.0)]),
                  Event(b, None, finish="length"), Event(a, None, finish="length")):
            e.seq.sink(e)
        await asyncio.wait_for(task, 5)
        return writes
    writes = asyncio.run(drive())
    chunks = [[json.loads(line[6:]) for line in w.split("\n\n") if line.startswith("data: {")] for w in writes]
    texts = [[(c["choices"][0]["index"], c["choices"][0]["text"]) for c in w
              if c["choices"] and c["choices"][0]["text"]] for w in chunks]
    lps = [c["choices"][0]["logprobs"]["token_logprobs"] for w in chunks for c in w
           if c["choices"] and c["choices"][0]["logprobs"]]
    assert texts[0] == [(0, "The")]                          # the first token at once, alone
    if interval:
        assert len(writes) == 2 and texts[1] == [(1, "A dog"), (0, " cat sat")]
        assert lps == [[-0.5], [-1.0, -2.0], [-0.25, -0.125]]
    else:
        assert [t for w in texts[1:] for t in w] == [(0, " cat"), (1, "A"), (0, " sat"), (1, " dog")]
        assert lps == [[-0.5], [-0.25], [-1.0], [-0.125], [-2.0]]
    reasons = [c["choices"][0]["finish_reason"] for w in chunks for c in w if c["choices"]]
    usage = [c["usage"] for w in chunks for c in w if not c["choices"]]
    assert reasons.count("length") == 2 and usage == [{"prompt_tokens": 2, "completion_tokens": 6,
                                                       "total_tokens": 8}]
    assert writes[-1].endswith('"total_tokens": 8}}\n\ndata: [DONE]\n\n')        # the end with the last tokens


def server_pid(server) -> int:
    from tests.conftest import stage_pid
    return stage_pid(server.proc.pid)


# --------------------------------------------------------------------------- auth, HF folders, int8
@pytest.fixture(scope="module")
def hf_dir(work):
    from tests.conftest import run_stage
    out = work["root"] / "exports" / "base-hf"
    r = run_stage("export", "--config", work["cfg"], "--checkpoint", work["pre"], "--format", "hf",
                 "--out", out, timeout=300)
    assert r.returncode == 0, r.stderr
    return out


def test_api_key_int8_and_an_hf_folder_beside_a_checkpoint(work, hf_dir):
    s = Server(work["root"], work["cfg"], "--checkpoint", work["pre"], "--hf-model", hf_dir,
               "--quantize", "int8", env=offline_env(LLM_SERVE_API_KEY="s3cret"))
    try:
        r = httpx.get(s.url + "/v1/models", timeout=TIMEOUT)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        public = httpx.get(s.url + "/health", timeout=TIMEOUT)
        assert public.status_code == 200                                             # public, but the
        assert all("prefix_cache" not in m for m in public.json()["models"].values())   # cache's hits are not
        keyed = httpx.get(s.url + "/health", headers={"Authorization": "Bearer s3cret"}, timeout=TIMEOUT).json()
        assert all("prefix_cache" in m for m in keyed["models"].values())
        # the scheme's name is case-insensitive; the key is not, nor is another scheme taken
        for header, status in (("bearer s3cret", 200), ("BEARER  s3cret", 200), ("Bearer S3CRET", 401),
                               ("Basic s3cret", 401), ("s3cret", 401), ("Bearer", 401), ("Bearers3cret", 401)):
            r = httpx.get(s.url + "/v1/models", headers={"Authorization": header}, timeout=TIMEOUT)
            assert r.status_code == status, (header, r.text)
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0, timeout=TIMEOUT)
        models = {m.id: m for m in c.models.list().data}
        assert set(models) == {"base", "base-hf"}
        assert all(m.model_extra["quantize"] == "int8" for m in models.values())
        texts = [c.completions.create(model=mid, prompt="The history of", max_tokens=12, temperature=0)
                 .choices[0].text for mid in ("base", "base-hf")]
        assert texts[0] == texts[1] and texts[0]           # the same weights through both loaders
        assert "int8 weights" in s.stderr() and "MiB" in s.stderr()
        # /metrics is behind the key too, and counts this server's two requests
        assert httpx.get(s.url + "/metrics", timeout=TIMEOUT).status_code == 401
        seen = scrape(s.url, {"Authorization": "Bearer s3cret"})
        assert sum(v for (name, labels), v in seen.items() if name == "llm_request_success_total") == 2
    finally:
        assert s.stop() == 130


def test_binding_beyond_loopback_without_a_key_warns(capsys):
    import socket
    import serve
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        for host in ("0.0.0.0", "::", "192.0.2.7", "myhost.example"):
            serve.announce(sock, host, {"m": None}, None)
            assert "WARNING" in capsys.readouterr().err, host
        serve.announce(sock, "0.0.0.0", {"m": None}, "key")
        for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
            serve.announce(sock, host, {"m": None}, None)
        assert "WARNING" not in capsys.readouterr().err


def test_usage_errors_exit_2_before_loading(work):
    from tests.conftest import run_stage
    r = run_stage("serve", "--config", work["cfg"], "--port", "0", "--checkpoint", work["pre"], "--threads", "0")
    assert r.returncode == 2 and "--threads 0" in r.stderr, r.stderr
    r = run_stage("serve", "--config", work["cfg"], "--port", "0")
    assert r.returncode == 2 and "--checkpoint" in r.stderr, r.stderr
    r = run_stage("serve", "--config", work["cfg"], "--port", "0", "--checkpoint", work["pre"], "--context", "1")
    assert r.returncode == 2 and "(--context) 1" in r.stderr and "Traceback" not in r.stderr, r.stderr
    missing = Path(work["pre"]).parent / "missing.pt"
    r = run_stage("serve", "--config", work["cfg"], "--port", "0", "--checkpoint", work["pre"], "--checkpoint", missing)
    assert r.returncode == 1 and f"{missing} does not exist" in r.stderr and "model '" not in r.stderr, r.stderr
    for key in ("", "  "):           # e.g. --api-key "$KEY" with KEY unset: not "serve without a key"
        r = run_stage("serve", "--config", work["cfg"], "--port", "0", "--checkpoint", work["pre"], "--api-key", key,
                     timeout=60)
        assert r.returncode == 2 and "--api-key is empty" in r.stderr, r.stderr
        assert "model '" not in r.stderr and "listening on" not in r.stdout and "Traceback" not in r.stderr


def test_a_checkpoint_the_engine_process_cannot_open_is_named_exit_1(work):
    """Models open in the engine process: the loader's own error comes back to the server,
    which names the file and exits 1, no traceback, nothing served."""
    from tests.conftest import run_stage
    bad = work["root"] / "checkpoints" / "garbage" / "checkpoint_best.pt"
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_bytes(b"this is not a checkpoint\n" * 10)
    r = run_stage("serve", "--config", work["cfg"], "--port", "0", "--checkpoint", work["pre"], "--checkpoint", bad,
                 timeout=300)
    assert r.returncode == 1 and str(bad) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "listening on" not in r.stdout and "engine process" not in r.stderr


def test_cors_lets_the_listed_origins_call_the_api_from_a_browser(work, server):
    """serve.cors_origins: a browser's preflight (OPTIONS, never carrying the key) from a listed
    origin is answered before the key check, and the answers name the origin; another origin
    gets no such header (the browser then blocks the page). Without the setting (the module's
    server), nothing cross-origin is allowed. A malformed origin is a usage error naming it."""
    from tests.conftest import run_stage
    page = "http://localhost:3000"
    pre = {"Origin": page, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(server.url + "/v1/completions", headers=pre, timeout=TIMEOUT)
    assert "access-control-allow-origin" not in r.headers, r.headers
    cfg = write_config(work["root"], {"tokenizer": {"name": TOK_NAME}, "serve": {"cors_origins": [page]}},
                       name="cors.json")
    s = Server(work["root"], cfg, "--checkpoint", work["pre"], "--api-key", "k3y")
    try:
        r = httpx.options(s.url + "/v1/completions", headers=pre, timeout=TIMEOUT)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page, (r.status_code, r.headers)
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        body = {"model": "base", "prompt": "The", "max_tokens": 2}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=TIMEOUT,
                       headers={"Origin": page, "Authorization": "Bearer k3y"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page, r.headers
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=TIMEOUT, headers={"Origin": page})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == page   # the page can read why
        evil = {**pre, "Origin": "http://evil.example"}
        r = httpx.options(s.url + "/v1/completions", headers=evil, timeout=TIMEOUT)
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=TIMEOUT,
                       headers={"Origin": "http://evil.example", "Authorization": "Bearer k3y"})
        assert "access-control-allow-origin" not in r.headers
    finally:
        assert s.stop() == 130
    bad = write_config(work["root"], {"tokenizer": {"name": TOK_NAME}, "serve": {"cors_origins": ["*", page + "/"]}},
                       name="cors-bad.json")
    r = run_stage("serve", "--config", bad, "--port", "0", "--checkpoint", work["pre"], timeout=60)
    assert r.returncode == 2 and "serve.cors_origins[1]" in r.stderr and "trailing /" in r.stderr, r.stderr
    assert "model '" not in r.stderr and "Traceback" not in r.stderr


def test_the_api_key_comes_from_the_flag_else_a_non_empty_variable(capsys):
    from serve import resolve_api_key
    from utils.cli import UsageError
    assert resolve_api_key("k", "other") == "k" and resolve_api_key(None, "v") == "v"
    assert resolve_api_key(None, None) is None and capsys.readouterr().err == ""
    assert resolve_api_key(None, "") is None
    assert "LLM_SERVE_API_KEY is set but empty" in capsys.readouterr().err
    with pytest.raises(UsageError, match="--api-key is empty"):
        resolve_api_key("", "v")


def test_int8_weights_stay_close_to_fp32():
    from tests.test_model import build
    from utils.quant import Int8Linear, quantize_int8
    m = build(seed=3)
    x = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        ref = m(x)[0]
        report = quantize_int8(m)
        got = m(x)[0]
    assert isinstance(m.lm_head, Int8Linear) and report.bytes_after < report.bytes_before / 3
    assert report.head_copy == 97 * 32 + 97 * 6 and "less for those layers); plus a" in report.line()
    untied = quantize_int8(build(seed=3, tie_embeddings=False))              # the head among the layers
    assert untied.head_copy == 0 and untied.line().endswith("less for those layers)")
    assert untied.bytes_before - report.bytes_before == 97 * 32 * 4
    rel = (got - ref).norm() / ref.norm()
    assert 0 < rel < 0.02, rel
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_int8_products_have_no_per_channel_bias_and_many_rows_take_one_gemm(monkeypatch):
    """The int8 product's error is the random rounding of bf16 activations and outputs, not a
    bias per output channel (a scale rounded to bf16: the CPU kernel gets unit scales and the
    fp32 scales multiply its output); 16 rows or more (a prefill) take the bf16 GEMM over the
    widened weights, a few rows (decode steps) the row-by-row kernel, and both agree."""
    import utils.quant as Q
    g = torch.Generator().manual_seed(0)
    w = Q.Int8Weight.quantize(torch.randn(64, 96, generator=g))
    exact = w.qweight.double() * w.scales.double()[:, None]                 # (out, in)
    x = torch.randn(512, 96, generator=g)
    ref = x.double() @ exact.t()
    rows = torch.cat([Q.int8_mm(x[i:i + 4], w) for i in range(0, 512, 4)])  # the decode path
    gain = ((rows.double() - ref) * ref).sum(0) / (ref * ref).sum(0)        # per channel: its scale's error
    assert gain.abs().max() < 2 ** -11, gain.abs().max()                    # bf16 scales: up to 2^-9
    calls, kernel = [], torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    many = Q.int8_matmul(x.view(32, 16, 96), w)                              # 512 rows at once
    assert calls == [] and many.shape == (32, 16, 64)
    assert Q.int8_matmul(x[:4], w).shape == (4, 64) and calls == [4]
    rel = (many.reshape(512, 64).double() - rows.double()).norm() / rows.double().norm()
    assert rel < 2 ** -7, rel                                            # often bit-equal


# --------------------------------------------------------------------------- shutdown
def _read_sse(r, stop_after: int):
    lines = r.iter_lines()
    got = []
    for line in lines:
        if line.startswith("data: "):
            got.append(line[6:])
            if len(got) >= stop_after:
                break
    return got, lines


@pytest.mark.parametrize("sig,grace", [(signal.SIGTERM, 60), (signal.SIGINT, 0)])
def test_a_stop_signal_finishes_or_cuts_running_streams_and_exits_130(work, sig, grace):
    """SIGTERM or SIGINT (Ctrl-C) to main.py, which forwards it: no new connections; a running
    stream finishes within serve.shutdown_grace (60 s here), or is cut at once (0) with an
    error event; both end with data: [DONE]; the stage exits 130."""
    cfg = write_config(work["root"], {"tokenizer": {"name": TOK_NAME}, "serve": {"shutdown_grace": grace}},
                       name=f"grace{grace}.json")
    s = Server(work["root"], cfg, "--checkpoint", work["long"])
    body = {"model": "long", "prompt": "The", "max_tokens": 1500, "temperature": 1.0, "seed": 1, "stream": True}
    try:
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            first, lines = _read_sse(r, 2)
            s.proc.send_signal(sig)
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        events = first + rest
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        if grace:
            assert last["choices"][0]["finish_reason"] == "length"
            text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
            assert len(text) > 100
        else:
            assert last["error"]["code"] == "cancelled"
        with pytest.raises(httpx.TransportError):
            httpx.get(s.url + "/health", timeout=5)
    finally:
        code = s.stop()
    assert code == 130, s.stderr()
    assert "generations get up to" in s.stderr() and f"received {sig.name}" in s.stderr()



def engine_pid(server) -> int:
    """The server's engine process (utils/generation/remote.py): the stage's one child."""
    from tests.conftest import child_pids
    kids = child_pids(server_pid(server))
    assert len(kids) == 1, kids
    assert "utils.generation.remote" in Path(f"/proc/{kids[0]}/cmdline").read_bytes().decode(), kids
    return kids[0]


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True                         # exited, not yet reaped
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_an_engine_process_that_dies_mid_stream_ends_it_with_an_error_and_stops_the_server(work):
    """The engine runs in a process of its own; killed (as the kernel's OOM killer would), a
    running stream ends with an error event naming it and data: [DONE], and the server stops
    with exit 1 and a message that says what happened, instead of refusing every request."""
    s = Server(work["root"], work["cfg"], "--checkpoint", work["long"])
    body = {"model": "long", "prompt": "The", "max_tokens": 1500, "temperature": 1.0, "seed": 1, "stream": True}
    try:
        engine = engine_pid(s)
        assert engine != server_pid(s)
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            first, lines = _read_sse(r, 2)
            os.kill(engine, signal.SIGKILL)
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        events = first + rest
        assert events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])["error"]
        assert err["code"] == "engine_error" and "killed by signal 9" in err["message"], err
        code = s.proc.wait(timeout=60)
    finally:
        if s.proc.poll() is None:
            s.stop()
    assert code == 1, s.stderr()
    assert "serve.py: error: the engine process was killed by signal 9; the server stopped" in s.stderr()


def test_the_engine_process_ends_with_a_server_that_was_killed(work):
    """A stage killed outright (SIGKILL: no shutdown runs) leaves no engine process behind: it
    ends when its socket to the server closes."""
    s = Server(work["root"], work["cfg"], "--checkpoint", work["pre"])
    try:
        engine = engine_pid(s)
        os.kill(server_pid(s), signal.SIGKILL)
        assert _gone(engine, 30), "the engine process outlived its server"
    finally:
        s.stop()


def test_weights_that_overflow_end_each_request_with_an_error_naming_it_and_the_server_goes_on(work):
    """A model whose arithmetic overflows (finite weights near float32's limit give inf, then
    NaN logits): a plain request is a 500 engine_error saying the logits are not finite, a
    stream ends with that error event and data: [DONE], the slot is free again, a sound model
    beside it answers, and the server stops cleanly."""
    from utils.run import load_checkpoint
    from utils.training.checkpoint import save_checkpoint
    bad = work["root"] / "checkpoints" / "overflow" / "checkpoint_best.pt"
    ck = load_checkpoint(work["pre"])
    ck["model"]["norm.weight"].fill_(3e38)
    bad.parent.mkdir(parents=True)
    save_checkpoint(bad, ck)
    s = Server(work["root"], work["cfg"], "--checkpoint", bad, "--checkpoint", work["pre"])
    try:
        r = httpx.post(s.url + "/v1/completions", json={"model": "overflow", "prompt": "The", "max_tokens": 4},
                       timeout=TIMEOUT)
        err = _err(r, 500, None, "engine_error")
        assert "not finite" in err["message"] and "overflows" in err["message"], err
        body = {"model": "overflow", "prompt": "The", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "not finite" in json.loads(events[-2])["error"]["message"], events
        assert s.health()["models"]["overflow"]["active"] == 0
        ok = s.client.completions.create(model="base", prompt="The", max_tokens=3, temperature=0)
        assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 3
        assert "engine step failed" in s.stderr() and "Traceback" not in s.stderr()
    finally:
        code = s.stop()
    assert code == 130, s.stderr()


def test_a_request_whose_body_arrives_after_sigterm_gets_503(work):
    """A request still uploading its body when SIGTERM comes: the engines stop (the server says
    so), then its body arrives and it is answered 503 shutting_down, not a 500; exit 130."""
    s = Server(work["root"], work["cfg"], "--checkpoint", work["pre"])
    body = json.dumps({"model": "base", "prompt": "The", "max_tokens": 2}).encode()
    sock = None
    try:
        sock = _open_upload(s.url, "/v1/completions", len(body))
        s.proc.send_signal(signal.SIGTERM)
        _wait_for_log(s, "engines stopped; 1 open connection(s)")
        sock.sendall(body)
        reply = b""
        while part := sock.recv(65536):                   # the server closes it after the answer
            reply += part
        head, _, content = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 "), reply[:2000]
        err = json.loads(content)["error"]
        assert (err["code"], err["type"]) == ("shutting_down", "server_error"), err
    finally:
        if sock is not None:
            sock.close()
        code = s.stop()
    assert code == 130, s.stderr()
    assert "Traceback" not in s.stderr() and "internal error" not in s.stderr()

# --------------------------------------------------------------------------- the chat page
@needs_browser
def test_chat_page_in_a_real_browser(work, tmp_path):
    """Headless Chromium: pick a model, type, watch the reply stream in, stop it, send again,
    a chat model keeps the conversation, clear; a screenshot lands in the test's folder."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait
    s = Server(work["root"], work["cfg"], "--checkpoint", work["long"], "--checkpoint", work["chat"])
    driver = headless_chromium(tmp_path / "profile", "1100,800")
    wait = WebDriverWait(driver, 60, poll_frequency=0.1)
    try:
        driver.get(s.url + "/")
        wait.until(lambda d: len(Select(d.find_element(By.ID, "model")).options) == 2)
        Select(driver.find_element(By.ID, "model")).select_by_value("long")
        box = driver.find_element(By.ID, "max-tokens")
        box.clear()
        box.send_keys("6000")
        driver.find_element(By.ID, "input").send_keys("Once upon a time")
        driver.find_element(By.ID, "send").click()
        reply = lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .text")  # noqa: E731
        wait.until(lambda d: len(reply(d)) == 1 and len(reply(d)[0].text) > 30)      # streaming
        assert not driver.find_element(By.ID, "stop").get_property("disabled")
        driver.find_element(By.ID, "stop").click()
        wait.until(lambda d: "stopped" in d.find_element(By.CSS_SELECTOR, ".msg.assistant .meta").text)
        stopped = reply(driver)[0].text
        assert driver.find_element(By.ID, "send").is_enabled()
        wait.until(lambda d: s.health()["models"]["long"]["active"] == 0)         # the slot is free
        assert reply(driver)[0].text == stopped
        Select(driver.find_element(By.ID, "model")).select_by_value("sft_chat")
        box.clear()
        box.send_keys("8")
        for question in ("Hello there", "And then?"):
            driver.find_element(By.ID, "input").send_keys(question)
            driver.find_element(By.ID, "send").click()
            n = len(reply(driver))
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta")) == n)
        metas = [m.text for m in driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta")]
        assert all("tokens" in m for m in metas[1:]) and "tokens/s" in driver.find_element(By.ID, "status").text
        chat_lines = [line for line in s.stderr().splitlines() if "model=sft_chat" in line]
        assert len(chat_lines) == 2
        first, second = (int(re.search(r"prompt_tokens=(\d+)", line)[1]) for line in chat_lines)
        assert second > first + 3                                 # the second carried the first exchange
        # a refused question (max tokens beyond the context) leaves the conversation and goes
        # back to the input box: the next one is sent after the last answer, not after it (the
        # page kept it, and every later send was a 400 for two user messages in a row)
        box.clear()
        box.send_keys("100000")
        driver.find_element(By.ID, "input").send_keys("Too long?")
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.error"))
        assert "max_tokens" in driver.find_element(By.CSS_SELECTOR, ".msg.error").text
        assert driver.find_element(By.ID, "input").get_property("value") == "Too long?"
        box.clear()                                  # empty: the server's default, not max_tokens 0
        driver.find_element(By.ID, "send").click()
        n = len(reply(driver))
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta")) == n)
        assert len(driver.find_elements(By.CSS_SELECTOR, ".msg.error")) == 1
        chat_lines = [line for line in s.stderr().splitlines() if "model=sft_chat" in line]
        assert len(chat_lines) == 3 and int(re.search(r"prompt_tokens=(\d+)", chat_lines[2])[1]) > second
        driver.save_screenshot(str(tmp_path / "chat.png"))
        assert (tmp_path / "chat.png").stat().st_size > 10_000
        driver.find_element(By.ID, "clear").click()
        assert not driver.find_elements(By.CSS_SELECTOR, ".msg")
    finally:
        driver.quit()
        s.stop()


def test_infer_and_benchmark_take_int8_weights(work, tmp_path):
    """--quantize int8 in infer and benchmark: said on stderr, results marked int8 (and kept out
    of the model card's table of these weights), perplexity within a few percent of fp32."""
    from tests.conftest import run_stage
    r = run_stage("infer", "--config", work["cfg"], "--checkpoint", work["pre"], "--prompt", "The history of",
                 "--max-new-tokens", "8", "--temperature", "0", "--quantize", "int8")
    assert r.returncode == 0 and r.stdout.strip() and "int8 weights" in r.stderr, r.stderr
    ppl = {}
    for q in ("none", "int8"):
        out = tmp_path / q
        r = run_stage("benchmark", "--config", work["cfg"], "--test", "--tasks", "perplexity,completion",
                     "--quantize", q, work["pre"], "--output-dir", out, timeout=600)
        assert r.returncode == 0, r.stderr
        m = json.loads(next(out.glob("*.json")).read_text())["models"][0]
        assert m["identity"].get("quantize") == (None if q == "none" else "int8")
        ppl[q] = m["results"]["perplexity"]["metrics"]["perplexity"]["value"]
    assert ppl["none"] != ppl["int8"] and abs(ppl["int8"] / ppl["none"] - 1) < 0.05, ppl
    r = run_stage("benchmark", "--config", work["cfg"], "--quantize", "int8", "--hf-model", "x")
    assert r.returncode == 2 and "--quantize applies to" in r.stderr


def test_the_demo_example_streams_a_chat_reply_and_stops_the_server(work):
    import sys
    from tests.conftest import ROOT
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "serve_and_ask.py"), "--question", "Hi?",
                        "--max-tokens", "6", "--", "--config", str(work["cfg"]), "--checkpoint",
                        str(work["chat"].parent)], capture_output=True, text=True, timeout=300,
                       env=offline_env(), cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "assistant: " in r.stdout and "exit 130" in r.stdout


def test_prompt_lookup_gives_the_same_greedy_text_and_its_bad_values_are_named(server):
    """prompt_lookup_num_tokens (utils/generation/speculative.py): a greedy request's text is
    plain decoding's, plain and streamed, chat and completions; a sampled request with a seed
    is unchanged; a bad value is a 400 naming the field."""
    c = server.client
    prompt = "the cat sat on the mat and the cat sat on the mat and the cat"
    for model, kw in (("base", dict(prompt=prompt)), ("script", dict(prompt="Hello"))):
        plain = c.completions.create(model=model, max_tokens=24, temperature=0, **kw).choices[0].text
        fast = c.completions.create(model=model, max_tokens=24, temperature=0,
                                    extra_body={"prompt_lookup_num_tokens": 6}, **kw).choices[0].text
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model=model, max_tokens=24, temperature=0, stream=True, extra_body={"prompt_lookup_num_tokens": 3}, **kw)
            if ch.choices)
        assert plain == fast == streamed and plain, (model, plain, fast, streamed)
    msgs = [{"role": "user", "content": prompt}]
    chat = [c.chat.completions.create(model="sft_chat", messages=msgs, max_tokens=16, temperature=t, seed=4,
                                      extra_body=extra).choices[0].message.content
            for t in (0, 0.8) for extra in ({}, {"prompt_lookup_num_tokens": 5})]
    assert chat[0] == chat[1] and chat[2] == chat[3], chat
    for bad in (-1, 65, 2.5, "4"):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="base", prompt="x", max_tokens=2, extra_body={"prompt_lookup_num_tokens": bad})
        assert e.value.body["param"] == "prompt_lookup_num_tokens", e.value.body
