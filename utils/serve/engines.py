"""What serve's engine process opens (utils/generation/remote.py runs :func:`open_engine` there,
on its engine thread): a model for generation, int8 if configured, its Engine with the CPU
decode weights made now rather than in the first request, and the context a request gets."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from utils.device import generation_dtype
from utils.generation.engine import Engine
from utils.quant import quantize_int8
from utils.run import open_for_generation


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
