"""The model: a Llama-style decoder-only transformer (the network only).

Contract (docs/DESIGN.md section 7; details and presets in docs/model.md):

- ``ModelArgs`` (dataclass, ``to_dict`` / ``from_dict``) fully describes a model; checkpoints
  store it. ``model_args_from_config(cfg, vocab_size, bos_id)`` builds it from config.json's
  ``model`` section (preset first, explicit keys over it). A model's shape is checked in one
  place, ``utils.config.model_problems``, which config.json, that translation and ModelArgs
  itself run: a bad combination is a configuration error (exit 2) naming its ``model.<key>``,
  before anything is allocated. ``create_model(args)``.
- ``Transformer.forward(idx, targets=None, loss_mask=None, return_logits=True)`` ->
  ``(logits, loss)``. The loss is utils/loss.py's: targets equal to -100 are ignored,
  ``loss_mask`` (0/1 or fractional weights) weights each position, the loss is the weighted
  mean over counted positions (0 when none count). ``return_logits=False`` computes it by the
  fused, chunked linear + cross-entropy that never holds the (B, T, vocab) logits.
- Generation (KV cache, sampling, the step loop) is ``utils/generation/engine.py``; the
  network offers it ``trunk(idx, positions, spec, caches)`` (the prefill: caches filled
  through ``Attention.forward``) and each block's one-token ``decode`` step.
- The Hugging Face mapping (state-dict renames, config translation both ways) is
  ``utils/hf/mapping.py``: the layouts are Llama's, so it is a pure rename.

Building blocks: pre-norm blocks (RMSNorm, or bias-free LayerNorm), rotary embeddings as
pure functions over cached fp32 tables, grouped-query attention, gated MLP
(utils/activations.py), no biases, optional dropout, optional tied embeddings.
``attention="infini"``: Infini-attention (docs/long_context.md) — attention causal within
segments of ``segment_length`` tokens (RoPE positions restart at each segment) plus a
compressive memory of the earlier segments mixed in by a gate per head (utils/infini.py).

Attention backends, picked per call by utils/attention.py: flash-attn when importable, on
CUDA, in fp16/bf16; else a flex-attention block mask for document masks on CUDA; else
``F.scaled_dot_product_attention``. Importing this module has no side effects.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from utils import attention
from utils.activations import GatedMLP, llama_ffn_hidden
from utils.attention import AttnSpec
from utils.config import ConfigError, model_arguments, model_problems
from utils.infini import InfiniMemory
from utils.loss import cross_entropy, linear_cross_entropy, loss_weights


@dataclass
class ModelArgs:
    vocab_size: int
    d_model: int = 384
    n_layers: int = 8
    n_heads: int = 6
    n_kv_heads: int = 2
    ffn_hidden: Optional[int] = None  # None: Llama's 8/3 rule rounded up to 256
    activation: str = "swiglu"
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    max_seq_len: int = 512          # at most utils.config.MAX_POSITIONS
    dropout: float = 0.0
    tie_embeddings: bool = True
    document_mask: bool = False
    bos_id: Optional[int] = None
    init_std: float = 0.02
    attention: str = "standard"            # "standard" | "infini"
    segment_length: Optional[int] = None   # infini: tokens per segment
    infini_gate: Optional[str] = None      # infini: hard_sigmoid (default), sigmoid, tanh
    infini_delta_rule: Optional[bool] = None   # infini: delta-rule memory update (default true)

    def __post_init__(self):
        if self.ffn_hidden is None and isinstance(self.d_model, int) and self.d_model > 0:
            self.ffn_hidden = llama_ffn_hidden(self.d_model)
        if self.attention == "infini":
            self.infini_gate = self.infini_gate or "hard_sigmoid"
            self.infini_delta_rule = True if self.infini_delta_rule is None else self.infini_delta_rule
        problems = model_problems(self.to_dict())       # utils/config.py: the one check of a model's shape
        if problems:
            raise ConfigError(problems, "the model arguments")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def segment(self) -> Optional[int]:
        """Infini-attention's segment length; None for standard attention."""
        return self.segment_length if self.attention == "infini" else None

    @property
    def context(self) -> Optional[int]:
        """The longest input the model attends over: ``max_seq_len``, or None (no limit) for
        Infini-attention, whose memory carries any number of earlier segments."""
        return None if self.attention == "infini" else self.max_seq_len

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError([f"model.{k}: unknown model argument" for k in unknown], "the model arguments")
        if "vocab_size" not in d:
            raise ConfigError(["model.vocab_size: missing"], "the model arguments")
        return cls(**d)


# --------------------------------------------------------------------------- RoPE (pure functions)
def rope_tables(head_dim: int, n_positions: int, theta: float = 10_000.0,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (n_positions, head_dim) fp32, in the rotate-half layout (the frequency
    of pair i sits at columns i and i + head_dim/2), as Hugging Face Llama computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
                                / head_dim))
    t = torch.arange(n_positions, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)                      # (n_positions, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)               # (n_positions, head_dim)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, T, n_heads, head_dim) by per-position angles; ``cos``/``sin`` are
    (T, head_dim) shared by the batch or (B, T, head_dim) per row (restarting positions)."""
    cos = cos.unsqueeze(-2).to(x.dtype)                   # (T, 1, hd) or (B, T, 1, hd)
    sin = sin.unsqueeze(-2).to(x.dtype)
    return x * cos + rotate_half(x) * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with rotate-half's sign folded in (its first half negated): the table of
    :func:`apply_rope_rolled`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope_rows(cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The (cos, sin_signed) rows of a decode step's rows at positions ``pos`` (B,) from the
    tables ``cos``/``sin`` (n_positions, hd), each (B, 1, hd) in ``dtype`` (:meth:`Block.decode`,
    :func:`apply_rope_rolled`)."""
    return cos[pos][:, None].to(dtype), signed_sin(sin[pos][:, None]).to(dtype)


def apply_rope_rolled(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` bit for bit, in fewer operations (generation's decode steps): x (B,
    heads, hd), ``cos`` and ``sin_signed`` (:func:`signed_sin`) (B, 1, hd) in x's dtype.
    ``rotate_half(x) * sin`` is ``x.roll(hd / 2) * sin_signed``: the same products, the sign
    moved from x to the table."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def make_norm(args: ModelArgs) -> nn.Module:
    if args.norm == "rmsnorm":
        return RMSNorm(args.d_model, args.norm_eps)
    return nn.LayerNorm(args.d_model, eps=args.norm_eps, bias=False)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as Llama does)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:      # no conversions; one call (on CUDA one fused kernel)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.d_model, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.d_model, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.d_model, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.d_model, bias=False)
        self.dropout = args.dropout
        self.resid_dropout = nn.Dropout(args.dropout) if args.dropout > 0 else nn.Identity()
        self.memory = (InfiniMemory(args.n_heads, args.n_kv_heads, self.head_dim, args.segment_length,
                                    args.infini_gate, args.infini_delta_rule)
                       if args.attention == "infini" else None)

    def forward(self, x, cos, sin, spec: AttnSpec, cache: Any = None):
        """x (B, T, d_model). ``cache``: generation's per-layer KV cache (anything with
        ``update(k, v) -> (keys, values)``, and ``infini`` for infini layers,
        utils/generation/engine.py), None in training."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)       # (B, T, n_heads, hd)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)    # (B, T, n_kv_heads, hd)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q_pre, k_pre, v_new = q, k, v                                # the memory reads them before RoPE
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        p = self.dropout if self.training else 0.0
        gqa = self.n_kv_heads != self.n_heads
        if spec.kind == "flash":
            y = attention.flash_attn()[0](q, k, v, dropout_p=p, causal=True)   # (B, T, n_heads, hd)
        elif spec.kind == "varlen":
            n = B * T
            y = attention.flash_attn()[1](q.reshape(n, self.n_heads, -1), k.reshape(n, self.n_kv_heads, -1),
                                 v.reshape(n, self.n_kv_heads, -1), spec.cu_seqlens, spec.cu_seqlens,
                                 spec.max_seqlen, spec.max_seqlen, dropout_p=p, causal=True)
            y = y.view(B, T, self.n_heads, self.head_dim)
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # (B, H, T, hd)
            if cache is not None:
                k, v = cache.update(k, v)                                     # (B, Hkv, L, hd)
            if spec.kind == "flex":
                y = attention.flex_attn()[0](q, k, v, block_mask=spec.block_mask, enable_gqa=gqa)
            else:
                y = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=spec.mask if spec.kind == "mask" else None, dropout_p=p,
                    is_causal=spec.kind == "causal", enable_gqa=gqa)
            y = y.transpose(1, 2)                                             # (B, T, H, hd)
        if self.memory is not None:                                           # local y + memory
            y = self.memory(y, q_pre, k_pre, v_new, cache.infini if cache is not None else None)
        return self.resid_dropout(self.wo(y.reshape(B, T, self.n_heads * self.head_dim)))

    def decode(self, x, cos, sin_signed, cache: Any, key_bias: Optional[torch.Tensor], packed: Any = None):
        """One new token per row over the cache: x (B, d_model) -> (B, d_model). ``cos`` and
        ``sin_signed`` (B, 1, hd): each row's RoPE angle (:func:`apply_rope_rolled`); ``cache``:
        ``update(k, v)`` with (B, n_kv_heads, hd) -> (keys, values) (B, n_kv_heads, L, hd).
        Plain matmul attention (softmax(q k^T / sqrt(hd) + key_bias) v, the query heads of one
        KV head batched together) instead of SDPA, whose CPU kernel pays a parallel region per
        call for a single query. ``key_bias`` (B, L): 0 for keys to attend, -inf for padding;
        None when every row attends over all L keys. When ``cache.update`` returns the keys of
        one sequence (1, n_kv_heads, L, hd), the B rows are B consecutive tokens of it (prompt
        lookup's verify pass, utils/generation/speculative.py): their queries are folded into
        one product, each with its own row of ``key_bias``. ``packed``: this layer's decode weights
        (``utils.generation.pack.PackedLayer``: fused q|k|v and products by ``packed.mm``);
        None: the Linear layers. A decode step pays a fixed dispatch cost per operation on CPU,
        so q and k are rotated together and the projections are fused."""
        B = x.shape[0]
        H, Hkv, G, hd = self.n_heads, self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim
        if packed is not None:
            qkv = packed.mm(x, packed.qkv)                                  # (B, (H + 2 Hkv) hd)
        else:
            qkv = torch.cat((self.wq(x), self.wk(x), self.wv(x)), dim=-1)
        qkv = qkv.view(B, H + 2 * Hkv, hd)
        qk = apply_rope_rolled(qkv[:, :H + Hkv], cos, sin_signed)          # (B, H + Hkv, hd)
        v = qkv[:, H + Hkv:]                                                # (B, Hkv, hd)
        keys, values = cache.update(qk[:, H:], v)                           # (B, Hkv, L, hd)
        q, L = qk[:, :H].view(B, Hkv, G, hd), keys.shape[2]
        bias = None if key_bias is None else key_bias[:, None, None, :L]   # (B, 1, 1, L)
        one = keys.shape[0] != B               # B tokens of one sequence: their queries side by side
        if one:
            q = q.transpose(0, 1).reshape(1, Hkv, B * G, hd)
            bias = None if key_bias is None else key_bias.repeat_interleave(G, dim=0)[None, None, :, :L]
        att = torch.matmul(q, keys.transpose(-1, -2))                       # (B, Hkv, G, L)
        att.mul_(1.0 / math.sqrt(hd))
        if bias is not None:
            att.add_(bias)
        y = torch.matmul(att.softmax(dim=-1, dtype=torch.float32).to(values.dtype), values)  # (B, Hkv, G, hd)
        if one:
            y = y.view(Hkv, B, G, hd).transpose(0, 1)
        if self.memory is not None:                                         # local y + memory (pre-RoPE q, k)
            y = self.memory(y.view(B, 1, H, hd), qkv[:, None, :H], qkv[:, None, H:H + Hkv], v[:, None],
                            cache.infini)
        y = y.reshape(B, H * hd)
        return packed.mm(y, packed.wo) if packed is not None else self.wo(y)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attn_norm = make_norm(args)
        self.attn = Attention(args)
        self.mlp_norm = make_norm(args)
        self.mlp = GatedMLP(args.d_model, args.ffn_hidden, args.activation, args.dropout)

    def forward(self, x, cos, sin, spec: AttnSpec, cache: Any = None):
        x = x + self.attn(self.attn_norm(x), cos, sin, spec, cache)
        return x + self.mlp(self.mlp_norm(x))

    def decode(self, x, cos, sin_signed, cache: Any, key_bias: Optional[torch.Tensor], packed: Any = None):
        """One new token per row: x (B, d_model), see :meth:`Attention.decode`. The norms'
        ``forward`` is called directly (a decode step runs 2 x n_layers of them; no hooks)."""
        x = x + self.attn.decode(self.attn_norm.forward(x), cos, sin_signed, cache, key_bias, packed)
        h = self.mlp_norm.forward(x)
        return x + (self.mlp(h) if packed is None else self.mlp.packed(h, packed.gate_up, packed.down, packed.mm))


# --------------------------------------------------------------------------- the model
class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.d_model)
        self.emb_dropout = nn.Dropout(args.dropout) if args.dropout > 0 else nn.Identity()
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = make_norm(args)
        self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        self.gradient_checkpointing = False  # recompute each block in backward (big models, small GPUs)
        # fused loss rows per chunk: ~128 MB of fp32 logits (1,048 rows at 32k), so a CPU batch is
        # one chunk (fewer passes over the head's gradient), a GPU batch a few dozen
        self.loss_chunk_rows = max(64, (1 << 25) // args.vocab_size)
        self._rope: dict = {}  # device -> (cos, sin) fp32, grown on demand; not a buffer, so .to(bf16) keeps it fp32
        self.reset_parameters()

    # ------------------------------------------------------------------ init and sizes
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) matrices; residual output projections scaled by 1/sqrt(2L); norm
        weights 1; infini gate parameters 0."""
        std = self.args.init_std
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                s = std / math.sqrt(2 * self.args.n_layers) if name.endswith(("wo.weight", "w_down.weight")) else std
                nn.init.normal_(p, mean=0.0, std=s)
            elif name.endswith("memory.beta"):
                nn.init.zeros_(p)                   # infini gates start at g(0): both paths mixed
            else:
                nn.init.ones_(p)

    def num_params(self, non_embedding: bool = False) -> int:
        """Unique parameters (tied weights once); ``non_embedding`` leaves out the embedding
        and, when untied, the output head."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_embeddings.weight.numel()
            if not self.args.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n

    def flops_per_token(self, seq_len: Optional[int] = None) -> float:
        """Training FLOPs per token (forward + backward): 6 x matmul parameters (the output
        head included, the embedding lookup not) + 12 x layers x d_model x seq_len for
        attention scores (PaLM appendix B). For MFU."""
        a = self.args
        T = seq_len or a.max_seq_len
        if a.segment is not None:                 # infini: local attention spans one segment
            T = min(T, a.segment)
        n_matmul = self.num_params(non_embedding=True) + a.vocab_size * a.d_model
        return 6.0 * n_matmul + 12.0 * a.n_layers * a.d_model * T

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    # ------------------------------------------------------------------ forward
    def attention_path(self, device_type: str, dtype: torch.dtype) -> str:
        """Which attention kernel training runs with, and why not a faster one (utils/attention.py)."""
        return attention.attention_path(self.args.document_mask, self.tok_embeddings.weight.dtype,
                                        device_type, dtype, segmented=self.args.segment is not None)

    def rope(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached (cos, sin) tables covering at least ``n`` positions on ``device``. They are
        made outside inference mode whoever asks first (a generation before training, as RL's
        rollouts do): inference tensors could not be saved for a later backward pass."""
        key = str(device)
        tab = self._rope.get(key)
        if tab is None or tab[0].shape[0] < n:
            size = max(n, self.args.max_seq_len, 0 if tab is None else 2 * tab[0].shape[0])
            with torch.inference_mode(False):
                tab = rope_tables(self.args.head_dim, size, self.args.rope_theta, device)
            self._rope[key] = tab
        return tab

    def decode_rope(self, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                    dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`rope_rows` of the tables :meth:`rope` gave (called outside inference mode, so
        they stay usable for training) in ``dtype``, the step's compute dtype (default: the
        weights'): a decode step's RoPE rows."""
        return rope_rows(cos, sin, pos, dtype or self.tok_embeddings.weight.dtype)

    def trunk(self, idx, positions, spec: AttnSpec, caches=None) -> torch.Tensor:
        """Embeddings -> blocks -> final norm: (B, T) -> (B, T, d_model)."""
        B, T = idx.shape
        start = caches[0].pos if caches else 0
        if positions is None:
            cos, sin = self.rope(start + T, idx.device)
            cos, sin = cos[start:start + T], sin[start:start + T]           # (T, hd)
        else:
            cos, sin = self.rope(int(positions.max()) + 1, idx.device)
            cos, sin = cos[positions], sin[positions]                       # (B, T, hd)
        h = self.emb_dropout(self.tok_embeddings(idx))                      # (B, T, d_model)
        for i, layer in enumerate(self.layers):
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, spec, None, use_reentrant=False)
            else:
                h = layer(h, cos, sin, spec, caches[i] if caches else None)
        return self.norm(h)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, return_logits: bool = True):
        """(B, T) token ids -> (logits (B, T, vocab) or None, loss or None)."""
        B, T = idx.shape
        positions, spec = attention.forward_spec(idx, self.tok_embeddings.weight.dtype,
                                                 self.args.document_mask, self.args.bos_id,
                                                 self.args.segment)
        h = self.trunk(idx, positions, spec)
        if targets is None:
            return self.lm_head(h), None
        w = loss_weights(targets.reshape(-1), loss_mask)                    # (B*T,) utils/loss.py
        if return_logits:
            logits = self.lm_head(h)                                          # (B, T, vocab)
            return logits, cross_entropy(logits, targets, w)
        return None, linear_cross_entropy(h.reshape(B * T, -1), self.lm_head.weight, targets.reshape(-1),
                                          w, self.loss_chunk_rows)            # no (B, T, vocab) logits


LAYER_KEY = r"layers\.(\d+)\."    # a Transformer state-dict name of block N: layers.N.<...>


def layer_count(names, pattern: str = LAYER_KEY) -> int:
    """The layers a state dict's (or weight file's) tensor ``names`` hold: 1 + the highest index
    ``pattern`` captures at the start of a name (0 when none does). The default is this model's
    naming; utils/hf/import_hf.py passes Hugging Face's (``model.layers.N.``) and GGUF's
    (``blk.N.``). Checks that stored weights agree with a config's layer count use it before
    any model of that config is built."""
    rx = re.compile(pattern)
    return 1 + max((int(m.group(1)) for m in map(rx.match, names) if m), default=-1)


def create_model(args: ModelArgs | dict, device: torch.device | str | None = None) -> Transformer:
    """Build a freshly initialized Transformer (on ``device`` if given)."""
    if isinstance(args, dict):
        args = ModelArgs.from_dict(args)
    model = Transformer(args)
    return model.to(device) if device is not None else model


def model_args_from_config(cfg, vocab_size: Optional[int], bos_id: Optional[int] = None) -> ModelArgs:
    """ModelArgs from config.json's ``model`` section (``cfg``: a Config or its ModelConfig)
    for a tokenizer of ``vocab_size`` tokens and BOS id ``bos_id``: the preset fills the shape
    keys left null, explicit keys win (utils/config.py's ``model_arguments``, which checks
    them). Raises ConfigError (exit 2)."""
    values = model_arguments(getattr(cfg, "model", cfg), vocab_size, bos_id)
    return ModelArgs(**{f.name: values[f.name] for f in dataclasses.fields(ModelArgs)})
