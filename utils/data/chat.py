"""A model's own rules for framing text: its chat template, BOS rule, stop tokens and generation
defaults (library; no side effects). The one place infer, serve, benchmark, sft and export
learn how a model wants its prompts.

    rules = rules_of_hf(tok, add_bos, config, folder, where)    an imported Hugging Face model
    rules = rules_of_checkpoint(ckpt, tok)                      a checkpoint of ours
    rules.prompt_ids(tok, text)                                 a plain (completion) prompt
    chat_prompt_ids(tok, rules.template, system, history, q)    a chat prompt, generation prompt added
    encode_conversations(tok, template, conversations, bos, eos)   SFT examples: (ids, loss mask)

Contracts (docs/sft_inference.md, "Public models"):

- **Templates are data.** Ours (``user-assistant-v1``/``-v2``, utils/data/sft.py) is the default for
  models trained here. A public model's own Jinja template is stored as
  ``{"name": "jinja", "template": SOURCE, "end_of_turn": TOKEN or None, "source": WHERE}`` (in SFT
  metadata and in checkpoints) and rendered by transformers' ``apply_chat_template`` exactly as the
  model's authors wrote it: for the same messages the ids equal
  ``tokenizer.apply_chat_template(messages, tokenize=True)``. One difference, on purpose: a control
  token typed inside a message (``"<|im_end|>"`` in a user's text) is encoded as ordinary text
  (transformers' ``sanitize_control_tokens``), so a message can never close its own turn or open
  another; only the template writes control tokens.
- **BOS.** A plain prompt starts with BOS when the model's tokenizer puts one there itself
  (transformers' rule: SmolLM2's tokenizer does not, Llama's does); models trained here always do
  (every training document is BOS + text + EOS). A chat prompt has exactly what its template writes.
- **Stop tokens.** Generation ends at any of the model's stop ids: its generation_config.json's
  ``eos_token_id`` (a number or a list, as transformers reads it), else config.json's, else the
  tokenizer's EOS; plus, for a model with a Jinja template, the token that ends an assistant turn
  in that template (the last control token of a rendered assistant turn), as llama.cpp adds its
  end-of-turn tokens.
- **Generation defaults.** The sampling settings a model's generation_config.json writes
  explicitly (temperature, top_k, top_p, max_new_tokens; as vLLM applies them) replace the
  ``inference`` section's; flags on the command line and fields of a request still win.
- **SFT loss with a model's template.** Each assistant turn is trained on from the end of its
  generation prompt (what ``add_generation_prompt`` renders) through the last control token of its
  rendering (SmolLM2: the answer and ``<|im_end|>``, not the newline after it), which is what the
  model generates before it stops. A conversation whose rendering does not begin with each of its
  generation prompts' ids (a template that rewrites earlier turns, or an answer whose first
  characters join the prompt's last token) is skipped, as our own template's are.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from jinja2 import TemplateError

from utils.cli import PipelineError
from utils.data import sft, tools
from utils.data.tok import encode_plain

JINJA = sft.TEMPLATE_JINJA
GENERATION_KEYS = ("temperature", "top_k", "top_p", "max_new_tokens")   # read from generation_config.json
_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


class ChatTemplateError(PipelineError):
    """The model's template refused the messages (its own ``raise_exception``) or failed to render."""


@dataclass(frozen=True)
class Rules:
    """How one model frames text (see the module docstring)."""
    template: Optional[dict]                 # chat template as data; None: plain completions only
    add_bos: bool                            # a plain prompt starts with BOS
    stop_ids: tuple = ()                     # generation ends at any of these
    defaults: dict = field(default_factory=dict)   # explicit generation_config.json settings
    source: str = "trained here"
    files: Optional[dict] = None             # the model's own config.json and generation_config.json
                                             # (utils.hf.export.hf_source): what its exports keep
    imported: bool = False                   # from a public model's own files (checkpoints record them)

    @property
    def chat(self) -> bool:
        return self.template is not None

    def prompt_ids(self, tok, text: str) -> list[int]:
        """A plain prompt's ids: BOS when the model's rule says so, then the text as ordinary text."""
        ids = encode_plain(tok, [text])[0]
        return [tok.bos_token_id] + ids if self.add_bos and tok.bos_token_id is not None else ids

    def to_dict(self) -> dict:
        """The checkpoint entry ``model_rules`` of a run started from a public model (the template
        is the entry ``chat_template``)."""
        out = {"add_bos": self.add_bos, "stop_ids": list(self.stop_ids), "defaults": dict(self.defaults),
               "source": self.source}
        return out if self.files is None else {**out, "files": self.files}

    @classmethod
    def ours(cls, tok, template: Optional[dict] = None) -> "Rules":
        """The rules of a model trained here: BOS in front of a prompt, stop at EOS (and at the
        end of a turn of ``template``)."""
        return cls(template, tok.bos_token_id is not None, stop_ids_of(None, tok, template))

    def without_template(self) -> "Rules":
        return dataclasses.replace(self, template=None)


# --------------------------------------------------------------------------- building the rules
def template_source(tok) -> Optional[str]:
    """The tokenizer's own chat template (its default one when it has several), or None."""
    src = getattr(tok, "chat_template", None)
    if isinstance(src, dict):
        src = src.get("default")
    return src if isinstance(src, str) and src.strip() else None


def jinja_record(tok, source: str, where: str) -> dict:
    """A model's Jinja template as the data stored in SFT metadata and checkpoints."""
    record = {"name": JINJA, "template": source, "end_of_turn": None, "source": where,
              "encoding": "rendered by transformers' apply_chat_template; control tokens inside "
                          "messages are encoded as text",
              "loss": "each assistant turn from the end of its generation prompt through its last "
                      "control token"}
    span = _assistant_span(tok, record, _PROBE)
    specials = set(tok.all_special_ids)
    ends = [t for t in (span or []) if t in specials]
    record["end_of_turn"] = tok.convert_ids_to_tokens(ends[-1]) if ends else None
    return record


def _assistant_span(tok, template: dict, messages: list[dict]) -> Optional[list[int]]:
    """The ids the template adds for the last (assistant) message, or None when it will not say."""
    try:
        prompt = render_ids(tok, template, messages[:-1], add_generation_prompt=True)
        full = render_ids(tok, template, messages, add_generation_prompt=False)
    except ChatTemplateError:
        return None
    return full[len(prompt):] if full[:len(prompt)] == prompt else None


def stop_ids_of(eos, tok, template: Optional[dict]) -> tuple[int, ...]:
    """The stop ids: ``eos`` (an id, a list, or None: the tokenizer's EOS), plus the template's
    end-of-turn token."""
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not ids and tok.eos_token_id is not None:
        ids = [tok.eos_token_id]
    turn_end = (template or {}).get("end_of_turn")
    if turn_end is not None:
        ids.append(tok.convert_tokens_to_ids(turn_end))
    return tuple(dict.fromkeys(int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool)))


def adds_bos(tok) -> bool:
    """Whether the tokenizer, as transformers loads it, puts BOS in front of a text by itself."""
    enc = tok.encode("a")
    bare = tok.encode("a", add_special_tokens=False)
    return tok.bos_token_id is not None and len(enc) > len(bare) and enc[0] == tok.bos_token_id


_SETTING_OK = {"temperature": lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v >= 0,
               "top_k": lambda v: isinstance(v, int) and v >= 0,
               "top_p": lambda v: isinstance(v, (int, float)) and 0 < v <= 1,
               "max_new_tokens": lambda v: isinstance(v, int) and v >= 1}


def generation_file_settings(folder: Optional[Path]) -> tuple[dict, object, list[str]]:
    """(sampling settings written explicitly in the folder's generation_config.json, its
    ``eos_token_id`` or None, the settings left out for a value out of range). Call only once
    utils.hf.inputs.generation_config_notice found the file usable (or absent)."""
    path = Path(folder) / "generation_config.json" if folder is not None else None
    if path is None or not path.is_file():
        return {}, None, []
    data = json.loads(path.read_text(encoding="utf-8"))
    written = {k: data[k] for k in GENERATION_KEYS if data.get(k) is not None}
    settings = {k: v for k, v in written.items() if not isinstance(v, bool) and _SETTING_OK[k](v)}
    bad = [f"{k} {written[k]!r}" for k in written if k not in settings]
    if data.get("do_sample") is False and "temperature" in settings:
        settings["temperature"] = 0.0           # transformers samples only with do_sample true
    return settings, data.get("eos_token_id"), bad


def rules_of_hf(tok, add_bos: bool, config, folder: Optional[Path], where: str,
                generation_file_usable: bool = True, files: Optional[dict] = None) -> Rules:
    """The rules of a Hugging Face folder or GGUF file: ``tok`` is the pipeline's copy of its
    tokenizer (its chat template kept), ``add_bos`` what :func:`adds_bos` says of the tokenizer
    as transformers loads it, ``config`` the transformers config; ``folder`` holds
    generation_config.json (None for a GGUF file)."""
    source = template_source(tok)
    template = jinja_record(tok, source, where) if source else None
    settings, eos, bad = generation_file_settings(folder) if generation_file_usable else ({}, None, [])
    if bad:
        print(f"notice: {folder}/generation_config.json: {', '.join(bad)} left out (out of range); the "
              "inference section's value is used instead.", file=sys.stderr)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    return Rules(template, add_bos, stop_ids_of(eos, tok, template), settings, where, files, imported=True)


def rules_of_checkpoint(ckpt: dict, tok) -> Rules:
    """A checkpoint's rules: those it recorded (a run started from a Hugging Face model), else
    ours (BOS, stop at EOS); the template is its ``chat_template`` entry."""
    template = ckpt.get("chat_template")
    stored = ckpt.get("model_rules") or {}
    stops = tuple(int(i) for i in stored.get("stop_ids") or ()) or stop_ids_of(None, tok, template)
    return Rules(template, bool(stored.get("add_bos", tok.bos_token_id is not None)), stops,
                 dict(stored.get("defaults") or {}), str(stored.get("source", "trained here")), stored.get("files"),
                 imported=bool(stored))


# --------------------------------------------------------------------------- rendering
def _chat_tokenizer(tok):
    """A copy of ``tok`` that reads control tokens (the pipeline's own has special-token matching
    off, utils.data.tok.plain), made once per tokenizer."""
    view = getattr(tok, "pipeline_chat_view", None)
    if view is None:
        view = copy.deepcopy(tok)          # the backend's encode_special_tokens is not copied: off
        view.split_special_tokens = False
        tok.pipeline_chat_view = view
    return view


def render_ids(tok, template: dict, messages: Sequence[dict], add_generation_prompt: bool,
               functions: Optional[Sequence[dict]] = None) -> list[int]:
    """The ids of ``messages`` (``{"role", "content"}`` dicts; tool use: utils/data/tools.py's
    normalized shape) through a Jinja template record, with ``functions`` as its ``tools``."""
    kw = {"tools": tools.as_transformers_tools(list(functions))} if functions else {}
    try:
        ids = _chat_tokenizer(tok).apply_chat_template(
            [_for_template(m) for m in messages], chat_template=template["template"], tokenize=True,
            return_dict=False, add_generation_prompt=add_generation_prompt, sanitize_control_tokens=True, **kw)
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template refused the conversation: {e}") from None
    return list(ids)


def _for_template(m: dict) -> dict:
    """A message as templates read it: no null fields (an assistant turn that only calls tools
    has content "")."""
    out = {k: v for k, v in m.items() if v is not None}
    if "content" not in out:
        out["content"] = ""
    return out


def knows_tools(tok, template: Optional[dict]) -> bool:
    """Whether a chat template renders tools: ours does (utils/data/tools.py; not v1); a Jinja
    template when a probe tool's name, and a call of it, appear in what it renders (transformers
    passes ``tools`` to every template, and one that does not use them drops them silently)."""
    if template is None:
        return False
    if template.get("name") != JINJA:
        return template.get("name") == sft.TEMPLATE_V2
    fn = {"name": "probe_tool_zq", "description": "probe", "parameters": {"type": "object", "properties": {
        "xq": {"type": "integer"}}}}
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"type": "function", "id": "call_1", "function": {"name": "probe_tool_zq", "arguments": {"xq": 7}}}]},
                {"role": "tool", "name": "probe_tool_zq", "content": "resultzq", "tool_call_id": "call_1"}]
    try:
        with_tools = tok.decode(render_ids(tok, template, messages[:1], True, [fn]))
        call = tok.decode(render_ids(tok, template, messages, False, [fn]))
    except (ChatTemplateError, TypeError, KeyError):
        return False
    return "probe_tool_zq" in with_tools and "resultzq" in call and call.count("probe_tool_zq") >= 2


def call_format(tok, template: Optional[dict]) -> Optional[tools.CallFormat]:
    """How a chat template that renders tools (:func:`knows_tools`) writes calls, when serve can
    read and constrain it: ours (utils/data/tools.py), or a Jinja template's own when it is the
    ``<tool_call>`` JSON shape (:func:`tools.read_call_format`: Hermes, Qwen2.5); None otherwise
    (Llama 3.1's bare JSON, Mistral's ``[TOOL_CALLS]``, ...)."""
    if not knows_tools(tok, template):
        return None
    if template.get("name") != JINJA:
        return tools.OUR_CALLS
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "id": f"call_{k}", "function": {"name": n, "arguments": a}}
                    for k, (n, a) in enumerate(tools.PROBE_CALLS)]}]
    fn = {"name": tools.PROBE_CALLS[0][0], "description": "probe", "parameters": {"type": "object"}}
    try:
        text = _chat_tokenizer(tok).apply_chat_template(
            messages, chat_template=template["template"], tokenize=False, add_generation_prompt=False,
            tools=tools.as_transformers_tools([fn]))
    except (TemplateError, TypeError, KeyError):
        return None
    return tools.read_call_format(text)


def messages_of(system: str, history: Sequence[tuple[str, str]], question: Optional[str]) -> list[dict]:
    out = [{"role": "system", "content": system}] if system else []
    for q, a in history:
        out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    if question is not None:
        out.append({"role": "user", "content": question})
    return out


def chat_prompt_ids(tok, template: dict, system: str, history: Sequence[tuple[str, str]], question: str) -> list[int]:
    """A chat prompt (earlier exchanges, the new question, the generation prompt). Our template
    has no system role: the system text opens the first user turn, separated by a blank line."""
    if template.get("name") == JINJA:
        return render_ids(tok, template, messages_of(system, history, question), add_generation_prompt=True)
    history = [list(p) for p in history]
    if system:
        if history:
            history[0][0] = f"{system}\n\n{history[0][0]}"
        else:
            question = f"{system}\n\n{question}"
    return sft.encode_prompt(tok, template, [tuple(p) for p in history], question, tok.bos_token_id,
                             tok.eos_token_id)


def answer_decoding(template: Optional[dict]) -> tuple[bool, str]:
    """``(continues, lead)`` for utils.generation.engine.TextDecoder: a completion continues its
    prompt; an answer through a model's template is decoded on its own (as transformers users
    decode ``output[len(prompt):]``); ours as utils/data/sft.py says."""
    if template is None:
        return True, ""
    if template.get("name") == JINJA:
        return False, ""
    return sft.answer_decoding(template)


# --------------------------------------------------------------------------- SFT examples
def encode_conversations(tok, template: dict, conversations: Sequence[Sequence[str]], bos_id, eos_id
                         ) -> list[Optional[tuple[list[int], list[int]]]]:
    """``(ids, mask)`` of each conversation (user, assistant, ... turns), or None for one that
    cannot be framed exactly (see the module docstring); ours: utils/data/sft.py."""
    if template.get("name") != JINJA:
        return sft.encode_conversations(tok, template, conversations, bos_id, eos_id)
    specials = set(tok.all_special_ids)
    return [_jinja_example(tok, template, turns, specials) for turns in conversations]


def encode_records(tok, template: dict, records: Sequence[dict], bos_id, eos_id
                   ) -> list[Optional[tuple[list[int], list[int]]]]:
    """``(ids, mask)`` of each SFT record (utils/data/sft.py): LIMA's ``conversations``, or the
    conversational ``messages`` (with ``tools``: tool use) shape, which our template frames as
    utils/data/tools.py writes it and a Jinja template through ``apply_chat_template(tools=...)``;
    None for one that cannot be framed exactly. The loss covers the assistant's turns (its calls
    and its answers), never a tool's result."""
    out: list = [None] * len(records)
    plain = [i for i, r in enumerate(records) if "messages" not in r]
    for i, pair in zip(plain, encode_conversations(tok, template, [records[i]["conversations"] for i in plain],
                                                   bos_id, eos_id)):
        out[i] = pair
    shaped = [i for i, r in enumerate(records) if "messages" in r]
    if not shaped:
        return out
    if template.get("name") == JINJA:
        specials = set(tok.all_special_ids)
        for i in shaped:
            out[i] = _jinja_example(tok, template, records[i]["messages"], specials, records[i]["tools"])
        return out
    if template.get("name") != sft.TEMPLATE_V2:
        raise PipelineError(f"chat template {template.get('name')!r} cannot frame 'messages' records (tool use); "
                            "prepare the data with template user-assistant-v2 (sft prepare's default).")
    plans = [[(e.opening, e.answer, e.tool) for e in tools.exchanges(records[i]["messages"], records[i]["tools"])]
             for i in shaped]
    for i, pair in zip(shaped, sft.encode_exchanges(tok, template, plans, bos_id, eos_id)):
        out[i] = pair
    return out


def tool_prompt_ids(tok, template: dict, messages: Sequence[dict], functions: Sequence[dict]) -> list[int]:
    """A chat prompt from normalized messages (utils/data/tools.py: tool calls and their results
    included) and the functions the model may call, generation prompt added."""
    if template.get("name") == JINJA:
        return render_ids(tok, template, messages, True, functions)
    plans = [(e.opening, e.answer, e.tool) for e in tools.exchanges(list(messages), list(functions))]
    return sft.encode_exchange_prompt(tok, template, plans, tok.bos_token_id, tok.eos_token_id)


def _jinja_example(tok, template: dict, turns: Sequence, specials: set, functions: Optional[Sequence[dict]] = None
                   ) -> Optional[tuple[list[int], list[int]]]:
    if turns and isinstance(turns[0], dict):
        messages = list(turns)
    else:
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    try:
        full = render_ids(tok, template, messages, messages[-1]["role"] != "assistant", functions)
        mask = [0] * len(full)
        for k in [k for k, m in enumerate(messages) if m["role"] == "assistant"]:
            prompt = render_ids(tok, template, messages[:k], True, functions)
            upto = render_ids(tok, template, messages[:k + 1], False, functions)
            if full[:len(prompt)] != prompt or full[:len(upto)] != upto or len(upto) <= len(prompt):
                return None
            span = upto[len(prompt):]
            ends = [i for i, t in enumerate(span) if t in specials]
            stop = len(prompt) + (ends[-1] + 1 if ends else len(span))
            mask[len(prompt):stop] = [1] * (stop - len(prompt))
    except ChatTemplateError:
        return None
    return full, mask
