"""Export a checkpoint as a Hugging Face model folder (library; no side effects).

    files = write_hf(folder, model, tok, card=..., dtype=..., generation=..., chat_template=...,
                     max_shard_size=2 * 10**9, hf_tok=None, source=None)
    source = hf_source(path)                        an imported model's config.json, generation_config.json

What LlamaForCausalLM cannot express is refused first (utils/hf/mapping.py ``llama_problems``).
The folder holds what ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` read with no custom code and no network:

- ``config.json``: ``LlamaConfig`` from utils/hf/mapping.py (sizes, GQA, rope_theta, RMS eps,
  tie_word_embeddings, bos/eos ids, max_position_embeddings) and ``dtype``; also the older
  top-level ``rope_theta`` and ``torch_dtype``, which transformers 4.x and other readers of
  config.json (llama.cpp's converter, vLLM) take instead of ``rope_parameters`` / ``dtype``.
  An imported model's export keeps every other key of its own config.json as it was
  (special-token ids and lists, use_cache ...; :func:`merged_config`) and its dtype by default,
  and its card lists each key written otherwise (utils/hf/card.py ``config_changes``);
- ``model.safetensors``, or shards of at most ``max_shard_size`` bytes
  (``model-00001-of-0000N.safetensors``) with ``model.safetensors.index.json``;
- ``generation_config.json``: the ``inference`` section's defaults (:func:`generation_defaults`:
  sampling settings only when it samples), bos/eos; an imported model's own, as it was;
- the tokenizer: our ``tokenizer.json`` (for a SentencePiece model, the exact conversion of
  utils/data/spm.py: the ids sentencepiece gives) with a post-processor that puts BOS in front
  of a text, as our documents and prompts start; ``tokenizer_config.json``. A pre-trained
  model's keeps special-token strings inside text as text (``split_special_tokens`` true),
  like every stage here. An SFT model's carries the chat template (utils/hf/chat.py) as
  ``chat_template`` and reads special-token strings (``split_special_tokens`` false, as Hugging
  Face chat models do): transformers encodes a rendered chat with that one flag, and the
  template writes BOS and EOS as ``<s>`` / ``</s>``, so this is what makes
  ``apply_chat_template`` give our ids (docs/export.md says what it costs);
  ``pipeline_tokenizer.json``: the tokenizer's fingerprint and own post-processor, with which
  the pipeline recognises the folder's tokenizer as the original (utils/data/tok.py
  ``as_exported_from``);
- ``README.md``: the model card the caller wrote (for an imported model, with its config changes).

``hf_tok``: a transformers tokenizer saved as it is, instead of the one built from ``tok``
(an imported model's own, with its own chat template and settings). Every file gets the mode
of the files written here (transformers writes the weights 0600).

The writer works in the folder it is given; the stage (export.py) gives it a temporary one
and renames it into place, so a failure never leaves a half-written export.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from tokenizers import processors
from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerFast

from utils.data.tok import INFO_FILE, backend_of, export_info
from utils.hf.card import config_changes
from utils.hf.inputs import generation_config_notice
from utils.hf.mapping import HF_CONFIG_NAMES, hf_config, llama_problems, to_hf_state_dict

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# config.json keys an export writes from the model it writes (utils/hf/mapping.py: its shapes and
# arguments) and from how it writes it (dtype, older names of two settings, the writer's version).
# An imported model's export takes every other key from the model's own config.json as it was:
# special-token ids (bos, eos or a list of them, pad, unk), use_cache, its name ...
MODEL_KEYS = (frozenset(HF_CONFIG_NAMES.values()) - {"bos_token_id"}) | {
    "head_dim", "hidden_act", "rope_parameters", "attention_bias", "mlp_bias", "architectures",
    "model_type", "dtype", "torch_dtype", "rope_theta", "transformers_version"}


def _not_json(path: Path, constant: str):
    raise ValueError(f"{path.name} would hold {constant}, which is not JSON (readers other than Python's "
                     "refuse it): a setting is not finite")


def hf_source(path) -> dict:
    """What the export of an imported model keeps of its own files: ``config``, its config.json
    key by key as the folder has it (a .gguf file: the config transformers reads from the
    file's metadata, as transformers would write it), and ``generation``, its
    generation_config.json when the folder has a usable one (utils/hf/inputs.py; else None)."""
    path = Path(path)
    if path.is_file():
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        return {"config": config.to_diff_dict(), "generation": None}
    gen = path / "generation_config.json"
    usable = gen.is_file() and generation_config_notice(path) is None
    return {"config": json.loads((path / "config.json").read_text(encoding="utf-8")),
            "generation": json.loads(gen.read_text(encoding="utf-8")) if usable else None}


def source_dtype(source: Optional[dict]) -> Optional[torch.dtype]:
    """The dtype an imported model's config.json gives its weights (``dtype``, or the older
    ``torch_dtype``); None when it names none of DTYPES'."""
    conf = (source or {}).get("config") or {}
    name = conf.get("dtype") or conf.get("torch_dtype")
    return {str(t).removeprefix("torch."): t for t in DTYPES.values()}.get(name)


def default_dtype(model, source: Optional[dict]) -> torch.dtype:
    """The export's dtype without --dtype: the one an imported model's config.json names when
    every weight is exactly a value of it (an import, which holds a bfloat16 model in float32:
    it comes back as the same weights), else the weights' own (a fine-tune keeps its precision)."""
    own, named = model.lm_head.weight.dtype, source_dtype(source)
    if named is None or named == own:
        return own
    exact = all(torch.equal(t, t.to(named).to(t.dtype)) for t in model.state_dict().values()
                if t.is_floating_point())
    return named if exact else own


def merged_config(ours: dict, source: dict) -> tuple[dict, list[tuple], list[str]]:
    """config.json of an imported model's export: ``source`` (the model's own config.json) with
    the keys the export writes from the model it writes (MODEL_KEYS) taken from ``ours``, and
    any key ``source`` lacks; also what that changed, (key, was, now), and the keys it added
    (both listed in the model card, utils/hf/card.py ``config_changes``)."""
    out = dict(source)
    for k, v in ours.items():
        if k in MODEL_KEYS or k not in source:
            out[k] = v
    changed = [(k, source[k], out[k]) for k in source if out[k] != source[k]]
    return out, changed, sorted(set(out) - set(source))


def generation_defaults(inference) -> dict:
    """generation_config.json's settings of the ``inference`` config section: its sampling
    settings when it samples (temperature > 0), greedy decoding otherwise (transformers
    refuses sampling settings without sampling)."""
    if inference.temperature > 0:
        return {"do_sample": True, "temperature": inference.temperature, "top_k": inference.top_k,
                "top_p": inference.top_p, "max_new_tokens": inference.max_new_tokens}
    return {"do_sample": False, "max_new_tokens": inference.max_new_tokens}


def hf_tokenizer(tok, chat_template: Optional[str] = None):
    """A ``PreTrainedTokenizerFast`` of ``tok``'s exact backend: BOS put in front of each text
    by the post-processor; without a chat template special-token strings in text stay text,
    with one (SFT) they are read as the special tokens the template writes."""
    backend = backend_of(tok).__class__.from_str(backend_of(tok).to_str())   # a copy
    bos = tok.bos_token
    if bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.bos_token_id)])
    kw = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
          if getattr(tok, k, None) is not None}
    out = PreTrainedTokenizerFast(tokenizer_object=backend, split_special_tokens=not chat_template,
                                  clean_up_tokenization_spaces=False,
                                  model_max_length=getattr(tok, "model_max_length", None) or 10 ** 30,
                                  **kw)
    if chat_template:
        out.chat_template = chat_template
    return out


def _write_config(folder: Path, args, dtype: torch.dtype, source: Optional[dict]) -> str:
    """config.json as transformers wrote it plus the older top-level ``rope_theta`` and
    ``torch_dtype``; for an imported model (``source``) merged with its own config.json and its
    generation_config.json written as it was. Returns what the card adds: the keys changed."""
    conf = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    conf.update(rope_theta=float(args.rope_theta), torch_dtype=str(dtype).removeprefix("torch."))
    said = ""
    if source is not None:
        conf, changed, added = merged_config(conf, source["config"])
        said = config_changes(changed, added)
        if source.get("generation") is not None:
            (folder / "generation_config.json").write_text(
                json.dumps(source["generation"], indent=2, allow_nan=False) + "\n", encoding="utf-8")
    (folder / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True, allow_nan=False) + "\n",
                                        encoding="utf-8")
    return said


def write_hf(folder: Path, model, tok, *, card: str, dtype: Optional[torch.dtype] = None,
             generation: Optional[dict] = None, chat_template: Optional[str] = None,
             tok_name: str = "", max_shard_size: int = 2 * 10**9, hf_tok=None,
             source: Optional[dict] = None) -> list[Path]:
    """Write the model folder into ``folder`` (which exists and is empty); return the files.
    ``dtype``: None for :func:`default_dtype`.
    ``source``: an imported model's own files (:func:`hf_source`): its config.json's keys
    are kept (:func:`merged_config`; the card lists what changed), its generation_config.json
    is written as it was instead of ``generation``."""
    # importing transformers' Llama modeling sets TORCHINDUCTOR_CACHE_DIR in the environment:
    # a library module may not change the process when it is imported, only when it is used
    from transformers import LlamaForCausalLM
    args = model.args
    problems = llama_problems(args)
    if problems:
        raise ValueError("; ".join(problems))
    dtype = dtype or default_dtype(model, source)
    config = hf_config(args, eos_id=tok.eos_token_id)
    config.dtype = dtype
    sd = {k: v.detach().to(dtype) for k, v in to_hf_state_dict(model).items()}
    with torch.device("meta"):
        hf = LlamaForCausalLM(config)
    missing, unexpected = hf.load_state_dict(sd, strict=False, assign=True)
    allowed = {"lm_head.weight"} if args.tie_embeddings else set()   # tied: lm_head is embed_tokens
    if set(missing) - allowed or unexpected:
        raise ValueError(f"the weights do not fill LlamaForCausalLM (missing "
                         f"{sorted(set(missing) - allowed)[:4]}, unexpected {unexpected[:4]})")
    if args.tie_embeddings:
        hf.tie_weights()
    gen = dict(generation or {})
    hf.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id,
                                            eos_token_id=tok.eos_token_id,
                                            pad_token_id=tok.pad_token_id, **gen)
    hf.save_pretrained(folder, max_shard_size=max_shard_size, safe_serialization=True)
    card += _write_config(folder, args, dtype, source)
    (hf_tok or hf_tokenizer(tok, chat_template)).save_pretrained(folder, save_jinja_files=False)
    tconf = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):   # how a loaded tokenizer was read, not what it is
        tconf.pop(key, None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tconf, indent=2, ensure_ascii=False, allow_nan=False)
                                                  + "\n", encoding="utf-8")
    (folder / INFO_FILE).write_text(json.dumps(export_info(tok, tok_name), indent=2, ensure_ascii=False,
                                               allow_nan=False) + "\n", encoding="utf-8")
    for f in sorted(folder.glob("*.json")):     # those transformers wrote too: standard JSON only
        json.loads(f.read_text(encoding="utf-8"), parse_constant=lambda c, f=f: _not_json(f, c))
    (folder / "README.md").write_text(card, encoding="utf-8")
    files = sorted(p for p in folder.iterdir() if p.is_file())
    mode = (folder / "README.md").stat().st_mode & 0o777      # what the umask gives a new file
    for f in files:
        f.chmod(mode)
    return files
