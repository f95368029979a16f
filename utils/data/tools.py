"""Tool use in chat: the conversational shape transformers and TRL use for tools, read and
checked, and our own documented text format for tool calls (library; no side effects).

The shape (transformers' ``apply_chat_template(messages, tools=...)``, TRL's SFT datasets, and
OpenAI's chat API, which differs only where noted):

    {"tools": [{"type": "function", "function": {"name", "description", "parameters": SCHEMA}}, ...],
     "messages": [{"role": "system", "content": ...},             optional, first
                  {"role": "user", "content": ...},
                  {"role": "assistant", "content": TEXT or null,
                   "tool_calls": [{"type": "function", "id": ...,   (id: OpenAI's; optional here)
                                   "function": {"name": ..., "arguments": {...} or JSON text}}]},
                  {"role": "tool", "name": ... or "tool_call_id": ..., "content": RESULT},
                  {"role": "assistant", "content": "the answer"}]}

A bare function dict (``{"name", "description", "parameters"}``, no ``"type"``) is read as
``{"type": "function", "function": it}``. :func:`read_tools` and :func:`read_messages` return the
normalized shape (arguments as dicts, every tool turn with its function's ``name``) or raise
:class:`ToolFormatError` naming the field at fault.

**Our format** (template ``user-assistant-v2``, utils/data/sft.py; docs/sft_inference.md "Tool
use"). A conversation is exchanges, each ONE text between BOS and EOS; an exchange's first part
is a user turn or the results of the calls before it:

    <s>User: [system\\n\\n][Tools:\\n{"name": ..., "description": ..., "parameters": ...}\\n...\\n\\n]question
    Assistant: [text\\n]<tool_call>{"name": "f", "arguments": {...}}</tool_call>[\\n<tool_call>...</tool_call>]</s>
    <s>Tool: {"name": "f", "content": "result"}[\\nTool: {...}]
    Assistant: the answer</s>

JSON in it is ``json.dumps`` with its default separators (``", "`` and ``": "``), non-ASCII kept;
the tools block is written once, in the first user turn. The loss covers each assistant part
(the call and the answer) and its EOS, never a tool's result. :func:`parse_reply` reads a
reply back into text and calls. :class:`CallFormat` says how a template writes calls (ours;
a public model's own ``<tool_call>`` JSON, read by :func:`read_call_format`), which serve's
grammar follows.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOLS_HEADER = "Tools:"
TOOL_PREFIX = "Tool: "
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")      # OpenAI's rule for function names


class ToolFormatError(ValueError):
    """A tools list or a message that is not the shape above: ``where`` names the field."""

    def __init__(self, where: str, what: str):
        super().__init__(f"{where}: {what}")
        self.where, self.what = where, what


def dumps(value: Any) -> str:
    """JSON as our format writes it (default separators, non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False)


# --------------------------------------------------------------------------- reading
def read_tools(tools: Any, where: str = "tools") -> list[dict]:
    """The functions of a tools list, each ``{"name", "description", "parameters"}``
    (description "" and parameters ``{"type": "object", "properties": {}}`` when left out)."""
    if not isinstance(tools, list):
        raise ToolFormatError(where, f"must be a list of functions, got a {type(tools).__name__}")
    out, seen = [], set()
    for i, t in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(t, dict):
            raise ToolFormatError(at, "must be an object ({\"type\": \"function\", \"function\": {...}})")
        if "type" in t or "function" in t:
            if t.get("type") != "function":
                raise ToolFormatError(f"{at}.type", f"{t.get('type')!r} is not supported: only \"function\"")
            fn, at = t.get("function"), f"{at}.function"
            if not isinstance(fn, dict):
                raise ToolFormatError(at, "must be an object with 'name' and 'parameters'")
        else:
            fn = t
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolFormatError(f"{at}.name", "must be 1 to 64 letters, digits, '_' or '-'")
        if name in seen:
            raise ToolFormatError(f"{at}.name", f"{name!r} is listed twice")
        seen.add(name)
        desc = fn.get("description", "")
        if desc is None:
            desc = ""
        if not isinstance(desc, str):
            raise ToolFormatError(f"{at}.description", "must be a string")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolFormatError(f"{at}.parameters", "must be a JSON Schema object")
        out.append({"name": name, "description": desc, "parameters": params})
    return out


def as_transformers_tools(functions: list[dict]) -> list[dict]:
    """The functions as transformers' templates take them (``{"type": "function", "function"}``)."""
    return [{"type": "function", "function": dict(f)} for f in functions]


def _arguments(value: Any, where: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ToolFormatError(where, f"is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ToolFormatError(where, "must be a JSON object (or its text)")
    return value


def _text(m: dict, where: str, required: bool) -> Optional[str]:
    c = m.get("content")
    if c is None and not required:
        return None
    if isinstance(c, list):               # OpenAI's text parts
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c):
            raise ToolFormatError(f"{where}.content", "parts must be text parts ({\"type\": \"text\", \"text\"})")
        c = "".join(p["text"] for p in c)
    if not isinstance(c, str):
        raise ToolFormatError(f"{where}.content", "must be a string")
    return c


def read_messages(messages: Any, where: str = "messages") -> list[dict]:
    """Messages in the shape above, normalized: ``{"role", "content"}`` for system / user /
    assistant text, ``{"role": "assistant", "content": TEXT or None, "tool_calls": [{"type":
    "function", "id": ..., "function": {"name", "arguments": dict}}]}``, and ``{"role": "tool",
    "name", "content", "tool_call_id"}``. Order: an optional system message, then a user turn;
    after each user turn an assistant turn; after an assistant turn with calls, one tool turn
    per call (matched by ``tool_call_id`` or ``name``), then an assistant turn again."""
    if not isinstance(messages, list) or not messages:
        raise ToolFormatError(where, "must be a non-empty list of messages")
    out: list[dict] = []
    pending: list[dict] = []                  # calls not yet answered by a tool turn
    for i, m in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise ToolFormatError(at, "must be an object with 'role' and 'content'")
        role = m.get("role")
        if role == "developer":
            role = "system"
        prev = out[-1]["role"] if out else None
        if role == "system":
            if out:
                raise ToolFormatError(f"{at}.role", "a system message must come first")
            out.append({"role": "system", "content": _text(m, at, True)})
        elif role == "user":
            if pending:
                raise ToolFormatError(f"{at}.role", f"expected a 'tool' turn with the result of "
                                      f"{pending[0]['function']['name']!r}")
            if prev in ("user", "tool"):
                raise ToolFormatError(f"{at}.role", f"a user turn after a {prev} turn; expected 'assistant'")
            out.append({"role": "user", "content": _text(m, at, True)})
        elif role == "assistant":
            if pending:
                raise ToolFormatError(f"{at}.role", f"expected a 'tool' turn with the result of "
                                      f"{pending[0]['function']['name']!r}")
            if prev not in ("user", "tool"):
                raise ToolFormatError(f"{at}.role", "an assistant turn must follow a user or tool turn")
            msg = _assistant_turn(m, at)
            out.append(msg)
            pending = list(msg.get("tool_calls", ()))
        elif role == "tool":
            if not pending:
                raise ToolFormatError(f"{at}.role", "a tool turn must answer a call of the assistant turn before it")
            out.append(_tool_turn(m, at, pending))
        else:
            raise ToolFormatError(f"{at}.role", f"{role!r}: expected 'system', 'user', 'assistant' or 'tool'")
    if pending:
        raise ToolFormatError(where, f"the call of {pending[0]['function']['name']!r} has no 'tool' turn with its result")
    return out


def _assistant_turn(m: dict, at: str) -> dict:
    """An assistant message, its calls' arguments read into dicts."""
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ToolFormatError(f"{at}.tool_calls", "must be a list")
    norm = []
    for j, c in enumerate(calls):
        cat = f"{at}.tool_calls[{j}]"
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
            raise ToolFormatError(cat, "must be {\"type\": \"function\", \"function\": {\"name\", \"arguments\"}}")
        if c.get("type", "function") != "function":
            raise ToolFormatError(f"{cat}.type", "only \"function\" calls are supported")
        name = c["function"].get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolFormatError(f"{cat}.function.name", "must be 1 to 64 letters, digits, '_' or '-'")
        cid = c.get("id")
        if cid is not None and not isinstance(cid, str):
            raise ToolFormatError(f"{cat}.id", "must be a string")
        norm.append({"type": "function", "id": cid,
                     "function": {"name": name, "arguments": _arguments(c["function"].get("arguments", {}),
                                                                        f"{cat}.function.arguments")}})
    text = _text(m, at, not norm)
    if not norm and not (text or "").strip():
        raise ToolFormatError(f"{at}.content", "an assistant turn needs text or tool_calls")
    msg = {"role": "assistant", "content": text}
    if norm:
        msg["tool_calls"] = norm
    return msg


def _tool_turn(m: dict, at: str, pending: list) -> dict:
    """A tool message, matched to the call it answers (by ``tool_call_id``, else ``name``, else
    the first call waiting), which leaves ``pending``."""
    if not pending:
        raise ToolFormatError(f"{at}.role", "a tool turn must answer a call of the assistant turn before it")
    cid, name = m.get("tool_call_id"), m.get("name")
    hit = next((c for c in pending if cid is not None and c["id"] == cid), None)
    if hit is None and name is not None:
        hit = next((c for c in pending if c["function"]["name"] == name), None)
    if hit is None and cid is None and name is None:
        hit = pending[0]              # results in the order of the calls
    if hit is None:
        raise ToolFormatError(at, f"answers no call of the assistant turn before it "
                              f"(tool_call_id {cid!r}, name {name!r})")
    pending.remove(hit)
    return {"role": "tool", "name": hit["function"]["name"], "content": _text(m, at, True),
            "tool_call_id": hit["id"]}


# --------------------------------------------------------------------------- our format
def tools_block(functions: list[dict]) -> str:
    """The tools as the first user turn carries them: a header, then one JSON line each."""
    return "\n".join([TOOLS_HEADER] + [dumps({"name": f["name"], "description": f["description"],
                                               "parameters": f["parameters"]}) for f in functions])


def call_text(name: str, arguments: dict) -> str:
    return f"{CALL_OPEN}{dumps({'name': name, 'arguments': arguments})}{CALL_CLOSE}"


def assistant_text(m: dict) -> str:
    """An assistant turn as our format writes it: its text, then its calls, one per line."""
    parts = [m["content"]] if (m.get("content") or "").strip() else []
    parts += [call_text(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", ())]
    return "\n".join(parts)


def results_text(results: list[dict]) -> str:
    """The tool turns after a call, one ``Tool: {"name", "content"}`` line each."""
    return "\n".join(TOOL_PREFIX + dumps({"name": r["name"], "content": r["content"]}) for r in results)


def first_turn(system: str, functions: list[dict], question: str) -> str:
    """The first user turn's text: the system text, the tools block, the question."""
    return "\n\n".join(p for p in (system, tools_block(functions) if functions else "", question) if p)


@dataclass
class Exchange:
    """One exchange of our format: what opens it (a user turn, or results with
    ``tool`` true) and the assistant's answer (None: a prompt waiting for it)."""
    opening: str
    answer: Optional[str]
    tool: bool = False


def exchanges(messages: list[dict], functions: list[dict]) -> list[Exchange]:
    """The exchanges of normalized messages (:func:`read_messages`); the last one has no answer
    when the messages end with a user or tool turn."""
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
    out: list[Exchange] = []
    results: list[dict] = []
    first = True
    for m in messages:
        role = m["role"]
        if role == "tool":
            results.append(m)
            continue
        if results:
            out.append(Exchange(results_text(results), None, tool=True))
            results = []
        if role == "user":
            text = first_turn(system, functions, m["content"]) if first else m["content"]
            first = False
            out.append(Exchange(text, None))
        elif role == "assistant":
            out[-1].answer = assistant_text(m)
    if results:
        out.append(Exchange(results_text(results), None, tool=True))
    return out


# --------------------------------------------------------------------------- call formats
@dataclass(frozen=True)
class CallFormat:
    """How a chat template writes tool calls: each ``open`` + ``{"name": ..., "arguments": {...}}``
    (``json.dumps``' text) + ``close``, several joined by ``between``. Ours is ``OUR_CALLS``;
    Hermes-style templates (Qwen2.5's) write ``<tool_call>\\n{...}\\n</tool_call>`` joined by
    ``\\n``. :func:`parse_reply` reads them all (it allows white space around the JSON)."""
    open: str
    close: str
    between: str


OUR_CALLS = CallFormat(CALL_OPEN, CALL_CLOSE, "\n")
PROBE_CALLS = [("probe_tool_zq", {"xq": 7}), ("probe_tool_zq", {"xq": 8})]


def read_call_format(rendered: str) -> Optional[CallFormat]:
    """The call format of a template, from its rendering of an assistant turn that makes the
    two :data:`PROBE_CALLS`; None unless each call is written as ``json.dumps({"name",
    "arguments"})`` inside ``<tool_call>`` ... ``</tool_call>`` with nothing but white space
    between a tag and the JSON, or between two calls."""
    first, second = (dumps({"name": n, "arguments": a}) for n, a in PROBE_CALLS)
    i = rendered.find(first)
    j = rendered.find(second, i + 1) if i >= 0 else -1
    at = rendered.rfind(CALL_OPEN, 0, i) if i >= 0 else -1
    if j < 0 or at < 0:
        return None
    opening = rendered[at:i]
    middle = rendered[i + len(first):j]
    end = middle.find(CALL_CLOSE)
    if end < 0 or not middle.endswith(opening):
        return None
    close = middle[:end + len(CALL_CLOSE)]
    between = middle[len(close):len(middle) - len(opening)]
    blank = lambda t: not t.strip()             # noqa: E731
    if not (blank(opening[len(CALL_OPEN):]) and blank(close[:-len(CALL_CLOSE)]) and blank(between)
            and rendered[j + len(second):].startswith(close)):
        return None
    return CallFormat(opening, close, between)


_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)


def parse_reply(text: str) -> tuple[str, list[dict]]:
    """A reply's text before its first call (its trailing white space, which the format puts
    between text and call, left out) and its calls ``{"name", "arguments"}`` (arguments a dict);
    no complete call: the whole text and []. A call whose JSON does not read (an unconstrained
    model's) leaves the reply as text."""
    at = text.find(CALL_OPEN)
    if at < 0:
        return text, []
    calls = []
    for body in _CALL.findall(text, at):
        try:
            obj = json.loads(body)
        except ValueError:
            return text, []
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)):
            return text, []
        calls.append({"name": obj["name"], "arguments": obj["arguments"]})
    return (text[:at].rstrip(), calls) if calls else (text, [])
