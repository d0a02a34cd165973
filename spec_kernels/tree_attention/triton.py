"""tree_attention's Triton path: a flash-attention kernel over a paged or contiguous cache, flash-decoding splits
of long prefixes, registered as the custom op ``spec_kernels::tree_attention_triton``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spec_kernels._backend import triton_available, triton_interpret

# Flash-decoding splits cut each node's sequence at fixed positions (multiples of SPLIT_LEN), whatever the batch, T
# or cache capacity, and the combine merges them MAX_SPLITS lanes at a time in split order: so splitting never changes
# a node's rounding. (4096: a prefill chunk's float32 partial outputs stay ~130 MB at 64K positions, T 512, 32 heads
# of 128; a decode step still splits past 4K positions.)
SPLIT_LEN = 4096
MAX_SPLITS = 64

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _kv_row_offsets(
        pos, b, kvh, valid, block_table_ptr, stride_btb, block_size, stride_b, stride_s, stride_h, HAS_BLOCK_TABLE
    ):
        """Element offsets of logical positions ``pos`` of sequence b, KV head kvh (int64: caches exceed 2^31)."""
        if HAS_BLOCK_TABLE:
            block = tl.load(block_table_ptr + b * stride_btb + pos // block_size, mask=valid, other=0).to(tl.int64)
            offs = block * stride_b + (pos % block_size).to(tl.int64) * stride_s + kvh * stride_h
        else:
            offs = b.to(tl.int64) * stride_b + pos.to(tl.int64) * stride_s + kvh * stride_h
        return offs

    @triton.jit
    def _attend_block(
        q,
        m_i,
        l_i,
        acc,
        k_ptr,
        v_ptr,
        k_offs,
        v_offs,
        offs_d,
        key_ok,
        allowed,
        qk_scale,
        softcap,
        D,
        UPCAST_DOT: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
    ):
        """One online-softmax step over a K/V tile of keys ``key_ok`` [BLOCK_N]; scores outside ``allowed``
        [BLOCK_M, BLOCK_N] are dropped. (Narrowing the loads to keys some row may see took a reduction across rows
        per tile; with it ptxas spilled around its warp-shuffle calls, 8-16 bytes, and it saved at most T keys.)"""
        d_ok = offs_d < D
        k = tl.load(k_ptr + k_offs[None, :] + offs_d[:, None], mask=d_ok[:, None] & key_ok[None, :], other=0.0)
        v = tl.load(v_ptr + v_offs[:, None] + offs_d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, k, input_precision=INPUT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if HAS_SOFTCAP:  # qk_scale is the plain scale here: cap, then log2 units (tanh(x) = 2 sigmoid(2x) - 1)
            qk = softcap * (2.0 * tl.sigmoid(2.0 * qk / softcap) - 1.0) * 1.4426950408889634
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        return m_new, l_i, acc

    # T is not specialised: T = 1 (plain decoding) compiled to its own kernel, which spilled in fp32 (192-376 bytes
    # of stack at BLOCK_D 128/256) where the general one did not.
    @triton.jit(do_not_specialize=["T", "num_tiles"])
    def _tree_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        lse_ptr,
        seqlens_ptr,
        tree_keys_ptr,
        tree_lens_ptr,
        tile_shared_ptr,
        tile_lens_ptr,
        block_table_ptr,
        stride_qb,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_os,
        stride_ob,
        stride_ot,
        stride_oh,
        stride_btb,
        T,
        num_tiles,
        D,
        Hkv,
        block_size,
        split_len,
        qk_scale,
        softcap,
        window,
        GROUP: tl.constexpr,
        NODES_PER_TILE: tl.constexpr,
        ROW_BLOCKS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HAS_BLOCK_TABLE: tl.constexpr,
        IS_SPLIT: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
    ):
        # grid: (tiles * ROW_BLOCKS, B * Hkv, splits). A tile's rows are (tree node, query head of this KV head)
        # pairs: NODES_PER_TILE consecutive nodes of GROUP rows each (or, for a group wider than BLOCK_M, one node in
        # ROW_BLOCKS blocks of rows). Each row attends over its node's own sequence: the prefix, then the tree nodes
        # it sees in node order (its ancestors along the path, itself last), at positions 0 .. L + tree_len - 1,
        # in tiles that start at multiples of BLOCK_N of those positions. Plain decoding of the same token at the
        # same position walks the same keys in the same tiles (a fully masked tile, or a row left out of a walk, is
        # an exact no-op), so a node's output is bitwise the lone token's whatever T, B or the tree (batch
        # invariance: greedy speculation in 16-bit dtypes relies on it). Nodes whose sequences are the tree's first
        # nodes in order (prefill chunks, chains: the tile is "shared") walk together, one K/V tile load for all;
        # otherwise each node of the tile walks in turn.
        tile = tl.program_id(0) // ROW_BLOCKS
        b = tl.program_id(1) // Hkv
        kvh = (tl.program_id(1) % Hkv).to(tl.int64)
        split = tl.program_id(2)
        L = tl.load(seqlens_ptr + b)

        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        if NODES_PER_TILE == 1:
            node = tile + offs_m * 0
            g = (tl.program_id(0) % ROW_BLOCKS) * BLOCK_M + offs_m
            row_ok = g < GROUP
        else:
            node = tile * NODES_PER_TILE + offs_m // GROUP
            g = offs_m % GROUP
            row_ok = (offs_m < NODES_PER_TILE * GROUP) & (node < T)
        h = kvh * GROUP + g
        d_ok = offs_d < D
        row_len = L + tl.load(tree_lens_ptr + b * T + node, mask=row_ok, other=0)  # each row's sequence length

        q_offs = b.to(tl.int64) * stride_qb + node.to(tl.int64)[:, None] * stride_qt + h[:, None] * stride_qh
        q = tl.load(q_ptr + q_offs + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST_DOT:
            q = q.to(tl.float32)
        # A finite floor instead of -inf keeps alpha = exp2(m_i - m_new) free of (-inf) - (-inf) = NaN.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        shared_flag = tl.load(tile_shared_ptr + b * num_tiles + tile)
        shared = shared_flag != 0
        num_walks = tl.where(shared, 1, tl.minimum(NODES_PER_TILE, T - tile * NODES_PER_TILE))
        lo = split * split_len  # this split's share of the positions
        split_hi = lo + split_len
        # One loop (one set of pipeline buffers) over: the prefix's whole tiles, once for every row (each node's
        # sequence starts with them); then the rest, walked by the tile's nodes together (shared) or once a node.
        prefix_end = L - L % BLOCK_N
        num_prefix = tl.maximum(tl.minimum(split_hi, prefix_end) - lo, 0) // BLOCK_N
        tail_start = tl.maximum(lo, prefix_end)
        tile_len = tl.load(tile_lens_ptr + b * num_tiles + tile)  # the longest tree part of the tile's nodes
        tail_hi = tl.minimum(split_hi, L + tile_len)
        num_tail = tl.cdiv(tl.maximum(tail_hi - tail_start, 0), BLOCK_N)
        for i in range(0, num_prefix + num_walks * num_tail):
            in_tail = i >= num_prefix
            w = tl.where(in_tail, (i - num_prefix) // tl.maximum(num_tail, 1), 0)
            start = tl.where(in_tail, tail_start + ((i - num_prefix) % tl.maximum(num_tail, 1)) * BLOCK_N,
                             lo + i * BLOCK_N)  # fmt: skip
            walker = tile * NODES_PER_TILE + w  # the node whose keys a tail tile loads (any of the tile's, if shared)
            walk_len = tl.where(shared, tile_len, tl.load(tree_lens_ptr + b * T + walker))
            hi = tl.where(in_tail, tl.minimum(split_hi, L + walk_len), prefix_end)
            pos = start + offs_n
            key_ok = pos < hi
            mapped = (pos >= L) & key_ok & (pos * 0 + shared_flag == 0)  # (a vector: the interpreter needs one)
            keys_row = tree_keys_ptr + (b * T + walker).to(tl.int64) * T
            slot = tl.where(mapped, L + tl.load(keys_row + (pos - L), mask=mapped, other=0), pos)
            k_offs = _kv_row_offsets(
                slot, b, kvh, key_ok, block_table_ptr, stride_btb, block_size, stride_kb, stride_ks, stride_kh,
                HAS_BLOCK_TABLE,
            )  # fmt: skip
            v_offs = _kv_row_offsets(
                slot, b, kvh, key_ok, block_table_ptr, stride_btb, block_size, stride_vb, stride_vs, stride_vh,
                HAS_BLOCK_TABLE,
            )  # fmt: skip
            walking = row_ok & (shared | (node == walker) | (i < num_prefix))
            allowed = walking[:, None] & key_ok[None, :] & (pos[None, :] < row_len[:, None])
            if HAS_WINDOW:  # a row's query sits at row_len - 1 of its own sequence
                allowed = allowed & (pos[None, :] >= row_len[:, None] - window)
            m_i, l_i, acc = _attend_block(
                q, m_i, l_i, acc, k_ptr, v_ptr, k_offs, v_offs, offs_d, key_ok, allowed, qk_scale, softcap, D,
                UPCAST_DOT, INPUT_PRECISION, HAS_SOFTCAP,
            )  # fmt: skip

        # A row that saw nothing (empty split, or L_b = 0 with an all-False mask row) has l_i = 0: write zeros.
        seen = l_i > 0
        # one division per row, not per element: IEEE divisions call a slow-path subroutine, and registers live
        # across those calls spilled (8-16 bytes of stack, fp32)
        out = acc * (1.0 / tl.where(seen, l_i, 1.0))[:, None]
        o_offs = (
            split.to(tl.int64) * stride_os
            + b.to(tl.int64) * stride_ob
            + node.to(tl.int64)[:, None] * stride_ot
            + h[:, None] * stride_oh
        )
        tl.store(o_ptr + o_offs + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if IS_SPLIT:
            # lse: contiguous [splits, B, T, Hq], log2 units
            lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
            B = tl.num_programs(1) // Hkv
            lse_offs = ((split.to(tl.int64) * B + b) * T + node) * (Hkv * GROUP) + h
            tl.store(lse_ptr + lse_offs, lse, mask=row_ok)

    @triton.jit
    def _combine_splits_kernel(
        o_part_ptr,
        lse_ptr,
        out_ptr,
        num_rows,
        D,
        num_splits,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # One program per output row (b, t, head): merge the splits' normalised outputs by their log-sum-exp, BLOCK_S
        # splits at a time in split order (chunks past the row's last split are exact no-ops: scale 1, weights 0).
        row = tl.program_id(0).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        m = tl.full([], -1.0e30, dtype=tl.float32)  # (a finite floor, as in the attention kernel)
        total = tl.zeros([], dtype=tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for s0 in range(0, num_splits, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            s_ok = offs_s < num_splits
            lse = tl.load(lse_ptr + offs_s * num_rows + row, mask=s_ok, other=float("-inf"))  # [BLOCK_S]
            m_new = tl.maximum(m, tl.max(lse, axis=0))
            scale = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)
            part_ptrs = o_part_ptr + (offs_s.to(tl.int64) * num_rows + row)[:, None] * D + offs_d[None, :]
            part = tl.load(part_ptrs, mask=s_ok[:, None] & (offs_d < D)[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
            total = total * scale + tl.sum(w, axis=0)
            acc = acc * scale + tl.sum(part * w[:, None], axis=0)
            m = m_new
        out = acc * (1.0 / tl.where(total > 0, total, 1.0))
        tl.store(out_ptr + row * D + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < D)


@dataclass(frozen=True)
class DevicePlan:
    """The work of a Triton ``tree_attention`` call that depends only on ``cache_seqlens``, ``tree_mask`` and
    ``block_table``: the lengths and block table as int32, each node's visible tree nodes as a list, and the queued
    length check. A forward's layers share one (``plan_tree_attention``), so each layer's call is one allocation
    and one kernel launch (two with flash-decoding splits); without a plan every call makes its own.

    Shapes: cache_seqlens ``[B]`` int32; tree_keys ``[B, T, T]`` int32 (row t: the nodes t sees, in node order, then
    padding); tree_lens ``[B, T]`` int32 (how many it sees); tile_shared / tile_lens ``[B, tiles]`` int32 (whether
    a kernel tile's nodes each see the tree's first nodes in order, so that they walk one sequence together, and the
    longest of their sequences' tree parts; tiles of ``_tiling``'s nodes_per_tile); block_table ``[B, max_blocks]``
    int32 or None (contiguous cache)."""

    batch: int
    num_nodes: int  # T
    group: int  # query heads per KV head (the tiling depends on it)
    cache_shape: tuple[int, ...]  # the k_cache shape it was built for
    paged: bool
    cache_seqlens: torch.Tensor
    tree_keys: torch.Tensor
    tree_lens: torch.Tensor
    tile_shared: torch.Tensor
    tile_lens: torch.Tensor
    block_table: torch.Tensor | None


def _device_plan(
    k_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: torch.Tensor,
    block_table: torch.Tensor | None,
    group: int,
) -> DevicePlan:
    """The plan of already-checked inputs (``_check_inputs`` queued or made the length check)."""
    B, T = tree_mask.shape[:2]
    table = None if block_table is None else block_table.to(torch.int32).contiguous()
    tree_keys, tree_lens = tree_key_lists(tree_mask)
    npt = _tiling(k_cache.dtype, group, k_cache.shape[-1])[4]
    tile_shared, tile_lens = tile_walks(tree_keys, tree_lens, npt)
    return DevicePlan(B, T, group, tuple(k_cache.shape), block_table is not None,
                      cache_seqlens.to(torch.int32).contiguous(), tree_keys, tree_lens, tile_shared, tile_lens,
                      table)  # fmt: skip


def tile_walks(tree_keys: torch.Tensor, tree_lens: torch.Tensor, nodes_per_tile: int):
    """Per kernel tile of ``nodes_per_tile`` consecutive nodes: ([B, tiles] int32) 1 where every node of the tile
    sees exactly the tree's first nodes (``tree_keys[.., t, :len] == 0 .. len-1``: a causal chunk, a chain), so that
    each node's sequence is the positions 0 .. L + len - 1 themselves; and ([B, tiles] int32) the longest len."""
    B, T = tree_lens.shape
    if B * T == 0:  # (nothing to walk; view() cannot infer a dimension of an empty tensor)
        none = torch.zeros(B, -(-T // nodes_per_tile), dtype=torch.int32, device=tree_lens.device)
        return none, none.clone()
    j = torch.arange(T, device=tree_keys.device)
    in_order = ((tree_keys == j) | (j >= tree_lens[..., None])).all(dim=-1)  # [B, T]
    pad = -T % nodes_per_tile
    in_order = torch.nn.functional.pad(in_order, (0, pad), value=True).view(B, -1, nodes_per_tile)
    lens = torch.nn.functional.pad(tree_lens, (0, pad)).view(B, -1, nodes_per_tile)
    return in_order.all(dim=-1).to(torch.int32), lens.amax(dim=-1).to(torch.int32)


def tree_key_lists(tree_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T, T]`` bool -> (``[B, T, T]`` int32: row t lists the nodes j with ``mask[.., t, j]`` in increasing j,
    then the others; ``[B, T]`` int32: how many it sees). Along a tree path node order is depth order, so a node's
    list is its ancestors from the root, itself last: the tokens at positions L, L+1, ... of its own sequence."""
    order = torch.argsort((~tree_mask).to(torch.int8), dim=-1, stable=True)  # seen first, each part in node order
    return order.to(torch.int32).contiguous(), tree_mask.sum(dim=-1, dtype=torch.int32)


def _split_len(capacity: int, block_n: int, num_splits: int) -> int:
    """Positions per flash-decoding split: SPLIT_LEN when the launcher chooses (``num_splits <= 0``), else capacity
    over ``num_splits`` (tests), in whole tiles."""
    if num_splits <= 0:
        return SPLIT_LEN
    return max(block_n, triton.cdiv(triton.cdiv(capacity, num_splits), block_n) * block_n)


FP32_TILE_PRODUCT = 1 << 16  # BLOCK_M * BLOCK_N * BLOCK_D of an fp32 tile that 8 warps hold without spilling
HALF_TILE_ROWS_X_DIM = 64 * 128  # the largest BLOCK_M * BLOCK_D of a 16-bit tile; from half of it, BLOCK_N is 32


def _tiling(dtype: torch.dtype, group: int, D: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, nodes per tile, row blocks per node) for a model's ``group`` query
    heads per KV head: a function of the model alone, never of T or B."""
    block_m, block_n, block_d, num_warps = _tile_config(dtype, group, D)
    return block_m, block_n, block_d, num_warps, max(1, block_m // group), triton.cdiv(group, block_m)


def _tile_config(dtype: torch.dtype, num_rows: int, D: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps) for ``num_rows = group`` query rows per KV head and tree node: a
    function of the model alone (never of T or B), so that every call of a model runs the same tiles.

    Chosen so that configurations spill little for register pressure on sm_80 or sm_90a: ``python
    bench/aot_compile.py`` compiles every one (bench/RESULTS-log.md, "Batch-invariant CUDA kernels": in the
    batch-invariant kernel only fp32 at head dim 64 with splits saves 8 bytes of stack, on sm_80). 16-bit tiles run 8
    warps at BLOCK_D 128 (4 spilled there, paged, on sm_80) and 4 elsewhere (8 spilled at BLOCK_D 64, paged).
    Measured there (before the batch-invariant kernel; the warp counts below are the old ones):
    - fp32 takes a true fp32 dot, on CUDA cores with both operand tiles in registers. BLOCK_M 32 spilled even at
      BLOCK_M * BLOCK_N * BLOCK_D = 2^16 (BLOCK_N 32, BLOCK_D 64: 255 registers, 32-56 bytes of stack on sm_90a),
      BLOCK_M 64 with BLOCK_N 64, BLOCK_D 128 spilled 6.6 KB. So fp32 rows come in blocks of 16, and BLOCK_N is
      2^16 / (16 * BLOCK_D): 64, 32, 16 for BLOCK_D 64, 128, 256.
    - fp16/bf16 dots run on tensor cores. BLOCK_M 64 with BLOCK_N 64 spilled (BLOCK_D 128, 8 warps: 8-24 bytes;
      BLOCK_D 64, 4 warps: 88 bytes), with BLOCK_N 32 it did not (188 registers); BLOCK_M 64 at BLOCK_D 256 spilled
      even with BLOCK_N 32 (16 bytes, sm_90a). So BLOCK_M * BLOCK_D stays <= 64 * 128, and BLOCK_N is 32 at
      BLOCK_M 64 and at BLOCK_D 256. The warp counts are measured per tile, not derived: 8-24 bytes were saved
      around ptxas's outlined warp-shuffle calls at 96-128 registers with 4 warps at BLOCK_M 16 / BLOCK_D 64 and
      with 8 warps at BLOCK_M 16 / BLOCK_D 256, and neither with the other count.
    """
    block_d = max(16, triton.next_power_of_2(D))
    if dtype == torch.float32:
        return 16, max(16, min(64, FP32_TILE_PRODUCT // (16 * block_d))), block_d, 8
    block_m = min(64, HALF_TILE_ROWS_X_DIM // block_d, max(16, triton.next_power_of_2(num_rows)))
    block_n = 32 if block_d >= 256 or block_m >= 64 else 64
    return block_m, block_n, block_d, 8 if block_d == 128 else 4


def _launch_tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_keys: torch.Tensor,
    tree_lens: torch.Tensor,
    tile_shared: torch.Tensor,
    tile_lens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    num_splits: int,
    softcap: float = 0.0,
    window: int = 0,
) -> torch.Tensor:
    """``softcap`` and ``window`` as ``tree_attention``'s, 0 for none. cache_seqlens ``[B]``, tree_keys ``[B, T, T]``,
    tree_lens ``[B, T]``, tile_shared / tile_lens ``[B, tiles]`` and
    block_table ``[B, max_blocks]`` (or None), all int32, as a ``DevicePlan`` holds them."""
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    # The kernel indexes D with unit stride; everything else goes through strides.
    q, k_cache, v_cache = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_cache, v_cache))
    # The Triton 3.9 interpreter truncates fp32 -> bf16 on store (1-ulp bias, 2x torch's error): there, store fp32
    # and let torch round to nearest.
    store_dtype = torch.float32 if triton_interpret() and q.dtype == torch.bfloat16 else q.dtype
    out = torch.empty((B, T, Hq, D), dtype=store_dtype, device=q.device)
    if out.numel() == 0:
        return out.to(q.dtype)
    has_block_table = block_table is not None
    if has_block_table:
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        block_table = cache_seqlens  # unused: a valid pointer for the HAS_BLOCK_TABLE=False specialisation
        capacity = k_cache.shape[1]

    block_m, block_n, block_d, num_warps, npt, row_blocks = _tiling(q.dtype, group, D)
    num_tiles = triton.cdiv(T, npt)
    if tile_shared.shape != (B, num_tiles):
        raise ValueError(f"tree_attention: the plan's tiles {tuple(tile_shared.shape)} are not this call's "
                         f"{(B, num_tiles)} (another group or dtype)")  # fmt: skip
    split_len = _split_len(capacity, block_n, num_splits)
    num_splits = max(1, triton.cdiv(capacity, split_len))
    is_split = num_splits > 1
    if is_split:
        o_part = torch.empty((num_splits, B, T, Hq, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_splits, B, T, Hq), dtype=torch.float32, device=q.device)
    else:
        o_part, lse = out.unsqueeze(0), cache_seqlens  # lse unused without splits

    grid = (num_tiles * row_blocks, B * Hkv, num_splits)
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, o_part, lse, cache_seqlens, tree_keys, tree_lens, tile_shared, tile_lens, block_table,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        block_table.stride(0),
        T, num_tiles, D, Hkv, k_cache.shape[1], split_len,
        softmax_scale if softcap else softmax_scale * math.log2(math.e), softcap, window,
        GROUP=group, NODES_PER_TILE=npt, ROW_BLOCKS=row_blocks, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_BLOCK_TABLE=has_block_table, IS_SPLIT=is_split,
        # bf16 tl.dot multiplies raw bit patterns under the Triton 3.9 interpreter (triton-lang/triton#11584).
        UPCAST_DOT=triton_interpret() and q.dtype == torch.bfloat16,
        # fp32 inputs get a true fp32 dot: TF32 would be ~1e-3 off, worse than torch's fp32 attention.
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_SOFTCAP=softcap > 0, HAS_WINDOW=window > 0,
        num_warps=num_warps,
    )  # fmt: skip
    if is_split:
        num_rows = B * T * Hq
        _combine_splits_kernel[(num_rows,)](
            o_part, lse, out, num_rows, D, num_splits, BLOCK_S=MAX_SPLITS, BLOCK_D=block_d
        )  # fmt: skip
    return out.to(q.dtype)


@torch.library.custom_op("spec_kernels::tree_attention_triton", mutates_args=())
def _tree_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_keys: torch.Tensor,
    tree_lens: torch.Tensor,
    tile_shared: torch.Tensor,
    tile_lens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    num_splits: int,
    softcap: float = 0.0,
    window: int = 0,
) -> torch.Tensor:
    """The Triton path as a custom op, on a ``DevicePlan``'s tensors; ``num_splits <= 0`` lets the launcher choose
    (splits of SPLIT_LEN positions); ``softcap`` and ``window`` 0 for none."""
    return _launch_tree_attention(
        q, k_cache, v_cache, cache_seqlens, tree_keys, tree_lens, tile_shared, tile_lens, block_table, softmax_scale,
        num_splits, softcap, window,
    )  # fmt: skip


@_tree_attention_triton.register_fake
def _(q, k_cache, v_cache, cache_seqlens, tree_keys, tree_lens, tile_shared, tile_lens, block_table, softmax_scale,
      num_splits, softcap=0.0, window=0):  # fmt: skip
    return torch.empty_like(q, memory_format=torch.contiguous_format)
