"""`main.py infer`: scripted output equals the generation engine, the chat template for SFT
checkpoints, bad inputs without tracebacks, and the interactive screen through a real pty
(pexpect): run and checkpoint menus, prompts, custom parameters, Ctrl-C during generation,
a multi-model comparison, NO_COLOR."""
from __future__ import annotations

import json
import os
import time

import pexpect  # a pinned requirement: missing is a failure, not a skip

import pytest
import torch

from tests.conftest import offline_env, run_stage, spawn_main, stage_pid, wait_until_blocked, write_config
from tests.test_sft import TOK_NAME, make_checkpoint, tokenizer
from utils.generation.engine import Engine



@pytest.fixture(scope="module")
def work(tmp_path_factory, samples):
    root = tmp_path_factory.mktemp("infer")
    cfg = write_config(root, {"tokenizer": {"name": TOK_NAME}})
    from utils.data import sft
    ck = root / "checkpoints"
    pre = make_checkpoint(ck / "run_pre" / "checkpoint_best.pt", seed=1)
    make_checkpoint(ck / "run_pre" / "checkpoint_latest.pt", seed=2)
    t0 = time.time()
    os.utime(ck / "run_pre" / "checkpoint_best.pt", (t0 - 3600, t0 - 3600))
    os.utime(ck / "run_pre" / "checkpoint_latest.pt", (t0 - 3600, t0 - 3600))
    flat = make_checkpoint(ck / "checkpoint_old.pt", seed=4)       # the seed's legacy flat layout
    os.utime(flat, (t0 - 7200, t0 - 7200))
    chat = make_checkpoint(ck / "sft_demo_x" / "checkpoint_best.pt", kind="sft", seed=3,
                           chat_template=sft.default_template())
    return {"root": root, "cfg": cfg, "pre": pre, "chat": chat}


def _model(path):
    from utils.run import load_model
    return load_model(path)[0]


# --------------------------------------------------------------------------- scripted
def test_scripted_output_equals_model_generate_with_the_same_seed(work):
    from utils.data import sft
    tok = tokenizer()
    prompt = "The history of </s> science"
    r = run_stage("infer", "--config", work["cfg"], "--checkpoint", work["pre"], "--prompt", prompt,
                 "--max-new-tokens", "12", "--temperature", "0.9", "--top-k", "40", "--seed", "7")
    assert r.returncode == 0, r.stderr
    ids = [tok.bos_token_id] + sft.encode_plain(tok, [prompt])[0]
    assert tok.eos_token_id not in ids
    want = Engine(_model(work["pre"])).generate([ids], 12, temperature=0.9, top_k=40, top_p=0.95,
                                        eos_id=tok.eos_token_id, seed=7)[0]
    assert r.stdout == tok.decode(want, skip_special_tokens=True) + "\n"
    assert "tokens/s" in r.stderr          # statistics go to stderr, never into the pipeline


def test_a_temperature_below_float32s_reach_is_greedy(work):
    """--temperature 1e-300 made the sampling step's softmax NaN (an unexpected error); it is
    the greedy limit: the same text as --temperature 0."""
    runs = [run_stage("infer", "--config", work["cfg"], "--checkpoint", work["pre"], "--prompt", "The river",
                     "--max-new-tokens", "10", "--temperature", t, "--seed", "3") for t in ("1e-300", "0")]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.strip()


def test_scripted_sft_checkpoint_uses_the_chat_template_and_json(work):
    from utils.data import sft
    tok = tokenizer()
    r = run_stage("infer", "--config", work["cfg"], "--checkpoint", work["chat"], "--prompt", "-",
                 "--max-new-tokens", "8", "--temperature", "0", "--json",
                 input="Why is the sky blue?\n")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    ids = sft.encode_prompt(tok, sft.default_template(), [], "Why is the sky blue?",
                            tok.bos_token_id, tok.eos_token_id)
    want = Engine(_model(work["chat"])).generate([ids], 8, temperature=0, eos_id=tok.eos_token_id)[0]
    from utils.generation.detok import TextDecoder       # the reply: after the prompt, no lead
    continues, lead = sft.answer_decoding(sft.default_template())
    reply = TextDecoder(tok, ids[-1:] if continues else (), lead)
    for t in want:
        reply.push(t)
    assert data["text"] == reply.text()
    assert data["chat_template"] is True and data["kind"] == "sft"
    assert data["tokens"] == len(want) and data["tokens_per_s"] > 0
    assert data["time_to_first_token_s"] is not None


def test_scripted_bad_inputs_exit_cleanly(work, tmp_path):
    cfg = work["cfg"]
    r = run_stage("infer", "--config", cfg, "--checkpoint", tmp_path / "missing.pt", "--prompt", "x")
    assert r.returncode == 1 and "file not found" in r.stderr and "Traceback" not in r.stderr
    hostile = tmp_path / "hostile.pt"

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))
    torch.save({"format_version": 1, "model": Boom(), "model_args": {}}, hostile)
    r = run_stage("infer", "--config", cfg, "--checkpoint", hostile, "--prompt", "x")
    assert r.returncode == 1 and "refused" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "pwned").exists()
    trunc = tmp_path / "trunc.pt"
    trunc.write_bytes(work["pre"].read_bytes()[:5000])
    r = run_stage("infer", "--config", cfg, "--checkpoint", trunc, "--prompt", "x")
    assert r.returncode == 1 and "trunc.pt" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "empty_run").mkdir()
    r = run_stage("infer", "--config", cfg, "--checkpoint", tmp_path / "empty_run", "--prompt", "x")
    assert r.returncode == 1 and "without checkpoint files" in r.stderr
    r = run_stage("infer", "--config", cfg, "--checkpoint", work["pre"].parent, "--prompt", "x",
                 "--max-new-tokens", "2")
    assert r.returncode == 0 and "using checkpoint_best.pt" in r.stderr
    r = run_stage("infer", "--config", cfg, "--checkpoint", work["pre"], "--prompt", "   ")
    assert r.returncode == 2 and "prompt is empty" in r.stderr
    r = run_stage("infer", "--config", cfg, "--prompt", "x")
    assert r.returncode == 2 and "--checkpoint" in r.stderr


def test_scripted_odd_values_and_bytes(work):
    """More new tokens than memory can hold a KV cache for: exit 2 saying so (a 10^12 request
    allocated a cache of 10^12 positions: an unexpected error). A seed beyond 64
    bits is taken modulo 2^64 (an overflow before). A device name that is not auto / cpu / cuda
    / cuda:N, and a prompt whose bytes are not UTF-8 on standard input or in argv: exit 2 with
    the reason (unexpected errors before)."""
    import re
    import subprocess
    from tests.conftest import ROOT, default_signals, main_command
    cfg, pre = work["cfg"], work["pre"]
    r = run_stage("infer", "--config", cfg, "--checkpoint", pre, "--prompt", "The history of",
                 "--max-new-tokens", 10 ** 12, "--temperature", "0")
    assert r.returncode == 2 and re.search(r"max new tokens 1,000,000,000,000: the KV cache for the prompt's "
                                           r"\d+ and that many positions would take [\d,.]+ GiB, more than "
                                           r"the [\d,.]+ GiB available", r.stderr), r.stderr
    outs = [run_stage("infer", "--config", cfg, "--checkpoint", pre, "--prompt", "x", "--max-new-tokens", 8,
                     "--temperature", "0.9", "--seed", seed) for seed in (2 ** 80 + 5, (2 ** 80 + 5) % 2 ** 64)]
    assert all(o.returncode == 0 for o in outs) and outs[0].stdout == outs[1].stdout, outs[0].stderr
    r = run_stage("infer", "--config", cfg, "--checkpoint", pre, "--prompt", "x", "--device", "tpu")
    assert r.returncode == 2 and "inference.device is 'tpu': give auto, cpu, cuda or cuda:N" in r.stderr, r.stderr
    run = dict(capture_output=True, env=offline_env(), cwd=ROOT, preexec_fn=default_signals, timeout=300)
    r = subprocess.run(main_command("infer", "--config", cfg, "--checkpoint", pre, "--prompt", "-"),
                       input="café\n".encode("latin-1"), **run)
    assert r.returncode == 2 and b"not UTF-8 text (byte 0xe9 at offset 3)" in r.stderr, r.stderr
    r = subprocess.run([*main_command("infer", "--config", cfg, "--checkpoint", pre, "--prompt"),
                        "café".encode("latin-1")], stdin=subprocess.DEVNULL, **run)
    assert r.returncode == 2 and b"argument --prompt: holds bytes that are not UTF-8" in r.stderr, r.stderr
    assert b"Traceback" not in r.stderr


# --------------------------------------------------------------------------- interactive (pty)
def _spawn(work, *extra, no_color=True):
    env = offline_env()
    if no_color:
        env["NO_COLOR"] = "1"
    else:
        env.pop("NO_COLOR", None)
    return spawn_main("infer", "--config", work["cfg"], *extra, env=env, timeout=90)


def test_interactive_single_model_session(work):
    c = _spawn(work, "--max-new-tokens", "6")
    c.expect("Select a mode")
    c.sendline("1")
    c.expect("most recent first")
    c.expect(r"1\) sft_demo_x .*<- most recent")     # newest run first and marked
    c.expect(r"2\) run_pre")
    c.expect(r"3\) checkpoints \(flat layout\)  \[legacy\]")
    c.expect("Select a run")
    c.sendline("2")
    c.expect(r"1\) checkpoint_best.pt  \(best\)")
    c.expect(r"2\) checkpoint_latest.pt  \(latest\)")
    c.sendline("1")
    c.expect("Loaded run_pre/checkpoint_best.pt")
    c.expect("Prompt")
    c.sendline("")                                    # empty prompt: asked again
    c.expect("empty prompt")
    c.expect("Prompt")
    c.sendline("The history of")
    c.expect("Parameters: 1\\) defaults \\(max new tokens 6")
    c.sendline("")
    c.expect("Generated:")
    c.expect(r"(\d+) tokens in [\d.]+ s \([\d.]+ tokens/s; first token after")
    c.expect("Prompt")
    c.sendline("Once upon a time")                    # second prompt, customized parameters
    c.expect("customize")
    c.sendline("2")
    c.expect("Max new tokens")
    c.sendline("100000")
    c.expect("Temperature")
    c.sendline("abc")                                 # invalid: asked again
    c.expect("not a valid value")
    c.sendline("inf")                                 # not finite (scripted --temperature refuses it too)
    c.expect("not a valid value")
    c.sendline("1.0")
    c.expect("Top-k")
    c.sendline("0")
    c.expect("Top-p")
    c.sendline("1.0")
    c.expect("Generated:\r\n")
    c.expect(r"\S")                                   # tokens are streaming
    c.sendintr()                                      # Ctrl-C stops this generation only
    c.expect("generation stopped by Ctrl-C")
    c.expect(r"\[stopped\]")
    c.expect("Prompt")
    c.sendline("More than memory holds")              # a KV cache too large: said, session goes on
    c.expect("customize")
    c.sendline("2")
    c.expect("Max new tokens")
    c.sendline(str(10 ** 12))
    for _ in ("Temperature", "Top-k", "Top-p"):
        c.expect(_)
        c.sendline("")
    c.expect("GiB available; ask for fewer")
    c.expect("Prompt")
    c.sendline("/quit")
    c.expect("Bye.")
    c.expect(pexpect.EOF)
    c.close()
    assert c.exitstatus == 0
    assert "Traceback" not in c.before and "\x1b[" not in c.before


def test_interactive_sft_chat_keeps_the_conversation(work):
    """The second turn's prompt holds the first exchange (its token count, printed with the
    statistics, equals the chat template rendered over that history), whose KV the prefix cache
    gives back (the reused tokens, printed too: whole blocks of the first turn's prompt and
    answer); /clear forgets it."""
    from utils.data import sft
    tok, template = tokenizer(), sft.default_template()
    bos, eos = tok.bos_token_id, tok.eos_token_id
    c = _spawn(work, "--checkpoint", work["chat"], "--max-new-tokens", "4", "--temperature", "0")
    c.expect("chat \\(User/Assistant template\\)")
    counts, reused = [], []
    q1 = "Hello, tell me about the history of the rivers and mountains"
    for text in (q1, "Why?", "/clear", "Why?"):
        c.expect("to forget the conversation\\): ")  # the prompt line
        c.sendline(text)
        if text == "/clear":
            c.expect("conversation cleared")
            continue
        c.sendline("")                                # default parameters
        c.expect(r"tokens/s; first token after [\d.]+ s; prompt (\d+) tokens(, (\d+) reused)?\)")
        counts.append(int(c.match.group(1)))
        reused.append(int(c.match.group(3) or 0))
    c.expect("to forget the conversation\\): ")
    c.sendeof()                                       # end of input: clean exit
    c.expect("Bye.")
    c.expect(pexpect.EOF)
    c.close()
    assert c.exitstatus == 0
    first = sft.encode_prompt(tok, template, [], q1, bos, eos)
    answer = Engine(_model(work["chat"])).generate([first], 4, temperature=0, eos_id=eos)[0]
    history = [(q1, tok.decode(answer, skip_special_tokens=True))]
    assert counts == [len(first),
                      len(sft.encode_prompt(tok, template, history, "Why?", bos, eos)),
                      len(sft.encode_prompt(tok, template, [], "Why?", bos, eos))]
    assert counts[1] > counts[2] + len(answer)        # the first exchange is in turn two
    assert reused[0] == reused[2] == 0 and reused[1] >= len(first) // 16 * 16 > 0, (reused, len(first))


def test_interactive_multi_model_comparison_with_colors(work):
    c = _spawn(work, "--max-new-tokens", "5", no_color=False)
    c.expect("Select a mode")
    c.sendline("2")
    c.expect("Select a run")
    c.sendline("2")
    c.expect("\x1b\\[32m  1\\) checkpoint_best.pt")    # best in green
    c.expect("\x1b\\[34m  2\\) checkpoint_latest.pt")  # latest in blue
    c.expect("Select checkpoints")
    c.sendline("9")
    c.expect("Enter numbers from 1 to 2")
    c.sendline("all")
    c.expect(r"2 model\(s\) selected; estimated memory [\d,]+ MB")
    c.expect("Prompt")
    c.sendline("The history of")
    c.sendline("1")
    c.expect(r"\[1\] run_pre/checkpoint_best.pt")
    c.expect(r"\[2\] run_pre/checkpoint_latest.pt")
    c.expect("Comparison")
    c.expect("Fastest: run_pre/checkpoint_\\w+.pt; most tokens: ")
    c.expect("Prompt")
    wait_until_blocked(stage_pid(c.pid))              # waiting for the line
    c.sendintr()                                      # Ctrl-C at a prompt: the stage ends (130)
    c.expect(pexpect.EOF)
    c.close()
    assert c.exitstatus == 130
    assert "Traceback" not in c.before


def test_interactive_menus_and_comparison_never_pass_control_characters_to_the_terminal(tmp_path, samples):
    """A run folder named with escape sequences and a newline, a model whose reply holds them
    too: the menus, the loading lines, the streamed reply and the comparison table show each
    control character as U+FFFD (the table and the menus wrote them raw: a reply could set the
    window title or clear the screen, a name could add a line to the listing)."""
    import io
    from tests.test_serve import make_script_checkpoint
    cfg = write_config(tmp_path, {"tokenizer": {"name": TOK_NAME}})
    run = tmp_path / "checkpoints" / "evil\x1b[2J\x1b]0;PWNED\x07\nline2"
    make_script_checkpoint(run / "checkpoint_best.pt", "A\x1b]0;OWN\x07B\rZ\x0c")
    env = offline_env(NO_COLOR="1")
    c = spawn_main("infer", "--config", cfg, "--max-new-tokens", "12", "--temperature", "0", env=env, timeout=90)
    c.logfile_read = seen = io.StringIO()
    c.expect("Select a mode")
    c.sendline("2")
    c.expect("Select a run")
    c.sendline("1")
    c.expect("Select checkpoints")
    c.sendline("all")
    c.expect("Prompt")
    c.sendline("Hi")
    c.sendline("")                                    # default parameters
    c.expect("Fastest: ")
    c.expect("Prompt")
    c.sendeof()
    c.expect(pexpect.EOF)
    c.close()
    text = seen.getvalue()
    assert "\x1b" not in text and "\x07" not in text, repr(text[-600:])
    assert "evil\ufffd[2J\ufffd]0;PWNED\ufffd\ufffdline2" in text           # the run's name, one line
    assert text.count("A\ufffd]0;OWN\ufffdB") >= 2                          # streamed, and in the table


def test_free_memory_sources_and_the_note_said_once(monkeypatch):
    """MemAvailable first, free pages where /proc/meminfo cannot be read, else (None, reason):
    infer then says once that the KV cache is not checked, and goes on."""
    import builtins

    import inference
    from utils import device as dev
    cpu = torch.device("cpu")
    have, why = dev.available_bytes(cpu)
    assert have > 2 ** 20 and why == ""
    real_open = builtins.open

    def no_proc(path, *a, **kw):
        if str(path) == "/proc/meminfo":
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *a, **kw)
    monkeypatch.setattr(builtins, "open", no_proc)
    real_sysconf = os.sysconf                     # free pages move from call to call: fixed here
    monkeypatch.setattr(dev.os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096, "SC_AVPHYS_PAGES": 5000}[name])
    pages, why = dev.available_bytes(cpu)
    assert pages == 4096 * 5000 and why == ""
    monkeypatch.setattr(dev.os, "sysconf", real_sysconf)
    pages, why = dev.available_bytes(cpu)
    assert pages > 2 ** 20 and why == ""                                    # the real call

    def no_sysconf(name):
        raise ValueError(f"unrecognized configuration name {name}")
    monkeypatch.setattr(dev.os, "sysconf", no_sysconf)
    none, why = dev.available_bytes(cpu)
    assert none is None and "could not be read" in why
    said = []
    session = inference.Session.__new__(inference.Session)
    session._memory_note_said = False
    for _ in range(3):
        session.unknown_memory(why, said.append)
    assert said == [f"({why}: the KV cache is not checked against free memory)"]
