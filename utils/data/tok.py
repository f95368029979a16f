"""Tokenizer loading, fingerprinting and description (library; no side effects).

A tokenizer is named by ``tokenizer.name`` in config.json: a Hugging Face hub name (the
seed's ``codellama/CodeLlama-7b-hf``, loaded through AutoTokenizer, from the local cache when
offline), a local directory with tokenizer files, or a SentencePiece ``.model`` file. Once the
``tokenize`` stage has saved it, every stage loads it from ``tokenizers/<slug>/`` so no network
is needed afterwards.

Contracts (docs/tokenizer.md):

- SentencePiece models (a ``.model`` file, or a folder or hub repo whose only tokenizer file
  is ``tokenizer.model``) are converted by :mod:`utils.data.spm`, which gives exactly the ids of
  the ``sentencepiece`` library. Models it cannot convert exactly fall back to transformers'
  conversion with a notice on stderr saying the ids may differ from sentencepiece's.
- Text is ordinary text: every tokenizer this module returns has special-token matching off
  (``split_special_tokens``), and :func:`encode_plain` encodes documents so that a literal
  ``<s>``, ``</s>``, ``<unk>`` or any other special-token string gives ordinary pieces. Only
  framing code adds BOS/EOS ids.
- :func:`fingerprint` hashes the tokenizer's canonical serialization together with the ids it
  gives on fixed probe strings, so anything that changes the ids (a new conversion, a
  different library behaviour) changes the fingerprint and marks shards built before as stale.
- A saved copy under tokenizers/ of a SentencePiece model converted by an older, inexact
  conversion is refused with the command that re-saves it.
- A Hugging Face export's tokenizer folder (``export --format hf``) loads as the tokenizer it
  was exported from (:func:`as_exported_from`): same fingerprint, so the original's shards,
  SFT data and checkpoints accept it.
- A damaged tokenizer file is one PipelineError naming the file, what is wrong with it (the
  key, for a field of the wrong type) and what to do (docs/tokenizer.md). The same checks
  (:func:`check_tokenizer_folder`, :func:`load_tokenizer_folder`) serve the tokenizer of a
  Hugging Face model folder being imported (utils/hf/import_hf.py). The small JSON files are
  checked before every load; tokenizer.json only after a load failed, so a sound one is parsed
  once, by transformers.

transformers is imported by the functions that load a tokenizer, not with this module: the
``report`` stage imports it (for the names of a saved copy's files) and loads no tokenizer.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Sequence

from huggingface_hub import hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
from tokenizers import Tokenizer

from utils.cli import PipelineError
from utils.config import Config, json_type, read_json_object_file
from utils.data import spm
from utils.data.textio import replace_surrogates

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
SPECIAL_TOKENS = {"unk": "<unk>", "bos": "<s>", "eos": "</s>", "pad": "<pad>"}
INFO_FILE = "pipeline_tokenizer.json"     # written by the tokenize stage next to a saved copy
INFO_FORMAT = ("pipeline-tokenizer", 1)
# How a SentencePiece model became a fast tokenizer (the ``conversion`` of INFO_FILE; a saved copy
# of a SentencePiece tokenizer whose INFO_FILE has no ``conversion`` key predates it: stale).
SPM_CONVERSION = "utils.data.spm/1"                  # exact
FALLBACK_CONVERSION = "transformers (inexact)"  # model utils.data.spm cannot convert exactly
FINGERPRINT_VERSION = 2
# Probe strings whose ids enter the fingerprint (spaces, tabs, newlines, CJK, emoji, specials).
FINGERPRINT_PROBES = ("x", " x", "  x", "a  b", "a   b \t c\n\nd ", "    def f(x):\n\treturn  x",
                      "Héllo wörld, 日本語の文章。😀🚀 👨‍👩‍👧", "\u00a0nbsp\u0301 ̈",
                      "<s> </s> <unk> <pad> end</s>", "")


def slug(name: str) -> str:
    """Directory name for a tokenizer under tokenizers/: 'codellama/CodeLlama-7b-hf' -> 'CodeLlama-7b-hf'."""
    p = Path(name)
    if p.suffix == ".model" or p.name in TOKENIZER_FILES:
        base = p.parent.name or p.stem
    else:
        base = p.name or str(name)
    return re.sub(r"[^A-Za-z0-9._-]+", "_", base).strip("._") or "tokenizer"


def save_dir(cfg: Config) -> Path:
    """Where the configured tokenizer is (or will be) saved."""
    if cfg.tokenizer.save_dir:
        return cfg.resolve(cfg.tokenizer.save_dir)
    return cfg.path("paths.tokenizers_dir") / slug(cfg.tokenizer.name)


def has_tokenizer_files(d: Path) -> bool:
    """Whether folder d holds a saved tokenizer."""
    return d.is_dir() and any((d / f).exists() for f in TOKENIZER_FILES)


def looks_like_path(name: str) -> bool:
    """Hub names are 'org/name' or 'name'; anything else that is path-shaped is a path."""
    if Path(name).suffix in (".model", ".json") or name.startswith((".", "/", "~")):
        return True
    return name.count("/") > 1


def offline_help(name: str) -> str:
    return (f"Cannot load tokenizer '{name}' from the Hugging Face hub (no network, or not in the "
            "local cache). Offline options: (1) set tokenizer.name in config.json to a local "
            "tokenizer directory or a SentencePiece .model file, e.g. the Llama-style sample "
            "'data/samples/tokenizers/mistral-v1/tokenizer.model' (fetch it with "
            "`python main.py samples`); (2) train one with `python main.py tokenize --train`; "
            "(3) on a machine with network, run `python main.py tokenize` once and copy "
            "tokenizers/ here.")


def _spm_tokenizer(model: Path):
    """A SentencePiece model file as a fast tokenizer: exact (utils.data.spm) when possible, else
    transformers' conversion with a notice. A file that is not a SentencePiece model is a
    PipelineError naming it and what to do."""
    _check_spm_file(model)
    try:
        return _mark(spm.tokenizer_from_spm(model), SPM_CONVERSION, model)
    except spm.SpmUnsupported as e:
        from transformers import LlamaTokenizer     # transformers, 1.6 s: lazy (module docstring)
        print(f"notice: {e} Falling back to transformers' conversion (LlamaTokenizer): its "
              "ids may differ from the sentencepiece library's (docs/tokenizer.md).",
              file=sys.stderr)
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copyfile(model, Path(tmp) / "tokenizer.model")
            return _mark(LlamaTokenizer.from_pretrained(tmp), FALLBACK_CONVERSION)


def _hub_spm_file(name: str) -> Optional[Path]:
    """The hub repo's tokenizer.model (local cache first), or None when it has none.

    Expected: the repo has no tokenizer.model (its tokenizer.json is the tokenizer: None,
    silently), or the file is not in the local cache while offline (None, with one notice
    saying the hub's tokenizer.json is used instead). Anything else propagates."""
    try:
        return Path(hf_hub_download(name, "tokenizer.model"))
    except LocalEntryNotFoundError:
        print(f"notice: '{name}' has no tokenizer.model in the local cache and the hub cannot be "
              "reached; using its tokenizer.json, whose ids may differ from the sentencepiece "
              "library's (docs/tokenizer.md).", file=sys.stderr)
        return None
    except EntryNotFoundError:
        return None


def _from_hub(name: str):
    """A hub tokenizer; a repo with a SentencePiece BPE ``tokenizer.model`` gets the exact
    conversion, keeping the repo's special tokens and added tokens."""
    from transformers import AutoTokenizer     # transformers, 1.6 s: lazy (module docstring)

    tok = AutoTokenizer.from_pretrained(name)
    model = _hub_spm_file(name)
    if model is None or not getattr(tok, "is_fast", False):
        return tok
    try:
        proto = spm.read_model(model)
    except PipelineError:
        return tok
    reason = spm.unsupported(proto)
    if reason:
        print(f"notice: the SentencePiece model of '{name}' has no exact fast conversion "
              f"({reason}); using the hub's tokenizer.json: its ids may differ from the "
              "sentencepiece library's (docs/tokenizer.md).", file=sys.stderr)
        return _mark(tok, FALLBACK_CONVERSION)
    exact = spm.tokenizer_from_spm(model)
    if len(exact) != len(tok):
        print(f"notice: '{name}' adds tokens beyond its SentencePiece model ({len(tok)} vs "
              f"{len(exact)}); using the hub's tokenizer.json: its ids may differ from the "
              "sentencepiece library's (docs/tokenizer.md).", file=sys.stderr)
        return _mark(tok, FALLBACK_CONVERSION)
    return _mark(exact, SPM_CONVERSION, model)


def _mark(tok, conversion: Optional[str], spm_model: Optional[Path] = None):
    """Record how a SentencePiece model was converted (read by :func:`conversion_of`) and the
    model file it came from (:func:`spm_model_of`: the GGUF export writes its pieces)."""
    tok.pipeline_conversion = conversion
    if spm_model is not None:
        tok.pipeline_spm_model = Path(spm_model)
    return tok


def spm_model_of(tok) -> Optional[Path]:
    """The SentencePiece ``.model`` an exactly converted tokenizer was made from, or None."""
    return getattr(tok, "pipeline_spm_model", None)


def conversion_of(tok) -> Optional[str]:
    """:data:`SPM_CONVERSION`, :data:`FALLBACK_CONVERSION`, or None (not from a SentencePiece
    model); the tokenize stage records it in INFO_FILE."""
    return getattr(tok, "pipeline_conversion", None)


def _read_info(d: Path) -> Optional[dict]:
    """INFO_FILE of a tokenizer folder (None when it has none)."""
    info_file = d / INFO_FILE
    if not info_file.is_file():
        return None
    resave = ("re-save the tokenizer with `python main.py tokenize` (add the --config you use), or "
              "point tokenizer.name in config.json to a valid tokenizer folder, tokenizer.json or "
              "SentencePiece .model file.")
    info, why = read_json_object_file(info_file)
    if info is None:
        raise PipelineError(f"{info_file} {why}; {resave}")
    for key, kind, name in (("conversion", str, "a string"), ("kind", str, "a string"),
                            ("source", str, "a string"), ("fingerprint", str, "a string"),
                            ("vocab_size", int, "a whole number")):
        v = info.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, kind)):
            raise PipelineError(f"{info_file} has {key!r} = {json_type(v)} (expected {name}); {resave}")
    if not any(k in info for k in ("kind", "source", "fingerprint")):   # every save writes them
        raise PipelineError(f"{info_file} is damaged: it has none of the keys every saved copy "
                            f"records (kind, source, fingerprint); {resave}")
    return info


def _check_saved_copy(d: Path) -> Optional[str]:
    """The recorded conversion of a saved copy; refuses one of a SentencePiece tokenizer saved
    before conversions were recorded (the old, inexact conversion)."""
    info = _read_info(d)
    if info is None:
        return None
    if "conversion" in info:
        return info["conversion"]
    kind, source = str(info.get("kind", "")), str(info.get("source", ""))
    if kind.startswith("trained"):
        return None
    if kind.startswith("SentencePiece") or source.endswith(".model") or (d / "tokenizer.model").exists():
        raise PipelineError(
            f"the saved tokenizer in {d} was converted from the SentencePiece model of "
            f"'{source}' by an older conversion that does not give sentencepiece's ids (leading "
            "and double spaces differ). Re-save it with `python main.py tokenize` (add the "
            "--config you use); shard sets built with it are stale and must be rebuilt.")
    return None


# --------------------------------------------------------------------------- damaged files
# A tokenizer folder's files, each checked for what transformers or tokenizers would stumble on
# (or silently misread): the message names the file, what is wrong and what to do. The small
# JSON files are checked on every load (microseconds); tokenizer.json, the large one, only
# when loading has failed, to find which file it was. The same checks serve a tokenizer that
# tokenizer.name names and the tokenizer of a Hugging Face model folder being imported
# (``imported``, utils/hf/import_hf.py); only the advice differs (tokenizer.name plays no part
# in an import).
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")
_BOOL_KEYS = ("clean_up_tokenization_spaces", "add_bos_token", "add_eos_token",
              "split_special_tokens", "legacy", "add_prefix_space", "do_lower_case")


def fix_advice(where: Path, imported: bool = False) -> str:
    """What to do about a damaged tokenizer file or folder ``where``; ``imported``: it belongs
    to a Hugging Face model folder being imported (the model's own tokenizer)."""
    folder = where if where.is_dir() else where.parent
    other = ("point tokenizer.name in config.json to a valid tokenizer folder, tokenizer.json "
             "or SentencePiece .model file")
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        if imported:
            return (f"It is in the Hugging Face cache: delete {folder.parent.parent} and download "
                    "the model again.")
        return (f"It is in the Hugging Face cache: delete {folder.parent.parent} so that the next "
                f"run with network downloads it again, or {other}.")
    if imported:
        return ("Replace the damaged or missing files with the model's own (download the model "
                "again; for a folder `python main.py export --format hf` wrote, export it again).")
    if (folder / INFO_FILE).is_file():
        return (f"{folder} is a copy this pipeline saved: save it again with `python main.py "
                f"tokenize` (add the --config you use), or {other}.")
    return f"Replace it with an undamaged copy of the tokenizer, or {other}."


def _damaged(path: Path, why: str, imported: bool = False) -> PipelineError:
    return PipelineError(f"tokenizer file {path} {why}, so the tokenizer cannot be loaded. "
                         f"{fix_advice(path, imported)}")


def _why(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _json_object(path: Path, imported: bool = False):
    """The JSON object in ``path``; a PipelineError naming the file when it is not one."""
    data, why = read_json_object_file(path)
    if data is None:
        raise _damaged(path, why, imported)
    return data


def _token_ok(v) -> bool:
    """A special token as transformers stores it: a string, or an AddedToken's dict."""
    return isinstance(v, str) or (isinstance(v, dict) and isinstance(v.get("content"), str))


def _check_token_fields(path: Path, data: dict, imported: bool) -> None:
    for key in _SPECIAL_KEYS:
        if key in data and data[key] is not None and not _token_ok(data[key]):
            raise _damaged(path, f"has {key!r} = {json_type(data[key])} (expected a string, "
                                 "an object with a string 'content', or null)", imported)
    for key in ("additional_special_tokens", "extra_special_tokens"):
        v = data.get(key)
        items = list(v.values()) if isinstance(v, dict) and key == "extra_special_tokens" else v
        if v is not None and (not isinstance(items, list) or not all(map(_token_ok, items))):
            raise _damaged(path, f"has {key!r} that is not a list of tokens (strings or objects "
                                 "with a string 'content')", imported)


def _check_tokenizer_config(path: Path, imported: bool) -> None:
    data = _json_object(path, imported)
    _check_token_fields(path, data, imported)
    decoder = data.get("added_tokens_decoder")
    if decoder is not None:
        if not isinstance(decoder, dict):
            raise _damaged(path, f"has 'added_tokens_decoder' = {json_type(decoder)} (expected an "
                                 "object of token id -> token)", imported)
        for k, v in decoder.items():
            if not k.isdigit() or not _token_ok(v):
                raise _damaged(path, f"has an 'added_tokens_decoder' entry {k[:40]!r} that is not "
                                     "token id (digits) -> object with a string 'content'", imported)
    mml = data.get("model_max_length")
    if mml is not None and (isinstance(mml, bool) or not isinstance(mml, (int, float))):
        raise _damaged(path, f"has 'model_max_length' = {json_type(mml)} (expected a number)", imported)
    for key in _BOOL_KEYS:
        if data.get(key) is not None and not isinstance(data[key], bool):
            raise _damaged(path, f"has {key!r} = {json_type(data[key])} (expected true or false)", imported)
    for key in ("padding_side", "truncation_side"):
        if data.get(key) is not None and data[key] not in ("left", "right"):
            raise _damaged(path, f"has {key!r} = {str(data[key])[:40]!r} (expected \"left\" or "
                                 "\"right\")", imported)
    if data.get("tokenizer_class") is not None and not isinstance(data["tokenizer_class"], str):
        raise _damaged(path, f"has 'tokenizer_class' = {json_type(data['tokenizer_class'])} "
                             "(expected a string)", imported)
    chat = data.get("chat_template")
    if chat is not None and not isinstance(chat, (str, list)):
        raise _damaged(path, f"has 'chat_template' = {json_type(chat)} (expected a template string or a "
                             "list of named templates)", imported)


def _check_special_tokens_map(path: Path, imported: bool) -> None:
    _check_token_fields(path, _json_object(path, imported), imported)


def _check_added_tokens(path: Path, imported: bool) -> None:
    for k, v in _json_object(path, imported).items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            got = repr(v)[:40] if json_type(v) == "number" else json_type(v)     # -1, 2.5: the value
            raise _damaged(path, f"maps {k[:40]!r} to {got} (expected token -> id, "
                                 "a non-negative integer)", imported)


def check_tokenizer_folder(d: Path, imported: bool = False) -> None:
    """Refuse a tokenizer folder whose small JSON files (tokenizer_config.json,
    special_tokens_map.json, added_tokens.json) are damaged, naming the file: not a regular
    file, not JSON, not UTF-8, truncated, not an object, or a field of the wrong type.
    tokenizer.json is not read here (see :func:`load_tokenizer_folder`). ``imported``: ``d`` is
    a Hugging Face model folder being imported (the advice in the message says so)."""
    for name, check in (("tokenizer_config.json", _check_tokenizer_config),
                        ("special_tokens_map.json", _check_special_tokens_map),
                        ("added_tokens.json", _check_added_tokens)):
        path = d / name
        if path.exists() or path.is_symlink():
            check(path, imported)


def load_tokenizer_folder(d: Path, imported: bool = False):
    """transformers' AutoTokenizer of folder ``d`` (local files only), its small JSON files
    checked first (:func:`check_tokenizer_folder`). tokenizer.json, the large file, is examined
    only when loading fails, to name the damaged file (a sound folder's tokenizer.json is parsed
    by transformers alone); any failure is one PipelineError naming the file, or the folder with
    transformers' reason. ``imported``: as for :func:`check_tokenizer_folder`."""
    from transformers import AutoTokenizer     # transformers, 1.6 s: lazy (module docstring)
    d = Path(d)
    check_tokenizer_folder(d, imported)
    try:
        return AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - find the damaged file and name it
        raise _diagnose_folder(d, e, imported) from None


def _check_spm_file(model: Path, imported: bool = False) -> None:
    """Refuse a ``tokenizer.model`` that is not a SentencePiece model, naming it."""
    if not model.is_file():
        raise _damaged(model, "is not a regular file", imported)
    try:
        spm.read_model(model)
    except OSError as e:
        raise _damaged(model, f"cannot be read ({e.strerror or e})", imported) from None
    except PipelineError as e:
        why = str(e).split(" is not a SentencePiece model", 1)[-1].strip(" .")
        raise _damaged(model, f"is not a SentencePiece model {why}".rstrip(), imported) from None


def _diagnose_tokenizer_json(path: Path, imported: bool = False) -> Optional[PipelineError]:
    """Why ``tokenizer.json`` cannot be loaded (a PipelineError naming it, raised when it is not
    a JSON object, returned when the tokenizers library refuses it), or None if it can."""
    data = _json_object(path, imported) if path.exists() or path.is_symlink() else None
    if data is None:
        return None
    try:
        Tokenizer.from_str(json.dumps(data))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a plain Exception
        return _damaged(path, f"is not a tokenizer the tokenizers library can read ({_why(e)})", imported)
    return None


def _diagnose_folder(d: Path, error: BaseException, imported: bool = False) -> PipelineError:
    """The error for a tokenizer folder that transformers could not load: the damaged file
    named when one is found, else the folder with transformers' own reason."""
    found = _diagnose_tokenizer_json(d / "tokenizer.json", imported)
    if found is not None:
        return found
    if not (d / "tokenizer.json").exists():
        model = d / "tokenizer.model"
        if model.exists():
            _check_spm_file(model, imported)    # raises, naming it, when it is damaged
        else:
            has = "tokenizer_config.json but " if (d / "tokenizer_config.json").exists() else ""
            return PipelineError(
                f"{d} has {has}neither tokenizer.json nor tokenizer.model, so the tokenizer "
                f"cannot be loaded. {fix_advice(d, imported)}")
    return PipelineError(f"cannot load the tokenizer in {d} ({_why(error)}). {fix_advice(d, imported)}")


def load_tokenizer_from(name: str, cfg: Optional[Config] = None):
    """Load a fast tokenizer from a hub name, a local directory, or a .model/.json file.

    The result never matches special-token strings inside text (see :func:`plain`)."""
    return plain(_load(name, cfg))


def _load(name: str, cfg: Optional[Config]):
    # transformers is imported per branch: AutoTokenizer's import is a large part of a stage's
    # start-up (perf/loader.py's "user path"), and a .model or tokenizer.json file does not need it.
    p = cfg.resolve(name) if cfg is not None else Path(name).expanduser().resolve()
    if p.exists() or looks_like_path(name):
        if not p.exists():
            raise PipelineError(f"tokenizer path {p} does not exist (tokenizer.name = '{name}').")
        try:
            if p.is_file() and p.suffix == ".model":
                return _spm_tokenizer(p)
            if p.is_file() and p.suffix == ".json":
                from transformers import PreTrainedTokenizerFast     # 1.6 s: lazy (module docstring)
                try:
                    return PreTrainedTokenizerFast(tokenizer_file=str(p))
                except Exception as e:  # noqa: BLE001 - named below, with the file
                    raise _diagnose_tokenizer_json(p) or _damaged(p, _why(e)) from None
            if p.is_dir():
                if (p / "tokenizer.json").exists() or (p / "tokenizer_config.json").exists():
                    conversion = _check_saved_copy(p)
                    model = p / "tokenizer.model"
                    tok = as_exported_from(load_tokenizer_folder(p), p)
                    spm_model = model if conversion == SPM_CONVERSION and model.is_file() else None
                    if spm_model is not None:
                        _check_spm_file(spm_model)
                    return _mark(tok, conversion, spm_model)
                if (p / "tokenizer.model").exists():
                    return _spm_tokenizer(p / "tokenizer.model")
                raise PipelineError(f"{p} holds no tokenizer files (expected one of "
                                    f"{', '.join(TOKENIZER_FILES)}). Point tokenizer.name in "
                                    "config.json to a tokenizer folder, tokenizer.json or "
                                    "SentencePiece .model file.")
        except PipelineError:
            raise
        except Exception as e:  # corrupt or unsupported files
            raise PipelineError(f"cannot load tokenizer from {p}: {_why(e)}. "
                                f"{fix_advice(p)}") from e
        raise PipelineError(f"{p} is not a tokenizer directory, .model or tokenizer.json file.")
    try:
        return _from_hub(name)
    except Exception as e:
        damaged = _damaged_hub_cache(name)
        if damaged is not None:
            raise damaged from None
        raise PipelineError(offline_help(name) + f" (Underlying error: {type(e).__name__}.)") from e


def _damaged_hub_cache(name: str) -> Optional[PipelineError]:
    """When a hub tokenizer fails to load: the error naming a damaged file of its copy in the
    local Hugging Face cache, or None (nothing cached, or nothing found damaged)."""
    try:
        cached = [try_to_load_from_cache(name, f) for f in (*TOKENIZER_FILES, "special_tokens_map.json")]
    except Exception:  # noqa: BLE001 - not a valid repo id: nothing to say
        return None
    folders = [Path(c).parent for c in cached if isinstance(c, str)]
    if not folders:
        return None
    d = folders[0]
    try:
        check_tokenizer_folder(d)
        found = _diagnose_tokenizer_json(d / "tokenizer.json")
        if found is None and (d / "tokenizer.model").exists():
            _check_spm_file(d / "tokenizer.model")
        return found
    except PipelineError as e:
        return e


def backend_of(tok):
    """The ``tokenizers.Tokenizer`` behind a transformers fast tokenizer (or tok itself)."""
    return getattr(tok, "backend_tokenizer", tok)


def decode_fn(tok):
    """``ids -> tok.decode(ids, skip_special_tokens=True)``, calling the ``tokenizers`` backend
    directly where transformers' decode would add nothing (no ``clean_up_tokenization_spaces``):
    transformers' wrapper costs more per call than the decode itself, and generation's
    incremental detokenization calls it twice per token."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and not getattr(tok, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def plain(tok):
    """Turn special-token matching off: text such as ``"<s>"`` encodes as ordinary pieces.

    Sets transformers' ``split_special_tokens`` default and the backend's
    ``encode_special_tokens``. The backend flag is not serialized (``to_str``/pickle), so code
    that rebuilds a backend (worker processes) calls this, or :func:`encode_plain`, again.
    Returns ``tok``.
    """
    if hasattr(tok, "split_special_tokens"):
        tok.split_special_tokens = True
    backend = backend_of(tok)
    if hasattr(backend, "encode_special_tokens"):
        backend.encode_special_tokens = True
    return tok


def encode_plain(tok, texts: Sequence[str]) -> list[list[int]]:
    """Ids of each text as ordinary text: no BOS/EOS, and no special id for a literal special-
    token string inside it. ``tok`` is a transformers fast tokenizer or a tokenizers backend.
    A lone surrogate (a JSON ``"\\ud800"`` escape: legal JSON, not Unicode text, refused by
    the tokenizers library with a TypeError) is encoded as U+FFFD
    (utils.data.textio.replace_surrogates); the good texts of a batch cost nothing extra."""
    texts = list(texts)
    if not texts:
        return []
    backend = backend_of(tok)
    if not hasattr(backend, "encode_batch"):   # a slow (Python) tokenizer
        texts = [_valid_text(t) for t in texts]
        return [list(ids) for ids in tok(texts, add_special_tokens=False,
                                         split_special_tokens=True)["input_ids"]]
    backend.encode_special_tokens = True
    encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
    try:
        return [e.ids for e in encode(texts, add_special_tokens=False)]
    except TypeError:
        repaired = [_valid_text(t) for t in texts]
        if repaired == texts:
            raise                              # not a surrogate: a caller's bug, not data
    return [e.ids for e in encode(repaired, add_special_tokens=False)]


def _valid_text(text):
    return replace_surrogates(text)[0] if isinstance(text, str) else text


def special_merges(tok) -> list[tuple[str, str]]:
    """BPE merges whose result is a special-token string (they would turn text into a special
    id even with special-token matching off); empty for a sound tokenizer."""
    backend = backend_of(tok)
    data = json.loads(backend.to_str())
    model = data.get("model", {})
    if model.get("type") != "BPE":
        return []
    specials = {t["content"] for t in data.get("added_tokens", []) if t.get("special")}
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in model.get("merges", [])]
    return [m for m in merges if "".join(m) in specials]


def tokenizer_source(cfg: Config) -> tuple[str, Optional[Path]]:
    """What :func:`load_tokenizer` loads: ``(spec, saved folder)`` for the saved copy under
    tokenizers/ when there is one, else ``(tokenizer.name, None)``."""
    d = save_dir(cfg)
    return (str(d), d) if has_tokenizer_files(d) else (cfg.tokenizer.name, None)


def load_tokenizer(cfg: Config):
    """The configured tokenizer: the saved copy under tokenizers/ if present, else tokenizer.name."""
    return load_tokenizer_from(tokenizer_source(cfg)[0], cfg)


def fingerprint(tok) -> str:
    """sha256 over the canonical (sorted-key, compact) JSON serialization of the fast tokenizer
    and the ids it gives, as ordinary text, on :data:`FINGERPRINT_PROBES` (version
    :data:`FINGERPRINT_VERSION`). Two tokenizers that encode differently never share it."""
    backend = backend_of(tok)
    canonical = json.dumps(json.loads(backend.to_str()), sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False)
    probes = encode_plain(backend, FINGERPRINT_PROBES)
    h = hashlib.sha256(f"pipeline-tokenizer-fingerprint/{FINGERPRINT_VERSION}\n".encode())
    h.update(canonical.encode("utf-8"))
    h.update(("\n" + json.dumps(probes, separators=(",", ":"))).encode())
    return h.hexdigest()


def special_ids(tok) -> dict:
    return {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "unk": tok.unk_token_id,
            "pad": tok.pad_token_id}


def describe(tok, name: str) -> dict:
    """What shards and checkpoints record about a tokenizer."""
    return {"name": name, "vocab_size": len(tok), **{f"{k}_id": v for k, v in special_ids(tok).items()},
            "fingerprint": fingerprint(tok)}


def require_bos_eos(tok, name: str) -> tuple[int, int]:
    bos, eos = tok.bos_token_id, tok.eos_token_id
    if bos is None or eos is None:
        raise PipelineError(f"tokenizer '{name}' has no BOS or EOS token (bos={bos}, eos={eos}); "
                            "documents are stored as BOS + tokens + EOS, so both are required.")
    return bos, eos


# --------------------------------------------------------------------------- exports
def export_info(tok, source: str) -> dict:
    """INFO_FILE of a Hugging Face export (utils/hf/export.py): the tokenizer's description
    (its fingerprint) and its own post-processor, which the export replaces by one that puts
    BOS in front of each text, as transformers users expect."""
    own = json.loads(backend_of(tok).to_str()).get("post_processor")
    return {**_info(tok, source), "exported": {"post_processor": own}}


def as_exported_from(tok, folder: Path):
    """A tokenizer folder written by ``export --format hf`` as the tokenizer it was exported
    from: the post-processor INFO_FILE records is put back when that gives exactly the recorded
    fingerprint (the folder's tokenizer is the original plus the export's BOS post-processor,
    which :func:`encode_plain` never applies), so shards, SFT data and checkpoints of the
    original accept it. Otherwise (edited since, or not an export) ``tok`` as it is. Returns tok."""
    info = _read_info(Path(folder))
    record = (info or {}).get("exported")
    if not isinstance(record, dict):
        return tok
    backend = backend_of(tok)
    data = json.loads(backend.to_str())
    data["post_processor"] = record.get("post_processor")
    try:
        original = Tokenizer.from_str(json.dumps(data))
    except Exception as e:  # tokenizers raises a plain Exception for a malformed component
        original, why = None, f"its recorded post-processor does not load ({e})"
    else:
        why = "its tokenizer changed since the export"
    if original is None or fingerprint(original) != info.get("fingerprint"):
        print(f"notice: {folder} was exported from tokenizer {str(info.get('fingerprint'))[:12]} "
              f"but {why}; it is used as it is, with its own fingerprint.", file=sys.stderr)
        return tok
    backend.post_processor = original.post_processor
    return tok


# --------------------------------------------------------------------------- saved copies
def _info(tok, source: str) -> dict:
    return {"format": INFO_FORMAT[0], "version": INFO_FORMAT[1], "source": source,
            "class": type(tok).__name__, "conversion": conversion_of(tok), **describe(tok, source),
            "special_tokens": special_tokens(tok),
            "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


# What a tokenizer save writes (save_pretrained, the SentencePiece model, our info file, the
# stage's resolved config): a folder holding anything else is never replaced by a save.
SAVED_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                         "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
                         "chat_template.jinja", "chat_template.json", "resolved_config.json", INFO_FILE})


def _not_replaceable(directory: Path, ours: bool) -> Optional[str]:
    """Why a save may not replace ``directory`` (None: it may): it must be absent, empty, or
    hold only files a tokenizer save writes (``SAVED_FILES``, no folders or links), and with
    ``ours`` also this pipeline's info file (an earlier save, not a folder a user filled)."""
    if not directory.exists() and not directory.is_symlink():
        return None
    if directory.is_symlink() or not directory.is_dir():
        return "it is not a folder"
    entries = sorted(directory.iterdir())
    other = [e.name for e in entries if e.name not in SAVED_FILES or e.is_symlink() or not e.is_file()]
    if other:
        more = f" and {len(other) - 5} more" if len(other) > 5 else ""
        return f"it holds {', '.join(other[:5])}{more}, which a tokenizer save does not write"
    if ours and entries and not (directory / INFO_FILE).is_file():
        return f"it has no {INFO_FILE}: not a tokenizer this pipeline saved"
    return None


def save_tokenizer(tok, directory: Path, source: str, extra: Optional[dict] = None) -> dict:
    """save_pretrained into ``directory`` plus pipeline_tokenizer.json; returns that info.

    Written into a sibling temp directory first and then moved into place, so an interrupted
    save never leaves a half-written tokenizer where the other stages look for one. Replaces
    only an earlier save (or an empty folder): any other existing ``directory`` (a file, a
    folder holding other files: ``--save-dir .`` once took a source checkout) is refused with
    a PipelineError before anything is written.
    """
    directory = Path(directory).absolute()
    tmp = directory.with_name(directory.name + ".tmp")
    for place, ours in ((directory, True), (tmp, False)):
        why = _not_replaceable(place, ours)
        if why is not None:
            raise PipelineError(f"{place} already exists and {why}; a tokenizer save replaces only an "
                                "earlier save. Nothing was changed: choose another folder (--save-dir, "
                                "--output) or move that one away first.")
    directory.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    info = _info(tok, source)
    if extra:
        info.update(extra)
    try:
        tok.save_pretrained(str(tmp))
        model = spm_model_of(tok)
        if model is not None:      # the SentencePiece pieces and scores (the GGUF export writes them)
            shutil.copyfile(model, tmp / "tokenizer.model")
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n",
                                     encoding="utf-8")
    except BaseException:          # a full disk, Ctrl-C ...: no half-written copy left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return info


def special_tokens(tok) -> dict:
    """{'bos': '<s>', ...} (None when the tokenizer has no such token)."""
    return {"bos": tok.bos_token, "eos": tok.eos_token, "unk": tok.unk_token, "pad": tok.pad_token}
