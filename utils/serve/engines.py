"""What serve's engine process opens (utils/generation/remote.py runs :func:`open_engine` there,
on its engine thread): a model for generation, int8 if configured, its Engine with the CPU
decode weights made now rather than in the first request, and the context a request gets.
LoRA adapters (utils/generation/adapters.py): :func:`read_adapter_source` reads one on the HTTP
side (off its event loop), :func:`load_adapter` / :func:`unload_adapter` run on the engine thread."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from utils.cli import PipelineError
from utils.device import generation_dtype
from utils.generation.engine import Engine
from utils.hf.adapter import CONFIG_FILE, read_adapter
from utils.quant import quantize_int8
from utils.run import load_checkpoint, open_for_generation, pick_checkpoint


def open_engine(worker, path: Path, cfg, device, threads: Optional[int]):
    """``(engine, tok, slots, capacity, info)`` for :meth:`RemoteLoop.open
    <utils.generation.remote.RemoteLoop.open>`: ``capacity`` is ``serve.context`` capped by the
    model's own (None: Infini-attention, no limit, docs/long_context.md); ``info`` what the
    HTTP side needs (the tokenizer, kind, rules (utils/data/chat.py: chat template, BOS,
    stop ids, generation defaults), label)."""
    o = open_for_generation(path, cfg, device, say=worker.log, cache=worker.cache)
    dtype = generation_dtype(cfg.serve.dtype, device, cfg.serve.quantize, "serve.dtype")
    if cfg.serve.quantize == "int8":
        worker.log(quantize_int8(o.model).line())
    elif dtype is not None:
        o.model.to(dtype)
    engine = Engine(o.model, threads=threads, prompt_lookup=cfg.inference.prompt_lookup_num_tokens,
                    compile=cfg.inference.compile)
    engine.decode_pack()
    own = o.model.args.context
    context = min(cfg.serve.context, own or cfg.serve.context) if cfg.serve.context else own
    # before the server listens, on the lane's own shape: no request waits for it
    seconds = engine.compile_now(cfg.serve.max_batch, context)
    if seconds is not None:
        worker.log(f"compiled the decode step in {seconds:.1f} s (inference.compile {cfg.inference.compile})")
    why_not = engine.use_prefix_cache(cfg.serve.prefix_cache_mb << 20)
    if why_not and cfg.serve.prefix_cache_mb:
        worker.log(f"{o.label}: prefix cache {why_not}")
    info = {"tok": o.tok, "kind": o.kind, "rules": o.rules, "label": o.label}
    return engine, o.tok, cfg.serve.max_batch, context, info


# --------------------------------------------------------------------------- LoRA adapters
def read_adapter_source(path) -> tuple[dict, str]:
    """(entry, source) of an adapter on disk: a PEFT LoRA folder (adapter_config.json +
    adapter_model.safetensors, utils/hf/adapter.py), or a LoRA run's folder (its best
    checkpoint) or checkpoint file (its ``"lora"`` entry, read by the one checkpoint loader,
    weights only; only the adapter's tensors are kept). PipelineError / CheckpointError naming
    the file and what is wrong."""
    path = Path(path)
    if not path.exists():
        raise PipelineError(f"{path} does not exist (give a PEFT adapter folder, or a LoRA run's folder or "
                            "checkpoint).")
    if path.is_dir() and (path / CONFIG_FILE).exists():
        return read_adapter(path), str(path)
    ckpt_path = pick_checkpoint(path)
    ckpt = load_checkpoint(ckpt_path, "weights", merge_lora=False)
    entry = ckpt.get("lora")
    if entry is None:
        raise PipelineError(f"{ckpt_path} holds no LoRA adapter (a full model: serve it with --checkpoint); give "
                            "the folder or checkpoint of an 'sft train --lora' or 'dpo train --lora' run, or a "
                            "PEFT adapter folder.")
    return entry, str(ckpt_path)


def load_adapter(engine, name: str, entry: dict, source: str) -> dict:
    """On the engine thread (RemoteLane.call): ``entry`` loaded as ``name`` into the engine's
    adapters (ValueError naming what does not fit the base); its /v1/models details."""
    a = engine.adapters.load(name, entry, source)
    st = a.settings
    return {"rank": st.rank, "alpha": st.alpha, "rslora": st.rslora, "target_modules": list(st.target_modules)}


def unload_adapter(engine, name: str) -> None:
    """On the engine thread: ``name`` unloaded (ValueError: not loaded); rows still running with
    it finish with it."""
    engine.adapters.unload(name)
