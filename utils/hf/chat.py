"""The SFT chat template as Jinja, for exported tokenizers (library; no side effects).

A public model's own template (``{"name": "jinja", ...}``, utils/data/chat.py) is its Jinja
source, returned as it is. Ours:

Our template is data (utils/data/sft.py ``default_template``). For template
``user-assistant-v2`` the Jinja version renders, from OpenAI-style messages, exactly the
texts our encoder frames, with the special tokens written as their strings:

    {bos}User: {q1}\\nAssistant: {a1}{eos}{bos}User: {q2}            (+ "\\nAssistant:" with
                                                                       add_generation_prompt)

- ``user`` / ``assistant`` roles alternate, starting with ``user`` (tool turns between an
  assistant turn with calls and the next assistant turn); system (or
  ``developer``) messages before the first user message open it, joined by a blank line,
  as the server does (utils/serve/served.py ``chat_ids``); other roles are refused.
- The assistant header belongs to the assistant message (``"\\nAssistant: " + answer``), and
  ``add_generation_prompt`` adds it without its trailing space (``"\\nAssistant:"``), where
  our prompts end: the space starts the answer the model generates.
- Tool use (utils/data/tools.py's format): ``tools`` (transformers' ``apply_chat_template(...,
  tools=...)``) go in the first user turn's tools block; an assistant turn with ``tool_calls``
  writes its text (when not blank) and its calls, one ``<tool_call>...</tool_call>`` a line
  (arguments as a dict through ``tojson``, which is ``json.dumps``; as JSON text, as they
  are); ``tool`` turns (named by their call's ``tool_call_id``, else their ``name``, else the
  calls in order) open the next exchange, ``Tool: {"name", "content"}`` a line, and
  ``add_generation_prompt`` after them adds ``"\\nAssistant:"``. The texts are those
  ``sft prepare`` trains on and ``serve`` prompts with (tests/test_tools.py).
- Tokenized as one string by a tokenizer that reads its special-token strings (transformers
  with ``split_special_tokens`` false, llama.cpp with special tokens parsed), each exchange
  between BOS and EOS is one piece of text, as our encoder has it, so the ids are ours
  token for token (tests/test_export.py).

Checkpoints of template ``user-assistant-v1`` (trained before SFT data format 2) get the
v1 text (the assistant prefix closes each user turn); the text is theirs, but their training
encoded each prompt and answer apart, which no rendering of one string reproduces.
"""
from __future__ import annotations

import json
from typing import Optional

from utils.data import sft, tools

ORDER = ("Conversation roles must alternate user/assistant/user/... starting with user "
         "(system messages only before the first user message; an assistant turn with tool_calls is "
         "followed by one tool turn per call, then an assistant turn)")


def _lit(s: str) -> str:
    """A Jinja string literal of ``s`` (a JSON string is one)."""
    return json.dumps(str(s), ensure_ascii=False)


def jinja_template(template: Optional[dict]) -> Optional[str]:
    """The Jinja chat template of our template dict (None for None)."""
    if not template:
        return None
    if sft.template_version(template) == sft.TEMPLATE_JINJA:      # a public model's own: as written
        return template["template"]
    if sft.template_version(template) == sft.TEMPLATE_V1:
        return _jinja_v1(template)
    return _jinja_v2(template)


_REFUSE = f"{{{{ raise_exception({_lit(ORDER)}) }}}}"


def _jinja_v2(template: dict) -> str:
    """Template v2 as Jinja: one branch per role, in the loop over the messages."""
    prompt_end = _lit(sft.prompt_text(template, "")[len(template["user_prefix"]):])
    return (
        "{%- set ns = namespace(system=[], lines=[], prev=none, first=true, calls=[], pending=0, k=0, name=none) -%}"
        "{%- for message in messages -%}"
        "{%- set role = 'system' if message['role'] == 'developer' else message['role'] -%}"
        # ---- the system text opens the first user turn
        "{%- if role == 'system' -%}"
        f"{{%- if ns.prev not in [none, 'system'] -%}}{_REFUSE}{{%- endif -%}}"
        "{%- set ns.system = ns.system + [message['content']] -%}"
        "{%- elif role == 'user' -%}" + _user_turn(template) +
        "{%- elif role == 'assistant' -%}" + _assistant_turn(template) +
        "{%- elif role == 'tool' -%}" + _tool_turn() +
        f"{{%- else -%}}{_REFUSE}"
        "{%- endif -%}"
        "{%- set ns.prev = role -%}"
        "{%- endfor -%}"
        f"{{%- if ns.pending -%}}{_REFUSE}{{%- endif -%}}"
        f"{{%- if add_generation_prompt and ns.prev in ['user', 'tool'] -%}}{{{{ {prompt_end} }}}}{{%- endif -%}}")


def _user_turn(template: dict) -> str:
    """A user turn opens an exchange; the first carries the system text and the tools block."""
    empty_params = "{'type': 'object', 'properties': {}}"
    return (
        f"{{%- if ns.prev not in [none, 'system', 'assistant'] or ns.pending -%}}{_REFUSE}{{%- endif -%}}"
        "{%- set parts = [] -%}"
        "{%- if ns.first and ns.system | join('\\n\\n') -%}"
        "{%- set parts = parts + [ns.system | join('\\n\\n')] -%}"
        "{%- endif -%}"
        "{%- if ns.first and tools -%}"
        f"{{%- set ns.lines = [{_lit(tools.TOOLS_HEADER)}] -%}}"
        "{%- for tool in tools -%}"
        "{%- set fn = tool['function'] if tool['function'] is defined else tool -%}"
        "{%- set ns.lines = ns.lines + [{'name': fn['name'], 'description': fn.get('description') or '', "
        f"'parameters': fn.get('parameters') if fn.get('parameters') is not none else {empty_params}}} | tojson] -%}}"
        "{%- endfor -%}"
        "{%- set parts = parts + [ns.lines | join('\\n')] -%}"
        "{%- endif -%}"
        "{%- if message['content'] or not tools -%}{%- set parts = parts + [message['content']] -%}{%- endif -%}"
        f"{{{{ bos_token }}}}{{{{ {_lit(template['user_prefix'])} }}}}{{{{ parts | join('\\n\\n') }}}}"
        "{%- set ns.first = false -%}")


def _assistant_turn(template: dict) -> str:
    """An assistant turn: its text, then its calls, one a line; EOS closes the exchange."""
    header = _lit(template["separator"] + template["assistant_prefix"])
    return (
        f"{{%- if ns.prev not in ['user', 'tool'] or ns.pending -%}}{_REFUSE}{{%- endif -%}}"
        "{%- set ns.calls = message.get('tool_calls') or [] -%}"
        "{%- set text = message['content'] if message['content'] is string else '' -%}"
        f"{{{{ {header} }}}}"
        "{%- if not ns.calls -%}{{ text }}"
        "{%- elif text | trim -%}{{ text }}{{ '\\n' }}"
        "{%- endif -%}"
        "{%- for call in ns.calls -%}"
        "{%- set fn = call['function'] if call['function'] is defined else call -%}"
        "{%- if not loop.first -%}{{ '\\n' }}{%- endif -%}"
        f"{{{{ {_lit(tools.CALL_OPEN)} }}}}"
        "{%- if fn['arguments'] is string -%}"
        "{{ '{\"name\": ' }}{{ fn['name'] | tojson }}{{ ', \"arguments\": ' }}{{ fn['arguments'] }}{{ '}' }}"
        "{%- else -%}{{ {'name': fn['name'], 'arguments': fn['arguments']} | tojson }}"
        "{%- endif -%}"
        f"{{{{ {_lit(tools.CALL_CLOSE)} }}}}"
        "{%- endfor -%}"
        "{{ eos_token }}"
        "{%- set ns.pending = ns.calls | length -%}{%- set ns.k = 0 -%}")


def _tool_turn() -> str:
    """Tool turns: the results of the calls before them open the next exchange, one a line."""
    return (
        f"{{%- if not ns.pending -%}}{_REFUSE}{{%- endif -%}}"
        "{%- set ns.name = none -%}"
        "{%- for call in ns.calls -%}"
        "{%- if message.get('tool_call_id') is not none and call.get('id') == message.get('tool_call_id') -%}"
        "{%- set ns.name = (call['function'] if call['function'] is defined else call)['name'] -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if ns.name is none -%}"
        "{%- set fn = ns.calls[ns.k]['function'] if ns.calls[ns.k]['function'] is defined else ns.calls[ns.k] -%}"
        "{%- set ns.name = message.get('name') or fn['name'] -%}"
        "{%- endif -%}"
        "{{ '\\n' if ns.prev == 'tool' else bos_token }}"
        f"{{{{ {_lit(tools.TOOL_PREFIX)} }}}}{{{{ {{'name': ns.name, 'content': message['content']}} | tojson }}}}"
        "{%- set ns.pending = ns.pending - 1 -%}{%- set ns.k = ns.k + 1 -%}")


def _jinja_v1(template: dict) -> str:
    q = lambda s: json.dumps(str(s))   # noqa: E731 (as v1 exports always wrote it)
    return (
        "{%- for message in messages -%}"
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/... "
        "starting with user (no system role)') }}"
        "{%- endif -%}"
        "{%- if message['role'] == 'user' -%}"
        f"{{{{ bos_token }}}}{{{{ {q(template['user_prefix'])} }}}}{{{{ message['content'] }}}}"
        f"{{{{ {q(template['separator'])} }}}}{{{{ {q(template['assistant_prefix'])} }}}}"
        "{%- else -%}"
        "{{ message['content'] }}{{ eos_token }}"
        "{%- endif -%}"
        "{%- endfor -%}")
