"""The raw files of a Hugging Face model folder or a GGUF file, checked before transformers
reads them (library; no side effects; used by utils/hf/import_hf.py).

transformers trusts what it reads: it divides by ``num_attention_heads`` while validating a
config, reads a GGUF file's token list by index, and so on; a zero, a list where an object
belongs or a count past the end of a file surfaces there as ZeroDivisionError, AttributeError
or IndexError. Each function here reads the values themselves (JSON as parsed, the GGUF header
through the ``gguf`` package's reader) and raises one PipelineError naming the file, the key or
field and what is wrong with it. The folder's tokenizer files are checked where every tokenizer
folder is, by utils.data.tok.load_tokenizer_folder.

    read_json_object(path)            the parsed JSON object of a file (PipelineError otherwise)
    check_config_json(folder)         config.json's sizes and numbers (before AutoConfig)
    weight_files(folder)              the safetensors files transformers loads (model.safetensors
                                      or the index's shards), refusing .bin pickles by name
    generation_config_notice(folder)  None, or why generation_config.json is unusable (it is ignored)
    read_gguf(path)                   a GGUFReader of the file, its header and metadata checked
"""
from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Optional

import gguf
from transformers import GenerationConfig

from utils.cli import PipelineError
from utils.config import json_type, read_json_object_file

# config.json's sizes: positive integers when present (None allowed where transformers derives one)
CONFIG_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "head_dim")
CONFIG_NULLABLE = ("num_key_value_heads", "head_dim")
CONFIG_NUMBERS = ("rms_norm_eps", "rope_theta", "initializer_range", "attention_dropout")
CONFIG_POSITIVE = ("rms_norm_eps", "rope_theta")            # of those, the ones only > 0 makes sense of
CONFIG_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias")   # true / false when present
PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]


def _json_object(path: Path, keys: str = "") -> tuple[Optional[dict], str]:
    """(the JSON object in ``path``, "") or (None, what is wrong with the file), worded as
    everywhere (``utils.config.read_json_object_file``); ``keys``: examples of what it holds."""
    data, why = read_json_object_file(path)
    if data is None and keys and why.endswith("not an object"):
        why += f" (keys such as {keys})"
    return data, why


def read_json_object(path: Path, keys: str = "") -> dict:
    """The JSON object in ``path``: PipelineError naming the file when it is unreadable, not
    UTF-8, not JSON (an integer of 4,300+ digits, nesting too deep) or not an object (``keys``:
    examples of what it holds, for the message)."""
    data, why = _json_object(path, keys)
    if data is None:
        raise PipelineError(f"{path} {why}; fix or replace the file.")
    return data


def _kind(v) -> str:
    return f"a JSON {json_type(v)}"


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_config_json(folder: Path) -> dict:
    """config.json's object, its sizes positive integers, its numbers finite (``rms_norm_eps``
    and ``rope_theta`` above 0) and its flags true or false, checked on the values as written
    (transformers divides by the head counts while it validates them, and words a wrong type
    in its own terms)."""
    path = Path(folder) / "config.json"
    conf = read_json_object(path, "model_type, hidden_size")
    p = []
    for key in CONFIG_SIZES:
        v = conf.get(key)
        if key in conf and not (v is None and key in CONFIG_NULLABLE) and not _positive_int(v):
            p.append(f"{key}: expected a positive integer, got {v!r}")
    numbers = [(k, conf[k]) for k in CONFIG_NUMBERS if conf.get(k) is not None]
    for block in ("rope_parameters", "rope_scaling"):
        v = conf.get(block)
        if v is not None and not isinstance(v, dict):
            p.append(f"{block}: expected an object (rope_type, rope_theta ...), got {_kind(v)}")
        elif isinstance(v, dict) and v.get("rope_theta") is not None:
            numbers.append((f"{block}.rope_theta", v["rope_theta"]))
    for key, v in numbers:
        if not _finite(v):
            p.append(f"{key}: expected a finite number, got {v!r}")
        elif key.rsplit(".", 1)[-1] in CONFIG_POSITIVE and v <= 0:
            p.append(f"{key}: expected a number above 0, got {v!r}")
    for key in CONFIG_FLAGS:
        if conf.get(key) is not None and not isinstance(conf[key], bool):
            p.append(f"{key}: expected true or false, got {conf[key]!r}")
    if p:
        raise PipelineError(f"{path}: " + "; ".join(p) + ".")
    return conf


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files transformers loads from ``folder``: model.safetensors, else the
    shards model.safetensors.index.json names (each a file of this folder). Pickled weights
    (pytorch_model.bin ...) are never loaded: unpickling a file can run any code in it."""
    folder = Path(folder)
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        wm = read_json_object(index, "weight_map").get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise PipelineError(f"{index}: weight_map: expected an object of tensor name -> shard file "
                                f"name, got {_kind(wm) if wm is not None else 'nothing'}.")
        files = set()
        for k, v in wm.items():
            if not isinstance(v, str) or Path(v).name != v or v in (".", "..") or not v.endswith(".safetensors"):
                raise PipelineError(f"{index}: weight_map[{k!r}]: {v!r:.80} is not the name of a "
                                    ".safetensors file in this folder (shards sit beside the index).")
            if not (folder / v).is_file():
                raise PipelineError(f"{index}: weight_map[{k!r}]: shard {v} is not in {folder}.")
            files.add(folder / v)
        return sorted(files)
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    pickled = [n for n in names if n.endswith(PICKLED_WEIGHTS)]
    other = [n for n in names if n.endswith(".safetensors")]
    why = (f" It holds {', '.join(pickled[:3])}: pickled PyTorch weights are not loaded (unpickling can "
           "run any code a file holds); convert them to safetensors where you trust them (transformers' "
           "from_pretrained then save_pretrained writes model.safetensors)." if pickled else "")
    why += (f" {', '.join(other[:3])}: transformers loads model.safetensors or the shards an index names; "
            "rename a single file model.safetensors." if other else "")
    raise PipelineError(f"{folder}: no weights: neither model.safetensors nor model.safetensors.index.json."
                        + (why or " Copy the model's safetensors weights into the folder."))


def generation_config_notice(folder: Path) -> Optional[str]:
    """None when generation_config.json is absent or valid, else why it is not. The pipeline
    never uses the file (infer, serve and benchmark sample with the config's ``inference``
    settings), so a bad one is ignored with this note rather than refused."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return None
    data, why = _json_object(path)
    if data is None:
        return (f"{path} is ignored: it {why} (the pipeline samples with the config's inference "
                "settings, never with this file).")
    try:
        GenerationConfig.from_dict(dict(data)).validate(strict=True)
    except (ValueError, TypeError) as e:    # validate() raises ValueError; a wrong type fails a comparison
        return (f"{path} is ignored: {_short(e)} (the pipeline samples with the config's inference "
                "settings, never with this file).")
    return None


# --------------------------------------------------------------------------- GGUF
# The smallest bytes a tensor-info and a key-value entry take (name length + type + ...):
# counts that could not fit in the file are refused before the reader allocates for them.
_MIN_TENSOR_INFO, _MIN_KV = 8 + 4 + 8 + 4 + 8, 8 + 4 + 1
GGUF_SIZES = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
              "context_length")
GGUF_OPTIONAL_SIZES = ("attention.head_count_kv", "vocab_size", "attention.key_length",
                       "attention.value_length", "rope.dimension_count")
GGUF_NUMBERS = ("rope.freq_base", "attention.layer_norm_rms_epsilon")
GGUF_TOKEN_IDS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id",
                  "seperator_token_id", "cls_token_id", "mask_token_id")


def read_gguf(path: Path):
    """A ``gguf.GGUFReader`` of ``path`` once its header counts fit the file and its metadata
    holds what a Llama import reads, each of the right type and range (PipelineError naming
    the key otherwise)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError as e:
        raise PipelineError(f"cannot read {path}: {e.strerror or e}.") from None
    if size == 0:
        raise PipelineError(f"{path} is empty (0 bytes), not a GGUF file.")
    if head[:4] != b"GGUF":
        raise PipelineError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF').")
    if len(head) < 24:
        raise PipelineError(f"{path}: truncated or damaged: {size} bytes, shorter than a GGUF header.")
    version = struct.unpack("<I", head[4:8])[0]
    if version not in (2, 3):
        raise PipelineError(f"{path}: GGUF.version is {version}; GGUF versions 2 and 3 are read (convert "
                            "the model again with a current llama.cpp).")
    tensors, kvs = struct.unpack("<QQ", head[8:24])
    for key, n, least in (("GGUF.tensor_count", tensors, _MIN_TENSOR_INFO), ("GGUF.kv_count", kvs, _MIN_KV)):
        if n * least > size:
            raise PipelineError(f"{path}: {key} is {n:,}, more entries than the file's {size:,} bytes can "
                                "hold: truncated or damaged.")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, IndexError, struct.error, OverflowError, EOFError) as e:
        # the reader's own failures on a header whose lengths point past the end of the file
        raise PipelineError(f"cannot read {path}: truncated or damaged GGUF header or tensor table "
                            f"({type(e).__name__}: {_short(e)}).") from None
    except OSError as e:
        raise PipelineError(f"cannot read {path}: {e.strerror or e}.") from None
    problems = gguf_problems(reader)
    if problems:
        raise PipelineError(f"{path}: " + "; ".join(problems) + ".")
    return reader


def _scalar(reader, key: str):
    """(present, value) of a scalar field; value None when it is an array or unreadable."""
    f = reader.fields.get(key)
    if f is None:
        return False, None
    if not f.types or f.types[0] == gguf.GGUFValueType.ARRAY:
        return True, None
    return True, f.contents()


def _int_type(t) -> bool:
    V = gguf.GGUFValueType
    return t in (V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64)


def gguf_problems(reader) -> list[str]:
    """What in a GGUF file's metadata and tensor table a Llama import cannot read, each naming
    its key (the sizes positive integers, the numbers finite and positive, the vocabulary a list
    of strings with scores and types of its length, special-token ids inside it, each tensor of
    the shape the sizes give)."""
    _, arch = _scalar(reader, "general.architecture")
    if not isinstance(arch, str):
        return ["general.architecture: missing or not a string (a Llama GGUF says 'llama')"]
    if arch != "llama":
        return [f"general.architecture: {arch!r}: only 'llama' models import"]
    p, sizes = _size_problems(reader)
    p += _head_problems(sizes)
    vocabulary, n_tokens = _vocabulary_problems(reader)
    p += vocabulary + _token_id_problems(reader, n_tokens)
    if not p:
        p += _tensor_problems(reader, sizes, n_tokens)
    return p


def _size_problems(reader) -> tuple[list[str], dict]:
    """The ``llama.*`` sizes (positive integers; the required ones present) and numbers (finite,
    above 0): what is wrong with them, and the sizes that are sound, by name."""
    p, sizes = [], {}
    for name in GGUF_SIZES + GGUF_OPTIONAL_SIZES:
        key = f"llama.{name}"
        there, v = _scalar(reader, key)
        if not there:
            if name in GGUF_SIZES:
                p.append(f"{key}: missing")
            continue
        if not _int_type(reader.fields[key].types[0]) or not _positive_int(v):
            p.append(f"{key}: expected a positive integer, got {v!r}"
                     + ("" if v is not None else f" ({reader.fields[key].types[0].name})"))
        else:
            sizes[name] = v
    for name in GGUF_NUMBERS:
        key = f"llama.{name}"
        there, v = _scalar(reader, key)
        if there and (not _finite(v) or v <= 0):
            p.append(f"{key}: expected a finite number > 0, got {v!r}")
    return p, sizes


def _head_problems(sizes: dict) -> list[str]:
    """The head counts against the width: they divide it, and a head's key and value length is
    the width / head count."""
    p = []
    d, h = sizes.get("embedding_length"), sizes.get("attention.head_count")
    kv = sizes.get("attention.head_count_kv", h)
    if d and h:
        if d % h:
            p.append(f"llama.attention.head_count: {h} does not divide llama.embedding_length ({d})")
        elif kv and h % kv:
            p.append(f"llama.attention.head_count_kv: {kv} does not divide llama.attention.head_count ({h})")
        for name in ("attention.key_length", "attention.value_length"):
            if name in sizes and not d % h and sizes[name] != d // h:
                p.append(f"llama.{name}: {sizes[name]} differs from embedding_length / head_count "
                         f"({d // h}): this pipeline's heads are embedding_length / head_count wide")
    return p


def _vocabulary_problems(reader) -> tuple[list[str], Optional[int]]:
    """The tokenizer's kind, its token list (an array of strings) and the arrays beside it (one
    entry per token): what is wrong with them, and the number of tokens (None: unreadable)."""
    V = gguf.GGUFValueType
    p = []
    there, model = _scalar(reader, "tokenizer.ggml.model")
    if not isinstance(model, str):
        p.append(f"tokenizer.ggml.model: {'missing' if not there else 'not a string'} (expected 'llama' "
                 "or 'gpt2')")
    elif model not in ("llama", "gpt2"):
        p.append(f"tokenizer.ggml.model: {model!r}: this pipeline reads 'llama' (SentencePiece) and "
                 "'gpt2' (byte-level BPE) vocabularies")
    tf = reader.fields.get("tokenizer.ggml.tokens")
    n_tokens = None
    if tf is None:
        p.append("tokenizer.ggml.tokens: missing (the vocabulary)")
    elif tf.types[:2] != [V.ARRAY, V.STRING]:
        p.append(f"tokenizer.ggml.tokens: expected an array of strings, got "
                 f"{'/'.join(t.name for t in tf.types)}")
    elif not tf.data:
        p.append("tokenizer.ggml.tokens: empty")
    else:
        n_tokens = len(tf.data)
    for name, types in (("scores", (V.FLOAT32, V.FLOAT64)), ("token_type", None), ("merges", (V.STRING,))):
        key = f"tokenizer.ggml.{name}"
        f = reader.fields.get(key)
        if f is None:
            continue
        ok_type = len(f.types) == 2 and f.types[0] == V.ARRAY and (
            f.types[1] in types if types else _int_type(f.types[1]))
        if not ok_type:
            p.append(f"{key}: an array of the wrong type ({'/'.join(t.name for t in f.types)})")
        elif name != "merges" and n_tokens is not None and len(f.data) != n_tokens:
            p.append(f"{key}: {len(f.data):,} entries for {n_tokens:,} tokens (one per token)")
    return p, n_tokens


def _token_id_problems(reader, n_tokens: Optional[int]) -> list[str]:
    """The special-token ids present: integers, each a token of the vocabulary."""
    p = []
    for name in GGUF_TOKEN_IDS:
        key = f"tokenizer.ggml.{name}"
        there, v = _scalar(reader, key)
        if there and (not _int_type(reader.fields[key].types[0]) or isinstance(v, bool) or not isinstance(v, int)
                      or (n_tokens is not None and not 0 <= v < n_tokens)):
            p.append(f"{key}: {v!r} is not a token id of the vocabulary"
                     + (f" (0..{n_tokens - 1})" if n_tokens else ""))
    return p


def _tensor_problems(reader, sizes: dict, n_tokens: Optional[int]) -> list[str]:
    """Each tensor's dimensions (ggml order: the row length first) positive and, for a Llama
    tensor name, the ones the sizes give."""
    d, h, ffn = sizes["embedding_length"], sizes["attention.head_count"], sizes["feed_forward_length"]
    kv = sizes.get("attention.head_count_kv", h)
    vocab = sizes.get("vocab_size", n_tokens)
    hd = d // h
    want = {"token_embd.weight": (d, vocab), "output.weight": (d, vocab), "output_norm.weight": (d,),
            "attn_norm.weight": (d,), "ffn_norm.weight": (d,), "attn_q.weight": (d, h * hd),
            "attn_k.weight": (d, kv * hd), "attn_v.weight": (d, kv * hd), "attn_output.weight": (h * hd, d),
            "ffn_gate.weight": (d, ffn), "ffn_up.weight": (d, ffn), "ffn_down.weight": (ffn, d)}
    out = []
    for t in reader.tensors:
        shape = tuple(int(x) for x in t.shape)
        if not shape or min(shape) < 1:
            out.append(f"tensor {t.name}: dimensions {list(shape)}, expected each >= 1")
            continue
        base = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
        if base in want and shape != want[base]:
            out.append(f"tensor {t.name}: dimensions {list(shape)}, but the metadata gives {list(want[base])}")
        if len(out) >= 4:
            break
    return out
