"""Stage ``dpo``: preference pairs -> Direct Preference Optimization of an SFT (or imported) model.

    python main.py dpo prepare                          trl-lib/ultrafeedback_binarized (online)
    python main.py dpo prepare --dataset samples        offline: SciQ + ARC, right vs wrong answer
    python main.py dpo prepare --dataset my.jsonl       local JSONL, {"prompt", "chosen", "rejected"}
    python main.py dpo train --checkpoint checkpoints/sft_x_<time>/checkpoint_best.pt
        [--beta 0.1] [--lr 1e-6] [--epochs 1] [--batch-size 4] [--name pref]
                                                        -> checkpoints/dpo_<name>_<time>/
    python main.py dpo train --init-from-hf DIR         a Hugging Face Llama model instead
    python main.py dpo train --resume checkpoints/dpo_pref_<time>/checkpoint_latest.pt

``prepare`` writes data/preference/ (paths.preference_dir): both sides of every pair rendered
with the chat template (the tokenizer's own or ours, chosen as ``sft prepare`` chooses it) and
tokenized, a loss mask on the final answer only, the held-out split (dpo.val_split, drawn once
from training.seed), example_pairs.json and metadata.json (last, atomically); the format is
utils/data/preference.py's contract. Malformed records are skipped and reported as
``file:line: reason``; no usable pair is an error (exit 1).

``train`` checks that the checkpoint's tokenizer and chat template are the data's, computes the
starting model's log-probabilities of every sequence once (the DPO reference,
utils/training/dpo.py; stored in the run folder as reference_logps.npy and checked on resume),
then runs the one training loop (utils/training/trainer.py) with the DPO loss; it logs the
chosen and rejected rewards, the reward accuracy and margin (train and held-out), and writes
checkpoint_best.pt (lowest held-out DPO loss), checkpoint_latest.pt, checkpoint_epoch_N.pt and
dpo_config.json. Ctrl-C (or SIGTERM) saves checkpoint_latest.pt and prints the exact resume
command (exit 130). Details: docs/dpo.md.
"""
from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from utils.atomic import write_json_atomic
from utils.cli import PipelineError, StageParser, UsageError, cli_lora_flags, cli_path, run_stage
from utils.data import preference, sft
from utils.data.shards import dtype_for_vocab, save_npy_atomic
from utils import post_start
from utils.post_start import Source
from utils.run import require_same_tokenizer, resume_command_post

if TYPE_CHECKING:    # torch-bound, imported where `dpo train` needs it: `dpo prepare` does not load it
    from utils import stage

SAMPLES_SOURCE = "samples"
TEST_MAX_PAIRS = 80
TEST_MAX_STEPS = 8
CONFIG_FILE = "dpo_config.json"
USAGE = ("usage: python main.py dpo {prepare,train} [options]\n"
         "  prepare   preference pairs -> data/preference/ (tokenized, answer-only masks, held-out split)\n"
         "  train     DPO of a checkpoint on them (--checkpoint PATH or --init-from-hf DIR)\n"
         "Both take --config FILE (layered over config.json), --debug, and --test (prepare: the\n"
         f"first {TEST_MAX_PAIRS} pairs; train: at most {TEST_MAX_STEPS} steps).\n"
         "Run `python main.py dpo prepare --help` or `... dpo train --help` for the options.")


# --------------------------------------------------------------------------- parsers
def prepare_parser() -> StageParser:
    p = StageParser("main.py dpo prepare", "Render preference pairs (prompt, chosen, rejected) with the chat "
                    "template and tokenize them with a mask on the answers.",
                    test=f"quick mode: the first {TEST_MAX_PAIRS} pairs")
    p.config_flag("--dataset", key="dpo.dataset", metavar="NAME|FILE|samples",
                  help="hub dataset name, a local .jsonl file ({prompt, chosen, rejected}), or 'samples' "
                       "(offline: SciQ + ARC questions, right answer vs a wrong option)")
    p.config_flag("--max-length", key="dpo.max_length", type=int, metavar="N",
                  help="drop pairs whose longer side has more tokens than this")
    p.config_flag("--template", key="sft.template", choices=["auto", "user-assistant", "tokenizer"],
                  help="chat template, chosen as for sft prepare (the tokenizer's own when it has one)")
    p.config_flag("--val-split", key="dpo.val_split", type=float, metavar="F", help="held-out fraction")
    p.config_flag("--seed", key="training.seed", type=int, metavar="N",
                  help="seed of the held-out draw (and of the samples' wrong options)")
    p.config_flag("--output-dir", key="paths.preference_dir", type=cli_path, metavar="DIR",
                  help="where the prepared pairs go")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help=f"use only the first N pairs (--test: {TEST_MAX_PAIRS})")
    post_start.for_flag(p, "dpo train")
    return p


def train_parser() -> StageParser:
    p = StageParser("main.py dpo train", "Direct Preference Optimization of a checkpoint on the prepared "
                    "pairs (reference log-probabilities computed once; resumable).",
                    test=f"quick mode: at most {TEST_MAX_STEPS} steps")
    post_start.start_flags(p, "dpo", "a DPO run",
                           "the model to start from (an SFT run's checkpoint, usually)",
                           "start from a local Hugging Face Llama model (prepare the pairs with its "
                           "tokenizer)", "pref")
    p.config_flag("--beta", key="dpo.beta", type=float, metavar="B", help="DPO's beta")
    p.config_flag("--epochs", key="dpo.epochs", type=int, metavar="N", help="epochs")
    p.config_flag("--lr", key="dpo.lr", type=float, metavar="LR", help="peak learning rate")
    p.config_flag("--batch-size", key="dpo.batch_size", type=int, metavar="N", help="pairs per batch")
    p.add_argument("--max-steps", type=int, default=None, metavar="N",
                   help=f"stop after N optimizer steps (default: epochs x steps per epoch; --test: {TEST_MAX_STEPS})")
    p.add_argument("--eval-every", type=float, default=0.25, metavar="F",
                   help="validate on the held-out pairs every this fraction of an epoch")
    p.config_flag("--data-dir", key="paths.preference_dir", type=cli_path, metavar="DIR",
                  help="the prepared pairs")
    p.config_flag("--device", key="training.device", metavar="DEV", help="auto, cpu, cuda or cuda:N")
    p.config_flag("--dtype", key="dpo.dtype", choices=["auto", "bf16", "fp16", "fp32"],
                  help="autocast precision")
    p.config_flag("--keep-dropout", key="dpo.keep_dropout", action="store_const", const=True,
                  help="keep dropout in the policy (default: off, as TRL, so that at step 0 the policy "
                       "computes what the reference did)")
    p.config_flag("--warmup-ratio", key="dpo.warmup_ratio", type=float, metavar="F",
                  help="linear warm-up as a fraction of the run's steps")
    p.config_flag("--seed", key="training.seed", type=int, metavar="N", help="random seed (order)")
    p.config_flag("--log-every", key="logging.log_every", type=int, metavar="N", help="steps between log records")
    cli_lora_flags(p)
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
    raise UsageError(f"unknown dpo command '{cmd}'. " + USAGE)


# --------------------------------------------------------------------------- prepare
def prepare(argv: Sequence[str]) -> int:
    args, cfg = prepare_parser().parse(argv)
    model = post_start.model_tokenizer(cfg, args.for_model) if args.for_model else None
    prepare_data(cfg, args.limit, model)
    return 0


def prepare_data(cfg, limit: Optional[int], model: Optional[post_start.ModelTokenizer]) -> Path:
    """Prepare the configured pairs into paths.preference_dir, tokenized with ``model``'s
    tokenizer and chat template (``--for``), else the configured tokenizer's; the folder."""
    tok, tok_info, name = post_start.data_tokenizer(cfg, model, "dpo prepare")
    template, bos, eos = (post_start.template_for(model, tok)
                          or preference.choose_template(tok, name, cfg.sft.template, cfg.sft))
    pairs, source, skips = read_pairs(cfg, limit)
    enc = preference.encode_pairs(tok, template, pairs, bos, eos, cfg.dpo.max_length, skips)
    require_some(enc, source, skips, len(pairs))
    split = preference.split_of(len(enc.kept), cfg.dpo.val_split, cfg.training.seed)
    out = cfg.path("paths.preference_dir")
    meta = write_pairs(cfg, out, tok, tok_info, template, source, skips, enc, split)
    print(f"dpo prepare: kept {meta['counts']['kept']}/{meta['counts']['read']} pairs "
          f"({int(split.sum())} held out); {enc.too_long} longer than {cfg.dpo.max_length} tokens dropped"
          + "".join(f"; {k} ({v})" for k, v in sorted(skips.counts.items())) + f". Wrote {out}.",
          flush=True)
    for where in skips.where:
        print(f"  skipped {where}", flush=True)
    return out


def read_pairs(cfg, limit: Optional[int]) -> tuple[list, dict, sft.Skips]:
    """The configured source's pairs (malformed ones skipped and counted), cut to --limit."""
    skips, spec = sft.Skips(), cfg.dpo.dataset
    max_chars = cfg.dpo.max_length * sft.MAX_TURN_CHARS_PER_TOKEN
    if spec == SAMPLES_SOURCE:
        pairs = preference.sample_pairs(cfg.path("paths.samples_dir"), cfg.training.seed)
        source = {"kind": "preference_substitute", "name": "sciq+arc_easy+arc_challenge",
                  "label": preference.SAMPLE_LABEL, "inputs": [str(cfg.path("paths.samples_dir"))]}
    else:
        p = sft.dataset_path(spec, cfg.resolve)
        if p.suffix.lower() in (".jsonl", ".json") or p.is_file():
            pairs = preference.read_jsonl_pairs(p, max_chars, skips)
            source = {"kind": "jsonl", "name": p.name, "label": "local preference JSONL", "inputs": [str(p)]}
        else:
            local = p.is_dir()          # a save_to_disk folder or a folder of data files
            pairs = preference.hub_pairs(str(p) if local else spec, max_chars, skips)
            source = {"kind": "local_dataset" if local else "hub", "name": p.name if local else spec,
                      "label": "local dataset folder" if local else "Hugging Face hub",
                      "inputs": [str(p) if local else spec]}
    limit = limit if limit is not None else (TEST_MAX_PAIRS if cfg.test else None)
    source["limit"] = limit
    if limit is not None:
        pairs = pairs[:limit]
    print(f"dpo prepare: {len(pairs)} pairs from {source['label']} ({source['name']})"
          + (f"; {skips.total} malformed skipped" if skips.total else "") + ".", flush=True)
    return pairs, source, skips


def require_some(enc, source: dict, skips: sft.Skips, n: int) -> None:
    """No pair kept is an error naming why (nothing is written)."""
    if enc.kept:
        return
    first = ("; first problems: " + "; ".join(skips.where[:5])) if skips.where else ""
    raise PipelineError(f"no usable preference pair in {', '.join(source['inputs'])}: {n} read, "
                        f"{skips.total} malformed, {enc.too_long} longer than dpo.max_length{first}. "
                        "Fix the records, or raise --max-length.")


def write_pairs(cfg, out: Path, tok, tok_info: dict, template: dict, source: dict, skips, enc, split) -> dict:
    """The arrays, example_pairs.json, then metadata.json (last, atomically)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / sft.METADATA_FILE).unlink(missing_ok=True)     # the set is incomplete until it is rewritten
    lengths = [len(i) for i in enc.ids]
    tokens = np.concatenate([np.asarray(i, dtype=np.int64) for i in enc.ids]).astype(dtype_for_vocab(len(tok)))
    mask = np.concatenate([np.asarray(m, dtype=np.uint8) for m in enc.masks])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    for name, arr in ((sft.TOKENS_FILE, tokens), (sft.MASK_FILE, mask), (sft.OFFSETS_FILE, offsets),
                      (preference.SPLIT_FILE, split)):
        save_npy_atomic(out / name, arr)
    examples = [{"pair": i, "held_out": bool(split[i]), "source": p["source"], "prompt_turns": p["turns"],
                 "chosen": p["chosen"], "rejected": p["rejected"],
                 "chosen_rendered": sft.decode_for_people(tok, enc.ids[2 * i]),
                 "rejected_rendered": sft.decode_for_people(tok, enc.ids[2 * i + 1])}
                for i, p in enumerate(enc.kept[:3])]
    write_json_atomic(out / preference.EXAMPLES_FILE, examples)
    heldout_rows = {}
    for i, p in enumerate(enc.kept):
        if split[i] and "row" in p:
            heldout_rows.setdefault(p["source"], []).append(p["row"])
    meta = {"format": preference.FORMAT_NAME, "format_version": preference.FORMAT_VERSION,
            "complete": True, "source": source, "template": template, "tokenizer": tok_info,
            "counts": {"read": len(enc.kept) + enc.too_long + skips.counts.get("template_does_not_frame", 0)
                       + sum(v for k, v in skips.counts.items() if k != "template_does_not_frame"),
                       "kept": len(enc.kept), "too_long": enc.too_long, "held_out": int(split.sum()),
                       **skips.to_dict()},
            "val_split": cfg.dpo.val_split, "seed": cfg.training.seed, "max_length": cfg.dpo.max_length,
            "lengths": sft.length_stats(lengths), "heldout_rows": heldout_rows,
            "data_fingerprint": preference.fingerprint(tokens, mask, offsets, split)}
    write_json_atomic(out / sft.METADATA_FILE, meta)
    return meta


# --------------------------------------------------------------------------- train
def train(argv: Sequence[str], full_argv: Sequence[str]) -> int:
    args, cfg = parse_train(argv)
    return set_up(cfg, args, full_argv[1:]).finish()


def parse_train(argv: Sequence[str]):
    args, cfg = train_parser().parse(argv)
    post_start.check_start_flags(args, "dpo train", "the model to start from, usually an SFT run's "
                                 "checkpoint", "a DPO run")
    if not 0 < args.eval_every <= 1:
        raise UsageError("--eval-every must be in (0, 1].")
    post_start.check_lora_flags(args, cfg)
    return args, cfg


def set_up(cfg, args, argv: Sequence[str]) -> stage.Run:
    """The steps of a start, each returning what it makes (utils/stage.py runs the rest)."""
    from utils import stage     # torch-bound (the model, the trainer): `dpo prepare` does not load it
    pairs = preference.load_pairs(cfg.path("paths.preference_dir"))
    if post_start.data_for_model(cfg, args, "dpo", pairs.meta, PREPARED):
        pairs = preference.load_pairs(cfg.path("paths.preference_dir"))
    src = open_source(cfg, args, pairs.meta)
    tok, tok_info, pad = open_run_tokenizer(cfg, src, pairs.meta)
    rules = post_start.run_rules(stage.kept_rules(tok, src.imported, src.ckpt), src, tok,
                                 pairs.meta["template"])
    data = split_data(cfg, args, pairs, pad)
    optimizer, settings = post_start.epoch_hyperparameters(cfg, "dpo", args.eval_every, data)
    start = post_start.start_of(cfg, src, "dpo train", args.lora, rules)
    latest, made = src.run_dir / "checkpoint_latest.pt", {}     # made: what the spec computed (the reference)
    parts = stage.Parts(
        lr_key="dpo.lr", tokenizer=tok,
        spec=functools.partial(dpo_spec, cfg, src, pairs, data, optimizer, settings, tok_info, rules, pad, made),
        run_files=functools.partial(run_files, cfg, args, src, pairs, data, made),
        resume_command=resume_command_post("dpo train", argv, latest),
        closing=functools.partial(closing_line, src.run_dir, start.lora is not None))
    return post_start.run_start(cfg, start, parts)


PREPARED = post_start.Prepared("paths.preference_dir", "dpo", prepare_data)


def open_source(cfg, args, meta: dict) -> Source:
    """Load and check the starting checkpoint (tokenizer, template, sizes) and name the run
    folder: ``dpo_<name>_<time>``, or the checkpoint's folder on resume, whose run must have
    trained on the pairs the data folder holds now (utils/post_start.py)."""
    data_dir = cfg.path("paths.preference_dir")

    def same_data(ckpt: dict, rpath: Path, base: Path) -> None:
        if (ckpt.get("dpo") or {}).get("data_fingerprint") != meta["data_fingerprint"]:
            raise PipelineError(f"--resume {rpath}: the run trained on other preference data than "
                                f"{data_dir} holds now; resume with the same data (re-run the same "
                                "`dpo prepare`) or start a new run.")

    return post_start.open_source(cfg, args, "dpo",
                                  check=lambda ckpt, path, model_args: check_fits(
                                      ckpt, path, meta, data_dir, model_args),
                                  on_resume=same_data)


def check_fits(ckpt: dict, path: Path, meta: dict, data_dir: Path, model_args) -> None:
    """The data was rendered with the checkpoint's chat template and fits its context."""
    had, have = ckpt.get("chat_template"), meta["template"]
    if had is not None and had != have:
        differ = sorted(k for k in set(had) | set(have) if had.get(k) != have.get(k))
        raise PipelineError(f"{path} was fine-tuned with another chat template than the pairs in {data_dir} "
                            f"are rendered with ('{had.get('name')}' vs '{have.get('name')}'; they differ in "
                            f"{', '.join(differ)}). Re-run `python main.py dpo prepare` with the tokenizer and "
                            "the sft section (template, prefixes) the checkpoint's SFT data was prepared with.")
    longest, limit = (meta.get("lengths") or {}).get("max", 0), model_args.max_seq_len
    if sft.positions_needed(longest) > limit:
        raise PipelineError(f"the longest sequence in {data_dir} has {longest} tokens but {path} takes "
                            f"{limit} positions (model.max_seq_len). Re-run `python main.py dpo prepare "
                            f"--max-length {limit}`.")


def open_run_tokenizer(cfg, src: Source, meta: dict):
    """The model's tokenizer, matched against the data's fingerprint; the padding id."""
    tok, tok_info = post_start.open_tokenizer(cfg, src)
    require_same_tokenizer(tok_info, meta.get("tokenizer"), "the checkpoint's tokenizer",
                           f"the preference data in {cfg.path('paths.preference_dir')}",
                           "Re-run `python main.py dpo prepare` with that tokenizer (tokenizer.name).")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pad is None:
        raise PipelineError(f"tokenizer '{tok_info.get('name')}' has neither a padding nor an EOS token: "
                            "batches cannot be padded.")
    return tok, tok_info, pad


def split_data(cfg, args, pairs: preference.Pairs, pad: int) -> stage.Data:
    """Training pairs (shuffled per epoch), held-out pairs (fixed order), the run's length."""
    from utils.stage import Data    # torch-bound: `dpo prepare` does not load it
    d, seed = cfg.dpo, cfg.training.seed
    train_idx, val_idx = pairs.train_indices, pairs.heldout_indices
    if not len(train_idx):
        raise PipelineError(f"every pair in {cfg.path('paths.preference_dir')} is held out; prepare "
                            "again with a smaller --val-split.")
    train_data = preference.PairLoader(pairs.examples, train_idx, d.batch_size, seed, pad)
    val_data = preference.PairValData(pairs.examples, val_idx, d.batch_size, pad) if len(val_idx) else None
    total = d.epochs * len(train_data)
    cap = args.max_steps or (TEST_MAX_STEPS if cfg.test else None)
    if cap:
        total = min(total, cap)
    return Data(train_data, val_data, len(train_data), total)


def reference(cfg, src: Source, pairs: preference.Pairs, pad: int, model) -> np.ndarray:
    """The reference log-probabilities: computed by the starting model (a new run), or read
    from the run folder and checked against the checkpoint's record (a resume)."""
    from tqdm import tqdm       # with torch: `dpo prepare` does not need it
    from utils.training import dpo
    from utils.training.trainer import resolve_dtype
    path = src.run_dir / dpo.REFERENCE_FILE
    if src.resumed:
        try:
            ref = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise PipelineError(f"{path} cannot be read ({e}): the run's reference log-probabilities are "
                                "lost; start a new run from its base.") from None
        recorded = (src.ckpt.get("dpo") or {}).get("reference_sha256")   # what the run's checkpoints recorded
        if dpo.array_sha256(ref) != recorded or ref.shape != (2 * len(pairs),):
            raise PipelineError(f"{path} is not the reference this run's checkpoints recorded (changed or "
                                "damaged); start a new run from its base.")
        return ref
    # the held-out pairs in exactly the batches validation makes of them: their step-0 rewards are 0.0
    batches = itertools.chain(*(preference.PairValData(pairs.examples, idx, cfg.dpo.batch_size, pad)
                                for idx in (pairs.train_indices, pairs.heldout_indices)))
    amp = resolve_dtype(cfg.dpo.dtype, model.device)     # the policy's precision: one computation
    with tqdm(total=len(pairs), desc="dpo reference log-probs", unit="pair", file=sys.stdout) as bar:
        return dpo.reference_logps(model, batches, len(pairs), model.device, bar.update, amp=amp)


def dpo_spec(cfg, src: Source, pairs, data, optimizer, settings, tok_info, rules, pad, made: dict, model):
    """DPO as a TrainSpec: the DPO loss against the stored reference, validated on the held-out
    pairs, one numbered checkpoint per epoch."""
    import torch
    from utils import stage
    from utils.training import dpo
    from utils.training.trainer import TrainSpec
    stage.say_dropout("dpo train", model, cfg.dpo.keep_dropout)
    ref = made["reference"] = reference(cfg, src, pairs, pad, model)   # a new adapter is zero: the base's
    stage.say_adapter("dpo train", model)
    spe = data.steps_per_epoch
    print(f"dpo train: {len(data.train.indices)} training / {len(pairs.heldout_indices)} held-out pairs "
          f"({pairs.meta['source'].get('label')}); {data.total_steps} steps ({spe}/epoch) of "
          f"{cfg.dpo.batch_size} pairs; beta {cfg.dpo.beta:g}; lr {optimizer.lr:g}; base {src.base}.", flush=True)
    record = stage.run_record("dpo", cfg, tok_info, rules, {"dpo": {
        "base_checkpoint": str(src.base), "data_fingerprint": pairs.meta["data_fingerprint"],
        "reference_sha256": dpo.array_sha256(ref), "beta": cfg.dpo.beta}})
    return TrainSpec(model, src.model_args, data.train, data.val, optimizer=optimizer, settings=settings,
                     record=record, loss=dpo.make_loss(torch.from_numpy(ref), cfg.dpo.beta),
                     count=dpo.pair_count, next_token_loss=False, checkpoint_name=lambda step: f"checkpoint_epoch_{step // spe}.pt")


def run_files(cfg, args, src: Source, pairs, data, made: dict, spec) -> dict:
    """reference_logps.npy (a new run) and dpo_config.json; the log's hyperparameters."""
    from utils import stage
    from utils.training import dpo
    from utils.training.trainer import resolve_dtype
    st, opt = spec.settings, spec.optimizer
    if not src.resumed:
        save_npy_atomic(src.run_dir / dpo.REFERENCE_FILE, made["reference"])
    hyper = {"beta": cfg.dpo.beta, "epochs": cfg.dpo.epochs, "lr": opt.lr, "min_lr": st.min_lr,
             "batch_size": cfg.dpo.batch_size, "warmup_steps": st.warmup_steps, "total_steps": st.total_steps,
             "steps_per_epoch": st.steps_per_epoch, "seed": cfg.training.seed, "eval_every": args.eval_every,
             "dtype": str(resolve_dtype(st.dtype, spec.model.device)), "device": str(spec.model.device),
             "weight_decay": opt.weight_decay, "betas": [opt.beta1, opt.beta2], "grad_clip": st.grad_clip,
             "lora": stage.adapter_record(spec.model)}
    write_json_atomic(src.run_dir / CONFIG_FILE, {
        "run": src.run_dir.name, "base_checkpoint": str(src.base),
        "base": src.base_record(),
        "resumed_from": str(args.resume) if src.resumed else None,
        "reference": {"file": dpo.REFERENCE_FILE, "sha256": spec.record.extra["dpo"]["reference_sha256"],
                      "how": "the starting model's log-probabilities, computed once at the run's start"},
        "data": {"dir": str(cfg.path("paths.preference_dir")), "fingerprint": pairs.meta["data_fingerprint"],
                 "source": pairs.meta["source"], "train_pairs": int(len(data.train.indices)),
                 "heldout_pairs": int(len(pairs.heldout_indices))},
        "chat_template": pairs.meta["template"], "hyperparameters": hyper,
        "model": src.model_args.to_dict(), "tokenizer": spec.record.tokenizer, "config": cfg.to_dict()})
    return {"run": src.run_dir.name, **hyper}


def closing_line(run_dir: Path, adapter: bool, result, logger) -> str:
    """Where the model is and how to try it (checkpoint_best.pt exists only when the held-out
    loss fell below the start's, which DPO's need not do while its margin grows)."""
    best = f"{result.best_val_loss:.4f}" if result.best_val_loss is not None else "n/a"
    pick = post_start.best_or_latest(run_dir)
    line = (f"dpo train: {result.reason} at step {result.step}; best held-out DPO loss {best}; "
            f"checkpoints in {run_dir}. Try it: python main.py infer --checkpoint {pick}")
    return post_start.closing("dpo train", run_dir, adapter, line, pick)


if __name__ == "__main__":
    run_stage(main)
