"""tree_attention's Triton path: a flash-attention kernel over a paged or contiguous cache, flash-decoding splits
of long prefixes, registered as the custom op ``spec_kernels::tree_attention_triton``."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spec_kernels._backend import triton_available, triton_interpret

MASK_WORD_BITS = 64  # the tree mask travels to the kernel as int64 bit words: T=64 costs 8 bytes per row, not 64

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
        D,
        UPCAST_DOT: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
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
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        return m_new, l_i, acc

    # T is not specialised: T = 1 (plain decoding) compiled to its own kernel, which spilled in fp32 (192-376 bytes
    # of stack at BLOCK_D 128/256) where the general one did not.
    @triton.jit(do_not_specialize=["T"])
    def _tree_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        lse_ptr,
        seqlens_ptr,
        mask_bits_ptr,
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
        stride_mb,
        stride_mt,
        stride_btb,
        T,
        D,
        Hkv,
        block_size,
        split_len,
        num_splits,
        qk_scale,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HAS_BLOCK_TABLE: tl.constexpr,
        IS_SPLIT: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        # grid: (row blocks, B * Hkv, splits). Rows are (tree node, head in group) pairs, m = t * GROUP + g, so the
        # GROUP query heads of one KV head share every K/V tile load.
        pid_m = tl.program_id(0)
        b = tl.program_id(1) // Hkv
        kvh = (tl.program_id(1) % Hkv).to(tl.int64)
        split = tl.program_id(2)
        L = tl.load(seqlens_ptr + b)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        t = offs_m // GROUP
        h = kvh * GROUP + offs_m % GROUP
        row_ok = offs_m < T * GROUP
        d_ok = offs_d < D

        q_offs = b.to(tl.int64) * stride_qb + t.to(tl.int64)[:, None] * stride_qt + h[:, None] * stride_qh
        q = tl.load(q_ptr + q_offs + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST_DOT:
            q = q.to(tl.float32)
        # A finite floor instead of -inf keeps alpha = exp2(m_i - m_new) free of (-inf) - (-inf) = NaN.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # Prefix: this split's share of positions [0, L); no mask beyond the length.
        lo = split * split_len
        hi = tl.minimum(lo + split_len, L)
        for start in range(lo, hi, BLOCK_N):
            pos = start + offs_n
            key_ok = pos < hi
            k_offs = _kv_row_offsets(
                pos, b, kvh, key_ok, block_table_ptr, stride_btb, block_size, stride_kb, stride_ks, stride_kh,
                HAS_BLOCK_TABLE,
            )  # fmt: skip
            v_offs = _kv_row_offsets(
                pos, b, kvh, key_ok, block_table_ptr, stride_btb, block_size, stride_vb, stride_vs, stride_vh,
                HAS_BLOCK_TABLE,
            )  # fmt: skip
            allowed = row_ok[:, None] & key_ok[None, :]
            m_i, l_i, acc = _attend_block(
                q, m_i, l_i, acc, k_ptr, v_ptr, k_offs, v_offs, offs_d, key_ok, allowed, qk_scale, D, UPCAST_DOT,
                INPUT_PRECISION,
            )  # fmt: skip

        # Tree block: positions L + j under the bitmask; done once, by the last split. A loop bound, not an `if`:
        # reductions inside a branch made ptxas outline its warp-shuffle slow path, and the call spilled registers.
        tree_hi = tl.where(split == num_splits - 1, T, 0)
        for j0 in range(0, tree_hi, BLOCK_N):
            j = j0 + offs_n
            key_ok = j < T
            pos = L + j
            k_offs = _kv_row_offsets(
                pos, b, kvh, key_ok, block_table_ptr, stride_btb, block_size, stride_kb, stride_ks, stride_kh,
                HAS_BLOCK_TABLE,
            )  # fmt: skip
            v_offs = _kv_row_offsets(
                pos, b, kvh, key_ok, block_table_ptr, stride_btb, block_size, stride_vb, stride_vs, stride_vh,
                HAS_BLOCK_TABLE,
            )  # fmt: skip
            word_ptrs = mask_bits_ptr + b * stride_mb + t[:, None] * stride_mt + (j // 64)[None, :]
            words = tl.load(word_ptrs, mask=row_ok[:, None] & key_ok[None, :], other=0)
            bits = (words >> (j % 64).to(tl.int64)[None, :]) & 1
            allowed = (bits != 0) & row_ok[:, None] & key_ok[None, :]
            m_i, l_i, acc = _attend_block(
                q, m_i, l_i, acc, k_ptr, v_ptr, k_offs, v_offs, offs_d, key_ok, allowed, qk_scale, D, UPCAST_DOT,
                INPUT_PRECISION,
            )  # fmt: skip

        # A row that saw nothing (empty split, or L_b = 0 with an all-False mask row) has l_i = 0: write zeros.
        seen = l_i > 0
        # one division per row, not per element: IEEE divisions call a slow-path subroutine, and registers live
        # across those calls spilled (8-16 bytes of stack, fp32)
        out = acc * (1.0 / tl.where(seen, l_i, 1.0))[:, None]
        o_offs = (
            split.to(tl.int64) * stride_os
            + b.to(tl.int64) * stride_ob
            + t.to(tl.int64)[:, None] * stride_ot
            + h[:, None] * stride_oh
        )
        tl.store(o_ptr + o_offs + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if IS_SPLIT:
            # lse: contiguous [splits, B, T, Hq], log2 units
            lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
            B = tl.num_programs(1) // Hkv
            lse_offs = ((split.to(tl.int64) * B + b) * T + t) * (Hkv * GROUP) + h
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
        # One program per output row (b, t, head): merge the splits' normalised outputs by their log-sum-exp.
        row = tl.program_id(0).to(tl.int64)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < num_splits
        lse = tl.load(lse_ptr + offs_s * num_rows + row, mask=s_ok, other=float("-inf"))  # [BLOCK_S]
        m = tl.max(lse, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)
        part_ptrs = o_part_ptr + (offs_s.to(tl.int64) * num_rows + row)[:, None] * D + offs_d[None, :]
        part = tl.load(part_ptrs, mask=s_ok[:, None] & (offs_d < D)[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
        total = tl.sum(w, axis=0)
        out = tl.sum(part * w[:, None], axis=0) * (1.0 / tl.where(total > 0, total, 1.0))
        tl.store(out_ptr + row * D + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < D)


@dataclass(frozen=True)
class DevicePlan:
    """The work of a Triton ``tree_attention`` call that depends only on ``cache_seqlens``, ``tree_mask`` and
    ``block_table``: the lengths and block table as int32, the mask packed into bit words, and the queued length
    check. A forward's layers share one (``plan_tree_attention``), so each layer's call is one allocation and one
    kernel launch (two with flash-decoding splits); without a plan every call makes its own.

    Shapes: seqlens ``[B]`` int32; mask_bits ``[B, T, ceil(T/64)]`` int64; block_table ``[B, max_blocks]`` int32 or
    None (contiguous cache)."""

    batch: int
    num_nodes: int  # T
    cache_shape: tuple[int, ...]  # the k_cache shape it was built for
    paged: bool
    seqlens: torch.Tensor
    mask_bits: torch.Tensor
    block_table: torch.Tensor | None


def _device_plan(
    k_cache: torch.Tensor, cache_seqlens: torch.Tensor, tree_mask: torch.Tensor, block_table: torch.Tensor | None
) -> DevicePlan:
    """The plan of already-checked inputs (``_check_inputs`` queued or made the length check)."""
    B, T = tree_mask.shape[:2]
    table = None if block_table is None else block_table.to(torch.int32).contiguous()
    return DevicePlan(B, T, tuple(k_cache.shape), block_table is not None, cache_seqlens.to(torch.int32).contiguous(),
                      _pack_tree_mask(tree_mask), table)  # fmt: skip


def _pack_tree_mask(tree_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T, T]`` bool -> ``[B, T, ceil(T/64)]`` int64; bit ``j % 64`` of word ``j // 64`` is ``mask[.., j]``."""
    B, T, _ = tree_mask.shape
    num_words = max(1, -(-T // MASK_WORD_BITS))
    padded = F.pad(tree_mask, (0, num_words * MASK_WORD_BITS - T)).view(B, T, num_words, MASK_WORD_BITS)
    weights = torch.ones((), dtype=torch.int64, device=tree_mask.device) << torch.arange(
        MASK_WORD_BITS, device=tree_mask.device
    )  # bit 63 is -2**63: the sum of distinct powers of two is their OR, wrap-around included
    return (padded.long() * weights).sum(dim=-1)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _pick_num_splits(q: torch.Tensor, num_programs: int, capacity: int, block_n: int) -> int:
    """Flash-decoding: split the prefix when (sequence, KV head, row block) programs cannot fill the GPU.

    Sync-free: decided from shapes (cache capacity), never from the values of ``cache_seqlens``. Splits past a
    sequence's length exit at once; a cache far larger than its contents therefore gains less from splitting.
    """
    if q.device.type != "cuda":
        return 1
    num_sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if num_programs >= num_sms or capacity < 4 * block_n * 4:
        return 1
    return max(1, min(-(-2 * num_sms // num_programs), capacity // (4 * block_n), 64))


FP32_TILE_PRODUCT = 1 << 16  # BLOCK_M * BLOCK_N * BLOCK_D of an fp32 tile that 8 warps hold without spilling
HALF_TILE_ROWS_X_DIM = 64 * 128  # the largest BLOCK_M * BLOCK_D of a 16-bit tile; from half of it, BLOCK_N is 32


def _tile_config(dtype: torch.dtype, num_rows: int, D: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps) for ``num_rows = T * group`` query rows per KV head.

    Chosen so that no configuration spills for register pressure on sm_80 or sm_90a: ``python bench/aot_compile.py``
    compiles every one (bench/RESULTS.md has the table; a few still save 8-24 bytes around ptxas's outlined
    warp-shuffle calls at 96-128 registers). Measured there (before these rules):
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
    num_warps = 4 if (block_m, block_d) in ((32, 64), (16, 256)) else 8
    return block_m, block_n, block_d, num_warps


def _launch_tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens: torch.Tensor,
    mask_bits: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    num_splits: int,
) -> torch.Tensor:
    """seqlens ``[B]`` int32, mask_bits ``[B, T, num_words]`` int64 and block_table ``[B, max_blocks]`` int32 (or
    None) as a ``DevicePlan`` holds them."""
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
        block_table = seqlens  # unused: a valid pointer for the HAS_BLOCK_TABLE=False specialisation
        capacity = k_cache.shape[1]

    block_m, block_n, block_d, num_warps = _tile_config(q.dtype, T * group, D)
    num_row_blocks = triton.cdiv(T * group, block_m)
    if num_splits <= 0:
        num_splits = _pick_num_splits(q, num_row_blocks * B * Hkv, capacity, block_n)
    split_len = triton.cdiv(triton.cdiv(capacity, num_splits), block_n) * block_n
    num_splits = triton.cdiv(capacity, split_len) if capacity > 0 else 1
    is_split = num_splits > 1
    if is_split:
        o_part = torch.empty((num_splits, B, T, Hq, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_splits, B, T, Hq), dtype=torch.float32, device=q.device)
    else:
        o_part, lse = out.unsqueeze(0), seqlens  # lse unused without splits

    grid = (num_row_blocks, B * Hkv, num_splits)
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, o_part, lse, seqlens, mask_bits, block_table,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        mask_bits.stride(0), mask_bits.stride(1),
        block_table.stride(0),
        T, D, Hkv, k_cache.shape[1], split_len, num_splits,
        softmax_scale * math.log2(math.e),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_BLOCK_TABLE=has_block_table, IS_SPLIT=is_split,
        # bf16 tl.dot multiplies raw bit patterns under the Triton 3.9 interpreter (triton-lang/triton#11584).
        UPCAST_DOT=triton_interpret() and q.dtype == torch.bfloat16,
        # fp32 inputs get a true fp32 dot: TF32 would be ~1e-3 off, worse than torch's fp32 attention.
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )  # fmt: skip
    if is_split:
        num_rows = B * T * Hq
        _combine_splits_kernel[(num_rows,)](
            o_part, lse, out, num_rows, D, num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )  # fmt: skip
    return out.to(q.dtype)


@torch.library.custom_op("spec_kernels::tree_attention_triton", mutates_args=())
def _tree_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens: torch.Tensor,
    mask_bits: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    num_splits: int,
) -> torch.Tensor:
    """The Triton path as a custom op, on a ``DevicePlan``'s tensors; ``num_splits <= 0`` lets the launcher choose
    (1 off CUDA)."""
    return _launch_tree_attention(q, k_cache, v_cache, seqlens, mask_bits, block_table, softmax_scale, num_splits)


@_tree_attention_triton.register_fake
def _(q, k_cache, v_cache, seqlens, mask_bits, block_table, softmax_scale, num_splits):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
