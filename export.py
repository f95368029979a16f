"""Stage ``export``: a checkpoint as a Hugging Face model folder or a GGUF file for llama.cpp.

    python main.py export --checkpoint checkpoints/exp1 --format hf --out exports/exp1-hf
    python main.py export --checkpoint checkpoints/sft_x/checkpoint_best.pt --format gguf \\
        --dtype q8_0 --out exports/sft_x-gguf
    python main.py export ... --force          replace an existing --out (only once the new
                                               export is complete)
    python main.py export ... --adapter DIR    merge a PEFT LoRA adapter folder first

A LoRA run's checkpoint (utils/lora.py) is exported with its adapter merged (the one loader
merges it); ``--adapter DIR`` merges a PEFT LoRA folder (a LoRA run's ``<run>/adapter``, or
one trained with peft on the same base) into any checkpoint or Hugging Face model first.

Input: any checkpoint the one loader reads (pre-trained or SFT), or a run folder (its best
checkpoint, as ``benchmark`` picks), opened with the tokenizer it was trained with
(utils/run.py); or a Hugging Face Llama folder or .gguf file (imported as ``--init-from-hf``
does, with its own tokenizer files and chat template: an import exported again, HF -> GGUF,
GGUF -> HF). Output, written into a temporary folder next to ``--out`` and renamed into place
at the end (a failure, Ctrl-C or SIGTERM leaves ``--out`` as it was and no temporary folder;
an existing ``--out`` is replaced only with ``--force``, and only when it is an earlier
export: never a file, a folder of other files, one that holds the model being exported, the
current folder, the project's folder or a folder above either; all checked before the model
loads):

- ``--format hf`` (``--dtype fp32|bf16|fp16``, default the weights' own): config.json,
  model.safetensors (shards of at most ``--max-shard-size``, default 2GB, with
  model.safetensors.index.json), generation_config.json, the tokenizer files, README.md (the
  model card, ``--license``):
  ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(DIR)`` load it with no custom
  code (utils/hf/export.py).
- ``--format gguf`` (``--dtype f32|f16|bf16|q8_0``, default f16): ``<run>-<dtype>.gguf`` and
  README.md; llama.cpp (llama-cli, llama-server, llama-cpp-python, Ollama, LM Studio) loads it
  (utils/hf/to_gguf.py).

What Llama cannot express (LayerNorm models; for GGUF also GeGLU/ReGLU, which llama.cpp's
llama graph cannot compute) is refused before anything is written (exit 1, naming the
option). Details and measured tolerances: docs/export.md.

``$LLM_PIPELINE_PAUSE_EXPORT=1``: once the export is complete in its temporary folder, wait
for a stop signal before renaming it into place (a deterministic point for tests to
interrupt at, as ``LLM_PIPELINE_PAUSE_AT_STEP`` is for training).
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from safetensors import SafetensorError

from utils.cli import PipelineError, StageParser, UsageError, cli_path, run_stage
from utils.config import PROJECT_ROOT
from utils.disk import WriteError, free_bytes, named
from utils.hf.card import Sources, model_card
from utils.run import (POST_TRAINING, checkpoint_bytes, is_hf_model, load_model_and_tokenizer,
                       pick_checkpoint, read_stage_config, stored_config)

# What imports torch or transformers (utils/hf/* but card.py, bench's adapters and report; 1-3
# s) or the tokenizer and SFT-data modules (huggingface_hub, numpy; ~0.3 s) is imported in the
# step that uses it: --help and the refusals before the model loads do not wait for them.

FORMATS = ("hf", "gguf")
PAUSE_ENV = "LLM_PIPELINE_PAUSE_EXPORT"
SHARD_DEFAULT = "2GB"
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
              "GIB": 2**30}


def build_parser() -> StageParser:
    p = StageParser("main.py export", "Export a checkpoint as a Hugging Face model folder or a "
                    "GGUF file for llama.cpp.")
    p.add_argument("--checkpoint", type=cli_path, required=True, metavar="PATH",
                   help="checkpoint file, or a run folder (its best checkpoint)")
    p.add_argument("--format", choices=FORMATS, required=True,
                   help="hf: a transformers model folder; gguf: one file for llama.cpp")
    p.add_argument("--out", type=cli_path, default=None, metavar="DIR",
                   help="output folder (default: <paths.exports_dir>/<run>-<format>, exports/ unless set)")
    p.add_argument("--dtype", default=None,
                   help="hf: fp32, bf16 or fp16 (default: the weights' own); "
                        "gguf: f32, f16 (default), bf16 or q8_0")
    p.add_argument("--license", default="other", type=license_id,
                   help="the license field of the model card: a Hugging Face license id such "
                        "as apache-2.0, mit, cc-by-4.0 (default: other)")
    p.add_argument("--max-shard-size", default=SHARD_DEFAULT, type=shard_size, metavar="SIZE",
                   help="hf: largest safetensors file (e.g. 500MB, 5GB); a larger model is "
                        "written in shards with model.safetensors.index.json")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --out (once the new export is complete)")
    p.add_argument("--adapter", type=cli_path, default=None, metavar="DIR",
                   help="a PEFT LoRA adapter folder (adapter_config.json + "
                        "adapter_model.safetensors, e.g. a LoRA run's <run>/adapter) to merge into "
                        "the model before it is written (a LoRA run's checkpoint is merged "
                        "without it)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, cfg = build_parser().parse(argv)
    dtype = check_dtype(args.format, args.dtype)
    if args.out:                                        # before the model loads
        check_out(Path(args.out), Path(args.checkpoint), args.force)
    loaded = open_checkpoint(cfg, args.checkpoint)
    say_merged(loaded)
    if args.adapter:
        merge_adapter(loaded, Path(args.adapter))
    out = Path(args.out) if args.out else cfg.path("paths.exports_dir") / f"{loaded.run}-{args.format}"
    check_out(out, loaded.path, args.force)
    check_exportable(loaded, args.format)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    unchanged = f"; {out} is unchanged." if out.exists() else "."
    needed = export_bytes(loaded.model, args.format, dtype)
    check_room(out, needed, unchanged)
    try:
        tmp.mkdir(parents=True)
        files = write_export(cfg, args, loaded, tmp, dtype)
        pause_if_asked()
        replace_dir(tmp, out)
    except ValueError as e:     # what the format cannot hold (the writers say which tensor)
        raise PipelineError(f"cannot export {loaded.path} as {args.format}: {e}. Nothing was "
                            "written" + unchanged) from None
    except (OSError, RuntimeError, SafetensorError) as e:   # a full disk (safetensors' own error too) ...
        refused = named(out, e, needed=needed, setting="--out", note="Nothing was written" + unchanged)
        if refused is not None:
            raise refused from None
        if not isinstance(e, OSError):
            raise
        where = e.filename if e.filename and str(tmp) not in str(e.filename) else out.parent
        raise PipelineError(f"cannot write the export to {out}: {e.strerror or e} ({where}). "
                            "Nothing was written" + unchanged) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    report(out, files, loaded, args.format, dtype)
    return 0


def export_bytes(model, fmt: str, dtype: Optional[str]) -> int:
    """About the bytes the export's weights take (the tokenizer and card add little)."""
    per = {"fp32": 4, "f32": 4, "fp16": 2, "f16": 2, "bf16": 2, "q8_0": 34 / 32}.get(dtype or "", 4)
    return int(sum(p.numel() for p in model.parameters()) * per)


def check_room(out: Path, needed: int, unchanged: str) -> None:
    """Refuse, before writing, an export whose weights alone do not fit the free space of --out's
    device (the export is written beside --out and then renamed into place)."""
    free = free_bytes(out.parent)
    if free is not None and free < needed:
        raise WriteError(out, "full", needed=needed, free=free, setting="--out",
                         note="Nothing was written" + unchanged)


# --------------------------------------------------------------------------- flags
def shard_size(value: str) -> int:
    """argparse type of --max-shard-size: bytes, or a number with KB/MB/GB (powers of 10) or
    KiB/MiB/GiB."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", value, re.IGNORECASE)
    size = int(float(m.group(1)) * SIZE_UNITS[(m.group(2) or "").upper()]) if m else 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: give a size such as 500MB, 2GB or 1048576")
    return size


def license_id(value: str) -> str:
    """argparse type of --license: one Hugging Face license id (it goes into the card's YAML
    header, so nothing that could break out of it)."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9.+_-]{0,63}", value):
        raise argparse.ArgumentTypeError(f"{value!r}: give one license id in lower case, such "
                                         "as apache-2.0, mit, cc-by-4.0 or other")
    return value


# --------------------------------------------------------------------------- steps of main
def check_dtype(fmt: str, dtype: Optional[str]) -> Optional[str]:
    if dtype is None:
        return "f16" if fmt == "gguf" else None
    from utils.hf.export import DTYPES                      # torch, transformers (see the imports)
    from utils.hf.to_gguf import GGUF_DTYPES                # torch
    allowed = tuple(DTYPES) if fmt == "hf" else GGUF_DTYPES   # what each writer takes
    if dtype not in allowed:
        raise UsageError(f"--dtype {dtype}: --format {fmt} takes {', '.join(allowed)}.")
    return dtype


class Loaded:
    """The checkpoint, its model and tokenizer, and what the model card says of them
    (``hf_tok``: an imported model's own transformers tokenizer, exported as it is)."""

    def __init__(self, path: Path, model, ckpt: dict, tok, tok_info: dict, hf_tok=None):
        self.path, self.model, self.ckpt, self.tok, self.tok_info = path, model, ckpt, tok, tok_info
        self.hf_tok = hf_tok
        self.run = path.stem if ckpt.get("kind") == "imported" else (path.parent.name or path.stem)

    @property
    def kind(self) -> str:
        return self.ckpt.get("kind", "pretrain")


def open_checkpoint(cfg, spec: str) -> Loaded:
    """The checkpoint (a run folder: its best one) with the tokenizer it was trained with, or
    an imported Hugging Face Llama folder / .gguf file with its own."""
    if is_hf_model(Path(spec)):
        from utils.hf.export import hf_source                           # torch, transformers (see the imports)
        from utils.hf.import_hf import load_hf_llama, source_tokenizer  # torch, transformers
        imp = load_hf_llama(spec)
        return Loaded(Path(imp.source), imp.model, {"kind": "imported", "hf_source": hf_source(spec)},
                      imp.tok, imp.tok_info, hf_tok=source_tokenizer(spec))
    path = pick_checkpoint(spec, say=lambda s: print(f"export: {s}", file=sys.stderr))
    model, ckpt, tok, info = load_model_and_tokenizer(path, cfg, say=lambda m: print(m, file=sys.stderr))
    return Loaded(path, model, ckpt, tok, info, hf_tok=public_model_tokenizer(ckpt, tok))


def say_merged(loaded: Loaded) -> None:
    """A LoRA run's checkpoint is exported merged (utils.run.load_checkpoint merged it)."""
    entry = loaded.ckpt.get("lora")
    if entry:
        print(f"export: {loaded.path} is a LoRA run's checkpoint: its adapter (r={entry['rank']}, "
              f"alpha={entry['alpha']:g}, on {', '.join(entry['target_modules'])}) is merged into "
              "the exported weights; the adapter alone is in its run folder's adapter/ (PEFT "
              "format).", file=sys.stderr)


def merge_adapter(loaded: Loaded, folder: Path) -> None:
    """``--adapter``: a PEFT LoRA folder (utils/hf/adapter.py) merged into the loaded model
    (W + scale * B @ A), refused naming the folder when it does not fit the model."""
    from utils import lora                                     # torch (see the imports)
    from utils.hf.adapter import read_adapter                  # peft's format, safetensors
    entry = read_adapter(folder)
    sd = loaded.model.state_dict()
    try:
        settings = lora.check_entry(entry, {k: tuple(v.shape) for k, v in sd.items()})
    except ValueError as e:
        raise PipelineError(f"--adapter {folder}: it does not fit the model of {loaded.path}: {e}. "
                            "Merge an adapter trained on this model.") from None
    loaded.model.load_state_dict(lora.merged(sd, entry), strict=True)
    loaded.ckpt = {**loaded.ckpt, "lora": {**settings.to_dict(), "merged": True, "adapter": str(folder)}}
    print(f"export: merged the LoRA adapter {folder} ({settings.describe()}) into {loaded.path}.",
          file=sys.stderr)


def public_model_tokenizer(ckpt: dict, tok):
    """For a run started from a public model (its checkpoint recorded the model's rules,
    utils/data/chat.py): the model's own tokenizer as transformers users load it (control tokens
    read, its own BOS rule) carrying the checkpoint's chat template; None for models trained here
    (their export frames text as we trained it)."""
    if not ckpt.get("model_rules"):
        return None
    from utils.hf.chat import jinja_template                  # numpy (see the imports)
    own = copy.deepcopy(tok)            # the backend's encode_special_tokens is not copied: off
    own.split_special_tokens = False
    own.chat_template = jinja_template(ckpt.get("chat_template"))
    return own


def is_export(folder: Path) -> bool:
    """An earlier export (or an empty folder): only files, a README.md with a config.json or a
    .gguf file. What --force may replace."""
    entries = list(folder.iterdir())
    names = {p.name for p in entries}
    return not entries or (all(p.is_file() for p in entries) and "README.md" in names
                           and ("config.json" in names or any(n.endswith(".gguf") for n in names)))


def check_out(out: Path, source: Optional[Path], force: bool) -> None:
    """Refuse an --out that would lose something, before anything is written. The export
    replaces the whole --out folder, so --out must be a new folder or an earlier export (with
    --force): never the current folder or one above it, the project's own folder or one above
    it, the model being exported (or a folder holding it), a file, or a folder that holds
    anything but an export (with or without --force)."""
    out = out.resolve()
    if source is not None:
        source = source.resolve()
        if out == source or out in source.parents:
            raise PipelineError(f"--out {out} holds the model being exported ({source}); choose "
                                "another --out.")
    new = "Give --out a new folder, such as exports/<name>"
    cwd = Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        where = "the current folder" if out == cwd else f"a folder above the current folder ({cwd})"
        raise PipelineError(f"--out {out} is {where}: an export replaces its whole --out folder. "
                            f"{new}. Nothing was written.")
    if out == PROJECT_ROOT or out in PROJECT_ROOT.parents:
        raise PipelineError(f"--out {out} holds this project's code ({PROJECT_ROOT}): an export "
                            f"replaces its whole --out folder. {new}. Nothing was written.")
    if not out.exists():
        return
    if not out.is_dir():
        raise PipelineError(f"--out {out} is a file, not a folder; choose another --out.")
    try:
        export = is_export(out)
        held = sorted(p.name for p in out.iterdir())
    except OSError as e:
        raise PipelineError(f"--out {out} cannot be read ({e.strerror or e}); choose another "
                            "--out.") from None
    if not export:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise PipelineError(f"--out {out} is not an earlier export (it holds {shown}): an export "
                            "replaces its whole --out folder, and --force replaces only an earlier "
                            f"export. {new}. Nothing was written.")
    if not force:
        raise PipelineError(f"{out} already exists (an earlier export); pass --force to replace it "
                            "(the old export stays until the new one is complete) or choose "
                            "another --out.")


def check_exportable(loaded: Loaded, fmt: str) -> None:
    from utils.hf.mapping import llama_problems, notes      # torch (see the imports)
    from utils.hf.to_gguf import gguf_problems              # torch
    problems = (gguf_problems if fmt == "gguf" else llama_problems)(loaded.model.args)
    if problems:
        raise PipelineError(f"{loaded.path} cannot be exported as {fmt}: " + "; ".join(problems)
                            + ". Nothing was written.")
    for n in notes(loaded.model.args):
        print(f"export: note: {n}.", file=sys.stderr)


def pause_if_asked() -> None:
    """With $LLM_PIPELINE_PAUSE_EXPORT set: say so, then wait (at most 10 min) for a stop
    signal, which run_stage turns into KeyboardInterrupt here."""
    if os.environ.get(PAUSE_ENV, "") in ("", "0"):
        return
    print(f"export: paused before moving the export into place until a stop signal ({PAUSE_ENV}).",
          flush=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        time.sleep(0.05)


def chat_template_of(loaded: Loaded) -> Optional[dict]:
    """A checkpoint's chat template (SFT, or a run started from a public model with one; None
    otherwise); one of template v1 (trained on SFT data format 1) is exported with a note: its
    text, not its token ids."""
    from utils.data import sft                                 # numpy (see the imports)
    template = loaded.ckpt.get("chat_template")
    if template and sft.template_version(template) == sft.TEMPLATE_V1:
        print(f"export: note: {loaded.path} was trained with chat template '{sft.TEMPLATE_V1}' "
              "(each prompt and answer encoded apart): the exported chat template renders its "
              "conversation text, but transformers and llama.cpp tokenize that text into other "
              "ids than it was trained on. Re-run `python main.py sft prepare` and `sft train` "
              "for a template they reproduce token for token.", file=sys.stderr)
    return template


def write_export(cfg, args, loaded: Loaded, folder: Path, dtype: Optional[str]) -> list[Path]:
    from utils.hf.chat import jinja_template                  # numpy (see the imports)
    template = (getattr(loaded.hf_tok, "chat_template", None) if loaded.hf_tok is not None
                else jinja_template(chat_template_of(loaded)))
    card = model_card(loaded.path, loaded.ckpt, loaded.model, loaded.tok_info, card_sources(cfg, loaded),
                      fmt=args.format, dtype=dtype, license=args.license, title=loaded.run)
    if args.format == "hf":
        from utils.hf.export import DTYPES, generation_defaults, write_hf   # torch, transformers (see the imports)
        return write_hf(folder, loaded.model, loaded.tok, card=card,
                        dtype=DTYPES[dtype] if dtype else None,
                        generation=generation_defaults(cfg.inference), chat_template=template,
                        tok_name=loaded.tok_info.get("name") or "",
                        max_shard_size=args.max_shard_size, hf_tok=loaded.hf_tok,
                        source=loaded.ckpt.get("hf_source") or (loaded.ckpt.get("model_rules") or {}).get("files"))
    from utils.hf.to_gguf import write_gguf                     # torch (see the imports)
    path = write_gguf(folder / f"{loaded.run}-{dtype}.gguf", loaded.model, loaded.tok, dtype=dtype,
                      name=loaded.run, chat_template=template, add_bos=adds_bos(loaded.hf_tok))
    if dtype in ("q8_0", "bf16"):
        card += quantization_report(cfg, loaded, dtype, checkpoint_bytes(path))
    (folder / "README.md").write_text(card, encoding="utf-8")
    return [path, folder / "README.md"]


def card_sources(cfg, loaded: Loaded) -> Sources:
    """What the model card reports beyond the checkpoint: the run folder's record of its data
    (a pre-training run's stored config, an SFT run's sft_config.json) and the newest benchmark
    scores of exactly these weights."""
    from utils.bench.adapters import weights_fingerprint       # torch (see the imports)
    from utils.bench.report import scored_results              # torch
    found = Sources()
    if loaded.kind in POST_TRAINING:
        found.sft_config = read_stage_config(loaded.path.parent)
    elif loaded.kind != "imported":
        run_cfg = stored_config(loaded.path.parent)
        if run_cfg is not None:
            found.dataset, found.test = run_cfg.to_dict()["dataset"], run_cfg.test
    found.scores, found.scores_file = scored_results(cfg.path("paths.benchmark_dir"),
                                                     weights_fingerprint(loaded.model.state_dict()))
    return found


def adds_bos(hf_tok) -> Optional[bool]:
    """Whether an imported model's own tokenizer puts BOS in front of a text (None for ours:
    every text starts with BOS)."""
    if hf_tok is None:
        return None
    ids = hf_tok("a")["input_ids"]
    return hf_tok.bos_token_id is not None and bool(ids) and ids[0] == hf_tok.bos_token_id


def quantization_report(cfg, loaded: Loaded, dtype: str, size: int, passages: int = 24) -> str:
    """What a smaller GGUF costs: its size, and the perplexity on held-out Wikipedia passages
    of the weights llama.cpp computes with (our forward pass on the de-quantized tensors),
    next to f16's and the original fp32's. Printed, and added to the model card."""
    from utils.bench import data as bench_data                     # numpy (see the imports)
    from utils.data.tok import encode_plain                        # huggingface_hub
    from utils.hf.to_gguf import dequantized_state, perplexity     # torch
    texts = bench_data.load_texts(None, cfg.path("paths.samples_dir"), cfg.path("paths.cache_dir"),
                                  cfg.root)
    items = [it.text for it in texts.items[:passages]]
    ids = [[loaded.tok.bos_token_id] + x for x in encode_plain(loaded.tok, items)]
    scratch = copy.deepcopy(loaded.model)
    ppl = {"fp32": perplexity(loaded.model, ids)}
    for d in ("f16", dtype):
        scratch.load_state_dict(dequantized_state(loaded.model, d))
        ppl[d] = perplexity(scratch, ids)
    f16_mb = f16_size(loaded.model, dtype, size) / 1e6
    line = (f"perplexity on {len(ids)} held-out Wikipedia passages (our forward pass on the "
            f"de-quantized weights): fp32 {ppl['fp32']:.3f}, f16 {ppl['f16']:.3f}, {dtype} "
            f"{ppl[dtype]:.3f}; size {size / 1e6:.1f} MB ({dtype}) vs {f16_mb:.1f} MB (f16)")
    print(f"export: {line}.", file=sys.stderr)
    return f"\n## Quantization\n\n{line[0].upper() + line[1:]}.\n"


def f16_size(model, dtype: str, size: int) -> int:
    """The size of the f16 GGUF of ``model``, from that of its ``dtype`` GGUF (``size``): the
    same file but for the bytes of the 2-D weights (each stored once; a tied head is not)."""
    per_value = {"bf16": 2.0, "q8_0": 34 / 32}[dtype]       # q8_0: 32 int8 + one f16 scale
    seen, values = set(), 0
    for t in model.state_dict().values():
        if t.dim() >= 2 and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            values += t.numel()
    return int(size + values * (2 - per_value))


def replace_dir(tmp: Path, out: Path) -> None:
    """``tmp`` becomes ``out``; an existing ``out`` is moved aside first and removed only after
    the rename, so no moment leaves neither."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        if old.exists():
            os.replace(old, out)
        raise
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def report(out: Path, files: list[Path], loaded: Loaded, fmt: str, dtype: Optional[str]) -> None:
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"export: {loaded.path} ({loaded.kind}) -> {out} as {fmt}"
          + (f" ({dtype})" if dtype else "") + f": {len(files)} files, {size / 1e6:,.1f} MB.")
    if fmt == "hf":
        print(f"  load it: AutoModelForCausalLM.from_pretrained('{out}'), "
              f"AutoTokenizer.from_pretrained('{out}')")
        print(f"  upload it: huggingface-cli upload <user>/<repo> {out} .")
    else:
        gguf = next(p for p in files if p.suffix == ".gguf")
        print(f"  run it: llama-cli -m {out / gguf.name} -p 'The history of' -n 64")


if __name__ == "__main__":
    run_stage(main)
