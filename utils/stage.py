"""The skeleton every training stage runs: pre-training (train.py) and SFT (post_training.py
``sft train``) today, the post-training methods that follow (DPO, RL) next (library; nothing
runs on import).

A stage's set-up is a short sequence of steps, each returning what it makes (frozen values;
nothing is changed on the way)::

    proc  = Process(device, dist, say)          this rank (the stage picks its device)
    start = Start(run, run_dir, model_args, resume=ckpt | weights=state_dict, rules=rules)
    data  = Data(train, val, steps_per_epoch, total_steps)
    run   = set_up(cfg, start, proc, Parts(...))    the trainer, ready; its logger
    return run.finish()                         0, or 130 when stopped

A training mode is a spec of parts: the stage brings :class:`Parts` (the
:class:`~utils.training.trainer.TrainSpec` built around the model: loss, data, optimizer,
numbers, what its checkpoints record, a sample at each validation; its own run files; the
resume command; its closing line), and the skeleton does what every stage does the same way:

- the run's outputs through utils.run.RunOutputs: a start refused before the trainer is ready
  (a resume refused by its training state, a model or data that do not fit) leaves nothing
  new behind;
- the model: seeded with ``training.seed``, built from ``start.model_args``, given the weights
  the run starts from (a fresh initialization without them), on the device;
- the logger (after a resume, TensorBoard drops what the log holds beyond the checkpoint's
  step), the Trainer, the resume state loaded before any of the run's files is written, then
  those files (rank 0): a copy of the run's tokenizer, the stage's own (config.json,
  sft_config.json) and the log's config record;
- the end: exit 130 after Ctrl-C or SIGTERM (the trainer saved checkpoint_latest.pt and printed
  the resume command), a PipelineError naming the learning rate's config key when the run
  diverged, the stage's closing line otherwise.

The checkpoint a run resumes from and the weights it starts from are held by ``start``, which
only the stage's set-up sees: once :func:`set_up` returns they can be freed (training holds
the model, the optimizer and their state, not a second copy).

Model rules (utils/data/chat.py): a run started from a public model keeps that model's chat
template, BOS rule, stop ids and generation defaults in its checkpoints (:func:`kept_rules`,
:func:`run_record`), so infer, serve and export frame prompts as the model expects.
Validation samples use the ``inference`` section's temperature and top-k (what ``infer``
samples with) and the run's seed (:func:`sampler`).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional

import torch.nn as nn

from model import create_model
from utils.cli import EXIT_INTERRUPTED, PipelineError, UsageError
from utils.data.chat import Rules, rules_of_checkpoint
from utils import lora
from utils.generation.engine import generate
from utils.lora import LoraSettings
from utils.run import RunOutputs, load_checkpoint, save_run_tokenizer
from utils.training import distributed as D
from utils.training.trainer import (RunRecord, TrainResult, Trainer, TrainSpec, disable_dropout,
                                    diverged_message, pause_step_from_env, seed_everything)


@dataclasses.dataclass(frozen=True)
class Process:
    """This rank: its device, the process group, and ``say`` (prints on rank 0 only)."""
    device: Any
    dist: D.DistInfo
    say: Callable[..., None]


def say_always(*args, **kw) -> None:
    print(*args, **kw, flush=True)


def one_process(device) -> Process:
    """A stage that runs in one process (no process group)."""
    return Process(device, D.DistInfo(), say_always)


@dataclasses.dataclass(frozen=True)
class Start:
    """Where the run lives and what it starts from: the checkpoint it continues (``resume``), or
    the weights a new run starts from (``weights``: an imported or a pretrained model's), or
    neither (a fresh initialization)."""
    run: str                            # the run's name: logs/*/<run>
    run_dir: Path
    model_args: Any                     # model.ModelArgs
    resume: Optional[dict] = None       # utils.run.load_checkpoint(..., "resume"): Trainer.load_state
    weights: Optional[dict] = None      # a state dict for the freshly built model
    rules: Optional[Rules] = None       # kept in checkpoints (None: ours apply)
    lora: Optional[LoraSettings] = None  # a LoRA run's adapter (utils/lora.py); None: all weights train

    @property
    def purge_step(self) -> Optional[int]:
        """The first step a resumed run logs again (TensorBoard drops what follows it)."""
        return int(self.resume["step"]) + 1 if self.resume is not None else None


@dataclasses.dataclass(frozen=True)
class Data:
    """The loaders and the run's length in optimizer steps."""
    train: Any
    val: Any
    steps_per_epoch: Optional[int]
    total_steps: int


@dataclasses.dataclass(frozen=True)
class Parts:
    """What a training stage brings to the skeleton."""
    lr_key: str                                     # the learning rate's key, named when a run diverges
    tokenizer: Any                                  # the run's tokenizer: a copy goes into the run folder
    spec: Callable[[nn.Module], TrainSpec]          # the training mode around the built model
    run_files: Callable[[TrainSpec], dict]          # the stage's own files; -> the log's hyperparameters
    resume_command: str                             # printed when the run is stopped
    closing: Callable[[TrainResult, Any], Optional[str]]   # (result, logger) -> the last line, or None;
                                                    # kept while training: must not hold ``start``
    keep_setting: Optional[str] = None              # the key that keeps fewer numbered checkpoints


@dataclasses.dataclass(frozen=True)
class Run:
    """A trainer ready to fit, with what :meth:`finish` needs (not ``start``: see the module
    docstring, so ``closing`` must not hold it either)."""
    trainer: Trainer
    logger: Any
    say: Callable[..., None]
    lr_key: str
    closing: Callable[[TrainResult, Any], Optional[str]]

    def finish(self) -> int:
        """Train, close the log, end as the module docstring says. The process group is left
        to the process's end (utils/training/distributed.py ``shutdown``): the trainer's DDP
        model still uses it here. A rank whose peer died (killed, out of memory, its node lost)
        ends with one line saying so (exit 1), not an unexpected error."""
        try:
            result = self.trainer.fit()
        except RuntimeError as e:
            dist = self.trainer.dist
            if not (dist.enabled and D.peer_lost(e)):
                raise
            then = ("torchrun restarts the workers, which resume from the run's newest checkpoint"
                    if D.restart_count() < D.max_restarts() else
                    "once the cause is fixed (the failed rank's own message says it), continue with "
                    "--resume auto")
            cause = str(e).splitlines()[0].split(". ")[0][:200]
            raise PipelineError(f"rank {dist.rank}: another rank's process ended during a step "
                                f"({cause}); this rank stops too, without saving "
                                f"(a checkpoint needs every rank): {then}.") from None
        finally:
            self.logger.close()
        if result.reason == "interrupted":
            return EXIT_INTERRUPTED
        if result.reason == "diverged":
            raise PipelineError(diverged_message(result, self.trainer.run_dir, self.lr_key,
                                                 self.trainer.spec.optimizer.lr))
        line = self.closing(result, self.logger)
        if line is not None:
            self.say(line)
        return 0


def kept_rules(tok, imported=None, ckpt: Optional[dict] = None) -> Optional[Rules]:
    """The rules a run keeps: an imported model's (``imported``: utils.hf.import_hf's), or those
    a checkpoint recorded (a run started from one); None for a model trained here (ours)."""
    if imported is not None:
        return imported.rules
    if ckpt is not None and ckpt.get("model_rules"):
        return rules_of_checkpoint(ckpt, tok)
    return None


def run_record(kind: str, cfg, tok_info: dict, rules: Optional[Rules], extra: Optional[dict] = None
               ) -> RunRecord:
    """What every checkpoint of the run says beyond its training state: the resolved config,
    the tokenizer, the chat template, and ``model_rules`` when the rules are a public model's own."""
    extra = dict(extra or {})
    if rules is not None and rules.imported:
        extra["model_rules"] = rules.to_dict()
    return RunRecord(kind, cfg.to_dict(), tok_info,
                     chat_template=rules.template if rules is not None else None, extra=extra)


def sampler(cfg, prompt: str, prompt_ids: list, tokens: int, stop_ids,
            decode: Callable[[list], str]) -> Optional[Callable]:
    """The sample printed at each validation: ``tokens`` new tokens after ``prompt_ids``,
    sampled with the ``inference`` section's temperature and top-k and ``training.seed``, as
    ``[(prompt, decode(new ids))]``; None when ``tokens`` is 0."""
    if tokens <= 0:
        return None
    temperature, top_k, seed = cfg.inference.temperature, cfg.inference.top_k, cfg.training.seed

    def sample(model) -> list[tuple[str, str]]:
        out = generate(model, [prompt_ids], max_new_tokens=tokens, temperature=temperature,
                       top_k=top_k, eos_id=stop_ids, seed=seed)
        return [(prompt, decode(out[0]))]
    return sample


def build_model(start: Start, seed: int, device) -> nn.Module:
    """The seeded model of ``start.model_args`` with the weights the run starts from (a resumed
    run's are loaded with its training state), on ``device``; with ``start.lora``, a new
    adapter on those weights, everything else frozen (a resumed run's adapter weights replace
    the new one's with its training state)."""
    seed_everything(seed)
    model = create_model(start.model_args)
    if start.weights is not None:
        model.load_state_dict(start.weights, strict=True)
    if start.lora is not None:
        lora.apply(model, start.lora)
    return model.to(device)


def set_up(cfg, start: Start, proc: Process, parts: Parts) -> Run:
    """The model, the training mode, the logger and the trainer (with the resumed state), then
    the run's files; a start refused on the way leaves nothing new behind (module docstring)."""
    with RunOutputs(start.run_dir, cfg.path("paths.logs_dir"), start.run,
                    enabled=proc.dist.is_main) as outputs:
        model = build_model(start, cfg.training.seed, proc.device)
        spec = parts.spec(model)
        logger = outputs.open_logger(tensorboard=cfg.logging.tensorboard,
                                     jsonl=cfg.logging.raw_metrics, purge_step=start.purge_step)
        trainer = Trainer(spec, run_dir=start.run_dir, logger=logger, device=proc.device,
                          dist=proc.dist, pause_at_step=pause_step_from_env(),
                          resume_command=parts.resume_command)
        if start.resume is not None:
            trainer.load_state(start.resume)    # before the run's files: a refusal changes nothing
        if proc.dist.is_main:
            room = trainer.check_checkpoint_room(parts.keep_setting)   # refuses when not one fits
            if room:
                proc.say(room)
            write_run_files(cfg, start.run_dir, spec, parts, logger)
        outputs.begin()
    return Run(trainer, logger, proc.say, parts.lr_key, parts.closing)


def write_run_files(cfg, run_dir: Path, spec: TrainSpec, parts: Parts, logger) -> None:
    """The run folder with a copy of its tokenizer and the stage's own files, and the log's
    config record (written once the start can no longer be refused)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    save_run_tokenizer(run_dir, parts.tokenizer, spec.record.tokenizer["name"])
    logger.config(cfg.to_dict(), parts.run_files(spec))


# --------------------------------------------------------------------------- LoRA
def lora_for(cfg, command: str, wanted: bool, model_args, base, resume: Optional[dict], path
             ) -> Optional[LoraSettings]:
    """The run's LoRA adapter (utils/lora.py), or None (all weights train): a new run's from
    the ``lora`` section when ``wanted`` (``--lora``); a resumed run (``resume``: its
    checkpoint, read at ``path``) keeps its own, and one that trains all weights cannot switch."""
    if resume is not None:
        entry = resume.get("lora")
        if entry is None and wanted:
            raise UsageError(f"--resume {path}: that run trains all weights; a run cannot switch to LoRA "
                             f"midway. Start a new run: python main.py {command} --lora --checkpoint {path}")
        kept = lora.settings_from_entry(entry) if entry is not None else None
        if kept is not None and wanted and LoraSettings.from_config(cfg.lora) != kept:
            print(f"{command}: note: the resumed run keeps its adapter ({kept.describe()}); the lora "
                  "section's settings apply to new runs.", flush=True)
        return kept
    if not wanted:
        return None
    problem = lora.refusal(model_args)
    if problem:
        raise UsageError(f"--lora: {base}: {problem}.")
    return LoraSettings.from_config(cfg.lora)


def say_adapter(command: str, model) -> None:
    """A LoRA run's adapter and what trains (nothing for a run of all weights)."""
    adapter = lora.settings_of(model)
    if adapter is not None:
        trainable, total = lora.parameter_counts(model)
        print(f"{command}: LoRA {adapter.describe()}: {trainable:,} trainable of {total:,} "
              f"parameters ({100 * trainable / total:.2f}%); the rest is frozen.", flush=True)


def say_dropout(command: str, model, keep: bool) -> None:
    """Dropout off in a DPO or RL policy unless ``keep`` (utils/training/trainer.py
    ``disable_dropout``), said once when there was any to turn off."""
    if keep:
        return
    n = disable_dropout(model)
    if n:
        print(f"{command}: dropout off in the policy ({n} module(s); --keep-dropout keeps it), so it "
              "computes as the eval-mode numbers it is compared with.", flush=True)


def adapter_record(model) -> Optional[dict]:
    """A stage config's ``lora``: the adapter's settings and parameter counts (None: all weights)."""
    adapter = lora.settings_of(model)
    if adapter is None:
        return None
    trainable, total = lora.parameter_counts(model)
    return {**adapter.to_dict(), "trainable_params": trainable, "total_params": total}


def write_adapter(command: str, run_dir: Path, picked: Path) -> str:
    """A LoRA run's end: the adapter of checkpoint ``picked`` as a PEFT folder
    (``<run>/adapter/``, utils/hf/adapter.py); returns the line that says where."""
    from utils.hf.adapter import save_adapter   # peft, transformers: a LoRA run's end only
    ckpt = load_checkpoint(picked, purpose="weights", mmap=True, merge_lora=False)
    base = next((str(v["base_checkpoint"]) for v in ckpt.values()
                 if isinstance(v, dict) and isinstance(v.get("base_checkpoint"), str)), "")
    save_adapter(run_dir / "adapter", ckpt["lora"], base)
    return (f"{command}: LoRA adapter of {picked.name} in PEFT format: {run_dir / 'adapter'}; "
            f"merged export: python main.py export --checkpoint {picked} --format hf")
