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

import copy
import dataclasses
import datetime
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from utils.atomic import write_json_atomic
from utils.cli import PipelineError, StageParser, UsageError, cli_nonblank, cli_path
from utils.data.chat import Rules, stop_ids_of
from utils.data.tok import describe, load_tokenizer, require_bos_eos, slug
from utils.device import resolve_device
from utils.run import (base_record, is_hf_model, load_checkpoint, model_args_of, pick_checkpoint,
                       read_stage_config, resume_checkpoint, tokenizer_for_checkpoint)

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
    p.add_argument("--checkpoint", type=cli_path, default=None, metavar="PATH",
                   help=f"{checkpoint_help}: a checkpoint file, or a run folder (its checkpoint_best.pt, "
                        "else the latest), as infer, export and serve take it")
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
    hf = args.init_from_hf or (args.checkpoint if is_hf_model(args.checkpoint) else None)
    if hf:
        from utils.hf.import_hf import load_hf_llama    # 2.5 s (torch, transformers): only for an import
        imported = load_hf_llama(hf)
        base, model_args = Path(imported.source), imported.model.args
        ckpt = {"model": imported.model.state_dict(), "tokenizer": imported.tok_info}
    else:
        base = base_checkpoint(args.checkpoint, kind)
        ckpt = load_checkpoint(base, purpose="weights")
        model_args = model_args_of(ckpt, base)
    if check is not None:
        check(ckpt, base, model_args)
    stamp = datetime.datetime.now().strftime("%Y_%m_%d_%H_%M_%S")
    run_dir = cfg.path("paths.checkpoints_dir") / f"{kind}_{args.name}_{stamp}"
    if run_dir.exists():
        raise UsageError(f"{run_dir} already exists; wait a second or choose another --name.")
    return Source(run_dir, base, model_args, ckpt, base, resumed=False, imported=imported)


def base_checkpoint(spec, kind: str) -> Path:
    """The checkpoint ``--checkpoint`` names: a file as given; a run folder's checkpoint_best.pt,
    else its latest (utils.run.pick_checkpoint, the rule infer, export and serve follow), said
    on stderr."""
    return pick_checkpoint(Path(spec), say=lambda s: print(f"{kind}: {s}", file=sys.stderr, flush=True))


@dataclass(frozen=True)
class ModelTokenizer:
    """What data prepared *for a model* is tokenized with (``sft prepare --for``, ``dpo prepare
    --for``, and ``sft train`` / ``dpo train`` re-preparing for their base): the model's own
    tokenizer, its record (whose fingerprint the model's runs check), and the chat template
    the model was fine-tuned with (None: a model without one; the data's template is then
    chosen as for the configured tokenizer)."""
    tok: object
    info: dict
    template: Optional[dict]
    name: str


def model_tokenizer(cfg, spec, say=lambda s: print(s, file=sys.stderr, flush=True)) -> ModelTokenizer:
    """The tokenizer (and chat template) of the model ``spec`` names: a Hugging Face model folder
    or .gguf file (the tokenizer an import of it uses), a checkpoint file, or a run folder (its
    best checkpoint, else the latest) of ours."""
    if is_hf_model(spec):
        from utils.hf.import_hf import imported_tokenizer     # torch and transformers: only for a public model
        tok, where = imported_tokenizer(spec)
        return ModelTokenizer(tok, describe(tok, where), None, where)
    path = pick_checkpoint(Path(spec), say=say)
    ckpt = load_checkpoint(path, purpose="weights", mmap=True, merge_lora=False, tensors=False)
    tok, info = tokenizer_for_checkpoint(ckpt, cfg, path, say=say)
    info = {k: v for k, v in info.items() if k != "verified"}
    return ModelTokenizer(tok, info, ckpt.get("chat_template"), str(info.get("name") or path))


def for_flag(p: StageParser, trains: str) -> None:
    """``--for MODEL`` of ``sft prepare`` and ``dpo prepare`` (``trains``: the command that
    trains on the data)."""
    p.add_argument("--for", dest="for_model", type=cli_path, default=None, metavar="MODEL",
                   help=f"prepare for this model: a checkpoint, a run folder, or a Hugging Face model "
                        f"folder or .gguf file; its tokenizer and chat template are used instead of "
                        f"tokenizer.name (what `{trains}` from that model needs)")


def data_tokenizer(cfg, model: Optional[ModelTokenizer], command: str) -> tuple:
    """(tok, its record, its name) a prepare step tokenizes with: ``model``'s (``--for``; said
    once, by ``command``), else the configured ``tokenizer.name``."""
    if model is None:
        tok = load_tokenizer(cfg)
        return tok, describe(tok, cfg.tokenizer.name), cfg.tokenizer.name
    print(f"{command}: for {model.name} (its tokenizer, fingerprint {model.info['fingerprint'][:12]}).", flush=True)
    return model.tok, model.info, model.name


def template_for(model: Optional[ModelTokenizer], tok) -> Optional[tuple]:
    """(template, bos, eos) of the data prepared for ``model`` when it was fine-tuned with a chat
    template (the data must speak it); None: choose one as for any tokenizer."""
    if model is None or model.template is None:
        return None
    print(f"prepare: chat template: the one {model.name} was fine-tuned with ('{model.template.get('name')}').",
          flush=True)
    if model.template.get("name") == "jinja":
        return model.template, tok.bos_token_id, tok.eos_token_id
    return (model.template, *require_bos_eos(tok, model.name))


PREPARED_FOR_FILE = "prepared_for.json"     # in data a train stage prepared again for its model


@dataclass(frozen=True)
class Prepared:
    """How a stage prepares its data (``sft``: post_training.prepare_data, ``dpo``:
    dpo.prepare_data), for :func:`data_for_model`: the paths key of its folder, the config
    section of its source and length, and ``prepare(cfg, limit, model) -> folder``."""
    key: str                      # "paths.post_training_dir"
    section: str                  # "sft" / "dpo"
    prepare: Callable


def source_spec(source: dict) -> str:
    """The ``dataset`` setting that reads the source a metadata.json records again."""
    if source.get("kind") in ("qa_substitute", "preference_substitute"):
        return "samples"
    if source.get("kind") == "hub":
        return str(source.get("name"))
    return str((source.get("inputs") or [source.get("name")])[0])


def model_of_run(cfg, args, kind: str) -> str:
    """The model a start's run trains: the --resume checkpoint, --init-from-hf folder, or the
    checkpoint --checkpoint names (a run folder: its best); what ``--for`` would take."""
    if args.resume:
        return str(resume_checkpoint(cfg.path("paths.checkpoints_dir"), args.resume, prefix=f"{kind}_{args.name}_"))
    if args.init_from_hf or is_hf_model(args.checkpoint):
        return str(args.init_from_hf or args.checkpoint)
    return str(pick_checkpoint(Path(args.checkpoint)))


def data_for_model(cfg, args, kind: str, meta: dict, how: Prepared) -> Optional[Path]:
    """Data fit for the run's model: when the prepared data (``meta``, in ``how.key``'s folder)
    was tokenized with another tokenizer than the model's (say, the configured one and a public
    model's), it is prepared again for the model, from the same source with the same settings,
    into the sibling folder ``<folder>-for-<model>-<fingerprint>`` (kept, and reused while the
    data it came from is unchanged), as ``train`` prepares its shards itself; said on stderr.
    ``cfg``'s key then names that folder (returned); None when the data fits as it is."""
    spec = model_of_run(cfg, args, kind)
    model = model_tokenizer(cfg, spec, say=lambda s: None) if is_hf_model(spec) else None
    record = (model.info if model is not None else
              load_checkpoint(spec, purpose="weights", mmap=True, merge_lora=False, tensors=False).get("tokenizer")
              or {})
    have, want = (meta.get("tokenizer") or {}).get("fingerprint"), record.get("fingerprint")
    if not have or not want or have == want:
        return None
    data_dir = cfg.path(how.key)
    try:
        model = model or model_tokenizer(cfg, spec, say=lambda s: None)
    except PipelineError as e:
        raise PipelineError(f"tokenizer mismatch: the data in {data_dir} was prepared with tokenizer "
                            f"'{(meta.get('tokenizer') or {}).get('name')}' (fingerprint {have[:12]}) but {spec} "
                            f"was trained with '{record.get('name')}' ({want[:12]}), and preparing the data "
                            f"again for it needs that tokenizer: {e}") from None
    label = Path(spec).stem if is_hf_model(spec) else Path(spec).parent.name
    out = data_dir.parent / f"{data_dir.name}-for-{slug(label)}-{want[:8]}"
    mark = {"from": str(data_dir), "from_fingerprint": meta.get("data_fingerprint"), "tokenizer": want}
    sec, key = how.key.split(".", 1)
    print(f"{kind}: the data in {data_dir} was prepared with tokenizer '{(meta.get('tokenizer') or {}).get('name')}' "
          f"(fingerprint {have[:12]}), not with the one of {spec} ('{model.name}', {want[:12]}); "
          f"{'using' if _marked(out, mark) else 'preparing'} it for that model, from the same source and "
          f"settings, in {out} (as `python main.py {kind} prepare --for {spec} --output-dir {out}` does).",
          file=sys.stderr, flush=True)
    if not _marked(out, mark):
        _prepare_again(cfg, how, meta, out, model)
        write_json_atomic(out / PREPARED_FOR_FILE, mark)
    setattr(getattr(cfg, sec), key, str(out))
    return out


def _prepare_again(cfg, how: Prepared, meta: dict, out: Path, model: ModelTokenizer) -> None:
    """The data ``meta`` describes prepared again into ``out`` for ``model``: its source, limit,
    length cut (and DPO's held-out draw) as recorded, the rest of the run's config."""
    again = copy.deepcopy(cfg)
    sec, key = how.key.split(".", 1)
    setattr(getattr(again, sec), key, str(out))
    section, source = getattr(again, how.section), meta.get("source") or {}
    section.dataset, section.max_length = source_spec(source), int(meta.get("max_length") or section.max_length)
    if how.section == "dpo":
        section.val_split = meta.get("val_split", section.val_split)
        again.training.seed = meta.get("seed", again.training.seed)
    how.prepare(again, source.get("limit"), model)


def _marked(out: Path, mark: dict) -> bool:
    """``out`` holds complete data prepared from the same data for the same tokenizer."""
    try:
        held = json.loads((out / PREPARED_FOR_FILE).read_text(encoding="utf-8"))
        done = json.loads((out / "metadata.json").read_text(encoding="utf-8")).get("complete") is True
    except (OSError, ValueError):
        return False
    return done and held == mark


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
