"""RL on verifiable rewards (rl.py, utils/rl/): the task's held-out split and verifiers, GRPO's
per-group advantages and the loss's sign, rollouts that a resumed position regenerates, and
`main.py rl` from an SFT run end to end (rewards and pass@1 logged, status, report), stopped
with Ctrl-C and resumed to the same rewards."""
from __future__ import annotations

import json
import shlex
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import SPM_MODEL, paused_env, popen_main, run_stage, wait_for_line, write_config
from utils.cli import PipelineError
from utils.rl import grpo
from utils.rl.tasks import Arithmetic, Item, exact_match, load_task, numeric_match, read_jsonl_items

RL = {"val_prompts": 6, "group_size": 4, "prompts_per_step": 2, "max_new_tokens": 4, "max_operand": 9,
      "eval_every": 2, "lr": 3e-3}


def rl_cfg(**kw):
    base = dict(task="arithmetic", checker="auto", max_operand=9, max_addend=None, val_prompts=20)
    return SimpleNamespace(**{**base, **kw})


# --------------------------------------------------------------------------- tasks and verifiers
def test_the_arithmetic_split_is_held_out_and_deterministic():
    a, b = Arithmetic.build(rl_cfg(), seed=1), Arithmetic.build(rl_cfg(), seed=1)
    assert a.train == b.train and a.val == b.val
    assert len(a.val) == 20 and len(a.train) == 100 - 20
    assert not {i.prompt for i in a.train} & {i.prompt for i in a.val}
    assert {i.prompt for i in a.train + a.val} == {Arithmetic.PROMPT.format(a=x, b=y)
                                                    for x in range(10) for y in range(10)}
    for item in a.train + a.val:
        x, y = map(int, item.prompt.split("?")[0].removeprefix("What is ").split(" + "))
        assert int(item.answer) == x + y
    assert Arithmetic.build(rl_cfg(), seed=2).val != a.val            # the seed picks the split
    wide = Arithmetic.build(rl_cfg(max_operand=99, max_addend=9, val_prompts=50), seed=1)
    assert len(wide.train) == 950 and len(wide.val) == 50
    assert {int(i.prompt.split(" + ")[1].split("?")[0]) for i in wide.train + wide.val} == set(range(10))
    assert a.checker == "numeric"


def test_the_verifiers():
    assert exact_match("  Paris. ", "paris") and exact_match('"Blue whale"', "blue  whale")
    assert not exact_match("It is Paris", "Paris")
    assert numeric_match("7 + 5 = 12.", "12") and numeric_match("The answer is 1,234", "1234")
    assert numeric_match("-3.50", "-3.5") and not numeric_match("12 or 13", "12")
    assert not numeric_match("twelve", "12") and not numeric_match("", "12")
    task = Arithmetic.build(rl_cfg(), seed=0)
    item = Item("What is 3 + 4?", "7")
    assert task.reward("So 3 + 4 = 7", item) == 1.0 and task.reward("3 + 4", item) == 0.0


def test_a_jsonl_task_splits_its_lines_and_names_malformed_ones(tmp_path):
    good = tmp_path / "t.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"Capital {i}?", "answer": f"City {i}"}) + "\n"
                            for i in range(10)))
    task = load_task(rl_cfg(task=str(good), val_prompts=3), 0, Path)
    assert task.checker == "exact" and len(task.val) == 3 and len(task.train) == 7
    assert not {i.prompt for i in task.train} & {i.prompt for i in task.val}
    nums = tmp_path / "n.jsonl"
    nums.write_text('{"prompt": "2*3?", "answer": 6}\n{"prompt": "2*4?", "answer": "8"}\n')
    assert load_task(rl_cfg(task=str(nums), val_prompts=1), 0, Path).checker == "numeric"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok?", "answer": "ok"}\n{"prompt": "no answer"}\nnot json\n\n[1]\n')
    with pytest.raises(PipelineError) as e:
        read_jsonl_items(bad)
    msg = str(e.value)
    assert f"{bad}:2: no \"answer\"" in msg and f"{bad}:3: not JSON" in msg and f"{bad}:5: a JSON list" in msg
    assert "3 malformed line(s)" in msg
    with pytest.raises(PipelineError, match="neither a task"):
        load_task(rl_cfg(task="no_such_task"), 0, lambda s: tmp_path / s)


# --------------------------------------------------------------------------- advantages and loss
def test_advantages_are_normalized_within_each_group_not_over_the_batch():
    rewards = torch.tensor([1., 0., 0., 0.,   1., 1., 1., 0.,   1., 1., 1., 1.])
    for scale in (True, False):
        adv = grpo.group_advantages(rewards, 4, scale=scale).view(3, 4)
        r = rewards.view(3, 4)
        expect = r - r.mean(1, keepdim=True)
        if scale:
            expect = expect / (r.std(1, keepdim=True) + grpo.ADV_EPS)
        torch.testing.assert_close(adv, expect)
        assert torch.allclose(adv.sum(1), torch.zeros(3), atol=1e-5)    # each group centred on its mean
        assert torch.equal(adv[2], torch.zeros(4))          # all solved: nothing to prefer
    adv = grpo.group_advantages(rewards, 4).view(3, 4)
    assert adv[0, 0] > adv[1, 0] > 0 and adv[1, 3] < adv[0, 1] < 0     # a rarer success counts more
    torch.testing.assert_close(adv[:2].std(1), torch.ones(2), atol=1e-3, rtol=0)


def tiny_model(vocab: int = 40):
    import model as model_lib
    torch.manual_seed(0)
    return model_lib.create_model(model_lib.ModelArgs(vocab_size=vocab, d_model=32, n_layers=1, n_heads=2,
                                                      n_kv_heads=2, max_seq_len=32, bos_id=1))


def reply_logprobs(m, batch) -> torch.Tensor:
    with torch.no_grad():
        lp = grpo.token_logprobs(m, batch["x"], batch["y"])
    return (lp * batch["loss_mask"]).sum(1)


def test_the_loss_raises_the_probability_of_rewarded_replies_and_lowers_the_others():
    m = tiny_model()
    batch = grpo.collate([[1, 5, 6]] * 2, [[7, 8, 2], [9, 10, 2]], pad_id=0)
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 1]] * 2        # the reply and its end token
    batch["rewards"] = torch.tensor([1.0, 0.0])
    batch["advantages"] = grpo.group_advantages(batch["rewards"], 2)
    before = reply_logprobs(m, batch)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    loss, metrics = grpo.pg_loss(m, batch)
    loss.backward()
    opt.step()
    after = reply_logprobs(m, batch)
    assert after[0] > before[0] and after[1] < before[1]
    assert float(metrics["reward"]) == 0.5 and float(metrics["reply_tokens"]) == 3.0
    _, same = grpo.pg_loss(m, batch, kl_beta=0.1, ref_model=m)
    _, moved = grpo.pg_loss(m, batch, kl_beta=0.1, ref_model=tiny_model())
    assert float(same["kl"]) == 0.0 and float(moved["kl"]) > 0.0


def test_rollouts_are_groups_of_one_prompt_and_a_restored_position_regenerates_them():
    m = tiny_model()
    prompts = [[1, 3 + i, 4] for i in range(6)]
    s = grpo.RolloutSettings(group_size=4, prompts_per_step=2, max_new_tokens=5, temperature=1.0, top_k=0,
                             stop_ids=(2,), pad_id=0)
    data = grpo.Rollouts(m, prompts, s, lambda i, ids: float(len(ids) % 2), seed=7)
    it = iter(data)
    first = next(it)
    state = data.state_dict()
    second = next(it)
    assert first["x"].shape[0] == 8 and state["index"] == 2 and len(data) == 3
    chosen = [int(i) for i in data.order(0)[:2]]
    for r in range(8):                                    # row r: prompt r // G, reply after it
        p = prompts[chosen[r // 4]]
        assert first["x"][r, :len(p)].tolist() == p
        assert first["loss_mask"][r, :len(p) - 1].sum() == 0 and first["loss_mask"][r, len(p) - 1] == 1
    torch.testing.assert_close(first["advantages"], grpo.group_advantages(first["rewards"], 4))
    again = grpo.Rollouts(m, prompts, s, lambda i, ids: float(len(ids) % 2), seed=7)
    again.load_state_dict(state)
    regen = next(iter(again))
    for k in ("x", "y", "loss_mask", "rewards", "advantages"):
        assert torch.equal(regen[k], second[k]), k
    with pytest.raises(PipelineError, match="same rl.task"):
        again.load_state_dict({**state, "num_prompts": 99})


def test_a_reply_that_stopped_is_trained_on_the_stop_id_it_sampled():
    """GRPO appended the template's end-of-turn id to every reply that stopped on any stop id, so
    a reply that stopped on EOS trained on a token the model never sampled. Now the reply ends
    with the stop id it sampled: the same token an unstopped run of the same seed samples there."""
    m = tiny_model()
    prompts = [[1, 3 + i, 4] for i in range(2)]
    stops = tuple(range(5, 30))                  # many stop ids: rows stop early, on different ones
    s = grpo.RolloutSettings(group_size=4, prompts_per_step=2, max_new_tokens=12, temperature=1.0, top_k=0,
                             stop_ids=stops, pad_id=0)
    data = grpo.Rollouts(m, prompts, s, lambda i, ids: 0.0, seed=7)
    chosen = [int(i) for i in data.order(0)[:2]]
    seed = 7 * 7919                              # the first batch's row seeds (Rollouts.__iter__)
    batch = next(iter(data))
    rows = [prompts[i] for i in chosen]
    stopped = grpo.generate_replies(data.engine, rows, 4, 12, 1.0, 0, stops, seed)
    free = grpo.generate_replies(data.engine, rows, 4, 12, 1.0, 0, (), seed)
    ended = {stop for _, stop in stopped if stop is not None}
    assert len(ended) > 1, stopped               # several different stop ids were sampled
    for r, ((ids, stop), (unstopped, _)) in enumerate(zip(stopped, free)):
        trained = batch["y"][r][batch["loss_mask"][r] > 0].tolist()
        assert trained == ids + ([stop] if stop is not None else []), r
        if stop is not None:                     # what the model sampled there, not a fixed end id
            assert unstopped[:len(ids) + 1] == ids + [stop], r


# --------------------------------------------------------------------------- the stage
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tmp root with a config and a tiny SFT checkpoint (our chat template) in a run folder."""
    from tests.test_sft import make_checkpoint
    from utils.data import sft
    root = tmp_path_factory.mktemp("rl")
    cfg = write_config(root, {"tokenizer": {"name": str(SPM_MODEL)}, "rl": RL,
                              "logging": {"log_every": 1}})
    base = make_checkpoint(root / "checkpoints" / "sft_base_2020_01_01_00_00_00" / "checkpoint_best.pt",
                           kind="sft", chat_template=sft.default_template())
    return {"root": root, "cfg": cfg, "base": base, "common": ["--config", cfg, "--checkpoint", base, "--steps", "4"]}


@pytest.fixture(scope="module")
def e2e(work):
    """`main.py rl` for 4 steps from the SFT checkpoint: the run folder and the stage's output."""
    r = run_stage("rl", *work["common"], "--name", "e2e")
    assert r.returncode == 0, r.stdout + r.stderr
    run, = (work["root"] / "checkpoints").glob("rl_e2e_*")
    return {"run": run, "out": r.stdout}


def log_records(root: Path, run: str) -> list[dict]:
    text = (root / "logs" / "raw_metrics" / f"{run}.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def rewards_by_step(root: Path, run: str) -> dict:
    return {r["step"]: r["reward"] for r in log_records(root, run) if r["type"] == "train"}


def test_rl_runs_from_an_sft_run_and_shows_in_status_and_report(work, e2e):
    root, run = work["root"], e2e["run"]
    recs = log_records(root, run.name)
    train = [x for x in recs if x["type"] == "train"]
    vals = [x for x in recs if x["type"] == "val"]
    assert [x["step"] for x in train] == [1, 2, 3, 4] and all(0 <= x["reward"] <= 1 for x in train)
    assert [x["step"] for x in vals] == [0, 2, 4] and all(0 <= x["val_pass_at_1"] <= 1 for x in vals)
    assert "step 0/4 | validation | pass_at_1" in e2e["out"]
    rc = json.loads((run / "rl_config.json").read_text())
    assert rc["base"] == {"run": work["base"].parent.name, "file": "checkpoint_best.pt",
                          "path": str(work["base"]), "imported": False}
    assert rc["task"]["val_prompts"] == 6 and rc["task"]["train_prompts"] == 94
    from utils.run import load_checkpoint
    ck = load_checkpoint(run / "checkpoint_latest.pt", "resume")
    assert ck["kind"] == "rl" and ck["step"] == 4 and ck["rl"]["base_checkpoint"] == str(work["base"])
    assert list((root / "logs" / "tensorboard" / run.name).glob("events.*"))
    s = run_stage("status", run.name, "--config", work["cfg"])
    assert s.returncode == 0 and f"run {run.name}" in s.stdout, s.stdout + s.stderr
    assert f"rl           started from {work['base'].parent.name}" in s.stdout
    assert "reward " in s.stdout and "held-out: pass_at_1 " in s.stdout
    rep = run_stage("report", run.name, "--config", work["cfg"])
    assert rep.returncode == 0, rep.stdout + rep.stderr
    md = (root / "reports" / run.name / "report.md").read_text()
    assert "Reinforcement learning (RL) run" in md and "held-out pass@1, first validation" in md
    assert (root / "reports" / run.name / "rl.png").stat().st_size > 1000


def test_rl_with_lora_and_a_kl_penalty_trains_the_adapter_alone(work):
    """`rl --lora --kl-beta`: the reference for the KL term is the plain base network (the
    policy carries the adapter), only the adapter trains (the base weights stay; the optimizer
    holds A and B alone), and its PEFT folder is written."""
    import torch
    r = run_stage("rl", *work["common"][:-1], "2", "--name", "lora", "--lora", "--lora-rank", "2",
                  "--kl-beta", "0.1", "--lr", "1e-2")
    assert r.returncode == 0, r.stdout + r.stderr
    run, = (work["root"] / "checkpoints").glob("rl_lora_*")
    assert "rl: LoRA r=2" in r.stdout and (run / "adapter" / "adapter_model.safetensors").is_file()
    ck = torch.load(run / "checkpoint_latest.pt", weights_only=True, map_location="cpu")
    base = torch.load(work["base"], weights_only=True, map_location="cpu")
    assert ck["step"] == 2 and all(torch.equal(ck["model"][k], v) for k, v in base["model"].items())
    assert ck["lora"]["rank"] == 2            # the optimizer holds the adapter alone:
    assert len(ck["optimizer"]["adamw"]["state"]) == len(ck["lora"]["weights"]) > 0
    assert [x["step"] for x in log_records(work["root"], run.name) if x["type"] == "train"] == [1, 2]


def test_a_resume_refuses_a_kl_reference_rewritten_since_the_start(work):
    """rl read its KL reference again from the base's path on resume with no check, so a base
    rewritten in between changed the KL term silently. Now the run records the reference's
    sha256 (as dpo records its reference's) and a resume against other weights is refused."""
    import shutil
    from utils.rl.grpo import weights_sha256
    from utils.run import load_checkpoint
    folder = work["root"] / "checkpoints" / "sft_klbase_2020_01_01_00_00_00"
    folder.mkdir()
    base = folder / "checkpoint_best.pt"
    shutil.copy(work["base"], base)
    r = run_stage("rl", "--config", work["cfg"], "--checkpoint", folder, "--steps", "1", "--eval-every", "1",
                  "--kl-beta", "0.1", "--name", "kl")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"rl: using checkpoint_best.pt of {folder}" in r.stderr     # a run folder, as infer takes it
    run, = (work["root"] / "checkpoints").glob("rl_kl_*")
    ck = load_checkpoint(run / "checkpoint_latest.pt", "resume")
    assert ck["rl"]["reference_sha256"] == weights_sha256(torch.load(base, weights_only=True)["model"])
    state = torch.load(base, weights_only=True)
    name = next(iter(state["model"]))
    state["model"][name] = state["model"][name] + 1.0
    torch.save(state, base)
    before = (run / "checkpoint_latest.pt").read_bytes()
    r = run_stage("rl", "--config", work["cfg"], "--resume", run / "checkpoint_latest.pt", "--steps", "2",
                  "--eval-every", "1", "--kl-beta", "0.1", "--name", "kl")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "the KL reference" in r.stderr and "has changed since the run started" in r.stderr, r.stderr
    assert (run / "checkpoint_latest.pt").read_bytes() == before


def test_ctrl_c_saves_and_the_resumed_run_gets_the_same_rewards(work, e2e):
    """Stopped after step 2 and resumed, the run samples the same replies as the uninterrupted
    one (e2e, same settings): the same rewards at every step and the same final weights."""
    root = work["root"]
    proc = popen_main("rl", *work["common"], "--name", "cut", env=paused_env(2))
    wait_for_line(proc, "paused after step 2")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, out + err
    cmd = err.split("resume with:")[1].strip().splitlines()[0]
    assert cmd.startswith("python main.py rl ") and "--resume" in cmd and "--checkpoint" not in cmd
    (b,) = (root / "checkpoints").glob("rl_cut_*")
    assert sorted(rewards_by_step(root, b.name)) == [1, 2]
    r = run_stage(*shlex.split(cmd)[2:])
    assert r.returncode == 0, r.stdout + r.stderr
    a = e2e["run"]
    want, got = rewards_by_step(root, a.name), rewards_by_step(root, b.name)
    assert sorted(got) == [1, 2, 3, 4] and got == want
    from utils.run import load_checkpoint
    wa, wb = load_checkpoint(a / "checkpoint_latest.pt")["model"], load_checkpoint(b / "checkpoint_latest.pt")["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
