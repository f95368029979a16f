"""Import a local Hugging Face Llama model (a folder with safetensors, or a ``.gguf`` file that
transformers reads) as this project's model and tokenizer (library; no side effects; local
files only, never the network).

    imported = load_hf_llama(path)       # .model, .tok, .tok_info, .config, .source

Accepted: ``LlamaForCausalLM`` checkpoints (``model_type`` "llama") with no bias terms, RMSNorm,
a gated MLP whose activation we have (SiLU, GELU, ReLU), default RoPE (no scaling). Refused
with a message naming the setting: other architectures (Mistral's sliding window, MoE, ...),
``attention_bias`` / ``mlp_bias``, RoPE scaling types, a tokenizer larger than the
embedding. The weights are loaded by transformers (so sharded safetensors and GGUF
de-quantization work as there) and renamed by utils/hf/mapping.py; the logits equal
transformers' on the same input (tests/test_export.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from utils.cli import PipelineError


@dataclass
class Imported:
    model: object            # model.Transformer, eval mode, fp32, CPU
    tok: object              # the model's own tokenizer (special-token strings stay text)
    tok_info: dict           # utils.data.tok.describe
    config: object           # the transformers config
    source: str              # what was read


def is_hf_model(path: Path) -> bool:
    """A Hugging Face model folder (config.json) or a .gguf file, not a run folder of ours."""
    path = Path(path)
    return (path.is_file() and path.suffix == ".gguf") or (
        path.is_dir() and (path / "config.json").is_file() and not any(path.glob("*.pt")))


def _split(path: Path) -> tuple[Path, Optional[str]]:
    """(folder, gguf file name or None) of a model folder or a .gguf file."""
    path = Path(path).expanduser().resolve()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return path, ggufs[0]
        if (path / "config.json").is_file():
            return path, None
        raise PipelineError(f"{path} is not a Hugging Face model folder: it has no config.json "
                            + (f"and several .gguf files ({', '.join(ggufs)}): pass one of them"
                               if ggufs else "and no .gguf file") + ".")
    raise PipelineError(f"{path} does not exist (pass a Hugging Face model folder or a .gguf file).")


def llama_config_problems(c) -> list[str]:
    """What of a transformers config this project's model cannot represent."""
    from utils.activations import HF_ACT_NAMES
    out = []
    if getattr(c, "model_type", None) != "llama":
        out.append(f"model_type '{getattr(c, 'model_type', None)}' (architectures "
                   f"{getattr(c, 'architectures', None)}): only Llama models import")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(c, flag, False):
            out.append(f"{flag} is true: this model has no bias terms")
    if getattr(c, "hidden_act", None) not in HF_ACT_NAMES.values():
        out.append(f"hidden_act '{getattr(c, 'hidden_act', None)}': the gated MLP supports "
                   f"{', '.join(HF_ACT_NAMES.values())}")
    rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind not in (None, "default"):
        out.append(f"RoPE scaling '{kind}' is not implemented (only plain RoPE)")
    if getattr(c, "pretraining_tp", 1) not in (None, 1):
        out.append("pretraining_tp > 1 is not supported")
    return out


def load_hf_llama(path) -> Imported:
    """The model and tokenizer of a local Hugging Face Llama folder or GGUF file."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from model import create_model
    from utils.data.tok import as_exported_from, describe, plain
    from utils.hf.mapping import from_hf_state_dict, model_args_from_hf_config
    folder, gguf = _split(Path(path))
    kw = {"gguf_file": gguf} if gguf else {}
    where = str(folder / gguf) if gguf else str(folder)
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True, **kw)
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kw)
        tok = plain(tok if gguf else as_exported_from(tok, folder))
    except (OSError, ValueError, KeyError) as e:
        raise PipelineError(f"cannot read the Hugging Face model in {where}: {type(e).__name__}: "
                            f"{str(e).splitlines()[0][:300]}") from None
    problems = llama_config_problems(config)
    if len(tok) > config.vocab_size:
        problems.append(f"its tokenizer has {len(tok)} tokens but the model {config.vocab_size} "
                        "embedding rows")
    if problems:
        raise PipelineError(f"{where} cannot be imported: " + "; ".join(problems) + ".")
    args = model_args_from_hf_config(config, bos_id=tok.bos_token_id)
    from safetensors import SafetensorError
    try:
        hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32, **kw)
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as e:   # missing, truncated, foreign
        raise PipelineError(f"cannot read the weights in {where}: {type(e).__name__}: "
                            f"{str(e).splitlines()[0][:300]}") from None
    sd = from_hf_state_dict(hf.state_dict(), args)
    del hf
    model = create_model(args)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise PipelineError(f"{where}: weights do not fit the model its config describes "
                            f"(missing {missing[:4]}, unexpected {unexpected[:4]}).")
    model.eval()
    return Imported(model, tok, describe(tok, where), config, where)
