"""One scoring interface over our checkpoints and Hugging Face causal LMs.

An adapter holds a model and its tokenizer and gives, in batches and without gradients:

- :meth:`Adapter.score` — for token sequences, the log-probability of their last ``n`` tokens,
  whether each of those is the greedy (argmax) token, and top-1/5/10 hits;
- :meth:`Adapter.loglikelihood` — lm-evaluation-harness's ``loglikelihood``: (context,
  continuation) strings -> (sum log p(continuation | context), is_greedy), with its pair
  encoding (trailing context spaces move to the continuation; the whole string is encoded and
  the continuation is what follows the context's tokens);
- :meth:`Adapter.generate_greedy` — greedy continuation of prompts.

Only :meth:`Adapter.logits` differs between our model and a Hugging Face one, so both are
scored by the same code. Text is encoded with :func:`utils.data.tok.encode_plain` (a literal
"<s>" in benchmark text is text, never a special id). BOS: our checkpoints saw every document
as BOS + tokens + EOS, so a context starts with BOS; a Hugging Face model gets its tokenizer's
default (what lm-eval 0.4 does: ``tokenizer.encode`` with its own special-token setting).
Batches are right-padded (causal scoring never looks right), sorted longest first, and
sequences longer than the model's context keep their last ``max_length + 1`` tokens (lm-eval's
left truncation). Log-softmax is taken in float32.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from utils import attention, device as devices, quant
from utils.cli import PipelineError
from utils.data.chat import adds_bos, rules_of_checkpoint, stop_ids_of
from utils.data.tok import encode_plain, load_tokenizer_folder
from utils.data.tok import fingerprint as tokenizer_fingerprint
from utils.generation.engine import Engine, NonFiniteLogits, SamplingParams
from utils.generation.engine import Sequence as GenSequence
from utils.hf.import_hf import load_hf_llama
from utils.run import load_model, tokenizer_for_checkpoint
from utils.training.trainer import resolve_dtype

TOPK = (1, 5, 10)


@dataclass
class SeqScore:
    ll: float                 # sum of log-probs of the scored tokens
    n: int                    # tokens scored
    greedy: bool              # every scored token is the argmax
    topk: dict                # k -> how many scored tokens were in the top k


def resolve_device(name: str) -> torch.device:
    return devices.resolve_device(name, "benchmark.device")


def autocast_dtype(dtype: str, device: torch.device) -> Optional[torch.dtype]:
    """The training rule (utils.training.trainer.resolve_dtype: auto = bf16 on CUDA, fp16 where bf16 is
    unsupported, float32 on CPU), with None for full float32."""
    resolved = resolve_dtype(dtype, device)
    return None if resolved == torch.float32 else resolved


class Adapter:
    """Base class: subclasses set ``tok``, ``device``, ``max_length``, ``add_bos``, ``identity``
    and implement :meth:`logits`."""

    name: str
    tok = None
    device: torch.device = torch.device("cpu")
    max_length: int = 2048
    long_context: bool = False      # no context limit (Infini-attention): never truncated
    add_bos: bool = False
    identity: dict = {}
    amp: Optional[torch.dtype] = None

    # ---- model-specific
    def logits(self, idx: torch.Tensor) -> torch.Tensor:   # (B, T) -> (B, T, V)
        raise NotImplementedError

    # ---- shared
    @property
    def bos_id(self) -> Optional[int]:
        return self.tok.bos_token_id

    @property
    def eos_id(self) -> Optional[int]:
        return self.tok.eos_token_id

    @property
    def stop_ids(self) -> tuple:
        """Where a greedy continuation ends: the model's stop ids (utils/data/chat.py), set by
        the subclasses that know them; else EOS."""
        return getattr(self, "_stop_ids", None) or ((self.eos_id,) if self.eos_id is not None else ())

    @property
    def prefix_token_id(self) -> int:
        """Start token for an empty context (lm-eval: BOS, else EOS)."""
        pid = self.bos_id if self.bos_id is not None else self.eos_id
        if pid is None:
            raise PipelineError(f"{self.name}: the tokenizer has neither BOS nor EOS; an empty "
                                "context cannot be scored.")
        return pid

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return encode_plain(self.tok, texts)

    def _framed(self, ids: list[int]) -> list[int]:
        return ([self.bos_id] + ids) if self.add_bos and self.bos_id is not None else ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's pair encoding (see module docstring)."""
        if context == "":
            return [self.prefix_token_id], self.encode([continuation])[0]
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        whole, ctx = self.encode([context + continuation, context])
        whole, ctx = self._framed(whole), self._framed(ctx)
        return ctx, whole[len(ctx):]

    def logits_at(self, idx: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """The logits of positions ``spans[r] = (start, end)`` of each row r (what scoring
        reads); this default computes every position's. Our model's adapters compute the
        output layer on those positions only (a 10-shot prompt scores a few tokens of
        hundreds: the (B, T, vocab) logits were most of the time)."""
        logits = self.logits(idx)
        return [logits[r, a:b] for r, (a, b) in enumerate(spans)]

    def _forward(self, idx: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        if self.amp is not None:
            with torch.autocast(device_type=self.device.type, dtype=self.amp):
                rows = self.logits_at(idx, spans)
        else:
            rows = self.logits_at(idx, spans)
        logits = torch.cat(rows) if rows else torch.zeros(0)
        if not bool(torch.isfinite(logits).all()):     # NaN compares false: ranks and losses would be garbage
            raise PipelineError(f"{self.name}: the model's logits are not finite (NaN or inf): its arithmetic "
                                "overflows (weights near float32's limit, 3e38, give inf, then NaN) or its "
                                "weights are damaged; nothing can be scored.")
        return rows

    @torch.no_grad()
    def score(self, seqs: Sequence[Sequence[int]], n_score: Sequence[int], batch_size: int = 8,
              progress=None) -> list[SeqScore]:
        """Score the last ``n_score[i]`` tokens of each ``seqs[i]`` given what precedes them."""
        items = []
        for s, n in zip(seqs, n_score):
            s = list(s)[-(self.max_length + 1):]
            if n < 1 or n >= len(s) + 1 or len(s) < 2:
                raise ValueError("each sequence needs at least one context token and n >= 1")
            items.append((s, min(n, len(s) - 1)))
        order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
        out: list[Optional[SeqScore]] = [None] * len(items)
        for b in range(0, len(order), batch_size):
            chunk = order[b:b + batch_size]
            width = max(len(items[i][0]) - 1 for i in chunk)
            idx = torch.zeros((len(chunk), width), dtype=torch.long)
            for r, i in enumerate(chunk):
                s = items[i][0][:-1]
                idx[r, :len(s)] = torch.tensor(s, dtype=torch.long)
            spans = [(len(items[i][0]) - 1 - items[i][1], len(items[i][0]) - 1) for i in chunk]
            logits = self._forward(idx.to(self.device), spans)
            for r, i in enumerate(chunk):
                s, n = items[i]
                lg = logits[r].float()                                          # (n, V)
                tgt = torch.tensor(s[-n:], dtype=torch.long, device=lg.device)
                logp = torch.log_softmax(lg, dim=-1).gather(1, tgt[:, None])[:, 0]
                greedy = bool((lg.argmax(dim=-1) == tgt).all())
                rank = (lg > lg.gather(1, tgt[:, None])).sum(dim=-1)          # strictly better
                out[i] = SeqScore(ll=float(logp.sum()), n=n, greedy=greedy,
                                  topk={k: int((rank < k).sum()) for k in TOPK})
            if progress is not None:
                progress.update(len(chunk))
        return out  # type: ignore[return-value]

    def loglikelihood(self, pairs: Sequence[tuple[str, str]], batch_size: int = 8,
                      progress=None) -> list[tuple[float, bool, int]]:
        """(log-likelihood, is_greedy, continuation tokens) per (context, continuation)."""
        seqs, ns = [], []
        for ctx, cont in pairs:
            c, t = self.encode_pair(ctx, cont)
            if not t:
                raise ValueError(f"continuation {cont!r} encodes to no tokens")
            seqs.append(c + t)
            ns.append(len(t))
        return [(s.ll, s.greedy, s.n) for s in self.score(seqs, ns, batch_size, progress)]

    def generate_until(self, prompts: Sequence[list[int]], max_new_tokens: int,
                       until: Sequence[str]) -> list[str]:
        """Greedy text after each prompt (lm-eval's ``generate_until``): decoding of a row
        ends at the model's stop ids, at one of the ``until`` strings (the engine's stop
        strings) or after ``max_new_tokens``; the prompt keeps its last ``max_length -
        max_new_tokens`` tokens (lm-eval's left truncation). The caller cuts the text at
        the stop strings (tasks.cut_at_stops), as lm-eval does."""
        if getattr(self, "_engine", None) is None:
            self._engine = Engine(self.model)
        keep = None if self.long_context else max(1, self.max_length - max_new_tokens)
        rows = [list(p)[-keep:] if keep else list(p) for p in prompts]
        capacity = max(len(r) for r in rows) + max_new_tokens
        batcher = self._engine.batcher(len(rows), capacity)
        params = SamplingParams(max_new_tokens, temperature=0.0, stop_ids=frozenset(self.stop_ids),
                                stop=tuple(until))
        out: list[list[int]] = [[] for _ in rows]
        for r, ids in enumerate(rows):
            batcher.add(GenSequence(ids, params, tok=self.tok, tag=r))
        try:
            for events in self._engine.run(batcher):
                for e in events:
                    if e.token is not None:
                        out[e.seq.tag].append(e.token)
        except NonFiniteLogits as e:
            raise PipelineError(f"{self.name}: {e}.") from None
        return [self.tok.decode(ids, skip_special_tokens=True) for ids in out]

    def quantize_int8(self) -> str:
        """Weight-only int8 (utils/quant.py) for our model's adapters; the identity keeps the
        checkpoint's fingerprint and says ``quantize: int8``, the name gets `` [int8]``."""
        report = quant.quantize_int8(self.model)
        self.identity["quantize"] = "int8"
        self.name += " [int8]"
        return report.line()

    def generate_greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation through the generation engine (stops at EOS, which is not
        returned); the prompt keeps its last ``max_length - max_new_tokens`` tokens, so prompt
        and continuation fit the model's context (the whole prompt for ``long_context``
        models). Runs at the scoring's precision (``amp``: its autocast, or none), so a task
        that generates and one that scores compute alike."""
        if getattr(self, "_engine", None) is None:
            self._engine = Engine(self.model, amp=self.amp)
        keep = len(prompt_ids) if self.long_context else max(1, self.max_length - max_new_tokens)
        try:
            return self._engine.generate([list(prompt_ids)[-keep:]], max_new_tokens, temperature=0,
                                         eos_id=self.stop_ids)[0]
        except NonFiniteLogits as e:
            raise PipelineError(f"{self.name}: {e}.") from None


# --------------------------------------------------------------------------- our checkpoints
class CheckpointAdapter(Adapter):
    """A checkpoint of this pipeline, loaded through utils.run.load_model."""

    def __init__(self, path: Path, cfg, device: torch.device, dtype: str = "auto",
                 tokenizers: Optional[dict] = None):
        self.path = Path(path)
        self.model, ckpt = load_model(self.path, device=str(device))
        self.device, self.amp = device, autocast_dtype(dtype, device)
        args = ckpt["model_args"]
        self.max_length = int(args.get("max_seq_len", 2048))
        self.long_context = self.model.args.context is None
        self.tok, tok_info = tokenizer_for_checkpoint(   # ``tokenizers``: the caller's cache
            ckpt, cfg, self.path, say=lambda m: print(m, file=sys.stderr), cache=tokenizers)
        rules = rules_of_checkpoint(ckpt, self.tok)
        self.add_bos, self._stop_ids = rules.add_bos, rules.stop_ids
        self.name = _run_label(self.path)
        self.identity = {
            "kind": "checkpoint", "path": str(self.path), "checkpoint_kind": ckpt.get("kind"),
            "step": ckpt.get("step"), "tokens_seen": ckpt.get("tokens_seen"),
            "fingerprint": weights_fingerprint(self.model.state_dict()),
            "tokenizer": tok_info, "model_args": args,
            "parameters": sum(p.numel() for p in self.model.parameters()),
        }

    def logits(self, idx):
        logits, _ = self.model(idx)
        return logits

    def logits_at(self, idx, spans):
        return our_logits_at(self.model, idx, spans)


def our_logits_at(model, idx: torch.Tensor, spans) -> list[torch.Tensor]:
    """Our model's forward pass (model.py ``forward``: the attention spec, the trunk) with the
    output layer applied to the ``spans`` positions of each row only."""
    a = model.args
    positions, spec = attention.forward_spec(idx, model.tok_embeddings.weight.dtype, a.document_mask,
                                             a.bos_id, a.segment)
    h = model.trunk(idx, positions, spec)
    rows = [h[r, s:e] for r, (s, e) in enumerate(spans)]
    out = model.lm_head(torch.cat(rows))
    return list(torch.split(out, [e - s for s, e in spans]))


class ImportedAdapter(Adapter):
    """A Hugging Face Llama folder or .gguf file imported as our model (utils/hf/import_hf.py):
    our forward pass on its weights, its own tokenizer; BOS framing as ``HFAdapter`` decides it
    for the same folder, so both score the same token sequences."""

    def __init__(self, path: Path, device: torch.device, dtype: str = "auto"):
        imported = load_hf_llama(path)
        self.model = imported.model.to(device).eval()
        self.device, self.amp = device, autocast_dtype(dtype, device)
        self.tok = imported.tok
        self.add_bos, self._stop_ids = imported.rules.add_bos, imported.rules.stop_ids
        self.max_length = int(self.model.args.max_seq_len)
        self.name = f"{Path(imported.source).name} (imported)"
        self.identity = {"kind": "imported", "path": imported.source,
                         "fingerprint": weights_fingerprint(self.model.state_dict()),
                         "tokenizer": imported.tok_info, "model_args": self.model.args.to_dict(),
                         "parameters": sum(p.numel() for p in self.model.parameters())}

    def logits(self, idx):
        logits, _ = self.model(idx)
        return logits

    def logits_at(self, idx, spans):
        return our_logits_at(self.model, idx, spans)


def _run_label(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}" if path.parent.name else path.stem


def weights_fingerprint(state_dict: dict) -> str:
    """sha256 over parameter names, shapes, dtypes and bytes (identifies the exact weights)."""
    h = hashlib.sha256()
    for k in sorted(state_dict):
        t = state_dict[k].detach().cpu().contiguous()
        h.update(json.dumps([k, list(t.shape), str(t.dtype)]).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# --------------------------------------------------------------------------- Hugging Face
class HFAdapter(Adapter):
    """A Hugging Face causal LM: a local folder (save_pretrained), a folder or file with a
    .gguf (``gguf_file``), or a hub name when online."""

    def __init__(self, spec: str, device: torch.device, dtype: str = "auto",
                 gguf_file: Optional[str] = None, model=None, tok=None):
        self.device, self.amp = device, autocast_dtype(dtype, device)
        self.name = Path(spec).name or spec
        if model is None:
            model, tok, spec = load_hf(spec, gguf_file)
        self.model = model.to(device).eval()
        self.tok = tok
        self.add_bos = adds_bos(tok)
        eos = getattr(model.generation_config, "eos_token_id", None)
        self._stop_ids = stop_ids_of(eos if eos is not None else model.config.eos_token_id, tok, None)
        c = model.config
        self.max_length = int(getattr(c, "max_position_embeddings", None) or 2048)
        self.identity = {
            "kind": "huggingface", "path": spec, "gguf_file": gguf_file,
            "architecture": type(model).__name__,
            "fingerprint": weights_fingerprint(model.state_dict()),
            "tokenizer": {"name": getattr(tok, "name_or_path", None), "vocab_size": len(tok),
                          "bos_id": tok.bos_token_id, "eos_id": tok.eos_token_id,
                          "fingerprint": tokenizer_fingerprint(tok)},
            "parameters": sum(p.numel() for p in model.parameters()),
        }

    def logits(self, idx):
        return self.model(input_ids=idx).logits

    @torch.no_grad()
    def generate_greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt_ids[-self.max_length:]], dtype=torch.long, device=self.device)
        stops = list(self.stop_ids)
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new_tokens, eos_token_id=stops or None,
                                  pad_token_id=stops[0] if stops else 0)
        new = out[0, ids.shape[1]:].tolist()
        ends = [i for i, t in enumerate(new) if t in stops]
        return new[:ends[0]] if ends else new

    @torch.no_grad()
    def generate_until(self, prompts: Sequence[list[int]], max_new_tokens: int,
                       until: Sequence[str]) -> list[str]:
        """As :meth:`Adapter.generate_until`, through transformers' ``generate`` (greedy, one
        prompt at a time: no padding, the same tokens as lm-eval's HFLM at batch size 1;
        ``stop_strings`` end it)."""
        stops = list(self.stop_ids)
        keep = max(1, self.max_length - max_new_tokens)
        texts = []
        for p in prompts:
            ids = torch.tensor([list(p)[-keep:]], dtype=torch.long, device=self.device)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_new_tokens, eos_token_id=stops or None,
                                      pad_token_id=stops[0] if stops else 0,
                                      stop_strings=list(until), tokenizer=self.tok)
            new = out[0, ids.shape[1]:].tolist()
            ends = [i for i, t in enumerate(new) if t in stops]
            texts.append(self.tok.decode(new[:ends[0]] if ends else new, skip_special_tokens=True))
        return texts


def load_hf(spec: str, gguf_file: Optional[str] = None):
    """(model, tokenizer, resolved spec) from a folder, a .gguf file, or a hub name."""
    p = Path(spec).expanduser()
    kw = {}
    if p.is_file() and p.suffix == ".gguf":
        gguf_file, p = p.name, p.parent
    if gguf_file:
        kw["gguf_file"] = gguf_file
    if p.exists():
        where = str(p.resolve())
    elif spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise PipelineError(f"--hf-model {spec}: no such folder or file.")
    else:
        where = spec
    folder = p.is_dir() and not gguf_file
    if folder:                                  # a damaged tokenizer file named, as an import names it
        tok = load_tokenizer_folder(p, imported=True)
    try:
        if not folder:
            tok = AutoTokenizer.from_pretrained(where, **kw)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw)
    except Exception as e:
        hint = ("" if p.exists() else " Offline, pass a local folder saved with save_pretrained "
                "(or a .gguf file); hub names need network or the local HF cache.")
        raise PipelineError(f"cannot load Hugging Face model '{spec}': {type(e).__name__}: "
                            f"{str(e)[:300]}.{hint}") from e
    return model, tok, where
