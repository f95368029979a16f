"""The GPU path, run on the CPU: every stage that trains or generates, once with ``--dtype
bf16``, which on the CPU takes the dtype flow CUDA takes by default (autocast on; generation
in the autocast dtype with its KV cache in it, the fp32 CPU decode pack off; infer and serve
with bf16 weights). Before these runs, the default CUDA run died at its first sample
("index_copy_(): self Float and source BFloat16"; on CPU "Got unsupported ScalarType
BFloat16"); DPO's reference was computed in fp32 while the policy ran under autocast.

One chain, as a user makes it: pre-training (samples, validation, an interrupted run resumed
bit for bit; fp16 with its loss scaler: tests/test_promises.py), SFT of all weights and with LoRA, DPO (step-0 rewards
exactly 0: reference and policy computed alike), RL (rollouts and pass@1 under the run's
autocast), infer, serve (a streamed chat through the openai client), benchmark and export."""
from __future__ import annotations

import json
import signal

import pytest
import torch

from tests.conftest import SPM_MODEL, paused_env, popen_main, run_stage, wait_for_line, write_config
from utils.run import load_checkpoint
from utils.training.logging_utils import read_jsonl

BF16 = ["--dtype", "bf16"]
TRAIN = ["--test", "--window", "32", "--batch-size", "2", "--eval-batches", "1", "--eval-steps", "2",
         "--sample-tokens", "6", "--log-every", "1", "--warmup-steps", "1"]
STEPS = 4


def ok(p):
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("cuda_shape")


@pytest.fixture(scope="module")
def cfg(root, train_shards):
    return write_config(root, {"tokenizer": {"name": str(SPM_MODEL)},
                               "dataset": {"wikipedia_test_dir": str(train_shards)},
                               "logging": {"log_every": 1, "tensorboard": False},
                               "rl": {"val_prompts": 4, "group_size": 2, "prompts_per_step": 2,
                                      "max_new_tokens": 4, "max_operand": 9, "eval_every": 2},
                               "dpo": {"val_split": 0.25, "batch_size": 4, "beta": 0.5},
                               "sft": {"batch_size": 2, "val_split": 0.03}})


@pytest.fixture(scope="module")
def pretrained(root, cfg):
    """`train --dtype bf16` for STEPS steps, a sample and a validation every 2 steps."""
    p = ok(run_stage("train", "--config", cfg, *TRAIN, *BF16, "--max-steps", STEPS, "--name", "bf16"))
    return {"run": root / "checkpoints" / "bf16", "out": p.stdout + p.stderr}


@pytest.fixture(scope="module")
def sft(root, cfg, pretrained):
    """The pre-trained model fine-tuned in bf16 (1 step, with its samples)."""
    ok(run_stage("sft", "prepare", "--config", cfg, "--test", "--dataset", "samples"))
    p = ok(run_stage("sft", "train", "--config", cfg, "--test", *BF16, "--checkpoint",
                     pretrained["run"] / "checkpoint_best.pt", "--name", "bf16", "--max-steps", "1",
                     "--sample-tokens", "6"))
    run, = (root / "checkpoints").glob("sft_bf16_*")
    return {"run": run, "ckpt": run / "checkpoint_best.pt", "out": p.stdout + p.stderr}


def records(root, run_name) -> list[dict]:
    return read_jsonl(root / "logs" / "raw_metrics" / f"{run_name}.jsonl")


# --------------------------------------------------------------------------- pre-training
def test_pretraining_in_bf16_samples_and_validates(root, pretrained):
    out = pretrained["out"]
    assert "bfloat16 on cpu" in out
    assert all(f"sample @ step {s}:" in out for s in (0, 2, 4)), out
    vals = [r for r in records(root, "bf16") if r.get("type") == "val"]
    assert [r["step"] for r in vals] == [0, 2, 4] and all(0 < r["val_loss"] < 20 for r in vals), vals


def test_an_interrupted_bf16_run_resumes_bit_exact(root, cfg, pretrained):
    p = popen_main("train", "--config", cfg, *TRAIN, *BF16, "--max-steps", STEPS, "--name", "cut",
                   env=paused_env(2))
    wait_for_line(p, "paused after step 2")
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 130, f"{out}\n{err}"
    ok(run_stage("train", "--config", cfg, *TRAIN, *BF16, "--max-steps", STEPS, "--name", "cut",
                 "--resume", "auto"))
    a = load_checkpoint(pretrained["run"] / "checkpoint_latest.pt", "resume")["model"]
    b = load_checkpoint(root / "checkpoints" / "cut" / "checkpoint_latest.pt", "resume")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- post-training
def test_sft_in_bf16_samples_from_its_chat_template(sft):
    assert "sample @ step 1:" in sft["out"], sft["out"]


def test_sft_with_lora_in_bf16(root, cfg, sft, pretrained):
    p = ok(run_stage("sft", "train", "--config", cfg, "--test", *BF16, "--checkpoint",
                     pretrained["run"] / "checkpoint_best.pt", "--name", "lora", "--lora", "--lora-rank", "2",
                     "--max-steps", "1", "--sample-tokens", "6"))
    assert "sample @ step 1:" in p.stdout + p.stderr
    run, = (root / "checkpoints").glob("sft_lora_*")
    assert (run / "adapter" / "adapter_model.safetensors").is_file()


@pytest.fixture(scope="module")
def pairs(cfg, sft):
    return ok(run_stage("dpo", "prepare", "--config", cfg, "--dataset", "samples", "--limit", "16",
                        "--max-length", "96"))


def test_dpo_in_bf16_starts_with_rewards_exactly_zero_and_without_dropout(root, cfg, sft, pairs):
    """The reference log-probabilities are computed under the run's autocast, as the policy's
    validation is: at step 0 (policy == reference) the held-out rewards are 0.0 exactly (before,
    the reference was fp32 and the policy bf16: they differed on every device but a CPU in
    fp32). A LoRA policy's dropout (0.05 by default) is turned off, and the run says so."""
    p = ok(run_stage("dpo", "train", "--config", cfg, *BF16, "--checkpoint", sft["ckpt"], "--name", "bf16",
                     "--lora", "--max-steps", "1", "--eval-every", "1"))
    assert "dpo train: dropout off in the policy" in p.stdout and "--keep-dropout keeps it" in p.stdout
    run, = (root / "checkpoints").glob("dpo_bf16_*")
    v0 = next(r for r in records(root, run.name) if r.get("type") == "val" and r["step"] == 0)
    assert v0["val_rewards_chosen"] == 0.0 and v0["val_rewards_rejected"] == 0.0, v0


@pytest.mark.parametrize("keep", [False, True])
def test_a_policy_without_dropout_computes_in_training_what_it_computes_in_eval(keep):
    """What `dpo train` and `rl` do to the policy (``disable_dropout``, unless --keep-dropout):
    with model and LoRA dropout on, a training-mode forward draws masks, so the policy trained
    is not the eval-mode one whose numbers it is compared with (DPO's reference, GRPO's
    rollouts); with them off, the two forwards are equal."""
    from tests.test_model import V, build
    from utils import lora
    from utils.training.trainer import disable_dropout
    model = lora.apply(build(seed=4, dropout=0.1), lora.LoraSettings(rank=2, alpha=4.0, dropout=0.2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()                        # a trained adapter (a new one's B is 0: no effect)
    assert keep or disable_dropout(model) >= 3     # the model's dropouts, attention's, LoRA's
    idx = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        train_logits = model.train()(idx)[0]
        eval_logits = model.eval()(idx)[0]
    assert torch.equal(train_logits, eval_logits) != keep


def test_rl_in_bf16_samples_and_scores_under_the_runs_autocast(root, cfg, sft):
    ok(run_stage("rl", "--config", cfg, *BF16, "--checkpoint", sft["ckpt"], "--steps", "2", "--name", "bf16"))
    run, = (root / "checkpoints").glob("rl_bf16_*")
    recs = records(root, run.name)
    assert [r["step"] for r in recs if r["type"] == "val"] == [0, 2]
    assert all(0 <= r["val_pass_at_1"] <= 1 for r in recs if r["type"] == "val")
    hyper = json.loads((run / "rl_config.json").read_text())["hyperparameters"]
    assert hyper["dtype"] == "torch.bfloat16"


def test_rollouts_sample_in_the_autocast_dtype_they_are_given():
    from tests.test_model import build
    from utils.rl import grpo
    model = build(seed=3)
    settings = grpo.RolloutSettings(group_size=2, prompts_per_step=1, max_new_tokens=3, temperature=1.0,
                                    top_k=0, stop_ids=frozenset(), pad_id=0)
    data = grpo.Rollouts(model, [[1, 5, 7], [1, 9]], settings, lambda i, ids: 1.0, 0, amp=torch.bfloat16)
    assert data.engine.dtype == torch.bfloat16
    batch = next(iter(data))
    assert batch["x"].shape[0] == 2 and torch.isfinite(batch["advantages"]).all()


# --------------------------------------------------------------------------- generation
def test_infer_with_bf16_weights(cfg, sft):
    p = ok(run_stage("infer", "--config", cfg, "--checkpoint", sft["run"], *BF16, "--prompt", "Why?",
                     "--max-new-tokens", "6", "--seed", "1", "--json"))
    got = json.loads(p.stdout)
    assert got["tokens"] >= 1 and got["dtype"] == "bfloat16", got


def test_int8_weights_refuse_another_dtype(cfg, sft):
    p = run_stage("infer", "--config", cfg, "--checkpoint", sft["run"], *BF16, "--quantize", "int8",
                  "--prompt", "Why?")
    assert p.returncode == 2 and "inference.dtype is 'bf16' with int8 weights" in p.stderr, p.stderr


def test_benchmark_in_bf16(cfg, sft, pretrained):
    """A scored task (under autocast) and a generated one (the engine at the same precision)."""
    p = ok(run_stage("benchmark", "--config", cfg, "--test", *BF16, "--tasks", "lambada,completion",
                     "--limit", "lambada=4", "--limit", "completion=2", sft["ckpt"]))
    out = p.stdout.lower()
    assert "lambada" in out and "completion" in out, p.stdout


def test_export_of_a_bf16_run_loads_in_transformers(root, cfg, sft):
    out = root / "exports" / "bf16-hf"
    ok(run_stage("export", "--config", cfg, "--checkpoint", sft["run"], "--format", "hf", "--dtype", "bf16",
                 "--out", out))
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(out)
    assert m.dtype == torch.bfloat16
    ids = torch.tensor([[1, 100, 200]])
    assert m.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 6)


def test_serve_with_bf16_weights_streams_a_chat(root, cfg, sft):
    """`serve --dtype bf16` (on CUDA, `auto` is bf16): a streamed chat through the openai client
    equals the same request unstreamed (greedy), and /health names the weights' dtype."""
    from tests.test_serve import Server
    s = Server(root, cfg, "--checkpoint", sft["run"], *BF16)
    try:
        model = s.client.models.list().data[0].id
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                "temperature": 0}
        parts = list(s.client.chat.completions.create(**body, stream=True))
        text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        assert parts[-1].choices[0].finish_reason in ("length", "stop")
        assert text == s.client.chat.completions.create(**body).choices[0].message.content
    finally:
        assert s.stop() == 130, s.stderr()


# --------------------------------------------------------------------------- the engine under autocast
def test_one_decode_pass_under_autocast_the_eager_compiled_and_verify_steps_agree(monkeypatch):
    """An engine made under the caller's autocast (the trainer's samples) decodes in its dtype:
    the KV cache in bf16, the fp32 CPU decode pack off (steps run the model's modules, as on
    CUDA). The eager step, the compiled step (traced with dynamo's eager backend) and prompt
    lookup's verify pass are one function (utils/generation/step.py): their greedy tokens are
    equal, and a seeded batch's rows equal their lone runs."""
    import utils.generation.compiled as compiled
    from tests.test_model import build
    from utils.generation.engine import Engine
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    torch._dynamo.reset()
    m = build(seed=5, max_seq_len=256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = Engine(m)
    assert eager.dtype == torch.bfloat16 and eager.amp == torch.bfloat16 and eager.decode_pack() is None
    assert Engine(m).dtype == torch.float32                     # outside autocast: the weights'
    prompt = [1, 5, 9, 5, 9, 5, 9, 33, 5, 9]                      # repeats: prompt lookup drafts
    want = eager.generate([prompt], 12, temperature=0)
    import utils.generation.speculative as speculative
    passes = []
    verify = speculative.verify_logits
    monkeypatch.setattr(speculative, "verify_logits", lambda *a: passes.append(1) or verify(*a))
    assert Engine(m, amp=torch.bfloat16, prompt_lookup=3).generate([prompt], 12, temperature=0) == want
    assert passes                                                 # the verify pass ran
    assert Engine(m, amp=torch.bfloat16, compile="on").generate([prompt], 12, temperature=0) == want
    b = eager.batcher(2, 32)
    assert b.bytes_per_slot == 2 * 2 * m.args.n_kv_heads * 32 * m.args.head_dim * 2   # bf16: 2 bytes
    rows = eager.generate([prompt, [1, 7, 3]], 8, temperature=1.0, seed=11)
    assert rows[1] == eager.generate([[1, 7, 3]], 8, temperature=1.0, seed=12)[0]
    assert rows[0] == eager.generate([prompt], 8, temperature=1.0, seed=11)[0]


def test_an_infini_model_decodes_under_autocast():
    from tests.test_model import build
    from utils.generation.engine import Engine
    m = build(seed=7, attention="infini", segment_length=8)
    want = Engine(m, amp=torch.bfloat16).generate([[1, 5, 9, 33, 2, 7, 4, 4, 4, 9, 12]], 10, temperature=0)[0]
    assert len(want) == 10
