"""Automatic prefix caching: the KV of token prefixes already seen, reused by later prompts
(library; no side effects). The engine (utils/generation/engine.py) owns one store per model
(``Engine.use_prefix_cache``); a batcher's prefill copies the longest cached prefix of a
prompt into the sequence's cache slot and computes only the rest.

    store = PrefixCache(budget_bytes, block_tokens=16)
    n = store.load(model, ids, kv, slot, limit, root=0)   # tokens of ids[:limit] whose KV is now in the slot
    store.save(model, ids, kv, slot, root=0)              # keep the full blocks of ids from the slot
    store.stats() -> {"hit_tokens", "queried_tokens", "blocks_used", "blocks_capacity",
                      "bytes_used", "bytes_budget", "block_tokens", "evicted_blocks"}   # plain ints

Blocks keyed by a chained hash, not a radix tree: a prompt is cut into blocks of
``block_tokens`` tokens and block i is stored under (the id of block i-1's entry, block i's
tokens), which is vLLM's chained block hash with the comparison made exact (a dict compares
the tokens, so two prefixes whose hashes collide never share KV). A block copies every layer's
K and V of its positions ((layers, 2, n_kv_heads, block_tokens, head_dim) in the weights'
dtype). Why blocks: the engine keeps one contiguous cache slot per sequence (a decode step
reads one block of memory), so reused KV is copied into the slot either way; with fixed-size
blocks the store's memory is a count of equal blocks, the lookup is one dict probe per block
and LRU eviction is per block, where a radix tree (SGLang) splits nodes at arbitrary token
counts to share KV in place, which a contiguous slot cannot. The cost: a prefix is reused up
to its last full block (at most ``block_tokens - 1`` tokens are recomputed).

What is stored: the full blocks of each prompt after its prefill, and of each finished
sequence's prompt + output (the positions its slot holds), so the next turn of a chat, which
resends the conversation, finds it. Eviction: least recently used first, within
``budget_bytes`` (the capacity in blocks is ``budget_bytes // block_bytes``). A lookup or save
touches its chain last block first, so a block is always more recent than the blocks after it
and eviction takes the ends of chains first (a block whose parent is gone could never be
reached again).

Adapters: a LoRA adapter's KV differs from the base's for the same tokens, so the first block
of a prompt run with an adapter hangs from that adapter's key (``root``: unique per loaded
adapter, utils/generation/adapters.py), the base's from 0: chains never cross adapters.

Model identity: the store remembers what its blocks were computed by (the model object and each
parameter's storage and ``_version``, as the decode pack does, utils/generation/pack.py); a
model whose weights changed since (an optimizer step, ``load_state_dict``, quantizing) finds
the store emptied, so a prefix never crosses models or weight versions.

Exactness: the reused K/V are those the earlier sequence computed, and the rest of the prompt
is prefilled over them with an explicit causal mask, so logits agree with a prefill of the
whole prompt to float rounding (a product over fewer rows sums in another order; K/V written
by decode steps are the decode path's), the same guarantee as batching (engine.py, Batcher).
Not for Infini-attention models (their slot holds one segment and a compressive memory of
everything before: no per-position KV to reuse) nor for prompts whose every position is scored
(``prompt_logprobs``: the hidden states of every prompt token are needed): the engine says so.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch

DEFAULT_BLOCK_TOKENS = 16


class _Block:
    """One cached block: its entry id (a child's key names it), key and K/V."""
    __slots__ = ("id", "key", "kv")

    def __init__(self, id_: int, key: tuple, kv: torch.Tensor):
        self.id, self.key, self.kv = id_, key, kv


def weights_identity(model) -> tuple:
    """What a model's KV depends on: the model object, each parameter's storage and version,
    its dtype and device (any change: another model, as far as the cache is concerned)."""
    w = model.tok_embeddings.weight
    return (id(model), str(w.dtype), str(w.device),
            tuple((p.data_ptr(), p._version) for p in model.parameters()))


class PrefixCache:
    """A store of KV blocks shared by every sequence of one model (see the module docstring)."""

    def __init__(self, budget_bytes: int, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 dtype: Optional[torch.dtype] = None):
        """``dtype``: the KV's, its engine's compute dtype (default: the weights')."""
        self.dtype = dtype
        if budget_bytes < 0 or block_tokens < 1:
            raise ValueError("the prefix cache needs a budget >= 0 bytes and blocks of >= 1 token")
        self.budget_bytes, self.block_tokens = int(budget_bytes), int(block_tokens)
        self.blocks: OrderedDict[tuple, _Block] = OrderedDict()     # least recently used first
        self.block_bytes = 0                    # set by the first model seen (see bind)
        self.identity: Optional[tuple] = None
        self.next_id = 1                        # 0 is the parent of a first block
        self.hit_tokens = self.queried_tokens = self.evicted_blocks = 0

    # -- the model the blocks belong to
    def bind(self, model) -> None:
        ident = weights_identity(model)
        if ident != self.identity:
            self.clear()
            a, w = model.args, model.tok_embeddings.weight
            self.identity = ident
            size = torch.empty((), dtype=self.dtype or w.dtype).element_size()
            self.block_bytes = a.n_layers * 2 * a.n_kv_heads * self.block_tokens * a.head_dim * size

    def clear(self) -> None:
        self.blocks.clear()

    @property
    def capacity(self) -> int:
        """Blocks the budget holds (0 before the first model is seen)."""
        return self.budget_bytes // self.block_bytes if self.block_bytes else 0

    def _chain(self, ids: list[int], n_blocks: int, create: bool, root=0) -> list[Optional[_Block]]:
        """The entries of the first ``n_blocks`` blocks of ``ids``, stopping at the first block
        not stored (``create``: a None for it and each one after, to be filled by the caller);
        ``root``: the parent of the first block (0: the base model; an adapter's key)."""
        B, parent, out = self.block_tokens, root, []
        for j in range(n_blocks):
            key = (parent, tuple(ids[j * B:(j + 1) * B]))
            blk = self.blocks.get(key) if parent is not None else None
            if blk is None and not create:
                break
            out.append(blk)
            parent = blk.id if blk is not None else None
        return out

    def _touch(self, chain: list[_Block]) -> None:
        """Most recently used, the first block last: a parent is always more recent than its
        children, so eviction takes the ends of chains first."""
        for blk in reversed(chain):
            self.blocks.move_to_end(blk.key)

    # -- the engine's two calls
    def load(self, model, ids: list[int], kv: list, slot: int, limit: int, root=0) -> int:
        """Copy the KV of the longest stored prefix of ``ids[:limit]`` (whole blocks) into cache
        slot ``slot`` of ``kv`` (per layer (k, v), each (slots, n_kv_heads, positions,
        head_dim)), from position 0; return its length in tokens (0: nothing stored). ``root``:
        whose KV it is (0: the base model's; a LoRA adapter's key, utils/generation/adapters.py)."""
        self.bind(model)
        self.queried_tokens += len(ids)
        chain = self._chain(ids, max(limit, 0) // self.block_tokens, create=False, root=root)
        if not chain:
            return 0
        self._touch(chain)
        n = len(chain) * self.block_tokens
        got = torch.stack([b.kv for b in chain], dim=3)      # (layers, 2, Hkv, blocks, B, hd)
        got = got.view(*got.shape[:3], n, got.shape[-1])      # (layers, 2, Hkv, n, hd)
        for layer, (k, v) in enumerate(kv):
            k[slot, :, :n].copy_(got[layer, 0])
            v[slot, :, :n].copy_(got[layer, 1])
        self.hit_tokens += n
        return n

    def save(self, model, ids: list[int], kv: list, slot: int, root=0) -> int:
        """Store the full blocks of ``ids`` (whose KV cache slot ``slot`` holds from position 0)
        that are not stored yet, evicting the least recently used beyond the budget; return the
        number of blocks added. A chain longer than the capacity keeps its first blocks."""
        self.bind(model)
        chain = self._chain(ids, min(len(ids) // self.block_tokens, self.capacity), create=True, root=root)
        first_new = next((j for j, b in enumerate(chain) if b is None), len(chain))
        for blk in chain[:first_new]:
            self.blocks.move_to_end(blk.key)                 # kept from eviction by the new blocks
        if first_new == len(chain):
            self._touch(chain)
            return 0
        B = self.block_tokens
        a, b = first_new * B, len(chain) * B
        fresh = torch.stack([torch.stack((k[slot, :, a:b], v[slot, :, a:b])) for k, v in kv])
        parent = chain[first_new - 1].id if first_new else root  # (layers, 2, Hkv, b - a, hd)
        for j in range(first_new, len(chain)):
            while len(self.blocks) >= self.capacity:
                self.blocks.popitem(last=False)
                self.evicted_blocks += 1
            s = (j - first_new) * B
            key = (parent, tuple(ids[j * B:(j + 1) * B]))
            chain[j] = self.blocks[key] = _Block(self.next_id, key, fresh[:, :, :, s:s + B].clone())
            parent, self.next_id = self.next_id, self.next_id + 1
        self._touch(chain)
        return len(chain) - first_new

    def stats(self) -> dict:
        """Plain ints for /health and /metrics (see the module docstring)."""
        return {"hit_tokens": self.hit_tokens, "queried_tokens": self.queried_tokens,
                "blocks_used": len(self.blocks), "blocks_capacity": self.capacity,
                "bytes_used": len(self.blocks) * self.block_bytes, "bytes_budget": self.budget_bytes,
                "block_tokens": self.block_tokens, "evicted_blocks": self.evicted_blocks}
