"""tree_attention: every node of a token tree attends to the committed prefix plus its own ancestors, in one pass.

Glossary:
- *prefix*: the committed positions ``0 .. L_b-1`` of sequence b; every tree node sees all of them.
- *tree block*: positions ``L_b .. L_b+T-1``, where the tree's own K/V were already written; node i sees node j
  there iff ``tree_mask[b, i, j]``.
- *group*: the ``Hq // Hkv`` query heads that share one KV head (GQA).
- *split*: flash-decoding; the prefix of one (sequence, KV head) is cut into pieces handled by separate programs,
  whose partial outputs are merged by their log-sum-exp.

Three implementations sit behind one public function (dispatch happens once, in ``tree_attention``):
- ``"native"`` (CPU): one ``F.scaled_dot_product_attention`` call over a boolean mask built once per call.
- ``"triton"``: a flash-attention kernel, registered as ``spec_kernels::tree_attention_triton``.
- ``"torch"``: ``tree_attention_ref``, the readable spec.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spec_kernels._backend import host_value_checks, resolve_backend, triton_available, triton_interpret
from spec_kernels.reference import tree_attention_ref

MAX_HEAD_DIM = 256
MASK_WORD_BITS = 64  # the tree mask travels to the kernel as int64 bit words: T=64 costs 8 bytes per row, not 64

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- input checks -----------------------------------------------------------------------------------------------


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: torch.Tensor,
    block_table: torch.Tensor | None,
    check_lengths: bool = True,
) -> None:
    """Raise a clear error for any input that breaks the contract in docs/ARCHITECTURE.md.

    Shapes, dtypes and devices are checked everywhere (metadata: free). The one value check, ``0 <= L_b`` and
    ``L_b + T`` within the cache, reads ``cache_seqlens`` on CPU tensors (``check_lengths=False`` skips it where a
    plan already made it) and is queued with ``torch._assert_async`` on the device path (CUDA, meta): no host sync,
    a bad length fails the stream instead. ``SPECDEC_DEBUG_CHECKS=1`` reads it on the host there too."""
    op = "tree_attention"
    if q.dim() != 4:
        raise ValueError(f"{op}: q must be [B, T, Hq, D], got shape {tuple(q.shape)}")
    B, T, Hq, D = q.shape
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: q must be float32, float16 or bfloat16, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(
            f"{op}: q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"{op}: k_cache and v_cache must have the same 4-d shape, "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    Hkv = k_cache.shape[2]
    if k_cache.shape[3] != D:
        raise ValueError(f"{op}: head dim mismatch: q has D={D}, the cache has D={k_cache.shape[3]}")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head dim D={D} exceeds the supported maximum {MAX_HEAD_DIM}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"{op}: Hq={Hq} query heads must be a multiple of Hkv={Hkv} KV heads")
    if tree_mask.dtype != torch.bool:
        raise TypeError(f"{op}: tree_mask must be bool, got {tree_mask.dtype}")
    if tuple(tree_mask.shape) != (B, T, T):
        raise ValueError(f"{op}: tree_mask must be [B, T, T] = {(B, T, T)}, got {tuple(tree_mask.shape)}")
    if cache_seqlens.dtype not in (torch.int32, torch.int64) or tuple(cache_seqlens.shape) != (B,):
        raise TypeError(
            f"{op}: cache_seqlens must be an int32 tensor of shape [B] = ({B},), "
            f"got {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}"
        )
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens, "tree_mask": tree_mask}
    if block_table is not None:
        tensors["block_table"] = block_table
        if block_table.dtype not in (torch.int32, torch.int64) or block_table.dim() != 2 or block_table.shape[0] != B:
            raise TypeError(
                f"{op}: block_table must be an int32 tensor of shape [B, max_blocks], "
                f"got {block_table.dtype} {tuple(block_table.shape)}"
            )
        capacity = block_table.shape[1] * k_cache.shape[1]
        what = f"block_table too short: max_blocks={block_table.shape[1]} x block_size={k_cache.shape[1]}"
    else:
        if k_cache.shape[0] != B:
            raise ValueError(f"{op}: contiguous k_cache must be [B={B}, S, Hkv, D], got {tuple(k_cache.shape)}")
        capacity = k_cache.shape[1]
        what = f"contiguous cache too short: S={capacity}"
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {devices}")
    # L_b + T must fit. On the device path the check is queued on the stream (no host sync, CUDA-graph safe);
    # SPECDEC_DEBUG_CHECKS=1 reads the lengths instead, for the message with the numbers.
    if B == 0:
        return
    if not host_value_checks(q.device):
        torch._assert_async((cache_seqlens >= 0).all() & (cache_seqlens.max() + T <= capacity), f"{op}: {what}")
    elif check_lengths:
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < 0:
            raise ValueError(f"{op}: cache_seqlens must be >= 0, got min {lo}")
        if hi + T > capacity:
            raise ValueError(f"{op}: {what} < max(cache_seqlens) + T = {hi} + {T}")


# --- native CPU path --------------------------------------------------------------------------------------------

BATCH_RAGGED_ELEMENTS = 1 << 20  # padded K elements up to which ragged lengths take one batched SDPA call


@dataclass(frozen=True)
class _SdpaCall:
    """One SDPA call of the native path over sequences ``seqs``.

    Shapes: key_rows ``[n, num_keys]`` int64 rows of the cache flattened to ``[rows, Hkv, D]`` (None: the
    contiguous cache's own view ``cache[seqs, :num_keys]``); row_mask ``[n, 1, T*group, num_keys]`` bool (None:
    every row sees every key); sees_nothing ``[n, T]`` bool (None: no row is empty).
    """

    seqs: slice
    num_keys: int
    key_rows: torch.Tensor | None
    row_mask: torch.Tensor | None
    sees_nothing: torch.Tensor | None


@dataclass(frozen=True)
class TreeAttentionPlan:
    """The work of a native ``tree_attention`` call that depends only on ``cache_seqlens``, ``tree_mask`` and
    ``block_table``: key rows and masks. A model's layers all attend with the same three tensors, so a forward
    builds the plan once (``plan_tree_attention``) and every layer reuses it; on this CPU that removes ~40 small
    ops per layer. Plans are for the native CPU path; other paths ignore them."""

    batch: int
    num_nodes: int  # T
    group: int  # Hq // Hkv
    cache_shape: tuple[int, ...]  # the k_cache shape it was built for
    paged: bool
    calls: tuple[_SdpaCall, ...]


def _attention_mask(cache_seqlens: torch.Tensor, tree_mask: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[B, T, num_keys]`` bool over logical positions: the prefix ``< L_b`` plus the allowed tree positions."""
    B, T, _ = tree_mask.shape
    rel = torch.arange(num_keys, device=tree_mask.device) - cache_seqlens.long()[:, None]  # [B, num_keys]
    in_tree = (rel >= 0) & (rel < T)
    tree = torch.gather(tree_mask, 2, rel.clamp(0, max(T - 1, 0))[:, None, :].expand(B, T, num_keys))
    return (rel < 0)[:, None, :] | (in_tree[:, None, :] & tree)


def _key_rows(
    cache_shape: tuple[int, ...], block_table: torch.Tensor | None, seqs: slice, cache_seqlens: torch.Tensor, T: int,
    num_keys: int,
) -> torch.Tensor:  # fmt: skip
    """``[n, num_keys]`` cache rows of positions ``0 .. num_keys-1`` of sequences ``seqs``.

    Positions past ``L_b + T`` (padding of a batched call over ragged lengths: stale slots, or past the
    sequence's blocks) are read from slot ``L_b`` instead, which the contract guarantees written. Whatever they
    hold is then finite wherever the attended keys are, so the masked softmax's zero weights cannot meet a NaN
    or inf from a stale slot.
    """
    lengths = cache_seqlens[seqs].long()[:, None]  # [n, 1]
    n = lengths.shape[0]
    pos = torch.arange(num_keys, device=cache_seqlens.device).expand(n, num_keys)
    pos = torch.where(pos < lengths + T, pos, lengths)  # [n, num_keys]
    rows_per_block = cache_shape[1]  # S for a contiguous cache
    if block_table is None:
        first = torch.arange(seqs.start or 0, (seqs.start or 0) + n, device=pos.device)[:, None] * rows_per_block
        return first + pos
    return block_table[seqs].long().gather(1, pos // rows_per_block) * rows_per_block + pos % rows_per_block


def _plan_call(cache_shape, block_table, seqs, cache_seqlens, tree_mask, group, num_keys, equal) -> _SdpaCall:
    lengths, mask = cache_seqlens[seqs], tree_mask[seqs]
    allowed = _attention_mask(lengths, mask, num_keys)  # [n, T, num_keys]
    sees = allowed.any(dim=-1)  # [n, T]; a row sees nothing only when L_b = 0 and its mask row is all False
    view = block_table is None and equal  # a contiguous cache's own slice: nothing to gather
    return _SdpaCall(
        seqs=seqs,
        num_keys=num_keys,
        key_rows=None if view else _key_rows(cache_shape, block_table, seqs, cache_seqlens, mask.shape[1], num_keys),
        row_mask=None if bool(allowed.all()) else allowed.repeat_interleave(group, dim=1)[:, None],
        sees_nothing=None if bool(sees.all()) else ~sees,
    )


def _native_plan(
    k_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: torch.Tensor,
    block_table: torch.Tensor | None,
    group: int,
    ragged: str = "auto",
) -> TreeAttentionPlan:
    """Equal lengths: one batched SDPA call over ``L + T`` keys. Ragged lengths: one batched call over
    ``max(L_b) + T`` keys (the slots past each row's ``L_b + T`` masked), or one call per sequence over its own
    keys. The batched call wastes work on padding and the loop pays a call per sequence, so ``ragged="auto"``
    batches while the padded K is small (``BATCH_RAGGED_ELEMENTS``); past that the gathered K/V leave the CPU
    caches and the batched call loses even when nearly full. Measured on this 2-core machine, 1 thread, paged,
    fp32 (batched vs looped, ms): Hq/Hkv=5/1 D=64 B=16 L_b in [100, 250) T=1: 0.5 vs 2.3; B=64 L_b in [10, 250)
    T=5: 7.9 vs 10.8 (1.0e6 elements); Hq/Hkv=16/4 D=64 B=16 L_b in [200, 500) T=4: 5.9 vs 5.1 (2.1e6);
    Hq/Hkv=32/8 D=128 B=32 L_b in [256, 512) T=1: 107 vs 25.
    """
    B, T = tree_mask.shape[:2]
    lengths = cache_seqlens.tolist()
    num_keys = (max(lengths) if lengths else 0) + T
    shape = tuple(k_cache.shape)
    equal = len(set(lengths)) <= 1
    if not equal and ragged == "auto":
        ragged = "batched" if B * num_keys * shape[-2] * shape[-1] <= BATCH_RAGGED_ELEMENTS else "loop"
    if equal or ragged == "batched":
        calls = (_plan_call(shape, block_table, slice(0, B), cache_seqlens, tree_mask, group, num_keys, equal),)
    else:
        calls = tuple(_plan_call(shape, block_table, slice(b, b + 1), cache_seqlens, tree_mask, group, n + T, True)
                      for b, n in enumerate(lengths))  # fmt: skip
    return TreeAttentionPlan(B, T, group, shape, block_table is not None, calls)


def _sdpa_call(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, call: _SdpaCall, scale: float):
    """q ``[n, T, Hq, D]`` -> ``[n, T, Hq, D]``. GQA folds each group into the query rows (``[n, Hkv, T*group,
    D]``), so K/V are never repeated."""
    n, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    if call.key_rows is None:
        k, v = k_cache[call.seqs, : call.num_keys], v_cache[call.seqs, : call.num_keys]  # [n, num_keys, Hkv, D]
    else:  # index_select gathers 4-7x faster than advanced indexing here
        rows = call.key_rows.flatten()
        k, v = (c.flatten(0, 1).index_select(0, rows).view(n, call.num_keys, Hkv, D) for c in (k_cache, v_cache))
    rows_q = q.reshape(n, T, Hkv, group, D).permute(0, 2, 1, 3, 4).reshape(n, Hkv, T * group, D)
    out = F.scaled_dot_product_attention(
        rows_q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=call.row_mask, scale=scale
    )  # [n, Hkv, T*group, D]
    out = out.view(n, Hkv, T, group, D).permute(0, 2, 1, 3, 4).reshape(n, T, Hq, D)
    if call.sees_nothing is not None:
        out = out.masked_fill(call.sees_nothing[:, :, None, None], 0.0)
    return out


def _native_tree_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TreeAttentionPlan, scale: float
) -> torch.Tensor:
    """CPU path: torch SDPA (fp32 accumulation for fp16/bf16, so no upcast) over keys ``0 .. L_b+T-1``, as the
    plan lays the calls out. Row folding with a bool mask beat ``enable_gqa=True`` (by ~30% at B=8 L=512 T=8) and
    matmul-softmax-matmul (by ~2.4x)."""
    outs = [_sdpa_call(q[call.seqs], k_cache, v_cache, call, scale) for call in plan.calls]
    return outs[0] if len(outs) == 1 else torch.cat(outs)  # [B, T, Hq, D]


# --- Triton kernel ----------------------------------------------------------------------------------------------

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
    cache_seqlens: torch.Tensor,
    tree_mask: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    num_splits: int,
) -> torch.Tensor:
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
    seqlens = cache_seqlens.to(torch.int32).contiguous()
    mask_bits = _pack_tree_mask(tree_mask)  # [B, T, num_words]
    has_block_table = block_table is not None
    if has_block_table:
        block_table = block_table.to(torch.int32).contiguous()
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
    cache_seqlens: torch.Tensor,
    tree_mask: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    num_splits: int,
) -> torch.Tensor:
    """The Triton path as a custom op; ``num_splits <= 0`` lets the launcher choose (1 off CUDA)."""
    return _launch_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, softmax_scale, num_splits)


@_tree_attention_triton.register_fake
def _(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, softmax_scale, num_splits):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# --- public op --------------------------------------------------------------------------------------------------


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    backend: str | None = None,
    plan: TreeAttentionPlan | None = None,
) -> torch.Tensor:
    """Attention of T tree nodes over the committed prefix plus their ancestors in the tree.

    Row i of sequence b attends to every cache position ``< L_b`` and to tree position ``L_b + j`` iff
    ``tree_mask[b, i, j]``. The tree's K/V must already be in the cache at ``L_b .. L_b+T-1``. Prefill is the
    special case of a causal (lower-triangular) mask. A row that sees nothing (only possible with ``L_b = 0`` and an
    all-False mask row) outputs zeros.

    Parameters
    ----------
    q : query of the tree nodes (float32, float16 or bfloat16).
    k_cache, v_cache : contiguous ``[B, S, Hkv, D]``, or paged ``[num_blocks, block_size, Hkv, D]`` with
        ``block_table``.
    cache_seqlens : int32 ``L_b``, the committed length of each sequence.
    tree_mask : bool, ``tree_mask[b, i, j]``: node i sees node j.
    block_table : int32, or None for a contiguous cache. Logical position p of sequence b lives in block
        ``block_table[b, p // block_size]`` at offset ``p % block_size``.
    softmax_scale : defaults to ``D ** -0.5``.
    backend : None (Triton on CUDA and meta tensors, native SDPA path on CPU), "torch" (the reference), "triton",
        "native". On CUDA the call never syncs with the host (see ``_check_inputs`` for the one value check); on meta
        tensors it takes the same path and the custom op returns a fake output.
    plan : from ``plan_tree_attention`` with these same ``cache_seqlens``, ``tree_mask`` and ``block_table``, to
        share their preparation among the calls of one forward (native path; other paths ignore it).

    Shapes
    ------
    q ``[B, T, Hq, D]`` with ``Hq % Hkv == 0`` and ``D <= 256``; cache_seqlens ``[B]``; tree_mask ``[B, T, T]``;
    block_table ``[B, max_blocks]``. Returns ``[B, T, Hq, D]`` in q's dtype.
    """
    backend = resolve_backend("tree_attention", backend, q.device)
    planned = plan is not None and backend == "native"  # the plan checked the lengths: no second host sync
    _check_inputs(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, check_lengths=not planned)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if backend == "torch":
        return tree_attention_ref(
            q, k_cache, v_cache, cache_seqlens, tree_mask, block_table=block_table, softmax_scale=scale
        )
    if backend == "native":
        if q.device.type != "cpu":
            raise RuntimeError(f"tree_attention: backend='native' is the CPU path; got {q.device.type} tensors")
        group = q.shape[2] // k_cache.shape[2]
        if plan is None:
            plan = _native_plan(k_cache, cache_seqlens, tree_mask, block_table, group)
        else:
            made_for = (plan.batch, plan.num_nodes, plan.group, plan.cache_shape, plan.paged)
            if made_for != (q.shape[0], q.shape[1], group, tuple(k_cache.shape), block_table is not None):
                raise ValueError("tree_attention: the plan was made for other shapes (batch, T, heads, cache, paging)")
        return _native_tree_attention(q, k_cache, v_cache, plan, scale)
    return _tree_attention_triton(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, scale, 0)


def plan_tree_attention(
    k_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: torch.Tensor,
    *,
    num_q_heads: int,
    block_table: torch.Tensor | None = None,
    backend: str | None = None,
) -> TreeAttentionPlan | None:
    """Prepare what every ``tree_attention`` call of one forward shares (same lengths, mask, block table and cache
    layout; q and the cache contents may differ per call). Returns None where the chosen path needs no plan.

    Shapes: k_cache as ``tree_attention`` (any layer's: they share one layout); cache_seqlens ``[B]``; tree_mask
    ``[B, T, T]``; block_table ``[B, max_blocks]``.
    """
    if tree_mask.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"plan_tree_attention: tree_mask must be [B, T, T] and k_cache 4-d, got {tuple(tree_mask.shape)} and "
            f"{tuple(k_cache.shape)}"
        )
    B, T = tree_mask.shape[:2]
    q_shape = k_cache.new_empty(()).expand(B, T, num_q_heads, k_cache.shape[-1])  # no memory: shape checks only
    _check_inputs(q_shape, k_cache, k_cache, cache_seqlens, tree_mask, block_table)
    if resolve_backend("tree_attention", backend, k_cache.device) != "native" or k_cache.device.type != "cpu":
        return None
    return _native_plan(k_cache, cache_seqlens, tree_mask, block_table, num_q_heads // k_cache.shape[2])
