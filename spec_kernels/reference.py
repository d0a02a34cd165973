"""Reference implementations: the readable spec of every op, in plain torch.

Each ``<op>_ref`` has its op's exact signature. It is what the tests and benchmarks compare against, and the
CPU fallback of last resort (``backend="torch"``). Clarity beats speed here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

PAD_NODE = -1  # padding in parents / accepted_nodes / output_tokens


class VerifyResult(NamedTuple):
    accepted_nodes: torch.Tensor  # [B, T] int64: the accepted path from the root, padded with PAD_NODE
    output_tokens: torch.Tensor  # [B, T] int64: accepted drafts, then the recovered/bonus token, padded with -1
    num_accepted: torch.Tensor  # [B] int64: path length including the root == number of emitted tokens


# --- tree_attention -------------------------------------------------------------------------------------------


def tree_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    raise NotImplementedError  # TREE_ATTENTION_REF (owned by the tree_attention work)


# --- verify_tree ------------------------------------------------------------------------------------------------


def verify_tree_ref(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    *,
    draft_probs: torch.Tensor | None = None,
    draft_sampling: str = "iid",
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    seed: int | None = None,
    backend: str | None = None,
) -> VerifyResult:
    raise NotImplementedError  # VERIFY_TREE_REF (owned by the verify_tree work)


# --- compact_kv_ ------------------------------------------------------------------------------------------------


def compact_kv_ref(
    cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    raise NotImplementedError  # COMPACT_KV_REF (owned by the compact_kv work)
