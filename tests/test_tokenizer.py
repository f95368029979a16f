"""Tokenizer stage: the real Mistral SentencePiece model (a Llama-style SPM tokenizer that
stands in for CodeLlama offline) and a byte-level BPE trained here on the real news sample.

In-process tests cover round trips, special ids, batch encoding and fingerprints; CLI tests
run `python main.py tokenize ...` as a user would (offline, outputs in a tmp root).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import tokenizer as stage
from tests.conftest import NEWS, SPM_MODEL, offline_env, run_main
from utils.cli import UsageError
from utils.config import load_config
from utils.textio import escape_article
from utils.tok import fingerprint, load_tokenizer_from

UNICODE_TEXTS = {
    "accents": "Héllo wörld, café crème, Ångström, naïve façade",
    "cjk": "日本語の文章です。中文句子。한국어 문장",
    "emoji": "😀🚀 family: 👨‍👩‍👧 flags: 🇮🇹",
    "code": "def f(x):\n\tif x:\n        return  x * 2  # double\n\n\treturn None\n",
    "mixed": "Line one\r\nLine two\u00a0with nbsp — and ∑ math ≤ ∞\n\n\nend",
}
BPE_VOCAB = 800


@pytest.fixture(scope="session")
def spm_tok(samples):
    return load_tokenizer_from(str(SPM_MODEL))


def news_docs() -> list[str]:
    return [line.rstrip("\n") for line in NEWS.open(encoding="utf-8") if line.strip()]


@pytest.fixture(scope="session")
def bpe_tok(samples):
    return stage.train_bpe(news_docs(), vocab_size=BPE_VOCAB, min_frequency=2)


@pytest.fixture(params=["spm", "bpe"])
def any_tok(request, spm_tok, bpe_tok):
    return {"spm": spm_tok, "bpe": bpe_tok}[request.param]


# --------------------------------------------------------------------------- in-process
def test_stage_module_does_not_shadow_hf_tokenizers():
    import tokenizers
    from tests.conftest import ROOT
    assert Path(stage.__file__).resolve() == ROOT / "tokenizer.py"
    assert "site-packages" in Path(tokenizers.__file__).parts  # the HF library, not ours
    assert hasattr(tokenizers, "Tokenizer")


@pytest.mark.parametrize("kind", list(UNICODE_TEXTS))
def test_unicode_round_trip(any_tok, kind):
    text = UNICODE_TEXTS[kind]
    ids = stage.encode(any_tok, text)
    assert ids and stage.decode(any_tok, ids) == text
    with_specials = stage.encode(any_tok, text, add_special_tokens=True)
    assert with_specials == [any_tok.bos_token_id, *ids, any_tok.eos_token_id]
    assert stage.decode(any_tok, with_specials, skip_special_tokens=True) == text


def test_bpe_round_trip_keeps_leading_and_trailing_spaces(bpe_tok):
    for text in ["  indented", " x ", "\n\nstarts with newlines", "tab\tend\t"]:
        assert stage.decode(bpe_tok, stage.encode(bpe_tok, text)) == text


def test_special_token_ids(spm_tok, bpe_tok):
    assert len(spm_tok) == 32000
    assert (spm_tok.unk_token_id, spm_tok.bos_token_id, spm_tok.eos_token_id) == (0, 1, 2)
    assert (spm_tok.unk_token, spm_tok.bos_token, spm_tok.eos_token) == ("<unk>", "<s>", "</s>")
    assert len(bpe_tok) == BPE_VOCAB
    assert (bpe_tok.unk_token_id, bpe_tok.bos_token_id, bpe_tok.eos_token_id,
            bpe_tok.pad_token_id) == (0, 1, 2, 3)
    assert bpe_tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<unk>", "<s>", "</s>", "<pad>"]
    # Special tokens are atomic: "<s>" in text encodes to the BOS id, not to pieces of it.
    assert stage.encode(bpe_tok, "<s>") == [1]


def test_batch_encoding_equals_single(any_tok):
    texts = list(UNICODE_TEXTS.values()) + news_docs()[:20] + ["", "a"]
    for specials in (False, True):
        batch = stage.encode_batch(any_tok, texts, add_special_tokens=specials)
        assert batch == [stage.encode(any_tok, t, add_special_tokens=specials) for t in texts]


def test_fingerprint_stable_across_save_reload(any_tok, tmp_path):
    fp = fingerprint(any_tok)
    assert re.fullmatch(r"[0-9a-f]{64}", fp)
    info = stage.save_tokenizer(any_tok, tmp_path / "tok", "test")
    assert info["fingerprint"] == fp
    saved = json.loads((tmp_path / "tok" / stage.INFO_FILE).read_text())
    assert saved["fingerprint"] == fp and saved["vocab_size"] == len(any_tok)
    reloaded = load_tokenizer_from(str(tmp_path / "tok"))
    assert fingerprint(reloaded) == fp
    assert (reloaded.bos_token_id, reloaded.eos_token_id) == (any_tok.bos_token_id,
                                                              any_tok.eos_token_id)
    text = UNICODE_TEXTS["code"]
    assert stage.encode(reloaded, text) == stage.encode(any_tok, text)
    # Saving again over an existing directory keeps the same fingerprint.
    stage.save_tokenizer(reloaded, tmp_path / "tok", "test")
    assert fingerprint(load_tokenizer_from(str(tmp_path / "tok"))) == fp


def test_fingerprint_differs(spm_tok, bpe_tok, tmp_path):
    assert fingerprint(spm_tok) != fingerprint(bpe_tok)
    stage.save_tokenizer(bpe_tok, tmp_path / "copy", "test")
    changed = load_tokenizer_from(str(tmp_path / "copy"))
    changed.add_tokens(["<extra_token>"])
    assert fingerprint(changed) != fingerprint(bpe_tok)
    # Editing the vocabulary in tokenizer.json (swapping the ids of two tokens) changes it too.
    data = json.loads((tmp_path / "copy" / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    a, b = (next(p for p, i in vocab.items() if i == n) for n in (500, 501))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "copy" / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    assert fingerprint(load_tokenizer_from(str(tmp_path / "copy"))) != fingerprint(bpe_tok)


def test_bpe_training_is_deterministic(bpe_tok):
    again = stage.train_bpe(news_docs(), vocab_size=BPE_VOCAB, min_frequency=2)
    assert fingerprint(again) == fingerprint(bpe_tok)
    other = stage.train_bpe(news_docs()[:100], vocab_size=BPE_VOCAB, min_frequency=2)
    assert fingerprint(other) != fingerprint(bpe_tok)


def test_vocab_size_too_small_is_usage_error():
    with pytest.raises(UsageError, match="at least 260"):
        stage.train_bpe(["some text"], vocab_size=100)


def test_parse_ids():
    assert stage.parse_ids("1,2,3") == [1, 2, 3]
    assert stage.parse_ids("[1, 2, 3]", 10) == [1, 2, 3]
    assert stage.parse_ids(" 4 5 ") == [4, 5]
    with pytest.raises(UsageError, match="'x'"):
        stage.parse_ids("1,x")
    with pytest.raises(UsageError, match="out of range"):
        stage.parse_ids("1,10", 10)
    with pytest.raises(UsageError, match="out of range"):
        stage.parse_ids("-1")
    with pytest.raises(UsageError, match="no token ids"):
        stage.parse_ids(" , ")


def test_training_documents_from_cleaned_and_plain_files(tmp_path):
    d = tmp_path / "cleaned"
    d.mkdir()
    articles = ["First article.\n\nSecond paragraph with a \\ backslash.", "Second article."]
    (d / "cleaned_a.txt").write_text("".join(escape_article(a) + "\n" for a in articles),
                                     encoding="utf-8")
    (d / "notes.txt").write_text("ignored when cleaned_*.txt exist\n", encoding="utf-8")
    files = stage.training_files([d])
    assert [f.name for f in files] == ["cleaned_a.txt"]
    assert list(stage.iter_documents(files)) == articles  # unescaped: real paragraph breaks
    plain = tmp_path / "plain.cor"
    plain.write_text("doc one\n\ndoc two\ndoc three\n", encoding="utf-8")
    assert list(stage.iter_documents([plain])) == ["doc one", "doc two", "doc three"]
    assert list(stage.iter_documents([plain], max_documents=2)) == ["doc one", "doc two"]


def test_sample_text_sources(tmp_config, tmp_path, spm_tok):
    cfg = load_config(tmp_config({"tokenizer": {"sample_articles": 5}}))
    texts, label = stage.sample_texts(cfg)
    assert len(texts) == 5 and "news" in label
    cleaned = cfg.path("paths.cleaned_dir")
    cleaned.mkdir(parents=True)
    (cleaned / "cleaned_x.txt").write_text("An article.\nAnother one.\n", encoding="utf-8")
    texts, label = stage.sample_texts(cfg)
    assert texts == ["An article.", "Another one."] and "cleaned articles" in label
    (tmp_path / "sample.txt").write_text("Some sample text.", encoding="utf-8")
    cfg = load_config(tmp_config({"tokenizer": {"sample_text": "sample.txt"}}))
    texts, label = stage.sample_texts(cfg)
    assert texts == ["Some sample text."] and "sample.txt" in label
    cfg = load_config(tmp_config({"paths": {"samples_dir": str(tmp_path / "none")}}))
    (cleaned / "cleaned_x.txt").unlink()
    texts, label = stage.sample_texts(cfg)
    assert texts == [stage.BUILTIN_SAMPLE] and "built-in" in label
    chars, tokens, ratio = stage.compression_ratio(spm_tok, texts)
    assert chars == len(stage.BUILTIN_SAMPLE) and 2.0 < ratio < 8.0


# --------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def saved_spm(samples, tmp_path_factory):
    """`main.py tokenize --config CFG` with tokenizer.name = the SPM model, run once."""
    from tests.conftest import write_config
    root = tmp_path_factory.mktemp("tok_cli")
    cfg = write_config(root, {"tokenizer": {"name": str(SPM_MODEL)}})
    proc = run_main("tokenize", "--config", cfg)
    return root, cfg, proc


def test_cli_save_and_report(saved_spm):
    root, cfg, proc = saved_spm
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert re.search(r"vocab size\s*:\s*32000", out)
    assert re.search(r"BOS\s*:\s*<s> = 1", out) and re.search(r"EOS\s*:\s*</s> = 2", out)
    assert re.search(r"UNK\s*:\s*<unk> = 0", out) and re.search(r"PAD\s*:\s*none", out)
    assert re.search(r"compression\s*:\s*\d+\.\d+ characters per token", out)
    assert "news documents" in out and "round trip  : exact" in out
    d = root / "tokenizers" / "mistral-v1"
    assert (d / "tokenizer.json").exists() and (d / "tokenizer_config.json").exists()
    assert json.loads((d / "resolved_config.json").read_text())["tokenizer"]["name"] == str(SPM_MODEL)
    info = json.loads((d / stage.INFO_FILE).read_text())
    assert info["vocab_size"] == 32000 and (info["bos_id"], info["eos_id"], info["unk_id"]) == (1, 2, 0)
    assert info["fingerprint"] in out and info["source"] == str(SPM_MODEL)
    assert info["fingerprint"] == fingerprint(load_tokenizer_from(str(SPM_MODEL)))


def test_cli_encode_then_decode_with_load(saved_spm):
    root, cfg, _ = saved_spm
    proc = run_main("tokenize", "--config", cfg, "--encode", "Hello world")
    assert proc.returncode == 0, proc.stderr
    assert "BOS/EOS added: no" in proc.stdout
    ids = re.search(r"Token IDs: ([\d,]+)", proc.stdout).group(1)
    assert [int(i) for i in ids.split(",")] == [22557, 1526]
    proc = run_main("tokenize", "--config", cfg, "--load", root / "tokenizers" / "mistral-v1",
                    "--decode", ids)
    assert proc.returncode == 0, proc.stderr
    assert "Text: Hello world\n" in proc.stdout and "--load" in proc.stdout


def test_cli_bad_decode_exits_2(saved_spm):
    _, cfg, _ = saved_spm
    proc = run_main("tokenize", "--config", cfg, "--decode", "1,x")
    assert proc.returncode == 2
    assert "'x'" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_train(samples, tmp_path, tmp_config, bpe_tok):
    cfg = tmp_config()
    proc = run_main("tokenize", "--config", cfg, "--train", "--input", NEWS, "--vocab-size", 600)
    assert proc.returncode == 0, proc.stderr
    d = tmp_path / "tokenizers" / "bpe"
    assert (d / "resolved_config.json").exists()
    assert (d / "tokenizer.json").exists() and (d / stage.INFO_FILE).exists()
    info = json.loads((d / stage.INFO_FILE).read_text())
    assert info["vocab_size"] == 600 and info["training"]["documents"] == 300
    assert (info["unk_id"], info["bos_id"], info["eos_id"], info["pad_id"]) == (0, 1, 2, 3)
    assert re.search(r"vocab size\s*:\s*600", proc.stdout) and "characters per token" in proc.stdout
    assert info["fingerprint"] in proc.stdout
    # Deterministic across processes: the same input and settings as an in-process training.
    same = stage.train_bpe(news_docs(), vocab_size=600, min_frequency=2)
    assert info["fingerprint"] == fingerprint(same)
    tok = load_tokenizer_from(str(d))
    for text in UNICODE_TEXTS.values():
        assert stage.decode(tok, stage.encode(tok, text)) == text


def test_cli_train_without_input_exits_1(samples, tmp_config):
    proc = run_main("tokenize", "--config", tmp_config(), "--train")
    assert proc.returncode == 1
    assert "cleaned_articles" in proc.stderr and "python main.py clean" in proc.stderr
    assert "--input" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_unreachable_hub_name_exits_1(tmp_path, tmp_config):
    hf = tmp_path / "hf_home"
    hf.mkdir()
    cfg = tmp_config({"tokenizer": {"name": "codellama/CodeLlama-7b-hf"}})
    env = offline_env(HF_HOME=hf, HF_HUB_CACHE=hf / "hub", TRANSFORMERS_CACHE=hf / "hub")
    proc = run_main("tokenize", "--config", cfg, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "codellama/CodeLlama-7b-hf" in proc.stderr and "Offline options" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "tokenizers" / "CodeLlama-7b-hf").exists()
