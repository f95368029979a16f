"""A run opens with the tokenizer it was trained with (utils/run.py), whatever config.json names.

The run is trained with the offline SentencePiece sample tokenizer; every later command here
uses a config that sets only where outputs go, so its ``tokenizer.name`` is the shipped
default (the hub's CodeLlama, unreachable offline), as a new user's `python main.py infer`
after `make demo` would. infer, sft train, benchmark, status and the interactive menu must
open the run anyway; a tokenizer that is gone is a clear error naming what it needs and where
it looked. Also: configs/offline.json selects the offline SFT samples.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import ROOT, SAMPLES, SPM_MODEL, offline_env, run_stage, spawn_main, write_config
from utils.config import Config

HUB_DEFAULT = Config().tokenizer.name


@pytest.fixture(scope="module")
def run(tmp_path_factory, train_shards):
    """A tiny pre-trained run and its SFT run, trained with a copy of the sample tokenizer."""
    root = tmp_path_factory.mktemp("runtok")
    tok_dir = root / "mytok"
    tok_dir.mkdir()
    shutil.copy(SPM_MODEL, tok_dir / "tokenizer.model")
    trained = write_config(root, {"tokenizer": {"name": str(tok_dir / "tokenizer.model")},
                                  "dataset": {"wikipedia_test_dir": str(train_shards)},
                                  "sft": {"dataset": "samples"}}, "trained.json")
    p = run_stage("train", "--test", "--config", trained, "--max-steps", "4", "--window", "32",
                 "--eval-steps", "4", "--eval-batches", "1", "--sample-tokens", "0",
                 "--name", "base", "--device", "cpu")
    assert p.returncode == 0, p.stdout + p.stderr
    p = run_stage("sft", "prepare", "--config", trained, "--test")
    assert p.returncode == 0, p.stdout + p.stderr
    plain = write_config(root, {}, "plain.json")          # outputs under root; nothing else
    assert json.loads(plain.read_text()).keys() == {"paths"}
    return {"root": root, "plain": plain, "tok_dir": tok_dir,
            "ckpt": root / "checkpoints" / "base" / "checkpoint_best.pt"}


def _ok(p):
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def test_the_default_config_names_the_hub_tokenizer():
    assert HUB_DEFAULT == "codellama/CodeLlama-7b-hf"


def test_infer_opens_a_run_without_its_config(run):
    out = _ok(run_stage("infer", "--config", run["plain"], "--checkpoint", run["ckpt"],
                       "--prompt", "The history of", "--max-new-tokens", "5", "--seed", "1"))
    assert f"was trained with tokenizer {run['tok_dir'] / 'tokenizer.model'}" in out
    assert out.count("was trained with tokenizer") == 1
    assert "5 tokens in" in out


def test_benchmark_and_status_open_a_run_without_its_config(run):
    out = _ok(run_stage("benchmark", "--config", run["plain"], "--test", "--tasks", "perplexity",
                       run["ckpt"], timeout=600))
    assert "base/checkpoint_best" in out
    out = _ok(run_stage("status", "--config", run["plain"], "base"))
    assert "run base: finished" in out and re.search(r"step\s+4 of 4", out), out


def test_sft_train_and_infer_its_checkpoint_without_the_config(run):
    _ok(run_stage("sft", "train", "--config", run["plain"], "--test", "--checkpoint", run["ckpt"],
                 "--name", "rt", "--max-steps", "2", "--sample-tokens", "0", timeout=600))
    sft_runs = sorted((run["root"] / "checkpoints").glob("sft_rt_*"))
    assert len(sft_runs) == 1
    out = _ok(run_stage("infer", "--config", run["plain"], "--checkpoint",
                       sft_runs[0] / "checkpoint_best.pt", "--prompt", "Why is the sky blue?",
                       "--max-new-tokens", "4", "--seed", "1"))
    assert "was trained with tokenizer" in out


def test_interactive_infer_opens_a_run_without_its_config(run):
    """On a terminal of 160 columns the note on the tokenizer, longer than that, wraps at word
    boundaries to the width (the terminal itself would cut it mid-word)."""
    import pexpect
    env = offline_env(NO_COLOR="1")
    c = spawn_main("infer", "--config", run["plain"], "--checkpoint", run["ckpt"],
                   "--max-new-tokens", "4", env=env, timeout=120, dimensions=(50, 160))
    c.expect(r"infer: note: [\s\S]*?'\)\.")
    lines, words = c.after.splitlines(), " ".join(c.after.split())
    assert words == (f"infer: note: {run['ckpt']} was trained with tokenizer "
                     f"{run['tok_dir'] / 'tokenizer.model'}; using it (the configuration names "
                     f"'{HUB_DEFAULT}').")
    assert len(words) > 160 and len(lines) > 1 and max(map(len, lines)) <= 160, lines
    c.expect("Prompt")
    c.sendline("The history of")
    c.expect("Parameters: 1\\) defaults")
    c.sendline("")
    c.expect("Generated:")
    c.expect(r"tokens/s")
    c.expect("Prompt")
    c.sendline("/quit")
    c.expect(pexpect.EOF)
    c.close()
    assert c.exitstatus == 0 and "Traceback" not in c.before


def test_a_run_folder_copied_elsewhere_opens_with_its_own_tokenizer_copy(run, tmp_path):
    """Each run folder keeps <run>/tokenizer/ (train and sft write it): copied to another
    place without the tokenizer it was trained with, infer, benchmark, sft train and export
    still open it, through that copy (checked by fingerprint). The export's model card says
    what the run was trained on, how far, and its best validation loss."""
    from utils.run import RUN_TOKENIZER_DIR, load_checkpoint
    from utils.data.tok import fingerprint, load_tokenizer_from
    base = run["root"] / "checkpoints" / "base"
    copy = base / RUN_TOKENIZER_DIR
    assert fingerprint(load_tokenizer_from(str(copy))) == load_checkpoint(run["ckpt"])["tokenizer"]["fingerprint"]
    elsewhere = tmp_path / "other_machine"
    shutil.copytree(base, elsewhere / "base")
    cfg = write_config(elsewhere, {}, "c.json")
    moved = run["root"] / "mytok_moved"
    run["tok_dir"].rename(moved)
    try:
        p = run_stage("infer", "--config", cfg, "--checkpoint", str(elsewhere / "base"),
                     "--prompt", "The history of", "--max-new-tokens", "4", "--seed", "1")
        e = run_stage("export", "--config", cfg, "--checkpoint", str(elsewhere / "base"),
                     "--format", "hf", "--out", str(elsewhere / "hf"))
        b = run_stage("benchmark", "--config", cfg, "--test", "--tasks", "perplexity",
                     str(elsewhere / "base"), timeout=600)
        s = run_stage("sft", "train", "--config", cfg, "--test", "--checkpoint",
                     str(elsewhere / "base" / "checkpoint_best.pt"),
                     "--data-dir", str(run["root"] / "data" / "post-training"), "--name", "away",
                     "--max-steps", "1", "--sample-tokens", "0", timeout=600)
    finally:
        moved.rename(run["tok_dir"])
    for r in (p, e, b, s):
        assert str(elsewhere / "base" / RUN_TOKENIZER_DIR) in _ok(r)
    assert (elsewhere / "hf" / "tokenizer.json").is_file()
    assert list((elsewhere / "checkpoints").glob("sft_away_*/checkpoint_latest.pt"))
    ckpt = load_checkpoint(run["ckpt"])
    card = (elsewhere / "hf" / "README.md").read_text()
    assert "- data: wikipedia shards (`" in card and "--test), windows of 32 tokens" in card
    assert "- optimizer steps: 4" in card and f"- tokens seen: {ckpt['tokens_seen']:,}" in card
    assert f"- best validation loss: {ckpt['best_val_loss']:.4f}" in card


def test_a_missing_tokenizer_is_named_with_where_it_looked(run):
    from utils.run import RUN_TOKENIZER_DIR
    moved = run["root"] / "mytok_moved"
    copy = run["ckpt"].parent / RUN_TOKENIZER_DIR
    hidden = run["ckpt"].parent / "tokenizer_hidden"
    run["tok_dir"].rename(moved)
    copy.rename(hidden)
    try:
        p = run_stage("infer", "--config", run["plain"], "--checkpoint", run["ckpt"],
                     "--prompt", "x", "--max-new-tokens", "2")
        e = run_stage("export", "--config", run["plain"], "--checkpoint", run["ckpt"], "--format",
                     "gguf", "--out", run["root"] / "exports" / "nowhere")
    finally:
        moved.rename(run["tok_dir"])
        hidden.rename(copy)
    for r in (p, e):
        out = r.stdout + r.stderr
        assert r.returncode == 1, out
        assert "cannot find the tokenizer this checkpoint was trained with" in out
        assert str(run["tok_dir"] / "tokenizer.model") in out          # where it looked
        assert HUB_DEFAULT in out and "Traceback" not in out
        assert ".;" not in out and ".." not in out.replace("...)", "").replace("(...)", ""), out   # one stop each
    assert not (run["root"] / "exports" / "nowhere").exists()


def test_offline_config_selects_the_offline_sft_samples(tmp_path):
    from utils.config import load_config
    assert load_config(ROOT / "configs" / "offline.json", base_file=None).sft.dataset == "samples"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "samples").symlink_to(SAMPLES)
    cfg = json.loads((ROOT / "configs" / "offline.json").read_text())
    cfg["paths"] = {"root": str(tmp_path)}
    (tmp_path / "offline.json").write_text(json.dumps(cfg))
    _ok(run_stage("sft", "prepare", "--config", tmp_path / "offline.json", "--test"))
    meta = json.loads((tmp_path / "data" / "post-training" / "metadata.json").read_text())
    assert meta["source"]["kind"] == "qa_substitute", meta["source"]


@pytest.mark.parametrize("damage", ["[1, 2]", "[" * 100_000, '{"fingerprint": 1' + "0" * 5000 + "}", "\xff"])
def test_a_damaged_tokenizer_copy_is_written_again(tmp_path, damage):
    """<run>/tokenizer/'s info file as a JSON list, nested too deeply, with a 5,001-digit
    number or not UTF-8: the next save writes the copy again instead of failing."""
    from utils.data.tok import INFO_FILE, fingerprint, load_tokenizer_from
    from utils.run import save_run_tokenizer
    tok = load_tokenizer_from(str(SPM_MODEL))
    target = save_run_tokenizer(tmp_path, tok, str(SPM_MODEL))
    (target / INFO_FILE).write_bytes(damage.encode("latin-1"))
    assert save_run_tokenizer(tmp_path, tok, str(SPM_MODEL)) == target
    assert json.loads((target / INFO_FILE).read_text())["fingerprint"] == fingerprint(tok)
