"""Paged KV caches and the block accounting shared by the target and the draft model.

One allocation per model: ``[layers, 2, num_blocks, block_size, Hkv, D]``. Viewed as ``[2 * layers, ...]`` it is the
plane stack that ``compact_kv_`` moves in one launch. Both models share one block table, so a request owns the same
block ids in both caches. Block 0 is a scratch block: padding rows of a ragged batch write there and nothing reads it.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict

import numpy as np
import torch

from spec_engine.models.config import ModelConfig
from spec_kernels import compact_kv_

SCRATCH_BLOCK = 0


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * torch.empty((), dtype=dtype).itemsize


class PagedKVCache:
    """The cache tensor of one model. Shapes: ``data [layers, 2, num_blocks, block_size, Hkv, D]``."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        shape = (cfg.num_hidden_layers, 2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def planes(self) -> torch.Tensor:
        """[2 * layers, num_blocks, block_size, Hkv, D]: every plane ``compact_kv_`` must move."""
        return self.data.flatten(0, 1)

    def compact_(self, cache_seqlens, accepted_nodes, num_accepted, *, block_table=None) -> None:
        """Move each row's accepted path to slots ``L_b ..`` in every plane (``compact_kv_``). A tensor-parallel
        shard (``spec_engine.distributed.ShardedKVCache``) also passes the path on to the other ranks."""
        compact_kv_(self.planes, cache_seqlens, accepted_nodes, num_accepted, block_table=block_table)


class BlockAllocator:
    """Free-list of KV blocks. A request takes the blocks of its prompt and its first step at admission and more as
    it grows (``take``); where none are left the engine preempts a request (``Scheduler.make_room``).

    With ``prefix_caching`` (vLLM's automatic prefix caching), a request's full blocks of prompt tokens (after a
    preemption, of the output its prefill computes again too) are cached as its prefill completes them (``cache``),
    under a key that names every token up to the block's end (``keys``: a SHA-256 chain over the blocks, so no crafted
    prompt can pass for another's), and a later request whose prompt starts with the same tokens takes them with their
    K/V instead of computing them again, while their first holder runs or after. A cached block no request holds is
    reclaimed, least recently used first, only when no free block is left. ``num_free`` counts such blocks as free.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is scratch); raise the memory budget")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self._free = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))  # pop() hands out low ids first
        self._refs: dict[int, int] = {}  # block -> the requests holding it (cached blocks may have several)
        self._key_of: dict[int, bytes] = {}  # cached block -> its key
        self._cached: dict[bytes, int] = {}  # key -> cached block
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached blocks no request holds, least recently used first

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks whose K/V a later request with the same prompt prefix can take."""
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def keys(self, tokens) -> list[bytes]:
        """The cache keys of the full blocks of ``tokens`` (a prompt's tokens whose K/V its prefill computes): each
        one names every token up to its block's end. [] without prefix caching."""
        if not self.prefix_caching:
            return []
        ids = np.asarray(tokens, dtype=np.int64)
        out, key = [], b""
        for start in range(0, len(ids) - self.block_size + 1, self.block_size):
            key = hashlib.sha256(key + ids[start : start + self.block_size].tobytes()).digest()
            out.append(key)
        return out

    def _hits(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``keys``."""
        hits = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_hits(self, keys: list[bytes]) -> int:
        """How many blocks of the longest prefix of ``keys`` are cached."""
        return len(self._hits(keys))

    def _fits(self, num_tokens: int, hits: list[int]) -> bool:
        """Whether the blocks ``num_tokens`` need beside ``hits`` are free (idle hits are taken, not reclaimed)."""
        return self.blocks_for(num_tokens) - len(hits) <= self.num_free - sum(b in self._idle for b in hits)

    def can_allocate(self, num_tokens: int, keys: list[bytes] = (), spare: int = 0) -> bool:
        """Whether ``allocate(num_tokens, keys)`` would succeed with ``spare`` blocks still free after it."""
        return self._fits(num_tokens + spare * self.block_size, self._hits(list(keys)))

    def allocate(self, num_tokens: int, keys: list[bytes] = ()) -> tuple[list[int], int]:
        """Blocks for ``num_tokens`` tokens, and how many of the first hold their tokens' K/V already: the cached
        blocks of the longest prefix of ``keys`` (``keys`` of the request's prompt)."""
        hits = self._hits(list(keys))
        if not self._fits(num_tokens, hits):
            raise MemoryError(f"need {self.blocks_for(num_tokens) - len(hits)} KV blocks, {self.num_free} free")
        for block in hits:
            self._idle.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1
        return hits + [self._take() for _ in range(self.blocks_for(num_tokens) - len(hits))], len(hits)

    def take(self, n: int) -> list[int]:
        """``n`` more blocks for a request that grows (none cached: they hold no K/V yet)."""
        if n > self.num_free:
            raise MemoryError(f"need {n} KV blocks, {self.num_free} free")
        return [self._take() for _ in range(n)]

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # the least recently used cached block that no request holds
            block, _ = self._idle.popitem(last=False)
            del self._cached[self._key_of.pop(block)]
        self._refs[block] = 1
        return block

    def cache(self, blocks: list[int], keys: list[bytes]) -> None:
        """Cache a request's first blocks under ``keys`` (full blocks of prompt K/V, all computed: a prefill chunk
        has just written them), the request still holding them; a key some other block holds already keeps that
        one (two requests that computed the same prompt together)."""
        for block, key in zip(blocks, keys):
            if block not in self._key_of and key not in self._cached:
                self._key_of[block], self._cached[key] = key, block

    def free(self, blocks: list[int]) -> None:
        """Return a request's blocks: its cached ones stay cached (idle, the request's last prompt blocks the first
        to be reclaimed), the others go back to the free list."""
        released = []
        for block in blocks:
            self._refs[block] -= 1
            if not self._refs[block]:
                del self._refs[block]
                released.append(block)
        for block in reversed(released):  # (deeper blocks less recently used: reclaimed first)
            if block in self._key_of:
                self._idle[block] = None
            else:
                self._free.append(block)


def plan_num_blocks(
    caches: list[tuple[ModelConfig, torch.dtype]], block_size: int, memory_budget_bytes: int, max_request_tokens: int
) -> int:
    """How many blocks fit the budget, counting every model's bytes per token (each cache in its model's dtype); at
    least one largest request (``max_request_tokens``: a full context plus the tree of its last step) and the
    scratch block."""
    per_token = sum(kv_bytes_per_token(c, dtype) for c, dtype in caches)
    num_blocks = memory_budget_bytes // (per_token * block_size)
    min_blocks = 1 + math.ceil(max_request_tokens / block_size)
    if num_blocks < min_blocks:
        raise ValueError(
            f"KV memory budget {memory_budget_bytes / 2**20:.0f} MiB holds {num_blocks} blocks of {block_size} tokens; "
            f"one request of {max_request_tokens} tokens (context + tree) needs {min_blocks}. Raise the budget or "
            "lower max_model_len."
        )
    return int(num_blocks)
