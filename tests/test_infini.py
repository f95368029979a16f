"""Infini-attention (model.attention "infini"; utils/infini.py, docs/long_context.md).

Model: one segment with the gate forced to 0 is standard attention bit for bit (torch.equal,
logits, loss and gradients); with several segments the local part is each segment alone
(positions restarting; 1e-6); the memory and its delta rule equal a direct per-token
transcription of the equations (1e-5); the gates' functions; a tiny infini model learns in
seconds a recall task across segments that the same model with its memory switched off
cannot solve. Training: the gates' own parameter group (lr, weight decay) under AdamW and
Muon. Generation: greedy decoding through the engine (one segment of cache, the memory
carried) equals the full forward's argmax, alone and under continuous batching with rows
joining and leaving; a slot's memory does not grow with the context. Config errors (exit 2).
The CLI: an infini run resumes bit for bit after a real SIGINT; export refuses an infini
checkpoint (exit 1, nothing written); infer and serve take prompts longer than the window
whole; DDP (2 CPU ranks, gloo) equals one process.
"""
from __future__ import annotations

import math
import time

import pytest
import torch

import model as M
from model import ModelArgs, create_model
from utils.config import ConfigError, load_config
from utils.generation.detok import TextDecoder
from utils.generation.engine import Engine, SamplingParams, Sequence
from utils.infini import InfiniMemory, gate_parameters, gate_value, sigma

V = 61


def args(**kw) -> ModelArgs:
    base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                rope_theta=500.0, bos_id=1, attention="infini", segment_length=8)
    base.update(kw)
    return ModelArgs(**base)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread for these small models (a busy 2-core machine makes a second one
    wait for time slices), restored after each test."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def build(seed=0, gates=None, **kw):
    """An infini model; ``gates``: the std of random gate parameters (None: zero, as at init),
    and then an untied head and larger weights, so greedy continuations are diverse (a tiny
    tied model at init std 0.02 repeats its last token) with wide argmax margins."""
    if gates is not None:
        kw = {"tie_embeddings": False, "init_std": 0.1, **kw}
    torch.manual_seed(seed)
    m = create_model(args(**kw)).eval()
    if gates is not None:
        with torch.no_grad():
            for b in gate_parameters(m):
                b.normal_(0.0, gates)
    return m


def standard_twin(m) -> M.Transformer:
    """The standard model with ``m``'s weights (the gates left out)."""
    a = ModelArgs(**{**m.args.to_dict(), "attention": "standard", "segment_length": None,
                     "infini_gate": None, "infini_delta_rule": None})
    s = create_model(a).eval()
    missing = s.load_state_dict({k: v for k, v in m.state_dict().items() if "memory" not in k})
    assert not missing.missing_keys and not missing.unexpected_keys
    return s


def close_gates(m) -> None:
    """hard_sigmoid(-2.5) = clamp(0.2 * -2.5 + 0.5, 0, 1) = 0 exactly: no memory at all."""
    with torch.no_grad():
        for b in gate_parameters(m):
            b.fill_(-2.5)


# --------------------------------------------------------------------------- equivalences
@pytest.mark.parametrize("T", [8, 5])
def test_one_segment_with_the_gate_at_zero_is_standard_attention_exactly(T):
    m = build(seed=3)
    close_gates(m)
    assert all(float(g) == 0.0 for b in gate_parameters(m) for g in gate_value(b.detach(), "hard_sigmoid"))
    s = standard_twin(m)
    x = torch.randint(0, V, (3, T))
    y = torch.randint(0, V, (3, T))
    a_logits, a_loss = m(x, y)
    b_logits, b_loss = s(x, y)
    assert torch.equal(a_logits, b_logits) and torch.equal(a_loss, b_loss)
    a_loss.backward()
    b_loss.backward()
    grads = {n: p.grad for n, p in s.named_parameters()}
    for n, p in m.named_parameters():
        if "memory" not in n:
            assert torch.equal(p.grad, grads[n]), n


def test_local_attention_is_each_segment_alone_with_positions_restarting():
    """Gate 0, three segments (the last one partial): each segment's logits are what the
    standard model gives for that segment alone (1e-6: SDPA with a block mask vs is_causal)."""
    m = build(seed=4)
    close_gates(m)
    s = standard_twin(m)
    x = torch.randint(0, V, (2, 21))
    with torch.no_grad():
        whole, _ = m(x)
        parts = torch.cat([s(x[:, i:i + 8])[0] for i in range(0, 21, 8)], dim=1)
    torch.testing.assert_close(whole, parts, atol=1e-6, rtol=0)


def _reference_memory(q, k, v, S, delta, G):
    """The equations of utils/infini.py written out token by token (float64): A_mem for every
    query position, from the memory of the earlier segments only."""
    B, T, H, hd = q.shape
    Hkv = k.shape[2]
    out = torch.zeros(B, T, H, hd, dtype=torch.float64)
    sq, sk, v = sigma(q.double()), sigma(k.double()), v.double()
    for b in range(B):
        for kv in range(Hkv):
            Mm = torch.zeros(hd, hd, dtype=torch.float64)
            z = torch.zeros(hd, dtype=torch.float64)
            for j in range(0, T, S):
                for t in range(j, min(j + S, T)):
                    for h in range(kv * G, (kv + 1) * G):
                        den = max(float(sq[b, t, h] @ z), 1e-6)
                        out[b, t, h] = (sq[b, t, h] @ Mm) / den
                seg = range(j, min(j + S, T))
                new_M, new_z = Mm.clone(), z.clone()
                for t in seg:
                    val = v[b, t, kv]
                    if delta:
                        val = val - (sk[b, t, kv] @ Mm) / max(float(sk[b, t, kv] @ z), 1e-6)
                    new_M += torch.outer(sk[b, t, kv], val)
                    new_z += sk[b, t, kv]
                Mm, z = new_M, new_z
    return out


@pytest.mark.parametrize("delta", [True, False])
def test_memory_follows_the_equations(delta):
    torch.manual_seed(0)
    S, H, Hkv, hd = 4, 4, 2, 6
    mem = InfiniMemory(H, Hkv, hd, S, "sigmoid", delta)
    with torch.no_grad():
        mem.beta.copy_(torch.tensor([-1.0, 0.0, 0.5, 2.0]))
    q, y = torch.randn(2, 11, H, hd), torch.randn(2, 11, H, hd)
    k, v = torch.randn(2, 11, Hkv, hd), torch.randn(2, 11, Hkv, hd)
    with torch.no_grad():
        got = mem(y, q, k, v)
    a = _reference_memory(q, k, v, S, delta, H // Hkv)
    assert a[:, :S].abs().max() == 0                       # nothing to retrieve in segment 0
    g = torch.sigmoid(mem.beta.detach()).double().view(H, 1)
    torch.testing.assert_close(got.double(), g * a + (1 - g) * y.double(), atol=1e-5, rtol=1e-5)


def test_gate_functions():
    b = torch.tensor([-3.0, -2.5, 0.0, 1.0, 2.5, 4.0])
    assert gate_value(b, "hard_sigmoid").tolist() == pytest.approx([0, 0, 0.5, 0.7, 1, 1])
    assert gate_value(b, "sigmoid").tolist() == pytest.approx([1 / (1 + math.exp(-x)) for x in b.tolist()])
    assert gate_value(b, "tanh").tolist() == pytest.approx([1 / (1 + math.exp(-2 * x)) for x in b.tolist()],
                                                           rel=1e-4)   # = sigmoid(2 b), fp32
    m = build()
    assert all(float(x) == 0.0 for x in torch.cat(gate_parameters(m)).detach())   # zeros init: g = 0.5


# --------------------------------------------------------------------------- learning
S_RECALL = 8


def _recall_batch(g, B):
    """Two segments of random filler (16..29); segment 0 holds a key (8..15) followed by its
    value (0..7); the sequence ends with the key again, whose target is the value."""
    x = torch.randint(16, 30, (B, 2 * S_RECALL), generator=g)
    y = torch.full_like(x, -100)
    key = torch.randint(8, 16, (B,), generator=g)
    val = torch.randint(0, 8, (B,), generator=g)
    at = torch.randint(0, S_RECALL - 1, (B,), generator=g)
    r = torch.arange(B)
    x[r, at], x[r, at + 1] = key, val
    x[:, -1], y[:, -1] = key, val
    return x, y


def _train_recall(memory: bool, steps: int = 300) -> float:
    torch.manual_seed(0)
    m = create_model(ModelArgs(vocab_size=32, d_model=32, n_layers=2, n_heads=2, n_kv_heads=2,
                               max_seq_len=2 * S_RECALL, attention="infini",
                               segment_length=S_RECALL))
    if not memory:                            # the same model limited to its own segment
        for b in gate_parameters(m):
            b.data.fill_(-5.0)
            b.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        _, loss = m(*_recall_batch(g, 32))
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, y = _recall_batch(torch.Generator().manual_seed(99), 512)
    with torch.no_grad():
        logits, _ = m(x)
    return float((logits[:, -1].argmax(-1) == y[:, -1]).float().mean())


def test_memory_carries_a_value_across_segments_that_local_attention_cannot_reach():
    """Chance is 1/8. Measured here: memory 1.00 (7 s), local only 0.12 (7 s), 300 steps each."""
    with_memory, local_only = _train_recall(True), _train_recall(False)
    assert with_memory >= 0.9, with_memory
    assert local_only <= 0.3, local_only


# --------------------------------------------------------------------------- optimizer groups
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_gates_are_their_own_group_with_their_own_lr_and_weight_decay(optimizer):
    from utils.training.scheduler import CosineWarmupScheduler
    from utils.training.trainer import OptimizerSpec
    m = build()
    spec = OptimizerSpec(optimizer=optimizer, lr=1e-3, weight_decay=0.1, gate_lr=0.01,
                         gate_weight_decay=0.0)
    opts = spec.build(m, torch.device("cpu"))
    gates = {id(p) for p in gate_parameters(m)}
    assert len(gates) == m.args.n_layers
    groups = [g for o in opts.values() for g in o.param_groups]
    gate_groups = [g for g in groups if {id(p) for p in g["params"]} & gates]
    assert len(gate_groups) == 1 and {id(p) for p in gate_groups[0]["params"]} == gates
    assert gate_groups[0]["lr"] == 0.01 and gate_groups[0]["weight_decay"] == 0.0
    assert gate_groups[0] in opts["adamw"].param_groups
    assert all(g["lr"] == 1e-3 for g in groups if g is not gate_groups[0])
    assert sum(len(g["params"]) for g in groups) == len(list(m.parameters()))
    sched = CosineWarmupScheduler(list(opts.values()), warmup=2, total=10, min_ratio=0.1)
    f = sched.apply(0)
    assert gate_groups[0]["lr"] == pytest.approx(0.01 * f)
    # defaults: the others' lr, no decay
    d = OptimizerSpec(optimizer=optimizer, lr=1e-3, weight_decay=0.1).build(m, torch.device("cpu"))
    g = next(g for o in d.values() for g in o.param_groups if {id(p) for p in g["params"]} & gates)
    assert g["lr"] == 1e-3 and g["weight_decay"] == 0.0


# --------------------------------------------------------------------------- generation
def _full_argmax(m, prompt, new):
    with torch.no_grad():
        logits, _ = m(torch.tensor([list(prompt) + list(new)]))
    return logits[0, len(prompt) - 1:-1].argmax(-1).tolist()


@pytest.mark.parametrize("plen", [3, 8, 13, 16, 17])
def test_greedy_generation_equals_the_full_forward(plen):
    """Prompts ending inside, at and just past a segment boundary; 30 new tokens cross 3-4
    more boundaries, where the engine folds the segment into the memory and reuses its cache."""
    m = build(seed=5, gates=2.0)
    torch.manual_seed(plen)
    prompt = torch.randint(0, V, (plen,)).tolist()
    out = Engine(m).generate([prompt], 30, temperature=0)[0]
    assert len(out) == 30 and len(set(out)) >= 5 and out == _full_argmax(m, prompt, out)
    # and the memory mattered: without it the continuation differs
    close_gates(m)
    assert Engine(m).generate([prompt], 30, temperature=0)[0] != out


def test_prompt_logprobs_across_segments_equal_the_full_forward():
    """Scoring a prompt (SamplingParams.prompt_logprobs, serve's echo + logprobs) of an infini
    model: the prefill runs segment by segment, and each prompt token's log-probability and
    top alternatives equal the full forward pass's, across the segment boundaries."""
    m = build(seed=5, gates=2.0)
    torch.manual_seed(3)
    prompt = torch.randint(0, V, (21,)).tolist()                      # 3 segments of 8
    b = Engine(m).batcher(1, 64)
    seq = b.add(Sequence(prompt, SamplingParams(1, 0.0, logprobs=2, prompt_logprobs=True)))
    b.step()
    with torch.no_grad():
        lp = m(torch.tensor([prompt]))[0][0].float().log_softmax(-1)
    assert [t for t, _, _ in seq.prompt_logprobs] == prompt[1:]
    for j, (t, got, top) in enumerate(seq.prompt_logprobs):
        assert abs(got - float(lp[j, t])) < 1e-4, j
        assert [a for a, _ in top] == lp[j].topk(2).indices.tolist(), j


def test_continuous_batching_rows_join_and_leave_as_alone():
    """Two slots, five sequences of different lengths: rows join, finish and move slots (their
    memory and segment with them); each gets its lone greedy continuation."""
    m = build(seed=6, gates=2.0, segment_length=4)
    torch.manual_seed(0)
    prompts = [torch.randint(0, V, (n,)).tolist() for n in (3, 9, 4, 12, 6)]
    news = [7, 15, 11, 5, 13]
    eng = Engine(m)
    alone = [eng.generate([p], n, temperature=0)[0] for p, n in zip(prompts, news)]
    b = eng.batcher(slots=2)
    seqs = [b.add(Sequence(p, SamplingParams(n, temperature=0))) for p, n in zip(prompts, news)]
    list(eng.run(b))
    assert [s.tokens for s in seqs] == alone
    assert all(s.tokens == _full_argmax(m, p, s.tokens) for s, p in zip(seqs, prompts))


def test_a_slot_holds_one_segment_whatever_the_context():
    """A standard batcher's slot grows with its capacity; an infini one holds one segment:
    3 x (layers x n_kv_heads x segment x head_dim) cache values + the fp32 memory."""
    m = build(segment_length=8)
    a = m.args
    eng = Engine(m)
    sizes = {c: eng.batcher(1, c).bytes_per_slot for c in (64, 4096, 1 << 20)}
    assert len(set(sizes.values())) == 1
    want = a.n_layers * a.n_kv_heads * a.head_dim * (3 * 8 * 4 + (a.head_dim + 1) * 4)
    assert sizes[64] == want
    b = eng.batcher(1)
    b.add(Sequence(list(range(1, 40)), SamplingParams(30, temperature=0)))
    list(eng.run(b))
    held = sum(t.numel() * t.element_size() for kv in b.kv for t in kv)
    held += sum(t.numel() * t.element_size() for mem in b.mem for t in mem)
    assert held == want                                          # what was really allocated
    s = Engine(standard_twin(m))
    assert s.batcher(1, 4096).bytes_per_slot == 512 * s.batcher(1, 8).bytes_per_slot


# --------------------------------------------------------------------------- configuration
def _cfg_problems(tmp_path, sections) -> str:
    import json
    f = tmp_path / "c.json"
    f.write_text(json.dumps(sections))
    with pytest.raises(ConfigError) as e:
        load_config(f, base_file=None)
    return str(e.value)


def test_bad_infini_settings_are_config_errors(tmp_path):
    msg = _cfg_problems(tmp_path, {"model": {"attention": "infini", "segment_length": 48},
                                   "dataset": {"window": 128}})
    assert "model.segment_length: 48 must divide dataset.window (128)" in msg
    msg = _cfg_problems(tmp_path, {"model": {"attention": "infini", "segment_length": 256},
                                   "dataset": {"window": 128}})
    assert "model.segment_length: 256 must divide dataset.window (128)" in msg
    msg = _cfg_problems(tmp_path, {"model": {"attention": "infini"}})
    assert "model.segment_length: must be set when model.attention is 'infini'" in msg
    msg = _cfg_problems(tmp_path, {"model": {"segment_length": 64, "infini_gate": "tanh"},
                                   "training": {"gate_lr": 0.01}})
    for key in ("model.segment_length", "model.infini_gate", "training.gate_lr"):
        assert f"{key}: is an Infini-attention setting" in msg, msg
    msg = _cfg_problems(tmp_path, {"model": {"attention": "infini", "segment_length": 64,
                                             "document_mask": True}})
    assert "model.document_mask: not available with model.attention 'infini'" in msg
    ok = tmp_path / "ok.json"
    ok.write_text('{"model": {"attention": "infini", "segment_length": 64}, "dataset": {"window": 256},'
                  ' "training": {"gate_lr": 0.01, "gate_weight_decay": 0}}')
    cfg = load_config(ok, base_file=None)
    a = M.model_args_from_config(cfg, 100, 1)
    assert (a.attention, a.segment_length, a.infini_gate, a.infini_delta_rule) == ("infini", 64, "hard_sigmoid", True)
    assert M.model_args_from_config(load_config(None, base_file=None), 100, 1).segment is None


# --------------------------------------------------------------------------- the CLI
INFINI = {"model": {"attention": "infini", "segment_length": 16, "max_seq_len": 32},
          "training": {"gate_lr": 0.05, "gate_weight_decay": 0.0}}
STEPS = 8


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("infini_root")


@pytest.fixture(scope="module")
def cfg(root, train_shards):
    from tests.conftest import SPM_MODEL, write_config
    return write_config(root, {"tokenizer": {"name": str(SPM_MODEL)},
                               "dataset": {"wikipedia_test_dir": str(train_shards), "window": 32},
                               **INFINI})


@pytest.fixture(scope="module")
def full_run(cfg):
    """An infini run of STEPS steps (windows of 32 tokens = two segments), uninterrupted."""
    from tests.test_train import ok, train
    return ok(train(cfg, "--name", "full", "--max-steps", STEPS)).stdout


def test_train_resumes_an_infini_run_bit_for_bit(root, cfg, full_run):
    import signal
    from tests.conftest import paused_env, popen_main, wait_for_line
    from tests.test_train import FLAGS, log_of, losses, ok, train, weights
    from utils.run import load_checkpoint
    ck = load_checkpoint(root / "checkpoints" / "full" / "checkpoint_latest.pt", "resume")
    assert ck["model_args"]["attention"] == "infini" and ck["model_args"]["segment_length"] == 16
    gates = [v for k, v in ck["model"].items() if k.endswith("memory.beta")]
    assert len(gates) == 2 and all(float(g.abs().max()) > 0 for g in gates)    # they trained
    groups = ck["optimizer"]["adamw"]["param_groups"]
    assert [g.get("name") for g in groups][-1] == "gates" and groups[-1]["initial_lr"] == 0.05
    assert "attention: PyTorch SDPA with a block-diagonal causal mask (segments)" in full_run

    p = popen_main("train", "--test", "--config", cfg, *FLAGS, "--name", "cut", "--max-steps",
                   STEPS, env=paused_env(3))
    wait_for_line(p, "paused after step 3")
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 130, f"{out}\n{err}"
    ok(train(cfg, "--name", "cut", "--max-steps", STEPS, "--resume", "auto"))
    a = weights(root / "checkpoints" / "full" / "checkpoint_latest.pt")
    b = weights(root / "checkpoints" / "cut" / "checkpoint_latest.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(log_of(root, "full")) == losses(log_of(root, "cut"))


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_export_refuses_an_infini_checkpoint_and_writes_nothing(root, cfg, full_run, fmt):
    from tests.conftest import run_stage
    out = root / "exports" / f"infini-{fmt}"
    r = run_stage("export", "--config", cfg, "--checkpoint", str(root / "checkpoints" / "full"),
                 "--format", fmt, "--out", str(out))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "model.attention is 'infini'" in r.stderr and "Nothing was written" in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()
    assert not (out.parent.exists() and any(out.parent.glob(".*")))       # no temp folder left


def test_infer_takes_a_prompt_longer_than_the_window_whole(root, cfg, full_run):
    """No truncation for an infini model (its context is not limited): a 100-word prompt,
    several times the 32-token window, is generated from in full."""
    from tests.conftest import run_stage
    prompt = " ".join(["the history of the city and its river"] * 12)
    r = run_stage("infer", "--config", cfg, "--checkpoint", str(root / "checkpoints" / "full"),
                 "--prompt", prompt, "--max-new-tokens", "8", "--temperature", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "shortened" not in r.stdout + r.stderr and r.stdout.strip()


def test_serve_answers_past_the_window_as_the_engine_does(root, cfg, full_run):
    """serve (main.py, a free local port, the openai client): an infini model's context is
    unbounded; a prompt of several windows gets the engine's own greedy continuation."""
    from tests.test_serve import Server
    from utils.data.tok import encode_plain, load_tokenizer_from
    from utils.run import load_model
    from tests.conftest import SPM_MODEL
    prompt = " ".join(["the history of the city and its river"] * 12)
    s = Server(root, cfg, "--checkpoint", root / "checkpoints" / "full")
    try:
        listed = s.client.models.list().data[0]
        r = s.client.completions.create(model=listed.id, prompt=prompt, max_tokens=6, temperature=0)
    finally:
        assert s.stop() == 130, s.stderr()
    assert "context unbounded (Infini-attention)" in s.stderr()
    assert listed.model_extra["context_length"] is None
    tok = load_tokenizer_from(str(SPM_MODEL))
    ids = [tok.bos_token_id] + encode_plain(tok, [prompt])[0]
    assert r.usage.prompt_tokens == len(ids) > 3 * 32
    m, _ = load_model(root / "checkpoints" / "full" / "checkpoint_latest.pt")
    want = Engine(m).generate([ids], r.usage.completion_tokens, temperature=0, eos_id=tok.eos_token_id)[0]
    text = TextDecoder(tok, prefix=ids[-1:])          # a completion continues the prompt's text
    assert r.choices[0].text == "".join(text.push(t) for t in want) + text.finish()


def test_ddp_two_ranks_equal_one_process_with_the_doubled_batch(root, cfg):
    """2 CPU ranks (gloo, torchrun) x 2 windows == 1 process x 4 windows, step by step, to what
    float arithmetic guarantees (tests/test_ddp.py assert_same_training: step 1's loss and
    gradients to rounding, the weights to a bound from the learning rate): DDP averages the
    gates' gradients like every other parameter's."""
    import subprocess
    from tests.conftest import ROOT, default_signals, offline_env
    from tests.test_ddp import assert_same_training, max_diff, torchrun_command
    from tests.test_train import FLAGS, log_of, losses, ok, train
    from utils.run import load_checkpoint
    every = ["--checkpoint-every", "1", "--keep-checkpoints", "5", "--max-steps", "4"]
    d = subprocess.run(torchrun_command("--config", cfg, *FLAGS, "--batch-size", "2", "--name", "ddp",
                                        *every), capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env=offline_env(), stdin=subprocess.DEVNULL, preexec_fn=default_signals)
    ok(d)
    ok(train(cfg, "--batch-size", "4", "--name", "single", *every))
    steps = {run: [load_checkpoint(root / "checkpoints" / run / f"checkpoint_step_{k}.pt", "resume")
                   for k in range(1, 5)] for run in ("ddp", "single")}
    assert_same_training(steps["ddp"], steps["single"], losses(log_of(root, "ddp")),
                         losses(log_of(root, "single")))
    a = steps["ddp"][-1]            # the gates are AdamW's group of their own, compared with the rest
    assert [g.get("name") for g in a["optimizer"]["adamw"]["param_groups"]][-1] == "gates"
    assert max_diff({k: v for k, v in a["model"].items() if "memory" in k},
                    {k: torch.zeros_like(v) for k, v in a["model"].items() if "memory" in k}) > 0


def test_config_files_stack_in_order(tmp_path):
    """--config A --config B: B's keys over A's over config.json (the offline setup + infini_tiny)."""
    from tests.conftest import ROOT
    cfg = load_config([ROOT / "configs" / "offline.json", ROOT / "configs" / "infini_tiny.json"],
                      base_file=None)
    assert cfg.tokenizer.name.endswith("mistral-v1/tokenizer.model")       # from offline.json
    assert (cfg.model.attention, cfg.model.segment_length) == ("infini", 32)  # from infini_tiny
    assert cfg.sources[-2:] == [str(ROOT / "configs" / "offline.json"),
                                str(ROOT / "configs" / "infini_tiny.json")]
