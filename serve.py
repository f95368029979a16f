"""Stage ``serve``: an OpenAI-compatible HTTP server with continuous batching and a web chat page.

    python main.py serve --checkpoint checkpoints/sft_demo_x           one model (a run folder
                                                                        serves its best checkpoint)
    python main.py serve --checkpoint A --checkpoint B --hf-model DIR   several: ids from run names
    python main.py serve ... --host 0.0.0.0 --port 8000 --api-key KEY   (or LLM_SERVE_API_KEY)
    python main.py serve ... --quantize int8                            weight-only int8
    python main.py serve --checkpoint BASE --adapter math=checkpoints/sft_lora_x   LoRA adapters on
                                                                        the base, unmerged, model
                                                                        "BASE_ID:math" (repeatable)

Then point any OpenAI client at ``http://127.0.0.1:8000/v1`` (``POST /v1/chat/completions``
for SFT checkpoints, ``POST /v1/completions`` for any model, ``GET /v1/models``, ``GET
/health``) or open ``http://127.0.0.1:8000/`` in a browser. ``--port 0`` takes a free port;
the first line on stdout is always ``serve: listening on http://HOST:PORT``.

Each model has its own continuous-batching engine (utils/generation/engine.py,
``serve.max_batch`` sequences decoded together; more wait for a slot); one engine process,
apart from the HTTP one, opens the models and steps them all (utils/generation/remote.py;
ended unasked, it stops the server: exit 1). SIGINT / SIGTERM: stop
accepting, give running streams ``serve.shutdown_grace`` seconds to finish, cut the rest with an error
event (a request whose body arrives meanwhile gets 503), exit 130. A connection with no request
under way is closed after ``serve.idle_timeout`` seconds; a request whose headers and body do not
all arrive within ``serve.read_timeout`` seconds gets 408 and its connection is closed. An empty
``--api-key`` is a usage error. Fields, limits, batching and security: docs/serve.md.
"""
from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import uvicorn

from utils.cli import PipelineError, StageParser, UsageError, cli_path, printable, run_stage
from utils.device import generation_dtype, resolve_device
from utils.serve.connections import timed_protocol
from utils.serve.protocol import Limits, adapter_name_problem, check_origins

# The engine (torch, 1-2 s) and the app (fastapi, ~0.25 s more) are imported where the models
# open and the app is made: --help and the refusals before them do not wait for them.

API_KEY_ENV = "LLM_SERVE_API_KEY"


def build_parser() -> StageParser:
    p = StageParser("main.py serve", "Serve checkpoints over an OpenAI-compatible HTTP API with a "
                    "web chat page.")
    p.add_argument("--checkpoint", type=cli_path, action="append", default=[], metavar="PATH",
                   help="checkpoint file or run folder (its best checkpoint); repeat for several")
    p.add_argument("--hf-model", type=cli_path, action="append", default=[], metavar="DIR",
                   help="a Hugging Face Llama folder or .gguf file (imported); repeatable")
    p.config_flag("--host", key="serve.host", metavar="ADDR", help="address to bind")
    p.config_flag("--port", key="serve.port", type=int, metavar="N", help="TCP port (0: any free port)")
    p.config_flag("--max-batch", key="serve.max_batch", type=int, metavar="N",
                  help="sequences decoded together per model")
    p.config_flag("--context", key="serve.context", type=int, metavar="N",
                  help="positions per request (0: the model's context)")
    p.config_flag("--quantize", key="serve.quantize", choices=["none", "int8"],
                  help="weights of the served models")
    p.config_flag("--device", key="serve.device", metavar="DEV", help="auto, cpu, cuda or cuda:N")
    p.config_flag("--dtype", key="serve.dtype", choices=["auto", "fp32", "bf16", "fp16"],
                  help="the served models' weights (auto: bf16 on CUDA, as stored on CPU)")
    p.config_flag("--prefix-cache-mb", key="serve.prefix_cache_mb", type=int, metavar="MB",
                  help="MiB of KV per model kept for reuse by requests with the same start (0: off)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="intra-op threads of each engine step (default: the engine's rule, 1 for a "
                        "small model's small steps, all cores for models of 64M+ weights; 1 on a busy machine)")
    p.add_argument("--adapter", action="append", default=[], metavar="[MODEL:]NAME=PATH",
                   help="a LoRA adapter served beside its base (a PEFT adapter folder, or a LoRA run's "
                        "folder or checkpoint), requested as model 'MODEL:NAME'; repeatable (MODEL: "
                        "the base's id, needed with several models); more at runtime: POST /v1/adapters")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1 and /metrics (default: ${API_KEY_ENV})")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, cfg = build_parser().parse(argv)
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads {args.threads}: give 1 or more (or leave it out for the engine's rule).")
    if cfg.serve.context == 1:
        raise UsageError("serve.context (--context) 1: a request needs at least 2 positions (its prompt "
                         "and one new token); give 2 or more, or 0 for each model's own context.")
    api_key = resolve_api_key(args.api_key, os.environ.get(API_KEY_ENV))
    if bad := check_origins(cfg.serve.cors_origins):
        raise UsageError("; ".join(bad) + ".")
    adapters = adapter_specs(args.adapter, model_ids([Path(p) for p in args.checkpoint + args.hf_model]))
    sock = bind(cfg.serve.host, cfg.serve.port)
    from utils.generation.remote import EngineGone, RemoteLoop     # torch (see the imports)
    died: list[str] = []
    loop = RemoteLoop(log=say, flush_interval=cfg.serve.stream_interval, on_death=died.append).start()
    try:
        models = open_models(args, cfg, loop)
        load_adapters(adapters, models)
        app = make_app(models, cfg, api_key, runtime_adapters=bool(api_key) or is_loopback(cfg.serve.host))
        announce(sock, cfg.serve.host, models, api_key)
        run_server(app, sock, loop, models, cfg.serve, died)
    except EngineGone as e:
        died.append(str(e))
    finally:
        loop.stop()
    if died:
        raise PipelineError(f"{died[0]}; the server stopped (its output is above). A killed engine is "
                            "often out of memory: try a smaller serve.max_batch or serve.context.")
    return 0


def say(msg: str) -> None:
    print(f"serve: {printable(msg)}", file=sys.stderr, flush=True)   # one line (a model id may hold a newline)


def resolve_api_key(flag: Optional[str], env: Optional[str]) -> Optional[str]:
    """The key /v1 requests need: ``--api-key``, else ``$LLM_SERVE_API_KEY``, else none. An
    empty (or blank) ``--api-key`` is a usage error: it is most likely an unset shell variable
    (``--api-key "$KEY"``), and serving without a key is asked for by leaving the flag out. An
    empty variable counts as unset, with a warning on stderr."""
    if flag is not None:
        if not flag.strip():
            raise UsageError("--api-key is empty (an unset shell variable?): give the key, or leave "
                             "--api-key out to serve without one.")
        return flag
    if env is not None and not env.strip():
        say(f"WARNING: {API_KEY_ENV} is set but empty: serving without an API key (no /v1 "
            "request needs one). Set it to the key, or unset it.")
        return None
    return env or None


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the models load so a busy port fails at once. Its
    protocol is named (IPPROTO_TCP): asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    connections whose socket says so, and with it on, every answer after a connection's first
    waited for the client's delayed ACK (40 ms on Linux) between its headers and its body."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise PipelineError(f"cannot listen on {host}:{port} ({e.strerror or e}); choose another "
                            "--port (0 takes a free one) or --host.") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def model_ids(paths: list[Path]) -> list[str]:
    """Model ids from run names: a run folder's or a checkpoint's run name; an HF folder's or
    .gguf file's own name; the file name is added where two would collide."""
    def base(p: Path) -> str:
        if p.is_file() and p.suffix == ".pt":
            return p.parent.name
        return p.stem if p.suffix == ".gguf" else p.name
    ids = [base(p) for p in paths]
    return [f"{i}/{p.name}" if ids.count(i) > 1 else i for i, p in zip(ids, paths)]


def open_models(args, cfg, loop) -> dict:
    """Each model opened in the engine process (utils/serve/engines.py, on its engine thread:
    see utils/generation/loop.py), with its engine and decode weights, as a lane of ``loop``."""
    from utils.generation.engine import UNBOUNDED                  # torch (see the imports)
    from utils.serve.engines import open_engine                     # torch
    from utils.serve.served import ServedModel                      # torch
    paths = [Path(p) for p in list(args.checkpoint) + list(args.hf_model)]
    if not paths:
        raise UsageError("give at least one --checkpoint PATH (or --hf-model DIR) to serve.")
    device = resolve_device(cfg.serve.device, "serve.device")
    generation_dtype(cfg.serve.dtype, device, cfg.serve.quantize, "serve.dtype")   # refused before a load
    ids, models = model_ids(paths), {}
    if len(set(ids)) < len(ids):
        raise UsageError(f"two models would have the same id ({', '.join(ids)}): serve distinct files.")
    for path in paths:                  # all checked before the first one loads
        if not path.exists():
            raise PipelineError(f"{path} does not exist (a checkpoint file, run folder, HF folder or .gguf).")
    for mid, path in zip(ids, paths):
        lane, o = loop.open(open_engine, path, cfg, device, args.threads)
        models[mid] = ServedModel(mid, o["tok"], o["kind"], o["rules"], lane, int(time.time()),
                                  cfg.serve.quantize, cfg.serve.max_queue, cfg.serve.max_tokens,
                                  cfg.serve.stream_interval)
        mb = lane.bytes_per_slot / 2 ** 20
        shown = "unbounded (Infini-attention)" if lane.capacity >= UNBOUNDED else lane.capacity
        say(f"model '{mid}': {o['label']} ({o['kind']}{', chat' if o['rules'].chat else ''}), context "
            f"{shown}, {lane.slots} slots x {mb:.1f} MiB of KV cache, "
            + (f"prefix cache {pc['bytes_budget'] / 2 ** 20:g} MiB ({pc['blocks_capacity']} blocks of "
               f"{pc['block_tokens']} tokens)" if (pc := lane.prefix_cache) else "no prefix cache"))
    return models


def adapter_specs(specs: list[str], models: list[str]) -> list[tuple[str, str, Path]]:
    """``--adapter [MODEL:]NAME=PATH`` flags as (model id, name, path); UsageError naming the
    flag (no '=', a bad name, an unknown model, MODEL: left out with several models, a name given
    twice, a path that does not exist)."""
    out, seen = [], set()
    for spec in specs:
        name, eq, path = spec.partition("=")
        if not eq or not path:
            raise UsageError(f"--adapter {spec!r}: give NAME=PATH (or MODEL:NAME=PATH), e.g. "
                             "--adapter math=checkpoints/sft_lora_x.")
        mid, colon, name = name.rpartition(":")
        if not models:
            break                                   # no model: open_models says so
        if not colon:
            if len(models) > 1:
                raise UsageError(f"--adapter {spec!r}: this server has several models ({', '.join(models)}): "
                                 "say which one the adapter goes on, MODEL:NAME=PATH.")
            mid = models[0]
        if mid not in models:
            raise UsageError(f"--adapter {spec!r}: no served model has the id {mid!r} (the ids: "
                             f"{', '.join(models)}).")
        if problem := adapter_name_problem(name):
            raise UsageError(f"--adapter {spec!r}: the {problem}.")
        if (mid, name) in seen:
            raise UsageError(f"--adapter {spec!r}: the name {name!r} is given twice for model {mid!r}.")
        if not Path(path).exists():
            raise UsageError(f"--adapter {spec!r}: {path} does not exist (a PEFT adapter folder, or a LoRA "
                             "run's folder or checkpoint).")
        seen.add((mid, name))
        out.append((mid, name, Path(path)))
    return out


def load_adapters(specs: list[tuple[str, str, Path]], models: dict) -> None:
    """The ``--adapter`` flags' adapters (:func:`adapter_specs`), read here and loaded into
    their models' engines; a bad one (unreadable, hostile, another base's shapes) stops the
    start-up: exit 2 naming the file and what is wrong."""
    from utils.serve.engines import load_adapter, read_adapter_source      # torch (see the imports)
    for mid, name, path in specs:
        m = models[mid]
        try:
            entry, source = read_adapter_source(path)
            info = m.lane.call(load_adapter, name, entry, source)
        except (PipelineError, ValueError) as e:
            raise UsageError(f"--adapter {name}={path}: {e}".rstrip(".") + ".") from None
        m.adapters[name] = {**info, "created": int(time.time())}
        say(f"adapter '{mid}:{name}': {source} (LoRA r={info['rank']}, alpha={info['alpha']:g}, on "
            f"{', '.join(info['target_modules'])})")


def make_app(models: dict, cfg, api_key: Optional[str], runtime_adapters: bool = True):
    from utils.serve.app import create_app                          # fastapi (see the imports)
    limits = Limits(cfg.serve.max_messages, cfg.serve.max_prompt_chars, cfg.serve.max_n,
                    cfg.serve.max_tokens, cfg.serve.read_timeout)
    return create_app(models, limits, api_key, log=say,
                      cors_origins=cfg.serve.cors_origins, runtime_adapters=runtime_adapters)


def announce(sock: socket.socket, host: str, models: dict, api_key: Optional[str]) -> None:
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    print(f"serve: listening on http://{shown}:{port}", flush=True)
    print(f"serve: OpenAI base URL http://{shown}:{port}/v1 (models: {printable(', '.join(models))}); chat page "
          f"http://{shown}:{port}/ ; Ctrl-C stops", file=sys.stderr, flush=True)
    if not api_key and not is_loopback(host):
        print(f"serve: WARNING: listening on {host} without an API key: anyone who can reach this "
              f"machine can use the models. Pass --api-key or set {API_KEY_ENV}.", file=sys.stderr,
              flush=True)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_server(app, sock: socket.socket, loop, models: dict, sc, died: list) -> None:
    """uvicorn on ``sock`` (``sc``: the config's serve section), its connections through
    utils/serve/connections.py: one with no request under way closes after
    ``sc.idle_timeout`` seconds, a request has ``sc.read_timeout`` seconds to arrive (then 408).
    SIGINT/SIGTERM: uvicorn stops accepting; running generations get ``sc.shutdown_grace``
    seconds to finish, then the engines stop, which ends each remaining stream with an error
    event and ``[DONE]``; uvicorn then re-raises the signal, which run_stage turns into exit 130.
    An engine process that ended unasked (``died`` holds why) stops the server the same way."""
    grace = sc.shutdown_grace

    class Server(uvicorn.Server):
        async def on_tick(self, counter: int) -> bool:
            if died:
                self.should_exit = True
            return await super().on_tick(counter)

        async def shutdown(self, sockets=None):
            for server in self.servers:
                server.close()                            # no new connections
            busy = lambda: sum(m.lane.active for m in models.values())  # noqa: E731
            deadline = time.monotonic() + grace
            if busy():
                print(f"serve: stopping: {busy()} generations get up to {grace:g} s to finish",
                      file=sys.stderr, flush=True)
            while busy() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(loop.stop)            # cut what is left: its streams end cleanly
            if self.server_state.connections:             # e.g. a request still uploading its body
                print(f"serve: engines stopped; {len(self.server_state.connections)} open connection(s) "
                      f"get up to {config.timeout_graceful_shutdown} s to close (new requests: 503)",
                      file=sys.stderr, flush=True)
            await super().shutdown(sockets)

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            http=timed_protocol(sc.idle_timeout, sc.read_timeout, say),
                            timeout_keep_alive=sc.idle_timeout,   # uvicorn's own timer, after an answer
                            timeout_graceful_shutdown=max(1, int(grace) + 1))
    Server(config).run(sockets=[sock])


if __name__ == "__main__":
    run_stage(main)
