"""Paged KV caches and the block accounting shared by the target and the draft model.

One allocation per model: ``[layers, 2, num_blocks, block_size, Hkv, D]``. Viewed as ``[2 * layers, ...]`` it is the
plane stack that ``compact_kv_`` moves in one launch. Both models share one block table, so a request owns the same
block ids in both caches. Block 0 is a scratch block: padding rows of a ragged batch write there and nothing reads it.
"""

from __future__ import annotations

import math

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
    """Free-list of KV blocks. A request reserves all the blocks it can ever need at admission, so it never OOMs."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is scratch); raise the memory budget")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= len(self._free)

    def allocate(self, num_tokens: int) -> list[int]:
        n = self.blocks_for(num_tokens)
        if n > len(self._free):
            raise MemoryError(f"need {n} KV blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


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
