"""Serving LoRA adapters unmerged (utils/generation/adapters.py): the aggregate throughput of
8 concurrent streams whose rows use 4 different adapters, against the same 8 streams on the
base model alone, on one `main.py serve` process.

    python perf/serve_adapters.py [--size tiny|7m] [--streams 8] [--adapters 4] [--rank 16]
                                  [--targets all-linear] [--repeats 5] [--requests 3] [--new-tokens 64]

A random-initialised checkpoint (perf/serve_throughput.py's sizes and sample tokenizer, 32k
vocabulary) and ``--adapters`` random LoRA adapters of rank ``--rank`` on ``--targets``
(written as PEFT folders), served by one server started with ``--adapter`` for each. Three
contenders, in each repeat one round each, in turn (this VM's speed moves within seconds):
``base`` (every stream asks the base model: no step has an adapter row, so the engine runs
exactly the base step), ``adapters`` (stream i asks adapter i mod 4: every row of every step
has an adapter, 2 rows per adapter at 8 streams) and ``mixed`` (half the streams base, half
adapters). A round: each of the ``--streams`` concurrent clients (a thread each, the official
``openai`` client, non-streamed completions) sends ``--requests`` requests back to back,
``--new-tokens`` tokens each at temperature 0; the aggregate is completion tokens (the
server's usage) / the round's wall time. Prints min / median / max of each contender's
tokens/s and of the per-repeat ratio to ``base``. Goal (issue 51): adapters / base >= 0.8.

``engine`` lines: the same three contenders on the engine alone, in this process (one
Batcher of ``--streams`` slots, every row a prompt of PROMPTS generating ``--new-tokens``
tokens, all rows decoding together; tokens / wall time of the whole call): the cost of the
adapters' products per step without the HTTP server's share, which dominates a tiny model's
served throughput.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from perf.machine import cpu_model                                   # noqa: E402
from perf.serve_throughput import PROMPTS, TOK_DIR, build, free_port, spread, wait_http   # noqa: E402


def write_adapters(work: Path, ck: Path, n: int, rank: int, targets: list[str]) -> list[Path]:
    """``n`` random PEFT LoRA folders for the checkpoint's shapes (B non-zero: a real delta)."""
    import torch
    from safetensors.torch import save_file
    from utils import lora
    from utils.hf.adapter import peft_key
    shapes = {k: tuple(v.shape) for k, v in torch.load(ck, weights_only=True)["model"].items()}
    layers = len({k.split(".")[1] for k in shapes if k.startswith("layers.")})
    out = []
    for j in range(n):
        g = torch.Generator().manual_seed(j)
        w = {}
        for i in range(layers):
            for t in targets:
                o, d = shapes[f"layers.{i}.{lora.TARGETS[t]}.weight"]
                w[peft_key(f"layers.{i}.{lora.TARGETS[t]}.lora_A.weight")] = torch.randn(rank, d, generator=g) * 0.02
                w[peft_key(f"layers.{i}.{lora.TARGETS[t]}.lora_B.weight")] = torch.randn(o, rank, generator=g) * 0.02
        folder = work / "adapters" / f"a{j}"
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
             "target_modules": targets, "bias": "none"}))
        save_file(w, str(folder / "adapter_model.safetensors"))
        out.append(folder)
    return out


def round_rate(client, models: list[str], requests: int, new_tokens: int) -> float:
    """Aggregate completion tokens/s of one round: stream i asks ``models[i]`` ``requests`` times."""
    def one(i: int) -> int:
        got = 0
        for r in range(requests):
            c = client.completions.create(model=models[i], prompt=PROMPTS[(i + r) % len(PROMPTS)],
                                          max_tokens=new_tokens, temperature=0.0)
            got += c.usage.completion_tokens
        return got
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(models)) as pool:
        tokens = sum(pool.map(one, range(len(models))))
    return tokens / (time.perf_counter() - t0)


def engine_rates(ck: Path, folders: list[Path], a) -> dict:
    """Interleaved tokens/s of the three contenders on the engine alone (see the docstring)."""
    from utils.data.tok import encode_plain, load_tokenizer_from
    from utils.generation.engine import Engine, Sequence, SamplingParams
    from utils.run import load_model
    from utils.serve.engines import read_adapter_source
    model, tok = load_model(ck)[0], load_tokenizer_from(str(TOK_DIR / "tokenizer.model"))
    engine = Engine(model)
    names = [f"a{j}" for j in range(len(folders))]
    for name, f in zip(names, folders):
        engine.adapters.load(name, read_adapter_source(f)[0])
    prompts = encode_plain(tok, PROMPTS)
    rows = {"base": [None] * a.streams, "adapters": [names[i % len(names)] for i in range(a.streams)],
            "mixed": [None if i % 2 else names[(i // 2) % len(names)] for i in range(a.streams)]}

    def run(adapters) -> float:
        b = engine.batcher(a.streams, 512)
        for i, ad in enumerate(adapters):
            b.add(Sequence([tok.bos_token_id] + prompts[i % len(prompts)],
                           SamplingParams(a.new_tokens, 0.0, adapter=ad)))
        t0, n = time.perf_counter(), 0
        for events in engine.run(b):
            n += sum(e.token is not None for e in events)
        return n / (time.perf_counter() - t0)
    run(rows["adapters"])                                                   # warm-up
    out = {k: [] for k in rows}
    for _ in range(a.repeats):
        for k, r in rows.items():
            out[k].append(run(r))
    return out


def report(label: str, rates: dict) -> None:
    for k, xs in rates.items():
        print(f"{label} {k:9s} tokens/s  {spread(xs, '.0f')}")
    for k in ("adapters", "mixed"):
        ratio = [x / y for x, y in zip(rates[k], rates["base"])]
        print(f"{label} {k}/base  {spread(ratio, '.2f')}  (goal >= 0.80: "
              f"{'met' if statistics.median(ratio) >= 0.8 else 'NOT met'} at the median)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny", choices=["tiny", "7m"])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="all-linear", help="comma-separated projections, or all-linear")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    a = p.parse_args()
    import openai
    from utils import lora
    targets = list(lora.targets_of(a.targets.split(","), "--targets"))
    print(f"# perf/serve_adapters.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  "
          f"{platform.node()}  {cpu_model()}  python {platform.python_version()}")
    print(f"size {a.size}, {a.streams} streams x {a.requests} requests x {a.new_tokens} tokens, "
          f"{a.adapters} adapters r={a.rank} on {','.join(targets)}, {a.repeats} repeats")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ck, cfg = build(work, a.size, 512)
        folders = write_adapters(work, ck, a.adapters, a.rank, targets)
        port = free_port()
        cmd = [sys.executable, str(ROOT / "main.py"), "serve", "--config", str(cfg), "--checkpoint", str(ck),
               "--port", str(port), "--max-batch", str(a.streams)]
        for j, f in enumerate(folders):
            cmd += ["--adapter", f"a{j}={f}"]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(url, proc)
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
            base = f"perf_{a.size}"
            adapters = [f"{base}:a{i % a.adapters}" for i in range(a.streams)]
            contenders = {"base": [base] * a.streams, "adapters": adapters,
                          "mixed": [base if i % 2 else adapters[i // 2] for i in range(a.streams)]}
            round_rate(client, contenders["adapters"], 1, 8)                  # warm-up
            rates = {k: [] for k in contenders}
            for _ in range(a.repeats):
                for k, models in contenders.items():
                    rates[k].append(round_rate(client, models, a.requests, a.new_tokens))
        finally:
            proc.terminate()
            proc.wait(60)
        report("served", rates)
        report("engine", engine_rates(ck, folders, a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
