"""Stage ``sft``: instruction data (LIMA's schema) -> supervised fine-tuning of a checkpoint.

    python main.py sft prepare                          LIMA (GAIR/lima) via `datasets` (online)
    python main.py sft prepare --dataset samples        offline: SciQ + ARC QA in LIMA's schema
    python main.py sft prepare --dataset my.jsonl       local JSONL, {"conversations": [...]}
    python main.py sft train --checkpoint checkpoints/run_x/checkpoint_best.pt [--epochs 2]
        [--lr 5e-5] [--batch-size 8] [--name lima]      -> checkpoints/sft_<name>_<time>/
    python main.py sft train --resume checkpoints/sft_lima_<time>/checkpoint_latest.pt

``prepare`` writes data/post-training/ (paths.post_training_dir): a copy of the source JSONL,
tokenized_examples.npy + loss_mask.npy + offsets.npy, metadata.json (last, atomically) and
example_conversations.json; the format, the template and the mask are utils/sft.py's
contract. Malformed records are skipped and reported as ``file:line: reason``; no usable
example is an error (exit 1).

``train`` checks that the checkpoint's tokenizer fingerprint and architecture fit the data,
then runs the one training loop (utils/trainer.py) with the loss mask; it validates every
20% of an epoch with a sample answer to a fixed question and writes checkpoint_best.pt,
checkpoint_latest.pt, checkpoint_epoch_N.pt and sft_config.json. Ctrl-C (or SIGTERM) saves
checkpoint_latest.pt and prints the exact resume command (exit 130); the resumed run
repeats the uninterrupted one. Details: docs/sft_inference.md.
"""
from __future__ import annotations

import copy
import datetime
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

from utils.cli import (EXIT_INTERRUPTED, PipelineError, StageParser, UsageError, argv_without,
                       cli_path, run_stage)

SAMPLES_SOURCE = "samples"
SAMPLE_QUESTION = "Why is the sky blue?"
TEST_MAX_RECORDS = 300
USAGE = ("usage: python main.py sft {prepare,train} [options]\n"
         "  prepare   instruction data -> data/post-training/ (tokenized, with loss mask)\n"
         "  train     fine-tune a checkpoint on it (--checkpoint PATH)\n"
         "Both take --config FILE (default config.json) and --test (a quick, small run).\n"
         "Run `python main.py sft prepare --help` or `... sft train --help` for the options.")


# --------------------------------------------------------------------------- parsers
def prepare_parser() -> StageParser:
    p = StageParser("post_training.py prepare", "Convert instruction data into the chat format "
                    "and tokenize it with a loss mask on the assistant tokens.")
    p.config_flag("--dataset", key="sft.dataset", metavar="NAME|FILE|samples",
                  help="hub dataset name (GAIR/lima), a local .jsonl file, or 'samples' (offline: "
                       "SciQ + ARC question/answer pairs converted into LIMA's schema)")
    p.config_flag("--max-length", key="sft.max_length", type=int, metavar="N",
                  help="drop examples longer than this many tokens")
    p.add_argument("--batch-size", type=int, default=100, metavar="N",
                   help="records tokenized per batch")
    p.config_flag("--output-dir", key="paths.post_training_dir", type=cli_path, metavar="DIR",
                  help="where the prepared data goes")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help=f"use only the first N records (--test: {TEST_MAX_RECORDS})")
    return p


def train_parser() -> StageParser:
    p = StageParser("post_training.py train", "Supervised fine-tuning of a pretrained checkpoint "
                    "on the prepared instruction data (masked loss, resumable).")
    p.add_argument("--checkpoint", type=cli_path, default=None, metavar="PATH",
                   help="pretrained checkpoint to fine-tune (required unless --resume)")
    p.add_argument("--resume", default=None, metavar="PATH|auto",
                   help="continue an SFT run from its checkpoint file, or 'auto': the newest "
                        "sft_<name>_* run's checkpoint_latest.pt")
    p.add_argument("--name", default="lima", help="run name: checkpoints/sft_<name>_<time>/")
    p.config_flag("--epochs", key="sft.epochs", type=int, metavar="N", help="fine-tuning epochs")
    p.config_flag("--lr", key="sft.lr", type=float, metavar="LR", help="learning rate")
    p.config_flag("--batch-size", key="sft.batch_size", type=int, metavar="N", help="conversations per batch")
    p.config_flag("--val-split", key="sft.val_split", type=float, metavar="F", help="held-out fraction")
    p.add_argument("--max-steps", type=int, default=None, metavar="N",
                   help="stop after N optimizer steps (default: epochs x steps per epoch)")
    p.add_argument("--eval-every", type=float, default=0.2, metavar="F",
                   help="validate every this fraction of an epoch")
    p.config_flag("--data-dir", key="paths.post_training_dir", type=cli_path, metavar="DIR",
                  help="the prepared SFT data")
    p.config_flag("--device", key="training.device", metavar="DEV", help="auto, cpu, cuda or cuda:N")
    p.config_flag("--dtype", key="training.dtype", choices=["auto", "bf16", "fp16", "fp32"],
                  help="autocast precision")
    p.config_flag("--seed", key="training.seed", type=int, metavar="N", help="random seed (split, order)")
    p.config_flag("--log-every", key="logging.log_every", type=int, metavar="N", help="steps between log records")
    p.add_argument("--sample-tokens", type=int, default=32, metavar="N",
                   help="tokens of the sample answer at each validation (0 = none)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "prepare":
        return prepare(rest)
    if cmd == "train":
        return train(rest, argv)
    raise UsageError(f"unknown sft command '{cmd}'. " + USAGE)


# --------------------------------------------------------------------------- prepare
def _load_source(cfg, spec: str, max_turn_chars: int, skips) -> tuple[list, dict, Optional[Path]]:
    """(records, source description, local file to copy or None)."""
    from utils import sft
    if spec == SAMPLES_SOURCE:
        recs = sft.qa_substitute_records(cfg.path("paths.samples_dir"))
        counts: dict = {}
        for r in recs:
            counts[r["source"]] = counts.get(r["source"], 0) + 1
        return recs, {"kind": "qa_substitute", "name": "sciq+arc_easy+arc_challenge",
                      "label": "SUBSTITUTE for LIMA: real SciQ (answer + support text) and "
                               "ARC-Easy/Challenge (correct choice written out) question/answer "
                               "pairs converted into LIMA's schema; LIMA itself is not reachable "
                               "offline",
                      "records_by_source": counts,
                      "inputs": [str(cfg.path("paths.samples_dir") / n) for n in
                                 ("sciq", "arc_easy", "arc_challenge")]}, None
    p = Path(os.path.expanduser(spec))
    p = p if p.is_absolute() else (cfg.resolve(spec) if cfg.resolve(spec).exists() else p.resolve())
    if p.suffix.lower() in (".jsonl", ".json") or p.exists():
        recs = sft.read_jsonl_records(p, max_turn_chars, skips)
        return recs, {"kind": "jsonl", "name": p.name, "label": "local LIMA-schema JSONL",
                      "inputs": [str(p)]}, p
    recs = sft.lima_records(spec)
    return recs, {"kind": "hub", "name": spec, "label": "LIMA (Hugging Face hub)", "inputs": [spec]}, None


def prepare(argv: Sequence[str]) -> int:
    parser = prepare_parser()
    args, cfg = parser.parse(argv)
    import numpy as np
    from utils import sft
    from utils.atomic import write_json_atomic
    from utils.shards import dtype_for_vocab, save_npy_atomic
    from utils.tok import describe, load_tokenizer, require_bos_eos

    if args.batch_size < 1:
        raise UsageError("--batch-size must be at least 1.")
    max_len = cfg.sft.max_length
    out = cfg.path("paths.post_training_dir")
    tok = load_tokenizer(cfg)
    tok_info = describe(tok, cfg.tokenizer.name)
    bos, eos = require_bos_eos(tok, cfg.tokenizer.name)
    template = sft.default_template(cfg.sft)
    skips = sft.Skips()
    records, source, local = _load_source(cfg, cfg.sft.dataset, max_len * sft.MAX_TURN_CHARS_PER_TOKEN,
                                          skips)
    limit = args.limit if args.limit is not None else (TEST_MAX_RECORDS if cfg.test else None)
    read = len(records) + skips.total
    if limit is not None:
        records = records[:limit]
    print(f"sft prepare: {len(records)} records from {source['label']} ({source['name']})"
          + (f"; {skips.total} malformed skipped" if skips.total else "") + ".", flush=True)

    ids_all, mask_all, lengths, kept_recs = [], [], [], []
    too_long = 0
    for s in range(0, len(records), args.batch_size):
        for rec in records[s:s + args.batch_size]:
            ids, mask = sft.encode_conversation(tok, template, rec["conversations"], bos, eos)
            if len(ids) > max_len:
                too_long += 1
                continue
            ids_all.append(ids)
            mask_all.append(mask)
            lengths.append(len(ids))
            kept_recs.append(rec)
    total = len(records)
    if not kept_recs:
        why = "; ".join(f"{k}: {v}" for k, v in sorted(skips.counts.items()))
        first = ("; first problems: " + "; ".join(skips.where[:5])) if skips.where else ""
        raise PipelineError(
            f"no usable SFT example in {', '.join(source['inputs'])}: {read} record(s) read, "
            f"{skips.total} malformed ({why or 'none'}), {too_long} longer than --max-length "
            f"{max_len}{first}. Fix the file (one {{\"conversations\": [user, assistant, ...]}} "
            "object per line) or raise --max-length; nothing was written.")

    out.mkdir(parents=True, exist_ok=True)
    (out / sft.METADATA_FILE).unlink(missing_ok=True)     # the set is incomplete until it is rewritten
    dtype = dtype_for_vocab(len(tok))
    tokens = np.fromiter((t for ids in ids_all for t in ids), dtype=dtype, count=sum(lengths))
    mask = np.fromiter((m for ms in mask_all for m in ms), dtype=np.uint8, count=sum(lengths))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths)
    save_npy_atomic(out / sft.TOKENS_FILE, tokens)
    save_npy_atomic(out / sft.MASK_FILE, mask)
    save_npy_atomic(out / sft.OFFSETS_FILE, offsets)

    if local is not None:
        copy_name = local.name
        tmp = out / f".{copy_name}.tmp-{os.getpid()}"
        shutil.copyfile(local, tmp)
        os.replace(tmp, out / copy_name)
    else:
        copy_name = "lima_train.jsonl" if source["kind"] == "hub" else "qa_substitute_lima_schema.jsonl"
        from utils.atomic import atomic_open
        with atomic_open(out / copy_name, "w") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")

    examples = []
    for rec, ids, m in list(zip(kept_recs, ids_all, mask_all))[:5]:
        examples.append({"source": rec["source"], "conversations": rec["conversations"],
                         "formatted": sft.decode_for_people(tok, ids),
                         "trained_on": tok.decode([t for t, k in zip(ids, m) if k],
                                                  skip_special_tokens=False),
                         "tokens": len(ids), "loss_tokens": int(sum(m))})
    write_json_atomic(out / sft.EXAMPLES_FILE, examples)
    single = sum(1 for r in kept_recs if len(r["conversations"]) == 2)
    meta = {"format": sft.FORMAT_NAME, "format_version": sft.FORMAT_VERSION, "complete": True,
            "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "source": {**source, "copy": copy_name, "test": cfg.test, "limit": limit},
            "template": template, "max_length": max_len, "dtype": str(np.dtype(dtype)),
            "files": {"tokens": sft.TOKENS_FILE, "loss_mask": sft.MASK_FILE,
                      "offsets": sft.OFFSETS_FILE, "examples": sft.EXAMPLES_FILE},
            "counts": {"records_read": read, "considered": total, "kept": len(kept_recs),
                       "too_long": too_long, "single_turn": single,
                       "multi_turn": len(kept_recs) - single, **skips.to_dict()},
            "lengths": sft.length_stats(lengths),
            "loss_tokens": int(mask.sum()),
            "tokenizer": tok_info,
            "data_fingerprint": sft.data_fingerprint(tokens, mask, offsets)}
    write_json_atomic(out / sft.METADATA_FILE, meta)

    print(f"sft prepare: kept {len(kept_recs)}/{total} examples (max length {max_len} tokens; "
          f"{too_long} too long); {sum(lengths):,} tokens, {int(mask.sum()):,} in the loss.")
    if skips.total:
        print(f"sft prepare: skipped {skips.total} malformed record(s): "
              + ", ".join(f"{k} {v}" for k, v in sorted(skips.counts.items())))
        for w in skips.where[:10]:
            print(f"  {w}")
    if skips.notes:
        print("sft prepare: converted: " + ", ".join(f"{k} ({v})" for k, v in sorted(skips.notes.items())))
    if source["kind"] == "qa_substitute":
        print("sft prepare: note: this is a labelled SUBSTITUTE for LIMA (SciQ + ARC), recorded "
              "as such in metadata.json.")
    print(f"sft prepare: wrote {out}. Next: python main.py sft train --checkpoint "
          "checkpoints/<run>/checkpoint_best.pt")
    return 0


# --------------------------------------------------------------------------- train
class _EpochCheckpoints:
    """Mixin for Trainer: numbered checkpoints are per epoch (checkpoint_epoch_N.pt, all kept)."""

    def save(self, name: str):
        m = re.fullmatch(r"checkpoint_step_(\d+)\.pt", name)
        if m and self.steps_per_epoch:
            name = f"checkpoint_epoch_{int(m.group(1)) // self.steps_per_epoch}.pt"
        return super().save(name)

    def _rotate_step_checkpoints(self) -> None:
        return None


def _resume_path(cfg, spec: str, name: str) -> Path:
    if spec != "auto":
        return Path(os.path.expanduser(spec)).resolve()
    from utils.checkpoint import list_runs
    runs = [r for r in list_runs(cfg.path("paths.checkpoints_dir"))
            if r.name.startswith(f"sft_{name}_") and r.latest is not None]
    if not runs:
        raise PipelineError(f"--resume auto: no sft_{name}_* run with a checkpoint_latest.pt under "
                            f"{cfg.path('paths.checkpoints_dir')}.")
    return runs[0].latest


def _resume_command(argv: Sequence[str], latest: Path) -> str:
    out = argv_without(argv[1:], ("--resume", "--checkpoint"))
    return "python main.py sft train " + shlex.join(out + ["--resume", str(latest)])


def check_compatible(ckpt: dict, ckpt_path: Path, meta: dict, data_dir: Path, model_args) -> None:
    """Refuse a checkpoint whose tokenizer or architecture does not fit the SFT data."""
    want = meta.get("tokenizer") or {}
    have = ckpt.get("tokenizer") or {}
    if have.get("fingerprint") and have.get("fingerprint") != want.get("fingerprint"):
        raise PipelineError(
            f"tokenizer mismatch: checkpoint {ckpt_path} was trained with tokenizer "
            f"'{have.get('name')}' (fingerprint {str(have.get('fingerprint'))[:12]}), but the SFT "
            f"data in {data_dir} was tokenized with '{want.get('name')}' (fingerprint "
            f"{str(want.get('fingerprint'))[:12]}). Re-run `python main.py sft prepare` with the "
            "checkpoint's tokenizer (tokenizer.name), or pick a checkpoint trained with this one.")
    vocab = want.get("vocab_size")
    if vocab and model_args.vocab_size < vocab:
        raise PipelineError(
            f"architecture mismatch: checkpoint {ckpt_path} has a vocabulary of "
            f"{model_args.vocab_size} tokens but the SFT data's tokenizer has {vocab}; the data "
            "and the model do not belong together. Re-run `python main.py sft prepare` with the "
            "checkpoint's tokenizer.")
    longest = (meta.get("lengths") or {}).get("max", 0)
    if longest > model_args.max_seq_len:
        raise PipelineError(
            f"architecture mismatch: the longest SFT example in {data_dir} has {longest} tokens "
            f"but checkpoint {ckpt_path} was built for max_seq_len {model_args.max_seq_len}. "
            f"Re-run `python main.py sft prepare --max-length {model_args.max_seq_len}`.")


def train(argv: Sequence[str], full_argv: Sequence[str]) -> int:
    parser = train_parser()
    args, cfg = parser.parse(argv)
    if not args.checkpoint and not args.resume:
        raise UsageError("sft train needs --checkpoint PATH (the pretrained checkpoint to "
                         "fine-tune), or --resume PATH|auto to continue an SFT run.")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", args.name or ""):
        raise UsageError(f"--name {args.name!r}: use letters, digits, '.', '_' or '-'.")
    if not 0 < args.eval_every <= 1:
        raise UsageError("--eval-every must be in (0, 1].")

    import model as model_lib
    from utils.device import resolve_device
    from utils import sft
    from utils.atomic import write_json_atomic
    from utils.checkpoint import load_checkpoint
    from utils.logging_utils import DualLogger
    from utils.run import tokenizer_for_checkpoint
    from utils.tok import require_bos_eos
    from utils.trainer import Trainer, pause_step_from_env, resolve_dtype, seed_everything

    data_dir = cfg.path("paths.post_training_dir")
    examples = sft.load_examples(data_dir)
    meta = examples.meta
    template = meta["template"]

    ckpt, resume = None, None
    if args.resume:
        rpath = _resume_path(cfg, args.resume, args.name)
        resume = load_checkpoint(rpath, purpose="resume")
        if resume.get("kind") != "sft":
            raise PipelineError(f"--resume {rpath}: not an SFT checkpoint (kind "
                                f"'{resume.get('kind')}'). To fine-tune it, pass it as --checkpoint.")
        run_dir = rpath.parent
        base_path = Path((resume.get("sft") or {}).get("base_checkpoint") or rpath)
        model_args = model_lib.ModelArgs.from_dict(dict(resume["model_args"]))
        check_compatible(resume, rpath, meta, data_dir, model_args)
    else:
        base_path = Path(args.checkpoint)
        ckpt = load_checkpoint(base_path, purpose="weights")
        model_args = model_lib.ModelArgs.from_dict(dict(ckpt["model_args"]))
        check_compatible(ckpt, base_path, meta, data_dir, model_args)
        stamp = datetime.datetime.now().strftime("%Y_%m_%d_%H_%M_%S")
        run_dir = cfg.path("paths.checkpoints_dir") / f"sft_{args.name}_{stamp}"
        if run_dir.exists():
            raise UsageError(f"{run_dir} already exists; wait a second or choose another --name.")
    run = run_dir.name
    # The base run's own tokenizer (utils.run), after the checkpoint checks (a refusal costs no
    # tokenizer load); check_compatible has matched its fingerprint to the SFT data's.
    tok, tok_info = tokenizer_for_checkpoint(resume or ckpt, cfg, rpath if resume else base_path)
    tok_info = {k: v for k, v in tok_info.items() if k != "verified"}
    if tok_info["fingerprint"] != (meta.get("tokenizer") or {}).get("fingerprint"):
        raise PipelineError(
            f"the SFT data in {data_dir} was tokenized with '{meta['tokenizer'].get('name')}' but "
            f"the checkpoint's tokenizer is '{tok_info.get('name')}' (different fingerprint). "
            "Re-run `python main.py sft prepare` with that tokenizer.")
    bos, eos = require_bos_eos(tok, tok_info.get("name") or cfg.tokenizer.name)

    hp = copy.copy(cfg.training)
    s = cfg.sft
    seed = hp.seed
    train_idx, val_idx = sft.split_indices(len(examples), s.val_split, seed)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    train_data = sft.SFTLoader(examples, train_idx, s.batch_size, seed, pad)
    val_data = sft.SFTValData(examples, val_idx, s.batch_size, pad) if len(val_idx) else None
    steps_per_epoch = len(train_data)
    total = s.epochs * steps_per_epoch
    if args.max_steps:
        total = min(total, args.max_steps)
    hp.lr, hp.min_lr = s.lr, s.lr * 0.1
    hp.batch_size, hp.epochs, hp.grad_accum = s.batch_size, s.epochs, 1
    hp.warmup_steps = min(hp.warmup_steps, max(0, total // 10))
    hp.eval_every, hp.eval_steps = args.eval_every, None
    hp.eval_batches = max(1, len(val_data) if val_data is not None else 1)
    hp.checkpoint_every, hp.keep_checkpoints = steps_per_epoch, 10 ** 9
    hp.max_steps = total

    device = resolve_device(cfg.training.device, "training.device")
    seed_everything(seed)
    net = model_lib.create_model(model_args)
    if ckpt is not None:
        net.load_state_dict(ckpt["model"], strict=True)
        del ckpt
    net.to(device)
    dtype = resolve_dtype(hp.dtype, device)
    print(f"sft train: {len(train_idx)} training / {len(val_idx)} validation examples "
          f"({meta['source'].get('label')}); {total} steps ({steps_per_epoch}/epoch) of "
          f"{s.batch_size} conversations; lr {s.lr:g}; {str(dtype).replace('torch.', '')} on "
          f"{device}; base {base_path}.", flush=True)

    q_ids = sft.encode_prompt(tok, template, [], SAMPLE_QUESTION, bos, eos)

    def sample_fn(m):
        out = m.generate([q_ids], max_new_tokens=args.sample_tokens, temperature=0.8, top_k=50,
                         eos_id=eos, seed=seed)
        return [(SAMPLE_QUESTION, tok.decode(out[0], skip_special_tokens=True))]

    logger = DualLogger(run, cfg.path("paths.logs_dir"), tensorboard=cfg.logging.tensorboard,
                        jsonl=cfg.logging.raw_metrics,
                        purge_step=(int(resume["step"]) + 1) if resume else None)
    run_dir.mkdir(parents=True, exist_ok=True)
    sft_config = {"run": run, "base_checkpoint": str(base_path), "resumed_from": str(args.resume) if resume else None,
                  "data": {"dir": str(data_dir), "fingerprint": meta["data_fingerprint"],
                           "source": meta["source"], "train_examples": int(len(train_idx)),
                           "val_examples": int(len(val_idx))},
                  "chat_template": template, "sample_question": SAMPLE_QUESTION,
                  "hyperparameters": {"epochs": s.epochs, "lr": s.lr, "min_lr": hp.min_lr,
                                      "batch_size": s.batch_size, "val_split": s.val_split,
                                      "warmup_steps": hp.warmup_steps, "total_steps": total,
                                      "steps_per_epoch": steps_per_epoch, "seed": seed,
                                      "eval_every": args.eval_every, "dtype": str(dtype),
                                      "device": str(device)},
                  "model": model_args.to_dict(), "tokenizer": tok_info, "config": cfg.to_dict()}
    write_json_atomic(run_dir / "sft_config.json", sft_config)
    logger.config(cfg.to_dict(), {"run": run, **sft_config["hyperparameters"]})

    class SFTTrainer(_EpochCheckpoints, Trainer):
        pass

    trainer = SFTTrainer(net, model_args, hp=hp, log_cfg=cfg.logging, train_data=train_data,
                         val_data=val_data, run_dir=run_dir, logger=logger, device=device,
                         total_steps=total, steps_per_epoch=steps_per_epoch,
                         config=cfg.to_dict(), tokenizer_info=tok_info, kind="sft",
                         chat_template=template,
                         sample_fn=sample_fn if args.sample_tokens > 0 else None,
                         resume_command=_resume_command(full_argv, run_dir / "checkpoint_latest.pt"),
                         pause_at_step=pause_step_from_env(),
                         extra_payload={"sft": {"base_checkpoint": str(base_path),
                                                "data_fingerprint": meta["data_fingerprint"]}})
    if resume is not None:
        trainer.load_state(resume)
        del resume
    try:
        result = trainer.fit()
    finally:
        logger.close()
    if result.reason == "interrupted":
        return EXIT_INTERRUPTED
    best = f"{result.best_val_loss:.4f}" if result.best_val_loss is not None else "n/a"
    print(f"sft train: {result.reason} at step {result.step}; best masked val loss {best}; "
          f"checkpoints in {run_dir}. Try it: python main.py infer --checkpoint "
          f"{run_dir / 'checkpoint_best.pt'}")
    return 0


if __name__ == "__main__":
    run_stage(main)
