"""Tokenizer stage: the real Mistral SentencePiece model (a Llama-style SPM tokenizer that
stands in for CodeLlama offline) and a byte-level BPE trained here on the real news sample.

In-process tests cover exactness against the ``sentencepiece`` library (ids and decoding on
every news document and on tricky strings), special-token strings in text (ordinary text;
only framing adds BOS/EOS), round trips, special ids, batch encoding and fingerprints
(honest: they change with the encoding, so shards of the old conversion are stale); CLI tests
run `python main.py tokenize ...` as a user would (offline, outputs in a tmp root).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

import tokenizer as stage
from tests.conftest import NEWS, SPM_MODEL, offline_env, run_main, run_stage
from utils.cli import UsageError
from utils.config import load_config
from utils.data.textio import escape_article
from utils.data import tok as tok_lib
from utils.data.tok import describe, encode_plain, fingerprint, load_tokenizer_from

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
    # "<s>" in text is ordinary text: pieces of its three characters, never the BOS id.
    assert 1 not in stage.encode(bpe_tok, "<s>")
    assert stage.decode(bpe_tok, stage.encode(bpe_tok, "<s>")) == "<s>"


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
    saved = json.loads((tmp_path / "tok" / tok_lib.INFO_FILE).read_text())
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


def test_bpe_with_split_digits_makes_every_digit_a_token(tmp_path, bpe_tok):
    """``split_digits`` (the passkey study's tokenizer): a number is one token per digit, even
    when the plain BPE merges it, and text still round-trips, after a save and load too."""
    from utils.data.tok import save_tokenizer
    text = "In 1999 the 71432 key cost $2,500.75 (about 10 %)."
    merged = bpe_tok.encode(text, add_special_tokens=False)
    assert any(sum(c.isdigit() for c in bpe_tok.decode([i])) > 1 for i in merged)
    split = stage.train_bpe(news_docs(), vocab_size=BPE_VOCAB, split_digits=True)
    save_tokenizer(split, tmp_path / "split", "test")
    for tok in (split, load_tokenizer_from(str(tmp_path / "split"))):
        ids = tok.encode(text, add_special_tokens=False)
        pieces = [tok.decode([i]) for i in ids]
        assert all(sum(c.isdigit() for c in p) <= 1 for p in pieces)
        assert sum(p.isdigit() for p in pieces) == sum(c.isdigit() for c in text)
        assert tok.decode(ids) == text


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


# --------------------------------------------------------------------------- exact SentencePiece
TRICKY = [
    "", " ", "  ", "x", " x", "  x", "    x", "x ", "x  ", "a  b", "a   b", "a \t b",
    "\tx", "\t\tx\t", "x\ny", "\n", "\n\nx\n\n", " \n ", "a\r\nb", "日本語の文章です。",
    "中文 句子", " 한국어", "😀", "👨‍👩‍👧 🇮🇹", "\u00a0", "a\u00a0b", "\u00a0 x",
    "\u0301", " \u0301", "a\u0301\u0308", "\u0301x", "\u200b", "ﬁ ① Ⅳ ｆｕｌｌ",
    "price: 1,000,000.50 $", "  leading, double  and trailing  ", "\x00\x01", "\ufffd",
]


@pytest.fixture(scope="module")
def sp(samples):
    import sentencepiece
    return sentencepiece.SentencePieceProcessor(model_file=str(SPM_MODEL))


def test_spm_ids_equal_sentencepiece_on_every_news_document(spm_tok, sp):
    docs = news_docs()
    assert len(docs) == 300
    ours = encode_plain(spm_tok, docs)
    differing = [i for i, (d, ids) in enumerate(zip(docs, ours)) if ids != sp.encode(d)]
    assert differing == []
    assert [stage.decode(spm_tok, ids) for ids in ours] == [sp.decode(ids) for ids in ours]
    # The transformers call path (tok(...)) gives the same ids.
    assert spm_tok(docs[:20], add_special_tokens=False)["input_ids"] == ours[:20]


@pytest.mark.parametrize("text", TRICKY, ids=[repr(t) for t in TRICKY])
def test_spm_tricky_strings_equal_sentencepiece(spm_tok, sp, text):
    ids = stage.encode(spm_tok, text)
    assert ids == sp.encode(text)
    assert stage.decode(spm_tok, ids) == sp.decode(ids)


def test_spm_leading_spaces_are_kept(spm_tok, sp):
    assert stage.encode(spm_tok, " x") != stage.encode(spm_tok, "x")
    for n in range(1, 6):
        text = " " * n + "x"
        assert stage.decode(spm_tok, stage.encode(spm_tok, text)) == text == sp.decode(sp.encode(text))


def old_conversion():
    """The conversion the pipeline used before utils/data/spm.py (transformers' LlamaTokenizer)."""
    import shutil
    import tempfile

    from transformers import LlamaTokenizer
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(SPM_MODEL, Path(tmp) / "tokenizer.model")
        return LlamaTokenizer.from_pretrained(tmp)


def test_fingerprint_changes_with_the_exact_conversion(spm_tok, sp, tmp_path):
    from utils.data.shards import ShardSetError, validate_metadata
    old = old_conversion()
    # The old conversion really is inexact (that is why the fingerprint must change) ...
    assert any(old.encode(t, add_special_tokens=False) != sp.encode(t) for t in TRICKY)
    # ... and a shard set recorded with it is stale for the exact one.
    assert fingerprint(old) != fingerprint(spm_tok)
    meta = {"tokenizer": describe(old, str(SPM_MODEL))}
    with pytest.raises(ShardSetError, match="stale shard set: tokenizer.fingerprint"):
        validate_metadata(meta, tmp_path, tokenizer_info=describe(spm_tok, str(SPM_MODEL)))


def test_fingerprint_depends_on_the_ids_not_only_the_files(bpe_tok, monkeypatch):
    """Same serialization, different ids on the probe strings -> different fingerprint (what a
    change of the tokenizers library's behaviour would look like)."""
    fp = fingerprint(bpe_tok)
    real = tok_lib.encode_plain

    def shifted(tok, texts):
        return [[i + 1 for i in ids] for ids in real(tok, texts)]
    monkeypatch.setattr(tok_lib, "encode_plain", shifted)
    assert fingerprint(bpe_tok) != fp
    monkeypatch.setattr(tok_lib, "encode_plain", real)
    assert fingerprint(bpe_tok) == fp
    # Every probe string the fingerprint encodes is covered by FINGERPRINT_PROBES.
    assert any("  " in p for p in tok_lib.FINGERPRINT_PROBES)
    assert any("<s>" in p for p in tok_lib.FINGERPRINT_PROBES)


# --------------------------------------------------------------------------- special-token strings
def special_strings(tok) -> list[str]:
    """Every special-token string the tokenizer knows (its added vocabulary included)."""
    added = [t.content for t in tok.backend_tokenizer.get_added_tokens_decoder().values()]
    return sorted(set(tok.all_special_tokens) | set(added) | {"<s>", "</s>", "<unk>"})


def injected(tok) -> list[str]:
    out = []
    for s in special_strings(tok):
        out += [s, f"{s}", f"text {s} more", f"end of text{s}", f"{s}{s}x{s}", f" {s} "]
    return out + ["Article one ends here.</s><s>Article two starts here.",
                  "<s>[INST] hi [/INST]</s>", "<</s>>", "<s </s"]


def test_special_token_strings_in_text_are_ordinary_text(any_tok):
    specials = set(any_tok.all_special_ids)
    texts = injected(any_tok)
    for enc in (encode_plain(any_tok, texts), stage.encode_batch(any_tok, texts),
                any_tok(texts, add_special_tokens=False)["input_ids"]):
        for text, ids in zip(texts, enc):
            assert not specials & set(ids), (text, ids)
            assert stage.decode(any_tok, ids) == text


def test_spm_special_strings_equal_sentencepiece(spm_tok, sp):
    texts = injected(spm_tok)
    assert encode_plain(spm_tok, texts) == [sp.encode(t) for t in texts]


def test_only_framing_adds_bos_and_eos(any_tok):
    import numpy as np

    from utils.data.packing import encode_frame
    bos, eos = any_tok.bos_token_id, any_tok.eos_token_id
    texts = injected(any_tok)
    for text in texts:
        ids = stage.encode(any_tok, text, add_special_tokens=True)
        assert ids[0] == bos and ids[-1] == eos
        assert bos not in ids[1:-1] and eos not in ids[1:-1]
    # The shard framing (utils.data.packing, in-process path) on a tokenizer loaded by the pipeline.
    framed, kept, lengths = encode_frame(any_tok.backend_tokenizer, texts, np.dtype(np.int64),
                                         bos, eos)
    assert kept.all()
    assert int((framed == bos).sum()) == len(texts) == int((framed == eos).sum())
    assert framed.tolist() == [i for t in texts for i in stage.encode(any_tok, t, True)]


def test_loaded_saved_copy_is_plain(any_tok, tmp_path):
    stage.save_tokenizer(any_tok, tmp_path / "tok", "test")
    tok = load_tokenizer_from(str(tmp_path / "tok"))
    text = "a</s>b<s>c<unk>"
    assert tok(text, add_special_tokens=False)["input_ids"] == encode_plain(any_tok, [text])[0]
    assert not set(tok.all_special_ids) & set(encode_plain(tok, [text])[0])


def test_bpe_trained_on_special_strings_stays_plain():
    docs = ["<s>hello</s> <pad><unk> </s></s><s>"] * 50 + news_docs()[:50]
    tok = stage.train_bpe(docs, vocab_size=400, min_frequency=2)
    assert tok_lib.special_merges(tok) == []
    ids = encode_plain(tok, docs[:1])[0]
    assert not set(tok.all_special_ids) & set(ids)
    assert stage.decode(tok, ids) == docs[0]


def test_special_merges_found(spm_tok, bpe_tok):
    """special_merges sees merges that would rebuild a special string (here planted)."""
    from tokenizers import Tokenizer
    assert tok_lib.special_merges(spm_tok) == [] == tok_lib.special_merges(bpe_tok)
    data = json.loads(bpe_tok.backend_tokenizer.to_str())
    model = data["model"]
    model["vocab"]["<s"] = len(model["vocab"])
    as_list = isinstance(model["merges"][0], list)
    model["merges"] += [["<", "s"], ["<s", ">"]] if as_list else ["< s", "<s >"]
    planted = Tokenizer.from_str(json.dumps(data))
    assert tok_lib.special_merges(planted) == [("<s", ">")]


def test_unsupported_spm_model_falls_back_with_notice(tmp_path, capsys):
    """A model utils.data.spm cannot convert exactly (here: user-defined pieces) still loads, through
    transformers' conversion, and says so."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    proto = pb.ModelProto()
    proto.ParseFromString(SPM_MODEL.read_bytes())
    piece = proto.pieces.add()
    piece.piece, piece.score, piece.type = "<extra>", 0.0, 4   # USER_DEFINED
    path = tmp_path / "udp" / "tokenizer.model"
    path.parent.mkdir()
    path.write_bytes(proto.SerializeToString())
    tok = load_tokenizer_from(str(path))
    assert "no exact fast conversion" in capsys.readouterr().err
    assert len(tok) == 32001 and tok.bos_token_id == 1


def test_bad_spm_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(b"this is not a sentencepiece model")
    with pytest.raises(stage.PipelineError, match=str(bad)):
        load_tokenizer_from(str(bad))


# --------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def saved_spm(samples, tmp_path_factory):
    """`main.py tokenize --config CFG` with tokenizer.name = the SPM model, run once."""
    from tests.conftest import write_config
    root = tmp_path_factory.mktemp("tok_cli")
    cfg = write_config(root, {"tokenizer": {"name": str(SPM_MODEL)}})
    proc = run_stage("tokenize", "--config", cfg)
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
    assert "ids exactly as the sentencepiece library" in out
    d = root / "tokenizers" / "mistral-v1"
    assert (d / "tokenizer.json").exists() and (d / "tokenizer_config.json").exists()
    assert json.loads((d / "resolved_config.json").read_text())["tokenizer"]["name"] == str(SPM_MODEL)
    info = json.loads((d / tok_lib.INFO_FILE).read_text())
    assert info["vocab_size"] == 32000 and (info["bos_id"], info["eos_id"], info["unk_id"]) == (1, 2, 0)
    assert info["fingerprint"] in out and info["source"] == str(SPM_MODEL)
    assert info["fingerprint"] == fingerprint(load_tokenizer_from(str(SPM_MODEL)))


def test_cli_encode_then_decode_with_load(saved_spm):
    root, cfg, _ = saved_spm
    proc = run_stage("tokenize", "--config", cfg, "--encode", "Hello world")
    assert proc.returncode == 0, proc.stderr
    assert "BOS/EOS added: no" in proc.stdout
    ids = re.search(r"Token IDs: ([\d,]+)", proc.stdout).group(1)
    assert [int(i) for i in ids.split(",")] == [22557, 1526]
    proc = run_stage("tokenize", "--config", cfg, "--load", root / "tokenizers" / "mistral-v1",
                    "--decode", ids)
    assert proc.returncode == 0, proc.stderr
    assert "Text: Hello world\n" in proc.stdout and "--load" in proc.stdout


def test_cli_bad_decode_exits_2(saved_spm):
    _, cfg, _ = saved_spm
    proc = run_stage("tokenize", "--config", cfg, "--decode", "1,x")
    assert proc.returncode == 2
    assert "'x'" in proc.stderr and "Traceback" not in proc.stderr
    for ids, why in (("1,,2", "is empty"), ("\u0663", "not an integer"), ("1_0", "not an integer")):
        proc = run_stage("tokenize", "--config", cfg, "--decode", ids)     # int() took "٣" and "1_0"
        assert proc.returncode == 2 and why in proc.stderr, proc.stderr


def test_cli_save_never_replaces_a_folder_it_did_not_write(saved_spm, samples, tmp_path):
    """`tokenize --save-dir DIR` and `--train --output DIR` replaced DIR whatever it held
    (`--save-dir .` in a source checkout deleted the checkout, exit 0). A folder holding other
    files, a file, or a folder of tokenizer files without our info file is refused with exit 1,
    untouched; an earlier save is replaced as before."""
    root, cfg, _ = saved_spm
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("keep me")
    hf = tmp_path / "hf_download"
    hf.mkdir()
    (hf / "tokenizer.json").write_text("{}")
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me too")
    for target, why in ((mine, "it holds notes.txt, sub"), (hf, "no pipeline_tokenizer.json"),
                        (a_file, "not a folder")):
        before = sorted((p.relative_to(tmp_path), p.read_bytes() if p.is_file() else None)
                        for p in [target, *target.rglob("*")])
        for args in (["--save-dir", target], ["--train", "--input", NEWS, "--vocab-size", 300, "--output", target]):
            proc = run_stage("tokenize", "--config", cfg, *args)
            assert proc.returncode == 1, proc.stderr
            assert str(target) in proc.stderr and why in proc.stderr and "Nothing was changed" in proc.stderr
            assert "Traceback" not in proc.stderr
            assert sorted((p.relative_to(tmp_path), p.read_bytes() if p.is_file() else None)
                          for p in [target, *target.rglob("*")]) == before
    proc = run_stage("tokenize", "--config", cfg, "--save-dir", ".", cwd=mine)
    assert proc.returncode == 1 and (mine / "notes.txt").read_text() == "keep me"
    again = run_stage("tokenize", "--config", cfg)                 # over its own earlier save
    assert again.returncode == 0, again.stderr
    assert (root / "tokenizers" / "mistral-v1" / tok_lib.INFO_FILE).is_file()


def test_cli_train(samples, tmp_path, tmp_config, bpe_tok):
    cfg = tmp_config()
    proc = run_stage("tokenize", "--config", cfg, "--train", "--input", NEWS, "--vocab-size", 600)
    assert proc.returncode == 0, proc.stderr
    d = tmp_path / "tokenizers" / "bpe"
    assert (d / "resolved_config.json").exists()
    assert (d / "tokenizer.json").exists() and (d / tok_lib.INFO_FILE).exists()
    info = json.loads((d / tok_lib.INFO_FILE).read_text())
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


def test_cli_text_that_is_not_utf8_is_named_with_its_line(saved_spm, tmp_path, tmp_config):
    """--encode-file and --train on a file whose second line is not UTF-8: exit 1 naming the
    file and line, no traceback, no tokenizer written."""
    _, cfg, _ = saved_spm
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("a first line of ordinary text\nthe café\n".encode("latin-1"))
    proc = run_stage("tokenize", "--config", cfg, "--encode-file", bad)
    assert proc.returncode == 1 and f"{bad}, line 2: not UTF-8 text (byte 0xe9" in proc.stderr, proc.stderr
    out = tmp_path / "tok_out"
    proc = run_stage("tokenize", "--config", tmp_config(), "--train", "--input", bad, "--output", out,
                    "--vocab-size", 300)
    assert proc.returncode == 1 and f"{bad}:2: not UTF-8 text (byte 0xe9" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
    cleaned = tmp_path / "cleaned_latin1.txt"                # the cleaner's format: the same reader
    cleaned.write_bytes(bad.read_bytes())
    proc = run_stage("tokenize", "--config", tmp_config(), "--train", "--input", cleaned, "--output", out,
                    "--vocab-size", 300)
    assert proc.returncode == 1 and f"{cleaned}:2: not UTF-8 text (byte 0xe9" in proc.stderr, proc.stderr
    assert "python main.py clean" in proc.stderr and "unexpected" not in proc.stderr and not out.exists()


def test_cli_train_without_input_exits_1(samples, tmp_config):
    proc = run_stage("tokenize", "--config", tmp_config(), "--train")
    assert proc.returncode == 1
    assert "cleaned_articles" in proc.stderr and "python main.py clean" in proc.stderr
    assert "--input" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_train_refuses_a_huge_vocab_a_path_as_name_and_text_that_is_not_utf8(samples, tmp_path, tmp_config):
    """Refused before anything runs or is written (exit 2, naming the flag or key): a vocab
    size over 2^20 (2^31 made the Rust trainer abort the process on a 141 GB allocation), a
    --train-name that is a path ("../../x" wrote outside tokenizers/), and --encode text whose
    bytes are not UTF-8 (it was encoded as U+FFFD pieces, where --encode-file refuses them)."""
    cfg = tmp_config()
    out = tmp_path / "out"
    proc = run_stage("tokenize", "--config", cfg, "--train", "--input", NEWS, "--vocab-size", 2 ** 31,
                    "--output", out)
    assert proc.returncode == 2 and "tokenizer.train_vocab_size" in proc.stderr, proc.stderr
    assert "must be <= 1048576" in proc.stderr and not out.exists()
    escape = tmp_path / "a" / "b"
    escape.mkdir(parents=True)
    proc = run_stage("tokenize", "--config", cfg, "--train", "--input", NEWS, "--vocab-size", 300,
                    "--train-name", "../../escaped", cwd=escape)
    assert proc.returncode == 2 and "tokenizer.train_name" in proc.stderr, proc.stderr
    assert "not a folder name" in proc.stderr and not any(tmp_path.rglob("escaped"))
    r = run_stage("tokenize", "--config", cfg, "--encode", b"ab\xff\xfe".decode("utf-8", "surrogateescape"))
    assert r.returncode == 2 and "argument --encode: holds bytes that are not UTF-8 text (at character 3)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


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


def test_cli_encode_special_string_is_text(saved_spm, sp):
    _, cfg, _ = saved_spm
    text = "end</s><s>start <unk>"
    proc = run_stage("tokenize", "--config", cfg, "--encode", text, "--plain",
                    "--add-special-tokens")
    assert proc.returncode == 0, proc.stderr
    assert [int(i) for i in proc.stdout.strip().split(",")] == [1, *sp.encode(text), 2]


def test_cli_saved_copy_of_the_old_conversion_is_refused_then_resaved(samples, tmp_path,
                                                                      tmp_config, sp):
    cfg = tmp_config({"tokenizer": {"name": str(SPM_MODEL)}})
    saved = tmp_path / "tokenizers" / "mistral-v1"
    old = old_conversion()
    old.save_pretrained(str(saved))    # what `tokenize` saved before utils/data/spm.py
    (saved / tok_lib.INFO_FILE).write_text(json.dumps({
        "format": "pipeline-tokenizer", "version": 1, "source": str(SPM_MODEL),
        "kind": "SentencePiece model, converted to a fast tokenizer",
        **describe(old, str(SPM_MODEL))}), encoding="utf-8")
    proc = run_stage("tokenize", "--config", cfg, "--encode", " x")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert str(saved) in proc.stderr and "older conversion" in proc.stderr
    assert "python main.py tokenize" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_stage("tokenize", "--config", cfg)      # re-save from the .model
    assert proc.returncode == 0, proc.stderr
    info = json.loads((saved / tok_lib.INFO_FILE).read_text())
    assert info["conversion"] == tok_lib.SPM_CONVERSION
    resaved = load_tokenizer_from(str(saved))
    assert stage.encode(resaved, " x") == sp.encode(" x") != old.encode(" x", add_special_tokens=False)


# --------------------------------------------------------------------------- damaged files
def _edit_json(path: Path, **changes) -> bytes:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(changes)
    return json.dumps(data).encode()


# (file, how it is damaged) -> new bytes from the good file's path; what the message must say.
DAMAGE = {
    "tokenizer.json-garbage": ("tokenizer.json", lambda p: b"not json {", "not valid JSON"),
    "tokenizer.json-truncated": ("tokenizer.json", lambda p: p.read_bytes()[:5000], "looks truncated"),
    "tokenizer.json-empty": ("tokenizer.json", lambda p: b"", "is empty"),
    "tokenizer.json-array": ("tokenizer.json", lambda p: b"[1, 2]", "JSON array, not an object"),
    "tokenizer.json-not-utf8": ("tokenizer.json", lambda p: b'{"a": "\xff"}', "not UTF-8"),
    "tokenizer.json-unknown-model": ("tokenizer.json", lambda p: _edit_json(p, model={"type": "Nope"}),
                                     "tokenizers library can read"),
    "tokenizer.model-garbage": ("tokenizer.model", lambda p: bytes(range(256)) * 12,
                                "not a SentencePiece model"),
    "tokenizer.model-truncated": ("tokenizer.model", lambda p: p.read_bytes()[:100_000],
                                  "not a SentencePiece model"),
    "tokenizer_config.json-garbage": ("tokenizer_config.json", lambda p: b"{bad", "not valid JSON"),
    "tokenizer_config.json-array": ("tokenizer_config.json", lambda p: b"[1]", "JSON array"),
    "tokenizer_config.json-bos-number": ("tokenizer_config.json", lambda p: _edit_json(p, bos_token=5),
                                         "'bos_token' = number"),
    "tokenizer_config.json-max-length-string": ("tokenizer_config.json",
                                                lambda p: _edit_json(p, model_max_length="big"),
                                                "'model_max_length' = string"),
    "tokenizer_config.json-added-tokens-list": ("tokenizer_config.json",
                                                lambda p: _edit_json(p, added_tokens_decoder=[1]),
                                                "'added_tokens_decoder' = array"),
    "special_tokens_map.json-garbage": ("special_tokens_map.json", lambda p: b"{bad", "not valid JSON"),
    "special_tokens_map.json-array": ("special_tokens_map.json", lambda p: b"[1]", "JSON array"),
    "special_tokens_map.json-eos-list": ("special_tokens_map.json", lambda p: b'{"eos_token": [2]}',
                                         "'eos_token' = array"),
    "added_tokens.json-garbage": ("added_tokens.json", lambda p: b"{bad", "not valid JSON"),
    "added_tokens.json-id-string": ("added_tokens.json", lambda p: b'{"<x>": "7"}', "maps '<x>' to string"),
    "added_tokens.json-id-negative": ("added_tokens.json", lambda p: b'{"<x>": -1}', "maps '<x>' to -1"),
    "pipeline_tokenizer.json-conversion-number": ("pipeline_tokenizer.json",
                                                  lambda p: _edit_json(p, conversion=3),
                                                  "'conversion' = number"),
    "pipeline_tokenizer.json-vocab-size-text": ("pipeline_tokenizer.json",
                                                lambda p: _edit_json(p, vocab_size="x"),
                                                "'vocab_size' = string (expected a whole number)"),
    "pipeline_tokenizer.json-keys-gone": ("pipeline_tokenizer.json", lambda p: b'{"vocab_size": 5}',
                                          "none of the keys every saved copy records"),
}


# Files a save does not write, made sound before they are damaged.
SOUND = {"special_tokens_map.json": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
         "added_tokens.json": {}}
# One damage per file through the CLI (each run costs seconds); every case in-process.
CLI_CASES = ["tokenizer.json-truncated", "tokenizer.json-unknown-model", "tokenizer.model-garbage",
             "tokenizer_config.json-bos-number", "special_tokens_map.json-garbage",
             "added_tokens.json-id-string", "pipeline_tokenizer.json-conversion-number"]


@pytest.fixture(scope="module")
def saved_copy(saved_spm):
    root, _, first = saved_spm
    assert first.returncode == 0, first.stderr
    return root / "tokenizers" / "mistral-v1"


def _damaged_copy(saved_copy: Path, tmp_path: Path, case: str) -> tuple[Path, Path, str]:
    """A copy of the saved tokenizer with one file damaged: (folder, damaged file, expected why)."""
    folder = tmp_path / "tok"
    shutil.copytree(saved_copy, folder)
    name, damage, why = DAMAGE[case]
    target = folder / name
    if not target.exists():
        target.write_text(json.dumps(SOUND[name]))
    target.write_bytes(damage(target))
    return folder, target, why


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_tokenizer_file_is_named_with_what_to_do(saved_copy, tmp_path, case):
    """Each class of damage to each file of a tokenizer folder is one PipelineError naming the
    file, what is wrong with it, and what to do."""
    folder, target, why = _damaged_copy(saved_copy, tmp_path, case)
    with pytest.raises(stage.PipelineError) as e:
        load_tokenizer_from(str(folder))
    err = str(e.value)
    assert str(target) in err and why in err, err
    assert "python main.py tokenize" in err and "tokenizer.name" in err, err


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_damaged_tokenizer_file_is_named_with_what_to_do(saved_copy, tmp_path, case):
    """A tokenizer folder (here a copy `tokenize` saved) with one damaged file: the stage stops
    with exit 1 and one message naming that file and what to do (save it again with
    `main.py tokenize`, or point tokenizer.name elsewhere); before, a bare library error named
    only the folder, or a wrong-typed field loaded silently."""
    from tests.conftest import write_config
    folder, target, why = _damaged_copy(saved_copy, tmp_path, case)
    cfg = write_config(tmp_path, {"tokenizer": {"name": str(folder)}})
    proc = run_stage("tokenize", "--config", cfg, "--encode", "Hello world")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    err = " ".join(proc.stderr.split())
    assert str(target) in err and why in err, err
    assert "python main.py tokenize" in err and "tokenizer.name" in err, err


def test_cli_damaged_saved_copy_is_named_then_saved_again(saved_spm, tmp_path, tmp_config):
    """The copy under tokenizers/ with a truncated tokenizer.json: the message names the file
    and says to run `main.py tokenize`; doing so saves it again and the next stage loads it."""
    cfg = tmp_config({"tokenizer": {"name": str(SPM_MODEL)}})
    assert run_stage("tokenize", "--config", cfg).returncode == 0
    damaged = tmp_path / "tokenizers" / "mistral-v1" / "tokenizer.json"
    damaged.write_bytes(damaged.read_bytes()[:20_000])
    proc = run_stage("tokenize", "--config", cfg, "--encode", "Hello world")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert str(damaged) in proc.stderr and "`python main.py tokenize`" in proc.stderr
    assert run_stage("tokenize", "--config", cfg).returncode == 0
    proc = run_stage("tokenize", "--config", cfg, "--encode", "Hello world")
    assert proc.returncode == 0 and "22557,1526" in proc.stdout, proc.stderr


def test_cli_damaged_hub_cache_file_is_named(saved_spm, tmp_path, tmp_config):
    """A hub tokenizer whose copy in the local Hugging Face cache is damaged is named as such
    (with the cache folder to delete), not reported as an unreachable hub."""
    root, _, _ = saved_spm
    hub = tmp_path / "hf" / "hub"
    repo = hub / "models--acme--tok"
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (snap / f).write_bytes((root / "tokenizers" / "mistral-v1" / f).read_bytes())
    (snap / "config.json").write_text('{"model_type": "llama"}')
    env = offline_env(HF_HOME=tmp_path / "hf", HF_HUB_CACHE=hub)
    cfg = tmp_config({"tokenizer": {"name": "acme/tok"}})
    proc = run_main("tokenize", "--config", cfg, "--encode", "Hello world", env=env)
    assert proc.returncode == 0 and "22557,1526" in proc.stdout, proc.stderr   # the cache works
    (snap / "tokenizer.json").write_bytes(b"{")
    proc = run_main("tokenize", "--config", cfg, "--encode", "Hello world", env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    err = " ".join(proc.stderr.split())
    assert str(snap / "tokenizer.json") in err and f"delete {repo}" in err
    assert "Offline options" not in err
