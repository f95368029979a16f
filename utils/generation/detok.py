"""Incremental detokenization (library; no side effects): the text of a stream of token ids,
piece by piece as the ids come, never cutting a UTF-8 character (or a multi-token grapheme the
tokenizer has not finished) in two (:class:`TextDecoder`), and with stop strings held back
until they can be told apart from text (:class:`TextStream`). The engine's sequences
(utils/generation/engine.py ``Sequence``), infer and serve read their text through these.
"""
from __future__ import annotations

from typing import Optional, Sequence

from utils.data.tok import decode_fn


class TextDecoder:
    """``push(id)`` returns the text that became final with that token ("" while a character is
    still incomplete: the decoded tail ends in U+FFFD, or the new text would change what was
    already shown), ``finish()`` the rest. Joined, the pieces
    equal ``tok.decode(ids, skip_special_tokens=True)``, except where that decode changes text
    already shown: byte-fallback tokens of a character cut short at the end (max_tokens) decode
    together with the byte tokens before them, one U+FFFD each, so a shown "\n" (``<0x0A>``)
    would turn into U+FFFD. Then what was shown stays and the held-back tokens' own text
    follows.

    Cost: each push decodes a short window (the tokens shown by the previous piece, those
    held back since, and the new one), not the whole sequence: a decode of everything per
    token costs time in proportion to the reply's length, quadratic over a long reply. The
    window starts at a token boundary on both sides of the difference taken, so a
    SentencePiece word-start piece keeps its space.

    ``prefix``: token ids the new ones continue (e.g. the prompt's last token): the text is
    then what the new ids add after the prefix's text, so a SentencePiece word-start piece
    keeps its leading space (a completion that continues a prompt mid-sentence).
    ``lead``: text the new ids are expected to start with, left out of the text (a chat
    answer's space after the assistant prefix, utils/data/sft.py ``answer_decoding``)."""

    def __init__(self, tok, prefix: Sequence[int] = (), lead: str = ""):
        self.tok = tok
        self.dec = decode_fn(tok)                      # tok.decode(ids, skip_special_tokens=True)
        self.prefix = [int(t) for t in prefix]
        self.skip = len(self.dec(self.prefix)) if self.prefix else 0
        self.lead = lead
        self._held: Optional[str] = "" if lead else None   # raw text while it may still be the lead
        self.ids: list[int] = []
        self.shown = ""
        self._all = list(self.prefix)                  # prefix + ids
        self._start, self._read = 0, len(self._all)    # the window, see push

    def _decode(self) -> str:
        text = self.dec(self.prefix + self.ids)[self.skip:] if self.prefix else self.dec(self.ids)
        return self._without_lead(text)

    def _without_lead(self, text: str) -> str:
        """``text`` without the lead: "" while it is the lead or the start of it; whole when it
        does not start with the lead."""
        if self.lead and self.lead.startswith(text):
            return ""
        return text[len(self.lead):] if self.lead and text.startswith(self.lead) else text

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        self._all.append(int(token))
        window = self._all[self._start:]                # _all[_start:_read] is already shown
        before = self.dec(window[:self._read - self._start])
        now = self.dec(window)
        if now.endswith("\ufffd") or len(now) <= len(before) or not now.startswith(before):
            return ""
        piece = now[len(before):]
        self._start, self._read = self._read, len(self._all)
        if self._held is not None:                      # the lead is not settled yet
            held = self._held + piece
            self._held = held if self.lead.startswith(held) else None
            piece = self._without_lead(held)
        self.shown += piece
        return piece

    def text(self) -> str:
        return self._decode()

    def finish(self) -> str:
        final = self.text()
        if final == self.shown:
            return ""
        if final.startswith(self.shown):
            piece = final[len(self.shown):]
        else:                                           # see the class docstring
            window = self._all[self._start:]
            before, now = self.dec(window[:self._read - self._start]), self.dec(window)
            piece = now[len(before):] if now.startswith(before) else self.dec(self._all[self._read:])
        self.shown += piece
        self._start = self._read = len(self._all)      # all shown: a second finish() gives ""
        return piece


class TextStream:
    """Text of one sequence with stop strings: ``push(id) -> (text, stopped)`` gives the text
    that became final, holding back any tail that could still grow into a stop string, so a
    stop string never reaches the caller, even split across tokens; once one appears, the text
    before it is returned with ``stopped`` True. ``finish()`` returns what was held back."""

    def __init__(self, tok, stop: Sequence[str] = (), prefix: Sequence[int] = (), lead: str = ""):
        self.decoder = TextDecoder(tok, prefix, lead)
        self.stop = [s for s in stop if s]
        self.pending = ""

    def push(self, token: int) -> tuple[str, bool]:
        return self._cut(self.pending + self.decoder.push(token))

    def _cut(self, buf: str) -> tuple[str, bool]:
        hits = [i for i in (buf.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.pending = ""
            return buf[:min(hits)], True
        keep = 0                                   # the longest tail that starts a stop string
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self.pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def finish(self) -> str:
        text, _ = self._cut(self.pending + self.decoder.finish())
        rest, self.pending = self.pending, ""
        return text + rest
