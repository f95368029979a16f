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
import json.decoder
import json.scanner
import math
import os
import re
import types
import typing
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from utils.atomic import write_json_atomic

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG_FILE = PROJECT_ROOT / "config.json"
# The base layer instead of config.json: a file path, or "none" for the dataclass defaults
# alone (which equal the shipped config.json). The test suite sets it to "none" so a user's
# edits to config.json never change what the tests check.
BASE_CONFIG_ENV = "LLM_PIPELINE_BASE_CONFIG"
INT_MIN, INT_MAX = -(2 ** 63), 2 ** 63 - 1   # any integer key must fit a 64-bit integer
SEED_MAX = 2 ** 32 - 1                        # seeds must suit random, NumPy and torch alike
SFT_MIN_LENGTH = 8                            # the smallest sft.max_length (--max-length)


class ConfigError(Exception):
    """One or more configuration problems (the stage exits with code 2)."""

    def __init__(self, problems: list[str], source: str = "configuration"):
        self.problems = list(problems)
        self.source = source
        lines = [f"{len(self.problems)} problem(s) in {source}:"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))

    @classmethod
    def combine(cls, per_source: list[tuple[str, list[str]]]) -> "ConfigError":
        """One error listing the problems of several layers, each naming its file."""
        if len(per_source) == 1:
            source, problems = per_source[0]
            return cls(problems, source)
        problems = [p if p.startswith(src) else f"{src}: {p}" for src, probs in per_source for p in probs]
        return cls(problems, "the configuration (" + ", ".join(src for src, _ in per_source) + ")")


def _f(default: Any, help: str = "", *, min: float | None = None, max: float | None = None,
       min_exclusive: bool = False, path: bool = False, nonblank: bool = False,
       folder: bool = False) -> Any:
    """A dataclass field with help text, optional numeric bounds, and markers: ``path`` for a
    file or folder path, ``nonblank`` for a name that may be a path (a hub name or a path),
    ``folder`` for one folder's name under a configured folder (never a path: ``../x`` or
    ``a/b`` would write elsewhere). None may be blank (:func:`_blank_problem`)."""
    meta = {"help": help, "min": min, "max": max, "min_exclusive": min_exclusive, "path": path,
            "nonblank": nonblank or path or folder, "folder": folder}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: json.loads(json.dumps(d)), metadata=meta)
    return field(default=default, metadata=meta)


def _resolved(path: Path, key: Optional[str] = None) -> Path:
    """``path.resolve()``; a symbolic link loop on the way is a ConfigError naming the path."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as e:    # a symlink loop (RuntimeError before Python 3.13)
        raise ConfigError([f"{key or 'a configured path'}: {path} cannot be resolved ({e}): a symbolic link that "
                           "leads back to itself? Give the real path."]) from None


# --------------------------------------------------------------------------- sections
@dataclass
class PathsConfig:
    root: str = _f(".", "base for every relative path below (relative to the project root)", path=True)
    data_dir: str = _f("data", "data root", path=True)
    samples_dir: str = _f("data/samples", "offline sample data fetched by `main.py samples`", path=True)
    cleaned_dir: str = _f("data/cleaned_articles", "cleaned articles, one per line", path=True)
    tokenized_dir: str = _f("data/tokenized_datasets", "token shard sets", path=True)
    post_training_dir: str = _f("data/post-training", "instruction data", path=True)
    preference_dir: str = _f("data/preference", "preference pairs for DPO (main.py dpo prepare)", path=True)
    tokenizers_dir: str = _f("tokenizers", "saved tokenizers", path=True)
    checkpoints_dir: str = _f("checkpoints", "training runs", path=True)
    logs_dir: str = _f("logs", "tensorboard and raw metrics", path=True)
    benchmark_dir: str = _f("benchmark_results", "benchmark outputs", path=True)
    reports_dir: str = _f("reports", "run reports (main.py report)", path=True)
    exports_dir: str = _f("exports", "exports (main.py export; --out overrides)", path=True)
    cache_dir: str = _f(".cache", "downloads (sample wheels) and other caches", path=True)


@dataclass
class TokenizerConfig:
    name: str = _f("codellama/CodeLlama-7b-hf",
                   "hub name, local tokenizer directory, or SentencePiece .model file", nonblank=True)
    save_dir: Optional[str] = _f(None, "where `tokenize` saves it (default tokenizers/<slug of name>)",
                                 path=True)
    sample_text: Optional[str] = _f(None, "text file for the compression-ratio report", path=True)
    train_vocab_size: int = _f(8000, "vocabulary size for `tokenize --train` (at most 2^20: four times the "
                                "largest released vocabularies; the trainer allocates memory per entry asked for)",
                                min=16, max=1 << 20)
    train_min_frequency: int = _f(2, "minimum pair frequency for BPE training", min=1)
    train_name: str = _f("bpe", "directory name under tokenizers/ for a trained tokenizer",
                         folder=True)
    train_max_documents: Optional[int] = _f(None, "documents read by `tokenize --train` "
                                            "(null = all; --test reads at most 10,000)", min=1)
    sample_articles: int = _f(200, "documents read for the compression-ratio report", min=1)


@dataclass
class WikipediaConfig:
    raw_dir: str = _f("data/raw/enwiki", "folder of *.jsonl / *.xml / *.xml.bz2 dumps", path=True)
    namespaces: list[int] = _f([0], "MediaWiki namespaces kept from XML dumps (0 = articles)")
    skip_redirects: bool = _f(True, "skip redirect pages")


@dataclass
class CleaningConfig:
    output_dir: Optional[str] = _f(None, "default: paths.cleaned_dir", path=True)
    min_chars: int = _f(200, "drop articles shorter than this (characters, after cleaning)", min=0)
    workers: int = _f(0, "processes (0 = all cores)", min=0)
    test_max_articles: int = _f(50_000, "articles per process in --test", min=1)
    drop_sections: list[str] = _f(["References", "External links", "See also", "Further reading",
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
    wikipedia_test_dir: str = _f("data/tokenized_datasets/wikipedia_test", "wikipedia shards (--test)", path=True)
    wikipedia_full_dir: str = _f("data/tokenized_datasets/wikipedia_full", "wikipedia shards (full run)", path=True)
    fineweb_test_dir: str = _f("data/tokenized_datasets/fineweb_test", "fineweb shards (--test)", path=True)
    fineweb_full_dir: str = _f("data/tokenized_datasets/fineweb_full", "fineweb shards (full run)", path=True)
    window: int = _f(512, "training window length in tokens", min=2)
    stride: Optional[int] = _f(None, "window stride (default window // 2: the seed's 50% overlap)",
                               min=1)
    batch: int = _f(10_000, "articles per tokenization batch", min=1)
    shard_tokens: int = _f(50_000_000, "tokens per shard file", min=16)
    workers: int = _f(0, "tokenizer processes (0 = all cores)", min=0)
    test_max_documents: int = _f(10_000, "documents read in --test", min=1)
    val_split: float = _f(0.1, "fraction of tokens held out for validation", min=0, max=1)
    seed: int = _f(42, "split and shuffle seed", min=0, max=SEED_MAX)
    auto_prepare: bool = _f(False, "rebuild a missing or stale shard set before training")
    mode: Literal["shards", "on_the_fly"] = _f("shards", "pre-tokenized shards or on-the-fly")
    on_the_fly_source: Optional[str] = _f(None, "hub dataset name or local parquet/jsonl/txt path",
                                          nonblank=True)
    on_the_fly_config: Optional[str] = _f(None, "hub dataset config for on-the-fly mode")
    on_the_fly_split: str = _f("train", "split for on-the-fly mode")
    on_the_fly_text_column: str = _f("text", "text column for on-the-fly mode")
    on_the_fly_batch_docs: int = _f(256, "documents per tokenization batch in on-the-fly mode", min=1)
    split_block_windows: int = _f(64, "train/val split granularity: blocks of this many strides "
                                  "are assigned whole to one split (no leakage across overlap)", min=1)


# Model size presets (docs/model.md). A preset gives the shape keys below; any shape key set
# to a non-null value in config.json, --config or a flag overrides the preset's value.
# Preset "custom" has no base: every shape key must be set. Parameter counts in docs/model.md.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=None, tie_embeddings=True),
    "default": dict(d_model=384, n_layers=8, n_heads=6, n_kv_heads=2, ffn_hidden=None, tie_embeddings=True),
    "125m": dict(d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_hidden=None, tie_embeddings=False),
    "200m": dict(d_model=1024, n_layers=6, n_heads=8, n_kv_heads=8, ffn_hidden=4096, tie_embeddings=False),
    "1b": dict(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192, tie_embeddings=True),
}
MODEL_SHAPE_KEYS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "tie_embeddings")


def llama_ffn_hidden(d_model: int, multiple_of: int = 256) -> int:
    """Llama's rule: 2/3 of 4*d_model, rounded up to a multiple of ``multiple_of``."""
    hidden = int(2 * 4 * d_model / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass
class ModelConfig:
    preset: Literal["tiny", "default", "125m", "200m", "1b", "custom"] = _f(
        "default", "size preset giving the shape keys (tiny: CPU tests; default: the seed's ~25M; "
        "125m; 200m: seeds/000's Llama; 1b: Llama-3.2-1B's shape, for FSDP on 24 GB GPUs); non-null shape "
        "keys override it; custom: set them all")
    vocab_size: Optional[int] = _f(None, "default: the tokenizer's vocabulary size (token ids are stored as uint32)", min=2, max=1 << 32)
    d_model: Optional[int] = _f(None, "hidden size (null: from the preset)", min=1)
    n_layers: Optional[int] = _f(None, "transformer blocks (null: from the preset)", min=1)
    n_heads: Optional[int] = _f(None, "query heads (null: from the preset)", min=1)
    n_kv_heads: Optional[int] = _f(None, "key/value heads, grouped-query attention (null: from the preset)", min=1)
    ffn_hidden: Optional[int] = _f(None, "MLP hidden size (null: the preset's, else Llama's 8/3 d_model "
                                   "rule rounded up to ffn_multiple_of)", min=1)
    ffn_multiple_of: int = _f(256, "round the derived MLP hidden size up to this multiple (64 or 256 "
                              "suit GPUs)", min=1)
    activation: Literal["swiglu", "geglu", "reglu"] = _f("swiglu", "gated MLP activation")
    norm: Literal["rmsnorm", "layernorm"] = _f("rmsnorm", "normalization layer")
    norm_eps: float = _f(1e-5, "normalization epsilon", min=0, min_exclusive=True)
    rope_theta: float = _f(10_000.0, "RoPE base", min=0, min_exclusive=True)
    max_seq_len: int = _f(512, "longest sequence the model is trained on (RoPE table size)", min=1)
    dropout: float = _f(0.0, "dropout probability", min=0, max=1)
    tie_embeddings: Optional[bool] = _f(None, "share input and output embeddings (null: from the preset)")
    document_mask: bool = _f(False, "attend only within each document of a packed window "
                             "(documents start at BOS; positions restart per document)")
    init_std: float = _f(0.02, "std of the normal weight init (residual projections scaled by "
                         "1/sqrt(2*n_layers))", min=0, min_exclusive=True)
    attention: Literal["standard", "infini"] = _f(
        "standard", "standard: causal attention over the window; infini: Infini-attention "
        "(docs/long_context.md): attention within segments of model.segment_length tokens plus "
        "a compressive memory of the earlier segments, mixed in by a gate per head")
    segment_length: Optional[int] = _f(None, "infini: tokens per segment; must divide "
                                       "dataset.window (null on standard models)", min=1)
    infini_gate: Optional[Literal["hard_sigmoid", "sigmoid", "tanh"]] = _f(
        None, "infini: gate g of each head's parameter b (null: hard_sigmoid = clamp(0.2 b + 0.5, "
        "0, 1); sigmoid; tanh = (1 + tanh b) / 2)")
    infini_delta_rule: Optional[bool] = _f(None, "infini: delta-rule memory update (null: true)")

    def resolve_preset(self) -> list[str]:
        """Fill null shape keys from the preset (idempotent); return problems."""
        if self.preset == "custom":
            base: dict[str, Any] = {"ffn_hidden": None}
        else:
            base = MODEL_PRESETS[self.preset]
        problems = []
        for key in MODEL_SHAPE_KEYS:
            if getattr(self, key) is None:
                if key in base:
                    setattr(self, key, base[key])
                else:
                    problems.append(f"model.{key}: must be set when model.preset is 'custom' "
                                    f"(or choose a preset: {', '.join(MODEL_PRESETS)})")
        if self.ffn_hidden is None and isinstance(self.d_model, int):
            self.ffn_hidden = llama_ffn_hidden(self.d_model, self.ffn_multiple_of)
        return problems


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
    seed: int = _f(42, "random seed", min=0, max=SEED_MAX)
    num_workers: int = _f(0, "DataLoader worker processes", min=0)
    optimizer: Literal["adamw", "muon"] = _f("adamw", "adamw, or muon: torch.optim.Muon for the 2-D "
                                             "hidden matrices + AdamW for embeddings, norms, head")
    muon_momentum: float = _f(0.95, "Muon momentum", min=0, max=1)
    activation_checkpointing: bool = _f(False, "recompute block activations in the backward pass "
                                        "(less memory, ~1 extra forward)")
    eval_steps: Optional[int] = _f(None, "validate every N steps (overrides eval_every; "
                                   "on-the-fly data has no epoch length)", min=1)
    sample_prompt: str = _f("The history of", "prompt of the sample generated at each validation")
    sample_tokens: int = _f(32, "tokens of that sample (0 = no sample), sampled with the inference "
                            "section's temperature and top-k", min=0)
    test_max_steps: int = _f(200, "--test: at most this many steps (one short epoch)", min=1)
    gate_lr: Optional[float] = _f(None, "infini: peak learning rate of the memory gates, their own "
                                  "parameter group (null: training.lr)", min=0, min_exclusive=True)
    gate_weight_decay: Optional[float] = _f(None, "infini: weight decay of the memory gates "
                                            "(null: 0, as for the other 1-D parameters)", min=0)
    parallel: Literal["ddp", "fsdp"] = _f("ddp", "several processes: ddp (the model on every GPU) or fsdp "
                                          "(FSDP2: weights, gradients and optimizer state sharded; "
                                          "sharded checkpoints, docs/training.md)")
    cpu_offload: bool = _f(False, "fsdp: keep the sharded weights, gradients and optimizer state in "
                           "CPU memory (slower; for models whose shards do not fit the GPUs)")
    max_restarts: int = _f(0, "torchrun restarts of the workers after a rank fails (elastic); restarted "
                           "workers resume from the run's newest checkpoint (0: the job ends)", min=0)


@dataclass
class SFTConfig:
    dataset: str = _f("GAIR/lima", "hub dataset name or local path of LIMA-format data",
                      nonblank=True)
    max_length: int = _f(512, "drop conversations longer than this (tokens)", min=SFT_MIN_LENGTH)
    epochs: int = _f(2, "fine-tuning epochs", min=1)
    batch_size: int = _f(8, "conversations per batch", min=1)
    lr: float = _f(5e-5, "peak learning rate (low to avoid forgetting)", min=0, min_exclusive=True)
    min_lr_ratio: float = _f(0.1, "final learning rate of the cosine decay, as a fraction of lr",
                             min=0, max=1)
    warmup_ratio: float = _f(0.1, "linear warm-up, as a fraction of the run's steps", min=0, max=1)
    weight_decay: float = _f(0.1, "AdamW weight decay (LIMA's 0.1)", min=0)
    beta1: float = _f(0.9, "AdamW beta1", min=0, max=1)
    beta2: float = _f(0.95, "AdamW beta2 (LIMA's 0.95)", min=0, max=1)
    grad_clip: float = _f(1.0, "gradient-norm clip (0 = off)", min=0)
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = _f("auto", "autocast dtype (auto: bf16 on CUDA, "
                                                        "fp32 on CPU)")
    val_split: float = _f(0.1, "held-out fraction", min=0, max=1)
    template: Literal["auto", "user-assistant", "tokenizer"] = _f(
        "auto", "chat template of the prepared data: the tokenizer's own (a public model's, "
        "e.g. SmolLM2's ChatML) when it has one, else our User/Assistant template (auto); "
        "always ours (user-assistant); or the tokenizer's, refused when it has none (tokenizer)")
    user_prefix: str = _f("User: ", "user turn marker (our template)")
    assistant_prefix: str = _f("Assistant: ", "assistant turn marker (our template)")


@dataclass
class LoraConfig:
    rank: int = _f(8, "LoRA rank r of each adapter (sft train --lora)", min=1)
    alpha: float = _f(16.0, "LoRA alpha: the adapter's output is scaled by alpha / rank", min=0,
                      min_exclusive=True)
    dropout: float = _f(0.05, "dropout on the adapter's input while training", min=0, max=0.99)
    target_modules: list[str] = _f(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                    "down_proj"],
                                   "projections that get an adapter: Hugging Face Llama names "
                                   "(q_proj k_proj v_proj o_proj gate_proj up_proj down_proj), ours "
                                   "(wq wk wv wo w_gate w_up w_down), or all-linear")


@dataclass
class RLConfig:
    task: str = _f("arithmetic", "the task: a registered one (arithmetic: 'What is a + b?') or a JSONL "
                   "file of {\"prompt\", \"answer\"} lines (utils/rl/tasks.py)", nonblank=True)
    checker: Literal["auto", "exact", "numeric"] = _f(
        "auto", "verifier: exact match of the reply, or the last number in it (numeric); auto: the "
        "task's own (arithmetic: numeric; a JSONL file: numeric when every answer is a number)")
    max_operand: int = _f(30, "arithmetic: first operands 0..max_operand", min=1)
    max_addend: Optional[int] = _f(None, "arithmetic: second operands 0..max_addend (null: max_operand); "
                                   "every pair once", min=0)
    val_prompts: int = _f(64, "held-out prompts (pass@1 at each validation)", min=1)
    group_size: int = _f(8, "replies sampled per prompt (one group; advantages are per group)", min=2)
    prompts_per_step: int = _f(4, "prompts per optimizer step (batch = prompts x group_size)", min=1)
    max_new_tokens: int = _f(16, "tokens per reply at most", min=1)
    temperature: float = _f(1.0, "rollout sampling temperature", min=0, min_exclusive=True)
    top_k: int = _f(0, "rollout top-k filter (0 = off)", min=0)
    advantage: Literal["grpo", "mean"] = _f(
        "grpo", "per-group advantage: (r - mean) / (std + 1e-4) (grpo, DeepSeekMath, TRL's default) or "
        "r - mean (mean, nanochat / Dr. GRPO)")
    kl_beta: float = _f(0.0, "weight of the KL penalty to the starting model (0 = none, no reference "
                        "copy kept)", min=0)
    steps: int = _f(60, "optimizer steps (one batch of fresh rollouts each)", min=1)
    test_steps: int = _f(4, "--test: at most this many steps", min=1)
    eval_every: int = _f(10, "steps between validations (greedy pass@1 on the held-out prompts)", min=1)
    lr: float = _f(1e-5, "peak learning rate", min=0, min_exclusive=True)
    min_lr_ratio: float = _f(1.0, "final learning rate of the cosine decay, as a fraction of lr "
                             "(1.0: constant)", min=0, max=1)
    warmup_ratio: float = _f(0.0, "linear warm-up, as a fraction of the run's steps", min=0, max=1)
    weight_decay: float = _f(0.0, "AdamW weight decay", min=0)
    beta1: float = _f(0.9, "AdamW beta1", min=0, max=1)
    beta2: float = _f(0.95, "AdamW beta2", min=0, max=1)
    grad_clip: float = _f(1.0, "gradient-norm clip (0 = off)", min=0)
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = _f("auto", "autocast dtype (auto: bf16 on CUDA, "
                                                        "fp32 on CPU)")
    keep_dropout: bool = _f(False, "keep the model's and LoRA's dropout in the policy (default off: "
                            "rollouts are sampled in eval mode, so the trained policy is the one that "
                            "sampled)")


@dataclass
class DPOConfig:
    dataset: str = _f("trl-lib/ultrafeedback_binarized", "hub dataset name or local JSONL of preference "
                      "pairs ({prompt, chosen, rejected}, TRL's shape), or 'samples' (offline "
                      "substitute from SciQ + ARC)", nonblank=True)
    max_length: int = _f(512, "drop pairs whose longer side has more tokens than this",
                         min=SFT_MIN_LENGTH)
    beta: float = _f(0.1, "DPO's beta: how far the policy may move from the reference (TRL's 0.1)",
                     min=0, min_exclusive=True)
    epochs: int = _f(1, "epochs over the training pairs", min=1)
    batch_size: int = _f(4, "pairs per batch (each pair is two sequences)", min=1)
    lr: float = _f(1e-6, "peak learning rate (TRL's default; small models trained briefly need more)",
                   min=0, min_exclusive=True)
    min_lr_ratio: float = _f(0.1, "final learning rate of the cosine decay, as a fraction of lr",
                             min=0, max=1)
    warmup_ratio: float = _f(0.1, "linear warm-up, as a fraction of the run's steps", min=0, max=1)
    weight_decay: float = _f(0.0, "AdamW weight decay (TRL's 0)", min=0)
    beta1: float = _f(0.9, "AdamW beta1", min=0, max=1)
    beta2: float = _f(0.999, "AdamW beta2 (TRL's 0.999)", min=0, max=1)
    grad_clip: float = _f(1.0, "gradient-norm clip (0 = off)", min=0)
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = _f("auto", "autocast dtype (auto: bf16 on CUDA, "
                                                        "fp32 on CPU)")
    keep_dropout: bool = _f(False, "keep the model's and LoRA's dropout in the policy (default off, as "
                            "TRL's disable_dropout: the reference log-probs are computed in eval mode, "
                            "so at step 0 the policy equals the reference)")
    val_split: float = _f(0.1, "held-out fraction of the pairs, drawn once by dpo prepare "
                          "(training.seed)", min=0, max=1)


@dataclass
class InferenceConfig:
    max_new_tokens: int = _f(200, "tokens generated per prompt", min=1)
    temperature: float = _f(0.8, "sampling temperature (0 = greedy)", min=0)
    top_k: int = _f(50, "top-k filter (0 = off)", min=0)
    top_p: float = _f(0.95, "nucleus filter (1.0 = off)", min=0, max=1, min_exclusive=True)
    device: str = _f("auto", "auto, cpu, cuda or cuda:N")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = _f("auto", "infer's weights (auto: bf16 on CUDA, as "
                                                        "stored on CPU; int8: auto only)")
    prefix_cache_mb: int = _f(256, "MiB of KV the interactive chat keeps for reuse by later turns "
                              "(prefix cache; 0: off)", min=0)
    prompt_lookup_num_tokens: int = _f(0, "prompt-lookup speculative decoding: tokens drafted per step "
                                       "from the text's own n-grams for greedy sequences decoding alone "
                                       "(0 = off); infer's and serve's default (a request's "
                                       "prompt_lookup_num_tokens wins)", min=0, max=64)
    compile: Literal["auto", "on", "off"] = _f("auto", "torch.compile the decode step of infer and serve "
                                               "(compiled when the model loads, before any request): auto "
                                               "= on CUDA only, where it pays (docs/performance.md)")


@dataclass
class BenchmarkConfig:
    preset: Literal["quick", "standard", "comprehensive", "full", "smollm2", "core"] = _f(
        "quick", "items per task: quick 50 perplexity passages / 20 LAMBADA / 10 HellaSwag, "
        "standard 100/50/20, comprehensive 200/100/50, full = whole sets; smollm2 and core: "
        "their own task lists and shots, whole sets (docs/benchmark.md)")
    tasks: list[str] = _f(["perplexity", "next_token", "lambada", "hellaswag", "arc_easy",
                      "arc_challenge", "completion"], "tasks to run")
    perplexity_source: Optional[str] = _f(None, "WikiText hub name, local .txt file/folder or "
                                          "XML dump (null: WikiText-103 online, else held-out "
                                          "Wikipedia articles)", nonblank=True)
    lambada_source: Optional[str] = _f(None, "LAMBADA hub name or local .jsonl[.gz] (null: the "
                                       "offline sample, else EleutherAI/lambada_openai)",
                                       nonblank=True)
    hellaswag_source: Optional[str] = _f(None, "HellaSwag hub name or local load_from_disk folder "
                                         "or .jsonl (null: the offline sample, else Rowan/hellaswag)",
                                         nonblank=True)
    arc_easy_source: Optional[str] = _f(None, "ARC-Easy hub name or local folder/.jsonl "
                                        "(null: the offline sample, else allenai/ai2_arc)",
                                        nonblank=True)
    arc_challenge_source: Optional[str] = _f(None, "ARC-Challenge hub name or local folder/.jsonl",
                                             nonblank=True)
    sources: list[str] = _f([], "TASK=SOURCE: a hub name (name:config) or a local folder/file "
                            "for a task (null list: the offline samples, else lm-eval's hub "
                            "datasets)")
    num_fewshot: Optional[int] = _f(None, "solved examples before each item (null: lm-eval's "
                                    "default, 0 for every task)", min=0, max=64)
    contamination_ngram: int = _f(13, "contamination check: n-gram length in tokens", min=4, max=64)
    contamination_threshold: float = _f(0.8, "contamination check: an item is contaminated when "
                                        "this share of its tokens lies in n-grams found in the "
                                        "training shards", min=0, max=1, min_exclusive=True)
    seed: int = _f(1234, "seed of the fixed item selection", min=0, max=SEED_MAX)
    batch_size: int = _f(8, "sequences per forward pass", min=1)
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = _f("auto", "autocast dtype (auto: bf16 on "
                                                        "CUDA, float32 on CPU)")
    device: str = _f("auto", "auto, cpu, cuda or cuda:N")
    passkey_lengths: list[int] = _f([256, 512, 1024, 2048, 4096], "passkey: context lengths of the "
                                    "grid, in tokens of the model's tokenizer", min=16)
    passkey_depths: list[int] = _f([0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100], "passkey: needle "
                                   "depths in percent (0: after the instructions, 100: before the "
                                   "question)", min=0, max=100)
    passkey_digits: int = _f(5, "passkey: digits of each key", min=1, max=18)


@dataclass
class ServeConfig:
    host: str = _f("127.0.0.1", "address to bind (anything but loopback without an API key warns)")
    port: int = _f(8000, "TCP port (0 = any free port, printed at start)", min=0, max=65535)
    max_batch: int = _f(8, "sequences decoded together per model (KV cache slots; more wait)", min=1)
    max_tokens: int = _f(256, "default max_tokens of a request that gives none", min=1)
    context: int = _f(0, "positions per request, prompt + completion (0: the model's own context; "
                      "a smaller value shrinks every KV cache slot)", min=0)
    max_messages: int = _f(64, "most chat messages in one request", min=1)
    max_prompt_chars: int = _f(100_000, "most characters in one request's prompt or messages", min=1)
    max_n: int = _f(8, "most choices (n) per request", min=1)
    max_queue: int = _f(256, "most requests waiting or running per model (more: HTTP 429)", min=1)
    quantize: Literal["none", "int8"] = _f("none", "weights of the served models (int8: weight-only)")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = _f("auto", "the served models' weights (auto: bf16 on "
                                                        "CUDA, as stored on CPU; int8: auto only)")
    shutdown_grace: float = _f(5.0, "seconds running generations get to finish on SIGINT/SIGTERM "
                               "before they are cut", min=0)
    device: str = _f("auto", "auto, cpu, cuda or cuda:N")
    stream_interval: float = _f(0.02, "least seconds between two writes of a stream: faster tokens go "
                                "out together, one chunk per choice (0: a chunk per token)", min=0)
    idle_timeout: float = _f(5.0, "seconds a connection with no request under way (just opened, or "
                             "after its last answer) stays open", min=0, min_exclusive=True)
    read_timeout: float = _f(30.0, "seconds a request has, from its first byte, to send its headers and "
                             "its whole body (beyond: HTTP 408, connection closed)", min=0, min_exclusive=True)
    prefix_cache_mb: int = _f(256, "MiB of KV per model kept for reuse by later requests that start "
                              "with the same tokens (prefix cache, LRU; 0: off)", min=0)
    cors_origins: list[str] = _f([], "origins (scheme://host[:port], or \"*\" for any) whose web pages may "
                                 "call the API from a browser (CORS); []: only the server's own chat page")


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
    dpo: DPOConfig = field(default_factory=DPOConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # Not a config.json key: set by --test on the command line.
    test: bool = field(default=False, metadata={"internal": True})
    sources: list = field(default_factory=list, metadata={"internal": True})
    # dotted key -> the layer that set it (file path or "command-line flags"), for messages.
    origins: dict = field(default_factory=dict, metadata={"internal": True})

    # ------------------------------------------------------------------ paths
    def resolve(self, p: Optional[str | os.PathLike], key: Optional[str] = None) -> Optional[Path]:
        """Resolve a configured path: absolute stays, relative is under paths.root. ``key``:
        the dotted key it came from, for the error of a path that cannot be resolved."""
        if p is None:
            return None
        p = Path(os.path.expanduser(str(p)))
        if p.is_absolute():
            return p
        return _resolved(self.root / p, key)

    @property
    def root(self) -> Path:
        r = Path(os.path.expanduser(self.paths.root))
        return r if r.is_absolute() else _resolved(PROJECT_ROOT / r, "paths.root")

    def path(self, dotted: str) -> Path:
        """``cfg.path("paths.cleaned_dir")`` -> resolved Path of that key."""
        sec, key = dotted.split(".", 1)
        return self.resolve(getattr(getattr(self, sec), key), dotted)

    def shard_dir(self, source: Optional[str] = None, test: Optional[bool] = None) -> Path:
        """The token shard directory for a source (wikipedia|fineweb) in test or full mode."""
        source = source or self.dataset.source
        test = self.test if test is None else test
        key = f"{source}_{'test' if test else 'full'}_dir"
        return self.resolve(getattr(self.dataset, key), f"dataset.{key}")

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
    if origin is list and typing.get_args(tp):
        plural = {int: "integers", float: "numbers", str: "strings", bool: "true/false values"}
        inner = typing.get_args(tp)[0]
        return "a list of " + plural.get(inner, _type_name(inner))
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
        return _check_value(key, value, inner[0], {**meta, "nullable": type(None) in args})
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            hint = _suggest(str(value), [str(c) for c in choices])
            return value, f"{key}: {value!r} is not {_type_name(tp)}{hint}"
        return value, None
    # report the value as the user wrote it (NaN, Infinity included; 1e400 as 1e400)
    shown = value.text if isinstance(value, _WrittenFloat) else json.dumps(value)
    if tp is list or origin is list:
        return _check_list(key, value, tp, meta, shown)
    value, problem = _check_type(key, value, tp, meta, shown)
    return value, problem or _range_problem(key, value, meta, shown)


def _check_list(key: str, value: Any, tp, meta: dict, shown: str) -> tuple[Any, Optional[str]]:
    """A list, each item checked against the list's item type (all problems joined)."""
    if not isinstance(value, list):
        return value, f"{key}: expected {_type_name(tp)}, got {shown}"
    (inner,) = typing.get_args(tp) or (Any,)
    if inner is Any:
        return value, None
    checked = [_check_value(f"{key}[{i}]", v, inner, meta) for i, v in enumerate(value)]
    problems = [p for _, p in checked if p]
    return [v for v, _ in checked], ("; ".join(problems) if problems else None)


def _check_type(key: str, value: Any, tp, meta: dict, shown: str) -> tuple[Any, Optional[str]]:
    """A bool, int, float or str value of that type (an integral float as an int, a number as
    a float); a float must be finite, a string passes :func:`_string_problem`."""
    bad = f"{key}: expected {_type_name(tp)}, got {shown}"
    if tp is bool:
        return value, (None if isinstance(value, bool) else bad)
    if tp is int:
        if not isinstance(value, bool) and isinstance(value, int):
            return value, None
        if isinstance(value, float) and value.is_integer():
            return int(value), None
        return value, bad
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value, bad
        written = isinstance(value, _WrittenFloat)
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value):
            why = "beyond a float's range" if written else "NaN and Infinity are not allowed"
            return value, f"{key}: expected a finite number, got {shown} ({why})"
        return value, None
    if tp is str:
        return value, (_string_problem(key, value, meta) if isinstance(value, str) else bad)
    return value, None


def _string_problem(key: str, value: str, meta: dict) -> Optional[str]:
    """A path-like key's value that is blank or holds a NUL; a folder name that is a path."""
    if meta.get("nonblank") and not value.strip():
        return _blank_problem(key, value, meta)
    if meta.get("nonblank") and "\x00" in value:
        return (f"{key}: {json.dumps(value)} holds a NUL character (\\u0000), which no file "
                f"or folder name can hold; give the path without it.")
    if meta.get("folder") and (value.strip() in (".", "..") or "/" in value or "\\" in value):
        return (f"{key}: {json.dumps(value)} is not a folder name: give one name ({meta['help']}), "
                f"not a path.")
    return None


def _range_problem(key: str, value: Any, meta: dict, shown: str) -> Optional[str]:
    """A number outside the key's ``min``/``max`` (``min_exclusive``), or an integer beyond 64 bits."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and (value < lo or (meta.get("min_exclusive") and value == lo)):
        op = ">" if meta.get("min_exclusive") else ">="
        return f"{key}: {shown} is out of range (must be {op} {lo})"
    if hi is not None and value > hi:
        return f"{key}: {shown} is out of range (must be <= {hi})"
    if isinstance(value, int) and not INT_MIN <= value <= INT_MAX:
        return f"{key}: {shown} is out of range (an integer key must fit 64 bits)"
    return None


def _blank_problem(key: str, value: str, meta: dict) -> str:
    """The one check for every path-like key (a path, a hub name or a path, a folder name): an
    empty or all-space value resolves to the folder it is relative to (``Path("")`` is "."),
    never to a file or folder of its own."""
    base = {"paths.root": "the project root",
            "tokenizer.train_name": "the tokenizers folder (paths.tokenizers_dir)"}.get(key, "paths.root")
    what = "empty" if not value else "only spaces"
    default = " or null for the default" if meta.get("nullable") else ""
    return (f"{key}: {json.dumps(value)} is {what}; as a path it would mean {base} itself. Give "
            f"a value ({meta.get('help') or 'a path'}){default}.")


def _section_fields(cls) -> dict[str, tuple[Any, dict]]:
    hints = typing.get_type_hints(cls, include_extras=False)
    return {f.name: (hints[f.name], dict(f.metadata)) for f in dataclasses.fields(cls)}


def _duplicates(data: Any) -> list[str]:
    """Problems for keys given twice in one JSON object (the last would silently win)."""
    dups = getattr(data, "duplicates", None) or {}
    return [f"{key}: given {len(lines)} times"
            f"{' (lines ' + ', '.join(map(str, lines)) + ')' if lines else ''}; keep only one "
            f"(JSON would silently use the last)" for key, lines in dups.items()]


def apply_layer(cfg: Config, data: Any, source: str, problems: list[str]) -> None:
    """Validate one layer (a parsed JSON object) and apply it onto cfg; collect problems."""
    if not isinstance(data, dict):
        problems.append(f"{source}: the top level must be a JSON object of sections, "
                        f'such as {{"training": {{"lr": 0.001}}}}')
        return
    problems += _duplicates(data)
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
        problems += [f"{sec_name}.{p}" for p in _duplicates(sec_data)]
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
                cfg.origins[dotted] = source


# ----------------------------------------------------------------------------- reading files
class _JSONObject(dict):
    """A parsed JSON object that remembers keys given more than once: {key: [line, ...]}."""

    duplicates: dict[str, list[int]] = {}


def _key_lines(s: str, start: int, end: int, key: str) -> list[int]:
    """Lines where ``key`` is a key of the object spanning s[start:end] (nested ones skipped)."""
    lines, depth, i = [], 0, start
    while i < end:
        c = s[i]
        if c == '"':
            text, j = json.decoder.scanstring(s, i + 1)
            if depth == 0 and text == key and s[j:end].lstrip().startswith(":"):
                lines.append(s.count("\n", 0, i) + 1)
            i = j
            continue
        depth += (c in "{[") - (c in "}]")
        i += 1
    return lines


def _parse_object(s_and_end, strict, scan_once, object_hook, object_pairs_hook, memo=None):
    s, start = s_and_end
    pairs, end = json.decoder.JSONObject(s_and_end, strict, scan_once, None, list, memo)
    obj = _JSONObject(pairs)
    counts = Counter(k for k, _ in pairs)
    if any(n > 1 for n in counts.values()):
        obj.duplicates = {k: _key_lines(s, start, end, k) for k, n in counts.items() if n > 1}
    return obj, end


class _WrittenFloat(float):
    """A JSON number beyond a float's range (``1e400`` reads as inf) that keeps the text the
    user wrote, so a message quotes that and not "Infinity", which the file never said."""
    text: str

    def __new__(cls, text: str):
        v = super().__new__(cls, text)
        v.text = text
        return v


def _parse_float(text: str) -> float:
    v = float(text)
    return _WrittenFloat(text) if math.isinf(v) else v


def parse_json(text: str) -> Any:
    """json.loads that keeps duplicated keys visible (see _JSONObject). NaN and Infinity are
    parsed as floats so the validator can name the key that holds them; a number beyond a
    float's range keeps its text (_WrittenFloat)."""
    decoder = json.JSONDecoder(parse_float=_parse_float)
    decoder.parse_object = _parse_object
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # the C scanner ignores parse_object
    return decoder.decode(text)


def json_type(v: Any) -> str:
    """The JSON name of a parsed value's type: object, array, string, boolean, null or number."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "number", float: "number"}.get(type(v), type(v).__name__)


class _RepeatedKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _object_without_repeats(pairs: list) -> dict:
    """``object_pairs_hook`` for json.loads: the object, or _RepeatedKey for a key given twice
    (the C scanner still does the parsing)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _RepeatedKey(k)
        out[k] = v
    return out


def read_json_object_file(path) -> tuple[Optional[dict], str]:
    """(the JSON object in file ``path``, "") or (None, why not), the reason worded to follow
    the file's name: "is not a regular file", "cannot be read (...)", "is empty", "is not UTF-8
    text (byte 0x.. at offset N)", "is not valid JSON: <what> at line L, column C (it looks
    truncated)", "is not valid JSON (nested too deeply)", "holds a JSON array, not an object".
    A key given twice in one object is "gives key 'k' twice in one object ..." (JSON readers
    silently keep the last, so a hand-edited ``"hidden_size"`` added below the old one won).
    The one reader of the JSON files other tools wrote (tokenizer and HF model folders)."""
    path = Path(path)
    if not path.is_file():
        return None, "is not a regular file"
    try:
        raw = path.read_bytes()
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_object_without_repeats)
    except _RepeatedKey as e:
        return None, (f"gives the key {e.key[:60]!r} twice in one object (JSON readers would "
                      "silently take the last one): keep only one")
    except json.JSONDecodeError as e:
        if not e.doc.strip():
            return None, "is empty"
        end = " (it looks truncated)" if e.pos >= len(e.doc.rstrip()) else ""
        return None, f"is not valid JSON: {json_error_text(e)} at line {e.lineno}, column {e.colno}{end}"
    except UnicodeDecodeError as e:
        return None, f"is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})"
    except (ValueError, RecursionError) as e:          # 4,300+ digit integers, nesting too deep
        return None, f"is not valid JSON ({json_error_text(e)})"
    if not isinstance(data, dict):
        return None, f"holds a JSON {json_type(data)}, not an object"
    return data, ""


def json_error_text(e: Exception) -> str:
    """Why ``json.loads`` refused a text, for any of the ways it can: a syntax error (json's
    message without its dangling " at"), nesting deeper than the parser's recursion limit
    (RecursionError), an integer of more than 4,300 digits or bytes that are not UTF-8 (plain
    ValueErrors)."""
    if isinstance(e, json.JSONDecodeError):
        return e.msg[:-3] if e.msg.endswith(" at") else e.msg
    if isinstance(e, RecursionError):
        return "nested too deeply"
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start})"
    text = str(e).split(";")[0]               # "Exceeds the limit (4300 digits) ...: value has N digits"
    return f"a number too long to read ({text})" if "digits" in text else text


def _syntax_hint(text: str, e: json.JSONDecodeError) -> str:
    """What most likely went wrong, for the mistakes people make writing JSON by hand."""
    here = text[e.pos:e.pos + 2]
    first = text.lstrip()[:1]
    if first and first not in "{[\"" and (text.lstrip().startswith("---")
                                       or re.match(r"\s*[A-Za-z_][\w.-]*\s*:", text)):
        return (" (this looks like YAML; config files are JSON, e.g. "
                '{"training": {"lr": 0.001}})')
    if here in ("//", "/*") or here[:1] == "#":
        return (" (JSON has no comments: remove them, or keep notes in a key starting with "
                '"_", such as "_comment")')
    if here[:1] == "'":
        return " (JSON strings and keys use double quotes)"
    if e.msg.startswith("Invalid control character"):
        return r" (write a tab or line break inside a string as \t or \n)"
    before = text[:e.pos].rstrip()
    if before.endswith(",") and here[:1] in "}]":
        return " (remove the trailing comma)"
    return ""


def read_json_file(path: Path, given_by: str = "--config") -> Any:
    """Read and parse one config file; every way it can be unreadable is a ConfigError.
    ``given_by``: what named the file (for a missing one)."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError([f"{path}: file not found (pass an existing file to {given_by})"], str(path))
    except OSError as e:
        raise ConfigError([f"{path}: cannot read ({e.strerror or e})"], str(path))
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError([f"{path}: the file is UTF-16 text; save it as UTF-8"], str(path))
    try:
        text = raw.decode("utf-8-sig")  # a leading byte-order mark is tolerated
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError([f"{path}, line {line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at "
                           f"offset {e.start}); save the file as UTF-8"], str(path))
    if not text.strip():
        raise ConfigError([f"{path}: the file is empty; a config file is a JSON object such as "
                           f'{{"training": {{"lr": 0.001}}}} (or {{}} for all defaults)'], str(path))
    try:
        return parse_json(text)
    except json.JSONDecodeError as e:
        raise ConfigError([f"{path}, line {e.lineno} column {e.colno}: invalid JSON: "
                           f"{json_error_text(e)}{_syntax_hint(text, e)}"], str(path))
    except (ValueError, RecursionError) as e:           # too deep, or an integer of 4,300+ digits
        raise ConfigError([f"{path}: invalid JSON: {json_error_text(e)}"], str(path))


def base_config_file() -> Optional[Path]:
    """The base layer: config.json, or what ``$LLM_PIPELINE_BASE_CONFIG`` names ("none": none)."""
    env = os.environ.get(BASE_CONFIG_ENV)
    if env is None:
        return DEFAULT_CONFIG_FILE
    if env.strip().lower() in ("", "none"):
        return None
    return Path(env)


def load_config(config_file: Optional[str | os.PathLike | list] = None,
                overrides: Optional[dict[str, Any]] = None,
                test: bool = False,
                base_file: Any = "env") -> Config:
    """Build the Config: defaults < base_file (config.json) < config_file < overrides.
    ``config_file`` may be a list of files, layered in order (``--config A --config B``).

    ``base_file`` "env" means :func:`base_config_file` (config.json unless
    ``$LLM_PIPELINE_BASE_CONFIG`` says otherwise); None means the dataclass defaults alone.
    ``overrides`` maps dotted keys (``"dataset.window"``) to values from CLI flags.
    Raises one ConfigError listing every problem of every layer, each naming its file;
    checks across keys run once every layer is valid and name the files that set the keys.
    """
    if isinstance(base_file, str) and base_file == "env":
        base_file = base_config_file()
    cfg = Config(test=test)
    layers: list[tuple[str, Any]] = []   # (source, a function giving the parsed layer)
    if base_file is not None and (Path(base_file) != DEFAULT_CONFIG_FILE or Path(base_file).exists()):
        given_by = f"${BASE_CONFIG_ENV}" if os.environ.get(BASE_CONFIG_ENV) else "the base config"
        layers.append((str(base_file), lambda p=Path(base_file): read_json_file(p, given_by)))
    files = config_file if isinstance(config_file, (list, tuple)) else [config_file]
    for cf in (Path(f) for f in files if f is not None):
        if base_file is None or cf.resolve() != Path(base_file).resolve():
            layers.append((str(cf), lambda p=cf: read_json_file(p)))
    if overrides:
        nested: dict[str, dict] = {}
        for dotted, value in overrides.items():
            sec, key = dotted.split(".", 1)
            nested.setdefault(sec, {})[key] = value
        layers.append(("command-line flags", lambda: nested))
    failed: list[tuple[str, list[str]]] = []
    for source, read in layers:
        problems: list[str] = []
        try:
            apply_layer(cfg, read(), source, problems)
        except ConfigError as e:   # unreadable or not JSON: its one problem already names the file
            failed.append((source, e.problems))
            continue
        if problems:
            failed.append((source, problems))
        else:
            cfg.sources.append(source)
    if failed:
        raise ConfigError.combine(failed)
    problems = cross_checks(cfg)  # also fills the model's shape keys from model.preset
    if problems:
        raise ConfigError([_with_origins(cfg, p) for p in problems],
                          "the combined configuration (" + ", ".join(["defaults", *cfg.sources]) + ")")
    return cfg


def _with_origins(cfg: Config, problem: str) -> str:
    """Append which layer set each key a cross-field problem mentions (defaults included)."""
    keys = [k for k in dict.fromkeys(re.findall(r"\b([a-z_]+\.[a-z_0-9]+)\b", problem))
            if k.split(".")[0] in SECTIONS]
    if not keys:
        return problem
    by_source: dict[str, list[str]] = {}
    for k in keys:
        by_source.setdefault(cfg.origins.get(k, "the defaults"), []).append(k)
    return problem + " [" + "; ".join(f"{', '.join(ks)} from {src}"
                                      for src, ks in by_source.items()) + "]"


# --------------------------------------------------------------------------- the model's shape
MAX_POSITIONS = 1 << 22     # model.max_seq_len limit: RoPE tables of 4M positions x head_dim 128 take 2 GiB
MAX_PARAMS = 10 ** 12       # a model of more weights is refused before anything is built (4 TB in fp32)
MODEL_INT_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len")
# The values of the model's named settings. ModelConfig's Literal types are the one list;
# utils/activations.py and utils/infini.py implement each (tests/test_layout.py checks it).
_MODEL_HINTS = typing.get_type_hints(ModelConfig)
ACTIVATIONS = typing.get_args(_MODEL_HINTS["activation"])
NORMS = typing.get_args(_MODEL_HINTS["norm"])
ATTENTIONS = typing.get_args(_MODEL_HINTS["attention"])
INFINI_GATES = typing.get_args(typing.get_args(_MODEL_HINTS["infini_gate"])[0])   # Optional[Literal]
INFINI_TRAINING_KEYS = ("gate_lr", "gate_weight_decay")


def model_arguments(m: ModelConfig, vocab_size: Optional[int], bos_id: Optional[int]) -> dict[str, Any]:
    """The translation of config.json's ``model`` section for a tokenizer of ``vocab_size``
    tokens (None: unknown) whose BOS id is ``bos_id`` (None: it has none): the section's keys
    by name (model.ModelArgs' fields, plus preset and ffn_multiple_of) with the preset filling
    the shape keys left null (explicit keys win), the vocabulary the tokenizer's unless
    model.vocab_size sets a larger one, and bos_id the tokenizer's. ``m`` is not changed.
    Raises ConfigError (exit 2) listing every problem (:func:`model_problems`)."""
    m = dataclasses.replace(m)
    problems = m.resolve_preset()
    vocab = m.vocab_size if m.vocab_size is not None else vocab_size
    if vocab is None:
        problems.append("model.vocab_size: unknown (set it, or load the tokenizer to use its size)")
    elif vocab_size is not None and vocab < vocab_size:
        problems.append(f"model.vocab_size: {vocab} is smaller than the tokenizer's vocabulary "
                        f"({vocab_size}); token ids would fall outside the embedding (use null)")
    values = {**dataclasses.asdict(m), "vocab_size": vocab, "bos_id": bos_id}
    problems += model_problems(_known(values))
    if problems:
        raise ConfigError(problems, "the model configuration")
    return values


def _known(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` without the keys whose null means "not known yet": the shape keys a custom
    preset leaves unset, a vocabulary left to the tokenizer."""
    return {k: v for k, v in values.items() if v is not None or k not in (*MODEL_SHAPE_KEYS, "vocab_size")}


def model_problems(m: dict[str, Any], window: Optional[int] = None) -> list[str]:
    """Every problem of a model's arguments, each naming its ``model.<key>`` and what is wrong:
    the one check of a model's shape, behind config.json's ``model`` section
    (:func:`cross_checks`, with ``dataset.window``), its translation for a tokenizer
    (:func:`model_arguments`) and ``model.ModelArgs`` (checkpoints, Hugging Face imports).
    ``m`` maps ModelArgs' field names to values; a key absent from ``m`` is not known yet and
    the checks that need it are skipped (config.json leaves vocab_size and bos_id to the
    tokenizer). Integers that are not positive are reported alone: the other checks divide
    and multiply by them."""
    p = [f"model.{k}: expected a positive integer, got {m[k]!r}" for k in MODEL_INT_KEYS
         if k in m and not _positive_int(m[k])]
    if p:
        return p
    p = _size_problems(m)
    p += _setting_problems(m)
    return p + _infini_problems(m, window)


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def model_weight_count(m: dict[str, Any]) -> int:
    """The model's parameters, from its arguments alone (no model built): embeddings (and an
    untied head), per layer the attention and gated-MLP products and two norms, the final norm."""
    d, hd = m["d_model"], m["d_model"] // m["n_heads"]
    attn = d * hd * (2 * m["n_heads"] + 2 * m["n_kv_heads"])
    layer = attn + 3 * d * m["ffn_hidden"] + 2 * d
    return m["n_layers"] * layer + m["vocab_size"] * d * (1 if m["tie_embeddings"] else 2) + d


def _size_problems(m: dict[str, Any]) -> list[str]:
    """Positions, head arithmetic, and the weight count (once the rest is sound)."""
    p = []
    if "max_seq_len" in m and m["max_seq_len"] > MAX_POSITIONS:
        p.append(f"model.max_seq_len: {m['max_seq_len']:,} positions is beyond the {MAX_POSITIONS:,} this "
                 "model supports (its RoPE tables cover max_seq_len positions)")
    if all(k in m for k in ("d_model", "n_heads", "n_kv_heads")):
        d_model, n_heads, n_kv_heads = m["d_model"], m["n_heads"], m["n_kv_heads"]
        if n_heads % n_kv_heads:
            p.append(f"model.n_kv_heads: {n_kv_heads} must divide model.n_heads ({n_heads})")
        if d_model % n_heads:
            p.append(f"model.d_model: {d_model} must be divisible by model.n_heads ({n_heads})")
        elif (d_model // n_heads) % 2:
            p.append(f"model.d_model: head size {d_model // n_heads} must be even for RoPE")
    sized = not p and all(k in m for k in (*MODEL_INT_KEYS, "tie_embeddings"))
    if sized and model_weight_count(m) > MAX_PARAMS:
        p.append(f"model: vocab_size {m['vocab_size']:,}, d_model {m['d_model']:,}, n_layers "
                 f"{m['n_layers']:,} and ffn_hidden {m['ffn_hidden']:,} make {model_weight_count(m):.3g} "
                 f"weights, beyond the {MAX_PARAMS:.0e} this pipeline builds (building them layer by "
                 "layer hung or ran out of memory); lower them")
    return p


def _setting_problems(m: dict[str, Any]) -> list[str]:
    """The named settings, the float settings, the BOS id and the attention kind."""
    p = []
    if "activation" in m and m["activation"] not in ACTIVATIONS:
        p.append(f"model.activation: {m['activation']!r} is not one of {', '.join(ACTIVATIONS)}")
    if "norm" in m and m["norm"] not in NORMS:
        p.append(f"model.norm: {m['norm']!r} is not one of {', '.join(map(repr, NORMS))}")
    for name in (n for n in ("norm_eps", "rope_theta", "init_std", "dropout") if n in m):
        v = m[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            p.append(f"model.{name}: expected a finite number, got {v!r}")
        elif name == "dropout" and not 0.0 <= v < 1.0:
            p.append(f"model.dropout: {v} must be in [0, 1)")
        elif name != "dropout" and v <= 0:
            p.append(f"model.{name}: {v} must be > 0")
    bos = m.get("bos_id")
    if bos is not None and "vocab_size" in m and not 0 <= bos < m["vocab_size"]:
        p.append(f"model.bos_id: {bos} is outside the vocabulary (0..{m['vocab_size'] - 1})")
    if m.get("document_mask") and "bos_id" in m and bos is None:
        p.append("model.document_mask: the tokenizer has no BOS token to find documents by "
                 "(documents start at BOS); set model.document_mask to false")
    attention, segment = m.get("attention", "standard"), m.get("segment_length")
    if attention not in ATTENTIONS:
        p.append(f"model.attention: {attention!r} is not one of {', '.join(map(repr, ATTENTIONS))}")
    elif attention == "infini" and segment is not None and not _positive_int(segment):
        p.append(f"model.segment_length: expected a positive integer, got {segment!r}")
    elif attention == "infini" and m.get("infini_gate") not in (None, *INFINI_GATES):
        p.append(f"model.infini_gate: {m['infini_gate']!r} is not one of {', '.join(INFINI_GATES)}")
    return p


def _infini_problems(m: dict[str, Any], window: Optional[int]) -> list[str]:
    """Infini-attention's settings: set only on an infini model, segments that tile
    ``window`` (dataset.window, when known), no document mask."""
    attention, segment_length = m.get("attention", "standard"), m.get("segment_length")
    if attention != "infini":
        return [f"model.{k}: is an Infini-attention setting, but model.attention is '{attention}' "
                "(set model.attention to 'infini', or leave the key null)"
                for k in ("segment_length", "infini_gate", "infini_delta_rule") if m.get(k) is not None]
    p = []
    if segment_length is None:
        p.append("model.segment_length: must be set when model.attention is 'infini' (tokens per "
                 "segment; it must divide dataset.window)")
    elif window is not None and (segment_length > window or window % segment_length):
        p.append(f"model.segment_length: {segment_length} must divide dataset.window ({window}) "
                 "(the window is a whole number of segments)")
    if m.get("document_mask"):
        p.append("model.document_mask: not available with model.attention 'infini' (the memory "
                 "would have to restart inside a segment at each document); train on packed "
                 "windows without it")
    return p


def cross_checks(cfg: Config) -> list[str]:
    """Checks that involve more than one key."""
    m = cfg.model
    p = m.resolve_preset()
    p += model_problems(_known(dataclasses.asdict(m)), cfg.dataset.window)
    if m.attention != "infini":
        p += [f"training.{k}: is an Infini-attention setting (the memory gates' own parameter "
              f"group), but model.attention is '{m.attention}' (leave it null)"
              for k in INFINI_TRAINING_KEYS if getattr(cfg.training, k) is not None]
    if cfg.dataset.window > m.max_seq_len:
        p.append(f"dataset.window: {cfg.dataset.window} exceeds model.max_seq_len ({m.max_seq_len}); "
                 f"raise model.max_seq_len or lower dataset.window")
    d = cfg.dataset
    if d.stride is not None and d.stride > d.window:
        p.append(f"dataset.stride: {d.stride} must be <= dataset.window ({d.window})")
    if cfg.training.min_lr > cfg.training.lr:
        p.append(f"training.min_lr: {cfg.training.min_lr} must be <= training.lr ({cfg.training.lr})")
    return p


def describe_keys() -> list[tuple[str, str, Any]]:
    """(dotted key, help, default) for documentation."""
    out = []
    for sec, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append((f"{sec}.{f.name}", f.metadata.get("help", ""), default))
    return out
