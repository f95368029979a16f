"""Constrained decoding: replies that are JSON matching a schema (library; no side effects),
through llguidance (docs/serve.md, Structured output, says why it over xgrammar and
outlines-core: measured by perf/structured_overhead.py).

    grammar = json_grammar(schema)               llguidance's grammar text; ConstraintError (a
                                                 ValueError) naming what it cannot do
    grammar = tool_grammar(functions, choice, parallel, lead)   a reply under OpenAI's tool_choice:
                                                 calls whose arguments match their schemas
    grammars = Grammars()                        per-tokenizer vocabularies, built once (an Engine
                                                 holds one)
    masked, broken = constrain(seqs, logits, grammars)   each constrained row's logits masked
    seq.constraint.advance(token) -> bool        True once the JSON is complete

Contract: a sequence whose ``SamplingParams.grammar`` is set samples only tokens the grammar
allows next; its stop ids (EOS) only while the grammar accepts (the JSON is complete); once
nothing can follow, it finishes ("stop") without waiting for EOS. A cut-off by max_new_tokens
before then finishes "length" with the JSON incomplete, as OpenAI's API does. Masks are per
row: a constrained row's logits are replaced in a copy, so the other rows of the batch are
sampled from exactly the logits they had (their tokens are what they are without it).
Logprobs stay the model's (the unmasked distribution).

White space between JSON tokens is bounded as llama.cpp's JSON grammars bound it (a space, or
one or two newlines and up to 20 spaces or tabs): a model that would write white space for
ever (a random one does) cannot, so an object of bounded strings and arrays always ends.

The vocabulary llguidance reads is each token's bytes (utils/generation/vocab.py): special
tokens and the model's ids past the tokenizer's are marked special, never text. Building it
takes a pass over the vocabulary (about half a second for 49k tokens), once per tokenizer.
"""
from __future__ import annotations

import json
import re
from typing import Optional

import llguidance
import numpy as np
import torch

from utils.data import tools
from utils.data.tok import encode_plain
from utils.generation.vocab import vocab_bytes

WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})?"     # between JSON tokens (see the module docstring)


class ConstraintError(ValueError):
    """A schema llguidance cannot turn into a grammar (a feature it lacks, a broken ``$ref``):
    the message names it."""


# What one grammar may cost llguidance (its own fuel and size counters, so a compile ends in a
# bounded time whatever the schema): a tenth of its defaults, which every schema of the tests and
# of docs/serve.md fits many times over. Used when a grammar is checked (serve, off its event
# loop) and when a sequence's matcher is made (the engine thread).
LIMITS = dict(initial_lexer_fuel=200_000, max_grammar_size=50_000, max_lexer_states=50_000)


def limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


def json_grammar(schema: Optional[dict]) -> str:
    """The grammar of JSON text matching ``schema`` (None: any JSON object), white space
    bounded (``WHITESPACE``). ConstraintError naming an unsupported feature, or a schema past
    :data:`LIMITS`."""
    schema = {"type": "object"} if schema is None else schema
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_pattern": WHITESPACE})
    except ValueError as e:
        raise ConstraintError(f"the schema is not a JSON object ({e})") from None
    return _checked(grammar)


def _checked(grammar: str) -> str:
    bad, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=limits())
    if bad:
        raise ConstraintError(messages[0])
    return grammar


# our tool-call format (utils/data/tools.py): JSON as json.dumps writes it, no other white space
_CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lark_text(text: str) -> str:
    return json.dumps(text)            # a JSON string is a Lark string literal


def _lark_regex(text: str) -> str:
    """``text`` matched literally inside a Lark ``/regex/`` (on one line: a newline as ``\\n``)."""
    return re.escape(text).replace("\\\n", "\\n").replace("\\\r", "\\r").replace("\\\t", "\\t")


def tool_grammar(functions: list, choice: str, parallel: bool, lead: str = "",
                 calls: Optional[tools.CallFormat] = None) -> str:
    """The grammar of a reply under OpenAI's ``tool_choice`` in a call format (``calls``,
    utils/data/tools.py; default ours: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    or a model's own Hermes-style one): each call's arguments match its function's ``parameters``
    schema. ``choice``: "required" (one call or more, nothing else), a function's name (calls of
    it only), "auto" (text without a call, or text and then calls: once a call opens, it is
    constrained) or "none" (text that never opens a call). ``parallel`` false: at most one call.
    ``lead``: what an answer may start with before its first call (our template's space after
    "Assistant:"). ConstraintError naming what cannot be enforced."""
    calls = calls or tools.OUR_CALLS
    no_call = "(/(?s:.*)/ & ~/(?s:.*" + re.escape(tools.CALL_OPEN) + ".*)/)"
    lines = [f"TEXT: {no_call}"]
    if choice == "none":
        return _checked(llguidance.LLMatcher.grammar_from_lark("start: TEXT?\n" + "\n".join(lines)))
    picked = [f for f in functions if choice in ("auto", "required") or f["name"] == choice]
    if not picked:
        raise ConstraintError(f"no function named {choice!r} is in 'tools'")
    shapes = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
               "required": ["name", "arguments"], "additionalProperties": False} for f in picked]
    body = dict(shapes[0]) if len(shapes) == 1 else {"anyOf": shapes}
    body["x-guidance"] = _CALL_JSON
    close, more = _lark_text(calls.close), _lark_text(calls.between + calls.open)
    lines += [f"body: %json {json.dumps(body)}", f"more: {more} body {close}",
              f"OPEN: {no_call} {_lark_text(calls.open)}"]
    sequence = f"body {close}" + (" more*" if parallel else "")
    if choice == "auto":
        start = f"start: TEXT? | OPEN {sequence}"
    else:
        lines.append(f"FIRST: /(?:{_lark_regex(lead)})?{_lark_regex(calls.open)}/")   # one lexeme: the lead is optional
        start = f"start: FIRST {sequence}"
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark("\n".join([start] + lines))
    except ValueError as e:
        raise ConstraintError(str(e)) from None
    return _checked(grammar)


class _Vocabulary:
    """A tokenizer as llguidance's ``TokenizerWrapper`` protocol reads it: each id's bytes,
    the special ids, and a text encoder (llguidance re-tokenizes forced text with it)."""

    def __init__(self, tok, n_vocab: int):
        self.tok = tok
        self.tokens = vocab_bytes(tok, n_vocab)
        self.eos_token_id = tok.eos_token_id if tok.eos_token_id is not None else 0
        self.bos_token_id = tok.bos_token_id
        # 0xFF starts llguidance's names of special tokens; it is never in UTF-8 text (a
        # byte-fallback piece <0xFF> is the one token with it): those are special too
        never = {i for i, b in enumerate(self.tokens) if b.startswith(b"\xff")}
        self.special_token_ids = sorted(set(tok.all_special_ids) | set(range(len(tok), n_vocab)) | never)
        self.is_tokenizer_wrapper = True

        self.greedy = None              # the LLTokenizer's own greedy_tokenize, once it exists

    def __call__(self, text) -> list[int]:
        """Ids whose bytes are exactly ``text``'s (llguidance fails on others): the tokenizer's
        own, else (a SentencePiece tokenizer puts a space before a text's first word)
        llguidance's greedy longest-match over the same vocabulary."""
        text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        ids = encode_plain(self.tok, [text])[0]
        if b"".join(self.tokens[i] for i in ids) == text.encode("utf-8") or self.greedy is None:
            return ids
        return self.greedy(text)


class Constraint:
    """One sequence's grammar state: the allowed next tokens and the tokens taken."""

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int, stop_ids: frozenset):
        self.matcher, self.n_vocab = matcher, n_vocab
        self.stop_ids = np.array(sorted(stop_ids), dtype=np.int64)
        # llguidance's bitmask: token i is bit i % 32 of word i // 32, read as little-endian bytes
        # (x86, ARM)
        self.bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    def allowed(self) -> np.ndarray:
        """(V,) bool: the tokens the grammar takes next; the stop ids only while it accepts."""
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        allow = np.unpackbits(self.bits.view(np.uint8), count=self.n_vocab, bitorder="little").view(bool)
        allow[self.stop_ids] = self.matcher.is_accepting()
        return allow

    def mask(self, row: torch.Tensor, allow: np.ndarray) -> None:
        """-inf in ``row`` (V,) where ``allow`` is False (NumPy on CPU: a third of torch's time)."""
        if row.device.type == "cpu":
            np.copyto(row.numpy(), -np.inf, where=~allow)
        else:
            row.masked_fill_(~torch.from_numpy(allow).to(row.device), float("-inf"))

    def advance(self, token: int) -> bool:
        """Take ``token``; True when the grammar is complete (nothing can follow)."""
        self.matcher.consume_token(int(token))
        return self.matcher.is_stopped() and not self.matcher.is_error()


class Grammars:
    """The vocabularies of the tokenizers sequences came with (built on first use, kept: one
    per tokenizer object) and the constraints made from them."""

    def __init__(self):
        self._vocab: dict[int, tuple[object, llguidance.LLTokenizer]] = {}

    def vocabulary(self, tok, n_vocab: int) -> llguidance.LLTokenizer:
        held = self._vocab.get(id(tok))
        if held is None or held[0] is not tok:
            wrapper = _Vocabulary(tok, n_vocab)
            held = (tok, llguidance.LLTokenizer(wrapper, n_vocab=n_vocab))
            wrapper.greedy = held[1].greedy_tokenize
            self._vocab[id(tok)] = held
        return held[1]

    def start(self, grammar: str, tok, n_vocab: int, stop_ids: frozenset) -> Constraint:
        matcher = llguidance.LLMatcher(self.vocabulary(tok, n_vocab), grammar, log_level=0, limits=limits())
        return Constraint(matcher, n_vocab, stop_ids)


def constrain(seqs: list, logits: torch.Tensor, grammars: Grammars) -> tuple[torch.Tensor, dict[int, str]]:
    """``logits`` with each constrained row's disallowed tokens at -inf (a copy when any row
    is constrained; ``logits`` itself otherwise), and ``{row: error}`` for the rows whose
    grammar failed (left unmasked: the caller ends them). A sequence's constraint starts at
    its first step (``seq.constraint``, from ``seq.params.grammar`` and ``seq.tok``)."""
    rows = [r for r, s in enumerate(seqs) if s.params.grammar is not None]
    if not rows:
        return logits, {}
    masked, broken = logits.clone(), {}
    n_vocab = logits.shape[-1]
    for r in rows:
        s = seqs[r]
        if s.constraint is None:
            s.constraint = grammars.start(s.params.grammar, s.tok, n_vocab, s.params.stop_ids)
        allow = s.constraint.allowed() if not s.constraint.error else None
        if s.constraint.error or not bool(allow.any()):
            broken[r] = f"the output grammar failed: {s.constraint.error or 'no token is allowed'}"
            continue
        s.constraint.mask(masked[r], allow)
    return masked, broken


__all__ = ["json_grammar", "tool_grammar", "limits", "LIMITS", "ConstraintError", "Grammars", "Constraint", "constrain", "WHITESPACE"]
