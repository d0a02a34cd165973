"""``compact_kv_ref``: the readable spec of ``compact_kv_``, in plain torch, with its exact signature.

Clarity beats speed here: tests and benchmarks compare against it, and ``backend="torch"`` runs it (the CPU
fallback of last resort).
"""

from __future__ import annotations

import torch


def compact_kv_ref(
    cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Move the K/V rows of each accepted path to the first slots after the committed prefix, in place.

    For every plane n, sequence b and t < num_accepted[b]:
    ``cache[n, b, L_b + t] <- old cache[n, b, L_b + accepted_nodes[b, t]]`` with ``L_b = cache_seqlens[b]``; a paged
    cache maps logical slot p of sequence b to ``cache[n, block_table[b, p // block_size], p % block_size]``.
    Every source row is gathered (a copy) before any row is written, because paths like [0, 1, 3, 4] overlap.
    ``backend`` is ignored: this is the reference.
    """
    num_nodes = accepted_nodes.shape[1]
    steps = torch.arange(num_nodes, device=cache.device)  # [T]
    keep = steps < num_accepted.to(torch.int64)[:, None]  # [B, T]
    seq, step = keep.nonzero(as_tuple=True)  # [K], [K]: every (b, t) that moves a row
    base = cache_seqlens.to(torch.int64)[seq]  # [K]
    src = base + accepted_nodes.to(torch.int64)[seq, step]  # [K] logical source slots
    dst = base + step  # [K] logical destination slots
    if block_table is None:
        rows = cache[:, seq, src].clone()  # [N, K, ...]: read everything first
        cache[:, seq, dst] = rows
    else:
        block_size = cache.shape[2]
        table = block_table.to(torch.int64)  # [B, max_blocks]
        rows = cache[:, table[seq, src // block_size], src % block_size].clone()  # [N, K, ...]
        cache[:, table[seq, dst // block_size], dst % block_size] = rows
