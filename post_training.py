"""Stage ``sft``: instruction data (LIMA's schema) -> supervised fine-tuning of a checkpoint.

    python main.py sft prepare                          LIMA (GAIR/lima) via `datasets` (online)
    python main.py sft prepare --dataset samples        offline: SciQ + ARC QA in LIMA's schema
    python main.py sft prepare --dataset my.jsonl       local JSONL, {"conversations": [...]} or
                                                        {"messages": [...], "tools": [...]} (tool use)
    python main.py sft prepare --dataset tools          offline: generated tool-use conversations
    python main.py sft train --checkpoint checkpoints/run_x/checkpoint_best.pt [--epochs 2]
        [--lr 5e-5] [--batch-size 8] [--name lima]      -> checkpoints/sft_<name>_<time>/
    python main.py sft train --resume checkpoints/sft_lima_<time>/checkpoint_latest.pt

``prepare`` writes data/post-training/ (paths.post_training_dir): a copy of the source JSONL,
tokenized_examples.npy + loss_mask.npy + offsets.npy, metadata.json (last, atomically) and
example_conversations.json; the format, the template and the mask are utils/data/sft.py's
contract. Malformed records are skipped and reported as ``file:line: reason``; no usable
example is an error (exit 1).

``train`` checks that the checkpoint's tokenizer fingerprint and architecture fit the data,
then runs the one training loop (utils/training/trainer.py) with the loss mask; it validates every
20% of an epoch with a sample answer to a fixed question and writes checkpoint_best.pt,
checkpoint_latest.pt, checkpoint_epoch_N.pt and sft_config.json. Ctrl-C (or SIGTERM) saves
checkpoint_latest.pt and prints the exact resume command (exit 130); the resumed run
repeats the uninterrupted one. Details: docs/sft_inference.md.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import shutil
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from utils.atomic import atomic_open, write_json_atomic
from utils.cli import PipelineError, StageParser, UsageError, cli_lora_flags, cli_path, run_stage
from utils.config import SFT_MIN_LENGTH
from utils.data import chat, sft, tool_samples
from utils.data.chat import Rules
from utils.data.shards import dtype_for_vocab, save_npy_atomic
from utils.data.tok import require_bos_eos
from utils.generation.detok import TextDecoder
from utils import post_start
from utils.post_start import Source
from utils.run import require_same_tokenizer, resume_command_post

if TYPE_CHECKING:    # torch-bound, imported where `sft train` needs it: `sft prepare` does not load it
    from utils import stage

SAMPLES_SOURCE = "samples"
TOOLS_SOURCE = "tools"                 # the generated tool-use sample set (utils/data/tool_samples.py)
SAMPLE_QUESTION = "Why is the sky blue?"
TEST_MAX_RECORDS = 300
USAGE = ("usage: python main.py sft {prepare,train} [options]\n"
         "  prepare   instruction data -> data/post-training/ (tokenized, with loss mask)\n"
         "  train     fine-tune a checkpoint on it (--checkpoint PATH)\n"
         "Both take --config FILE (layered over config.json), --debug, and --test (prepare: the\n"
         f"first {TEST_MAX_RECORDS} records; train: nothing, use --max-steps).\n"
         "Run `python main.py sft prepare --help` or `... sft train --help` for the options.")


# --------------------------------------------------------------------------- parsers
def prepare_parser() -> StageParser:
    p = StageParser("main.py sft prepare", "Convert instruction data into the chat format "
                    "and tokenize it with a loss mask on the assistant tokens.",
                    test=f"quick mode: the first {TEST_MAX_RECORDS} records")
    p.config_flag("--dataset", key="sft.dataset", metavar="NAME|FILE|samples|tools",
                  help="hub dataset name (GAIR/lima), a local .jsonl file (LIMA's conversations, or "
                       "messages + tools for tool use), 'samples' (offline: SciQ + ARC question/answer "
                       "pairs converted into LIMA's schema) or 'tools' (offline: generated tool-use "
                       "conversations)")
    p.config_flag("--max-length", key="sft.max_length", type=int, metavar="N",
                  help="drop examples longer than this many tokens")
    p.config_flag("--template", key="sft.template", choices=["auto", "user-assistant", "tokenizer"],
                  help="chat template: the tokenizer's own when it has one (auto), ours (user-assistant), "
                       "or the tokenizer's, refused without one (tokenizer)")
    p.add_argument("--batch-size", type=int, default=100, metavar="N",
                   help="conversations tokenized per tokenizer call (the fast tokenizer encodes "
                        "a batch on all cores; the result does not depend on it)")
    p.config_flag("--output-dir", key="paths.post_training_dir", type=cli_path, metavar="DIR",
                  help="where the prepared data goes")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help=f"use only the first N records (--test: {TEST_MAX_RECORDS})")
    post_start.for_flag(p, "sft train")
    return p


def train_parser() -> StageParser:
    p = StageParser("main.py sft train", "Supervised fine-tuning of a pretrained checkpoint "
                    "on the prepared instruction data (masked loss, resumable).",
                    test="accepted, and changes nothing here: make a quick run with `sft prepare "
                         "--test` and --max-steps")
    post_start.start_flags(p, "sft", "an SFT run",
                           "pretrained checkpoint to fine-tune (required unless --resume)",
                           "fine-tune a local Hugging Face Llama model (folder or .gguf file) instead of "
                           "--checkpoint (prepare the data with its tokenizer)", "lima")
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
    p.config_flag("--dtype", key="sft.dtype", choices=["auto", "bf16", "fp16", "fp32"],
                  help="autocast precision")
    p.config_flag("--min-lr-ratio", key="sft.min_lr_ratio", type=float, metavar="F",
                  help="final learning rate as a fraction of --lr")
    p.config_flag("--warmup-ratio", key="sft.warmup_ratio", type=float, metavar="F",
                  help="linear warm-up as a fraction of the run's steps")
    p.config_flag("--weight-decay", key="sft.weight_decay", type=float, metavar="WD",
                  help="AdamW weight decay")
    p.config_flag("--grad-clip", key="sft.grad_clip", type=float, metavar="NORM",
                  help="gradient-norm clip (0 = off)")
    p.config_flag("--seed", key="training.seed", type=int, metavar="N", help="random seed (split, order)")
    p.config_flag("--log-every", key="logging.log_every", type=int, metavar="N", help="steps between log records")
    p.add_argument("--sample-tokens", type=int, default=32, metavar="N",
                   help="tokens of the sample answer at each validation (0 = none)")
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
    raise UsageError(f"unknown sft command '{cmd}'. " + USAGE)


# --------------------------------------------------------------------------- prepare
def _load_source(cfg, spec: str, max_turn_chars: int, skips) -> tuple[list, dict, Optional[Path]]:
    """(records, source description, local file to copy or None)."""
    if spec == TOOLS_SOURCE:
        recs = []
        for i, obj in enumerate(tool_samples.records()):
            rec = sft.normalize_record(obj, f"generated[{i}]", skips, max_turn_chars)
            if rec is not None:
                recs.append(rec)
        return recs, {"kind": "generated_tools", "name": tool_samples.SOURCE,
                      "label": "GENERATED tool-use conversations: questions answered by calling the real "
                               "Python functions of utils/data/tool_samples.py (their results are what "
                               "the functions returned); no public data set",
                      "inputs": ["utils/data/tool_samples.py"]}, None
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
    p = sft.dataset_path(spec, cfg.resolve)
    if p.suffix.lower() in (".jsonl", ".json") or p.is_file():
        recs = sft.read_jsonl_records(p, max_turn_chars, skips)
        return recs, {"kind": "jsonl", "name": p.name, "label": "local LIMA-schema JSONL",
                      "inputs": [str(p)]}, p
    if p.is_dir():                      # a save_to_disk folder or a folder of data files
        recs = sft.lima_records(str(p))
        return recs, {"kind": "local_dataset", "name": p.name, "label": "local dataset folder (LIMA's schema)",
                      "inputs": [str(p)]}, None
    recs = sft.lima_records(spec)
    return recs, {"kind": "hub", "name": spec, "label": "LIMA (Hugging Face hub)", "inputs": [spec]}, None


def prepare(argv: Sequence[str]) -> int:
    args, cfg = prepare_parser().parse(argv)
    if args.batch_size < 1:
        raise UsageError("--batch-size must be at least 1.")
    model = post_start.model_tokenizer(cfg, args.for_model) if args.for_model else None
    prepare_data(cfg, args.limit, args.batch_size, model)
    return 0


def prepare_data(cfg, limit: Optional[int], batch_size: int, model: Optional[post_start.ModelTokenizer]) -> Path:
    """Prepare the configured source into paths.post_training_dir, tokenized with ``model``'s
    tokenizer and chat template (``--for``), else the configured tokenizer's; the folder."""
    tok, tok_info, name = post_start.data_tokenizer(cfg, model, "sft prepare")
    src = read_records(cfg, limit)
    with_tools = any(r.get("tools") for r in src.records)
    template, bos, eos = post_start.template_for(model, tok) or choose_template(cfg, tok, name, with_tools)
    enc = encode_records(tok, template, src, cfg.sft.max_length, batch_size, bos, eos)
    out = cfg.path("paths.post_training_dir")
    arrays = write_arrays(out, enc, len(tok))
    copy_name = write_source_copy(out, src)
    write_examples_and_metadata(cfg, out, tok, tok_info, template, src, enc, arrays, copy_name)
    report_prepare(out, src, enc, arrays)
    return out


def choose_template(cfg, tok, name: str, with_tools: bool = False) -> tuple[dict, Optional[int], Optional[int]]:
    """The data's chat template (``sft.template``: the tokenizer's own when it has one, and, for
    data with tools, when it renders tools; else ours; utils/data/chat.py) and the BOS and EOS
    ids our template frames exchanges with; ``name``: the tokenizer's, for messages."""
    own = chat.template_source(tok)
    if cfg.sft.template == "tokenizer" and own is None:
        raise PipelineError(f"sft.template is 'tokenizer' but tokenizer '{name}' has no chat template of its "
                            "own; set sft.template to 'auto' or 'user-assistant' (our User/Assistant "
                            "template), or point tokenizer.name at a model folder that has one.")
    if with_tools and own is not None and cfg.sft.template != "user-assistant" \
            and not chat.knows_tools(tok, chat.jinja_record(tok, own, name)):
        if cfg.sft.template == "tokenizer":
            raise PipelineError(f"the data has tools but the chat template of tokenizer '{name}' does not render "
                                "them (transformers' apply_chat_template(tools=...) leaves them out); set "
                                "sft.template to 'auto' or 'user-assistant' to use our format "
                                "(docs/sft_inference.md, Tool use).")
        print(f"sft prepare: chat template: ours (user-assistant, with its tool format): the tokenizer's "
              f"own ({name}) does not render tools.", flush=True)
        own = None
    if own is not None and cfg.sft.template != "user-assistant":
        print(f"sft prepare: chat template: the tokenizer's own ({name}); sft.template "
              "'user-assistant' would use ours.", flush=True)
        return chat.jinja_record(tok, own, name), tok.bos_token_id, tok.eos_token_id
    bos, eos = require_bos_eos(tok, name)
    return sft.default_template(cfg.sft), bos, eos


@dataclass
class Records:
    records: list
    source: dict
    local: Optional[Path]         # a local file to copy next to the data, else None
    skips: object                 # sft.Skips: malformed records
    read: int                     # records read (kept + malformed)
    limit: Optional[int]


def read_records(cfg, limit: Optional[int]) -> Records:
    """The records of the configured source (malformed ones counted), cut to ``limit`` (--limit)."""
    skips = sft.Skips()
    records, source, local = _load_source(cfg, cfg.sft.dataset,
                                          cfg.sft.max_length * sft.MAX_TURN_CHARS_PER_TOKEN, skips)
    limit = limit if limit is not None else (TEST_MAX_RECORDS if cfg.test else None)
    read = len(records) + skips.total
    if limit is not None:
        records = records[:limit]
    print(f"sft prepare: {len(records)} records from {source['label']} ({source['name']})"
          + (f"; {skips.total} malformed skipped" if skips.total else "") + ".", flush=True)
    return Records(records, source, local, skips, read, limit)


@dataclass
class Encoded:
    ids: list
    masks: list
    lengths: list
    kept: list                    # the records kept (not longer than max_length)
    too_long: int
    max_length: int
    shortest_too_long: Optional[int] = None   # tokens of the shortest example over max_length


def encode_records(tok, template, src: Records, max_len: int, batch_size: int, bos, eos) -> Encoded:
    """Token ids and loss masks of every record (``batch_size`` conversations per tokenizer
    call); longer than ``max_len`` dropped and counted, as are conversations whose answer
    merges into its prompt's last token (skip reason ``answer_joins_prompt``); none left is an
    error (nothing written)."""
    enc = Encoded([], [], [], [], 0, max_len)
    records = src.records
    jinja = template.get("name") == chat.JINJA
    reason, why = (("template_does_not_frame", "the rendered conversation does not begin with each "
                    "assistant turn's generation prompt (the template rewrites earlier turns or refuses "
                    "them, or an answer's first characters join the prompt's last token)") if jinja else
                   ("answer_joins_prompt", "an answer's first characters join the assistant prefix's "
                    "last token; end sft.assistant_prefix with a space"))
    for s in range(0, len(records), batch_size):
        batch = records[s:s + batch_size]
        encoded = chat.encode_records(tok, template, batch, bos, eos)
        for j, (rec, pair) in enumerate(zip(batch, encoded)):
            if pair is None:
                src.skips.skip(reason, f"record {s + j + 1}", why)
                continue
            ids, mask = pair
            if len(ids) > max_len:
                enc.too_long += 1
                enc.shortest_too_long = min(enc.shortest_too_long or len(ids), len(ids))
                continue
            enc.ids.append(ids)
            enc.masks.append(mask)
            enc.lengths.append(len(ids))
            enc.kept.append(rec)
    if not enc.kept:
        skips = src.skips
        why = "; ".join(f"{k}: {v}" for k, v in sorted(skips.counts.items()))
        first = ("; first problems: " + "; ".join(skips.where[:5])) if skips.where else ""
        raise PipelineError(
            f"no usable SFT example in {', '.join(src.source['inputs'])}: {src.read} record(s) read, "
            f"{skips.total} malformed ({why or 'none'}), {enc.too_long} longer than --max-length "
            f"{max_len}{first}. Fix the file (one {{\"conversations\": [user, assistant, ...]}} "
            "object per line)" + (f" or raise --max-length (the shortest example that is too long "
                                  f"has {enc.shortest_too_long} tokens)" if enc.too_long else "")
            + "; nothing was written.")
    return enc


def write_arrays(out: Path, enc: Encoded, vocab_size: int) -> dict:
    """tokens, loss mask and offsets as .npy files (atomically; metadata.json removed first:
    the set is incomplete until it is rewritten)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / sft.METADATA_FILE).unlink(missing_ok=True)
    dtype = dtype_for_vocab(vocab_size)
    n = sum(enc.lengths)
    tokens = np.fromiter((t for ids in enc.ids for t in ids), dtype=dtype, count=n)
    mask = np.fromiter((m for ms in enc.masks for m in ms), dtype=np.uint8, count=n)
    offsets = np.zeros(len(enc.lengths) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(enc.lengths)
    save_npy_atomic(out / sft.TOKENS_FILE, tokens)
    save_npy_atomic(out / sft.MASK_FILE, mask)
    save_npy_atomic(out / sft.OFFSETS_FILE, offsets)
    return {"tokens": tokens, "mask": mask, "offsets": offsets, "dtype": dtype}


def write_source_copy(out: Path, src: Records) -> str:
    """A copy of the source next to the data (the local file, or the records as JSONL)."""
    if src.local is not None:
        copy_name = src.local.name
        with open(src.local, "rb") as source, atomic_open(out / copy_name, "wb") as f:
            shutil.copyfileobj(source, f)
        return copy_name
    copy_name = {"hub": "lima_train.jsonl", "local_dataset": f"{src.source['name']}.jsonl",
                 "generated_tools": "generated_tool_use.jsonl"}.get(
        src.source["kind"], "qa_substitute_lima_schema.jsonl")
    with atomic_open(out / copy_name, "w") as f:
        for r in src.records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return copy_name


def write_examples_and_metadata(cfg, out, tok, tok_info, template, src: Records, enc: Encoded,
                                arrays: dict, copy_name: str) -> None:
    """example_conversations.json (the first five as the model sees them) and metadata.json
    (last: its presence marks a complete set)."""
    examples = []
    for rec, ids, m in list(zip(enc.kept, enc.ids, enc.masks))[:5]:
        examples.append({"source": rec["source"], **{k: rec[k] for k in ("conversations", "messages", "tools") if k in rec},
                         "formatted": sft.decode_for_people(tok, ids),
                         "trained_on": tok.decode([t for t, k in zip(ids, m) if k],
                                                  skip_special_tokens=False),
                         "tokens": len(ids), "loss_tokens": int(sum(m))})
    write_json_atomic(out / sft.EXAMPLES_FILE, examples)
    single = sum(1 for r in enc.kept if len(r.get("conversations") or r["messages"]) == 2)
    with_tools = sum(1 for r in enc.kept if r.get("tools"))
    meta = {"format": sft.FORMAT_NAME, "format_version": sft.FORMAT_VERSION, "complete": True,
            "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "source": {**src.source, "copy": copy_name, "test": cfg.test, "limit": src.limit},
            "template": template, "max_length": enc.max_length,
            "dtype": str(np.dtype(arrays["dtype"])),
            "files": {"tokens": sft.TOKENS_FILE, "loss_mask": sft.MASK_FILE,
                      "offsets": sft.OFFSETS_FILE, "examples": sft.EXAMPLES_FILE},
            "counts": {"records_read": src.read, "considered": len(src.records),
                       "kept": len(enc.kept), "too_long": enc.too_long, "single_turn": single,
                       "multi_turn": len(enc.kept) - single, "with_tools": with_tools, **src.skips.to_dict()},
            "lengths": sft.length_stats(enc.lengths),
            "loss_tokens": int(arrays["mask"].sum()),
            "tokenizer": tok_info,
            "data_fingerprint": sft.data_fingerprint(arrays["tokens"], arrays["mask"],
                                                     arrays["offsets"])}
    write_json_atomic(out / sft.METADATA_FILE, meta)


def report_prepare(out: Path, src: Records, enc: Encoded, arrays: dict) -> None:
    skips = src.skips
    print(f"sft prepare: kept {len(enc.kept)}/{len(src.records)} examples (max length "
          f"{enc.max_length} tokens; {enc.too_long} too long); {sum(enc.lengths):,} tokens, "
          f"{int(arrays['mask'].sum()):,} in the loss.")
    if skips.total:
        print(f"sft prepare: skipped {skips.total} malformed record(s): "
              + ", ".join(f"{k} {v}" for k, v in sorted(skips.counts.items())))
        for w in skips.where[:10]:
            print(f"  {w}")
    if skips.notes:
        print("sft prepare: converted: " + ", ".join(f"{k} ({v})" for k, v in sorted(skips.notes.items())))
    if src.source["kind"] == "generated_tools":
        print("sft prepare: note: these tool-use conversations are GENERATED (utils/data/tool_samples.py runs "
              "real Python functions), recorded as such in metadata.json.")
    if src.source["kind"] == "qa_substitute":
        print("sft prepare: note: this is a labelled SUBSTITUTE for LIMA (SciQ + ARC), recorded "
              "as such in metadata.json.")
    print(f"sft prepare: wrote {out}. Next: python main.py sft train --checkpoint checkpoints/<run> "
          "(a run folder: its best checkpoint)")


# --------------------------------------------------------------------------- train
PREPARED = post_start.Prepared("paths.post_training_dir", "sft",
                               lambda cfg, limit, model: prepare_data(cfg, limit, 100, model))


def check_compatible(ckpt: dict, ckpt_path: Path, meta: dict, data_dir: Path, model_args) -> None:
    """Refuse a checkpoint whose tokenizer or architecture does not fit the SFT data."""
    want = meta.get("tokenizer") or {}
    require_same_tokenizer(ckpt.get("tokenizer"), want, f"checkpoint {ckpt_path}",
                           f"the SFT data in {data_dir}",
                           "Re-run `python main.py sft prepare` with the checkpoint's tokenizer "
                           "(tokenizer.name), or pick a checkpoint trained with this one.")
    vocab = want.get("vocab_size")
    if vocab and model_args.vocab_size < vocab:
        raise PipelineError(
            f"architecture mismatch: checkpoint {ckpt_path} has a vocabulary of "
            f"{model_args.vocab_size} tokens but the SFT data's tokenizer has {vocab}; the data "
            "and the model do not belong together. Re-run `python main.py sft prepare` with the "
            "checkpoint's tokenizer.")
    lengths = meta.get("lengths") or {}
    longest = lengths.get("max", 0)
    if sft.positions_needed(longest) > model_args.max_seq_len:
        raise PipelineError(
            f"architecture mismatch: the longest SFT example in {data_dir} has {longest} tokens "
            f"but checkpoint {ckpt_path} was built for max_seq_len {model_args.max_seq_len}. "
            + fit_advice(model_args.max_seq_len, lengths.get("min")))


def fit_advice(max_seq_len: int, shortest: Optional[int] = None) -> str:
    """What to do when SFT examples are longer than a model's context. A model of max_seq_len
    M trains on examples of up to M + 1 tokens (utils.data.sft.positions_needed, the rule DPO
    follows too); re-preparing with ``--max-length`` M + 1 is suggested only when that is a
    value --max-length takes (at least SFT_MIN_LENGTH) and it keeps some example (the data's
    shortest fits); otherwise the message says that no --max-length helps, and what does."""
    longest = max_seq_len + 1
    if longest < SFT_MIN_LENGTH:
        return (f"No --max-length makes the data fit this model: --max-length (sft.max_length) "
                f"takes at least {SFT_MIN_LENGTH} tokens, more than the {longest} its max_seq_len of "
                f"{max_seq_len} trains on. Fine-tune a checkpoint built for at least "
                f"{sft.positions_needed(SFT_MIN_LENGTH)} positions (model.max_seq_len) instead.")
    if isinstance(shortest, int) and sft.positions_needed(shortest) > max_seq_len:
        return (f"No --max-length makes this data fit the model: its shortest example has "
                f"{shortest} tokens. Fine-tune a checkpoint built for at least "
                f"{sft.positions_needed(shortest)} positions (model.max_seq_len), or prepare data "
                "with shorter conversations.")
    return (f"Re-run `python main.py sft prepare --max-length {longest}` (it drops the "
            "examples that do not fit).")


def train(argv: Sequence[str], full_argv: Sequence[str]) -> int:
    args, cfg = parse_train(argv)
    return set_up(cfg, args, full_argv[1:]).finish()


def set_up(cfg, args, argv: Sequence[str]) -> stage.Run:
    """The steps of a start, each returning what it makes (utils/stage.py runs the rest).
    What they hold (the checkpoint, an imported model) is freed when this returns."""
    from utils import stage     # torch-bound (the model, the trainer): `sft prepare` does not load it
    examples = sft.load_examples(cfg.path("paths.post_training_dir"))
    if post_start.data_for_model(cfg, args, "sft", examples.meta, PREPARED):
        examples = sft.load_examples(cfg.path("paths.post_training_dir"))
    src = open_source(cfg, args, examples.meta)
    tok, tok_info, eos = open_run_tokenizer(cfg, src, examples.meta)
    rules = post_start.run_rules(stage.kept_rules(tok, src.imported, src.ckpt), src, tok,
                                 examples.meta["template"])
    data = split_data(cfg, args, examples, tok, eos)
    optimizer, settings = sft_hyperparameters(cfg, args, data)
    start = post_start.start_of(cfg, src, "sft train", args.lora, rules)
    parts = stage.Parts(
        lr_key="sft.lr", tokenizer=tok,
        spec=functools.partial(sft_spec, cfg, args, src, examples.meta, data, optimizer, settings,
                               tok, tok_info, rules),
        run_files=functools.partial(run_files, cfg, args, src, examples.meta, data),
        resume_command=resume_command_post("sft train", argv, src.run_dir / "checkpoint_latest.pt"),
        closing=functools.partial(closing_line, src.run_dir, start.lora is not None))
    return post_start.run_start(cfg, start, parts)


# --------------------------------------------------------------------------- steps of train
def parse_train(argv: Sequence[str]):
    args, cfg = train_parser().parse(argv)
    post_start.check_start_flags(args, "sft train", "a pretrained checkpoint to fine-tune", "an SFT run")
    if not 0 < args.eval_every <= 1:
        raise UsageError("--eval-every must be in (0, 1].")
    post_start.check_lora_flags(args, cfg)
    return args, cfg


def open_source(cfg, args, meta: dict) -> Source:
    """Load and check the checkpoint (its tokenizer and sizes against the SFT data) and name
    the run folder: ``sft_<name>_<time>`` for a new run, the checkpoint's folder on resume,
    whose chat template must still be the data's (utils/post_start.py)."""
    data_dir = cfg.path("paths.post_training_dir")

    def same_template(resume: dict, rpath: Path, base: Path) -> None:
        was, now = (resume.get("chat_template") or {}).get("name"), meta["template"].get("name")
        if was != now:
            raise PipelineError(f"--resume {rpath}: that run trains on chat template '{was}' but "
                                f"the SFT data in {data_dir} uses '{now}'; a run cannot change its "
                                f"template midway. Start a new run: python main.py sft train "
                                f"--checkpoint {base}")

    return post_start.open_source(cfg, args, "sft",
                                  check=lambda ckpt, path, model_args: check_compatible(
                                      ckpt, path, meta, data_dir, model_args),
                                  on_resume=same_template)


def open_run_tokenizer(cfg, src: Source, meta: dict):
    """The base run's own tokenizer (utils.run), after the checkpoint checks (a refusal costs
    no tokenizer load), matched once more against the SFT data's fingerprint."""
    tok, tok_info = post_start.open_tokenizer(cfg, src)
    require_same_tokenizer(tok_info, meta.get("tokenizer"), "the checkpoint's tokenizer",
                           f"the SFT data in {cfg.path('paths.post_training_dir')}",
                           "Re-run `python main.py sft prepare` with that tokenizer.")
    name = tok_info.get("name") or cfg.tokenizer.name
    if meta["template"].get("name") != "jinja":
        return tok, tok_info, require_bos_eos(tok, name)[1]
    if tok.eos_token_id is None and tok.pad_token_id is None:     # a model's template frames its own turns
        raise PipelineError(f"tokenizer '{name}' has neither an EOS nor a padding token: batches cannot be "
                            "padded.")
    return tok, tok_info, tok.eos_token_id


def split_data(cfg, args, examples, tok, eos) -> stage.Data:
    """The seeded train/validation split, the loaders (padding with pad, else EOS), the length."""
    from utils.stage import Data    # torch-bound: `sft prepare` does not load it
    s, seed = cfg.sft, cfg.training.seed
    train_idx, val_idx = sft.split_indices(len(examples), s.val_split, seed)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    train_data = sft.SFTLoader(examples, train_idx, s.batch_size, seed, pad)
    val_data = sft.SFTValData(examples, val_idx, s.batch_size, pad) if len(val_idx) else None
    steps_per_epoch = len(train_data)
    total = s.epochs * steps_per_epoch
    if args.max_steps:
        total = min(total, args.max_steps)
    return Data(train_data, val_data, steps_per_epoch, total)


def _example_counts(data: stage.Data) -> tuple[int, int]:
    """Conversations in the training and the validation split."""
    return len(data.train.indices), len(data.val.indices) if data.val is not None else 0


def sft_hyperparameters(cfg, args, data: stage.Data):
    """SFT's optimizer and numbers, from the ``sft`` section; what it takes from ``training``
    and ``logging`` (how the run is executed, not how it learns) is said once, here."""
    optimizer, settings = post_start.epoch_hyperparameters(cfg, "sft", args.eval_every, data)
    hp, log = cfg.training, cfg.logging
    print(f"sft train: from the training section: device {hp.device}, seed {hp.seed}, compile "
          f"{hp.compile}, activation_checkpointing {hp.activation_checkpointing}, "
          f"early_stopping_patience {hp.early_stopping_patience}; from logging: log_every "
          f"{log.log_every}, smoothing_window {log.smoothing_window}.", flush=True)
    return optimizer, settings


def sft_spec(cfg, args, src: Source, meta: dict, data: stage.Data, optimizer, settings, tok, tok_info,
             rules: Rules, model):
    """SFT as a TrainSpec: the masked next-token loss on the conversations, one numbered
    checkpoint per epoch (``checkpoint_epoch_N.pt``), a sample answer to a fixed question."""
    from utils import stage     # torch-bound: `sft prepare` does not load it
    from utils.training.trainer import TrainSpec, resolve_dtype
    spe = data.steps_per_epoch
    q_ids = chat.chat_prompt_ids(tok, meta["template"], "", [], SAMPLE_QUESTION)
    continues, lead = chat.answer_decoding(meta["template"])

    def answer(ids) -> str:
        reply = TextDecoder(tok, q_ids[-1:] if continues else (), lead=lead)
        for t in ids:
            reply.push(t)
        return reply.text()

    n_train, n_val = _example_counts(data)
    print(f"sft train: {n_train} training / {n_val} validation examples "
          f"({meta['source'].get('label')}); {data.total_steps} steps ({spe}/epoch) of "
          f"{cfg.sft.batch_size} conversations; lr {optimizer.lr:g}; "
          f"{str(resolve_dtype(settings.dtype, model.device)).replace('torch.', '')} on "
          f"{model.device}; base {src.base}.", flush=True)
    stage.say_adapter("sft train", model)
    record = stage.run_record("sft", cfg, tok_info, rules,
                              {"sft": {"base_checkpoint": str(src.base),
                                       "data_fingerprint": meta["data_fingerprint"]}})
    return TrainSpec(model, src.model_args, data.train, data.val, optimizer=optimizer,
                     settings=settings, record=record,
                     checkpoint_name=lambda step: f"checkpoint_epoch_{step // spe}.pt",
                     sample_fn=stage.sampler(cfg, SAMPLE_QUESTION, q_ids, args.sample_tokens,
                                             rules.stop_ids, answer))


def run_files(cfg, args, src: Source, meta: dict, data: stage.Data, spec) -> dict:
    """sft_config.json (what the run was trained from and with); the hyperparameters of the
    log's config record."""
    from utils import stage     # torch-bound: `sft prepare` does not load it
    from utils.training.trainer import resolve_dtype
    st, opt, device = spec.settings, spec.optimizer, spec.model.device
    n_train, n_val = _example_counts(data)
    hyper = {"epochs": cfg.sft.epochs, "lr": opt.lr, "min_lr": st.min_lr,
             "batch_size": cfg.sft.batch_size, "val_split": cfg.sft.val_split,
             "warmup_steps": st.warmup_steps, "total_steps": st.total_steps,
             "steps_per_epoch": st.steps_per_epoch, "seed": cfg.training.seed,
             "eval_every": args.eval_every, "dtype": str(resolve_dtype(st.dtype, device)),
             "device": str(device), "weight_decay": opt.weight_decay,
             "betas": [opt.beta1, opt.beta2], "grad_clip": st.grad_clip,
             "lora": stage.adapter_record(spec.model)}
    sft_config = {"run": src.run_dir.name, "base_checkpoint": str(src.base),
                  "base": src.base_record(),
                  "resumed_from": str(args.resume) if src.resumed else None,
                  "data": {"dir": str(cfg.path("paths.post_training_dir")),
                           "fingerprint": meta["data_fingerprint"], "source": meta["source"],
                           "train_examples": n_train, "val_examples": n_val},
                  "chat_template": meta["template"], "sample_question": SAMPLE_QUESTION,
                  "hyperparameters": hyper, "model": src.model_args.to_dict(),
                  "tokenizer": spec.record.tokenizer, "config": cfg.to_dict()}
    write_json_atomic(src.run_dir / "sft_config.json", sft_config)
    return {"run": src.run_dir.name, **hyper}


def closing_line(run_dir: Path, adapter: bool, result, logger) -> str:
    """Where the model is and how to try it; a LoRA run also writes its adapter as a PEFT
    folder (``<run>/adapter/``, from its best checkpoint, else its latest)."""
    best = f"{result.best_val_loss:.4f}" if result.best_val_loss is not None else "n/a"
    picked = post_start.best_or_latest(run_dir)
    line = (f"sft train: {result.reason} at step {result.step}; best masked val loss {best}; "
            f"checkpoints in {run_dir}. Try it: python main.py infer --checkpoint {picked}")
    return post_start.closing("sft train", run_dir, adapter, line, picked)


if __name__ == "__main__":
    run_stage(main)
