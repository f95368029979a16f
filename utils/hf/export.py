"""Export a checkpoint as a Hugging Face model folder (library; no side effects).

    problems = llama_problems(args)                 what LlamaForCausalLM cannot express
    files = write_hf(folder, model, tok, card=..., dtype=..., generation=..., chat_template=...,
                     max_shard_size=2 * 10**9, hf_tok=None)

The folder holds what ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` read with no custom code and no network:

- ``config.json``: ``LlamaConfig`` from utils/hf/mapping.py (sizes, GQA, rope_theta, RMS eps,
  tie_word_embeddings, bos/eos ids, max_position_embeddings) and ``dtype``; also the older
  top-level ``rope_theta`` and ``torch_dtype``, which transformers 4.x and other readers of
  config.json (llama.cpp's converter, vLLM) take instead of ``rope_parameters`` / ``dtype``;
- ``model.safetensors``, or shards of at most ``max_shard_size`` bytes
  (``model-00001-of-0000N.safetensors``) with ``model.safetensors.index.json``;
- ``generation_config.json``: the ``inference`` section's defaults (:func:`generation_defaults`:
  sampling settings only when it samples), bos/eos;
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
- ``README.md``: the model card the caller wrote.

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

from utils.hf.mapping import hf_config, to_hf_state_dict

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _not_json(path: Path, constant: str):
    raise ValueError(f"{path.name} would hold {constant}, which is not JSON (readers other than Python's "
                     "refuse it): a setting is not finite")


def llama_problems(args) -> list[str]:
    """What of ``args`` LlamaForCausalLM cannot express (empty: exportable), each naming the
    option and why."""
    out = []
    if args.norm != "rmsnorm":
        out.append(f"model.norm is '{args.norm}': Llama has RMSNorm only (train with "
                   "model.norm 'rmsnorm' to export)")
    if getattr(args, "attention", "standard") != "standard":
        out.append(f"model.attention is '{args.attention}': Llama (and llama.cpp's llama "
                   "architecture) has no compressive memory nor its gates, and attends over the "
                   "whole input rather than within segments, so no Llama model computes what this "
                   "one does (use it with infer, benchmark and serve here)")
    return out


def notes(args) -> list[str]:
    """What changes meaning on export, said in the model card and by the stage."""
    out = []
    if args.document_mask:
        out.append("trained with document masks (attention kept inside each document of a "
                   "packed window); a Llama model attends over the whole input, which is the "
                   "same for one document per input")
    if args.dropout:
        out.append(f"trained with dropout {args.dropout}: inference runs without it, as here")
    return out


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
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from utils.data.tok import backend_of
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


def write_hf(folder: Path, model, tok, *, card: str, dtype: Optional[torch.dtype] = None,
             generation: Optional[dict] = None, chat_template: Optional[str] = None,
             tok_name: str = "", max_shard_size: int = 2 * 10**9, hf_tok=None) -> list[Path]:
    """Write the model folder into ``folder`` (which exists and is empty); return the files."""
    from transformers import GenerationConfig, LlamaForCausalLM
    from utils.data.tok import INFO_FILE, export_info
    args = model.args
    problems = llama_problems(args)
    if problems:
        raise ValueError("; ".join(problems))
    dtype = dtype or model.lm_head.weight.dtype
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
    conf = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    conf.update(rope_theta=float(args.rope_theta), torch_dtype=str(dtype).removeprefix("torch."))
    (folder / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True, allow_nan=False) + "\n",
                                        encoding="utf-8")
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
