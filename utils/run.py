"""What a run folder and its checkpoints say about the run (library; no side effects).

Contract: a checkpoint opens with the tokenizer it was trained with, whatever today's
config.json names. :func:`tokenizer_for_checkpoint` looks, in order, at

1. the run's own tokenizer: what the checkpoint's stored config resolves to (its saved copy
   under the run's ``tokenizers/`` folder, else its ``tokenizer.name``, relative paths taken
   against the run's ``paths.root``), then the ``name`` the checkpoint's tokenizer record
   gives, against the same root;
2. the configured tokenizer (``--config`` / config.json), when it names something else;

and takes the first whose fingerprint equals the one stored in the checkpoint (a checkpoint
without a fingerprint, from before fingerprints, takes the first that loads). When the
configured tokenizer names something other than what was used, it says so once. When none
matches, one error names the fingerprint, every place it looked and why each was refused,
and what to do. infer, sft train, benchmark and status need no ``--config`` to open a run.

Cost: loading a tokenizer (about 0.1-1 s for a SentencePiece model) and its fingerprint
(a few ms); ``cache`` (a dict the caller keeps) makes several checkpoints of one run pay once.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from utils.cli import PipelineError
from utils.config import Config, apply_layer


def run_config(ckpt: dict) -> Optional[Config]:
    """The config a checkpoint was trained with (its stored, resolved config), or None when it
    holds none or the stored one no longer validates."""
    stored = ckpt.get("config")
    if not isinstance(stored, dict):
        return None
    cfg, problems = Config(), []
    apply_layer(cfg, stored, "the checkpoint's stored config", problems)
    return None if problems else cfg


def _candidates(ckpt: dict, cfg: Config) -> list[tuple[str, str, Config]]:
    """(label, tokenizer spec, config to resolve it against), in the order they are tried,
    without repeats."""
    from utils.tok import tokenizer_source
    out: list[tuple[str, str, Config]] = []
    run_cfg = run_config(ckpt)
    if run_cfg is not None:
        out.append(("the run's config", tokenizer_source(run_cfg)[0], run_cfg))
    name = (ckpt.get("tokenizer") or {}).get("name")
    if isinstance(name, str) and name:
        out.append(("the checkpoint's tokenizer record", name, run_cfg or cfg))
    out.append(("the configured tokenizer.name", tokenizer_source(cfg)[0], cfg))
    seen, unique = set(), []
    for label, spec, base in out:
        key = str(base.resolve(spec)) if _is_path(spec, base) else spec
        if key not in seen:
            seen.add(key)
            unique.append((label, spec, base))
    return unique


def _is_path(spec: str, base: Config) -> bool:
    from utils.tok import looks_like_path
    return looks_like_path(spec) or base.resolve(spec).exists()


def tokenizer_for_checkpoint(ckpt: dict, cfg: Config, path: Path,
                             say: Callable[[str], None] = print,
                             cache: Optional[dict] = None):
    """``(tokenizer, info)`` for the checkpoint at ``path`` (see the module docstring);
    ``info`` is the checkpoint's tokenizer record with ``fingerprint`` and ``verified``."""
    from utils.tok import fingerprint, load_tokenizer_from
    info = dict(ckpt.get("tokenizer") or {})
    want = info.get("fingerprint")
    cache = {} if cache is None else cache
    tried = []
    for label, spec, base in _candidates(ckpt, cfg):
        where = str(base.resolve(spec)) if _is_path(spec, base) else spec
        try:
            if where not in cache:
                tok = load_tokenizer_from(spec, base)
                cache[where] = (tok, fingerprint(tok))
        except PipelineError as e:
            tried.append(f"{label} ({where}): {str(e).splitlines()[0][:200]}")
            continue
        tok, fp = cache[where]
        if want is None or fp == want:
            if label == "the configured tokenizer.name" and tried:
                say(f"note: {path} opens with the configured tokenizer {where} (same fingerprint "
                    "as the checkpoint's).")
            elif label != "the configured tokenizer.name" and cfg.tokenizer.name != info.get("name"):
                say(f"note: {path} was trained with tokenizer {where}; using it (the configuration "
                    f"names '{cfg.tokenizer.name}').")
            return tok, {**info, "fingerprint": fp, "verified": want is not None}
        tried.append(f"{label} ({where}): fingerprint {fp[:12]} differs")
    raise PipelineError(
        f"{path}: cannot find the tokenizer this checkpoint was trained with (name "
        f"{info.get('name')!r}, fingerprint {str(want)[:12]}...). Looked at: " + "; ".join(tried)
        + ". Put that tokenizer back (re-run `python main.py tokenize` with the run's config), "
        "or pass --config with tokenizer.name set to a tokenizer with this fingerprint.")
