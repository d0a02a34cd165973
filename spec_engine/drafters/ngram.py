"""Prompt-lookup (n-gram) drafting: propose what followed the last occurrence of the current suffix."""

from __future__ import annotations

import numpy as np
import torch

from spec_engine.drafters.base import Draft, Drafter, StepBatch
from spec_engine.transfer import to_device
from spec_engine.tree import tree_mask_and_depths
from spec_kernels import PAD_NODE


def ngram_lookup(history: np.ndarray, max_n: int, min_n: int, k: int) -> np.ndarray:
    """The up-to-k tokens that followed the most recent earlier match of the longest suffix n-gram (n >= min_n)."""
    L = len(history)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = history[L - n :]
        windows = np.lib.stride_tricks.sliding_window_view(history[: L - 1], n)  # [L - n, n], starts before the suffix
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = hits[-1] + n
            return history[start : start + k]
    return history[:0]


NGRAM_MAX_N = 4  # the longest suffix n-gram looked up by default


class NgramDrafter(Drafter):
    """Deterministic chains (``draft_probs=None``): verification treats each as a point-mass proposal.

    The lookup runs on the host over each request's token history (a numpy view, never rebuilt); the chains and
    their shapes go to the device in one copy per dtype."""

    def __init__(self, num_speculative_tokens: int, max_n: int = NGRAM_MAX_N, min_n: int = 1, device="cpu"):
        self.max_gamma = num_speculative_tokens
        self.max_nodes = num_speculative_tokens + 1
        self.max_n, self.min_n = max_n, min_n
        self.device = torch.device(device)

    def propose(self, batch: StepBatch) -> Draft:
        T = max(batch.gammas) + 1
        tokens = torch.zeros(batch.size, T, dtype=torch.int64)  # [B, T]; the root is filled on the device
        parents = torch.full((batch.size, T), PAD_NODE, dtype=torch.int64)  # [B, T]
        for b, (row, gamma) in enumerate(zip(batch.rows, batch.gammas)):
            if gamma == 0:
                continue
            cont = ngram_lookup(row.token_ids, self.max_n, self.min_n, gamma)
            n = len(cont)
            tokens[b, 1 : n + 1] = torch.tensor(cont)  # a copy: cont views the read-only history
            parents[b, 1 : n + 1] = torch.arange(n)
        mask, depths = tree_mask_and_depths(parents)  # host: the chains' lengths are host values
        tokens, parents, mask, depths = to_device(self.device, tokens, parents, mask, depths)
        tokens[:, 0] = batch.roots
        return Draft(tokens, parents, mask, depths, None, "iid")
