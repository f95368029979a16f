"""Stage ``train``: pre-train the model on token shards (or on-the-fly data), resumably.

    python main.py train --test                        quick run: tiny model, one short epoch
    python main.py train --name exp1                   checkpoints/exp1/, logs/*/exp1
    python main.py train --name exp1 --resume auto     continue exp1 exactly where it stopped
    python main.py train --resume checkpoints/exp1/checkpoint_step_2000.pt
    python main.py train --nproc-per-node 4 --name exp1   DDP on 4 GPUs of this machine (gloo on CPU)
    torchrun --nproc_per_node=4 train.py --name exp1   the same through torchrun (multi-node flags)

The loop itself is utils/training/trainer.py (shared with SFT); checkpoints go through
utils/training/checkpoint.py. This file parses flags, picks the device, builds the data, the model and
the logger, and reports. docs/training.md describes every flag, file and guarantee.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from utils.cli import (EXIT_INTERRUPTED, PipelineError, StageParser, UsageError, argv_without,
                       cli_nonblank, cli_path, run_stage)

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
    p.add_argument("--resume", metavar="PATH|auto", default=None, type=cli_nonblank,
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
    p.add_argument("--init-from-hf", type=cli_path, default=None, metavar="DIR",
                   help="start from a local Hugging Face Llama model (folder or .gguf file): its "
                        "weights, shape and tokenizer (the shards must be made with that "
                        "tokenizer: tokenizer.name DIR)")
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


def pick_device(cfg, local_rank: int):
    from utils.device import resolve_device
    return resolve_device(cfg.training.device, "training.device", local_rank)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, cfg = parse(argv)
    if args.nproc_per_node > 1:
        return launch_ranks(argv, args.nproc_per_node)
    proc = set_up_process(cfg)
    tok, tok_info, imported = open_tokenizer(cfg, args)
    start = open_run(cfg, args, tok, tok_info, proc, imported)
    from utils.run import RunOutputs, resume_command_train
    from utils.training.trainer import Trainer, pause_step_from_env
    # A start that fails before outputs.begin() (a resume refused by the training state, a
    # model or data that do not fit) leaves no new run folder, log or TensorBoard folder.
    with RunOutputs(start.run_dir, cfg.path("paths.logs_dir"), start.run,
                    enabled=proc.dist.is_main) as outputs:
        data = build_data(cfg, tok, tok_info, proc)
        model = build_model(cfg, start, data, proc)
        logger = open_logger(cfg, start, outputs)
        spec = pretraining_spec(cfg, model, start, data, tok, tok_info, proc)
        trainer = Trainer(spec, run_dir=start.run_dir, logger=logger, device=proc.device,
                          dist=proc.dist, pause_at_step=pause_step_from_env(),
                          resume_command=resume_command_train(
                              argv, start.run, proc.dist.world_size,
                              int(os.environ.get("LOCAL_WORLD_SIZE", proc.dist.world_size))))
        if start.ckpt is not None:
            trainer.load_state(start.ckpt)     # before the run's files: a refusal changes nothing
            start.ckpt = None
        write_run_files(cfg, start, data, model, tok, tok_info, proc, logger)
        outputs.begin()
    return finish(trainer, start, logger, proc)


# --------------------------------------------------------------------------- steps of main
def parse(argv: list[str]):
    """Flags over the config; ``--test`` fills in the quick profile where no flag is given."""
    parser = build_parser()
    if "--test" in argv:
        parser.set_defaults(**{dest: value for flag, (dest, value) in TEST_DEFAULTS.items()
                               if not any(a == flag or a.startswith(flag + "=") for a in argv)})
    return parser.parse(argv)


def launch_ranks(argv: list[str], n: int) -> int:
    """``--nproc-per-node N``: start N ranks of this script through torchrun."""
    from utils.training import distributed as D
    if D.env_world_size() > 1:
        raise UsageError("--nproc-per-node launches the ranks itself; under torchrun, leave "
                         "it out (torchrun's --nproc_per_node sets the count).")
    return D.launch_local(Path(__file__).resolve(), n, argv_without(argv, ("--nproc-per-node",)),
                          "train.py")


@dataclass
class Process:
    """This rank: its device, the process group, and ``say`` (prints on rank 0 only)."""
    device: object
    dist: object
    say: Callable


def set_up_process(cfg) -> Process:
    """Device (the local rank's GPU under DDP), the process group, CPU allocator or TF32."""
    import torch
    from utils.training import distributed as D
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(cfg, local_rank if D.env_world_size() > 1 else 0)
    dist = D.init(device.type)
    say = (lambda *a, **k: print(*a, **k, flush=True)) if dist.is_main else (lambda *a, **k: None)
    if device.type == "cpu":
        from utils.training.allocator import cpu_allocator_plan
        restart, note = cpu_allocator_plan("train.py")
        if restart is not None:
            restart_process(restart)
        note = note or ""
        say(f"train: no CUDA GPU: training on CPU ({torch.get_num_threads()} threads)"
            + (f"; {note}" if note else "") + ".")
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return Process(device, dist, say)


def restart_process(restart) -> None:
    """Re-execute this stage with the allocator's environment (same pid, arguments, signal
    mask): glibc reads its tunables only at start (utils/training/allocator.py)."""
    print(restart.message, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(restart.executable, restart.argv, restart.env)


def open_tokenizer(cfg, args):
    """The configured tokenizer; with ``--init-from-hf``, the imported model's own (and the
    imported model)."""
    if args.init_from_hf:
        if args.resume:
            raise UsageError("--init-from-hf starts a new run from a Hugging Face model; "
                             "--resume continues a run of ours: give one of them.")
        from utils.hf.import_hf import load_hf_llama
        imported = load_hf_llama(args.init_from_hf)
        print(f"train: starting from {imported.source} ({imported.model.num_params():,} "
              "parameters, its own tokenizer).", flush=True)
        return imported.tok, imported.tok_info, imported
    from utils.data.tok import describe, load_tokenizer
    tok = load_tokenizer(cfg)
    return tok, describe(tok, cfg.tokenizer.name), None


@dataclass
class Start:
    """Where the run lives and what it starts from (a resume checkpoint, imported weights, or
    a fresh initialization)."""
    run: str
    run_dir: Path
    model_args: object
    ckpt: Optional[dict]
    init_weights: Optional[dict] = None      # --init-from-hf: the imported state dict
    imported: bool = False
    rules: object = None                     # utils.data.chat.Rules of an imported model (kept on resume)


def open_run(cfg, args, tok, tok_info, proc: Process, imported=None) -> Start:
    """A resumed run (its checkpoint, checked against today's tokenizer and settings) or a new
    one (a name, a model from the config); refuses to start over an existing run."""
    import model as model_lib
    from utils.training import distributed as D
    from utils.run import check_run_name, load_checkpoint, require_same_tokenizer, resume_checkpoint
    hp, ckdir = cfg.training, cfg.path("paths.checkpoints_dir")
    if hp.run_name is not None:
        check_run_name(hp.run_name, "--name (training.run_name)")
    ckpt = None
    if args.resume:
        path = resume_checkpoint(ckdir, args.resume, hp.run_name)
        ckpt = load_checkpoint(path, purpose="resume")
        run = hp.run_name or (path.parent.name if path.parent != ckdir else "legacy")
        require_same_tokenizer(ckpt.get("tokenizer"), tok_info, str(path), "the configured tokenizer",
                               "Resume with the run's tokenizer (its config's tokenizer.name).")
        model_args = model_lib.ModelArgs.from_dict(dict(ckpt["model_args"]))
        _report_config_changes(ckpt.get("config") or {}, cfg.to_dict(), proc.say)
        proc.say(f"train: resuming run '{run}' from {path} (step {ckpt['step']}).")
    else:
        run = hp.run_name or D.broadcast_object(
            proc.dist, datetime.datetime.now().strftime("run_%Y_%m_%d_%H_%M"))
        if imported is not None:
            model_args = imported.model.args
            if cfg.dataset.window > model_args.max_seq_len:
                raise UsageError(f"dataset.window {cfg.dataset.window} is longer than the imported "
                                 f"model's context ({model_args.max_seq_len}); lower --window.")
        else:
            model_args = model_lib.model_args_from_config(cfg, cfg.model.vocab_size or len(tok),
                                                          tok.bos_token_id)
    run_dir = ckdir / run
    if ckpt is None and (run_dir / "checkpoint_latest.pt").exists():
        raise UsageError(f"{run_dir} already holds a run. Continue it with `--name {run} --resume "
                         "auto`, or choose another --name.")
    return Start(run, run_dir, model_args, ckpt, imported.model.state_dict() if imported is not None else None,
                 rules=model_rules(imported, ckpt, tok))


def model_rules(imported, ckpt: Optional[dict], tok):
    """The rules a run keeps (utils/data/chat.py): an imported model's (its chat template, BOS
    rule, stop ids and generation defaults), or those its checkpoint recorded; None for a
    model trained here from scratch (ours apply)."""
    from utils.data.chat import rules_of_checkpoint
    if imported is not None:
        return imported.rules
    if ckpt is not None and ckpt.get("model_rules"):
        return rules_of_checkpoint(ckpt, tok)
    return None


@dataclass
class Data:
    train: object
    val: object
    steps_per_epoch: Optional[int]
    total_steps: int


def build_data(cfg, tok, tok_info, proc: Process) -> Data:
    """The loaders (shard sets are checked against ``tok_info``; on-the-fly data needs the
    tokenizer itself) and the run's length in optimizer steps."""
    import dataloader
    hp, dist = cfg.training, proc.dist
    on_the_fly = cfg.dataset.mode == "on_the_fly"
    if dist.enabled and not on_the_fly:
        _open_shards_on_rank0(cfg, tok_info, proc)
    train_loader, val_loader, info = dataloader.build_loaders(
        cfg, tok if on_the_fly else tok_info, device=proc.device, rank=dist.rank,
        world_size=dist.world_size)
    proc.say("train: " + dataloader.describe_info(info))
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
    return Data(train_loader, val_loader, steps_per_epoch, total)


def _open_shards_on_rank0(cfg, tok_info, proc: Process) -> None:
    """Rank 0 checks the shard set first (and, with dataset.auto_prepare, builds it); the other
    ranks wait, then open the finished set: never several preps in one folder."""
    import dataloader
    from utils.training import distributed as D
    failure: Optional[BaseException] = None
    if proc.dist.rank == 0:
        try:
            dataloader.open_shard_set(cfg, tok_info)
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
            failure = e
    if D.any_rank(proc.dist, failure is not None, proc.device):    # also the barrier
        if failure is not None:
            raise failure
        raise PipelineError("rank 0 could not open the shard set (its own error message says why).")


def build_model(cfg, start: Start, data: Data, proc: Process):
    """The seeded, freshly initialized model on the device (a resume loads its weights later)."""
    import model as model_lib
    from utils.training.trainer import resolve_dtype, seed_everything
    hp = cfg.training
    seed_everything(hp.seed)
    model = model_lib.create_model(start.model_args)
    start.imported = start.init_weights is not None
    if start.init_weights is not None:
        model.load_state_dict(start.init_weights, strict=True)
        start.init_weights = None
    model = model.to(proc.device)
    dtype = resolve_dtype(hp.dtype, proc.device)
    if start.imported:
        origin = "imported"
    elif start.ckpt is not None:            # resumed: the model is the checkpoint's, whatever model.* says now
        was = ((start.ckpt.get("config") or {}).get("model") or {}).get("preset")
        origin = f"the checkpoint's model{f', preset {was}' if isinstance(was, str) else ''}"
    else:
        origin = f"preset {cfg.model.preset}"
    proc.say(f"train: model {model.num_params():,} parameters ({origin}); "
             f"{data.total_steps} steps of {_effective_batch(cfg, proc)} x {cfg.dataset.window} "
             f"tokens ({data.steps_per_epoch or '?'} steps/epoch); {hp.optimizer}, lr {hp.lr:g} -> "
             f"{hp.min_lr:g}, {str(dtype).replace('torch.', '')} on {proc.device}"
             + (f", {proc.dist.world_size} processes ({proc.dist.backend})" if proc.dist.enabled else "")
             + ".")
    return model


def _effective_batch(cfg, proc: Process) -> int:
    return cfg.training.batch_size * cfg.training.grad_accum * proc.dist.world_size


def open_logger(cfg, start: Start, outputs):
    """TensorBoard + JSONL metrics (rank 0; ``outputs``, the run layer's RunOutputs, closes
    it on a failed start)."""
    return outputs.open_logger(tensorboard=cfg.logging.tensorboard, jsonl=cfg.logging.raw_metrics,
                               purge_step=(int(start.ckpt["step"]) + 1) if start.ckpt else None)


def write_run_files(cfg, start: Start, data: Data, model, tok, tok_info, proc: Process, logger) -> None:
    """Rank 0: the run folder with its resolved config and a copy of its tokenizer, and the
    log's config record (written once the start can no longer be refused)."""
    from utils.run import save_run_tokenizer
    from utils.training.trainer import resolve_dtype
    hp = cfg.training
    if proc.dist.is_main:
        start.run_dir.mkdir(parents=True, exist_ok=True)
        cfg.save_resolved(start.run_dir, "config.json")
        save_run_tokenizer(start.run_dir, tok, tok_info["name"])
        hparams = {**vars(hp), "run": start.run, "params": model.num_params(),
                   "total_steps": data.total_steps, "effective_batch": _effective_batch(cfg, proc),
                   "window": cfg.dataset.window, "world_size": proc.dist.world_size,
                   "dtype": str(resolve_dtype(hp.dtype, proc.device)), "device": str(proc.device),
                   "model": start.model_args.to_dict()}
        logger.config(cfg.to_dict(), hparams)


def pretraining_spec(cfg, model, start: Start, data: Data, tok, tok_info, proc: Process):
    """Pre-training as a TrainSpec: next-token loss on the windows, the ``training`` section's
    optimizer and numbers, a sample from ``training.sample_prompt`` at each validation."""
    from utils.data.chat import Rules
    from utils.training.metrics import measure_bytes_per_token
    from utils.training.trainer import OptimizerSpec, RunRecord, Settings, TrainSpec
    from utils.training import distributed as D
    hp = cfg.training
    bpt = None
    if data.val is not None and not start.ckpt:
        bpt = measure_bytes_per_token(_take(data.val, 8), tok.decode)
        if proc.dist.enabled:   # each rank measured its own, equally long val slice: average them
            bpt = D.all_reduce_sum(proc.dist, [bpt or 0.0], proc.device)[0] / proc.dist.world_size
    prompt = hp.sample_prompt
    rules = start.rules or Rules.ours(tok)
    prompt_ids = rules.prompt_ids(tok, prompt)

    def sample_fn(m):
        from utils.generation.engine import generate
        out = generate(m, [prompt_ids], max_new_tokens=hp.sample_tokens, temperature=0.8, top_k=50,
                       eos_id=rules.stop_ids, seed=hp.seed)
        return [(prompt, tok.decode(out[0], skip_special_tokens=True))]

    return TrainSpec(model, start.model_args, data.train, data.val,
                     optimizer=OptimizerSpec.from_config(hp),
                     settings=Settings.from_config(hp, cfg.logging, data.total_steps,
                                                   data.steps_per_epoch),
                     record=RunRecord("pretrain", cfg.to_dict(), tok_info,
                                      chat_template=start.rules.template if start.rules else None,
                                      extra={"model_rules": start.rules.to_dict()} if start.rules else {}),
                     sample_fn=sample_fn if hp.sample_tokens > 0 else None, bytes_per_token=bpt)


def finish(trainer, start: Start, logger, proc: Process) -> int:
    """Train, close the logs, say where things are; 130 when stopped."""
    from utils.training import distributed as D
    try:
        result = trainer.fit()
    finally:
        logger.close()
    if result.reason == "interrupted":
        D.shutdown()
        return EXIT_INTERRUPTED
    if result.reason == "diverged":
        from utils.training.trainer import diverged_message
        D.shutdown()
        raise PipelineError(diverged_message(result, start.run_dir, "training.lr", trainer.spec.optimizer.lr))
    if proc.dist.is_main and result.reason != "already_done":
        best = f"{result.best_val_loss:.4f}" if result.best_val_loss is not None else "n/a"
        proc.say(f"train: {result.reason} at step {result.step}; best val loss {best}; checkpoints "
                 f"in {start.run_dir}; metrics in {logger.jsonl_path}. Next: python main.py "
                 f"status {shlex.quote(start.run)}")
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
    was, now = old.get("model"), new.get("model") or {}
    if isinstance(was, dict):
        model = [f"model.{k} {was.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(was) | set(now))
                 if was.get(k) != now.get(k)]
        if model:
            say("train: note: the model is the checkpoint's; these settings differ from its run and "
                "are not used (" + "; ".join(model) + "). To train another model, start a new run.")


if __name__ == "__main__":
    run_stage(main)
