"""Suffix decoding (SuffixDecoding, NeurIPS 2025; vLLM's ``method="suffix"``): model-free drafts from suffix trees.

Each request's prompt and output so far, and the outputs of earlier requests, are indexed in suffix trees
(``spec_engine.drafters.suffix_ref``, whose docstring is the glossary; the trees themselves are C++,
``csrc/suffix_tree_cpu.cpp``). Each step the longest suffixes of a row's context are matched there and a speculation
tree grown by estimated probability: a few microseconds per row, no forward pass. The drafts are deterministic
(``draft_probs=None``): verification treats every node as a point-mass proposal, lossless for sampled rows too.

The trees are this drafter's own cache, as a draft model's KV cache is its: it reads each row's history from the
engine's read-only ``RowView`` (indexing the tokens it has not seen) and forgets a request's own tree when the
engine retires it (``finish_request``); the request's output stays in the global tree until evicted.

A structured-output request whose grammar allows one way on (``RowView.forced``: a schema's next key, say) is
drafted those tokens instead, a sure chain: nothing a suffix tree could know (the schema is not in the text).
"""

from __future__ import annotations

import numpy as np
import torch

from spec_engine.drafters.base import Draft, Drafter, DraftPlan, RowView, StepBatch
from spec_engine.drafters.suffix_ref import SuffixCache, SuffixDraft
from spec_engine.transfer import to_device
from spec_engine.tree import tree_mask_and_depths
from spec_kernels import PAD_NODE
from spec_kernels._ext import load_ext

# vLLM's defaults (SpeculativeConfig's suffix_decoding_* fields), except two. The global tree's bound: ours is a
# trie without path compression (about max_depth nodes per distinct output token), so 10000 cached requests could
# hold gigabytes. The depth (vLLM's 24): a match and the draft below it share the trie's max_depth tokens, and a
# draft has at most max_spec_factor nodes per matched token, so a repeat is drafted at most max_depth / 2 tokens a
# step; 32 lets it fill the 16 nodes of "auto" (bench/RESULTS.md, "Suffix decoding"), for a third more nodes
MAX_TREE_DEPTH = 32
MAX_SPEC_FACTOR = 1.0
MIN_TOKEN_PROB = 0.1
MAX_CACHED_REQUESTS = 1000
# a row is drafted only where its best speculation expects at least this many accepted tokens: a weaker one buys
# less than the wider verify costs (our key; ArcticInference and vLLM draft whatever matches)
MIN_SCORE = 1.0
# plain steps in a row before the drafter is asked again: a plain native chain cannot see a match start, and a
# repetition that begins mid-chain would be decoded plainly to the chain's end (the engine's chains are longer)
PLAIN_CHAIN_CAP = 8


class NativeSuffixTree:
    """``spec_kernels.SuffixTree`` (C++) behind ``SuffixTreeRef``'s interface: token arrays in, ``SuffixDraft`` out."""

    def __init__(self, max_depth: int):
        load_ext()
        self._tree = torch.classes.spec_kernels.SuffixTree(max_depth)
        self.max_depth = max_depth

    def extend(self, seq_id: int, tokens) -> None:
        self._tree.extend(seq_id, torch.from_numpy(np.array(tokens, dtype=np.int64)))  # a copy: views are read-only

    def remove(self, seq_id: int) -> None:
        self._tree.remove(seq_id)

    def frequency(self, tokens) -> int:
        return self._tree.frequency(torch.tensor(list(tokens), dtype=torch.int64))

    def num_nodes(self) -> int:
        return self._tree.num_nodes()

    @property
    def num_seqs(self) -> int:
        return self._tree.num_seqs()

    def speculate(self, context, max_tokens: int, max_spec_factor: float, min_token_prob: float,
                  tree: bool = True) -> SuffixDraft:  # fmt: skip
        ctx = torch.from_numpy(np.array(context, dtype=np.int64))
        tokens, parents, probs, score, match_len = self._tree.speculate(ctx, max_tokens, max_spec_factor,
                                                                        min_token_prob, tree)  # fmt: skip
        return SuffixDraft(list(tokens), list(parents), list(probs), score, match_len)


class SuffixDrafter(Drafter):
    """Per-row speculation trees from suffix matching. ``num_speculative_tokens`` caps the nodes of a row's tree
    (so its depth too); a row's depth in a step (the engine's or the adaptive controller's) caps it further.

    Parameters
    ----------
    num_speculative_tokens : the most nodes a row's tree has.
    max_tree_depth, max_spec_factor, min_token_prob, max_cached_requests : vLLM's ``suffix_decoding_*`` knobs (see
        ``suffix_ref``): the longest suffix indexed (and matched), nodes per matched token, the least estimated
        probability of a drafted node, the requests whose outputs the global tree keeps (0: none; -1: unbounded).
    tree : speculation trees (True) or chains of the most frequent continuation (ArcticInference's default).
    min_score : a row is drafted only when its speculation's score (expected accepted tokens) reaches this.
    """

    plans = True
    sizes_trees = True

    def __init__(self, num_speculative_tokens: int, *, max_tree_depth: int = MAX_TREE_DEPTH,
                 max_spec_factor: float = MAX_SPEC_FACTOR, min_token_prob: float = MIN_TOKEN_PROB,
                 max_cached_requests: int = MAX_CACHED_REQUESTS, tree: bool = True, min_score: float = MIN_SCORE,
                 device="cpu", make_tree=NativeSuffixTree):  # fmt: skip
        self.max_gamma = num_speculative_tokens
        self.max_nodes = num_speculative_tokens + 1
        self.max_spec_factor, self.min_token_prob, self.use_tree = max_spec_factor, min_token_prob, tree
        self.min_score = min_score
        self.plain_chain_cap = PLAIN_CHAIN_CAP
        self.device = torch.device(device)
        self.cache = SuffixCache(max_tree_depth, max_cached_requests, make_tree)

    def speculate(self, row: RowView, budget: int, tree: bool | None = None) -> SuffixDraft:
        """Row ``row``'s best speculation of at most ``budget`` nodes (and no more than the row can keep), its new
        tokens indexed first."""
        self.cache.update(row.key, row.token_ids, row.num_prompt_tokens)
        budget = min(budget, row.draft_room)
        if budget <= 0:
            return SuffixDraft()
        if row.forced:  # the row's grammar allows one way on: a sure chain (another tokenization may be chosen)
            n = min(len(row.forced), budget)
            return SuffixDraft(list(row.forced[:n]), list(range(-1, n - 1)), [1.0] * n, float(n), sure=True)
        tree = self.use_tree if tree is None else tree
        return self.cache.speculate(row.key, row.token_ids, budget, self.max_spec_factor, self.min_token_prob, tree)

    def plan(self, rows: list[RowView], gammas: list[int], gains: list[float] | None = None,
             faster=None) -> DraftPlan:  # fmt: skip
        """Each row keeps its depth (its budget of nodes) where its speculation scores at least ``min_score`` (its
        score scaled by the row's ``score_trust``); the others are not drafted (every row indexed either way). Every
        drafted row is a suffix row: what it keeps is its request's score trust, not the adaptive controller's
        acceptance of chains."""
        gammas = [min(g, r.draft_room) for g, r in zip(gammas, rows)]  # a deeper tree is verified for nothing
        drafts = [self.speculate(r, g) for r, g in zip(rows, gammas)]
        scores = [trusted_score(d, r) for d, r in zip(drafts, rows)]
        kept = [s >= max(self.min_score, 1e-9) or d.sure and s > 0 for s, d in zip(scores, drafts)]
        return DraftPlan([g if k else 0 for g, k in zip(gammas, kept)], suffix_rows=kept,
                         nodes=[len(d.tokens) + 1 if k else 1 for d, k in zip(drafts, kept)],
                         expected=[s if k else 0.0 for s, k in zip(scores, kept)],
                         sure=[d.sure and k for d, k in zip(drafts, kept)])  # fmt: skip

    def propose(self, batch: StepBatch) -> Draft:
        drafts = [self.speculate(r, g) for r, g in zip(batch.rows, batch.gammas)]
        tokens, parents, mask, depths = draft_tensors(drafts, self.device)
        tokens[:, 0] = batch.roots
        return Draft(tokens, parents, mask, depths, None, "iid")

    def finish_request(self, row: RowView) -> None:
        self.cache.finish(row.key, row.token_ids, row.num_prompt_tokens)


def trusted_score(draft: SuffixDraft, row: RowView) -> float:
    """A speculation's expected accepted tokens on this request: its score times what such scores kept here
    (``RowView.score_trust``); a grammar's forced chain its length, sure."""
    return draft.score if draft.sure else draft.score * row.score_trust


def draft_tensors(drafts: list[SuffixDraft], device, width: int | None = None) -> list[torch.Tensor]:
    """(tokens, parents [B, T] int64, tree_mask [B, T, T], depths [B, T]) on ``device`` of one speculation per row,
    node i of a row at column i + 1 under the root (column 0, its token left 0 for the caller); T is the largest
    speculation + 1, or ``width``; shorter rows are padding."""
    T = max([len(d.tokens) for d in drafts] + [0]) + 1 if width is None else width
    tokens = torch.zeros(len(drafts), T, dtype=torch.int64)  # [B, T]
    parents = torch.full((len(drafts), T), PAD_NODE, dtype=torch.int64)  # [B, T]
    for b, d in enumerate(drafts):
        n = len(d.tokens)
        if n:
            tokens[b, 1 : n + 1] = torch.tensor(d.tokens)
            parents[b, 1 : n + 1] = torch.tensor(d.parents) + 1  # the speculation's -1 is the root, node 0
    mask, depths = tree_mask_and_depths(parents)  # host: the trees' shapes are host values
    return to_device(device, tokens, parents, mask, depths)


def tree_depth(draft: SuffixDraft) -> int:
    """The depth of a speculation's deepest node (0 for none)."""
    depth = [0] * len(draft.tokens)
    for i, p in enumerate(draft.parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    return max(depth, default=0)
