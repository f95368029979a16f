"""Stage ``export``: a checkpoint as a Hugging Face model folder or a GGUF file for llama.cpp.

    python main.py export --checkpoint checkpoints/exp1 --format hf --out exports/exp1-hf
    python main.py export --checkpoint checkpoints/sft_x/checkpoint_best.pt --format gguf \\
        --dtype q8_0 --out exports/sft_x-gguf
    python main.py export ... --force          replace an existing --out (only once the new
                                               export is complete)

Input: any checkpoint the one loader reads (pre-trained or SFT), or a run folder (its best
checkpoint, as ``benchmark`` picks), opened with the tokenizer it was trained with
(utils/run.py). Output, written into a temporary folder next to ``--out`` and renamed into
place at the end (a failure or Ctrl-C leaves ``--out`` as it was; an existing ``--out`` is
replaced only with ``--force``):

- ``--format hf`` (``--dtype fp32|bf16|fp16``, default the weights' own): config.json,
  model.safetensors, generation_config.json, the tokenizer files, README.md (the model card):
  ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(DIR)`` load it with no custom
  code (utils/hf/export.py).
- ``--format gguf`` (``--dtype f32|f16|bf16|q8_0``, default f16): ``<run>-<dtype>.gguf`` and
  README.md; llama.cpp (llama-cli, llama-server, llama-cpp-python, Ollama, LM Studio) loads it
  (utils/hf/to_gguf.py).

What Llama cannot express (LayerNorm models) is refused before anything is written (exit 1,
naming the option). Details and measured tolerances: docs/export.md.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

from utils.cli import PipelineError, StageParser, UsageError, cli_path, run_stage

FORMATS = ("hf", "gguf")


def build_parser() -> StageParser:
    p = StageParser("main.py export", "Export a checkpoint as a Hugging Face model folder or a "
                    "GGUF file for llama.cpp.")
    p.add_argument("--checkpoint", type=cli_path, required=True, metavar="PATH",
                   help="checkpoint file, or a run folder (its best checkpoint)")
    p.add_argument("--format", choices=FORMATS, required=True,
                   help="hf: a transformers model folder; gguf: one file for llama.cpp")
    p.add_argument("--out", type=cli_path, default=None, metavar="DIR",
                   help="output folder (default: exports/<run>-<format>)")
    p.add_argument("--dtype", default=None,
                   help="hf: fp32, bf16 or fp16 (default: the weights' own); "
                        "gguf: f32, f16 (default), bf16 or q8_0")
    p.add_argument("--license", default="other",
                   help="the license field of the model card (default: other)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --out (once the new export is complete)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, cfg = build_parser().parse(argv)
    dtype = check_dtype(args.format, args.dtype)
    loaded = open_checkpoint(cfg, args.checkpoint)
    out = Path(args.out) if args.out else cfg.root / "exports" / f"{loaded.run}-{args.format}"
    if out.exists() and not args.force:
        raise PipelineError(f"{out} already exists; pass --force to replace it (the old export "
                            "stays until the new one is complete) or choose another --out.")
    check_exportable(loaded)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
        try:
            files = write_export(cfg, args, loaded, tmp, dtype)
        except ValueError as e:     # what the format cannot hold (the writers say which tensor)
            raise PipelineError(f"cannot export {loaded.path} as {args.format}: {e}. Nothing "
                                "was written" + (f"; {out} is unchanged." if out.exists() else ".")) from None
        replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    report(out, files, loaded, args.format, dtype)
    return 0


# --------------------------------------------------------------------------- steps of main
def check_dtype(fmt: str, dtype: Optional[str]) -> Optional[str]:
    if dtype is None:
        return "f16" if fmt == "gguf" else None
    from utils.hf.export import DTYPES
    from utils.hf.to_gguf import GGUF_DTYPES
    allowed = tuple(DTYPES) if fmt == "hf" else GGUF_DTYPES   # what each writer takes
    if dtype not in allowed:
        raise UsageError(f"--dtype {dtype}: --format {fmt} takes {', '.join(allowed)}.")
    return dtype


class Loaded:
    """The checkpoint, its model and tokenizer, and what the model card says of them."""

    def __init__(self, path: Path, model, ckpt: dict, tok, tok_info: dict):
        self.path, self.model, self.ckpt, self.tok, self.tok_info = path, model, ckpt, tok, tok_info
        self.run = path.parent.name or path.stem

    @property
    def kind(self) -> str:
        return self.ckpt.get("kind", "pretrain")


def open_checkpoint(cfg, spec: str) -> Loaded:
    """The checkpoint (a run folder: its best one) with the tokenizer it was trained with."""
    from utils.run import load_model_and_tokenizer, pick_checkpoint
    path = pick_checkpoint(spec, say=lambda s: print(f"export: {s}", file=sys.stderr))
    model, ckpt, tok, info = load_model_and_tokenizer(path, cfg, say=lambda m: print(m, file=sys.stderr))
    return Loaded(path, model, ckpt, tok, info)


def check_exportable(loaded: Loaded) -> None:
    from utils.hf.export import llama_problems, notes
    problems = llama_problems(loaded.model.args)
    if problems:
        raise PipelineError(f"checkpoint {loaded.path} cannot be exported as a Llama model: "
                            + "; ".join(problems) + ". Nothing was written.")
    for n in notes(loaded.model.args):
        print(f"export: note: {n}.", file=sys.stderr)


def chat_template_of(loaded: Loaded) -> Optional[dict]:
    """An SFT checkpoint's chat template (None for other kinds); one of template v1 (trained on
    SFT data format 1) is exported with a note: its text, not its token ids."""
    from utils.data import sft
    template = loaded.ckpt.get("chat_template") if loaded.kind == "sft" else None
    if template and sft.template_version(template) == sft.TEMPLATE_V1:
        print(f"export: note: {loaded.path} was trained with chat template '{sft.TEMPLATE_V1}' "
              "(each prompt and answer encoded apart): the exported chat template renders its "
              "conversation text, but transformers and llama.cpp tokenize that text into other "
              "ids than it was trained on. Re-run `python main.py sft prepare` and `sft train` "
              "for a template they reproduce token for token.", file=sys.stderr)
    return template


def write_export(cfg, args, loaded: Loaded, folder: Path, dtype: Optional[str]) -> list[Path]:
    from utils.hf.card import model_card
    from utils.hf.chat import jinja_template
    template = jinja_template(chat_template_of(loaded))
    card = model_card(cfg, loaded.path, loaded.ckpt, loaded.model, loaded.tok_info,
                      fmt=args.format, dtype=dtype, license=args.license)
    if args.format == "hf":
        from utils.hf.export import DTYPES, write_hf
        inf = cfg.inference
        generation = {"do_sample": inf.temperature > 0, "temperature": inf.temperature,
                      "top_k": inf.top_k, "top_p": inf.top_p, "max_new_tokens": inf.max_new_tokens}
        return write_hf(folder, loaded.model, loaded.tok, card=card,
                        dtype=DTYPES[dtype] if dtype else None, generation=generation,
                        chat_template=template, tok_name=loaded.tok_info.get("name") or "")
    from utils.hf.to_gguf import write_gguf
    path = write_gguf(folder / f"{loaded.run}-{dtype}.gguf", loaded.model, loaded.tok, dtype=dtype,
                      name=loaded.run, chat_template=template)
    if dtype in ("q8_0", "bf16"):
        card += quantization_report(cfg, loaded, dtype, path.stat().st_size)
    (folder / "README.md").write_text(card, encoding="utf-8")
    return [path, folder / "README.md"]


def quantization_report(cfg, loaded: Loaded, dtype: str, size: int, passages: int = 24) -> str:
    """What a smaller GGUF costs: its size, and the perplexity on held-out Wikipedia passages
    of the weights llama.cpp computes with (our forward pass on the de-quantized tensors),
    next to f16's and the original fp32's. Printed, and added to the model card."""
    import copy
    from utils.bench import data as bench_data
    from utils.data.tok import encode_plain
    from utils.hf.to_gguf import dequantized_state, perplexity
    texts = bench_data.load_texts(None, cfg.path("paths.samples_dir"), cfg.path("paths.cache_dir"),
                                  cfg.root)
    items = [it.text for it in texts.items[:passages]]
    ids = [[loaded.tok.bos_token_id] + x for x in encode_plain(loaded.tok, items)]
    scratch = copy.deepcopy(loaded.model)
    ppl = {"fp32": perplexity(loaded.model, ids)}
    for d in ("f16", dtype):
        scratch.load_state_dict(dequantized_state(loaded.model, d))
        ppl[d] = perplexity(scratch, ids)
    n_params = loaded.model.num_params()
    f16_mb = (n_params * 2) / 1e6
    line = (f"perplexity on {len(ids)} held-out Wikipedia passages (our forward pass on the "
            f"de-quantized weights): fp32 {ppl['fp32']:.3f}, f16 {ppl['f16']:.3f}, {dtype} "
            f"{ppl[dtype]:.3f}; size {size / 1e6:.1f} MB ({dtype}) vs about {f16_mb:.1f} MB (f16)")
    print(f"export: {line}.", file=sys.stderr)
    return f"\n## Quantization\n\n{line[0].upper() + line[1:]}.\n"


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
