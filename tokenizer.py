#!/usr/bin/env python3
"""Stage `tokenize`: get, save or train the tokenizer; encode and decode text.

    python main.py tokenize                       # get tokenizer.name, save to tokenizers/<name>/
    python main.py tokenize --name path/to/tokenizer.model
    python main.py tokenize --encode "Hello world"
    python main.py tokenize --decode "22557,1526"
    python main.py tokenize --load tokenizers/CodeLlama-7b-hf
    python main.py tokenize --train --input data/cleaned_articles --vocab-size 8000

The configured tokenizer (``tokenizer.name``) is a Hugging Face hub name (the seed's
``codellama/CodeLlama-7b-hf``, through AutoTokenizer: from the hub or the local cache), a local
tokenizer directory, or a SentencePiece ``.model`` file (converted to a fast tokenizer that gives
exactly the ``sentencepiece`` library's ids, utils/data/spm.py). The default action saves it under ``tokenizers/<name>/`` with ``pipeline_tokenizer.json`` (source,
fingerprint, vocabulary size, special ids) and prints a report that includes the compression
ratio (characters per token) on sample text. ``--train`` trains a byte-level BPE tokenizer
with the ``tokenizers`` library instead: every Unicode string round-trips exactly, and the
special tokens are <unk>=0, <s>=1 (BOS), </s>=2 (EOS), <pad>=3.

Text is ordinary text (utils.data.tok.encode_plain): ``--encode "<s>"`` gives the pieces of the
three characters, never the BOS id; only ``--add-special-tokens`` (the shard framing) adds
BOS and EOS. See docs/tokenizer.md.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import sys
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from utils.cli import PipelineError, StageParser, UsageError, cli_path, run_stage
from utils.config import Config
from utils.data.textio import iter_articles, text_lines
from utils.data.tok import (SPECIAL_TOKENS, SPM_CONVERSION, conversion_of, encode_plain, fingerprint, has_tokenizer_files, load_tokenizer_from,
                       looks_like_path, plain, save_dir, save_tokenizer, special_ids,
                       special_merges, special_tokens, tokenizer_source)

# Trained tokenizers: special tokens in id order (unk 0, bos 1, eos 2, pad 3, as in the seed).
TRAIN_SPECIALS = [SPECIAL_TOKENS["unk"], SPECIAL_TOKENS["bos"], SPECIAL_TOKENS["eos"],
                  SPECIAL_TOKENS["pad"]]
BYTE_ALPHABET = 256
TEST_MAX_DOCUMENTS = 10_000           # --train --test reads at most this many documents
MAX_SAMPLE_CHARS = 2_000_000          # cap on the compression-ratio sample
PROBE = "Héllo wörld, 日本語の文章 😀🚀\ndef f(x):\n\treturn  x  # ok\n"
BUILTIN_SAMPLE = (
    "A tokenizer turns text into a sequence of integer ids and back again. Language models "
    "never see characters, only these ids, so the tokenizer decides how long a document "
    "becomes and how much text fits in the context window. Common English words usually map "
    "to a single token, while rare words, names and numbers are split into several pieces.\n"
    "def tokens_per_line(lines):\n    return [len(tokenize(line)) for line in lines]\n")


# --------------------------------------------------------------------------- getting
def source_kind(name: str, cfg: Optional[Config] = None) -> str:
    """How a tokenizer name is interpreted: 'SentencePiece model', 'local directory', ... or 'hub'."""
    p = cfg.resolve(name) if cfg is not None else Path(name).expanduser().resolve()
    if p.exists() or looks_like_path(name):
        if p.suffix == ".model":
            return "SentencePiece model, converted to a fast tokenizer"
        if p.is_dir() and not (p / "tokenizer.json").exists() and (p / "tokenizer.model").exists():
            return "SentencePiece model (folder), converted to a fast tokenizer"
        if p.suffix == ".json":
            return "tokenizer.json file"
        return "local tokenizer directory"
    return "Hugging Face hub (AutoTokenizer; local cache when offline)"


def get_tokenizer(cfg: Config) -> tuple[object, str, str]:
    """The configured tokenizer, freshly from ``tokenizer.name``: (tokenizer, name, source note).

    When the name is a hub name that cannot be reached but a saved copy exists under
    tokenizers/, the saved copy is used (and the note says so); otherwise the error carries
    the offline options.
    """
    name = cfg.tokenizer.name
    try:
        return load_tokenizer_from(name, cfg), name, source_kind(name, cfg)
    except PipelineError:
        saved = save_dir(cfg)
        if source_kind(name, cfg).startswith("Hugging Face") and has_tokenizer_files(saved):
            return (load_tokenizer_from(str(saved), cfg), name,
                    f"hub unreachable: using the saved copy in {saved}")
        raise


def configured_tokenizer(cfg: Config, load: Optional[str] = None) -> tuple[object, str, str]:
    """For --encode/--decode: --load DIR, else the saved copy under tokenizers/, else tokenizer.name."""
    if load:
        return load_tokenizer_from(load, cfg), load, "saved tokenizer directory (--load)"
    spec, saved = tokenizer_source(cfg)
    note = f"saved copy in {saved}" if saved else source_kind(spec, cfg)
    return load_tokenizer_from(spec, cfg), cfg.tokenizer.name, note


# --------------------------------------------------------------------------- sample text
def sample_texts(cfg: Config) -> tuple[list[str], str]:
    """Text for the compression-ratio report and a label saying where it came from.

    In order: the ``tokenizer.sample_text`` file; the first ``tokenizer.sample_articles``
    cleaned articles (paths.cleaned_dir/cleaned_*.txt); the news sample from the offline
    samples; a built-in paragraph.
    """
    n = cfg.tokenizer.sample_articles
    if cfg.tokenizer.sample_text:
        p = cfg.resolve(cfg.tokenizer.sample_text)
        if not p.is_file():
            raise PipelineError(f"tokenizer.sample_text: {p} is not a file.")
        text = p.read_text(encoding="utf-8", errors="replace")[:MAX_SAMPLE_CHARS]
        return [text], f"{p} (tokenizer.sample_text)"
    cleaned = sorted(cfg.path("paths.cleaned_dir").glob("cleaned_*.txt"))
    if cleaned:
        texts = list(itertools.islice(iter_articles(cleaned), n))
        if texts:
            return texts, f"first {len(texts)} cleaned articles in {cfg.path('paths.cleaned_dir')}"
    news = cfg.path("paths.samples_dir") / "news" / "lee_background.cor"
    if news.is_file():
        texts = list(itertools.islice(_iter_lines(news), n))
        return texts, f"first {len(texts)} news documents of the offline sample {news}"
    return [BUILTIN_SAMPLE], "built-in paragraph (no cleaned articles or samples found)"


def compression_ratio(tok, texts: Sequence[str]) -> tuple[int, int, float]:
    """(characters, tokens, characters per token) of ``texts`` encoded without special tokens."""
    chars = sum(len(t) for t in texts)
    tokens = sum(len(ids) for ids in encode_batch(tok, texts))
    return chars, tokens, (chars / tokens if tokens else 0.0)


# --------------------------------------------------------------------------- encode / decode
def _with_specials(tok, ids: list[int]) -> list[int]:
    bos, eos = tok.bos_token_id, tok.eos_token_id
    return ([bos] if bos is not None else []) + ids + ([eos] if eos is not None else [])


def encode(tok, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text`` as ordinary text (a literal "<s>" is not BOS); with
    add_special_tokens, framed as BOS + ids + EOS (the shard layout)."""
    ids = encode_plain(tok, [text])[0]
    return _with_specials(tok, ids) if add_special_tokens else ids


def encode_batch(tok, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
    """Batch version of :func:`encode` (one call into the Rust tokenizer)."""
    if not texts:
        return []
    out = encode_plain(tok, texts)
    return [_with_specials(tok, ids) for ids in out] if add_special_tokens else out


def decode(tok, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def parse_ids(text: str, vocab_size: Optional[int] = None) -> list[int]:
    """'1,2,3' (or '1 2 3', '[1, 2, 3]') -> [1, 2, 3]; a bad item or out-of-range id is a UsageError."""
    body = text.strip().strip("[]()").strip().rstrip(",").strip()      # a trailing comma is fine
    items = re.split(r"\s*,\s*|\s+", body) if body else []
    if not items:
        raise UsageError(f"--decode: no token ids in {text!r} (expected e.g. \"1,2,3\").")
    ids = []
    for i, item in enumerate(items, 1):
        if not re.fullmatch(r"[+-]?[0-9]+", item):   # int() also takes "٣", "1_0" and " 7 "
            what = "empty (two commas in a row?)" if not item else "not an integer token id"
            raise UsageError(f"--decode: item {i} ({item!r}) of {text!r} is {what} (expected e.g. "
                             "\"1,2,3\").")
        value = int(item)
        if value < 0 or (vocab_size is not None and value >= vocab_size):
            valid = f"0..{vocab_size - 1}" if vocab_size is not None else "0 and up"
            raise UsageError(f"--decode: token id {value} (item {i}) is out of range: the "
                             f"vocabulary has ids {valid}.")
        ids.append(value)
    return ids


# --------------------------------------------------------------------------- training
def training_files(inputs: Sequence[Path]) -> list[Path]:
    """Files to train on: files as given; a directory gives its cleaned_*.txt, else *.txt/*.cor."""
    files: list[Path] = []
    for p in map(Path, inputs):
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = sorted(p.glob("cleaned_*.txt")) or sorted(
                list(p.glob("*.txt")) + list(p.glob("*.cor")))
            files.extend(found)
        else:
            raise PipelineError(f"training input {p} does not exist. Run `python main.py clean` "
                                "to produce cleaned articles, or pass --input FILE_OR_DIR.")
    return files


def iter_documents(files: Iterable[Path], max_documents: Optional[int] = None) -> Iterator[str]:
    """Documents from training files: cleaned_*.txt are unescaped (utils.data.textio); other
    .txt/.cor files hold one document per line. Blank lines are skipped."""
    count = 0
    for f in files:
        docs = iter_articles([f]) if f.name.startswith("cleaned_") else _iter_lines(f)
        for doc in docs:
            if max_documents is not None and count >= max_documents:
                return
            count += 1
            yield doc


def _iter_lines(path: Path) -> Iterator[str]:
    """Non-empty lines of a plain text file (one document per line); a line that is not UTF-8
    is a PipelineError naming ``file:line``."""
    return text_lines(path, "save the file as UTF-8 or leave it out of --input")


def check_vocab_size(vocab_size: int) -> None:
    """A byte-level BPE needs room for the 256 byte symbols and the special tokens."""
    minimum = BYTE_ALPHABET + len(TRAIN_SPECIALS)
    if vocab_size < minimum:
        raise UsageError(f"--vocab-size {vocab_size} is too small for a byte-level BPE: it needs "
                         f"at least {minimum} (256 bytes + {len(TRAIN_SPECIALS)} special tokens).")


def train_bpe(documents: Iterable[str], vocab_size: int, min_frequency: int = 2,
              show_progress: bool = False, split_digits: bool = False):
    """Train a byte-level BPE tokenizer; returns a transformers PreTrainedTokenizerFast.

    Byte-level pre-tokenization (no normalizer, no prefix space) makes decode(encode(x)) == x
    for every Unicode string. Special tokens: <unk>=0, <s>=1, </s>=2, <pad>=3. Training is
    deterministic: the same documents and settings give the same fingerprint.
    ``split_digits``: every digit is a token of its own (as Llama's tokenizer does), so an
    n-digit number is always n tokens.
    """
    check_vocab_size(vocab_size)
    backend = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk"]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_digits:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=TRAIN_SPECIALS, show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(documents, trainer=trainer)
    backend = _without_special_merges(backend)
    return plain(PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=SPECIAL_TOKENS["bos"], eos_token=SPECIAL_TOKENS["eos"],
        unk_token=SPECIAL_TOKENS["unk"], pad_token=SPECIAL_TOKENS["pad"],
        clean_up_tokenization_spaces=False))


def _without_special_merges(backend):
    """Drop learned merges that would rebuild a special-token string (e.g. "<s" + ">" when the
    training text contains "<s>"), so text can never encode to a special id."""
    bad = special_merges(backend)
    if not bad:
        return backend
    data = json.loads(backend.to_str())
    drop = {" ".join(m) for m in bad}
    data["model"]["merges"] = [m for m in data["model"]["merges"]
                               if (m if isinstance(m, str) else " ".join(m)) not in drop]
    return Tokenizer.from_str(json.dumps(data))


class _Counter:
    """Wraps a document iterator and counts documents and characters as they stream by."""

    def __init__(self, docs: Iterable[str]):
        self.docs, self.documents, self.characters = docs, 0, 0

    def __iter__(self):
        for d in self.docs:
            self.documents += 1
            self.characters += len(d)
            yield d


# --------------------------------------------------------------------------- report
def _token(tok, kind: str) -> str:
    token, tid = special_tokens(tok)[kind], special_ids(tok)[kind]
    return "none" if token is None else f"{token} = {tid}"


def report(tok, name: str, source: str, cfg: Config, saved_to: Optional[Path] = None,
           extra: Sequence[tuple[str, str]] = ()) -> str:
    """The human-readable tokenizer report (the compression ratio uses sample_texts)."""
    texts, label = sample_texts(cfg)
    chars, tokens, ratio = compression_ratio(tok, texts)
    roundtrip = decode(tok, encode(tok, PROBE)) == PROBE
    rows = [("name", name), ("source", source),
            ("class", f"{type(tok).__name__} ({'fast, tokenizers backend' if tok.is_fast else 'slow'})"),
            ("vocab size", str(len(tok))),
            ("BOS", _token(tok, "bos")), ("EOS", _token(tok, "eos")),
            ("UNK", _token(tok, "unk")), ("PAD", _token(tok, "pad")),
            ("fingerprint", fingerprint(tok)), *extra]
    conversion = conversion_of(tok)
    if conversion:
        exact = conversion == SPM_CONVERSION
        rows.append(("conversion", f"{conversion}: " + ("ids exactly as the sentencepiece library"
                                                         if exact else "ids may differ from "
                                                         "the sentencepiece library's")))
    if saved_to is not None:
        rows.append(("saved to", str(saved_to)))
    rows += [("sample text", f"{label} ({chars:,} characters)"),
             ("compression", f"{ratio:.2f} characters per token ({chars:,} characters / "
                             f"{tokens:,} tokens)"),
             ("round trip", f"{'exact' if roundtrip else 'NOT exact'} on {PROBE!r}")]
    width = max(len(k) for k, _ in rows)
    return "Tokenizer report\n" + "\n".join(f"  {k:<{width}} : {v}" for k, v in rows)


# --------------------------------------------------------------------------- actions
def do_save(args, cfg: Config) -> int:
    """Default action: get tokenizer.name, save it under tokenizers/, print the report."""
    tok, name, source = get_tokenizer(cfg)
    target = save_dir(cfg)
    save_tokenizer(tok, target, name, {"kind": source})
    cfg.save_resolved(target)
    print(report(tok, name, source, cfg, saved_to=target))
    return 0


def do_train(args, cfg: Config) -> int:
    """--train: byte-level BPE on cleaned text, saved to tokenizers/<train_name>/."""
    inputs = [Path(p) for p in args.input] if args.input else [cfg.path("paths.cleaned_dir")]
    files = training_files(inputs)
    where = ", ".join(str(p) for p in inputs)
    if not files:
        raise PipelineError(f"no training text found in {where} (expected cleaned_*.txt, *.txt "
                            "or *.cor files). Run `python main.py clean` first, or pass "
                            "--input FILE_OR_DIR.")
    t = cfg.tokenizer
    check_vocab_size(t.train_vocab_size)
    limit = t.train_max_documents
    if cfg.test:
        limit = min(limit or TEST_MAX_DOCUMENTS, TEST_MAX_DOCUMENTS)
    target = Path(args.output) if args.output else cfg.path("paths.tokenizers_dir") / t.train_name
    print(f"Training a byte-level BPE tokenizer (vocab size {t.train_vocab_size}, min frequency "
          f"{t.train_min_frequency}) on {len(files)} file(s) from {where}"
          + (f", at most {limit:,} documents" if limit else "") + " ...", flush=True)
    docs = _Counter(iter_documents(files, limit))
    tok = train_bpe(docs, t.train_vocab_size, t.train_min_frequency,
                    show_progress=sys.stderr.isatty())
    if docs.documents == 0:
        raise PipelineError(f"the training input ({where}) holds no documents (all files empty).")
    training = {"inputs": [str(f) for f in files], "documents": docs.documents,
                "characters": docs.characters, "requested_vocab_size": t.train_vocab_size,
                "min_frequency": t.train_min_frequency, "max_documents": limit}
    save_tokenizer(tok, target, f"trained BPE ({t.train_name})",
                   {"kind": "trained byte-level BPE", "training": training})
    cfg.save_resolved(target)
    extra = [("trained on", f"{docs.documents:,} documents, {docs.characters:,} characters "
                            f"({len(files)} file(s))"),
             ("requested vocab", f"{t.train_vocab_size} (min frequency {t.train_min_frequency})")]
    print(report(tok, t.train_name, "trained byte-level BPE (tokenizers library)", cfg,
                 saved_to=target, extra=extra))
    try:
        shown = "./" + target.relative_to(cfg.root).as_posix()
    except ValueError:
        shown = str(target)
    print(f'To use it in the pipeline, set "tokenizer": {{"name": "{shown}"}} in config.json '
          f"(or pass --load {shown} to --encode/--decode).")
    return 0


def do_encode(args, cfg: Config) -> int:
    tok, name, source = configured_tokenizer(cfg, args.load)
    if args.encode_file:
        path = Path(args.encode_file)
        if not path.is_file():
            raise PipelineError(f"--encode-file: {path} is not a file.")
        try:
            raw = path.read_bytes()
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start) + 1
            raise PipelineError(f"--encode-file: {path}, line {line}: not UTF-8 text (byte 0x{raw[e.start]:02x} "
                                f"at offset {e.start}); save the file as UTF-8.") from None
        except OSError as e:
            raise PipelineError(f"--encode-file: {path} cannot be read ({e.strerror or e}).") from None
    else:
        text = args.encode
    ids = encode(tok, text, add_special_tokens=args.add_special_tokens)
    if args.plain:
        print(",".join(map(str, ids)))
        return 0
    added = ("yes (BOS + tokens + EOS)" if args.add_special_tokens
             else "no (pass --add-special-tokens for BOS + tokens + EOS)")
    print(f"Tokenizer: {name} ({source})")
    if args.encode_file:
        print(f"File: {args.encode_file} ({len(text):,} characters)")
    else:
        print(f"Text: {text!r} ({len(text)} characters)")
    print(f"BOS/EOS added: {added}")
    n_plain = len(ids) - (2 if args.add_special_tokens else 0)
    print(f"Tokens: {len(ids)} ({len(text) / max(1, n_plain):.2f} characters per token)")
    print(f"Token IDs: {','.join(map(str, ids))}")
    if args.verbose:
        print(f"Pieces: {tok.convert_ids_to_tokens(ids)}")
    return 0


def do_decode(args, cfg: Config) -> int:
    tok, name, source = configured_tokenizer(cfg, args.load)
    ids = parse_ids(args.decode, len(tok))
    text = decode(tok, ids, skip_special_tokens=args.skip_special_tokens)
    if args.plain:
        sys.stdout.write(text + "\n")
        return 0
    print(f"Tokenizer: {name} ({source})")
    print(f"Token IDs: {len(ids)}")
    if args.verbose:
        print(f"Pieces: {tok.convert_ids_to_tokens(ids)}")
    print(f"Text: {text}")
    return 0


def do_load(args, cfg: Config) -> int:
    """--load DIR alone: report on a saved tokenizer (nothing is written)."""
    tok, name, source = configured_tokenizer(cfg, args.load)
    print(report(tok, name, source, cfg))
    return 0


# --------------------------------------------------------------------------- CLI
def name_arg(value: str) -> str:
    """--name: a path (existing here, or path-shaped) is made absolute relative to the current
    directory like every CLI path; anything else is kept as a hub name."""
    if os.path.exists(os.path.expanduser(value)) or looks_like_path(value):
        return cli_path(value)
    return value


def build_parser() -> StageParser:
    p = StageParser("main.py tokenize", (__doc__ or "tokenize").strip().splitlines()[0],
                    test=f"quick mode: --train reads at most {TEST_MAX_DOCUMENTS:,} documents")   # -OO: no docstrings
    action = p.add_mutually_exclusive_group()
    action.add_argument("--encode", metavar="TEXT", help="print the token ids of TEXT")
    action.add_argument("--encode-file", metavar="FILE", type=cli_path,
                        help="encode a whole UTF-8 file and print its ids and ratio")
    action.add_argument("--decode", metavar="IDS", help="print the text of comma-separated ids")
    action.add_argument("--train", action="store_true",
                        help="train a byte-level BPE tokenizer on cleaned text")
    p.config_flag("--name", key="tokenizer.name", metavar="NAME", type=name_arg,
                  help="tokenizer to get: hub name, tokenizer directory or SentencePiece .model")
    p.add_argument("--load", metavar="DIR", type=cli_path,
                   help="use a saved tokenizer directory (as written by this stage)")
    p.config_flag("--save-dir", key="tokenizer.save_dir", type=cli_path, metavar="DIR",
                  help="where the default action saves the tokenizer (it replaces only an earlier save)")
    p.add_argument("--add-special-tokens", action="store_true",
                   help="--encode: add BOS and EOS around the ids")
    p.add_argument("--skip-special-tokens", action="store_true",
                   help="--decode: leave special tokens out of the text")
    p.add_argument("--plain", action="store_true",
                   help="--encode/--decode: print only the ids / the text (for scripts)")
    p.add_argument("-v", "--verbose", action="store_true", help="also print token pieces")
    p.add_argument("--input", nargs="+", type=cli_path, metavar="FILE_OR_DIR",
                   help="--train: text files or folders (default: paths.cleaned_dir)")
    p.add_argument("--output", type=cli_path, metavar="DIR",
                   help="--train: output folder (default: tokenizers/<tokenizer.train_name>; it replaces "
                        "only an earlier save)")
    p.config_flag("--vocab-size", key="tokenizer.train_vocab_size", type=int, metavar="N",
                  help="--train: vocabulary size")
    p.config_flag("--min-frequency", key="tokenizer.train_min_frequency", type=int, metavar="N",
                  help="--train: minimum pair frequency")
    p.config_flag("--train-name", key="tokenizer.train_name", metavar="NAME",
                  help="--train: folder name under tokenizers/")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, cfg = build_parser().parse(argv)
    if args.train:
        if args.load:
            raise UsageError("--load and --train cannot be combined.")
        return do_train(args, cfg)
    if args.input or args.output:
        raise UsageError("--input and --output only apply to --train.")
    if args.encode is not None or args.encode_file:
        return do_encode(args, cfg)
    if args.decode is not None:
        return do_decode(args, cfg)
    if args.load:
        return do_load(args, cfg)
    return do_save(args, cfg)


if __name__ == "__main__":
    run_stage(main)
