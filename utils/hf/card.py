"""The model card (README.md) of an export: what the model is, what it was trained on, how
far, how good it got (library; no side effects). Everything comes from the checkpoint and
the files the stages wrote; a missing part is left out, never guessed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def benchmark_rows(bench_dir: Path, weights_fp: str) -> tuple[list[str], Optional[str]]:
    """Markdown rows of the newest benchmark run that scored exactly these weights (matched by
    the weights fingerprint benchmark records), and that file's name."""
    from utils.bench.report import fmt_value
    files = sorted(bench_dir.glob("benchmark_*.json"), key=lambda p: p.stat().st_mtime,
                   reverse=True) if bench_dir.is_dir() else []
    for f in files:
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue                       # a damaged result file: the next one may do
        for m in data.get("models") or []:
            ident = m.get("identity") or {}
            if ident.get("fingerprint") != weights_fp or ident.get("quantize"):   # int8: other weights
                continue
            rows = []
            for task, res in sorted((m.get("results") or {}).items()):
                for metric, v in (res.get("metrics") or {}).items():
                    if isinstance(v, dict) and v.get("value") is not None:
                        rows.append(f"| {task} | {metric} | {fmt_value(metric, v['value'], v.get('stderr'))} |")
            return rows, f.name
    return [], None


def model_card(cfg, path: Path, ckpt: dict, model, tok_info: dict, *, fmt: str,
               dtype: Optional[str], license: str) -> str:
    from utils.bench.adapters import weights_fingerprint
    a = model.args
    conf = ckpt.get("config") or {}
    data = conf.get("dataset") or {}
    kind = ckpt.get("kind", "pretrain")
    best = ckpt.get("best_val_loss")
    lines = ["---", f"license: {license}", "library_name: transformers" if fmt == "hf" else
             "library_name: gguf", "pipeline_tag: text-generation",
             "tags: [llama, text-generation, llm-pipeline]", "---", "",
             f"# {path.parent.name or path.stem}", "",
             f"A Llama-architecture language model trained with this project's pipeline "
             f"({'supervised fine-tuning' if kind == 'sft' else 'pre-training'}), exported from "
             f"`{path.name}` as {'a Hugging Face model folder' if fmt == 'hf' else 'GGUF for llama.cpp'}"
             + (f" ({dtype})" if dtype else "") + ".", "", "## Model", "",
             f"- parameters: {model.num_params():,} ({model.num_params(non_embedding=True):,} "
             "without embeddings)",
             f"- d_model {a.d_model}, {a.n_layers} layers, {a.n_heads} heads ({a.n_kv_heads} "
             f"key/value heads), MLP {a.ffn_hidden} ({a.activation}), context {a.max_seq_len}, "
             f"RoPE base {a.rope_theta:g}, {'tied' if a.tie_embeddings else 'untied'} embeddings",
             f"- tokenizer: {tok_info.get('name')} ({tok_info.get('vocab_size')} tokens, "
             f"fingerprint {str(tok_info.get('fingerprint'))[:12]}); texts start with BOS", "",
             "## Training", ""]
    if kind == "sft":
        sft = ckpt.get("sft") or {}
        lines.append(f"- fine-tuned from `{sft.get('base_checkpoint')}` on instruction data "
                     f"(data fingerprint {str(sft.get('data_fingerprint'))[:12]}), loss on the "
                     "assistant's tokens only; chat template in the tokenizer")
    else:
        lines.append(f"- data: {data.get('source', 'unknown')} shards, windows of "
                     f"{data.get('window', a.max_seq_len)} tokens")
    lines += [f"- optimizer steps: {ckpt.get('step', 'unknown')}",
              f"- tokens seen: {ckpt['tokens_seen']:,}" if isinstance(ckpt.get("tokens_seen"), int)
              else "- tokens seen: unknown",
              f"- best validation loss: {best:.4f}" if isinstance(best, float) else
              "- best validation loss: not recorded"]
    rows, source = benchmark_rows(cfg.path("paths.benchmark_dir"), weights_fingerprint(model.state_dict()))
    lines += ["", "## Benchmarks", ""]
    if rows:
        lines += [f"Scored on exactly these weights (`{source}`):", "",
                  "| task | metric | value |", "| --- | --- | --- |", *rows]
    else:
        lines.append("No benchmark result names these weights (`python main.py benchmark` "
                     "scores a checkpoint).")
    return "\n".join(lines) + "\n"
