"""SentencePiece models as exact fast tokenizers (library; no side effects).

A pretrained SentencePiece BPE model (``tokenizer.model`` of Llama, CodeLlama, Mistral v1) is
turned into a ``tokenizers`` backend that gives exactly the ids the ``sentencepiece`` library
gives (``SentencePieceProcessor.encode(text)``, i.e. add_bos=False) and decodes ids back to
what ``sentencepiece`` decodes. transformers' own conversion is not exact: its
``Metaspace(prepend_scheme="first")`` pre-tokenizer skips the dummy-prefix ``▁`` when the
text already starts with a space (``" x"`` and ``"x"`` give the same ids), and it orders BPE
merges by piece id instead of piece score (whitespace-only pieces, which Mistral and Llama
score at -1e9, merge too early: ``"a  b"`` differs).

What makes this conversion exact, step by step of ``sentencepiece``'s own pipeline:

- normalizer: the model's precompiled character map (``Precompiled``), then, if
  ``remove_extra_whitespaces``, strip and collapse runs of spaces, then the dummy prefix
  (``Prepend("▁")`` on every non-empty text, whatever it starts with) and the whitespace
  escape (``Replace(" ", "▁")``). No pre-tokenizer: sentencepiece encodes the whole text.
- model: every piece ``l + r`` of type NORMAL with both halves NORMAL pieces becomes a
  merge, ranked by the merged piece's score (highest first); among equal scores the longer
  left part first, which reproduces sentencepiece's leftmost-first order inside runs of
  equally scored (whitespace) pieces. ``byte_fallback`` as in the model; unknown characters
  (no byte fallback) become one ``<unk>`` per run, as in sentencepiece.
- control and unknown pieces (``<s>``, ``</s>``, ``<unk>``) are special added tokens; they are
  never merged from text, so with ``encode_special_tokens`` (utils.data.tok.encode_plain) their
  literal strings encode as the ordinary pieces sentencepiece gives.
- decoder: ``▁`` -> space, byte pieces -> bytes, then the dummy prefix removed once.

Unigram models, models with user-defined pieces and whitespace-as-suffix models have no
exact conversion here (:func:`unsupported` says why); utils.data.tok falls back to transformers'
conversion for them and says so. Parity is checked by tests/test_tokenizer.py against
``sentencepiece`` on every sample news document and on tricky strings (docs/tokenizer.md).
Converting a 32,000-piece model takes about a second.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from sentencepiece import sentencepiece_model_pb2 as pb
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors

from utils.cli import PipelineError

SPIECE_UNDERLINE = "\u2581"
# sentencepiece_model.proto ModelProto.SentencePiece.Type and TrainerSpec.ModelType
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2


class SpmUnsupported(PipelineError):
    """A SentencePiece model this module cannot convert exactly (see :func:`unsupported`)."""


def read_model(source: Union[str, Path, bytes]):
    """Parse a SentencePiece ``ModelProto`` from a path or bytes; a clear error if it is not one."""
    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    proto = pb.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception as e:   # protobuf DecodeError and friends
        raise PipelineError(f"{source if not isinstance(source, bytes) else 'data'} is not a "
                            f"SentencePiece model ({type(e).__name__}: {e}).") from e
    if not proto.pieces:
        raise PipelineError(f"{source if not isinstance(source, bytes) else 'data'} is not a "
                            "SentencePiece model (no pieces).")
    return proto


def is_spm_file(path: Path) -> bool:
    """Whether ``path`` is a readable SentencePiece model file."""
    try:
        read_model(path)
        return True
    except (PipelineError, OSError):
        return False


def _normalizer(ns):
    steps = []
    if ns.precompiled_charsmap:
        steps.append(normalizers.Precompiled(ns.precompiled_charsmap))
    if ns.remove_extra_whitespaces:
        steps += [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
    if ns.add_dummy_prefix:
        steps.append(normalizers.Prepend(SPIECE_UNDERLINE))
    if ns.escape_whitespaces:
        steps.append(normalizers.Replace(" ", SPIECE_UNDERLINE))
    return normalizers.Sequence(steps)


def _decoder(ns):
    steps = [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if ns.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    return decoders.Sequence(steps)


def bpe_merges(pieces) -> list[tuple[str, str]]:
    """All merges of a SentencePiece BPE model, in sentencepiece's priority order."""
    score = {p.piece: p.score for p in pieces if p.type == NORMAL}
    merges = []
    for piece, s in score.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in score and right in score:
                merges.append((-s, -len(left), -len(right), left, right))
    merges.sort()
    return [(m[3], m[4]) for m in merges]


def unsupported(proto) -> Optional[str]:
    """Why this model has no exact fast conversion (None when it has one).

    Measured limits of ``tokenizers``: a unigram model's Viterbi search can pick a control piece
    (``</s>``) out of plain text, and user-defined pieces are matched with the dummy prefix
    attached and not between other text; BPE models without user-defined pieces (Llama,
    CodeLlama, Mistral v1) are exact.
    """
    ts = proto.trainer_spec
    if ts.model_type != BPE:
        return f"it is a {'unigram' if ts.model_type == UNIGRAM else 'word/char'} model"
    if ts.treat_whitespace_as_suffix:
        return "it treats whitespace as a suffix"
    if any(p.type == USER_DEFINED for p in proto.pieces):
        return "it has user-defined pieces"
    return None


def backend_from_spm(source: Union[str, Path, bytes]):
    """A ``tokenizers.Tokenizer`` that encodes and decodes exactly as the SentencePiece model.

    Raises :class:`SpmUnsupported` (a PipelineError) for models :func:`unsupported` names.
    """
    proto = read_model(source)
    ns, ts = proto.normalizer_spec, proto.trainer_spec
    reason = unsupported(proto)
    if reason:
        where = source if not isinstance(source, bytes) else "the model"
        raise SpmUnsupported(f"{where}: no exact fast conversion of this SentencePiece model "
                             f"({reason}).")
    pieces = list(proto.pieces)
    unk = next((i for i, p in enumerate(pieces) if p.type == UNKNOWN), None)
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=bpe_merges(pieces), dropout=None,
                               unk_token=pieces[unk].piece if unk is not None else None,
                               fuse_unk=True, byte_fallback=bool(ts.byte_fallback)))
    tok.normalizer = _normalizer(ns)
    tok.pre_tokenizer = None
    tok.decoder = _decoder(ns)
    tok.add_special_tokens([AddedToken(p.piece, special=True, normalized=False)
                            for p in pieces if p.type in (CONTROL, UNKNOWN)])
    return tok


def special_pieces(source: Union[str, Path, bytes]) -> dict:
    """{'unk': '<unk>', 'bos': '<s>', 'eos': '</s>', 'pad': None} from the model's trainer spec."""
    proto = read_model(source)
    ts, n = proto.trainer_spec, len(proto.pieces)
    return {k: (proto.pieces[i].piece if 0 <= i < n else None)
            for k, i in (("unk", ts.unk_id), ("bos", ts.bos_id), ("eos", ts.eos_id),
                         ("pad", ts.pad_id))}


def tokenizer_from_spm(source: Union[str, Path]):
    """A transformers fast tokenizer (PreTrainedTokenizerFast) backed by :func:`backend_from_spm`.

    Special tokens come from the model (unk, bos, eos, pad ids of its trainer spec). Calling
    it with the transformers default ``add_special_tokens=True`` adds BOS, as Llama's own
    tokenizers do; the pipeline always frames documents itself (utils.data.tok.encode_plain).
    """
    from transformers import PreTrainedTokenizerFast    # 1.6 s: as in utils/data/tok.py, only to load

    backend = backend_from_spm(source)
    names = special_pieces(source)
    if names["bos"] is not None:
        bos_id = backend.token_to_id(names["bos"])
        backend.post_processor = processors.TemplateProcessing(
            single=f"{names['bos']} $A", pair=f"{names['bos']} $A {names['bos']} $B:1",
            special_tokens=[(names["bos"], bos_id)])
    kwargs = {f"{k}_token": v for k, v in names.items() if v is not None}
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                   **kwargs)
