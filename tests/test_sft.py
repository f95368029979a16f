"""SFT: the chat template and loss mask, malformed records, `main.py sft prepare` and
`main.py sft train` (masked loss lowers, mismatches refused, Ctrl-C resumes exactly).

Checkpoints here are tiny models built with model.py and saved with
utils.training.checkpoint.save_checkpoint (the format load_checkpoint reads), with the offline sample
tokenizer (Mistral v1 SentencePiece, 32,000 pieces)."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import (SPM_MODEL, bpe_tokenizer, paused_env, popen_main, run_places, run_stage,
                            spm_tokenizer, wait_for_line, write_config)

TOK_NAME = str(SPM_MODEL)


# --------------------------------------------------------------------------- helpers
def tokenizer():
    """The sample SentencePiece tokenizer, shared by the whole run (conftest.spm_tokenizer)."""
    return spm_tokenizer()


def make_checkpoint(path: Path, *, kind: str = "pretrain", chat_template=None, seed: int = 0,
                    tokenizer_info: dict | None = None, **args) -> Path:
    """A tiny model saved as a weights checkpoint the pipeline loads (utils.training.checkpoint)."""
    import model as model_lib
    from utils.training.checkpoint import save_checkpoint
    from utils.data.tok import describe
    tok = tokenizer()
    a = dict(vocab_size=len(tok), d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
             max_seq_len=256, bos_id=tok.bos_token_id)
    a.update(args)
    margs = model_lib.ModelArgs(**a)
    torch.manual_seed(seed)
    m = model_lib.create_model(margs)
    info = tokenizer_info or describe(tok, TOK_NAME)
    save_checkpoint(path, {"kind": kind, "model": m.state_dict(), "model_args": margs.to_dict(),
                           "tokenizer": info, "chat_template": chat_template, "step": 0})
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory, samples):
    """A tmp root with a config (offline tokenizer), prepared SFT data and a base checkpoint."""
    root = tmp_path_factory.mktemp("sft")
    cfg = write_config(root, {"tokenizer": {"name": TOK_NAME},
                              "logging": {"tensorboard": False, "log_every": 1}})
    r = run_stage("sft", "prepare", "--config", cfg, "--dataset", "samples", "--limit", "48",
                 "--max-length", "96")
    assert r.returncode == 0, r.stderr
    base = make_checkpoint(root / "checkpoints" / "base" / "checkpoint_best.pt")
    return {"root": root, "cfg": cfg, "base": base, "prepare_out": r.stdout}


# Questions ending in whitespace; answers starting with punctuation, digits, non-ASCII, spaces.
TRICKY_TURNS = ["What is 2+2?  ", "!? It is 4.", "And 3+3?\t", "6, i.e. 3+3.", "Ünïcödé?\n",
                "日本語 and é first", "Spaces?", "  two leading spaces", "Ok ", "42"]


# --------------------------------------------------------------------------- template and mask
@pytest.mark.parametrize("kind", ["spm", "bpe"])
def test_each_exchange_is_one_text_and_the_mask_is_exactly_its_answer(kind):
    """Template v2: BOS + one text per exchange + EOS; every exchange's ids begin with exactly
    the prompt infer/serve send for it (encode_prompt), the mask is 0 there and 1 on the rest
    and the EOS, and the masked tokens decode (as the reply is decoded) to exactly the answer."""
    from utils.data import sft
    from utils.generation.detok import TextDecoder
    tok = tokenizer() if kind == "spm" else bpe_tokenizer()
    tpl = sft.default_template()
    assert tpl["name"] == sft.TEMPLATE_V2
    bos, eos = tok.bos_token_id, tok.eos_token_id
    turns = TRICKY_TURNS
    ids, mask = sft.encode_conversation(tok, tpl, turns, bos, eos)
    texts = [f"User: {turns[i]}\nAssistant: {turns[i + 1]}" for i in range(0, len(turns), 2)]
    assert ids == [t for e in sft.encode_plain(tok, texts) for t in [bos, *e, eos]]
    continues, lead = sft.answer_decoding(tpl)
    assert continues and lead == " "
    pos = 0
    for i in range(0, len(turns), 2):
        history = list(zip(turns[:i:2], turns[1:i:2]))
        prompt = sft.encode_prompt(tok, tpl, history, turns[i], bos, eos)
        assert ids[:len(prompt)] == prompt and ids[pos] == bos
        end = ids.index(eos, len(prompt))
        assert mask[pos:len(prompt)] == [0] * (len(prompt) - pos)
        assert mask[len(prompt):end + 1] == [1] * (end + 1 - len(prompt))
        reply = TextDecoder(tok, prompt[-1:], lead)
        streamed = "".join(reply.push(t) for t in ids[len(prompt):end])
        assert reply.text() == turns[i + 1]
        assert streamed + reply.finish() == turns[i + 1]        # as infer and serve stream it
        pos = end + 1
    assert pos == len(ids) == len(mask)


def test_template_v1_of_old_checkpoints_encodes_as_before():
    """Checkpoints trained on format-1 data keep their encoding in infer and serve: the prompt
    (ending with the assistant prefix's space) and the answer as two pieces."""
    from utils.data import sft
    tok = bpe_tokenizer()
    tpl = dict(sft.default_template(), name=sft.TEMPLATE_V1)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    turns = ["What is 2+2?", "It is 4.", "And 3+3?", "It is 6."]
    ids, mask = sft.encode_conversation(tok, tpl, turns, bos, eos)
    enc = sft.encode_plain(tok, ["User: What is 2+2?\nAssistant: ", "It is 4.",
                                 "User: And 3+3?\nAssistant: ", "It is 6."])
    assert ids == [bos] + enc[0] + enc[1] + [eos] + [bos] + enc[2] + enc[3] + [eos]
    assert mask == ([0] * (1 + len(enc[0])) + [1] * (len(enc[1]) + 1)
                    + [0] * (1 + len(enc[2])) + [1] * (len(enc[3]) + 1))
    assert sft.encode_prompt(tok, tpl, [tuple(turns[:2])], "And 3+3?", bos, eos) == ids[:len(ids) - len(enc[3]) - 1]
    assert sft.answer_decoding(tpl) == (False, "")
    assert ids != sft.encode_conversation(tok, sft.default_template(), turns, bos, eos)[0]
    from utils.cli import PipelineError
    with pytest.raises(PipelineError, match="not one this version"):
        sft.encode_prompt(tok, dict(tpl, name="user-assistant-v9"), [], "q", bos, eos)


@pytest.mark.parametrize("kind", ["spm", "bpe"])
def test_an_answer_that_merges_into_the_prompt_is_not_trained_on(kind):
    """With an assistant prefix that ends inside a word, the answer's first characters merge
    into the prompt's last token: no exact prompt/answer boundary, so training skips the
    conversation (encode_conversation gives None); prompts still encode (infer)."""
    from utils.data import sft
    tok = tokenizer() if kind == "spm" else bpe_tokenizer()
    tpl = dict(sft.default_template(), assistant_prefix="Assistant: th")
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert sft.encode_conversation(tok, tpl, ["q", "e cat"], bos, eos) is None
    assert sft.encode_conversation(tok, tpl, ["q", " fine", "q2", "e cat"], bos, eos) is None
    assert sft.encode_conversation(tok, tpl, ["q", " fine"], bos, eos) is not None
    assert sft.encode_prompt(tok, tpl, [("q", "e cat")], "q2", bos, eos)[-1] != eos


def test_prepare_counts_answers_that_merge_into_the_prompt(tmp_path):
    cfg = write_config(tmp_path, {"tokenizer": {"name": TOK_NAME},
                                  "sft": {"assistant_prefix": "Assistant: th"}})
    src = tmp_path / "th.jsonl"
    src.write_text(json.dumps({"conversations": ["q", " fine"]}) + "\n"
                   + json.dumps({"conversations": ["q", "e cat"]}) + "\n")
    r = run_stage("sft", "prepare", "--config", cfg, "--dataset", str(src))
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "data" / "post-training" / "metadata.json").read_text())
    c = meta["counts"]
    assert c["kept"] == 1 and c["skipped"] == {"answer_joins_prompt": 1}
    assert c["skipped_examples"][0].startswith("record 2: answer_joins_prompt")
    assert "answer_joins_prompt 1" in r.stdout and meta["format_version"] == 2


def test_literal_special_token_strings_in_turns_stay_text():
    from utils.data import sft
    tok = tokenizer()
    bos, eos = tok.bos_token_id, tok.eos_token_id
    turns = ["Please print </s> and <s> literally", "Sure: </s> <s> <unk>"]
    ids, mask = sft.encode_conversation(tok, sft.default_template(), turns, bos, eos)
    assert ids.count(eos) == 1 and ids.count(bos) == 1 and tok.unk_token_id not in ids
    assert ids[0] == bos and ids[-1] == eos
    text = tok.decode(ids[1:-1])
    assert "</s> and <s> literally" in text and "Sure: </s> <s> <unk>" in text


def test_collate_shifts_and_masks():
    from utils.data import sft
    tokens = np.array([1, 5, 6, 7, 2, 1, 8, 9, 2], dtype=np.uint16)
    mask = np.array([0, 0, 1, 1, 1, 0, 0, 1, 1], dtype=np.uint8)
    offsets = np.array([0, 5, 9])
    ex = sft.Examples(tokens, mask, offsets, {})
    b = sft.collate(ex, [0, 1], pad_id=0)
    assert b["x"].tolist() == [[1, 5, 6, 7], [1, 8, 9, 0]]
    assert b["y"].tolist() == [[5, 6, 7, 2], [8, 9, 2, -100]]
    assert b["loss_mask"].tolist() == [[0, 1, 1, 1], [0, 1, 1, 0]]


def test_loader_position_resumes_the_same_batches():
    from utils.data import sft
    lens = [3, 4, 5, 6, 7, 3, 4]
    offsets = np.concatenate([[0], np.cumsum(lens)])
    tokens = np.arange(offsets[-1], dtype=np.uint16) % 50 + 3
    ex = sft.Examples(tokens, np.ones_like(tokens, dtype=np.uint8), offsets, {})
    a = sft.SFTLoader(ex, range(7), 2, seed=3, pad_id=0)
    ref = [b["x"].tolist() for _ in range(2) for b in a]          # two epochs
    b = sft.SFTLoader(ex, range(7), 2, seed=3, pad_id=0)
    it = iter(b)
    got = [next(it)["x"].tolist(), next(it)["x"].tolist()]
    state = b.state_dict()
    c = sft.SFTLoader(ex, range(7), 2, seed=3, pad_id=0)
    c.load_state_dict(state)
    got += [x["x"].tolist() for x in c] + [x["x"].tolist() for x in c]
    assert got == ref and len(a) == 4


# --------------------------------------------------------------------------- malformed records
def test_malformed_records_skipped_with_file_line_and_reason(tmp_path):
    from utils.data import sft
    lines = [
        json.dumps({"conversations": ["q1", "a1"]}).encode(),                               # 1 ok
        json.dumps({"conversations": ["q", "a", "q2"]}).encode(),                           # 2 odd
        json.dumps({"conversations": ["q", "   "]}).encode(),                               # 3 whitespace
        json.dumps({"conversations": ["", "a"]}).encode(),                                  # 4 empty
        json.dumps({"conversations": "q a"}).encode(),                                      # 5 not list
        json.dumps({"conversations": ["q", 3]}).encode(),                                   # 6 not str
        json.dumps({"conversations": [{"from": "human", "value": "hq"},
                                      {"from": "gpt", "value": "ha"}]}).encode(),           # 7 sharegpt ok
        json.dumps({"conversations": [{"from": "gpt", "value": "x"},
                                      {"from": "human", "value": "y"}]}).encode(),          # 8 ambiguous
        b'{"conversations": ["broken"',                                                     # 9 bad json
        b'{"conversations": ["caf\xe9", "x"]}',                                             # 10 bad utf-8
        json.dumps({"conversations": ["q3", "a3"]}).encode() + b"\r",                       # 11 crlf ok
        json.dumps({"conversations": ["q", "x" * 5000]}).encode(),                          # 12 too long
        json.dumps(["q", "a"]).encode(),                                                    # 13 not object
        json.dumps({"text": "q"}).encode(),                                                 # 14 no key
        b'{"conversations": ["q", "a"], "n": 1' + b"0" * 5000 + b"}",                       # 15 huge int
        b'{"conversations": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",                     # 16 too deep
    ]
    p = tmp_path / "mixed.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + b"\n".join(lines) + b"\n")
    skips = sft.Skips()
    recs = sft.read_jsonl_records(p, 1000, skips)
    assert [r["conversations"] for r in recs] == [["q1", "a1"], ["hq", "ha"], ["q3", "a3"]]
    assert skips.counts == {"odd_turn_count": 1, "empty_turn": 2, "conversations_not_a_list": 1,
                            "turn_not_a_string": 1, "sharegpt_turns_ambiguous": 1,
                            "invalid_json": 3, "invalid_utf8": 1, "turn_too_long": 1,
                            "not_an_object": 1, "no_conversations_key": 1}
    where = "\n".join(skips.where)
    for line, reason in [(2, "odd_turn_count"), (3, "empty_turn"), (4, "empty_turn"),
                         (5, "conversations_not_a_list"), (6, "turn_not_a_string"),
                         (8, "sharegpt_turns_ambiguous"), (9, "invalid_json"),
                         (10, "invalid_utf8"), (12, "turn_too_long"), (15, "invalid_json"),
                         (16, "invalid_json")]:
        assert f"mixed.jsonl:{line}: {reason}" in where
    assert skips.notes == {"utf8_bom_removed": 1, "sharegpt_dict_turns_to_strings": 1,
                           "crlf_line_ends": 1}


def test_json_array_saved_as_jsonl_is_read_and_said_so(tmp_path):
    from utils.data import sft
    p = tmp_path / "array.jsonl"
    p.write_text(json.dumps([{"conversations": ["q", "a"]}, {"conversations": ["q"]}], indent=1))
    skips = sft.Skips()
    recs = sft.read_jsonl_records(p, 1000, skips)
    assert len(recs) == 1 and skips.notes == {"json_array_read_as_records": 1}
    assert skips.where == ["array.jsonl:[1]: odd_turn_count (1 turns; need user/assistant pairs)"]


def test_prepare_with_no_usable_example_fails_and_writes_nothing(tmp_path):
    cfg = write_config(tmp_path, {"tokenizer": {"name": TOK_NAME}})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversations": ["only a question"]}\n{"conversations": []}\nnot json\n')
    r = run_stage("sft", "prepare", "--config", cfg, "--dataset", str(bad))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert "no usable SFT example" in r.stderr and "bad.jsonl:1: odd_turn_count" in r.stderr
    assert "bad.jsonl:3: invalid_json" in r.stderr
    assert not (tmp_path / "data" / "post-training" / "metadata.json").exists()


def test_prepare_into_a_path_that_is_a_file_names_it_and_keeps_it(tmp_path):
    """--output-dir naming a file (or a folder under one) was an unexpected FileExistsError /
    NotADirectoryError; exit 1 naming the path and what to do, the file untouched."""
    cfg = write_config(tmp_path, {"tokenizer": {"name": TOK_NAME}})
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"conversations": ["What is two plus two?", "Four."]}) + "\n")
    blocker = tmp_path / "a_file"
    blocker.write_text("keep me")
    for out, words in ((blocker, "a file of that name is in the way"),
                       (blocker / "sub", "a part of this path is a file, not a folder")):
        r = run_stage("sft", "prepare", "--config", cfg, "--dataset", str(good), "--output-dir", str(out))
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"cannot use {blocker}" in r.stderr, r.stderr
        assert words in r.stderr and "unexpected" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert blocker.read_text() == "keep me"


def test_default_lima_source_offline_says_what_to_do(tmp_path):
    cfg = write_config(tmp_path, {"tokenizer": {"name": TOK_NAME}})
    r = run_stage("sft", "prepare", "--config", cfg)          # sft.dataset = GAIR/lima (the default)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "GAIR/lima" in r.stderr and "--dataset samples" in r.stderr
    r = run_stage("sft")
    assert r.returncode == 2 and "prepare" in r.stdout + r.stderr


def test_prepare_local_jsonl_copies_source_and_reports_skips(tmp_path):
    cfg = write_config(tmp_path, {"tokenizer": {"name": TOK_NAME}})
    src = tmp_path / "mine.jsonl"
    src.write_text(json.dumps({"conversations": ["Hi </s> there", "Hello!"], "source": "t"}) + "\n"
                   + json.dumps({"conversations": ["q", "a", "q2"]}) + "\n")
    r = run_stage("sft", "prepare", "--config", cfg, "--dataset", str(src))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "data" / "post-training"
    assert (out / "mine.jsonl").read_bytes() == src.read_bytes()
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["counts"]["kept"] == 1 and meta["counts"]["skipped"] == {"odd_turn_count": 1}
    assert meta["counts"]["skipped_examples"] == ["mine.jsonl:2: odd_turn_count (3 turns; need "
                                                  "user/assistant pairs)"]
    assert "mine.jsonl:2: odd_turn_count" in r.stdout
    toks = np.load(out / "tokenized_examples.npy")
    tok = tokenizer()
    assert int((toks == tok.eos_token_id).sum()) == 1      # the literal "</s>" stayed text


def test_prepare_reads_a_local_copy_of_a_hub_dataset(tmp_path):
    """Offline, a dataset saved with save_to_disk (a Dataset, or a DatasetDict's train split)
    stands in for its hub name; a folder without LIMA's column or the split is named."""
    import datasets
    cfg = write_config(tmp_path, {"tokenizer": {"name": TOK_NAME}})
    rows = [{"conversations": ["Why is the sky blue?", "Rayleigh scattering."], "source": "mine"},
            {"conversations": ["2+2?", "4", "and 3+3?", "6"], "source": "mine"}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "lima_copy"))
    r = run_stage("sft", "prepare", "--config", cfg, "--dataset", str(tmp_path / "lima_copy"))
    assert r.returncode == 0, r.stdout + r.stderr
    meta = json.loads((tmp_path / "data" / "post-training" / "metadata.json").read_text())
    assert meta["counts"]["kept"] == 2 and meta["source"]["kind"] == "local_dataset", meta
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "no_train"))
    datasets.Dataset.from_list([{"text": "hi"}]).save_to_disk(str(tmp_path / "no_column"))
    for folder, said in (("no_train", "holds the splits ['test'], not 'train'"), ("no_column", "no 'conversations' column")):
        r = run_stage("sft", "prepare", "--config", cfg, "--dataset", str(tmp_path / folder),
                      "--output-dir", str(tmp_path / "none"))
        assert r.returncode == 1 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "none").exists()


def test_prepare_batch_size_is_tokenizer_calls_and_never_changes_the_data(work, tmp_path):
    """--batch-size N: N conversations per tokenizer call. Prepared with 1 and with 7 (neither
    divides 48) the arrays are byte-identical to the default run's."""
    from utils.data import sft
    ref = work["root"] / "data" / "post-training"
    for n in ("1", "7"):
        out = tmp_path / f"b{n}"
        r = run_stage("sft", "prepare", "--config", work["cfg"], "--dataset", "samples",
                     "--limit", "48", "--max-length", "96", "--batch-size", n, "--output-dir", str(out))
        assert r.returncode == 0, r.stderr
        for name in (sft.TOKENS_FILE, sft.MASK_FILE, sft.OFFSETS_FILE):
            assert (out / name).read_bytes() == (ref / name).read_bytes(), (n, name)
    r = run_stage("sft", "prepare", "--config", work["cfg"], "--dataset", "samples",
                 "--batch-size", "0", "--output-dir", str(tmp_path / "b0"))
    assert r.returncode == 2 and "--batch-size must be at least 1" in r.stderr


# --------------------------------------------------------------------------- prepare (samples)
def test_prepare_samples_layout_counts_and_mask(work):
    from utils.data import sft
    out = work["root"] / "data" / "post-training"
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["complete"] and meta["source"]["kind"] == "qa_substitute"
    assert "SUBSTITUTE for LIMA" in meta["source"]["label"]
    c = meta["counts"]
    assert c["considered"] == 48 and c["kept"] + c["too_long"] == 48 and c["kept"] > 0
    assert f"kept {c['kept']}/48 examples" in work["prepare_out"]
    assert meta["tokenizer"]["fingerprint"] and meta["template"]["user_prefix"] == "User: "
    # the length filter: re-encode the copied records and count what exceeds 96 tokens
    tok = tokenizer()
    recs = [json.loads(l) for l in (out / meta["source"]["copy"]).read_text().splitlines()]
    assert len(recs) == 48
    enc = [sft.encode_conversation(tok, meta["template"], r["conversations"], tok.bos_token_id,
                                   tok.eos_token_id) for r in recs]
    kept = [e for e in enc if len(e[0]) <= 96]
    assert len(kept) == c["kept"] and 48 - len(kept) == c["too_long"]
    ex = sft.load_examples(out)
    assert len(ex) == c["kept"]
    for i, (ids, mask) in enumerate(kept):
        t, m = ex.example(i)
        assert t.tolist() == ids and m.tolist() == mask
    shown = json.loads((out / "example_conversations.json").read_text())
    assert shown[0]["formatted"].startswith("<s> User: ") and shown[0]["trained_on"].endswith("</s>")


# --------------------------------------------------------------------------- train
def _val_losses(root: Path, run: str) -> list[float]:
    recs = [json.loads(l) for l in (root / "logs" / "raw_metrics" / f"{run}.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in recs if r.get("type") == "val"]


def test_train_lowers_masked_val_loss_and_writes_the_run(work):
    root = work["root"]
    r = run_stage("sft", "train", "--config", work["cfg"], "--checkpoint", work["base"],
                 "--epochs", "2", "--batch-size", "4", "--lr", "3e-3", "--name", "t1",
                 "--sample-tokens", "4", timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    runs = sorted((root / "checkpoints").glob("sft_t1_*"))
    assert len(runs) == 1
    run = runs[0]
    names = sorted(p.name for p in run.iterdir())
    assert {"checkpoint_best.pt", "checkpoint_latest.pt", "checkpoint_epoch_1.pt",
            "checkpoint_epoch_2.pt", "sft_config.json"} <= set(names)
    assert not [n for n in names if n.startswith("checkpoint_step_")]
    assert (run / "tokenizer" / "tokenizer.json").is_file()        # the run folder's own copy
    from utils.run import load_checkpoint
    ck = load_checkpoint(run / "checkpoint_best.pt")
    assert ck["kind"] == "sft" and ck["chat_template"]["assistant_prefix"] == "Assistant: "
    conf = json.loads((run / "sft_config.json").read_text())
    assert conf["base_checkpoint"] == str(work["base"]) and conf["hyperparameters"]["lr"] == 3e-3
    vals = _val_losses(root, run.name)
    assert len(vals) >= 3 and vals[-1] < vals[0] - 0.3, vals
    assert "sample @ step" in r.stdout and "Why is the sky blue?" in r.stdout


def test_sft_hyperparameters_are_its_own_and_the_inherited_ones_are_said(work, tmp_path):
    """The sft section's weight decay, betas, clip, warm-up and final lr are what the optimizer
    and the schedule use, whatever the training section says; the settings taken from
    training/logging are printed in one line."""
    import copy
    root = work["root"]
    cfg = json.loads(Path(work["cfg"]).read_text())
    cfg = copy.deepcopy(cfg)
    cfg.setdefault("training", {}).update({"weight_decay": 0.7, "beta2": 0.5, "grad_clip": 9.0,
                                           "warmup_steps": 1000, "min_lr": 1.0, "lr": 1.0})
    cfg.setdefault("sft", {}).update({"weight_decay": 0.03, "beta1": 0.8, "beta2": 0.9,
                                      "grad_clip": 0.5, "warmup_ratio": 0.2, "min_lr_ratio": 0.25})
    path = tmp_path / "sft_own.json"
    path.write_text(json.dumps(cfg))
    r = run_stage("sft", "train", "--config", str(path), "--checkpoint", work["base"],
                 "--epochs", "2", "--batch-size", "2", "--lr", "2e-3", "--name", "own",
                 "--sample-tokens", "0", timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "sft train: from the training section: device" in r.stdout
    assert "early_stopping_patience 0; from logging: log_every 1" in r.stdout
    run = next((root / "checkpoints").glob("sft_own_*"))
    from utils.run import load_checkpoint
    ck = load_checkpoint(run / "checkpoint_latest.pt", "resume")
    groups = ck["optimizer"]["adamw"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.03, 0.0]
    assert all(tuple(g["betas"]) == (0.8, 0.9) for g in groups)
    hyper = json.loads((run / "sft_config.json").read_text())["hyperparameters"]
    total = hyper["total_steps"]
    assert total >= 20 and hyper["warmup_steps"] == int(total * 0.2) and hyper["grad_clip"] == 0.5
    assert hyper["min_lr"] == 2e-3 * 0.25 and hyper["weight_decay"] == 0.03
    recs = [json.loads(l) for l in (root / "logs" / "raw_metrics" / f"{run.name}.jsonl").read_text().splitlines()]
    lrs = [x["lr"] for x in recs if x.get("type") == "train"]
    warm = hyper["warmup_steps"]
    assert lrs[0] == pytest.approx(2e-3 / warm) and lrs[warm - 1] == pytest.approx(2e-3)   # sft's warm-up and lr
    assert min(lrs) >= 2e-3 * 0.25 and lrs[-1] < 2e-3 * 0.4          # decays towards sft's floor
    norms = [x["grad_norm"] for x in recs if x.get("type") == "train"]
    assert norms and all(n is not None for n in norms)


def test_train_refuses_tokenizer_and_architecture_mismatch(work):
    root = work["root"]
    from utils.data.tok import describe
    info = dict(describe(tokenizer(), TOK_NAME), fingerprint="0" * 64, name="other-tokenizer")
    other_tok = make_checkpoint(root / "mm" / "tok.pt", tokenizer_info=info)
    r = run_stage("sft", "train", "--config", work["cfg"], "--checkpoint", other_tok)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "tokenizer mismatch" in r.stderr and "other-tokenizer" in r.stderr
    short = make_checkpoint(root / "mm" / "short.pt", max_seq_len=16)
    r = run_stage("sft", "train", "--config", work["cfg"], "--checkpoint", short)
    assert r.returncode == 1 and "architecture mismatch" in r.stderr and "max_seq_len 16" in r.stderr
    small = make_checkpoint(root / "mm" / "small.pt", vocab_size=1000, bos_id=1)
    r = run_stage("sft", "train", "--config", work["cfg"], "--checkpoint", small)
    assert r.returncode == 1 and "architecture mismatch" in r.stderr and "1000" in r.stderr
    r = run_stage("sft", "train", "--config", work["cfg"])
    assert r.returncode == 2 and "--checkpoint" in r.stderr
    assert not list((root / "checkpoints").glob("sft_lima_*"))


def test_checkpoint_takes_a_run_folder_as_infer_does(work):
    """The README's `sft train --checkpoint checkpoints/exp1 --lora --lr 2e-4` passes a run
    folder, which sft, dpo and rl refused ("is a directory") while infer, export and serve take
    one. Now the folder's best checkpoint is used (utils.run.pick_checkpoint, their rule), said."""
    folder = work["base"].parent
    r = run_stage("sft", "train", "--config", work["cfg"], "--checkpoint", folder, "--lora", "--lr", "2e-4",
                  "--max-steps", "1", "--sample-tokens", "0", "--name", "folder")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"sft: using checkpoint_best.pt of {folder}" in r.stderr
    run, = (work["root"] / "checkpoints").glob("sft_folder_*")
    record = json.loads((run / "sft_config.json").read_text())
    assert record["base"]["path"] == str(work["base"]) and record["base"]["file"] == "checkpoint_best.pt"


def test_one_length_rule_for_sft_and_dpo():
    """sft refused data whose longest example had more tokens than max_seq_len, dpo only when
    it had more than max_seq_len + 1: a model reads all but a sequence's last token. One rule
    now (utils.data.sft.positions_needed), so the same data fits the same model in both."""
    import types
    import dpo
    import post_training
    from utils.cli import PipelineError
    args = types.SimpleNamespace(max_seq_len=64, vocab_size=10_000)
    for longest, fits in ((65, True), (66, False)):
        meta = {"lengths": {"min": 20, "max": longest}, "tokenizer": {}, "template": {"name": "x"}}
        for check in (lambda: post_training.check_compatible({}, Path("m.pt"), meta, Path("d"), args),
                      lambda: dpo.check_fits({}, Path("m.pt"), meta, Path("d"), args)):
            if fits:
                check()
            else:
                with pytest.raises(PipelineError, match=f"{longest} tokens"):
                    check()


def test_dataset_paths_resolve_alike_in_sft_and_dpo(tmp_path, monkeypatch):
    """A relative --dataset resolved against the project root in dpo and against the root, else
    the current folder, in sft; one rule now: the root's when it exists there, else the current
    folder's."""
    from utils.config import load_config
    from utils.data.sft import dataset_path
    (tmp_path / "root").mkdir()
    cfg = load_config(write_config(tmp_path / "root", {}))
    (tmp_path / "root" / "here.jsonl").write_text("")
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd" / "there.jsonl").write_text("")
    monkeypatch.chdir(tmp_path / "cwd")
    assert dataset_path("here.jsonl", cfg.resolve) == tmp_path / "root" / "here.jsonl"
    assert dataset_path("there.jsonl", cfg.resolve) == tmp_path / "cwd" / "there.jsonl"
    assert dataset_path(str(tmp_path / "x.jsonl"), cfg.resolve) == tmp_path / "x.jsonl"


def test_length_mismatch_advice_is_a_valid_max_length_or_says_none_helps(work, tmp_path):
    """Examples longer than the checkpoint's max_seq_len: the message suggested
    `--max-length <max_seq_len>` whatever it was, also below --max-length's minimum (8, a
    configuration error) or below the data's shortest example (prepare then keeps nothing).
    Now a suggested --max-length is always one that prepare takes and that keeps examples, and
    following it makes the data fit; otherwise the message says that no --max-length helps."""
    import re
    from utils.config import SFT_MIN_LENGTH
    root = work["root"]
    lengths = json.loads((root / "data" / "post-training" / "metadata.json").read_text())["lengths"]
    shortest, longest = lengths["min"], lengths["max"]
    assert SFT_MIN_LENGTH < shortest < longest
    fits = (shortest + longest) // 2

    def refused(max_seq_len: int) -> str:
        ck = make_checkpoint(tmp_path / f"ctx{max_seq_len}.pt", max_seq_len=max_seq_len)
        r = run_stage("sft", "train", "--config", work["cfg"], "--checkpoint", ck)
        err = " ".join(r.stderr.split())
        assert r.returncode == 1 and "Traceback" not in err, r.stdout + r.stderr
        assert "architecture mismatch" in err and f"max_seq_len {max_seq_len}" in err, err
        for n in re.findall(r"--max-length (\d+)", err):      # any suggested value is valid
            assert int(n) >= SFT_MIN_LENGTH and int(n) >= shortest, err
        return err

    # a model of max_seq_len M trains on examples of up to M + 1 tokens (it reads all but the last)
    for tiny in (4, SFT_MIN_LENGTH - 2):                       # below --max-length's minimum
        err = refused(tiny)
        assert "No --max-length makes the data fit" in err and f"at least {SFT_MIN_LENGTH}" in err
    err = refused(shortest - 2)                                  # nothing would be kept
    assert "No --max-length makes this data fit" in err and f"shortest example has {shortest}" in err
    err = refused(fits)
    assert f"sft prepare --max-length {fits + 1}`" in err
    out = tmp_path / "refit"                                     # following it: the data fits
    r = run_stage("sft", "prepare", "--config", work["cfg"], "--dataset", "samples", "--limit", "48",
                 "--max-length", str(fits + 1), "--output-dir", out)
    assert r.returncode == 0, r.stderr
    ck = make_checkpoint(tmp_path / "fits.pt", max_seq_len=fits)
    r = run_stage("sft", "train", "--config", work["cfg"], "--checkpoint", ck, "--data-dir", out,
                 "--name", "refit", "--max-steps", "1", "--sample-tokens", "0", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert list((root / "checkpoints").glob("sft_refit_*"))


def test_prepare_with_only_too_long_examples_names_a_length_that_keeps_one(tmp_path):
    """Every example longer than --max-length: the message says how far to raise it (the
    shortest one's length: a valid --max-length, above the minimum) and nothing is written."""
    cfg = write_config(tmp_path, {"tokenizer": {"name": TOK_NAME}})
    src = tmp_path / "long.jsonl"
    src.write_text(json.dumps({"conversations": ["Why is the sky blue? " * 4, "Rayleigh scattering. " * 4]})
                   + "\n" + json.dumps({"conversations": ["Why? " * 30, "Because. " * 30]}) + "\n")
    r = run_stage("sft", "prepare", "--config", cfg, "--dataset", str(src), "--max-length", "8")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    import re
    m = re.search(r"raise --max-length \(the shortest example that is too long has (\d+) tokens\)",
                  " ".join(r.stderr.split()))
    assert m and int(m.group(1)) > 8, r.stderr
    assert not (tmp_path / "data" / "post-training" / "metadata.json").exists()
    r = run_stage("sft", "prepare", "--config", cfg, "--dataset", str(src), "--max-length", m.group(1))
    assert r.returncode == 0 and "kept 1/2 examples" in r.stdout, r.stdout + r.stderr


def test_a_refused_resume_leaves_the_run_as_it_was(work):
    """A resume refused by the checkpoint's training state had already rewritten the run's
    sft_config.json and tokenizer copy and appended a config record to its log. Now the run
    folder and the logs are exactly as they were."""
    root = work["root"]
    r = run_stage("sft", "train", "--config", work["cfg"], "--checkpoint", work["base"], "--epochs", "1",
                 "--batch-size", "4", "--sample-tokens", "0", "--name", "refused", timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    run = next((root / "checkpoints").glob("sft_refused_*"))
    from utils.run import load_checkpoint
    from utils.training.checkpoint import save_checkpoint
    ck = load_checkpoint(run / "checkpoint_latest.pt", "resume")
    save_checkpoint(run / "checkpoint_latest.pt", dict(ck, rng={"world_size": 1, "ranks": "x"}))
    before = run_places(root)
    assert (run / "sft_config.json").is_file() and f"logs/raw_metrics/{run.name}.jsonl" in before
    r = run_stage("sft", "train", "--config", work["cfg"], "--resume", str(run / "checkpoint_latest.pt"),
                 "--sample-tokens", "0", timeout=400)
    assert r.returncode == 1 and "training state is damaged" in r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert run_places(root) == before


def test_format_1_data_is_refused_with_the_command_that_rebuilds_it(work, tmp_path):
    """SFT data prepared before format 2 (template v1) is not trained on: the message names
    the command that rebuilds it; nothing starts."""
    import shutil
    old = tmp_path / "old"
    shutil.copytree(work["root"] / "data" / "post-training", old)
    meta = json.loads((old / "metadata.json").read_text())
    meta.update(format_version=1, template=dict(meta["template"], name="user-assistant-v1"))
    (old / "metadata.json").write_text(json.dumps(meta))
    r = run_stage("sft", "train", "--config", work["cfg"], "--checkpoint", work["base"],
                 "--data-dir", str(old), "--name", "old")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "SFT data format 1" in r.stderr and "`python main.py sft prepare`" in r.stderr
    assert not list((work["root"] / "checkpoints").glob("sft_old_*"))


def test_ctrl_c_saves_and_resume_matches_an_uninterrupted_run(work):
    root = work["root"]
    common = ["--config", work["cfg"], "--checkpoint", work["base"], "--epochs", "4",
              "--batch-size", "4", "--lr", "3e-3", "--sample-tokens", "0"]
    ref = run_stage("sft", "train", *common, "--name", "ref", timeout=400)
    assert ref.returncode == 0, ref.stderr
    proc = popen_main("sft", "train", *common, "--name", "cut", env=paused_env(2))
    wait_for_line(proc, "paused after step 2")          # the signal lands after step 2
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, out + err
    assert "resume with:" in err and "Traceback" not in err
    cmd = err.split("resume with:")[1].strip().splitlines()[0]
    assert cmd.startswith("python main.py sft train ") and "--resume" in cmd
    import shlex
    args = shlex.split(cmd)[2:]
    # a run cannot change its chat template midway: this one as if trained on format-1 data
    from utils.run import load_checkpoint
    from utils.training.checkpoint import save_checkpoint
    cut = load_checkpoint(next((root / "checkpoints").glob("sft_cut_*")) / "checkpoint_latest.pt",
                          "resume")
    v1 = root / "checkpoints" / "sft_v1_2020_01_01_00_00_00" / "checkpoint_latest.pt"
    save_checkpoint(v1, dict(cut, chat_template=dict(cut["chat_template"], name="user-assistant-v1")))
    r = run_stage("sft", "train", "--config", work["cfg"], "--resume", str(v1))
    assert r.returncode == 1 and "cannot change its template midway" in r.stderr, r.stderr
    r = run_stage(*args, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    a = load_checkpoint(next((root / "checkpoints").glob("sft_ref_*")) / "checkpoint_latest.pt")
    b = load_checkpoint(next((root / "checkpoints").glob("sft_cut_*")) / "checkpoint_latest.pt")
    assert a["step"] == b["step"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_prepare_reads_lone_surrogates_as_replacement_characters(tmp_path):
    """A turn or source holding a lone surrogate (a JSON "\\ud800" escape) crashed prepare
    writing its JSON files; it is text: U+FFFD, counted under converted."""
    cfg = write_config(tmp_path, {"tokenizer": {"name": TOK_NAME}})
    src = tmp_path / "sur.jsonl"
    src.write_text(json.dumps({"conversations": ["What is \ud800 this?", "A \udfff thing."],
                               "source": "odd \udc80"}) + "\n"
                   + json.dumps({"conversations": ["q", "a"]}) + "\n", encoding="ascii")
    r = run_stage("sft", "prepare", "--config", cfg, "--dataset", str(src))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "lone_surrogates_replaced (3)" in r.stdout
    out = tmp_path / "data" / "post-training"
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["counts"]["kept"] == 2
    tok = tokenizer()
    text = tok.decode(np.load(out / "tokenized_examples.npy").tolist())
    assert "What is \ufffd this?" in text and "A \ufffd thing." in text
