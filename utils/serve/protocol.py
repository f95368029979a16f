"""The OpenAI request and response shapes of ``serve`` (library; no side effects).

Requests are read by hand rather than by pydantic models so that every refusal is OpenAI's
error body, ``{"error": {"message", "type", "param", "code"}}``, naming the field and what to
send instead (:class:`ApiError`). Fields read (docs/serve.md lists them and what is ignored):

- both: ``model``, ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature`` (0..2),
  ``top_p`` (0..1], ``top_k`` (extra field, >= 0), ``n``, ``seed``, ``stop`` (string or list of
  up to 4), ``stream``, ``stream_options.include_usage``, ``response_format`` (text, json_object,
  json_schema: :func:`read_response_format`), ``prompt_lookup_num_tokens`` (extra field, 0..64:
  prompt-lookup speculative decoding of a greedy request); ``presence_penalty`` /
  ``frequency_penalty`` only as 0 (refused otherwise: not implemented), other servers' sampling
  extras (``min_p``, ``repetition_penalty`` ...: :data:`SAMPLING_EXTRAS_OFF`) only as their
  "off" value, their structured-output extras (``guided_json`` ...) not at all (send
  ``response_format``); ``user`` ignored.
- completions: ``prompt`` (a string, or a list of one or more strings), ``logprobs`` (0..5),
  ``echo``; ``suffix``, ``best_of`` (beyond ``n``) and ``logit_bias`` refused.
- chat: ``messages`` (roles system / user / assistant / tool; content a string or a list of text
  parts; assistant ``tool_calls``), ``logprobs`` (bool) with ``top_logprobs`` (0..20), ``tools``,
  ``tool_choice`` and ``parallel_tool_calls`` (:func:`read_tool_fields`; the calls' grammar is
  built by :func:`build_grammar`, off the event loop); the legacy ``functions``, ``logit_bias``,
  other modalities, audio, predicted outputs and web search refused.

A field that would change what a request means, which this server cannot do, is refused
(400, ``unsupported_parameter``) unless it holds the value that means "off": never ignored.
An error message quotes a client's value only through :func:`shown` / :func:`clip` (bounded,
lone surrogates escaped), so every error body is short and encodes.
"""
from __future__ import annotations

import json
import math
import re
import reprlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from utils.data import tools as tool_format
from utils.generation.constrained import ConstraintError, json_grammar, tool_grammar


class ApiError(Exception):
    """An HTTP error with OpenAI's JSON body (and any response headers, e.g. Retry-After)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, type_: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_body(message: str, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


ECHO_CHARS = 200        # the most characters of a client's value an error message quotes

_ECHO = reprlib.Repr()
_ECHO.maxstring = _ECHO.maxother = _ECHO.maxlong = ECHO_CHARS
_ECHO.maxlevel = 2


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """A client's text as an error message quotes it: at most ``limit`` characters (then
    "... (N characters)"), lone surrogates written as ``\\udXXX`` (they are legal in JSON, not
    in UTF-8), so the body stays short and always encodes."""
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def shown(value: Any) -> str:
    """A client's JSON value as an error message quotes it: its repr (which writes lone
    surrogates as escapes), at most ECHO_CHARS characters (a long string or number elided in
    its middle, a container at a few items and two levels, then cut)."""
    text = _ECHO.repr(value)
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "..."


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


# --------------------------------------------------------------------------- field readers
_MISSING = object()


def _num(body: dict, key: str, default, lo=None, hi=None, integer=False, lo_open=False):
    v = body.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)) \
            or (isinstance(v, float) and not math.isfinite(v)):
        raise ApiError(400, f"'{key}' must be {kind}, got {type(v).__name__} {shown(v)}.", key,
                       "invalid_type")
    if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
        rng = f"{'(' if lo_open else '['}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise ApiError(400, f"'{key}' is {shown(v)}; it must be in {rng}.", key, "invalid_value")
    return v


def _bool(body: dict, key: str, default: bool, path: Optional[str] = None) -> bool:
    """``body[key]`` as true/false; an error names it by ``path`` (its place in the request,
    e.g. "stream_options.include_usage"), else by ``key``."""
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        name = path or key
        raise ApiError(400, f"'{name}' must be true or false, got {shown(v)}.", name, "invalid_type")
    return v


STOP_CHARS = 1000       # the longest stop string


def _stop(body: dict, max_chars: int = STOP_CHARS) -> tuple:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError(400, "'stop' must be a string or a list of strings.", "stop", "invalid_type")
    if len(items) > 4:
        raise ApiError(400, f"'stop' has {len(items)} strings; at most 4 are allowed.", "stop", "invalid_value")
    longest = max((len(s) for s in items), default=0)
    if longest > max_chars:
        raise ApiError(400, f"a 'stop' string has {longest} characters; at most {max_chars} are "
                       "allowed: send a shorter one.", "stop", "invalid_value")
    return tuple(_text(s, "stop") for s in items if s)


@dataclass
class Limits:
    max_messages: int = 64
    max_prompt_chars: int = 100_000
    max_n: int = 8
    default_max_tokens: int = 256
    read_timeout: float = 30.0          # seconds a body has to arrive (serve.read_timeout): then 408

    @property
    def max_body_bytes(self) -> int:
        """Room for the longest allowed prompt written as JSON escapes (``\\uXXXX``, 12 bytes
        for a character outside the BMP) plus 1 MiB for the rest of a request."""
        return 12 * self.max_prompt_chars + (1 << 20)


def _text(s: str, param: str) -> str:
    """``s`` if it is valid Unicode text (JSON can carry lone surrogates, which no tokenizer
    takes)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"'{param}' holds an unpaired surrogate (\\ud800-\\udfff): send valid "
                       "Unicode text.", param, "invalid_value") from None
    return s


@dataclass
class Sampling:
    """The generation fields shared by both endpoints (sampling fields the request leaves out
    are None: the served model's defaults apply, :meth:`ServedModel.sampling`)."""
    model: Optional[str]
    max_tokens: Optional[int]
    temperature: Optional[float]
    top_p: Optional[float]
    top_k: Optional[int]
    n: int
    seed: Optional[int]
    stop: tuple
    stream: bool
    include_usage: bool
    logprobs: Optional[int] = None        # None: not asked; k: the token's and k alternatives
    echo: bool = False
    max_tokens_param: str = "max_tokens"  # the field max_tokens came from (chat: or max_completion_tokens)
    grammar: Optional[str] = None         # the output grammar (utils/generation/constrained.py), once compiled
    constraint: Optional[tuple] = None    # what it is compiled from (compile_grammar): ("json", schema or None)
                                          # from response_format, ("tools", functions, choice, parallel)
    prompt_lookup: Optional[int] = None   # prompt_lookup_num_tokens (None: the server's default)
    tools: bool = False                   # the reply may hold tool calls (tool_choice not "none")


PROMPT_LOOKUP_MAX = 64     # draft tokens per step a request may ask for (rows of one verify pass)


def read_common(body: dict, limits: Limits, chat: bool) -> Sampling:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object.", None, "invalid_type")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string (GET /v1/models lists them).", "model", "invalid_type")
    max_tokens, max_tokens_param = _num(body, "max_tokens", None, lo=1, integer=True), "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _num(body, "max_completion_tokens", None, lo=1, integer=True)
        max_tokens_param = "max_completion_tokens"
    for key in ("presence_penalty", "frequency_penalty"):
        if _num(body, key, 0, lo=-2, hi=2) != 0:
            raise ApiError(400, f"'{key}' is not supported by this server (send 0 or leave it out).",
                           key, "unsupported_parameter")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object.", "stream_options", "invalid_type")
    stream = _bool(body, "stream", False)
    include_usage = _bool(opts or {}, "include_usage", False, "stream_options.include_usage")
    if opts and not stream:
        raise ApiError(400, "'stream_options' is only allowed with \"stream\": true.", "stream_options",
                       "invalid_value")
    _refuse_sampling_extras(body)
    seed = _num(body, "seed", None, integer=True)
    constraint = read_response_format(body.get("response_format"))
    temperature, top_p = _num(body, "temperature", None, lo=0, hi=2), _num(body, "top_p", None, lo=0, hi=1, lo_open=True)
    return Sampling(model, max_tokens, None if temperature is None else float(temperature),
                    None if top_p is None else float(top_p), _num(body, "top_k", None, lo=0, integer=True),
                    _num(body, "n", 1, lo=1, hi=limits.max_n, integer=True),
                    None if seed is None else int(seed) % (1 << 63),
                    _stop(body), stream, include_usage, max_tokens_param=max_tokens_param, constraint=constraint,
                    prompt_lookup=_num(body, "prompt_lookup_num_tokens", None, lo=0, hi=PROMPT_LOOKUP_MAX, integer=True))


# --------------------------------------------------------------------------- response_format
FORMAT_HELP = ("send {\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}, "
               "{\"type\": \"json_object\"} or {\"type\": \"text\"}")


def read_response_format(fmt: Any) -> Optional[tuple]:
    """``response_format`` as what the reply's grammar is made from (None: plain text):
    ``json_object`` any JSON object, ``json_schema`` JSON matching ``json_schema.schema`` (always
    enforced: ``strict`` changes nothing). 400 naming the field at fault; the grammar itself is
    compiled by :func:`build_grammar` (off the event loop), which names the schema features the
    grammar compiler lacks (``unsupported_schema``)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise ApiError(400, f"'response_format' must be an object with a 'type': {FORMAT_HELP}.",
                       "response_format", "invalid_type")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json", None)
    if kind != "json_schema":
        raise ApiError(400, f"'response_format.type' {shown(kind)} is not supported: {FORMAT_HELP}.",
                       "response_format.type", "invalid_value")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, "'response_format.json_schema' must be an object with 'name' and 'schema'.",
                       "response_format.json_schema", "invalid_type")
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise ApiError(400, f"'response_format.json_schema.name' must be 1 to 64 letters, digits, '_' or "
                       f"'-', got {shown(name)}.", "response_format.json_schema.name", "invalid_value")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ApiError(400, "'response_format.json_schema.strict' must be true or false.",
                       "response_format.json_schema.strict", "invalid_type")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ApiError(400, f"'response_format.json_schema.schema' must be a JSON Schema object, got "
                       f"{shown(schema)}.", "response_format.json_schema.schema", "invalid_type")
    return ("json", schema)


MAX_SCHEMA_BYTES = 64 * 1024       # the JSON text of a response_format schema, or of all tools' parameters


def constraint_size(constraint: tuple) -> int:
    """The bytes of JSON a grammar is compiled from (bounded by MAX_SCHEMA_BYTES)."""
    return len(json.dumps(constraint[1:], ensure_ascii=False).encode("utf-8"))


def build_grammar(constraint: tuple, lead: str = "", calls=None) -> str:
    """The grammar text of a request's constraint (:attr:`Sampling.constraint`; tools: in the
    model's call format ``calls``, utils/data/tools.py CallFormat, default ours); 400 naming what
    cannot be enforced. Compiling takes time that grows with the schema: serve runs this off its
    event loop, bounded (utils/serve/intake.py compile_grammar)."""
    kind = constraint[0]
    try:
        if kind == "json":
            return json_grammar(constraint[1])
        _, functions, choice, parallel = constraint
        return tool_grammar(functions, choice, parallel, lead, calls)
    except ConstraintError as e:
        if kind == "json":
            raise ApiError(400, f"'response_format.json_schema.schema' cannot be enforced: {clip(str(e))}. "
                           "Leave those features out of the schema.", "response_format.json_schema.schema",
                           "unsupported_schema") from None
        raise ApiError(400, f"the parameters of 'tools' cannot be enforced: {clip(str(e))}. Leave those "
                       "features out of the schemas.", "tools", "unsupported_schema") from None


# --------------------------------------------------------------------------- refused fields
# Sampling and decoding fields of other servers (vLLM, llama.cpp, text-generation-inference),
# which their clients send as extra fields: each with the value that leaves sampling as it is.
# Any other value is refused (this engine samples with temperature, top_k and top_p only); an
# unknown field that is none of these is ignored.
SAMPLING_EXTRAS_OFF = {"min_p": 0, "typical_p": 1, "tfs_z": 1, "top_a": 0, "repetition_penalty": 1,
                       "repeat_penalty": 1, "length_penalty": 1, "dynatemp_range": 0, "mirostat": 0,
                       "mirostat_mode": 0, "min_tokens": 0, "ignore_eos": False,
                       "use_beam_search": False, "skip_special_tokens": True}
GUIDED_EXTRAS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "grammar", "json_schema")


def _refuse_sampling_extras(body: dict) -> None:
    for key, off in SAMPLING_EXTRAS_OFF.items():
        v = body.get(key)
        same_kind = isinstance(v, bool) == isinstance(off, bool)       # true is not 1 here
        if v is not None and not (same_kind and v == off):
            raise _unsupported(key, f"{shown(v)} (another server's sampling option)",
                               f"send {json.dumps(off)} or leave it out")
    for key in GUIDED_EXTRAS:
        if body.get(key) is not None:
            raise _unsupported(key, "(another server's structured output)", "send 'response_format' "
                               "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": ...}}")


def _on(v: Any) -> bool:
    """Whether a field's value asks for something (null, "", [] and {} ask for nothing)."""
    return v is not None and not (isinstance(v, (str, list, dict)) and not v)


def _unsupported(key: str, what: str, instead: str) -> ApiError:
    return ApiError(400, f"'{key}' {what} is not supported by this server: {instead}.", key,
                    "unsupported_parameter")


def _refuse_completion_fields(body: dict, n: int) -> None:
    """Completion fields that would change the request's meaning, refused unless "off"."""
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or best_of not in (1, n)):
        raise _unsupported("best_of", f"{shown(best_of)} (ranking candidates)",
                           "leave it out, or send 1 or the same value as 'n'")
    if _on(body.get("suffix")):
        raise _unsupported("suffix", "(insertion)", "leave it out or send \"\"")
    if _on(body.get("logit_bias")):
        raise _unsupported("logit_bias", "(biasing tokens)", "leave it out or send {}")


def _refuse_chat_fields(body: dict) -> None:
    """Chat fields that would change the request's meaning, refused unless "off": the model
    writes text (JSON through ``response_format``, calls through ``tools``), so the legacy
    ``functions`` / ``function_call``, biased tokens, other modalities, predicted outputs and web
    search cannot be honoured."""
    if _on(body.get("functions")) and body.get("function_call") != "none":
        raise _unsupported("functions", "(the legacy form of tools)", "send 'tools' with {\"type\": \"function\", "
                           "\"function\": {...}} entries instead")
    if body.get("function_call") not in (None, "none", "auto"):
        raise _unsupported("function_call", f"{shown(body.get('function_call'))} (the legacy form of tool_choice)",
                           "send 'tool_choice' instead")
    if _on(body.get("logit_bias")):
        raise _unsupported("logit_bias", "(biasing tokens)", "leave it out or send {}")
    if body.get("modalities") not in (None, ["text"]):
        raise _unsupported("modalities", f"{shown(body.get('modalities'))} (it writes text only)",
                           "send [\"text\"] or leave it out")
    for key, what in (("audio", "(audio output)"), ("prediction", "(predicted outputs)"),
                      ("web_search_options", "(web search)")):
        if body.get(key) is not None:
            raise _unsupported(key, what, "leave it out")


def read_completion(body: dict, limits: Limits) -> tuple[Sampling, list[str]]:
    s = read_common(body, limits, chat=False)
    _refuse_completion_fields(body, s.n)
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING:
        raise ApiError(400, "'prompt' is required (a string, or a list of strings).", "prompt", "missing_required")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ApiError(400, "'prompt' must be a string or a non-empty list of strings (token-id "
                       "prompts are not supported).", "prompt", "invalid_type")
    prompts = [_text(p, "prompt") for p in prompts]
    if sum(len(p) for p in prompts) > limits.max_prompt_chars:
        raise ApiError(400, f"the prompt has more than {limits.max_prompt_chars} characters "
                       "(serve.max_prompt_chars).", "prompt", "prompt_too_long")
    if len(prompts) * s.n > limits.max_n:
        raise ApiError(400, f"{len(prompts)} prompts x n={s.n} choices is more than "
                       f"{limits.max_n} (serve.max_n).", "n", "invalid_value")
    lp = body.get("logprobs")
    if lp is not None:
        s.logprobs = _num(body, "logprobs", None, lo=0, hi=5, integer=True)
    if body.get("top_logprobs") is not None:                 # chat's field; completions count in logprobs
        raise ApiError(400, "'top_logprobs' is a chat field: on /v1/completions send \"logprobs\": k, the "
                       "number of alternatives (0..5).", "top_logprobs", "unsupported_parameter")
    s.echo = _bool(body, "echo", False)
    return s, prompts


@dataclass
class Chat:
    """A chat request's conversation: the system text (or ""), the finished (user, assistant)
    exchanges, and the last user message; a conversation with tools or tool turns is
    ``messages`` instead (utils/data/tools.py's normalized shape) with the ``functions`` the
    model may call."""
    system: str
    history: list = field(default_factory=list)
    question: str = ""
    messages: Optional[list] = None
    functions: list = field(default_factory=list)


def _content(msg: Any, i: int) -> str:
    c = msg.get("content")
    if isinstance(c, str):
        return _text(c, f"messages[{i}].content")
    if isinstance(c, list):
        parts = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}].content[{j}] must be a text part "
                               "({\"type\": \"text\", \"text\": ...}); images and audio are not supported.",
                               f"messages[{i}].content", "invalid_type")
            parts.append(part["text"])
        return _text("".join(parts), f"messages[{i}].content")
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts.",
                   f"messages[{i}].content", "invalid_type")


MAX_TOOLS = 128        # functions in one request's 'tools'


def read_tool_fields(body: dict) -> tuple[list, str, bool]:
    """``tools`` (functions, utils/data/tools.py), ``tool_choice`` ("none", "auto", "required" or
    a function's name; default "auto" with tools, "none" without) and ``parallel_tool_calls``
    (default true); 400 naming the field at fault."""
    raw = body.get("tools")
    functions: list = []
    if raw is not None:
        try:
            functions = tool_format.read_tools(raw, "tools")
        except tool_format.ToolFormatError as e:
            raise ApiError(400, f"'{e.where}' {clip(e.what)}.", e.where,
                           "unsupported_parameter" if e.where.endswith(".type") else "invalid_value") from None
    if len(functions) > MAX_TOOLS:
        raise ApiError(400, f"'tools' lists {len(functions)} functions; at most {MAX_TOOLS} are allowed.", "tools",
                       "invalid_value")
    choice = body.get("tool_choice")
    names = [f["name"] for f in functions]
    if choice is None:
        choice = "auto" if functions else "none"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"'tool_choice' {shown(choice)} is not supported: send \"none\", \"auto\", "
                           "\"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}.", "tool_choice",
                           "unsupported_parameter" if choice.get("type") != "function" else "invalid_value")
        if fn["name"] not in names:
            raise ApiError(400, f"'tool_choice.function.name' {shown(fn['name'])} is not a function in 'tools' "
                           f"({', '.join(names) or 'none listed'}).", "tool_choice.function.name", "invalid_value")
        choice = fn["name"]
    elif choice not in ("none", "auto", "required"):
        raise ApiError(400, f"'tool_choice' {shown(choice)} is not one of \"none\", \"auto\", \"required\" or "
                       "a named function.", "tool_choice", "invalid_value")
    if choice == "required" and not functions:
        raise ApiError(400, "'tool_choice' \"required\" needs 'tools' to call.", "tool_choice", "invalid_value")
    return functions, choice if functions else "none", _bool(body, "parallel_tool_calls", True)


def _tool_messages(msgs: list, functions: list, limits: Limits) -> list[dict]:
    """A conversation with tool turns, normalized (utils/data/tools.py); it ends with a user
    or tool turn."""
    try:
        out = tool_format.read_messages(msgs, "messages")
    except tool_format.ToolFormatError as e:
        raise ApiError(400, f"{e.where}: {clip(e.what)}.", e.where, "invalid_value") from None
    if out[-1]["role"] not in ("user", "tool"):
        raise ApiError(400, "the last message must be from the user or a tool (the model answers it).",
                       "messages", "invalid_value")
    for i, m in enumerate(out):
        if m.get("content") is not None:
            _text(m["content"], f"messages[{i}].content")
    size = sum(len(m.get("content") or "") + sum(len(json.dumps(c["function"]["arguments"])) for c in m.get("tool_calls", ()))
               for m in out)
    if size > limits.max_prompt_chars:
        raise ApiError(400, f"the messages have more than {limits.max_prompt_chars} characters "
                       "(serve.max_prompt_chars).", "messages", "prompt_too_long")
    return out


def _read_tool_chat(body: dict, s: Sampling, msgs: list, fields: tuple, limits: Limits) -> Chat:
    """A chat with tools or tool turns: its messages normalized, and ``s`` given the calls'
    constraint (``tools``: the reply may call them)."""
    functions, choice, parallel = fields
    if any(isinstance(m, dict) and _on(m.get("function_call")) for m in msgs):
        i = next(i for i, m in enumerate(msgs) if isinstance(m, dict) and _on(m.get("function_call")))
        raise ApiError(400, f"messages[{i}].function_call is the legacy form of a call: send 'tool_calls'.",
                       f"messages[{i}].function_call", "unsupported_parameter")
    messages = _tool_messages(msgs, functions, limits)
    if choice != "none" and s.constraint is not None:
        raise _unsupported("response_format", "with 'tools' (a reply is text or calls)",
                           "leave response_format out, or send \"tool_choice\": \"none\"")
    if s.logprobs is not None or body.get("logprobs"):
        raise _unsupported("logprobs", "with 'tools'", "leave logprobs out when sending tools")
    if functions and s.constraint is None:
        s.constraint = ("tools", functions, choice, parallel)
    s.tools = choice != "none"
    return Chat("", [], messages[-1].get("content") or "", messages=messages, functions=functions)


def read_chat(body: dict, limits: Limits) -> tuple[Sampling, Chat]:
    s = read_common(body, limits, chat=True)
    _refuse_chat_fields(body)
    functions, choice, parallel = read_tool_fields(body)
    msgs = body.get("messages", _MISSING)
    shaped = functions or (isinstance(msgs, list) and any(
        isinstance(m, dict) and (m.get("role") == "tool" or _on(m.get("tool_calls")) or _on(m.get("function_call")))
        for m in msgs))
    if shaped and isinstance(msgs, list) and msgs and len(msgs) <= limits.max_messages:
        return s, _read_tool_chat(body, s, msgs, (functions, choice, parallel), limits)
    if msgs is _MISSING:
        raise ApiError(400, "'messages' is required.", "messages", "missing_required")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects.",
                       "messages", "invalid_type")
    if len(msgs) > limits.max_messages:
        raise ApiError(400, f"'messages' has {len(msgs)} entries; at most {limits.max_messages} are "
                       "allowed (serve.max_messages).", "messages", "too_many_messages")
    system, turns = [], []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object with 'role' and 'content'.",
                           f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"messages[{i}].role is {shown(role)}; this server takes 'system', "
                           "'user', 'assistant' and 'tool'.", f"messages[{i}].role", "invalid_value")
        text = _content(m, i)
        if role in ("system", "developer"):
            if turns:
                raise ApiError(400, f"messages[{i}]: a system message must come before the "
                               "conversation.", f"messages[{i}].role", "invalid_value")
            system.append(text)
            continue
        want = "user" if len(turns) % 2 == 0 else "assistant"
        if role != want:
            raise ApiError(400, f"messages[{i}].role is '{role}' where '{want}' was expected: the "
                           "conversation must alternate user / assistant, starting with user.",
                           f"messages[{i}].role", "invalid_value")
        turns.append(text)
    if not turns or len(turns) % 2 == 0:
        raise ApiError(400, "the last message must be from the user (the model answers it).",
                       "messages", "invalid_value")
    if sum(len(t) for t in turns) + sum(len(t) for t in system) > limits.max_prompt_chars:
        raise ApiError(400, f"the messages have more than {limits.max_prompt_chars} characters "
                       "(serve.max_prompt_chars).", "messages", "prompt_too_long")
    if _bool(body, "logprobs", False):
        s.logprobs = _num(body, "top_logprobs", 0, lo=0, hi=20, integer=True)
    elif body.get("top_logprobs") is not None:
        raise ApiError(400, "'top_logprobs' needs \"logprobs\": true.", "top_logprobs", "invalid_value")
    pairs = [(turns[i], turns[i + 1]) for i in range(0, len(turns) - 1, 2)]
    return s, Chat("\n\n".join(system), pairs, turns[-1])


def now() -> int:
    return int(time.time())


ORIGIN = re.compile(r"https?://[^/?#\s]+")


def check_origins(origins: list) -> list[str]:
    """Problems of ``serve.cors_origins``: each must be "*" or an origin as a browser sends it,
    ``scheme://host[:port]`` (no path, not even a trailing "/", which no Origin header has)."""
    out = []
    for i, o in enumerate(origins):
        if o != "*" and not (isinstance(o, str) and ORIGIN.fullmatch(o)):
            out.append(f"serve.cors_origins[{i}] {shown(o)}: expected \"*\" or an origin such as "
                       "\"http://localhost:3000\" (scheme://host[:port], no path or trailing /)")
    return out


# a LoRA adapter's name (serve --adapter, POST /v1/adapters): a request names it "base:name"
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def adapter_name_problem(name: str) -> Optional[str]:
    """Why ``name`` cannot name an adapter (None: it can): 1-64 letters, digits, '.', '_', '-'
    (no ':' or '/': a request names it as ``base:name``)."""
    if not isinstance(name, str) or not ADAPTER_NAME.match(name):
        return (f"adapter name {str(name)[:80]!r} is not 1-64 letters, digits, '.', '_' or '-' "
                "(starting with a letter or digit)")
    return None
