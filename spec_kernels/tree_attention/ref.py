"""``tree_attention_ref``: the readable spec of ``tree_attention``, in plain torch, with its exact signature.

Clarity beats speed here: tests and benchmarks compare against it, and ``backend="torch"`` runs it (the CPU
fallback of last resort).
"""

from __future__ import annotations

import torch


def _gather_kv(cache: torch.Tensor, b: int, length: int, block_table: torch.Tensor | None) -> torch.Tensor:
    """Logical positions ``0 .. length-1`` of sequence ``b``: ``[length, Hkv, D]``."""
    if block_table is None:
        return cache[b, :length]  # [length, Hkv, D]
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table[b, pos // block_size].long()
    return cache[blocks, pos % block_size]  # [length, Hkv, D]


def tree_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Every tree node attends to the whole committed prefix plus the tree nodes its mask allows.

    Softmax runs in float32 (float64 inputs stay float64, which makes this the tests' exact reference). A row that
    sees nothing (L_b = 0 and an all-False mask row) outputs zeros rather than NaN. ``softcap``: scores become
    ``softcap * tanh(scores / softcap)`` (after the scale). ``window``: a node at logical position p (``L_b`` plus
    its depth, the ancestors it sees less one) sees only positions ``> p - window``, a tree node at ``L_b`` plus its
    own depth.
    """
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    for b in range(B):
        L = int(cache_seqlens[b])
        k = _gather_kv(k_cache, b, L + T, block_table).to(compute_dtype).repeat_interleave(group, dim=1)
        v = _gather_kv(v_cache, b, L + T, block_table).to(compute_dtype).repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q[b].to(compute_dtype), k) * scale  # [Hq, T, L+T]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        prefix = torch.ones(T, L, dtype=torch.bool, device=q.device)
        allowed = torch.cat([prefix, tree_mask[b]], dim=1)  # [T, L+T]
        if window is not None:
            depth = tree_mask[b].sum(dim=-1) - 1  # [T]
            key_pos = torch.cat([torch.arange(L, device=q.device), L + depth])  # [L+T]
            allowed = allowed & (L + depth[:, None] - key_pos[None, :] < window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows: NaN -> 0
        out[b] = torch.einsum("hts,shd->thd", probs, v).to(q.dtype)  # [T, Hq, D]
    return out
