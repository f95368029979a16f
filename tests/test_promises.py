"""README promises that had no test of their own, each driven as a user would.

Training (`python main.py train --test ...` on the tiny shared shard set, fp32 CPU unless the
case is about precision): torch.compile, activation checkpointing, fp16 with loss scaling,
early-stop patience, keeping K step checkpoints, gradient accumulation (4 x batch 4 equals
batch 16). Inference: `infer --raw` on an SFT checkpoint, and the chat history dropping its
oldest exchange when the context is full.
"""
from __future__ import annotations

import json

import pexpect
import pytest
import torch

from tests.conftest import SPM_MODEL, offline_env, run_stage, spawn_main, write_config
from utils.generation.engine import Engine
from utils.run import load_checkpoint
from utils.training.logging_utils import latest_per_step, read_jsonl

FLAGS = ["--window", "32", "--batch-size", "2", "--eval-batches", "2", "--sample-tokens", "0",
         "--log-every", "1", "--warmup-steps", "2", "--eval-steps", "4", "--device", "cpu"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("promises")


@pytest.fixture(scope="module")
def cfg(root, train_shards):
    return write_config(root, {"tokenizer": {"name": str(SPM_MODEL)},
                               "dataset": {"wikipedia_test_dir": str(train_shards)}})


def train(cfg, name, *args, timeout=600):
    p = run_stage("train", "--test", "--config", cfg, *FLAGS, "--name", name, *map(str, args),
                 timeout=timeout)
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}"
    return p.stdout + p.stderr


def losses(root, name) -> dict[int, float]:
    recs = read_jsonl(root / "logs" / "raw_metrics" / f"{name}.jsonl")
    return {r["step"]: r["loss"] for r in latest_per_step(recs, "train")}


def final_weights(root, name) -> dict:
    return load_checkpoint(root / "checkpoints" / name / "checkpoint_latest.pt", "resume")["model"]


@pytest.fixture(scope="module")
def base(cfg, root):
    """The plain 6-step run the options are compared with."""
    train(cfg, "base", "--max-steps", 6)
    return losses(root, "base")


# --------------------------------------------------------------------------- training options
def test_compile_trains_like_eager(cfg, root, base):
    out = train(cfg, "compiled", "--max-steps", 6, "--compile")
    got = losses(root, "compiled")
    assert got.keys() == base.keys()
    # Inductor fuses and reorders fp32 sums: the same losses to a few units in the 5th digit.
    assert max(abs(got[k] - base[k]) for k in base) < 2e-4, (got, base)
    assert "Traceback" not in out


def test_activation_checkpointing_is_on_and_changes_nothing(cfg, root, base):
    out = train(cfg, "ckpt", "--max-steps", 6, "--activation-checkpointing")
    assert "activation checkpointing: 2 blocks recompute their activations" in out
    got = losses(root, "ckpt")
    assert max(abs(got[k] - base[k]) for k in base) < 1e-6, (got, base)
    a, b = final_weights(root, "base"), final_weights(root, "ckpt")
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)


def test_activation_checkpointing_recomputes_blocks_in_backward():
    """The blocks' forward runs again during backward (twice per step instead of once)."""
    from model import ModelArgs, create_model
    from utils.training.trainer import enable_activation_checkpointing
    m = create_model(ModelArgs(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               max_seq_len=16))
    calls = []

    def counted(forward):
        def run(*a, **k):
            calls.append(1)
            return forward(*a, **k)
        return run

    for blk in m.layers:
        blk.forward = counted(blk.forward)
    x = torch.randint(0, 64, (2, 16))

    def step() -> int:
        calls.clear()
        m.zero_grad()
        _, loss = m(x, x, return_logits=False)
        loss.backward()
        return len(calls)

    assert step() == 2
    assert enable_activation_checkpointing(m) == 2
    assert step() == 4


def test_fp16_trains_with_a_loss_scaler(cfg, root, base):
    out = train(cfg, "half", "--max-steps", 6, "--dtype", "fp16")
    assert "float16 on cpu" in out
    got = losses(root, "half")
    assert all(abs(got[k] - base[k]) < 0.05 for k in base), (got, base)   # fp16 matmuls
    assert got != base                                                      # really fp16
    ck = load_checkpoint(root / "checkpoints" / "half" / "checkpoint_latest.pt", "resume")
    scaler = ck["grad_scaler"]
    assert scaler["scale"] == 2.0 ** 16 and scaler["_growth_tracker"] == 6   # 6 unskipped steps
    plain = load_checkpoint(root / "checkpoints" / "base" / "checkpoint_latest.pt", "resume")
    assert plain["grad_scaler"] is None                                      # fp32: no scaler


def test_patience_stops_early(cfg, root):
    """A learning rate that makes validation worse at every evaluation: with --patience 2 the
    run stops after 2 evaluations without improvement, says so, and logs it."""
    out = train(cfg, "impatient", "--max-steps", 40, "--eval-steps", "1", "--patience", 2,
                "--lr", 3.0, "--min-lr", 3.0, "--warmup-steps", 0, "--grad-clip", 0)
    assert "early stopping: validation loss did not improve for 2 evaluations" in out
    recs = read_jsonl(root / "logs" / "raw_metrics" / "impatient.jsonl")
    val = [r["val_loss"] for r in latest_per_step(recs, "val")]
    assert len(val) < 40 and val[-1] > min(val) and val[-2] > min(val)
    best = val.index(min(val))
    assert len(val) == best + 3                                # best, then 2 without improvement
    assert "train: early_stopping at step" in out


def test_keeps_the_last_k_step_checkpoints(cfg, root):
    train(cfg, "keep", "--max-steps", 7, "--checkpoint-every", 1, "--keep-checkpoints", 3)
    files = sorted(p.name for p in (root / "checkpoints" / "keep").glob("checkpoint_step_*.pt"))
    assert files == ["checkpoint_step_5.pt", "checkpoint_step_6.pt", "checkpoint_step_7.pt"]
    for name in files:
        assert load_checkpoint(root / "checkpoints" / "keep" / name, "resume")["step"] == int(
            name.split("_")[-1].split(".")[0])


def test_gradient_accumulation_equals_the_large_batch(cfg, root, base):
    """4 micro-batches of 4 windows per step against one batch of 16 windows: the same
    windows in the same order, so the same training up to fp32 summation order, held to what
    that guarantees (tests/test_ddp.py assert_same_training: step 1's loss and gradients to
    rounding, the weights of every step to a bound from the learning rate)."""
    from tests.test_ddp import assert_same_training
    every = ["--checkpoint-every", 1, "--keep-checkpoints", 6]
    train(cfg, "b16", "--max-steps", 5, "--batch-size", 16, "--grad-accum", 1, *every)
    train(cfg, "b4x4", "--max-steps", 5, "--batch-size", 4, "--grad-accum", 4, *every)
    a, b = losses(root, "b16"), losses(root, "b4x4")
    assert a.keys() == b.keys() == set(range(1, 6))
    steps = {run: [load_checkpoint(root / "checkpoints" / run / f"checkpoint_step_{k}.pt", "resume")
                   for k in range(1, 6)] for run in ("b16", "b4x4")}
    assert_same_training(steps["b4x4"], steps["b16"], b, a, tokens=16 * 32)
    assert abs(base[1] - a[1]) > 1e-3                   # batch 2: a different run altogether


# --------------------------------------------------------------------------- inference
@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory, samples):
    from tests.test_sft import TOK_NAME, make_checkpoint
    from utils.data import sft
    root = tmp_path_factory.mktemp("promises_infer")
    cfg = write_config(root, {"tokenizer": {"name": TOK_NAME}})
    path = make_checkpoint(root / "checkpoints" / "sft_x" / "checkpoint_best.pt", kind="sft",
                           seed=3, chat_template=sft.default_template(), max_seq_len=48)
    return cfg, path


def test_infer_raw_skips_the_chat_template(chat_ckpt):
    from tests.test_sft import tokenizer
    from utils.data import sft
    from utils.run import load_model
    cfg, path = chat_ckpt
    tok = tokenizer()
    common = ["infer", "--config", cfg, "--checkpoint", path, "--prompt", "Why is the sky blue?",
              "--max-new-tokens", "6", "--seed", "5", "--json"]
    raw = json.loads(run_stage(*common, "--raw").stdout)
    chat = json.loads(run_stage(*common).stdout)
    assert raw["chat_template"] is False and chat["chat_template"] is True
    plain_ids = [tok.bos_token_id] + sft.encode_plain(tok, ["Why is the sky blue?"])[0]
    assert raw["prompt_tokens"] == len(plain_ids) < chat["prompt_tokens"]
    model = load_model(path)[0]
    want = Engine(model).generate([plain_ids], 6, temperature=raw["params"]["temperature"],
                          top_k=raw["params"]["top_k"], top_p=raw["params"]["top_p"],
                          eos_id=tok.eos_token_id, seed=5)[0]
    assert raw["text"] == tok.decode(want, skip_special_tokens=True)


def test_chat_history_drops_the_oldest_exchange_when_the_context_is_full(chat_ckpt):
    """A 48-token model asked for 20 new tokens: the second question no longer fits after the
    first exchange, which is dropped with a note; the prompt is then the question alone."""
    from tests.test_sft import tokenizer
    from utils.data import sft
    cfg, path = chat_ckpt
    tok, template = tokenizer(), sft.default_template()
    c = spawn_main("infer", "--config", cfg, "--checkpoint", path, "--max-new-tokens", "20",
                   "--temperature", "0", env=offline_env(NO_COLOR="1"), timeout=90)
    counts = []
    for text in ("Tell me about the history of science", "And then?"):
        c.expect("to forget the conversation\\): ")
        c.sendline(text)
        c.sendline("")
        if text == "And then?":
            c.expect(r"\(context full: dropped the oldest exchange; 0 kept\)")
        c.expect(r"prompt (\d+) tokens\)")
        counts.append(int(c.match.group(1)))
    c.expect("to forget the conversation\\): ")
    c.sendeof()
    c.expect(pexpect.EOF)
    c.close()
    assert c.exitstatus == 0
    alone = sft.encode_prompt(tok, template, [], "And then?", tok.bos_token_id, tok.eos_token_id)
    assert counts[1] == len(alone)
