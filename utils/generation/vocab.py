"""The bytes of a tokenizer's tokens (library; no side effects): what each token adds to the
text, as a grammar needs it (utils/generation/constrained.py) and as chat logprobs' ``bytes``
show it (utils/serve/served.py).

    byte_level(tok) -> bool                 GPT-2 style byte-level BPE (its decoder holds ByteLevel)
    piece_bytes(tok, piece, byte_level)     one token piece's bytes, None when the rule has none
    vocab_bytes(tok, n) -> [bytes] * n      every id's bytes (ids past the tokenizer: b"")

Rules: a byte-level BPE piece is read back through GPT-2's byte alphabet (printable Latin-1
bytes as themselves, the other 68 as U+0100 onwards); a SentencePiece byte-fallback piece
``<0xHH>`` is that one byte; any other SentencePiece piece is its text with U+2581 (the word
start) as a space. A SentencePiece decoder drops the space of the very first piece of a text;
a grammar sees it (JSON allows white space there, so a reply parses the same either way).
"""
from __future__ import annotations

import json
import re
from typing import Optional


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the character each byte is written as in a
    byte-level BPE vocabulary (printable Latin-1 bytes as themselves, the other 68 as U+0100
    onwards, in byte order) -> that byte."""
    kept = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)}
    table, extra = {}, 0
    for b in range(256):
        if b in kept:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


BYTE_ALPHABET = _byte_alphabet()
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")     # a SentencePiece byte-fallback piece
WORD_START = "\u2581"                                 # SentencePiece's space


def _has_type(node: dict, name: str) -> bool:
    """Whether a tokenizers component's JSON is of type ``name`` or a sequence holding one."""
    return node.get("type") == name or any(_has_type(d, name) for d in node.get("decoders") or [])


def byte_level(tok) -> bool:
    """Whether ``tok`` is a byte-level BPE (GPT-2 style): its backend decoder is, or holds,
    ByteLevel (a slow tokenizer: it has GPT-2's ``byte_decoder``)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or backend.decoder is None:
        return hasattr(tok, "byte_decoder")
    return _has_type(json.loads(backend.decoder.__getstate__()), "ByteLevel")   # its tokenizer.json entry


def piece_bytes(piece: str, is_byte_level: bool) -> Optional[bytes]:
    """A byte-level piece's bytes, a byte-fallback piece's byte; None for any other piece
    (the caller decides: its text)."""
    if is_byte_level:
        if all(c in BYTE_ALPHABET for c in piece):
            return bytes(BYTE_ALPHABET[c] for c in piece)
    elif (hit := BYTE_PIECE.fullmatch(piece)) is not None:
        return bytes([int(hit[1], 16)])
    return None


def vocab_bytes(tok, n: int) -> list[bytes]:
    """Each id's bytes for ids 0..n-1 (``n``: the model's vocabulary, which may be larger than
    the tokenizer's; the ids past it get b""). Special tokens get their text's bytes (a grammar
    marks them special: never text)."""
    is_bl = byte_level(tok)
    pieces = tok.convert_ids_to_tokens(list(range(min(n, len(tok)))))
    out = []
    for piece in pieces:
        got = piece_bytes(piece, is_bl) if piece is not None else b""
        out.append(got if got is not None else piece.replace(WORD_START, " ").encode("utf-8"))
    return out + [b""] * (n - len(out))
