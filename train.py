"""Stage ``train``: pre-train the model on token shards (or on-the-fly data), resumably.

    python main.py train --test                        quick run: the tiny preset, 40 steps
    python main.py train --name exp1                   checkpoints/exp1/, logs/*/exp1
    python main.py train --name exp1 --resume auto     continue exp1 exactly where it stopped
    python main.py train --resume checkpoints/exp1/checkpoint_step_2000.pt
    python main.py train --nproc-per-node 4 --name exp1   DDP on 4 GPUs of this machine (gloo on CPU)
    python main.py train --nproc-per-node 4 --parallel fsdp --name exp1   FSDP2 (sharded; *.dcp checkpoints)
    torchrun --nproc_per_node=4 train.py --name exp1   the same through torchrun
    python main.py train --nnodes 2 --node-rank 0 --rdzv-endpoint HOST:29500 --name big
                                                       this machine as node 0 of 2 (it prints the
                                                       other nodes' command); --max-restarts N:
                                                       elastic restarts from the newest checkpoint

The loop itself is utils/training/trainer.py (shared with SFT); checkpoints go through
utils/training/checkpoint.py. This file parses flags, picks the device, builds the data, the model and
the logger, and reports. docs/training.md describes every flag, file and guarantee.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import shlex
import socket
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

import dataloader
import model as model_lib
from utils import stage
from utils.cli import PipelineError, StageParser, UsageError, argv_without, cli_nonblank, cli_path, run_stage
from utils.data.chat import Rules
from utils.data.tok import describe, load_tokenizer
from utils.device import resolve_device
from utils.hf.import_hf import load_hf_llama
from utils.run import (check_run_name, find_run, load_checkpoint, model_args_of, newest_checkpoint,
                       require_same_tokenizer, resume_checkpoint, resume_command_train)
from utils.training import distributed as D
from utils.training import fsdp, sharded
from utils.training.allocator import cpu_allocator_plan
from utils.training.logging_utils import log_paths, read_log
from utils.training.metrics import measure_bytes_per_token
from utils.training.trainer import OptimizerSpec, Settings, TrainSpec, resolve_dtype

# --test: a quick CPU profile. Each entry applies unless its flag is given on the command line
# (it then overrides the config file's value, like any flag).
TEST_DEFAULTS = {"--preset": ("cfg__model__preset", "tiny"),
                 "--window": ("cfg__dataset__window", 64),
                 "--batch-size": ("cfg__training__batch_size", 8),
                 "--max-steps": ("cfg__training__max_steps", 40),
                 "--eval-batches": ("cfg__training__eval_batches", 4),
                 "--sample-tokens": ("cfg__training__sample_tokens", 16)}


def build_parser() -> StageParser:
    p = StageParser("main.py train", "Pre-train the model on the configured token shards (or "
                    "on-the-fly data). Ctrl-C saves checkpoint_latest.pt and prints the exact "
                    "resume command; --resume continues bit for bit.",
                    test="quick mode: the tiny preset, window 64, batch 8, 40 steps, on the "
                         "--test shards (a flag given still wins)")
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
    add_process_flags(p)
    return p


def add_process_flags(p: StageParser) -> None:
    """How many processes train and how they share the model."""
    p.add_argument("--nproc-per-node", type=_positive_int, default=1, metavar="N",
                   help="N processes of this machine (one per GPU; gloo on CPU), DDP or "
                        "--parallel fsdp: torchrun --standalone, launched for you")
    p.add_argument("--nnodes", type=_positive_int, default=1, metavar="N",
                   help="machines in the job: this one is node --node-rank of N (torchrun, c10d "
                        "rendezvous at --rdzv-endpoint; the checkpoints and logs folders on a file "
                        "system every node shares)")
    p.add_argument("--node-rank", type=_node_rank, default=0, metavar="R",
                   help="this machine's node number, 0 .. N-1; node 0 hosts the rendezvous and "
                        "prints the command for the other nodes")
    p.add_argument("--rdzv-endpoint", type=_endpoint, default=None, metavar="HOST:PORT",
                   help="node 0's address and a free port there (default on node 0: its host "
                        "name and port 29500)")
    p.config_flag("--max-restarts", key="training.max_restarts", type=int,
                  help="torchrun restarts of the workers after a rank fails; restarted workers "
                       "resume from the run's newest checkpoint (0 = the job ends)")
    p.config_flag("--parallel", key="training.parallel", choices=["ddp", "fsdp"],
                  help="several processes: ddp (default), or fsdp: FSDP2 shards weights, gradients "
                       "and optimizer state; sharded checkpoints (*.dcp folders)")
    p.config_flag("--cpu-offload", key="training.cpu_offload", action="store_const", const=True,
                  help="fsdp: sharded state in CPU memory")


def _node_rank(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a node number >= 0, got {text!r}")
    return int(text)


def _endpoint(text: str) -> str:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (node 0's address and a port from 1 to "
                                         f"65535), got {text!r}")
    return text


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of processes >= 1, got {text!r}")
    return n


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, cfg = parse(argv)
    refuse_parallel(cfg)
    if args.nproc_per_node > 1 or args.nnodes > 1:
        return launch_ranks(argv, args, cfg)
    if args.node_rank or args.rdzv_endpoint:
        raise UsageError("--node-rank and --rdzv-endpoint place this machine in a job of several "
                         "(--nnodes N > 1); give --nnodes, or leave them out.")
    if cfg.training.max_restarts and D.env_world_size() <= 1:
        stage.say_always(f"train: note: training.max_restarts {cfg.training.max_restarts} applies to "
                         "several processes (torchrun restarts its workers); one process is not restarted.")
    return set_up(cfg, args, argv).finish()


def set_up(cfg, args, argv: list[str]) -> stage.Run:
    """The steps of a start, each returning what it makes (utils/stage.py runs the rest).
    What they hold (a resume checkpoint, an imported model) is freed when this returns."""
    proc = set_up_process(cfg)
    restart = elastic_restart(cfg, args, proc)
    tok, tok_info, imported = open_tokenizer(cfg, args, restart)
    start = open_run(cfg, args, tok, tok_info, proc, imported, restart)
    data = build_data(cfg, tok, tok_info, proc)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", proc.dist.world_size))
    parts = stage.Parts(
        lr_key="training.lr", tokenizer=tok,
        spec=functools.partial(pretraining_spec, cfg, start, data, tok, tok_info, proc),
        run_files=functools.partial(run_files, cfg, start, data, proc),
        resume_command=resume_command_train(argv, start.run, proc.dist.world_size, local_world,
                                            shlex.split(os.environ.get(NODES_ENV, ""))),
        closing=functools.partial(closing_line, start.run, start.run_dir),
        keep_setting="training.keep_checkpoints")
    run = stage.set_up(cfg, start, proc, parts)
    if restart is not None:
        note_restart(run, restart, start, proc)
    return run


# --------------------------------------------------------------------------- steps
def parse(argv: list[str]):
    """Flags over the config; ``--test`` fills in the quick profile where no flag is given."""
    parser = build_parser()
    if "--test" in argv:
        parser.set_defaults(**{dest: value for flag, (dest, value) in TEST_DEFAULTS.items()
                               if not any(a == flag or a.startswith(flag + "=") for a in argv)})
    return parser.parse(argv)


def refuse_parallel(cfg) -> None:
    """Settings FSDP cannot train with, refused before any rank starts (utils/training/fsdp.py)."""
    hp = cfg.training
    if hp.parallel == "fsdp":
        named = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(hp.dtype, torch.float32)
        problem = fsdp.refusal(hp.optimizer, named)
        if problem:
            raise UsageError(problem)
    elif hp.cpu_offload:
        raise UsageError("training.cpu_offload applies to training.parallel fsdp only (DDP keeps the "
                         "whole model on each GPU); add --parallel fsdp or leave it out.")


LAUNCH_FLAGS = ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint")
NODES_ENV = "LLM_PIPELINE_NODES"     # set by the launcher of several machines for its ranks
DEFAULT_RDZV_PORT = 29500


def launch_ranks(argv: list[str], args, cfg) -> int:
    """``--nproc-per-node N`` and/or ``--nnodes N``: start this machine's ranks of this script
    through torchrun (one machine: ``--standalone``; several: c10d rendezvous at node 0). Node 0
    prints the command of the other nodes. The run's name is fixed here (``--name``, default
    ``run_<time>``), so that every node and every restarted worker writes the same run."""
    if D.env_world_size() > 1:
        raise UsageError("--nproc-per-node and --nnodes launch the ranks themselves; under torchrun, "
                         "leave them out (torchrun's --nproc_per_node and --nnodes set the counts).")
    nnodes, node_rank, endpoint = args.nnodes, args.node_rank, args.rdzv_endpoint
    run = cfg.training.run_name
    if run is not None:
        check_run_name(run, "--name (training.run_name)")
    rest = argv_without(argv, LAUNCH_FLAGS)
    if nnodes > 1:
        if node_rank >= nnodes:
            raise UsageError(f"--node-rank {node_rank} is not a node of --nnodes {nnodes}: give 0 .. {nnodes - 1}.")
        if node_rank > 0 and (endpoint is None or run is None):
            raise UsageError(f"node {node_rank}: give node 0's --rdzv-endpoint HOST:PORT and the run's "
                             "--name, as node 0's printed command does (python main.py train --nnodes "
                             f"{nnodes} --node-rank 0 ... prints it).")
        endpoint = endpoint or f"{socket.getfqdn()}:{DEFAULT_RDZV_PORT}"
    elif node_rank or endpoint:
        raise UsageError("--node-rank and --rdzv-endpoint place this machine in a job of several "
                         "(--nnodes N > 1); give --nnodes, or leave them out.")
    if run is None:
        run = datetime.datetime.now().strftime("run_%Y_%m_%d_%H_%M")
        rest += ["--name", run]
    launch = D.Launch(args.nproc_per_node, nnodes, node_rank, endpoint, run_id=run,
                      max_restarts=cfg.training.max_restarts)
    if nnodes > 1:      # what the ranks' resume command adds (they see none of these flags)
        os.environ[NODES_ENV] = shlex.join(["--nproc-per-node", str(launch.nproc), "--nnodes",
                                            str(nnodes), "--rdzv-endpoint", endpoint])
        if node_rank == 0:
            print(other_nodes_text(rest, launch), flush=True)
    return D.launch_local(Path(__file__).resolve(), launch, rest, "train.py")


def other_nodes_text(rest: list[str], launch: D.Launch) -> str:
    """What node 0 says before it waits at the rendezvous: the command of every other node."""
    lines = [f"train: node 0 of {launch.nnodes}: the rendezvous is at {launch.endpoint} (run "
             f"{launch.run_id}, {launch.world_size} ranks); start the other node(s) from a copy of this "
             "project folder whose checkpoints and logs folders every node shares:"]
    for k in range(1, launch.nnodes):
        flags = [*rest, "--nproc-per-node", str(launch.nproc), "--nnodes", str(launch.nnodes),
                 "--node-rank", str(k), "--rdzv-endpoint", launch.endpoint]
        lines.append(f"  python main.py train {shlex.join(flags)}")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Restart:
    """A worker torchrun started again after a failure (``attempt`` >= 1): the run's newest
    checkpoint it resumes from (None: none was written yet, the run starts over) and the
    last step the failed attempt logged."""
    attempt: int
    max_restarts: int
    checkpoint: Optional[Path]
    reached_step: Optional[int]


def elastic_restart(cfg, args, proc: stage.Process) -> Optional[Restart]:
    """None on a first start; after torchrun restarted the workers, where the run continues.
    Rank 0 first undoes what a killed sharded save left in the run folder (it is the only one
    to change it: utils/training/sharded.py ``recover``), then every rank takes the same newest
    checkpoint. A first start with restarts allowed but no run name is refused: a restarted
    worker finds its run by name."""
    warning = D.store_warning()
    if warning and D.restart_count() == 0:
        proc.say(f"train: warning: {warning}.")
    if D.max_restarts() > 0 and cfg.training.run_name is None and not args.resume:
        raise UsageError("torchrun --max-restarts: give the run a --name, so that restarted workers "
                         "find its checkpoints (python main.py train --max-restarts N names it for you).")
    attempt = D.restart_count()
    if attempt == 0:
        return None
    run_dir = _written_run_dir(cfg, args.resume)
    recover_saves(run_dir, proc)
    newest = D.broadcast_object(proc.dist, newest_checkpoint(run_dir) if proc.dist.is_main else None)
    reached = last_logged_step(cfg, run_dir.name) if proc.dist.is_main else None
    return Restart(attempt, D.max_restarts(), Path(newest) if newest else None, reached)


def _written_run_dir(cfg, resume: Optional[str]) -> Path:
    """The run folder this job writes (before its checkpoint is read)."""
    ckdir = cfg.path("paths.checkpoints_dir")
    if cfg.training.run_name is not None:
        return ckdir / cfg.training.run_name
    if resume and resume != "auto":
        parent = Path(os.path.expanduser(resume)).resolve().parent
        return ckdir / (parent.name if parent != ckdir.resolve() else "legacy")
    run = find_run(ckdir)
    return run.path if run is not None else ckdir / "legacy"


def recover_saves(run_dir: Path, proc: stage.Process) -> None:
    """Rank 0 undoes what killed sharded saves left in ``run_dir`` (and says what); the other
    ranks wait, and learn of a failure from rank 0."""
    failure: Optional[BaseException] = None
    if proc.dist.is_main and run_dir.is_dir():
        try:
            for line in sharded.recover(run_dir):
                proc.say(f"train: {line}")
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
            failure = e
    if D.any_rank(proc.dist, failure is not None, proc.device):    # also the barrier
        if failure is not None:
            raise failure
        raise PipelineError(f"rank 0 could not put {run_dir} in order (its own message says why).")


def last_logged_step(cfg, run: str) -> Optional[int]:
    """The last training step the run's log holds (what a failed attempt reached)."""
    log = log_paths(cfg.path("paths.logs_dir"), run)[1]
    if not log.is_file():
        return None
    steps = [r.get("step") for r in read_log(log).records if r.get("type") == "train"]
    steps = [x for x in steps if isinstance(x, int)]
    return max(steps) if steps else None


def note_restart(run: stage.Run, restart: Restart, start: stage.Start, proc: stage.Process) -> None:
    """The restart in the run's log (an ``event`` record: ``status`` shows it) and on screen."""
    step = int(start.resume["step"]) if start.resume is not None else 0
    lost = (restart.reached_step - step) if restart.reached_step is not None else None
    run.logger.event(step, "restart", attempt=restart.attempt, max_restarts=restart.max_restarts,
                     checkpoint=restart.checkpoint.name if restart.checkpoint else None,
                     reached_step=restart.reached_step, steps_lost=lost)
    where = (f"resuming from {restart.checkpoint.name} (step {step})" if restart.checkpoint else
             "no checkpoint was written yet: starting over")
    again = f"; the {lost} step(s) after it are trained again" if lost else ""
    proc.say(f"train: restarted by torchrun (restart {restart.attempt} of {restart.max_restarts}): "
             f"{where}{again}.")


def set_up_process(cfg) -> stage.Process:
    """Device (the local rank's GPU under DDP), the process group, CPU allocator or TF32."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(cfg.training.device, "training.device",
                            local_rank if D.env_world_size() > 1 else 0)
    dist = D.init(device.type)
    hp = cfg.training
    if not dist.enabled and hp.parallel == "fsdp" and hp.cpu_offload and device.type == "cuda":
        dist = D.init_single(device.type)          # FSDP2's offload on one GPU needs a group of one
    say = stage.say_always if dist.is_main else (lambda *a, **k: None)
    if device.type == "cpu":
        restart, note = cpu_allocator_plan("train.py")
        if restart is not None:
            restart_process(restart)
        note = note or ""
        say(f"train: no CUDA GPU: training on CPU ({torch.get_num_threads()} threads)"
            + (f"; {note}" if note else "") + ".")
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return stage.Process(device, dist, say)


def restart_process(restart) -> None:
    """Re-execute this stage with the allocator's environment (same pid, arguments, signal
    mask): glibc reads its tunables only at start (utils/training/allocator.py)."""
    print(restart.message, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(restart.executable, restart.argv, restart.env)


def open_tokenizer(cfg, args, restart: Optional[Restart] = None):
    """The configured tokenizer; with ``--init-from-hf``, the imported model's own (and the
    imported model)."""
    if args.init_from_hf:
        if args.resume and restart is None:
            raise UsageError("--init-from-hf starts a new run from a Hugging Face model; "
                             "--resume continues a run of ours: give one of them.")
        imported = load_hf_llama(args.init_from_hf)
        print(f"train: starting from {imported.source} ({imported.model.num_params():,} "
              "parameters, its own tokenizer).", flush=True)
        return imported.tok, imported.tok_info, imported
    tok = load_tokenizer(cfg)
    return tok, describe(tok, cfg.tokenizer.name), None


def open_run(cfg, args, tok, tok_info, proc: stage.Process, imported=None,
             restart: Optional[Restart] = None) -> stage.Start:
    """A resumed run (its checkpoint, checked against today's tokenizer and settings) or a new
    one (a name, a model from the config or the imported one); refuses to start over an
    existing run. A restarted worker (``restart``) continues from the run's newest checkpoint,
    or starts the run over when there is none yet."""
    hp, ckdir = cfg.training, cfg.path("paths.checkpoints_dir")
    if hp.run_name is not None:
        check_run_name(hp.run_name, "--name (training.run_name)")
    if restart is not None and restart.checkpoint is not None:
        return resumed_run(cfg, str(restart.checkpoint), tok, tok_info, proc)
    if args.resume:
        return resumed_run(cfg, args.resume, tok, tok_info, proc)
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
    if restart is None and any((run_dir / f"checkpoint_latest{ext}").exists() for ext in (".pt", ".dcp")):  # .dcp: FSDP
        raise UsageError(f"{run_dir} already holds a run. Continue it with `--name {run} --resume "
                         "auto`, or choose another --name.")
    return stage.Start(run, run_dir, model_args,
                       weights=imported.model.state_dict() if imported is not None else None,
                       rules=stage.kept_rules(tok, imported))


def resumed_run(cfg, resume: str, tok, tok_info, proc: stage.Process) -> stage.Start:
    """The run ``--resume`` names, with its checkpoint (the tokenizer must be the run's; changed
    settings are named)."""
    hp, ckdir = cfg.training, cfg.path("paths.checkpoints_dir")
    recover_saves(_written_run_dir(cfg, resume), proc)     # a sharded save killed mid-swap
    path = resume_checkpoint(ckdir, resume, hp.run_name)
    # An FSDP run loads a sharded checkpoint's tensors rank by rank (each its shards); one
    # process or DDP reads them whole.
    ckpt = load_checkpoint(path, purpose="resume", tensors=not (hp.parallel == "fsdp" and proc.dist.enabled))
    run = hp.run_name or (path.parent.name if path.parent != ckdir else "legacy")
    require_same_tokenizer(ckpt.get("tokenizer"), tok_info, str(path), "the configured tokenizer",
                           "Resume with the run's tokenizer (its config's tokenizer.name).")
    model_args = model_args_of(ckpt, path)
    _report_config_changes(ckpt.get("config") or {}, cfg.to_dict(), proc.say)
    proc.say(f"train: resuming run '{run}' from {path} (step {ckpt['step']}).")
    return stage.Start(run, ckdir / run, model_args, resume=ckpt, rules=stage.kept_rules(tok, ckpt=ckpt))


def build_data(cfg, tok, tok_info, proc: stage.Process) -> stage.Data:
    """The loaders (shard sets are checked against ``tok_info``; on-the-fly data needs the
    tokenizer itself) and the run's length in optimizer steps."""
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
    return stage.Data(train_loader, val_loader, steps_per_epoch, total)


def _open_shards_on_rank0(cfg, tok_info, proc: stage.Process) -> None:
    """Rank 0 checks the shard set first (and, with dataset.auto_prepare, builds it); the other
    ranks wait, then open the finished set: never several preps in one folder."""
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


def pretraining_spec(cfg, start: stage.Start, data: stage.Data, tok, tok_info, proc: stage.Process,
                     model) -> TrainSpec:
    """Pre-training as a TrainSpec: next-token loss on the windows, the ``training`` section's
    optimizer and numbers, a sample from ``training.sample_prompt`` at each validation."""
    say_model(cfg, start, data, model, proc)
    hp = cfg.training
    bpt = None
    if data.val is not None and start.resume is None:
        bpt = measure_bytes_per_token(_take(data.val, 8), tok.decode)
        if proc.dist.enabled:   # each rank measured its own, equally long val slice: average them
            bpt = D.all_reduce_sum(proc.dist, [bpt or 0.0], proc.device)[0] / proc.dist.world_size
    rules = start.rules or Rules.ours(tok)
    sample = stage.sampler(cfg, hp.sample_prompt, rules.prompt_ids(tok, hp.sample_prompt),
                           hp.sample_tokens, rules.stop_ids,
                           lambda ids: tok.decode(ids, skip_special_tokens=True))
    return TrainSpec(model, start.model_args, data.train, data.val,
                     optimizer=OptimizerSpec.from_config(hp),
                     settings=Settings.from_config(hp, cfg.logging, data.total_steps,
                                                   data.steps_per_epoch),
                     record=stage.run_record("pretrain", cfg, tok_info, start.rules),
                     sample_fn=sample, bytes_per_token=bpt)


def say_model(cfg, start: stage.Start, data: stage.Data, model, proc: stage.Process) -> None:
    """The model (where it comes from) and the run's length, batch, optimizer and precision."""
    hp = cfg.training
    if start.weights is not None:
        origin = "imported"
    elif start.resume is not None:      # resumed: the model is the checkpoint's, whatever model.* says now
        was = ((start.resume.get("config") or {}).get("model") or {}).get("preset")
        origin = f"the checkpoint's model{f', preset {was}' if isinstance(was, str) else ''}"
    else:
        origin = f"preset {cfg.model.preset}"
    dtype = resolve_dtype(hp.dtype, proc.device)
    proc.say(f"train: model {model.num_params():,} parameters ({origin}); "
             f"{data.total_steps} steps of {_effective_batch(cfg, proc)} x {cfg.dataset.window} "
             f"tokens ({data.steps_per_epoch or '?'} steps/epoch); {hp.optimizer}, lr {hp.lr:g} -> "
             f"{hp.min_lr:g}, {str(dtype).replace('torch.', '')} on {proc.device}"
             + (f", {proc.dist.world_size} processes ({proc.dist.backend})" if proc.dist.enabled else "")
             + (", FSDP2" if proc.dist.enabled and hp.parallel == "fsdp" else "")
             + ".")


def _effective_batch(cfg, proc: stage.Process) -> int:
    return cfg.training.batch_size * cfg.training.grad_accum * proc.dist.world_size


def run_files(cfg, start: stage.Start, data: stage.Data, proc: stage.Process, spec: TrainSpec) -> dict:
    """The run folder's resolved config.json; the hyperparameters of the log's config record."""
    hp = cfg.training
    cfg.save_resolved(start.run_dir, "config.json")
    return {**vars(hp), "run": start.run, "params": spec.model.num_params(),
            "total_steps": data.total_steps, "effective_batch": _effective_batch(cfg, proc),
            "window": cfg.dataset.window, "world_size": proc.dist.world_size,
            "dtype": str(resolve_dtype(hp.dtype, proc.device)), "device": str(proc.device),
            "model": start.model_args.to_dict()}


def closing_line(run: str, run_dir: Path, result, logger) -> Optional[str]:
    """Where things are, after a run that trained (none after one that was already complete)."""
    if result.reason == "already_done":
        return None
    best = f"{result.best_val_loss:.4f}" if result.best_val_loss is not None else "n/a"
    return (f"train: {result.reason} at step {result.step}; best val loss {best}; checkpoints "
            f"in {run_dir}; metrics in {logger.jsonl_path}. Next: python main.py "
            f"status {shlex.quote(run)}")


def _take(loader, n: int):
    for i, b in enumerate(loader):
        if i >= n:
            break
        yield b


_EXACTNESS_KEYS = ("dataset.window", "dataset.stride", "dataset.seed", "dataset.val_split",
                   "dataset.source", "training.batch_size", "training.grad_accum",
                   "training.optimizer", "training.lr", "training.min_lr", "training.warmup_steps",
                   "training.weight_decay", "training.dtype", "training.seed", "training.parallel")


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
