"""LoRA (utils/lora.py, utils/hf/adapter.py; docs/lora.md): `sft train --lora` end to end.

One LoRA run of the shared SFT data (``lora_run``) is checked as a user meets it: what trains
and what its checkpoints hold, the merged model against the model with the adapter, peft's
own PeftModel on our Hugging Face export, llama.cpp on the merged GGUF, the validation loss,
an exact resume after a stop, and the refusals."""
from __future__ import annotations

import json
import os
import signal
import threading

import llama_cpp  # a test requirement (requirements-test.txt): missing is a failure, not a skip
import numpy as np
import pytest
import torch

from tests.conftest import run_stage

STEPS = 2


def _lora_args(cfg, base, name: str) -> list:
    return ["sft", "train", "--config", cfg, "--test", "--checkpoint", base, "--lora", "--name", name,
            "--max-steps", STEPS, "--eval-every", "1", "--val-split", "0.03", "--sample-tokens", "4",
            "--lr", "3e-2",
            "--lora-rank", "4",
            "--lora-target-modules", "q_proj,wv,o_proj,gate_proj,up_proj,w_down"]


@pytest.fixture(scope="module")
def lora_run(sft_run) -> dict:
    """sft_run's data fine-tuned from its base with a LoRA adapter, STEPS steps, run "lora"."""
    root, cfg = sft_run["root"], sft_run["cfg"]
    base = root / "checkpoints" / "base" / "checkpoint_best.pt"
    p = run_stage(*_lora_args(cfg, base, "lora"))
    assert p.returncode == 0, p.stdout + p.stderr
    run, = (root / "checkpoints").glob("sft_lora_*")
    return {"root": root, "cfg": cfg, "run": run, "base": base, "ckpt": run / "checkpoint_best.pt",
            "out": p.stdout + p.stderr}


def _adapter_model(ckpt_path):
    """Our model with the checkpoint's adapter unmerged (as a resumed run holds it), eval mode."""
    from model import create_model
    from utils import lora
    from utils.run import load_checkpoint, model_args_of
    ckpt = load_checkpoint(ckpt_path, "resume")
    model = create_model(model_args_of(ckpt, ckpt_path))
    lora.apply(model, lora.settings_from_entry(ckpt["lora"]))
    lora.load_weights(model, ckpt)
    return model.eval()


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0][0]


IDS = [1, 415, 7072, 302, 272, 7212, 349, 264, 1215, 28723, 415, 2]


@pytest.fixture(scope="module")
def exports(lora_run, tmp_path_factory) -> dict:
    """The base exported as HF; the LoRA checkpoint exported merged as HF and as an f32 GGUF;
    the base exported with ``--adapter`` <run>/adapter."""
    out = tmp_path_factory.mktemp("lora_exports")
    got = {"base": out / "base-hf", "merged": out / "merged-hf", "gguf": out / "merged-gguf",
           "adapter": out / "adapter-hf"}
    for src, fmt, dest, extra in ((lora_run["base"], "hf", got["base"], ()),
                                  (lora_run["ckpt"], "hf", got["merged"], ()),
                                  (lora_run["ckpt"], "gguf", got["gguf"], ("--dtype", "f32")),
                                  (lora_run["base"], "hf", got["adapter"],
                                   ("--adapter", lora_run["run"] / "adapter"))):
        p = run_stage("export", "--config", lora_run["cfg"], "--checkpoint", src, "--format", fmt,
                      "--out", dest, *extra)
        assert p.returncode == 0, p.stdout + p.stderr
        got[f"{dest.name}-out"] = p.stdout + p.stderr
    return got


def test_only_the_adapter_trains_and_checkpoints_hold_base_plus_adapter(lora_run):
    from utils import lora
    assert "sft train: LoRA r=4, alpha=16" in lora_run["out"]
    assert "on q_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in lora_run["out"]
    base = torch.load(lora_run["base"], weights_only=True, map_location="cpu")
    ck = torch.load(lora_run["run"] / "checkpoint_latest.pt", weights_only=True, map_location="cpu")
    assert ck["step"] == STEPS
    assert set(ck["model"]) == set(base["model"])                 # plain names: stands alone
    for k, v in base["model"].items():                            # the base stayed frozen
        assert torch.equal(ck["model"][k], v), k
    entry = ck["lora"]
    assert (entry["rank"], entry["alpha"]) == (4, 16.0)
    assert entry["target_modules"] == ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    n_layers = ck["model_args"]["n_layers"]
    assert len(entry["weights"]) == n_layers * 6 * 2
    assert all(entry["weights"][k].abs().max() > 0 for k in entry["weights"] if ".lora_B." in k)
    moments = [s for s in ck["optimizer"]["adamw"]["state"].values()]
    assert len(moments) == len(entry["weights"])                  # the optimizer holds the adapter alone
    trained = sum(v.numel() for v in entry["weights"].values())
    cfg = json.loads((lora_run["run"] / "sft_config.json").read_text())
    assert cfg["hyperparameters"]["lora"]["trainable_params"] == trained
    assert f"{trained:,} trainable of" in lora_run["out"]
    folder = lora_run["run"] / "adapter"
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert lora.parameter_counts(_adapter_model(lora_run["ckpt"]))[0] == trained


def test_merged_and_unmerged_logits_agree_and_differ_from_the_base(lora_run):
    """Every reader of weights gets the merged model (the one loader merges): its logits equal
    the model with the adapter to fp32 rounding, and are not the base's."""
    from utils.run import load_model
    merged, ck = load_model(lora_run["ckpt"])
    assert ck["lora"]["merged"] is True and "weights" not in ck["lora"]
    base, _ = load_model(lora_run["base"])
    want, got, was = _logits(_adapter_model(lora_run["ckpt"]), IDS), _logits(merged, IDS), _logits(base, IDS)
    assert (got - want).abs().max() < 1e-4
    assert (got - was).abs().max() > 1e-2


def test_peft_on_our_hf_export_equals_our_model_with_the_adapter(lora_run, exports):
    """PeftModel.from_pretrained(the base's HF export, <run>/adapter) computes our logits."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(exports["base"], dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(hf, lora_run["run"] / "adapter").eval()
    with torch.no_grad():
        got = peft_model(torch.tensor([IDS])).logits[0]
    want = _logits(_adapter_model(lora_run["ckpt"]), IDS)
    assert (got - want).abs().max() < 1e-4
    cfg = json.loads((lora_run["run"] / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["task_type"] == "CAUSAL_LM"


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_merged_exports_hf_and_gguf_agree(lora_run, exports):
    """The merged HF folder computes the adapter model's logits (not the base's); --adapter on
    the base writes the same weights; llama.cpp's greedy tokens on the merged GGUF equal
    transformers' on the merged HF folder."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    assert "its adapter (r=4, alpha=16" in exports["merged-hf-out"]
    assert "merged the LoRA adapter" in exports["adapter-hf-out"]
    merged = LlamaForCausalLM.from_pretrained(exports["merged"], dtype=torch.float32).eval()
    with torch.no_grad():
        got = merged(torch.tensor([IDS])).logits[0]
    assert (got - _logits(_adapter_model(lora_run["ckpt"]), IDS)).abs().max() < 1e-4
    a, b = (load_file(exports[k] / "model.safetensors") for k in ("merged", "adapter"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    base = load_file(exports["base"] / "model.safetensors")
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(a["model.layers.0.self_attn.k_proj.weight"], base["model.layers.0.self_attn.k_proj.weight"])
    want = _hf_greedy(merged, IDS, 8)
    gguf, = exports["gguf"].glob("*.gguf")
    L = llama_cpp.Llama(model_path=str(gguf), n_ctx=64, logits_all=True, verbose=False, n_threads=2, seed=0)
    try:
        L.eval(IDS)
        got_ids = []
        for _ in range(8):
            got_ids.append(int(np.argmax(L.scores[L.n_tokens - 1])))
            L.eval(got_ids[-1:])
    finally:
        L.close()
    assert got_ids == want


def _val_loss(model, lora_run) -> float:
    """The token-weighted masked loss on the run's SFT validation split (as the trainer's)."""
    from utils.config import load_config
    from utils.data import sft
    from utils.training.trainer import counted_tokens, next_token_loss
    cfg = load_config(lora_run["cfg"], test=True)
    examples = sft.load_examples(cfg.path("paths.post_training_dir"))
    split = json.loads((lora_run["run"] / "sft_config.json").read_text())["hyperparameters"]["val_split"]
    _, val_idx = sft.split_indices(len(examples), split, cfg.training.seed)
    total = count = 0.0
    with torch.no_grad():
        for batch in sft.SFTValData(examples, val_idx, cfg.sft.batch_size, 2):
            n = counted_tokens(batch)
            total, count = total + float(next_token_loss(model, batch)) * n, count + n
    return total / count


def test_the_fine_tune_is_in_the_merged_model(lora_run):
    """The merged model's loss on the SFT validation set equals the adapter model's (the run's
    own best validation loss) and differs from the base's."""
    from utils.run import load_checkpoint, load_model
    merged, base = load_model(lora_run["ckpt"])[0], load_model(lora_run["base"])[0]
    got, was = _val_loss(merged, lora_run), _val_loss(base, lora_run)
    adapter = load_checkpoint(lora_run["ckpt"])["best_val_loss"]     # the trainer's, of the adapter model
    assert abs(got - adapter) < 1e-5, (got, adapter)
    assert was - got > 0.02, (was, got)


def test_a_stopped_lora_run_resumes_exactly(lora_run):
    """A LoRA run stopped (SIGTERM, in this process) after its first steps, resumed with the
    command it prints, ends with the adapter, base and optimizer state of the uninterrupted run.
    (SIGTERM: a job started in the background, as CI may be, inherits SIGINT ignored, and the
    trainer keeps an ignored signal ignored.)"""
    from utils.run import load_checkpoint
    from utils.training.trainer import StopRequest
    root = lora_run["root"]
    done = threading.Event()

    def stop_once_trainer_listens():
        while not done.is_set():
            handler = signal.getsignal(signal.SIGTERM)
            if getattr(handler, "__self__", None).__class__ is StopRequest:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            done.wait(0.005)
    sender = threading.Thread(target=stop_once_trainer_listens)
    sender.start()
    try:
        p = run_stage(*_lora_args(lora_run["cfg"], lora_run["base"], "cut"),
                      env=dict(os.environ, LLM_PIPELINE_PAUSE_AT_STEP="1"))
    finally:
        done.set()
        sender.join()
    assert p.returncode == 130, p.stdout + p.stderr
    run, = (root / "checkpoints").glob("sft_cut_*")
    assert load_checkpoint(run / "checkpoint_latest.pt", "resume")["step"] < STEPS
    cmd = p.stderr.split("resume with:")[1].strip().splitlines()[0].split()
    r = run_stage(*cmd[2:])
    assert r.returncode == 0, r.stdout + r.stderr
    a = load_checkpoint(lora_run["run"] / "checkpoint_latest.pt", "resume")
    b = load_checkpoint(run / "checkpoint_latest.pt", "resume")
    assert a["step"] == b["step"] == STEPS
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for k in a["lora"]["weights"]:
        assert torch.equal(a["lora"]["weights"][k], b["lora"]["weights"][k]), k
    for i, s in a["optimizer"]["adamw"]["state"].items():
        assert torch.equal(s["exp_avg"], b["optimizer"]["adamw"]["state"][i]["exp_avg"])


def test_refusals_name_the_setting(lora_run):
    """An unknown target module (with the valid names), rank 0, LoRA on Infini-attention, a
    resumed full fine-tune switched to LoRA, an adapter of another model at export."""
    from model import ModelArgs, create_model
    from utils import lora
    from utils.cli import UsageError
    cfg, base = lora_run["cfg"], lora_run["base"]
    p = run_stage("sft", "train", "--config", cfg, "--checkpoint", base, "--lora",
                  "--lora-target-modules", "q_proj,qkv")
    assert p.returncode == 2 and "lora.target_modules: unknown target module 'qkv'" in p.stderr, p.stderr
    assert "q_proj, k_proj" in p.stderr and "wq, wk" in p.stderr and "all-linear" in p.stderr
    p = run_stage("sft", "train", "--config", cfg, "--checkpoint", base, "--lora", "--lora-rank", "0")
    assert p.returncode == 2 and "lora.rank" in p.stderr, p.stderr
    infini = create_model(ModelArgs(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                    max_seq_len=32, attention="infini", segment_length=16))
    with pytest.raises(UsageError, match="not supported on model.attention 'infini'"):
        lora.apply(infini, lora.LoraSettings())
    sft_latest = next((lora_run["root"] / "checkpoints").glob("sft_base_*")) / "checkpoint_latest.pt"
    p = run_stage("sft", "train", "--config", cfg, "--resume", sft_latest, "--lora")
    assert p.returncode == 2 and "cannot switch to LoRA midway" in p.stderr, p.stderr
    bad = lora_run["root"] / "bad-adapter"
    bad.mkdir(exist_ok=True)
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                         "use_dora": True}))
    p = run_stage("export", "--config", cfg, "--checkpoint", base, "--format", "hf",
                  "--out", lora_run["root"] / "never", "--adapter", bad)
    assert p.returncode == 1 and "use_dora is set: DoRA cannot be merged" in p.stderr, p.stderr
    assert not (lora_run["root"] / "never").exists()


def test_the_menu_reaches_sft_train_with_lora(lora_run, tmp_path):
    """main.py's menu suggests `sft train ... --lora` and hands the LoRA flags to the stage (its
    refusal of an unknown target module comes back through the router; the run itself is the
    CLI's, tested above: the menu launches the same command)."""
    import sys

    import pexpect

    from tests.conftest import ROOT, default_signals, offline_env
    child = pexpect.spawn(sys.executable, [str(ROOT / "main.py")], cwd=str(tmp_path), env=offline_env(),
                          encoding="utf-8", timeout=240, dimensions=(50, 200), preexec_fn=default_signals)
    child.expect(r"Choose a stage \[1-(\d+)\]: ")
    child.sendline("sft")
    child.expect(r"Arguments for 'sft' \(Enter for none, e\.g\. train --checkpoint checkpoints/<run> --lora\)")
    child.sendline(f"train --config '{lora_run['cfg']}' --checkpoint '{lora_run['base']}' --lora "
                   "--lora-target-modules q_proj,qkv")
    child.expect(r"lora\.target_modules: unknown target module 'qkv'; valid names are q_proj")
    child.expect("Stage 'sft' failed with code 2.")
    child.expect(r"Run another stage\? \[y/N\]: ")
    child.sendline("n")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 2
    assert not list((lora_run["root"] / "checkpoints").glob("sft_lima_*"))    # refused before any write


def test_status_and_report_show_the_adapter(lora_run):
    cfg, name = lora_run["cfg"], lora_run["run"].name
    p = run_stage("status", name, "--config", cfg)
    assert p.returncode == 0, p.stdout + p.stderr
    line, = [ln for ln in p.stdout.splitlines() if ln.strip().startswith("LoRA")]
    assert "r=4, alpha=16.0, on q_proj, v_proj, o_proj, gate_proj, up_proj, down_proj: " in line
    assert "trainable of" in line
    p = run_stage("report", name, "--config", cfg)
    assert p.returncode == 0, p.stdout + p.stderr
    md = (lora_run["root"] / "reports" / name / "report.md").read_text().replace("\\_", "_")   # Markdown escapes
    assert "| LoRA | r=4, alpha=16.0, dropout 0.05, on q_proj" in md
    assert f"{lora_run['run']}/adapter" in md


def test_generation_with_an_unmerged_adapter_goes_through_it():
    """Validation samples of a LoRA run are the adapter model's: the CPU decode pack (a copy
    of W) is not used for a model with an unmerged adapter, so greedy tokens equal the merged
    model's (and not the base's)."""
    from model import ModelArgs, create_model
    from utils import lora
    from utils.generation.engine import generate
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    base = create_model(args).eval()
    adapted = create_model(args)
    adapted.load_state_dict(base.state_dict())
    lora.apply(adapted, lora.LoraSettings(rank=4, alpha=8.0, dropout=0.0))
    for name, p in adapted.named_parameters():
        if ".lora_B." in name:
            torch.nn.init.normal_(p, std=0.5)
    adapted.eval()
    merged = create_model(args).eval()
    merged.load_state_dict(lora.merged(lora.split_state(adapted)[0], lora.checkpoint_entries(adapted)["lora"]))
    run = lambda m: generate(m, [[1, 5, 9, 13]], max_new_tokens=12, temperature=0)[0]   # noqa: E731
    assert run(adapted) == run(merged)
    assert run(base) != run(merged)
