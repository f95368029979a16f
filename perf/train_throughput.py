"""Training-step throughput: our model.py against transformers' LlamaForCausalLM (attn "sdpa").

    python perf/train_throughput.py [--repeats 3] [--steps 4] [--batch 4] [--seq 128]
                                    [--sizes 7m,50m] [--dtypes fp32,bf16] [--threads N]

For each size and precision, each contender runs in its own fresh subprocess (same thread
count, same environment but for the allocator), with identical shapes and the same initial
weights (ours copied into LlamaForCausalLM through utils.hf.mapping.to_hf_state_dict). Three contenders:
ours with the allocator settings train.py applies on CPU (utils/training/allocator.py: glibc malloc
tunables), HF with the same settings, HF plain (glibc defaults). Two ratios: ours / HF with
the same allocator and threads (what our model and loop are worth), and ours as shipped / HF
run plainly (what a user of the train stage gains):

- timed region: ``--steps`` whole optimizer steps (forward, loss, backward, AdamW step,
  zero_grad) on fixed random batches, after two warm-up steps; nothing else (no data
  loading, no logging);
- ours: ``model(x, y, return_logits=False)`` (the chunked fused loss the trainer uses);
  HF: ``hf(input_ids=x).logits`` then ``F.cross_entropy`` in fp32 (what a user writes);
- ours: the train stage's optimizer (``utils.training.trainer.build_optimizers``: fused AdamW,
  weight decay on matrices only); HF: ``torch.optim.AdamW(..., foreach=True)``, the faster of
  the unfused forms; the same learning rate, betas and decay;
- both: autocast bf16 on CPU for "bf16", fp32 otherwise;
- peak memory of the process (VmHWM, read from /proc) after the timed steps; user and system
  CPU seconds and minor page faults per timed step (getrusage), which show the allocator's
  effect even when the machine's load makes wall-clock figures noisy.

Contenders alternate (ours, HF, HF plain, ours, ...) ``--repeats`` times so background load hits
both alike; the ratio ours / HF is printed per repeat with min / median / max. Tokens/s
counts B x T input tokens per step for both.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 32_000
SIZES = {  # about 7M and 50M parameters with a 32k vocabulary (tied embeddings)
    "7m": dict(d_model=192, n_layers=4, n_heads=6, n_kv_heads=2),
    "50m": dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4),
}


def vm_hwm_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(kind: str, size: str, dtype: str, steps: int, batch: int, seq: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.nn.functional as F
    import model as M
    import utils.hf.mapping as H

    torch.manual_seed(0)
    args = M.ModelArgs(vocab_size=VOCAB, max_seq_len=seq, tie_embeddings=True, **SIZES[size])
    ours = M.create_model(args)
    if kind == "ours":
        net = ours
    else:
        from transformers import LlamaForCausalLM
        net = LlamaForCausalLM(H.hf_config(args))
        net.config._attn_implementation = "sdpa"
        net.load_state_dict(H.to_hf_state_dict(ours), strict=False)
        net.tie_weights()
        del ours
    net.train()
    if kind == "ours":   # the train stage's optimizer (fused AdamW on CPU, decay on matrices only)
        import types
        from utils.training.trainer import build_optimizers
        hp = types.SimpleNamespace(lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, optimizer="adamw")
        opt = build_optimizers(net, hp, torch.device("cpu"))["adamw"]
    else:                # what a user writes (foreach: torch's faster non-fused form)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                foreach=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (batch, seq), generator=g)
    y = torch.randint(0, VOCAB, (batch, seq), generator=g)
    amp = dtype == "bf16"

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            if kind == "ours":
                _, loss = net(x, y, return_logits=False)
            else:
                logits = net(input_ids=x).logits
                loss = F.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    for _ in range(2):
        step()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dt = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    n_params = sum(p.numel() for p in net.parameters())
    return {"tokens_per_s": steps * batch * seq / dt, "seconds": dt, "peak_mb": vm_hwm_mb(),
            "params": n_params, "threads": torch.get_num_threads(),
            "user_s": (r1.ru_utime - r0.ru_utime) / steps, "sys_s": (r1.ru_stime - r0.ru_stime) / steps,
            "minflt": (r1.ru_minflt - r0.ru_minflt) / steps}


def run_child(env_extra: dict, threads: int, **kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and k != "LD_PRELOAD"}
    env.update(env_extra)
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, __file__, "--child", json.dumps(kw)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread(xs: list[float], fmt: str) -> str:
    return (f"min {format(min(xs), fmt)}  median {format(statistics.median(xs), fmt)}  "
            f"max {format(max(xs), fmt)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--sizes", default="7m,50m")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--threads", type=int, default=0,
                    help="OMP_NUM_THREADS for every contender (0: torch's default, one per core)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(**json.loads(a.child))))
        return 0
    import torch
    print(f"perf/train_throughput.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
          f"(affinity {len(os.sched_getaffinity(0))}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; batch {a.batch} x {a.seq} tokens, {a.steps} timed "
          f"steps after 2 warm-up, {a.repeats} alternating repeats")
    sys.path.insert(0, str(ROOT))
    from utils.training.allocator import cpu_allocator_env
    shipped = cpu_allocator_env()
    print("shipped allocator (what train.py applies on CPU): "
          + (" ".join(f"{k}={v}" for k, v in shipped.items()) or "none (not glibc)"))
    print("contenders per repeat, interleaved: ours + shipped allocator, HF + shipped allocator, "
          "HF plain (glibc defaults)")
    for size in a.sizes.split(","):
        for dtype in a.dtypes.split(","):
            kw = dict(size=size, dtype=dtype, steps=a.steps, batch=a.batch, seq=a.seq)
            runs: dict[str, list] = {"ours": [], "hf_same": [], "hf_plain": []}
            for _ in range(a.repeats):
                runs["ours"].append(run_child(shipped, a.threads, kind="ours", **kw))
                runs["hf_same"].append(run_child(shipped, a.threads, kind="hf", **kw))
                runs["hf_plain"].append(run_child({}, a.threads, kind="hf", **kw))
            print(f"\n{size} ({runs['ours'][0]['params'] / 1e6:.1f}M params), {dtype}, "
                  f"{runs['ours'][0]['threads']} threads:")
            for name, label in (("ours", "ours, shipped alloc"), ("hf_same", "HF, shipped alloc "),
                                ("hf_plain", "HF, plain         ")):
                rs = runs[name]
                med = lambda key: statistics.median(r[key] for r in rs)  # noqa: E731
                print(f"  {label} tokens/s {spread([r['tokens_per_s'] for r in rs], ',.0f')}; "
                      f"peak {med('peak_mb'):,.0f} MB; per step: user {med('user_s'):.2f} s, "
                      f"sys {med('sys_s'):.2f} s, {med('minflt'):,.0f} page faults")
            tps = {k: [r["tokens_per_s"] for r in v] for k, v in runs.items()}
            same = [o / h for o, h in zip(tps["ours"], tps["hf_same"])]
            plain = [o / h for o, h in zip(tps["ours"], tps["hf_plain"])]
            print(f"  ratio ours/HF, same allocator and threads    {spread(same, '.2f')}")
            print(f"  ratio train as shipped / HF run plainly      {spread(plain, '.2f')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
