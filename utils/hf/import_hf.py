"""Import a local Hugging Face Llama model (a folder with safetensors, or a ``.gguf`` file that
transformers reads) as this project's model and tokenizer (library; no side effects; local
files only, never the network).

    imported = load_hf_llama(path)       # .model, .tok, .tok_info, .config, .source
    source_tokenizer(path)               # its tokenizer as transformers has it (to export again)

Accepted: ``LlamaForCausalLM`` checkpoints (``model_type`` "llama") with no bias terms, RMSNorm,
a gated MLP whose activation we have (SiLU, GELU, ReLU), default RoPE (no scaling). Refused
with a message naming the setting: other architectures (Mistral's sliding window, MoE, ...),
``attention_bias`` / ``mlp_bias``, RoPE scaling types, a tokenizer larger than the
embedding. The weights are loaded by transformers (so sharded safetensors and GGUF
de-quantization work as there) and renamed by utils/hf/mapping.py; the logits equal
transformers' on the same input (tests/test_export.py).

Damaged or inconsistent input is a PipelineError naming the file and the field or tensor:
a config.json that is not JSON or has values of the wrong type or range, damaged tokenizer
files (checked as every tokenizer folder is, by utils.data.tok.load_tokenizer_folder: the
small JSON files before transformers reads them, tokenizer.json when loading fails), weights
that are missing, left over (a bias tensor in a bias-free model), of another shape than the
config gives, not floating point, or not finite, a truncated file.
transformers itself would fill a missing tensor with random values and drop an unexpected
one with a warning; an import never does.
"""
from __future__ import annotations

import functools
import json
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig,
                          PreTrainedTokenizerFast)

from model import create_model, layer_count
from utils.activations import HF_ACT_NAMES
from utils.cli import PipelineError
from utils.config import ConfigError
from utils.data.chat import adds_bos, rules_of_hf
from utils.data.tok import as_exported_from, describe, load_tokenizer_folder, plain
from utils.hf.export import hf_source
from utils.hf.inputs import check_config_json, generation_config_notice, read_gguf, weight_files
from utils.hf.mapping import HF_CONFIG_NAMES, from_hf_state_dict, model_args_from_hf_config


@dataclass
class Imported:
    model: object            # model.Transformer, eval mode, fp32, CPU
    tok: object              # the model's own tokenizer (special-token strings stay text)
    tok_info: dict           # utils.data.tok.describe
    config: object           # the transformers config
    source: str              # what was read
    rules: object            # utils.data.chat.Rules: its chat template, BOS rule, stop ids, defaults


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


def source_tokenizer(path):
    """The transformers tokenizer of a Hugging Face folder or .gguf file as transformers loads
    it (its own settings and chat template; what an export of the import writes again)."""
    folder, gguf = _split(Path(path))
    if gguf:
        return _gguf_tokenizer(folder / gguf, str(folder / gguf))
    return load_tokenizer_folder(folder, imported=True)


def _tokenizers(folder: Path, gguf: Optional[str], where: str) -> tuple:
    """(whether the tokenizer as read adds a BOS, the tokenizer an import uses: an export's own
    post-processor put back, in place, special-token text plain). The folder's tokenizer files
    are checked by utils.data.tok, tokenizer.json only if loading fails."""
    tok = _gguf_tokenizer(folder / gguf, where) if gguf else load_tokenizer_folder(folder, imported=True)
    bos_rule = adds_bos(tok)             # before an export's own post-processor is put back
    return bos_rule, plain(tok if gguf else as_exported_from(tok, folder))


def imported_tokenizer(path) -> tuple:
    """(tokenizer, where): the tokenizer an import of ``path`` (a Hugging Face folder or .gguf
    file) trains with, without reading its weights: what data prepared for it is tokenized
    with (``sft prepare --for``)."""
    folder, gguf = _split(Path(path))
    where = str(folder / gguf) if gguf else str(folder)
    return _tokenizers(folder, gguf, where)[1], where


def llama_config_problems(c) -> list[str]:
    """What of a transformers config this project's model cannot represent."""
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
    quant = getattr(c, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        out.append(f"quantization_config (quant_method {str(method)!r}): quantized weights (GPTQ, AWQ, "
                   "bitsandbytes ...) are not imported; give the model's unquantized weights (float32, "
                   "float16 or bfloat16 safetensors)")
    hd, d, h = getattr(c, "head_dim", None), getattr(c, "hidden_size", None), getattr(c, "num_attention_heads", None)
    if hd is not None and isinstance(d, int) and isinstance(h, int) and h > 0 and hd != d // h:
        out.append(f"head_dim {hd} differs from hidden_size / num_attention_heads ({d} / {h} = {d // h}): "
                   "this model's attention heads are hidden_size / num_attention_heads wide (a separate "
                   "head_dim is not supported)")
    rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind not in (None, "default"):
        out.append(f"RoPE scaling '{kind}' is not implemented (only plain RoPE)")
    if getattr(c, "pretraining_tp", 1) not in (None, 1):
        out.append("pretraining_tp > 1 is not supported")
    return out


def load_hf_llama(path) -> Imported:
    """The model and tokenizer of a local Hugging Face Llama folder or GGUF file."""
    folder, gguf = _split(Path(path))
    # generation_config.json is read by utils.data.chat (its stop ids and explicit sampling
    # settings) when it is usable; a bad one is said once and ignored, not refused
    kw = {"gguf_file": gguf} if gguf else {"generation_config": GenerationConfig()}
    where = str(folder / gguf) if gguf else str(folder)
    note = None
    if gguf:                    # the raw values first: transformers divides by them, indexes by them
        _gguf_header(folder / gguf)
    else:
        check_config_json(folder)
        note = generation_config_notice(folder)
        if note:
            print(f"notice: {note}", file=sys.stderr)
    config = _read(lambda: AutoConfig.from_pretrained(folder, local_files_only=True,
                                                      **({"gguf_file": gguf} if gguf else {})),
                   where if gguf else str(folder / "config.json"))
    problems = llama_config_problems(config)
    if problems:
        raise PipelineError(f"{where} cannot be imported: " + "; ".join(problems) + ".")
    bos_rule, tok = _tokenizers(folder, gguf, where)
    if len(tok) > config.vocab_size:
        raise PipelineError(f"{where} cannot be imported: its tokenizer has {len(tok)} tokens but "
                            f"the model {config.vocab_size} embedding rows.")
    args = _model_args(config, tok.bos_token_id, where if gguf else str(folder / "config.json"))
    if not gguf:
        check_weight_files(folder, config)
    else:
        _check_layer_count(_gguf_header(folder / gguf)[1], r"blk\.(\d+)\.", config, where)
    hf, info = _read(lambda: AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, dtype=torch.float32, output_loading_info=True, **kw),
        f"the weights in {where}")
    _check_loading(info, where)
    sd = from_hf_state_dict(hf.state_dict(), args)
    del hf
    bad = [k for k, v in sd.items() if not torch.isfinite(v).all()]
    if bad:
        raise PipelineError(f"{where}: non-finite weights (NaN or inf) in {', '.join(bad[:4])}.")
    model = create_model(args)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise PipelineError(f"{where}: weights do not fit the model its config describes "
                            f"(missing {missing[:4]}, unexpected {unexpected[:4]}).")
    model.eval()
    rules = rules_of_hf(tok, bos_rule, config, None if gguf else folder, where, generation_file_usable=note is None,
                        files=hf_source(folder / gguf if gguf else folder))
    return Imported(model, tok, describe(tok, where), config, where, rules)


def _read(load, what: str):
    """``load()``, its failures on damaged input (not JSON, wrong types, truncated, missing;
    a binary header whose counts or lengths point past the end of the file: struct.error,
    IndexError, OverflowError, EOFError; nesting too deep) as one PipelineError naming ``what``."""
    try:
        return load()
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError, StrictDataclassError,
            struct.error, IndexError, OverflowError, EOFError, RecursionError) as e:
        text = " ".join(str(e).split())[:400]
        if isinstance(e, (struct.error, IndexError, OverflowError, EOFError)):
            raise PipelineError(f"cannot read {what}: truncated or damaged ({text}).") from None
        raise PipelineError(f"cannot read {what}: {type(e).__name__}: {text}") from None


def _model_args(config, bos_id: Optional[int], what: str):
    """ModelArgs of the config, its values out of range or of the wrong type named by their
    config.json keys."""
    try:
        return model_args_from_hf_config(config, bos_id=bos_id)
    except ConfigError as e:
        problems = [re.sub(r"model\.(\w+)", lambda m: HF_CONFIG_NAMES.get(m.group(1), m.group(1)), p)
                    for p in e.problems]
        raise PipelineError(f"{what}: " + "; ".join(problems) + ".") from None
    except (ValueError, TypeError) as e:
        raise PipelineError(f"{what}: {e}.") from None


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")   # safetensors' names of what a weight can be


def check_weight_files(folder: Path, config) -> None:
    """Each of the folder's safetensors files is readable, and each tensor in it floating point
    (an integer tensor would be cast into nonsense weights) of the shape ``config`` gives it
    (read from the headers: no weights are loaded)."""
    from transformers import LlamaForCausalLM   # sets an environment variable: see utils/hf/export.py write_hf
    files = {}
    for f in weight_files(Path(folder)):
        try:
            with safe_open(str(f), "pt") as st:
                files[f] = [(k, st.get_slice(k).get_dtype(), tuple(st.get_slice(k).get_shape()))
                            for k in st.keys()]
        except (OSError, SafetensorError) as e:
            raise PipelineError(f"cannot read the weights in {f}: {type(e).__name__}: "
                                f"{' '.join(str(e).split())[:300]}") from None
    _check_layer_count([k for ts in files.values() for k, _, _ in ts], r"model\.layers\.(\d+)\.", config,
                       str(Path(folder) / "config.json"))
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(config).state_dict().items()}
    for f, tensors in files.items():
        for k, dtype, shape in tensors:
            if dtype not in FLOAT_DTYPES:
                raise PipelineError(f"{f}: tensor {k} is {dtype}, not floating point (weights "
                                    f"are {', '.join(FLOAT_DTYPES)}).")
            if k in shapes and shape != shapes[k]:
                raise PipelineError(f"{f}: tensor {k} has shape {shape}, but config.json gives "
                                    f"{shapes[k]}.")


def _gguf_tokenizer(path: Path, where: str, say=lambda s: print(s, file=sys.stderr)):
    """The tokenizer of a GGUF file as transformers builds it, without the tokens transformers
    adds past the file's own: its byte-level BPE builder (GPT2Tokenizer) adds "<|endoftext|>"
    when the vocabulary lacks it (every GGUF exported with a BPE tokenizer of ours), an id the
    model has no embedding row for. Such ids are left out (said once); encoding and decoding of
    the file's tokens are unchanged."""
    n = _gguf_header(path)[0]          # the header checked before transformers reads it
    tok = _read(lambda: AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True),
                where)
    n = len(tok) if n is None else n
    extra = sorted((i, t.content) for i, t in tok.added_tokens_decoder.items() if i >= n)
    if not extra or len(tok) - len(extra) != n:
        return tok
    gone = {c for _, c in extra}
    data = json.loads(tok.backend_tokenizer.to_str())
    data["added_tokens"] = [a for a in data.get("added_tokens", []) if a["id"] < n]
    if isinstance(data["model"].get("vocab"), dict):
        data["model"]["vocab"] = {k: i for k, i in data["model"]["vocab"].items() if i < n}
    special = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
               if getattr(tok, k, None) is not None and getattr(tok, k) not in gone}
    out = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)),
                                  clean_up_tokenization_spaces=getattr(tok, "clean_up_tokenization_spaces", False),
                                  **special)
    out.chat_template = getattr(tok, "chat_template", None)
    say(f"{where}: left out {', '.join(f'{c!r} (id {i})' for i, c in extra)}, which transformers adds to a "
        f"byte-level vocabulary that lacks it: the file has {n} tokens and the model no row for more.")
    return out


def _gguf_header(path: Path) -> tuple[Optional[int], list[str]]:
    """(tokens in its vocabulary or None, tensor names) of a GGUF file, read by the ``gguf``
    package (a file's header is read once per import, kept for the same file unchanged)."""
    st = path.stat()
    return _gguf_header_of(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _gguf_header_of(path: str, mtime_ns: int, size: int) -> tuple[Optional[int], list[str]]:
    reader = read_gguf(Path(path))
    field = reader.fields.get("tokenizer.ggml.tokens")
    return (None if field is None else len(field.data)), [t.name for t in reader.tensors]


def _check_layer_count(names: list[str], pattern: str, config, where: str) -> None:
    """The config's layer count against the layers the weight files hold (``pattern`` captures
    a tensor name's layer index), before any model of that config is built: a config asking for
    a billion layers would otherwise be built layer by layer (on the meta device, still a hang)."""
    held = layer_count(names, pattern)
    if held != config.num_hidden_layers:
        raise PipelineError(f"{where}: the config gives {config.num_hidden_layers:,} layers but the weights "
                            f"hold {held}.")


def _check_loading(info: dict, where: str) -> None:
    """Refuse what transformers would paper over: missing tensors (it initializes them at
    random) and unexpected ones (it drops them). A shape that differs from the config's it
    refuses itself (and check_weight_files names it first for safetensors)."""
    missing = sorted(k for k in info.get("missing_keys", ()) if not k.endswith("rotary_emb.inv_freq"))
    unexpected = sorted(info.get("unexpected_keys", ()))
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) the config needs are missing ({', '.join(missing[:4])})")
    if unexpected:
        problems.append(f"{len(unexpected)} tensor(s) a Llama of this config has no place for "
                        f"({', '.join(unexpected[:4])}: bias terms, another architecture?)")
    problems += [" ".join(str(m).split())[:300] for m in info.get("error_msgs") or []]
    problems += [f"{k}: {v}" for k, v in (info.get("conversion_errors") or {}).items()]
    if problems:
        raise PipelineError(f"{where}: the weights do not match its config: " + "; ".join(problems) + ".")
