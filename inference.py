"""Stage ``infer`` (alias ``inference``): generate text from checkpoints, interactively or in scripts.

    python main.py infer                                   menu: single model / comparison / benchmark
    python main.py infer --checkpoint PATH                 prompt loop with that checkpoint
    python main.py infer --checkpoint PATH --prompt "The history of" --max-new-tokens 50 \\
        --temperature 0 [--seed 1] [--json]                scripted: prints only the generated text
    echo "Why is the sky blue?" | python main.py infer --checkpoint PATH --prompt -
    python main.py infer --checkpoint exports/run-hf --prompt "..."   a Hugging Face Llama folder or .gguf file

Interactive: pick a training run (newest first, highlighted; SFT runs and the legacy flat
layout included), then a checkpoint (best in green, latest in blue), or several for a
comparison (``1,3`` or ``all``: memory estimate and warning, the same prompt through each,
outputs and a summary: fastest, most tokens, highest tokens/s). Prompts loop without
reloading; parameters are the ``inference`` config section's defaults (200 new tokens,
temperature 0.8, top-k 50, top-p 0.95) or customized per prompt. Text streams as it is
generated, then statistics (tokens, seconds, tokens/s, time to first token).

SFT checkpoints (kind "sft") get their stored chat template (User/Assistant) automatically,
and the conversation is kept across turns until ``/clear`` or until the context is full
(the oldest exchanges are then dropped, with a note); ``--raw`` turns the template off.

Scripted mode (``--prompt``) writes only the generated text to stdout (``--json``: one
object with text and statistics), everything else to stderr; the output equals the
generation engine's (utils/generation/engine.py) with the same ``--seed``. Colors only on a
terminal and never with NO_COLOR. Bad checkpoints, end of input, empty prompts and Ctrl-C are handled without a
traceback: Ctrl-C during generation stops that generation and returns to the prompt;
at a prompt it ends the stage (exit 130). Details: docs/sft_inference.md.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from utils.cli import (EXIT_INTERRUPTED, PipelineError, StageParser, Terminated, UsageError, cli_path, printable,
                       run_stage, wrapped_for)
from utils.device import available_bytes, generation_dtype, resolve_device
from utils.run import age_text, list_runs, open_for_generation

# The generation engine, int8 weights and the decode-weight estimate import torch (1-2 s), the
# chat and text modules the tokenizer's (huggingface_hub, numpy, jinja2; ~0.3 s): they are
# imported where a model is loaded, prompted or measured, so --help and the refusals before it
# do not wait for them.

ROOT = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- terminal
class Colors:
    def __init__(self, enabled: bool):
        on = enabled
        self.green = "\033[32m" if on else ""
        self.blue = "\033[34m" if on else ""
        self.yellow = "\033[33m" if on else ""
        self.cyan = "\033[36m" if on else ""
        self.red = "\033[31m" if on else ""
        self.bold = "\033[1m" if on else ""
        self.dim = "\033[2m" if on else ""
        self.reset = "\033[0m" if on else ""


def use_color(stream=None) -> bool:
    stream = stream or sys.stdout
    return "NO_COLOR" not in os.environ and hasattr(stream, "isatty") and stream.isatty()


class EndOfInput(Exception):
    """Standard input closed at a prompt."""


def utf8_text(text: str, where: str) -> str:
    """``text`` if it is valid Unicode; bytes that were not UTF-8 (kept by Python as lone
    surrogates in a terminal's input; argv is checked by utils.cli.StageParser) are a
    UsageError naming ``where``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{where} holds bytes that are not UTF-8 text (at character {e.start + 1}); "
                         "pass UTF-8 text.") from None
    return text


def read_stdin_text() -> str:
    """Standard input as UTF-8 text (a UsageError naming the byte offset otherwise)."""
    raw = sys.stdin.buffer.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"the prompt on standard input is not UTF-8 text (byte 0x{raw[e.start]:02x} at "
                         f"offset {e.start}); pass UTF-8 text.") from None


def ask(text: str, default: Optional[str] = None) -> str:
    try:
        got = input(text)
    except EOFError:
        raise EndOfInput() from None
    try:
        utf8_text(got, "the input")
    except UsageError as e:
        print(f"({e}) ", end="")
        got = ""
    got = got.strip()
    return got if got else (default or "")


# --------------------------------------------------------------------------- parser
def build_parser() -> StageParser:
    p = StageParser("main.py infer", "Generate text from trained checkpoints: an interactive menu, "
                    "or scripted with --checkpoint and --prompt.")
    p.add_argument("--checkpoint", type=cli_path, default=None, metavar="PATH",
                   help="checkpoint file or run folder (skips the run/checkpoint menu); also a "
                        "Hugging Face Llama folder or .gguf file (imported)")
    p.add_argument("--prompt", default=None, metavar="TEXT",
                   help="scripted mode: generate once for TEXT ('-' reads standard input) and "
                        "print only the generated text")
    p.config_flag("--max-new-tokens", key="inference.max_new_tokens", type=int, metavar="N",
                  help="tokens generated per prompt")
    p.config_flag("--temperature", key="inference.temperature", type=float, metavar="T",
                  help="sampling temperature (0 = greedy)")
    p.config_flag("--top-k", key="inference.top_k", type=int, metavar="K", help="top-k filter (0 = off)")
    p.config_flag("--top-p", key="inference.top_p", type=float, metavar="P", help="nucleus filter (1.0 = off)")
    p.config_flag("--device", key="inference.device", metavar="DEV", help="auto, cpu, cuda or cuda:N")
    p.config_flag("--dtype", key="inference.dtype", choices=["auto", "fp32", "bf16", "fp16"],
                  help="the weights' dtype (auto: bf16 on CUDA, as stored on CPU)")
    p.config_flag("--prefix-cache-mb", key="inference.prefix_cache_mb", type=int, metavar="MB",
                  help="MiB of KV kept for reuse by later chat turns (0: off)")
    p.config_flag("--prompt-lookup", key="inference.prompt_lookup_num_tokens", type=int, metavar="K",
                  help="prompt-lookup speculative decoding: K tokens drafted per step from the text's own "
                       "n-grams, greedy only, same tokens (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    p.add_argument("--json", action="store_true",
                   help="scripted mode: print one JSON object (text and statistics)")
    p.add_argument("--quantize", choices=["none", "int8"], default="none",
                   help="weight-only int8 weights (less memory, utils/quant.py)")
    p.add_argument("--raw", action="store_true",
                   help="no chat template, even for SFT checkpoints (plain completion)")
    return p


# --------------------------------------------------------------------------- models
@dataclass
class Params:
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: Optional[int] = None

    def describe(self) -> str:
        return (f"max new tokens {self.max_new_tokens}, temperature {self.temperature:g}, "
                f"top-k {self.top_k}, top-p {self.top_p:g}"
                + (f", seed {self.seed}" if self.seed is not None else ""))

    def for_model(self, defaults: dict, flags: set, note: Callable[[str], None]) -> "Params":
        """These parameters with the model's own generation defaults (the settings its
        generation_config.json writes, utils/data/chat.py) in place of the config's, except
        those given as flags (``flags``: their names)."""
        taken = {k: v for k, v in defaults.items() if k not in flags and getattr(self, k) != v}
        if taken:
            note("(the model's generation_config.json sets " + ", ".join(f"{k} {v:g}" for k, v in taken.items())
                 + ": used instead of the config's inference settings)")
        return dataclasses.replace(self, **taken)


@dataclass
class Stats:
    tokens: int
    seconds: float
    ttft: Optional[float]
    stopped: bool = False
    prompt_tokens: Optional[int] = None     # what the model was given (chat: history included)
    reused: int = 0                         # of them, taken from the prefix cache (not recomputed)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        ttft = f"{self.ttft:.3f} s" if self.ttft is not None else "n/a"
        prompt = f"; prompt {self.prompt_tokens} tokens" if self.prompt_tokens is not None else ""
        prompt += f", {self.reused} reused" if self.reused else ""
        return (f"{self.tokens} tokens in {self.seconds:.2f} s ({self.rate:.1f} tokens/s; first "
                f"token after {ttft}{prompt})" + (" [stopped]" if self.stopped else ""))


@dataclass
class Loaded:
    path: Path
    label: str
    model: object
    ckpt_kind: str
    rules: object                # utils.data.chat.Rules: its template (None: completion), BOS, stop ids
    n_params: int
    tok: object                  # the tokenizer it was trained with (utils.run)
    engine: object = None        # its generation engine (utils.generation.engine.Engine)
    history: list = field(default_factory=list)

    @property
    def template(self) -> Optional[dict]:
        return self.rules.template

    @property
    def chat(self) -> bool:
        return self.template is not None

    @property
    def mode(self) -> str:
        """How prompts are framed, as the loading line says it."""
        if not self.chat:
            return "completion"
        if self.template.get("name") == "jinja":
            return "chat (the model's own template)"
        return "chat (User/Assistant template)"


def pick_device(name: str):
    return resolve_device(name, "inference.device")


class Session:
    """Loaded checkpoints (each with its tokenizer and generation engine), the chat history,
    and one generation at a time with streaming and statistics."""

    def __init__(self, cfg, raw: bool = False, err=None, quantize: str = "none"):
        self.cfg, self.raw, self.quantize = cfg, raw, quantize
        self.err = err or sys.stderr
        self.device = pick_device(cfg.inference.device)
        self.dtype = generation_dtype(cfg.inference.dtype, self.device, quantize, "inference.dtype")
        self._tokenizers: dict = {}      # loaded once for checkpoints that share one
        self._memory_note_said = False

    def unknown_memory(self, why: str, note: Callable[[str], None]) -> None:
        """Say once per session that free memory is unknown and its checks are skipped."""
        if not self._memory_note_said:
            self._memory_note_said = True
            note(f"({why}: the KV cache is not checked against free memory)")

    def note(self, msg: str) -> None:
        """``msg`` on the error stream, wrapped at word boundaries to a terminal's width."""
        print(wrapped_for(self.err, f"infer: {msg}", " " * len("infer: ")), file=self.err)

    def load(self, path: Path, label: Optional[str] = None) -> Loaded:
        from utils.generation.engine import Engine          # torch (see the imports)
        o = open_for_generation(path, self.cfg, self.device, raw=self.raw, cache=self._tokenizers,
                                say=self.note)
        n = sum(p.numel() for p in o.model.parameters())
        if self.quantize == "int8":
            from utils.quant import quantize_int8           # torch (see the imports)
            print(f"infer: {quantize_int8(o.model).line()}", file=self.err)
        elif self.dtype is not None:
            o.model.to(self.dtype)
        inf = self.cfg.inference
        engine = Engine(o.model, prompt_lookup=inf.prompt_lookup_num_tokens, compile=inf.compile)
        engine.decode_pack()            # the CPU decode weights now, as part of loading, not of the first reply
        why_not = engine.use_prefix_cache(inf.prefix_cache_mb << 20)   # later turns reuse the KV
        if why_not and inf.prefix_cache_mb:
            self.note(f"prefix cache {why_not}")
        seconds = engine.compile_now()  # and the compiled step, if on
        if seconds is not None:
            self.note(f"(compiled the decode step in {seconds:.1f} s: inference.compile {inf.compile})")
        return Loaded(o.path, label or o.label, o.model, o.kind, o.rules, n, o.tok, engine)

    def prompt_ids(self, m: Loaded, text: str, max_new: int, note: Callable[[str], None]) -> list[int]:
        from utils.data.chat import ChatTemplateError, chat_prompt_ids      # (see the imports)
        tok = m.tok
        limit = m.model.args.context            # None: Infini-attention, no limit
        if m.chat:
            while True:
                try:
                    ids = chat_prompt_ids(tok, m.template, "", m.history, text)
                except ChatTemplateError as e:
                    raise UsageError(str(e)) from None
                if limit is None or len(ids) + max_new <= limit or not m.history:
                    break
                m.history.pop(0)
                note(f"(context full: dropped the oldest exchange; {len(m.history)} kept)")
        else:
            ids = m.rules.prompt_ids(tok, text)
            if not ids:
                raise UsageError("the prompt gives no tokens, and the model's tokenizer has no BOS token "
                                 "to start from: give some text.")
        if limit is not None and len(ids) > limit:
            note(f"(prompt of {len(ids)} tokens shortened to its last {limit}: the model was "
                 f"trained on {limit}-token sequences)")
            ids = ids[-limit:]
        need = m.engine.batcher(1, len(ids) + max_new).bytes_per_slot    # the KV cache, allocated at once
        have, why = available_bytes(m.model.device)
        if have is None:
            self.unknown_memory(why, note)
        elif need > have:
            raise UsageError(f"max new tokens {max_new:,}: the KV cache for the prompt's {len(ids)} and that many "
                             f"positions would take {need / 2 ** 30:,.1f} GiB, more than the "
                             f"{have / 2 ** 30:,.1f} GiB available; ask for fewer"
                             + (f" (the model was trained on {limit}-token sequences)." if limit else "."))
        return ids

    def generate(self, m: Loaded, text: str, p: Params, on_text: Optional[Callable[[str], None]],
                 note: Callable[[str], None] = lambda s: None) -> tuple[str, Stats]:
        """Stream one completion; Ctrl-C stops it (the partial text is kept)."""
        from utils.data.chat import answer_decoding             # (see the imports)
        from utils.generation.detok import TextDecoder
        from utils.generation.engine import NonFiniteLogits     # torch
        continues, lead = answer_decoding(m.template) if m.chat else (False, "")
        text_out = TextDecoder(m.tok)
        t0 = time.perf_counter()
        ttft = None
        stopped = False
        stream = None
        ids: list[int] = []
        store = m.engine.prefix_cache
        hits = store.hit_tokens if store is not None else 0
        try:
            ids = self.prompt_ids(m, text, p.max_new_tokens, note)
            text_out = TextDecoder(m.tok, ids[-1:] if continues else (), lead)
            stream = m.engine.stream(ids, max_new_tokens=p.max_new_tokens,
                                     temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                     eos_id=m.rules.stop_ids, seed=p.seed)
            for t in stream:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                piece = text_out.push(t)
                if on_text is not None and piece:
                    on_text(piece)
        except Terminated:
            raise
        except KeyboardInterrupt:
            stopped = True
        except NonFiniteLogits as e:
            raise PipelineError(f"{m.path}: {e}.") from None
        finally:
            if stream is not None:
                stream.close()
        seconds = time.perf_counter() - t0
        rest = text_out.finish()
        if on_text is not None and rest:
            on_text(rest)
        final = text_out.text()
        if not stopped and not text_out.ids and p.max_new_tokens > 0:
            note("(the model ended its reply immediately (end-of-turn token))" if m.chat else
                 "(the model ended the text immediately (end-of-text token))")
        if m.chat and not stopped:
            m.history.append((text, final))
        reused = store.hit_tokens - hits if store is not None else 0
        return final, Stats(len(text_out.ids), seconds, ttft, stopped, len(ids), reused)


def _label(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


# --------------------------------------------------------------------------- scripted mode
def scripted(session: Session, args, params: Params) -> int:
    if not args.checkpoint:
        raise UsageError("--prompt needs --checkpoint PATH (scripted mode loads one checkpoint).")
    text = read_stdin_text() if args.prompt == "-" else args.prompt   # UTF-8: StageParser checked it
    if args.prompt == "-":
        text = text.rstrip("\n")
    if not text.strip():
        raise UsageError("the prompt is empty; pass --prompt TEXT (or --prompt - with text on "
                         "standard input).")
    m = session.load(Path(args.checkpoint))
    note = (lambda s: print(s, file=sys.stderr))
    params = params.for_model(m.rules.defaults, flags_given(args), note)
    if args.json:
        out, st = session.generate(m, text, params, None, note)
        print(json.dumps({"text": out, "checkpoint": str(m.path), "kind": m.ckpt_kind,
                          "chat_template": m.chat, "prompt": text,
                          "prompt_tokens": st.prompt_tokens, "tokens": st.tokens,
                          "seconds": round(st.seconds, 4), "tokens_per_s": round(st.rate, 2),
                          "time_to_first_token_s": None if st.ttft is None else round(st.ttft, 4),
                          "dtype": str(m.engine.dtype).removeprefix("torch."),
                          "params": vars(params)}, ensure_ascii=False))
        return 0
    out, st = session.generate(m, text, params, None, note)
    sys.stdout.write(out + "\n")
    sys.stdout.flush()
    print(st.line(), file=sys.stderr)
    return EXIT_INTERRUPTED if st.stopped else 0


# --------------------------------------------------------------------------- interactive
class UI:
    def __init__(self, session: Session, defaults: Params, flags: set = frozenset()):
        self.session, self.defaults, self.flags = session, defaults, flags
        self.c = Colors(use_color())

    def say(self, s: str = "") -> None:
        print(s, flush=True)

    def choose_number(self, question: str, n: int, default: int = 1) -> int:
        while True:
            got = ask(f"{question} [1-{n}, Enter = {default}]: ", str(default))
            if got.isdigit() and 1 <= int(got) <= n:
                return int(got)
            self.say(f"{self.c.red}Please enter a number from 1 to {n}.{self.c.reset}")

    def pick_run(self):
        base = self.session.cfg.path("paths.checkpoints_dir")
        runs = list_runs(base)
        if not runs:
            raise PipelineError(f"no checkpoints under {base}. Train a model first (`python "
                                "main.py train --test`) or pass --checkpoint PATH.")
        c = self.c
        self.say(f"\n{c.bold}Training runs{c.reset} (most recent first):")
        for i, r in enumerate(runs, 1):
            age = age_text(time.time() - r.mtime)
            line = f"  {i}) {printable(r.name)}  [{r.kind}]  {len(r.checkpoints)} checkpoint(s), {age} ago"
            if i == 1:
                line = f"{c.yellow}{c.bold}{line}  <- most recent{c.reset}"
            self.say(line)
        return runs[self.choose_number("Select a run", len(runs)) - 1]

    def list_checkpoints(self, run) -> list:
        c = self.c
        self.say(f"\n{c.bold}Checkpoints in {printable(run.name)}:{c.reset}")
        for i, p in enumerate(run.checkpoints, 1):
            tag, color = "", ""
            if p.name == "checkpoint_best.pt":
                tag, color = "  (best)", c.green
            elif p.name == "checkpoint_latest.pt":
                tag, color = "  (latest)", c.blue
            size = p.stat().st_size / 1e6
            self.say(f"{color}  {i}) {printable(p.name)}{tag}  {size:.1f} MB{c.reset if color else ''}")
        return run.checkpoints

    def pick_checkpoint(self) -> Path:
        run = self.pick_run()
        files = self.list_checkpoints(run)
        return files[self.choose_number("Select a checkpoint", len(files)) - 1]

    def pick_many(self) -> list[Path]:
        run = self.pick_run()
        files = self.list_checkpoints(run)
        while True:
            got = ask("Select checkpoints to compare (e.g. 1,3 or all) [all]: ", "all").lower()
            if got == "all":
                return list(files)
            try:
                idx = [int(x) for x in got.replace(" ", "").split(",") if x]
            except ValueError:
                idx = []
            if idx and all(1 <= i <= len(files) for i in idx):
                return [files[i - 1] for i in dict.fromkeys(idx)]
            self.say(f"{self.c.red}Enter numbers from 1 to {len(files)} separated by commas, or "
                     f"'all'.{self.c.reset}")

    def params(self) -> Params:
        d = self.defaults
        got = ask(f"Parameters: 1) defaults ({d.describe()})  2) customize [1]: ", "1")
        if got != "2":
            return d
        return Params(self._num("Max new tokens", d.max_new_tokens, int, lambda v: v >= 1),
                      self._num("Temperature (0 = greedy)", d.temperature, float,
                                lambda v: math.isfinite(v) and v >= 0),
                      self._num("Top-k (0 = off)", d.top_k, int, lambda v: v >= 0),
                      self._num("Top-p (1.0 = off)", d.top_p, float, lambda v: 0 < v <= 1),
                      d.seed)

    def _num(self, name, default, typ, ok):
        while True:
            got = ask(f"  {name} [{default}]: ", str(default))
            try:
                v = typ(got)
                if ok(v):
                    return v
            except ValueError:
                pass
            self.say(f"{self.c.red}  not a valid value for {name.lower()}.{self.c.reset}")

    def read_prompt(self, chat: bool) -> Optional[str]:
        """The next prompt; None to quit. Commands: /quit, /clear."""
        hint = "/quit to exit" + (", /clear to forget the conversation" if chat else "")
        while True:
            got = ask(f"\n{self.c.cyan}Prompt{self.c.reset} ({hint}): ")
            if got.lower() in ("/quit", "/exit", "/q", "quit", "exit"):
                return None
            if got == "/clear":
                return "/clear"
            if not got:
                self.say("(empty prompt: type some text, or /quit)")
                continue
            return got

    def out(self, s: str) -> None:
        # generated text may hold control characters (\r, escape codes): never let them
        # drive the terminal
        sys.stdout.write(printable(s, keep="\n\t"))
        sys.stdout.flush()

    def single(self, path: Optional[Path] = None) -> None:
        path = path or self.pick_checkpoint()
        self.say(f"Loading {printable(str(path))} ...")
        m = self.session.load(path)
        self.say(f"Loaded {printable(m.label)}: {m.n_params:,} parameters, {m.ckpt_kind}, {m.mode}, on "
                 f"{self.session.device}.")
        self.defaults = self.defaults.for_model(m.rules.defaults, self.flags, self.say)
        while True:
            text = self.read_prompt(m.chat)
            if text is None:
                return
            if text == "/clear":
                m.history.clear()
                self.say("(conversation cleared)")
                continue
            p = self.params()
            self.say(f"\n{self.c.bold}Generated:{self.c.reset}")
            try:
                _, st = self.session.generate(m, text, p, self.out, lambda s: self.say(s))
            except UsageError as e:                 # e.g. more new tokens than memory holds
                self.say(f"{self.c.red}{e}{self.c.reset}")
                continue
            self.say("")
            if st.stopped:
                self.say(f"{self.c.yellow}(generation stopped by Ctrl-C){self.c.reset}")
            self.say(f"{self.c.dim}{st.line()}{self.c.reset}")

    def compare(self) -> None:
        paths = self.pick_many()
        need = sum(_estimate_bytes(p, self.session.device) for p in paths)
        avail, why = available_bytes(self.session.device)
        if avail is None:
            self.session.unknown_memory(why, self.say)
        self.say(f"\n{len(paths)} model(s) selected; estimated memory {need / 1e6:,.0f} MB"
                 + (f" of {avail / 1e6:,.0f} MB available" if avail else "") + ".")
        if avail and need > 0.8 * avail:
            self.say(f"{self.c.red}Warning: the selected models may not fit in memory; choose "
                     f"fewer checkpoints if loading fails.{self.c.reset}")
        models = []
        for p in paths:
            self.say(f"Loading {printable(_label(p))} ...")
            models.append(self.session.load(p))
        while True:
            text = self.read_prompt(False)
            if text is None:
                return
            if text == "/clear":
                continue
            prm = self.params()
            results = []
            for i, m in enumerate(models, 1):
                m.history.clear()
                self.say(f"\n{self.c.bold}[{i}] {printable(m.label)}{self.c.reset}")
                try:
                    out, st = self.session.generate(m, text, prm, self.out, lambda s: self.say(s))
                except UsageError as e:             # e.g. more new tokens than memory holds
                    self.say(f"{self.c.red}{e}{self.c.reset}")
                    break
                self.say("")
                self.say(f"{self.c.dim}{st.line()}{self.c.reset}")
                results.append((m, out, st))
            if results:
                self.summary(results)

    def summary(self, results) -> None:
        c = self.c
        label = {id(m): printable(m.label) for m, _, _ in results}
        w = max(map(len, label.values()))
        self.say(f"\n{c.bold}Comparison{c.reset}")
        self.say(f"  {'model'.ljust(w)}  tokens  seconds  tokens/s  first token  output")
        for m, out, st in results:
            ttft = f"{st.ttft:.3f}" if st.ttft is not None else "n/a"
            snippet = printable(" ".join(out.split())[:50])
            self.say(f"  {label[id(m)].ljust(w)}  {st.tokens:6d}  {st.seconds:7.2f}  {st.rate:8.1f}  "
                     f"{ttft:>11}  {snippet}")
        fastest = min(results, key=lambda r: r[2].seconds)
        most = max(results, key=lambda r: r[2].tokens)
        rate = max(results, key=lambda r: r[2].rate)
        self.say(f"Fastest: {label[id(fastest[0])]}; most tokens: {label[id(most[0])]}; highest tokens/s: "
                 f"{label[id(rate[0])]}.")

    def benchmark(self) -> None:
        if not (ROOT / "benchmark.py").is_file():
            self.say("The benchmark stage is not available in this checkout.")
            return
        extra = ask("Arguments for `main.py benchmark` (Enter for none): ", "")
        cmd = [sys.executable, str(ROOT / "main.py"), "benchmark", *shlex.split(extra)]
        self.say("Running: " + " ".join(shlex.quote(x) for x in cmd[1:]))
        code = subprocess.call(cmd)
        self.say(f"benchmark finished with exit code {code}.")

    def menu(self) -> None:
        c = self.c
        self.say(f"{c.bold}Inference{c.reset}\n  1) Single model inference\n  2) Multi-model "
                 "comparison\n  3) Benchmark models\n  4) Quit")
        choice = self.choose_number("Select a mode", 4)
        if choice == 1:
            self.single()
        elif choice == 2:
            self.compare()
        elif choice == 3:
            self.benchmark()



def _estimate_bytes(path: Path, device=None) -> int:
    """The weights in memory while generating (utils.generation.pack), plus 20% for
    activations."""
    from utils.generation.pack import estimated_weight_bytes    # torch (see the imports)
    return int(estimated_weight_bytes(path.stat().st_size, getattr(device, "type", "cpu")) * 1.2)


# --------------------------------------------------------------------------- main
SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_k", "top_p")


def flags_given(args) -> set:
    """The sampling parameters given on the command line (their Params names)."""
    return {k for k in SAMPLING_FLAGS if getattr(args, f"cfg__inference__{k}", None) is not None}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, cfg = build_parser().parse(argv)
    inf = cfg.inference
    params = Params(inf.max_new_tokens, inf.temperature, inf.top_k, inf.top_p, args.seed)
    session = Session(cfg, raw=args.raw, quantize=args.quantize)
    if args.prompt is not None:
        return scripted(session, args, params)
    if args.json:
        raise UsageError("--json needs --prompt (scripted mode).")
    ui = UI(session, params, flags_given(args))
    try:
        if args.checkpoint:
            ui.single(Path(args.checkpoint))
        else:
            ui.menu()
    except EndOfInput:
        print("\n(end of input)")
    print("Bye.")
    return 0


if __name__ == "__main__":
    run_stage(main)
