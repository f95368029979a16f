"""The SFT chat template as Jinja, for exported tokenizers (library; no side effects).

A public model's own template (``{"name": "jinja", ...}``, utils/data/chat.py) is its Jinja
source, returned as it is. Ours:

Our template is data (utils/data/sft.py ``default_template``). For template
``user-assistant-v2`` the Jinja version renders, from OpenAI-style messages, exactly the
texts our encoder frames, with the special tokens written as their strings:

    {bos}User: {q1}\\nAssistant: {a1}{eos}{bos}User: {q2}            (+ "\\nAssistant:" with
                                                                       add_generation_prompt)

- ``user`` / ``assistant`` roles strictly alternate, starting with ``user``; system (or
  ``developer``) messages before the first user message open it, joined by a blank line,
  as the server does (utils/serve/served.py ``chat_ids``); other roles are refused.
- The assistant header belongs to the assistant message (``"\\nAssistant: " + answer``), and
  ``add_generation_prompt`` adds it without its trailing space (``"\\nAssistant:"``), where
  our prompts end: the space starts the answer the model generates.
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

from utils.data import sft

ALTERNATE = ("Conversation roles must alternate user/assistant/user/... starting with user "
             "(system messages only before the first user message)")


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
    user = _lit(template["user_prefix"])
    header = _lit(template["separator"] + template["assistant_prefix"])
    prompt_end = _lit(sft.prompt_text(template, "")[len(template["user_prefix"]):])
    return (
        "{%- set ns = namespace(system=[], turns=0) -%}"
        "{%- for message in messages -%}"
        "{%- if message['role'] in ['system', 'developer'] -%}"
        f"{{%- if ns.turns -%}}{{{{ raise_exception({_lit(ALTERNATE)}) }}}}{{%- endif -%}}"
        "{%- set ns.system = ns.system + [message['content']] -%}"
        "{%- elif message['role'] not in ['user', 'assistant'] "
        "or (message['role'] == 'user') != (ns.turns % 2 == 0) -%}"
        f"{{{{ raise_exception({_lit(ALTERNATE)}) }}}}"
        "{%- elif message['role'] == 'user' -%}"
        f"{{{{ bos_token }}}}{{{{ {user} }}}}"
        "{%- if ns.turns == 0 and ns.system | join('\\n\\n') -%}"
        "{{ ns.system | join('\\n\\n') }}{{ '\\n\\n' }}"
        "{%- endif -%}"
        "{{ message['content'] }}"
        "{%- set ns.turns = ns.turns + 1 -%}"
        "{%- else -%}"
        f"{{{{ {header} }}}}{{{{ message['content'] }}}}{{{{ eos_token }}}}"
        "{%- set ns.turns = ns.turns + 1 -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
        f"{{%- if add_generation_prompt and ns.turns % 2 == 1 -%}}{{{{ {prompt_end} }}}}{{%- endif -%}}")


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
