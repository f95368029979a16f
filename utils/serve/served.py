"""A model as ``serve`` serves it (library; no side effects): an opened checkpoint's tokenizer,
kind and rules (utils/data/chat.py) with its lane on the server's one engine thread.

    m = ServedModel(id, tok, kind, rules, lane, created, quantize, max_queue, max_tokens, interval)
    m.completion_ids(text) / m.chat_ids(chat)     a request's prompt ids (ApiError 400 when the
                                                  model has no chat template, or it refuses the chat)
    m.sampling(s)                                 (temperature, top_k, top_p) of a request
    m.token_text(id) / m.token_bytes(id)          what logprobs show of a token
    m.describe()                                  its GET /v1/models entry
    m.with_adapter(name)                          the same model run with one of its LoRA adapters
                                                  (id ``base:name``; ``m.adapters``: those loaded)
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Optional

from utils.data.chat import (JINJA, ChatTemplateError, answer_decoding, chat_prompt_ids, knows_tools,
                             tool_prompt_ids)
from utils.data.chat import call_format as template_call_format
from utils.generation.engine import UNBOUNDED
from utils.generation.vocab import byte_level, piece_bytes
from utils.serve.protocol import ApiError, Chat, Sampling


@dataclass
class ServedModel:
    id: str
    tok: object
    kind: str                       # pretrain | sft | hf
    rules: object                   # utils.data.chat.Rules: chat template (None: completions only), BOS, stops
    lane: object                    # a Lane (utils/generation/loop.py) or RemoteLane (remote.py)
    created: int
    quantize: str = "none"
    max_queue: int = 256
    default_max_tokens: int = 256
    stream_interval: float = 0.0    # seconds between two wake-ups of a request's stream (Job)
    adapter: Optional[str] = None   # this view's LoRA adapter (with_adapter), None: the base model
    adapters: dict = field(default_factory=dict)   # name -> its /v1/models details, shared by the views

    def with_adapter(self, name: str) -> "ServedModel":
        """This model run with its loaded adapter ``name`` (a view: the same lane and tokenizer,
        id ``base:name``)."""
        return replace(self, id=f"{self.id}:{name}", adapter=name)

    @property
    def context(self) -> int:
        return self.lane.capacity

    @property
    def template(self) -> Optional[dict]:
        return self.rules.template

    def completion_ids(self, text: str) -> list[int]:
        return self.rules.prompt_ids(self.tok, text)

    def chat_ids(self, chat: Chat) -> list[int]:
        """The conversation through the model's own chat template (utils/data/chat.py: a public
        model's Jinja template, or ours, where a system message's text opens the first user turn)."""
        if self.template is None:
            raise ApiError(400, f"model '{self.id}' is a pre-trained ({self.kind}) model without a chat "
                           "template: use POST /v1/completions with a plain prompt, or serve an SFT "
                           "checkpoint for chat.", "model", "chat_not_supported")
        try:
            if chat.messages is not None:
                return self.tool_chat_ids(chat)
            return chat_prompt_ids(self.tok, self.template, chat.system, chat.history, chat.question)
        except ChatTemplateError as e:
            raise ApiError(400, f"{e}.", "messages", "invalid_value") from None

    def tool_chat_ids(self, chat: Chat) -> list[int]:
        """A conversation with tools or tool turns, through the model's template when it renders
        tools in a call format this server reads and constrains (:attr:`call_format`: ours, or a
        public model's own ``<tool_call>`` JSON, Hermes / Qwen2.5); otherwise 400 naming why."""
        if self.call_format is None:
            raise ApiError(400, self.no_tools_reason, "tools", "unsupported_parameter")
        return tool_prompt_ids(self.tok, self.template, chat.messages, chat.functions)

    @cached_property
    def call_format(self):
        """How the model's chat template writes tool calls (utils/data/tools.py CallFormat), or
        None when it renders no tools or writes calls in a format this server cannot read."""
        return template_call_format(self.tok, self.template)

    @property
    def no_tools_reason(self) -> str:
        if self.template.get("name") != JINJA:
            return (f"model '{self.id}' has chat template {self.template.get('name')!r}, which has no tool "
                    "format (it predates it): send the conversation without tools, or fine-tune it again "
                    "with sft.template user-assistant (sft prepare's default).")
        if not knows_tools(self.tok, self.template):
            return (f"model '{self.id}' chats by its own chat template, which does not render tools "
                    "(transformers hands it the tools and it leaves them out, so the model would never see "
                    "them): send the conversation without tools, or fine-tune the model on tool use with "
                    "our template (sft prepare --dataset tools, sft.template user-assistant).")
        return (f"model '{self.id}' chats by its own chat template, which renders tools but writes its "
                "calls in a format this server does not read (it reads <tool_call>{\"name\": ..., "
                "\"arguments\": {...}}</tool_call>, the Hermes / Qwen2.5 shape, and ours): send the "
                "conversation without tools, or fine-tune the model on tool use with our template "
                "(sft prepare --dataset tools, sft.template user-assistant).")

    @property
    def answer_lead(self) -> str:
        """What a chat answer starts with before its text (our template: the space after
        "Assistant:"); an output grammar lets it through."""
        return answer_decoding(self.template)[1] if self.template is not None else ""

    def sampling(self, s: Sampling) -> tuple[float, int, float]:
        """(temperature, top_k, top_p) of a request: its own fields, else the model's
        generation_config.json defaults, else OpenAI's (1, off, 1)."""
        d = self.rules.defaults
        pick = lambda v, k, off: v if v is not None else d.get(k, off)   # noqa: E731
        return float(pick(s.temperature, "temperature", 1.0)), int(pick(s.top_k, "top_k", 0)), float(pick(s.top_p, "top_p", 1.0))

    def token_text(self, token: int) -> str:
        piece = self.tok.convert_ids_to_tokens(int(token))
        text = self.tok.convert_tokens_to_string([piece])
        if piece.startswith("\u2581") and not text.startswith(" "):    # SentencePiece word start
            text = " " + text
        return text

    @cached_property
    def byte_level(self) -> bool:
        """Whether the tokenizer is a byte-level BPE (GPT-2 style): its backend decoder is, or
        holds, ByteLevel (a slow tokenizer: it has GPT-2's ``byte_decoder``)."""
        return byte_level(self.tok)

    def token_bytes(self, token: int) -> bytes:
        """The token's own bytes (chat logprobs' ``bytes``: a client joins them to rebuild a
        character split over tokens): a byte-level BPE piece read back through GPT-2's byte
        alphabet; a SentencePiece byte-fallback piece ``<0xHH>`` is that one byte; any other
        token (a special or added one included) the UTF-8 of its text."""
        got = piece_bytes(self.tok.convert_ids_to_tokens(int(token)), self.byte_level)
        return got if got is not None else self.token_text(token).encode("utf-8")

    def describe(self) -> dict:
        if self.adapter is not None:                 # vLLM's shape for a LoRA: its parent model
            base = self.id[:-len(self.adapter) - 1]
            return {"id": self.id, "object": "model", "created": self.adapters[self.adapter]["created"],
                    "owned_by": "llm-pipeline", "kind": "lora", "parent": base, "root": base,
                    "chat": self.template is not None,
                    "context_length": None if self.context >= UNBOUNDED else self.context,
                    "adapter": {k: v for k, v in self.adapters[self.adapter].items() if k != "created"}}
        return {"id": self.id, "object": "model", "created": self.created, "owned_by": "llm-pipeline",
                "kind": self.kind, "chat": self.template is not None,
                "context_length": None if self.context >= UNBOUNDED else self.context,  # None: infini
                "quantize": self.quantize}
