"""Export a model as one GGUF file for llama.cpp (library; no side effects), written with the
``gguf`` package (llama.cpp's own Python writer; nothing vendored).

    write_gguf(path, model, tok, dtype="f16", name=..., chat_template=None) -> path

What goes in (the ``llama`` architecture of llama.cpp):

- metadata: context length, embedding/feed-forward sizes, blocks, heads and KV heads, RoPE
  base and dimension, RMS epsilon, vocabulary size, file type;
- tensors, renamed from Hugging Face Llama's names (utils/hf/mapping.py) to llama.cpp's
  (``token_embd``, ``blk.N.attn_q`` ...). Q and K rows are permuted from the rotate-half RoPE
  layout (first half / second half of each head) to llama.cpp's interleaved pairs, as
  llama.cpp's own converter does; a tied head is left out (llama.cpp reuses ``token_embd``);
- ``dtype``: f32, f16, bf16 or q8_0 for the 2-D weights; norms stay f32 (as llama.cpp's
  converter keeps 1-D tensors);
- the tokenizer: a SentencePiece model of this project (its ``.model`` file) as llama.cpp's
  ``llama`` tokenizer (pieces, scores, piece types, the dummy-prefix setting); a byte-level BPE
  (this project's, or an imported model's own) as ``gpt2`` with the pre-tokenizer llama.cpp
  knows it by, recognised from tokenizer.json itself (:func:`llama_cpp_pre`: GPT-2's ``gpt-2``,
  SmolLM2's ``smollm``, Llama 3's ``llama-bpe``), its tokens, merges and token types (a special
  added token CONTROL, another added token USER_DEFINED); BOS/EOS/UNK/PAD ids; ``add_bos`` as
  the caller says (this project's models: true; an imported one: its tokenizer's own rule);
  rows the model has beyond the tokenizer's vocabulary become unused ``[PAD<i>]`` tokens; the
  Jinja chat template the caller gives as ``tokenizer.chat_template``.

Refused (ValueError naming the option): what Llama cannot express (utils/hf/export.py);
GeGLU and ReGLU models (:func:`gguf_problems`: llama.cpp's ``llama`` graph applies SiLU to the
gate, whatever the file says, so it would compute another function; the Hugging Face export
expresses them); a q8_0 export whose rows are not a multiple of 32 values; a tokenizer whose
ids llama.cpp's tokenizers would not reproduce, each part named (:func:`llama_cpp_pre`: a
normalizer, another pre-tokenizer or merge rule, a SentencePiece-style tokenizer.json without
its .model file, another decoder, added tokens that strip spaces; docs/export.md). Nothing is
written before the tokenizer and the tensors have been accepted.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import gguf
import numpy as np
import torch

from utils.data.spm import read_model
from utils.data.tok import SPM_CONVERSION, backend_of, conversion_of, spm_model_of
from utils.hf.mapping import llama_problems, rename, to_hf_state_dict

GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")

_NAMES = [  # Hugging Face Llama -> llama.cpp ({i}: block index)
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight"),
    ("model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight"),
    ("model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
]


def gguf_problems(args) -> list[str]:
    """What of ``args`` the GGUF ``llama`` architecture cannot express (empty: exportable): what
    Llama lacks (utils/hf/export.py) and a gate activation other than SiLU."""
    out = llama_problems(args)
    if args.activation != "swiglu":
        out.append(f"model.activation is '{args.activation}': llama.cpp's llama architecture "
                   "applies SiLU (SwiGLU) to the gate, so it would compute another function "
                   "(export --format hf: transformers' Llama expresses it)")
    return out


def rope_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a Q or K projection (n_head * head_dim, d_model) from rotate-half order (each
    head: the first halves of the rotated pairs, then the second halves) to llama.cpp's
    interleaved pairs."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _tensor(name: str, w: torch.Tensor, dtype: str):
    """(array, raw_dtype or None) as the writer takes them."""
    arr = w.detach().float().cpu().numpy()
    if arr.ndim < 2 or dtype == "f32":
        return arr.astype(np.float32), None
    if dtype == "f16":
        return arr.astype(np.float16), None
    if dtype == "bf16":
        return gguf.quants.quantize(arr, gguf.GGMLQuantizationType.BF16), gguf.GGMLQuantizationType.BF16
    if arr.shape[-1] % 32:
        raise ValueError(f"q8_0 quantizes rows in blocks of 32 values; {name} has rows of "
                         f"{arr.shape[-1]}: export it as f16 instead")
    return gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0


def _file_type(dtype: str):
    return {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]


def write_gguf(path: Path, model, tok, dtype: str = "f16", name: str = "model",
               chat_template: Optional[str] = None, add_bos: Optional[bool] = None) -> Path:
    """Write ``model`` and ``tok`` as one GGUF file at ``path``. ``add_bos``: whether llama.cpp
    puts BOS in front of a text (None: when the tokenizer has one, as this project's models
    read every text)."""
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"GGUF dtype {dtype!r}: choose one of {', '.join(GGUF_DTYPES)}")
    a = model.args
    problems = gguf_problems(a)
    if problems:
        raise ValueError("; ".join(problems))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(a.max_seq_len)
    w.add_embedding_length(a.d_model)
    w.add_block_count(a.n_layers)
    w.add_feed_forward_length(a.ffn_hidden)
    w.add_head_count(a.n_heads)
    w.add_head_count_kv(a.n_kv_heads)
    w.add_rope_freq_base(float(a.rope_theta))
    w.add_rope_dimension_count(a.head_dim)
    w.add_layer_norm_rms_eps(float(a.norm_eps))
    w.add_vocab_size(a.vocab_size)
    w.add_file_type(_file_type(dtype))
    if dtype == "q8_0":
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(w, tok, a.vocab_size, tok.bos_token_id is not None if add_bos is None else add_bos)
    if chat_template:
        w.add_chat_template(chat_template)
    sd = to_hf_state_dict(model)
    if a.tie_embeddings:
        del sd["lm_head.weight"]                      # llama.cpp reuses token_embd
    for hf_name, t in sd.items():
        if hf_name.endswith("q_proj.weight"):
            sd[hf_name] = rope_permute(t, a.n_heads)
        elif hf_name.endswith("k_proj.weight"):
            sd[hf_name] = rope_permute(t, a.n_kv_heads)
    for name, t in rename(sd, _NAMES).items():
        arr, raw = _tensor(name, t, dtype)
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


# --------------------------------------------------------------------------- tokenizers
# Llama 3's split pattern (its tokenizer.json's Split step; llama.cpp's ``llama-bpe``).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_BYTES = ("ByteLevel", "GPT-2's pattern")    # ByteLevel(use_regex): splits, then maps bytes
_BYTES = ("ByteLevel", "no pattern")              # ByteLevel(use_regex false): maps bytes only

# The byte-level BPE pre-tokenizers llama.cpp reproduces: tokenizer.json's pre-tokenizer steps
# (as :func:`_pre_steps` spells them) -> (tokenizer.ggml.pre, llama.cpp's ``ignore_merges`` for
# it). llama.cpp hard-codes a split pattern and that merge rule per name (src/llama-vocab.cpp:
# gpt-2 splits with GPT-2's pattern; smollm each digit first, then GPT-2's pattern; llama-bpe
# with Llama 3's pattern and takes a word found whole in the vocabulary before any merge), so
# a tokenizer is written only when its own steps and merge rule are exactly one of these.
LLAMA_CPP_PRE = {
    (_GPT2_BYTES,): ("gpt-2", False),
    (("Digits", "each digit"), _GPT2_BYTES): ("smollm", False),
    (("Split", LLAMA3_PATTERN, "Isolated"), _BYTES): ("llama-bpe", True),
}


def _add_tokenizer(w, tok, vocab_size: int, add_bos: bool) -> None:
    source = spm_model_of(tok)
    if conversion_of(tok) == SPM_CONVERSION and source is not None:
        _add_spm(w, source, vocab_size)
    elif conversion_of(tok) == SPM_CONVERSION:
        raise ValueError("the tokenizer was converted from a SentencePiece model, but that "
                         ".model file is not at hand (a saved copy from before copies kept it): "
                         "re-save it with `python main.py tokenize`, or export --format hf")
    else:
        data = json.loads(backend_of(tok).to_str())
        _add_byte_bpe(w, data, len(tok), vocab_size, llama_cpp_pre(data))
    for key, tid in (("bos", tok.bos_token_id), ("eos", tok.eos_token_id), ("unk", tok.unk_token_id),
                     ("pad", tok.pad_token_id)):
        if tid is not None:
            getattr(w, f"add_{key}_token_id")(int(tid))
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(False)


def _add_spm(w, source, vocab_size: int) -> None:
    proto = read_model(source)
    tokens, scores, types = [], [], []
    for p in proto.pieces:
        tokens.append(p.piece)
        scores.append(float(p.score))
        types.append(int(p.type))              # sentencepiece's piece types are GGUF's token types
    _pad(tokens, scores, types, vocab_size)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_key_value(gguf.Keys.Tokenizer.ADD_PREFIX, bool(proto.normalizer_spec.add_dummy_prefix),
                    gguf.GGUFValueType.BOOL)


def _pre_steps(pre: Optional[dict]) -> tuple:
    """tokenizer.json's pre-tokenizer as a tuple of steps, each spelled as LLAMA_CPP_PRE's keys
    are (what changes no id, such as ``trim_offsets``, left out); a step of another kind or
    setting keeps its JSON, so it matches no key."""
    steps = [] if pre is None else pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    out = []
    for s in steps:
        kind = s.get("type")
        if kind == "ByteLevel" and not s.get("add_prefix_space"):
            out.append(_GPT2_BYTES if s.get("use_regex", True) else _BYTES)
        elif kind == "Digits" and s.get("individual_digits"):
            out.append(("Digits", "each digit"))
        elif kind == "Split" and not s.get("invert") and "Regex" in (s.get("pattern") or {}):
            out.append(("Split", s["pattern"]["Regex"], s.get("behavior")))
        else:
            out.append((kind, json.dumps(s, sort_keys=True)))
    return tuple(out)


def _spelled(part: Optional[dict]) -> str:
    """A tokenizer.json component (normalizer, pre-tokenizer, decoder) in short: its type and
    settings, a long pattern cut."""
    if not part:
        return "none"
    if part.get("type") == "Sequence":
        inner = next((v for k, v in part.items() if k != "type" and isinstance(v, list)), [])
        return "Sequence[" + ", ".join(_spelled(p) for p in inner) + "]"
    kw = ", ".join(f"{k}={json.dumps(v)[:48]}" for k, v in part.items() if k not in ("type", "trim_offsets"))
    return f"{part.get('type')}({kw})"
def llama_cpp_pre(data: dict) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` under which its BPE tokenizer gives the ids that
    tokenizer.json ``data`` gives (LLAMA_CPP_PRE), read from the tokenizer's own definition:
    a BPE model without byte fallback, dropout or word affixes, no normalizer, one of the
    pre-tokenizers llama.cpp knows with its merge rule (``ignore_merges``), a ByteLevel decoder
    and added tokens matched as written. Anything else is a ValueError naming each part
    llama.cpp would treat otherwise (docs/export.md lists them)."""
    model = data.get("model") or {}
    kind = model.get("type")
    if kind != "BPE":
        raise ValueError(f"tokenizer.json's model is {kind}: llama.cpp reads a Llama's vocabulary as "
                         "byte-level BPE or as a SentencePiece model (.model file) only; export --format hf")
    if model.get("byte_fallback"):
        raise ValueError("tokenizer.json is a SentencePiece-style BPE (byte_fallback): llama.cpp's "
                         "SentencePiece tokenizer merges pieces by their SentencePiece scores, which "
                         "tokenizer.json does not hold (a .model file does); export --format hf")
    problems = [f"{k} {model[k]!r}: llama.cpp's BPE has no such setting" for k in
                ("dropout", "continuing_subword_prefix", "end_of_word_suffix") if model.get(k)]
    if data.get("normalizer"):
        problems.append(f"normalizer {_spelled(data['normalizer'])}: llama.cpp's BPE tokenizers "
                        "normalize no text")
    steps = _pre_steps(data.get("pre_tokenizer"))
    pre, ignore_merges = LLAMA_CPP_PRE.get(steps, (None, None))
    if pre is None:
        problems.append(f"pre-tokenizer {_spelled(data.get('pre_tokenizer'))}: llama.cpp splits "
                        "text by a pattern fixed per pre-tokenizer, and this one is none of those "
                        "it knows (byte-level: GPT-2's ByteLevel, SmolLM2's Digits + ByteLevel, "
                        "Llama 3's Split + ByteLevel)")
    elif bool(model.get("ignore_merges")) != ignore_merges:
        problems.append(f"ignore_merges is {bool(model.get('ignore_merges'))}, but llama.cpp's {pre} "
                        f"tokenizer {'takes' if ignore_merges else 'never takes'} a word found whole "
                        "in the vocabulary before merging")
    if (data.get("decoder") or {}).get("type") != "ByteLevel":
        problems.append(f"decoder {_spelled(data.get('decoder'))}: llama.cpp turns byte-level "
                        "tokens back into their bytes (a ByteLevel decoder)")
    for a in data.get("added_tokens", []):
        flags = [f for f in ("lstrip", "rstrip", "single_word") if a.get(f)]
        if flags:
            problems.append(f"added token {a.get('content')!r} has {'/'.join(flags)}: a GGUF "
                            "vocabulary matches an added token as written only")
    if problems:
        raise ValueError("its tokenizer.json would give other ids in llama.cpp ("
                         + "; ".join(problems[:4]) + "); export --format hf instead, which keeps the "
                         "tokenizer as it is")
    return pre


def _add_byte_bpe(w, data: dict, n_tokens: int, vocab_size: int, pre: str) -> None:
    """The byte-level BPE as llama.cpp's ``gpt2`` tokenizer model with pre-tokenizer ``pre``.
    Token types as llama.cpp reads them: a special added token CONTROL (its string in text is
    that token only when special tokens are parsed), any other added token USER_DEFINED (always
    matched, as transformers does), the rest NORMAL."""
    by_id = {i: t for t, i in data["model"]["vocab"].items()}
    added = {a["id"]: a for a in data.get("added_tokens", [])}
    tokens, scores, types = [], [], []
    for i in range(n_tokens):
        a = added.get(i)
        t = a["content"] if a else by_id.get(i)
        if t is None:
            raise ValueError(f"the tokenizer has no token with id {i}")
        tokens.append(t)
        scores.append(0.0)
        types.append(int(gguf.TokenType.NORMAL if a is None else
                         gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED))
    _pad(tokens, scores, types, vocab_size)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)


def _pad(tokens: list, scores: list, types: list, vocab_size: int) -> None:
    if len(tokens) > vocab_size:
        raise ValueError(f"the tokenizer has {len(tokens)} tokens, more than the model's "
                         f"{vocab_size} embedding rows")
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(int(gguf.TokenType.UNUSED))


# --------------------------------------------------------------------------- what quantization costs
def dequantized_state(model, dtype: str) -> dict:
    """Our state dict with every tensor the GGUF stores in ``dtype`` rounded through that type
    and back (gguf's own quantize/dequantize): the weights llama.cpp computes with."""
    qtype = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}.get(dtype)
    out = {}
    for k, v in model.state_dict().items():
        if qtype is None or v.dim() < 2:
            out[k] = v
            continue
        arr = v.detach().float().cpu().numpy()
        back = gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype)
        out[k] = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32).reshape(arr.shape))
    return out


@torch.no_grad()
def perplexity(model, token_lists: list[list[int]]) -> float:
    """exp of the mean next-token loss over the given sequences (each cut to the context)."""
    total = count = 0.0
    for ids in token_lists:
        ids = ids[: model.args.max_seq_len + 1]
        if len(ids) < 2:
            continue
        x = torch.tensor([ids[:-1]])
        _, loss = model(x, torch.tensor([ids[1:]]), return_logits=False)
        total += float(loss) * (len(ids) - 1)
        count += len(ids) - 1
    return float(np.exp(total / count)) if count else float("nan")
