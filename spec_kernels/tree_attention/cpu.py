"""tree_attention's native CPU path: torch SDPA (float32; 16-bit inputs reduce in float64) over the prefix and each
node's ancestors, planned once per forward (``TreeAttentionPlan``) and shared by its layers' calls."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BATCH_RAGGED_ELEMENTS = 1 << 20  # padded K elements up to which ragged lengths take one batched SDPA call


@dataclass(frozen=True)
class _SdpaCall:
    """One SDPA call of the native path over sequences ``seqs``.

    Shapes: key_rows ``[n, num_keys]`` int64 rows of the cache flattened to ``[rows, Hkv, D]`` (None: the
    contiguous cache's own view ``cache[seqs, :num_keys]``); row_mask ``[n, 1, T*group, num_keys]`` bool (None:
    every row sees every key); sees_nothing ``[n, T]`` bool (None: no row is empty); distance ``[n, T, num_keys]``
    int64: each node's logical position less each key's (a tree key at ``L_b`` plus its depth), for a window.
    """

    seqs: slice
    num_keys: int
    key_rows: torch.Tensor | None
    row_mask: torch.Tensor | None
    sees_nothing: torch.Tensor | None
    distance: torch.Tensor


@dataclass(frozen=True)
class TreeAttentionPlan:
    """The work of a native ``tree_attention`` call that depends only on ``cache_seqlens``, ``tree_mask`` and
    ``block_table``: key rows and masks. A model's layers all attend with the same three tensors, so a forward
    builds the plan once (``plan_tree_attention``) and every layer reuses it; on this CPU that removes ~40 small
    ops per layer. The Triton path has a plan of its own (``DevicePlan``)."""

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


def _distance(cache_seqlens: torch.Tensor, tree_mask: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[B, T, num_keys]``: node t's logical position (``L_b`` plus its depth) less key k's (k below ``L_b``: k;
    tree slot ``L_b + j``: ``L_b`` plus node j's depth; slots past the tree are masked anyway)."""
    T = tree_mask.shape[1]
    depth = tree_mask.sum(dim=-1) - 1  # [B, T]
    rel = torch.arange(num_keys, device=tree_mask.device) - cache_seqlens.long()[:, None]  # [B, num_keys]
    key_depth = torch.gather(depth, 1, rel.clamp(0, max(T - 1, 0)))  # [B, num_keys]
    return depth[:, :, None] - torch.where(rel < 0, rel, key_depth)[:, None, :]


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
        distance=_distance(lengths, mask, num_keys),
    )


def _native_plan(
    k_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: torch.Tensor,
    block_table: torch.Tensor | None,
    group: int,
    ragged: str = "auto",
    max_batched_elements: int = BATCH_RAGGED_ELEMENTS,
) -> TreeAttentionPlan:
    """Equal lengths: one batched SDPA call over ``L + T`` keys. Ragged lengths: one batched call over
    ``max(L_b) + T`` keys (the slots past each row's ``L_b + T`` masked), or one call per sequence over its own
    keys. The batched call wastes work on padding and the loop pays a call per sequence, so ``ragged="auto"``
    batches while the padded K holds at most ``max_batched_elements`` elements (B * (max L_b + T) * Hkv * D); past
    that the gathered K/V leave the CPU caches and the batched call loses even when nearly full (the timings behind
    ``BATCH_RAGGED_ELEMENTS``: bench/RESULTS-log.md, "Ragged batches in the native tree attention").
    """
    B, T = tree_mask.shape[:2]
    lengths = cache_seqlens.tolist()
    num_keys = (max(lengths) if lengths else 0) + T
    shape = tuple(k_cache.shape)
    equal = len(set(lengths)) <= 1
    if not equal and ragged == "auto":
        ragged = "batched" if B * num_keys * shape[-2] * shape[-1] <= max_batched_elements else "loop"
    if equal or ragged == "batched":
        calls = (_plan_call(shape, block_table, slice(0, B), cache_seqlens, tree_mask, group, num_keys, equal),)
    else:
        calls = tuple(_plan_call(shape, block_table, slice(b, b + 1), cache_seqlens, tree_mask, group, n + T, True)
                      for b, n in enumerate(lengths))  # fmt: skip
    return TreeAttentionPlan(B, T, group, shape, block_table is not None, calls)


def _sdpa_call(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, call: _SdpaCall, scale: float,
               softcap: float | None = None, window: int | None = None):  # fmt: skip
    """q ``[n, T, Hq, D]`` -> ``[n, T, Hq, D]``. GQA folds each group into the query rows (``[n, Hkv, T*group,
    D]``), so K/V are never repeated. A window narrows the plan's mask. float32 takes SDPA, unless a softcap (which
    SDPA lacks): then, and for 16-bit inputs, matmul, softcap, masked softmax and matmul."""
    n, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    if call.key_rows is None:
        k, v = k_cache[call.seqs, : call.num_keys], v_cache[call.seqs, : call.num_keys]  # [n, num_keys, Hkv, D]
    else:  # index_select gathers faster than advanced indexing here
        # (bench/RESULTS-log.md, "Figures moved from code comments (2026-11-26)")
        rows = call.key_rows.flatten()
        k, v = (c.flatten(0, 1).index_select(0, rows).view(n, call.num_keys, Hkv, D) for c in (k_cache, v_cache))
    rows_q = q.reshape(n, T, Hkv, group, D).permute(0, 2, 1, 3, 4).reshape(n, Hkv, T * group, D)
    mask = call.row_mask
    if window is not None:
        near = (call.distance < window).repeat_interleave(group, dim=1)[:, None]  # [n, 1, T*group, num_keys]
        mask = near if mask is None else mask & near
    if softcap is None and q.dtype == torch.float32:
        out = F.scaled_dot_product_attention(
            rows_q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
        )  # [n, Hkv, T*group, D]
    else:
        # 16-bit inputs reduce in float64: their products are exact there and the sums round back to q's dtype alike
        # whatever order the BLAS picks for a call's T rows, so a tree node's output is a lone token's (SDPA's 16-bit
        # kernels' were not: greedy speculation parted from plain decoding, DESIGN's batch invariance)
        acc = torch.float32 if q.dtype == torch.float32 else torch.float64
        scores = rows_q.to(acc) @ k.to(acc).permute(0, 2, 3, 1) * scale  # [n, Hkv, T*group, num_keys]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = (torch.softmax(scores, dim=-1) @ v.to(acc).transpose(1, 2)).to(q.dtype)  # [n, Hkv, T*group, D]
    out = out.view(n, Hkv, T, group, D).permute(0, 2, 1, 3, 4).reshape(n, T, Hq, D)
    if call.sees_nothing is not None:
        out = out.masked_fill(call.sees_nothing[:, :, None, None], 0.0)
    return out


def _native_tree_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TreeAttentionPlan, scale: float,
    softcap: float | None = None, window: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """CPU path: torch SDPA over keys ``0 .. L_b+T-1`` in float32 (matmul, softmax, matmul reduced in float64 for
    16-bit inputs, or with a softcap: ``_sdpa_call``), as the plan lays the calls out. Row folding with a bool mask
    beat ``enable_gqa=True`` and matmul-softmax-matmul at B=8 L=512 T=8 in float32 (bench/RESULTS-log.md, "Figures
    moved out of code comments (2026-11-25)")."""
    outs = [_sdpa_call(q[call.seqs], k_cache, v_cache, call, scale, softcap, window) for call in plan.calls]
    return outs[0] if len(outs) == 1 else torch.cat(outs)  # [B, T, Hq, D]
