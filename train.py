"""Stage ``train``: pre-train the model on token shards (or on-the-fly data), resumably.

    python main.py train --test                        quick run: tiny model, one short epoch
    python main.py train --name exp1                   checkpoints/exp1/, logs/*/exp1
    python main.py train --name exp1 --resume auto     continue exp1 exactly where it stopped
    python main.py train --resume checkpoints/exp1/checkpoint_step_2000.pt
    python main.py train --nproc-per-node 4 --name exp1   DDP on 4 GPUs of this machine (gloo on CPU)
    torchrun --nproc_per_node=4 train.py --name exp1   the same through torchrun (multi-node flags)

The loop itself is utils/trainer.py (shared with SFT); checkpoints go through
utils/checkpoint.py. This file parses flags, picks the device, builds the data, the model and
the logger, and reports. docs/training.md describes every flag, file and guarantee.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence

from utils.cli import EXIT_INTERRUPTED, PipelineError, StageParser, UsageError, argv_without, run_stage

# --test: a quick CPU profile. Each entry applies unless its flag is given on the command line
# (it then overrides the config file's value, like any flag).
TEST_DEFAULTS = {"--preset": ("cfg__model__preset", "tiny"),
                 "--window": ("cfg__dataset__window", 64),
                 "--batch-size": ("cfg__training__batch_size", 8),
                 "--max-steps": ("cfg__training__max_steps", 40),
                 "--eval-batches": ("cfg__training__eval_batches", 4),
                 "--sample-tokens": ("cfg__training__sample_tokens", 16)}


def build_parser() -> StageParser:
    p = StageParser("train.py", "Pre-train the model on the configured token shards (or "
                    "on-the-fly data). Ctrl-C saves checkpoint_latest.pt and prints the exact "
                    "resume command; --resume continues bit for bit.")
    p.config_flag("--name", key="training.run_name", help="run name: checkpoints/NAME, "
                  "logs/tensorboard/NAME, logs/raw_metrics/NAME.jsonl (default run_<time>)")
    p.add_argument("--resume", metavar="PATH|auto", default=None,
                   help="continue from a checkpoint file, or 'auto': checkpoint_latest.pt of "
                        "--name (of the newest run without --name)")
    p.config_flag("--max-steps", key="training.max_steps", type=int,
                  help="optimizer steps of the whole run (a resumed run stops where an "
                       "uninterrupted one would)")
    p.config_flag("--epochs", key="training.epochs", type=int, help="passes over the data")
    p.config_flag("--batch-size", key="training.batch_size", type=int, help="windows per micro-batch")
    p.config_flag("--grad-accum", key="training.grad_accum", type=int,
                  help="micro-batches per optimizer step")
    p.config_flag("--lr", key="training.lr", type=float, help="peak learning rate")
    p.config_flag("--min-lr", key="training.min_lr", type=float, help="final learning rate")
    p.config_flag("--warmup-steps", key="training.warmup_steps", type=int, help="linear warm-up steps")
    p.config_flag("--weight-decay", key="training.weight_decay", type=float, help="weight decay")
    p.config_flag("--grad-clip", key="training.grad_clip", type=float, help="gradient-norm clip (0 = off)")
    p.config_flag("--optimizer", key="training.optimizer", choices=["adamw", "muon"],
                  help="adamw, or muon (Muon for hidden matrices + AdamW for the rest)")
    p.config_flag("--dtype", key="training.dtype", choices=["auto", "bf16", "fp16", "fp32"],
                  help="autocast precision")
    p.config_flag("--compile", key="training.compile", action="store_const", const=True,
                  help="torch.compile the model")
    p.config_flag("--activation-checkpointing", key="training.activation_checkpointing",
                  action="store_const", const=True, help="recompute activations in backward")
    p.config_flag("--device", key="training.device", help="auto, cpu, cuda or cuda:N")
    p.config_flag("--seed", key="training.seed", type=int, help="random seed")
    p.config_flag("--eval-every", key="training.eval_every", type=float,
                  help="validate every this fraction of an epoch")
    p.config_flag("--eval-steps", key="training.eval_steps", type=int,
                  help="validate every N steps (overrides --eval-every)")
    p.config_flag("--eval-batches", key="training.eval_batches", type=int,
                  help="validation batches per evaluation")
    p.config_flag("--checkpoint-every", key="training.checkpoint_every", type=int,
                  help="steps between checkpoint_step_N.pt files")
    p.config_flag("--keep-checkpoints", key="training.keep_checkpoints", type=int,
                  help="checkpoint_step_N.pt files kept")
    p.config_flag("--patience", key="training.early_stopping_patience", type=int,
                  help="early stopping after N evaluations without improvement (0 = off)")
    p.config_flag("--num-workers", key="training.num_workers", type=int, help="loader processes")
    p.config_flag("--log-every", key="logging.log_every", type=int, help="steps between log records")
    p.config_flag("--preset", key="model.preset", help="model size preset (--test: tiny)")
    p.config_flag("--window", key="dataset.window", type=int,
                  help="training window length in tokens (--test: 64)")
    p.config_flag("--sample-tokens", key="training.sample_tokens", type=int,
                  help="tokens of the sample generated at each validation (0 = none)")
    p.add_argument("--nproc-per-node", type=_positive_int, default=1, metavar="N",
                   help="DDP on N processes of this machine (one per GPU; gloo on CPU): "
                        "torchrun --standalone, launched for you")
    return p


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of processes >= 1, got {text!r}")
    return n


def resume_command(argv: Sequence[str], run: str, world_size: int,
                   local_world_size: Optional[int] = None) -> str:
    """The command that continues this run: main.py's, with ``--nproc-per-node`` for DDP on
    one machine; torchrun's when the ranks span several machines (its rendezvous flags are
    the user's to add)."""
    rest = argv_without(argv, ("--resume", "--name")) + ["--name", run, "--resume", "auto"]
    local = world_size if local_world_size is None else local_world_size
    if world_size > 1 and local != world_size:
        return f"torchrun --nproc_per_node={local} train.py {shlex.join(rest)}"
    if world_size > 1:
        rest += ["--nproc-per-node", str(world_size)]
    return f"python main.py train {shlex.join(rest)}"


def pick_device(cfg, local_rank: int):
    from utils.device import resolve_device
    return resolve_device(cfg.training.device, "training.device", local_rank)


def find_resume_checkpoint(cfg, spec: str, name: Optional[str]) -> Path:
    from utils.checkpoint import find_run
    ckdir = cfg.path("paths.checkpoints_dir")
    if spec != "auto":
        return Path(os.path.expanduser(spec)).resolve()
    run = find_run(ckdir, name)
    if run is None:
        what = f"run '{name}'" if name else "any run"
        raise PipelineError(f"--resume auto: no checkpoints of {what} under {ckdir}. Start it "
                            "without --resume, or pass a checkpoint path.")
    path = run.latest or (run.checkpoints[0] if run.checkpoints else None)
    if path is None:
        raise PipelineError(f"--resume auto: {run.path} holds no checkpoint file.")
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if "--test" in argv:
        parser.set_defaults(**{dest: value for flag, (dest, value) in TEST_DEFAULTS.items()
                               if not any(a == flag or a.startswith(flag + "=") for a in argv)})
    args, cfg = parser.parse(argv)
    if args.nproc_per_node > 1:
        from utils import distributed as D
        if D.env_world_size() > 1:
            raise UsageError("--nproc-per-node launches the ranks itself; under torchrun, leave "
                             "it out (torchrun's --nproc_per_node sets the count).")
        return D.launch_local(Path(__file__).resolve(), args.nproc_per_node,
                              argv_without(argv, ("--nproc-per-node",)), "train.py")

    import torch
    import dataloader
    import model as model_lib
    from utils import distributed as D
    from utils.checkpoint import load_checkpoint
    from utils.logging_utils import DualLogger
    from utils.metrics import measure_bytes_per_token
    from utils.tok import describe, encode_plain, load_tokenizer
    from utils.trainer import Trainer, pause_step_from_env, resolve_dtype, seed_everything

    hp = cfg.training
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(cfg, local_rank if D.env_world_size() > 1 else 0)
    dist = D.init(device.type)
    main_proc = dist.is_main
    say = (lambda *a, **k: print(*a, **k, flush=True)) if main_proc else (lambda *a, **k: None)
    if device.type == "cpu":
        from utils.allocator import apply_cpu_allocator
        note = apply_cpu_allocator() or ""
        say(f"train: no CUDA GPU: training on CPU ({torch.get_num_threads()} threads)"
            + (f"; {note}" if note else "") + ".")
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    tok = load_tokenizer(cfg)
    tok_info = describe(tok, cfg.tokenizer.name)

    # ---- resume or new run
    ckpt = None
    if args.resume:
        path = find_resume_checkpoint(cfg, args.resume, hp.run_name)
        ckpt = load_checkpoint(path, purpose="resume")
        run = hp.run_name or (path.parent.name if path.parent != cfg.path("paths.checkpoints_dir")
                              else "legacy")
        saved_fp = (ckpt.get("tokenizer") or {}).get("fingerprint")
        if saved_fp and saved_fp != tok_info["fingerprint"]:
            raise PipelineError(f"{path} was trained with another tokenizer "
                                f"({(ckpt.get('tokenizer') or {}).get('name')}); the configured one "
                                f"is {cfg.tokenizer.name}. Resume with the run's tokenizer.")
        model_args = model_lib.ModelArgs.from_dict(dict(ckpt["model_args"]))
        _report_config_changes(ckpt.get("config") or {}, cfg.to_dict(), say)
        say(f"train: resuming run '{run}' from {path} (step {ckpt['step']}).")
    else:
        run = hp.run_name or D.broadcast_object(
            dist, datetime.datetime.now().strftime("run_%Y_%m_%d_%H_%M"))
        vocab = cfg.model.vocab_size or len(tok)
        model_args = model_lib.model_args_from_config(cfg, vocab, tok.bos_token_id)
    run_dir = cfg.path("paths.checkpoints_dir") / run
    if ckpt is None and (run_dir / "checkpoint_latest.pt").exists():
        raise UsageError(f"{run_dir} already holds a run. Continue it with `--name {run} --resume "
                         "auto`, or choose another --name.")

    # ---- data: shard sets are checked against tok_info (already fingerprinted above); only
    # on-the-fly mode needs the tokenizer object itself.
    on_the_fly = cfg.dataset.mode == "on_the_fly"
    if dist.enabled and not on_the_fly:
        # Rank 0 checks the shard set first (and, with dataset.auto_prepare, builds it); the
        # other ranks wait, then open the finished set: never several preps in one folder.
        failure: Optional[BaseException] = None
        if dist.rank == 0:
            try:
                dataloader.open_shard_set(cfg, tok_info)
            except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
                failure = e
        if D.any_rank(dist, failure is not None, device):    # also the barrier
            if failure is not None:
                raise failure
            raise PipelineError("rank 0 could not open the shard set (its own error message says why).")
    train_loader, val_loader, info = dataloader.build_loaders(
        cfg, tok if on_the_fly else tok_info, device=device, rank=dist.rank,
        world_size=dist.world_size)
    say("train: " + dataloader.describe_info(info))
    per_epoch = info.get("batches_per_epoch")
    steps_per_epoch = per_epoch // hp.grad_accum if per_epoch else None
    if steps_per_epoch == 0:
        raise PipelineError(f"one epoch has {per_epoch} batches, fewer than training.grad_accum "
                            f"({hp.grad_accum}); lower grad_accum or batch_size.")
    if hp.max_steps:
        total = hp.max_steps
    elif steps_per_epoch:
        total = hp.epochs * steps_per_epoch
        if cfg.test:
            total = min(total, hp.test_max_steps)
    else:
        raise UsageError("on-the-fly data has no known length: set training.max_steps "
                         "(or --max-steps).")

    # ---- model
    seed_everything(hp.seed)
    model = model_lib.create_model(model_args).to(device)
    dtype = resolve_dtype(hp.dtype, device)
    n_params = model.num_params() if hasattr(model, "num_params") else sum(
        p.numel() for p in model.parameters())
    eff_batch = hp.batch_size * hp.grad_accum * dist.world_size
    say(f"train: model {n_params:,} parameters (preset {cfg.model.preset}); "
        f"{total} steps of {eff_batch} x {cfg.dataset.window} tokens "
        f"({steps_per_epoch or '?'} steps/epoch); {hp.optimizer}, lr {hp.lr:g} -> {hp.min_lr:g}, "
        f"{str(dtype).replace('torch.', '')} on {device}"
        + (f", {dist.world_size} processes ({dist.backend})" if dist.enabled else "") + ".")

    logs_dir = cfg.path("paths.logs_dir")
    logger = DualLogger(run, logs_dir, tensorboard=cfg.logging.tensorboard,
                        jsonl=cfg.logging.raw_metrics, enabled=main_proc,
                        purge_step=(int(ckpt["step"]) + 1) if ckpt else None)
    if main_proc:
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.save_resolved(run_dir, "config.json")
        hparams = {"run": run, "params": n_params, "total_steps": total, "effective_batch": eff_batch,
                   "window": cfg.dataset.window, "world_size": dist.world_size,
                   "dtype": str(dtype), "device": str(device), **{k: v for k, v in vars(hp).items()},
                   "model": model_args.to_dict()}
        logger.config(cfg.to_dict(), hparams)

    bpt = None
    if val_loader is not None and not ckpt:
        bpt = measure_bytes_per_token(_take(val_loader, 8), tok.decode)
        if dist.enabled:   # each rank measured its own, equally long val slice: average them
            bpt = D.all_reduce_sum(dist, [bpt or 0.0], device)[0] / dist.world_size

    prompt = hp.sample_prompt
    prompt_ids = [tok.bos_token_id] + encode_plain(tok, [prompt])[0]

    def sample_fn(m):
        out = m.generate([prompt_ids], max_new_tokens=hp.sample_tokens, temperature=0.8, top_k=50,
                         eos_id=tok.eos_token_id, seed=hp.seed)
        return [(prompt, tok.decode(out[0], skip_special_tokens=True))]

    trainer = Trainer(model, model_args, hp=hp, log_cfg=cfg.logging, train_data=train_loader,
                      val_data=val_loader, run_dir=run_dir, logger=logger, device=device,
                      dist=dist, total_steps=total, steps_per_epoch=steps_per_epoch,
                      config=cfg.to_dict(), tokenizer_info=tok_info, kind="pretrain",
                      sample_fn=sample_fn if hp.sample_tokens > 0 else None,
                      bytes_per_token=bpt, pause_at_step=pause_step_from_env(),
                      resume_command=resume_command(argv, run, dist.world_size,
                                                     int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size))))
    if ckpt is not None:
        trainer.load_state(ckpt)
        del ckpt
    try:
        result = trainer.fit()
    finally:
        logger.close()
    if result.reason == "interrupted":
        D.shutdown()
        return EXIT_INTERRUPTED
    if main_proc and result.reason != "already_done":
        best = f"{result.best_val_loss:.4f}" if result.best_val_loss is not None else "n/a"
        say(f"train: {result.reason} at step {result.step}; best val loss {best}; checkpoints in "
            f"{run_dir}; metrics in {logger.jsonl_path}. Next: python main.py status {run}")
    D.shutdown()
    return 0


def _take(loader, n: int):
    for i, b in enumerate(loader):
        if i >= n:
            break
        yield b


_EXACTNESS_KEYS = ("dataset.window", "dataset.stride", "dataset.seed", "dataset.val_split",
                   "dataset.source", "training.batch_size", "training.grad_accum",
                   "training.optimizer", "training.lr", "training.min_lr", "training.warmup_steps",
                   "training.weight_decay", "training.dtype", "training.seed")


def _report_config_changes(old: dict, new: dict, say) -> None:
    """Name settings that differ from the checkpoint's run (the resume is then not exact)."""
    diffs = []
    for key in _EXACTNESS_KEYS:
        sec, k = key.split(".")
        a, b = (old.get(sec) or {}).get(k, None), (new.get(sec) or {}).get(k, None)
        if sec in old and a != b:
            diffs.append(f"{key} {a!r} -> {b!r}")
    if diffs:
        say("train: note: settings differ from the checkpoint's run (" + "; ".join(diffs)
            + "); the continuation follows the new settings and is not an exact replay.")


if __name__ == "__main__":
    run_stage(main)
