"""The model card (README.md) of an export: what the model is, what it was trained on, how
far, how good it got (library; no side effects). Everything comes from the checkpoint and what
the export stage found beside it (:class:`Sources`: the run folder's record of its data, the
benchmark scores of these weights); a missing part is left out, never guessed.

    card = model_card(path, ckpt, model, tok_info, Sources(...), fmt="hf", dtype=None, license="mit")
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


@dataclass
class Sources:
    """What the card says beyond the checkpoint, each None (or empty) when it was not found:
    the run folder's record of its data (utils/run.py) and the newest benchmark scores of
    exactly these weights (utils/bench/report.py ``scored_results``)."""
    dataset: Optional[dict] = None     # a pre-training run's stored dataset section
    test: Optional[bool] = None        # whether that run had --test (None: unknown)
    sft_config: Optional[dict] = None  # an SFT run's sft_config.json
    scores: list = field(default_factory=list)   # (task, metric, value as shown)
    scores_file: Optional[str] = None  # the result file they come from


def trained_on(data: dict, test: Optional[bool], a) -> str:
    """What a pre-training run read, from its config's dataset section (``test``: whether it
    ran with --test, None when unknown): the shard set (or the streamed source) and the
    window length."""
    window = data.get("window", a.max_seq_len)
    if data.get("mode") == "on_the_fly":
        return (f"- data: {data.get('on_the_fly_source', 'unknown')} (tokenized on the fly), "
                f"windows of {window} tokens")
    source = data.get("source")
    if not source:
        return "- data: not recorded in the checkpoint"
    where = None if test is None else data.get(f"{source}_{'test' if test else 'full'}_dir")
    return (f"- data: {source} shards" + (f" (`{Path(where).name}`{', --test' if test else ''})"
                                          if where else "") + f", windows of {window} tokens")


def model_card(path: Path, ckpt: dict, model, tok_info: dict, sources: Sources, *, fmt: str,
               dtype: Optional[str], license: str, title: Optional[str] = None) -> str:
    """The card's Markdown: its YAML header, the model, its training and its benchmarks."""
    lines = _header(path, ckpt, model, tok_info, fmt=fmt, dtype=dtype, license=license, title=title)
    lines += _training(ckpt, model.args, sources)
    lines += ["", "## Benchmarks", ""]
    if sources.scores:
        lines += [f"Scored on exactly these weights (`{sources.scores_file}`):", "",
                  "| task | metric | value |", "| --- | --- | --- |",
                  *[f"| {task} | {metric} | {value} |" for task, metric, value in sources.scores]]
    else:
        lines.append("No benchmark result names these weights (`python main.py benchmark` "
                     "scores a checkpoint).")
    return "\n".join(lines) + "\n"


def _header(path: Path, ckpt: dict, model, tok_info: dict, *, fmt: str, dtype: Optional[str],
            license: str, title: Optional[str]) -> list[str]:
    """The YAML header, the title and the Model section."""
    a, kind = model.args, ckpt.get("kind", "pretrain")
    what = {"sft": "trained with this project's pipeline (supervised fine-tuning)",
            "dpo": "trained with this project's pipeline (preference tuning, DPO)",
            "imported": "imported into this project's pipeline (not trained by it)"}.get(
                kind, "trained with this project's pipeline (pre-training)")
    return ["---", f"license: {license}", "library_name: transformers" if fmt == "hf" else
            "library_name: gguf", "pipeline_tag: text-generation",
            "tags: [llama, text-generation, llm-pipeline]", "---", "",
            f"# {title or path.parent.name or path.stem}", "",
            f"A Llama-architecture language model {what}, exported from "
            f"`{path.name}` as {'a Hugging Face model folder' if fmt == 'hf' else 'GGUF for llama.cpp'}"
            + (f" ({dtype})" if dtype else "") + ".", "", "## Model", "",
            f"- parameters: {model.num_params():,} ({model.num_params(non_embedding=True):,} "
            "without embeddings)",
            f"- d_model {a.d_model}, {a.n_layers} layers, {a.n_heads} heads ({a.n_kv_heads} "
            f"key/value heads), MLP {a.ffn_hidden} ({a.activation}), context {a.max_seq_len}, "
            f"RoPE base {a.rope_theta:g}, {'tied' if a.tie_embeddings else 'untied'} embeddings",
            f"- tokenizer: {tok_info.get('name')} ({tok_info.get('vocab_size')} tokens, "
            f"fingerprint {str(tok_info.get('fingerprint'))[:12]})"
            + ("" if kind == "imported" else "; texts start with BOS"), ""]


def _training(ckpt: dict, a, sources: Sources) -> list[str]:
    """The Training section: what the model was trained (or fine-tuned) on, and how far."""
    kind, best = ckpt.get("kind", "pretrain"), ckpt.get("best_val_loss")
    lines = ["## Training", ""]
    if kind == "imported":
        return lines + ["- not trained here: see the card of the model it was imported from"]
    if kind == "sft":
        sft = ckpt.get("sft") or {}
        data = (sources.sft_config or {}).get("data") or {}
        source = data.get("source") if isinstance(data.get("source"), dict) else {}
        lines.append(f"- fine-tuned from `{sft.get('base_checkpoint')}` on instruction data"
                     + (f": {source['label']}" if source.get("label") else "")
                     + (f", {data['train_examples']:,} training conversations"
                        if isinstance(data.get("train_examples"), int) else "")
                     + f" (data fingerprint {str(sft.get('data_fingerprint'))[:12]}), loss on "
                     "the assistant's tokens only; chat template in the tokenizer")
    elif kind == "dpo":
        dpo = ckpt.get("dpo") or {}
        lines.append(f"- preference-tuned (DPO, beta {dpo.get('beta')}) from `{dpo.get('base_checkpoint')}` "
                     f"on preference pairs (data fingerprint {str(dpo.get('data_fingerprint'))[:12]}), "
                     "log-probabilities of the answers only; chat template in the tokenizer")
    else:       # the run folder's stored config knows --test; the checkpoint's alone does not
        conf = ckpt.get("config") if isinstance(ckpt.get("config"), dict) else {}
        data = sources.dataset if sources.dataset is not None else conf.get("dataset")
        lines.append(trained_on(data if isinstance(data, dict) else {}, sources.test, a))
    return lines + [f"- optimizer steps: {ckpt.get('step', 'unknown')}",
                    f"- tokens seen: {ckpt['tokens_seen']:,}" if isinstance(ckpt.get("tokens_seen"), int)
                    else "- tokens seen: unknown",
                    f"- best validation loss: {best:.4f}" if isinstance(best, float) else
                    "- best validation loss: not recorded"]


# Why the export of an imported model writes a config.json key otherwise than the model's own
CONFIG_REASONS = {
    "dtype": "the dtype the weights are written in: --dtype, by default the one the imported "
             "config.json names when the weights are exactly its values, else theirs (float32)",
    "torch_dtype": "`dtype` under its older name, which transformers 4.x, vLLM and llama.cpp's "
                   "converter read",
    "rope_theta": "the RoPE base under its older top-level name, which transformers 4.x, vLLM and "
                  "llama.cpp's converter read",
    "rope_parameters": "the RoPE settings under transformers 5's name",
    "transformers_version": "the version of transformers that wrote this folder",
}


def config_changes(changed: list[tuple], added: list[str]) -> str:
    """The model card's section on config.json against the imported model's own config.json
    (utils/hf/export.py ``merged_config``): each key whose value the export changed (was -> now)
    and each key it added, with why; "" when it kept every key as it was."""
    if not changed and not added:
        return ""
    lines = ["", "## Configuration", "",
             "config.json keeps every key of the imported model's own configuration (its config.json; "
             "for a GGUF file, what transformers reads from its metadata), except:", ""]
    for key, was, now in changed:
        lines.append(f"- `{key}`: {json.dumps(was)} -> {json.dumps(now)} "
                     f"({CONFIG_REASONS.get(key, 'what the exported weights are')})")
    for key in added:
        lines.append(f"- `{key}` added ({CONFIG_REASONS.get(key, 'written by transformers for a Llama model')})")
    return "\n".join(lines) + "\n"
