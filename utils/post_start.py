"""The start every post-training stage shares: ``sft train`` (post_training.py), ``dpo train``
(dpo.py) and ``rl`` (rl.py) (library; nothing runs on import).

A post-training run starts from exactly one of ``--checkpoint PATH`` (a checkpoint of ours),
``--init-from-hf DIR`` (a Hugging Face Llama model, imported) or ``--resume PATH|auto`` (the
run's own checkpoint), and lives in ``checkpoints_dir/<kind>_<name>_<stamp>/``. The steps::

    start_flags(parser, kind, run_is, ...)    the four flags, in the stage's parser
    check_start_flags(args, command, checkpoint_is, run_is)   exactly one of the three; --name
    check_lora_flags(args, cfg)               an unknown LoRA target refused before any load
    src = open_source(cfg, args, kind, check, on_resume)     the Source (frozen)
    tok, tok_info = open_tokenizer(cfg, src)  the base's own tokenizer (an import: its own)
    rules = run_rules(kept, src, tok, template)   the base's rules with the run's template
    start = start_of(cfg, src, command, lora, rules)         utils.stage.Start, with its adapter
    return run_start(cfg, start, parts)       utils.stage.set_up in one process

What differs between the stages is passed in: the run kind, the stage's check of a
checkpoint against its data (``check``: a new run's base and a resumed run's checkpoint
alike), and the checks only a resume makes (``on_resume``: DPO's data fingerprint, SFT's
chat template). The messages name the stage (``command``) and say what to do.

This module is imported by the stage scripts at the top: what needs torch (the importer,
utils.stage, utils.lora) is imported where it is used, so that ``sft prepare``,
``dpo prepare`` and ``--help`` do not load it.
"""
from __future__ import annotations

import dataclasses
import datetime
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from utils.cli import PipelineError, StageParser, UsageError, cli_nonblank, cli_path
from utils.data.chat import Rules, stop_ids_of
from utils.device import resolve_device
from utils.run import (base_record, load_checkpoint, model_args_of, read_stage_config, resume_checkpoint,
                       tokenizer_for_checkpoint)

# kind -> (the kind with its article, what --checkpoint would do with such a checkpoint)
KINDS = {"sft": ("an SFT", "fine-tune it"), "dpo": ("a DPO", "start DPO from it"),
         "rl": ("an RL", "start RL from it")}


@dataclass(frozen=True)
class Source:
    """What a post-training run opens: the model it starts from (a new run) or its own
    checkpoint (a resume), checked against the stage's data, and where the run lives."""
    run_dir: Path
    base: Path                    # the checkpoint (or imported model) the run starts from
    model_args: object
    ckpt: dict                    # the checkpoint read (an imported model: its weights and tokenizer)
    path: Path                    # where ``ckpt`` was read
    resumed: bool
    imported: object = None       # --init-from-hf: utils.hf.import_hf.Imported
    base_imported: bool = False   # a resumed run whose base is an imported model

    def base_record(self) -> dict:
        """The stage config's ``base`` (utils.run.base_record)."""
        return base_record(self.base, imported=self.imported is not None or self.base_imported)


def start_flags(p: StageParser, kind: str, run_is: str, checkpoint_help: str, init_help: str,
                name_default: str) -> None:
    """A post-training stage's --checkpoint, --resume, --init-from-hf and --name (``run_is``:
    the run --resume continues, as "an SFT run")."""
    p.add_argument("--checkpoint", type=cli_path, default=None, metavar="PATH", help=checkpoint_help)
    p.add_argument("--resume", default=None, metavar="PATH|auto", type=cli_nonblank,
                   help=f"continue {run_is} from its checkpoint file, or 'auto': the newest "
                        f"{kind}_<name>_* run's checkpoint_latest.pt")
    p.add_argument("--init-from-hf", type=cli_path, default=None, metavar="DIR", help=init_help)
    p.add_argument("--name", default=name_default, help=f"run name: checkpoints/{kind}_<name>_<time>/")


def check_start_flags(args, command: str, checkpoint_is: str, run_is: str) -> None:
    """Exactly one of --checkpoint, --init-from-hf and --resume (``checkpoint_is``: what the
    stage's --checkpoint is; ``run_is``: the run --resume continues), and a --name fit for a
    folder name."""
    given = [f for f, v in (("--checkpoint", args.checkpoint), ("--init-from-hf", args.init_from_hf),
                            ("--resume", args.resume)) if v]
    if len(given) != 1:
        raise UsageError(f"{command} needs exactly one of --checkpoint PATH ({checkpoint_is}), "
                         f"--init-from-hf DIR (a Hugging Face Llama model) or --resume PATH|auto "
                         f"(continue {run_is})" + (f"; got {' and '.join(given)}." if given else "."))
    if not re.fullmatch(r"[A-Za-z0-9._-]+", args.name or ""):
        raise UsageError(f"--name {args.name!r}: use letters, digits, '.', '_' or '-'.")


def check_lora_flags(args, cfg) -> None:
    """With --lora, the ``lora`` section's settings (an unknown target module) are refused
    before any checkpoint loads."""
    if args.lora:
        from utils.lora import LoraSettings   # torch-bound: a stage's prepare and --help do not load it
        LoraSettings.from_config(cfg.lora)


def open_source(cfg, args, kind: str, check: Optional[Callable] = None,
                on_resume: Optional[Callable] = None) -> Source:
    """Load the base (--checkpoint, or --init-from-hf imported) and name the run folder
    ``<kind>_<name>_<stamp>`` (an existing one is refused), or on --resume the run's own
    checkpoint and folder. ``check(ckpt, path, model_args)`` refuses a model that does not fit
    the stage's data; ``on_resume(ckpt, path, base)`` makes the checks only a resume makes."""
    if args.resume:
        return resumed_source(cfg, args, kind, check, on_resume)
    imported = None
    if args.init_from_hf:
        from utils.hf.import_hf import load_hf_llama    # 2.5 s (torch, transformers): only for an import
        imported = load_hf_llama(args.init_from_hf)
        base, model_args = Path(imported.source), imported.model.args
        ckpt = {"model": imported.model.state_dict(), "tokenizer": imported.tok_info}
    else:
        base = Path(args.checkpoint)
        ckpt = load_checkpoint(base, purpose="weights")
        model_args = model_args_of(ckpt, base)
    if check is not None:
        check(ckpt, base, model_args)
    stamp = datetime.datetime.now().strftime("%Y_%m_%d_%H_%M_%S")
    run_dir = cfg.path("paths.checkpoints_dir") / f"{kind}_{args.name}_{stamp}"
    if run_dir.exists():
        raise UsageError(f"{run_dir} already exists; wait a second or choose another --name.")
    return Source(run_dir, base, model_args, ckpt, base, resumed=False, imported=imported)


def resumed_source(cfg, args, kind: str, check: Optional[Callable] = None,
                   on_resume: Optional[Callable] = None) -> Source:
    """The run ``--resume`` names (``auto``: the newest ``<kind>_<name>_*`` run's
    checkpoint_latest.pt): a checkpoint of this kind, its base as its record names it, and
    whether that base was imported (the run's stage config)."""
    rpath = resume_checkpoint(cfg.path("paths.checkpoints_dir"), args.resume, prefix=f"{kind}_{args.name}_")
    ckpt = load_checkpoint(rpath, purpose="resume")
    if ckpt.get("kind") != kind:
        what, verb = KINDS[kind]
        raise PipelineError(f"--resume {rpath}: not {what} checkpoint (kind '{ckpt.get('kind')}'). "
                            f"To {verb}, pass it as --checkpoint.")
    base = Path((ckpt.get(kind) or {}).get("base_checkpoint") or rpath)
    if on_resume is not None:
        on_resume(ckpt, rpath, base)
    model_args = model_args_of(ckpt, rpath)
    if check is not None:
        check(ckpt, rpath, model_args)
    kept = (read_stage_config(rpath.parent) or {}).get("base")
    return Source(rpath.parent, base, model_args, ckpt, rpath, resumed=True,
                  base_imported=bool(kept.get("imported")) if isinstance(kept, dict) else False)


def open_tokenizer(cfg, src: Source) -> tuple:
    """(tok, tok_info): an imported model's own, else the base run's (utils.run), after the
    checkpoint checks (a refusal costs no tokenizer load)."""
    if src.imported is not None:
        return src.imported.tok, dict(src.imported.tok_info)
    tok, tok_info = tokenizer_for_checkpoint(src.ckpt, cfg, src.path)
    return tok, {k: v for k, v in tok_info.items() if k != "verified"}


def run_rules(kept: Optional[Rules], src: Source, tok, template: dict) -> Rules:
    """The run's rules (utils/data/chat.py): the base model's BOS rule, stop ids and generation
    defaults (``kept``: an imported model's own or those its checkpoint recorded, else ours),
    with the run's chat ``template`` and its end-of-turn token."""
    base = kept or Rules.ours(tok, src.ckpt.get("chat_template"))
    stops = tuple(dict.fromkeys(base.stop_ids + stop_ids_of(None, tok, template)))
    return dataclasses.replace(base, template=template, stop_ids=stops)


def epoch_hyperparameters(cfg, kind: str, eval_every: float, data) -> tuple:
    """(OptimizerSpec, Settings) of a run in epochs (SFT, DPO) from its own config section
    (``kind``: lr, betas, weight decay, warm-up, clip, dtype) and, for how it is executed,
    ``training`` and ``logging``: validated every ``eval_every`` of an epoch, one numbered
    checkpoint per epoch, all kept."""
    from utils.training.trainer import OptimizerSpec, Settings, eval_interval   # torch-bound: not for prepare
    s, hp, log = getattr(cfg, kind), cfg.training, cfg.logging
    optimizer = OptimizerSpec("adamw", s.lr, s.beta1, s.beta2, s.weight_decay)
    settings = Settings(
        total_steps=data.total_steps, min_lr=s.lr * s.min_lr_ratio,
        warmup_steps=int(data.total_steps * s.warmup_ratio + 1e-9), warmup_source=f"{kind}.warmup_ratio",
        eval_interval=eval_interval(None, eval_every, data.steps_per_epoch, data.total_steps),
        eval_batches=max(1, len(data.val) if data.val is not None else 1),
        checkpoint_every=data.steps_per_epoch, keep_checkpoints=None,     # one per epoch, all kept
        steps_per_epoch=data.steps_per_epoch, grad_accum=1, grad_clip=s.grad_clip, dtype=s.dtype,
        patience=hp.early_stopping_patience, log_every=log.log_every,
        smoothing_window=log.smoothing_window, compile=hp.compile,
        activation_checkpointing=hp.activation_checkpointing)
    return optimizer, settings


def start_of(cfg, src: Source, command: str, lora: bool, rules):
    """utils.stage.Start of the run: its checkpoint (a resume) or the base's weights, its rules,
    and its LoRA adapter (None: all weights train)."""
    from utils import stage     # torch-bound (the model, the trainer): prepare and --help do not load it
    resume = src.ckpt if src.resumed else None
    adapter = stage.lora_for(cfg, command, lora, src.model_args, src.base, resume, src.path)
    return stage.Start(src.run_dir.name, src.run_dir, src.model_args, resume=resume,
                       weights=None if src.resumed else src.ckpt["model"], rules=rules, lora=adapter)


def run_start(cfg, start, parts):
    """utils.stage.set_up in one process on ``training.device``: the run, ready to finish."""
    from utils import stage     # torch-bound: prepare and --help do not load it
    proc = stage.one_process(resolve_device(cfg.training.device, "training.device"))
    return stage.set_up(cfg, start, proc, parts)


def best_or_latest(run_dir: Path) -> Path:
    """The checkpoint to try: checkpoint_best.pt when the run wrote one, else checkpoint_latest.pt."""
    best = run_dir / "checkpoint_best.pt"
    return best if best.is_file() else run_dir / "checkpoint_latest.pt"


def closing(command: str, run_dir: Path, adapter: bool, line: str, picked: Path) -> str:
    """The stage's closing ``line``; a LoRA run also writes its adapter (of checkpoint
    ``picked``) as a PEFT folder, ``<run>/adapter/``, and says so."""
    if not adapter:
        return line
    from utils import stage     # torch-bound: prepare and --help do not load it
    return line + "\n" + stage.write_adapter(command, run_dir, picked)
