"""`main.py serve`: a live server on 127.0.0.1 (a free port, started through main.py as a
user would) driven with the official `openai` client and raw HTTP: chat and completions,
plain and streaming, seeds, stop strings, n > 1, logprobs, errors in OpenAI's shape, auth,
disconnects, 32 concurrent streams equal to their lone runs, SIGTERM, int8 weights, an HF
folder served beside checkpoints. Every request loop is bounded in count and time."""
from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import subprocess
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import pytest
import torch

from tests.conftest import offline_env, popen_main, wait_for_line, write_config
from tests.test_sft import TOK_NAME, make_checkpoint, tokenizer

TIMEOUT = 60


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
        self.err.flush()
        return self.log.read_text()

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=TIMEOUT).json()

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
    cfg = write_config(root, {"tokenizer": {"name": TOK_NAME}, "serve": {"max_batch": 4}})
    from utils.data import sft
    ck = root / "checkpoints"
    chat = make_checkpoint(ck / "sft_chat" / "checkpoint_best.pt", kind="sft", seed=3,
                           chat_template=sft.default_template())
    pre = make_checkpoint(ck / "base" / "checkpoint_best.pt", seed=1)
    long = make_checkpoint(ck / "long" / "checkpoint_best.pt", seed=2, max_seq_len=8192)
    return {"root": root, "cfg": cfg, "chat": chat, "pre": pre, "long": long}


@pytest.fixture(scope="module")
def server(work):
    s = Server(work["root"], work["cfg"], "--checkpoint", work["chat"].parent, "--checkpoint", work["pre"])
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
    assert [m.id for m in c.models.list().data] == ["sft_chat", "base"]
    assert set(server.health()["models"]) == {"sft_chat", "base"}
    r = c.chat.completions.create(model="sft_chat", messages=[{"role": "user", "content": "Hello?"}],
                                  max_tokens=9, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 9 and r.usage.prompt_tokens > 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert "sft_chat" in server.stderr() and "ttft=" in server.stderr()       # one log line per request


def test_chat_uses_the_checkpoints_template_and_equals_the_engine(server, work):
    """The reply is what the engine gives for the template's prompt ids (greedy), with history."""
    from utils.data import sft
    tok = tokenizer()
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3+3?"}]
    r = server.client.chat.completions.create(model="sft_chat", messages=msgs, max_tokens=12, temperature=0)
    ids = sft.encode_prompt(tok, sft.default_template(), [("What is 2+2?", "4.")], "And 3+3?",
                            tok.bos_token_id, tok.eos_token_id)
    want = _lone(work, "chat", ids, 12, temperature=0, eos_id=tok.eos_token_id)
    assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)


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


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}), 404, "model"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": "hello"}), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [{"role": "user", "content": "x"}] * 65}), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [{"role": "assistant", "content": "x"}]}), 400, "messages[0].role"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [{"role": "tool", "content": "x"}]}), 400, "messages[0].role"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}), 400, "temperature"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [{"role": "user", "content": "x"}], "top_p": 1.5}), 400, "top_p"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}), 400, "max_tokens"),
    ("/v1/chat/completions", json.dumps({"model": "sft_chat", "messages": [{"role": "user", "content": "x" * 100_001}]}), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"model": "base", "messages": [{"role": "user", "content": "x"}]}), 400, "model"),
    ("/v1/completions", json.dumps({"model": "base", "prompt": 5}), 400, "prompt"),
    ("/v1/completions", json.dumps({"model": "base", "prompt": "x", "n": 0}), 400, "n"),
    ("/v1/completions", json.dumps({"model": "base", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}), 400, "stop"),
    ("/v1/completions", json.dumps({"model": "base", "prompt": "x", "max_tokens": -1}), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"model": "base", "prompt": "word " * 400}), 400, "prompt"),
    ("/v1/nothing", b"{}", 404, None),
])
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


def test_a_disconnected_stream_frees_its_slot(work, server):
    body = {"model": "base", "prompt": "The", "max_tokens": 250, "temperature": 1.0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(2)]
        assert any(line.startswith("data: ") for line in got)
    deadline = time.monotonic() + 30
    while server.health()["models"]["base"]["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.health()["models"]["base"]["active"] == 0
    log = server.stderr()
    assert "finish=cancelled" in log or "finish=length" in log


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

    def rss() -> int:
        status = Path(f"/proc/{server_pid(server)}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))

    with cf.ThreadPoolExecutor(32) as ex:
        list(ex.map(stream, reqs[:8]))                     # warm-up: caches and pools allocated
        before = rss()
        together = list(ex.map(stream, reqs))
    alone = [stream(kw) for kw in reqs]
    assert together == alone
    assert all(reason in ("stop", "length") for _, reason in together)
    with cf.ThreadPoolExecutor(32) as ex:
        list(ex.map(stream, reqs))
    assert rss() - before < 64 * 1024, (before, rss())      # KiB: no growth per request
    assert server.health()["models"]["base"]["active"] == 0


def server_pid(server) -> int:
    from tests.conftest import stage_pid
    return stage_pid(server.proc.pid)
