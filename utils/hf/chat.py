"""The SFT chat template as Jinja, for exported tokenizers (library; no side effects).

Our template is data (utils/data/sft.py ``default_template``): each exchange is
``<s>{user_prefix}{question}{separator}{assistant_prefix}{answer}</s>``. The Jinja version
renders the same text from OpenAI-style messages (``user`` / ``assistant`` roles, strictly
alternating, starting with ``user``); the assistant prefix closes each user turn, so a
conversation that ends with a user message is already a generation prompt
(``add_generation_prompt`` adds nothing). Other roles are refused by the template.
"""
from __future__ import annotations

import json
from typing import Optional


def jinja_template(template: Optional[dict]) -> Optional[str]:
    """The Jinja chat template of our template dict (None for None)."""
    if not template:
        return None
    q = lambda s: json.dumps(str(s))   # noqa: E731 (a JSON string is a Jinja string literal)
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


def render(template: dict, turns: list[str], bos: str, eos: str) -> str:
    """The text the Jinja template renders for ``turns`` (user, assistant, ...), by our rule."""
    out = []
    for i, t in enumerate(turns):
        if i % 2 == 0:
            out.append(f"{bos}{template['user_prefix']}{t}{template['separator']}{template['assistant_prefix']}")
        else:
            out.append(f"{t}{eos}")
    return "".join(out)
