"""Tests of spec_engine.kv_cache: the block allocator, the paged cache's layout, and the memory plan."""

from __future__ import annotations

import pytest
import torch

from spec_engine.kv_cache import SCRATCH_BLOCK, BlockAllocator, PagedKVCache, kv_bytes_per_token, plan_num_blocks
from spec_engine.models import ModelConfig
from spec_kernels import PAD_NODE, compact_kv_ref


def config(layers: int = 2, kv_heads: int = 3, head_dim: int = 80) -> ModelConfig:
    return ModelConfig("llama", vocab_size=111, hidden_size=6 * head_dim, intermediate_size=64,
                       num_hidden_layers=layers, num_attention_heads=6, num_key_value_heads=kv_heads,
                       head_dim=head_dim)  # fmt: skip


# --- BlockAllocator -------------------------------------------------------------------------------------------


def test_allocator_never_hands_out_the_scratch_block():
    alloc = BlockAllocator(num_blocks=5, block_size=4)
    blocks, cached = alloc.allocate(16)  # every usable block
    assert sorted(blocks) == [1, 2, 3, 4] and SCRATCH_BLOCK not in blocks and cached == 0
    assert alloc.num_free == 0 and alloc.num_used == 4


def test_allocator_rounds_up_to_whole_blocks():
    alloc = BlockAllocator(num_blocks=9, block_size=4)
    assert [alloc.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert len(alloc.allocate(5)[0]) == 2 and alloc.num_free == 6
    assert alloc.can_allocate(24) and not alloc.can_allocate(25)


def test_allocator_raises_when_full_and_reuses_freed_blocks():
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    first, _ = alloc.allocate(4)
    with pytest.raises(MemoryError, match="need 2 KV blocks, 1 free"):
        alloc.allocate(3)
    alloc.free(first)
    assert alloc.num_used == 0 and alloc.num_free == 3
    assert alloc.allocate(4) == (first, 0)  # low ids first, again


def test_prefix_caching_shares_full_prompt_blocks_by_their_tokens():
    """A request's full blocks of prompt K/V are cached under keys naming every token up to their end: a
    prompt with the same first tokens takes them (as many as match, in order), one that differs in an earlier block
    takes none past it, and a partial block is never shared. Held blocks count as used, idle cached ones as free."""
    alloc = BlockAllocator(num_blocks=12, block_size=4, prefix_caching=True)
    prompt = list(range(100, 111))  # 11 tokens: blocks [0:4], [4:8] full, [8:11] partial
    keys = alloc.keys(prompt)
    assert len(keys) == 2 and alloc.keys(prompt[:4]) == keys[:1]
    blocks, cached = alloc.allocate(16, keys)
    assert cached == 0 and alloc.num_used == 4
    alloc.cache(blocks, keys)  # (its prefill wrote them) taken by a request that comes while it still runs
    twin, cached = alloc.allocate(12, keys)
    assert cached == 2 and twin[:2] == blocks[:2] and alloc.num_used == 5
    alloc.free(twin)
    alloc.free(blocks)  # the two full prompt blocks stay cached, idle
    assert alloc.num_used == 0 and alloc.num_free == 11 and alloc.num_cached == 2
    again, cached = alloc.allocate(12, alloc.keys(prompt))
    assert cached == 2 and again[:2] == blocks[:2] and alloc.num_used == 3
    other, cached = alloc.allocate(8, alloc.keys(prompt[:4] + [7, 7, 7, 7]))  # the same first block only
    assert cached == 1 and other[0] == blocks[0] and other[1] != blocks[1]
    assert alloc.allocate(8, alloc.keys([7] + prompt[1:8]))[1] == 0  # a different first token: nothing
    alloc.free(other)
    assert alloc.num_used == 5  # block 0 is still held by `again`
    assert alloc.keys([]) == [] and BlockAllocator(4, 4).keys(prompt) == []  # off: no keys


def test_prefix_caching_reclaims_the_least_recently_used_idle_blocks_only_when_needed():
    """Cached blocks no request holds are taken back only when the free list is empty, the least recently used
    first (a prompt's deeper blocks before its first); a held one never; and can_allocate counts what would be."""
    alloc = BlockAllocator(num_blocks=7, block_size=2, prefix_caching=True)  # 6 usable blocks
    a, b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    for prompt in (a, b):  # each: 2 full prompt blocks, cached at the end
        blocks, _ = alloc.allocate(4, alloc.keys(prompt[:-1]))
        alloc.cache(blocks, alloc.keys(prompt[:-1]))
        alloc.free(blocks)
    assert alloc.num_cached == 4 and alloc.num_free == 6
    held, cached = alloc.allocate(4, alloc.keys(b[:-1]))  # b's blocks held again (and now the most recent)
    assert cached == 2 and alloc.num_free == 4
    fresh, _ = alloc.allocate(6)  # 3 blocks: the 2 free ones, then a's deeper block (its least recently used)
    assert alloc.num_cached == 3 and alloc.num_free == 1  # a's first block, idle
    keys_a = alloc.keys(a[:-1])
    assert alloc.can_allocate(2, keys_a) and not alloc.can_allocate(4, keys_a)  # its first block, but no second
    assert not alloc.can_allocate(4)  # 2 new blocks, 1 left
    alloc.free(fresh)
    alloc.free(held)
    assert alloc.allocate(4, alloc.keys(b[:-1]))[1] == 2  # b's blocks survived: they were held


def test_two_requests_that_computed_the_same_prompt_leave_one_copy_cached():
    alloc = BlockAllocator(num_blocks=9, block_size=2, prefix_caching=True)
    keys = alloc.keys([1, 2, 3, 4])
    first, _ = alloc.allocate(6, keys)
    second, cached = alloc.allocate(6, keys)  # admitted together: nothing cached yet
    assert cached == 0
    alloc.cache(first, keys)
    alloc.cache(second, keys)  # the keys are taken: its blocks stay its own
    alloc.free(first)
    alloc.free(second)
    assert alloc.num_cached == 2 and alloc.num_free == 8 and alloc.allocate(6, keys)[0][:2] == first[:2]


def test_allocator_needs_a_block_beside_scratch():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockAllocator(num_blocks=1, block_size=16)


# --- PagedKVCache ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cache_layout_and_planes_share_storage(dtype):
    cfg = config(layers=3, kv_heads=2, head_dim=80)
    kv = PagedKVCache(cfg, num_blocks=5, block_size=4, dtype=dtype, device="cpu")
    assert kv.data.shape == (3, 2, 5, 4, 2, 80) and kv.data.dtype == dtype  # [layers, K/V, blocks, slots, Hkv, D]
    assert bool((kv.data == 0).all())
    planes = kv.planes  # [2 * layers, blocks, slots, Hkv, D]
    assert planes.shape == (6, 5, 4, 2, 80) and planes.data_ptr() == kv.data.data_ptr()
    planes[3, 1, 2] = 1.0  # layer 1's V plane: a view, not a copy
    assert bool((kv.data[1, 1, 1, 2] == 1).all())


def test_compact_moves_every_plane_along_the_block_table():
    """A paged compaction across a block boundary equals the reference on the plane stack, K and V of all layers."""
    cfg = config(layers=2, kv_heads=1, head_dim=8)
    kv = PagedKVCache(cfg, num_blocks=6, block_size=4, dtype=torch.float32, device="cpu")
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(0)))
    table = torch.tensor([[3, 5, 1], [2, 4, 0]], dtype=torch.int32)  # [B, W]; row 1 pads with scratch
    cache_seqlens = torch.tensor([3, 2], dtype=torch.int32)  # [B]: row 0's tree starts at slot 3, the end of block 3
    accepted = torch.tensor([[0, 2, 3, PAD_NODE], [0, 1, PAD_NODE, PAD_NODE]])  # [B, T]
    num = torch.tensor([3, 2], dtype=torch.int32)  # [B]
    expected = kv.planes.clone()
    compact_kv_ref(expected, cache_seqlens, accepted, num, block_table=table)
    kv.compact_(cache_seqlens, accepted, num, block_table=table)
    assert torch.equal(kv.planes, expected)
    assert not torch.equal(expected, kv.data.flatten(0, 1).roll(1, 0))  # (the check is not vacuous)


# --- sizes and the plan ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,itemsize", [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)])
def test_kv_bytes_per_token(dtype, itemsize):
    cfg = config(layers=30, kv_heads=3, head_dim=64)  # SmolLM2-135M's cache geometry
    assert kv_bytes_per_token(cfg, dtype) == 2 * 30 * 3 * 64 * itemsize


def test_plan_counts_every_models_bytes_in_its_own_dtype():
    target, draft = config(layers=4, kv_heads=2, head_dim=16), config(layers=1, kv_heads=1, head_dim=16)
    per_token = kv_bytes_per_token(target, torch.float32) + kv_bytes_per_token(draft, torch.bfloat16)
    budget = per_token * 8 * 10 + per_token * 3  # ten blocks of 8 tokens and a remainder that is not a block
    caches = [(target, torch.float32), (draft, torch.bfloat16)]
    assert plan_num_blocks(caches, block_size=8, memory_budget_bytes=budget, max_request_tokens=70) == 10


def test_plan_refuses_a_budget_below_one_request():
    cfg = config()
    per_block = kv_bytes_per_token(cfg, torch.float32) * 16
    caches = [(cfg, torch.float32)]
    # one request of 64 tokens needs 4 blocks plus scratch: 5 fit, 4 do not
    assert plan_num_blocks(caches, block_size=16, memory_budget_bytes=5 * per_block, max_request_tokens=64) == 5
    with pytest.raises(ValueError, match="needs 5"):
        plan_num_blocks(caches, block_size=16, memory_budget_bytes=5 * per_block - 1, max_request_tokens=64)
