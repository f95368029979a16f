"""Tokenizer loading, fingerprinting and description (library; no side effects).

A tokenizer is named by ``tokenizer.name`` in config.json: a Hugging Face hub name (the
seed's ``codellama/CodeLlama-7b-hf``, loaded through AutoTokenizer, from the local cache when
offline), a local directory with tokenizer files, or a SentencePiece ``.model`` file (turned
into a fast, tokenizers-backed Llama tokenizer). Once the ``tokenize`` stage has saved it,
every stage loads it from ``tokenizers/<slug>/`` so no network is needed afterwards.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from utils.cli import PipelineError
from utils.config import Config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
SPECIAL_TOKENS = {"unk": "<unk>", "bos": "<s>", "eos": "</s>", "pad": "<pad>"}


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


def load_tokenizer_from(name: str, cfg: Optional[Config] = None):
    """Load a fast tokenizer from a hub name, a local directory, or a .model/.json file."""
    from transformers import AutoTokenizer, LlamaTokenizer, PreTrainedTokenizerFast

    p = cfg.resolve(name) if cfg is not None else Path(name).expanduser().resolve()
    if p.exists() or looks_like_path(name):
        if not p.exists():
            raise PipelineError(f"tokenizer path {p} does not exist (tokenizer.name = '{name}').")
        try:
            if p.is_file() and p.suffix == ".model":
                with tempfile.TemporaryDirectory() as tmp:
                    shutil.copyfile(p, Path(tmp) / "tokenizer.model")
                    return LlamaTokenizer.from_pretrained(tmp)
            if p.is_file() and p.suffix == ".json":
                return PreTrainedTokenizerFast(tokenizer_file=str(p))
            if p.is_dir():
                if (p / "tokenizer.json").exists() or (p / "tokenizer_config.json").exists():
                    return AutoTokenizer.from_pretrained(str(p))
                if (p / "tokenizer.model").exists():
                    return LlamaTokenizer.from_pretrained(str(p))
                raise PipelineError(f"{p} holds no tokenizer files (expected one of "
                                    f"{', '.join(TOKENIZER_FILES)}).")
        except PipelineError:
            raise
        except Exception as e:  # corrupt or unsupported files
            raise PipelineError(f"cannot load tokenizer from {p}: {type(e).__name__}: {e}") from e
        raise PipelineError(f"{p} is not a tokenizer directory, .model or tokenizer.json file.")
    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as e:
        raise PipelineError(offline_help(name) + f" (Underlying error: {type(e).__name__}.)") from e


def tokenizer_source(cfg: Config) -> tuple[str, Optional[Path]]:
    """What :func:`load_tokenizer` loads: ``(spec, saved folder)`` for the saved copy under
    tokenizers/ when there is one, else ``(tokenizer.name, None)``."""
    d = save_dir(cfg)
    return (str(d), d) if has_tokenizer_files(d) else (cfg.tokenizer.name, None)


def load_tokenizer(cfg: Config):
    """The configured tokenizer: the saved copy under tokenizers/ if present, else tokenizer.name."""
    return load_tokenizer_from(tokenizer_source(cfg)[0], cfg)


def fingerprint(tok) -> str:
    """sha256 of the canonical (sorted-key, compact) JSON serialization of the fast tokenizer."""
    backend = getattr(tok, "backend_tokenizer", tok)
    canonical = json.dumps(json.loads(backend.to_str()), sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


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
