"""Typed configuration for every stage, loaded from config.json.

Precedence (lowest first): dataclass defaults < config.json < ``--config FILE`` < CLI flags.
Every problem in a file (unknown key, wrong type, value out of range) is collected and
reported at once, each naming its key path (``training.lr``) and, for typos, a suggestion.

Relative paths are resolved against ``paths.root``, which itself is relative to the project
root (the directory holding main.py). Nothing is hard-coded to a home directory.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from utils.atomic import write_json_atomic

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG_FILE = PROJECT_ROOT / "config.json"


class ConfigError(Exception):
    """One or more configuration problems; exit code 2."""

    exit_code = 2

    def __init__(self, problems: list[str], source: str = "configuration"):
        self.problems = list(problems)
        self.source = source
        lines = [f"{len(self.problems)} problem(s) in {source}:"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


def _f(default: Any, help: str = "", *, min: float | None = None, max: float | None = None,
       min_exclusive: bool = False, path: bool = False) -> Any:
    """A dataclass field with help text, optional numeric bounds, and a path marker."""
    meta = {"help": help, "min": min, "max": max, "min_exclusive": min_exclusive, "path": path}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: json.loads(json.dumps(d)), metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------- sections
@dataclass
class PathsConfig:
    root: str = _f(".", "base for every relative path below (relative to the project root)", path=True)
    data_dir: str = _f("data", "data root", path=True)
    samples_dir: str = _f("data/samples", "offline sample data fetched by `main.py samples`", path=True)
    cleaned_dir: str = _f("data/cleaned_articles", "cleaned articles, one per line", path=True)
    tokenized_dir: str = _f("data/tokenized_datasets", "token shard sets", path=True)
    post_training_dir: str = _f("data/post-training", "instruction data", path=True)
    tokenizers_dir: str = _f("tokenizers", "saved tokenizers", path=True)
    checkpoints_dir: str = _f("checkpoints", "training runs", path=True)
    logs_dir: str = _f("logs", "tensorboard and raw metrics", path=True)
    benchmark_dir: str = _f("benchmark_results", "benchmark outputs", path=True)
    cache_dir: str = _f(".cache", "downloads (sample wheels) and other caches", path=True)


@dataclass
class TokenizerConfig:
    name: str = _f("codellama/CodeLlama-7b-hf",
                   "hub name, local tokenizer directory, or SentencePiece .model file")
    save_dir: Optional[str] = _f(None, "where `tokenize` saves it (default tokenizers/<slug of name>)",
                                 path=True)
    sample_text: Optional[str] = _f(None, "text file for the compression-ratio report", path=True)
    train_vocab_size: int = _f(8000, "vocabulary size for `tokenize --train`", min=16)
    train_min_frequency: int = _f(2, "minimum pair frequency for BPE training", min=1)
    train_name: str = _f("bpe", "directory name under tokenizers/ for a trained tokenizer")
    train_max_documents: Optional[int] = _f(None, "documents read by `tokenize --train` "
                                            "(null = all; --test reads at most 10,000)", min=1)
    sample_articles: int = _f(200, "documents read for the compression-ratio report", min=1)


@dataclass
class WikipediaConfig:
    raw_dir: str = _f("data/raw/enwiki", "folder of *.jsonl / *.xml / *.xml.bz2 dumps", path=True)
    namespaces: list = _f([0], "MediaWiki namespaces kept from XML dumps")
    skip_redirects: bool = _f(True, "skip redirect pages")


@dataclass
class CleaningConfig:
    output_dir: Optional[str] = _f(None, "default: paths.cleaned_dir", path=True)
    min_chars: int = _f(200, "drop articles shorter than this (characters, after cleaning)", min=0)
    workers: int = _f(0, "processes (0 = all cores)", min=0)
    test_max_articles: int = _f(50_000, "articles per process in --test", min=1)
    drop_sections: list = _f(["References", "External links", "See also", "Further reading",
                              "Notes", "Bibliography", "Sources", "Citations", "Footnotes",
                              "Notes and references", "References and notes", "Works cited",
                              "Cited works", "Sources and further reading"],
                             "section titles dropped with their content (case-insensitive)")
    unicode_normalization: Literal["NFC", "NFKC", "none"] = _f("NFC", "Unicode normalization form")
    keep_headings: bool = _f(False, "keep section headings as their own paragraphs (default: dropped)")


@dataclass
class FinewebConfig:
    dataset: str = _f("HuggingFaceFW/fineweb", "hub dataset name (streamed)")
    config_name: Optional[str] = _f("sample-10BT", "hub dataset config")
    split: str = _f("train", "split to stream")
    data_dir: Optional[str] = _f(None, "local folder of FineWeb parquet files (overrides the hub)",
                                 path=True)
    text_column: str = _f("text", "column holding the document text")
    min_language_score: float = _f(0.65, "drop documents below this language_score", min=0, max=1)
    min_tokens: int = _f(100, "drop documents with fewer tokens", min=0)
    workers: int = _f(0, "processes (0 = all cores)", min=0)
    batch_size: int = _f(10_000, "documents per tokenization batch", min=1)
    max_files: int = _f(38, "maximum number of shard files", min=1)
    test_max_documents: int = _f(10_000, "documents read in --test", min=1)


@dataclass
class DatasetConfig:
    source: Literal["wikipedia", "fineweb"] = _f("wikipedia", "which shard set training reads")
    wikipedia_test_dir: str = _f("data/tokenized_datasets/wikipedia_test", path=True)
    wikipedia_full_dir: str = _f("data/tokenized_datasets/wikipedia_full", path=True)
    fineweb_test_dir: str = _f("data/tokenized_datasets/fineweb_test", path=True)
    fineweb_full_dir: str = _f("data/tokenized_datasets/fineweb_full", path=True)
    window: int = _f(512, "training window length in tokens", min=2)
    stride: Optional[int] = _f(None, "window stride (default window // 2: the seed's 50% overlap)",
                               min=1)
    batch: int = _f(10_000, "articles per tokenization batch", min=1)
    shard_tokens: int = _f(50_000_000, "tokens per shard file", min=16)
    workers: int = _f(0, "tokenizer processes (0 = all cores)", min=0)
    test_max_documents: int = _f(10_000, "documents read in --test", min=1)
    val_split: float = _f(0.1, "fraction of tokens held out for validation", min=0, max=1)
    seed: int = _f(42, "split and shuffle seed")
    auto_prepare: bool = _f(False, "rebuild a missing or stale shard set before training")
    mode: Literal["shards", "on_the_fly"] = _f("shards", "pre-tokenized shards or on-the-fly")
    on_the_fly_source: Optional[str] = _f(None, "hub dataset name or local parquet/jsonl/txt path")
    on_the_fly_config: Optional[str] = _f(None, "hub dataset config for on-the-fly mode")
    on_the_fly_split: str = _f("train", "split for on-the-fly mode")
    on_the_fly_text_column: str = _f("text", "text column for on-the-fly mode")
    on_the_fly_batch_docs: int = _f(256, "documents per tokenization batch in on-the-fly mode", min=1)
    split_block_windows: int = _f(64, "train/val split granularity: blocks of this many strides "
                                  "are assigned whole to one split (no leakage across overlap)", min=1)


@dataclass
class ModelConfig:
    vocab_size: Optional[int] = _f(None, "default: the tokenizer's vocabulary size", min=2)
    d_model: int = _f(512, "hidden size", min=1)
    n_layers: int = _f(8, "transformer blocks", min=1)
    n_heads: int = _f(8, "query heads", min=1)
    n_kv_heads: int = _f(2, "key/value heads (grouped-query attention)", min=1)
    ffn_hidden: Optional[int] = _f(None, "MLP hidden size (default: Llama's 8/3 d_model rule)", min=1)
    activation: Literal["swiglu", "geglu", "reglu"] = _f("swiglu", "gated MLP activation")
    norm: Literal["rmsnorm", "layernorm"] = _f("rmsnorm", "normalization layer")
    norm_eps: float = _f(1e-5, "normalization epsilon", min=0, min_exclusive=True)
    rope_theta: float = _f(10_000.0, "RoPE base", min=0, min_exclusive=True)
    max_seq_len: int = _f(512, "longest sequence the model sees", min=1)
    dropout: float = _f(0.0, "dropout probability", min=0, max=1)
    tie_embeddings: bool = _f(True, "share input and output embeddings")


@dataclass
class TrainingConfig:
    run_name: Optional[str] = _f(None, "run directory name (default: run_<timestamp>)")
    epochs: int = _f(1, "passes over the training windows", min=1)
    max_steps: Optional[int] = _f(None, "stop after this many optimizer steps", min=1)
    batch_size: int = _f(16, "windows per micro-batch", min=1)
    grad_accum: int = _f(1, "micro-batches per optimizer step", min=1)
    lr: float = _f(2e-3, "peak learning rate (MobileLLM's 2e-3)", min=0, min_exclusive=True)
    min_lr: float = _f(2e-4, "final learning rate of the cosine decay", min=0)
    warmup_steps: int = _f(100, "linear warm-up steps", min=0)
    weight_decay: float = _f(0.1, "AdamW weight decay", min=0)
    beta1: float = _f(0.9, "AdamW beta1", min=0, max=1)
    beta2: float = _f(0.95, "AdamW beta2", min=0, max=1)
    grad_clip: float = _f(1.0, "gradient-norm clip (0 = off)", min=0)
    eval_every: float = _f(0.1, "validate every this fraction of an epoch", min=0, max=1,
                           min_exclusive=True)
    eval_batches: int = _f(50, "validation batches per evaluation", min=1)
    checkpoint_every: int = _f(1000, "steps between numbered checkpoints", min=1)
    keep_checkpoints: int = _f(3, "numbered checkpoints kept", min=0)
    early_stopping_patience: int = _f(0, "evaluations without improvement before stopping (0 = off)",
                                      min=0)
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = _f("auto", "autocast dtype (auto: bf16 on CUDA)")
    compile: bool = _f(False, "torch.compile the model")
    device: str = _f("auto", "auto, cpu, cuda or cuda:N")
    seed: int = _f(42, "random seed")
    num_workers: int = _f(0, "DataLoader worker processes", min=0)


@dataclass
class SFTConfig:
    dataset: str = _f("GAIR/lima", "hub dataset name or local path of LIMA-format data")
    max_length: int = _f(512, "drop conversations longer than this (tokens)", min=8)
    epochs: int = _f(2, "fine-tuning epochs", min=1)
    batch_size: int = _f(8, "conversations per batch", min=1)
    lr: float = _f(5e-5, "learning rate (low to avoid forgetting)", min=0, min_exclusive=True)
    val_split: float = _f(0.1, "held-out fraction", min=0, max=1)
    user_prefix: str = _f("User: ", "user turn marker")
    assistant_prefix: str = _f("Assistant: ", "assistant turn marker")


@dataclass
class InferenceConfig:
    max_new_tokens: int = _f(200, "tokens generated per prompt", min=1)
    temperature: float = _f(0.8, "sampling temperature (0 = greedy)", min=0)
    top_k: int = _f(50, "top-k filter (0 = off)", min=0)
    top_p: float = _f(0.95, "nucleus filter (1.0 = off)", min=0, max=1, min_exclusive=True)
    device: str = _f("auto", "auto, cpu, cuda or cuda:N")


@dataclass
class BenchmarkConfig:
    preset: Literal["quick", "standard", "comprehensive"] = _f("quick", "sample sizes")
    perplexity_source: Optional[str] = _f(None, "WikiText name or local path (offline: held-out articles)")
    lambada_source: Optional[str] = _f(None, "LAMBADA hub name or local requests.jsonl.gz")
    hellaswag_source: Optional[str] = _f(None, "HellaSwag hub name or local load_from_disk folder")
    device: str = _f("auto", "auto, cpu, cuda or cuda:N")


@dataclass
class LoggingConfig:
    tensorboard: bool = _f(True, "write TensorBoard events")
    raw_metrics: bool = _f(True, "write logs/raw_metrics/<run>.jsonl")
    log_every: int = _f(10, "steps between log lines", min=1)
    smoothing_window: int = _f(50, "steps in the moving average of metrics", min=1)


@dataclass
class Config:
    paths: PathsConfig = field(default_factory=PathsConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    wikipedia: WikipediaConfig = field(default_factory=WikipediaConfig)
    cleaning: CleaningConfig = field(default_factory=CleaningConfig)
    fineweb: FinewebConfig = field(default_factory=FinewebConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # Not a config.json key: set by --test on the command line.
    test: bool = field(default=False, metadata={"internal": True})
    sources: list = field(default_factory=list, metadata={"internal": True})

    # ------------------------------------------------------------------ paths
    def resolve(self, p: Optional[str | os.PathLike]) -> Optional[Path]:
        """Resolve a configured path: absolute stays, relative is under paths.root."""
        if p is None:
            return None
        p = Path(os.path.expanduser(str(p)))
        if p.is_absolute():
            return p
        return (self.root / p).resolve()

    @property
    def root(self) -> Path:
        r = Path(os.path.expanduser(self.paths.root))
        return r if r.is_absolute() else (PROJECT_ROOT / r).resolve()

    def path(self, dotted: str) -> Path:
        """``cfg.path("paths.cleaned_dir")`` -> resolved Path of that key."""
        sec, key = dotted.split(".", 1)
        return self.resolve(getattr(getattr(self, sec), key))

    def shard_dir(self, source: Optional[str] = None, test: Optional[bool] = None) -> Path:
        """The token shard directory for a source (wikipedia|fineweb) in test or full mode."""
        source = source or self.dataset.source
        test = self.test if test is None else test
        return self.resolve(getattr(self.dataset, f"{source}_{'test' if test else 'full'}_dir"))

    @property
    def stride(self) -> int:
        return self.dataset.stride or max(1, self.dataset.window // 2)

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            if f.metadata.get("internal"):
                continue
            out[f.name] = dataclasses.asdict(getattr(self, f.name))
        return out

    def save_resolved(self, directory: str | os.PathLike, filename: str = "resolved_config.json") -> Path:
        """Write the fully resolved config (plus test flag and sources) next to a run's outputs."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        data["_meta"] = {"test": self.test, "sources": self.sources, "root": str(self.root)}
        write_json_atomic(d / filename, data)
        return d / filename


# Section name -> its dataclass (get_type_hints resolves the postponed annotations).
_HINTS = typing.get_type_hints(Config)
SECTIONS: dict[str, type] = {f.name: _HINTS[f.name] for f in dataclasses.fields(Config)
                             if not f.metadata.get("internal")}


# --------------------------------------------------------------------------- validation
def _suggest(name: str, options) -> str:
    m = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{m[0]}'?)" if m else ""


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false",
            list: "a list", dict: "an object"}.get(tp, getattr(tp, "__name__", str(tp)))


def _check_value(key: str, value: Any, tp, meta: dict) -> tuple[Any, Optional[str]]:
    """Return (coerced value, problem or None)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None, None
        inner = [a for a in args if a is not type(None)]
        return _check_value(key, value, inner[0], meta)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            hint = _suggest(str(value), [str(c) for c in choices])
            return value, f"{key}: {value!r} is not {_type_name(tp)}{hint}"
        return value, None
    shown = json.dumps(value)  # report the value as the user wrote it
    bad = f"{key}: expected {_type_name(tp)}, got {shown}"
    if tp is bool:
        if not isinstance(value, bool):
            return value, bad
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                return value, bad
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value, bad
        value = float(value)
    elif tp is str:
        if not isinstance(value, str):
            return value, bad
    elif tp is list:
        if not isinstance(value, list):
            return value, bad
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        lo, hi = meta.get("min"), meta.get("max")
        if lo is not None and (value < lo or (meta.get("min_exclusive") and value == lo)):
            op = ">" if meta.get("min_exclusive") else ">="
            return value, f"{key}: {shown} is out of range (must be {op} {lo})"
        if hi is not None and value > hi:
            return value, f"{key}: {shown} is out of range (must be <= {hi})"
    return value, None


def _section_fields(cls) -> dict[str, tuple[Any, dict]]:
    hints = typing.get_type_hints(cls, include_extras=False)
    return {f.name: (hints[f.name], dict(f.metadata)) for f in dataclasses.fields(cls)}


def apply_layer(cfg: Config, data: Any, source: str, problems: list[str]) -> None:
    """Validate one layer (a parsed JSON object) and apply it onto cfg; collect problems."""
    if not isinstance(data, dict):
        problems.append(f"{source}: the top level must be a JSON object of sections")
        return
    for sec_name, sec_data in data.items():
        if sec_name.startswith("_"):  # comments such as "_comment" or "_meta"
            continue
        if sec_name not in SECTIONS:
            problems.append(f"{sec_name}: unknown section{_suggest(sec_name, SECTIONS)}; "
                            f"sections are: {', '.join(SECTIONS)}")
            continue
        if not isinstance(sec_data, dict):
            problems.append(f"{sec_name}: expected an object of settings, got {json.dumps(sec_data)}")
            continue
        section = getattr(cfg, sec_name)
        fields = _section_fields(type(section))
        for key, value in sec_data.items():
            if key.startswith("_"):
                continue
            dotted = f"{sec_name}.{key}"
            if key not in fields:
                problems.append(f"{dotted}: unknown key{_suggest(key, fields)}")
                continue
            tp, meta = fields[key]
            value, problem = _check_value(dotted, value, tp, meta)
            if problem:
                problems.append(problem)
            else:
                setattr(section, key, value)


def read_json_file(path: Path) -> Any:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{path}: file not found (pass an existing file to --config)"], str(path))
    except OSError as e:
        raise ConfigError([f"{path}: cannot read ({e.strerror})"], str(path))
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError([f"{path}, line {e.lineno} column {e.colno}: invalid JSON: {e.msg}"], str(path))


def load_config(config_file: Optional[str | os.PathLike] = None,
                overrides: Optional[dict[str, Any]] = None,
                test: bool = False,
                base_file: Optional[str | os.PathLike] = DEFAULT_CONFIG_FILE) -> Config:
    """Build the Config: defaults < base_file (config.json) < config_file < overrides.

    ``overrides`` maps dotted keys (``"dataset.window"``) to values from CLI flags.
    Raises ConfigError listing every problem of the first layer that has any.
    """
    cfg = Config(test=test)
    layers: list[tuple[str, Any]] = []
    if base_file is not None and Path(base_file).exists():
        layers.append((str(base_file), read_json_file(Path(base_file))))
    if config_file is not None:
        cf = Path(config_file)
        if base_file is None or cf.resolve() != Path(base_file).resolve():
            layers.append((str(cf), read_json_file(cf)))
    if overrides:
        nested: dict[str, dict] = {}
        for dotted, value in overrides.items():
            sec, key = dotted.split(".", 1)
            nested.setdefault(sec, {})[key] = value
        layers.append(("command-line flags", nested))
    for source, data in layers:
        problems: list[str] = []
        apply_layer(cfg, data, source, problems)
        if problems:
            raise ConfigError(problems, source)
        cfg.sources.append(source)
    problems = cross_checks(cfg)
    if problems:
        raise ConfigError(problems, "the combined configuration")
    return cfg


def cross_checks(cfg: Config) -> list[str]:
    """Checks that involve more than one key."""
    p = []
    m = cfg.model
    if m.n_heads % m.n_kv_heads:
        p.append(f"model.n_kv_heads: {m.n_kv_heads} must divide model.n_heads ({m.n_heads})")
    if m.d_model % m.n_heads:
        p.append(f"model.d_model: {m.d_model} must be divisible by model.n_heads ({m.n_heads})")
    elif (m.d_model // m.n_heads) % 2:
        p.append(f"model.d_model: head size {m.d_model // m.n_heads} must be even for RoPE")
    d = cfg.dataset
    if d.stride is not None and d.stride > d.window:
        p.append(f"dataset.stride: {d.stride} must be <= dataset.window ({d.window})")
    if cfg.training.min_lr > cfg.training.lr:
        p.append(f"training.min_lr: {cfg.training.min_lr} must be <= training.lr ({cfg.training.lr})")
    return p


def default_config_dict() -> dict:
    """The defaults as a config.json-shaped dict (used to write and test config.json)."""
    return Config().to_dict()


def describe_keys() -> list[tuple[str, str, Any]]:
    """(dotted key, help, default) for documentation."""
    out = []
    for sec, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append((f"{sec}.{f.name}", f.metadata.get("help", ""), default))
    return out
