"""DPO (`main.py dpo prepare|train`, utils/data/preference.py, utils/training/dpo.py): the
preference data and its held-out split, malformed records named by file and line, the loss on a
hand-computed case and against TRL's own DPOTrainer code on the same log-probabilities, its sign
(training raises the reward margin), exact resume after SIGTERM, and the run in status and
report. The base model is conftest's sft_run (a tiny SFT run)."""
from __future__ import annotations

import json
import math
import shlex
import signal
import sys
import types
from collections import defaultdict

import numpy as np
import pexpect
import pytest
import torch

import main
from tests.conftest import (ROOT, default_signals, offline_env, paused_env, popen_main, run_stage,
                            wait_for_line, write_config)

STEPS = 6                  # 2 epochs of 3 steps over the 12 training pairs


@pytest.fixture(scope="module")
def work(sft_run, tmp_path_factory):
    """A config over sft_run's tokenizer (its SFT data's template: ours) with preference pairs
    prepared from the offline samples, and a DPO run of STEPS steps started from the SFT model."""
    root = tmp_path_factory.mktemp("dpo")
    tok = json.loads(sft_run["cfg"].read_text())["tokenizer"]
    cfg = write_config(root, {"tokenizer": tok, "logging": {"log_every": 1, "tensorboard": False},
                              "dpo": {"val_split": 0.25, "batch_size": 4, "lr": 3e-3, "beta": 0.5}})
    p = run_stage("dpo", "prepare", "--config", cfg, "--dataset", "samples", "--limit", "16",
                  "--max-length", "96")
    assert p.returncode == 0, p.stdout + p.stderr
    common = ["--config", cfg, "--checkpoint", sft_run["ckpt"], "--epochs", "2", "--eval-every", "1"]
    q = run_stage("dpo", "train", *common, "--name", "ref")
    assert q.returncode == 0, q.stdout + q.stderr
    run, = (root / "checkpoints").glob("dpo_ref_*")
    return {"root": root, "cfg": cfg, "run": run, "common": common, "prepare": p, "train": q,
            "base": sft_run}


def records(root, run) -> list[dict]:
    path = root / "logs" / "raw_metrics" / f"{run.name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------- data
def test_prepare_keeps_a_held_out_split_and_masks_only_the_answers(work):
    from utils.data import preference
    from utils.data.tok import load_tokenizer_from
    out = work["root"] / "data" / "preference"
    pairs = preference.load_pairs(out)
    meta = pairs.meta
    assert meta["counts"]["kept"] == len(pairs) == 16 and meta["source"]["kind"] == "preference_substitute"
    assert "SUBSTITUTE" in meta["source"]["label"]
    assert int(pairs.split.sum()) == meta["counts"]["held_out"] == 4                  # val_split 0.25
    assert sorted(pairs.heldout_indices.tolist() + pairs.train_indices.tolist()) == list(range(16))
    tok = load_tokenizer_from(meta["tokenizer"]["name"])
    first = json.loads((out / preference.EXAMPLES_FILE).read_text())[0]
    for side, i in (("chosen", 0), ("rejected", 1)):
        ids, mask = pairs.examples.example(i)
        answer = tok.decode([t for t, m in zip(ids, mask) if m and t != tok.eos_token_id]).strip()
        assert answer == first[side] and answer.startswith("The answer is ")
        assert ids[mask.astype(bool)][-1] == tok.eos_token_id                        # the answer's EOS counts
        prompt = tok.decode([t for t, m in zip(ids, mask) if not m])
        assert first["prompt_turns"][0] in prompt and "The answer" not in prompt
    assert first["chosen"] != first["rejected"]


def test_last_turn_only_keeps_the_final_answer():
    from utils.data.preference import last_turn_only
    assert last_turn_only([0, 1, 1, 0, 0, 1, 1, 1, 0]) == [0, 0, 0, 0, 0, 1, 1, 1, 0]
    assert last_turn_only([0, 0, 1]) == [0, 0, 1]
    assert last_turn_only([0, 0]) == [0, 0]


def test_malformed_records_are_named_by_file_and_line(work, tmp_path):
    good = {"prompt": "Why is the sky blue?", "chosen": "Rayleigh scattering.", "rejected": "Paint."}
    conversational = {"prompt": [{"role": "user", "content": "2+2?"}],
                      "chosen": [{"role": "assistant", "content": "4"}],
                      "rejected": [{"role": "assistant", "content": "5"}]}
    implicit = {"chosen": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}],
                "rejected": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Go."}]}
    lines = [json.dumps(good), "{not json", json.dumps({"prompt": "q", "chosen": "a"}),
             json.dumps(conversational), json.dumps({"prompt": "q", "chosen": "same", "rejected": "same"}),
             json.dumps({"prompt": [{"role": "assistant", "content": "x"}], "chosen": "a", "rejected": "b"}),
             json.dumps(implicit), json.dumps([1, 2]), json.dumps({"prompt": "q", "chosen": " ", "rejected": "b"})]
    src = tmp_path / "pairs.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "pref"
    r = run_stage("dpo", "prepare", "--config", work["cfg"], "--dataset", src, "--output-dir", out)
    assert r.returncode == 0, r.stdout + r.stderr
    for where in ("pairs.jsonl:2: invalid_json", "pairs.jsonl:3: missing_key (no rejected",
                  "pairs.jsonl:5: chosen_equals_rejected", "pairs.jsonl:6: prompt_roles",
                  "pairs.jsonl:8: not_an_object", "pairs.jsonl:9: empty_text (chosen"):
        assert where in r.stdout, (where, r.stdout)
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["counts"]["kept"] == 3 and meta["counts"]["skipped_total"] == 6
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n" + json.dumps({"prompt": "q"}) + "\n")
    r = run_stage("dpo", "prepare", "--config", work["cfg"], "--dataset", bad, "--output-dir", tmp_path / "none")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "no usable preference pair" in r.stderr and "bad.jsonl:1: invalid_json" in r.stderr
    assert not (tmp_path / "none" / "metadata.json").exists()


def test_prepare_reads_a_local_dataset_folder(work, tmp_path):
    """A hub preference dataset's local copy: a folder of parquet files, as the hub stores one."""
    import datasets
    rows = [{"prompt": f"Is {i} even?", "chosen": "yes" if i % 2 == 0 else "no",
             "rejected": "no" if i % 2 == 0 else "yes"} for i in range(6)]
    (tmp_path / "prefs" / "data").mkdir(parents=True)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "prefs" / "data" / "train-00000-of-00001.parquet"))
    out = tmp_path / "pref"
    r = run_stage("dpo", "prepare", "--config", work["cfg"], "--dataset", tmp_path / "prefs", "--output-dir", out)
    assert r.returncode == 0, r.stdout + r.stderr
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["counts"]["kept"] == 6 and meta["source"]["kind"] == "local_dataset", meta


def test_train_refuses_pairs_rendered_with_another_template(work, tmp_path):
    """The SFT checkpoint records its chat template: pairs rendered with another one (here our
    template with other prefixes) are refused before anything is written."""
    other = tmp_path / "other"
    r = run_stage("dpo", "prepare", "--config", work["cfg"], "--dataset", "samples", "--limit", "8",
                  "--output-dir", other, "--config", write_config(tmp_path, {"sft": {"user_prefix": "Q: "}},
                                                                   name="q.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_stage("dpo", "train", "--config", work["cfg"], "--checkpoint", work["base"]["ckpt"],
                  "--data-dir", other, "--name", "wrong")
    assert r.returncode == 1 and "another chat template" in r.stderr and "user_prefix" in r.stderr, r.stderr
    assert not list((work["root"] / "checkpoints").glob("dpo_wrong_*"))


# --------------------------------------------------------------------------- the loss
def test_loss_on_a_hand_computed_case():
    from utils.training.dpo import dpo_loss
    pc, pr = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])
    rc, rr = torch.tensor([-1.5, -2.0]), torch.tensor([-1.5, -2.0])
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.5)
    # pair 1: r_w = 0.5 * 0.5 = 0.25, r_l = 0.5 * -0.5 = -0.25, margin 0.5
    # pair 2: r_w = 0.5 * -1 = -0.5, r_l = 0.5 * 1 = 0.5, margin -1
    want = (math.log1p(math.exp(-0.5)) + math.log1p(math.exp(1.0))) / 2
    assert float(loss) == pytest.approx(want, abs=1e-6)
    assert float(m["rewards_chosen"]) == pytest.approx((0.25 - 0.5) / 2)
    assert float(m["rewards_rejected"]) == pytest.approx((-0.25 + 0.5) / 2)
    assert float(m["reward_accuracy"]) == 0.5 and float(m["reward_margin"]) == pytest.approx(-0.25)


def test_gradient_raises_the_chosen_and_lowers_the_rejected():
    """The loss's core rule: descending it raises log pi(chosen) and lowers log pi(rejected)
    (a flipped sign does the opposite and fails here)."""
    from utils.training.dpo import dpo_loss
    pc, pr = torch.tensor([-1.0], requires_grad=True), torch.tensor([-2.0], requires_grad=True)
    loss, _ = dpo_loss(pc, pr, torch.tensor([-1.0]), torch.tensor([-2.0]), beta=0.1)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(2))           # policy == reference: -log sigmoid(0)
    assert float(pc.grad) == pytest.approx(-0.05) and float(pr.grad) == pytest.approx(0.05)


def test_loss_and_rewards_match_trls_dpo_trainer():
    """TRL's own DPOTrainer._compute_loss (trl pinned in requirements-test.txt), run on the same
    per-token log-probabilities through a stand-in model, gives our loss and reward metrics."""
    from trl import DPOTrainer
    from utils.training.dpo import dpo_loss
    g = torch.Generator().manual_seed(0)
    n, T, beta = 3, 7, 0.3
    completion = torch.zeros(2 * n, T, dtype=torch.long)
    completion[:, 3:] = 1
    completion[1, 6:] = 0                                              # a shorter answer
    per_token = -torch.rand(2 * n, T - 1, generator=g) * completion[:, 1:]
    ref = -torch.rand(2 * n, generator=g) * 5
    outputs = types.SimpleNamespace(log_probs=per_token, entropy=torch.zeros(2 * n, T - 1),
                                    mean_logits=torch.zeros(2 * n, T - 1),
                                    is_top1=torch.zeros(2 * n, T - 1, dtype=torch.bool))
    identity = types.SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t,
                                     gather_for_metrics=lambda t: t)
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=identity, aux_loss_enabled=False,
        ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=["sigmoid"],
        loss_weights=[1.0], beta=beta, use_weighting=False, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1, label_smoothing=0.0)
    inputs = {"input_ids": torch.zeros(2 * n, T, dtype=torch.long), "attention_mask": torch.ones(2 * n, T),
              "completion_mask": completion, "ref_chosen_logps": ref[:n], "ref_rejected_logps": ref[n:]}
    theirs = DPOTrainer._compute_loss(trainer, lambda **kw: outputs, inputs, False)
    logps = per_token.sum(1)
    ours, m = dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], beta)
    assert float(ours) == pytest.approx(float(theirs), abs=1e-6)
    got = trainer._metrics["train"]
    for name, key in (("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected"),
                      ("reward_accuracy", "rewards/accuracies"), ("reward_margin", "rewards/margins")):
        assert float(m[name]) == pytest.approx(got[key][0], abs=1e-6), name


def test_sequence_logps_count_only_the_masked_positions():
    from utils.training.dpo import sequence_logps
    logits = torch.randn(2, 4, 5)
    model = lambda x: (logits, None)                                  # noqa: E731
    y = torch.tensor([[1, 2, 3, -100], [4, 0, 1, 2]])
    mask = torch.tensor([[0.0, 1, 1, 0], [1, 1, 0, 1]])
    got = sequence_logps(model, {"x": y.clamp(min=0), "y": y, "loss_mask": mask})
    lp = torch.log_softmax(logits, -1)
    want = [lp[0, 1, 2] + lp[0, 2, 3], lp[1, 0, 4] + lp[1, 1, 0] + lp[1, 3, 2]]
    assert torch.allclose(got, torch.stack(want))


# --------------------------------------------------------------------------- training
def test_training_raises_the_reward_margin_and_writes_the_run(work):
    """From the SFT model, a few steps at a high rate: the implicit reward of the chosen answers
    rises above the rejected's on the training pairs and on the held-out ones (at step 0 the
    policy is the reference: every reward is 0)."""
    run = work["run"]
    recs = records(work["root"], run)
    train = [r for r in recs if r.get("type") == "train"]
    val = [r for r in recs if r.get("type") == "val"]
    assert len(train) == STEPS and [r["step"] for r in val] == [0, 3, 6], recs
    assert train[0]["reward_margin"] == pytest.approx(0.0, abs=1e-6)         # policy == reference
    assert val[0]["val_reward_margin"] == 0.0 and val[0]["val_reward_accuracy"] == 0.0   # exactly
    last_epoch = train[-3:]
    assert all(r["reward_margin"] > 0.5 and r["reward_accuracy"] == 1.0 for r in last_epoch), last_epoch
    assert all(r["rewards_chosen"] > r["rewards_rejected"] and r["loss"] < 0.5 for r in last_epoch)
    assert val[-1]["val_reward_margin"] > val[0]["val_reward_margin"]
    assert val[-1]["val_loss"] < math.log(2)
    assert all(r["perplexity"] is None and r["bits_per_byte"] is None for r in val)   # not a next-token loss
    cfg = json.loads((run / "dpo_config.json").read_text())
    assert cfg["base_checkpoint"] == str(work["base"]["ckpt"]) and cfg["data"]["heldout_pairs"] == 4
    ref = np.load(run / "reference_logps.npy")
    assert ref.shape == (32,) and np.isfinite(ref).all() and (ref < 0).all()
    from utils.run import load_checkpoint
    ck = load_checkpoint(run / "checkpoint_latest.pt", "resume")
    assert ck["kind"] == "dpo" and ck["dpo"]["beta"] == 0.5 and ck["step"] == STEPS


def test_sigterm_saves_and_resume_matches_the_uninterrupted_run(work):
    proc = popen_main("dpo", "train", *map(str, work["common"]), "--name", "cut", env=paused_env(4))
    wait_for_line(proc, "paused after step 4")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, out + err
    cmd = err.split("resume with:")[1].strip().splitlines()[0]
    assert cmd.startswith("python main.py dpo train ") and "--resume" in cmd and "--checkpoint" not in cmd
    r = run_stage(*shlex.split(cmd)[2:])
    assert r.returncode == 0, r.stdout + r.stderr
    from utils.run import load_checkpoint
    cut, = (work["root"] / "checkpoints").glob("dpo_cut_*")
    a = load_checkpoint(work["run"] / "checkpoint_latest.pt")
    b = load_checkpoint(cut / "checkpoint_latest.pt")
    assert a["step"] == b["step"] == STEPS
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    ra, rb = records(work["root"], work["run"]), records(work["root"], cut)
    losses = lambda rs: [(r["step"], r["loss"]) for r in rs if r.get("type") == "train"]  # noqa: E731
    assert losses(ra) == sorted(set(losses(rb)))
    r = run_stage("dpo", "train", "--config", work["cfg"], "--resume", "auto", "--name", "cut")
    assert r.returncode == 0 and f"already_done at step {STEPS}" in r.stdout, r.stdout + r.stderr
    # a reference file changed under the run is refused on resume
    np.save(cut / "reference_logps.npy", np.load(cut / "reference_logps.npy") + 1)
    r = run_stage("dpo", "train", "--config", work["cfg"], "--resume", cut / "checkpoint_latest.pt")
    assert r.returncode == 1 and "not the reference this run's checkpoints recorded" in r.stderr, r.stderr


def test_dpo_with_lora_trains_an_adapter_against_the_base_reference(work):
    """`dpo train --lora`: the adapter starts at zero, so its reference log-probs are the base
    model's (equal to the full run's); only A and B move, the base weights stay, and the
    adapter is written as a PEFT folder at the end."""
    import numpy as np
    import torch
    q = run_stage("dpo", "train", *work["common"], "--name", "lora", "--lora", "--lora-rank", "2",
                  "--max-steps", "2")
    assert q.returncode == 0, q.stdout + q.stderr
    run, = (work["root"] / "checkpoints").glob("dpo_lora_*")
    assert "dpo train: LoRA r=2" in q.stdout and (run / "adapter" / "adapter_config.json").is_file()
    assert np.array_equal(np.load(run / "reference_logps.npy"), np.load(work["run"] / "reference_logps.npy"))
    ck = torch.load(run / "checkpoint_latest.pt", weights_only=True, map_location="cpu")
    base = torch.load(work["base"]["ckpt"], weights_only=True, map_location="cpu")
    assert all(torch.equal(ck["model"][k], v) for k, v in base["model"].items())
    assert ck["lora"]["rank"] == 2 and any(v.abs().max() > 0 for k, v in ck["lora"]["weights"].items()
                                           if ".lora_B." in k)
    dc = json.loads((run / "dpo_config.json").read_text())
    assert dc["hyperparameters"]["lora"]["rank"] == 2 and dc["base"]["run"] == work["base"]["run"].name


def test_status_and_report_show_the_run(work):
    name = work["run"].name
    s = run_stage("status", "--config", work["cfg"])
    assert s.returncode == 0 and name in s.stdout, s.stdout + s.stderr
    s = run_stage("status", "--config", work["cfg"], name)
    assert s.returncode == 0 and "reward_accuracy" in s.stdout, s.stdout + s.stderr
    assert "perplexity" not in s.stdout and "validation   loss" in s.stdout, s.stdout
    r = run_stage("report", "--config", work["cfg"], name)
    assert r.returncode == 0, r.stdout + r.stderr
    md = (work["root"] / "reports" / name / "report.md").read_text()
    assert "Preference tuning (DPO)" in md and "reward accuracy" in md
    assert str(work["base"]["ckpt"]) in md


def test_the_menu_runs_the_dpo_and_rl_stages(tmp_path):
    """`python main.py` (the interactive menu, on a pty) lists dpo and rl and runs each."""
    child = pexpect.spawn(sys.executable, [str(ROOT / "main.py")], cwd=str(tmp_path), env=offline_env(),
                          encoding="utf-8", timeout=120, dimensions=(50, 200), preexec_fn=default_signals)
    for stage, listed, args, said, again in (("dpo", "preference pairs", "prepare --help",
                                              ("mask on the answers", "--val-split"), "y"),
                                             ("rl", "verifiable rewards", "--help", ("--group-size", "--lora"), "n")):
        child.expect(r"Choose a stage \[1-(\d+)\]: ")
        assert stage in child.before and listed in child.before
        child.sendline(str(main.MENU_ORDER.index(stage) + 1))
        child.expect(f"Arguments for '{stage}'")
        child.sendline(args)
        for text in said:
            child.expect(text)
        child.expect(f"Stage '{stage}' finished successfully.")
        child.expect(r"Run another stage\? \[y/N\]: ")
        child.sendline(again)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
