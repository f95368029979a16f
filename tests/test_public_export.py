"""A public model's export (`main.py export` of an imported Hugging Face Llama): its own
tokenizer as GGUF for llama.cpp under the pre-tokenizer llama.cpp knows it by, and its own
config.json kept key by key in the Hugging Face folder. Checked with the real consumers:
llama.cpp (llama-cpp-python) against transformers on the original folder.

Offline stand-ins (built once per module): a tiny random Llama (hidden 64, 2 layers,
SmolLM2's vocabulary of 49,152) saved with SmolLM2-135M-Instruct's tokenizer files, chat
template and config.json (sizes changed), in three tokenizer variants: the folder transformers
built from SmolLM2's GGUF (GPT-2's ByteLevel: llama.cpp's ``gpt-2``), the Hugging Face hub's
form (Digits + ByteLevel: ``smollm``) and a Llama-3-style one (Split with Llama 3's pattern +
ByteLevel, ignore_merges, a BOS post-processor, three non-special added tokens: ``llama-bpe``).
This project's SentencePiece exports are covered by tests/test_export.py. One test runs the
real SmolLM2-135M-Instruct (data/samples/smollm2/)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import llama_cpp  # a test requirement (requirements-test.txt): missing is a failure, not a skip
import numpy as np
import pytest
import torch

from tests.conftest import NEWS, SAMPLES, run_main

SMOLLM2 = SAMPLES / "smollm2" / "SmolLM2-135M-Instruct"
VARIANTS = ("gpt2", "smollm", "llama-bpe")
PRE = {"gpt2": "gpt-2", "smollm": "smollm", "llama-bpe": "llama-bpe"}   # variant -> tokenizer.ggml.pre
DTYPE = {"gpt2": "f32", "smollm": "f16", "llama-bpe": "q8_0"}    # each variant's GGUF: every dtype once
USER_DEFINED = ("<issue_start>", "<issue_comment>", "<issue_closed>")   # llama-bpe: not special
GREEDY = 24
TEXTS = ["Hello world! 123", "Call 555-0123 or 1,234,567.89 before 2024-11-28; 0.5% of 10000.",
         "١٢٣ ½ ² Ⅻ: numbers beyond ASCII", "日本語の文章。中文字符，한국어 텍스트", "😀🚀 👨‍👩‍👧 emoji, ZWJ",
         "def f(x):\n\treturn  x**2  # code {}[]<>\n", "Héllo wörld, café déjà vu, naïve Ångström",
         "  two  spaces\tand\ttabs\n\n\nnewlines   ", "x   \n  y", " leading space", "trailing ", "\n",
         "<|im_start|>user\nhi<|im_end|>\n", "<s> </s> <unk> <|endoftext|> typed as text",
         "an <issue_comment> inside text", "don't I'LL we've THEY'RE it's", "a" * 40 + "1" * 25]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "2+2? Naïve 日本"}],
         [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
          {"role": "user", "content": "  Tell me a joke about <|im_end|> tokens.\n"}]]
# How the export may write a config.json key otherwise than the imported model's own: the dtype
# the weights are written in, under both names; the RoPE base under both names; the writer's
# version (utils/hf/card.py CONFIG_REASONS, which the card quotes)
CONFIG_CHANGED = {"dtype", "torch_dtype", "transformers_version"}
CONFIG_ADDED = {"dtype", "torch_dtype", "rope_theta", "rope_parameters"}


def news(n: int) -> list[str]:
    return [x.strip() for x in NEWS.read_text(encoding="utf-8").splitlines() if x.strip()][:n]


# --------------------------------------------------------------------------- stand-ins
def _chain_weights(model, seed: int, length: int = 64) -> list[int]:
    """Set the first MLP of ``model`` so that greedy decoding after "\\n" (the last token of
    SmolLM2's generation prompt) walks a fixed chain of ``length`` distinct random tokens; returns
    the chain. Random weights give no usable greedy path: the argmax among 49,152 random logits
    wins by as little as 0.5% of their spread, below what q8_0's rounding moves them, and a
    tied random model otherwise repeats its input token. Here neuron k fires for the embedding
    of chain[k] and writes the embedding of chain[k + 1], so each step wins by about twice the
    logits' spread; everything else (attention with RoPE, the second layer, the norms, the tied
    head) stays random and in the path."""
    g = torch.Generator().manual_seed(seed)
    emb = model.model.embed_tokens.weight
    with torch.no_grad():
        emb.normal_(0, 0.5, generator=g)                # the residual outweighs random attention
        chain = [198] + [i for i in (torch.randperm(emb.shape[0] - 17, generator=g) + 17).tolist()
                         if i != 198][:length - 1]
        keys = emb[chain] / emb[chain].pow(2).mean(-1, keepdim=True).sqrt()   # as RMSNorm gives them
        mlp, gain, d = model.model.layers[0].mlp, 8.0, emb.shape[1]
        mlp.gate_proj.weight[:length] = gain * keys / d
        mlp.up_proj.weight[:length] = gain * keys / d
        mlp.down_proj.weight[:, :length] = 10.0 * emb[chain[1:] + chain[:1]].T / gain ** 2
    return chain


def _llama3_style(tokenizer: dict, config: dict) -> None:
    from utils.hf.to_gguf import LLAMA3_PATTERN
    tokenizer["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    tokenizer["model"]["ignore_merges"] = True
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}
    for a in tokenizer["added_tokens"]:
        if a["content"] in USER_DEFINED:
            a["special"] = False
    # a transformers-4 config.json as the hub's Llama 3 ones are: top-level rope_theta, torch_dtype
    # (its weights are saved so), a list of end-of-turn ids
    rope = config.pop("rope_parameters")
    config.pop("dtype")
    config.update(rope_theta=rope["rope_theta"], rope_scaling=None, torch_dtype="bfloat16",
                  eos_token_id=[2, 0], transformers_version="4.45.0", max_position_embeddings=4096)


def _hub_style(tokenizer: dict, config: dict) -> None:
    tokenizer["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}


@pytest.fixture(scope="module")
def standins(tmp_path_factory) -> dict:
    """{variant: folder} of the stand-in model (module docstring), one set of weights, and
    "chain": its greedy chain."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    root = tmp_path_factory.mktemp("public")
    config = json.loads((SMOLLM2 / "config.json").read_text(encoding="utf-8"))
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    out = {"chain": _chain_weights(model, seed=0)}
    model.save_pretrained(root / "weights")
    for variant, edit in (("gpt2", None), ("smollm", _hub_style), ("llama-bpe", _llama3_style)):
        d = root / variant
        d.mkdir()
        shutil.copy(root / "weights" / "model.safetensors", d)
        if variant == "llama-bpe":                 # its config.json says bfloat16, as the hub's do
            sd = load_file(d / "model.safetensors")
            save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, d / "model.safetensors",
                      metadata={"format": "pt"})
        for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            shutil.copy(SMOLLM2 / name, d)
        tok, conf = json.loads((SMOLLM2 / "tokenizer.json").read_text(encoding="utf-8")), dict(config)
        if edit:
            edit(tok, conf)
        (d / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
        (d / "config.json").write_text(json.dumps(conf, indent=2) + "\n", encoding="utf-8")
        out[variant] = d
    return out


@pytest.fixture(scope="module")
def exported(standins):
    """``exported(variant, dtype)``: the GGUF file `main.py export` writes for a stand-in
    (each exported once per module)."""
    done = {}

    def get(variant: str, dtype: str) -> Path:
        if (variant, dtype) not in done:
            out = standins[variant].parent / "exports" / f"{variant}-{dtype}"
            _export(standins[variant], "gguf", out, "--dtype", dtype)
            done[variant, dtype] = next(out.glob("*.gguf"))
        return done[variant, dtype]
    return get


def _export(folder: Path, fmt: str, out: Path, *extra) -> None:
    """`main.py export` run in this process (a subprocess would import torch and transformers
    again; the exit code and the stderr of a refusal are checked through main.py below)."""
    import export
    assert export.main(["--checkpoint", str(folder), "--format", fmt, "--out", str(out), *extra]) == 0


def _hf_tokenizer(folder: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _vocab(path: Path):
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def _chat_ids(template: str, L, messages: list[dict]) -> list[int]:
    """The prompt ids llama-cpp-python's chat completion sends for ``messages``: the template
    rendered by its Jinja chat formatter, tokenized with special tokens parsed and no BOS
    added (the template writes what it wants)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    r = Jinja2ChatFormatter(template, eos_token="<|im_end|>", bos_token="<|im_start|>")(messages=messages)
    return L.tokenize(r.prompt.encode("utf-8"), add_bos=not r.added_special, special=True)


def _hf_chat_ids(tok, messages: list[dict]) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"])


# --------------------------------------------------------------------------- recognising pre-tokenizers
def test_the_variants_tokenize_apart_so_a_wrong_pre_tokenizer_would_show(standins):
    """Each stand-in's tokenizer.json is recognised as its llama.cpp pre-tokenizer, and the three
    tokenize TEXTS differently pairwise (digits next to a space, newline runs), so llama.cpp
    matching each one (below) says the right pre-tokenizer was written."""
    from utils.hf.to_gguf import llama_cpp_pre
    ids = {}
    for v in VARIANTS:
        assert llama_cpp_pre(json.loads((standins[v] / "tokenizer.json").read_text(encoding="utf-8"))) == PRE[v]
        tok = _hf_tokenizer(standins[v])
        ids[v] = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    assert ids["gpt2"] != ids["smollm"] != ids["llama-bpe"] != ids["gpt2"]


def _refusal_cases() -> dict:
    def pre(p):
        return lambda d: d.__setitem__("pre_tokenizer", p)

    def model(**kw):
        return lambda d: d["model"].update(kw)

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {   # name: (edit of SmolLM2's hub-style tokenizer.json, words the refusal says)
        "normalizer": (lambda d: d.__setitem__("normalizer", {"type": "NFC"}),
                       ["normalizer NFC()", "normalize no text"]),
        "digit_runs": (pre({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": False}, byte_level]}), ["pre-tokenizer Sequence[Digits("]),
        "prefix_space": (pre(dict(byte_level, add_prefix_space=True)), ["add_prefix_space=true", "none of those"]),
        "other_pattern": (pre({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r"\p{N}{1,3}| ?\p{L}+"}, "behavior": "Isolated", "invert": False},
            dict(byte_level, use_regex=False)]}), ["pre-tokenizer Sequence[Split(", "Llama 3's Split"]),
        "metaspace": (lambda d: (d.__setitem__("pre_tokenizer", {"type": "Metaspace", "replacement": "▁"}),
                                 d["model"].update(byte_fallback=True)), ["SentencePiece-style", ".model file"]),
        "unigram": (model(type="Unigram"), ["model is Unigram"]),
        "ignore_merges": (model(ignore_merges=True), ["ignore_merges is True", "smollm tokenizer never takes"]),
        "dropout": (model(dropout=0.1), ["dropout 0.1"]),
        "decoder": (lambda d: d.__setitem__("decoder", {"type": "Metaspace", "replacement": "▁"}),
                    ["decoder Metaspace("]),
        "lstrip": (lambda d: d["added_tokens"][2].update(lstrip=True), ["'<|im_end|>' has lstrip"]),
    }


@pytest.mark.parametrize("case", sorted(_refusal_cases()))
def test_what_llama_cpp_cannot_reproduce_is_refused_by_name(standins, case):
    """Each part of a tokenizer.json that llama.cpp would tokenize or decode otherwise is named
    (docs/export.md lists them), with the way out (`export --format hf`)."""
    from utils.hf.to_gguf import llama_cpp_pre
    edit, words = _refusal_cases()[case]
    data = json.loads((standins["smollm"] / "tokenizer.json").read_text(encoding="utf-8"))
    edit(data)
    with pytest.raises(ValueError) as e:
        llama_cpp_pre(data)
    for w in words + ["export --format hf"]:
        assert w in str(e.value), (w, str(e.value))


def test_a_refused_tokenizer_leaves_nothing_written(standins, tmp_path):
    """`main.py export --format gguf` of a model whose tokenizer llama.cpp cannot reproduce:
    exit 1, the message names the model, tokenizer.json's part and the way out; no --out, no
    temporary folder."""
    d = tmp_path / "digit-runs"
    shutil.copytree(standins["smollm"], d)
    data = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    data["pre_tokenizer"]["pretokenizers"][0]["individual_digits"] = False
    (d / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    out = tmp_path / "exports" / "x"
    r = run_main("export", "--checkpoint", str(d), "--format", "gguf", "--out", str(out), timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    for w in (f"cannot export {d} as gguf", "pre-tokenizer Sequence[Digits(individual_digits=false)",
              "export --format hf", "Nothing was written"):
        assert w in r.stderr, (w, r.stderr)
    assert "Traceback" not in r.stderr
    assert not out.exists() and not list(out.parent.glob(".x*"))


# --------------------------------------------------------------------------- llama.cpp against transformers
@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_cpp_tokenizes_and_renders_chats_as_transformers(standins, exported, variant):
    """The GGUF of each stand-in (DTYPE): tokenizer.ggml.pre, the special ids, add_bos by the
    tokenizer's own rule (only the llama-bpe variant's post-processor adds BOS) and the token
    types (special added tokens CONTROL, others USER_DEFINED); llama.cpp's ids equal
    transformers' on TEXTS and 40 news lines, like for like (special tokens as text: llama.cpp
    parse_special false, transformers split_special_tokens; read: both defaults); the stored
    chat template is the folder's and renders, in llama-cpp-python's chat formatter, the prompt
    ids transformers' apply_chat_template gives."""
    import gguf
    path, tok = exported(variant, DTYPE[variant]), _hf_tokenizer(standins[variant])
    reader = gguf.GGUFReader(str(path))
    types = np.asarray(reader.fields["tokenizer.ggml.token_type"].contents())
    added = {a["id"]: a for a in json.loads(tok.backend_tokenizer.to_str())["added_tokens"]}
    want = [gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED
            for i in sorted(added)]
    assert types[sorted(added)].tolist() == want and set(types[len(added):].tolist()) == {gguf.TokenType.NORMAL}
    assert (types == gguf.TokenType.USER_DEFINED).sum() == (3 if variant == "llama-bpe" else 0)
    L = _vocab(path)
    try:
        meta = L.metadata
        assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"]) == ("gpt2", PRE[variant])
        assert [meta[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "unknown", "padding")] == \
               ["1", "2", "0", "2"]
        assert meta["tokenizer.ggml.add_bos_token"] == ("true" if variant == "llama-bpe" else "false")
        assert meta["tokenizer.chat_template"] == tok.chat_template
        texts = TEXTS + news(40)
        assert [L.tokenize(t.encode(), add_bos=True, special=False) for t in texts] == \
               [tok(t, split_special_tokens=True)["input_ids"] for t in texts]
        assert [L.tokenize(t.encode(), add_bos=True, special=True) for t in texts] == \
               [tok(t)["input_ids"] for t in texts]
        for messages in CHATS:
            assert _chat_ids(meta["tokenizer.chat_template"], L, messages) == _hf_chat_ids(tok, messages)
    finally:
        L.close()


def _hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy continuation (KV cache, as generate) and its logits at each step."""
    ids, past, out, logits = torch.tensor([prompt]), None, [], []
    with torch.no_grad():
        for _ in range(n):
            r = model(ids, past_key_values=past, use_cache=True)
            logits.append(r.logits[0, -1].numpy())
            past, ids = r.past_key_values, r.logits[0, -1].argmax().view(1, 1)
            out.append(int(ids))
    return out, np.stack(logits)


def _llama_greedy(L, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """llama.cpp's greedy continuation (incremental evaluation, as its generation runs) and its
    logits at each step."""
    L.reset()
    L.eval(prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(L.scores[L.n_tokens - 1])))
        L.eval(out[-1:])
    return out, np.array(L.scores[len(prompt) - 1:len(prompt) - 1 + n], dtype=np.float32)


def _compare(got: list[int], want: list[int], got_logits: np.ndarray, want_logits: np.ndarray):
    """(steps equal, each comparable step's largest logit difference, each step's margin: the
    top logit minus the second in transformers'). A step is comparable while the tokens before
    it are equal."""
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    top2 = np.sort(want_logits, axis=-1)[:, -2:]
    return (same, np.abs(got_logits - want_logits)[:same + 1].max(-1), top2[:, 1] - top2[:, 0])


def _model(path: Path):
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2, seed=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_tokens_equal_transformers(standins, exported, variant, capsys):
    """Each stand-in's GGUF (f32, f16 and q8_0: DTYPE): llama.cpp's greedy continuation of a chat
    prompt equals transformers' (fp32, on the folder) for GREEDY tokens. Each step is decided:
    llama.cpp's logits differ from transformers' by less than half that step's margin (the
    arithmetic condition for the same argmax), which the chain weights give q8_0 as well (their
    margins are about twice the logits' spread)."""
    from transformers import AutoModelForCausalLM
    folder, dtype = standins[variant], DTYPE[variant]
    tok = _hf_tokenizer(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    prompt = _hf_chat_ids(tok, CHATS[0])
    want, want_logits = _hf_greedy(hf, prompt, GREEDY)
    assert want == standins["chain"][1:GREEDY + 1]            # the weights do what they were set to
    L = _model(exported(variant, dtype))
    try:
        got, got_logits = _llama_greedy(L, prompt, GREEDY)
    finally:
        L.close()
    same, errors, margins = _compare(got, want, got_logits, want_logits)
    with capsys.disabled():
        print(f"\n{variant} {dtype}: greedy equal for {same} of {GREEDY} tokens; logits max diff "
              f"{errors.max():.2e}; smallest margin {margins.min():.2f}")
    assert same == GREEDY
    assert (errors < margins / 2).all(), (errors, margins)


# --------------------------------------------------------------------------- the Hugging Face folder
def _card_keys(card: str) -> set[str]:
    section = card.split("## Configuration", 1)[1] if "## Configuration" in card else ""
    return set(re.findall(r"^- `([^`]+)`", section, re.MULTILINE))


@pytest.mark.parametrize("variant", ["smollm", "llama-bpe"])
def test_hf_export_keeps_the_config_key_by_key(standins, variant):
    """`export --format hf` of an imported model: every key of its config.json comes back with
    its value (special-token ids, the llama-bpe variant's list of end ids, RoPE base, tie flag,
    max positions, RMS epsilon, sizes, use_cache ...) but the ones the export writes on purpose
    (CONFIG_CHANGED / CONFIG_ADDED, the same the card lists with why); generation_config.json is
    the model's own; transformers reads the folder as the original (same config values, logits)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    src = standins[variant]
    out = src.parent / "exports" / f"{variant}-hf"
    _export(src, "hf", out)
    was = json.loads((src / "config.json").read_text(encoding="utf-8"))
    now = json.loads((out / "config.json").read_text(encoding="utf-8"))
    changed = {k for k in was if now.get(k, "missing") != was[k]}
    added = set(now) - set(was)
    assert changed <= CONFIG_CHANGED and added <= CONFIG_ADDED, (changed, added)
    assert "missing" not in [now.get(k, "missing") for k in was]
    assert _card_keys((out / "README.md").read_text(encoding="utf-8")) == changed | added
    assert json.loads((out / "generation_config.json").read_text(encoding="utf-8")) == \
           json.loads((src / "generation_config.json").read_text(encoding="utf-8"))
    a, b = ({k: v for k, v in AutoConfig.from_pretrained(d, local_files_only=True).to_dict().items()
             if k not in CONFIG_CHANGED | {"_name_or_path"}} for d in (src, out))      # where it was read
    assert a == b
    x = torch.tensor([_hf_tokenizer(src)(news(1)[0])["input_ids"][:64]])
    with torch.no_grad():
        ref, again = (AutoModelForCausalLM.from_pretrained(d, local_files_only=True, dtype=torch.float32)
                      .eval()(x).logits for d in (src, out))
    assert torch.equal(ref, again)


# --------------------------------------------------------------------------- the real model
def test_real_smollm2_in_llama_cpp_f16_and_q8_0(tmp_path, capsys):
    """SmolLM2-135M-Instruct (data/samples/smollm2/, the folder transformers built from the
    model's published GGUF): `export --format gguf` (f16) gives llama.cpp transformers' ids on
    TEXTS and news, the chat prompt ids of apply_chat_template, and transformers' greedy answer
    (fp32, on the folder) for GREEDY tokens, each step decided by more than twice llama.cpp's
    logit difference (the prompt was picked for that: this model's answers have steps won by
    0.01).

    q8_0 (the same writer, run in this process: `main.py export --dtype q8_0` also measures
    held-out perplexity, minutes for this model) rounds weights and activations to 8 bits per
    32 values, which moves this model's logits by about 1 where the answer's steps are won by
    0.24 and up: its greedy path may leave fp32's at such a step without any fault of the
    file, and no tolerance could make that an equality. What is exact is checked: its
    vocabulary, token ids and chat prompt ids are transformers'; its greedy agreement and
    logit differences are printed."""
    from transformers import AutoModelForCausalLM
    from utils.hf.import_hf import load_hf_llama
    from utils.hf.to_gguf import write_gguf
    tok = _hf_tokenizer(SMOLLM2)
    hf = AutoModelForCausalLM.from_pretrained(SMOLLM2, local_files_only=True, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "Give me a recipe for pancakes."}]
    prompt = _hf_chat_ids(tok, messages)
    want, want_logits = _hf_greedy(hf, prompt, GREEDY)
    del hf
    _export(SMOLLM2, "gguf", tmp_path / "f16")
    imp = load_hf_llama(SMOLLM2)
    q8 = write_gguf(tmp_path / "q8_0.gguf", imp.model, imp.tok, dtype="q8_0", name="SmolLM2-135M-Instruct",
                    chat_template=tok.chat_template, add_bos=False)      # as export.py writes it
    del imp
    texts, said = TEXTS + news(40), []
    for path in (tmp_path / "f16" / "SmolLM2-135M-Instruct-f16.gguf", q8):
        L = _model(path)
        try:
            assert (L.metadata["tokenizer.ggml.pre"], L.metadata["tokenizer.ggml.add_bos_token"]) == ("gpt-2", "false")
            assert [L.tokenize(t.encode(), add_bos=True, special=False) for t in texts] == \
                   [tok(t, split_special_tokens=True)["input_ids"] for t in texts]
            assert _chat_ids(L.metadata["tokenizer.chat_template"], L, messages) == prompt
            got, got_logits = _llama_greedy(L, prompt, GREEDY)
        finally:
            L.close()
        same, errors, margins = _compare(got, want, got_logits, want_logits)
        said.append(f"SmolLM2 {path.name}: greedy equal for {same} of {GREEDY} tokens; logits max diff "
                    f"{errors.max():.3f} (mean of the steps' {errors.mean():.3f}); smallest margin {margins.min():.2f}")
        if path.name.endswith("-f16.gguf"):
            assert same == GREEDY, (tok.decode(got), tok.decode(want))
            assert (errors < margins / 2).all(), (errors, margins)
    with capsys.disabled():                  # the measured numbers, in the test log (docs/export.md)
        print("\n" + "\n".join(said))
