"""Prompt-lookup (n-gram) drafting: propose what followed the last occurrence of the current suffix."""

from __future__ import annotations

import numpy as np
import torch

from spec_engine.drafters.base import Draft, Drafter, StepBatch
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


class NgramDrafter(Drafter):
    """Deterministic chains (``draft_probs=None``): verification treats each as a point-mass proposal."""

    def __init__(self, num_speculative_tokens: int, max_n: int = 4, min_n: int = 1):
        self.max_depth = num_speculative_tokens
        self.max_nodes = num_speculative_tokens + 1
        self.max_n, self.min_n = max_n, min_n

    def propose(self, batch: StepBatch) -> Draft:
        T = max(batch.gammas) + 1
        tokens = torch.zeros(batch.size, T, dtype=torch.int64)  # [B, T]
        parents = torch.full((batch.size, T), PAD_NODE, dtype=torch.int64)  # [B, T]
        tokens[:, 0] = batch.roots
        for b, (req, gamma) in enumerate(zip(batch.requests, batch.gammas)):
            if gamma == 0:
                continue
            cont = ngram_lookup(np.asarray(req.all_token_ids, dtype=np.int64), self.max_n, self.min_n, gamma)
            n = len(cont)
            tokens[b, 1 : n + 1] = torch.from_numpy(cont)
            parents[b, 1 : n + 1] = torch.arange(n)
        return Draft(tokens, parents, None, "iid")
